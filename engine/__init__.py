"""Tollgate's inference engine: paged KV cache, continuous batching, prefix caching.

Imports only torch, numpy, safetensors, gguf (lazily) and tokenizers/transformers (tokenizer only)."""

from engine.config import EngineConfig, SamplingParams
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

__all__ = [
    "AsyncEngine",
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "TokenLogprob",
]


def __getattr__(name: str):
    # the engine classes pull in torch and the model code; configs and outputs stay cheap to import
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
