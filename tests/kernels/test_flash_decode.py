import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, random_paged_kv, rel_err, tolerance

pytest.importorskip("triton")
from kernels.flash_decode import DecodeConfig, choose_num_splits, decode_attention, default_config  # noqa: E402

SMALL = DecodeConfig(block_n=16)


@pytest.mark.parametrize(
    ("seq_lens", "num_kv_heads", "group", "head_dim", "block_size", "num_splits"),
    [
        ([1, 17, 45], 2, 2, 32, 16, None),
        ([1, 17, 45], 1, 4, 16, 16, 3),
        ([45, 17, 1], 3, 1, 64, 16, 2),
        ([33, 9], 2, 4, 16, 8, 5),
        ([70], 1, 2, 32, 16, 8),
        ([20, 5, 31], 2, 3, 24, 16, 2),
        ([50, 13, 2], 2, 2, 32, 24, 2),  # pages that do not divide a tile: page ids read per token
    ],
)
def test_decode_attention(
    device: torch.device,
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    num_splits: int | None,
) -> None:
    kv = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, device)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=device)
    scale = head_dim**-0.5
    config = DecodeConfig(block_n=16, num_splits=num_splits)
    with poisoned_outputs():
        out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, config=config)
    ref = reference.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    assert out.shape == q.shape
    assert rel_err(out, ref) < 1e-3


def test_decode_attention_contiguous_cache(device: torch.device) -> None:
    """The kernel follows the cache's strides: a plain [num_blocks, block_size, G, D] tensor works too."""
    kv = random_paged_kv([40, 7, 33], 2, 32, 8, torch.float32, device, head_major=False)
    assert kv.k_cache.is_contiguous()
    q = torch.randn(3, 4, 32, device=device)
    with poisoned_outputs():
        out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, config=SMALL)
    ref = reference.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3)
    assert rel_err(out, ref) < 1e-3


def test_k_and_v_caches_must_share_a_layout(device: torch.device) -> None:
    kv = random_paged_kv([9], 2, 16, 8, torch.float32, device)
    q = torch.randn(1, 4, 16, device=device)
    with pytest.raises(ValueError, match="share one layout"):
        decode_attention(q, kv.k_cache, kv.v_cache.contiguous(), kv.block_tables, kv.seq_lens, 0.25)


def test_decode_attention_default_config(device: torch.device) -> None:
    kv = random_paged_kv([3, 600, 130], 2, 32, 16, torch.float32, device)
    q = torch.randn(3, 4, 32, device=device)
    with poisoned_outputs():
        out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    ref = reference.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    assert rel_err(out, ref) < 1e-3


def test_default_config_by_batch() -> None:
    small = default_config(1, 8, 132)
    assert small.block_n == 128 and choose_num_splits(1, 8, 2048, 132, small) == 16  # one tile per split
    assert default_config(4, 8, 132) == small and default_config(5, 8, 132) == DecodeConfig()
    assert default_config(64, 8, 132) == DecodeConfig()


def test_choose_num_splits_fills_the_sms() -> None:
    config = DecodeConfig()
    assert choose_num_splits(64, 8, 4096, 132, config) * 64 * 8 >= 132
    assert choose_num_splits(1, 8, 4096, 132, config) * 8 >= 100
    assert choose_num_splits(1, 8, 64, 132, config) == 1
    assert choose_num_splits(512, 8, 4096, 132, config) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "max_len"), [(64, 4096), (3, 4096), (1, 1000), (200, 300)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (32, 32)])
def test_decode_attention_gpu_bf16(batch: int, max_len: int, num_heads: int, num_kv_heads: int) -> None:
    seq_lens = torch.randint(1, max_len + 1, (batch,)).tolist()
    seq_lens[0] = max_len
    kv = random_paged_kv(seq_lens, num_kv_heads, 128, 16, torch.bfloat16, torch.device("cuda"))
    q = torch.randn(batch, num_heads, 128, device="cuda", dtype=torch.bfloat16)
    with poisoned_outputs():
        out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 128**-0.5)
    ref = reference.decode_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.seq_lens, 128**-0.5
    )
    assert rel_err(out, ref) < tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_decode_attention_gpu_cuda_graph() -> None:
    """The launch must not synchronise with the host, so that the runner can capture it."""
    seq_lens = [1000, 17, 4096, 333]
    kv = random_paged_kv(seq_lens, 8, 128, 16, torch.bfloat16, torch.device("cuda"))
    q = torch.randn(len(seq_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)
    kv.seq_lens.copy_(torch.tensor([999, 16, 2000, 1], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref = reference.decode_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.seq_lens, 0.1
    )
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
