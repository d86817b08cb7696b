"""The serving benchmark's requests: prompts (token ids, and text where the model reads text), forced output lengths,
and when each is sent (a seeded Poisson process, or all at once)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench.common import random_workload


@dataclass(frozen=True)
class ServeRequest:
    prompt_ids: list[int]
    output_len: int
    text: str | None = None  # sent as a chat message where the model has a tokenizer; else the ids go to /v1/completions


def nano_requests(num: int, seed: int) -> list[ServeRequest]:
    """nano-vllm's bench workload (random ids, 100..1024 in and out): 256 requests, seed 0 give 133,966 output tokens."""
    work = random_workload(num, 100, 1024, 100, 1024, seed)
    return [ServeRequest(p, n) for p, n in zip(work.prompts, work.output_lens)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[ServeRequest]:
    """vllm bench serve's random dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        ids = [rng.randint(0, 10000) for _ in range(draw(input_len))]
        requests.append(ServeRequest(ids, draw(output_len)))
    return requests


def sharegpt_requests(path: Path, num: int, tokenizer, output_range: tuple[int, int], max_prompt_tokens: int,
                      seed: int) -> list[ServeRequest]:  # type: ignore[no-untyped-def]
    """ShareGPT first turns (shuffled: the file is sorted longest first), tokenized by `tokenizer`, with output
    lengths drawn uniformly from output_range (the file holds no replies)."""
    if not path.is_file():
        raise SystemExit(f"--dataset sharegpt: {path} does not exist; pass --dataset-path or set TOLLGATE_DATA_DIR "
                         "to the folder holding prompts_sharegpt_en_first_turn.jsonl")
    # rows end at newlines only: str.splitlines() would also split at the U+2028 some prompts hold
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(rows)
    requests = []
    for row in rows:
        ids = tokenizer.encode(row["prompt"], add_special_tokens=True)
        if not 4 <= len(ids) <= max_prompt_tokens:
            continue
        requests.append(ServeRequest(ids, rng.randint(*output_range), row["prompt"]))
        if len(requests) == num:
            break
    return requests


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of `rate` per second (inf: all at
    once), seeded so runs of different targets send the same schedule."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, offsets = 0.0, []
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def fold_vocab(requests: list[ServeRequest], vocab_size: int) -> list[ServeRequest]:
    """Token ids folded into a vocabulary smaller than the workload's (tiny test models)."""
    return [ServeRequest([t % vocab_size for t in r.prompt_ids], r.output_len, r.text) for r in requests]


def salted(ids: list[int], salt: int, vocab_size: int) -> list[int]:
    """The ids shifted by `salt`: a run's prompts that the prefix cache of an earlier run cannot serve."""
    return [(t + salt) % vocab_size for t in ids]


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    a, b = int(low), int(high or low)
    if not 0 < a <= b:
        raise ValueError(f"range: expected LOW:HIGH with 0 < LOW <= HIGH, got {text!r}")
    return a, b
