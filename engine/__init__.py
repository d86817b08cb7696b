"""Tollgate's inference engine: paged KV cache, continuous batching, prefix caching.

Imports only torch, numpy, safetensors, gguf (lazily) and tokenizers/transformers (tokenizer only)."""

from engine.config import EngineConfig, SamplingParams
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

__all__ = [
    "EngineConfig",
    "SamplingParams",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "TokenLogprob",
]
