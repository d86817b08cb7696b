"""Shared pieces of the engine benchmarks: the random workload, timing, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def fit_vocab(self, vocab_size: int) -> "Workload":
        """Folds token ids into a vocabulary smaller than the workload's (tiny test models)."""
        if all(t < vocab_size for p in self.prompts for t in p):
            return self
        return Workload([[t % vocab_size for t in p] for p in self.prompts], self.output_lens)


def random_workload(num_seqs: int, min_input: int, max_input: int, min_output: int, max_output: int,
                    seed: int, max_token_id: int = 10000) -> Workload:
    """nano-vllm's bench.py workload, drawn exactly as it draws it, from Python's `random` (bounds inclusive,
    token ids 0..10000): with seed 0, 256 seqs, 100..1024 in and out it gives the same 133,966 output tokens."""
    if not (0 < min_input <= max_input and 0 < min_output <= max_output and num_seqs > 0):
        raise ValueError("workload: need num_seqs > 0, 0 < min <= max for input and output lengths")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_input, max_input))] for _ in range(num_seqs)]
    output_lens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    return Workload(prompts, output_lens)


# EngineConfig switches that A/B runs turn off: --no-tp-greedy-on-shards, --no-tp-fused-norm, ...
ENGINE_SWITCHES = ("tp_greedy_on_shards", "tp_fused_norm", "int4_int8_activations")


def add_engine_switches(parser: argparse.ArgumentParser) -> None:
    for name in ENGINE_SWITCHES:
        parser.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_false",
                            help=f"run with EngineConfig.{name}=False")


def engine_switches(args: argparse.Namespace) -> dict[str, bool]:
    """The switches turned off on the command line, as LLM(...) keywords."""
    return {name: False for name in ENGINE_SWITCHES if not getattr(args, name)}


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: str | torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """Runs fn once; returns (result, seconds), device work included."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def copy_bandwidth(num_bytes: int = 4 << 30, reps: int = 10) -> float:
    """Device-to-device copy of a num_bytes buffer: bytes read + written per second, median of reps (CUDA events)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(times)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def emit(result: dict, path: str | None) -> None:
    """Prints the result as JSON on stdout and writes it to path when given."""
    text = json.dumps(result, indent=2, sort_keys=False)
    print(text, flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
