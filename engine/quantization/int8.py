"""int8 weight-only linear: symmetric, one scale per output channel (W[n] ~ qweight[n] * scales[n])."""

from __future__ import annotations

import torch
from torch import nn

import kernels as ops
from kernels.reference import dequantize_int8

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight [N, K] int8 in -127..127, scales [N] float32), round to nearest."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / INT8_MAX
    qweight = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight, scales


class Int8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        return cls(*quantize_int8(weight), bias)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_linear(x, self.qweight, self.scales, self.bias)
