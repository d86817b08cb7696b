"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # the top alternatives at this position, best first: (token_id, logprob)
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    # prompt tokens served from the prefix cache vs. computed by a forward pass (summed over the n samples)
    num_cached_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


# The serving path's unit: what one request added in one step, as plain tuples. It crosses a process boundary every
# step (engine/core_process.py), and builtins pickle several times faster than dataclasses.
#   Delta = (request_id, finished, completions, metrics)
#   completions: one (index, text, token_ids, logprobs, finish_reason, stop_reason) per sequence, each the part added
#   since the request's previous delta (logprobs None unless asked for)
#   metrics: the request's RequestMetrics as a tuple of its fields, or None when unchanged since its previous delta
CompletionDelta = tuple[int, str, list[int], "list[TokenLogprob] | None", "str | None", "str | int | None"]
Delta = tuple[str, bool, list[CompletionDelta], "tuple | None"]


def metrics_tuple(m: RequestMetrics) -> tuple:
    return (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_prompt_tokens,
            m.num_cached_tokens, m.num_computed_prompt_tokens, m.num_preemptions)
