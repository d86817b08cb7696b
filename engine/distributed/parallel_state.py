"""The tensor-parallel group a model shard belongs to, and the collectives its layers call.

With size 1 every collective is a no-op and torch.distributed is never touched, so a single-GPU or
CPU engine runs exactly as before."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import kernels as ops


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # NCCL on GPUs, gloo on CPU: the collectives inside the forward pass
    cpu_group: Any = None  # gloo: host-side messages (each step's inputs, the KV pool size)
    fused_norm: Any = None  # FusedAllReduceNorm (engine/distributed/peer_exchange.py) on GPUs, when it works

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard_size(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"tensor_parallel_size: {self.size} does not divide the model's {what} ({total})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks; may return a new tensor rather than reduce `x` in place."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm(sum of `partial` over the ranks, residual, weight, eps); one kernel for decode-sized rows."""
        if self.fused_norm is not None and self.fused_norm.handles(partial):
            return self.fused_norm(partial, residual, weight, eps)
        return ops.add_rms_norm(self.all_reduce(partial), residual, weight, eps)

    def all_reduce_rms_norm(self, partial: torch.Tensor, weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum of `partial` over the ranks, weight, eps), the sum): all_reduce_add_rms_norm without a
        residual."""
        if self.fused_norm is not None and self.fused_norm.handles(partial):
            return self.fused_norm(partial, None, weight, eps)
        reduced = self.all_reduce(partial)
        return ops.rms_norm(reduced, weight, eps), reduced

    def argmax_over_shards(self, logits: torch.Tensor, offset: int, width: int) -> torch.Tensor:
        """[N] int64 on every rank: each row's argmax over the vocabulary split across the ranks, from this rank's
        logits [N, V <= width] of ids offset .. offset + V; through the peer buffers when they take it, else each
        rank's chunk candidates (kernels.argmax_candidates) gathered."""
        if self.fused_norm is not None and self.fused_norm.handles_argmax(logits, width):
            return self.fused_norm.argmax(logits, offset, width)
        return ops.pick_argmax_candidate(self.all_gather_stacked(ops.argmax_candidates(logits, offset, width)))

    def release_peer_buffers(self) -> None:
        """Unmaps the peers' exchange buffers (the fused path is off from here on)."""
        self.fused_norm = None

    def all_gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x stacked along a new first dimension [size, *x.shape], in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        x = x.contiguous()
        gathered = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x, group=self.device_group)  # gloo wants the ranks along dim 0
        return gathered.view(self.size, *x.shape)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension. Gathered into one tensor (rank-major rows), which
        for one row is already the result; more rows take one copy to interleave them."""
        if self.size == 1:
            return x
        rows = x.reshape(-1, x.shape[-1])
        side_by_side = self.all_gather_stacked(rows).transpose(0, 1).reshape(rows.shape[0], -1)
        return side_by_side.view(*x.shape[:-1], self.size * x.shape[-1])

    def min_over_ranks(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TensorParallel()


# Ranks other than 0 wait on the host group for the next step, however long the engine sits idle.
_IDLE_TIMEOUT = timedelta(days=30)
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def init_tensor_parallel(rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
    """Joins (rank 0: creates) the process group of `size` ranks rendezvousing on 127.0.0.1:port."""
    if size == 1:
        return SINGLE
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=_COLLECTIVE_TIMEOUT)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallel(rank=rank, size=size, device_group=device_group, cpu_group=cpu_group)


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    tp.release_peer_buffers()
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
