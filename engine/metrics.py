"""Engine counters: TTFT, TPOT, tokens/s, KV-cache use, busy and idle seconds."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class EngineMetrics:
    started_at: float = field(default_factory=time.monotonic)
    num_requests_finished: int = 0
    num_steps: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    asleep_seconds: float = 0.0  # time with nothing to do spent asleep (engine/sleep.py): not idle on the GPU
    # busy_seconds split over the requests' accounts by their tokens in each step (LLMEngine._count_step_tokens)
    busy_seconds_by_account: dict[str | None, float] = field(default_factory=dict)
    # speculative decoding: sequence-steps that verified drafts, draft tokens verified, draft tokens kept
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    ttft_seconds: deque = field(default_factory=lambda: deque(maxlen=4096))
    tpot_seconds: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add_busy(self, seconds: float, tokens_by_account: dict[str | None, int]) -> None:
        self.busy_seconds += seconds
        total = sum(tokens_by_account.values())
        shares = {a: n / total for a, n in tokens_by_account.items()} if total else {None: 1.0}
        for account, share in shares.items():
            self.busy_seconds_by_account[account] = self.busy_seconds_by_account.get(account, 0.0) + seconds * share

    def record_request(self, arrival: float, first_token: float | None, finished: float, num_output_tokens: int) -> None:
        self.num_requests_finished += 1
        if first_token is None:
            return
        self.ttft_seconds.append(first_token - arrival)
        if num_output_tokens > 1:
            self.tpot_seconds.append((finished - first_token) / (num_output_tokens - 1))

    def snapshot(self, kv_blocks_used: int, kv_blocks_total: int, num_running: int, num_waiting: int) -> dict:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        ttft, tpot = list(self.ttft_seconds), list(self.tpot_seconds)
        return {
            "num_requests_finished": self.num_requests_finished,
            "num_running": num_running,
            "num_waiting": num_waiting,
            "num_steps": self.num_steps,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "generation_tokens": self.generation_tokens,
            "generation_tokens_per_s": self.generation_tokens / elapsed,
            "num_preemptions": self.num_preemptions,
            "kv_blocks_used": kv_blocks_used,
            "kv_blocks_free": kv_blocks_total - kv_blocks_used,
            "kv_blocks_total": kv_blocks_total,
            "kv_cache_usage": kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0,
            "busy_seconds": self.busy_seconds,
            "busy_seconds_by_account": dict(self.busy_seconds_by_account),
            "idle_seconds": self.idle_seconds,
            "asleep_seconds": self.asleep_seconds,
            "ttft_p50_s": _percentile(ttft, 0.5),
            "ttft_p99_s": _percentile(ttft, 0.99),
            "tpot_p50_s": _percentile(tpot, 0.5),
            "tpot_p99_s": _percentile(tpot, 0.99),
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_acceptance_rate": self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None,
            # draft tokens kept per verification (0..k); each verification also yields one token of the target's
            "spec_mean_accepted_length": (self.spec_accepted_tokens / self.spec_verifications
                                          if self.spec_verifications else None),
        }
