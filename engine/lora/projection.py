"""A base projection with the LoRA term of each token's adapter added to its output. The base layer runs as in a
step without adapters (its fused norm and residual add included); the LoRA kernels take the same norm, so the LoRA
term sees the same normed input as the base weight. The gate|up projection's SiLU product must see the LoRA term, so
with adapters it moves from the base layer's epilogue to the LoRA kernels' (decode) or after the add. A decode
step on CUDA launches the shrink on a stream of its own, beside the base projection (both read the same input), so
only the expand waits for the base: the shrinks leave the step's critical path."""

from __future__ import annotations

import torch
from torch import nn

import kernels as ops
from engine.lora.slot_pool import GroupStacks, LoRASlotPool
from engine.lora.targets import GROUP_MODULES
from engine.models.linear import gate_up_silu
from kernels.lora_indices import LoRAIndices


class LoRAStep:
    """The running step's adapter indices, shared by every LoRAProjection of a model; None: no adapter this step. And
    the stream a CUDA decode step's shrinks run on, beside the base projections."""

    def __init__(self) -> None:
        self.indices: LoRAIndices | None = None
        self._side: torch.cuda.Stream | None = None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side


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
        if indices is not None and ops.lora_decode_halves(x, indices):
            shrunk = self._shrink_beside(x, indices, norm)
            out = self.base(x, **kwargs)
            torch.cuda.current_stream(x.device).wait_stream(self.step.side_stream(x.device))
            ops.lora_expand_(out.view(-1, out.shape[-1]), shrunk, *self._b_stacks(), indices)
            return out
        out = self.base(x, **kwargs)
        if indices is not None:
            ops.lora_add_(out.view(-1, out.shape[-1]), x.view(-1, x.shape[-1]), *self._stacks(), indices, norm=norm)
        return out

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        indices = self.step.indices
        if indices is None:
            return gate_up_silu(self.base, x, norm)
        if ops.lora_decode_halves(x, indices):
            shrunk = self._shrink_beside(x, indices, norm)
            out = self.base(x) if norm is None else self.base(x, norm=norm)
            torch.cuda.current_stream(x.device).wait_stream(self.step.side_stream(x.device))
            rows = ops.lora_expand_silu_and_mul(out.view(-1, out.shape[-1]), shrunk, *self._b_stacks(), indices)
            return rows.view(*out.shape[:-1], rows.shape[-1])
        out = self.base(x) if norm is None else self.base(x, norm=norm)
        rows = ops.lora_add_silu_and_mul(out.view(-1, out.shape[-1]), x.view(-1, x.shape[-1]), *self._stacks(),
                                         indices, norm=norm)
        return rows.view(*out.shape[:-1], rows.shape[-1])

    def _shrink_beside(self, x: torch.Tensor, indices: LoRAIndices, norm: ops.Norm | None):
        """The shrink, launched on the step's side stream: it runs beside the base projection, which reads the same
        input, instead of before or after it (the current stream waits for it before the expand). In the dense form
        its rows for the dense expand are laid out there too."""
        s = self.stacks
        dense_rank = s.rank if ops.lora_dense_expand(indices, s.slice_offsets_host) else None
        return ops.lora_shrink(x.view(-1, x.shape[-1]), s.a, indices, norm=norm,
                               stream=self.step.side_stream(x.device), dense_rank=dense_rank)

    def _b_stacks(self) -> tuple:
        s = self.stacks
        return s.b, s.slice_offsets, s.slice_offsets_host, s.rank

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
