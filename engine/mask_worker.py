"""One process of engine/mask_processes.py: it holds the llguidance matchers of the sequences given to it, has each
consume its sequence's new tokens and writes their masks into a shared buffer.

    python -m engine.mask_worker CONN_FD BUFFER_FD BUFFER_BYTES

It imports llguidance and the standard library only (no torch): it starts in well under a second, and its only
Python thread never waits for another's GIL, which is what kept a thread of the engine's process from filling masks
while the engine thread ran (docs/benchmarks/structured.md).

A step comes one of two ways. Usually through the shared control block alone: the engine writes the step's tokens
into the shared buffer and bumps `seq`, and the worker runs its plan again (the sequences it had last step, in the
same rows). A message on the socket comes when anything else changes (sequences added or dropped, rows moved, a
catch-up) or while the worker sleeps. Between steps the worker spins on `seq` for `spin_s` (the engine then needs
no system call to wake it, which cost it about 50 us a process a step), then sleeps on the socket. A steady step may
also come before its tokens are on the host: the device copies them into the shared buffer behind its sampling, and
the worker starts on each row as soon as its token has landed there."""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

# parent -> worker: ("init", tokenizer_json, vocab_size, eos_ids, row_bytes, rows_per_buffer, tokens_offset,
#                            device_tokens_offset, control_offset, spin_s); each step's control.seq is written before
#                            its message is sent
#                   ("plan", seq, new, dropped, plan, half)  plan: [(key, row, batch_row)]: the key consumes token
#                            `row` of the half's tokens (`batch_row` of the device's), then writes its mask into the
#                            half's row; kept for RUN_PLAN and RUN_PLAN_ON_DEVICE_TOKENS steps
#                   ("step", seq, new, dropped, consume, fill, half)  new: [(key, grammar_key, grammar_text)],
#                            dropped: [key], consume: [(key, [token, ...])], fill: [(key, row)]
#                   ("wake",): look at the control block (sent for a plan step to a worker that sleeps)
#                   ("stop", seq)
# worker -> parent: the init's reply ("ok", []); after a step with refusals or an error (status REPLY):
#                   ("ok", [(consume item, tokens it accepted, the error of the next)]) or ("error", traceback)
RUN_PLAN, READ_MESSAGE, RUN_PLAN_ON_DEVICE_TOKENS = 0, 1, 2  # Control.kind
NO_TOKEN = -1  # a device token slot the device has not written yet
STATUS_OK, STATUS_REPLY = 0, 1  # Control.status
IDLE_POLL_S = 0.05  # a sleeping worker looks at seq this often too (a wake-up lost to memory ordering costs this)


class Control(ctypes.Structure):
    """One worker's control block in the shared buffer: the engine's cache line, then the worker's."""

    _fields_ = [("seq", ctypes.c_uint64), ("half", ctypes.c_uint32), ("kind", ctypes.c_uint32),
                ("_engine_pad", ctypes.c_char * 48),
                ("done", ctypes.c_uint64), ("status", ctypes.c_uint32), ("sleeping", ctypes.c_uint32),
                # the last step's, monotonic clock: started, had its tokens (later than started only when it
                # waited for the device's), done
                ("started_ns", ctypes.c_uint64), ("tokens_ns", ctypes.c_uint64), ("done_ns", ctypes.c_uint64),
                ("_worker_pad", ctypes.c_char * 24)]


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier (taking a lock is one): the stores before it are seen before the loads after it."""
    with _FENCE:
        pass


class Matchers:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], row_bytes: int,
                 rows_per_buffer: int, tokens_offset: int, device_tokens_offset: int, control_offset: int,
                 spin_s: float, buffer: mmap.mmap) -> None:
        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.row_bytes = row_bytes
        self.rows_per_buffer = rows_per_buffer
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        self.tokens = (ctypes.c_int32 * (2 * rows_per_buffer)).from_buffer(buffer, tokens_offset)
        self.device_tokens = (ctypes.c_int64 * (2 * rows_per_buffer)).from_buffer(buffer, device_tokens_offset)
        self.parent = os.getppid()
        self.control = Control.from_buffer(buffer, control_offset)
        self.spin_s = spin_s
        self.templates: dict[str, Any] = {}  # grammar key -> a matcher in its start state
        self.matchers: dict[int, Any] = {}  # sequence key -> its matcher
        self.plan: list[tuple[int, int, int]] = []

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

    def update(self, new: list, dropped: list[int]) -> None:
        for key in dropped:
            self.matchers.pop(key, None)
        for key, grammar_key, text in new:
            self.add(key, grammar_key, text)

    def step(self, new: list, dropped: list[int], consume: list, fill: list, buffer: int) -> list:
        self.update(new, dropped)
        refused = []
        for i, (key, tokens) in enumerate(consume):
            accepted, error = self.consume(key, tokens)
            if error is not None:
                refused.append((i, accepted, error))
        for key, row in fill:
            self.fill(key, row, buffer)
        return refused

    def run_plan(self, buffer: int, on_device_tokens: bool = False) -> list:
        """The plan's step: each key consumes its row's token of the buffer's tokens (or, on_device_tokens, its batch
        row's token once the device has copied it), then fills its row."""
        first = buffer * self.rows_per_buffer
        if on_device_tokens:
            consume = [(key, [self.device_token(first + batch_row)]) for key, _, batch_row in self.plan]
            self.control.tokens_ns = time.monotonic_ns()
        else:
            consume = [(key, [self.tokens[first + row]]) for key, row, _ in self.plan]
        return self.step([], [], consume, [(key, row) for key, row, _ in self.plan], buffer)

    def device_token(self, slot: int) -> int:
        """The token the device copies into device_tokens[slot], once it has. Raises _StepAbandoned if the engine
        hands over another step meanwhile (it is stopping) or has gone."""
        token = self.device_tokens[slot]
        if token != NO_TOKEN:
            return token
        control = self.control
        seq = control.done + 1  # the step this is: the engine hands over the next only once this one is done
        next_check = time.monotonic() + IDLE_POLL_S
        while (token := self.device_tokens[slot]) == NO_TOKEN:
            os.sched_yield()  # the engine thread may share this core
            if control.seq != seq:
                raise _StepAbandoned
            if time.monotonic() > next_check:
                if os.getppid() != self.parent:
                    raise EOFError
                next_check = time.monotonic() + IDLE_POLL_S
        return token

    def next_step(self, conn: Connection) -> tuple | None:
        """Waits for the next step: None to run the plan on control.half's tokens, else the step's message."""
        control = self.control
        done = control.done
        deadline = time.monotonic() + self.spin_s
        while control.seq == done and time.monotonic() < deadline:
            pass
        if control.seq == done:
            control.sleeping = 1
            fence()  # sleeping before seq is looked at again: the engine sends a wake-up, or this sees the step
            try:
                while control.seq == done:
                    if select.select([conn], [], [], IDLE_POLL_S)[0]:
                        message = conn.recv()
                        if message[0] != "wake":
                            return message
            finally:
                control.sleeping = 0
        if control.kind != READ_MESSAGE:
            return None
        while (message := conn.recv())[0] == "wake":  # a wake-up for a step this saw without it
            pass
        return message


class _StepAbandoned(Exception):
    """The engine handed over a new step while this one waited for the device's tokens."""


def serve(conn: Connection, buffer: mmap.mmap) -> None:
    message = conn.recv()
    try:
        matchers = Matchers(*message[1:], buffer=buffer)
        conn.send(("ok", []))
    except Exception:  # noqa: BLE001 - the parent raises it with the traceback, naming this process
        conn.send(("error", traceback.format_exc()))
        return
    control = matchers.control
    while True:
        try:
            message = matchers.next_step(conn)
        except (EOFError, OSError):  # the engine went away
            return
        if message is not None and message[0] == "stop":
            return
        control.started_ns = control.tokens_ns = time.monotonic_ns()
        try:
            if message is None:
                seq = control.seq
                refused = matchers.run_plan(control.half, control.kind == RUN_PLAN_ON_DEVICE_TOKENS)
            elif message[0] == "plan":
                seq = message[1]
                matchers.update(*message[2:4])
                matchers.plan = message[4]
                refused = matchers.run_plan(message[5])
            else:
                seq = message[1]
                refused = matchers.step(*message[2:])
            reply = ("ok", refused) if refused else None
        except _StepAbandoned:
            continue
        except EOFError:
            return
        except Exception:  # noqa: BLE001
            seq, reply = control.seq, ("error", traceback.format_exc())
        try:
            if reply is not None:
                conn.send(reply)
        except OSError:  # the engine closed its end while this step ran
            return
        control.status = STATUS_OK if reply is None else STATUS_REPLY
        control.done_ns = time.monotonic_ns()
        fence()  # the masks and the status before done
        control.done = seq


def main(argv: list[str]) -> None:
    conn_fd, buffer_fd, buffer_bytes = (int(a) for a in argv)
    buffer = mmap.mmap(buffer_fd, buffer_bytes)
    serve(Connection(conn_fd), buffer)


if __name__ == "__main__":
    main(sys.argv[1:])
