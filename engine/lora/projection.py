"""A base projection with the LoRA term of each token's adapter added to its output. Steps without adapters take the
base layer's own path (its fused norm, residual and SiLU epilogues, and the CUDA graphs captured over it); steps with
adapters apply the norm first, so the LoRA term sees the same normed input as the base weight."""

from __future__ import annotations

import torch
from torch import nn

import kernels as ops
from engine.lora.slot_pool import GroupStacks, LoRASlotPool
from engine.lora.targets import GROUP_MODULES
from engine.models.linear import gate_up_silu
from kernels.lora_indices import LoRAIndices


class LoRAStep:
    """The running step's adapter indices, shared by every LoRAProjection of a model; None: no adapter this step."""

    def __init__(self) -> None:
        self.indices: LoRAIndices | None = None


class LoRAProjection(nn.Module):
    def __init__(self, base: nn.Module, stacks: GroupStacks, step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.stacks = stacks
        self.step = step

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor, *, norm: ops.Norm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        indices = self.step.indices
        kwargs = {} if residual is None else {"residual": residual}
        if indices is None:
            return self.base(x, norm=norm, **kwargs) if norm is not None else self.base(x, **kwargs)
        if norm is not None:
            x = ops.rms_norm(x, *norm)
        out = self.base(x, **kwargs)
        s = self.stacks
        ops.lora_add_(out.view(-1, out.shape[-1]), x.view(-1, x.shape[-1]), s.a, s.b, s.slice_offsets,
                      s.slice_offsets_host, s.rank, indices)
        return out

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        if self.step.indices is None:
            return gate_up_silu(self.base, x, norm)
        return ops.silu_and_mul(self.forward(x, norm=norm))


def attach_lora(model: nn.Module, pool: LoRASlotPool, step: LoRAStep) -> None:
    """Wraps every decoder layer's four projection groups (after the weights are loaded: their names change)."""
    for layer, groups in zip(model.layers, pool.layers):
        for group, path in GROUP_MODULES.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, name, LoRAProjection(getattr(parent, name), groups[group], step))
