"""Load the model: the seeded tiny Llama, a local Hugging Face folder (config + safetensors), or a
GGUF file (gpu_worker/gguf_checkpoint.py; which one a model value names: services/tokenization/model_source.py).

No network, ever: a checkpoint is a folder the user already has. Every refusal names the file,
tensor or field at fault and what would be accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpu_worker.layers import load_shard
from gpu_worker.loading import CheckpointError, resolve_dtype
from gpu_worker.model import (
    SUPPORTED_ARCHITECTURES,
    LlamaForCausalLM,
    ModelConfig,
    ModelConfigError,
    init_random_weights,
    tiny_config,
)
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.safetensors_reader import SafetensorsError, SafetensorsFile
from services.environment import env
from services.tokenization.model_source import TINY_MODEL, resolve_model
from services.tokenization.tokenizer import ByteTokenizer

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older transformers saved; we recompute


def load_model(
    model: str | Path = TINY_MODEL,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    seed: int | None = None,
    max_model_len: int | None = None,
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """'tiny' builds the seeded tiny Llama (KVLEDGER_SEED), a .gguf file (or 'smollm2') is
    dequantized, anything else is a folder. With `tp` of size N, this rank's shard of it."""
    source = resolve_model(model)
    if source.kind == "gguf":
        from gpu_worker.gguf_checkpoint import load_gguf

        assert source.path is not None
        return load_gguf(
            source.path, dtype=dtype, device=device, max_model_len=max_model_len, tp=tp
        )
    if source.kind == "folder":
        return load_checkpoint(
            model, dtype=dtype, device=device, max_model_len=max_model_len, tp=tp
        )
    if seed is None:
        seed = int(env("KVLEDGER_SEED", "0") or 0)
    cfg = tiny_config(vocab_size=ByteTokenizer().vocab_size)
    with torch.device(device):
        net = LlamaForCausalLM(cfg)
    init_random_weights(net, seed, muted_token_ids=_unprintable_byte_ids())
    if tp.size > 1:  # the seeded weights are drawn whole (as at size 1), then sliced
        net = shard_model(net, tp)
    return net.to(resolve_dtype(dtype, cfg.dtype, device)).eval()


def shard_model(full: LlamaForCausalLM, tp: TensorParallel) -> LlamaForCausalLM:
    """This rank's shard of a whole model (same dtype and device)."""
    param = next(full.parameters())
    with torch.device("meta"):
        net = LlamaForCausalLM(full.config, tp)
    net = net.to(param.dtype).to_empty(device=param.device)
    net.tie_weights()
    for name, tensor in net.named_parameters():
        whole = full.get_parameter(name)
        slices = net.full_slices(name)
        load_shard(tensor, whole if slices is None else whole[slices])
    return net.eval()


def model_name(model: str | Path) -> str:
    return resolve_model(model).name


def _unprintable_byte_ids() -> list[int]:
    # The random default model then writes printable ASCII and never stops on EOS by chance.
    printable = set(range(32, 127)) | {ord("\n")}
    return [i for i in range(258) if i not in printable]


def read_model_config(folder: str | Path, max_model_len: int | None = None) -> ModelConfig:
    folder = _check_folder(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a Hugging Face model folder needs config.json")
    try:
        hf: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    try:
        cfg = ModelConfig.from_hf(hf)
    except ModelConfigError as exc:
        raise CheckpointError(f"cannot serve {folder}: {exc}") from None
    except KeyError as exc:
        raise CheckpointError(f"{path} lacks the field {exc.args[0]!r}") from None
    window = cfg.sliding_window
    if window is not None and (max_model_len is None or max_model_len > window):
        raise CheckpointError(
            f"{cfg.architecture} at {folder} uses sliding-window attention (window {window} "
            f"tokens), which kvledger does not implement; attention is exact only while a request "
            f"fits in the window: set max_model_len <= {window}"
        )
    return cfg


def load_checkpoint(
    folder: str | Path,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """The model of a Hugging Face folder, every parameter checked by name and shape.

    Under tensor parallelism each rank reads only its slice of each tensor (plain
    positioned reads straight into the preallocated parameters, gpu_worker/safetensors_reader.py),
    so a rank's memory holds about 1/N of the weights, never the whole, and no mapped file."""
    folder = _check_folder(folder)
    cfg = read_model_config(folder, max_model_len)
    files = weight_files(folder)
    # Meta construction: no random init of weights we are about to overwrite.
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, tp)
        # Full shapes to check the checkpoint against, at no memory cost.
        full_shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()}
    net = net.to(resolve_dtype(dtype, cfg.dtype, device)).to_empty(device=device)
    net.tie_weights()  # to_empty gives each module its own tensor
    params = dict(net.named_parameters())  # tied lm_head.weight is deduplicated away
    loaded: set[str] = set()
    for file in files:
        with _open_weights(file) as reader:
            for name in reader.keys():  # noqa: SIM118 (a file, not a dict)
                if name.endswith(_IGNORED_SUFFIXES) or (
                    cfg.tie_word_embeddings and name == "lm_head.weight"
                ):
                    continue
                param = params.get(name)
                if param is None:
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {file.name}: it is not a parameter of "
                        f"{cfg.architecture} with this config.json"
                    )
                _check_shape(full_shapes[name], reader.info(name).shape, name, file)
                with torch.no_grad():
                    held = reader.read_into(name, param, net.full_slices(name))
                    param[held[0] :].zero_()  # the last rank's vocabulary padding rows
                loaded.add(name)
    missing = [name for name in params if name not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(f"{folder} lacks {len(missing)} tensor(s) the model needs: {shown}")
    return net.eval()


def _open_weights(file: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(file)
    except (SafetensorsError, OSError) as exc:
        raise CheckpointError(f"cannot read weights {file}: {exc}") from None


def _check_shape(expected: tuple[int, ...], got: tuple[int, ...], name: str, file: Path) -> None:
    if got != expected:
        raise CheckpointError(
            f"shape mismatch for {name!r} in {file.name}: config.json implies "
            f"{list(expected)}, the checkpoint has {list(got)}"
        )


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the single file or every shard of the index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(
                    f"shard {file.name} named in {index.name} is missing from {folder}"
                )
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    hint = ""
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        hint = (
            " (found pickle weights: kvledger loads safetensors only; re-save them with "
            "save_pretrained(safe_serialization=True))"
        )
    raise CheckpointError(
        f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json{hint}"
    )


def _check_folder(folder: str | Path) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(
            f"model folder {path} does not exist; kvledger never downloads: give a local "
            f"Hugging Face folder ({', '.join(SUPPORTED_ARCHITECTURES)}), a .gguf file, or "
            f"'{TINY_MODEL}'"
        )
    return path
