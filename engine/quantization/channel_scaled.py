"""Base of the linears whose weight is stored quantized with one float32 scale per output channel
(int8, fp8): W[n] ~ qweight[n] * scales[n]."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn


def channel_scales(weight: torch.Tensor, max_quantized: float) -> torch.Tensor:
    """[N, K] float -> [N] float32: each output channel's largest magnitude maps to max_quantized."""
    return weight.float().abs().amax(dim=1).clamp_min(1e-12) / max_quantized


_Linear = TypeVar("_Linear", bound="ChannelScaledLinear")


class ChannelScaledLinear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, K] float -> (qweight [N, K], scales [N] float32)."""
        raise NotImplementedError

    @classmethod
    def from_weight(cls: type[_Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> _Linear:
        return cls(*cls.quantize(weight), bias)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None]).to(dtype)
