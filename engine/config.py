"""Engine and sampling configuration. Every validation error is a ValueError naming its field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from engine.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from engine.spec_decode.config import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_CACHE_DTYPES = ("auto", "fp8", "int8")
_QUANTIZATIONS = (None, "int8", "int4", "fp8")
_ENGINE_CORES = ("auto", "thread", "process")
_LORA_DECODE_KERNELS = ("auto", "bgmv", "grouped", "dense")
# prompts (and chats) longer than this are tokenized in a worker thread, so that a huge one never stalls
# the event loop (the short ones, nearly all, skip the thread hop)
TOKENIZE_IN_THREAD_CHARS = 20_000
# OpenAI's range of a logit_bias value
LOGIT_BIAS_BOUND = 100


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    # KV pool size in blocks; None sizes it from memory (GPU) or from cpu_kv_cache_gib (CPU).
    num_kv_blocks: int | None = None
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    # Launch step N+1 before reading step N's tokens, so host work overlaps the forward pass. Off with
    # speculative decoding (its proposer reads the newest tokens) and for steps returning logprobs.
    async_scheduling: bool = True
    # Tensor parallelism: when every sequence of a step decodes greedily, each rank picks the best token of its
    # vocabulary shard and the ranks exchange those candidates instead of gathering the logits.
    tp_greedy_on_shards: bool = True
    # Tensor parallelism on GPUs: a decode step's all-reduces run in one kernel with the residual add and RMSNorm
    # after them, through buffers the GPUs write into (checked at start; NCCL where the check fails).
    tp_fused_norm: bool = True
    # int4 weights: batch-1 decode on CUDA rounds each linear's input to int8 for a DP4A GEMV; False keeps bf16.
    int4_int8_activations: bool = True
    # Structured outputs: processes holding the sequences' grammar matchers, which fill each step's token masks
    # beside the engine thread (engine/mask_processes.py); 0 fills them in this process (a worker thread and
    # llguidance's thread pool). None: 4 on a CUDA device where each process has a core of its own to spin on between
    # steps, else 0 (engine/mask_processes.py default_processes; docs/benchmarks/structured.md, 2026-12-06).
    structured_output_processes: int | None = None
    # Where AsyncEngine (serving) runs the engine: "process" (its own, fed over a socket; vLLM v1's EngineCore),
    # "thread" (one in the serving process), "auto" (process on CUDA, thread on CPU). LLM (offline) ignores it.
    engine_core: str = "auto"
    # Serving: a request's streamed tokens are handed over once this many have gathered (its first token and its
    # end at once), as vLLM's --stream-interval; more than 1 spares a large batch's steps host time.
    stream_interval: int = 1
    # LoRA (engine/lora/): device slots for adapters used by one step (0: no LoRA), the largest adapter rank they
    # hold, how many adapters stay in host memory (None: all; the others are read from disk again when needed), and
    # adapters to serve from the start (name -> PEFT directory).
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | None = None
    # The LoRA kernels of a decode step on CUDA (kernels/punica_*.py): "bgmv" per token (each token reads its
    # adapter's weights), "grouped" by slot (each adapter's weights read once a step), "dense" grouped shrinks and
    # cuBLAS expands over every slot (kernels/punica_dense.py), "auto" grouped when the step's adapter tokens number
    # at least two per distinct adapter, dense when its adapters also fill 3/4 of the pool's slots
    # (engine/lora/batch.py), so batch 1 is per token.
    lora_decode_kernels: str = "auto"
    # Serving a sleeping engine (engine/sleep.py): a request that arrives wakes it (wake_on_request), or else waits
    # for an explicit wake; either way one that waits longer than sleep_wait_timeout_s is refused (EngineAsleepError).
    wake_on_request: bool = True
    sleep_wait_timeout_s: float = 120.0
    # An engine that will sleep (vLLM's enable_sleep_mode): on CUDA the host buffer a level-1 sleep copies the
    # weights into is pinned as the engine starts, in a thread of its own, and kept; the first sleep then only copies
    # (pinning 16 GB took ~10 s of the first switch between two 8B models). Costs that much host memory for good.
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        """Every bad field at once: a ValueError with one `field: problem` line each."""
        problems: list[str] = []

        def check(ok: bool, field_name: str, message: str) -> None:
            if not ok:
                problems.append(f"{field_name}: {message}")

        def positive_int(name: str, optional: bool = False) -> None:
            value = getattr(self, name)
            check((optional and value is None) or (_is_int(value) and value > 0), name,
                  f"must be a positive integer, got {value!r}")

        check(isinstance(self.model, str) and self.model != "", "model", "must be a non-empty path or name")
        check(isinstance(self.dtype, str) and self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        check(isinstance(self.device, str) and (self.device in ("auto", "cpu") or self.device.startswith("cuda")),
              "device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        check(_is_int(self.block_size) and self.block_size > 0 and self.block_size % 8 == 0, "block_size",
              f"must be a positive integer multiple of 8, got {self.block_size!r}")
        positive_int("max_model_len", optional=True)
        positive_int("max_num_seqs")
        positive_int("max_num_batched_tokens")
        positive_int("num_kv_blocks", optional=True)
        positive_int("stream_interval")
        check(self.structured_output_processes is None
              or (_is_int(self.structured_output_processes) and 0 <= self.structured_output_processes <= 64),
              "structured_output_processes",
              f"must be None or an integer in [0, 64], got {self.structured_output_processes!r}")
        check(_is_int(self.max_loras) and self.max_loras >= 0, "max_loras",
              f"must be an integer >= 0, got {self.max_loras!r}")
        check(_is_int(self.max_lora_rank) and 1 <= self.max_lora_rank <= 256, "max_lora_rank",
              f"must be an integer in [1, 256], got {self.max_lora_rank!r}")
        positive_int("max_cpu_loras", optional=True)
        check(self.lora_modules is None or (isinstance(self.lora_modules, dict) and all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items())),
              "lora_modules", "must map adapter names to PEFT adapter directories")
        check(not self.lora_modules or (_is_int(self.max_loras) and self.max_loras > 0), "lora_modules",
              "needs max_loras > 0")
        check(not self.max_loras or self.tensor_parallel_size == 1, "max_loras",
              "LoRA adapters are served with tensor_parallel_size 1 only")
        check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        check(_is_number(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0,
              "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(_is_number(self.cpu_kv_cache_gib) and self.cpu_kv_cache_gib > 0, "cpu_kv_cache_gib",
              f"must be positive, got {self.cpu_kv_cache_gib!r}")
        check(self.kv_cache_dtype in _KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.lora_decode_kernels in _LORA_DECODE_KERNELS, "lora_decode_kernels",
              f"must be one of {_LORA_DECODE_KERNELS}, got {self.lora_decode_kernels!r}")
        check(self.engine_core in _ENGINE_CORES, "engine_core",
              f"must be one of {_ENGINE_CORES}, got {self.engine_core!r}")
        check(self.quantization in _QUANTIZATIONS, "quantization",
              f"must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        check(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
              f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        check(_is_number(self.sleep_wait_timeout_s) and self.sleep_wait_timeout_s > 0, "sleep_wait_timeout_s",
              f"must be positive, got {self.sleep_wait_timeout_s!r}")
        for switch in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "tp_greedy_on_shards",
                       "tp_fused_norm", "int4_int8_activations", "wake_on_request", "enable_sleep_mode"):
            value = getattr(self, switch)
            check(isinstance(value, bool), switch, f"must be true or false, got {value!r}")
        if not problems:
            try:
                _ = self.speculative  # parses and checks speculative_config once; readers get the cached result
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ValueError("\n".join(problems))

    @cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed; None without speculation."""
        if self.speculative_config is None:
            return None
        from engine.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"{unknown[0]}: not an EngineConfig field (known: {sorted(names)})")
        return cls(model=model, **kwargs)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # number of top alternatives; 0 returns only the chosen token's
    skip_special_tokens: bool = True
    # added to the token's logit before penalties and sampling (OpenAI's logit_bias): -100 bans, +100 forces
    logit_bias: dict[int, float] | None = None
    # the output must match a JSON schema, a regex, a choice or a grammar (engine/grammar.py); a dict is read as
    # StructuredOutputs' fields
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
            self._check_ends_left_to_the_grammar()
        _require(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(_is_number(self.temperature) and self.temperature >= 0.0, "temperature",
                 f"must be >= 0, got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k",
                 f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _require(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _require(_is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty!r}")
        _require(_is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty!r}")
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                 "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
                 f"must be an integer >= 0, got {self.min_tokens!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be non-negative integers")
        _require(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
                 f"must be an integer in [0, 20], got {self.logprobs!r}")
        _require(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_number(b) and -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND
            for t, b in self.logit_bias.items())), "logit_bias",
            f"must map token ids (integers >= 0) to biases in [-{LOGIT_BIAS_BOUND}, {LOGIT_BIAS_BOUND}]")

    def _check_ends_left_to_the_grammar(self) -> None:
        """A constrained output ends where its grammar lets it, and only there: every field that would end it
        earlier (leaving a document that does not parse) or later is refused, naming the constraint's own field."""
        constraint = self.structured_outputs.field.split(".")[0]
        early = f"cannot be combined with {constraint}: it would end the output before the constraint is complete"
        _require(not self.stop, "stop", early)
        _require(not self.stop_token_ids, "stop_token_ids", early)
        _require(self.min_tokens == 0, "min_tokens",
                 f"cannot be combined with {constraint}: the constraint decides where the output may end")
        _require(not self.ignore_eos, "ignore_eos",
                 f"cannot be combined with {constraint}: the output ends where the constraint is complete")

    def check_vocab(self, vocab_size: int) -> None:
        """A ValueError naming the field when a token id the params name is outside the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids)):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside this model's vocabulary [0, {vocab_size})")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # YAML's true is no block count


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
