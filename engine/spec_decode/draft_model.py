"""A small draft model with the target's vocabulary proposes k tokens by decoding them one at a time.

It keeps its own paged KV cache (a ModelRunner and block pool of its own, no prefix caching) and a
shadow Sequence per target sequence. Each step the shadow takes the target's tokens, keeps the KV of the
prefix they share (the draft tokens the target rejected are dropped), catches up in one pass and then
decodes the proposals."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.quantization import load_weights
from engine.runner import ModelRunner
from engine.sampler import processed_probs, sample_from_probs
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Proposal

# On a GPU the draft and its KV pool are set up before the target, whose pool then takes what is left.
_GPU_DRAFT_KV_FRACTION = 0.05


@dataclass
class _Shadow:
    seq: Sequence  # the draft's copy: the target's tokens, then the last proposals
    num_synced: int  # how many leading tokens are known to equal the target's


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, engine_config: EngineConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        assert spec.draft_model is not None
        try:
            loaded = load_model(spec.draft_model, device, dtype, load_tokenizer=False)  # it uses the target's
        except ValueError as e:
            raise ValueError(f"speculative_config.draft_model: {e}") from e
        cfg = loaded.config
        self.max_model_len = min(cfg.max_position_embeddings, engine_config.max_model_len or cfg.max_position_embeddings)
        runner_config = dataclasses.replace(
            engine_config, model=spec.draft_model, tokenizer=None, max_model_len=self.max_model_len,
            max_num_seqs=min(engine_config.max_num_seqs, spec.disable_by_batch_size),
            num_kv_blocks=_pool_blocks(cfg, engine_config.block_size, device, dtype), enable_prefix_caching=False,
            quantization=None, kv_cache_dtype="auto", speculative_config=None, tensor_parallel_size=1,
        )
        model = LlamaForCausalLM(cfg, self.max_model_len, device, dtype)
        load_weights(model, loaded, runner_config)  # an AWQ or GPTQ draft checkpoint loads as it is
        model.eval()
        self.device = device
        self.model_config = cfg
        self.runner = ModelRunner(runner_config, cfg, model, device, dtype, self.max_model_len,
                                  frozenset(cfg.eos_token_ids))
        self.kv = KVCacheManager(self.runner.num_blocks, engine_config.block_size, enable_prefix_caching=False)
        self.shadows: dict[Sequence, _Shadow] = {}

    def check_target(self, target_config: ModelConfig, max_model_len: int) -> None:
        if self.model_config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"speculative_config.draft_model: its vocabulary has {self.model_config.vocab_size} tokens, the "
                f"target's {target_config.vocab_size}; the draft must use the target's tokenizer"
            )
        if self.max_model_len < max_model_len:
            raise ValueError(
                f"speculative_config.draft_model: it takes at most {self.max_model_len} positions, the engine's "
                f"max_model_len is {max_model_len}"
            )

    def _synced(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq)
        if shadow is None:
            copy = Sequence(seq.request_id, seq.index, seq.token_ids, seq.params, seq.priority, seq.arrival_time,
                            None, self.device, seq.cache_salt)
            self.shadows[seq] = _Shadow(copy, seq.num_tokens)
            return copy
        draft, target = shadow.seq.token_ids, seq.token_ids
        same = shadow.num_synced
        limit = min(len(draft), len(target))
        while same < limit and draft[same] == target[same]:
            same += 1
        shadow.seq.token_ids = list(target)
        # the last token is always run again: its logits give the first proposal
        shadow.seq.num_computed_tokens = min(shadow.seq.num_computed_tokens, same, len(target) - 1)
        shadow.num_synced = len(target)
        return shadow.seq

    @torch.inference_mode()
    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[Proposal]:
        proposals = [Proposal() for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        work: list[tuple[int, Sequence, int]] = []  # (index, shadow, tokens to propose)
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            shadow = self._synced(seq)
            # the draft computes every token but its last proposal; a full pool means no proposal this step
            if self.kv.allocate(shadow, seq.num_tokens + k - 1 - shadow.num_computed_tokens):
                work.append((i, shadow, k))
        num_new = [s.num_tokens - s.num_computed_tokens for _, s, _ in work]
        while work:
            shadows = [s for _, s, _ in work]
            logits, _ = self.runner.forward_logits(ScheduledBatch(seqs=shadows, num_new_tokens=num_new))
            tokens, rows = _sample(logits, [seqs[i] for i, _, _ in work])
            unfinished = []
            for (i, shadow, k), n, token, row in zip(work, num_new, tokens, rows):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
                proposals[i].token_ids.append(token)
                if row is not None:
                    probs[i].append(row)
                if len(proposals[i].token_ids) < k:
                    unfinished.append((i, shadow, k))
            work, num_new = unfinished, [1] * len(unfinished)
        for proposal, rows in zip(proposals, probs):
            if rows:
                proposal.draft_probs = torch.stack(rows)
        return proposals

    def release(self, keep: SequenceOf[Sequence]) -> None:
        kept = {id(seq) for seq in keep}
        for seq in [s for s in self.shadows if id(s) not in kept]:
            self.kv.free(self.shadows.pop(seq).seq)


def _sample(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
    """The draft's token for each row, drawn as the target's sampler would draw it (same temperature and
    filters, the sequence's own generator), with the distribution it came from (None for greedy rows)."""
    tokens = logits.argmax(dim=-1)
    rows: list[torch.Tensor | None] = [None] * len(seqs)
    sampled = [i for i, seq in enumerate(seqs) if seq.params.temperature != 0.0]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        probs = processed_probs(logits[index], [seqs[i].params for i in sampled])
        tokens[index] = sample_from_probs(probs, [seqs[i].generator for i in sampled])
        for j, i in enumerate(sampled):
            rows[i] = probs[j]
    return tokens.tolist(), rows


def _pool_blocks(cfg: ModelConfig, block_size: int, device: torch.device, dtype: torch.dtype) -> int | None:
    """None on the CPU (the runner sizes the pool from cpu_kv_cache_gib); a fixed share of a GPU's memory."""
    if device.type != "cuda":
        return None
    bytes_per_block = (2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim
                       * torch.empty((), dtype=dtype).element_size())
    total = torch.cuda.get_device_properties(device).total_memory
    return max(1, int(total * _GPU_DRAFT_KV_FRACTION) // bytes_per_block)
