"""KV cache in fp8 (e4m3) or int8, with static scales per (layer, KV head, K or V).

The scales come from one calibration pass at engine start: the model runs a fixed prompt (a
paragraph of English text through the model's tokenizer, or seeded random token ids for a model
without one) with an unquantized cache, and each head's largest |K| and |V| (after rotary and q/k
norms, exactly as the cache would store them) sets its scale:
- fp8: scale = amax * 4 / 448. e4m3 has the same relative precision (3 mantissa bits) from 2^-6 to
  448, so a 4x headroom for keys and values larger than calibration saw costs nothing measurable.
- int8: scale = amax * 1.25 / 127. int8's steps are uniform, so headroom costs resolution for every
  value; 1.25x covers modest excursions, anything larger is clamped to +-127.
Static scales keep the cache a plain tensor (no per-token scale storage), let a page be written once
and read by every later step and by prefix-cache hits, and keep decode CUDA-graph friendly.

Keys have outlier channels, and rounding them costs the most accuracy (on SmolLM2 with an fp8 cache,
rounding K alone flips 5% of top-1 predictions, V alone 2%). So with a quantized cache each attention
layer also multiplies q and k, after rotary, by one orthonormal matrix R (normalized Hadamard for a
power-of-two head_dim, else a seeded random orthogonal one): q R (k R)^T = q k^T, so attention is
unchanged, while k R spreads each outlier over all channels before it is rounded (as QuaRot does).
V is stored as is. Measured on SmolLM2 (bench/quantization_quality.py), fp8 top-1 agreement went from
94.6% to 96.0% with it (int8: 96.8%)."""

from __future__ import annotations

import logging
import random

import torch
from torch import nn

from engine.models.attention_metadata import AttentionMetadata
from kernels.kv_layout import new_kv_cache

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
FP8_HEADROOM, FP8_MAX = 4.0, 448.0
INT8_HEADROOM, INT8_MAX = 1.25, 127.0
CALIBRATION_TOKENS = 256
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made books far "
    "cheaper to produce. Within fifty years, presses in more than two hundred European cities had printed "
    "millions of copies. Question: how did cheaper books change education? Answer: literacy spread beyond "
    "clergy and nobles; merchants kept written accounts, scientists shared results in journals, and "
    "governments printed laws. def mean(values): return sum(values) / len(values)  # 3.14159, 2.71828, 42. "
    "Translate to French: 'The weather is nice today.' -> 'Il fait beau aujourd'hui.' Summary: technology "
    "that lowers the cost of copying information tends to widen who can take part in public life."
)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    if kv_cache_dtype == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype: 'fp8' needs a GPU of compute capability >= 8.9 (this one is "
                         f"{major}.{minor}); use 'int8' or 'auto'")


def calibration_token_ids(tokenizer, vocab_size: int, max_tokens: int) -> list[int]:
    ids: list[int] = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True) if tokenizer is not None else []
    if not ids:
        rng = random.Random(0)
        ids = [rng.randrange(vocab_size) for _ in range(CALIBRATION_TOKENS)]
    return ids[: min(CALIBRATION_TOKENS, max_tokens)]


def qk_rotation(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An orthonormal [head_dim, head_dim] matrix that mixes every channel into every other."""
    if head_dim & (head_dim - 1) == 0:
        rotation = torch.ones(1, 1)
        while rotation.shape[0] < head_dim:
            rotation = torch.cat([torch.cat([rotation, rotation], 1), torch.cat([rotation, -rotation], 1)])
        rotation /= head_dim**0.5
    else:
        generator = torch.Generator().manual_seed(0)
        rotation, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
    return rotation.to(device=device, dtype=dtype)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.layers]


@torch.inference_mode()
def measure_kv_amax(model: nn.Module, token_ids: list[int], block_size: int) -> list[torch.Tensor]:
    """Per layer, [2, G] float32: the largest |K| and |V| of each KV head over token_ids."""
    device, dtype = model.norm.device, model.norm.dtype
    cfg = model.config
    num_kv_heads = attention_modules(model)[0].num_kv_heads
    n = len(token_ids)
    blocks = -(-n // block_size)
    shape = (blocks, block_size, num_kv_heads, cfg.head_dim)
    caches = [(new_kv_cache(*shape, dtype, device), new_kv_cache(*shape, dtype, device)) for _ in model.layers]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(blocks, device=device, dtype=torch.int32).unsqueeze(0),
        seq_lens=torch.tensor([n], device=device, dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], device=device, dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    model(ids, torch.arange(n, device=device), meta, caches)
    return [torch.stack([k.float().abs().amax(dim=(0, 1, 3)), v.float().abs().amax(dim=(0, 1, 3))])
            for k, v in caches]


def scales_from_amax(amax: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    if cache_dtype == torch.int8:
        return (amax * INT8_HEADROOM / INT8_MAX).clamp_min(1e-8)
    return (amax * FP8_HEADROOM / FP8_MAX).clamp_min(1e-8)


def calibrate_kv_cache_(model: nn.Module, kv_cache_dtype: str, tokenizer, block_size: int) -> None:
    """Sets each attention layer's qk_rotation and kv_scales [2, G] for an fp8 / int8 KV cache
    (no-op for 'auto')."""
    if kv_cache_dtype == "auto":
        return
    cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    for attn in attention_modules(model):
        attn.kv_scales = None  # calibrate with an unquantized cache, on the rotated keys
        attn.qk_rotation = qk_rotation(attn.head_dim, model.norm.device, model.norm.dtype)
    token_ids = calibration_token_ids(tokenizer, model.config.vocab_size, model.cos_sin.shape[0])
    amaxes = measure_kv_amax(model, token_ids, block_size)
    for attn, amax in zip(attention_modules(model), amaxes):
        attn.kv_scales = scales_from_amax(amax, cache_dtype)
    log.info("KV cache %s: scales calibrated on %d tokens", kv_cache_dtype, len(token_ids))
