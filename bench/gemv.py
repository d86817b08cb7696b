"""Decode GEMV benchmark on the GPU: kernels/gemv.py (bf16 and fp8 weights), kernels/gemv_int.py (int8 weights
decoded by bit operations: PRMT in inline PTX, or "int8_shifts", the same in shifts and masks) and kernels/gemv_int4.py
(int4 in groups of 128, half2 arithmetic; "int4_a8" the same weights with the activations rounded to int8 and DP4A,
kernels/gemv_int4_a8.py, which batch-1 decode runs; "int4_tinygemm" torch's tinygemm kernel on the same weight), against
cuBLAS (F.linear) on bf16 weights of the same shape, at the linear layers of Llama-3-8B (whole and as tensor-parallel
halves) and its LM head, one token (M = 1) unless told otherwise.

    python bench/gemv.py --json gemv.json                 # the shipped configurations
    python bench/gemv.py --sweep --jobs 12 --json gemv.json  # also every launch configuration in the grid

Each timing replays a CUDA graph of 64 launches that cycle through copies of the weight adding up to more than
the L2 cache, so every launch reads its weight from HBM, as in a decode step where 31 other layers run in
between. Reports microseconds per launch and weight bytes read per second. The gate_up layers are also timed gated
(the SiLU and product fused into the GEMV) against the plain GEMV followed by the SiLU kernel.

    python bench/gemv.py --layers gate_up gate_up_tp2 --sweep-gated --jobs 14   # every gated configuration

`--fusions` also times, at one row on the whole model's layers, what batch-1 decode runs with the RMSNorm and the
residual add folded into the GEMVs (kernels/gemv_rows.py): qkv and gate_up after a norm kernel against the GEMV
that norms x itself (the launch rule for the fused form; where that rule declines, the norm kernel stays), o_proj
and down with the residual added in their epilogue.

    python bench/gemv.py --dtypes bf16 int8 int4 fp8 --layers qkv o_proj gate_up down --fusions
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_configs import gated_gemv_config, gemv_config, int4_gemv_config, normed_gemv_config  # noqa: E402
from kernels.gemv_int import gemv_int8  # noqa: E402
from kernels.gemv_int4 import gemv_int4  # noqa: E402
from kernels.gemv_int4_a8 import gemv_int4_a8  # noqa: E402
from kernels.int4_tinygemm import pack_for_tinygemm, tinygemm_linear  # noqa: E402
from kernels.norm import rms_norm  # noqa: E402
from kernels.reference import dequantize_int4  # noqa: E402
from kernels.quant_linear_config import GemvConfig  # noqa: E402

# (name, N, K): Llama-3-8B's fused projections, then their halves under TP = 2, then the LM head.
SHAPES = [
    ("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
    ("qkv_tp2", 3072, 4096), ("o_proj_tp2", 4096, 2048), ("gate_up_tp2", 14336, 4096), ("down_tp2", 4096, 7168),
    ("lm_head", 128256, 4096),
]
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "int8_shifts": torch.int8, "fp8": torch.float8_e4m3fn,
                 "int4": torch.int32, "int4_a8": torch.int32, "int4_tinygemm": torch.int32}
INT4_GROUP = 128
FUSABLE = ("bf16", "int8", "int4", "int4_a8", "fp8")  # the kernels that take the norm and residual fusions
FUSED_LAYERS = ("qkv", "o_proj", "gate_up", "down")  # one GPU: the tensor-parallel halves keep the fused all-reduce
LAUNCHES = 64
L2_FLUSH_BYTES = 512 << 20


def sweep_grid() -> list[GemvConfig]:
    grid = []
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048, 4096),
                                                   (1, 2, 4, 8), (1, 3)):
        per_thread = bn * bk // (32 * warps)
        if 4 <= per_thread <= 64 and (bk <= 2048 or stages == 1):
            grid.append(GemvConfig(bn, bk, warps, stages))
    return grid


def random_weight(n: int, k: int, dtype: str) -> tuple[torch.Tensor, ...]:
    """The tensors of one random weight: (w,), (q, channel scales), (q, group scales, zero points) or tinygemm's
    (packed weight, scales and zeros)."""
    if dtype.startswith("int4"):
        q = torch.randint(-2**31, 2**31, (n, k // 8), dtype=torch.int32, device="cuda")
        scales = torch.rand(n, k // INT4_GROUP, device="cuda") * 1e-3
        zeros = torch.randint(0, 16, (n, k // INT4_GROUP), dtype=torch.uint8, device="cuda")
        return pack_for_tinygemm(q, scales, zeros) if dtype == "int4_tinygemm" else (q, scales, zeros)
    if dtype.startswith("int8"):
        return torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda"), torch.rand(n, device="cuda") * 1e-2
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return (w.to(torch.float8_e4m3fn), torch.rand(n, device="cuda") * 1e-2) if dtype == "fp8" else (w,)


def dequantized(weight: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if len(weight) == 3:
        return dequantize_int4(*weight, INT4_GROUP, torch.float32)
    return weight[0].float() * (weight[1][:, None] if len(weight) > 1 else 1.0)


def gemv_of(dtype: str, gated: bool = False) -> Callable[..., torch.Tensor]:
    """kind -> f(x, weight tensors, config); gated: the fused gate_up's silu(gate) * up."""
    if dtype == "int4_tinygemm":  # no configuration; gated: followed by the SiLU kernel
        plain = lambda x, w, cfg: tinygemm_linear(x, *w, INT4_GROUP, None)  # noqa: E731
        return (lambda x, w, cfg: silu_and_mul(plain(x, w, cfg))) if gated else plain
    if dtype == "int4":
        return lambda x, w, cfg, **fusions: gemv_int4(x, *w, INT4_GROUP, config=cfg, gated=gated, **fusions)
    if dtype == "int4_a8":  # its launch shape is fixed (kernels/gemv_int4_a8.py): cfg is not read
        return lambda x, w, cfg, **fusions: gemv_int4_a8(x, *w, INT4_GROUP, gated=gated, **fusions)
    if dtype.startswith("int8"):
        return lambda x, w, cfg, **fusions: gemv_int8(x, *w, config=cfg, prmt=dtype == "int8", gated=gated, **fusions)
    return lambda x, w, cfg, **fusions: gemv(x, w[0], w[1] if len(w) > 1 else None, config=cfg, gated=gated,
                                             **fusions)


def takes(dtype: str, cfg: GemvConfig) -> bool:
    if dtype in ("int4_tinygemm", "int4_a8"):
        return False  # nothing to configure
    if dtype == "int4":  # a thread's share of a tile: 1 to 16 words of eight weights
        return cfg.block_k >= INT4_GROUP and 1 <= cfg.block_n * cfg.block_k // (256 * cfg.num_warps) <= 16
    return not dtype.startswith("int8") or cfg.num_stages == 1  # no loads in its loop for num_stages to pipeline


class Layer:
    """Copies of one random weight, enough of them to outgrow L2."""

    def __init__(self, n: int, k: int, dtype: str, m: int) -> None:
        self.n, self.k, self.dtype = n, k, dtype
        self.weights = [random_weight(n, k, dtype) for _ in range(2)]
        self.bytes = sum(t.numel() * t.element_size() for t in self.weights[0])
        copies = max(2, -(-L2_FLUSH_BYTES // self.bytes))
        self.weights += [tuple(t.clone() for t in self.weights[0]) for _ in range(copies - 2)]
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def per_launch_us(self, call: Callable[[torch.Tensor], object]) -> float:
        """Microseconds per launch of call(weight), replayed from a graph of LAUNCHES launches."""
        for w in self.weights:
            call(w)  # compiles / autotunes outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(LAUNCHES):
                call(self.weights[i % len(self.weights)])
        graph.replay()
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / LAUNCHES)
        return sorted(times)[len(times) // 2]

    def shipped_config(self, gated: bool = False) -> GemvConfig:
        if self.dtype.startswith("int4"):
            return int4_gemv_config(self.n, self.k, gated)
        rule = gated_gemv_config if gated else gemv_config
        return rule(self.n, self.k, self.x.shape[0], WEIGHT_DTYPES[self.dtype])

    def gemv_call(self, cfg: GemvConfig | None, gated: bool = False) -> Callable[[tuple[torch.Tensor, ...]], object]:
        cfg = cfg or self.shipped_config(gated)
        run = gemv_of(self.dtype, gated)
        return lambda w: run(self.x, w, cfg)

    def fusion_times(self, gated: bool, takes_norm: bool) -> dict[str, float | None]:
        """One row: (takes_norm) the norm kernel then the shipped GEMV against the GEMV that norms x itself under
        the fused launch rule (None where the rule declines: the norm kernel stays); else the shipped GEMV with the
        residual added in its epilogue (the plain GEMV is the row's gemv_us)."""
        run, shipped = gemv_of(self.dtype, gated), self.shipped_config(gated)
        if not takes_norm:
            residual = torch.randn(1, self.n, device="cuda", dtype=torch.bfloat16)
            return {"gemv_residual_us": self.per_launch_us(lambda w: run(self.x, w, shipped, residual=residual))}
        norm = (torch.rand(self.k, device="cuda").add_(0.5).to(torch.bfloat16), 1e-5)
        if self.dtype == "int4_a8":
            fused = shipped  # it takes every norm and reads no configuration
        elif self.dtype.startswith("int4"):
            fused = int4_gemv_config(self.n, self.k, gated, normed=True)
        else:
            fused = normed_gemv_config(self.n, self.k, WEIGHT_DTYPES[self.dtype], gated)
        times = {"norm_kernel_then_gemv_us": self.per_launch_us(lambda w: run(rms_norm(self.x, *norm), w, shipped))}
        times["fused_norm_us"] = self.per_launch_us(lambda w: run(self.x, w, fused, norm=norm)) if fused else None
        return times

    def check(self) -> float:
        """Largest difference of the shipped configuration to dequantize-then-matmul in float32, relative to the
        output's scale."""
        w = self.weights[0]
        if self.dtype == "int4_tinygemm":
            return float("nan")  # its packed weight has no reference here; tests/kernels/test_int4_tinygemm.py
        ref = F.linear(self.x.float(), dequantized(w))
        ours = self.gemv_call(None)(w).float()
        return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def cublas_us(n: int, k: int, m: int) -> float:
    """cuBLAS (F.linear) on a bf16 weight of the same shape: the baseline for every weight dtype."""
    layer = Layer(n, k, "bf16", m)
    return layer.per_launch_us(lambda w: F.linear(layer.x, w[0]))


def _compile(item: tuple[str, int, GemvConfig, bool]) -> None:
    dtype, m, cfg, gated = item
    for k in (4096, 7168):  # every K of SHAPES divides by 1024; 7168 does not by 2048 (the masked variant)
        if takes(dtype, cfg):
            gemv_of(dtype, gated)(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                  random_weight(16 * cfg.block_n, k, dtype), cfg)


def precompile(items: list[tuple[str, int, GemvConfig, bool]], jobs: int) -> None:
    """Fills Triton's on-disk cache from worker processes, so the timed process only loads kernels."""
    if jobs > 1 and items:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for i, _ in enumerate(pool.imap_unordered(_compile, items, chunksize=4)):
                if i % 50 == 0:
                    print(f"  compiled {i}/{len(items)}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(WEIGHT_DTYPES), choices=list(WEIGHT_DTYPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="M values (tokens) to time")
    parser.add_argument("--sweep", action="store_true", help="also time every configuration of the grid")
    parser.add_argument("--sweep-gated", action="store_true",
                        help="gate_up layers: time every configuration of the grid with two or more rows, gated")
    parser.add_argument("--layers", nargs="+", choices=[name for name, _, _ in SHAPES], help="only these layers")
    parser.add_argument("--jobs", type=int, default=1, help="processes compiling the sweep's kernels first")
    parser.add_argument("--fusions", action="store_true",
                        help="one row, whole-model layers: also time the norm and residual fused into the GEMVs")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    grid = sweep_grid() if args.sweep else []
    gated_grid = [c for c in sweep_grid() if c.block_n >= 2] if args.sweep_gated else []
    precompile([(d, m, c, False) for d in args.dtypes for m in args.rows for c in grid]
               + [(d, m, c, True) for d in args.dtypes for m in args.rows for c in gated_grid], args.jobs)
    shapes = [s for s in SHAPES if not args.layers or s[0] in args.layers]
    results = []
    for dtype, m, (name, n, k) in itertools.product(args.dtypes, args.rows, shapes):
        layer = Layer(n, k, dtype, m)
        row = {"dtype": dtype, "m": m, "layer": name, "n": n, "k": k, "weight_bytes": layer.bytes,
               "max_rel_err": layer.check()}
        row["baseline_us"] = cublas_us(n, k, m)
        row["gemv_us"] = layer.per_launch_us(layer.gemv_call(None))
        shipped = None if dtype in ("int4_tinygemm", "int4_a8") else layer.shipped_config()  # these take none
        row["gemv_config"] = vars(shipped) if shipped else None
        if grid and any(takes(dtype, c) for c in grid):
            timed = sorted(((layer.per_launch_us(layer.gemv_call(c)), c) for c in grid if takes(dtype, c)),
                           key=lambda t: t[0])
            row["best_us"], best = timed[0]
            row["best_config"] = vars(best)
            row["sweep"] = [{"us": us, **vars(c)} for us, c in timed]
        if name.startswith("gate_up"):  # the fused SiLU against the projection then kernels/activation.py
            plain = layer.gemv_call(None)
            row["unfused_silu_us"] = layer.per_launch_us(lambda w: silu_and_mul(plain(w)))
            row["gated_us"] = layer.per_launch_us(layer.gemv_call(None, gated=True))
            print(f"{dtype:5s} m={m} {name:12s} gemv + SiLU kernel {row['unfused_silu_us']:7.2f} us  "
                  f"gated gemv {row['gated_us']:7.2f} us", flush=True)
            if gated_grid and any(takes(dtype, c) for c in gated_grid):
                timed = sorted(((layer.per_launch_us(layer.gemv_call(c, gated=True)), c) for c in gated_grid
                                if takes(dtype, c)), key=lambda t: t[0])
                row["gated_best_us"], best = timed[0]
                row["gated_best_config"] = vars(best)
                row["gated_sweep"] = [{"us": us, **vars(c)} for us, c in timed]
                print(f"{dtype:5s} m={m} {name:12s} gated best {timed[0][0]:7.2f} us {vars(best)}", flush=True)
        if args.fusions and m == 1 and dtype in FUSABLE and name in FUSED_LAYERS:
            row["fusions"] = layer.fusion_times(name == "gate_up", takes_norm=name in ("qkv", "gate_up"))
            print(f"{dtype:5s} m={m} {name:12s} gemv {row['gemv_us']:.2f} us, fusions {row['fusions']}", flush=True)
        tb_s = lambda us, nbytes=layer.bytes: nbytes / (us * 1e-6) / 1e12  # noqa: E731
        cublas_tb_s = tb_s(row["baseline_us"], 2 * n * k)  # cuBLAS reads the bf16 weight
        print(f"{dtype:5s} m={m} {name:12s} cuBLAS bf16 {row['baseline_us']:7.2f} us ({cublas_tb_s:.2f} TB/s)"
              f"  gemv {row['gemv_us']:7.2f} us ({tb_s(row['gemv_us']):.2f} TB/s, "
              f"{row['baseline_us'] / row['gemv_us']:.3f}x)"
              + (f"  best {row['best_us']:7.2f} us ({tb_s(row['best_us']):.2f} TB/s) {row['best_config']}"
                 if "best_us" in row else "")
              + f"  err {row['max_rel_err']:.1e}", flush=True)
        results.append(row)
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "launches_per_graph": LAUNCHES, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
