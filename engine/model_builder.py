"""Loads a model onto one device (one tensor-parallel shard of it) and builds the runner that executes it.

LLMEngine calls this on rank 0; every other tensor-parallel rank calls it in its worker process."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.loader import LoadedModel, load_model
from engine.lora.manager import LoRAManager
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.quantization import load_weights
from engine.runner import ModelRunner
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    eos_token_ids: frozenset[int]
    runner: ModelRunner


def build_model(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                tp: TensorParallel = SINGLE) -> BuiltModel:
    baseline_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    with load_model(config.model, device, dtype, config.tokenizer) as loaded:
        model_config = loaded.config
        max_model_len = choose_max_model_len(config, model_config)
        model = build_network(config, loaded, max_model_len, device, dtype, tp)
        lora = LoRAManager(config, model_config, model, device, dtype) if config.max_loras else None
        tokenizer = loaded.tokenizer
    eos = frozenset(tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids)
    eos |= frozenset(model_config.eos_token_ids)
    runner = ModelRunner(config, model_config, model, device, dtype, max_model_len, eos, tp, lora,
                         baseline_free)
    return BuiltModel(model_config, tokenizer, max_model_len, eos, runner)


def build_network(config: EngineConfig, loaded: LoadedModel, max_model_len: int, device: torch.device,
                  dtype: torch.dtype, tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """The network with the loaded weights in it, quantized as config.quantization / kv_cache_dtype ask."""
    model = LlamaForCausalLM(loaded.config, max_model_len, device, dtype, tp)
    load_weights(model, loaded, config)
    model.eval()
    if tp.size > 1 and device.type == "cuda" and config.tp_fused_norm:
        from engine.distributed.peer_exchange import try_fused_all_reduce_norm

        tp.fused_norm = try_fused_all_reduce_norm(tp, device, loaded.config.hidden_size, dtype,
                                                  model.embed_tokens.rows)
    return model


def reload_network(config: EngineConfig, tokenizer: Tokenizer | None, max_model_len: int, device: torch.device,
                   dtype: torch.dtype) -> LlamaForCausalLM:
    """The network loaded again from config.model (a level-2 sleeper waking); the tokenizer is the one already
    loaded (an fp8 / int8 KV cache calibrates with it)."""
    loaded = load_model(config.model, device, dtype, config.tokenizer, load_tokenizer=False)
    loaded.tokenizer = tokenizer
    return build_network(config, loaded, max_model_len, device, dtype)


def choose_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    wanted = config.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len: {wanted} exceeds the model's max_position_embeddings ({limit})")
    window = model_config.sliding_window
    if window is not None and wanted > window:
        log.warning("max_model_len capped at the sliding window (%d): attention here is full attention", window)
        wanted = window
    return wanted
