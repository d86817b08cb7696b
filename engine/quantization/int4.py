"""int4 weight-only linear: groups of 128 input channels (fewer where K is not a multiple of 128),
asymmetric with an integer zero point per group, as AWQ and GPTQ store it:
W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = k // group_size, q in 0..15.
Layout: qweight [N, K/8] int32 (eight nibbles along K per word), scales [N, K/G] float32,
zeros [N, K/G] uint8; every tensor has the output channel first, like a float weight."""

from __future__ import annotations

import torch
from torch import nn

import kernels as ops
from kernels import int4_tinygemm as tinygemm
from engine.distributed.parallel_state import SINGLE
from engine.models.linear import shard_tensor
from kernels.formats import pack_int4
from kernels.reference import dequantize_int4

INT4_MAX = 15
_GROUP_SIZES = (128, 64, 32, 16, 8)


def int4_group_size(in_features: int) -> int:
    """128 where it divides K, else the largest of 64, 32, 16, 8 that does (SmolLM2's K = 576 -> 64)."""
    for size in _GROUP_SIZES:
        if in_features % size == 0:
            return size
    raise ValueError(f"quantization: int4 needs in_features divisible by 8, got {in_features}")


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight, scales, zeros). Each group's range is widened to include 0, so the zero
    point is an integer in 0..15 and zero weights stay exactly zero."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"quantization: group_size {group_size} does not divide in_features {k}")
    w = weight.float().view(n, k // group_size, group_size)
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1).clamp(min=0.0)
    scales = ((hi - lo) / INT4_MAX).clamp_min(1e-12)
    zeros = torch.round(-lo / scales).clamp_(0, INT4_MAX)
    q = (torch.round(w / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp_(0, INT4_MAX)
    return pack_int4(q.view(n, k).to(torch.int32)), scales, zeros.to(torch.uint8)


class Int4Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.group_size = group_size
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales.float(), requires_grad=False)
        self.zeros = nn.Parameter(zeros, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # tinygemm's copy of the weight for decode batches of 2-16 rows on a GPU (prepare_for_decode); None elsewhere
        self.tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None
        # one bf16 row on a GPU may round its activations to int8 (EngineConfig.int4_int8_activations)
        self.int8_activations = True
        # under tensor parallelism, the slice of a checkpoint's tensors this rank loads (see shard_of)
        self.tp = SINGLE
        self.shard_dim: int | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int | None = None
                    ) -> "Int4Linear":
        group_size = group_size or int4_group_size(weight.shape[1])
        linear = cls(*quantize_int4(weight, group_size), group_size, bias)
        linear.prepare_for_decode()
        return linear

    def prepare_for_decode(self) -> None:
        """On a GPU, repacks the weight for tinygemm (once its values are final: after loading a checkpoint)."""
        if self.qweight.is_cuda and tinygemm.tinygemm_fits(self.out_features, self.in_features, self.group_size):
            self.tinygemm = tinygemm.pack_for_tinygemm(self.qweight, self.scales, self.zeros)

    @classmethod
    def empty(cls, in_features: int, out_features: int, group_size: int, bias: torch.Tensor | None,
              device: torch.device) -> "Int4Linear":
        """Uninitialised, to be filled by load_weights from a pre-quantized (AWQ / GPTQ) checkpoint."""
        if group_size % 8:
            raise ValueError(f"quantization_config.group_size: {group_size} must be a multiple of 8")
        if in_features % group_size:
            raise ValueError(f"quantization_config.group_size: {group_size} does not divide the {in_features} input "
                             "features of a linear layer (of this rank's shard, under tensor parallelism)")
        groups = in_features // group_size
        return cls(
            torch.empty(out_features, in_features // 8, dtype=torch.int32, device=device),
            torch.empty(out_features, groups, dtype=torch.float32, device=device),
            torch.empty(out_features, groups, dtype=torch.uint8, device=device),
            group_size,
            bias,
        )

    def shard_of(self, tensor: torch.Tensor, is_bias: bool = False) -> torch.Tensor:
        """This rank's slice of a checkpoint's qweight / scales / zeros / bias: along the output channels
        (column-parallel), or along K (row-parallel: qweight's words and scales' groups both run along K)."""
        return shard_tensor(tensor, self.shard_dim, self.tp, is_bias)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, dtype)

    def forward(self, x: torch.Tensor, *, norm: ops.Norm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """linear(rms_norm(x, *norm)) + residual, each part where given; fused in the one-row GEMV."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.tinygemm is not None and x.dtype == torch.bfloat16 and 1 < rows <= tinygemm.MAX_ROWS:
            return ops.norm_project_add(
                lambda h: tinygemm.tinygemm_linear(h, *self.tinygemm, self.group_size, self.bias), x, norm, residual)
        return ops.int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias, norm=norm,
                               residual=residual, int8_activations=self.int8_activations)

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        """silu(gate) * up of a fused gate_up projection; one row on a GPU in the GEMV's epilogue."""
        if x.numel() == x.shape[-1]:
            return ops.int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias, gated=True,
                                   norm=norm, int8_activations=self.int8_activations)
        return ops.silu_and_mul(self(x, norm=norm))
