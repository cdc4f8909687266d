"""vLLM's tool flags on `kvledger gateway` and `kvledger up`, through the real command-line
parser: `--enable-auto-tool-choice` alone (vLLM's form) or with 0/1, `--tool-call-parser NAME`,
their environment variables, and a bad parser name refused naming the flag."""

from __future__ import annotations

import pytest

from kvledger.cli import build_parser
from services.config import GatewayConfig, from_arguments
from services.environment import ConfigError


def gateway_config(*argv: str, command: str = "gateway") -> GatewayConfig:
    return from_arguments(GatewayConfig, build_parser().parse_args([command, *argv]))


@pytest.fixture(autouse=True)
def no_tool_env(monkeypatch):
    monkeypatch.delenv("KVLEDGER_ENABLE_AUTO_TOOL_CHOICE", raising=False)
    monkeypatch.delenv("KVLEDGER_TOOL_CALL_PARSER", raising=False)


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_vllms_tool_flags(command):
    cfg = gateway_config("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         command=command)  # fmt: skip
    assert (cfg.enable_auto_tool_choice, cfg.tool_call_parser) == (True, "hermes")
    off = gateway_config("--enable-auto-tool-choice", "0", command=command)
    assert (off.enable_auto_tool_choice, off.tool_call_parser) == (False, None)


def test_the_environment_sets_them_and_a_bad_parser_names_the_flag(monkeypatch):
    monkeypatch.setenv("KVLEDGER_ENABLE_AUTO_TOOL_CHOICE", "1")
    monkeypatch.setenv("KVLEDGER_TOOL_CALL_PARSER", "Mistral")
    cfg = gateway_config()
    assert (cfg.enable_auto_tool_choice, cfg.tool_call_parser) == (True, "mistral")
    with pytest.raises(ConfigError, match=r"--tool-call-parser.*hermes, llama3_json, mistral"):
        gateway_config("--tool-call-parser", "pythonic")
