"""How a KV cache tensor is laid out in memory.

Every kernel and reference op indexes a cache as [num_blocks, block_size, num_kv_heads, head_dim]
through its strides. The storage under that view is head-major within a block
([num_blocks, num_kv_heads, block_size, head_dim]): one KV head's page is a single contiguous run of
block_size * head_dim values, which the decode kernel streams faster than block_size runs of head_dim
values interleaved with the other heads (measured on an H200 in BENCHMARKS.md).

A quantized cache (int8 or float8_e4m3fn pages) comes with kv_scales [2, G] float32: the K and V scale of each KV
head; a stored value times its head's scale is the key or value.
"""

from __future__ import annotations

import torch


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed cache, viewed as [num_blocks, block_size, num_kv_heads, head_dim] over head-major storage."""
    storage = torch.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
    return storage.transpose(1, 2)


QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_kv_scales(cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor | None:
    """kv_scales when the cache is quantized (then they are required), else None."""
    if cache.dtype not in QUANTIZED_KV_DTYPES:
        return None
    if kv_scales is None or kv_scales.shape != (2, cache.shape[2]):
        raise ValueError(f"kv_scales: a {cache.dtype} KV cache needs scales of shape (2, {cache.shape[2]})")
    return kv_scales
