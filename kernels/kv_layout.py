"""How a KV cache tensor is laid out in memory.

Every kernel and reference op indexes a cache as [num_blocks, block_size, num_kv_heads, head_dim]
through its strides. The storage under that view is head-major within a block
([num_blocks, num_kv_heads, block_size, head_dim]): one KV head's page is a single contiguous run of
block_size * head_dim values, which the decode kernel streams faster than block_size runs of head_dim
values interleaved with the other heads (measured on an H200 in BENCHMARKS.md).
"""

from __future__ import annotations

import torch


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed cache, viewed as [num_blocks, block_size, num_kv_heads, head_dim] over head-major storage."""
    storage = torch.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
    return storage.transpose(1, 2)
