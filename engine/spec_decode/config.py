"""EngineConfig.speculative_config, parsed and checked. Errors name the field: speculative_config.<key>."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

_METHODS = ("ngram", "draft")
# Verifying k drafts costs a (k + 1)-token forward pass; past 16 a rejection early on wastes most of it.
MAX_SPECULATIVE_TOKENS = 16


def _fail(key: str, message: str) -> ValueError:
    return ValueError(f"speculative_config.{key}: {message}")


def _positive_int(raw: dict[str, Any], key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(key, f"must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # ngram: prompt lookup in the sequence's own tokens; draft: a smaller model with the same vocabulary
    num_speculative_tokens: int
    draft_model: str | None = None
    # ngram: the longest suffix of 2..4 tokens that occurred before is looked up; longer first
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Speculation is off while this many sequences (or more) run. A large batch already keeps the
    # accelerator busy, so each draft token costs nearly a full token of compute and every rejected one is
    # wasted work: vLLM measured slowdowns under load. 32 keeps it to the latency-bound small batches.
    disable_by_batch_size: int = 32

    @classmethod
    def from_dict(cls, raw: Any) -> "SpeculativeConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config: must be a mapping, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known), key=str)
        if unknown:
            raise _fail(str(unknown[0]), f"unknown field (known: {known})")
        method = raw.get("method")
        if method not in _METHODS:
            raise _fail("method", f"must be one of {_METHODS}, got {method!r}")
        if "num_speculative_tokens" not in raw:
            raise _fail("num_speculative_tokens", "is required")
        k = _positive_int(raw, "num_speculative_tokens", None)
        if k > MAX_SPECULATIVE_TOKENS:
            raise _fail("num_speculative_tokens", f"must be at most {MAX_SPECULATIVE_TOKENS}, got {k}")
        draft_model = raw.get("draft_model")
        if method == "draft":
            if not isinstance(draft_model, str) or not draft_model:
                raise _fail("draft_model", f"method 'draft' needs a model path or name, got {draft_model!r}")
        elif draft_model is not None:
            raise _fail("draft_model", "only applies to method 'draft'")
        if method != "ngram":
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if key in raw:
                    raise _fail(key, "only applies to method 'ngram'")
        low = _positive_int(raw, "prompt_lookup_min", cls.prompt_lookup_min)
        high = _positive_int(raw, "prompt_lookup_max", max(cls.prompt_lookup_max, low))
        if low > high:
            raise _fail("prompt_lookup_min", f"must be <= prompt_lookup_max ({high}), got {low}")
        return cls(
            method=method,
            num_speculative_tokens=k,
            draft_model=draft_model,
            prompt_lookup_min=low,
            prompt_lookup_max=high,
            disable_by_batch_size=_positive_int(raw, "disable_by_batch_size", cls.disable_by_batch_size),
        )
