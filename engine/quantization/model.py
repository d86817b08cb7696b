"""Quantizing a loaded model's linear layers, and loading a checkpoint into a model as the engine
config asks: on the fly (`quantization: int8 | int4 | fp8` over a float checkpoint), from an AWQ / GPTQ
checkpoint (int4, repacked exactly), and with an fp8 / int8 KV cache (calibrated scales).

Every `Linear` of the decoder layers (q/k/v, o, gate/up, down) is replaced by its quantized module. Quantizing on
the fly also stores the LM head in int8 per vocabulary row, whatever the mode: at one row its GEMV is as fast as
int4's tinygemm and faster than fp8's, and 8 bits keep the logits closest to the float ones. The embeddings and
the norms stay in the model dtype."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.models.linear import RowParallelLinear
from engine.models.llama import Linear
from engine.quantization.checkpoint import CheckpointQuantization, repack_checkpoint
from engine.quantization.fp8 import Fp8Linear
from engine.quantization.int4 import Int4Linear
from engine.quantization.int8 import Int8Linear
from engine.quantization.kv_cache import calibrate_kv_cache_, check_kv_cache_dtype

log = logging.getLogger(__name__)

QUANTIZED_LINEARS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], nn.Module]] = {
    "int8": Int8Linear.from_weight,
    "int4": Int4Linear.from_weight,
    "fp8": Fp8Linear.from_weight,
}


def _linear_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(parent, name) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, Linear)]


class RowParallelQuantized(nn.Module):
    """A quantized row-parallel linear: this rank's partial product, summed over the ranks, then the bias."""

    def __init__(self, inner: nn.Module, tp, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner, self.tp, self.bias = inner, tp, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.forward_partial(x))
        return out if self.bias is None else out + self.bias

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def replace_linears_(model: nn.Module, make: Callable[[Linear], nn.Module]) -> int:
    """Swaps every Linear for make(linear), one at a time so each float weight is freed as it goes."""
    slots = _linear_slots(model)
    for parent, name in slots:
        linear = getattr(parent, name)
        if isinstance(linear, RowParallelLinear) and linear.tp.size > 1:
            bias, linear.bias = linear.bias, None  # added once, after the sum
            setattr(parent, name, RowParallelQuantized(make(linear), linear.tp, bias))
        else:
            setattr(parent, name, make(linear))
        del linear
    return len(slots)


@torch.inference_mode()
def quantize_model_(model: nn.Module, method: str) -> int:
    """Quantizes every Linear in place with int8 / int4 / fp8; returns how many."""
    if method not in QUANTIZED_LINEARS:
        raise ValueError(f"quantization: must be one of {sorted(QUANTIZED_LINEARS)}, got {method!r}")
    make = QUANTIZED_LINEARS[method]
    count = replace_linears_(model, lambda linear: make(linear.weight, linear.bias))
    if hasattr(model, "quantized_lm_head"):
        quantize_lm_head_(model)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.info("quantized %d linear layers to %s", count, method)
    return count


def quantize_lm_head_(model: nn.Module) -> None:
    """Sets model.quantized_lm_head to int8 rows of this rank's LM head (the embedding's, when tied); an untied
    head's float weight is released, a tied one stays for the embedding lookups."""
    untied = model.lm_head is not None
    head = model.lm_head if untied else model.embed_tokens
    model.quantized_lm_head = Int8Linear.from_weight(head.weight, None)
    if untied:
        head.weight = nn.Parameter(head.weight.new_empty(0, head.weight.shape[1]), requires_grad=False)


def prepare_int4_checkpoint_(model: nn.Module, quant: CheckpointQuantization) -> None:
    """Empty Int4Linears in place of the Linears (this rank's shard of each), for load_weights to fill from a
    repacked checkpoint."""
    def empty_like(linear: Linear) -> Int4Linear:
        out_features, in_features = linear.weight.shape
        int4 = Int4Linear.empty(in_features, out_features, quant.group_size, linear.bias, linear.weight.device)
        int4.tp, int4.shard_dim = linear.tp, linear.shard_dim
        return int4

    replace_linears_(model, empty_like)


def load_weights(model: nn.Module, loaded, config) -> None:
    """model.load_weights(loaded.weights), quantized as config (an EngineConfig) asks.
    `loaded` is engine.loader.LoadedModel; its `quantization` is the checkpoint's own, if any."""
    checkpoint: CheckpointQuantization | None = getattr(loaded, "quantization", None)
    method = config.quantization
    check_kv_cache_dtype(config.kv_cache_dtype, model.norm.device)
    if checkpoint is not None:
        if method not in (None, "int4"):
            raise ValueError(f"quantization: {loaded.source} is a 4-bit {checkpoint.method.upper()} checkpoint; "
                             f"leave quantization unset or set it to 'int4', not {method!r}")
        prepare_int4_checkpoint_(model, checkpoint)
        model.load_weights(repack_checkpoint(loaded.weights, checkpoint))
        for module in model.modules():
            if isinstance(module, Int4Linear):
                module.prepare_for_decode()
    else:
        model.load_weights(loaded.weights)
        if method is not None:
            quantize_model_(model, method)
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.int8_activations = config.int4_int8_activations
    calibrate_kv_cache_(model, config.kv_cache_dtype, loaded.tokenizer, config.block_size)
