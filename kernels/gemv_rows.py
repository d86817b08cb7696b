"""Which weight rows a decode-GEMV program reads and how it writes its outputs, shared by kernels/gemv.py and
kernels/gemv_int.py. GATED runs a fused gate_up projection (the weight's first N rows the gate, the next N the up
projection) and writes silu(gate) * up, N channels, in place of the 2N products and the separate SiLU kernel: each
program reads BLOCK_N / 2 gate rows interleaved with the matching up rows.

Two more fusions spare a batch-1 decode step the RMSNorm kernels between its projections. NORM: the GEMV reads the
residual stream x and computes linear(rms_norm(x, norm_weight)): each program streams all of x anyway, so it
multiplies x by the norm's weight as it goes, sums x^2 beside the dot products and scales its outputs by
1 / rms(x) at the end (the norm's scale is one number a row). RESIDUAL: the outputs come back with the residual
stream added (out = x W^T + residual), as the add before a norm does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def program_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """(weight rows [BLOCK_N], which of them are in range) for output block pid_n of N output channels."""
    i = tl.arange(0, BLOCK_N)
    if GATED:
        channel = pid_n * (BLOCK_N // 2) + i // 2
        return channel + (i % 2) * N, channel < N
    rows = pid_n * BLOCK_N + i
    return rows, rows < N


@triton.jit
def inverse_rms(sum_squares, K, eps):
    """1 / rms of a row of K values from their sum of squares (the NORM fusion's output scale)."""
    return tl.rsqrt(sum_squares / K + eps)


@triton.jit
def store_outputs(out_row_ptr, out, pid_n, N, row_ok, BLOCK_N: tl.constexpr, GATED: tl.constexpr,
                  residual_row_ptr=None, RESIDUAL: tl.constexpr = False):
    """Writes one row's outputs [BLOCK_N] (float32, one per weight row of program_rows), plus the residual row's
    values when RESIDUAL (not with GATED)."""
    out_ty = out_row_ptr.dtype.element_ty
    if GATED:
        # rounded to the output dtype first, as the unfused projection hands them to kernels/activation.py
        gate, up = tl.split(tl.reshape(out.to(out_ty).to(tl.float32), [BLOCK_N // 2, 2]))
        channels = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row_ptr + channels, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ty), mask=channels < N)
    else:
        channels = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if RESIDUAL:
            out += tl.load(residual_row_ptr + channels, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_row_ptr + channels, out.to(out_ty), mask=row_ok)


def gated_block_n(block_n: int) -> int:
    """Rows a gated program reads for a configuration tuned for block_n plain rows: the same, and at least one pair."""
    return max(2, block_n - block_n % 2)


@dataclass(frozen=True)
class Fusions:
    """A decode GEMV's fused norm before it and residual add after it, checked; the launch arguments are
    placeholders (never read) where a fusion is off."""

    norm_weight: torch.Tensor | None = None  # [K]: the GEMV computes linear(rms_norm(x, norm_weight, eps))
    eps: float = 0.0
    residual: torch.Tensor | None = None  # [M, N] rows in x's dtype: added to the outputs

    @staticmethod
    def checked(op: str, rows: int, k: int, n: int, dtype: torch.dtype, gated: bool,
                norm: tuple[torch.Tensor, float] | None, residual: torch.Tensor | None) -> "Fusions":
        """ValueError naming the argument when norm = (weight [K], eps) or residual [..., N] (M rows) does not fit."""
        norm_weight, eps = norm if norm is not None else (None, 0.0)
        if norm is not None and (not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (k,)
                                 or not norm_weight.is_contiguous()):
            raise ValueError(f"{op}: a contiguous norm weight of shape ({k},) expected, got "
                             f"{getattr(norm_weight, 'shape', norm_weight)}")
        if residual is not None:
            if gated:
                raise ValueError(f"{op}: a gated GEMV takes no residual")
            if residual.numel() != rows * n or residual.shape[-1] != n or residual.dtype != dtype:
                raise ValueError(f"{op}: residual [{rows}, {n}] in {dtype} expected, got {residual.dtype} of shape "
                                 f"{tuple(residual.shape)}")
            residual = residual.reshape(rows, n).contiguous()
        return Fusions(norm_weight, float(eps), residual)

    def launch_args(self, placeholder: torch.Tensor) -> dict:
        """The kernels' norm_weight_ptr, eps, residual_ptr, NORM and RESIDUAL."""
        return {
            "norm_weight_ptr": self.norm_weight if self.norm_weight is not None else placeholder,
            "eps": self.eps,
            "residual_ptr": self.residual if self.residual is not None else placeholder,
            "NORM": self.norm_weight is not None,
            "RESIDUAL": self.residual is not None,
        }
