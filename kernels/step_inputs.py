"""A decode step's inputs unpacked on the GPU inside its CUDA graph, from one buffer the host copies in.

Each step the host copies its HostInputs (engine/batch_inputs.py) into a static buffer that the graph's first kernel
reads: a header (sequences, block-table width, the address of the previous step's sampled tokens), the packed int64
sections (token ids, positions, slots, previous-step rows, sequence ends, query starts) and the int32 block tables
16-byte aligned after them. That kernel writes the graph's static inputs: token ids (a pending one read from the
previous step's tokens), positions, slots (-1 for padding rows), sequence lengths (int32; padding rows see their q
tokens) and block-table rows. Before, a step ran a dozen small copy and index kernels before its graph (~25 us of a
2.5 ms step at TP = 2 on H200s)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.formats import STEP_HEADER_WORDS, check_step_buffers

TABLE_BLOCK = 256


@triton.jit
def _unpack_kernel(
    staging_ptr, staging_words_ptr,  # the same buffer as int64 and as int32
    ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr, tables_ptr, stride_tables,
    Q: tl.constexpr,
    Q_PAD: tl.constexpr,
    HEADER: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    seq = tl.program_id(0)
    n = tl.load(staging_ptr)
    width = tl.load(staging_ptr + 1)
    previous = tl.load(staging_ptr + 2).to(tl.pointer_type(tl.int64))
    total = n * Q
    packed = staging_ptr + HEADER
    lanes = tl.arange(0, Q_PAD)
    token = seq * Q + lanes
    in_q = lanes < Q
    real = in_q & (tl.full([Q_PAD], 0, tl.int64) + seq < n)  # masks as rows: the interpreter mishandles scalars
    ids = tl.load(packed + token, mask=real, other=0)
    rows = tl.load(packed + 3 * total + token, mask=real, other=-1)
    ids = tl.where(rows >= 0, tl.load(previous + rows, mask=real & (rows >= 0), other=0), ids)
    tl.store(ids_ptr + token, ids, mask=real)
    tl.store(positions_ptr + token, tl.load(packed + total + token, mask=real, other=0), mask=real)
    tl.store(slots_ptr + token, tl.load(packed + 2 * total + token, mask=real, other=-1), mask=in_q)
    first = lanes == 0
    seq_len = tl.load(packed + 4 * total + seq + lanes, mask=real & first, other=Q)
    tl.store(seq_lens_ptr + seq + lanes, seq_len.to(tl.int32), mask=first)
    words = HEADER + 4 * total + 2 * n + 1
    table = staging_words_ptr + (words * 8 + 15) // 16 * 4 + seq * width
    cols = tl.arange(0, BLOCK)
    row_real = tl.full([BLOCK], 0, tl.int64) + seq < n
    for c0 in range(0, width, BLOCK):
        c = c0 + cols
        ok = row_real & (c < width)
        tl.store(tables_ptr + seq * stride_tables + c, tl.load(table + c, mask=ok, other=0), mask=ok)


def unpack_step_inputs(staging: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       batch_size: int, tokens_per_seq: int) -> None:
    """kernels.reference.unpack_step_inputs, the previous step's tokens read at the address in the header."""
    check_step_buffers(staging, seq_lens, block_tables)
    q = tokens_per_seq
    _unpack_kernel[(batch_size,)](
        staging, staging.view(torch.int32), input_ids, positions, slot_mapping, seq_lens, block_tables,
        block_tables.stride(0), Q=q, Q_PAD=triton.next_power_of_2(q), HEADER=STEP_HEADER_WORDS, BLOCK=TABLE_BLOCK,
        num_warps=1, **launch_options(staging),
    )
