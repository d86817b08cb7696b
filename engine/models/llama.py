"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm, SmolLM2)
written for paged attention: the tokens of all sequences in a step form one flat batch."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import kernels as ops
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.model_config import ModelConfig
from engine.models.attention_metadata import AttentionMetadata
from engine.models.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    VocabParallelEmbedding,
    fuses_norms,
    gate_up_silu,
    row_parallel_add_rms_norm,
    vocab_parallel_argmax,
    vocab_parallel_logits,
)
from engine.models.rope import cos_sin_cache

__all__ = ["Linear", "LlamaForCausalLM"]


def _norm_weight(size: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    """Under tensor parallelism each rank runs num_heads / tp query heads and num_kv_heads / tp KV heads."""

    def __init__(self, cfg: ModelConfig, device, dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = tp.shard_size(cfg.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.shard_size(cfg.num_key_value_heads, "KV heads")
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        full_q, full_kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, full_q + 2 * full_kv, cfg.attention_bias, device,
                                             dtype, tp)
        self.o_proj = RowParallelLinear(full_q, cfg.hidden_size, False, device, dtype, tp)
        self.q_norm = _norm_weight(self.head_dim, device, dtype) if cfg.qk_norm else None
        self.k_norm = _norm_weight(self.head_dim, device, dtype) if cfg.qk_norm else None
        # [2, num_kv_heads] K and V scales of an fp8 / int8 KV cache, and the orthonormal [head_dim, head_dim]
        # rotation of q and k that spreads K's outlier channels before rounding (engine/quantization/kv_cache.py)
        self.kv_scales: torch.Tensor | None = None
        self.qk_rotation: torch.Tensor | None = None

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        norm: ops.Norm | None = None,
    ) -> torch.Tensor:
        """The attention heads' outputs [tokens, heads * head_dim] of x (of rms_norm(x, *norm) with a norm), before
        o_proj."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x, norm=norm).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)
            k = ops.rms_norm(k, self.k_norm, self.eps)
        if self.qk_rotation is None and meta.decode_only:
            out = ops.rotary_decode_attention(positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping,
                                              meta.block_tables, meta.seq_lens, self.scale, self.kv_scales)
            return out.reshape(num_tokens, self.q_size)
        if self.qk_rotation is None:
            q = ops.rotary_kv_store(positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping, self.kv_scales)
        else:
            q, k = ops.rotary_embedding(positions, q, k, cos_sin)
            q, k = q @ self.qk_rotation, k @ self.qk_rotation  # q R (k R)^T = q k^T
            ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.kv_scales)
        if meta.decode_only:
            out = ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                       self.kv_scales)
        else:
            out = ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                self.kv_scales,
            )
        return out.reshape(num_tokens, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size, False, device, dtype, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, device, dtype, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _norm_weight(cfg.hidden_size, device, dtype)
        self.self_attn = Attention(cfg, device, dtype, tp)
        self.post_attention_layernorm = _norm_weight(cfg.hidden_size, device, dtype)
        self.mlp = MLP(cfg, device, dtype, tp)

    def forward(self, h, residual, next_norm, positions, meta, k_cache, v_cache, cos_sin):
        """h: the normed input, residual: the stream it was normed from. Returns the next layer's (h, residual),
        normed with next_norm; each row-parallel projection's all-reduce runs together with the norm after it.
        h None: the norms are left to the projections (engine/models/linear.py, fuses_norms), and so is the next
        layer's: it gets (None, residual)."""
        if h is None:
            return None, self._forward_fused_norms(residual, positions, meta, k_cache, v_cache, cos_sin)
        attention = self.self_attn.attend(h, positions, meta, k_cache, v_cache, cos_sin)
        h, residual = row_parallel_add_rms_norm(self.self_attn.o_proj, attention, residual,
                                                self.post_attention_layernorm, self.eps)
        activation = gate_up_silu(self.mlp.gate_up_proj, h)
        return row_parallel_add_rms_norm(self.mlp.down_proj, activation, residual, next_norm, self.eps)

    def _forward_fused_norms(self, residual, positions, meta, k_cache, v_cache, cos_sin):
        """The residual stream after this layer, each norm applied by the projection after it and each add by the
        one before it."""
        attention = self.self_attn.attend(residual, positions, meta, k_cache, v_cache, cos_sin,
                                          norm=(self.input_layernorm, self.eps))
        residual = self.self_attn.o_proj(attention, residual=residual)
        activation = gate_up_silu(self.mlp.gate_up_proj, residual, norm=(self.post_attention_layernorm, self.eps))
        return self.mlp.down_proj(activation, residual=residual)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = _norm_weight(cfg.hidden_size, device, dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype, tp)
        )
        # The LM head quantized along with the decoder's linears (engine/quantization/model.py), else None.
        self.quantized_lm_head: nn.Module | None = None
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
        eps = self.config.rms_norm_eps
        if fuses_norms(self.tp, input_ids.numel()):
            h, residual = None, self.embed_tokens(input_ids)
        else:
            h, residual = self.embed_tokens.forward_rms_norm(input_ids, self.layers[0].input_layernorm, eps)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, (k_cache, v_cache) in zip(self.layers, next_norms, kv_caches):
            h, residual = layer(h, residual, next_norm, positions, meta, k_cache, v_cache, self.cos_sin)
        return ops.rms_norm(residual, self.norm, eps) if h is None else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self._logits_shard(hidden), self.embed_tokens)

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row, without gathering the vocabulary-split logits."""
        return vocab_parallel_argmax(self._logits_shard(hidden), self.embed_tokens)

    def _logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_lm_head is not None:
            return self.quantized_lm_head(hidden)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return ops.linear(hidden, head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors in, fusing q/k/v and gate/up and keeping this rank's slice of each.
        ValueError if any parameter is missing."""
        cfg, tp = self.config, self.tp
        q_size = cfg.num_attention_heads * cfg.head_dim // tp.size
        kv_size = cfg.num_key_value_heads * cfg.head_dim // tp.size
        inter = cfg.intermediate_size // tp.size
        fused = {
            "q_proj": ("self_attn.qkv_proj", 0, q_size),
            "k_proj": ("self_attn.qkv_proj", q_size, kv_size),
            "v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("mlp.gate_up_proj", 0, inter),
            "up_proj": ("mlp.gate_up_proj", inter, inter),
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

        def sharded(module_name: str, tensor: torch.Tensor, kind: str) -> torch.Tensor:
            module = self.get_submodule(module_name)
            module = getattr(module, "inner", module)  # a row-parallel quantized layer wraps its int4 linear
            return module.shard_of(tensor, is_bias=kind == "bias") if hasattr(module, "shard_of") else tensor

        for hf_name, tensor in weights:
            if hf_name == "model.embed_tokens.weight":
                put("embed_tokens.weight", self.embed_tokens.shard_of(tensor))
            elif hf_name == "model.norm.weight":
                put("norm", tensor)
            elif hf_name == "lm_head.weight":
                if self.lm_head is not None:
                    put("lm_head.weight", self.lm_head.shard_of(tensor))
            elif hf_name.startswith("model.layers."):
                index, rest = hf_name[len("model.layers.") :].split(".", 1)
                prefix = f"layers.{index}."
                module, _, kind = rest.rpartition(".")
                short = module.rsplit(".", 1)[-1]
                if short in fused:
                    target, start, length = fused[short]
                    put(f"{prefix}{target}.{kind}", sharded(prefix + target, tensor, kind), start, length)
                elif rest in renamed:
                    put(prefix + renamed[rest], tensor)
                elif prefix + rest in params:
                    put(prefix + rest, sharded(prefix + module, tensor, kind))
                elif f"{prefix}{module}.inner.{kind}" in params:
                    put(f"{prefix}{module}.inner.{kind}", sharded(prefix + module, tensor, kind))
        missing = [name for name, size in expected.items() if filled.get(name, 0) != size]
        if missing:
            raise ValueError(f"weights: checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
