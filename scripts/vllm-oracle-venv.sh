#!/usr/bin/env bash
# Makes (or reuses) a CPU-only virtual environment holding vLLM 0.33.0's KV-cache manager, block
# pool, KV-event structs, scheduler and the OffloadingConnector's scheduler side (its CPU manager
# and policies): the oracle of tests/oracle and benchmarks/ledger_ops.py.
# vLLM's CUDA dependency tree is skipped: only what those modules import is installed.
#
# Usage: bash scripts/vllm-oracle-venv.sh DIR    (about 3 minutes the first time; prints OK)
# A DIR that already imports what the oracle uses from vLLM 0.33 is reused as is; anything else
# there (an interrupted build, another version) is removed and built again.
set -euo pipefail
V=${1:?usage: vllm-oracle-venv.sh DIR}
PROBE="import vllm.v1.core.kv_cache_manager, vllm.v1.core.block_pool, vllm.distributed.kv_events, \
vllm.v1.request, vllm.v1.core.sched.scheduler, vllm.v1.core.sched.async_scheduler, \
vllm.v1.kv_offload.cpu.manager, vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler; \
import vllm; \
assert vllm.__version__.startswith('0.33.'), vllm.__version__; print('OK vllm', vllm.__version__)"

probe() { [ -x "$V/bin/python" ] && VLLM_TARGET_DEVICE=cpu "$V/bin/python" -c "$PROBE" 2>/dev/null | tail -1; }
if [[ "$(probe || true)" == "OK vllm"* ]]; then
    # vLLM's OpenAI serving code and tool parsers (tests/oracle/vllm_serving_driver.py) also
    # need orjson, ijson and mistral_common, which venvs built before they were listed lack:
    # added in place.
    "$V/bin/python" -c "import orjson, ijson, mistral_common" 2>/dev/null \
        || "$V/bin/pip" install -q orjson ijson "mistral_common>=1.11.6" 2>&1 \
        | grep -v -E "^WARNING: Location|^vllm 0.33.0 requires|dependency resolver" || true
    echo "OK vllm oracle venv reused: $V"
    exit 0
fi
if [ -e "$V" ] && [ ! -f "$V/pyvenv.cfg" ] && [ -n "$(ls -A "$V")" ]; then
    echo "$V exists and is not a virtual environment: name a new or empty folder" >&2
    exit 2
fi
echo "[oracle] building vLLM 0.33's venv in $V (about 3 minutes)"
rm -rf "$V"
mkdir -p "$(dirname "$V")"
python3 -m venv "$V"
P="$V/bin/pip"
quiet() { grep -v -E "^WARNING: Location|^vllm 0.33.0 requires|dependency resolver|dependency conflicts" || true; }
$P install -q torch==2.13.0 2>&1 | quiet              # the CPU build on this machine's disk
$P install -q --no-deps vllm==0.33.0 2>&1 | quiet
$P install -q "torch==2.13.0" packaging "pydantic>=2.12.0" regex numpy msgspec "pyzmq>=25.0.0" \
  cbor2 cachetools psutil py-cpuinfo pybase64 pyyaml cloudpickle tqdm "requests>=2.33.0" \
  "certifi>=2026.10.19" "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0" \
  "tokenizers>=0.23.2" "safetensors>=0.6.2" "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" \
  "aiohttp>=3.14.4" "multidict>=6.9.1" "openai>=2.25.0" "prometheus_client>=0.18.0" \
  "pillow>=13.0.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" "apache-tvm-ffi==0.1.11" \
  "oss-harmony>=0.0.11" "opentelemetry-api>=1.27.0" uvloop einops orjson ijson \
  "mistral_common>=1.11.6" 2>&1 | quiet
$P install -q --no-deps "xgrammar==0.2.8" 2>&1 | quiet
RESULT="$(probe || true)"
[[ "$RESULT" == "OK vllm"* ]] || { echo "the venv in $V cannot import vLLM 0.33" >&2; exit 1; }
echo "$RESULT"
