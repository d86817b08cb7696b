"""A low-latency all-reduce for the small tensors of decode steps, through PyTorch's symmetric memory:
every rank copies its input into a buffer all GPUs of the host can read over NVLink, and one kernel
per rank sums the peers' buffers (a "one-shot" all-reduce). NCCL needs several kernel stages and
protocol handshakes for the same few kilobytes.

PyTorch marks the API alpha, so the engine checks it against NCCL once at start and falls back to
NCCL when it is missing, fails, or disagrees."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = 4 << 20  # decode-sized tensors; prefill's large ones go through NCCL's bandwidth-optimal rings


class SymmetricAllReduce:
    def __init__(self, group, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = MAX_BYTES // torch.empty((), dtype=dtype).element_size()
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def handles(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        self.buffer[:n].copy_(x.view(-1))
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(self.buffer[:n], "sum", self.group_name, out.view(-1))
        return out


def try_symmetric_all_reduce(group, device: torch.device) -> SymmetricAllReduce | None:
    """The symmetric all-reduce if it works on this host and agrees with NCCL, else None (use NCCL).
    Every rank makes the same NCCL calls whatever happens here, so a failure on one cannot hang the other."""
    probe = torch.arange(4096 * 3, device=device, dtype=torch.float32).remainder(97).to(torch.bfloat16)
    probe.mul_(dist.get_rank(group) + 1)
    expected = probe.clone()
    dist.all_reduce(expected, group=group)
    fast: SymmetricAllReduce | None = None
    try:
        fast = SymmetricAllReduce(group, device)
        got = fast(probe)
        torch.cuda.synchronize(device)
        ok = torch.equal(got, expected)
    except Exception as e:  # missing operator, no P2P access, driver without IPC support
        log.info("symmetric-memory all-reduce unavailable (%s); using NCCL", e)
        ok = False
    agreed = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not agreed.item():
        if fast is not None:
            log.warning("symmetric-memory all-reduce disagreed with NCCL or failed on a peer; using NCCL")
        return None
    log.info("tensor parallel: small all-reduces use symmetric memory (one-shot)")
    return fast
