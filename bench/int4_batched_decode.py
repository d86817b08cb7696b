"""Batched decode with int4 weights, with the int4 tensor-core GEMM on wide layers (kernels/int4_matmul.py) and
without it (those layers then dequantize and call cuBLAS, as the others do above 16 rows).

    python -m bench.int4_batched_decode --model random:llama-8b --device cuda [--num-seqs 32] [--json FILE]

Each variant builds its own engine (the CUDA graphs capture the kernels chosen at start), the two alternating
--repeats times; each run greedily decodes --output-len tokens for --num-seqs random prompts at once and reports
generated tokens per second. JSON goes to --json, else to $OUT/int4_batched_decode.json when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import kernels.int4_matmul as int4_matmul
from bench.common import emit, log
from bench.quantization_speed import release
from engine import LLM, SamplingParams

VARIANTS = {"gemm": int4_matmul.GEMM_MIN_N, "dequantize": 1 << 62}  # the GEMM's minimum layer width


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def decode_tok_s(args: argparse.Namespace, variant: str) -> float:
    int4_matmul.GEMM_MIN_N = VARIANTS[variant]
    try:
        llm = LLM(args.model, device=args.device, quantization="int4", max_num_seqs=args.num_seqs,
                  max_model_len=args.prompt_len + args.output_len)
        rng = random.Random(0)
        vocab = min(10000, llm.engine.model_config.vocab_size)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len))
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        release(llm)
    finally:
        int4_matmul.GEMM_MIN_N = VARIANTS["gemm"]
    log(f"{variant}: {tok_s:.0f} tok/s")
    return tok_s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            runs[variant].append(round(decode_tok_s(args, variant), 1))
    result: dict[str, Any] = {"model": args.model, "device": args.device, "num_seqs": args.num_seqs,
                              "prompt_len": args.prompt_len, "output_len": args.output_len, "tok_s_runs": runs,
                              "tok_s": {variant: max(rates) for variant, rates in runs.items()}}
    result["gemm_speedup"] = round(result["tok_s"]["gemm"] / result["tok_s"]["dequantize"], 3)
    path = args.json or (os.path.join(os.environ["OUT"], "int4_batched_decode.json") if os.environ.get("OUT") else None)
    emit(result, path)
    return result


if __name__ == "__main__":
    main()
