"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed over static buffers.

A decode step launches a few hundred small kernels; replaying a captured graph removes their launch
gaps. Rows past the real batch write nowhere (slot -1) and their outputs are ignored. The decode
attention kernel splits the context by the block table's width, which a graph fixes: small batches
get one graph per context bucket (256, 512, ... tokens, then max_model_len), so a short context runs
one split instead of the many a 4k-wide table asks for, and skips the combining kernel.

The same class captures speculative verify steps: every sequence brings the same q = k + 1 tokens
(its last token and k drafts), which go through the prefill attention kernel; that kernel's launch
depends only on the token and sequence counts, so one graph per batch size serves those steps too."""

from __future__ import annotations

import logging

import torch

from engine.models.attention_metadata import AttentionMetadata
from engine.models.llama import LlamaForCausalLM

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
    ) -> None:
        self.model = model
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
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch size, table width)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

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

    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            for width in reversed(self.widths(bs)):
                meta = self._meta(bs, width)
                args = (self.input_ids[: bs * self.q], self.positions[: bs * self.q], meta, self.kv_caches)
                self.model(*args)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bs, width] = self.model(*args)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs, width] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for steps of %d token(s) per sequence, batch sizes %s, context buckets %s "
                 "(blocks, batches <= %d)", self.q, self.sizes, self.buckets, BUCKETED_MAX_BATCH)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        n = seq_lens.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        width = next(w for w in self.widths(bs) if w * self.block_size >= max_seq_len and w >= block_tables.shape[1])
        tokens, padded = n * self.q, bs * self.q
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(slot_mapping)
        self.slot_mapping[tokens:padded].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(self.q)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs, width].replay()
        return self.outputs[bs, width][:tokens]
