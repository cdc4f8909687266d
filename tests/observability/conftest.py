"""Fixtures for the observability tests: a live OTLP receiver, a clean OTEL_* environment, and
logging put back as it was after each test."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root off sys.path
    sys.path.insert(0, str(ROOT))

from observability.tracing import shutdown_tracing  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
)
LOG_VARS = ("KVLEDGER_LOG_LEVEL", "KVLEDGER_LOG_FORMAT", "KVLEDGER_API_KEY")


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No OTEL_* variables from the outside; every provider set up in the test is shut down."""
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    shutdown_tracing()


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in LOG_VARS:
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield monkeypatch
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()
