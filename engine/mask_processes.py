"""Structured outputs' matchers in processes of their own (engine/mask_worker.py), for engine/token_mask.py.

A thread of the engine's process that fills masks has to take the GIL back after each of llguidance's calls, and
gets it only when the engine thread blocks (or after sys.getswitchinterval(), 5 ms): the fill ran after the engine
thread's host work instead of beside it. Here the engine thread hands each process its sequences' new tokens as soon
as it has read them and collects the masks when it samples, while the processes consume and fill in parallel with
it and with each other. The masks land in one shared buffer, registered with CUDA so the copy to the device is
asynchronous; it has two halves, filled in turn, so a step's fill never writes rows whose copy to the device may not
have run yet.

Every system call on the engine thread lengthens the step, and waking a process that sleeps on a socket was the
dearest of them: a steady step (the same sequences in the same rows) is handed over through shared memory alone,
to processes that spin between steps while the machine has cores to spare (spin_s), and collected the same way;
the socket carries what changes, refusals and errors (engine/mask_worker.py).

A steady step's tokens need not wait for the engine thread at all: send_steady_from_device has the device copy them
into the shared buffer right behind the sampling that made them (the buffer is registered with CUDA), and each
worker starts its plan when its rows' tokens land there, while the engine thread is still busy with the step before.

The GPU may also wait for the masks itself (wait_on_device): the copy of a round's masks to the device is queued
behind a wait on each worker's `done` counter (engine/stream_ops.py), so the engine thread launches the
sampling and goes on while the workers finish, and collects their replies (receive()) later.

A process that dies (killed, out of memory) is started again, and its sequences' matchers are rebuilt there from
their tokens: TokenMasker catches them up like any sequence whose matcher is behind. Its successor counts steps on
from where it left off, so the step a GPU may be waiting for is the successor's next one."""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from engine.mask_worker import NO_TOKEN, READ_MESSAGE, RUN_PLAN, RUN_PLAN_ON_DEVICE_TOKENS, STATUS_REPLY, Control, fence
from engine.stream_ops import stream_ops

if TYPE_CHECKING:
    from engine.grammar import SequenceGrammar

log = logging.getLogger(__name__)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mask_worker.py")
DEFAULT_PROCESSES = 4  # on a CUDA device with the cores: the constrained step measured fastest with 4 (16-core host)
SPIN_S = 0.05  # how long a worker spins after a step before it sleeps, where the machine has the cores
LIVENESS_CHECK_S = 0.002  # while the engine thread waits for a worker, it looks this often whether it died
_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the device can address the buffer (the counters it waits on)


def spin_seconds(num_processes: int) -> float:
    """SPIN_S where every worker can have a core of its own beside the engine's threads, else 0 (they sleep on
    their sockets between steps: on a small machine a spinning worker would take the engine thread's core)."""
    return SPIN_S if len(os.sched_getaffinity(0)) >= 2 * num_processes + 2 else 0.0


def default_processes(device: torch.device) -> int:
    """EngineConfig.structured_output_processes when not set: DEFAULT_PROCESSES on a CUDA device where each can spin
    on a core of its own (spin_seconds), else 0. Without spare cores, or on a CPU device (whose steps are long beside
    the masks), the worker thread in the engine's process measured faster (docs/benchmarks/structured.md)."""
    return DEFAULT_PROCESSES if device.type == "cuda" and spin_seconds(DEFAULT_PROCESSES) > 0 else 0


@dataclass
class RoundTripTimes:
    """Totals over round trips, for benchmarks (seconds). Summed over the workers of each round: from the hand-over
    to the worker starting the step, from then until it had its tokens (waiting for the device's), and its work
    after that. Once a round: how long the workers had between the first one having its tokens and receive()
    beginning (the window the masks could hide in, 0 if none), how long after receive() began the last worker was
    done (0 if before), and from then until receive() returned."""

    rounds: int = 0
    start_lag_s: float = 0.0
    token_wait_s: float = 0.0
    work_s: float = 0.0
    window_s: float = 0.0
    late_s: float = 0.0
    notice_s: float = 0.0

    def add(self, handed_ns: int, started_ns: int, tokens_ns: int, done_ns: int) -> None:
        self.start_lag_s += max(0, started_ns - handed_ns) * 1e-9
        self.token_wait_s += max(0, tokens_ns - started_ns) * 1e-9
        self.work_s += max(0, done_ns - max(started_ns, tokens_ns)) * 1e-9

    def add_round(self, first_tokens_ns: int, receive_ns: int, last_done_ns: int, returned_ns: int) -> None:
        self.rounds += 1
        self.window_s += max(0, receive_ns - first_tokens_ns) * 1e-9
        self.late_s += max(0, last_done_ns - receive_ns) * 1e-9
        self.notice_s += max(0, returned_ns - max(last_done_ns, receive_ns)) * 1e-9


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    control: Control
    seq: int = 0  # the last step handed to it
    handed_ns: int = 0  # when (monotonic clock)
    messages: int = 0  # steps (and wake-ups) it was sent on its socket
    live: int = 0  # sequences it holds
    new: list[tuple[int, str, str]] = field(default_factory=list)  # sequences to add with the next message
    dropped: list[int] = field(default_factory=list)  # sequences to forget with the next message
    plan: list[tuple[int, int]] | None = None  # (key, row) of its last plan: a step with the same one needs no message
    grammars: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)  # key -> grammar


class MaskProcesses:
    """`num_processes` workers, each with the matchers of the sequences assign() gave it; masks are written to
    buffer(half)[row]. A round trip (send_ahead() or send(), then receive()) is under way at most one at a time."""

    def __init__(self, num_processes: int, ll_tokenizer_json: str, vocab_size: int, eos: list[int],
                 rows: int, mask_words: int, device: torch.device, spin_s: float | None = None) -> None:
        """`spin_s`: how long the workers spin after a step before they sleep (spin_seconds() when not given)."""
        masks_bytes = 2 * rows * mask_words * 4
        device_tokens_offset = masks_bytes  # int64 [2, rows], beside the masks: one range registered with CUDA
        tokens_offset = device_tokens_offset + 2 * rows * 8
        control_offset = -(-(tokens_offset + 2 * rows * 4) // 128) * 128
        nbytes = control_offset + num_processes * ctypes.sizeof(Control)
        self.spin_s = spin_seconds(num_processes) if spin_s is None else spin_s
        self._setup = (ll_tokenizer_json, vocab_size, eos, mask_words * 4, rows, tokens_offset, device_tokens_offset)
        self._control_offset = control_offset
        self._fd = os.memfd_create("tollgate-masks")
        os.ftruncate(self._fd, nbytes)
        self._map = mmap.mmap(self._fd, nbytes)
        self._words = torch.frombuffer(self._map, dtype=torch.int32, count=2 * rows * mask_words).view(
            2, rows, mask_words)
        self._rows = rows
        self._tokens = (ctypes.c_int32 * (2 * rows)).from_buffer(self._map, tokens_offset)  # [2, rows]
        self._device_tokens = torch.frombuffer(self._map, dtype=torch.int64, count=2 * rows,
                                               offset=device_tokens_offset).view(2, rows)
        self._device_slots: dict[tuple[int, int], tuple[torch.Tensor, int, int]] = {}  # (half, batch rows) -> slots
        self._registered = False
        self.stream_ops = None  # the driver's stream operations, where the GPU can wait on the workers' counters
        self._done_on_device: list[int] = []  # each worker's `done` counter, as the device addresses it
        self._device_waits = False  # a wait_on_device was queued: close() lets the device pass it
        if device.type == "cuda":
            torch.cuda.cudart().cudaHostRegister(self._words.data_ptr(), nbytes, _HOST_REGISTER_MAPPED)
            self._registered = True
            self.stream_ops = stream_ops()
            if self.stream_ops is not None:
                base = self.stream_ops.device_address(self._words.data_ptr())
                self._done_on_device = [base + control_offset + i * ctypes.sizeof(Control) + Control.done.offset
                                        for i in range(num_processes)]
        self._keys = itertools.count()
        self._lock = threading.Lock()  # drops may come from any thread (a sequence's last reference)
        self._workers = [self._spawn(i) for i in range(num_processes)]
        for worker in self._workers:  # each builds its view of the tokenizer (about a second), all at once
            self._reply(worker)
        self._sent: list[tuple[int, int]] = []  # (worker, step) a reply is awaited from
        self._sent_consume: list[list[int]] = []  # the keys of each one's consume items, in order
        self._last_plans: list[tuple[int, list[int]]] = []  # send_ahead's workers and their plans' keys
        self.times = RoundTripTimes()

    @property
    def num_processes(self) -> int:
        return len(self._workers)

    def buffer(self, half: int) -> torch.Tensor:
        """[rows, mask_words] int32 on the host, pinned for a CUDA device."""
        return self._words[half]

    def _spawn(self, index: int, seq: int = 0) -> _Worker:
        """A worker started and sent its set-up, its steps counted on from `seq` (done); its reply is still to be
        read. Its own session: a Ctrl-C meant for the engine does not reach it, and it exits when the engine's end
        of the socket closes."""
        control_offset = self._control_offset + index * ctypes.sizeof(Control)
        control = Control.from_buffer(self._map, control_offset)
        ctypes.memset(ctypes.addressof(control), 0, ctypes.sizeof(Control))
        control.seq = control.done = seq
        parent, child = socket.socketpair()
        process = subprocess.Popen([sys.executable, WORKER, str(child.fileno()), str(self._fd), str(len(self._map))],
                                   pass_fds=(child.fileno(), self._fd), stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        child.close()
        conn = Connection(parent.detach())
        conn.send(("init", *self._setup, control_offset, self.spin_s))
        return _Worker(process, conn, control, seq=seq)

    def assign(self, grammar: SequenceGrammar) -> None:
        """Gives the sequence's grammar to the worker holding the fewest; its matcher is made with the next message
        (from grammar.grammar_key and grammar.text)."""
        index = min(range(len(self._workers)), key=lambda i: self._workers[i].live)
        worker = self._workers[index]
        grammar.worker, grammar.key = index, next(self._keys)
        worker.live += 1
        worker.new.append((grammar.key, grammar.grammar_key, grammar.text))
        worker.grammars[grammar.key] = grammar
        weakref.finalize(grammar, self._drop, index, grammar.key).atexit = False

    def _drop(self, index: int, key: int) -> None:
        with self._lock:
            if index >= len(self._workers):  # closed
                return
            worker = self._workers[index]
            worker.live -= 1
            worker.dropped.append(key)

    def _changes(self, worker: _Worker) -> tuple[list, list[int]]:
        with self._lock:
            new, worker.new = worker.new, []
            dropped, worker.dropped = worker.dropped, []
        return new, dropped

    def _hand_over(self, index: int, message: tuple | None, half: int, kind: int = RUN_PLAN) -> None:
        """Step worker.seq + 1 to the worker: the message, or (None) its plan again on the half's tokens (`kind`
        says which: those the engine wrote, or those the device copies)."""
        worker = self._workers[index]
        worker.seq += 1
        worker.handed_ns = time.monotonic_ns()
        control = worker.control
        control.half = half
        control.kind = kind if message is None else READ_MESSAGE
        fence()  # the tokens, half and kind before seq
        control.seq = worker.seq
        fence()  # seq before sleeping is looked at: the worker sees the step, or this sees that it sleeps
        if message is None and control.sleeping:
            message = ("wake",)
        elif message is not None:
            message = (message[0], worker.seq) + message[1:]
        if message is not None:
            worker.messages += 1
            try:
                worker.conn.send(message)
            except OSError:
                pass  # a dead worker: receive() finds out and starts it again

    def send_ahead(self, grammars: list[SequenceGrammar], tokens: list[int], half: int,
                   batch_rows: list[int]) -> None:
        """grammars[i] consumes tokens[i], then writes its mask into buffer(half)[i]. Returns at once. batch_rows[i]:
        the row of grammars[i]'s sequence in its step's batch (where send_steady_from_device finds its token)."""
        assert not self._sent, "receive() the last round trip first"
        first = half * self._rows
        self._tokens[first: first + len(tokens)] = tokens
        plans: dict[int, tuple[list, list]] = {}
        for row, (grammar, batch_row) in enumerate(zip(grammars, batch_rows)):
            plan = plans.setdefault(grammar.worker, ([], []))
            plan[0].append((grammar.key, row, batch_row))
            plan[1].append(grammar.key)
        self._last_plans = []
        for index, (plan, keys) in plans.items():
            worker = self._workers[index]
            message = None
            if worker.new or worker.dropped or plan != worker.plan:
                message = ("plan", *self._changes(worker), plan, half)
                worker.plan = plan
            self._hand_over(index, message, half)
            self._sent.append((index, worker.seq))
            self._sent_consume.append(keys)
            self._last_plans.append((index, keys))

    def unchanged(self) -> bool:
        """Whether no grammar of a worker in the last plans has gone since send_ahead: the plans still hold. (One
        that came waits for the next message; a plan names only what it consumes.)"""
        workers = self._workers
        return bool(self._last_plans) and not any(workers[index].dropped for index, _ in self._last_plans)

    def send_steady(self, tokens: list[int], half: int) -> None:
        """send_ahead for the grammars of the last send_ahead in the same rows, while unchanged(): each worker runs
        its plan again on these tokens (tokens[i] for row i), with no message. Returns at once."""
        assert not self._sent and self._last_plans, "receive() the last round trip first, after a send_ahead"
        first = half * self._rows
        self._tokens[first: first + len(tokens)] = tokens
        self._run_plans(half, RUN_PLAN)

    def takes_from_device(self, batch_rows: int) -> bool:
        """Whether send_steady_from_device has a slot for each of a batch's rows."""
        return batch_rows <= self._rows

    def send_steady_from_device(self, tokens: torch.Tensor, half: int, staged: bool = False) -> None:
        """send_steady with the step's tokens still on the device (tokens[r]: the token of batch row r, as sampled):
        their copy into the shared buffer is queued behind the sampling (unless `staged`: stage_device_tokens did),
        and each worker runs its plan once its rows' tokens have landed. Returns at once, before the device has
        them."""
        assert not self._sent and self._last_plans, "receive() the last round trip first, after a send_ahead"
        if not staged:
            self.stage_device_tokens(tokens, half)
        self._run_plans(half, RUN_PLAN_ON_DEVICE_TOKENS)

    def stage_device_tokens(self, tokens: torch.Tensor, half: int) -> None:
        """The copy of a steady step's tokens from the device into the half's slots, queued now (behind the sampling
        that makes them), for a send_steady_from_device that may come after the round trip under way is received.
        That round trip must use the other half."""
        assert self.takes_from_device(tokens.numel())
        found = self._device_slots.get((half, tokens.numel()))
        if found is None:
            slots = self._device_tokens[half, : tokens.numel()]
            found = self._device_slots[half, tokens.numel()] = (slots, slots.data_ptr(), slots.nbytes)
        slots, address, nbytes = found
        ctypes.memset(address, NO_TOKEN & 0xFF, nbytes)  # no worker reads this half's slots now
        ops = self.stream_ops
        if ops is not None and tokens.is_cuda and tokens.dtype == slots.dtype and tokens.is_contiguous():
            ops.copy_to_host(address, tokens.data_ptr(), nbytes, ops.current_stream(tokens.device.index))
        else:
            slots.copy_(tokens, non_blocking=True)

    def _run_plans(self, half: int, kind: int) -> None:
        for index, keys in self._last_plans:
            self._hand_over(index, None, half, kind)
            self._sent.append((index, self._workers[index].seq))
            self._sent_consume.append(keys)

    def send(self, consume: list[tuple[SequenceGrammar, list[int]]], fill: list[tuple[SequenceGrammar, int]],
             half: int, also: set[int] = frozenset()) -> None:
        """Each worker's share of the work: its grammars consume their tokens (in order), then write their masks
        into buffer(half)[row]. Workers in `also` are handed a step even with no share (a GPU waits for it).
        Returns at once."""
        assert not self._sent, "receive() the last round trip first"
        by_worker: dict[int, tuple[list, list, list]] = {index: ([], [], []) for index in also}
        for grammar, tokens in consume:
            share = by_worker.setdefault(grammar.worker, ([], [], []))
            share[0].append((grammar.key, tokens))
            share[2].append(grammar.key)
        for grammar, row in fill:
            by_worker.setdefault(grammar.worker, ([], [], []))[1].append((grammar.key, row))
        self._last_plans = []  # a steady step needs a send_ahead first
        for index, (consume_items, fill_rows, keys) in by_worker.items():
            worker = self._workers[index]
            self._hand_over(index, ("step", *self._changes(worker), consume_items, fill_rows, half), half)
            self._sent.append((index, worker.seq))
            self._sent_consume.append(keys)

    @property
    def can_wait_on_device(self) -> bool:
        """Whether wait_on_device can queue its waits (a CUDA device whose driver has stream memory operations)."""
        return bool(self._done_on_device)

    def wait_on_device(self, stream: int) -> None:
        """Has `stream` wait until every worker of the round trip under way has done its step (its masks written),
        so work queued on it next (the masks' copy) follows them (`stream`: a CUstream handle, as torch's
        Stream.cuda_stream). receive() must still be called before the host waits for anything behind the stream:
        it is what starts a dead worker again, whose successor's next step is the one the stream waits for."""
        assert self.can_wait_on_device
        for index, seq in self._sent:
            self.stream_ops.wait_value(stream, self._done_on_device[index], seq)
        self._device_waits = True

    def release_device_waits(self) -> None:
        """Lets the device pass every wait_on_device queued (the masks behind them may be stale): for stopping,
        or giving up on workers that keep dying."""
        for worker in self._workers:
            worker.control.done = worker.seq

    def receive(self) -> tuple[list[tuple[SequenceGrammar, int, str]], set[int]]:
        """Waits for the round trip's replies: (grammar, tokens it accepted, the error of the first it did not) for
        each consume item with a token outside its grammar, and the workers that had died. Each of those is running
        again with none of its matchers: every grammar it held is reset (SequenceGrammar.reset), and its part of the
        round trip (masks and consume items) is missing."""
        sent, consumed = self._sent, self._sent_consume
        self._sent, self._sent_consume = [], []
        refused: list[tuple[SequenceGrammar, int, str]] = []
        restarted: set[int] = set()
        receive_ns = last_done_ns = time.monotonic_ns()
        first_tokens_ns = receive_ns
        times = self.times
        for (index, seq), keys in zip(sent, consumed):
            worker = self._workers[index]
            try:
                self._wait(worker, seq)
                replies = self._reply(worker) if worker.control.status == STATUS_REPLY else []
            except (EOFError, OSError):
                self._restart(index)
                restarted.add(index)
                continue
            control = worker.control
            done_ns = control.done_ns
            times.add(worker.handed_ns, control.started_ns, control.tokens_ns, done_ns)
            first_tokens_ns = min(first_tokens_ns, control.tokens_ns)
            last_done_ns = max(last_done_ns, done_ns)
            for i, accepted, error in replies:
                grammar = worker.grammars.get(keys[i])
                if grammar is not None:  # else its sequence has finished meanwhile
                    refused.append((grammar, accepted, error))
        if sent:
            times.add_round(first_tokens_ns, receive_ns, last_done_ns, time.monotonic_ns())
        return refused, restarted

    @staticmethod
    def _wait(worker: _Worker, seq: int) -> None:
        """Returns once the worker has done step `seq`; EOFError if it died first."""
        control = worker.control
        if control.done == seq:
            return
        next_check = time.perf_counter() + LIVENESS_CHECK_S
        while control.done != seq:
            os.sched_yield()  # the workers may share this thread's cores
            if time.perf_counter() > next_check:
                if worker.process.poll() is not None:
                    raise EOFError
                next_check = time.perf_counter() + LIVENESS_CHECK_S

    def _reply(self, worker: _Worker) -> list:
        status, value = worker.conn.recv()
        if status != "ok":
            raise RuntimeError(f"structured-output mask process {worker.process.pid} failed:\n{value}")
        return value

    def _restart(self, index: int) -> None:
        old = self._workers[index]
        self._last_plans = []
        log.warning("structured-output mask process %d exited (%s); starting it again", old.process.pid,
                    old.process.poll())
        old.conn.close()
        old.process.kill()
        old.process.wait()
        worker = self._spawn(index, old.seq - 1)  # old.seq, the step it died in, is its successor's next
        self._reply(worker)
        worker.live = old.live
        for key, grammar in list(old.grammars.items()):
            grammar.reset()
            worker.grammars[key] = grammar
            worker.new.append((key, grammar.grammar_key, grammar.text))
        self._workers[index] = worker

    def close(self) -> None:
        self._last_plans = []
        for index in range(len(self._workers)):
            self._hand_over(index, ("stop",), 0)
        for worker in self._workers:
            worker.conn.close()
        for worker in self._workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        if self._device_waits:  # the device must be past every wait before the counters go away
            self.release_device_waits()
            try:
                torch.cuda.synchronize()
            except RuntimeError:  # the CUDA context is gone (interpreter exit) or broken: nothing waits any more
                pass
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._words.data_ptr())
            self._registered = False
        self._workers = []
