"""The GPU's view of async decode steps: wall time per step against kernel time per step, the kernels that take
it (rank 0's GPU; with tensor parallelism NCCL kernels that wait for another rank show up long), and where the GPU
sits idle between two operations (the pairs of neighbours with the most idle time a step). The profiler slows the
host, so idle time here is an upper bound of the idle time without it.

    python -m bench.overlap_profile --model random:llama-8b --device cuda --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import tempfile
import time
from pathlib import Path
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


GPU_OP_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_between_ops(trace: dict, device: int, steps: int, top: int = 12) -> dict[str, Any]:
    """From a profiler's Chrome trace: the device's busy and idle time a step (kernels, copies and memsets laid end
    to end) and the neighbouring operations with the most idle time between them."""
    ops = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_OP_CATEGORIES
                  and int(e.get("args", {}).get("device", -1)) == device), key=lambda e: e["ts"])
    if not ops:
        return {}
    idle: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    busy_until, previous, busy = ops[0]["ts"] + ops[0]["dur"], ops[0]["name"], ops[0]["dur"]
    for op in ops[1:]:
        if op["ts"] > busy_until:
            pair = idle[(previous[:60], op["name"][:60])]
            pair[0] += op["ts"] - busy_until
            pair[1] += 1
        busy += max(0.0, op["ts"] + op["dur"] - max(op["ts"], busy_until))
        busy_until = max(busy_until, op["ts"] + op["dur"])
        previous = op["name"]
    per_step_ms = lambda us: round(us / steps / 1e3, 4)  # noqa: E731
    return {
        "busy_ms_per_step": per_step_ms(busy),
        "idle_ms_per_step": per_step_ms(sum(us for us, _ in idle.values())),
        "top_idle": [{"after": a, "before": b, "us_per_step": round(us / steps, 2), "times_per_step": round(n / steps, 2)}
                     for (a, b), (us, n) in sorted(idle.items(), key=lambda kv: -kv[1][0])[:top]],
    }


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
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        result.update(idle_between_ops(json.loads(trace_path.read_text()), torch.cuda.current_device(), args.steps))
    emit(result, args.json)
    llm.close()
    return result


if __name__ == "__main__":
    main()
