"""Batch-1 decode speed per weight quantization, and KV-cache capacity per KV dtype.

    python -m bench.quantization_speed --model random:llama-8b --device cuda [--json FILE]
    python -m bench.quantization_speed --model random:llama-tiny --device cpu   # end-to-end check

Decode: for each of bf16 (the model dtype; float32 on CPU), int8, int4 and fp8 weights, one engine
with max_num_seqs=1 (one CUDA graph, batch 1) runs a random 128-token prompt and greedily decodes
--output-len tokens, --repeats times; decode tok/s = (tokens - 1) / (finish - first token), the median
run. The first engine call autotunes the int8 / int4 GEMV kernels (during CUDA-graph warm-up).

KV capacity: for kv_cache_dtype auto and fp8 (and int8), an engine sizes its KV pool exactly as in
serving (GPU: what gpu_memory_utilization leaves after a profiling pass; CPU: cpu_kv_cache_gib);
reported are the blocks, bytes per block, and how many --max-model-len sequences fit at once.
JSON goes to --json, else to $OUT/quantization_speed.json when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
from typing import Any

import torch

from bench.common import emit, log
from engine import LLM, SamplingParams

WEIGHT_MODES = ("bf16", "int8", "int4", "fp8")
KV_DTYPES = ("auto", "fp8", "int8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--modes", nargs="+", default=list(WEIGHT_MODES), choices=WEIGHT_MODES)
    p.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096, help="for the KV capacity: sequences of this length")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=0.25)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def release(llm: LLM | None) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_speed(args: argparse.Namespace, mode: str) -> tuple[dict[str, Any], int]:
    """The mode's decode measurement, and the model's max_position_embeddings."""
    context = args.prompt_len + args.output_len
    kwargs: dict[str, Any] = {
        "device": args.device,
        "max_model_len": context,
        "max_num_seqs": 1,
        "num_kv_blocks": -(-context // 16) + 1,
    }
    if mode != "bf16":
        kwargs["quantization"] = mode
    log(f"decode {mode}: loading {args.model}")
    llm = LLM(args.model, **kwargs)
    vocab = min(10000, llm.engine.model_config.vocab_size)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([[rng.randrange(vocab) for _ in range(args.prompt_len)]],
                 SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(16, args.output_len)))
    rates = []
    for _ in range(args.repeats):
        out = llm.generate([[rng.randrange(vocab) for _ in range(args.prompt_len)]], params)[0]
        n = len(out.outputs[0].token_ids)
        rates.append((n - 1) / (out.metrics.finished_time - out.metrics.first_token_time))
    tok_s = statistics.median(rates)
    result = {
        "decode_tok_s": round(tok_s, 2),
        "decode_tok_s_runs": [round(r, 2) for r in rates],
        "ms_per_token": round(1e3 / tok_s, 3),
        "weight_bytes": parameter_bytes(llm.engine.runner.model),
        "load_seconds": round(llm.engine.load_seconds, 2),
    }
    log(f"decode {mode}: {tok_s:.1f} tok/s, weights {result['weight_bytes'] / 1e9:.2f} GB")
    max_positions = llm.engine.model_config.max_position_embeddings
    release(llm)
    return result, max_positions


def kv_capacity(args: argparse.Namespace, kv_dtype: str, max_model_len: int) -> dict[str, Any]:
    # max_num_seqs high enough that memory, not max_num_seqs x blocks per sequence, bounds the pool
    kwargs: dict[str, Any] = {"device": args.device, "max_model_len": max_model_len, "enforce_eager": True,
                              "kv_cache_dtype": kv_dtype, "max_num_seqs": 1024 if args.device == "cuda" else 65536}
    if args.device == "cpu":
        kwargs["cpu_kv_cache_gib"] = args.cpu_kv_cache_gib
    log(f"KV {kv_dtype}: sizing the pool")
    llm = LLM(args.model, **kwargs)
    runner = llm.engine.runner
    blocks_per_seq = -(-max_model_len // runner.block_size)
    result = {
        "num_blocks": runner.num_blocks,
        "bytes_per_block": runner.bytes_per_block,
        "cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "max_concurrent_seqs": runner.num_blocks // blocks_per_seq,
    }
    log(f"KV {kv_dtype}: {result['num_blocks']} blocks of {result['bytes_per_block']} bytes, "
        f"{result['max_concurrent_seqs']} sequences of {max_model_len} tokens")
    release(llm)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    decode: dict[str, Any] = {}
    max_positions = args.max_model_len
    for mode in args.modes:
        decode[mode], max_positions = decode_speed(args, mode)
    max_model_len = min(args.max_model_len, max_positions)
    result: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "max_model_len_for_kv": max_model_len,
        "decode": decode,
        "kv_cache": {kv: kv_capacity(args, kv, max_model_len) for kv in args.kv_dtypes},
    }
    base = result["decode"].get("bf16")
    for mode, row in result["decode"].items():
        if base and mode != "bf16":
            row["speedup_vs_bf16"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
            result[f"{mode}_speedup"] = row["speedup_vs_bf16"]
    auto = result["kv_cache"].get("auto")
    for kv, row in result["kv_cache"].items():
        if auto and kv != "auto":
            row["blocks_vs_auto"] = round(row["num_blocks"] / auto["num_blocks"], 3)
            result[f"kv_{kv}_block_ratio"] = row["blocks_vs_auto"]
    path = args.json or (os.path.join(os.environ["OUT"], "quantization_speed.json") if os.environ.get("OUT") else None)
    emit(result, path)
    return result


if __name__ == "__main__":
    main()
