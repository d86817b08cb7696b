"""Turns a scheduled batch into tensors, runs the network, samples.

A step's tokens come out of it one of four ways (TokenPath), chosen in one place, ModelRunner.token_path: sampled
from the logits at once; sampled on the device and read by the host a step later (async scheduling); picked greedily
on each tensor-parallel rank's vocabulary shard, also read a step later; or speculative drafts verified by rejection
sampling. `execute` launches the forward pass for the path, `sample_tokens` then gives the tokens."""

from __future__ import annotations

import enum
import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from engine.batch_inputs import HostInputs, device_inputs, host_inputs
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.deferred_tokens import DeferredTokens
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.distributed.step_channel import receive_step, send_step, share_previous_tokens
from engine.lora.manager import LoRAManager
from engine.model_config import ModelConfig
from engine.models.attention_metadata import AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from engine.quantization.kv_cache import kv_cache_torch_dtype
from engine.sampler import Sampler, SamplingRow, suppress_tokens
from engine.scheduler import ScheduledBatch
from engine.sequence import SampledToken, Sequence
from engine.spec_decode.rejection_sampler import rejection_sample
from engine.token_mask import TokenMasker
from engine.transfer import to_device
from kernels.kv_layout import new_kv_cache

log = logging.getLogger(__name__)

FREE_MARGIN_BYTES = 256 << 20  # left free on the device after the KV pool (allocator slack, other processes)


class TokenPath(enum.Enum):
    SAMPLED = "sampled"  # the logits' rows through the sampler, read now
    DEFERRED = "deferred"  # through the sampler on the device, read by the host a step later (async scheduling)
    GREEDY_ON_SHARDS = "greedy_on_shards"  # each rank's argmax over its vocabulary shard, exchanged; read a step later
    SPECULATIVE = "speculative"  # the last token's and the drafts' rows through rejection sampling, read now


@dataclass
class LaunchedStep:
    """A step whose forward pass is launched: how its tokens come out, and from what."""

    path: TokenPath
    seqs: list[Sequence]  # the sequences whose tokens are all computed after this step: each gets tokens
    logits: torch.Tensor | None = None  # as forward_logits returns them; None on the greedy-on-shards path
    tokens: DeferredTokens | None = None  # the greedy-on-shards path's


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model: LlamaForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        tp: TensorParallel = SINGLE,
        lora: LoRAManager | None = None,
        baseline_free: int | None = None,
    ) -> None:
        """`baseline_free`: the device's free bytes before this engine loaded anything (CUDA), so that its KV pool
        is sized from its own share of the GPU."""
        self.config = config
        self.lora = lora  # adapters applied beside the model's projections (engine/lora/), when max_loras > 0
        self.baseline_free = baseline_free
        self.tp = tp
        self.model_config = model_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)  # fp8 / int8 halve bytes_per_block
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.token_masker = TokenMasker(device)  # structured outputs' masks, filled when a step samples
        # the last step's greedy tokens when every rank picked them (forward_greedy), else None
        self.picked_tokens: torch.Tensor | None = None
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_kv_heads = model_config.num_key_value_heads // tp.size
        self.num_blocks = tp.min_over_ranks(self._choose_num_blocks())
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self.lora_graphs: DecodeGraphs | None = None  # decode steps in which a sequence uses an adapter
        self.verify_graphs: DecodeGraphs | None = None
        self.allocate_kv_cache()
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                 self.num_blocks * self.bytes_per_block / 2**30)

    def allocate_kv_cache(self) -> None:
        """The KV pool (num_blocks blocks, zeroed) and, on CUDA, the decode graphs over it and the network's weights
        as they are now (each captured by the first step of its shape): at start, and again when a sleeping engine
        wakes."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.model_config.head_dim)
        self.kv_caches = [
            (new_kv_cache(*shape, self.kv_dtype, self.device), new_kv_cache(*shape, self.kv_dtype, self.device))
            for _ in range(self.model_config.num_hidden_layers)
        ]
        if self.device.type == "cuda" and not self.config.enforce_eager and kernels.triton_available():
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs, self.max_blocks_per_seq,
                                       self.device)
            self.lora_graphs = self._lora_graphs()
            self.verify_graphs = self._verify_graphs()
            for graphs in (self.graphs, self.lora_graphs, self.verify_graphs):
                if graphs is not None:  # masks the GPU may wait for are collected before a capture waits for it
                    graphs.before_capture = self.token_masker.wait

    def release_kv_cache(self) -> None:
        """Frees the KV pool and the graphs that point into it and at the weights (an engine going to sleep)."""
        self.release_graphs()
        self.kv_caches = []
        self.picked_tokens = None

    def _lora_graphs(self) -> DecodeGraphs | None:
        """Decode graphs with the adapters' kernels in them, in the base graphs' memory pool (each captured on first
        use, as the base ones are). A second set rather than one that always runs the LoRA kernels: a base-only step
        then launches none of them (even with no adapter to add, each costs a kernel launch per projection) and keeps
        the GEMV's fused SiLU."""
        if self.lora is None:
            return None
        if self.graphs.pool is None:
            self.graphs.pool = torch.cuda.graph_pool_handle()
        slots = self.lora.graph_slots(self.config.max_num_seqs)
        return DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs, self.max_blocks_per_seq,
                            self.device, lora=slots, pool=self.graphs.pool)

    def _verify_graphs(self) -> DecodeGraphs | None:
        """Graphs for speculative verify steps in which every sequence checks all k drafts (batch-1 decode
        always does); speculation runs only below disable_by_batch_size sequences, so no larger ones."""
        spec = self.config.speculative
        if spec is None:
            return None
        max_seqs = min(self.config.max_num_seqs, spec.disable_by_batch_size)
        return DecodeGraphs(self.model, self.kv_caches, max_seqs, self.max_blocks_per_seq, self.device,
                            tokens_per_seq=spec.num_speculative_tokens + 1)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def _choose_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        enough = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.device.type == "cuda":
            return min(enough, self._profile_free_blocks())
        budget = int(self.config.cpu_kv_cache_gib * 2**30) // self.bytes_per_block
        return max(1, min(enough, budget))

    @torch.inference_mode()
    def _profile_free_blocks(self) -> int:
        """Runs the largest batch once, then gives the KV pool what is left of gpu_memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_seqs = min(self.config.max_num_seqs, num_tokens)
        blocks = -(-num_tokens // self.block_size)
        cfg = self.model_config
        shape = (blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        caches = [(new_kv_cache(*shape, self.dtype, self.device),) * 2 for _ in range(cfg.num_hidden_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(blocks, device=self.device, dtype=torch.int32).unsqueeze(0),
            seq_lens=torch.tensor([num_tokens], device=self.device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, num_tokens], device=self.device, dtype=torch.int32),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta, caches)
        logits = self.model.compute_logits(hidden[:num_seqs])
        torch.softmax(logits, dim=-1).sort(dim=-1)
        torch.cuda.synchronize(self.device)
        del caches, hidden, logits, meta
        free, total = torch.cuda.mem_get_info(self.device)
        # gpu_memory_utilization is this engine's share of the GPU (as vLLM's): what it took since it began
        # loading counts, not what other processes (models sharing the GPU) hold; never more than is free
        used = total - free if self.baseline_free is None else max(0, self.baseline_free - free)
        peak, current = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        budget = int(min(total * self.config.gpu_memory_utilization - used, free - FREE_MARGIN_BYTES) - peak + current)
        if budget < self.bytes_per_block:
            raise ValueError(
                "gpu_memory_utilization: no memory left for the KV cache after loading the model "
                f"({used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
            )
        return budget // self.bytes_per_block

    def token_path(self, batch: ScheduledBatch, deferred: bool) -> TokenPath:
        """How this batch's tokens come out of its forward pass; deferred: the engine may read them a step late
        (async scheduling), which a step returning logprobs does not."""
        seqs = _caught_up(batch)
        if deferred and self.picks_greedy_on_shards(batch.seqs):
            return TokenPath.GREEDY_ON_SHARDS
        if deferred and seqs and all(seq.logprobs is None for seq in seqs):
            return TokenPath.DEFERRED
        if any(seq.spec_token_ids for seq in seqs):
            return TokenPath.SPECULATIVE
        return TokenPath.SAMPLED

    def execute(self, batch: ScheduledBatch, previous: DeferredTokens | None, deferred: bool) -> LaunchedStep:
        """Launches the batch's forward pass for its token path; pending input tokens are read from `previous`,
        the step still in flight. sample_tokens gives its tokens."""
        path = self.token_path(batch, deferred)
        if path is TokenPath.GREEDY_ON_SHARDS:
            tokens = self.forward_greedy(batch, previous)
            return LaunchedStep(path, tokens.seqs, tokens=tokens)
        logits, seqs = self.forward_logits(batch, previous)
        return LaunchedStep(path, seqs, logits=logits)

    @torch.inference_mode()
    def sample_tokens(self, step: LaunchedStep) -> DeferredTokens | list[SampledToken]:
        """The launched step's next tokens: on the device, for the host to read a step later, or read now (one per
        sequence, or for one that speculates its kept drafts and one more). Penalties and min_tokens read each
        sequence's tokens, so the tokens of the step before must be in place."""
        if step.path is TokenPath.GREEDY_ON_SHARDS:
            return step.tokens
        if step.path is TokenPath.DEFERRED:
            logits = self._constrained(step.logits, step.seqs)
            tokens = self.sampler.token_tensor(logits, self._sampling_rows(step.seqs),
                                               self.token_masker.for_step(step.seqs, deferred=True))
            deferred = DeferredTokens(tokens, step.seqs)
            self.token_masker.start_ahead(deferred)  # the next step's masks, in a worker, once these reach the host
            return deferred
        if step.path is TokenPath.SPECULATIVE:
            return self._verify_drafts(step.logits, step.seqs)
        return self._sample(step.logits, step.seqs)

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch, previous: DeferredTokens | None = None
                       ) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs the batch; returns logits for the sequences whose tokens are all computed now: one row each, and
        before it one per draft token of a sequence that speculates (its last token's row, then its drafts').
        Pending input tokens are read from `previous`, the step still in flight."""
        return self._forward(batch, previous, greedy_tokens=False)

    @torch.inference_mode()
    def forward_greedy(self, batch: ScheduledBatch, previous: DeferredTokens | None = None) -> DeferredTokens:
        """The greedy-on-shards path: the tokens come from each rank's vocabulary shard (no logits are gathered) and
        every rank holds them, so the next step's pending inputs are not broadcast."""
        tokens, sampled_seqs = self._forward(batch, previous, greedy_tokens=True)
        return DeferredTokens(tokens, sampled_seqs)

    def picks_greedy_on_shards(self, seqs: list[Sequence]) -> bool:
        """Whether forward_greedy serves these sequences: tensor parallelism (with one rank the logits are not
        gathered anyway) with config.tp_greedy_on_shards and, for each, the plain argmax of its logits: greedy, no
        penalties, no logprobs, no draft tokens, no tokens banned short of min_tokens, no grammar, no logit_bias."""
        if self.tp.size == 1 or not self.config.tp_greedy_on_shards:
            return False
        return all(
            seq.params.temperature == 0.0 and not _uses_penalties(seq.params) and seq.params.logprobs is None
            and not seq.spec_token_ids and seq.num_output_tokens >= seq.params.min_tokens and seq.grammar is None
            and not seq.params.logit_bias
            for seq in seqs
        )

    def _forward(self, batch: ScheduledBatch, previous: DeferredTokens | None, greedy_tokens: bool
                 ) -> tuple[torch.Tensor, list[Sequence]]:
        host = host_inputs(batch, self.block_size, previous.num_rows if previous is not None else 0, greedy_tokens)
        if self.lora is not None:
            host.lora_slots = self.lora.begin_step(batch.seqs, batch.num_new_tokens)
        out = self.run_model(host, previous.device_ids if previous is not None else None)
        return out, _caught_up(batch)

    @torch.inference_mode()
    def run_model(self, host: HostInputs, previous_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The forward pass every tensor-parallel rank runs; rank 0 first sends the step to the others. Returns the
        logits, or for a greedy_tokens step the argmax tokens (which every rank keeps for the next step)."""
        if self.tp.size > 1:
            if self.tp.is_driver:
                send_step(self.tp, host)
            previous_ids = share_previous_tokens(self.tp, host, previous_ids, self.device, self.picked_tokens)
        self.picked_tokens = None
        logits_indices = host.logits_indices
        graphs = self._graphs_for(host)
        if graphs is not None:
            hidden = graphs.run(host, previous_ids)
        else:
            inputs = device_inputs(host, self.device, previous_ids)
            if self.lora is not None:
                self.lora.set_indices(host.lora_slots, host.num_tokens == host.num_seqs)
            try:
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
            finally:
                if self.lora is not None:
                    self.lora.set_indices(None, False)
        if not logits_indices:
            if host.greedy_tokens:
                return torch.empty(0, dtype=torch.int64, device=self.device)
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        if len(logits_indices) < hidden.shape[0]:
            hidden = hidden.index_select(0, to_device(logits_indices, torch.int64, self.device))
        if host.greedy_tokens:
            self.picked_tokens = self.model.compute_greedy_tokens(hidden)
            return self.picked_tokens
        return self.model.compute_logits(hidden)

    def _graphs_for(self, host: HostInputs) -> DecodeGraphs | None:
        """The captured graphs that replay this step: with the adapters' kernels when a token uses an adapter (decode
        steps only), else without; None: it runs eagerly."""
        candidates = (self.graphs, self.verify_graphs) if host.lora_slots is None else (self.lora_graphs,)
        return next((g for g in candidates
                     if g is not None and g.fits(host.num_seqs, host.num_tokens, host.max_query_len)), None)

    def serve_steps(self) -> None:
        """The loop of a rank other than 0: run each step rank 0 sends until it says stop."""
        while (host := receive_step(self.tp)) is not None:
            self.run_model(host)

    def stop_workers(self) -> None:
        if self.tp.size > 1 and self.tp.is_driver:
            send_step(self.tp, None)
        self.release_graphs()

    def release_graphs(self) -> None:
        """Graphs that captured NCCL calls must be freed before the process group is torn down, or
        ncclCommDestroy waits forever (pytorch/pytorch#115388)."""
        if self.graphs is not None or self.lora_graphs is not None or self.verify_graphs is not None:
            self.graphs = self.lora_graphs = self.verify_graphs = None
            torch.cuda.synchronize(self.device)
            gc.collect()

    def _verify_drafts(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        last_rows = np.cumsum([1 + len(seq.spec_token_ids) for seq in seqs]) - 1
        plain = [i for i, seq in enumerate(seqs) if not seq.spec_token_ids]
        drafted = [i for i, seq in enumerate(seqs) if seq.spec_token_ids]
        out: list[list[SampledToken]] = [[] for _ in seqs]
        if plain:
            rows = torch.tensor(last_rows[plain], device=logits.device)
            for i, item in zip(plain, self._sample(logits[rows], [seqs[i] for i in plain])):
                out[i].append(item)
        kept = rejection_sample(
            logits,
            [int(last_rows[i]) - len(seqs[i].spec_token_ids) for i in drafted],
            [seqs[i].spec_token_ids for i in drafted],
            [seqs[i].spec_draft_probs for i in drafted],
            [seqs[i].params for i in drafted],
            [seqs[i].generator for i in drafted],
        )
        for i, tokens in zip(drafted, kept):
            out[i] = [SampledToken(seqs[i], token, None) for token in tokens]
        return [item for items in out for item in items]

    @staticmethod
    def _sampling_rows(seqs: list[Sequence]) -> list[SamplingRow]:
        return [
            SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator)
            if _uses_penalties(seq.params) else SamplingRow(seq.params, (), (), seq.generator)
            for seq in seqs
        ]

    def _constrained(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Bans end-of-sequence and stop tokens (in place) for sequences short of their min_tokens."""
        banned = {
            i: self.eos_token_ids | frozenset(seq.params.stop_token_ids)
            for i, seq in enumerate(seqs)
            if seq.num_output_tokens < seq.params.min_tokens
        }
        if banned:
            suppress_tokens(logits, banned)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        if not seqs:
            return []
        out = self.sampler(self._constrained(logits, seqs), self._sampling_rows(seqs),
                           self.token_masker.for_step(seqs))
        logprobs = out.logprobs or [None] * len(seqs)
        return [SampledToken(seq, tok, lp) for seq, tok, lp in zip(seqs, out.token_ids, logprobs)]


def _caught_up(batch: ScheduledBatch) -> list[Sequence]:
    """The batch's sequences whose tokens are all computed once it has run: those that get a next token."""
    return [seq for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_computed_tokens + n >= seq.num_tokens]


def _uses_penalties(params) -> bool:
    """Only penalties read a sequence's earlier tokens; other rows skip building those lists."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)
