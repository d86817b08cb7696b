import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.rotary import rotary_embedding  # noqa: E402


def cos_sin_cache(max_position: int, head_dim: int, device: torch.device, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 16), (3, 3, 32), (4, 1, 64), (5, 5, 24)])
def test_rotary_embedding(device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    tokens = 11
    # q and k are views into one fused qkv projection, as the model produces them.
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 100, (tokens,), device=device)
    cache = cos_sin_cache(100, head_dim, device)
    qkv_before = qkv.clone()
    with poisoned_outputs():
        q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert rel_err(q_out, q_ref) < 1e-3
    assert rel_err(k_out, k_ref) < 1e-3
    assert torch.equal(qkv, qkv_before)


@pytest.mark.gpu
def test_rotary_embedding_gpu_bf16() -> None:
    tokens, num_heads, num_kv_heads, head_dim = 4097, 32, 8, 128
    q = torch.randn(tokens, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cache = cos_sin_cache(8192, head_dim, torch.device("cuda"), base=500000.0)
    with poisoned_outputs():
        q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q.float(), k.float(), cache)
    assert rel_err(q_out, q_ref) < tolerance(torch.bfloat16)
    assert rel_err(k_out, k_ref) < tolerance(torch.bfloat16)
