"""Runs inside vLLM 0.33's venv: parses JSON bodies kvledger produced with vLLM's own OpenAI
protocol models and reports, per body, the validation error and every key the models do not
declare (they allow extra keys, so a misspelt field would otherwise pass unnoticed).

Usage: python api_protocol_driver.py IN.json OUT.json, where IN is
{"cases": [{"name": ..., "model": "module:Class", "body": {...}}, ...]}.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from pydantic import BaseModel, ValidationError


def undeclared(value: Any, path: str = "$") -> list[str]:
    """Paths of the keys a parsed model kept only as extras, at any depth."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        found += [f"{path}.{key}" for key in sorted(value.model_extra or {})]
        for name in type(value).model_fields:
            found += undeclared(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += undeclared(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            found += undeclared(item, f"{path}.{key}")
    return found


def check(case: dict[str, Any]) -> dict[str, Any]:
    module, _, name = case["model"].partition(":")
    model = getattr(importlib.import_module(module), name)
    try:
        parsed = model.model_validate(case["body"])
    except ValidationError as exc:
        return {"name": case["name"], "error": str(exc)[:2000], "undeclared": []}
    return {"name": case["name"], "error": None, "undeclared": undeclared(parsed)}


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        cases = json.load(f)["cases"]
    with open(target, "w") as f:
        json.dump({"results": [check(c) for c in cases]}, f)


if __name__ == "__main__":
    main()
