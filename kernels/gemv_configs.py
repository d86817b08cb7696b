"""Launch configurations of the decode GEMVs, from sweeps on an H200 at Llama-3-8B's layer shapes, whole and halved
by tensor parallelism, and its LM head (`python bench/gemv.py --sweep`; BENCHMARKS.md). kernels/gemv.py (bf16, fp8):
one output channel per program won everywhere at M = 1; the rule is within 1.5% of each shape's best (2.6% on the
LM head). kernels/gemv_int.py (int8): 4-16 channels per program won, sharing the decoded activations; the rule is
within 0.2% of the best on the wide layers and 7% on the others."""

from __future__ import annotations

import torch

from kernels.quant_linear_config import GemvConfig

_WIDE = 14336  # output channels from which the wide-tile configuration wins (gate_up, LM head)


def gemv_config(n: int, k: int, m: int, weight_dtype: torch.dtype) -> GemvConfig:
    """The configuration for M rows of activations times an [N, K] weight stored in weight_dtype."""
    if m > 1:  # each row re-reads the weight tile from L2: small tiles keep the most programs in flight
        return GemvConfig(block_n=4, block_k=256, num_warps=1)
    if weight_dtype == torch.int8:  # kernels/gemv_int.py: more channels a program share the decoded activations
        return GemvConfig(block_n=8, block_k=512, num_warps=2) if n >= _WIDE else GemvConfig(4, 2048, 4)
    if weight_dtype.itemsize == 1:  # float8_e4m3fn
        return GemvConfig(block_n=1, block_k=256, num_warps=1)
    if n >= _WIDE:
        return GemvConfig(block_n=1, block_k=2048, num_warps=4, num_stages=3)
    return GemvConfig(block_n=1, block_k=256, num_warps=1)
