"""Which weight rows a decode-GEMV program reads and how it writes its outputs, shared by kernels/gemv.py and
kernels/gemv_int.py. GATED runs a fused gate_up projection (the weight's first N rows the gate, the next N the up
projection) and writes silu(gate) * up, N channels, in place of the 2N products and the separate SiLU kernel: each
program reads BLOCK_N / 2 gate rows interleaved with the matching up rows."""

from __future__ import annotations

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
def store_outputs(out_row_ptr, out, pid_n, N, row_ok, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Writes one row's outputs [BLOCK_N] (float32, one per weight row of program_rows)."""
    out_ty = out_row_ptr.dtype.element_ty
    if GATED:
        # rounded to the output dtype first, as the unfused projection hands them to kernels/activation.py
        gate, up = tl.split(tl.reshape(out.to(out_ty).to(tl.float32), [BLOCK_N // 2, 2]))
        channels = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row_ptr + channels, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ty), mask=channels < N)
    else:
        tl.store(out_row_ptr + pid_n * BLOCK_N + tl.arange(0, BLOCK_N), out.to(out_ty), mask=row_ok)


def gated_block_n(block_n: int) -> int:
    """Rows a gated program reads for a configuration tuned for block_n plain rows: the same, and at least one pair."""
    return max(2, block_n - block_n % 2)
