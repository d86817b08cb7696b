"""A prompt's token count for admission, as the model's engine will count it: the chat template rendered (with the
tools, as engine/tokenizer.py renders them) and tokenized by the model's own tokenizer. Budgets and tpm then hold
the prompt's real tokens, not the UTF-8 byte bound, so a budget admits the requests it fits. And the engine's own
checks of the token ids a request names (a token-id prompt, logit_bias, stop_token_ids) against the model's
vocabulary, made before the model is called: a bad id is a 400 that never wakes a model scaled to zero. The same
for an embedding model: token-id inputs and `dimensions`, checked as its replica checks them
(gateway/embedding_backend.py), from its config files.

The tokenizer and the model's config are read once per model source, lazily, in a worker thread; a source whose
tokenizer this process cannot load (`random:` weights, a path only the model's nodes have) counts None, and
admission keeps the byte bound; one whose config it cannot read leaves the token ids to the engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from engine.config import TOKENIZE_IN_THREAD_CHARS
from engine.loader import load_tokenizer, read_model_config
from engine.tokenizer import Tokenizer, encode_prompt
from gateway.backends import GenerationRequest
from gateway.embedding_backend import check_dimensions, check_rows
from gateway.embedding_source import EmbeddingModelFacts, read_embedding_model
from gateway.specs import ModelSpec, embedding_engine

log = logging.getLogger("tollgate.gateway")

# counting reads no token id against a vocabulary (check_token_ids does that)
_ANY_VOCAB = 1 << 62


class PromptTokenCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizers: dict[tuple[str, str | None], concurrent.futures.Future[Tokenizer | None]] = {}
        self._vocab_rows: dict[str, concurrent.futures.Future[int | None]] = {}
        self._embedding_models: dict[str, concurrent.futures.Future[EmbeddingModelFacts | None]] = {}

    async def check_embedding_inputs(self, spec: ModelSpec | None, inputs: list[str] | list[list[int]],
                                     dimensions: int | None) -> None:
        """A ValueError naming `input` or `dimensions`, as the model's replica would raise it, for token-id inputs
        it cannot read or a size of embeddings it does not give; nothing is read for texts at the model's own
        size (the replica's tokenizer checks those)."""
        token_ids = bool(inputs) and not isinstance(inputs[0], str)
        if spec is None or (dimensions is None and not token_ids):
            return
        facts = await self._loaded(self._embedding_models, spec.source, _read_embedding_model)
        if facts is None:
            return
        options = embedding_engine(spec)
        check_dimensions(spec.name, facts.dimension, options.matryoshka_dimensions, dimensions)
        if token_ids and facts.vocab_size is not None:
            check_rows(spec.name, options.max_model_len or facts.max_seq_length, facts.vocab_size,
                       inputs)  # type: ignore[arg-type]

    async def check_token_ids(self, spec: ModelSpec | None, request: GenerationRequest) -> None:
        """A ValueError naming the field, as the engine would raise it, when a token id the request names is outside
        the model's vocabulary (its embedding rows); nothing is read for a request that names none."""
        params = request.params
        if spec is None or not (isinstance(request.prompt, list) or params.logit_bias or params.stop_token_ids):
            return
        rows = await self._loaded(self._vocab_rows, spec.source, _read_vocab_rows)
        if rows is None:
            return
        params.check_vocab(rows)
        if isinstance(request.prompt, list):
            encode_prompt(None, rows, request.prompt)

    async def count(self, spec: ModelSpec | None, request: GenerationRequest) -> int | None:
        """The prompt's tokens; None where the model's tokenizer cannot be had here. A ValueError naming the field
        where the engine would refuse the prompt (a message the chat template rejects)."""
        if request.prompt is not None and not isinstance(request.prompt, str):
            return len(request.prompt)  # token ids
        if spec is None:
            return None
        tokenizer = await self._tokenizer(spec)
        if tokenizer is None:
            return None
        if request.messages is not None:
            chars = sum(len(m.get("content") or "") for m in request.messages)
            heavy = chars > TOKENIZE_IN_THREAD_CHARS or bool(request.tools)
            work = lambda: _chat_tokens(tokenizer, request.messages or [], request.tools)  # noqa: E731
        elif request.prompt is not None:
            heavy = len(request.prompt) > TOKENIZE_IN_THREAD_CHARS
            work = lambda: len(encode_prompt(tokenizer, _ANY_VOCAB, request.prompt or "")[1])  # noqa: E731
        else:
            return None
        return await asyncio.to_thread(work) if heavy else work()

    async def _tokenizer(self, spec: ModelSpec) -> Tokenizer | None:
        tokenizer_source = spec.engine.get("tokenizer")
        key = (spec.source, tokenizer_source if isinstance(tokenizer_source, str) else None)
        return await self._loaded(self._tokenizers, key, _load_tokenizer)

    async def _loaded(self, cache: dict[Any, concurrent.futures.Future], key: Any, load: Callable[[Any], Any]) -> Any:
        """load(key), run once per key in a thread of its own; None where it failed."""
        with self._lock:
            loading = cache.get(key)
            if loading is None:
                loading = cache[key] = concurrent.futures.Future()
                threading.Thread(target=_run_into, args=(load, key, loading), daemon=True,
                                 name="model-facts-load").start()
        return await asyncio.wrap_future(loading)


def _run_into(load: Callable[[Any], Any], key: Any, into: concurrent.futures.Future) -> None:
    try:
        into.set_result(load(key))
    except Exception as e:  # noqa: BLE001 - the caller falls back (byte bound; the engine's own checks)
        log.warning("%s", e)
        into.set_result(None)


def _load_tokenizer(key: tuple[str, str | None]) -> Tokenizer | None:
    try:
        return load_tokenizer(*key)
    except Exception as e:
        raise RuntimeError(f"cannot load the tokenizer of {key[0]} here ({e}): budgets hold its prompts' UTF-8 "
                           "bytes") from e


def _read_embedding_model(source: str) -> EmbeddingModelFacts:
    try:
        return read_embedding_model(source)
    except Exception as e:
        raise RuntimeError(f"cannot read the embedding model {source} here ({e}): its replica checks its inputs") \
            from e


def _read_vocab_rows(source: str) -> int:
    try:
        return read_model_config(source).vocab_size
    except Exception as e:
        raise RuntimeError(f"cannot read the config of {source} here ({e}): the engine checks its token ids") from e


def _chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    rendered = tokenizer.apply_chat_template(messages, tools=tools)
    return len(encode_prompt(tokenizer, _ANY_VOCAB, rendered)[1])
