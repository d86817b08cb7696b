"""What an engine holds for LoRA: the registry of served adapters, the device slot pool, and the shared step state
that its model's LoRA projections read. Built with the model when EngineConfig.max_loras > 0."""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from engine.config import EngineConfig
from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.batch import adapter_ids, decode_form, token_slots
from engine.lora.graph_slots import GraphLoRASlots
from engine.lora.projection import LoRAStep, attach_lora
from engine.lora.registry import AdapterEntry, LoRARegistry
from engine.lora.slot_pool import LoRASlotPool
from engine.model_config import ModelConfig
from engine.sequence import Sequence
from kernels.lora_indices import lora_indices

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.max_rank = config.max_lora_rank
        self.decode_kernels = config.lora_decode_kernels
        self.pool = LoRASlotPool(model_config, config.max_loras, config.max_lora_rank, device, dtype)
        self.registry = LoRARegistry(config.max_cpu_loras, self.load)
        self.step = LoRAStep()
        attach_lora(model, self.pool, self.step)
        log.info("LoRA: %d device slots of rank %d (%.1f MiB)", config.max_loras, config.max_lora_rank,
                 self.pool.nbytes / 2**20)
        for name, path in (config.lora_modules or {}).items():
            self.add(self.load(path, name))

    def load(self, path: str, name: str) -> LoRAAdapter:
        """Reads and checks an adapter (no engine state changes: callers run it off the engine's thread)."""
        adapter = load_adapter(path, name, self.model_config, self.max_rank, self.dtype)
        return adapter.pinned() if self.device.type == "cuda" else adapter

    def add(self, adapter: LoRAAdapter) -> AdapterEntry:
        """Serves the adapter under its name from the next request on; an adapter it replaces keeps serving the
        sequences already running with it, and its device slot goes the LRU way."""
        return self.registry.add(adapter)

    def remove(self, name: str) -> bool:
        return self.registry.remove(name) is not None

    def resolve(self, name: str) -> AdapterEntry:
        return self.registry.get(name)

    def begin_step(self, seqs: SequenceOf[Sequence], num_new_tokens: SequenceOf[int]) -> np.ndarray | None:
        """Places the step's adapters in device slots; each token's slot (None when no sequence uses one)."""
        needed = adapter_ids(seqs)
        if not needed:
            return None
        entries = {s.lora.id: s.lora for s in seqs if s.lora is not None}
        slot_of = self.pool.place(needed, lambda adapter_id: self.registry.host_copy(entries[adapter_id]))
        return token_slots(seqs, num_new_tokens, slot_of)

    def set_indices(self, slots: np.ndarray | None, one_token_per_seq: bool) -> None:
        """The indices of a step run eagerly; a decode step takes the form a graph of it would (graph_slots)."""
        if slots is None:
            self.step.indices = None
            return
        form = decode_form(slots, self.decode_kernels, self.pool.max_loras) if one_token_per_seq else "bgmv"
        self.step.indices = lora_indices(slots, self.device, one_token_per_seq, self.pool.max_loras,
                                         grouped=form != "bgmv", dense=form == "dense")

    def graph_slots(self, max_tokens: int) -> GraphLoRASlots:
        """Static token-slot buffers for decode graphs of up to max_tokens rows captured with the adapters."""
        return GraphLoRASlots(self.step, max_tokens, self.device, self.pool.max_loras, self.decode_kernels)
