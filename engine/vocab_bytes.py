"""A token's own bytes read off its vocabulary entry, for the two encodings most models' tokenizers use: byte-level BPE
(each byte written as one character of GPT-2's table: Llama 3, Qwen, SmolLM2) and SentencePiece with byte fallback
(`<0xNN>` pieces for bytes, '▁' for a space: Llama 2, Mistral). The detokenizer reads the few tokens it holds back at
the end of an output this way, on the engine thread, where building llguidance's view of the whole vocabulary
(Tokenizer.token_bytes' general path: 0.3 s for 49k tokens, more for 128k) would stall every stream of the replica."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

BYTE_LEVEL = "byte-level"
BYTE_FALLBACK = "byte-fallback"


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable Latin-1 bytes stand for themselves, every other
    byte (controls, space, 0x7F-0xA0, 0xAD) for the next unused code point from 256 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    kept = set(printable)
    for n, b in enumerate(b for b in range(256) if b not in kept):
        table[chr(256 + n)] = b
    return table


def vocabulary_encoding(hf_tokenizer: Any) -> str | None:
    """BYTE_LEVEL or BYTE_FALLBACK when the fast tokenizer's decoder says its vocabulary is written that way; None
    for any other (its tokens' bytes then come from llguidance's view)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return None
    parts = spec.get("decoders", [spec])  # a Sequence's decoders, or the one decoder
    kinds = [part.get("type") for part in parts]
    if kinds == ["ByteLevel"]:
        return BYTE_LEVEL
    spaces = any(part.get("type") == "Replace" and part.get("pattern", {}).get("String") == "▁"
                 and part.get("content") == " " for part in parts)
    if "ByteFallback" in kinds and spaces and "ByteLevel" not in kinds and "Metaspace" not in kinds:
        return BYTE_FALLBACK
    return None


class VocabularyBytes:
    """token ids -> their bytes for a tokenizer of a known encoding; None where a token needs llguidance's view (an
    added or special token, a piece outside the encoding's alphabet)."""

    def __init__(self, hf_tokenizer: Any, encoding: str) -> None:
        self._hf = hf_tokenizer
        self._size = len(hf_tokenizer)
        self._added = frozenset(hf_tokenizer.added_tokens_decoder)
        self._piece_bytes = _byte_level_bytes if encoding == BYTE_LEVEL else _byte_fallback_bytes

    def __call__(self, token_ids: Sequence[int]) -> bytes | None:
        ids = [t for t in token_ids if 0 <= t < self._size]  # an id past the vocabulary has no bytes
        if any(t in self._added for t in ids):
            return None
        out = bytearray()
        for piece in self._hf.convert_ids_to_tokens(ids):
            piece_bytes = self._piece_bytes(piece) if isinstance(piece, str) else None
            if piece_bytes is None:
                return None
            out += piece_bytes
        return bytes(out)


def _byte_level_bytes(piece: str) -> bytes | None:
    table = _byte_level_table()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:
        return None


def _byte_fallback_bytes(piece: str) -> bytes | None:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return piece.replace("▁", " ").encode("utf-8")
