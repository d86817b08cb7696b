"""A step's token masks filled by llguidance's thread pool (engine/token_mask.py) are the masks each matcher
computes alone, on random walks through several grammars whose sequences are spread over several lexers
(engine/grammar.py), whether the engine thread fills them or the worker fills them a step ahead."""

from __future__ import annotations

import random

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
    """As with async scheduling: the step's tokens go to the worker, which consumes them and fills the next
    step's masks; a sequence that leaves the batch makes the next step assemble its rows."""
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
        masker.start_ahead(tokens)
        tokens.mark_pending()
        for sampled in tokens.read():
            sampled.seq.token_ids.append(sampled.token_id)
    masker.wait()
    assert masker.rows_ahead > masker.rows // 2
