"""The GPU's view of async decode steps: wall time per step against kernel time per step, and the kernels
that take it (rank 0's GPU; with tensor parallelism NCCL kernels that wait for another rank show up long).

    python -m bench.overlap_profile --model random:llama-8b --device cuda --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from bench.common import emit, log
from engine import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--device", choices=("cuda",), default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def _device_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size)
    engine = llm.engine
    rng = random.Random(0)
    vocab = min(10000, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2 * args.steps + 16)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    log(f"profiling {args.steps} async decode steps at batch {args.batch}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    kernels = sorted((e for e in averages if _device_us(e) > 0), key=_device_us, reverse=True)
    per_step = lambda us: round(us / args.steps / 1e3, 3)  # noqa: E731
    result = {
        "model": args.model, "batch": args.batch, "tensor_parallel_size": args.tensor_parallel_size,
        "wall_ms_per_step": round(wall / args.steps * 1e3, 3),
        "kernel_ms_per_step": per_step(sum(_device_us(e) for e in kernels)),
        "top_kernels": [{"name": e.key[:80], "calls_per_step": round(e.count / args.steps, 2),
                         "ms_per_step": per_step(_device_us(e)), "us_per_call": round(_device_us(e) / e.count, 2)}
                        for e in kernels[:20]],
    }
    emit(result, args.json)
    llm.close()
    return result


if __name__ == "__main__":
    main()
