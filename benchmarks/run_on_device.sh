#!/usr/bin/env bash
# One shot on a CUDA machine that reaches no package index (made for an H200, ~8 minutes):
# install the Python packages the GPU image lacks from benchmarks/wheels (msgspec for the
# worker's messages; FlashInfer and its apache-tvm-ffi for the baseline), start FlashInfer's JIT
# build in the background, build the kernels, run the GPU tests, run the benchmark. Every step
# has a time limit and its own log; results land in OUT (first argument, default
# benchmarks/results): install.log, build.log, gpu_tests.log, gpu_tests.xml,
# flashinfer_warmup.log, benchmark.log, kernels.json, tier_load_cost.log and
# tier_load_cost_cuda.json (issue 25: a CPU-tier load against recompute, per block). Tensor
# parallelism is recorded apart: tp_nccl.log and tp_nccl.json (TP=1 vs TP=2 over NCCL,
# benchmarks/tp_nccl.py; with one GPU the file says it needs two, since NCCL refuses two ranks
# on one device). Exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results}"
PY="${PYTHON:-python3}"
SITE="${KVLEDGER_DEVICE_SITE:-/tmp/kvledger-site}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
failed=0

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - started))s"
    [ "$rc" -eq 0 ] || failed=1
}

step install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" benchmarks/wheels/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# FlashInfer compiles its kernels on first use: let that overlap the build and the tests.
timeout 420 "$PY" benchmarks/flashinfer_warmup.py >"$OUT/flashinfer_warmup.log" 2>&1 &
step build 240 bash -c "nvidia-smi -L; nvcc --version | tail -1; \
    $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())'; \
    $PY -c 'import time, torch; from kernels import build, cuda, AttentionSpec, select_backend; t = time.time(); print(build.build()); print(\"built in %.0fs; backend = %s\" % (time.time() - t, select_backend(AttentionSpec(torch.device(\"cuda\"), torch.bfloat16, 32, 8, 128, 16), \"cuda\").name))'"
step gpu_tests 240 "$PY" -m pytest -q -m gpu tests/kernels -p no:cacheprovider -o addopts="" \
    --junitxml="$OUT/gpu_tests.xml"
step benchmark 420 "$PY" benchmarks/kernels.py --out "$OUT"
# Issue 25: a block loaded from the CPU tier (pinned host buffer, DMA) against prefilling it.
step tier_load_cost 120 "$PY" benchmarks/tier_load_cost.py --models tiny --device cuda \
    --json "$OUT/tier_load_cost_cuda.json"
# Needs only torch and safetensors (in the image) and msgspec (installed above).
step tp_nccl 300 "$PY" benchmarks/tp_nccl.py --json "$OUT/tp_nccl.json"
wait
echo "=== flashinfer warm-up: $(tail -2 "$OUT/flashinfer_warmup.log" | tr '\n' ' ')"
echo "=== results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $failed
