"""Output processing: a step's new tokens into each sequence's tokens and text, and each request's RequestOutput.

Each token is appended (with its logprob), detokenized and checked against the stops: a stop token, end of
sequence, a stop string, max_tokens, the model's context. The sequences that stop go back to the engine, which frees
them. Each request that got tokens then gets a RequestOutput with the totals and what was added since its last one;
text that may still turn out to begin a stop string is held back until it cannot."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from engine.config import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import EngineMetrics
from engine.outputs import CompletionDelta, CompletionOutput, Delta, RequestMetrics, RequestOutput, metrics_tuple
from engine.sequence import SampledToken, Sequence
from engine.tokenizer import Tokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    stream: bool
    account: str | None = None  # whose GPU time the request's steps are (EngineMetrics.busy_seconds_by_account)
    # what its deltas have carried so far: metrics go out with the first delta, the first token's and the last
    delta_sent: bool = False
    first_token_sent: bool = False

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].finished if len(seqs) == 1 else all(seq.finished for seq in seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int,
                 metrics: EngineMetrics, stream_interval: int = 1) -> None:
        """`stream_interval`: deltas() hands over a request's tokens once this many have gathered (its first token and
        its end at once): fewer, larger deltas cost the step less host time."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self._touched: dict[str, RequestState] = {}  # requests with tokens since the last outputs()

    def add_request(self, state: RequestState) -> None:
        if self.tokenizer is not None:
            for seq in state.seqs:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                                         state.params.skip_special_tokens)
        self.requests[state.request_id] = state

    def pop_request(self, request_id: str) -> RequestState | None:
        self._touched.pop(request_id, None)
        return self.requests.pop(request_id, None)

    def add_tokens(self, sampled: list[SampledToken]) -> list[Sequence]:
        """Appends each token to its sequence; returns the sequences that stopped, in the order they did."""
        now = time.monotonic()
        stopped = []
        requests, touched = self.requests, self._touched
        added = 0
        for item in sampled:
            seq = item.seq
            if seq.finish_reason is not None:  # finished before, or a kept draft after a stop in this step
                continue
            added += 1
            state = requests[seq.request_id]
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if self._append_token(item):
                stopped.append(seq)
            touched[seq.request_id] = state
        self.metrics.generation_tokens += added
        return stopped

    def outputs(self) -> list[RequestOutput]:
        """The outputs of the requests with tokens since the last call (of finished requests, and of streamed ones
        at every step); finished requests are forgotten."""
        return [self.output(state) for state in self.take_touched() if state.stream or state.finished]

    def deltas(self) -> list[Delta]:
        """What each request with tokens since the last call added (the serving path; engine/outputs.py's Delta): no
        totals are copied, so a step costs the same at its thousandth token as at its first."""
        out = []
        interval = self.stream_interval
        for state in self.take_touched():
            if interval > 1 and state.first_token_sent and not state.finished and max(
                    seq.num_tokens - seq.num_prompt_tokens - seq.num_emitted_tokens for seq in state.seqs) < interval:
                self._touched[state.request_id] = state  # gathers until the interval is full
                continue
            out.append(self.delta(state))
        return out

    def take_touched(self) -> list[RequestState]:
        """The requests with tokens since the last call; the finished ones among them are forgotten."""
        now = time.monotonic()
        touched, self._touched = self._touched, {}
        for state in touched.values():
            if state.finished:
                del self.requests[state.request_id]
                state.metrics.finished_time = now
                self.metrics.record_request(state.metrics.arrival_time, state.metrics.first_token_time, now,
                                            max(seq.num_output_tokens for seq in state.seqs))
        return list(touched.values())

    def _append_token(self, item: SampledToken) -> bool:
        """Appends the token; True when the sequence stops with it (its finish_reason is set then)."""
        seq, token = item.seq, item.token_id
        params = seq.params
        token_ids = seq.token_ids
        token_ids.append(token)
        logprobs = seq.logprobs if item.logprob is not None else None
        if logprobs is not None:
            logprobs.append(item.logprob)
        finish: str | None = None
        stop_reason: str | int | None = None
        if token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            finish = "stop"
        detokenizer = seq.detokenizer
        if finish is None and detokenizer is not None:
            new_text = detokenizer.add_token(token)
            if new_text:
                seq.text += new_text
                if params.stop:
                    finish, stop_reason = _check_stop_strings(seq, len(new_text))
        if finish is None:
            num_tokens = len(token_ids)
            if not (params.max_tokens is not None and num_tokens - seq.num_prompt_tokens >= params.max_tokens
                    or num_tokens >= self.max_model_len):
                if logprobs is not None:
                    seq.logprob_text_ends.append(len(seq.text))
                return False
            finish = "length"
        stopped_by_token = finish == "stop" and not isinstance(stop_reason, str)
        if detokenizer is not None and not isinstance(stop_reason, str):
            # the text held back for a character that was still to complete goes out, less that character
            held = detokenizer.finish()
            if held:
                seq.text += held
                if params.stop:
                    stop_finish, stop_string = _check_stop_strings(seq, len(held))
                    if stop_finish is not None:
                        finish, stop_reason = stop_finish, stop_string
        if logprobs is not None:
            seq.logprob_text_ends.append(len(seq.text))
            if stopped_by_token:  # the end of sequence or a stop token is no part of the output's text
                logprobs.pop()
                seq.logprob_text_ends.pop()
        if isinstance(stop_reason, str) and seq.logprobs is not None:
            _drop_logprobs_past(seq, len(seq.text))
        seq.finish_reason, seq.stop_reason = finish, stop_reason
        return True

    @staticmethod
    def output(state: RequestState) -> RequestOutput:
        """The request's output now: totals, and the deltas since the last output made."""
        completions = []
        for seq in state.seqs:
            _, delta_text, delta_ids, delta_lp, _, _ = _emit(seq)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text[:seq.num_emitted_chars],
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                    delta_logprobs=delta_lp,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            metrics=state.metrics,
        )

    @staticmethod
    def delta(state: RequestState) -> Delta:
        """What the request added since its last output or delta."""
        metrics = None
        m = state.metrics
        finished = state.finished
        if finished or not state.first_token_sent and (m.first_token_time is not None or not state.delta_sent):
            metrics = metrics_tuple(m)
            state.delta_sent, state.first_token_sent = True, m.first_token_time is not None
        return state.request_id, finished, [_emit(seq) for seq in state.seqs], metrics


def _emit(seq: Sequence) -> CompletionDelta:
    """The sequence's tokens and text since the last emission, marked emitted. Text that may still turn out to
    begin a stop string is held back until it cannot."""
    text, stop = seq.text, seq.params.stop
    if stop and not seq.finished:
        visible = max(seq.num_emitted_chars, len(text) - max(len(s) for s in stop) + 1)
    else:
        visible = len(text)
    ids = seq.token_ids
    start = seq.num_prompt_tokens + seq.num_emitted_tokens
    delta_ids = ids[start:]
    delta_text = text[seq.num_emitted_chars:visible] if visible > seq.num_emitted_chars else ""
    delta_lp = None
    if seq.logprobs is not None:
        # while a stop string not found yet can still begin at `visible`, only the tokens whose text begins before
        # it (one whose text is held back for a character still to complete begins past it)
        ready = _tokens_beginning_before(seq, visible) if stop and not seq.finished else len(seq.logprobs)
        delta_lp = seq.logprobs[seq.num_emitted_logprobs:ready]
        seq.num_emitted_logprobs = max(seq.num_emitted_logprobs, ready)
    seq.num_emitted_tokens += len(delta_ids)
    seq.num_emitted_chars = visible
    return seq.index, delta_text, delta_ids, delta_lp, seq.finish_reason, seq.stop_reason


def _tokens_beginning_before(seq: Sequence, chars: int) -> int:
    """How many of the tokens with logprobs begin their text before character `chars` (token i begins where token
    i - 1's text ends)."""
    return min(len(seq.logprob_text_ends), bisect.bisect_left(seq.logprob_text_ends, chars) + 1) if chars else 0


def _drop_logprobs_past(seq: Sequence, cut: int) -> None:
    """Drops the logprobs of the tokens whose text begins at or past `cut`, where a stop string cut the text."""
    keep = max(_tokens_beginning_before(seq, cut), seq.num_emitted_logprobs)
    del seq.logprobs[keep:], seq.logprob_text_ends[keep:]


def _check_stop_strings(seq: Sequence, num_new_chars: int) -> tuple[str | None, str | None]:
    params = seq.params
    longest = max(len(s) for s in params.stop)
    search_from = max(0, len(seq.text) - num_new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for stop in params.stop:
        at = seq.text.find(stop, search_from)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None, None
    at, stop = best
    seq.text = seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
    return "stop", stop
