"""Weight quantization (int8, int4, fp8; AWQ / GPTQ checkpoints) and quantized KV caches (fp8, int8)."""

from engine.quantization.checkpoint import CheckpointQuantization
from engine.quantization.fp8 import Fp8Linear
from engine.quantization.int4 import Int4Linear
from engine.quantization.int8 import Int8Linear
from engine.quantization.kv_cache import kv_cache_torch_dtype
from engine.quantization.model import load_weights, quantize_model_

__all__ = [
    "CheckpointQuantization",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "kv_cache_torch_dtype",
    "load_weights",
    "quantize_model_",
]
