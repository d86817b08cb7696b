import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, random_paged_kv, rel_err, tolerance

pytest.importorskip("triton")
from kernels.prefill_attention import PrefillConfig, paged_attention  # noqa: E402


def start_locs(query_lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "num_kv_heads", "group", "head_dim", "block_size", "config"),
    [
        # whole prompts
        ([1, 17, 45], [1, 17, 45], 2, 2, 32, 16, PrefillConfig(block_m=16, block_n=16)),
        # chunks over cached prefixes, a decode row and a sequence with no new tokens
        ([45, 17, 40, 9], [20, 1, 0, 9], 1, 4, 16, 16, PrefillConfig(block_m=16, block_n=32)),
        ([50, 33], [31, 15], 3, 1, 64, 8, PrefillConfig(block_m=32, block_n=16)),
        ([38, 7, 26], [5, 7, 26], 2, 3, 24, 16, PrefillConfig(block_m=16, block_n=16)),
        ([100, 1, 45], [70, 1, 13], 2, 2, 32, 16, None),
        ([60, 20], [30, 20], 2, 2, 16, 24, PrefillConfig(block_m=16, block_n=16)),  # page ids read per token
    ],
)
def test_paged_attention(
    device: torch.device,
    seq_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    config: PrefillConfig | None,
) -> None:
    kv = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, device)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, device=device)
    qsl = start_locs(query_lens, device)
    scale = head_dim**-0.5
    with poisoned_outputs():
        out = paged_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, qsl, scale, config=config)
    ref = reference.paged_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, qsl, scale)
    assert out.shape == q.shape
    assert rel_err(out, ref) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        ([4096, 1000, 17], [4096, 1000, 17]),  # whole prompts
        ([4096, 2500, 300, 77], [512, 1, 300, 20]),  # chunked prefill over cached prefixes, a decode row
        ([4000] * 4, [129] * 4),
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (32, 32)])
def test_paged_attention_gpu_bf16(
    seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int
) -> None:
    kv = random_paged_kv(seq_lens, num_kv_heads, 128, 16, torch.bfloat16, torch.device("cuda"))
    q = torch.randn(sum(query_lens), num_heads, 128, device="cuda", dtype=torch.bfloat16)
    qsl = start_locs(query_lens, torch.device("cuda"))
    with poisoned_outputs():
        out = paged_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, qsl, 128**-0.5)
    ref = reference.paged_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.seq_lens, qsl, 128**-0.5
    )
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
