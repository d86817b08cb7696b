"""On the GPU (Triton SGMV/BGMV kernels, bf16, decode steps in CUDA graphs): a batch mixing the base model and several
LoRA adapters gives each request the logits of peft's PeftModel over its adapter, as close as peft's own bf16 run comes
to float32, with the per-token and with the grouped LoRA decode kernels; so does batch-1 decode, where the base
projections' GEMVs and the LoRA kernels fuse the RMSNorms."""

import copy

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.conftest import tiny_hf_model
from tests.engine.lora_helpers import ALL_TARGETS, peft_reference, write_peft_adapter
from tests.engine.test_lora_peft_parity import _run

pytestmark = pytest.mark.gpu

ADAPTERS = {
    "qv-r8": (8, 16, ["q_proj", "v_proj"], False),
    "all-r16": (16, 32, ALL_TARGETS, False),
    "all-r64-rslora": (64, 16, ALL_TARGETS, True),
}


def _base_and_adapters(tmp_path):
    base = tiny_hf_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256)
    base.save_pretrained(tmp_path / "base")
    adapters = {name: write_peft_adapter(base, str(tmp_path / name), r, alpha, targets, seed=i, use_rslora=rslora,
                                         weight_std=0.05)
                for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items())}
    return base, adapters


def _engine(tmp_path, adapters, **config):
    return LLMEngine(EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype="bfloat16", num_kv_blocks=64,
                                  max_loras=2, max_lora_rank=64, lora_modules=adapters, **config))


def _check_against_peft(base, adapters, requests, outputs, logits):
    references = {name: peft_reference(base, path) for name, path in adapters.items()}
    for rid, (ids, adapter) in requests.items():
        tokens = outputs[rid].outputs[0].token_ids
        fp32 = base if adapter is None else references[adapter]
        full = torch.tensor([ids + tokens])
        want = fp32(input_ids=full).logits[0].float()
        noisy = copy.deepcopy(fp32).to("cuda", torch.bfloat16)(input_ids=full.cuda()).logits[0].float().cpu()
        for num_tokens, row in logits[rid]:
            ours = (row.float().cpu() - want[num_tokens - 1]).abs().max().item()
            peft_bf16 = (noisy[num_tokens - 1] - want[num_tokens - 1]).abs().max().item()
            assert ours <= 2 * peft_bf16 + 0.05, (rid, num_tokens, ours, peft_bf16)


@torch.inference_mode()
@pytest.mark.parametrize("decode_kernels", ["auto", "bgmv", "grouped", "dense"])
def test_mixed_adapter_batch_on_cuda_bf16_matches_peft(tmp_path, decode_kernels):
    base, adapters = _base_and_adapters(tmp_path)
    engine = _engine(tmp_path, adapters, max_num_batched_tokens=48, lora_decode_kernels=decode_kernels)
    gen = torch.Generator().manual_seed(5)
    prompt = lambda n: torch.randint(0, 300, (n,), generator=gen).tolist()  # noqa: E731
    shared = prompt(41)
    requests = {"base": (shared, None), "qv": (shared, "qv-r8"), "all16": (prompt(23), "all-r16"),
                "all64": (shared, "all-r64-rslora"), "qv-short": (prompt(3), "qv-r8")}
    outputs, logits = _run(engine, requests, max_tokens=6)
    _check_against_peft(base, adapters, requests, outputs, logits)
    assert engine.runner.lora_graphs.num_replays > 0  # the steps that decode all five replay the adapters' graphs
    if decode_kernels != "auto":
        assert {form for _, _, form in engine.runner.lora_graphs.graphs} == {decode_kernels}
    assert not torch.allclose(logits["base"][0][1].float(), logits["all64"][0][1].float(), atol=0.1)
    assert engine.lora.pool.num_loads >= 3
    assert engine.kv.num_used_blocks == 0


@torch.inference_mode()
def test_batch1_adapter_decode_on_cuda_bf16_matches_peft(tmp_path):
    base, adapters = _base_and_adapters(tmp_path)
    engine = _engine(tmp_path, adapters, max_num_seqs=4)
    gen = torch.Generator().manual_seed(6)
    for adapter in ADAPTERS:
        requests = {adapter: (torch.randint(0, 300, (30,), generator=gen).tolist(), adapter)}
        replays = engine.runner.lora_graphs.num_replays
        outputs, logits = _run(engine, requests, max_tokens=8)
        _check_against_peft(base, {adapter: adapters[adapter]}, requests, outputs, logits)
        assert engine.runner.lora_graphs.num_replays - replays >= 7
