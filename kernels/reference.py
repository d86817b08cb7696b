"""PyTorch reference ops. The CPU engine runs these; every Triton kernel is tested against them.

Shapes (T tokens in a flattened batch, B sequences, H query heads, G KV heads, D head dim):
  KV cache of one layer: k_cache, v_cache [num_blocks, block_size, G, D]
  slot_mapping [T]: block_id * block_size + offset for each new token; negative slots are skipped
  block_tables [B, max_blocks] int32, seq_lens [B]: context length of each sequence including its new tokens
  query_start_loc [B + 1]: sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] of q,
  and they are the last tokens of its context (causal).
  Quantized KV cache (int8 or float8_e4m3fn pages): kv_scales [2, G] float32, the K and V scale of each
  KV head; a stored value times its head's scale is the key or value.
Weight-only quantized linears (int8 per output channel; int4 in groups along K with zero points):
  see dequantize_int8 and dequantize_int4 for the layouts (kernels/formats.py packs int4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.formats import (
    ARGMAX_CHUNK,
    STEP_HEADER_WORDS,
    check_candidate_inputs,
    check_candidates,
    check_masked_argmax,
    check_step_buffers,
    check_token_bitmask,
    step_tables_offset,
    unpack_int4,
)
from kernels.kv_layout import check_kv_scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def norm_project_add(project, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                     residual: torch.Tensor | None = None, rms_norm=rms_norm) -> torch.Tensor:
    """project(rms_norm(x, *norm)) + residual, each part where given, one op after another: what a decode GEMV's
    fusions (kernels/gemv_rows.py) compute in one kernel, and the path of the rows that no GEMV takes."""
    out = project(x if norm is None else rms_norm(x, *norm))
    return out if residual is None else out + residual


def argmax(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: logits [N, V] with V > 0 expected, got shape {tuple(x.shape)}")
    return x.argmax(dim=-1)


def apply_token_bitmask_(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets logits[rows[k], j] = -inf in place wherever bit j of words[k] is 0 (or j is past the words)."""
    check_token_bitmask(logits, words, rows)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def masked_argmax(logits: torch.Tensor, words: torch.Tensor, mask_of_row: torch.Tensor) -> torch.Tensor:
    """argmax(logits) after apply_token_bitmask_ of words[mask_of_row[i]] on each row i with mask_of_row[i] >= 0,
    without writing logits."""
    check_masked_argmax(logits, words, mask_of_row)
    rows = (mask_of_row >= 0).nonzero().flatten()
    masked = logits.clone()
    apply_token_bitmask_(masked, words[mask_of_row[rows].long()], rows)
    return argmax(masked)


def check_embedding_inputs(ids: torch.Tensor, weight: torch.Tensor) -> None:
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"shard_embedding: ids must be int32 or int64, got {ids.dtype}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"shard_embedding: weight [rows, hidden] with unit stride along hidden expected, got "
                         f"shape {tuple(weight.shape)}, strides {weight.stride()}")
    if ids.device != weight.device:
        raise ValueError(f"shard_embedding: ids on {ids.device}, weight on {weight.device}")


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [...] -> [..., hidden]: row id - start of weight (the vocabulary rows start .. start + len(weight) of a
    shard) where the shard holds the id, zeros elsewhere."""
    check_embedding_inputs(ids, weight)
    local = ids.long() - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill_(outside.unsqueeze(-1), 0)


def unpack_step_inputs(staging: torch.Tensor, previous: torch.Tensor | None, input_ids: torch.Tensor,
                       positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, batch_size: int, tokens_per_seq: int) -> None:
    """A staged decode step (kernels/step_inputs.py: header, packed sections, block tables) -> the first batch_size
    sequences' rows of a CUDA graph's static inputs, in place: token ids (previous[row] where a token's
    previous-step row is >= 0), positions, slots, int32 sequence lengths and block-table rows for the header's n
    sequences; slot -1 and a length of tokens_per_seq for the rows past them (ids, positions and tables there are
    left as they were)."""
    check_step_buffers(staging, seq_lens, block_tables)
    n, width = int(staging[0]), int(staging[1])
    q, total = tokens_per_seq, n * tokens_per_seq
    sections = staging[STEP_HEADER_WORDS: STEP_HEADER_WORDS + 4 * total + n]
    ids, pos, slots, rows, ends = sections.split([total] * 4 + [n])
    if previous is not None:
        ids = torch.where(rows >= 0, previous[rows.clamp(min=0)], ids)
    input_ids[:total] = ids
    positions[:total] = pos
    slot_mapping[:total] = slots
    slot_mapping[total: batch_size * q] = -1
    seq_lens[:n] = ends.to(torch.int32)
    seq_lens[n:batch_size] = q
    start = step_tables_offset(n, q)
    block_tables[:n, :width] = staging.view(torch.int32)[start: start + n * width].view(n, width)


def argmax_candidates(x: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """x [N, V] (V <= width) -> [N, ceil(width / ARGMAX_CHUNK), 2] float32: each chunk's largest value and
    offset + its first index. Columns V..width are not values (a shard's padding): the chunks are as many on
    every shard of the same width, whatever each holds."""
    check_candidate_inputs(x, offset, width)
    num_chunks = -(-width // ARGMAX_CHUNK)
    padded = x.new_full((x.shape[0], num_chunks * ARGMAX_CHUNK), float("-inf"), dtype=torch.float32)
    padded[:, : x.shape[1]] = x
    values, at = padded.view(x.shape[0], num_chunks, ARGMAX_CHUNK).max(dim=-1)
    starts = torch.arange(num_chunks, device=x.device) * ARGMAX_CHUNK + offset
    return torch.stack([values, (at + starts).float()], dim=-1)


def pick_argmax_candidate(candidates: torch.Tensor) -> torch.Tensor:
    """candidates [S, N, C, 2] (argmax_candidates of S consecutive shards) -> [N] int64: the index of each row's
    first largest value, NaN counting as largest (as argmax)."""
    check_candidates(candidates)
    rows = candidates.transpose(0, 1).reshape(candidates.shape[1], -1, 2)  # shard-major, then chunk: index order
    values, indices = rows[..., 0], rows[..., 1]
    nan = values.isnan()
    values = values.masked_fill(nan, float("inf"))
    best = (values == values.amax(dim=-1, keepdim=True)) & (nan | ~nan.any(dim=-1, keepdim=True))
    return indices.gather(1, best.int().argmax(dim=-1, keepdim=True)).squeeze(1).long()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding. q [T, H, D], k [T, G, D];
    cos_sin_cache [max_position, D]: cos of the D/2 frequencies, then their sin."""
    cos_sin = cos_sin_cache[positions].float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


FP8_E4M3_MAX = 448.0
INT8_KV_MAX = 127.0


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G, D] / scale [G], rounded to the cache dtype: int8 round-half-up clamped to +-127,
    fp8 e4m3 round-to-nearest-even clamped to +-448 (saturating, never NaN)."""
    y = x.float() / scale.float()[:, None]
    if cache_dtype == torch.int8:
        return torch.floor(y + 0.5).clamp(-INT8_KV_MAX, INT8_KV_MAX).to(torch.int8)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


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
    """rotary_embedding, then store_kv_cache of the rotated k and v; returns the rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored keys or values [..., G, D] back to float32 (unchanged values when scale is None)."""
    return x.float() if scale is None else x.float() * scale.float()[:, None]


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Writes key/value [T, G, D] into the pages at slot_mapping [T], in place, quantizing for an
    int8 / fp8 cache."""
    scales = check_kv_scales(k_cache, kv_scales)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if scales is None:
        k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
        v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)
    else:
        k_cache[blocks, offsets] = quantize_kv(key[keep], scales[0], k_cache.dtype)
        v_cache[blocks, offsets] = quantize_kv(value[keep], scales[1], v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len cached keys and values of one sequence, each [seq_len, G, D]
    (float32, dequantized, for a quantized cache)."""
    scales = check_kv_scales(k_cache, kv_scales)
    block_size = k_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    k = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:seq_len]
    v = v_cache[ids].reshape(-1, *v_cache.shape[2:])[:seq_len]
    if scales is not None:
        k, v = dequantize_kv(k, scales[0]), dequantize_kv(v, scales[1])
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, H, D] are the last L positions of a causal context of k, v [S, G, D]."""
    num_q = q.shape[0]
    seq_len = k.shape[0]
    qf = q.float().transpose(0, 1)  # [H, L, D]
    kf = k.float().transpose(0, 1)  # [G, S, D]
    vf = v.float().transpose(0, 1)
    if num_q == seq_len:  # nothing cached before these tokens: plain causal attention
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos  # [L, S]
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


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
    """Causal attention of each sequence's new tokens q [T, H, D] over its whole paged context.
    Covers prefill, chunked prefill over a cached prefix, and decode. Returns [T, H, D]."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[i], seq_len, kv_scales)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] attends to all seq_lens[b] cached tokens. Returns [B, H, D]."""
    scales = check_kv_scales(k_cache, kv_scales)
    batch = q.shape[0]
    max_len = int(seq_lens.max().item()) if batch else 0
    if batch == 0 or max_len == 0:
        return torch.zeros_like(q)
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].long().clamp(min=0)
    k = k_cache[ids].reshape(batch, num_blocks * block_size, *k_cache.shape[2:])[:, :max_len]  # [B, S, G, D]
    v = v_cache[ids].reshape(batch, num_blocks * block_size, *v_cache.shape[2:])[:, :max_len]
    if scales is not None:
        k, v = dequantize_kv(k, scales[0]), dequantize_kv(v, scales[1])
    kf = k.float().permute(0, 2, 1, 3)  # [B, G, S, D]
    vf = v.float().permute(0, 2, 1, 3)
    valid = torch.arange(max_len, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, S]
    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2).to(q.dtype)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 per output channel: W[n, k] = qweight[n, k] * scales[n]; qweight [N, K] int8, scales [N] float32."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """int4 in groups of group_size along K, asymmetric: W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]
    with g = k // group_size; qweight [N, K/8] int32 (see unpack_int4), scales [N, K/G] float32,
    zeros [N, K/G] uint8."""
    q = unpack_int4(qweight).float()
    n, k = q.shape
    grouped = q.view(n, k // group_size, group_size)
    w = (grouped - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.view(n, k).to(dtype)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype), bias)


def quantize_activations_int8(x: torch.Tensor, run: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (float32) -> (the int8 values as floats [..., K], scales [..., K / run]), as kernels/gemv_int4_a8.py
    computes them in float32: each run of consecutive values times 127 / the run's absolute maximum, rounded half to
    even; the run's scale is its maximum times 1 / 127."""
    runs = x.reshape(*x.shape[:-1], x.shape[-1] // run, run)
    amax = runs.abs().amax(-1).clamp_min(1e-30)
    inv = torch.full_like(amax, 127.0) / amax  # a division, as the kernel's (127 / amax is 127 * (1 / amax) in torch)
    q = torch.round(runs * inv.unsqueeze(-1))
    return q.reshape(x.shape), amax * torch.tensor(1 / 127, dtype=torch.float32)


def int4_linear_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None, norm: tuple[torch.Tensor, float] | None = None,
                   run: int = 16) -> torch.Tensor:
    """What kernels/gemv_int4_a8.py computes, in float64 from the same int8 activations: x (times the norm's weight)
    rounded to int8 per run of values, exact integer dot products with q - zero per run, scaled by the weight's group
    scale and the run's scale, then 1 / rms(x) (norm) and the bias -> float32 [..., N]."""
    k = x.shape[-1]
    values = x.float() if norm is None else x.float() * norm[0].float()
    q, x_scales = quantize_activations_int8(values.reshape(-1, k), run)
    n = qweight.shape[0]
    w = (unpack_int4(qweight).double().view(n, k // group_size, group_size)
         - zeros.double().unsqueeze(-1)).view(n, k // run, run)
    dots = torch.einsum("mcj,ncj->mnc", q.double().view(-1, k // run, run), w)
    run_scales = scales.double().repeat_interleave(group_size // run, dim=1)
    out = (dots * run_scales.unsqueeze(0) * x_scales.double().unsqueeze(1)).sum(-1)
    if norm is not None:
        out = out * torch.rsqrt(x.double().reshape(-1, k).pow(2).mean(-1, keepdim=True) + norm[1])
    if bias is not None:
        out = out + bias.double()
    return out.float().view(*x.shape[:-1], n)


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> [T, R'] float32: each token's x @ a_stack[slot]^T (a_stack [S, R', K]); zeros for slot -1."""
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        out[rows] = x[rows].float() @ a_stack[slot].float().T
    return out


def lora_expand_(y: torch.Tensor, shrunk: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor,
                 slice_offsets: list[int], rank: int) -> None:
    """y[t, o_i:o_i+1] += shrunk[t, i*rank:(i+1)*rank] @ b_stack[slot, o_i:o_i+1]^T for each slice i, in place;
    tokens of slot -1 are left alone. b_stack [S, N, rank]; slice_offsets [slices + 1] columns of y."""
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        for i, (start, end) in enumerate(zip(slice_offsets[:-1], slice_offsets[1:])):
            delta = shrunk[rows, i * rank:(i + 1) * rank] @ b_stack[slot, start:end].float().T
            y[rows, start:end] += delta.to(y.dtype)
