"""Exchange buffers that every tensor-parallel rank's GPU writes into over NVLink, shared through CUDA IPC, and the
fused all-reduce + residual add + RMSNorm of decode steps that runs on them (kernels/all_reduce_norm.py), with greedy
steps' argmax over the vocabulary shards (kernels/exchange_argmax.py).

PyTorch's symmetric memory gives such buffers too, but in the releases the engine runs on, its rendezvous numbers
the exchanges per process, so a second tensor-parallel engine in one process (whose new workers count from zero)
hangs (pytorch/pytorch#196082). CUDA IPC handles, which torch.multiprocessing shares CUDA tensors with, keep no such
state. Each rank opens its peers' handles on its own GPU, so its kernels reach them through peer access.

The engine checks the kernels once at start against a sum in rank order and add_rms_norm and against argmax over
the whole logits, and every rank falls back to NCCL unless all of them pass."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kernels import exchange_argmax, reference
from kernels.all_reduce_norm import PATIENT_SPINS, all_reduce_add_rms_norm, cell_words, exchange_bytes, warm_up

log = logging.getLogger(__name__)

MAX_ROWS = 64  # decode batches; more rows (prefill) go through NCCL's bandwidth-optimal rings
_PROBE_SPINS = 1 << 22  # a few seconds: the start-up check fails rather than hangs if a peer's writes never land


def _ipc_handle(t: torch.Tensor) -> tuple:
    # (device, handle, size, offset, ref-counter handle, ref-counter offset, event handle, event sync): all but the
    # first and last, which the opening side replaces with its own device and no event to wait on
    return t.untyped_storage()._share_cuda_()[1:7]


def _open_ipc(handle: tuple, device: torch.device) -> torch.UntypedStorage:
    """A peer's block mapped into this process on this rank's own GPU, which reaches it through peer access."""
    return torch.UntypedStorage._new_shared_cuda(device.index, *handle, False)


class FusedAllReduceNorm:
    """Per rank: an exchange buffer that every peer writes into, its address in every rank's process, and this rank's
    per-row epochs. Decode steps' all-reduces run through it fused with their norms, and greedy steps' argmax over
    the vocabulary shards (kernels/exchange_argmax.py) when it knows the shards' width."""

    def __init__(self, rank: int, world: int, device: torch.device, hidden: int, dtype: torch.dtype,
                 vocab_shard_rows: int | None = None) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world, self.device, self.hidden, self.dtype = rank, world, device, hidden, dtype
        self.cell_words = cell_words(hidden, dtype)[1]
        # shards with more candidates than a cell holds exchange them over NCCL
        fits = vocab_shard_rows is not None and exchange_argmax.fits_cell(vocab_shard_rows, self.cell_words)
        self.vocab_shard_rows = vocab_shard_rows if fits else None
        self.buffer = torch.zeros(exchange_bytes(MAX_ROWS, world, hidden, dtype), dtype=torch.uint8, device=device)
        self.epochs = torch.zeros(MAX_ROWS, dtype=torch.int64, device=device)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)  # zeroed before any peer can write
        self._opened: list[torch.UntypedStorage] = []  # keeps the mappings of the peers' blocks alive
        self.buffer_ptrs = None

    def ipc_handle(self) -> tuple:
        return _ipc_handle(self.buffer)

    def open_peers(self, ipc_handles: list[tuple]) -> None:
        """ipc_handles[r]: rank r's ipc_handle()."""
        buffers = []
        for peer, handle in enumerate(ipc_handles):
            if peer == self.rank:
                buffers.append(self.buffer.data_ptr())
                continue
            self._opened.append(_open_ipc(handle, self.device))
            buffers.append(self._opened[-1].data_ptr())
        self.buffer_ptrs = torch.tensor(buffers, dtype=torch.int64, device=self.device)

    def handles(self, partial: torch.Tensor) -> bool:
        return (partial.dim() == 2 and partial.shape[0] <= MAX_ROWS and partial.shape[1] == self.hidden
                and partial.dtype == self.dtype and partial.is_cuda)

    def handles_argmax(self, logits: torch.Tensor, width: int) -> bool:
        return (width == self.vocab_shard_rows and logits.dim() == 2 and logits.shape[0] <= MAX_ROWS
                and logits.is_cuda and logits.dtype == self.dtype)

    def _tables(self) -> dict:
        return dict(buffer_ptrs=self.buffer_ptrs, epochs=self.epochs, error=self.error)

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 max_spins: int = PATIENT_SPINS) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_add_rms_norm(partial, residual, weight, eps, rank=self.rank, max_spins=max_spins,
                                       **self._tables())

    def argmax(self, logits: torch.Tensor, offset: int, width: int, max_spins: int = PATIENT_SPINS) -> torch.Tensor:
        """Each row's argmax over the whole vocabulary, from this rank's logits of ids offset .. + width."""
        return exchange_argmax.exchange_argmax(logits, offset, width, rank=self.rank, words=self.cell_words,
                                               max_spins=max_spins, **self._tables())

    def warm_up(self, eps: float) -> None:
        x = torch.zeros(1, self.hidden, dtype=self.dtype, device=self.device)
        warm_up(x, x[0], eps=eps, **self._tables())
        if self.vocab_shard_rows is not None:
            logits = torch.zeros(1, self.vocab_shard_rows, dtype=self.dtype, device=self.device)
            exchange_argmax.warm_up(logits, self.vocab_shard_rows, words=self.cell_words, **self._tables())

    def failed_waits(self) -> int:
        return int(self.error.item())


def _on_every_rank(ok: bool, cpu_group) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


def try_fused_all_reduce_norm(tp, device: torch.device, hidden: int, dtype: torch.dtype,
                              vocab_shard_rows: int | None = None) -> FusedAllReduceNorm | None:
    """The fused op if it works on every rank and agrees with a sum in rank order + add_rms_norm (and, given the
    vocabulary shards' rows, the exchanged argmax with argmax over the whole logits), else None.
    Every rank makes the same host collectives whatever fails where, and no rank's kernel waits on a peer that has
    given up, so a failure cannot hang the group."""
    fused, shared = None, None
    try:
        fused = FusedAllReduceNorm(tp.rank, tp.size, device, hidden, dtype, vocab_shard_rows)
        shared = fused.ipc_handle()
    except Exception as e:  # no IPC on this device
        log.warning("fused all-reduce + RMSNorm: no exchange buffer (%s)", e)
    everyone: list = [None] * tp.size
    dist.all_gather_object(everyone, shared, group=tp.cpu_group)
    opened = False
    if all(h is not None for h in everyone):
        try:
            fused.open_peers(everyone)
            fused.warm_up(1e-5)
            opened = True
        except Exception as e:  # no peer access between these GPUs
            log.warning("fused all-reduce + RMSNorm: cannot reach the peers' buffers (%s)", e)
    if not _on_every_rank(opened, tp.cpu_group):
        return None
    if not _on_every_rank(_agrees_with_reference(fused, tp.rank, tp.size), tp.cpu_group):
        log.warning("fused all-reduce + RMSNorm disagreed with the reference on a rank; using NCCL")
        return None
    log.info("tensor parallel: decode all-reduces run fused with the residual add and RMSNorm")
    return fused


def _agrees_with_reference(fused: FusedAllReduceNorm, rank: int, world: int) -> bool:
    """Every rank draws every rank's rows from one seed, so each can check its result without a collective."""
    device, dtype, hidden = fused.device, fused.dtype, fused.hidden
    gen = torch.Generator(device=device).manual_seed(1234)
    try:
        for rows in (1, 3, 1, MAX_ROWS):  # both cells of row 0's senders, and every row
            partials = torch.randn(world, rows, hidden, generator=gen, device=device).to(dtype)
            residual = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
            weight = torch.randn(hidden, generator=gen, device=device).to(dtype)
            reduced = partials.float().sum(0).to(dtype)
            want_out, want_summed = reference.add_rms_norm(reduced, residual, weight, 1e-5)
            out, summed = fused(partials[rank].contiguous(), residual, weight, 1e-5, max_spins=_PROBE_SPINS)
            torch.cuda.synchronize(device)
            if fused.failed_waits() or not (torch.allclose(summed.float(), want_summed.float(), rtol=1e-2, atol=1e-2)
                                            and torch.allclose(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)):
                log.warning("fused all-reduce + RMSNorm: %d failed waits, max error %.3g", fused.failed_waits(),
                            (out.float() - want_out.float()).abs().max().item())
                return False
        return fused.vocab_shard_rows is None or _argmax_agrees(fused, rank, world, gen)
    except Exception as e:
        log.warning("fused all-reduce + RMSNorm failed its check (%s)", e)
        return False


def _argmax_agrees(fused: FusedAllReduceNorm, rank: int, world: int, gen: torch.Generator) -> bool:
    """The exchanged argmax against argmax over the whole logits, with the winner in each rank's shard."""
    width = fused.vocab_shard_rows
    logits = torch.randn(MAX_ROWS, world * width, generator=gen, device=fused.device).to(fused.dtype)
    logits[torch.arange(MAX_ROWS), torch.arange(MAX_ROWS) * width // 2 % (world * width)] = 100.0
    got = fused.argmax(logits[:, rank * width: (rank + 1) * width], rank * width, width, max_spins=_PROBE_SPINS)
    want = logits.float().argmax(dim=-1)
    torch.cuda.synchronize(fused.device)
    if fused.failed_waits() or not torch.equal(got, want):
        log.warning("exchanged argmax: %d failed waits, %d rows differ from argmax", fused.failed_waits(),
                    int((got != want).sum().item()))
        return False
    return True
