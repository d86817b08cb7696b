"""PEFT adapters for tests: random LoRA weights (B not zero, so the adapter changes the outputs) written as peft's
save_pretrained writes them, and peft's own model over them as the reference."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# three adapters of different ranks and targets over one base: the mixed batches of the CUDA-graph and grouped-kernel tests
MIXED_ADAPTERS = {  # name -> (rank, alpha, targets)
    "qv-r8": (8, 16, ["q_proj", "v_proj"]),
    "all-r16": (16, 32, ALL_TARGETS),
    "mlp-r4": (4, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def write_peft_adapter(base_model, out_dir: str, r: int, alpha: float, targets: list[str], seed: int,
                       use_rslora: bool = False, weight_std: float = 0.1, **config) -> str:
    """Saves a random LoRA adapter for base_model (an HF model, left unchanged) to out_dir; returns out_dir."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base_model), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, weight_std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_reference(base_model, adapter_dir: str):
    """peft's PeftModel over a copy of base_model, loaded from the saved adapter: the independent reference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir).eval()


def save_base_and_mixed_adapters(root: Path) -> tuple[str, dict[str, str]]:
    """A tiny random Llama saved under root/base and MIXED_ADAPTERS for it: (the base's dir, name -> adapter dir)."""
    from tests.engine.conftest import tiny_hf_model

    base = tiny_hf_model("llama")
    base.save_pretrained(root / "base")
    adapters = {name: write_peft_adapter(base, str(root / name), r, alpha, targets, seed=i)
                for i, (name, (r, alpha, targets)) in enumerate(MIXED_ADAPTERS.items())}
    return str(root / "base"), adapters
