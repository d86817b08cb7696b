"""The tensor-parallel all-reduce of a row-parallel layer's partial outputs, fused with the residual add and the
RMSNorm that follow it: one kernel instead of an all-reduce and a norm kernel, for the few rows of a decode step.

Every rank's GPU can write into every other rank's exchange buffer (CUDA IPC over NVLink; the addresses come from
engine/distributed/peer_exchange.py). Per row, a program
1. writes its partial row into its own cell of every peer's buffer as 64-bit words, each 32 bits of the row (two
   bf16 / fp16 values or one float32) beside the low 32 bits of this call's epoch, the stamp;
2. reads its own buffer until every word of every peer's cell carries the stamp, and sums the rows in rank order in
   float32, so every rank gets the same bits;
3. adds the residual and normalises as add_rms_norm does (kernels/norm.py).

A 64-bit store lands whole, so a stamped word is its own proof of arrival: no flag to raise after the data, no fence
between the two and no second read (NCCL's low-latency protocol works the same way). Epochs count each row's calls on
the GPU (a counter per row that the program increments), so graph replays need no host bookkeeping, and the two cells
per sender alternate between consecutive epochs. A sender starts epoch e + 2 only after it has read every peer's
epoch e + 1, which a peer sends after it has finished reading epoch e's cell, so a cell is never overwritten while it
is read. Stamps are compared for equality: a cell's stale words carry e - 2, never e's low 32 bits.

A wait gives up after `max_spins` polls (the default is minutes, like NCCL's watchdog; the engine's start-up check
uses seconds) and counts the failure in `error` instead of hanging the GPU forever."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm import store_rms_normed
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.stamped_words import cell_start, check_exchange_call, missing_stamps, stamped


@triton.jit
def _halves(words, dtype: tl.constexpr):
    """Stamped words -> (low, high) values of their 32 bits as float32; a float32 word is one value (both)."""
    payload = words.to(tl.int32)
    if dtype == tl.float32:
        lo = payload.to(tl.float32, bitcast=True)
        hi = lo
    elif dtype == tl.bfloat16:  # a bf16 is the high half of a float32
        lo = (payload << 16).to(tl.float32, bitcast=True)
        hi = (payload & -65536).to(tl.float32, bitcast=True)
    else:
        lo = payload.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (payload >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _in_order(lo, hi, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """The row's BLOCK values from its words' halves (the low half of a word comes first)."""
    if dtype == tl.float32:
        values = lo
    else:
        values = tl.reshape(tl.join(lo, hi), [BLOCK])
    return values


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank
def _all_reduce_add_rms_norm_kernel(
    payload_ptr,  # the partial rows as int32 words
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    buffer_ptrs,  # int64 [WORLD]: the address of each rank's exchange buffer, as this process reaches it
    epoch_ptr,  # int64 [MAX_ROWS]: this rank's calls so far, per row
    error_ptr,  # int32 [1]: waits that gave up
    rank,
    eps,
    max_spins,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_WORDS: tl.constexpr,  # words of a row: N values
    WORDS: tl.constexpr,  # words of a cell: BLOCK values
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0)
    word_cols = tl.arange(0, WORDS)
    word_mask = word_cols < ROW_WORDS
    payload = tl.load(payload_ptr + row * ROW_WORDS + word_cols, mask=word_mask, other=0)
    epoch = tl.load(epoch_ptr + row) + 1
    tl.store(epoch_ptr + row, epoch)
    words = stamped(payload, epoch)
    # masks rather than branches on the rank, which is not a constant (branches here break Triton 3.6's layout pass;
    # the masks are full rows because the interpreter mishandles a scalar one)
    for peer in tl.static_range(WORLD):
        peer_buffer = tl.load(buffer_ptrs + peer).to(tl.pointer_type(tl.int64))
        to_peer = word_mask & (tl.full([WORDS], peer, tl.int32) != rank)
        tl.store(peer_buffer + cell_start(epoch, row, rank, WORDS, WORLD, MAX_ROWS) + word_cols, words, mask=to_peer)

    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty  # the partial rows' too
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0)  # read while the peers' words travel
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(tl.int64))
    total_lo = tl.zeros([WORDS], dtype=tl.float32)
    total_hi = tl.zeros([WORDS], dtype=tl.float32)
    for sender in tl.static_range(WORLD):
        cell = own_buffer + cell_start(epoch, row, sender, WORDS, WORLD, MAX_ROWS) + word_cols
        own = tl.full([WORDS], sender, tl.int32) == rank
        expected = word_mask & ~own
        received = tl.load(cell, mask=expected, other=0, volatile=True)
        missing = missing_stamps(received, epoch, expected)
        spins = 0
        while (missing > 0) & (spins < max_spins):
            received = tl.load(cell, mask=expected, other=0, volatile=True)
            missing = missing_stamps(received, epoch, expected)
            spins += 1
        tl.atomic_add(error_ptr, 1, mask=missing > 0)
        lo, hi = _halves(tl.where(own, words, received), dtype)
        total_lo += lo
        total_hi += hi
    total = _in_order(total_lo, total_hi, dtype, BLOCK)

    summed = total.to(dtype)  # the all-reduce's result in the model's dtype, as NCCL returns it
    if HAS_RESIDUAL:
        summed = (summed.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(summed_ptr + row * N + cols, summed, mask=mask)
    store_rms_normed(summed, weight, out_ptr + row * N, cols, mask, eps, N)


PATIENT_SPINS = 1 << 30  # polls a wait makes before it gives up: minutes


def cell_words(hidden: int, dtype: torch.dtype) -> tuple[int, int]:
    """(words of a row, words of a cell) for rows of `hidden` values: 32 bits of values a word."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"partial: float32, bfloat16 or float16 rows expected, got {dtype}")
    if hidden * dtype.itemsize % 4:
        raise ValueError(f"partial: {hidden} {dtype} values do not fill whole 32-bit words")
    return hidden * dtype.itemsize // 4, triton.next_power_of_2(hidden) * dtype.itemsize // 4


def exchange_bytes(max_rows: int, world: int, hidden: int, dtype: torch.dtype) -> int:
    """Size of one rank's exchange buffer: two cells per (row, sender), of 64-bit stamped words."""
    return 2 * max_rows * world * cell_words(hidden, dtype)[1] * 8


def _checked(partial, residual, weight, buffer_ptrs, epochs, rank):
    if partial.dim() != 2:
        raise ValueError(f"partial: [rows, hidden] expected, got shape {tuple(partial.shape)}")
    rows, hidden = partial.shape
    cell_words(hidden, partial.dtype)
    if residual is not None and (residual.shape != partial.shape or residual.dtype != partial.dtype):
        raise ValueError(f"residual: {tuple(residual.shape)} {residual.dtype}, expected {tuple(partial.shape)} "
                         f"{partial.dtype}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    check_exchange_call("partial", rows, buffer_ptrs, epochs, rank)
    partial = partial.contiguous()
    if partial.data_ptr() % 4:  # read as 32-bit words
        partial = partial.clone()
    return partial, None if residual is None else residual.contiguous(), weight.contiguous()


def _launch_options(partial: torch.Tensor, world: int, max_rows: int, has_residual: bool) -> dict:
    hidden = partial.shape[1]
    block = triton.next_power_of_2(hidden)
    row_words, words = cell_words(hidden, partial.dtype)
    return dict(N=hidden, BLOCK=block, ROW_WORDS=row_words, WORDS=words, WORLD=world, MAX_ROWS=max_rows,
                HAS_RESIDUAL=has_residual, num_warps=max(1, min(16, block // 512)), **launch_options(partial))


def all_reduce_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    buffer_ptrs: torch.Tensor,
    epochs: torch.Tensor,
    error: torch.Tensor,
    rank: int,
    max_spins: int = PATIENT_SPINS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of partial + residual), sum + residual) for partial, residual [rows, hidden]; with no
    residual, (rms_norm(sum), sum). Every rank must call it with the same shapes in the same order. Each rank's
    buffer holds exchange_bytes(len(epochs), world, hidden, dtype), zeroed before the first call."""
    partial, residual, weight = _checked(partial, residual, weight, buffer_ptrs, epochs, rank)
    out = torch.empty_like(partial)
    summed = torch.empty_like(partial)
    if partial.shape[0] == 0:
        return out, summed
    _all_reduce_add_rms_norm_kernel[(partial.shape[0],)](
        partial.view(torch.int32), partial if residual is None else residual, weight, out, summed, buffer_ptrs,
        epochs, error, rank, eps, max_spins,
        **_launch_options(partial, buffer_ptrs.numel(), epochs.numel(), residual is not None),
    )
    return out, summed


def warm_up(partial: torch.Tensor, weight: torch.Tensor, *, buffer_ptrs: torch.Tensor, epochs: torch.Tensor,
            error: torch.Tensor, eps: float) -> None:
    """Compiles and loads the kernel for rows like partial, with and without a residual, without running it. A GPU
    may stall while a module loads, so a rank must not load one while its peers' kernels wait for it."""
    if not partial.is_cuda:
        return
    partial, _, weight = _checked(partial, None, weight, buffer_ptrs, epochs, 0)
    for has_residual in (True, False):
        compiled = _all_reduce_add_rms_norm_kernel.warmup(
            partial.view(torch.int32), partial, weight, partial, partial, buffer_ptrs, epochs, error, 0, eps,
            PATIENT_SPINS, grid=(1,), **_launch_options(partial, buffer_ptrs.numel(), epochs.numel(), has_residual),
        )
        compiled._init_handles()
