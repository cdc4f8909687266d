"""Writes `vllm_fields.json`: every field vLLM 0.33's OpenAI request models accept, with its
default, so the field walk (test_field_walk.py) runs without vLLM installed.

Run with the oracle environment: `$KVLEDGER_VLLM_ORACLE/bin/python tests/gateway/dump_vllm_fields.py`
(the environment comes from `../shared/tools/vllm-oracle-venv.sh DIR`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import vllm
from pydantic_core import PydanticUndefined
from vllm.entrypoints.generate.base.protocol import StreamOptions
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vllm.sampling_params import StructuredOutputsParams

OUT = Path(__file__).with_name("vllm_fields.json")


def _default(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        return repr(value)
    return value


def pydantic_fields(model: Any) -> dict[str, Any]:
    fields = {}
    for name, info in model.model_fields.items():
        required = info.is_required()
        if info.default_factory is not None:
            default: Any = (
                "<generated>" if name == "request_id" else _default(info.default_factory())
            )
        else:
            default = None if info.default is PydanticUndefined else _default(info.default)
        fields[info.alias or name] = {"required": required, "default": default}
    return fields


def dataclass_fields(cls: Any) -> dict[str, Any]:
    return {
        f.name: {"required": False, "default": _default(f.default)}
        for f in dataclasses.fields(cls)
        if f.init
    }


def main() -> None:
    data = {
        "vllm_version": vllm.__version__,
        "models": {
            "completion": pydantic_fields(CompletionRequest),
            "chat": pydantic_fields(ChatCompletionRequest),
            "tokenize_completion": pydantic_fields(TokenizeCompletionRequest),
            "tokenize_chat": pydantic_fields(TokenizeChatRequest),
            "detokenize": pydantic_fields(DetokenizeRequest),
            "stream_options": pydantic_fields(StreamOptions),
            "structured_outputs": dataclass_fields(StructuredOutputsParams),
        },
    }
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{k} {len(v)}" for k, v in data["models"].items()))


if __name__ == "__main__":
    main()
