"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed over static buffers, each captured
the first time a step of its shape runs.

A decode step launches a few hundred small kernels; replaying a captured graph removes their launch
gaps. Rows past the real batch write nowhere (slot -1) and their outputs are ignored. The decode
attention kernel splits the context by the block table's width, which a graph fixes: small batches
get one graph per context bucket (256, 512, ... tokens, then max_model_len), so a short context runs
one split instead of the many a 4k-wide table asks for, and skips the combining kernel.

Each graph begins with a kernel that unpacks the step's inputs from one buffer the host copies in
(kernels/step_inputs.py), so a replay is one host-to-device copy and the graph.

Decode steps in which some sequence uses a LoRA adapter replay a second set, captured with the adapters' kernels in
it (`lora`: they read each token's slot from a static buffer, engine/lora/graph_slots.py), sharing the first set's
memory pool; base-only steps keep the graphs without those kernels. That set keys its graphs by the LoRA kernels'
form too (per token, grouped by slot, or dense: engine/lora/batch.py decode_form): a step of one shape replays the graph of its form,
each captured the first time a step of that shape and form runs.

The same class captures speculative verify steps: every sequence brings the same q = k + 1 tokens
(its last token and k drafts), which go through the prefill attention kernel; that kernel's launch
depends only on the token and sequence counts, so one graph per batch size serves those steps too.

Capturing every shape up front took 1.5-2 s of an 8B model's start and of every wake from sleep (the graphs point
at the KV pool and the weights, which a wake puts at new addresses), all before the first token; a prefill needs no
graph, so capturing on first use keeps that time off the first token and spends it only on the shapes that run.
All graphs share one memory pool: a step replays one graph and reads its output before the next replays."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from engine.batch_inputs import HostInputs, graph_staging
from engine.lora.graph_slots import GraphLoRASlots
from engine.models.attention_metadata import AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from kernels.formats import step_tables_offset

log = logging.getLogger(__name__)


# batches up to this size get a graph per context bucket; larger ones have enough programs per split anyway
BUCKETED_MAX_BATCH = 8
SHORTEST_BUCKET_TOKENS = 256


def context_buckets(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths (in blocks) to capture at: 256 tokens, doubling, then the full width."""
    widths, tokens = [], SHORTEST_BUCKET_TOKENS
    while tokens < max_blocks * block_size:
        widths.append(-(-tokens // block_size))
        tokens *= 2
    return widths + [max_blocks]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        tokens_per_seq: int = 1,
        lora: GraphLoRASlots | None = None,
        pool: tuple | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.q = tokens_per_seq
        self.block_size = kv_caches[0][0].shape[1]
        # verify steps (q > 1) use the prefill kernel, whose launch does not depend on the table's width
        self.buckets = context_buckets(max_blocks_per_seq, self.block_size) if self.q == 1 else [max_blocks_per_seq]
        max_bs = self.sizes[-1]
        max_tokens = max_bs * self.q
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        # padding rows see a context of exactly their q tokens, all in block 0 of their (zero) table row
        self.seq_lens = torch.full((max_bs,), self.q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (max_bs + 1) * self.q, self.q, dtype=torch.int32, device=device)
        table_words = step_tables_offset(max_bs, self.q) + max_bs * max_blocks_per_seq  # int32
        self.staging = torch.zeros(-(-table_words // 2), dtype=torch.int64, device=device)  # n = 0: all padding
        # (batch size, table width), and with LoRA the decode form of its kernels
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.pool = pool
        self.before_capture: Callable[[], None] | None = None  # runs before a capture waits for the device
        self.num_replays = 0

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, num_tokens: int, max_query_len: int) -> bool:
        """Whether a step is one of this set's shape: at most max_batch_size sequences of q tokens each."""
        return num_seqs <= self.max_batch_size and max_query_len == self.q and num_tokens == num_seqs * self.q

    def widths(self, bs: int) -> list[int]:
        return self.buckets if bs <= BUCKETED_MAX_BATCH else self.buckets[-1:]

    def _meta(self, bs: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * self.q],
            block_tables=self.block_tables[:bs, :width],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=self.q,
            max_seq_len=width * self.block_size,
        )

    def _forward(self, bs: int, width: int, lora_form: str = "bgmv") -> torch.Tensor:
        from kernels.step_inputs import unpack_step_inputs

        unpack_step_inputs(self.staging, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                           self.block_tables, bs, self.q)
        with self.lora.applied(bs * self.q, lora_form) if self.lora is not None else contextlib.nullcontext():
            return self.model(self.input_ids[: bs * self.q], self.positions[: bs * self.q], self._meta(bs, width),
                              self.kv_caches)

    def key(self, host: HostInputs) -> tuple:
        """(batch size, table width) of the graph that runs a step that fits; with LoRA, then the decode form of its
        LoRA kernels."""
        bs = next(s for s in self.sizes if s >= host.num_seqs)
        width = next(w for w in self.widths(bs)
                     if w * self.block_size >= host.max_seq_len and w >= host.block_tables.shape[1])
        if self.lora is not None:
            return bs, width, self.lora.form(host.lora_slots)
        return bs, width

    @torch.inference_mode()
    def capture(self, bs: int, width: int, lora_form: str = "bgmv") -> None:
        """Captures the graph of one shape (and LoRA kernel form). Its warm-up pass runs eagerly over an all-padding
        step (the staging buffer zeroed: no sequences; no adapter on any row), so it writes no KV slot whatever the
        buffers held before, and the grouped LoRA kernels see only this graph's rows (an earlier, larger step's
        grouping would point past them)."""
        started = time.perf_counter()
        key = (bs, width, lora_form) if self.lora is not None else (bs, width)
        self.staging.zero_()
        if self.lora is not None:
            self.lora.stage(None, bs * self.q)  # the warm-up's rows: no adapter
        self._forward(bs, width, lora_form)  # warm-up: Triton compiles and autotunes outside the capture
        if self.before_capture is not None:
            self.before_capture()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (a tokenizer, an adapter load) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[key] = self._forward(bs, width, lora_form)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        kind = "" if self.lora is None else f" with the {lora_form} LoRA kernels"
        log.debug("captured the CUDA graph of %d sequence(s) x %d token(s), %d blocks wide%s, in %.0f ms", bs, self.q,
                  width, kind, 1000 * (time.perf_counter() - started))

    def run(self, host: HostInputs, previous_ids: torch.Tensor | None) -> torch.Tensor:
        """Replays the graph for a step that fits: copies the staged step into the graph's buffer (pending input
        tokens are read from previous_ids) and returns the hidden states of its tokens."""
        key = self.key(host)
        if key not in self.graphs:
            self.capture(*key)
        staged = graph_staging(host, previous_ids)
        self.staging.view(torch.uint8)[: staged.numel()].copy_(staged, non_blocking=True)
        if self.lora is not None:
            self.lora.stage(host.lora_slots, key[0] * self.q)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][: host.num_tokens]
