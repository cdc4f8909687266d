#!/usr/bin/env bash
# One shot on a CUDA machine (made for an H200, ~8 minutes): build the kernels, run the GPU tests,
# run the benchmark. Every step has a time limit and its own log; results land in OUT
# (first argument, default benchmarks/results): build.log, gpu_tests.log, gpu_tests.xml,
# benchmark.log, kernels.json, kernels.png. Exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results}"
PY="${PYTHON:-python3}"
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

step build 240 bash -c "nvidia-smi -L; nvcc --version | tail -1; \
    $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())'; \
    $PY -c 'import time; from kernels import build, backend; t = time.time(); print(build.build()); print(\"built in %.0fs; backend(cuda) = %s\" % (time.time() - t, backend(\"cuda\")))'"
step gpu_tests 240 "$PY" -m pytest -q -m gpu tests/kernels -p no:cacheprovider -o addopts="" \
    --junitxml="$OUT/gpu_tests.xml"
step benchmark 420 "$PY" benchmarks/kernels.py --out "$OUT"
echo "=== results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $failed
