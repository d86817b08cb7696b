"""How the HTTP layer reaches an embedding model. It knows only `EmbeddingBackend`: first `tokenize` (the
inputs as the model reads them, every bad input refused with a ValueError naming `input` or `dimensions`, so
the gateway refuses before it reserves or records anything), then `embed` those token ids.
`LocalEmbeddingBackend` runs a sentence-transformers model in this process, its forward passes shared by
concurrent requests (gateway/embedding_batcher.py); a Ray Serve replica runs the same class
(gateway/serving/embedding_replica.py) behind `RayEmbeddingBackend`."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.config import TOKENIZE_IN_THREAD_CHARS
from gateway.backends import BackendInfo, BackendState, BackendUnavailable
from gateway.embedding_batcher import EmbeddingBatcher
from gateway.specs import ModelSpec, embedding_engine

Inputs = list[str] | list[list[int]]


@dataclass(frozen=True)
class EmbedRequest:
    request_id: str
    token_ids: list[list[int]]  # as `tokenize` returned them
    dimensions: int | None = None  # None: the model's own
    account: str | None = None  # the tenant (uid) whose share of each forward pass this request's is


@runtime_checkable
class EmbeddingBackend(Protocol):
    async def tokenize(self, inputs: Inputs, dimensions: int | None) -> list[list[int]]: ...

    async def embed(self, request: EmbedRequest) -> np.ndarray: ...

    def info(self) -> BackendInfo: ...


@dataclass(frozen=True)
class _Loaded:
    model: Any  # sentence_transformers.SentenceTransformer
    tokenizer: Any
    dimension: int
    max_len: int
    vocab_size: int
    pad_id: int
    token_types: bool  # the encoder takes token_type_ids
    normalizes: bool  # its last module scales embeddings to unit length


class LocalEmbeddingBackend:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.options = embedding_engine(spec)
        self._state: BackendState = "stopped"
        self._reason: str | None = None
        self._loaded: _Loaded | None = None
        self._batcher: EmbeddingBatcher | None = None
        self._tokenizer_lock = threading.Lock()  # a Hugging Face tokenizer is not safe to call from two threads

    async def start(self) -> None:
        """Load the model (in a thread). One that cannot load is left unavailable, with the reason, and the
        error is raised."""
        self._state = "loading"
        try:
            self._loaded = await asyncio.to_thread(self._load)
        except BaseException as e:
            self.mark_unavailable(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
            raise
        self._batcher = EmbeddingBatcher(self.forward, self._loaded.dimension, self.options.max_batch_size)
        self._state = "ready"

    def _load(self) -> _Loaded:
        import torch
        from sentence_transformers import SentenceTransformer

        from gateway.embedding_source import read_embedding_model

        facts = read_embedding_model(self.spec.source)
        device = "cuda" if self.spec.resources.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        model = SentenceTransformer(str(facts.directory), device=device, local_files_only=True)
        model.float()
        model.eval()
        dimension = int(model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension")
                        else model.get_sentence_embedding_dimension())
        reads = int(model.max_seq_length)
        if self.options.max_model_len is not None and self.options.max_model_len > reads:
            raise ValueError(f"engine.max_model_len: {self.options.max_model_len} is more than the model reads "
                             f"({reads} tokens)")
        too_large = [d for d in self.options.matryoshka_dimensions or [] if d > dimension]
        if too_large:
            raise ValueError(f"engine.matryoshka_dimensions: {too_large[0]} is larger than the model's embeddings "
                             f"({dimension})")
        tokenizer = model.tokenizer
        return _Loaded(model, tokenizer, dimension, self.options.max_model_len or reads, len(tokenizer),
                       tokenizer.pad_token_id or 0, "token_type_ids" in tokenizer.model_input_names,
                       any(type(module).__name__ == "Normalize" for module in model))

    def mark_unavailable(self, reason: str) -> None:
        self._state, self._reason = "unavailable", reason

    def stop(self) -> None:
        self._loaded = self._batcher = None
        if self._state != "unavailable":
            self._state = "stopped"

    def info(self) -> BackendInfo:
        ready = self._state == "ready"
        states = {"running": 1} if ready else {"starting": 1} if self._state == "loading" else {}
        max_len = self._loaded.max_len if self._loaded is not None else self.options.max_model_len
        return BackendInfo(self.spec.name, max_len, self._state, 1 if ready else 0, states, self._reason,
                           kind="embedding")

    @property
    def dimension(self) -> int | None:
        return self._loaded.dimension if self._loaded is not None else None

    def batch_stats(self) -> dict[str, Any]:
        """Forward passes, the inputs they took and the largest one (how much concurrent requests shared)."""
        s = self._batcher.stats if self._batcher is not None else None
        return {} if s is None else {"passes": s.passes, "rows": s.rows, "largest_pass": s.largest_pass,
                                     "busy_s": s.busy_s}

    def busy_totals(self) -> tuple[float, dict[str | None, float]]:
        """Busy seconds since the model loaded, in all and per account (replica interval rows)."""
        if self._batcher is None:
            return 0.0, {}
        return self._batcher.stats.busy_s, dict(self._batcher.stats.busy_s_by_account)

    # ---- requests ------------------------------------------------------------------------------

    async def tokenize(self, inputs: Inputs, dimensions: int | None) -> list[list[int]]:
        loaded = self._ready()
        self._check_dimensions(loaded, dimensions)
        if inputs and isinstance(inputs[0], str):
            texts: list[str] = inputs  # type: ignore[assignment]
            # short texts inline, unless another request's long ones hold the tokenizer: never wait on the loop
            if sum(len(t) for t in texts) <= TOKENIZE_IN_THREAD_CHARS and self._tokenizer_lock.acquire(blocking=False):
                try:
                    rows = self._tokenize_texts(loaded, texts)
                finally:
                    self._tokenizer_lock.release()
            else:
                rows = await asyncio.to_thread(self._tokenize_texts_locked, loaded, texts)
        else:
            rows = [list(r) for r in inputs]  # type: ignore[arg-type]
        self._check_rows(loaded, rows)
        return rows

    async def embed(self, request: EmbedRequest) -> np.ndarray:
        """float32 [inputs, dimensions]: the model's embeddings, cut to `dimensions` (and scaled back to unit
        length when the model's are) where one was asked for."""
        loaded = self._ready()
        self._check_dimensions(loaded, request.dimensions)
        self._check_rows(loaded, request.token_ids)
        assert self._batcher is not None
        vectors = await self._batcher.embed(request.token_ids, request.account)
        if request.dimensions is None or request.dimensions == loaded.dimension:
            return vectors
        cut = np.ascontiguousarray(vectors[:, :request.dimensions])
        if loaded.normalizes:
            cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
        return cut

    def _ready(self) -> _Loaded:
        if self._state != "ready" or self._loaded is None:
            why = f": {self._reason}" if self._reason else ""
            raise BackendUnavailable(f"The model `{self.spec.name}` is {self._state}{why}")
        return self._loaded

    def _check_dimensions(self, loaded: _Loaded, dimensions: int | None) -> None:
        check_dimensions(self.spec.name, loaded.dimension, self.options.matryoshka_dimensions, dimensions)

    @staticmethod
    def _tokenize_texts(loaded: _Loaded, texts: list[str]) -> list[list[int]]:
        # whole, so that _check_rows refuses a too-long input with a 400; verbose=False: without transformers'
        # "Token indices sequence length is longer than ..." on the replica's stderr (the 400 says it)
        return loaded.tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]

    def _tokenize_texts_locked(self, loaded: _Loaded, texts: list[str]) -> list[list[int]]:
        with self._tokenizer_lock:
            return self._tokenize_texts(loaded, texts)

    def _check_rows(self, loaded: _Loaded, rows: list[list[int]]) -> None:
        check_rows(self.spec.name, loaded.max_len, loaded.vocab_size, rows)

    def forward(self, rows: list[list[int]]) -> np.ndarray:
        """One forward pass over the rows, padded to the longest (the batcher runs it in a worker thread)."""
        import torch

        loaded = self._loaded
        if loaded is None:
            raise BackendUnavailable(f"The model `{self.spec.name}` was stopped")
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), loaded.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        features = {"input_ids": ids, "attention_mask": mask}
        if loaded.token_types:
            features["token_type_ids"] = torch.zeros_like(ids)
        device = loaded.model.device
        with torch.inference_mode():
            out = loaded.model({k: v.to(device) for k, v in features.items()})["sentence_embedding"]
        return out.float().cpu().numpy()


def check_dimensions(name: str, dimension: int, matryoshka: list[int] | None, dimensions: int | None) -> None:
    """A ValueError naming `dimensions` unless the model (its own `dimension`, the sizes its spec says it was trained
    to be cut to) gives embeddings of that many."""
    if dimensions is None or dimensions == dimension:
        return
    allowed = matryoshka or []
    if dimensions > dimension:
        raise ValueError(f"dimensions: {dimensions} is larger than the embeddings of `{name}` ({dimension})")
    if dimensions not in allowed:
        sizes = f"only {', '.join(map(str, sorted({*allowed, dimension})))}" if allowed else \
            f"only its own {dimension} (it was not trained to be shortened)"
        raise ValueError(f"dimensions: `{name}` gives embeddings of {sizes}, not {dimensions}")


def check_rows(name: str, max_len: int, vocab_size: int, rows: list[list[int]]) -> None:
    """A ValueError naming `input` for a row of token ids the model cannot read: too long, or an id outside its
    vocabulary."""
    for i, row in enumerate(rows):
        if len(row) > max_len:
            raise ValueError(f"input: input {i} is {len(row)} tokens long; `{name}` reads at most {max_len} (its "
                             "special tokens included). Shorten or split it.")
        if not row or min(row) < 0 or max(row) >= vocab_size:
            raise ValueError(f"input: input {i} holds a token id outside the vocabulary of `{name}` "
                             f"(0 to {vocab_size - 1})")
