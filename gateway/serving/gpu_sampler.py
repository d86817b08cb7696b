"""NVML utilisation samples of this process's GPUs (optional: only where pynvml imports and a GPU is
visible); the mean since start is reported with a replica's stats."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("tollgate.gpu")


class GpuSampler:
    def __init__(self, nvml: Any, handles: list[Any], every_s: float) -> None:
        self._nvml = nvml
        self._handles = handles
        self._every_s = every_s
        self._total = 0.0
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tollgate-nvml", daemon=True)

    @classmethod
    def maybe_start(cls, every_s: float = 1.0) -> "GpuSampler | None":
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            indices = [int(i) for i in visible.split(",") if i.strip().isdigit()] if visible else [0]
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except Exception:  # no pynvml, no driver, no GPU: no samples
            return None
        sampler = cls(pynvml, handles, every_s)
        sampler._thread.start()
        return sampler

    def mean(self) -> float | None:
        return self._total / self._count if self._count else None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            except Exception:
                log.debug("NVML sample failed", exc_info=True)
                continue
            self._total += sum(util) / len(util) / 100.0
            self._count += 1
