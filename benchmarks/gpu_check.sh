#!/usr/bin/env bash
# GPU check of RoundPipe for Lightning: one script for a 15-minute GPU slot, with
# room to run it twice. Every phase has its own time limit; the limits plus a fixed
# allowance for the probes and the table add up to the "time budget" printed first,
# and the script refuses to start when that is over 300 s.
#
# Run in the repository root of a machine with a CUDA GPU (made for one H200:
# Python 3.12, torch with CUDA, pytest, pytest-timeout, transformers, lightning
# already installed). That machine reaches no package registry: the script installs
# nothing and runs on whatever torch the image has (2.11 with CUDA 13 so far, while
# this project is developed on 2.13); it reports the version it ran with and does
# not require a particular one:
#
#     bash benchmarks/gpu_check.sh        # logs and results in $OUT (or /tmp/roundpipe-gpu-check)
#
# Phases, results first (seconds; env overrides):
#   0. environment: GPU, driver, torch version; .whl/*.whl on PYTHONPATH (T_ENV=15)
#   1. Qwen3-1.7B shape (random weights, bf16 params, fp32 masters, seq 2048,
#      batch 8), a few steps with this project's RoundPipe               (T_OURS=85)
#   2. the same with plain PyTorch + activation checkpointing            (T_PLAIN=45)
#   3. the same with the published `roundpipe` package, if its wheel is
#      under .whl/                                                        (T_PUB=55)
#   4. a forced multi-stage plan (8 decoder layers, 5 stages) on two workers
#      sharing GPU 0: peak allocated memory checked against running stage +
#      prefetched stage + one microbatch of its heaviest stage + one
#      accumulated gradient of the largest parameter, per worker; peak reserved
#      against that plus the allocator's per-stream slack                  (T_MULTI=40)
#   5. the CUDA tests, verbose (-v -rA): the cuda-marked tests and the engine
#      equivalence / recompute / memory tests with every worker on CUDA  (T_TESTS=45)
#   6. the results table, once (table.md: paste it whole): each engine's row, the
#      tests' outcome, GPU and torch version.                 (probes + table: T_OVERHEAD=15)
#
# Every phase writes its log to $OUT as it runs (progress.log: one line per phase;
# <phase>.log: set-up time, each step's time and loss, each test's name and
# outcome), so a phase killed by its limit still shows how far it got.
#
# The published package (PyPI `roundpipe`, LGPL; run, never copied) needs
# `beartype` and `py-cpuinfo`, which that machine lacks. Fetch all three as
# wheels on a machine with pip, into the git-ignored .whl/ folder of the repo root:
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 --platform any \
#         -d .whl roundpipe==0.1.1 beartype py-cpuinfo
#
# (all pure-Python wheels). This script installs nothing: it puts each .whl/*.whl on
# PYTHONPATH as it is (Python imports pure-Python wheels from the zip). Through the
# device tool: carry [".whl"]; command "bash benchmarks/gpu_check.sh".
#
# Without a GPU, GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh runs every phase on
# a tiny model and CPU workers (the GPU-only parts say "skipped") to check the
# script itself.
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-/tmp/roundpipe-gpu-check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
T_ENV="${T_ENV:-15}"
T_OURS="${T_OURS:-85}"
T_PLAIN="${T_PLAIN:-45}"
T_PUB="${T_PUB:-55}"
T_MULTI="${T_MULTI:-40}"
T_TESTS="${T_TESTS:-45}"
T_OVERHEAD="${T_OVERHEAD:-15}"
TINY="${GPU_CHECK_TINY:-0}"
RESULTS="$OUT_DIR/results.jsonl"
PROGRESS="$OUT_DIR/progress.log"
: >"$RESULTS"
: >"$PROGRESS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
BUDGET=$((T_ENV + T_OURS + T_PLAIN + T_PUB + T_MULTI + T_TESTS + T_OVERHEAD))
elapsed() { echo $(($(date +%s) - START)); }
note() { echo "[$(elapsed) s] $*" | tee -a "$PROGRESS"; }
phase() { echo; note "=== $*"; }
TESTS_STATUS="not run"

echo "time budget: $BUDGET s (env $T_ENV + ours $T_OURS + plain $T_PLAIN + published $T_PUB + multi-stage $T_MULTI + tests $T_TESTS + probes and table $T_OVERHEAD)" | tee -a "$PROGRESS"
if [ "$BUDGET" -gt 300 ]; then
    echo "the time budget is over 300 s: lower a T_* limit so that a rerun fits the slot" | tee -a "$PROGRESS"
    exit 2
fi
# the wheels go on the path as they are: nothing is installed on this machine
for whl in .whl/*.whl; do
    [ -f "$whl" ] && export PYTHONPATH="$PYTHONPATH:$PWD/$whl"
done

phase "0. environment (limit ${T_ENV} s)"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
        || echo "nvidia-smi: none (no GPU here)"
    # one interpreter start for the versions and the GPU probe (importing torch costs seconds)
    timeout -k 2 "$T_ENV" "$PY" - "$OUT_DIR/has_gpu" <<'EOF'
import sys, torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| GPUs", gpus, flush=True)
open(sys.argv[1], "w").write(str(int(gpus > 0)))
EOF
    if ls .whl/*.whl >/dev/null 2>&1; then
        echo "wheels on PYTHONPATH (not installed): $(cd .whl && ls *.whl | tr '\n' ' ')"
    else
        echo "no .whl/ folder: the published-package run will be skipped"
    fi
} 2>&1 | tee "$OUT_DIR/env.log"
HAS_GPU=$(cat "$OUT_DIR/has_gpu" 2>/dev/null || echo 0)
TORCH_LINE=$(grep -m1 '^python ' "$OUT_DIR/env.log" || echo "torch: unknown (the probe failed)")
if [ "$TINY" = "1" ]; then
    note "GPU_CHECK_TINY=1: tiny model; GPU-only parts are skipped where there is no GPU"
elif [ "$HAS_GPU" != "1" ]; then
    note "no CUDA GPU visible: run with GPU_CHECK_TINY=1 to check the script on CPU"
    exit 2
fi

train() {  # label, limit, gpu_train.py args...
    local label=$1 limit=$2
    shift 2
    local extra=()
    [ "$TINY" = "1" ] && extra=(--tiny)
    timeout -k 5 "$limit" "$PY" benchmarks/gpu_train.py --label "$label" --json "$RESULTS" \
        "${extra[@]}" "$@" 2>&1 | tee "$OUT_DIR/train_$label.log"
    local rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        echo "{\"engine\": \"$label\", \"status\": \"timeout\", \"error\": \"over ${limit} s, see train_$label.log\"}" >>"$RESULTS"
        note "$label: TIMED OUT after $limit s (last lines of train_$label.log show how far it got)"
    elif ! grep -q "\"engine\": \"$label\"" "$RESULTS"; then
        echo "{\"engine\": \"$label\", \"status\": \"error\", \"error\": \"exit $rc, see train_$label.log\"}" >>"$RESULTS"
        note "$label: failed (exit $rc)"
    else
        note "$label: done (exit $rc)"
    fi
}

phase "1. Qwen3-1.7B shape, roundpipe_core (limit ${T_OURS} s)"
train roundpipe_core "$T_OURS" --engine roundpipe_core
phase "2. Qwen3-1.7B shape, plain PyTorch + activation checkpointing (limit ${T_PLAIN} s)"
train plain "$T_PLAIN" --engine plain
phase "3. Qwen3-1.7B shape, published roundpipe (limit ${T_PUB} s)"
if ls .whl/roundpipe-*.whl >/dev/null 2>&1; then
    train published "$T_PUB" --engine published   # an import failure is reported in the table
else
    note "published: skipped, no .whl/roundpipe-*.whl (see the header for how to carry it)"
    echo '{"engine": "published", "status": "unavailable", "error": "no roundpipe wheel under .whl/"}' >>"$RESULTS"
fi
phase "4. forced multi-stage plan, two workers sharing GPU 0, memory bound (limit ${T_MULTI} s)"
if [ "$TINY" = "1" ]; then
    MULTI_ARGS=(--layers 4 --stages 3)
else
    MULTI_ARGS=(--layers 8 --stages 5 --batch 4 --num-microbatch 4)
fi
train multi-stage "$T_MULTI" --engine roundpipe_core --devices 2 --plan uniform \
    --check-memory --warmup 1 "${MULTI_ARGS[@]}"
[ "$HAS_GPU" = "1" ] || note "multi-stage: memory check skipped (no GPU; the run itself used CPU workers)"

phase "5. CUDA tests, verbose (limit ${T_TESTS} s)"
if [ "$HAS_GPU" = "1" ]; then
    TEST_ENV=(ROUNDPIPE_TEST_DEVICE=cuda)
    TEST_ARGS=(tests/core/test_cuda_backend.py tests/core/test_engine_equivalence.py
        tests/core/test_recompute.py tests/core/test_memory.py)
else
    note "tests: no GPU, so the cuda-marked tests skip; running the device tests on fake CUDA instead"
    TEST_ENV=(ROUNDPIPE_TEST_DEVICE=fake-cuda)
    TEST_ARGS=(tests/core/test_cuda_backend.py tests/core/test_devices_fake_cuda.py)
fi
env "${TEST_ENV[@]}" timeout -k 5 "$T_TESTS" "$PY" -m pytest -o addopts="" -v -rA \
    -p no:cacheprovider --timeout 30 --durations=5 "${TEST_ARGS[@]}" 2>&1 | tee "$OUT_DIR/tests.log"
rc=$?
case $rc in
    0) TESTS_STATUS="passed" ;;
    124|137) TESTS_STATUS="TIMED OUT after ${T_TESTS} s (tests.log lists each test that ran)" ;;
    *) TESTS_STATUS="FAILED (pytest exit $rc)" ;;
esac
TESTS_STATUS="$TESTS_STATUS: $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT_DIR/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//')"
note "tests: $TESTS_STATUS"

phase "6. results ($(elapsed) s of the $BUDGET s budget)"
{
    echo "RoundPipe GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'): $TORCH_LINE"
    echo "CUDA tests: $TESTS_STATUS"
    timeout -k 2 "$T_OVERHEAD" "$PY" benchmarks/gpu_train.py --table "$RESULTS" \
        || echo "(the table could not be printed: results.jsonl holds the rows)"
    echo "total: $(elapsed) s"
} | tee "$OUT_DIR/table.md"
# Exit status: 0 only if the tests passed and no run failed, timed out or broke its memory bound
# (plain PyTorch running out of memory, or the published package being absent, is a result).
if [ "$TESTS_STATUS" != "${TESTS_STATUS#passed}" ] \
    && ! grep -qE '"status": "(error|timeout)"|"mem_check": "FAIL"' "$RESULTS"; then
    note "gpu check: all green"
else
    note "gpu check: something failed (see above)"
    exit 1
fi
