"""Decode GEMV for int8 weights times bf16 rows, decoding with integer bit operations instead of int-to-float
conversions.

Converting int8 to float is slower than an FMA, which capped the byte-wise GEMV (kernels/gemv.py) at 2.2-3.3 TB/s
of int8 weight. Here a 32-bit word of weight is read whole and each byte, its sign bit flipped (v + 128), is moved
into the low mantissa bits of the float 2**23 (one XOR per word and one PRMT per byte, in inline PTX; shifts and
masks under the interpreter), so the float is 2**23 + v + 128 and one subtraction leaves v exactly. The bf16
activations are read four to a 64-bit word (kernels/bf16_words.py). Each program owns BLOCK_N output channels,
which share the decoded activations. The RMSNorm before it and the residual add after it can be fused
(kernels/gemv_rows.py).

Layout: qweight [N, K] int8 with a float32 scale per output channel (applied once per output)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.bf16_words import bf16_quad, bf16_words
from kernels.gemv_rows import Fusions, gated_block_n, inverse_rms, program_rows, store_outputs
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.quant_linear_config import GemvConfig

MAGIC = tl.constexpr(8388608.0)  # 2**23: a float32 whose mantissa's low bits read as an unsigned integer
MAGIC_BITS = tl.constexpr(0x4B000000)


@triton.jit
def _int8_byte(words, SHIFT: tl.constexpr):
    """Byte SHIFT / 8 of uint32 words, read as int8, as float32: the XOR with 0x80 turns it into int8 + 128."""
    if SHIFT == 24:
        byte = words >> SHIFT
    else:
        byte = (words >> SHIFT) & 0xFF
    return (byte ^ (MAGIC_BITS | 0x80)).to(tl.float32, bitcast=True) - (MAGIC + 128.0)


@triton.jit
def _int8_bytes_prmt(words):
    """The four bytes of int32 words as 2**23 + int8 + 128 float bits: one XOR flips the four sign bits, then
    each PRMT puts one byte under the exponent byte 0x4B (PTX; the interpreter runs _int8_byte instead)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 flipped, magic;
        xor.b32 flipped, $4, 0x80808080;
        mov.b32 magic, 0x4B000000;
        prmt.b32 $0, flipped, magic, 0x7440;
        prmt.b32 $1, flipped, magic, 0x7441;
        prmt.b32 $2, flipped, magic, 0x7442;
        prmt.b32 $3, flipped, magic, 0x7443;
        }""",
        constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1,
    )


@triton.jit
def gemv_int8_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K4,
    norm_weight_ptr, residual_ptr, eps,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # every program's rows in range and K4 % (BLOCK_K / 4) == 0
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRMT: tl.constexpr,  # decode with inline PTX (not under the interpreter)
    GATED: tl.constexpr = False,  # N output channels of silu(gate) * up from 2N weight rows (kernels/gemv_rows.py)
    NORM: tl.constexpr = False,  # x is normed on the way in (kernels/gemv_rows.py); norm_weight_ptr: bf16 words
    RESIDUAL: tl.constexpr = False,  # the residual rows are added to the outputs
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    # x_ptr: rows of x as int64 words of four bf16 [M, K4]; w_ptr: the weight as int32 words of four int8 [N, K4].
    # Rows of x vary fastest in the grid: the programs reading one weight tile run together and share it in L2.
    m = tl.program_id(0) % M
    x_ptr += m.to(tl.int64) * K4
    pid_n = tl.program_id(0) // M
    rows, row_ok = program_rows(pid_n, N, BLOCK_N, GATED)
    words = tl.arange(0, BLOCK_K // 4)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K4
    acc = tl.zeros([BLOCK_N, BLOCK_K // 4], tl.float32)
    squares = tl.zeros([BLOCK_K // 4], tl.float32)
    for k0 in range(0, K4, BLOCK_K // 4):
        j = k0 + words
        if EVEN:
            xw = tl.load(x_ptr + j)
            w = tl.load(w_rows + j[None, :])
        else:
            xw = tl.load(x_ptr + j, mask=j < K4, other=0)
            w = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < K4)[None, :], other=0)
        x0, x1, x2, x3 = bf16_quad(xw)
        if NORM:
            squares += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
            n0, n1, n2, n3 = bf16_quad(tl.load(norm_weight_ptr + j, mask=j < K4, other=0))
            x0, x1, x2, x3 = x0 * n0, x1 * n1, x2 * n2, x3 * n3
        if PRMT:
            b0, b1, b2, b3 = _int8_bytes_prmt(w)
            acc += (b0 - (MAGIC + 128.0)) * x0[None, :]
            acc += (b1 - (MAGIC + 128.0)) * x1[None, :]
            acc += (b2 - (MAGIC + 128.0)) * x2[None, :]
            acc += (b3 - (MAGIC + 128.0)) * x3[None, :]
        else:
            w = w.to(tl.uint32, bitcast=True)
            acc += _int8_byte(w, 0) * x0[None, :]
            acc += _int8_byte(w, 8) * x1[None, :]
            acc += _int8_byte(w, 16) * x2[None, :]
            acc += _int8_byte(w, 24) * x3[None, :]
    out = tl.sum(acc, axis=1) * tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    if NORM:
        out *= inverse_rms(tl.sum(squares, axis=0), 4 * K4, eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    store_outputs(out_ptr + m.to(tl.int64) * N, out, pid_n, N, row_ok, BLOCK_N, GATED,
                  residual_ptr + m.to(tl.int64) * N, RESIDUAL)


_PRMT = os.environ.get("TRITON_INTERPRET") != "1"


def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
              config: GemvConfig, prmt: bool = True, gated: bool = False,
              norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 rows x [..., K] @ (qweight [N, K] int8 * scales[:, None])^T + bias -> [..., N] bf16; gated: silu of the
    first N / 2 outputs times the last N / 2 -> [..., N / 2]. norm = (bf16 weight [K], eps): the product is taken
    with rms_norm(x, weight, eps); residual [..., N]: added to the outputs."""
    n, k = qweight.shape
    if qweight.dtype != torch.int8 or not qweight.is_contiguous() or scales.shape != (n,):
        raise ValueError(f"gemv_int8: contiguous int8 qweight [N, K] and scales [{n}] expected")
    if gated and n % 2:
        raise ValueError(f"gemv_int8: a gated weight needs an even number of rows, got {n}")
    x_words = bf16_words(x, k, "gemv_int8")
    m = x_words.shape[0]
    block_n = gated_block_n(config.block_n) if gated else config.block_n
    channels, per_program = (n // 2, block_n // 2) if gated else (n, block_n)
    fusions = Fusions.checked("gemv_int8", m, k, channels, x.dtype, gated, norm, residual)
    if fusions.norm_weight is not None:
        fusions = replace(fusions, norm_weight=bf16_words(fusions.norm_weight, k, "gemv_int8 norm weight"))
    out = torch.empty(m, channels, dtype=x.dtype, device=x.device)
    k4, words_per_tile = k // 4, config.block_k // 4
    if m:
        gemv_int8_kernel[(m * triton.cdiv(channels, per_program),)](
            x_words, qweight.view(torch.int32), scales, bias if bias is not None else scales, out, m, channels, k4,
            **fusions.launch_args(scales), HAS_BIAS=bias is not None,
            EVEN=channels % per_program == 0 and k4 % words_per_tile == 0,
            PRMT=_PRMT and prmt, BLOCK_N=block_n, BLOCK_K=config.block_k, GATED=gated, num_warps=config.num_warps,
            num_stages=config.num_stages, **launch_options(x),
        )
    return out.view(*x.shape[:-1], channels)
