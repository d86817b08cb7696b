"""The OpenAI JSON shape of an embeddings response, its vectors as float lists or base64 (little-endian float32
bytes, what the official clients decode)."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np


class EmbeddingFormat:
    """What the ledger and the request ids need to know of the endpoint (as ChatFormat / CompletionFormat)."""

    endpoint = "embeddings"
    id_prefix = "embd-"


EMBEDDINGS = EmbeddingFormat()


def embedding_response(model: str, vectors: np.ndarray, encoding: Literal["float", "base64"],
                       prompt_tokens: int) -> dict[str, Any]:
    rows = np.asarray(vectors, dtype="<f4")
    if encoding == "base64":
        data = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        data = rows.tolist()
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
