"""Reads safetensors files at the storage's speed, as ServerlessLLM loads checkpoints.

The tensors of each file are grouped, in file order, into segments of about SEGMENT_BYTES (a larger tensor is a
segment of its own); each segment becomes one buffer on the target device, and its tensors are views of it. The
bytes come off the disk in pieces of PIECE_BYTES read by several threads at once (positioned reads on one file
descriptor, so more than one request is in flight). On CUDA a piece lands in a ring of pinned host buffers and is
copied to the device asynchronously while the next pieces are read; a ring buffer is read into again only once
its copy has finished. On a CPU the pieces are read straight into the segment's buffer."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

SEGMENT_BYTES = 256 << 20
PIECE_BYTES = 32 << 20
READ_THREADS = 4
RING_SIZE = 8  # pinned pieces in flight (RING_SIZE * PIECE_BYTES of pinned host memory, kept for the process)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class Segment:
    file: str
    start: int
    end: int
    entries: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: str) -> list[TensorEntry]:
    """The file's tensors in the order of their bytes. ValueError for a file that is not safetensors."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            raise ValueError(f"{file}: not a safetensors file (header length {length} past the end)")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{file}: not a safetensors file (unreadable header: {e})") from e
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {name} has dtype {info.get('dtype')!r}, which is not read here")
        begin, end = info["data_offsets"]
        entry = TensorEntry(name, dtype, tuple(info["shape"]), base + begin, base + end)
        numel = 1
        for dim in entry.shape:
            numel *= dim
        if entry.end - entry.start != numel * dtype.itemsize or entry.end > size:
            raise ValueError(f"{file}: tensor {name}'s bytes do not match its shape and dtype")
        entries.append(entry)
    return sorted(entries, key=lambda e: e.start)


def plan_segments(file: str, entries: list[TensorEntry], segment_bytes: int = SEGMENT_BYTES) -> list[Segment]:
    """Consecutive tensors grouped up to segment_bytes (a larger one alone). A segment starts at a multiple of 16
    bytes of the file, so a tensor's offset in its buffer keeps the alignment it has in the file."""
    segments: list[Segment] = []
    group: list[TensorEntry] = []

    def close() -> None:
        if group:
            segments.append(Segment(file, group[0].start - group[0].start % 16, group[-1].end, tuple(group)))
            group.clear()

    for entry in entries:
        if group and entry.end - group[0].start > segment_bytes:
            close()
        group.append(entry)
    close()
    return segments


def _read_exactly(fd: int, dest: torch.Tensor, offset: int) -> None:
    view = memoryview(dest.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


_ring_lock = threading.Lock()
_ring: list[torch.Tensor] = []


def _pinned_ring(piece_bytes: int, size: int) -> list[torch.Tensor]:
    """The process's pinned pieces, allocated once (pinning is slow) and reused by every load."""
    with _ring_lock:
        if len(_ring) != size or _ring[0].numel() != piece_bytes:
            _ring[:] = [torch.empty(piece_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(size)]
        return list(_ring)


def _tensor_of(buffer: torch.Tensor, segment: Segment, entry: TensorEntry) -> torch.Tensor:
    raw = buffer[entry.start - segment.start: entry.end - segment.start]
    if (entry.start - segment.start) % entry.dtype.itemsize:
        raw = raw.clone()  # an odd offset in the file: a fresh, aligned copy can take the dtype
    return raw.view(entry.dtype).view(entry.shape)


def iter_safetensors(files: list[str], names: dict[str, set[str]] | None = None,
                     device: torch.device | str = "cpu", segment_bytes: int = SEGMENT_BYTES,
                     piece_bytes: int = PIECE_BYTES, threads: int = READ_THREADS
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the files' tensors on `device`, in file order (only `names[file]`, when given). Each
    tensor is a view of its segment's buffer, which lives as long as some view of it does."""
    device = torch.device(device)
    segments = []
    for file in files:
        entries = read_header(file)
        if names is not None:
            entries = [e for e in entries if e.name in names[file]]
        segments += plan_segments(file, entries, segment_bytes)
    if not segments:
        return
    fds = {file: os.open(file, os.O_RDONLY) for file in files}
    try:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tollgate-read") as pool:
            if device.type == "cuda":
                yield from _to_cuda(segments, fds, pool, device, piece_bytes)
            else:
                yield from _to_host(segments, fds, pool, piece_bytes)
    finally:
        for fd in fds.values():
            os.close(fd)


def _pieces(segment: Segment, piece_bytes: int) -> list[tuple[int, int]]:
    """(offset in the segment, length) of its pieces."""
    return [(at, min(piece_bytes, segment.nbytes - at)) for at in range(0, segment.nbytes, piece_bytes)]


def _to_host(segments: list[Segment], fds: dict[str, int], pool: ThreadPoolExecutor, piece_bytes: int
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each segment read by the pool into its own buffer, the next segment's reads queued before this one's
    tensors are handed out."""
    def start(segment: Segment) -> tuple[torch.Tensor, list[Future]]:
        buffer = torch.empty(segment.nbytes, dtype=torch.uint8)
        fd = fds[segment.file]
        return buffer, [pool.submit(_read_exactly, fd, buffer[at: at + n], segment.start + at)
                        for at, n in _pieces(segment, piece_bytes)]

    pending = start(segments[0])
    for i, segment in enumerate(segments):
        buffer, reads = pending
        for read in reads:
            read.result()
        if i + 1 < len(segments):
            pending = start(segments[i + 1])
        for entry in segment.entries:
            yield entry.name, _tensor_of(buffer, segment, entry)


def _to_cuda(segments: list[Segment], fds: dict[str, int], pool: ThreadPoolExecutor, device: torch.device,
             piece_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Pieces read into the pinned ring ahead of their copies: piece k uses ring slot k % RING_SIZE, and its read
    waits for the copy out of that slot of piece k - RING_SIZE."""
    ring = _pinned_ring(piece_bytes, RING_SIZE)
    work = [(s, at, n) for s in segments for at, n in _pieces(s, piece_bytes)]
    copied: list[torch.cuda.Event | None] = [None] * len(ring)

    def read(k: int, event: torch.cuda.Event | None) -> None:
        segment, at, n = work[k]
        if event is not None:
            event.synchronize()
        _read_exactly(fds[segment.file], ring[k % len(ring)][:n], segment.start + at)

    reads: dict[int, Future] = {}

    def submit(k: int) -> None:
        if k < len(work):
            reads[k] = pool.submit(read, k, copied[k % len(ring)])

    for k in range(min(len(ring), len(work))):
        submit(k)
    buffer: torch.Tensor | None = None
    with torch.cuda.device(device):
        for k, (segment, at, n) in enumerate(work):
            if at == 0:
                buffer = torch.empty(segment.nbytes, dtype=torch.uint8, device=device)
            reads.pop(k).result()
            slot = k % len(ring)
            buffer[at: at + n].copy_(ring[slot][:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            copied[slot] = event
            submit(k + len(ring))
            if at + n == segment.nbytes:
                for entry in segment.entries:
                    yield entry.name, _tensor_of(buffer, segment, entry)
