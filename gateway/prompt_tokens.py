"""A prompt's token count for admission, as the model's engine will count it: the chat template rendered (with the
tools, as engine/tokenizer.py renders them) and tokenized by the model's own tokenizer. Budgets and tpm then hold
the prompt's real tokens, not the UTF-8 byte bound, so a budget admits the requests it fits.

The tokenizer is loaded once per model source, lazily, in a worker thread; a source whose tokenizer this process
cannot load (`random:` weights, a path only the model's nodes have) counts None, and admission keeps the byte bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from engine.config import TOKENIZE_IN_THREAD_CHARS
from engine.loader import load_tokenizer
from engine.tokenizer import Tokenizer, encode_prompt
from gateway.backends import GenerationRequest
from gateway.specs import ModelSpec

log = logging.getLogger("tollgate.gateway")

# token ids are not checked against a vocabulary here: the engine refuses bad ones before anything runs
_ANY_VOCAB = 1 << 62


class PromptTokenCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizers: dict[tuple[str, str | None], concurrent.futures.Future[Tokenizer | None]] = {}

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
        with self._lock:
            loading = self._tokenizers.get(key)
            if loading is None:
                loading = concurrent.futures.Future()
                self._tokenizers[key] = loading
                threading.Thread(target=_load, args=(key, loading), daemon=True, name="tokenizer-load").start()
        return await asyncio.wrap_future(loading)


def _load(key: tuple[str, str | None], into: concurrent.futures.Future[Tokenizer | None]) -> None:
    try:
        into.set_result(load_tokenizer(*key))
    except Exception as e:  # admission keeps the byte bound for this model
        log.warning("cannot load the tokenizer of %s here (%s): budgets hold its prompts' UTF-8 bytes", key[0], e)
        into.set_result(None)


def _chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    rendered = tokenizer.apply_chat_template(messages, tools=tools)
    return len(encode_prompt(tokenizer, _ANY_VOCAB, rendered)[1])
