"""A step's token masks filled by llguidance's thread pool (engine/token_mask.py) are the masks each matcher
computes alone, on random walks through several grammars whose sequences are spread over several lexers
(engine/grammar.py), whether the engine thread fills them or the worker fills them a step ahead."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch

from bench.json_schemas import CASES
from engine.config import SamplingParams
from engine.deferred_tokens import DeferredTokens
from engine.grammar import GrammarCompiler
from engine.sequence import Sequence
from engine.structured_outputs import StructuredOutputs
from engine.token_mask import TokenMasker
from tests.engine.helpers import smollm2_tokenizer

SPECS = [StructuredOutputs(json=CASES[0].schema), StructuredOutputs(json=CASES[1].schema),
         StructuredOutputs(regex=r"[a-z]{2,12}( [0-9]+)*"), StructuredOutputs(json_object=True)]
NUM_SEQS = 10
LEXERS = 3


@pytest.fixture
def grammars() -> GrammarCompiler:
    tokenizer = smollm2_tokenizer()
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, lexers=LEXERS)


def new_sequences(grammars: GrammarCompiler) -> list[Sequence]:
    seqs = []
    for i in range(NUM_SEQS):
        seq = Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(), 0, 0.0, None, torch.device("cpu"))
        seq.grammar = grammars.new_matcher(grammars.compile(SPECS[i % len(SPECS)]))
        seqs.append(seq)
    return seqs


def alone(seq: Sequence) -> torch.Tensor:
    """The sequence's mask as its matcher computes it by itself (llguidance's own rounds up to a word more)."""
    words = torch.frombuffer(bytearray(seq.grammar.matcher.compute_bitmask()), dtype=torch.int32)
    assert not words[seq.grammar.mask_words:].any()
    return words[: seq.grammar.mask_words]


def allowed(words: torch.Tensor) -> list[int]:
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def random_step(seqs: list[Sequence], words: torch.Tensor, rows: torch.Tensor, rng: random.Random) -> list[int]:
    """Checks each row against its matcher's own mask; returns a token per sequence drawn from its mask."""
    assert rows.tolist() == list(range(len(seqs)))
    for seq, row in zip(seqs, words):
        assert torch.equal(row, alone(seq)), seq.request_id
    return [rng.choice(allowed(row)) for row in words]


def test_grammars_spread_their_sequences_over_lexers(grammars: GrammarCompiler) -> None:
    new_sequences(grammars)  # sequence i follows SPECS[i % 4]: 3, 3, 2 and 2 sequences
    assert [len(grammars.compile(spec).templates) for spec in SPECS] == [3, 3, 2, 2]
    new_sequences(grammars)
    assert [len(grammars.compile(spec).templates) for spec in SPECS] == [LEXERS] * len(SPECS)


@pytest.mark.parametrize("threads", [1, 3])
def test_masks_filled_in_parallel_equal_each_matchers_own(grammars: GrammarCompiler, threads: int) -> None:
    rng = random.Random(threads)
    seqs = new_sequences(grammars)
    masker = TokenMasker(torch.device("cpu"), threads=threads)
    for _ in range(25):
        live = [seq for seq in seqs if not seq.grammar.matcher.is_stopped()]
        if not live:
            break
        mask = masker.for_step(live)
        for seq, token in zip(live, random_step(live, mask.words, mask.rows, rng)):
            seq.token_ids.append(token)  # as the engine reads it; the next step's matcher consumes it
    assert masker.rows_ahead == 0 and masker.rows > 100


@pytest.mark.parametrize("threads", [1, 3])
def test_masks_filled_ahead_by_the_worker_equal_each_matchers_own(grammars: GrammarCompiler, threads: int) -> None:
    """As with async scheduling: once the step's tokens are on the host each matcher consumes its token and the
    worker fills the next step's masks; a sequence that leaves the batch makes the next step assemble its rows."""
    rng = random.Random(10 + threads)
    seqs = new_sequences(grammars)
    masker = TokenMasker(torch.device("cpu"), threads=threads)
    for step in range(25):
        if step == 12:
            seqs = seqs[1:]
        masker.wait()  # the engine thread touches no matcher while the worker does
        live = [seq for seq in seqs if not seq.grammar.matcher.is_stopped()]
        if not live:
            break
        mask = masker.for_step(live)
        tokens = DeferredTokens(torch.tensor(random_step(live, mask.words, mask.rows, rng)), live)
        tokens.mark_pending()
        masker.start_fill(tokens)
        for sampled in tokens.read():
            sampled.seq.token_ids.append(sampled.token_id)
    masker.wait()
    assert masker.rows_ahead > masker.rows // 2


def pending_step(seqs: list[Sequence], masker: TokenMasker, rng: random.Random,
                 cls: type[DeferredTokens] = DeferredTokens) -> DeferredTokens:
    """A step's masks, and its tokens drawn from them, in flight as async scheduling leaves them."""
    mask = masker.for_step(seqs)
    tokens = cls(torch.tensor(random_step(seqs, mask.words, mask.rows, rng)), seqs)
    tokens.mark_pending()
    return tokens


def read(tokens: DeferredTokens) -> None:
    for sampled in tokens.read():
        sampled.seq.token_ids.append(sampled.token_id)


def test_the_worker_is_inside_the_fill_when_start_fill_returns(grammars: GrammarCompiler) -> None:
    """The engine thread goes on only once the worker has begun filling, so the fill never waits for the engine
    thread to let go of the GIL. With a switch interval of 10 s the engine thread gives the GIL up only when it
    blocks: a worker that still had to take it would not have begun by then."""
    rng = random.Random(5)
    seqs = new_sequences(grammars)
    masker = TokenMasker(torch.device("cpu"), threads=2)
    tokens = pending_step(seqs, masker, rng)
    masker.start_fill(tokens)  # the worker thread is started, and idle again once its masks are taken
    read(tokens)
    tokens = pending_step(seqs, masker, rng)
    real, entered, release = masker.executor, threading.Event(), threading.Event()

    class Gated:
        consume_token_par = real.consume_token_par

        def unsafe_compute_mask_ptr(self, *args) -> None:
            entered.set()
            release.wait()
            real.unsafe_compute_mask_ptr(*args)

    masker._executor = Gated()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        masker.start_fill(tokens)
        began = entered.is_set()
    finally:
        release.set()
        sys.setswitchinterval(interval)
    assert began
    read(tokens)
    pending_step(seqs, masker, rng)  # checks every row against its matcher's own mask
    assert masker.rows_ahead == 2 * len(seqs) and masker.fills == 2


def test_a_fill_begins_once_per_step_and_skips_a_sequence_whose_token_is_its_last(grammars: GrammarCompiler) -> None:
    """A step's tokens begin one fill however often they are offered; a sequence whose pending token is its last
    (it stops for length once read) consumes nothing and gets no mask."""
    seqs = new_sequences(grammars)
    masker = TokenMasker(torch.device("cpu"), threads=2)
    tokens = pending_step(seqs, masker, random.Random(7))
    last = seqs[0]
    last.max_num_tokens = last.num_tokens  # its pending token is its last
    consumed = [seq.grammar.num_consumed for seq in seqs]
    masker.start_fill(tokens)
    masker.start_fill(tokens)
    assert masker.fills == 1
    assert [seq.grammar.num_consumed for seq in seqs] == [consumed[0]] + [n + 1 for n in consumed[1:]]
    read(tokens)
    pending_step(seqs[1:], masker, random.Random(8))
    assert masker.rows_ahead == len(seqs) - 1
