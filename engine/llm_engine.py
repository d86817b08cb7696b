"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out.

A step is schedule (engine/scheduler.py) -> run (engine/runner.py, which picks how the tokens come out) -> process
the outputs (engine/output_processor.py); the engine books the KV blocks and the requests that finish in between."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence as SequenceOf

import torch

from engine.checkpoint_prefetch import prefetch_checkpoint
from engine.config import EngineConfig, SamplingParams
from engine.deferred_tokens import DeferredTokens, drop_pending_token
from engine.errors import PromptTooLongError
from engine.grammar import GrammarCompiler
from engine.kv_cache import KVCacheManager
from engine.mask_processes import default_processes
from engine.distributed.parallel_state import SINGLE
from engine.distributed.workers import TensorParallelWorkers
from engine.metrics import EngineMetrics
from engine.model_builder import build_model
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import Delta, RequestMetrics, RequestOutput
from engine.runner import LaunchedStep
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sleep import EngineAsleepError, EngineSleep
from engine.sequence import SampledToken, Sequence, choice_seed
from engine.tokenizer import encode_prompt
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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        prefetch_checkpoint(config.model)  # the disk works while CUDA starts and the network is built
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
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                        processes=(default_processes(self.device)
                                                   if config.structured_output_processes is None
                                                   else config.structured_output_processes),
                                        max_rows=config.max_num_seqs, device=self.device)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora = self.runner.lora  # None unless config.max_loras > 0
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_loras)
        self.metrics = EngineMetrics()
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.metrics,
                                                config.stream_interval)
        self.overlap = config.async_scheduling and self.speculator is None
        self.in_flight: DeferredTokens | None = None  # the last step's tokens, sampled but not read yet
        self.step_tokens_by_account: Counter[str | None] = Counter()  # of the last step that launched a batch
        self.sleep_mode = EngineSleep(self)
        self.load_seconds = time.perf_counter() - started
        log.info("engine ready in %.1f s: max_model_len=%d, %d KV blocks", self.load_seconds, self.max_model_len,
                 self.runner.num_blocks)

    # ---- requests -------------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests by id."""
        return self.output_processor.requests

    def encode_prompt(self, prompt: str | SequenceOf[int]) -> tuple[str | None, list[int]]:
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        stream: bool = True,
        cache_salt: str | None = None,
        account: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Validates and queues a request. Bad input raises ValueError and changes nothing. `cache_salt`: the
        request reuses (and leaves) prefix-cache blocks only for requests with the same salt. `account`: whom
        its share of each step's time is counted to (step_tokens_by_account). `lora_name`: the served LoRA adapter
        it runs with (add_lora), None for the base model."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        lora = self.resolve_lora(lora_name)
        params.check_vocab(self.model_config.vocab_size)
        grammar = self._compile_grammar(params)
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
            seed = None if params.seed is None else choice_seed(params.seed, i)
            seq = Sequence(request_id, i, ids, params, priority, arrival, seed, self.device, cache_salt, lora)
            seq.max_num_tokens = longest
            if grammar is not None:
                seq.grammar = self.grammars.new_matcher(grammar)
            seqs.append(seq)
        state = RequestState(request_id, text, ids, params, seqs, RequestMetrics(arrival, num_prompt_tokens=len(ids)),
                             stream, account)
        self.output_processor.add_request(state)
        for seq in seqs:
            self.scheduler.add(seq)

    def resolve_lora(self, lora_name: str | None):
        if lora_name is None:
            return None
        if not isinstance(lora_name, str):
            raise ValueError(f"lora_name: must be a string, got {lora_name!r}")
        if self.lora is None:
            raise ValueError(f"lora_name: unknown adapter {lora_name!r} (this engine serves no adapters: max_loras is 0)")
        return self.lora.resolve(lora_name)

    # ---- LoRA adapters --------------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Serves the PEFT adapter at `path` as `name` (replacing one of that name) from the next request on. Reads
        it here; the serving path reads it off the engine's thread (load_lora) and registers it with add_loaded_lora."""
        self.add_loaded_lora(self.load_lora(name, path))

    def load_lora(self, name: str, path: str):
        """The adapter read and checked, not yet served; touches no engine state."""
        if self.lora is None:
            raise ValueError("max_loras: this engine was started without adapter slots (max_loras is 0)")
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"lora_name: must be a non-empty name without ':', got {name!r}")
        return self.lora.load(path, name)

    def add_loaded_lora(self, adapter) -> None:
        if self.lora is None:
            raise ValueError("max_loras: this engine was started without adapter slots (max_loras is 0)")
        self.lora.add(adapter)

    def remove_lora(self, name: str) -> bool:
        """Stops serving an adapter to new requests (running ones finish with it); False if it was not served."""
        return self.lora.remove(name) if self.lora is not None else False

    def list_loras(self) -> list[str]:
        return self.lora.registry.names() if self.lora is not None else []

    def _compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured request (cached by its hash), None for others; a ValueError naming
        the field when the constraint cannot be compiled or served."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.speculator is not None:
            raise ValueError(f"{spec.field}: structured outputs are not supported with speculative decoding "
                             "(this model's speculative_config); serve the model without it to constrain outputs")
        return self.grammars.compile(spec)

    def abort_request(self, request_id: str, as_delta: bool = False) -> RequestOutput | Delta | None:
        """Stops the request and frees its blocks; its last output (a Delta with as_delta), None if unknown."""
        state = self.output_processor.pop_request(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.finished:
                drop_pending_token(seq)
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        state.metrics.finished_time = time.monotonic()
        return self.output_processor.delta(state) if as_delta else self.output_processor.output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, process the outputs; returns the requests with new output. With async scheduling the step
        is launched before the tokens of the step before it are read, and its own are read by the next step."""
        deferred = self._advance()
        outputs = self.output_processor.outputs()  # before the in-flight step's placeholders are appended
        self._finish_step(deferred)
        return outputs

    def step_deltas(self) -> list[Delta]:
        """A step as step() runs it; returns what each request with new tokens added (the serving path)."""
        deferred = self._advance()
        deltas = self.output_processor.deltas()
        self._finish_step(deferred)
        return deltas

    def _advance(self) -> DeferredTokens | None:
        """Schedule, launch, take the tokens now known; returns this step's tokens when they are read next step."""
        if self.sleep_mode.level:
            raise EngineAsleepError(f"the engine is asleep (level {self.sleep_mode.level}): wake() it before stepping")
        previous = self.in_flight
        self._hand_over_early(previous)
        batch = self._schedule()
        self._hand_over_early(previous)  # the last step's sampling often ends while this one schedules
        launched = self._launch(batch, previous)
        self.in_flight = None  # kept until here, so a step that failed to launch leaves it for the next one
        self.runner.token_masker.forward_launched()  # before the host waits for the device (token_mask.py)
        if previous is not None:
            sampled = previous.read()
            self.runner.token_masker.tokens_read(previous)  # if they were not on the host before
            self._add_tokens(sampled)
        return self._take_tokens(batch, self.runner.sample_tokens(launched)) if launched is not None else None

    def _hand_over_early(self, previous: DeferredTokens | None) -> None:
        """Mask processes waiting for the last step's tokens get them as soon as they are on the host: they fill the
        next masks while this thread schedules and launches."""
        masker = self.runner.token_masker
        if previous is not None and masker.awaits(previous) and previous.on_host():
            masker.tokens_read(previous, early=True)

    def _schedule(self) -> ScheduledBatch:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.metrics.num_preemptions += len(batch.preempted)
        for seq in batch.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
        return batch

    def _launch(self, batch: ScheduledBatch, previous: DeferredTokens | None) -> LaunchedStep | None:
        """Launches the batch's forward pass (None for an empty batch); its tokens count as computed from here."""
        if not batch.seqs:
            return None
        self._count_prompt_tokens(batch)
        self._count_step_tokens(batch)
        launched = self.runner.execute(batch, previous, self.overlap)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
        self.metrics.num_steps += 1
        return launched

    def _count_step_tokens(self, batch: ScheduledBatch) -> None:
        """Each account's tokens in the step being launched: its share of the step's time (a prefill token and
        a decode token both pass every weight matrix once, so each counts 1). A step that launches nothing
        keeps the last batch's counts: its time goes to finishing that batch."""
        requests = self.requests
        counts: Counter[str | None] = Counter()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            counts[requests[seq.request_id].account] += num_new
        self.step_tokens_by_account = counts

    def _count_prompt_tokens(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue  # decoding: scheduled before, its prompt counted
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if seq.num_computed_tokens == seq.num_cached_tokens and seq.num_cached_tokens and seq.num_preemptions == 0:
                metrics.num_cached_tokens += seq.num_cached_tokens
                self.metrics.prompt_tokens_cached += seq.num_cached_tokens
            computed = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens) - seq.num_computed_tokens
            metrics.num_computed_prompt_tokens += computed
            self.metrics.prompt_tokens_computed += computed

    def _take_tokens(self, batch: ScheduledBatch, tokens: DeferredTokens | list[SampledToken]
                     ) -> DeferredTokens | None:
        """This step's tokens: sampled ones are added now; deferred ones are returned, to be read next step."""
        if isinstance(tokens, DeferredTokens):
            for seq in batch.seqs:
                self.kv.cache_computed_blocks(seq)
            return tokens if tokens.seqs else None
        num_sampled = Counter(id(item.seq) for item in tokens)
        for seq in batch.seqs:
            if seq.spec_token_ids:
                self._drop_rejected_drafts(seq, num_sampled[id(seq)] - 1)
            self.kv.cache_computed_blocks(seq)
        self._add_tokens(tokens)
        return None

    def _add_tokens(self, sampled: list[SampledToken]) -> None:
        for seq in self.output_processor.add_tokens(sampled):
            self.kv.cache_computed_blocks(seq)  # kept drafts counted computed before they were appended
            self.scheduler.finish(seq)

    def _finish_step(self, deferred: DeferredTokens | None) -> None:
        if deferred is not None:
            deferred.mark_pending()
            self.in_flight = deferred
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)

    def _drop_rejected_drafts(self, seq: Sequence, num_kept: int) -> None:
        """After a verification: the KV of rejected draft tokens no longer counts and their blocks go back;
        the slot for the target's own token, computed next step, stays."""
        seq.num_computed_tokens -= len(seq.spec_token_ids) - num_kept
        self.kv.trim(seq, seq.num_computed_tokens + 1)
        self.metrics.spec_verifications += 1
        self.metrics.spec_draft_tokens += len(seq.spec_token_ids)
        self.metrics.spec_accepted_tokens += num_kept
        seq.spec_token_ids, seq.spec_draft_probs = [], None

    # ---- sleep (engine/sleep.py) ----------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Gives the device memory back: level 1 keeps the weights in host memory, level 2 drops them (reloaded
        from the model's source on wake). Only an idle engine sleeps; requests added while it sleeps wait for
        wake()."""
        self.sleep_mode.sleep(level)

    def wake(self) -> float:
        """Weights and KV pool back (CUDA graphs are captured again as decode steps need them); the seconds it took
        (0.0 when awake)."""
        return self.sleep_mode.wake()

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level it sleeps at."""
        return self.sleep_mode.level

    def close(self) -> None:
        """Stops the structured outputs' mask processes and the tensor-parallel workers, if any."""
        grammars = getattr(self, "grammars", None)  # an engine whose start failed may have none yet
        if grammars is not None:
            grammars.close()
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
        snap["sleep_level"] = self.sleep_mode.level
        snap["last_wake_seconds"] = self.sleep_mode.last_wake_seconds
        snap.update(self.sleep_mode.memory())
        return snap

