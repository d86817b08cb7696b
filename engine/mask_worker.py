"""One process of engine/mask_processes.py: it holds the llguidance matchers of the sequences given to it, has each
consume its sequence's new tokens and writes their masks into a shared buffer, one message a step.

    python -m engine.mask_worker CONN_FD BUFFER_FD BUFFER_BYTES

It imports llguidance and the standard library only (no torch): it starts in well under a second, and its only
Python thread never waits for another's GIL, which is what kept a thread of the engine's process from filling masks
while the engine thread ran (docs/benchmarks/structured.md)."""

from __future__ import annotations

import mmap
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

# parent -> worker: ("init", tokenizer_json, vocab_size, eos_ids, row_bytes, rows_per_buffer)
#                   ("step", new, dropped, consume, fill, buffer)  new: [(key, grammar_key, grammar_text)],
#                   dropped: [key], consume: [(key, [token, ...])], fill: [(key, row)], buffer: which half to fill
#                   ("stop",)
# worker -> parent: ("ok", [(consume item, tokens it accepted, the error of the next)] for the items with a token
#                   outside the grammar (none, usually)) or ("error", traceback)


class Matchers:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], row_bytes: int,
                 rows_per_buffer: int, buffer: mmap.mmap) -> None:
        import ctypes

        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.row_bytes = row_bytes
        self.rows_per_buffer = rows_per_buffer
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        self.templates: dict[str, Any] = {}  # grammar key -> a matcher in its start state
        self.matchers: dict[int, Any] = {}  # sequence key -> its matcher

    def add(self, key: int, grammar_key: str, text: str) -> None:
        template = self.templates.get(grammar_key)
        if template is None:
            template = self.templates[grammar_key] = self._llg.LLMatcher(self.tokenizer, text, log_level=0)
        self.matchers[key] = template.deep_copy()

    def consume(self, key: int, tokens: list[int]) -> tuple[int, str | None]:
        """Tokens accepted before the first one outside the grammar (all of them, usually), and its error."""
        matcher = self.matchers[key]
        for i, token in enumerate(tokens):
            if not matcher.consume_token(token):
                return i, matcher.get_error()
        return len(tokens), None

    def fill(self, key: int, row: int, buffer: int) -> None:
        address = self.base + (buffer * self.rows_per_buffer + row) * self.row_bytes
        self.matchers[key].unsafe_compute_mask_ptr(address, self.row_bytes)

    def step(self, new: list, dropped: list[int], consume: list, fill: list, buffer: int) -> list:
        for key in dropped:
            self.matchers.pop(key, None)
        for key, grammar_key, text in new:
            self.add(key, grammar_key, text)
        refused = []
        for i, (key, tokens) in enumerate(consume):
            accepted, error = self.consume(key, tokens)
            if error is not None:
                refused.append((i, accepted, error))
        for key, row in fill:
            self.fill(key, row, buffer)
        return refused


def serve(conn: Connection, buffer: mmap.mmap) -> None:
    matchers = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine went away
            return
        if message[0] == "stop":
            return
        try:
            if message[0] == "init":
                matchers = Matchers(*message[1:], buffer=buffer)
                reply = ("ok", [])
            else:
                reply = ("ok", matchers.step(*message[1:]))
        except Exception:  # noqa: BLE001 - the parent raises it with the traceback, naming this process
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:  # the engine closed its end while this step ran
            return


def main(argv: list[str]) -> None:
    conn_fd, buffer_fd, buffer_bytes = (int(a) for a in argv)
    buffer = mmap.mmap(buffer_fd, buffer_bytes)
    serve(Connection(conn_fd), buffer)


if __name__ == "__main__":
    main(sys.argv[1:])
