"""int4 linear layers at 2-512 rows on the GPU: the tensor-core GEMM of kernels/int4_matmul.py at six tile shapes,
torch's tinygemm, dequantize + cuBLAS, and (up to 8 rows) the float32 GEMV, at Llama-3-8B's qkv, gate_up and down
(groups of 128), timed like bench/gemv.py (graph replays cycling through weight copies larger than L2).

    python bench/int4_rows.py [--rows 2 16 64 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gemv import INT4_GROUP, Layer  # noqa: E402
from kernels.int4_matmul import dequantize_int4, int4_linear  # noqa: E402
from kernels.int4_tinygemm import pack_for_tinygemm, tinygemm_linear  # noqa: E402
from kernels.quant_linear_config import GemmConfig  # noqa: E402
from kernels.reference import dequantize_int4 as reference_dequantize  # noqa: E402

TILES = {"16x64x128": GemmConfig(16, 64, 128, 4, 4), "16x128x128": GemmConfig(16, 128, 128, 4, 4),
         "32x64x128": GemmConfig(32, 64, 128, 4, 4), "64x64x64": GemmConfig(64, 64, 64, 4, 4),
         "64x128x128": GemmConfig(64, 128, 128, 4, 3), "128x128x64": GemmConfig(128, 128, 64, 8, 3)}
SHAPES = [("qkv", 6144, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def time_layer(name: str, n: int, k: int, m: int) -> dict:
    layer = Layer(n, k, "int4", m)
    w0 = layer.weights[0]
    ref = F.linear(layer.x.float(), reference_dequantize(*w0, INT4_GROUP, torch.float32))
    gemm = int4_linear(layer.x, *w0, INT4_GROUP, None, max_gemv_m=0, max_gemm_m=m).float()
    row = {"layer": name, "n": n, "k": k, "m": m, "gemm_rel_err": float((gemm - ref).norm() / ref.norm()), "gemm_us": {
        tile: layer.per_launch_us(lambda w, cfg=cfg: int4_linear(layer.x, *w, INT4_GROUP, None, max_gemv_m=0,
                                                                  max_gemm_m=m, gemm=cfg))
        for tile, cfg in TILES.items() if cfg.block_m <= max(16, 2 * m)}}
    packed = {w[0].data_ptr(): pack_for_tinygemm(*w) for w in layer.weights}
    row["tinygemm_us"] = layer.per_launch_us(lambda w: tinygemm_linear(layer.x, *packed[w[0].data_ptr()],
                                                                       INT4_GROUP, None))
    row["dequantize_cublas_us"] = layer.per_launch_us(
        lambda w: F.linear(layer.x, dequantize_int4(*w, INT4_GROUP, torch.bfloat16)))
    if m <= 8:
        row["float32_gemv_us"] = layer.per_launch_us(lambda w: int4_linear(layer.x, *w, INT4_GROUP, None,
                                                                           max_gemv_m=8))
    best = min(row["gemm_us"], key=row["gemm_us"].get)
    print(f"{name:8s} m={m:4d} gemm {row['gemm_us'][best]:7.1f} us ({best})  tinygemm {row['tinygemm_us']:7.1f}  "
          f"dequantize + cuBLAS {row['dequantize_cublas_us']:7.1f}  err {row['gemm_rel_err']:.1e}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    results = []
    for name, n, k in SHAPES:
        for m in args.rows:
            results.append(time_layer(name, n, k, m))
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
