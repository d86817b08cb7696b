"""fp8 / int8 KV caches: the store kernel quantizes exactly as the reference, the decode and prefill
kernels read quantized pages as the reference does, and the reference equals float attention over the
dequantized cache."""

import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, random_paged_kv, rel_err, tolerance

pytest.importorskip("triton")
from kernels.cache_ops import store_kv_cache  # noqa: E402
from kernels.flash_decode import DecodeConfig, decode_attention  # noqa: E402
from kernels.prefill_attention import PrefillConfig, paged_attention  # noqa: E402

KV_DTYPES = [torch.float8_e4m3fn, torch.int8]


def quantized_kv(kv, scales: torch.Tensor, dtype: torch.dtype):
    return reference.quantize_kv(kv.k_cache, scales[0], dtype), reference.quantize_kv(kv.v_cache, scales[1], dtype)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_store_quantizes_like_the_reference(device: torch.device, dtype: torch.dtype) -> None:
    tokens, heads, head_dim, block_size, blocks = 29, 3, 24, 8, 9
    key = torch.randn(tokens, heads, head_dim, device=device) * torch.tensor([0.01, 1.0, 40.0], device=device)[:, None]
    value = torch.randn(tokens, heads, head_dim, device=device)
    # fp8 ties, subnormals, and a value past the range (saturates, never NaN)
    key[0, 0, :5] = torch.tensor([2**-7 * 1.5, 2**-10 * 3, 2**-8 * 2.5, 1e-6, 9.0], device=device)
    scales = torch.tensor([[0.001, 0.05, 0.2], [0.01, 0.02, 0.03]], device=device)
    slots = torch.randperm(blocks * block_size, device=device)[:tokens]
    slots[[3, 17]] = -1
    caches = [torch.zeros(blocks, block_size, heads, head_dim, dtype=dtype, device=device) for _ in range(4)]
    store_kv_cache(key, value, caches[0], caches[1], slots, scales)
    reference.store_kv_cache(key, value, caches[2], caches[3], slots, scales)
    assert torch.equal(caches[0].float(), caches[2].float()) and torch.equal(caches[1].float(), caches[3].float())
    assert not caches[0].float().isnan().any()
    assert caches[0].float().abs().max() == (448.0 if dtype == torch.float8_e4m3fn else 127.0)


def test_quantized_cache_needs_scales(device: torch.device) -> None:
    cache = torch.zeros(2, 8, 2, 16, dtype=torch.int8, device=device)
    key = torch.randn(1, 2, 16, device=device)
    with pytest.raises(ValueError, match="kv_scales"):
        store_kv_cache(key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="kv_scales"):
        reference.decode_attention(torch.randn(1, 4, 16), cache.cpu(), cache.cpu(),
                                   torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.25)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_reference_reads_the_dequantized_cache(dtype: torch.dtype) -> None:
    """Independent check of the references: float attention over dequantize(quantize(cache))."""
    kv = random_paged_kv([9, 40], 2, 16, 8, torch.float32, torch.device("cpu"))
    scales = torch.tensor([[0.02, 0.05], [0.03, 0.01]])
    k_q, v_q = quantized_kv(kv, scales, dtype)
    k_f, v_f = reference.dequantize_kv(k_q, scales[0]), reference.dequantize_kv(v_q, scales[1])
    q = torch.randn(2, 4, 16)
    out = reference.decode_attention(q, k_q, v_q, kv.block_tables, kv.seq_lens, 0.25, scales)
    assert rel_err(out, reference.decode_attention(q, k_f, v_f, kv.block_tables, kv.seq_lens, 0.25)) < 1e-6
    loc = torch.tensor([0, 3, 10], dtype=torch.int32)
    qp = torch.randn(10, 4, 16)
    out = reference.paged_attention(qp, k_q, v_q, kv.block_tables, kv.seq_lens, loc, 0.25, scales)
    assert rel_err(out, reference.paged_attention(qp, k_f, v_f, kv.block_tables, kv.seq_lens, loc, 0.25)) < 1e-6


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_reads_quantized_pages(device: torch.device, dtype: torch.dtype, num_splits: int | None) -> None:
    kv = random_paged_kv([1, 17, 45], 2, 32, 16, torch.float32, device)
    scales = torch.tensor([[0.05, 0.1], [0.03, 0.2]], device=device)
    k_q, v_q = quantized_kv(kv, scales, dtype)
    q = torch.randn(3, 4, 32, device=device)
    with poisoned_outputs():
        out = decode_attention(q, k_q, v_q, kv.block_tables, kv.seq_lens, 0.2, scales,
                               config=DecodeConfig(block_n=16, num_splits=num_splits))
    assert rel_err(out, reference.decode_attention(q, k_q, v_q, kv.block_tables, kv.seq_lens, 0.2, scales)) < 1e-5


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_prefill_reads_quantized_pages(device: torch.device, dtype: torch.dtype) -> None:
    kv = random_paged_kv([5, 30, 45], 2, 24, 16, torch.float32, device)
    scales = torch.tensor([[0.05, 0.1], [0.03, 0.2]], device=device)
    k_q, v_q = quantized_kv(kv, scales, dtype)
    loc = torch.tensor([0, 5, 11, 31], dtype=torch.int32, device=device)  # full prefill, then chunks over prefixes
    q = torch.randn(31, 4, 24, device=device)
    with poisoned_outputs():
        out = paged_attention(q, k_q, v_q, kv.block_tables, kv.seq_lens, loc, 0.2, scales,
                              config=PrefillConfig(block_m=16, block_n=16))
    ref = reference.paged_attention(q, k_q, v_q, kv.block_tables, kv.seq_lens, loc, 0.2, scales)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantized_kv_gpu_bf16(dtype: torch.dtype) -> None:
    seq_lens = [4096, 1000, 17, 333]
    kv = random_paged_kv(seq_lens, 8, 128, 16, torch.float32, torch.device("cuda"))
    scales = torch.rand(2, 8, device="cuda") * 0.02 + 0.01
    k_q, v_q = quantized_kv(kv, scales, dtype)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = decode_attention(q, k_q, v_q, kv.block_tables, kv.seq_lens, 128**-0.5, scales)
    ref = reference.decode_attention(q.float(), k_q, v_q, kv.block_tables, kv.seq_lens, 128**-0.5, scales)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
    loc = torch.tensor([0, 96, 96 + 1000, 96 + 1000 + 17, 96 + 1000 + 17 + 5], dtype=torch.int32, device="cuda")
    qp = torch.randn(int(loc[-1]), 32, 128, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(qp, k_q, v_q, kv.block_tables, kv.seq_lens, loc, 128**-0.5, scales)
    ref = reference.paged_attention(qp.float(), k_q, v_q, kv.block_tables, kv.seq_lens, loc, 128**-0.5, scales)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
    key = torch.randn(4097, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(k_q.shape[0] * 16, device="cuda")[:4097]
    caches = [torch.zeros_like(k_q) for _ in range(4)]
    store_kv_cache(key, key, caches[0], caches[1], slots, scales)
    reference.store_kv_cache(key, key, caches[2], caches[3], slots, scales)
    assert torch.equal(caches[0].float(), caches[2].float())
