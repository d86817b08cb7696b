"""The projections an adapter may target, and how they map onto the engine's fused layers: q/k/v are slices of
qkv_proj, gate/up slices of gate_up_proj."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig

# PEFT module name -> (the engine's projection group, slice of it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# where each group sits in a decoder layer
GROUP_MODULES: dict[str, str] = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GroupShape:
    in_features: int
    slice_widths: tuple[int, ...]  # output features of each slice, in the fused layer's order


def group_shapes(cfg: ModelConfig) -> dict[str, GroupShape]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {
        "qkv": GroupShape(cfg.hidden_size, (q, kv, kv)),
        "o": GroupShape(q, (cfg.hidden_size,)),
        "gate_up": GroupShape(cfg.hidden_size, (cfg.intermediate_size, cfg.intermediate_size)),
        "down": GroupShape(cfg.intermediate_size, (cfg.hidden_size,)),
    }


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one PEFT target module."""
    group, index = TARGETS[module]
    shape = group_shapes(cfg)[group]
    return shape.in_features, shape.slice_widths[index]
