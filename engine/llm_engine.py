"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, SamplingParams
from engine.deferred_tokens import PENDING_TOKEN, DeferredTokens
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import PromptTooLongError
from engine.kv_cache import KVCacheManager
from engine.distributed.parallel_state import SINGLE
from engine.distributed.workers import TensorParallelWorkers
from engine.metrics import EngineMetrics
from engine.model_builder import build_model
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.runner import SampledToken
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec_decode.speculator import make_speculator

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA was asked for but is not available")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = _DTYPES[config.dtype]
    return device, dtype


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    stream: bool

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.device, self.dtype = resolve_device_and_dtype(config)
        torch.manual_seed(config.seed)
        log.info("loading %s on %s (%s)", config.model, self.device, self.dtype)
        # a draft model loads first: on a GPU the target's KV pool is sized from the memory left after it
        self.speculator = make_speculator(config, self.device, self.dtype)
        self.workers = None
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            self.workers = TensorParallelWorkers.start(config, self.device, self.dtype)
            tp = self.workers.tp
        try:
            built = build_model(config, self.device, self.dtype, tp)
            if self.speculator is not None:
                self.speculator.check_target(built.model_config, built.max_model_len)
        except BaseException:
            self.close()
            raise
        self.model_config = built.model_config
        self.tokenizer = built.tokenizer
        self.max_model_len = built.max_model_len
        self.eos_token_ids = built.eos_token_ids
        self.runner = built.runner
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, RequestState] = {}
        self.metrics = EngineMetrics()
        self.overlap = config.async_scheduling and self.speculator is None
        self.in_flight: DeferredTokens | None = None  # the last step's tokens, sampled but not read yet
        self.load_seconds = time.perf_counter() - started
        log.info("engine ready in %.1f s: max_model_len=%d, %d KV blocks", self.load_seconds, self.max_model_len,
                 self.runner.num_blocks)

    # ---- requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | SequenceOf[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            bos = self.tokenizer.bos_token_id
            if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
                ids = ids[1:]  # the text (e.g. a rendered chat template) already began with BOS
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        stream: bool = True,
    ) -> None:
        """Validates and queues a request. Bad input raises ValueError and changes nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text, ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if self.kv.blocks_needed(longest) > self.kv.num_blocks:
            raise ValueError(
                f"prompt: {longest} tokens need {self.kv.blocks_needed(longest)} KV blocks, the pool has {self.kv.num_blocks}"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(request_id, i, ids, params, priority, arrival, seed, self.device)
            seq.max_num_tokens = longest
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            seqs.append(seq)
        state = RequestState(request_id, text, ids, params, seqs, RequestMetrics(arrival, num_prompt_tokens=len(ids)),
                             stream)
        self.requests[request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.finished:
                _drop_pending_token(seq)
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        state.metrics.finished_time = time.monotonic()
        return self._output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, then reads the tokens of the step before it (async scheduling) or of
        this one; returns the requests with new output."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.metrics.num_preemptions += len(batch.preempted)
        for seq in batch.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
        previous = self.in_flight
        greedy = None
        if batch.seqs:
            self._count_prompt_tokens(batch)
            if self.overlap and self.runner.picks_greedy_on_shards(batch.seqs):
                greedy = self.runner.forward_greedy(batch, previous)
            else:
                logits, sampled_seqs = self.runner.forward_logits(batch, previous)
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
                seq.num_computed_tokens += num_new
            self.metrics.num_steps += 1
        self.in_flight = None  # kept until here, so a step that failed to launch leaves it for the next one
        touched: dict[str, RequestState] = {}
        if previous is not None:
            self._accept(self._read_in_flight(previous), touched)
        deferred = None
        if greedy is not None:
            for seq in batch.seqs:
                self.kv.cache_computed_blocks(seq)
            deferred = greedy if greedy.seqs else None
        elif batch.seqs:
            if self.overlap and sampled_seqs and all(seq.logprobs is None for seq in sampled_seqs):
                for seq in batch.seqs:
                    self.kv.cache_computed_blocks(seq)
                deferred = self.runner.sample_deferred(logits, sampled_seqs)
            else:
                sampled = self.runner.sample(logits, sampled_seqs)
                num_sampled = Counter(id(item.seq) for item in sampled)
                for seq in batch.seqs:
                    if seq.spec_token_ids:
                        self._drop_rejected_drafts(seq, num_sampled[id(seq)] - 1)
                    self.kv.cache_computed_blocks(seq)
                self._accept(sampled, touched)
        outputs = self._outputs(touched)
        if deferred is not None:
            for row, seq in enumerate(deferred.seqs):
                if not seq.finished:
                    seq.token_ids.append(PENDING_TOKEN)
                    seq.pending_row = row
            self.in_flight = deferred
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return outputs

    def _count_prompt_tokens(self, batch) -> None:
        now = time.monotonic()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                if seq.num_computed_tokens == seq.num_cached_tokens and seq.num_cached_tokens and seq.num_preemptions == 0:
                    metrics.num_cached_tokens += seq.num_cached_tokens
                    self.metrics.prompt_tokens_cached += seq.num_cached_tokens
                computed = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens) - seq.num_computed_tokens
                metrics.num_computed_prompt_tokens += computed
                self.metrics.prompt_tokens_computed += computed

    @staticmethod
    def _read_in_flight(deferred: DeferredTokens) -> list[SampledToken]:
        """The in-flight step's tokens in place of their PENDING_TOKEN; sequences finished since are skipped."""
        sampled = []
        for seq, token in zip(deferred.seqs, deferred.tolist()):
            if seq.finished:
                continue
            _drop_pending_token(seq)
            sampled.append(SampledToken(seq, token, None))
        return sampled

    def _accept(self, sampled: list[SampledToken], touched: dict[str, RequestState]) -> None:
        now = time.monotonic()
        for item in sampled:
            if item.seq.finished:  # kept drafts after a stop in the same step
                continue
            self.metrics.generation_tokens += 1
            state = self.requests[item.seq.request_id]
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            self._append_token(item)
            touched[state.request_id] = state

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for state in touched.values():
            finished = state.finished
            if finished:
                del self.requests[state.request_id]
                state.metrics.finished_time = now
                self.metrics.record_request(state.metrics.arrival_time, state.metrics.first_token_time, now,
                                            max(seq.num_output_tokens for seq in state.seqs))
            if state.stream or finished:
                outputs.append(self._output(state))
        return outputs

    def _drop_rejected_drafts(self, seq: Sequence, num_kept: int) -> None:
        """After a verification: the KV of rejected draft tokens no longer counts and their blocks go back;
        the slot for the target's own token, computed next step, stays."""
        seq.num_computed_tokens -= len(seq.spec_token_ids) - num_kept
        self.kv.trim(seq, seq.num_computed_tokens + 1)
        self.metrics.spec_verifications += 1
        self.metrics.spec_draft_tokens += len(seq.spec_token_ids)
        self.metrics.spec_accepted_tokens += num_kept
        seq.spec_token_ids, seq.spec_draft_probs = [], None

    def _append_token(self, item: SampledToken) -> None:
        seq, token = item.seq, item.token_id
        params = seq.params
        seq.token_ids.append(token)
        if seq.logprobs is not None and item.logprob is not None:
            seq.logprobs.append(item.logprob)
        finish: str | None = None
        stop_reason: str | int | None = None
        if token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            finish = "stop"
        if finish is None and seq.detokenizer is not None:
            new_text = seq.detokenizer.add([token])
            if new_text:
                seq.text += new_text
                if params.stop:
                    finish, stop_reason = self._check_stop_strings(seq, len(new_text))
        if finish is None:
            if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
                finish = "length"
            elif seq.num_tokens >= self.max_model_len:
                finish = "length"
            if finish is not None and seq.detokenizer is not None:
                # text held back for an incomplete character; the character itself never completed
                seq.text += seq.detokenizer.finish().rstrip("\ufffd")
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            self.kv.cache_computed_blocks(seq)  # kept drafts counted computed before they were appended
            self.scheduler.finish(seq)

    @staticmethod
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

    def _output(self, state: RequestState) -> RequestOutput:
        completions = []
        for seq in state.seqs:
            if seq.finished or not seq.params.stop:
                visible = len(seq.text)
            else:
                visible = max(seq.num_emitted_chars, len(seq.text) - max(len(s) for s in seq.params.stop) + 1)
            out_ids = seq.output_token_ids
            delta_ids = out_ids[seq.num_emitted_tokens :]
            delta_text = seq.text[seq.num_emitted_chars : visible]
            delta_lp = None
            if seq.logprobs is not None:
                delta_lp = seq.logprobs[seq.num_emitted_logprobs :]
                seq.num_emitted_logprobs = len(seq.logprobs)
            seq.num_emitted_tokens = len(out_ids)
            seq.num_emitted_chars = visible
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text[:visible],
                    token_ids=out_ids,
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

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any. A single-process engine needs no closing."""
        workers, self.workers = self.workers, None
        if workers is None:
            return
        workers.tp.release_peer_buffers()  # before the workers, whose buffers this process maps, exit
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.stop_workers()
        workers.join()

    # ---- introspection --------------------------------------------------------------------------

    def stats(self) -> dict:
        snap = self.metrics.snapshot(
            self.kv.num_used_blocks, self.kv.num_blocks, len(self.scheduler.running), len(self.scheduler.waiting)
        )
        snap["load_seconds"] = self.load_seconds
        return snap


def _drop_pending_token(seq: Sequence) -> None:
    if seq.pending_row >= 0:
        assert seq.token_ids[-1] == PENDING_TOKEN
        seq.token_ids.pop()
        seq.pending_row = -1
