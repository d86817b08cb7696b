"""A batch mixing several LoRA adapters and the base model gives, for every request, the logits and greedy tokens of
peft's PeftModel over that request's adapter (tiny random Llama and Qwen2, float32 on CPU)."""

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.conftest import tiny_hf_model
from tests.engine.lora_helpers import ALL_TARGETS, peft_reference, write_peft_adapter
from tests.engine.test_hf_parity import run_and_capture_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (rank, alpha, targets, use_rslora): several ranks and target sets; the 3 adapters share 2 device slots
ADAPTERS = {
    "qv-r8": (8, 16, ["q_proj", "v_proj"], False),
    "all-r4-rslora": (4, 8, ALL_TARGETS, True),
    "mlp-o-r16": (16, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_adapters(request, tmp_path_factory):
    arch = request.param
    base = tiny_hf_model(arch, tie_word_embeddings=arch == "qwen2")
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    base.save_pretrained(root / "base")
    adapters = {
        name: write_peft_adapter(base, str(root / name), r, alpha, targets, seed=i, use_rslora=rslora)
        for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items())
    }
    return base, str(root / "base"), adapters


def test_mixed_adapter_batch_logits_equal_peft_per_request(model_and_adapters):
    base, base_dir, adapters = model_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, max_num_batched_tokens=24, num_kv_blocks=64, max_loras=2,
                                    max_lora_rank=16, lora_modules=adapters))
    gen = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(0, 300, (n,), generator=gen).tolist()  # noqa: E731
    shared = prompt(33)  # one prompt under the base model and two adapters: no prefix-cache block is shared
    requests = {  # request id -> (prompt, adapter)
        "base": (shared, None),
        "qv": (shared, "qv-r8"),
        "all": (shared, "all-r4-rslora"),
        "mlp": (prompt(19), "mlp-o-r16"),
        "qv-short": (prompt(2), "qv-r8"),
    }
    captured = _run(engine, requests, max_tokens=8)
    outputs, logits = captured
    references = {name: peft_reference(base, path) for name, path in adapters.items()}
    for rid, (ids, adapter) in requests.items():
        tokens = outputs[rid].outputs[0].token_ids
        model = base if adapter is None else references[adapter]
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids + tokens])).logits[0].float()
        assert len(logits[rid]) == 8
        for num_tokens, row in logits[rid]:
            torch.testing.assert_close(row, ref[num_tokens - 1], atol=5e-5, rtol=1e-4)
    # the adapters change the model: the same prompt's logits differ between base and adapters
    assert not torch.allclose(logits["base"][0][1], logits["qv"][0][1], atol=1e-3)
    assert engine.lora.pool.num_loads >= 3  # three adapters went through two slots
    assert engine.kv.num_used_blocks == 0


def _run(engine, requests, max_tokens):
    add = engine.add_request

    def add_with_adapter(rid, ids, params, *args, **kwargs):
        return add(rid, ids, params, *args, lora_name=requests[rid][1], **kwargs)

    engine.add_request = add_with_adapter
    try:
        return run_and_capture_logits(engine, {rid: ids for rid, (ids, _) in requests.items()}, max_tokens)
    finally:
        engine.add_request = add


def test_greedy_tokens_equal_peft_generate(model_and_adapters):
    base, base_dir, adapters = model_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=64, max_loras=3, lora_modules=adapters))
    prompt = [5, 17, 42, 7, 99, 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for name in [None, *adapters]:
        engine.add_request(name or "base", prompt, params, lora_name=name)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    for name, path in adapters.items():
        with torch.no_grad():
            expected = peft_reference(base, path).generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert outputs[name].outputs[0].token_ids == expected.tolist()
    assert outputs["base"].outputs[0].token_ids != outputs["all-r4-rslora"].outputs[0].token_ids


def test_unknown_adapter_is_a_value_error_naming_it(model_and_adapters):
    _, base_dir, adapters = model_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=16, max_loras=1, lora_modules=adapters))
    with pytest.raises(ValueError, match="lora_name: unknown adapter 'nope'"):
        engine.add_request("x", [1, 2, 3], lora_name="nope")
    assert not engine.has_unfinished_requests()
    plain = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=16))
    with pytest.raises(ValueError, match="lora_name: unknown adapter 'qv-r8'"):
        plain.add_request("x", [1, 2, 3], lora_name="qv-r8")
