"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step is ~350 short kernels in a row. Launched with PDL, a kernel is set up while the one before it in the
stream still runs and starts the moment it ends; each such kernel calls `wait_for_earlier_kernels` before touching
memory, which returns once the earlier kernel has finished and its writes are visible. Kernels launched without PDL
(PyTorch's, NCCL's) keep the ordinary full dependency on both sides. The kernels compiled by NVRTC launch with it
through kernels/cuda_launch.py.

The GEMVs never trigger their dependents early (`gdc_launch_dependents`): on an H200, letting the next kernel's
programs start at the top of each kernel and wait on the SMs made batch-1 decode of a Llama-3-8B 8% slower in bf16
(thousands of waiting one-warp GEMV programs), while launching at the end gained 1-2%; in int4, triggering at the
top of the int8-activation GEMV, at the end of its main loop, or with its blocks prefetching their weights into L2
while they wait, cost 1-17%. Decode attention, its split reduction and the norm, whose programs are few, let the next
kernel launch once their main work is done and only their stores are left: +0.5% in int4, +0.2% in bf16
(BENCHMARKS.md).

On wherever the device has compute capability >= 9, except in Triton's interpreter."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on t launch with PDL."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(t: torch.Tensor, early: bool = False) -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that takes `PDL: tl.constexpr = False`: the constexpr and Triton's
    launch flag set together, or nothing (the interpreter and older GPUs). early: for a kernel that also takes
    `EARLY: tl.constexpr = False` and calls `let_later_kernels_launch(EARLY)` once its main work is done."""
    if not enabled(t):
        return {}
    return {"PDL": True, "EARLY": True, "launch_pdl": True} if early else {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_for_earlier_kernels(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_later_kernels_launch(EARLY: tl.constexpr):
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
