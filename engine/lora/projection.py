"""A base projection with the LoRA term of each token's adapter added to its output. The base layer runs as in a
step without adapters (its fused norm and residual add included); the LoRA kernels take the same norm, so the LoRA
term sees the same normed input as the base weight. The gate|up projection's SiLU product must see the LoRA term, so
with adapters it moves from the base layer's epilogue to the LoRA kernels' (decode) or after the add. At batch 1 on
CUDA the shrink runs first and the base GEMV adds the expand in its epilogue, the gate's product included
(kernels/lora_epilogue.py): four kernels fewer a layer."""

from __future__ import annotations

import torch
from torch import nn

import kernels as ops
from engine.lora.slot_pool import GroupStacks, LoRASlotPool
from engine.lora.targets import GROUP_MODULES
from engine.models.linear import Linear, gate_up_silu
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
        kwargs = {} if norm is None else {"norm": norm}
        if residual is not None:
            kwargs["residual"] = residual
        indices = self.step.indices
        if self._expand_in_gemv(x, indices):
            return self.base(x, **kwargs, lora=ops.lora_term(x, *self._stacks(), indices, norm=norm))
        out = self.base(x, **kwargs)
        if indices is not None:
            ops.lora_add_(out.view(-1, out.shape[-1]), x.view(-1, x.shape[-1]), *self._stacks(), indices, norm=norm)
        return out

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        indices = self.step.indices
        if indices is None:
            return gate_up_silu(self.base, x, norm)
        if self._expand_in_gemv(x, indices):
            return self.base.forward_silu_and_mul(x, norm=norm, lora=ops.lora_term(x, *self._stacks(), indices,
                                                                                  norm=norm))
        out = self.base(x) if norm is None else self.base(x, norm=norm)
        rows = ops.lora_add_silu_and_mul(out.view(-1, out.shape[-1]), x.view(-1, x.shape[-1]), *self._stacks(),
                                         indices, norm=norm)
        return rows.view(*out.shape[:-1], rows.shape[-1])

    def _expand_in_gemv(self, x: torch.Tensor, indices: LoRAIndices | None) -> bool:
        """A batch-1 decode step over a plain linear: the expand rides in its GEMV (kernels/lora_epilogue.py)."""
        return indices is not None and isinstance(self.base, Linear) and ops.lora_into_gemv(x, self.base.weight,
                                                                                            indices)

    def _stacks(self) -> tuple:
        s = self.stacks
        return s.a, s.b, s.slice_offsets, s.slice_offsets_host, s.rank


def attach_lora(model: nn.Module, pool: LoRASlotPool, step: LoRAStep) -> None:
    """Wraps every decoder layer's four projection groups (after the weights are loaded: their names change)."""
    for layer, groups in zip(model.layers, pool.layers):
        for group, path in GROUP_MODULES.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, name, LoRAProjection(getattr(parent, name), groups[group], step))
