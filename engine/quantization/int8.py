"""int8 weight-only linear: symmetric, one scale per output channel (W[n] ~ qweight[n] * scales[n])."""

from __future__ import annotations

import torch

import kernels as ops
from engine.quantization.channel_scaled import ChannelScaledLinear, channel_scales

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight [N, K] int8 in -127..127, scales [N] float32), round to nearest."""
    scales = channel_scales(weight, INT8_MAX)
    qweight = torch.round(weight.float() / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight, scales


class Int8Linear(ChannelScaledLinear):
    quantize = staticmethod(quantize_int8)

    def forward(self, x: torch.Tensor, *, norm: ops.Norm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.int8_linear(x, self.qweight, self.scales, self.bias, norm=norm, residual=residual)

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        return ops.int8_linear_silu_and_mul(x, self.qweight, self.scales, self.bias, norm=norm)
