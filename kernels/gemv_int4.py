"""Decode GEMV for int4 weights (kernels/int4_matmul.py's layout: eight nibbles along K per int32 word, a float32
scale and a uint8 zero point per group of K) times bf16 rows, in packed half-precision arithmetic.

Converting nibbles to float32 one at a time takes three integer operations per weight, which bounds a GEMV below
DRAM bandwidth. Here one LOP3 ORs two nibbles of a word (bits 0-3 and 16-19, or 4-7 and 20-23) into the mantissas
of a pair of float16 1024.0, giving 1024 + q or 1024 + 16 q in both halves, and one half2 subtraction or FMA
leaves each pair of q exactly. Half2 FMAs against the activations then sum four words of one group at a time into
two float16 partial sums, added in float32 (one inline-PTX block). The activations are rounded to float16 and
paired to match, (x_i, x_i+4), in inline PTX once per tile of a program, which shares them between its rows. Per
group, s * (sum q x - z * sum x) applies scale and zero point. Under the interpreter, and for groups of fewer than
32, the same sums run in float32 with shifts and masks.

The RMSNorm before it and the residual add after it can be fused (kernels/gemv_rows.py): with the norm, x times the
norm's weight is what gets rounded to float16.

Activations beyond float16's range (65504) do not fit this kernel; decode inputs to linear layers stay far below."""

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


@triton.jit
def _half2(lo, hi):
    """Two float32 tensors as int32 words of two float16 (lo in the low half)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _half2_parts(pairs):
    """int32 words of two float16 -> (low, high) as float32."""
    lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


_UNPACK_BF16 = """
            mov.b64 {{a0, a1}}, {a};
            mov.b64 {{b0, b1}}, {b};
            shl.b32 {p}0, a0, 16;
            and.b32 {p}1, a0, 0xFFFF0000;
            shl.b32 {p}2, a1, 16;
            and.b32 {p}3, a1, 0xFFFF0000;
            shl.b32 {p}4, b0, 16;
            and.b32 {p}5, b0, 0xFFFF0000;
            shl.b32 {p}6, b1, 16;
            and.b32 {p}7, b1, 0xFFFF0000;"""

# f0..f7 -> the four half2 pairs ($0..$3) and the float32 sum ($4)
_PAIRS_AND_SUM = """
            cvt.rn.f16x2.f32 $0, f4, f0;
            cvt.rn.f16x2.f32 $1, f5, f1;
            cvt.rn.f16x2.f32 $2, f6, f2;
            cvt.rn.f16x2.f32 $3, f7, f3;
            add.f32 s, f0, f1;
            add.f32 s, s, f2;
            add.f32 s, s, f3;
            add.f32 s, s, f4;
            add.f32 s, s, f5;
            add.f32 s, s, f6;
            add.f32 $4, s, f7;
            }"""

PAIRS_ASM = tl.constexpr("""{
            .reg .b32 a0, a1, b0, b1, f0, f1, f2, f3, f4, f5, f6, f7, s;"""
                         + _UNPACK_BF16.format(a="$5", b="$6", p="f") + _PAIRS_AND_SUM)

# the sum of the squares of f0..f7 into $5
_SQUARES = "\n            mul.f32 q, f0, f0;" + "".join(
    f"\n            fma.rn.f32 {'$5' if i == 7 else 'q'}, f{i}, f{i}, q;" for i in range(1, 8))

# x's values in f, the norm weight's in g; the sum of x's squares ($5) before f is scaled by g
NORMED_PAIRS_ASM = tl.constexpr("""{
            .reg .b32 a0, a1, b0, b1, f0, f1, f2, f3, f4, f5, f6, f7, g0, g1, g2, g3, g4, g5, g6, g7, s, q;"""
                                + _UNPACK_BF16.format(a="$6", b="$7", p="f")
                                + _UNPACK_BF16.format(a="$8", b="$9", p="g")
                                + _SQUARES + "".join(f"\n            mul.f32 f{i}, f{i}, g{i};" for i in range(8))
                                + _PAIRS_AND_SUM)


@triton.jit
def _pairs_and_sum(x0, x1, x2, x3, x4, x5, x6, x7):
    """Float32 activations -> the half2 pairs (x_0, x_4) .. (x_3, x_7) and their float32 sum (the PTX paths'
    _PAIRS_AND_SUM, for the interpreter)."""
    return (_half2(x0, x4), _half2(x1, x5), _half2(x2, x6), _half2(x3, x7),
            x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)


@triton.jit
def _activation_pairs(xa, xb, PTX: tl.constexpr):
    """The eight bf16 activations of a weight word (xa: x_0..x_3, xb: x_4..x_7, int64 words) -> the half2 pairs
    (x_0, x_4), (x_1, x_5), (x_2, x_6), (x_3, x_7) and their float32 sum."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm=PAIRS_ASM, constraints="=r,=r,=r,=r,=f,l,l", args=[xa, xb],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32), is_pure=True, pack=1,
        )
    x0, x1, x2, x3 = bf16_quad(xa)
    x4, x5, x6, x7 = bf16_quad(xb)
    return _pairs_and_sum(x0, x1, x2, x3, x4, x5, x6, x7)


@triton.jit
def _normed_activation_pairs(xa, xb, na, nb, PTX: tl.constexpr):
    """_activation_pairs of x times the norm's weight (na, nb: its bf16 words like xa, xb), and the sum of the
    squares of x's eight values."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm=NORMED_PAIRS_ASM, constraints="=r,=r,=r,=r,=f,=f,l,l,l,l", args=[xa, xb, na, nb],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32, tl.float32), is_pure=True, pack=1,
        )
    x0, x1, x2, x3 = bf16_quad(xa)
    x4, x5, x6, x7 = bf16_quad(xb)
    n0, n1, n2, n3 = bf16_quad(na)
    n4, n5, n6, n7 = bf16_quad(nb)
    squares = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7
    p04, p15, p26, p37, total = _pairs_and_sum(x0 * n0, x1 * n1, x2 * n2, x3 * n3, x4 * n4, x5 * n5, x6 * n6, x7 * n7)
    return p04, p15, p26, p37, total, squares


@triton.jit
def _word_dots_shifts(words, p04, p15, p26, p37):
    """sum_i q_i * x_i over each word's eight nibbles in float32 with shifts and masks (interpreter, small groups)."""
    x0, x4 = _half2_parts(p04)
    x1, x5 = _half2_parts(p15)
    x2, x6 = _half2_parts(p26)
    x3, x7 = _half2_parts(p37)
    acc = ((words & 0xF).to(tl.float32) * x0 + ((words >> 4) & 0xF).to(tl.float32) * x1
           + ((words >> 8) & 0xF).to(tl.float32) * x2 + ((words >> 12) & 0xF).to(tl.float32) * x3)
    acc += (((words >> 16) & 0xF).to(tl.float32) * x4 + ((words >> 20) & 0xF).to(tl.float32) * x5
            + ((words >> 24) & 0xF).to(tl.float32) * x6 + ((words >> 28) & 0xF).to(tl.float32) * x7)
    return acc


_DEQUANT_AND_DOT = """
        shr.u32 t, {w}, 8;
        lop3.b32 q0, {w}, 0x000F000F, magic, 0xEA;
        lop3.b32 q1, {w}, 0x00F000F0, magic, 0xEA;
        lop3.b32 q2, t, 0x000F000F, magic, 0xEA;
        lop3.b32 q3, t, 0x00F000F0, magic, 0xEA;
        sub.f16x2 q0, q0, magic;
        fma.rn.f16x2 q1, q1, sixteenth, minus64;
        sub.f16x2 q2, q2, magic;
        fma.rn.f16x2 q3, q3, sixteenth, minus64;
        fma.rn.f16x2 acc, q0, {x04}, acc;
        fma.rn.f16x2 acc, q1, {x15}, acc;
        fma.rn.f16x2 acc, q2, {x26}, acc;
        fma.rn.f16x2 acc, q3, {x37}, acc;"""


def _quad_dots_asm() -> str:
    """PTX for the sum of q * x over four words ($1..$4) and their pairs ($5..$20): each nibble pair ORed into two
    float16 1024.0 and brought back to q exactly, then half2 FMAs; the two halves added in float32 ($0)."""
    words = "".join(_DEQUANT_AND_DOT.format(w=f"${1 + i}", x04=f"${5 + 4 * i}", x15=f"${6 + 4 * i}",
                                            x26=f"${7 + 4 * i}", x37=f"${8 + 4 * i}") for i in range(4))
    return ("""{
        .reg .b32 t, q0, q1, q2, q3, magic, sixteenth, minus64, acc;
        .reg .b16 lo, hi;
        .reg .f32 flo, fhi;
        mov.b32 magic, 0x64006400;
        mov.b32 sixteenth, 0x2C002C00;
        mov.b32 minus64, 0xD400D400;
        mov.b32 acc, 0;""" + words + """
        mov.b32 {lo, hi}, acc;
        cvt.f32.f16 flo, lo;
        cvt.f32.f16 fhi, hi;
        add.f32 $0, flo, fhi;
        }""")


QUAD_DOTS_ASM = tl.constexpr(_quad_dots_asm())


@triton.jit
def _split4(t):
    """t [..., 4] -> its four slices along the last axis."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def gemv_int4_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    M, N, KW, G,
    norm_weight_ptr, residual_ptr, eps,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # every program's rows in range and KW % (BLOCK_K / 8) == 0
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP_SIZE
    PTX: tl.constexpr,  # inline PTX (not under the interpreter); groups of fewer than 32 take the float32 path
    GATED: tl.constexpr = False,  # silu(gate) * up from interleaved gate / up rows (kernels/gemv_rows.py)
    NORM: tl.constexpr = False,  # x is normed on the way in (kernels/gemv_rows.py); norm_weight_ptr: like x_ptr
    RESIDUAL: tl.constexpr = False,  # the residual rows are added to the outputs
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    # x_ptr: rows of x as int64 words of four bf16 [M, 2 * KW]; w_ptr: [N, KW] int32 words of eight nibbles;
    # scales_ptr / zeros_ptr: [N, G]. Rows of x vary fastest in the grid: programs sharing a weight tile run together.
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUP_WORDS: tl.constexpr = GROUP_SIZE // 8
    GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE
    m = tl.program_id(0) % M
    x_ptr += m.to(tl.int64) * (2 * KW)
    pid_n = tl.program_id(0) // M
    rows, row_ok = program_rows(pid_n, N, BLOCK_N, GATED)
    rows64 = rows.to(tl.int64)[:, None]
    words = tl.arange(0, WORDS)
    groups = tl.arange(0, GROUPS)
    acc = tl.zeros([BLOCK_N, GROUPS], tl.float32)
    squares = tl.zeros([WORDS], tl.float32)
    for k0 in range(0, KW, WORDS):
        j = k0 + words
        g = k0 // GROUP_WORDS + groups
        if EVEN:
            xa = tl.load(x_ptr + 2 * j)
            xb = tl.load(x_ptr + 2 * j + 1)
            w = tl.load(w_ptr + rows64 * KW + j[None, :])
            s = tl.load(scales_ptr + rows64 * G + g[None, :])
            z = tl.load(zeros_ptr + rows64 * G + g[None, :])
        else:
            xa = tl.load(x_ptr + 2 * j, mask=j < KW, other=0)
            xb = tl.load(x_ptr + 2 * j + 1, mask=j < KW, other=0)
            w = tl.load(w_ptr + rows64 * KW + j[None, :], mask=row_ok[:, None] & (j < KW)[None, :], other=0)
            tile_groups_ok = row_ok[:, None] & (g < G)[None, :]
            s = tl.load(scales_ptr + rows64 * G + g[None, :], mask=tile_groups_ok, other=0.0)
            z = tl.load(zeros_ptr + rows64 * G + g[None, :], mask=tile_groups_ok, other=0)
        if NORM:
            na = tl.load(norm_weight_ptr + 2 * j, mask=j < KW, other=0)
            nb = tl.load(norm_weight_ptr + 2 * j + 1, mask=j < KW, other=0)
            p04, p15, p26, p37, x_words, word_squares = _normed_activation_pairs(xa, xb, na, nb, PTX)
            squares += word_squares
        else:
            p04, p15, p26, p37, x_words = _activation_pairs(xa, xb, PTX)
        # [1, GROUPS], laid out like group_dots below (a [GROUPS] vector would be moved through shared memory)
        x_sums = tl.sum(tl.reshape(x_words[None, :], [1, GROUPS, GROUP_WORDS]), axis=2)
        if PTX and GROUP_WORDS % 4 == 0:  # four words of one group per inline PTX call
            w0, w1, w2, w3 = _split4(tl.reshape(w, [BLOCK_N, WORDS // 4, 4]))
            a0, a1, a2, a3 = _split4(tl.reshape(p04, [WORDS // 4, 4]))
            b0, b1, b2, b3 = _split4(tl.reshape(p15, [WORDS // 4, 4]))
            c0, c1, c2, c3 = _split4(tl.reshape(p26, [WORDS // 4, 4]))
            d0, d1, d2, d3 = _split4(tl.reshape(p37, [WORDS // 4, 4]))
            dots = tl.inline_asm_elementwise(
                asm=QUAD_DOTS_ASM, constraints="=f" + ",r" * 20,
                args=[w0, w1, w2, w3, a0[None, :], b0[None, :], c0[None, :], d0[None, :],
                      a1[None, :], b1[None, :], c1[None, :], d1[None, :], a2[None, :], b2[None, :], c2[None, :],
                      d2[None, :], a3[None, :], b3[None, :], c3[None, :], d3[None, :]],
                dtype=tl.float32, is_pure=True, pack=1,
            )
            group_dots = tl.sum(tl.reshape(dots, [BLOCK_N, GROUPS, GROUP_WORDS // 4]), axis=2)
        else:
            dots = _word_dots_shifts(w, p04[None, :], p15[None, :], p26[None, :], p37[None, :])
            group_dots = tl.sum(tl.reshape(dots, [BLOCK_N, GROUPS, GROUP_WORDS]), axis=2)
        acc += s * (group_dots - z.to(tl.float32) * x_sums)
    out = tl.sum(acc, axis=1)
    if NORM:
        out *= inverse_rms(tl.sum(squares, axis=0), 8 * KW, eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    store_outputs(out_ptr + m.to(tl.int64) * N, out, pid_n, N, row_ok, BLOCK_N, GATED,
                  residual_ptr + m.to(tl.int64) * N, RESIDUAL)


_PTX = os.environ.get("TRITON_INTERPRET") != "1"


def gemv_int4_takes(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel reads these tensors as they are: contiguous qweight [N, K/8] int32, scales [N, K/G] float32
    and zeros [N, K/G] uint8, with a group size that is a power of two from 8 up and divides K."""
    n, kw = qweight.shape
    k = kw * 8
    groups = k // group_size if group_size else 0
    return (qweight.dtype == torch.int32 and qweight.is_contiguous()
            and group_size >= 8 and group_size & (group_size - 1) == 0 and k % group_size == 0
            and scales.shape == (n, groups) and zeros.shape == (n, groups) and scales.dtype == torch.float32
            and zeros.dtype == torch.uint8 and scales.is_contiguous() and zeros.is_contiguous())


def gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, *, config: GemvConfig, ptx: bool = True, gated: bool = False,
              norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 rows x [..., K] @ dequantized(qweight [N, K/8], scales [N, K/G], zeros [N, K/G])^T + bias -> [..., N];
    gated: silu of the first N / 2 outputs times the last N / 2 -> [..., N / 2]. config.block_k is raised to a
    multiple of the group size. norm = (bf16 weight [K], eps): the product is taken with rms_norm(x, weight, eps);
    residual [..., N]: added to the outputs."""
    n, kw = qweight.shape
    k = kw * 8
    if not gemv_int4_takes(qweight, scales, zeros, group_size):
        raise ValueError(
            f"gemv_int4: contiguous qweight [{n}, K/8] int32, scales [{n}, K/G] float32 and zeros [{n}, K/G] uint8 "
            f"with a power-of-two group size dividing K = {k} expected; got group_size={group_size}"
        )
    if gated and n % 2:
        raise ValueError(f"gemv_int4: a gated weight needs an even number of rows, got {n}")
    x_words = bf16_words(x, k, "gemv_int4")
    m = x_words.shape[0]
    groups = k // group_size
    block_n = gated_block_n(config.block_n) if gated else config.block_n
    block_k = max(config.block_k, group_size)
    channels, per_program = (n // 2, block_n // 2) if gated else (n, block_n)
    fusions = Fusions.checked("gemv_int4", m, k, channels, x.dtype, gated, norm, residual)
    if fusions.norm_weight is not None:
        fusions = replace(fusions, norm_weight=bf16_words(fusions.norm_weight, k, "gemv_int4 norm weight"))
    out = torch.empty(m, channels, dtype=x.dtype, device=x.device)
    if m:
        gemv_int4_kernel[(m * triton.cdiv(channels, per_program),)](
            x_words, qweight, scales, zeros, bias if bias is not None else scales, out, m, channels, kw, groups,
            **fusions.launch_args(scales), GROUP_SIZE=group_size, HAS_BIAS=bias is not None,
            EVEN=channels % per_program == 0 and kw % (block_k // 8) == 0, BLOCK_N=block_n, BLOCK_K=block_k,
            PTX=_PTX and ptx, GATED=gated, num_warps=config.num_warps, num_stages=config.num_stages,
            **launch_options(x),
        )
    return out.view(*x.shape[:-1], channels)
