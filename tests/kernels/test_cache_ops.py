import pytest
import torch

from kernels import reference
from kernels.kv_layout import new_kv_cache

pytest.importorskip("triton")
from kernels.cache_ops import store_kv_cache  # noqa: E402


def run_both(key: torch.Tensor, value: torch.Tensor, cache_shape: tuple[int, ...], cache_dtype: torch.dtype, slots: torch.Tensor) -> None:
    """The kernel against the reference, into the engine's head-major cache and into a contiguous one."""
    for k_cache, v_cache in (
        (new_kv_cache(*cache_shape, cache_dtype, key.device), new_kv_cache(*cache_shape, cache_dtype, key.device)),
        (torch.empty(cache_shape, dtype=cache_dtype, device=key.device), torch.empty(cache_shape, dtype=cache_dtype, device=key.device)),
    ):
        compare_stores(key, value, k_cache.fill_(float("nan")), v_cache.fill_(float("nan")), slots)


def compare_stores(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(key, value, k_cache, v_cache, slots)
    reference.store_kv_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.isnan(), k_ref.isnan())
    assert torch.equal(v_cache.isnan(), v_ref.isnan())
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 16, 16), (3, 32, 8), (2, 24, 5)])
def test_store_kv_cache(device: torch.device, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    num_blocks, tokens = 7, 19
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[[2, 11]] = -1
    key = torch.randn(tokens, num_kv_heads, head_dim, device=device)
    value = torch.randn(tokens, num_kv_heads, head_dim, device=device)
    run_both(key, value, (num_blocks, block_size, num_kv_heads, head_dim), torch.float32, slots)


def test_store_kv_cache_strided_inputs(device: torch.device) -> None:
    tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 16
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(48, device=device)[:tokens].to(torch.int32)
    run_both(key, value, (3, 16, num_kv_heads, head_dim), torch.float32, slots)


@pytest.mark.gpu
def test_store_kv_cache_gpu_bf16() -> None:
    tokens, num_kv_heads, head_dim, block_size, num_blocks = 4097, 8, 128, 16, 1024
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    slots[::7] = -1
    key = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    run_both(key, value, (num_blocks, block_size, num_kv_heads, head_dim), torch.bfloat16, slots)
    run_both(key.float(), value.float(), (num_blocks, block_size, num_kv_heads, head_dim), torch.bfloat16, slots)
