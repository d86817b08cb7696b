"""The tensor-parallel all-reduce of a row-parallel layer's partial outputs, fused with the residual add and the
RMSNorm that follow it: one kernel instead of an all-reduce and a norm kernel, for the few rows of a decode step.

Every rank's GPU can write into every other rank's exchange buffer (CUDA IPC over NVLink; the addresses come from
engine/distributed/peer_exchange.py). Per row, a program
1. writes its partial row into its own cell of every peer's buffer and, once all its threads have, sets its flag
   in every peer's flag array to this call's epoch (an atomic exchange, release semantics at system scope);
2. waits until every peer's flag in its own array has reached the epoch (loads with acquire semantics), reads the
   peers' rows from its own buffer and sums all rows in rank order, so every rank gets the same bits;
3. adds the residual and normalises as add_rms_norm does (kernels/norm.py).

Epochs count each row's calls on the GPU (a counter per row that the program increments), so graph replays need no
host bookkeeping, and the two cells per sender alternate between consecutive epochs. A sender starts epoch e + 2
only after every peer has flagged epoch e + 1, which a peer does after it has finished reading epoch e's cell, so a
cell is never overwritten while it is read, and flags only grow.

A wait gives up after `max_spins` polls (the default is minutes, like NCCL's watchdog; the engine's start-up check
uses seconds) and counts the failure in `error` instead of hanging the GPU forever."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm import store_rms_normed
from kernels.pdl import launch_options, wait_for_earlier_kernels


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    buffer_ptrs,  # int64 [WORLD]: the address of each rank's exchange buffer, as this process reaches it
    flag_ptrs,  # int64 [WORLD]: the address of each rank's int64 flags [MAX_ROWS, WORLD]
    epoch_ptr,  # int64 [MAX_ROWS]: this rank's calls so far, per row
    error_ptr,  # int32 [1]: waits that gave up
    rank,
    eps,
    max_spins,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = partial_ptr.dtype.element_ty
    x = tl.load(partial_ptr + row * N + cols, mask=mask, other=0.0)
    epoch = tl.load(epoch_ptr + row) + 1
    tl.store(epoch_ptr + row, epoch)
    cells = (epoch % 2) * MAX_ROWS * WORLD + row * WORLD  # this epoch's cell of rank 0 for this row

    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_buffer = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(peer_buffer + (cells + rank) * BLOCK + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's row is written before the flag that announces it
    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + row * WORLD + rank, epoch, sem="release", scope="sys")

    own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype))
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for sender in tl.static_range(WORLD):
        if sender == rank:
            total += x.to(tl.float32)
        else:
            flag = own_flags + row * WORLD + sender
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < epoch) & (spins < max_spins):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < epoch:
                tl.atomic_add(error_ptr, 1)
            # .cg reads from L2, where the peer's NVLink writes land, never from a stale L1 line
            theirs = tl.load(own_buffer + (cells + sender) * BLOCK + cols, mask=mask, other=0.0, cache_modifier=".cg")
            total += theirs.to(tl.float32)

    reduced = total.to(dtype)  # the all-reduce's result in the model's dtype, as NCCL returns it
    r = tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0)
    summed = (reduced.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(summed_ptr + row * N + cols, summed, mask=mask)
    store_rms_normed(summed, weight_ptr, out_ptr + row * N, cols, mask, eps, N)


PATIENT_SPINS = 1 << 30  # polls a wait makes before it gives up: minutes


def exchange_bytes(max_rows: int, world: int, hidden: int, dtype: torch.dtype) -> int:
    """Size of one rank's exchange buffer: two cells per (row, sender)."""
    return 2 * max_rows * world * triton.next_power_of_2(hidden) * torch.empty((), dtype=dtype).element_size()


def _checked(partial, residual, weight, buffer_ptrs, flag_ptrs, epochs, rank):
    if partial.dim() != 2:
        raise ValueError(f"partial: [rows, hidden] expected, got shape {tuple(partial.shape)}")
    rows, hidden = partial.shape
    world = buffer_ptrs.numel()
    if residual.shape != partial.shape or residual.dtype != partial.dtype:
        raise ValueError(f"residual: {tuple(residual.shape)} {residual.dtype}, expected {tuple(partial.shape)} "
                         f"{partial.dtype}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if rows > epochs.numel():
        raise ValueError(f"partial: {rows} rows, the exchange buffers hold {epochs.numel()}")
    if not 0 <= rank < world or flag_ptrs.numel() != world:
        raise ValueError(f"rank {rank} of {world} ranks with {flag_ptrs.numel()} flag arrays")
    return partial.contiguous(), residual.contiguous(), weight.contiguous()


def _launch_options(partial: torch.Tensor, world: int, max_rows: int) -> dict:
    block = triton.next_power_of_2(partial.shape[1])
    return dict(N=partial.shape[1], BLOCK=block, WORLD=world, MAX_ROWS=max_rows,
                num_warps=max(1, min(16, block // 512)), **launch_options(partial))


def all_reduce_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    buffer_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    epochs: torch.Tensor,
    error: torch.Tensor,
    rank: int,
    max_spins: int = PATIENT_SPINS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of partial + residual), sum + residual) for partial, residual [rows, hidden].
    Every rank must call it with the same shapes in the same order. The buffers hold 2 * len(epochs) * world cells
    of next_power_of_2(hidden) elements of partial's dtype per rank (exchange_bytes)."""
    partial, residual, weight = _checked(partial, residual, weight, buffer_ptrs, flag_ptrs, epochs, rank)
    out = torch.empty_like(partial)
    summed = torch.empty_like(partial)
    if partial.shape[0] == 0:
        return out, summed
    _all_reduce_add_rms_norm_kernel[(partial.shape[0],)](
        partial, residual, weight, out, summed, buffer_ptrs, flag_ptrs, epochs, error, rank, eps, max_spins,
        **_launch_options(partial, buffer_ptrs.numel(), epochs.numel()),
    )
    return out, summed


def warm_up(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, buffer_ptrs: torch.Tensor,
            flag_ptrs: torch.Tensor, epochs: torch.Tensor, error: torch.Tensor, eps: float) -> None:
    """Compiles and loads the kernel for these shapes without running it. A GPU may stall while a module loads, so a
    rank must not load one while its peers' kernels wait for it."""
    if not partial.is_cuda:
        return
    partial, residual, weight = _checked(partial, residual, weight, buffer_ptrs, flag_ptrs, epochs, 0)
    compiled = _all_reduce_add_rms_norm_kernel.warmup(
        partial, residual, weight, partial, partial, buffer_ptrs, flag_ptrs, epochs, error, 0, eps, PATIENT_SPINS,
        grid=(1,), **_launch_options(partial, buffer_ptrs.numel(), epochs.numel()),
    )
    compiled._init_handles()
