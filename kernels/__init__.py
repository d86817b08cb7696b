"""Ops used by the engine: Triton kernels on CUDA, the PyTorch references in `reference.py` elsewhere.

Each op takes the Triton path when its tensors are on CUDA and Triton imports; the setting
TOLLGATE_KERNELS=reference (tollgate/envs.py) forces the references. On Hopper the kernels of a decode step launch
with programmatic dependent launch (kernels/pdl.py). Triton and the kernel modules are imported on the first CUDA
call, so CPU-only processes never import Triton. No kernel module is named like an op: importing a module binds it
in this package under its name.
"""

from __future__ import annotations

import functools
import importlib
import types

import torch
import torch.nn.functional as F

from kernels import reference as _ref
from kernels.lora_indices import LoRAIndices, check_lora_stacks
from tollgate import envs

__all__ = [
    "add_rms_norm",
    "apply_token_bitmask_",
    "argmax",
    "argmax_candidates",
    "decode_attention",
    "int4_linear",
    "int8_linear",
    "int8_linear_silu_and_mul",
    "linear",
    "linear_silu_and_mul",
    "lora_add_",
    "masked_argmax",
    "lora_add_silu_and_mul",
    "norm_project_add",
    "paged_attention",
    "pick_argmax_candidate",
    "rms_norm",
    "rotary_decode_attention",
    "rotary_embedding",
    "rotary_kv_store",
    "shard_embedding",
    "silu_and_mul",
    "store_kv_cache",
    "triton_available",
]


@functools.lru_cache(maxsize=1)
def _triton_modules() -> types.SimpleNamespace | None:
    try:
        import triton  # noqa: F401

        modules = {
            key: importlib.import_module(f"kernels.{name}")
            for key, name in [
                ("activation", "activation"),
                ("argmax", "row_argmax"),
                ("cache_ops", "cache_ops"),
                ("norm", "norm"),
                ("decode", "flash_decode"),
                ("embedding", "embedding"),
                ("gemv", "gemv"),
                ("gemv_configs", "gemv_configs"),
                ("int4_matmul", "int4_matmul"),
                ("int8_matmul", "int8_matmul"),
                ("prefill", "prefill_attention"),
                ("punica_dense", "punica_dense"),
                ("punica_expand", "punica_expand"),
                ("punica_shrink", "punica_shrink"),
                ("rotary", "rotary"),
                ("rotary_store", "rotary_store"),
                ("token_bitmask", "token_bitmask"),
            ]
        }
    except ImportError:
        return None
    return types.SimpleNamespace(**modules)


def _forced_reference() -> bool:
    return envs.get("TOLLGATE_KERNELS") == "reference"


def triton_available() -> bool:
    """True when the ops run Triton kernels for CUDA tensors: a CUDA device is present, Triton imports,
    and TOLLGATE_KERNELS=reference is not set."""
    return not _forced_reference() and torch.cuda.is_available() and _triton_modules() is not None


def _triton_for(t: torch.Tensor) -> types.SimpleNamespace | None:
    if not t.is_cuda or _forced_reference():
        return None
    return _triton_modules()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if ops := _triton_for(x):
        return ops.norm.rms_norm(x, weight, eps)
    return _ref.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    if ops := _triton_for(x):
        return ops.norm.add_rms_norm(x, residual, weight, eps)
    return _ref.add_rms_norm(x, residual, weight, eps)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N] int64: each row's first index of its largest value (NaN counts as largest)."""
    if ops := _triton_for(x):
        return ops.argmax.argmax(x)
    return _ref.argmax(x)


def apply_token_bitmask_(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs: logits[rows[k], j] = -inf in place wherever bit j of words[k] (int32 [K, W]) is 0; the
    other rows are left alone."""
    if ops := _triton_for(logits):
        return ops.token_bitmask.apply_token_bitmask_(logits, words, rows)
    return _ref.apply_token_bitmask_(logits, words, rows)


def masked_argmax(logits: torch.Tensor, words: torch.Tensor, mask_of_row: torch.Tensor) -> torch.Tensor:
    """argmax(logits) after apply_token_bitmask_ (words[mask_of_row[i]] masks row i; -1: no mask), in one pass that
    leaves logits as they are."""
    if ops := _triton_for(logits):
        return ops.argmax.masked_argmax(logits, words, mask_of_row)
    return _ref.masked_argmax(logits, words, mask_of_row)


def argmax_candidates(x: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """x [N, V <= width] -> [N, ceil(width / 4096), 2] float32: each 4096-column chunk's largest value and
    offset + its index, for an argmax over shards of width `width` (pick_argmax_candidate)."""
    if ops := _triton_for(x):
        return ops.argmax.argmax_candidates(x, offset, width)
    return _ref.argmax_candidates(x, offset, width)


def pick_argmax_candidate(candidates: torch.Tensor) -> torch.Tensor:
    """candidates [S, N, C, 2] of S consecutive shards -> [N] int64: the argmax over all of them."""
    if ops := _triton_for(candidates):
        return ops.argmax.pick_argmax_candidate(candidates)
    return _ref.pick_argmax_candidate(candidates)


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [...] -> [..., hidden]: the rows of weight, a shard of the vocabulary starting at id `start`, for the ids
    it holds; zeros for the others."""
    if ops := _triton_for(weight):
        return ops.embedding.shard_embedding(ids, weight, start)
    return _ref.shard_embedding(ids, weight, start)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if ops := _triton_for(x):
        return ops.activation.silu_and_mul(x)
    return _ref.silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding; returns new (q, k)."""
    if ops := _triton_for(q):
        return ops.rotary.rotary_embedding(positions, q, k, cos_sin_cache)
    return _ref.rotary_embedding(positions, q, k, cos_sin_cache)


def rotary_kv_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """rotary_embedding of q and k, then store_kv_cache of the rotated k and v, in one kernel; returns the rotated q."""
    if ops := _triton_for(q):
        return ops.rotary_store.rotary_kv_store(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                   kv_scales)
    return _ref.rotary_kv_store(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, kv_scales)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Writes key/value [T, G, D] into the pages at slot_mapping [T], in place; an int8 / fp8 cache
    needs kv_scales [2, G] (K and V scale per KV head)."""
    if ops := _triton_for(k_cache):
        ops.cache_ops.store_kv_cache(key, value, k_cache, v_cache, slot_mapping, kv_scales)
    else:
        _ref.store_kv_cache(key, value, k_cache, v_cache, slot_mapping, kv_scales)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens q [T, H, D] over its whole paged context."""
    if ops := _triton_for(q):
        return ops.prefill.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                           kv_scales)
    return _ref.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, kv_scales)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] attends to all seq_lens[b] cached tokens."""
    if ops := _triton_for(q):
        return ops.decode.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales)
    return _ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales)


Norm = tuple[torch.Tensor, float]  # an RMSNorm's (weight, eps)


def norm_project_add(project, x: torch.Tensor, norm: Norm | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """project(rms_norm(x, *norm)) + residual, each part where given, as separate ops: for projections with no fused
    kernel (kernels/reference.py)."""
    return _ref.norm_project_add(project, x, norm, residual, rms_norm)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, norm: Norm | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias; with norm, of rms_norm(x, *norm); with residual [..., N], plus it. One
    row of bf16 / fp16 activations on CUDA (batch-1 decode) runs the decode GEMV, which reads the weight faster than
    cuBLAS does at M = 1 and fuses the norm and the residual add; everything else is F.linear and separate ops."""
    return _linear(x, weight, bias, norm, residual, gated=False)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        norm: Norm | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, weight, bias, norm=norm)) for a fused gate_up weight [2N, K] -> [..., N]; at one row on
    CUDA the decode GEMV applies the SiLU and product itself, saving a kernel."""
    if weight.shape[0] % 2:
        return silu_and_mul(linear(x, weight, bias, norm=norm))
    return _linear(x, weight, bias, norm, None, gated=True)


def _linear(x, weight, bias, norm, residual, gated: bool) -> torch.Tensor:
    if ops := _gemv_row(x, weight):
        n, k = weight.shape
        configs = ops.gemv_configs
        if norm is None:
            config = (configs.gated_gemv_config if gated else configs.gemv_config)(n, k, 1, weight.dtype)
        else:
            config = configs.normed_gemv_config(n, k, weight.dtype, gated)
        if config is not None:
            return ops.gemv.gemv(x, weight, None, bias, config=config, gated=gated, norm=norm, residual=residual)
        return _linear(rms_norm(x, *norm), weight, bias, None, residual, gated)
    out = norm_project_add(lambda h: F.linear(h, weight, bias), x, norm, residual)
    return silu_and_mul(out) if gated else out


_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def _gemv_row(x: torch.Tensor, weight: torch.Tensor) -> types.SimpleNamespace | None:
    """The Triton modules when x is one row that the decode GEMV takes, else None."""
    if x.numel() == x.shape[-1] and weight.dtype in _GEMV_DTYPES and weight.stride(-1) == 1:
        return _triton_for(x)
    return None


def lora_add_(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int, indices: LoRAIndices,
              norm: Norm | None = None) -> None:
    """y [T, N] += each token's LoRA term (x [T, K] @ A[slot]^T) @ B[slot]^T, in place, slice by slice of a fused
    projection (kernels/punica_shrink.py, kernels/punica_expand.py: the stacks' layouts); tokens of slot -1 are left
    alone. With norm, the term of rms_norm(x, *norm). On CUDA a decode step (one token per sequence) runs the BGMV
    kernels, or the grouped ones when its indices say so (indices.grouped: tokens sharing adapters, each adapter's
    weights read once; with indices.dense, the dense expand where lora_dense_expand says), which fuse the norm and
    launch nothing else (what a CUDA graph of the step captures), other steps the SGMV ones."""
    check_lora_stacks(x, a_stack, b_stack, slice_offsets_host, rank)
    if lora_decode_halves(x, indices):
        dense_rank = rank if lora_dense_expand(indices, slice_offsets_host) else None
        lora_expand_(y, lora_shrink(x, a_stack, indices, norm, dense_rank=dense_rank), b_stack, slice_offsets,
                     slice_offsets_host, rank, indices)
        return
    if ops := _triton_for(x):
        x = x if norm is None else ops.norm.rms_norm(x, *norm)
        shrunk = ops.punica_shrink.sgmv_shrink(x, a_stack, indices)
        ops.punica_expand.sgmv_expand_(y, shrunk, b_stack, indices, slice_offsets, slice_offsets_host, rank)
        return
    x = x if norm is None else _ref.rms_norm(x, *norm)
    shrunk = _ref.lora_shrink(x, a_stack, indices.token_slots)
    _ref.lora_expand_(y, shrunk, b_stack, indices.token_slots, slice_offsets_host, rank)


def lora_decode_halves(x: torch.Tensor, indices: LoRAIndices) -> bool:
    """Whether a decode step's LoRA term can run as lora_shrink on a stream of its own beside the base projection,
    then lora_expand_ after it: one token per sequence on CUDA."""
    return indices.one_token_per_seq and _triton_for(x) is not None


# the dense expand takes one GEMM per slice: q|k|v's three narrow slices cost more launches than the GEMMs save
# (docs/benchmarks/lora.md, 2026-12-05)
DENSE_EXPAND_MAX_SLICES = 2


def lora_dense_expand(indices: LoRAIndices, slice_offsets_host: list[int]) -> bool:
    """Whether a decode step's expand of a projection with these slices takes the dense form
    (kernels/punica_dense.py): the step's indices ask for it and the projection has few enough slices."""
    return indices.dense and len(slice_offsets_host) - 1 <= DENSE_EXPAND_MAX_SLICES


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: LoRAIndices, norm: Norm | None = None,
                stream: torch.cuda.Stream | None = None, *, dense_rank: int | None = None):
    """A decode step's shrink (lora_decode_halves): per token or grouped by slot as the indices say, on `stream` once
    the current stream's work so far is done; the current stream must wait for `stream` before lora_expand_. With
    dense_rank (the stacks' rank), its rows are then laid out for the dense expand, on the same stream."""
    ops = _triton_for(x)
    shrink = ops.punica_shrink.grouped_shrink if indices.grouped else ops.punica_shrink.bgmv_shrink
    shrunk = shrink(x, a_stack, indices, norm=norm, stream=stream)
    if dense_rank is None:
        return shrunk
    return ops.punica_dense.dense_rows(shrunk, indices, a_stack.shape[0], dense_rank, a_stack.dtype, stream=stream)


def lora_expand_(y: torch.Tensor, shrunk, b_stack: torch.Tensor, slice_offsets: torch.Tensor,
                 slice_offsets_host: list[int], rank: int, indices: LoRAIndices) -> None:
    """y [T, N] += each token's expand of lora_shrink's result, in place (lora_add_'s second half)."""
    ops = _triton_for(y)
    if isinstance(shrunk, ops.punica_dense.DenseRows):
        ops.punica_dense.dense_expand_(y, shrunk, b_stack, slice_offsets_host)
        return
    expand = ops.punica_expand.grouped_expand_ if indices.grouped else ops.punica_expand.bgmv_expand_
    expand(y, shrunk, b_stack, indices, slice_offsets, slice_offsets_host, rank)


def lora_expand_silu_and_mul(y: torch.Tensor, shrunk, b_stack: torch.Tensor, slice_offsets: torch.Tensor,
                             slice_offsets_host: list[int], rank: int, indices: LoRAIndices) -> torch.Tensor:
    """silu_and_mul of a fused gate|up projection's output y [T, 2N] after lora_expand_, in one kernel (two GEMMs and
    one kernel in the dense form)."""
    ops = _triton_for(y)
    if slice_offsets_host == [0, y.shape[1] // 2, y.shape[1]] and not isinstance(shrunk, ops.punica_dense.DenseRows):
        if indices.grouped:
            return ops.punica_expand.grouped_expand_silu_and_mul(y, shrunk, b_stack, indices, rank)
        return ops.punica_expand.bgmv_expand_silu_and_mul(y, shrunk, b_stack, indices, rank)
    lora_expand_(y, shrunk, b_stack, slice_offsets, slice_offsets_host, rank, indices)
    return silu_and_mul(y)


def lora_add_silu_and_mul(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                          slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int, indices: LoRAIndices,
                          norm: Norm | None = None) -> torch.Tensor:
    """silu_and_mul of a fused gate|up projection's output y [T, 2N] after lora_add_ (its two slices of N columns);
    on CUDA a decode step adds the expand and the product in one kernel. y may be overwritten."""
    if lora_decode_halves(x, indices):
        check_lora_stacks(x, a_stack, b_stack, slice_offsets_host, rank)
        dense_rank = rank if lora_dense_expand(indices, slice_offsets_host) else None
        return lora_expand_silu_and_mul(y, lora_shrink(x, a_stack, indices, norm, dense_rank=dense_rank), b_stack,
                                        slice_offsets, slice_offsets_host, rank, indices)
    lora_add_(y, x, a_stack, b_stack, slice_offsets, slice_offsets_host, rank, indices, norm=norm)
    return silu_and_mul(y)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, *,
                norm: Norm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the int8 (or float8_e4m3fn) weight [N, K] with per-output-channel scales [N], plus bias; norm
    and residual as in linear (fused in the GEMVs)."""
    if ops := _triton_for(x):
        return ops.int8_matmul.int8_linear(x, qweight, scales, bias, norm=norm, residual=residual)
    return norm_project_add(lambda h: _ref.int8_linear(h, qweight, scales, bias), x, norm, residual)


def int8_linear_silu_and_mul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, *,
    norm: Norm | None = None,
) -> torch.Tensor:
    """silu_and_mul(int8_linear(...)) for a fused gate_up weight [2N, K] -> [..., N], in the GEMV at decode sizes."""
    if ops := _triton_for(x):
        return ops.int8_matmul.int8_linear(x, qweight, scales, bias, gated=True, norm=norm)
    return _ref.silu_and_mul(int8_linear(x, qweight, scales, bias, norm=norm))


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    *,
    gated: bool = False,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
    int8_activations: bool = True,
) -> torch.Tensor:
    """x [..., K] times the int4 weight (qweight [N, K/8] int32, scales / zeros [N, K/G]), plus bias; gated: silu(gate)
    * up of a fused gate_up weight [2N, K] -> [..., N], in the GEMV at one row; norm and residual as in linear.
    int8_activations: one bf16 row on CUDA may round x to int8 for the DP4A GEMV (kernels/gemv_int4_a8.py)."""
    if gated and residual is not None:
        raise ValueError("int4_linear: a gated projection takes no residual")
    if ops := _triton_for(x):
        return ops.int4_matmul.int4_linear(x, qweight, scales, zeros, group_size, bias, gated=gated, norm=norm,
                                           residual=residual, int8_activations=int8_activations)
    out = norm_project_add(lambda h: _ref.int4_linear(h, qweight, scales, zeros, group_size, bias), x, norm,
                           residual)
    return _ref.silu_and_mul(out) if gated else out


def rotary_decode_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """rotary_kv_store of the new tokens (one per sequence), then decode_attention of the rotated q; on CUDA one kernel
    does both where the head_dim is a power of two."""
    if (ops := _triton_for(q)) and ops.decode.fuses_rotary(q.shape[-1]):
        return ops.decode.rotary_decode_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                  block_tables, seq_lens, scale, kv_scales)
    q = rotary_kv_store(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, kv_scales)
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales)
