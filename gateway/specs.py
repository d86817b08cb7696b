"""Model specs: the YAML files under platform/models/ (README, "The `platform` command"). Every
validation error names its field path (`autoscaling.max_replicas: ...`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from billing.money import dollars
from billing.pricing import Prices
from engine.config import EngineConfig
from gateway.model_roots import checked_source

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model"}
MAX_SPEC_BYTES = 64 * 1024
# chat: /v1/chat/completions and /v1/completions on the engine; embedding: /v1/embeddings (gateway/embeddings.py)
ModelKind = Literal["chat", "embedding"]
# the formats gateway/tool_calls/parsers.py reads
TOOL_PARSERS = ("hermes", "llama3_json")
DEFAULT_TOOL_PARSER = "hermes"


class Pricing(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    input_per_1m: float = Field(0.0, ge=0)
    output_per_1m: float = Field(0.0, ge=0)
    gpu_hour: float = Field(0.0, ge=0)
    # prompt tokens read from the KV prefix cache (usage's cached_tokens); unset: the input price
    cached_input_per_1m: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _cached_at_most_input(self) -> "Pricing":
        if self.cached_input_per_1m is not None and self.cached_input_per_1m > self.input_per_1m:
            raise ValueError(f"cached_input_per_1m ({self.cached_input_per_1m}) must not exceed input_per_1m "
                             f"({self.input_per_1m})")
        return self

    def prices(self) -> Prices:
        return _exact_prices(self.input_per_1m, self.output_per_1m, self.gpu_hour, self.cached_input_per_1m)


@functools.lru_cache(maxsize=1024)
def _exact_prices(input_per_1m: float, output_per_1m: float, gpu_hour: float, cached_input_per_1m: float | None
                  ) -> Prices:
    """Read for every request: each spec's prices converted to exact dollars once."""
    cached = None if cached_input_per_1m is None else dollars(cached_input_per_1m)
    return Prices(dollars(input_per_1m), dollars(output_per_1m), dollars(gpu_hour), cached)


CUSTOM_RESOURCE_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-/]{0,99}"
# set through the spec's own fields, never as custom resources
RAY_BUILTIN_RESOURCES = {"CPU": "resources.num_cpus", "GPU": "resources.num_gpus", "memory": "resources.memory_gib",
                         "object_store_memory": "not settable per model"}


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_gpus: float = Field(0, ge=0)  # 0: a CPU replica
    num_cpus: float = Field(1, ge=0)
    memory_gib: float | None = Field(None, gt=0)
    # Ray custom resources each replica needs (its actor's `resources`): `{node_b: 1}` pins the model to the
    # nodes started with that resource (`ray start --resources='{"node_b": 1}'`, a KubeRay group's rayStartParams)
    custom: dict[str, float] = Field(default_factory=dict)

    @field_validator("custom", mode="before")
    @classmethod
    def _custom_resources(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        problems = []
        for name, amount in v.items():
            if not isinstance(name, str) or not re.fullmatch(CUSTOM_RESOURCE_PATTERN, name):
                problems.append(f"{name!r}: a resource name is letters, digits, '_', '-', '.' or '/'")
            elif name in RAY_BUILTIN_RESOURCES:
                problems.append(f"{name}: a built-in Ray resource; use its own field "
                                f"({RAY_BUILTIN_RESOURCES[name]})")
            elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount):
                problems.append(f"{name}: the amount must be a finite number, got {amount!r}")
            elif amount <= 0:
                problems.append(f"{name}: the amount must be > 0, got {amount!r}")
            elif amount > 1 and amount != int(amount):
                problems.append(f"{name}: an amount over 1 must be a whole number (Ray's rule), got {amount!r}")
        if problems:
            raise ValueError("".join(f"{p}\n" for p in problems))  # one line a key: _problems names each
        return v

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus_over_one(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError(f"a share of more than one GPU must be a whole number of GPUs (Ray's rule), got {v:g}")
        return v


class Autoscaling(BaseModel):
    """Ray Serve's autoscaling_config fields that a spec may set."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_replicas: int = Field(0, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(16, gt=0)
    max_ongoing_requests: int = Field(64, ge=1)  # per replica, beyond it requests queue in the router
    upscale_delay_s: float = Field(0.0, ge=0)
    downscale_delay_s: float = Field(300.0, ge=0)
    downscale_to_zero_delay_s: float | None = Field(None, ge=0)
    look_back_period_s: float = Field(10.0, gt=0)
    metrics_interval_s: float = Field(2.0, gt=0)
    # a replica idle this long puts its engine to sleep (level 1: weights to host memory, GPU memory given back);
    # the next request wakes it (x-tollgate-cold-start). None: never. Ray Serve ends it after downscale_delay_s.
    sleep_after_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas: must be >= min_replicas ({self.min_replicas}), got {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas: must lie between min_replicas and max_replicas")
        ends_after = self.downscale_to_zero_delay_s if self.downscale_to_zero_delay_s is not None else \
            self.downscale_delay_s
        if self.sleep_after_s is not None and self.min_replicas == 0 and self.sleep_after_s >= ends_after:
            which = "downscale_to_zero_delay_s" if self.downscale_to_zero_delay_s is not None else "downscale_delay_s"
            raise ValueError(f"sleep_after_s: {self.sleep_after_s:g} s is not less than {which} ({ends_after:g} s): "
                             "with min_replicas 0 an idle replica ends before it would sleep")
        return self

    def serve_config(self) -> dict[str, Any]:
        out = self.model_dump(exclude={"max_ongoing_requests", "sleep_after_s"}, exclude_none=True)
        return out


class EmbeddingEngine(BaseModel):
    """The `engine:` block of an embedding model's spec (its only settings)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # the longest input in tokens: at most the model's own (sentence-transformers' max_seq_length)
    max_model_len: int | None = Field(None, ge=1)
    # inputs in one forward pass: concurrent requests share passes up to this many inputs
    max_batch_size: int = Field(64, ge=1, le=2048)
    # the sizes `dimensions` may ask for: a Matryoshka-trained model's leading components embed alone
    matryoshka_dimensions: list[int] | None = Field(None, min_length=1)

    @field_validator("matryoshka_dimensions")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(d < 1 for d in v):
            raise ValueError("each size must be >= 1")
        return v


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
DEFAULT_MAX_LORAS = 4  # device slots of a model whose spec lists adapters and sets no engine.max_loras


class AdapterSpec(BaseModel):
    """A LoRA adapter served over the spec's model: clients ask for `model: "<model>:<name>"`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=ADAPTER_NAME_PATTERN)
    source: str = Field(min_length=1)  # a directory written by peft's save_pretrained
    # tenants (by name) that may use it and see it in /v1/models; unset: every tenant
    tenants: list[str] | None = Field(None, min_length=1)
    pricing: Pricing | None = None  # unset: the base model's prices

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not isinstance(t, str) or not t.strip() for t in v):
            raise ValueError("each tenant must be a non-empty tenant name")
        return v


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    source: str = Field(min_length=1)
    kind: ModelKind = "chat"
    size: Literal["small", "large"] = "small"
    tasks: list[str] = Field(default_factory=lambda: ["chat"])
    engine: dict[str, Any] = Field(default_factory=dict)
    # who may reuse the KV prefix cache blocks another request left: requests of the same tenant (default),
    # of the same API key, or anyone's (one tenant's timing and cached_tokens then reveal another's prompts)
    prefix_sharing: Literal["tenant", "key", "all"] = "tenant"
    # how `tool_choice: auto` reads the model's tool calls: hermes (`<tool_call>{json}</tool_call>`: Hermes, Qwen 2.5
    # and the fallback prompt of templates without tools) or llama3_json (Llama 3.1 / 3.2 JSON calls)
    tool_parser: str = DEFAULT_TOOL_PARSER
    resources: Resources = Field(default_factory=Resources)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    pricing: Pricing = Field(default_factory=Pricing)
    adapters: list[AdapterSpec] = Field(default_factory=list)

    @field_validator("adapters")
    @classmethod
    def _unique_adapters(cls, v: list[AdapterSpec]) -> list[AdapterSpec]:
        seen: set[str] = set()
        for adapter in v:
            if adapter.name in seen:
                raise ValueError(f"adapter name {adapter.name!r} appears twice")
            seen.add(adapter.name)
        return v

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "kind" not in info.data:  # the kind itself is refused: which settings apply is unknown
            return v
        if info.data["kind"] == "embedding":  # checked with the spec's other fields (check_embedding_fields)
            return v
        unknown = sorted(set(v) - _ENGINE_FIELDS)
        if unknown:
            raise ValueError(f"{unknown[0]}: not an engine setting (known: {sorted(_ENGINE_FIELDS)})")
        return v

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, v: str) -> str:
        if v not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call format {v!r} (known: {', '.join(TOOL_PARSERS)})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _embedding_defaults(cls, data: Any) -> Any:
        """An embedding model is on no side of the router: no tasks unless the spec names some (refused)."""
        if isinstance(data, dict) and data.get("kind") == "embedding" and "tasks" not in data:
            return {**data, "tasks": []}
        return data

    @model_validator(mode="after")
    def _engine_config(self) -> "ModelSpec":
        """The engine block is checked whole, as the replica will build it, so a bad value is refused here
        and not inside a replica's cold start."""
        if self.kind == "embedding":
            check_embedding_fields(self)
            return self
        config = engine_config(self)
        gpus = self.resources.num_gpus
        if gpus > 0 and config.tensor_parallel_size > 1 and config.tensor_parallel_size > gpus:
            raise ValueError(f"engine.tensor_parallel_size: {config.tensor_parallel_size} ranks need "
                             f"{config.tensor_parallel_size} GPUs per replica, resources.num_gpus is {gpus:g}")
        if 0 < gpus < 1 and config.gpu_memory_utilization > gpus:
            # a fraction of a GPU shares it with other models: the memory share must fit in the fraction
            raise ValueError(f"engine.gpu_memory_utilization: {config.gpu_memory_utilization:g} is more than this "
                             f"replica's share of its GPU (resources.num_gpus: {gpus:g}); set it to at most {gpus:g}")
        return self

    @property
    def max_model_len(self) -> int | None:
        return self.engine.get("max_model_len")


def embedding_engine(spec: ModelSpec) -> EmbeddingEngine:
    return EmbeddingEngine.model_validate(spec.engine)


def check_embedding_fields(spec: ModelSpec) -> None:
    """An embedding spec's engine block, and the chat-only fields it must leave alone: a ValueError of
    `field: problem` lines, one a problem."""
    problems = []
    try:
        embedding_engine(spec)
    except ValidationError as e:
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"not a setting of an embedding model (it takes {sorted(EmbeddingEngine.model_fields)})"
            problems.append(f"engine.{'.'.join(map(str, err['loc']))}: {msg}")
    if spec.tasks:
        problems.append("tasks: an embedding model serves /v1/embeddings only; the router never sends chat to it")
    if spec.size != "small":
        problems.append("size: an embedding model is on no side of the router")
    if spec.prefix_sharing != "tenant":
        problems.append("prefix_sharing: an embedding model keeps no KV prefix cache")
    if spec.pricing.output_per_1m:
        problems.append("pricing.output_per_1m: an embedding model produces no output tokens (input_per_1m prices "
                        "its input)")
    if spec.pricing.cached_input_per_1m is not None:
        problems.append("pricing.cached_input_per_1m: an embedding model reads no cached prompt tokens")
    if spec.adapters:
        problems.append("adapters: LoRA adapters are served over chat models only")
    if problems:
        raise ValueError("\n".join(problems))


def engine_fields(spec: ModelSpec) -> dict[str, Any]:
    """The spec's engine block with its adapters: served from the start, in max_loras device slots."""
    fields = dict(spec.engine)
    if spec.kind == "chat" and spec.autoscaling.sleep_after_s is not None:
        fields.setdefault("enable_sleep_mode", True)  # it will sleep: its host buffer is pinned as it starts
    if spec.adapters:
        fields.setdefault("max_loras", DEFAULT_MAX_LORAS)
        fields["lora_modules"] = {**(fields.get("lora_modules") or {}), **{a.name: a.source for a in spec.adapters}}
    return fields


def engine_config(spec: ModelSpec) -> EngineConfig:
    """The spec's EngineConfig; bad values are a ValueError of `engine.<field>: ...` lines, one a problem."""
    try:
        return EngineConfig.from_kwargs(spec.source, **engine_fields(spec))
    except (ValueError, TypeError) as e:
        lines = []
        for line in str(e).splitlines():
            field, sep, problem = line.partition(": ")
            ok = sep and all(part.isidentifier() for part in field.split("."))
            lines.append(f"engine.{field}: {problem}" if ok else f"engine: {line}")
        raise ValueError("\n".join(lines)) from None


class SpecError(ValueError):
    """All problems of one spec, each as `field.path: message`."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: invalid model spec\n" + "\n".join(f"  {p}" for p in problems))
        self.problems = problems


def _problems(e: ValidationError) -> list[str]:
    out = []
    for err in e.errors():
        path = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        if "\n" in msg:  # a whole block's problems (engine, an embedding spec's, custom resources), one a line
            out.extend(f"{path}.{line}" if path else line for line in msg.splitlines() if line)
            continue
        head, _, rest = msg.partition(": ")
        if rest and head.isidentifier() and " " not in head:  # "max_replicas: ..." raised inside a model
            path = f"{path}.{head}" if path and not path.endswith(head) else (path or head)
            msg = rest
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        out.append(f"{path}: {msg}" if path else msg)
    return out


def parse_spec(data: Any, source: str = "spec") -> ModelSpec:
    if not isinstance(data, dict):
        raise SpecError(source, ["a model spec must be a YAML mapping"])
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(source, _problems(e)) from None


def load_spec(path: str | Path) -> ModelSpec:
    """A spec file: at most MAX_SPEC_BYTES of YAML read with safe_load (plain data, no Python objects) and
    no aliases, whose model paths lie under the allowed roots (gateway/model_roots.py)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(str(path), [f"file: cannot be read ({e.strerror or e})"]) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(str(path), [f"file: larger than {MAX_SPEC_BYTES} bytes; a model spec is a few lines"])
    try:
        text = raw.decode("utf-8")
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            # an alias repeats a subtree by reference: nested ones expand exponentially once serialized
            raise SpecError(str(path), ["file: YAML aliases (*name) are not allowed in a model spec"])
        data = yaml.safe_load(text)
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise SpecError(str(path), [f"not valid YAML: {e}"]) from None
    return _with_checked_paths(parse_spec(data, str(path)), path.parent, str(path))


def _with_checked_paths(spec: ModelSpec, spec_dir: Path, source: str) -> ModelSpec:
    """The spec with its model and tokenizer paths made absolute; SpecError when one leaves the roots."""
    problems: list[str] = []

    def check(field: str, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return checked_source(field, value, spec_dir)
        except ValueError as e:
            problems.append(str(e))
            return value

    engine = dict(spec.engine)
    if "tokenizer" in engine:
        engine["tokenizer"] = check("engine.tokenizer", engine["tokenizer"])
    speculative = engine.get("speculative_config")
    if isinstance(speculative, dict) and "draft_model" in speculative:
        engine["speculative_config"] = {**speculative, "draft_model": check(
            "engine.speculative_config.draft_model", speculative["draft_model"])}
    adapters = [a.model_copy(update={"source": check(f"adapters.{i}.source", a.source)})
                for i, a in enumerate(spec.adapters)]
    checked = spec.model_copy(update={"source": check("source", spec.source), "engine": engine, "adapters": adapters})
    if problems:
        raise SpecError(source, problems)
    return checked


def check_source(spec: ModelSpec) -> None:
    """SpecError `source: ...` (or `engine.tokenizer: ...`) unless the weights are there and their config
    reads: a path that exists, a package that is installed and holds a model, a config the engine parses."""
    from engine.loader import read_model_config, resolve_model_source

    if spec.kind == "embedding":
        return check_embedding_source(spec)
    problems = []
    try:
        read_model_config(spec.source)
    except ValueError as e:
        problems.append(f"source: {e}")
    tokenizer = spec.engine.get("tokenizer")
    if isinstance(tokenizer, str):
        try:
            resolve_model_source(tokenizer)
        except ValueError as e:
            problems.append(f"engine.tokenizer: {e}")
    if problems:
        raise SpecError(f"model {spec.name}", problems)


def check_embedding_source(spec: ModelSpec) -> None:
    """SpecError unless the source is an embedding model whose files read, and the engine block fits it
    (max_model_len and Matryoshka sizes at most the model's)."""
    from gateway.embedding_source import read_embedding_model

    try:
        facts = read_embedding_model(spec.source)
    except ValueError as e:
        raise SpecError(f"model {spec.name}", [f"source: {e}"]) from None
    engine = embedding_engine(spec)
    problems = []
    if engine.max_model_len is not None and engine.max_model_len > facts.max_seq_length:
        problems.append(f"engine.max_model_len: {engine.max_model_len} is more than the model reads "
                        f"({facts.max_seq_length} tokens)")
    too_large = [d for d in engine.matryoshka_dimensions or [] if d > facts.dimension]
    if too_large:
        problems.append(f"engine.matryoshka_dimensions: {too_large[0]} is larger than the model's embeddings "
                        f"({facts.dimension})")
    if problems:
        raise SpecError(f"model {spec.name}", problems)


@dataclass
class SpecFiles:
    """The valid specs of a directory, and why each other file was left out: one bad file never keeps
    the others from being served."""

    specs: list[ModelSpec]
    errors: dict[str, str]


def load_specs(directory: str | Path) -> SpecFiles:
    specs: list[ModelSpec] = []
    errors: dict[str, str] = {}
    for path in sorted(Path(directory).glob("*.y*ml")):
        try:
            spec = load_spec(path)
        except (SpecError, OSError) as e:
            errors[str(path)] = str(e)
            continue
        if any(s.name == spec.name for s in specs):
            errors[str(path)] = f"{path}: model name {spec.name!r} is used by an earlier spec in {directory}"
            continue
        specs.append(spec)
    return SpecFiles(specs, errors)
