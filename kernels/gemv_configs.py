"""Launch configurations of the decode GEMVs, from sweeps on an H200 at Llama-3-8B's layer shapes, whole and halved
by tensor parallelism, and its LM head (`python bench/gemv.py --sweep`; BENCHMARKS.md). kernels/gemv.py (bf16, fp8):
one output channel per program won everywhere at M = 1; the rule is within 1.5% of each shape's best (2.6% on the
LM head). kernels/gemv_int.py (int8): 4-16 channels per program won, sharing the decoded activations; the rule picks
each layer's best of a second sweep (within 0.2% on the wide layers in the first). The gated GEMVs (gate_up with
the SiLU fused, `--sweep-gated`) have rules of their own."""

from __future__ import annotations

import torch

from kernels.quant_linear_config import GemvConfig

_WIDE = 14336  # output channels from which the wide-tile configuration wins (gate_up, LM head)


def gemv_config(n: int, k: int, m: int, weight_dtype: torch.dtype) -> GemvConfig:
    """The configuration for M rows of activations times an [N, K] weight stored in weight_dtype."""
    if m > 1:  # each row re-reads the weight tile from L2: small tiles keep the most programs in flight
        return GemvConfig(block_n=4, block_k=256, num_warps=1)
    if weight_dtype == torch.int8:  # kernels/gemv_int.py: more channels a program share the decoded activations
        return _int8_config(n, k)
    if weight_dtype.itemsize == 1:  # float8_e4m3fn
        return GemvConfig(block_n=1, block_k=256, num_warps=1)
    if n >= _WIDE:
        return GemvConfig(block_n=1, block_k=2048, num_warps=4, num_stages=3)
    return GemvConfig(block_n=1, block_k=256, num_warps=1)


def _int8_config(n: int, k: int) -> GemvConfig:
    """From the second sweep (with PDL, BENCHMARKS.md): tiles of 2048 where they divide K, 1024 where they would leave a
    masked tail (the TP = 2 down_proj's K = 7168) or K is short; the tall qkv 2 warps."""
    if n >= _WIDE:
        return GemvConfig(block_n=8, block_k=512, num_warps=2)
    if k % 2048 or k < 4096:
        return GemvConfig(block_n=4, block_k=1024, num_warps=4)
    if n > k:
        return GemvConfig(block_n=4, block_k=1024, num_warps=2)
    return GemvConfig(block_n=4, block_k=2048, num_warps=4)


def gated_gemv_config(n: int, k: int, m: int, weight_dtype: torch.dtype) -> GemvConfig:
    """The configuration of a gated GEMV (kernels/gemv_rows.py) over a fused gate_up weight [n, k]: within 2% of the
    best at Llama-3-8B's gate_up and its TP = 2 half, each faster than the GEMV followed by the SiLU kernel
    (bf16 52.8 vs 54.2 us, int8 29.8 vs 31.3, fp8 31.7 vs 31.6 whole and 16.6 vs 18.0 halved)."""
    if m > 1:
        return gemv_config(n, k, m, weight_dtype)
    if weight_dtype == torch.int8:
        return GemvConfig(block_n=16, block_k=512, num_warps=4)
    if weight_dtype.itemsize == 1:
        return GemvConfig(block_n=16, block_k=128, num_warps=8)
    return GemvConfig(block_n=2, block_k=2048, num_warps=2, num_stages=3)


def normed_gemv_config(n: int, k: int, weight_dtype: torch.dtype, gated: bool = False) -> GemvConfig | None:
    """One row through kernels/gemv.py or kernels/gemv_int.py with the RMSNorm before it fused (kernels/gemv_rows.py):
    each program re-reads the norm's weight with x, so more channels a program than without it pay. The best of a
    sweep at Llama-3-8B's qkv and gated gate_up (BENCHMARKS.md); None where the best fused GEMV measured slower than
    the plain one after a separate norm kernel (~2 us): the gated gate_up in bf16 (55.1 against 52.7 us) and fp8
    (39.1 against 31.7)."""
    if weight_dtype == torch.int8:
        return GemvConfig(block_n=16, block_k=512, num_warps=4) if gated else GemvConfig(block_n=8, block_k=1024)
    if gated:
        return None
    if weight_dtype.itemsize == 1:  # float8_e4m3fn
        return GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=3)
    return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)


def int4_gemv_config(n: int, k: int, gated: bool = False, normed: bool = False) -> GemvConfig:
    """kernels/gemv_int4.py at one row, from a sweep (BENCHMARKS.md): 16 channels a program over 1024-wide tiles
    (within 2% of each layer's best, plain and gated), 4 channels over 2048-wide tiles where those divide K and the
    layer is no wider than deep (o_proj, down_proj and TP = 2's qkv: 7-9% faster there). With the RMSNorm fused
    (normed), 8 channels over 2048-wide tiles where those divide K (qkv and gate_up, plain and gated)."""
    if normed and k % 2048 == 0:
        return GemvConfig(block_n=8, block_k=2048, num_warps=4)
    if not gated and k % 2048 == 0 and n <= k:
        return GemvConfig(block_n=4, block_k=2048, num_warps=4)
    return GemvConfig(block_n=16, block_k=1024, num_warps=8)
