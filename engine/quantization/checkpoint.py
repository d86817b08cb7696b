"""AWQ and GPTQ 4-bit checkpoints: their quantization_config, the tensors they hold, and an exact
repacking of each linear's (qweight, qzeros, scales) into Int4Linear's layout (no dequantization).

Both formats quantize W[n, k] = (q - z) * s in groups of group_size input channels and pack eight
4-bit values into an int32:
- AWQ (version "gemm"): qweight [K, N/8] and qzeros [K/G, N/8] pack along the output channels in the
  order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i of word c holds channel 8c + AWQ_ORDER[i]); scales [K/G, N].
- GPTQ: qweight [K/8, N] packs along the input channels in order (nibble i of word j is row 8j + i);
  qzeros [K/G, N/8] packs along the output channels in order and, in the original ("gptq", v1)
  format, stores z - 1 (checkpoint_format "gptq_v2" stores z); scales [K/G, N]; g_idx [K] maps each
  input channel to its group. Only desc_act=False (g_idx[k] == k // G) is supported: act-order
  checkpoints raise ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.model_config import ModelConfig, parameter_shapes
from kernels.formats import pack_int4, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED_PARTS = ("qweight", "qzeros", "scales")
_LINEAR_SUFFIXES = tuple(f"{name}.weight" for name in
                         ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "awq" | "gptq"
    group_size: int
    zero_offset: int  # added to stored zero points: 1 for GPTQ v1, else 0


def _field(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in config:
            return config[name]
    return default


def parse_quantization_config(config: Any) -> CheckpointQuantization:
    """ValueError naming the quantization_config field that this engine cannot load."""
    if not isinstance(config, dict):
        raise ValueError("quantization_config: must be an object")
    method = str(config.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"quantization_config.quant_method: {method!r} checkpoints are not supported (awq, gptq)")
    bits = _field(config, "bits", "w_bit")
    if bits != 4:
        raise ValueError(f"quantization_config.bits: only 4-bit {method} checkpoints are supported, got {bits!r}")
    group_size = _field(config, "group_size", "q_group_size")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise ValueError(f"quantization_config.group_size: must be a positive multiple of 8, got {group_size!r}")
    if config.get("modules_to_not_convert"):
        raise ValueError("quantization_config.modules_to_not_convert: partly quantized checkpoints are not supported")
    zero_offset = 0
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: only AWQ 'gemm' packing is supported, got {version!r}")
        if config.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point: AWQ without zero points is not supported")
    else:
        if config.get("desc_act", False):
            raise ValueError("quantization_config.desc_act: act-order GPTQ checkpoints (desc_act=true) are not "
                             "supported; use one quantized with desc_act=false")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported (gptq, gptq_v2)")
        zero_offset = 1 if fmt == "gptq" else 0
    return CheckpointQuantization(method, group_size, zero_offset)


def is_quantized_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(_LINEAR_SUFFIXES)


def checkpoint_shapes(config: ModelConfig, quant: CheckpointQuantization) -> dict[str, tuple[int, ...]]:
    """The tensors a quantized checkpoint of this model must hold, with their shapes (g_idx is optional)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in parameter_shapes(config).items():
        if not is_quantized_linear(name):
            shapes[name] = shape
            continue
        n, k = shape
        base = name.removesuffix(".weight")
        groups = k // quant.group_size
        if k % quant.group_size or n % 8:
            raise ValueError(f"quantization_config.group_size: {quant.group_size} does not divide {base}'s "
                             f"{k} inputs, or its {n} outputs are not a multiple of 8")
        packed = (k, n // 8) if quant.method == "awq" else (k // 8, n)
        shapes.update({f"{base}.qweight": packed, f"{base}.qzeros": (groups, n // 8), f"{base}.scales": (groups, n)})
    return shapes


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 in AWQ order -> [R, 8C] values 0..15."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8], nibble i
    values = torch.empty_like(nibbles)
    values[..., list(AWQ_ORDER)] = nibbles
    return values.reshape(packed.shape[0], -1)


def repack_linear(parts: dict[str, torch.Tensor], quant: CheckpointQuantization
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, scales) of one checkpoint linear -> Int4Linear's (qweight, scales, zeros)."""
    qweight, qzeros, scales = (parts[p] for p in QUANTIZED_PARTS)
    if quant.method == "awq":
        packed = pack_int4(unpack_awq(qweight).t())
        zeros = unpack_awq(qzeros)
    else:
        packed = qweight.t().contiguous()  # the same words: nibble i of word j is input channel 8j + i
        zeros = unpack_int4(qzeros) + quant.zero_offset
    return packed, scales.t().float().contiguous(), zeros.t().to(torch.uint8).contiguous()


def _check_g_idx(name: str, g_idx: torch.Tensor, group_size: int) -> None:
    trivial = torch.arange(g_idx.shape[0], device=g_idx.device) // group_size
    if not torch.equal(g_idx.to(trivial.dtype), trivial):
        raise ValueError(f"{name}: act-order g_idx (desc_act=true) is not supported; only g_idx[k] == k // "
                         f"{group_size}")


def repack_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear's parts replaced by Int4Linear's
    `<linear>.qweight`, `.scales` and `.zeros`; other tensors pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition(".")
        if part == "g_idx":
            _check_g_idx(name, tensor, quant.group_size)
        elif part in QUANTIZED_PARTS:
            parts = pending.setdefault(base, {})
            parts[part] = tensor
            if len(parts) == len(QUANTIZED_PARTS):
                del pending[base]
                qweight, scales, zeros = repack_linear(parts, quant)
                yield f"{base}.qweight", qweight
                yield f"{base}.scales", scales
                yield f"{base}.zeros", zeros
        else:
            yield name, tensor
    for base, parts in pending.items():
        raise ValueError(f"{base}: the checkpoint holds {sorted(parts)} but a quantized linear needs "
                         f"{list(QUANTIZED_PARTS)}")
