"""PyTorch reference ops. The CPU engine runs these; every Triton kernel is tested against them.

Shapes (T tokens in a flattened batch, B sequences, H query heads, G KV heads, D head dim):
  KV cache of one layer: k_cache, v_cache [num_blocks, block_size, G, D]
  slot_mapping [T]: block_id * block_size + offset for each new token; negative slots are skipped
  block_tables [B, max_blocks] int32, seq_lens [B]: context length of each sequence including its new tokens
  query_start_loc [B + 1]: sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] of q,
  and they are the last tokens of its context (causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes key/value [T, G, D] into the pages at slot_mapping [T], in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len cached keys and values of one sequence, each [seq_len, G, D]."""
    block_size = k_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    k = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:seq_len]
    v = v_cache[ids].reshape(-1, *v_cache.shape[2:])[:seq_len]
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
        k, v = gather_kv(k_cache, v_cache, block_tables[i], seq_len)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] attends to all seq_lens[b] cached tokens. Returns [B, H, D]."""
    batch = q.shape[0]
    max_len = int(seq_lens.max().item()) if batch else 0
    if batch == 0 or max_len == 0:
        return torch.zeros_like(q)
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].long().clamp(min=0)
    k = k_cache[ids].reshape(batch, num_blocks * block_size, *k_cache.shape[2:])[:, :max_len]  # [B, S, G, D]
    v = v_cache[ids].reshape(batch, num_blocks * block_size, *v_cache.shape[2:])[:, :max_len]
    kf = k.float().permute(0, 2, 1, 3)  # [B, G, S, D]
    vf = v.float().permute(0, 2, 1, 3)
    valid = torch.arange(max_len, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, S]
    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2).to(q.dtype)
