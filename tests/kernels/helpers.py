"""Shared helpers for the kernel tests: random paged caches, error measures, NaN-poisoned outputs, CUDA graph
replays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kernels.kv_layout import new_kv_cache


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 2e-2


def replayed_in_a_graph(step: Callable[[], torch.Tensor], new_inputs: Callable[[], None]) -> torch.Tensor:
    """step's output from a replay of the CUDA graph it was captured in (after one eager run), its inputs changed by
    new_inputs() after the capture."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new_inputs()
    graph.replay()
    torch.cuda.synchronize()
    return out


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Makes torch.empty / torch.empty_like return NaN-filled floating tensors (and -7 for integers),
    so an output element the kernel never writes shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    def poisoned_empty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return poison(empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, G, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled block ids, -1 past each sequence's pages
    seq_lens: torch.Tensor  # [B] int32


def random_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    spare_blocks: int = 3,
    spare_columns: int = 1,
    head_major: bool = True,
) -> PagedKV:
    """A paged cache holding len(seq_lens) sequences in randomly permuted blocks, plus unused blocks
    filled with huge values so that reading a wrong page spoils the result. head_major=False stores it
    contiguously as [num_blocks, block_size, G, D] instead of the engine's layout."""
    pages = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    width = max(pages, default=0) + spare_columns
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Drawn where the kernels run: a GPU-sized cache filled on the CPU takes seconds.
    if head_major:  # the engine's layout (kernels/kv_layout.py)
        k_cache = new_kv_cache(*shape, torch.float32, device).normal_()
        v_cache = new_kv_cache(*shape, torch.float32, device).normal_()
    else:
        k_cache = torch.randn(shape, dtype=torch.float32, device=device)
        v_cache = torch.randn(shape, dtype=torch.float32, device=device)
    unused = perm[used:].long().to(device)
    k_cache[unused] = 1e4
    v_cache[unused] = 1e4
    for i, n in enumerate(seq_lens):
        if n % block_size:
            last = int(tables[i, pages[i] - 1])
            k_cache[last, n % block_size :] = 1e4
            v_cache[last, n % block_size :] = 1e4
    return PagedKV(
        k_cache.to(dtype),
        v_cache.to(dtype),
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
