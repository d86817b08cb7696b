"""AWQ and GPTQ checkpoints: tiny models written here from known 4-bit values with the formats' own
packing (written out from the format definitions, independently of the engine's repacking) load
exactly: each linear's dequantized weight equals the known one bit for bit, its forward equals a
matmul with it, and the whole model's logprobs equal those of a float checkpoint of those weights."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.random_models import random_model_config
from engine.quantization import Int4Linear

GROUP = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
CONFIG = dataclasses.replace(
    random_model_config("llama-tiny"), vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, torch_dtype="float16",
)
LINEARS = {  # HF name -> (out, in)
    "self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
    "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
    "mlp.down_proj": (128, 256),
}


def to_int32(words: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def pack_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, C] ints -> [R, C/8] int32, word c of a row holding columns 8c + order[i] in nibble i."""
    rows, cols = values.tolist(), values.shape[1]
    return to_int32([[sum((row[8 * c + order[i]] & 0xF) << (4 * i) for i in range(8)) for c in range(cols // 8)]
                     for row in rows])


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints -> [R/8, C] int32, word (j, c) holding rows 8j + i in nibble i (GPTQ's qweight)."""
    v = values.tolist()
    return to_int32([[sum((v[8 * j + i][c] & 0xF) << (4 * i) for i in range(8)) for c in range(values.shape[1])]
                     for j in range(values.shape[0] // 8)])


@dataclasses.dataclass
class KnownLinear:
    q: torch.Tensor  # [N, K] in 0..15
    zeros: torch.Tensor  # [K/G, N]
    scales: torch.Tensor  # [K/G, N] float16

    @property
    def weight(self) -> torch.Tensor:
        groups = torch.arange(self.q.shape[1]) // GROUP
        return (self.q - self.zeros[groups].t()).float() * self.scales[groups].t().float()


def known_linear(out_features: int, in_features: int, min_zero: int) -> KnownLinear:
    groups = in_features // GROUP
    return KnownLinear(
        q=torch.randint(0, 16, (out_features, in_features)),
        zeros=torch.randint(min_zero, 16, (groups, out_features)),
        scales=(torch.rand(groups, out_features) * 0.02 + 0.005).half(),
    )


def write_model(path: str, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> str:
    os.makedirs(path, exist_ok=True)
    hf = CONFIG.to_hf_dict()
    if quantization_config is not None:
        hf["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


def float_tensors(generator: torch.Generator) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": torch.randn(96, 128, generator=generator).half(),
           "lm_head.weight": (torch.randn(96, 128, generator=generator) * 0.1).half(),
           "model.norm.weight": torch.ones(128).half()}
    for layer in range(CONFIG.num_hidden_layers):
        out[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(128).half()
        out[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(128).half()
    return out


def write_checkpoints(tmp_path, method: str, fmt: str = "gptq", g_idx: bool = True):
    """(quantized dir, float dir with the same dequantized weights, {layer.linear: KnownLinear})."""
    torch.manual_seed(0)
    tensors = float_tensors(torch.Generator().manual_seed(1))
    floats = dict(tensors)
    known: dict[str, KnownLinear] = {}
    for layer in range(CONFIG.num_hidden_layers):
        for name, (n, k) in LINEARS.items():
            base = f"model.layers.{layer}.{name}"
            lin = known[base] = known_linear(n, k, min_zero=1 if fmt == "gptq" else 0)
            floats[f"{base}.weight"] = lin.weight
            if method == "awq":
                tensors[f"{base}.qweight"] = pack_columns(lin.q.t(), AWQ_ORDER)
                tensors[f"{base}.qzeros"] = pack_columns(lin.zeros, AWQ_ORDER)
            else:
                tensors[f"{base}.qweight"] = pack_rows(lin.q.t())
                stored = lin.zeros - 1 if fmt == "gptq" else lin.zeros
                tensors[f"{base}.qzeros"] = pack_columns(stored, tuple(range(8)))
                if g_idx:
                    tensors[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
            tensors[f"{base}.scales"] = lin.scales
    if method == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
    else:
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                "checkpoint_format": fmt}
    return (write_model(str(tmp_path / method), tensors, qcfg), write_model(str(tmp_path / "float"), floats, None),
            known)


def fused(known: dict[str, KnownLinear], layer: int, parts: list[str]) -> torch.Tensor:
    return torch.cat([known[f"model.layers.{layer}.{p}"].weight for p in parts])


@pytest.mark.parametrize(("method", "fmt"), [("awq", "gptq"), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_checkpoint_loads_exactly(tmp_path, method: str, fmt: str) -> None:
    qdir, fdir, known = write_checkpoints(tmp_path, method, fmt)
    llm = LLM(qdir, device="cpu", num_kv_blocks=8, max_model_len=64)
    model = llm.engine.runner.model
    for layer_index, layer in enumerate(model.layers):
        expected = {
            layer.self_attn.qkv_proj: fused(known, layer_index, ["self_attn.q_proj", "self_attn.k_proj",
                                                                 "self_attn.v_proj"]),
            layer.self_attn.o_proj: fused(known, layer_index, ["self_attn.o_proj"]),
            layer.mlp.gate_up_proj: fused(known, layer_index, ["mlp.gate_proj", "mlp.up_proj"]),
            layer.mlp.down_proj: fused(known, layer_index, ["mlp.down_proj"]),
        }
        for module, weight in expected.items():
            assert isinstance(module, Int4Linear) and module.group_size == GROUP
            assert torch.equal(module.dequantize(torch.float32), weight)
            x = torch.randn(3, weight.shape[1])
            torch.testing.assert_close(module(x), torch.matmul(x, weight.t()), rtol=1e-5, atol=1e-5)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    prompt = [3, 17, 50, 8, 91, 2, 40]
    quantized = llm.generate([prompt], params)[0].outputs[0]
    reference = LLM(fdir, device="cpu", num_kv_blocks=8, max_model_len=64).generate([prompt], params)[0].outputs[0]
    assert quantized.token_ids == reference.token_ids
    for ours, theirs in zip(quantized.logprobs, reference.logprobs):
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours.top, theirs.top)) < 1e-4


def test_int4_quantization_conflicts_are_refused(tmp_path) -> None:
    qdir, _, _ = write_checkpoints(tmp_path, "awq")
    with pytest.raises(ValueError, match="^quantization: .*AWQ checkpoint"):
        LLM(qdir, device="cpu", quantization="int8", num_kv_blocks=8, max_model_len=64)
    llm = LLM(qdir, device="cpu", quantization="int4", num_kv_blocks=8, max_model_len=64)
    assert isinstance(llm.engine.runner.model.layers[0].mlp.down_proj, Int4Linear)


def test_act_order_gptq_is_refused(tmp_path) -> None:
    qdir, _, _ = write_checkpoints(tmp_path, "gptq")
    config_file = os.path.join(qdir, "config.json")
    with open(config_file) as f:
        hf = json.load(f)
    hf["quantization_config"]["desc_act"] = True
    with open(config_file, "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="quantization_config.desc_act"):
        LLM(qdir, device="cpu", num_kv_blocks=8, max_model_len=64)


def test_shuffled_g_idx_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file

    qdir, _, _ = write_checkpoints(tmp_path, "gptq")
    file = os.path.join(qdir, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0)
    save_file(tensors, file)
    with pytest.raises(ValueError, match="g_idx"):
        LLM(qdir, device="cpu", num_kv_blocks=8, max_model_len=64)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("bits", 8, "quantization_config.bits"),
    ("quant_method", "bitsandbytes", "quantization_config.quant_method"),
    ("group_size", -1, "quantization_config.group_size"),
])
def test_unsupported_quantization_configs(tmp_path, field: str, value, match: str) -> None:
    qdir, _, _ = write_checkpoints(tmp_path, "gptq", g_idx=False)
    config_file = os.path.join(qdir, "config.json")
    with open(config_file) as f:
        hf = json.load(f)
    hf["quantization_config"][field] = value
    with open(config_file, "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match=match):
        LLM(qdir, device="cpu", num_kv_blocks=8, max_model_len=64)
