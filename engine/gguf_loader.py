"""Reads a llama.cpp .gguf file: the ModelConfig from its metadata and its weights dequantized, with HF names.

`gguf` is imported only here, and this module is imported only when a GGUF is loaded."""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine.model_config import ModelConfig, parameter_shapes

_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp stores Llama-3 rope scaling as this per-frequency tensor instead of metadata.
_ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path: str) -> Any:
    """A GGUFReader, shared by the weight loader and the tokenizer: parsing the metadata takes seconds."""
    try:
        stat = os.stat(path)
        return _cached_reader(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    except Exception as e:  # the reader fails with ValueError, OSError or numpy errors on a bad file
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, mtime_ns: int, size: int) -> Any:
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        """gguf's reader, slicing a plain ndarray view of its memory map (the same pages, still mapped, not read):
        it slices the file once per metadata value (~250k times for a 49k-token vocabulary), and each slice of an
        np.memmap runs memmap's Python-level __array_finalize__, which made parsing SmolLM2's metadata 3x slower."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            if isinstance(self.data, np.memmap):
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

    return PlainViewReader(path)


def load_gguf(path: str, device: torch.device | str, dtype: torch.dtype
              ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The config now (metadata and tensor shapes are checked here) and a lazy iterator of the weights."""
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_model_config(reader, tensors, path)
    hf_names = _hf_names(tensors, path)
    expected = parameter_shapes(config)
    for gguf_name, hf_name in hf_names.items():
        shape = _numpy_shape(tensors[gguf_name])
        if expected.get(hf_name) != shape:
            raise ValueError(f"{path}: tensor {gguf_name} has shape {shape}, the config expects {expected.get(hf_name)}")
    missing = sorted(set(expected) - set(hf_names.values()))
    if missing:
        raise ValueError(f"{path}: missing tensors for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return config, _iter_weights(reader, tensors, hf_names, config, path, torch.device(device), dtype)


def gguf_eos_token_ids(reader: Any) -> tuple[int, ...]:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _meta(reader, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def gguf_model_config(reader: Any, tensors: dict[str, Any], path: str) -> ModelConfig:
    arch = _meta(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {arch!r} (supported: {list(_GGUF_ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = _meta(reader, f"{arch}.{name}")
        if value is None and default is None:
            raise ValueError(f"{path}: metadata key {arch}.{name} is missing")
        return default if value is None else value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    token_list = reader.fields.get("tokenizer.ggml.tokens")
    if token_list is not None:
        vocab = len(token_list.data)
    elif "token_embd.weight" in tensors:
        vocab = _numpy_shape(tensors["token_embd.weight"])[0]
    else:
        raise ValueError(f"{path}: neither a token list nor token_embd.weight gives the vocabulary size")
    rope_theta = float(key("rope.freq_base", 10000.0))
    head_dim = int(key("attention.key_length", hidden // heads))
    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(reader, arch, tensors, rope_theta, head_dim, path),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            sliding_window=None,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=gguf_eos_token_ids(reader),
            torch_dtype=_checkpoint_dtype(tensors),
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (interleaved rope pairs) back to HF's rotate-half order."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _iter_weights(reader: Any, tensors: dict[str, Any], hf_names: dict[str, str], config: ModelConfig,
                  path: str, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for gguf_name, hf_name in hf_names.items():
        t = tensors[gguf_name]
        try:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(_numpy_shape(t))
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize {gguf_name} ({t.tensor_type.name}): {e}") from e
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        if config.architecture == "llama" and ".attn_q." in gguf_name:
            tensor = unpermute_qk(tensor, config.num_attention_heads)
        elif config.architecture == "llama" and ".attn_k." in gguf_name:
            tensor = unpermute_qk(tensor, config.num_key_value_heads)
        yield hf_name, tensor.to(device=device, dtype=dtype).contiguous()


def _hf_names(tensors: dict[str, Any], path: str) -> dict[str, str]:
    names: dict[str, str] = {}
    for gguf_name in tensors:
        if gguf_name == _ROPE_FREQS:
            continue
        if gguf_name in _GLOBAL_NAMES:
            names[gguf_name] = _GLOBAL_NAMES[gguf_name]
            continue
        match = _LAYER_TENSOR.fullmatch(gguf_name)
        if match is None or match.group(2) not in _LAYER_NAMES:
            raise ValueError(f"{path}: unsupported tensor {gguf_name!r}")
        layer, part, kind = match.groups()
        names[gguf_name] = f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return names


def _rope_scaling(reader: Any, arch: str, tensors: dict[str, Any], theta: float, head_dim: int,
                  path: str) -> dict | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none", "linear", "yarn"):
        raise ValueError(f"{path}: unsupported rope scaling type {kind!r}")
    if _ROPE_FREQS in tensors:
        return _llama3_scaling_from_freqs(tensors[_ROPE_FREQS], theta, head_dim, path)
    return None


def _llama3_scaling_from_freqs(tensor: Any, theta: float, head_dim: int, path: str) -> dict:
    """Llama-3.1/3.2 rope scaling, recognised from llama.cpp's per-frequency divisors.

    The file keeps only the divisors; the factor is their maximum and the other parameters are those of
    every released Llama 3.x model, which is checked by recomputing the divisors from them."""
    divisors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4.0:
            expected.append(1.0)
        elif wavelen > 8192 / 1.0:
            expected.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1.0 / ((1 - smooth) / factor + smooth))
    if len(expected) != len(divisors) or not np.allclose(divisors, expected, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight does not match Llama-3 rope scaling")
    return scaling


def _checkpoint_dtype(tensors: dict[str, Any]) -> str:
    """The float type of the big matrices; quantized weights are computed in bfloat16."""
    kinds = {t.tensor_type.name for t in tensors.values() if len(t.shape) > 1}
    if kinds == {"F32"}:
        return "float32"
    if kinds <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"


def _numpy_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dimensions innermost first.
    return tuple(int(d) for d in reversed(tensor.shape))


def _meta(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value
