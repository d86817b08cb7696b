#!/usr/bin/env bash
# The GPU suite: GPU tests and the engine/kernel benchmarks, in three parts of under 10 minutes each (one device
# command each; the whole no longer fits one):
#   bash bench/gpu_suite.sh 1      # GPU tests, decode, kernels, offline throughput
#   bash bench/gpu_suite.sh 2      # serving through the gateway (1 and 4 API processes), engine start, sleep / wake
#   bash bench/gpu_suite.sh 3      # model switching, quantization, speculative decoding, LoRA, structured outputs
#   bash bench/gpu_suite.sh        # all three in a row (about 25 minutes)
# JSON results go to $OUT when set, else ./bench-results/. Each step has its own timeout and a share of the part's
# 9.5-minute deadline; a failing step is recorded and the suite goes on. A summary table comes last: one JSON per
# benchmark, summary.json, suite.log (everything printed) and benchmarks.svg. With two GPUs part 3 adds the
# tensor-parallel steps.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared machines
PY=${PYTHON:-python3}
RESULTS=${OUT:-./bench-results}
mkdir -p "$RESULTS"
PART=${1:-all}
case "$PART" in 1|2|3) PARTS=" $PART " ;; all) PARTS=" 1 2 3 " ;; *) echo "usage: bash bench/gpu_suite.sh [1|2|3]" >&2; exit 2 ;; esac
exec > >(tee -a "$RESULTS/suite.log") 2>&1
DEADLINE=$((SECONDS + 570))
NAMES=() RCS=() TIMES=() PYTEST_LINE=""

part() {  # part N: the steps that follow belong to part N (each part gets its own 9.5-minute deadline)
  IN_PART=0
  [[ $PARTS == *" $1 "* ]] || return 0
  IN_PART=1
  DEADLINE=$((SECONDS + 570))
  echo "=== part $1"
}

step() {  # step NAME CAP_SECONDS COMMAND...
  ((IN_PART)) || return 0
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  local limit=$((cap < left ? cap : left))
  local start=$SECONDS rc
  if ((limit < 10)); then
    echo "=== $name: skipped, suite deadline reached" >&2
    rc=skipped
  else
    echo "=== $name (timeout ${limit}s): $*" >&2
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "${TMPDIR:-/tmp}/gpu_suite_step.$$.log"
    rc=${PIPESTATUS[0]}
    [[ $name == gpu_tests ]] && PYTEST_LINE=$(tail -n 1 "${TMPDIR:-/tmp}/gpu_suite_step.$$.log")
    ((rc == 124 || rc == 137)) && echo "=== $name: timed out after ${limit}s" >&2
  fi
  NAMES+=("$name") RCS+=("$rc") TIMES+=($((SECONDS - start)))
}

WORKLOAD=(--min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0)
# the serving benchmark runs the gateway: its web stack comes from the wheels a run carries (bench/device_env.sh)
if ! "$PY" -c "import fastapi, sqlalchemy" 2>/dev/null && [[ -d .whl ]]; then
  bash bench/device_env.sh install && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1
part 1
step gpu_tests 270 "$PY" -m pytest -q -m gpu tests/ --ignore=tests/billing --ignore=tests/gateway --ignore=tests/cache \
  -p no:cacheprovider
# The GPU path's four measurements first (issue 3), then quantization, speculative decoding and tensor parallelism.
step decode_8b 70 "$PY" -m bench.decode_latency --model random:llama-8b --device cuda --json "$RESULTS/decode_8b.json"
step kernels 50 "$PY" bench/kernels.py --json "$RESULTS/kernels.json"
step throughput_1b 100 "$PY" -m bench.throughput --model random:llama-1b --device cuda --num-seqs 256 "${WORKLOAD[@]}" \
  --max-model-len 4096 --json "$RESULTS/throughput_1b.json"
step throughput_1b_vs_hf 150 "$PY" -m bench.throughput --model random:llama-1b --device cuda --num-seqs 64 \
  "${WORKLOAD[@]}" --max-model-len 4096 --compare-hf --json "$RESULTS/throughput_1b_vs_hf.json"
step gemv 60 "$PY" bench/gemv.py --json "$RESULTS/gemv.json"
part 2
# serving: the same requests offline, through AsyncEngine and through the HTTP gateway (issue 34): one API process,
# then four in front of the same engine core (platform serve --local --api-servers 4), read by three client processes:
# with six, the clients and the API processes took the 16 cores the engine core needs (docs/benchmarks/serving.md)
step serve_1b 170 "$PY" -m bench.serve --model random:llama-1b --device cuda --dataset nano --num-prompts 256 \
  --request-rate inf,0.7x --client-procs 6 --json "$RESULTS/serve_1b.json" --chart "$RESULTS/serve_1b.svg"
step serve_1b_api4 170 "$PY" -m bench.serve --model random:llama-1b --device cuda --dataset nano --num-prompts 256 \
  --request-rate inf,0.7x --client-procs 3 --api-servers 4 --json "$RESULTS/serve_1b_api4.json" \
  --chart "$RESULTS/serve_1b_api4.svg"
step engine_start_8b 120 "$PY" -m bench.engine_start --model random:llama-8b --device cuda \
  --json "$RESULTS/engine_start_8b.json"
# sleep / wake and loading from disk (issue 36): read rates cold and warm, wakes from both levels, a fresh process
step wake_8b 240 "$PY" -m bench.wake --model random:llama-8b --device cuda --repeats 3 --json "$RESULTS/wake_8b.json"
part 3
# two 8B engines taking turns on one GPU: each switch to the other's first token (issue 36)
step switch_8b 100 "$PY" -m bench.model_switch --model random:llama-8b --device cuda --switches 6 \
  --json "$RESULTS/switch_8b.json"
step overlap_8b 60 "$PY" -m bench.overlap_profile --model random:llama-8b --device cuda --json "$RESULTS/overlap_8b.json"
step quantization_8b 130 "$PY" -m bench.quantization_speed --model random:llama-8b --device cuda --output-len 128 \
  --json "$RESULTS/quantization_8b.json"
step int4_batched_8b 90 "$PY" -m bench.int4_batched_decode --model random:llama-8b --device cuda --num-seqs 32 \
  --json "$RESULTS/int4_batched_8b.json"
step spec_decode_8b 90 "$PY" -m bench.spec_decode --mode oracle --model random:llama-8b --device cuda -k 4 \
  --output-len 128 --max-model-len 4096 --max-num-seqs 8 --json "$RESULTS/spec_decode_8b.json"
# multi-LoRA (issue 37): 16 rank-16 adapters on all seven projections vs the base model
step lora_8b 150 "$PY" -m bench.lora --model random:llama-8b --device cuda --rank 16 --batch 64 --num-adapters 16 \
  --repeats 2 --json "$RESULTS/lora_8b.json"
step lora_forms_8b 120 "$PY" -m bench.lora_decode_forms --device cuda --json "$RESULTS/lora_forms_8b.json"
# structured outputs need llguidance's wheel and a tokenizer (python -m bench.structured --export-tokenizer), carried
if [[ -d .bench-tokenizer ]] && "$PY" -c "import llguidance" 2>/dev/null; then
  step structured_1b 90 "$PY" -m bench.structured --model random:llama-1b --tokenizer .bench-tokenizer --device cuda \
    --batch 64 --repeats 2 --out "$RESULTS/structured_1b.json"
fi
if ((IN_PART)) && (($("$PY" -c "import torch; print(torch.cuda.device_count())") >= 2)); then
  step allreduce 40 "$PY" -m bench.allreduce_latency --json "$RESULTS/allreduce.json"
  step decode_8b_tp2 90 "$PY" -m bench.decode_latency --model random:llama-8b --device cuda --tensor-parallel-size 2 \
    --json "$RESULTS/decode_8b_tp2.json"
  step fused_norm_tp2 40 "$PY" -m bench.fused_norm_latency --json "$RESULTS/fused_norm_tp2.json"
  step decode_8b_tp2_int8 90 "$PY" -m bench.decode_latency --model random:llama-8b --device cuda \
    --tensor-parallel-size 2 --quantization int8 --repeats 2 --json "$RESULTS/decode_8b_tp2_int8.json"
  step decode_8b_tp2_int4 80 "$PY" -m bench.decode_latency --model random:llama-8b --device cuda \
    --tensor-parallel-size 2 --quantization int4 --repeats 2 --json "$RESULTS/decode_8b_tp2_int4.json"
  step throughput_1b_tp2 100 "$PY" -m bench.throughput --model random:llama-1b --device cuda --num-seqs 256 \
    "${WORKLOAD[@]}" --max-model-len 4096 --tensor-parallel-size 2 --json "$RESULTS/throughput_1b_tp2.json"
fi

ROWS=""
"$PY" -m bench.chart "$RESULTS" --out "$RESULTS/benchmarks.svg" || true

echo
echo "step                   rc       seconds  result"
for i in "${!NAMES[@]}"; do
  name=${NAMES[$i]}
  summary=$("$PY" - "$RESULTS/$name.json" <<'PYEOF' 2>/dev/null
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit()
flat = {}
def walk(prefix, value):
    flat[prefix] = value
    if isinstance(value, dict):
        for k, v in value.items():
            walk(f"{prefix}.{k}" if prefix else k, v)
walk("", r)
keys = ("tok_s", "hf_tok_s", "ratio", "ratio_to_offline", "decode_tok_s", "mbu", "total_seconds", "load_seconds",
        "int8_speedup", "int4_speedup", "fp8_speedup", "kv_fp8_block_ratio", "gemm_speedup",
        "triton_decode.fraction_of_copy_bandwidth", "speedup_vs_sdpa", "verify_overhead", "upper_bound_speedup",
        "nccl_graph_us", "wall_ms_per_step", "kernel_ms_per_step",
        "per_link_us.fused.best", "per_link_us.nccl.best", "per_link_us.local.best",
        "best.wake_level1_seconds", "best.wake_level2_cold_seconds", "best.fresh_process_seconds",
        "best.engine_reader_cold_gb_per_s")
fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
name = lambda k: "_".join(k.split(".")[-2:]) if k.startswith("per_link_us.") else k.split(".")[-1]
print("  ".join(f"{name(k)}={fmt(flat[k])}" for k in keys if k in flat))
PYEOF
)
  [[ $name == gpu_tests ]] && summary=$PYTEST_LINE
  printf '%-22s %-8s %-8s %s\n' "$name" "${RCS[$i]}" "${TIMES[$i]}" "$summary"
  ROWS+="{\"step\": \"$name\", \"rc\": \"${RCS[$i]}\", \"seconds\": ${TIMES[$i]}},"
done
printf '{"date": "%s", "total_seconds": %d, "pytest": "%s", "steps": [%s]}\n' "$(date -u +%FT%TZ)" "$SECONDS" \
  "${PYTEST_LINE//\"/}" "${ROWS%,}" > "$RESULTS/summary.json"
echo "results in $RESULTS (total ${SECONDS}s)"
