"""Reads a checkpoint's files into the page cache in background threads, so that a fresh process reads the disk
while it imports torch, starts CUDA and builds the network; the engine's reader (engine/safetensors_reader.py) then
finds the bytes in memory, or waits on the same pages in flight, and the disk reads each byte once.

Imports only the standard library: the engine core process and the wake benchmark's fresh process start it before
torch. The files are read in the order the engine reads them (file after file, each from its start) by a few
threads that take consecutive pieces. A checkpoint too small to matter, or one that would not fit in the memory
available (reading it ahead would evict its own first pages before the engine reads them), is not read ahead."""

from __future__ import annotations

import os
import threading

PIECE_BYTES = 16 << 20
THREADS = 4
MIN_BYTES = 256 << 20
MAX_SHARE_OF_AVAILABLE_MEMORY = 0.5

_lock = threading.Lock()
_running: dict[tuple[str, ...], "CheckpointPrefetch"] = {}


def checkpoint_files(source: str) -> list[str]:
    """The weight files of a model directory (*.safetensors) or a .gguf file; none for other sources (random:,
    pkg:, a path that is not there: the loader reports those)."""
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return [path]
    return []


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CheckpointPrefetch:
    """Threads reading `files` through once, in order; `bytes_read` counts what they have read."""

    def __init__(self, files: list[str], threads: int = THREADS, piece_bytes: int = PIECE_BYTES) -> None:
        self.files = list(files)
        self.bytes_read = 0
        self._pieces = iter([(file, at, min(piece_bytes, size - at))
                             for file, size in ((f, os.path.getsize(f)) for f in self.files)
                             for at in range(0, size, piece_bytes)])
        self._take = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read, args=(piece_bytes,), name=f"tollgate-prefetch-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    @property
    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every thread has finished (within timeout seconds, shared by all)."""
        for thread in self._threads:
            thread.join(timeout)
        return self.done

    def stop(self) -> None:
        """The threads end after the piece each is reading."""
        self._stop.set()

    def _next(self) -> tuple[str, int, int] | None:
        with self._take:
            return next(self._pieces, None)

    def _read(self, piece_bytes: int) -> None:
        buffer = bytearray(piece_bytes)
        view = memoryview(buffer)
        fds: dict[str, int] = {}
        try:
            while not self._stop.is_set() and (piece := self._next()) is not None:
                file, at, length = piece
                if file not in fds:
                    fds[file] = os.open(file, os.O_RDONLY)
                done = 0
                while done < length:
                    n = os.preadv(fds[file], [view[done:length]], at + done)
                    if n <= 0:
                        break  # the file shrank: the loader will say so
                    done += n
                with self._take:
                    self.bytes_read += done
        except OSError:
            pass  # a read ahead that fails costs nothing: the loader reads the file itself and reports its error
        finally:
            for fd in fds.values():
                os.close(fd)


def prefetch_checkpoint(source: str, min_bytes: int = MIN_BYTES, threads: int = THREADS,
                        piece_bytes: int = PIECE_BYTES) -> CheckpointPrefetch | None:
    """Starts reading the checkpoint of `source` (a model path, as EngineConfig.model) ahead, once per process
    for the same files while a read is under way; None when it is not read ahead."""
    try:
        files = checkpoint_files(source)
        total = sum(os.path.getsize(f) for f in files)
    except (OSError, TypeError, ValueError):
        return None
    available = available_memory_bytes()
    if not files or total < min_bytes or (available is not None and total > MAX_SHARE_OF_AVAILABLE_MEMORY * available):
        return None
    key = tuple(files)
    with _lock:
        running = _running.get(key)
        if running is not None and not running.done:
            return running
        _running[key] = CheckpointPrefetch(files, threads, piece_bytes)
        return _running[key]
