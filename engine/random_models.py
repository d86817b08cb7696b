"""Models of real shapes with random weights, for benchmarks (speed does not depend on weight values)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from engine.model_config import ModelConfig, parameter_shapes

_LLAMA3 = dict(
    architecture="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
    attention_bias=False, qk_norm=False, sliding_window=None, bos_token_id=128000, torch_dtype="bfloat16",
)

RANDOM_MODELS: dict[str, ModelConfig] = {
    "llama-1b": ModelConfig(
        **_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        eos_token_ids=(128001,),
    ),
    "llama-8b": ModelConfig(
        **_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        eos_token_ids=(128001,),
    ),
    "llama-tiny": ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, sliding_window=None, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32",
    ),
    # llama-1b's vocabulary (its logits and token masks) on a network that runs fast on a CPU: host-side work
    # per step, such as structured outputs' masks, measured without a GPU
    "llama-tiny-128k": ModelConfig(
        **_LLAMA3, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=None, eos_token_ids=(128001,),
    ),
}

SEED = 0


def random_model_config(name: str) -> ModelConfig:
    if name not in RANDOM_MODELS:
        raise ValueError(f"random:{name}: unknown random model (known: {sorted(RANDOM_MODELS)})")
    return RANDOM_MODELS[name]


def random_weights(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                   seed: int = SEED) -> Iterator[tuple[str, torch.Tensor]]:
    """normal(0, 0.02) matrices and all-ones norms, drawn on `device` in `dtype` from one seeded generator."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in parameter_shapes(config).items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device, dtype=dtype)
        else:
            tensor = torch.empty(shape, device=device, dtype=dtype)
            yield name, tensor.normal_(0.0, 0.02, generator=generator)


def write_random_checkpoint(name: str, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                            device: torch.device | str = "cpu") -> str:
    """Writes config.json + model.safetensors of a random model into out_dir; returns out_dir."""
    config = random_model_config(name)
    os.makedirs(out_dir, exist_ok=True)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    tensors = {n: t.contiguous() for n, t in random_weights(config, device, dtype)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
