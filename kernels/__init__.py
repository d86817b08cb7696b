"""Ops used by the engine: Triton kernels on CUDA, the PyTorch references in `reference.py` elsewhere."""

from kernels.reference import (  # noqa: F401
    add_rms_norm,
    decode_attention,
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    store_kv_cache,
)
