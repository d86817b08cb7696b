"""fp8 (e4m3) linear: weight in float8_e4m3fn with one float32 scale per output channel.

Decode rows on CUDA (at most GEMV_MAX_M) go through the int8 GEMV kernel, which reads fp8 weights as well:
torch._scaled_mm has no GEMV and at one row runs slower than bf16. Otherwise, on CUDA with compute
capability >= 8.9 the matmul runs in fp8 through torch._scaled_mm: activations
are quantized per token (row) with a dynamic scale, amax / 448. Hopper (9.0+) with bf16 activations
uses row-wise scales for both operands; Ada (8.9) or other activation dtypes use one activation scale
per call and apply the weight's channel scales after. Elsewhere (CPU, older GPUs) the weight is
dequantized and multiplied in the activation dtype."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import kernels as ops
from engine.quantization.channel_scaled import ChannelScaledLinear, channel_scales
from kernels.quant_linear_config import GEMV_MAX_M

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight [N, K] float8_e4m3fn, scales [N] float32)."""
    scales = channel_scales(weight, FP8_MAX)
    return (weight.float() / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def scaled_mm_mode(device: torch.device, in_features: int, out_features: int) -> str | None:
    """'rowwise' (Hopper), 'tensorwise' (Ada) or None (dequantize) for a weight on this device."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or in_features % 16 or out_features % 16:
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (9, 0):
        return "rowwise"
    if capability >= (8, 9):
        return "tensorwise"
    return None


class Fp8Linear(ChannelScaledLinear):
    quantize = staticmethod(quantize_fp8)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 mode: str | None = "auto") -> None:
        super().__init__(qweight, scales, bias)
        n, k = qweight.shape
        self.mode = scaled_mm_mode(qweight.device, k, n) if mode == "auto" else mode
        if self.mode is None and qweight.is_cuda:
            log.warning("fp8 weights: torch._scaled_mm needs compute capability >= 8.9 and sizes divisible by 16; "
                        "this layer dequantizes instead")

    def forward(self, x: torch.Tensor, *, norm: ops.Norm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """linear(rms_norm(x, *norm)) + residual, each part where given; fused in the decode GEMV."""
        if self.mode is not None and self._decode_rows(x):
            return ops.int8_linear(x, self.qweight, self.scales, self.bias, norm=norm, residual=residual)
        return ops.norm_project_add(self._project, x, norm, residual)

    def forward_silu_and_mul(self, x: torch.Tensor, *, norm: ops.Norm | None = None) -> torch.Tensor:
        if self.mode is not None and self._decode_rows(x):
            return ops.int8_linear_silu_and_mul(x, self.qweight, self.scales, self.bias, norm=norm)
        return ops.silu_and_mul(self(x, norm=norm))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        rows = x.reshape(-1, x.shape[-1])
        if self.mode == "rowwise" and x.dtype == torch.bfloat16:
            out = self._rowwise(rows)
        else:
            out = self._tensorwise(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @staticmethod
    def _decode_rows(x: torch.Tensor) -> bool:
        """Few enough rows on a GPU for the fp8 GEMV (torch._scaled_mm has none)."""
        return x.is_cuda and x.numel() // x.shape[-1] <= GEMV_MAX_M

    def _rowwise(self, rows: torch.Tensor) -> torch.Tensor:
        x_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX  # [M, 1]
        x8 = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return torch._scaled_mm(x8, self.qweight.t(), scale_a=x_scale, scale_b=self.scales.view(1, -1),
                                out_dtype=rows.dtype)

    def _tensorwise(self, rows: torch.Tensor) -> torch.Tensor:
        x_scale = rows.abs().amax().float().clamp_min(1e-12) / FP8_MAX
        x8 = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        one = torch.ones((), device=rows.device, dtype=torch.float32)
        out = torch._scaled_mm(x8, self.qweight.t(), scale_a=x_scale, scale_b=one, out_dtype=torch.float32)
        return (out * self.scales).to(rows.dtype)
