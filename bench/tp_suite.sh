#!/usr/bin/env bash
# Tensor parallelism on a two-GPU host: GPU tests, collective latencies, batch-1 decode and step breakdown at TP=2.
#   bash bench/tp_suite.sh          # JSON to $OUT when set, else ./bench-results/
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=${OUT:-./bench-results}; mkdir -p "$R"
exec > >(tee "$R/tp.log") 2>&1
timeout 60 python -m bench.allreduce_latency --json "$R/allreduce.json" | tail -6
timeout 100 python -m bench.step_breakdown --model random:llama-8b --device cuda --tensor-parallel-size 2 \
  --json "$R/steps_tp2.json" | tail -12
timeout 150 python -m pytest -q -m gpu tests/engine/test_tensor_parallel_gpu.py -x -p no:cacheprovider 2>&1 | tail -15
