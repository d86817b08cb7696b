"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed over static buffers.

A decode step launches a few hundred small kernels; replaying a captured graph removes their launch
gaps. The block-table buffer is as wide as max_model_len needs, so a graph serves any context length;
rows past the real batch write nowhere (slot -1) and their outputs are ignored.

The same class captures speculative verify steps: every sequence brings the same q = k + 1 tokens
(its last token and k drafts), which go through the prefill attention kernel; that kernel's launch
depends only on the token and sequence counts, so one graph per batch size serves those steps too."""

from __future__ import annotations

import logging

import torch

from engine.models.attention_metadata import AttentionMetadata
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


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
        max_bs = self.sizes[-1]
        max_tokens = max_bs * self.q
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        # padding rows see a context of exactly their q tokens, all in block 0 of their (zero) table row
        self.seq_lens = torch.full((max_bs,), self.q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (max_bs + 1) * self.q, self.q, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, num_tokens: int, max_query_len: int) -> bool:
        """Whether a step is one of this set's shape: at most max_batch_size sequences of q tokens each."""
        return num_seqs <= self.max_batch_size and max_query_len == self.q and num_tokens == num_seqs * self.q

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * self.q],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=self.q,
            max_seq_len=self.block_tables.shape[1],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._meta(bs)
            args = (self.input_ids[: bs * self.q], self.positions[: bs * self.q], meta, self.kv_caches)
            self.model(*args)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for steps of %d token(s) per sequence, batch sizes %s", self.q, self.sizes)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        n = seq_lens.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        tokens, padded = n * self.q, bs * self.q
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(slot_mapping)
        self.slot_mapping[tokens:padded].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(self.q)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs][:tokens]
