"""Worker processes for tensor-parallel ranks 1..N-1. Rank 0 is the engine's own process: it runs the
scheduler and the sampler and tells the workers, step by step, what to run."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.distributed.parallel_state import TensorParallel, destroy_tensor_parallel, init_tensor_parallel

log = logging.getLogger(__name__)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses the r-th GPU after the engine's own (cuda:N -> cuda:N+r); on CPU every rank uses the CPU."""
    if device.type != "cuda":
        return device
    device = torch.device("cuda", (device.index or 0) + rank)
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: needs GPU {device.index}, only {torch.cuda.device_count()} visible")
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TensorParallelWorkers:
    tp: TensorParallel
    processes: list[mp.Process] = field(default_factory=list)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> "TensorParallelWorkers":
        """Starts ranks 1..N-1 in spawned processes and joins rank 0 (this process) to their group."""
        size, port = config.tensor_parallel_size, free_port()
        for rank in range(1, size):
            rank_device(device, rank)  # fail before spawning anything
        ctx = mp.get_context("spawn")
        processes = [
            ctx.Process(target=_worker_main, args=(config, rank, size, port, device, dtype, os.getpid()),
                        name=f"tollgate-tp-rank{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for p in processes:
            p.start()
        log.info("tensor parallel: started %d worker processes, rendezvous on port %d", len(processes), port)
        tp = init_tensor_parallel(0, size, port, rank_device(device, 0))
        return cls(tp, processes)

    def join(self, timeout_s: float = 30.0) -> None:
        """Leaves the group together with the workers (tearing NCCL down can wait on peers), then reaps them."""
        destroy_tensor_parallel(self.tp)
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("tensor parallel: %s did not exit in time; killing it", p.name)
                p.kill()
                p.join()


def _worker_main(config: EngineConfig, rank: int, size: int, port: int, device: torch.device,
                 dtype: torch.dtype, parent_pid: int) -> None:
    from engine.model_builder import build_model

    _exit_when_parent_dies(parent_pid)
    device = rank_device(device, rank)
    torch.manual_seed(config.seed)
    tp = init_tensor_parallel(rank, size, port, device)
    runner = None
    try:
        runner = build_model(config, device, dtype, tp).runner
        runner.serve_steps()
    finally:
        if runner is not None:
            runner.release_graphs()
        destroy_tensor_parallel(tp)


def _exit_when_parent_dies(parent_pid: int) -> None:
    """A worker blocks waiting for rank 0's next step; if rank 0 is gone it must not wait forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
