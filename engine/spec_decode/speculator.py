"""Decides each step which running sequences speculate and how far, and sets their draft tokens."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = 0  # set by check_target

    def check_target(self, target_config: ModelConfig, max_model_len: int) -> None:
        self.proposer.check_target(target_config, max_model_len)
        self.max_model_len = max_model_len

    def num_draft_tokens(self, seq: Sequence) -> int:
        """How many draft tokens seq may verify next step; 0 when it decodes one token at a time."""
        if seq.num_tokens - seq.num_computed_tokens != 1:  # still prefilling or recomputing after preemption
            return 0
        params = seq.params
        # Penalties would have to count each draft as output before scoring the next, logprobs would be
        # needed for every kept token, min_tokens bans EOS at some draft positions but not others, and
        # logit_bias would have to bias the verifying distribution: such sequences decode plainly, which is
        # exact by construction.
        if params.logprobs is not None or params.presence_penalty or params.frequency_penalty:
            return 0
        if params.repetition_penalty != 1.0 or seq.num_output_tokens < params.min_tokens or params.logit_bias:
            return 0
        # a step appends at most k + 1 tokens: never past max_model_len or max_tokens
        room = self.max_model_len - seq.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, running: SequenceOf[Sequence]) -> None:
        """Sets spec_token_ids (and spec_draft_probs) on the running sequences that speculate this step."""
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        if len(running) >= self.config.disable_by_batch_size:
            self.proposer.release(())
            return
        self.proposer.release(running)
        chosen = [(seq, k) for seq in running if (k := self.num_draft_tokens(seq)) > 0]
        if not chosen:
            return
        proposals = self.proposer.propose([seq for seq, _ in chosen], [k for _, k in chosen])
        for (seq, _), proposal in zip(chosen, proposals):
            seq.spec_token_ids, seq.spec_draft_probs = proposal.token_ids, proposal.draft_probs

    def release(self, running: SequenceOf[Sequence]) -> None:
        """Frees the proposer's state (a draft model's KV blocks) for sequences no longer running."""
        self.proposer.release(running)


def make_speculator(engine_config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Speculator | None:
    """The speculator engine_config.speculative_config asks for, or None; check_target it once the target is
    loaded. A draft model is loaded here, before the target sizes its KV pool from the memory left."""
    config = engine_config.speculative
    if config is None:
        return None
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        proposer = DraftModelProposer(config, engine_config, device, dtype)
    return Speculator(config, proposer)
