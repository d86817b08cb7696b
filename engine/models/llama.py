"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm, SmolLM2)
written for paged attention: the tokens of all sequences in a step form one flat batch."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import kernels as ops
from engine.model_config import ModelConfig
from engine.models.attention_metadata import AttentionMetadata
from engine.models.rope import cos_sin_cache


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _norm_weight(size: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, device, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, device, dtype)
        self.q_norm = _norm_weight(self.head_dim, device, dtype) if cfg.qk_norm else None
        self.k_norm = _norm_weight(self.head_dim, device, dtype) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)
            k = ops.rms_norm(k, self.k_norm, self.eps)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            out = ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale)
        else:
            out = ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
            )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, device, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _norm_weight(cfg.hidden_size, device, dtype)
        self.self_attn = Attention(cfg, device, dtype)
        self.post_attention_layernorm = _norm_weight(cfg.hidden_size, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, x, residual, positions, meta, k_cache, v_cache, cos_sin):
        if residual is None:
            residual = x
            h = ops.rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_layernorm, self.eps)
        h = self.self_attn(h, positions, meta, k_cache, v_cache, cos_sin)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = _norm_weight(cfg.hidden_size, device, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype), requires_grad=False)
        )
        self.register_buffer(
            "cos_sin", cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, meta, k_cache, v_cache, self.cos_sin)
        x, _ = ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors in, fusing q/k/v and gate/up. ValueError if any parameter is missing."""
        cfg = self.config
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        fused = {
            "q_proj": ("self_attn.qkv_proj", 0, q_size),
            "k_proj": ("self_attn.qkv_proj", q_size, kv_size),
            "v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("mlp.gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("mlp.gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        renamed = {
            "self_attn.q_norm.weight": "self_attn.q_norm",
            "self_attn.k_norm.weight": "self_attn.k_norm",
            "input_layernorm.weight": "input_layernorm",
            "post_attention_layernorm.weight": "post_attention_layernorm",
        }
        params = dict(self.named_parameters())
        expected = {name: param.numel() for name, param in params.items()}
        filled: dict[str, int] = {}

        def put(name: str, tensor: torch.Tensor, start: int | None = None, length: int | None = None) -> None:
            target = params[name]
            part = target if start is None else target.narrow(0, start, length)
            if part.shape != tensor.shape:
                raise ValueError(f"weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(part.shape)}")
            part.copy_(tensor)
            filled[name] = filled.get(name, 0) + tensor.numel()

        for hf_name, tensor in weights:
            if hf_name == "model.embed_tokens.weight":
                put("embed_tokens", tensor)
            elif hf_name == "model.norm.weight":
                put("norm", tensor)
            elif hf_name == "lm_head.weight":
                if self.lm_head is not None:
                    put("lm_head", tensor)
            elif hf_name.startswith("model.layers."):
                index, rest = hf_name[len("model.layers.") :].split(".", 1)
                prefix = f"layers.{index}."
                module, _, kind = rest.rpartition(".")
                short = module.rsplit(".", 1)[-1]
                if short in fused:
                    target, start, length = fused[short]
                    put(f"{prefix}{target}.{kind}", tensor, start, length)
                elif rest in renamed:
                    put(prefix + renamed[rest], tensor)
                elif prefix + rest in params:
                    put(prefix + rest, tensor)
        missing = [name for name, size in expected.items() if filled.get(name, 0) != size]
        if missing:
            raise ValueError(f"weights: checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
