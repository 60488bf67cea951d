#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script: run it from the repository root on a GPU machine.
#
#     OUT=gpu_results bash tools/gpu_checks.sh
#
# 1. lesson 05's attention benchmark (naive vs SDPA vs our Triton flash kernel, 12 layers, causal
#    fp16, S = 512 ... 8192): python -m lib.course.bench.attention -> $OUT/attention_gpu.json
# 2. the kernel tests compiled on CUDA tensors, with the GPU-only ones (tests/lib/test_kernels.py,
#    tests/lib/test_scan_kernel.py) -> $OUT/pytest_gpu.xml
# 3. lesson 06's scans on the GPU: reference, chunked and the fused Triton scan -> $OUT/ssm_cuda.json
# 4. lesson 07's MoE dispatch and lesson 04's KV-cache decode, on the GPU -> $OUT/moe_cuda.json,
#    $OUT/kv_cache_cuda.json
# Everything it prints goes to $OUT/gpu_log.txt too. Each step has its own time limit and a failed
# step does not stop the next. Copy the JSON files into benchmarks/ and re-execute lessons 04-07.
# Needs python3 with torch (CUDA) and triton, pytest and hypothesis; nothing else from the course's
# environment (no Jupyter): it imports only lib and the tests.
set -u
OUT=${OUT:-gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_log${LOG_SUFFIX:-}.txt"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tools/ scripts import lib

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c "import torch, triton, platform; print('python', platform.python_version(), 'torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name(), 'cuda', torch.version.cuda)"
} 2>&1 | tee "$LOG"

STEPS=${STEPS:-attention tests ssm moe kv_cache}  # a subset reruns only those steps
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log it, report its status and time
    local name=$1 limit=$2 start rc
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    start=$(date +%s)
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$LOG"
}

step attention "${LIMIT_ATTENTION:-170}" "$PY" -m lib.course.bench.attention --out "$OUT/attention_gpu.json"
step tests "${LIMIT_TESTS:-200}" "$PY" -m pytest -q -rs tests/lib/test_kernels.py tests/lib/test_scan_kernel.py \
    --junitxml="$OUT/pytest_gpu.xml"
step ssm "${LIMIT_SSM:-110}" "$PY" -m lib.course.bench.ssm --threads 1 --repeats 5 --sweep --out "$OUT/ssm_cuda.json"
step moe "${LIMIT_MOE:-35}" "$PY" -m lib.course.bench.moe --threads 1 --repeats 5 --out "$OUT/moe_cuda.json"
step kv_cache "${LIMIT_KV:-35}" "$PY" -m lib.course.bench.kv_cache --repeats 3 --out "$OUT/kv_cache_cuda.json"
date -u | tee -a "$LOG"
