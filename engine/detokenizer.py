"""Streams text as tokens arrive, without re-decoding the whole output at each step."""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a window of tokens: [prefix_offset, read_offset) were already emitted and give the context,
    [read_offset, end) are new; the text the new ones add is the window's decode minus the context's.

    The output is decoded as a sequence of its own, so that the pieces add up to
    tokenizer.decode(output_ids); the prompt does not change the text of the first output token."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        grew = len(window) > len(context)
        # Text ending in U+FFFD is an incomplete UTF-8 character whose remaining bytes come with later tokens.
        if not final and (not grew or window.endswith(_REPLACEMENT_CHAR)):
            return ""
        piece = window[len(context):] if grew else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(piece)
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
