"""Sleep and wake of an idle engine, as vLLM's sleep mode: its device memory given back without ending the process.

Level 1 copies the weights to host memory (pinned on CUDA) and frees them and the KV pool on the device; waking
copies them back in one transfer. Level 2 drops the weights too; waking loads them again from the model's source
(engine/safetensors_reader.py reads a local checkpoint at the disk's speed). Either way the KV pool comes back with
the same number of blocks, empty (the prefix cache is forgotten), and the CUDA graphs, which pointed at the old
addresses, are captured again, each by the first decode step of its shape (engine/cuda_graphs.py): the first token
after a wake waits for no capture. A sleeping engine's tokenizer and bookkeeping stay, so it takes requests at once
and runs them after the wake."""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from engine.errors import EngineAsleepError
from engine.weight_offload import WeightOffload

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

__all__ = ["EngineAsleepError", "EngineSleep", "SLEEP_LEVELS"]

SLEEP_LEVELS = (1, 2)


class EngineSleep:
    """The sleep state of one LLMEngine; `level` 0 is awake."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.level = 0
        self._offload: WeightOffload | None = None
        self._host_buffer: torch.Tensor | None = None  # a level-1 sleep's host copy, reused by the next one
        self.last_sleep_seconds = 0.0
        self.last_wake_seconds = 0.0
        self._pinning: threading.Thread | None = None
        # the network's bytes on its device (what a level-1 sleep copies to the host), counted once: the same after a
        # level-2 reload
        self.weights_bytes = WeightOffload(engine.runner.model, engine.device).nbytes
        if engine.config.enable_sleep_mode and engine.device.type == "cuda":
            self._pinning = threading.Thread(target=self._pin_host_buffer, name="tollgate-sleep-pin", daemon=True)
            self._pinning.start()

    def _pin_host_buffer(self) -> None:
        """The first level-1 sleep's host buffer, pinned ahead (config.enable_sleep_mode)."""
        try:
            self.check_supported()
            nbytes = WeightOffload(self.engine.runner.model, self.engine.device).nbytes
            started = time.perf_counter()
            self._host_buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            log.info("sleep mode: %.1f GB of host memory pinned for the weights in %.1f s", nbytes / 1e9,
                     time.perf_counter() - started)
        except (ValueError, RuntimeError) as e:  # not supported here, or no host memory to pin: sleep pins later
            log.warning("sleep mode: the weights' host buffer was not pinned ahead: %s", e)

    def check_supported(self) -> None:
        engine = self.engine
        if engine.speculator is not None:
            raise ValueError("sleep: not supported with speculative decoding (this engine's speculative_config)")
        if engine.workers is not None:
            raise ValueError("sleep: not supported with tensor_parallel_size > 1")
        if engine.runner.lora is not None:  # its adapters' device slots are filled at run time
            raise ValueError("sleep: not supported with LoRA adapters (max_loras > 0)")

    def sleep(self, level: int) -> None:
        """Puts the idle engine to sleep at `level`, or deeper if it sleeps already (1 -> 2 drops the host copy).
        ValueError (naming them) when requests are unfinished."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level: must be one of {SLEEP_LEVELS}, got {level!r}")
        self.check_supported()
        engine = self.engine
        if engine.has_unfinished_requests():
            raise ValueError(f"sleep: {len(engine.requests)} request(s) are unfinished; sleep when the engine is idle")
        if level <= self.level:
            return
        started = time.perf_counter()
        if self._pinning is not None:  # a sleep soon after the start waits for the rest of the pinning
            self._pinning.join()
            self._pinning = None
        if self.level == 0:
            self._settle()
            engine.kv.forget_cached_blocks()
            engine.runner.release_kv_cache()
            self._offload = WeightOffload(engine.runner.model, engine.device, self._host_buffer)
            self._offload.offload(keep=level == 1)
        if level == 2:  # the network is built again on wake: no host copy, no record of its tensors
            self._offload = None
        self._host_buffer = self._offload.host if self._offload is not None else None
        self.level = level
        self._give_back_memory()
        self.last_sleep_seconds = time.perf_counter() - started
        log.info("engine asleep at level %d in %.2f s", level, self.last_sleep_seconds)

    def wake(self) -> float:
        """Brings the weights and the KV pool back; returns the seconds it took (0 when awake). On failure
        (out of device memory, a missing checkpoint) the engine stays asleep at its level."""
        if self.level == 0:
            return 0.0
        engine, runner = self.engine, self.engine.runner
        started = time.perf_counter()
        try:
            if self.level == 1:
                assert self._offload is not None
                self._offload.restore()
            else:
                from engine.model_builder import reload_network

                runner.model = reload_network(engine.config, engine.tokenizer, engine.max_model_len, engine.device,
                                              engine.dtype)
            runner.allocate_kv_cache()
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
        except BaseException:
            runner.release_kv_cache()
            # level 1: the host copy stays for the next try; level 2: whichever network is there lets go
            (self._offload or WeightOffload(runner.model, engine.device)).release_device()
            self._give_back_memory()
            raise
        self._offload = None
        if engine.device.type != "cuda":  # plain host memory is cheap to allocate again: no second copy kept awake
            self._host_buffer = None
        self.level = 0
        self.last_wake_seconds = time.perf_counter() - started
        log.info("engine awake in %.2f s", self.last_wake_seconds)
        return self.last_wake_seconds

    def memory(self) -> dict[str, int]:
        """What the engine holds, for the node's memory record (gateway/serving/node_memory.py): its weights and KV
        pool when awake, the host copy of a level-1 sleep (kept, pinned, on CUDA between sleeps), and on CUDA the
        device memory PyTorch reserves in this process and what the device has free (torch.cuda.mem_get_info)."""
        runner = self.engine.runner
        out = {"weights_bytes": self.weights_bytes, "kv_cache_bytes": runner.num_blocks * runner.bytes_per_block,
               "host_copy_bytes": self._host_buffer.numel() if self._host_buffer is not None else 0}
        if self.engine.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.engine.device)
            out.update(device_free_bytes=free, device_total_bytes=total,
                       device_reserved_bytes=torch.cuda.memory_reserved(self.engine.device))
        return out

    def _settle(self) -> None:
        """Reads a step still in flight (async scheduling leaves one after the last request finishes)."""
        engine = self.engine
        engine.runner.token_masker.wait()  # masks the GPU may wait for, collected before this waits for the GPU
        if engine.in_flight is not None:
            engine.in_flight.tolist()
            engine.in_flight = None

    def _give_back_memory(self) -> None:
        gc.collect()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
            torch.cuda.empty_cache()
