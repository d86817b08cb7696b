"""Where a decode step's GPU time goes, seen from the GPU's own clock: CUDA events recorded in the stream at five
points of each step, with no synchronisation (a few microseconds of host time an event).

    forward_start ... forward_end      the forward pass (graph replay or eager)
    forward_end ... masks_asked        the host still on its own work: reading the last step's tokens, adding them
    masks_asked ... sampling_start     the engine thread waiting for the structured outputs' masks, and their copy
    sampling_start ... sampling_end    masks applied, tokens picked
    sampling_end ... next forward_start  the host launching the next step

An event's time is when the GPU reached it: where the GPU had nothing queued before it, that is when the host
recorded it, so a gap between two neighbours is time the GPU waited for the host (or the work launched between
them). With the GPU ahead of the host every gap is idle time; behind it, the gaps shrink to the work between them.
The host's clock is read at each mark too: host_* are the same phases by the host's clock, and lag_<mark> is how far
behind the host the GPU reached the mark (about 0 where the GPU waited for the host; the work still queued
otherwise), against a reference taken with the device idle when the timeline starts.

Used by bench/structured.py --gpu-timeline; the engine runs as always, its runner's methods wrapped per instance."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

MARKS = ("forward_start", "forward_end", "masks_asked", "sampling_start", "sampling_end")
PHASES = {  # name: (from mark, to mark, steps ahead of the to mark)
    "forward_ms": ("forward_start", "forward_end", 0),
    "host_before_masks_ms": ("forward_end", "masks_asked", 0),
    "masks_wait_ms": ("masks_asked", "sampling_start", 0),
    "sampling_ms": ("sampling_start", "sampling_end", 0),
    "launch_gap_ms": ("sampling_end", "forward_start", 1),
}


class GpuTimeline:
    """Records MARKS around the runner's forward pass, the token masker's for_step and the sampler while `active`;
    summary() gives each phase's median and mean over the complete steps."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._active = False
        self.steps: list[dict[str, tuple[torch.cuda.Event, float]]] = []
        self._reference: tuple[torch.cuda.Event, float] | None = None
        self._wrap(runner, "run_model", "forward_start", "forward_end")
        self._wrap(runner.token_masker, "for_step", "masks_asked", None)
        self._wrap(runner.sampler, "token_tensor", "sampling_start", "sampling_end")

    def _wrap(self, owner: Any, name: str, before: str, after: str | None) -> None:
        method: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._mark(before)
            out = method(*args, **kwargs)
            if after is not None:
                self._mark(after)
            return out

        setattr(owner, name, timed)

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, on: bool) -> None:
        if on and not self._active:
            torch.cuda.synchronize()
            self._reference = self._event_now()
        self._active = on

    @staticmethod
    def _event_now() -> tuple[torch.cuda.Event, float]:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, time.perf_counter()

    def _mark(self, name: str) -> None:
        if not self._active:
            return
        if name == "forward_start" or not self.steps:
            self.steps.append({})
        self.steps[-1][name] = self._event_now()

    def summary(self) -> dict[str, float]:
        """Each phase's median and mean in ms over the steps that recorded every mark (and, for the launch gap, whose
        next step did too); the marks recorded since are cleared."""
        torch.cuda.synchronize()
        steps = [s for s in self.steps if all(m in s for m in MARKS)]
        self.steps = []
        out: dict[str, float] = {"timeline_steps": float(len(steps))}
        for phase, (start, end, ahead) in PHASES.items():
            pairs = [(steps[i][start], steps[i + ahead][end]) for i in range(len(steps) - ahead)]
            if not pairs:
                continue
            gpu = [a[0].elapsed_time(b[0]) for a, b in pairs]
            host = [(b[1] - a[1]) * 1e3 for a, b in pairs]
            out[f"gpu_{phase}_median"], out[f"gpu_{phase}_mean"] = statistics.median(gpu), statistics.fmean(gpu)
            out[f"host_{phase}_median"], out[f"host_{phase}_mean"] = statistics.median(host), statistics.fmean(host)
        if self._reference is not None and steps:
            event, host_s = self._reference
            for mark in ("forward_start", "sampling_start"):
                lags = [event.elapsed_time(s[mark][0]) - (s[mark][1] - host_s) * 1e3 for s in steps]
                out[f"lag_{mark}_median"] = statistics.median(lags)
        if len(steps) > 1:
            first, last = steps[0]["forward_start"], steps[-1]["forward_start"]
            out["gpu_step_ms_mean"] = first[0].elapsed_time(last[0]) / (len(steps) - 1)
            out["host_step_ms_mean"] = (last[1] - first[1]) * 1e3 / (len(steps) - 1)
        return out
