"""Rotary embedding fused with the KV-cache store (kernels/rotary_store.py) against the two separate kernels it
replaces (bit for bit) and against the PyTorch references (rotary then store), for plain, int8 and fp8 caches,
GQA head counts that are not powers of two, a head dim whose half is not one, skipped slots, strided q / k / v
views of one fused qkv row, and the engine's head-major cache layout."""

import pytest
import torch

from kernels import reference
from kernels.kv_layout import new_kv_cache
from tests.kernels.helpers import rel_err, tolerance

pytest.importorskip("triton")
from kernels.cache_ops import store_kv_cache  # noqa: E402
from kernels.rotary import rotary_embedding  # noqa: E402
from kernels.rotary_store import rotary_kv_store  # noqa: E402

CASES = [  # (query heads, KV heads, head dim, block size, tokens)
    (4, 2, 16, 8, 11),
    (6, 3, 40, 5, 7),
    (32, 8, 128, 16, 3),
]


def _inputs(device, dtype, heads, kv_heads, head_dim, tokens, max_position=64):
    gen = torch.Generator(device=device).manual_seed(heads + head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    views = [t.view(tokens, -1, head_dim) for t in (q, k, v)]  # strided views, as the model passes them
    positions = torch.randint(0, max_position, (tokens,), device=device, generator=gen)
    angles = torch.rand(max_position, head_dim // 2, device=device, generator=gen) * 6.28
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    return positions, *views, cos_sin


def _caches(device, cache_dtype, kv_heads, head_dim, block_size, num_blocks=6):
    return [new_kv_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, device) for _ in range(4)]


@pytest.mark.parametrize("cache", ["same", "int8", "fp8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "tokens"), CASES)
def test_rotary_kv_store_equals_the_separate_kernels(device, cache, heads, kv_heads, head_dim, block_size, tokens):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    positions, q, k, v, cos_sin = _inputs(device, dtype, heads, kv_heads, head_dim, tokens)
    cache_dtype = {"same": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[cache]
    scales = None if cache == "same" else torch.rand(2, kv_heads, device=device) * 0.02 + 0.01
    slots = torch.randperm(6 * block_size, device=device)[:tokens]
    slots[1] = -1
    fused_k, fused_v, split_k, split_v = _caches(device, cache_dtype, kv_heads, head_dim, block_size)

    q_fused = rotary_kv_store(positions, q, k, v, cos_sin, fused_k, fused_v, slots, scales)
    q_split, k_split = rotary_embedding(positions, q, k, cos_sin)
    store_kv_cache(k_split, v, split_k, split_v, slots, scales)
    assert torch.equal(q_fused, q_split)
    assert torch.equal(fused_k.float(), split_k.float()) and torch.equal(fused_v.float(), split_v.float())

    ref_k, ref_v = _caches(device, cache_dtype, kv_heads, head_dim, block_size)[:2]
    q_ref = reference.rotary_kv_store(positions, q, k, v, cos_sin, ref_k, ref_v, slots, scales)
    assert rel_err(q_fused, q_ref) < tolerance(dtype)
    # rounding the rotated k may land one quantization step apart from the reference on a few elements
    step = 1.0 if scales is None else 0.07
    assert rel_err(fused_k.float(), ref_k.float()) < tolerance(dtype) + step * (cache != "same")
    assert torch.equal(fused_v.float(), ref_v.float())


def test_rotary_kv_store_rejects_bad_inputs(device):
    positions, q, k, v, cos_sin = _inputs(device, torch.float32, 4, 2, 16, 3)
    k_cache, v_cache = _caches(device, torch.float32, 2, 16, 8)[:2]
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_kv_store(positions, q, k, v, cos_sin[:, :8], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches"):
        rotary_kv_store(positions, q, k, v[:, :1], cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="kv_scales"):
        int8 = _caches(device, torch.int8, 2, 16, 8)
        rotary_kv_store(positions, q, k, v, cos_sin, int8[0], int8[1], slots)
    with pytest.raises(ValueError, match="layout"):
        rotary_kv_store(positions, q, k, v, cos_sin, k_cache, torch.zeros_like(k_cache.contiguous()), slots)
    assert rotary_kv_store(positions[:0], q[:0], k[:0], v[:0], cos_sin, k_cache, v_cache, slots[:0]).shape == (0, 4, 16)
