"""Where the engine thread's time goes in a decode step, by the host's clock: each stage of LLMEngine.step timed
with perf_counter_ns around the call (its callees included), summed while `active`.

    step                 the whole of engine.step()
    hand_over_early      tokens handed to the mask processes before the engine reads them (both calls)
    schedule             the scheduler
    launch               the forward pass launched (inputs prepared, graph replayed)
    forward_launched     the token masker's collect once the forward is launched
    read_tokens          the last step's tokens read on the host (the wait for the device included)
    tokens_read          their hand-over to the mask processes (inside hand_over_early when that found them)
    add_tokens           the tokens appended, stop checks, detokenizing
    sample               the sampling launched (for_step and start_ahead inside it)
      masks              the token masker's for_step
      sampler            the sampler's launch
      start_ahead        the next step's masks set going
    outputs              the step's outputs built
    finish_step          the step's own tokens put in place

and, with mask processes, the token masker's parts (each inside one of the stages above): mask_send (_send_ahead),
mask_collect (_collect), mask_receive (the processes' replies read), mask_hand_over (a step handed to each process),
mask_stage (the device's copy of the tokens queued), mask_upload (the masks' copy queued behind the device's wait
for the processes), mask_device_wait (that wait queued).

A stage's own overhead is about a quarter of a microsecond a call. Used by bench/structured.py --host-stages; the
engine runs as always, its methods wrapped per instance (DeferredTokens.read on its class, while active)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

from engine.deferred_tokens import DeferredTokens


class HostStages:
    def __init__(self, engine: Any) -> None:
        self.active = False
        self._ns: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        runner, masker = engine.runner, engine.runner.token_masker
        for owner, name, stage in ((engine, "step", "step"), (engine, "_hand_over_early", "hand_over_early"),
                                   (engine, "_schedule", "schedule"), (engine, "_launch", "launch"),
                                   (masker, "forward_launched", "forward_launched"),
                                   (masker, "tokens_read", "tokens_read"), (engine, "_add_tokens", "add_tokens"),
                                   (runner, "sample_tokens", "sample"), (masker, "for_step", "masks"),
                                   (runner.sampler, "token_tensor", "sampler"), (masker, "start_ahead", "start_ahead"),
                                   (engine.output_processor, "outputs", "outputs"),
                                   (engine, "_finish_step", "finish_step")):
            setattr(owner, name, self._timed(getattr(owner, name), stage))
        pool = engine.grammars.pool
        if pool is not None:
            for owner, name, stage in ((masker, "_send_ahead", "mask_send"), (masker, "_collect", "mask_collect"),
                                       (masker, "_upload_waited", "mask_upload"), (pool, "receive", "mask_receive"),
                                       (pool, "_hand_over", "mask_hand_over"),
                                       (pool, "stage_device_tokens", "mask_stage"),
                                       (pool, "wait_on_device", "mask_device_wait")):
                setattr(owner, name, self._timed(getattr(owner, name), stage))
        self._read = DeferredTokens.read
        DeferredTokens.read = self._timed(self._read, "read_tokens")

    def _timed(self, method: Callable[..., Any], stage: str) -> Callable[..., Any]:
        ns, calls, clock = self._ns, self._calls, time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return method(*args, **kwargs)
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                ns[stage] += clock() - started
                calls[stage] += 1

        return timed

    def summary(self) -> dict[str, float]:
        """Each stage's mean ms a step (steps: the calls of step()) since the last summary; the totals cleared."""
        steps = self._calls.get("step", 0)
        out = {f"host_stage_{stage}_ms": total / steps * 1e-6 for stage, total in self._ns.items()} if steps else {}
        self._ns.clear()
        self._calls.clear()
        return out

    def close(self) -> None:
        DeferredTokens.read = self._read
