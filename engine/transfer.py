"""Small host lists to the device without waiting for the GPU.

torch.tensor(values, device="cuda") copies from pageable memory, and such a copy synchronises the
stream: the host would wait for the step in flight. Through pinned memory the copy is queued instead."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(dtype)
    return host.to(dtype).pin_memory().to(device, non_blocking=True)
