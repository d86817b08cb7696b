"""The shape of a Llama-family network, read from an HF config.json (or built by the GGUF loader)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_HF_CLASS_BY_ARCH = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}
# Keys of an HF rope dict that describe the base rotation, not a scaling.
_ROPE_BASE_KEYS = ("rope_theta", "partial_rotary_factor")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    def __post_init__(self) -> None:
        if self.architecture not in _HF_CLASS_BY_ARCH:
            raise ValueError(f"architecture: unsupported {self.architecture!r} (supported: {sorted(_HF_CLASS_BY_ARCH)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads {self.num_attention_heads}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be positive, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be positive, got {self.rope_theta!r}")

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a JSON object, got {type(d).__name__}")
        arch = _architecture(d)
        num_heads = _required_int(d, "num_attention_heads")
        hidden = _required_int(d, "hidden_size")
        rope_theta, rope_scaling = _rope(d)
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        if arch != "qwen2" and d.get("attention_bias"):
            raise ValueError(f"attention_bias: attention biases are not supported for {arch}")
        text_dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=_required_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(d, "intermediate_size"),
            num_hidden_layers=_required_int(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases (and no o_proj bias)
            qk_norm=arch == "qwen3",
            sliding_window=_sliding_window(d, arch),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_id_tuple(d.get("eos_token_id")),
            torch_dtype=str(text_dtype).removeprefix("torch."),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json for this shape (what from_hf_dict and transformers both read)."""
        d: dict[str, Any] = {
            "architectures": [_HF_CLASS_BY_ARCH[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.torch_dtype,
        }
        return d


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint of this config holds, by HF name, with its shape."""
    c = config
    q_dim = c.num_attention_heads * c.head_dim
    kv_dim = c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, c.hidden_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q_dim)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def token_id_tuple(value: Any) -> tuple[int, ...]:
    """An HF eos_token_id field (None, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id: expected an int or a list of ints, got {value!r}")


def _architecture(d: dict) -> str:
    names = d.get("architectures") or []
    if names:
        for name in names:
            if name in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[name]
        raise ValueError(f"architecture: unsupported {names[0]!r} (supported: {sorted(HF_ARCHITECTURES)})")
    model_type = d.get("model_type")
    if model_type in _HF_CLASS_BY_ARCH:
        return model_type
    raise ValueError(f"architecture: unsupported {model_type!r} (supported: {sorted(HF_ARCHITECTURES)})")


def _required_int(d: dict, key: str) -> int:
    value = d.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key}: missing or not an integer in the model config ({value!r})")
    return value


def _rope(d: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling dict from either transformers 4 or 5 spelling."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling: expected an object, got {params!r}")
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k not in _ROPE_BASE_KEYS}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _sliding_window(d: dict, arch: str) -> int | None:
    window = d.get("sliding_window")
    if arch == "llama" or window is None:
        return None
    if arch in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return None
    return int(window)
