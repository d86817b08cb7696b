"""CUDA driver calls that torch lacks or makes dear, through ctypes on libcuda: a stream that waits on a counter in
host memory (cuStreamWaitValue32), and copies to and from the device with their events, launched in a few
microseconds (torch's stream context, non-blocking copy, wait_stream and record_stream cost the engine thread about
50 us a step).

A stream waiting on a counter holds its later work until (int32)(*counter - value) >= 0, a greater-or-equal that
survives the counter's 32-bit wrap; the counter's memory must be registered with CUDA (cudaHostRegister) and is
addressed by its device address. Work on other streams that must follow it waits on an event recorded behind it,
which CUDA does see. A counter that never gets there holds the stream, and all behind it, for ever: whoever queues
a wait must make sure the counter arrives, and raise it themselves if the process that should has died."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING


class StreamOps:
    def __init__(self, driver: ctypes.CDLL) -> None:
        def function(name: str, *argtypes):
            f = getattr(driver, name)
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f

        p, u64, u32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint
        self._device_pointer = function("cuMemHostGetDevicePointer_v2", ctypes.POINTER(u64), p, u32)
        self._wait = function("cuStreamWaitValue32_v2" if hasattr(driver, "cuStreamWaitValue32_v2")
                              else "cuStreamWaitValue32", p, u64, ctypes.c_uint32, u32)
        self._copy = function("cuMemcpyHtoDAsync_v2", u64, p, ctypes.c_size_t, p)
        self._copy_back = function("cuMemcpyDtoHAsync_v2", p, u64, ctypes.c_size_t, p)
        self._event_create = function("cuEventCreate", ctypes.POINTER(p), u32)
        self._record = function("cuEventRecord", p, p)
        self._wait_event = function("cuStreamWaitEvent", p, p, u32)

    @staticmethod
    def _check(error: int, what: str) -> None:
        if error:
            raise RuntimeError(f"{what} failed (CUresult {error})")

    def device_address(self, host_address: int) -> int:
        """The device's address of registered host memory."""
        out = ctypes.c_uint64()
        self._check(self._device_pointer(ctypes.byref(out), host_address, 0), "cuMemHostGetDevicePointer")
        return out.value

    def wait_value(self, stream: int, device_address: int, value: int) -> None:
        """Work queued on `stream` (a CUstream handle, as torch's Stream.cuda_stream) after this waits until the
        32-bit counter at device_address reaches value."""
        self._check(self._wait(stream, device_address, value & 0xFFFFFFFF, _WAIT_GEQ), "cuStreamWaitValue32")

    def copy_to_device(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """An asynchronous copy of nbytes from pinned (or registered) host memory to device memory on `stream`."""
        self._check(self._copy(destination, source, nbytes, stream), "cuMemcpyHtoDAsync")

    def copy_to_host(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """An asynchronous copy of nbytes from device memory to pinned (or registered) host memory on `stream`."""
        self._check(self._copy_back(destination, source, nbytes, stream), "cuMemcpyDtoHAsync")

    @staticmethod
    def current_stream(device_index: int) -> int:
        """The CUstream handle of torch's current stream on the device: torch.cuda.current_stream(d).cuda_stream
        without building a Stream object."""
        return torch._C._cuda_getCurrentRawStream(device_index)

    def new_event(self) -> int:
        """A CUevent without timing, for record / wait_event (never destroyed: one is kept per user)."""
        event = ctypes.c_void_p()
        self._check(self._event_create(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return event.value

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cuEventRecord")

    def wait_event(self, stream: int, event: int) -> None:
        """Work queued on `stream` after this waits for the work queued before the event's last record."""
        self._check(self._wait_event(stream, event, 0), "cuStreamWaitEvent")


@functools.cache
def stream_ops() -> StreamOps | None:
    """The driver's functions, or None where there is no CUDA driver or it lacks them (callers then wait on the
    host and copy through torch)."""
    if not torch.cuda.is_available():
        return None
    try:
        return StreamOps(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as error:
        log.info("CUDA stream memory operations unavailable (%s): masks are waited for on the host", error)
        return None
