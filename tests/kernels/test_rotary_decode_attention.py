"""Decode attention that rotates q and stores the new tokens' k and v itself (kernels/flash_decode.py,
rotary_decode_attention) against the two kernels it replaces (kernels/rotary_store.py, then decode_attention) and
against the PyTorch references, for plain, int8 and fp8 caches, one or several splits, strided q / k / v views of
one qkv row, a sequence whose slot is skipped, and a slot poisoned beforehand so that a missing store shows."""

import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, random_paged_kv, rel_err, tolerance

pytest.importorskip("triton")
from kernels.flash_decode import DecodeConfig, decode_attention, rotary_decode_attention  # noqa: E402
from kernels.rotary_store import rotary_kv_store  # noqa: E402

CASES = [  # (sequence lengths, KV heads, query heads per KV head, head dim, block size, splits)
    ([1, 17, 45], 2, 2, 32, 16, None),
    ([33, 9], 2, 4, 16, 8, 3),
    ([20, 5, 31], 1, 3, 64, 16, 2),
    ([70], 2, 2, 32, 16, 1),
]
CACHE_DTYPES = {"same": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _new_tokens(seq_lens, heads, kv_heads, head_dim, dtype, device, max_position=96):
    gen = torch.Generator(device=device).manual_seed(len(seq_lens) * 31 + head_dim)
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * head_dim, device=device, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    angles = torch.rand(max_position, head_dim // 2, device=device, generator=gen) * 6.28
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    positions = torch.tensor([n - 1 for n in seq_lens], device=device)
    return (*(t.view(len(seq_lens), -1, head_dim) for t in (q, k, v)), positions, cos_sin)


def _caches(seq_lens, kv_heads, head_dim, block_size, cache, dtype, device):
    kv = random_paged_kv(seq_lens, kv_heads, head_dim, block_size, torch.float32, device)
    tables = kv.block_tables.long()
    last = torch.tensor([n - 1 for n in seq_lens], device=device)
    slots = tables[torch.arange(len(seq_lens), device=device), last // block_size] * block_size + last % block_size
    blocks, offsets = slots // block_size, slots % block_size
    for c in (kv.k_cache, kv.v_cache):  # the new token's slot holds garbage until a kernel writes it
        c[blocks, offsets] = 1e4
    scales = None
    if cache == "same":
        caches = kv.k_cache.to(dtype), kv.v_cache.to(dtype)
    else:
        scales = torch.rand(2, kv_heads, device=device) * 0.02 + 0.01
        caches = tuple(reference.quantize_kv(c, s, CACHE_DTYPES[cache]) for c, s in zip((kv.k_cache, kv.v_cache),
                                                                                         scales))
    return kv, caches, slots, scales


def _copies(caches):
    return tuple(c.clone() for c in caches)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize(("seq_lens", "kv_heads", "group", "head_dim", "block_size", "splits"), CASES)
def test_rotary_decode_attention_equals_the_separate_kernels(device, cache, seq_lens, kv_heads, group, head_dim,
                                                             block_size, splits):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, positions, cos_sin = _new_tokens(seq_lens, kv_heads * group, kv_heads, head_dim, dtype, device)
    kv, caches, slots, scales = _caches(seq_lens, kv_heads, head_dim, block_size, cache, dtype, device)
    config = DecodeConfig(block_n=16, num_splits=splits)
    scale = head_dim**-0.5
    fused_k, fused_v = _copies(caches)
    with poisoned_outputs():
        out = rotary_decode_attention(positions, q, k, v, cos_sin, fused_k, fused_v, slots, kv.block_tables,
                                      kv.seq_lens, scale, scales, config=config)
    split_k, split_v = _copies(caches)
    q_rot = rotary_kv_store(positions, q, k, v, cos_sin, split_k, split_v, slots, scales)
    split = decode_attention(q_rot, split_k, split_v, kv.block_tables, kv.seq_lens, scale, scales, config=config)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, split) < tolerance(dtype)
    # the same rotation, but the compiler may contract its multiply-adds differently: one rounding step at most
    step = 0.0 if cache == "same" else 0.07
    assert rel_err(fused_k.float(), split_k.float()) < tolerance(dtype) + step
    assert torch.equal(fused_v.float(), split_v.float())

    ref_k, ref_v = _copies(caches)
    q_ref = reference.rotary_kv_store(positions, q, k, v, cos_sin, ref_k, ref_v, slots, scales)
    ref = reference.decode_attention(q_ref, ref_k, ref_v, kv.block_tables, kv.seq_lens, scale, scales)
    assert rel_err(out, ref) < tolerance(dtype) + 2 * step


def test_a_skipped_slot_is_not_written(device):
    seq_lens = [12, 30]
    q, k, v, positions, cos_sin = _new_tokens(seq_lens, 4, 2, 16, torch.float32, device)
    kv, (k_cache, v_cache), slots, _ = _caches(seq_lens, 2, 16, 8, "same", torch.float32, device)
    before = k_cache.clone(), v_cache.clone()
    slots[0] = -1
    out = rotary_decode_attention(positions, q, k, v, cos_sin, k_cache, v_cache, slots, kv.block_tables, kv.seq_lens,
                                  0.25, config=DecodeConfig(block_n=16, num_splits=2))
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=device)
    written[slots[1] // 8, slots[1] % 8] = True
    assert torch.equal(k_cache[~written], before[0][~written]) and torch.equal(v_cache[~written], before[1][~written])
    assert not torch.equal(k_cache[written], before[0][written])
    assert out[0].abs().max() > 100  # sequence 0 read its slot's old garbage, as the separate kernels would
    assert out[1].abs().max() < 100


def test_rotary_decode_attention_rejects_bad_inputs(device):
    seq_lens = [5, 9]
    q, k, v, positions, cos_sin = _new_tokens(seq_lens, 4, 2, 16, torch.float32, device)
    kv, (k_cache, v_cache), slots, _ = _caches(seq_lens, 2, 16, 8, "same", torch.float32, device)
    args = (kv.block_tables, kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_decode_attention(positions, q, k, v, cos_sin[:, :8], k_cache, v_cache, slots, *args)
    with pytest.raises(ValueError, match="one row per sequence"):
        rotary_decode_attention(positions[:1], q, k, v, cos_sin, k_cache, v_cache, slots, *args)
    with pytest.raises(ValueError, match="caches"):
        rotary_decode_attention(positions, q, k, v[:, :1], cos_sin, k_cache, v_cache, slots, *args)
    q24, k24, v24, _, cos24 = _new_tokens(seq_lens, 4, 2, 24, torch.float32, device)
    with pytest.raises(ValueError, match="head_dim 24"):
        rotary_decode_attention(positions, q24, k24, v24, cos24, k_cache, v_cache, slots, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize(("seq_lens", "heads", "kv_heads"), [
    ([384], 32, 8), ([384], 16, 4), ([1], 32, 8), ([700, 5, 2048, 129], 32, 8),
    ([700, 5, 2048, 129, 1, 64, 300, 17], 32, 8),  # past 4 sequences: the batched launch configuration
])
def test_rotary_decode_attention_gpu_llama_shapes(cache, seq_lens, heads, kv_heads):
    """bf16 at Llama-3-8B's shapes (and a tensor-parallel rank's half), the splits chosen from the shapes as the
    engine launches it, replayed in a CUDA graph with new inputs."""
    device, dtype, head_dim, block_size = torch.device("cuda"), torch.bfloat16, 128, 16
    q, k, v, positions, cos_sin = _new_tokens(seq_lens, heads, kv_heads, head_dim, dtype, device,
                                              max_position=4096)
    kv, caches, slots, scales = _caches(seq_lens, kv_heads, head_dim, block_size, cache, dtype, device)
    fused_k, fused_v = _copies(caches)
    args = (kv.block_tables, kv.seq_lens, head_dim**-0.5, scales)
    rotary_decode_attention(positions, q, k, v, cos_sin, fused_k, fused_v, slots, *args)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotary_decode_attention(positions, q, k, v, cos_sin, fused_k, fused_v, slots, *args)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    split_k, split_v = _copies(caches)
    q_rot = rotary_kv_store(positions, q, k, v, cos_sin, split_k, split_v, slots, scales)
    split = decode_attention(q_rot, split_k, split_v, *args)
    assert rel_err(out, split) < tolerance(dtype)
    step = 0.0 if cache == "same" else 0.07
    assert rel_err(fused_k.float(), split_k.float()) < tolerance(dtype) + step
    assert torch.equal(fused_v.float(), split_v.float())
    ref_k, ref_v = _copies(caches)
    q_ref = reference.rotary_kv_store(positions, q.float(), k.float(), v.float(), cos_sin.float(), ref_k, ref_v, slots,
                                      scales)
    ref = reference.decode_attention(q_ref, ref_k.float() if cache == "same" else ref_k, ref_v.float()
                                     if cache == "same" else ref_v, *args)
    assert rel_err(out, ref) < tolerance(dtype) + 2 * step
