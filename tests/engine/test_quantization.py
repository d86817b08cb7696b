"""On-the-fly weight quantization (int8, int4, fp8), the fp8 / int8 KV cache in the engine, and the
config words that switch them on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.llama import Linear
from engine.quantization import Fp8Linear, Int4Linear, Int8Linear
from engine.quantization.fp8 import quantize_fp8
from engine.quantization.int4 import int4_group_size, quantize_int4
from engine.quantization.int8 import quantize_int8
from kernels.reference import dequantize_int4, dequantize_int8

QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}
PROMPT = [5, 77, 300, 12, 9, 411, 3, 250, 18]


def test_int8_round_to_nearest_per_channel() -> None:
    w = torch.randn(33, 70) * torch.rand(33, 1) * 3
    w[4] = 0.0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and torch.all(q[4] == 0)
    assert torch.all((dequantize_int8(q, s, torch.float32) - w).abs() <= s[:, None] / 2 + 1e-7)


def test_int4_groups_with_zero_points() -> None:
    w = torch.randn(16, 256) + 0.3
    q, s, z = quantize_int4(w, 128)
    assert q.shape == (16, 32) and s.shape == z.shape == (16, 2) and int(z.max()) <= 15
    err = (dequantize_int4(q, s, z, 128, torch.float32) - w).abs().view(16, 2, 128)
    assert torch.all(err <= s[..., None] / 2 + 1e-6)
    assert int4_group_size(4096) == 128 and int4_group_size(576) == 64 and int4_group_size(24) == 8
    with pytest.raises(ValueError, match="quantization"):
        int4_group_size(20)


def test_fp8_keeps_relative_precision() -> None:
    w = torch.randn(8, 64) * torch.logspace(-3, 1, 8)[:, None]
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and not q.float().isnan().any()
    deq = q.float() * s[:, None]
    assert torch.all((deq - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-9)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_engine_quantizes_every_linear_and_nothing_else(method: str) -> None:
    llm = LLM("random:llama-tiny", device="cpu", quantization=method, num_kv_blocks=16, max_model_len=128)
    model = llm.engine.runner.model
    assert not any(isinstance(m, Linear) for m in model.modules())
    layers = [m for m in model.layers.modules() if isinstance(m, QUANTIZED[method])]
    assert len(layers) == 4 * model.config.num_hidden_layers
    float_params = [n for n, p in model.named_parameters() if p.dtype == torch.float32]
    assert all("embed_tokens" in n or "lm_head" in n or "norm" in n or "scales" in n for n in float_params)
    x = torch.randn(3, layers[0].in_features)
    torch.testing.assert_close(layers[0](x), F.linear(x, layers[0].dequantize(torch.float32)))
    # the LM head too, in int8 per vocabulary row whatever the mode: its logits those of the dequantized rows
    head = model.quantized_lm_head
    assert isinstance(head, Int8Linear)
    assert head.out_features == model.config.vocab_size
    assert model.lm_head.weight.numel() == 0  # llama-tiny's head is untied: its float copy is released
    hidden = torch.randn(2, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, head.dequantize(torch.float32)))


def test_int8_weights_stay_close_to_float() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ref = LLM("random:llama-tiny", device="cpu", num_kv_blocks=16, max_model_len=128).generate([PROMPT], params)[0]
    out = LLM("random:llama-tiny", device="cpu", quantization="int8", num_kv_blocks=16,
              max_model_len=128).generate([PROMPT], params)[0]
    ref_lp = dict(ref.outputs[0].logprobs[0].top)
    for token, logprob in out.outputs[0].logprobs[0].top:
        if token in ref_lp:
            assert abs(logprob - ref_lp[token]) < 5e-3  # int8 decoder linears and LM head


@pytest.mark.parametrize(("kv_dtype", "torch_dtype"), [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_quantized_kv_cache_fits_more_blocks(kv_dtype: str, torch_dtype: torch.dtype) -> None:
    common = dict(device="cpu", cpu_kv_cache_gib=2**-7, max_model_len=128, max_num_seqs=4096)
    plain = LLM("random:llama-tiny", **common).engine.runner
    llm = LLM("random:llama-tiny", kv_cache_dtype=kv_dtype, **common)
    quantized = llm.engine.runner
    assert quantized.kv_caches[0][0].dtype == torch_dtype
    assert plain.bytes_per_block == 4 * quantized.bytes_per_block  # float32 model on CPU: 4 bytes -> 1
    assert quantized.num_blocks == 4 * plain.num_blocks
    for layer in quantized.model.layers:
        scales = layer.self_attn.kv_scales
        assert scales.shape == (2, 2) and torch.all(scales > 0)
        assert layer.self_attn.qk_rotation.shape == (16, 16)
    out = llm.generate([PROMPT, PROMPT[:4]], SamplingParams(temperature=0.0, max_tokens=6))
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)


def test_config_words_are_checked() -> None:
    with pytest.raises(ValueError, match="^quantization:"):
        EngineConfig(model="random:llama-tiny", quantization="int3")
    with pytest.raises(ValueError, match="^kv_cache_dtype:"):
        EngineConfig(model="random:llama-tiny", kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="^quantization:"):
        LLM("random:llama-tiny", device="cpu", quantization="awq")


def test_a_spec_takes_the_same_words() -> None:
    from gateway.specs import parse_spec

    spec = parse_spec({"name": "tiny-q", "source": "random:llama-tiny",
                       "engine": {"quantization": "int8", "kv_cache_dtype": "fp8"}})
    config = EngineConfig.from_kwargs(spec.source, **spec.engine)
    assert (config.quantization, config.kv_cache_dtype) == ("int8", "fp8")
    assert EngineConfig.from_kwargs("random:llama-tiny", quantization="int8", kv_cache_dtype="fp8") == config


@pytest.mark.gpu
@pytest.mark.parametrize(("method", "kv_dtype"), [("int8", "fp8"), ("int4", "int8"), ("fp8", "auto")])
def test_quantized_engine_on_gpu(method: str, kv_dtype: str) -> None:
    """Triton GEMV / GEMM / dequantize, _scaled_mm, the quantized KV kernels and CUDA graphs in one engine."""
    kwargs = dict(device="cuda", quantization=method, kv_cache_dtype=kv_dtype, num_kv_blocks=64, max_model_len=512,
                  max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    out = LLM("random:llama-tiny", **kwargs).generate([PROMPT, PROMPT[:3], list(range(1, 300))], params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert all(-30 < lp.top[0][1] <= 0 for o in out for lp in o.outputs[0].logprobs)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_qk_rotation_is_orthonormal(head_dim: int) -> None:
    from engine.quantization.kv_cache import qk_rotation

    r = qk_rotation(head_dim, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(r @ r.t(), torch.eye(head_dim), atol=1e-5, rtol=0)
    if head_dim == 64:  # Hadamard: every channel into every other, with equal weight
        torch.testing.assert_close(r.abs(), torch.full_like(r, head_dim**-0.5))
