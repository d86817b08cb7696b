"""Reads a PEFT LoRA adapter as `save_pretrained` writes it: adapter_config.json and adapter_model.safetensors.

Each targeted projection gets A [r, in] and B [out, r] with the adapter's scaling (lora_alpha / r, or / sqrt(r) with
use_rslora; per module through alpha_pattern) folded into B, so the kernels add x A^T B^T as it is. Anything the
engine cannot apply exactly (DoRA, biases, extra trained modules, embeddings) is refused with a ValueError naming the
field or tensor, never served approximately."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from engine.lora.targets import TARGETS, module_shape
from engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# (field, value that the engine can serve): anything else is refused
_MUST_BE = {
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
}


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, scaled B)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def pinned(self) -> "LoRAAdapter":
        """The same adapter in page-locked host memory, from which device copies run asynchronously."""
        weights = {key: (a.pin_memory(), b.pin_memory()) for key, (a, b) in self.weights.items()}
        return LoRAAdapter(self.name, self.path, self.rank, weights)


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} has no {CONFIG_FILE} (a directory written by peft's save_pretrained)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: {config_path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path: {config_path} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type: only LORA adapters are served, got {config['peft_type']!r}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias: adapters that train biases are not supported, got {config['bias']!r}")
    for field, allowed in _MUST_BE.items():
        if config.get(field) not in allowed:
            raise ValueError(f"{field}: not supported by the engine, got {config[field]!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha: must be a number, got {alpha!r}")
    return config


def _alpha_for(config: dict, module_name: str) -> float:
    """lora_alpha, or the alpha_pattern entry matching this module (peft's rule: the key matches the name's end)."""
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return float(value)
    return float(config.get("lora_alpha", 8))


def load_adapter(path: str, name: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at `path` on the host, checked against the base model's shapes and max_rank."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.abspath(os.path.expanduser(path))
    config = _read_config(path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"lora_path: {path!r} has no {WEIGHTS_FILE} (only safetensors adapters are loaded)")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"lora_path: {weights_path} is not a readable safetensors file: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise ValueError(f"lora_path: tensor {key!r} is not a LoRA A/B of one of {sorted(TARGETS)} (target_modules: "
                             "only the decoder layers' q/k/v/o/gate/up/down projections can be adapted)")
        layer = int(match.group(1))
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"lora_path: tensor {key!r} is for layer {layer}; the model has {cfg.num_hidden_layers}")
        halves.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not halves:
        raise ValueError(f"lora_path: {weights_path} holds no LoRA weights")
    use_rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"lora_path: layer {layer} {module} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        in_features, out_features = module_shape(cfg, module)
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise ValueError(f"lora_path: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the "
                             f"base model needs A [r, {in_features}] and B [{out_features}, r]")
        if rank > max_rank:
            raise ValueError(f"max_lora_rank: the adapter's rank {rank} ({module}) exceeds max_lora_rank {max_rank}")
        parent = "mlp" if TARGETS[module][0] in ("gate_up", "down") else "self_attn"
        alpha = _alpha_for(config, f"model.layers.{layer}.{parent}.{module}")
        scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        weights[layer, module] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(name, path, max(a.shape[0] for a, _ in weights.values()), weights)
