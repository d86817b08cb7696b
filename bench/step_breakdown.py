"""Where a decode step's time goes: scheduling, input preparation, the forward pass (GPU), sampling and
output handling, each timed with the device synchronised at its end.

    python -m bench.step_breakdown --model random:llama-8b --device cuda --batch 1 [--quantization int4] [--json FILE]

Synchronising between phases removes any overlap, so the phases add up to a bit more than a normal
step; the point is the share of host work next to the GPU's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from bench.common import emit, log
from engine import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--quantization", choices=("int8", "int4", "fp8"), help="weights quantized on the fly")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS more steps with torch.profiler and print the busiest ops")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # synchronous steps: the timers below wait for the GPU around each phase, which async scheduling would hide
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization, async_scheduling=False)
    engine = llm.engine
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            sync()
            start = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            times[name].append(time.perf_counter() - start)
            return out
        return wrapper

    rng = random.Random(0)
    vocab = min(10000, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps + 8)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    engine.step()  # the prefill
    runner = engine.runner
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    runner.run_model = timed("forward", runner.run_model)
    sampler = runner.sampler
    runner.sampler = timed("sample", sampler)
    log(f"timing {args.steps} decode steps at batch {args.batch}")
    step_times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        step_times.append(time.perf_counter() - start)
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile):
                engine.step()
            sync()
        sort = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)
    ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in times.items()}
    step_ms = statistics.median(step_times) * 1e3
    ms["other"] = round(step_ms - sum(ms.values()), 3)
    result = {"model": args.model, "quantization": args.quantization, "device": args.device, "batch": args.batch,
              "tensor_parallel_size": args.tensor_parallel_size, "step_ms": round(step_ms, 3), "phase_ms": ms}
    emit(result, args.json)
    llm.close()
    return result


if __name__ == "__main__":
    main()
