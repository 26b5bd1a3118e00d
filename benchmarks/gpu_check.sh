#!/usr/bin/env bash
# GPU check of RoundPipe for Lightning: one script, one machine, under 8 minutes.
#
# Run in the repository root of a machine with a CUDA GPU (made for one H200:
# Python 3.12, torch 2.11+cu130, pytest, pytest-timeout, transformers, lightning
# already installed; nothing is downloaded):
#
#     bash benchmarks/gpu_check.sh            # results and logs in $OUT (or /tmp/roundpipe-gpu-check)
#
# What it does, each phase under its own time limit (seconds, env overrides):
#   0. environment: GPU, driver, torch                                     (~5 s)
#   1. the engine test suite on CUDA: every test of tests/core and tests/presets
#      with ROUNDPIPE_TEST_DEVICE=cuda (each CPU worker a test asks for becomes a
#      CUDA worker on the visible GPUs), plus the cuda-marked tests      (T_TESTS=170)
#   2. training a Qwen3-1.7B-shaped model (random weights, bf16 params, fp32
#      masters, seq 2048, batch 8) for a few steps with this project's RoundPipe (T_OURS=120)
#   3. the same model with plain PyTorch + activation checkpointing        (T_PLAIN=70)
#   4. the same run with the published `roundpipe` package, if its wheel is
#      under .whl/                                                         (T_PUB=100)
#   5. a table: tokens/s, ratio to plain PyTorch, peak GPU memory.
#
# The published package (PyPI `roundpipe`, LGPL; run, never copied) needs
# `beartype`, which that machine lacks. Fetch both as wheels on a machine with
# pip, into the git-ignored .whl/ folder of the repo root:
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 --platform any \
#         -d .whl roundpipe==0.1.1 beartype
#
# (both are pure-Python wheels). This script installs whatever .whl/*.whl holds
# into /tmp/site (no index, no dependencies) and puts it on PYTHONPATH. Through
# the device tool: carry [".whl"]; command "bash benchmarks/gpu_check.sh".
#
# Smoke test of the script itself without a GPU: GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-/tmp/roundpipe-gpu-check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
T_TESTS="${T_TESTS:-170}"
T_OURS="${T_OURS:-120}"
T_PLAIN="${T_PLAIN:-70}"
T_PUB="${T_PUB:-100}"
TINY="${GPU_CHECK_TINY:-0}"
RESULTS="$OUT_DIR/results.jsonl"
: >"$RESULTS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }
phase() { echo; echo "=== [$(elapsed) s] $*"; }
declare -A STATUS

phase "0. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
"$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| GPUs", torch.cuda.device_count() if torch.cuda.is_available() else 0)
EOF
if ls .whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
        echo "installed wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
    else
        echo "could not install .whl/*.whl (the published-package run will say so)"
    fi
fi

phase "1. engine tests on CUDA (limit ${T_TESTS} s)"
if [ "$TINY" = "1" ]; then
    TEST_ENV=()
    TEST_ARGS=(tests/core/test_cuda_backend.py)
else
    TEST_ENV=(ROUNDPIPE_TEST_DEVICE=cuda)
    TEST_ARGS=(tests/core tests/presets)
fi
env "${TEST_ENV[@]}" timeout -k 5 "$T_TESTS" "$PY" -m pytest -rfEs -p no:cacheprovider \
    --timeout 60 --durations=5 "${TEST_ARGS[@]}" 2>&1 | tee "$OUT_DIR/tests.log"
rc=$?
case $rc in
    0) STATUS[tests]="passed" ;;
    124|137) STATUS[tests]="TIMED OUT after ${T_TESTS} s" ;;
    *) STATUS[tests]="FAILED (pytest exit $rc)" ;;
esac
STATUS[tests]="${STATUS[tests]}: $(grep -E ' in [0-9.]+s( |$)' "$OUT_DIR/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//')"

train() {  # name, limit, extra args...
    local name=$1 limit=$2
    shift 2
    local extra=()
    [ "$TINY" = "1" ] && extra=(--tiny)
    timeout -k 5 "$limit" "$PY" benchmarks/gpu_train.py --engine "$name" --json "$RESULTS" \
        "${extra[@]}" "$@" 2>&1 | tee "$OUT_DIR/train_$name.log"
    local rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        echo "{\"engine\": \"$name\", \"status\": \"timeout\", \"error\": \"over ${limit} s\"}" >>"$RESULTS"
    elif ! grep -q "\"engine\": \"$name\"" "$RESULTS"; then
        echo "{\"engine\": \"$name\", \"status\": \"error\", \"error\": \"exit $rc, see train_$name.log\"}" >>"$RESULTS"
    fi
}

phase "2. Qwen3-1.7B shape, roundpipe_core (limit ${T_OURS} s)"
train roundpipe_core "$T_OURS"
phase "3. Qwen3-1.7B shape, plain PyTorch + activation checkpointing (limit ${T_PLAIN} s)"
train plain "$T_PLAIN"
phase "4. Qwen3-1.7B shape, published roundpipe (limit ${T_PUB} s)"
if ls .whl/roundpipe-*.whl >/dev/null 2>&1; then
    train published "$T_PUB"   # an import failure is reported in the table
else
    echo "no .whl/roundpipe-*.whl: skipped (see the header for how to carry it)"
    echo '{"engine": "published", "status": "unavailable", "error": "no roundpipe wheel under .whl/"}' >>"$RESULTS"
fi

phase "5. summary ($(elapsed) s in all)"
echo "engine tests on CUDA: ${STATUS[tests]}"
"$PY" benchmarks/gpu_train.py --table "$RESULTS" | tee "$OUT_DIR/table.md"
