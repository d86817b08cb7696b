"""One request's outputs on its consumer's event loop.

The engine hands over what each step added (engine/outputs.py's Delta tuples); this rebuilds the totals a RequestOutput carries. Steps
that arrive while the consumer is busy (writing to a slow client, say) wait here and are handed over together as one
output, as vLLM v1's output collector does: a consumer behind by k steps catches up in one wake-up instead of k, so
the engine never waits for it and the consumer's cost per token falls as load rises."""

from __future__ import annotations

import asyncio

from engine.outputs import CompletionOutput, Delta, RequestMetrics, RequestOutput, TokenLogprob


class _Totals:
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "stop_reason")

    def __init__(self, with_logprobs: bool) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class RequestStream:
    """Filled on the consumer's loop by `put` / `fail`; read by `get`. Not thread-safe: the engine's side reaches
    it through `loop.call_soon_threadsafe`."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int, with_logprobs: bool,
                 metrics: RequestMetrics, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self._prompt = prompt
        self._prompt_token_ids = prompt_token_ids
        self._totals = [_Totals(with_logprobs) for _ in range(n)]
        self._metrics = metrics  # the latest a delta carried
        self._pending: list[Delta] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: Delta) -> None:
        self._pending.append(delta)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    async def get(self) -> RequestOutput:
        """Everything that arrived since the last call, as one output; raises the engine's error for this request."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending, self._pending = self._pending, []
        return self._merge(pending)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _merge(self, deltas: list[Delta]) -> RequestOutput:
        for _, _, _, metrics in deltas:
            if metrics is not None:
                self._metrics = RequestMetrics(*metrics) if isinstance(metrics, tuple) else metrics
        completions = []
        for i, totals in enumerate(self._totals):
            parts = [d[2][i] for d in deltas]
            if len(parts) == 1:
                index, delta_text, delta_ids, delta_lp, finish, stop = parts[0]
                delta_ids = list(delta_ids)
            else:
                index, _, _, _, finish, stop = parts[-1]
                delta_text = "".join(p[1] for p in parts)
                delta_ids = [t for p in parts for t in p[2]]
                delta_lp = None if totals.logprobs is None else [lp for p in parts for lp in (p[3] or ())]
            if totals.logprobs is not None:
                delta_lp = list(delta_lp or ())
                totals.logprobs.extend(delta_lp)
            totals.token_ids.extend(delta_ids)
            totals.text += delta_text
            totals.finish_reason, totals.stop_reason = finish, stop
            completions.append(CompletionOutput(
                index=index, text=totals.text, token_ids=list(totals.token_ids), finish_reason=finish,
                stop_reason=stop, logprobs=list(totals.logprobs) if totals.logprobs is not None else None,
                delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_lp))
        return RequestOutput(self.request_id, self._prompt, self._prompt_token_ids, completions, deltas[-1][1],
                             self._metrics)
