"""Streams text as tokens arrive, without re-decoding the whole output at each step."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Tokens held back (ending inside a character, or adding no text) before their text goes out as it is. A character
# is at most 4 bytes: valid text added a token at a time (as the engine adds it) is never held for more than 3. A
# model made to emit stray bytes (logit_bias) or text-less tokens would otherwise have each step decode its whole
# held run, a cost that grows with every token (1.6 ms a token at 4,000 held on the 2-core box).
MAX_HELD_TOKENS = 32


def _unfinished_character_bytes(raw: bytes) -> int:
    """How many bytes at the end of `raw` begin a UTF-8 character that is not finished (0 to 3)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(raw, final=False)
    return len(decoder.getstate()[0])


class IncrementalDetokenizer:
    """The output is decoded as a sequence of its own, so that the pieces add up to tokenizer.decode(output_ids);
    the prompt does not change the text of the first output token. Text that ends inside a character is held back
    until the character completes, or finish(), or MAX_HELD_TOKENS tokens.

    Through the Rust tokenizer's streaming decoder where the tokenizer has one (Tokenizer.decode_stream), else by
    decoding a window: [prefix_offset, read_offset) were already emitted and give the context, [read_offset, end)
    are new, and the text the new ones add is the window's decode minus the context's."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = tokenizer.decode_stream(skip_special_tokens)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0  # the stream keeps the same two offsets, so a detokenizer can go on with windows
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        ids = [int(t) for t in token_ids]
        if not ids:
            return ""
        self._ids += ids
        return self._emit(final=False) if self._stream is None else self._stream_piece(ids)

    def add_token(self, token_id: int) -> str:
        """add([token_id]) for the usual step of one token."""
        self._ids.append(token_id)
        return self._emit(final=False) if self._stream is None else self._stream_piece(token_id)

    def _stream_piece(self, ids: int | list[int]) -> str:
        try:
            piece = self._stream(ids)
        except Exception:  # the window's text does not begin with its context's (random bytes): go on as windows do
            self._stream = None
            return self._emit(final=False)
        if piece is None:
            if len(self._ids) - self._read_offset > MAX_HELD_TOKENS:  # the stream would hold them for ever
                self._stream = None
                return self._emit(final=False)
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """The text held back, where the output ends: all of it but a character the output ended inside of, whose
        remaining bytes never came. Stray bytes that cannot begin a character stay (as U+FFFD), as they went out
        before while the output ran."""
        self._stream = None  # what it holds back is the window past its offsets, which are ours
        context_start, start = self._prefix_offset, self._read_offset
        piece = self._emit(final=True)
        if not piece.endswith(_REPLACEMENT_CHAR):
            return piece
        held = [self._tokenizer.token_bytes([t], self._skip_special_tokens) for t in self._ids[start:]]
        unfinished = _unfinished_character_bytes(b"".join(held))
        if not unfinished:
            return piece
        tail, covered = 0, 0  # the fewest last tokens that hold the unfinished character's bytes
        while covered < unfinished:
            tail += 1
            covered += len(held[-tail])
        if covered == unfinished:  # they hold nothing else (a byte-fallback decoder gives each its own U+FFFD)
            context = self._decode(self._ids[context_start:start])
            window = self._decode(self._ids[context_start:len(self._ids) - tail])
            kept = window[len(context):] if len(window) > len(context) else ""
        else:  # a token holds text and the character's first bytes: its decoder gave that character one U+FFFD
            kept = piece[:-1]
        self._pieces[-1] = kept
        return kept

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        grew = len(window) > len(context)
        # Text ending in U+FFFD is an incomplete UTF-8 character whose remaining bytes come with later tokens.
        held_back = not grew or window.endswith(_REPLACEMENT_CHAR)
        if held_back and not final and len(self._ids) - self._read_offset <= MAX_HELD_TOKENS:
            return ""
        piece = window[len(context):] if grew else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(piece)
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
