"""Structured outputs' matchers in processes of their own (engine/mask_worker.py), for engine/token_mask.py.

A thread of the engine's process that fills masks has to take the GIL back after each of llguidance's calls, and
gets it only when the engine thread blocks (or after sys.getswitchinterval(), 5 ms): the fill ran after the engine
thread's host work instead of beside it. Here the engine thread sends each process its sequences' new tokens as soon
as it has read them (one message a process) and collects the masks when it samples, while the processes consume
and fill in parallel with it and with each other. The masks land in one shared buffer, registered with CUDA so the
copy to the device is asynchronous; it has two halves, filled in turn, so a step's fill never writes rows whose
copy to the device may not have run yet.

A process that dies (killed, out of memory) is started again, and its sequences' matchers are rebuilt there from
their tokens: TokenMasker catches them up like any sequence whose matcher is behind."""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.grammar import SequenceGrammar

log = logging.getLogger(__name__)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mask_worker.py")


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    live: int = 0  # sequences it holds
    new: list[tuple[int, str, str]] = field(default_factory=list)  # sequences to add with the next message
    dropped: list[int] = field(default_factory=list)  # sequences to forget with the next message
    grammars: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)  # key -> grammar


class MaskProcesses:
    """`num_processes` workers, each with the matchers of the sequences assign() gave it; masks are written to
    buffer(half)[row]. send() and receive() make one round trip: at most one is under way at a time."""

    def __init__(self, num_processes: int, ll_tokenizer_json: str, vocab_size: int, eos: list[int],
                 rows: int, mask_words: int, device: torch.device) -> None:
        self._init = ("init", ll_tokenizer_json, vocab_size, eos, mask_words * 4, rows)
        nbytes = 2 * rows * mask_words * 4
        self._fd = os.memfd_create("tollgate-masks")
        os.ftruncate(self._fd, nbytes)
        self._map = mmap.mmap(self._fd, nbytes)
        self._words = torch.frombuffer(self._map, dtype=torch.int32).view(2, rows, mask_words)
        self._registered = False
        if device.type == "cuda":
            torch.cuda.cudart().cudaHostRegister(self._words.data_ptr(), nbytes, 0)
            self._registered = True
        self._keys = itertools.count()
        self._lock = threading.Lock()  # drops may come from any thread (a sequence's last reference)
        self._workers = [self._spawn() for _ in range(num_processes)]
        for worker in self._workers:  # each builds its view of the tokenizer (about a second), all at once
            self._reply(worker)
        self._sent: list[int] = []  # workers a reply is awaited from
        self._sent_consume: list[list[SequenceGrammar]] = []

    def buffer(self, half: int) -> torch.Tensor:
        """[rows, mask_words] int32 on the host, pinned for a CUDA device."""
        return self._words[half]

    def _spawn(self) -> _Worker:
        """A worker started and sent its set-up; its reply is still to be read. Its own session: a Ctrl-C meant for
        the engine does not reach it, and it exits when the engine's end of the socket closes."""
        parent, child = socket.socketpair()
        process = subprocess.Popen([sys.executable, WORKER, str(child.fileno()), str(self._fd), str(len(self._map))],
                                   pass_fds=(child.fileno(), self._fd), stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        child.close()
        conn = Connection(parent.detach())
        conn.send(self._init)
        return _Worker(process, conn)

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

    def send(self, consume: list[tuple[SequenceGrammar, list[int]]], fill: list[tuple[SequenceGrammar, int]],
             half: int) -> None:
        """Each worker's share of the work: its grammars consume their tokens (in order), then write their masks
        into buffer(half)[row]. Returns at once."""
        assert not self._sent, "receive() the last round trip first"
        by_worker: dict[int, tuple[list, list, list]] = {}
        for grammar, tokens in consume:
            share = by_worker.setdefault(grammar.worker, ([], [], []))
            share[0].append((grammar.key, tokens))
            share[2].append(grammar)
        for grammar, row in fill:
            by_worker.setdefault(grammar.worker, ([], [], []))[1].append((grammar.key, row))
        for index, (consume_keys, fill_rows, grammars) in by_worker.items():
            worker = self._workers[index]
            with self._lock:
                new, worker.new = worker.new, []
                dropped, worker.dropped = worker.dropped, []
            try:
                worker.conn.send(("step", new, dropped, consume_keys, fill_rows, half))
            except OSError:
                pass  # a dead worker: receive() finds out and starts it again
            self._sent.append(index)
            self._sent_consume.append(grammars)

    def receive(self) -> tuple[list[tuple[SequenceGrammar, int, str]], set[int]]:
        """Waits for the round trip's replies: (grammar, tokens it accepted, the error of the first it did not) for
                each consume item with a token outside its grammar, and the workers that had died. Each of those is running
        again with none of its matchers: every grammar it held is reset (SequenceGrammar.reset), and its part of the
        round trip (masks and consume items) is missing."""
        sent, consumed = self._sent, self._sent_consume
        self._sent, self._sent_consume = [], []
        refused: list[tuple[SequenceGrammar, int, str]] = []
        restarted: set[int] = set()
        for index, grammars in zip(sent, consumed):
            try:
                replies = self._reply(self._workers[index])
            except (EOFError, OSError):
                self._restart(index)
                restarted.add(index)
                continue
            refused.extend((grammars[i], accepted, error) for i, accepted, error in replies)
        return refused, restarted

    def _reply(self, worker: _Worker) -> list:
        status, value = worker.conn.recv()
        if status != "ok":
            raise RuntimeError(f"structured-output mask process {worker.process.pid} failed:\n{value}")
        return value

    def _restart(self, index: int) -> None:
        old = self._workers[index]
        log.warning("structured-output mask process %d exited (%s); starting it again", old.process.pid,
                    old.process.poll())
        old.conn.close()
        old.process.kill()
        old.process.wait()
        worker = self._spawn()
        self._reply(worker)
        worker.live = old.live
        for key, grammar in list(old.grammars.items()):
            grammar.reset()
            worker.grammars[key] = grammar
            worker.new.append((key, grammar.grammar_key, grammar.text))
        self._workers[index] = worker

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(("stop",))
            except OSError:
                pass
            worker.conn.close()
        for worker in self._workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._words.data_ptr())
            self._registered = False
        self._workers = []
