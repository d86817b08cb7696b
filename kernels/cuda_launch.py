"""Launches a kernel compiled by NVRTC (`torch.cuda._compile_kernel`) through the driver's cuLaunchKernelEx, so that
it can launch with programmatic dependent launch (kernels/pdl.py) like the Triton kernels around it. Where the driver
call or the kernel's handle is missing, the kernel's own launch (without PDL) runs."""

from __future__ import annotations

import ctypes
import functools

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    try:
        from torch.cuda._utils import _get_gpu_runtime_library

        function = _get_gpu_runtime_library().cuLaunchKernelEx
    except (ImportError, OSError, AttributeError):
        return None
    function.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return function


def _argument(arg: torch.Tensor | int | float):
    if isinstance(arg, torch.Tensor):
        return ctypes.c_void_p(arg.data_ptr())
    if isinstance(arg, bool) or not isinstance(arg, (int, float)):
        raise TypeError(f"kernel arguments are tensors, ints and floats, got {type(arg).__name__}")
    return ctypes.c_int(arg) if isinstance(arg, int) else ctypes.c_double(arg)


def launch(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, pdl: bool) -> None:
    """Runs kernel on the current stream; pdl: it may be set up while the kernel before it runs and must call
    `griddepcontrol.wait` before reading what that kernel wrote."""
    launch_ex = _launch_kernel_ex()
    if not pdl or launch_ex is None or not hasattr(kernel, "func"):
        kernel(grid=grid, block=block, args=args)
        return
    values = [_argument(arg) for arg in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block), shared_mem=0,
                           stream=torch.cuda.current_stream().cuda_stream, attrs=ctypes.pointer(attribute),
                           num_attrs=1)
    status = launch_ex(ctypes.byref(config), kernel.func, pointers, None)
    if status:
        from torch.cuda._utils import _check_cuda

        _check_cuda(status)
