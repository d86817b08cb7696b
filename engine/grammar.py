"""Grammars for structured outputs, through llguidance (docs/benchmarks/structured.md says why this library):
a request's StructuredOutputs compiled for the engine's tokenizer and cached by its hash, and one matcher per
sequence that follows the sequence's tokens. llguidance is imported on the first structured request.

JSON comes out with json.dumps' separators (", " and ": ") and no other whitespace: a small model cannot then pad a
document with blank lines until max_tokens. llguidance refuses the schema keywords it cannot enforce (uniqueItems,
not, if/then, ...) rather than ignoring them, so every refusal here is a ValueError naming the request's field."""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.deferred_tokens import PENDING_TOKEN
from engine.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from engine.mask_processes import MaskProcesses
    from engine.sequence import Sequence
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept, least recently used first out


@functools.lru_cache(maxsize=1)
def _llguidance() -> Any:
    import llguidance
    import llguidance.gbnf_to_lark  # noqa: F401 - grammar_text converts GBNF through it

    return llguidance


def _message(error: str) -> str:
    """llguidance's error on one line: its first line and the regex parser's `error:` line, without the caret
    drawings."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    picked = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(picked)[:500]


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for the constraint; a ValueError naming spec.field when it cannot be built."""
    llg = _llguidance()
    make = llg.LLMatcher
    try:
        if spec.kind == "json":
            return make.grammar_from_json_schema(json.dumps(spec.json), defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return make.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if spec.kind == "regex":  # \d and \w mean ASCII digits and word characters, as in JSON Schema's patterns
            return make.grammar_from_lark(f"start: /{llg.regex_to_lark(spec.regex, 'dw')}/")
        if spec.kind == "choice":
            return make.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                 for c in spec.choice))
        return make.grammar_from_lark(llg.gbnf_to_lark.any_to_lark(spec.grammar))
    except Exception as e:  # noqa: BLE001 - the library's parse errors are the client's to read
        raise ValueError(f"{spec.field}: {_message(str(e))}") from e


def check(spec: StructuredOutputs, tokenizer: Any = None) -> str:
    """The constraint's grammar once llguidance has checked it (for `tokenizer` when given); a ValueError naming
    spec.field otherwise. Warnings refuse too: they name parts of the constraint that would not be enforced."""
    text = grammar_text(spec)
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if is_error or messages:
        raise ValueError(f"{spec.field}: {'; '.join(_message(m) for m in messages)}")
    return text


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of a tokenizer, built once per process (about half a second) for every engine that shares
    the tokenizer (a GGUF's is one object per file)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size, eos_token=list(eos))


def mask_threads() -> int:
    """The size of llguidance's thread pool (engine/token_mask.py): its own default, 80% of the usable cores and
    at most 32, computed here because each grammar spreads its matchers over that many lexers."""
    return max(1, min(32, int(0.8 * len(os.sched_getaffinity(0)))))


@dataclass
class CompiledGrammar:
    """A constraint compiled for the tokenizer. An llguidance matcher's copies share its lexer (deep_copy copies
    the parser state, not the lexer), and the lexer's lock is held for each mask and token: the masks of copies of
    one matcher are computed one at a time however many threads fill them. So the sequences of a grammar are
    spread over up to `lexers` templates in turn, each compiled from the grammar text on its own (the first when
    the grammar is compiled, the others as sequences arrive), and a step's masks are filled in parallel."""

    key: str
    text: str  # llguidance's grammar
    ll_tokenizer: Any
    lexers: int
    templates: list[Any]  # llguidance LLMatchers in their start state; each sequence gets a copy of one
    handed_out: int = 0

    def next_template(self) -> Any:
        index = self.handed_out % self.lexers
        self.handed_out += 1
        if index == len(self.templates):
            self.templates.append(_llguidance().LLMatcher(self.ll_tokenizer, self.text, log_level=0))
        return self.templates[index]


class SequenceGrammar:
    """One sequence's matcher: it consumes the sequence's output tokens as they are read, and its mask says which
    tokens may come next (engine/token_mask.py). With mask processes (engine/mask_processes.py) the matcher lives
    in one of them: `matcher` is None, `pool`, `worker` and `key` say where, and `grammar_key` and `text` rebuild
    it there."""

    __slots__ = ("matcher", "num_consumed", "mask_words", "rejected", "pool", "worker", "key", "grammar_key",
                 "text", "__weakref__")

    def __init__(self, matcher: Any, mask_words: int, compiled: CompiledGrammar | None = None,
                 pool: MaskProcesses | None = None) -> None:
        self.matcher = matcher
        self.num_consumed = 0  # output tokens consumed
        self.mask_words = mask_words  # int32 words of one mask row
        self.rejected = False  # a token outside the grammar was read (never, while masks are applied)
        self.pool = pool
        self.worker = self.key = -1
        self.grammar_key = compiled.key if compiled is not None else ""
        self.text = compiled.text if compiled is not None else ""
        if pool is not None:
            pool.assign(self)

    def reset(self) -> None:
        """The matcher is back in its start state (its mask process was started again): every token is new."""
        self.num_consumed = 0
        self.rejected = False

    def new_tokens(self, seq: Sequence) -> list[int]:
        """The output tokens read since the matcher last consumed (up to a placeholder still on the device)."""
        new = seq.token_ids[seq.num_prompt_tokens + self.num_consumed:]
        if PENDING_TOKEN in new:
            new = new[: new.index(PENDING_TOKEN)]
        return new

    def consume(self, seq: Sequence, tokens: list[int]) -> None:
        for token in tokens:
            self.consumed(seq, token, self.matcher.consume_token(token))

    def consumed(self, seq: Sequence, token: int, accepted: bool) -> None:
        """Books one token the matcher has consumed (accepted: it was inside the grammar)."""
        self.num_consumed += 1
        if not accepted:
            self.refused(seq, token, self.matcher.get_error())

    def refused(self, seq: Sequence, token: int, error: str) -> None:
        if not self.rejected:
            # from an error state only end-of-sequence is allowed: the sequence stops at its next token
            self.rejected = True
            log.warning("request %s: token %d is outside its grammar: %s", seq.request_id, token, _message(error))


class GrammarCompiler:
    """The engine's grammars: llguidance's view of the tokenizer (built on first use, about half a second), the
    compiled grammars by hash, and the sequences' matchers alive now (num_live; each is dropped when its sequence
    finishes or is aborted)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE, lexers: int | None = None, processes: int = 0,
                 max_rows: int = 256, device: Any = None, spin_s: float | None = None) -> None:
        """`lexers`: per grammar, at most (mask_threads() when not given). `processes`: hold the matchers in that
        many mask processes (engine/mask_processes.py, started with the first structured request) whose buffer
        has room for `max_rows` masks a step, pinned for a CUDA `device`, and which spin `spin_s` between steps
        (the machine's choice when not given); 0 keeps them in this process."""
        self._tokenizer = tokenizer
        self.processes = processes
        self.max_rows = max_rows
        self.device = device
        self.spin_s = spin_s
        self._pool: MaskProcesses | None = None
        self.lexers = lexers or mask_threads()
        self.vocab_size = vocab_size  # the model's logits rows: a mask covers them all (a tokenizer may have fewer)
        self._eos = sorted(eos_token_ids)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._live: weakref.WeakSet[SequenceGrammar] = weakref.WeakSet()
        self.hits = 0
        self.misses = 0

    @property
    def ll_tokenizer(self) -> Any:
        # a model's own end-of-sequence ids may lie past a borrowed tokenizer's vocabulary: the grammar ends with
        # the ones the tokenizer has
        eos = tuple(t for t in self._eos if t < self._tokenizer.vocab_size)
        if not eos:
            raise ValueError("this model's tokenizer has none of its end-of-sequence tokens")
        return _ll_tokenizer(self._tokenizer, self.vocab_size, eos)

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        key = spec.key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return compiled
        if self._tokenizer is None:
            raise ValueError(f"{spec.field}: this model has no tokenizer, so its outputs cannot be constrained")
        if self._tokenizer.vocab_size > self.vocab_size:
            # the grammar could allow only tokens the model cannot write
            raise ValueError(f"{spec.field}: this model's tokenizer has more tokens ({self._tokenizer.vocab_size}) "
                             f"than the model has vocabulary rows ({self.vocab_size}), so its outputs cannot be "
                             "constrained")
        try:
            ll_tokenizer = self.ll_tokenizer
        except ValueError as e:
            raise ValueError(f"{spec.field}: {e}") from e
        text = check(spec, ll_tokenizer)
        template = _llguidance().LLMatcher(ll_tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(f"{spec.field}: {_message(template.get_error())}")
        self.misses += 1
        compiled = CompiledGrammar(key, text, ll_tokenizer, self.lexers, [template])
        self._cache[key] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, compiled: CompiledGrammar) -> SequenceGrammar:
        if self.processes:
            grammar = SequenceGrammar(None, self.mask_words, compiled, self.pool)
        else:
            grammar = SequenceGrammar(compiled.next_template().deep_copy(), self.mask_words, compiled)
        self._live.add(grammar)
        return grammar

    @property
    def pool(self) -> MaskProcesses:
        """The mask processes, started on first use."""
        if self._pool is None:
            import torch

            from engine.mask_processes import MaskProcesses

            hf = copy.copy(self._tokenizer.hf.backend_tokenizer)  # as llguidance.hf reads it: no padding, whole
            hf.no_padding()
            hf.no_truncation()
            eos = [t for t in self._eos if t < self._tokenizer.vocab_size]
            self._pool = MaskProcesses(self.processes, hf.to_str(), self.vocab_size, eos, self.max_rows,
                                       self.mask_words, self.device or torch.device("cpu"), self.spin_s)
        return self._pool

    def close(self) -> None:
        """Stops the mask processes, if any ran."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
