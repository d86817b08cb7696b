"""Decode-attention benchmark on the GPU: the Triton split-K kernel over the paged cache against
torch's scaled_dot_product_attention on the same K/V laid out contiguously.

    python bench/kernels.py --json bench-kernels.json          # default shape: Llama-8B heads
    python bench/kernels.py --sweep --json bench-kernels.json  # also times other launch configs

Reports median times, launched one by one (triton.testing.do_bench) and replayed from a CUDA graph as
the engine runs them (do_bench_cudagraph), and KV bytes read per second against the device-to-device
copy bandwidth of the same run (bytes read + written per second; a pure read stream can beat it).
On an H200 SDPA dispatches this shape to cuDNN's attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton.testing  # noqa: E402

from kernels.kv_layout import new_kv_cache  # noqa: E402
from kernels.flash_decode import DecodeConfig, choose_num_splits, decode_attention, default_config  # noqa: E402


def median_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_median_ms(fn: Callable[[], object]) -> float:
    """Timed as CUDA-graph replays, the way the engine runs decode attention (no launch overhead)."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also time other block_n / warps / stages / splits")
    parser.add_argument("--sweep-graph", action="store_true",
                        help="time the sweep as CUDA-graph replays (small batches, where launches dominate)")
    parser.add_argument("--json", metavar="FILE", help="write the results here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")

    torch.manual_seed(0)
    dtype = torch.bfloat16
    batch, ctx, heads, kv_heads, dim, bs = args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size
    blocks_per_seq = triton.cdiv(ctx, bs)
    num_blocks = batch * blocks_per_seq
    k_cache = new_kv_cache(num_blocks, bs, kv_heads, dim, dtype, "cuda").normal_()  # the engine's layout
    v_cache = new_kv_cache(num_blocks, bs, kv_heads, dim, dtype, "cuda").normal_()
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=dtype, device="cuda")
    scale = dim**-0.5
    kv_bytes = 2 * batch * ctx * kv_heads * dim * k_cache.element_size()

    # The same K/V, gathered into [B, G, S, D] for SDPA.
    ids = block_tables.long()
    k_contig = k_cache[ids].reshape(batch, blocks_per_seq * bs, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    v_contig = v_cache[ids].reshape(batch, blocks_per_seq * bs, kv_heads, dim)[:, :ctx].transpose(1, 2).contiguous()
    q_sdpa = q.unsqueeze(2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k_contig, v_contig, scale=scale, enable_gqa=True)

    def triton_decode(config: DecodeConfig) -> Callable[[], torch.Tensor]:
        return lambda: decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, config=config)

    props = torch.cuda.get_device_properties(0)
    default = default_config(batch, kv_heads, props.multi_processor_count)  # what the engine launches
    ref = sdpa().squeeze(2).float()
    out = triton_decode(default)().float()
    rel_err = ((out - ref).norm() / ref.norm()).item()

    copy_bw = copy_bandwidth()
    triton_ms = median_ms(triton_decode(default))
    sdpa_ms = median_ms(sdpa)
    triton_graph_ms = graph_median_ms(triton_decode(default))
    sdpa_graph_ms = graph_median_ms(sdpa)
    result: dict[str, object] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"batch": batch, "context": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "block_size": bs, "dtype": "bf16"},
        "kv_bytes": kv_bytes,
        "copy_bandwidth_TBps": copy_bw / 1e12,
        "triton_decode": {
            "config": dataclasses.asdict(default),
            "num_splits": choose_num_splits(batch, kv_heads, blocks_per_seq * bs, props.multi_processor_count, default),
            "ms": triton_ms,
            "kv_TBps": kv_bytes / (triton_ms * 1e-3) / 1e12,
            "fraction_of_copy_bandwidth": kv_bytes / (triton_ms * 1e-3) / copy_bw,
            "rel_err_vs_sdpa": rel_err,
        },
        "sdpa_contiguous": {"ms": sdpa_ms, "kv_TBps": kv_bytes / (sdpa_ms * 1e-3) / 1e12},
        "speedup_vs_sdpa": sdpa_ms / triton_ms,
        "graph_replay": {"triton_ms": triton_graph_ms, "sdpa_ms": sdpa_graph_ms, "speedup_vs_sdpa": sdpa_graph_ms / triton_graph_ms},
    }

    if args.sweep:
        sweep_ms = graph_median_ms if args.sweep_graph else median_ms
        rows = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (1, 2, 4), (2, 3, 4, 6)):
            if block_n * stages > 384:  # past the shared memory of one SM
                continue
            cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
            rows.append((cfg, sweep_ms(triton_decode(cfg))))
        best = min(rows, key=lambda row: row[1])[0]
        for splits in (1, 2, 3, 4, 6, 8, 16):
            cfg = dataclasses.replace(best, num_splits=splits)
            rows.append((cfg, sweep_ms(triton_decode(cfg))))
        rows.sort(key=lambda row: row[1])
        result["sweep"] = [
            {**dataclasses.asdict(cfg), "ms": ms, "kv_TBps": kv_bytes / (ms * 1e-3) / 1e12} for cfg, ms in rows
        ]

    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
