"""Moving a loaded network's tensors off its device and back, for engine sleep (engine/sleep.py).

Every tensor the network holds on its device (parameters, buffers, and plain tensor attributes such as an fp8 KV
cache's scales or tinygemm's packed copy) is found once; each keeps its Python object, and only its storage is
swapped (`tensor.data = ...`), so whatever holds a reference to it sees the change. While offloaded each holds an
empty tensor of its dtype: a forward pass that ran by mistake would fail at once instead of reading stale memory.

On the host the bytes live in one flat buffer (pinned on CUDA, so the copy back runs at the link's speed and needs
one transfer); on wake one device buffer of the same size takes them, and each tensor becomes a view into it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN_BYTES = 256  # every tensor starts at a multiple of this in the flat buffers: any dtype can view it


@dataclass(frozen=True)
class _Slot:
    tensor: torch.Tensor
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    packed: bool  # contiguous: its elements alone were copied; else its whole storage


def network_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The distinct tensors the network holds (each object once), in a fixed order."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []

    def add(value: object) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)

    for module in model.modules():
        for value in module._parameters.values():
            add(value)
        for value in module._buffers.values():
            add(value)
        for value in vars(module).values():
            if isinstance(value, (tuple, list)):
                for item in value:
                    add(item)
            else:
                add(value)
    return found


def indexed_device(device: torch.device) -> torch.device:
    """The device with its index: a tensor's .device always has one, and torch.device("cuda") != "cuda:0"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _layout(tensors: list[torch.Tensor]) -> tuple[list[_Slot], int]:
    slots, offset = [], 0
    for t in tensors:
        packed = t.is_contiguous()
        nbytes = t.numel() * t.element_size() if packed else t.untyped_storage().nbytes()
        slots.append(_Slot(t, offset, nbytes, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
                           packed))
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return slots, offset


def _as_bytes(slot: _Slot) -> torch.Tensor:
    """The tensor's bytes, flat: its elements in order for a packed one, its whole storage otherwise."""
    t = slot.tensor
    if slot.packed:
        return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    raw = flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype)
    if slot.packed:
        return raw.view(slot.shape)
    # a strided view of the whole storage it was copied with; as_strided counts from the flat buffer's start
    return raw.as_strided(slot.shape, slot.stride, raw.storage_offset() + slot.storage_offset)


class WeightOffload:
    """The network's device tensors, to be moved to the host (keep=True) or dropped, and restored."""

    def __init__(self, model: nn.Module, device: torch.device, host: torch.Tensor | None = None) -> None:
        """`host`: the buffer of an earlier sleep, reused when the size fits (pinning gigabytes takes seconds)."""
        self.device = indexed_device(device)
        tensors = [t for t in network_tensors(model) if t.device == self.device]
        self._slots, self.nbytes = _layout(tensors)
        self._host = host if host is not None and host.numel() == self.nbytes else None
        self.offloaded = False

    @property
    def host(self) -> torch.Tensor | None:
        """The host buffer (to hand to the next sleep's WeightOffload)."""
        return self._host

    @torch.inference_mode()
    def offload(self, keep: bool) -> None:
        """Copies the tensors to the host buffer when `keep`, then lets go of their device memory."""
        if keep:
            if self._host is None:
                self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            for slot in self._slots:
                self._host[slot.offset: slot.offset + slot.nbytes].copy_(_as_bytes(slot), non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        else:
            self._host = None
        self.release_device()

    def release_device(self) -> None:
        """Lets go of the tensors' device memory; a host copy, if any, stays."""
        for slot in self._slots:
            slot.tensor.data = torch.empty(0, dtype=slot.dtype, device=self.device)
        self.offloaded = True

    @property
    def has_host_copy(self) -> bool:
        return self._host is not None and self.offloaded

    @torch.inference_mode()
    def restore(self) -> None:
        """Brings the host copy back in one transfer; the tensors become views of one device buffer. On failure
        (out of memory) nothing changes and the host copy stays."""
        if not self.has_host_copy:
            raise RuntimeError("weights: there is no host copy to restore (level 2 sleep dropped them)")
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        flat.copy_(self._host, non_blocking=True)
        for slot in self._slots:
            slot.tensor.data = _view(flat, slot)
        self.offloaded = False
