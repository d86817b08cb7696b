"""One generated sequence: its tokens, its KV blocks and how far the model has computed it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.grammar import SequenceGrammar
    from engine.lora.registry import AdapterEntry

_counter = itertools.count()

_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (n > 1): choice 0 keeps the request's seed, the others
    a 63-bit mix of (seed, index) (SplitMix64's finaliser), so requests with neighbouring seeds share no samples (with
    seed + index, seed s's choice 1 was seed s+1's choice 0)."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
        seed: int | None,
        device: torch.device,
        cache_salt: str | None = None,
        lora: AdapterEntry | None = None,
    ) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt  # prefix-cache blocks are shared only among sequences with the same salt
        self.lora = lora  # the LoRA adapter it runs with; None: the base model
        self.index = index
        self.order = next(_counter)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        # tokens whose keys and values are in the KV cache
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # chained hashes of this sequence's full blocks, computed once and kept across preemption
        self.block_hashes: list[int] = []
        # leading blocks already offered to the prefix cache
        self.num_registered_blocks = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # len(text) once each token of `logprobs` was added: a token's logprob goes out with its text, and one whose
        # text a stop cut off is not in the output
        self.logprob_text_ends: list[int] = []
        self.detokenizer: IncrementalDetokenizer | None = None
        self.text = ""
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.num_emitted_logprobs = 0
        # Draft tokens to verify after token_ids in the next step (speculative decoding). They are never part
        # of token_ids: the kept ones are appended once the target has checked them.
        self.spec_token_ids: list[int] = []
        # [len(spec_token_ids), V]: the distribution a draft model drew them from; None for a deterministic proposal
        self.spec_draft_probs: torch.Tensor | None = None
        # row of this sequence in the in-flight step's sampled tokens while its last token is PENDING_TOKEN
        self.pending_row = -1
        # tokens at which it stops for length (max_tokens or the model's context); set by the engine
        self.max_num_tokens: int | None = None
        # structured outputs: the matcher its next tokens are masked by; set by the engine, dropped when it finishes
        self.grammar: SequenceGrammar | None = None

    @property
    def prefix_salt(self) -> str | None:
        """What its prefix-cache blocks are keyed by besides their tokens: the cache salt and the adapter, whose
        keys and values differ from the base model's for the same tokens."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora.id}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finishes_when_read(self) -> bool:
        """Its pending token is its last: it stops for length once the host reads it, so it needs no next step."""
        return self.pending_row >= 0 and self.max_num_tokens is not None and self.num_tokens >= self.max_num_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Smaller runs first: lower priority value, then earlier arrival."""
        return (self.priority, self.arrival_time, self.order)


@dataclass
class SampledToken:
    """A new token of a sequence, with its logprob when the sequence asked for them."""

    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None
