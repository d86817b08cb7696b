"""Serving adapters at run time: add and remove without a restart, what a bad adapter directory is told, host
memory bounded by max_cpu_loras (dropped adapters read from disk again), prefix-cache blocks kept per adapter."""

import json
import os

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.conftest import tiny_hf_model
from tests.engine.lora_helpers import ALL_TARGETS, write_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    base = tiny_hf_model("llama")
    root = tmp_path_factory.mktemp("lora-adapters")
    base.save_pretrained(root / "base")
    adapters = {f"a{i}": write_peft_adapter(base, str(root / f"a{i}"), 8, 16, ALL_TARGETS, seed=10 + i)
                for i in range(3)}
    return str(root / "base"), adapters, base, root


def _generate(engine, prompt, lora_name=None, rid="r"):
    engine.add_request(rid, prompt, GREEDY, lora_name=lora_name)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return out


def test_adapters_added_and_removed_while_serving(base_and_adapters):
    base_dir, adapters, _, _ = base_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=32, max_loras=1))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    base_tokens = _generate(engine, prompt).outputs[0].token_ids
    engine.add_lora("mine", adapters["a0"])
    assert engine.list_loras() == ["mine"]
    with_adapter = _generate(engine, prompt, "mine").outputs[0].token_ids
    assert with_adapter != base_tokens
    engine.add_lora("mine", adapters["a1"])  # replaced under the same name: the new weights serve
    replaced = _generate(engine, prompt, "mine").outputs[0].token_ids
    assert replaced != with_adapter
    assert engine.remove_lora("mine") and not engine.remove_lora("mine")
    with pytest.raises(ValueError, match="lora_name: unknown adapter 'mine'"):
        engine.add_request("x", prompt, lora_name="mine")
    assert _generate(engine, prompt).outputs[0].token_ids == base_tokens


def test_host_memory_keeps_max_cpu_loras_and_reloads_from_disk(base_and_adapters):
    base_dir, adapters, _, _ = base_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=32, max_loras=1, max_cpu_loras=1,
                                    lora_modules=adapters))
    prompt = [7, 7, 8, 9]
    first = {name: _generate(engine, prompt, name, rid=name).outputs[0].token_ids for name in adapters}
    assert sum(entry.host is not None for entry in engine.lora.registry.entries()) == 1
    again = {name: _generate(engine, prompt, name, rid=name).outputs[0].token_ids for name in adapters}
    assert again == first
    assert engine.lora.registry.num_disk_loads >= 3


def test_prefix_cache_blocks_are_shared_within_an_adapter_only(base_and_adapters):
    base_dir, adapters, _, _ = base_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=32, max_loras=2, lora_modules=adapters))
    prompt = list(range(40))
    first = _generate(engine, prompt, "a0", rid="1")
    again = _generate(engine, prompt, "a0", rid="2")
    other = _generate(engine, prompt, "a1", rid="3")
    base = _generate(engine, prompt, None, rid="4")
    assert again.metrics.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.metrics.num_cached_tokens == 0 and base.metrics.num_cached_tokens == 0


def _edit_config(path, **changes):
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("change,message", [
    (dict(use_dora=True), "use_dora: not supported"),
    (dict(bias="all"), "bias: adapters that train biases"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save: not supported"),
    (dict(lora_alpha="big"), "lora_alpha: must be a number"),
])
def test_adapters_the_engine_cannot_apply_exactly_are_refused(base_and_adapters, tmp_path, change, message):
    base_dir, _, base, _ = base_and_adapters
    path = write_peft_adapter(base, str(tmp_path / "bad"), 4, 8, ["q_proj"], seed=1)
    _edit_config(path, **change)
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=16, max_loras=1))
    with pytest.raises(ValueError, match=message):
        engine.add_lora("bad", path)
    assert engine.list_loras() == []


def test_rank_above_max_lora_rank_and_missing_files_are_refused(base_and_adapters, tmp_path):
    base_dir, adapters, base, _ = base_and_adapters
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=16, max_loras=1, max_lora_rank=4))
    with pytest.raises(ValueError, match="max_lora_rank: the adapter's rank 8"):
        engine.add_lora("big", adapters["a0"])
    with pytest.raises(ValueError, match="lora_path: .* has no adapter_config.json"):
        engine.add_lora("none", str(tmp_path))
    other = tiny_hf_model("llama", hidden_size=32, intermediate_size=64)
    path = write_peft_adapter(other, str(tmp_path / "other"), 4, 8, ["q_proj"], seed=2)
    with pytest.raises(ValueError, match=r"lora_path: layer 0 q_proj has A \(4, 32\)"):
        engine.add_lora("other-base", path)


def test_alpha_pattern_scales_its_modules(base_and_adapters, tmp_path):
    """peft's alpha_pattern: one module's alpha differs from lora_alpha; the engine's logits still equal peft's."""
    from tests.engine.lora_helpers import peft_reference

    base_dir, _, base, _ = base_and_adapters
    path = write_peft_adapter(base, str(tmp_path / "pattern"), 4, 8, ["q_proj", "down_proj"], seed=5,
                              alpha_pattern={"down_proj": 32})
    engine = LLMEngine(EngineConfig(model=base_dir, num_kv_blocks=16, max_loras=1, lora_modules={"p": path}))
    prompt = [11, 12, 13, 14, 15]
    tokens = _generate(engine, prompt, "p").outputs[0].token_ids
    with torch.no_grad():
        expected = peft_reference(base, path).generate(input_ids=torch.tensor([prompt]), max_new_tokens=6,
                                                       min_new_tokens=6, do_sample=False)[0, len(prompt):]
    assert tokens == expected.tolist()


def test_lora_config_fields_are_checked():
    for fields, message in [(dict(max_loras=-1), "max_loras: must be an integer >= 0"),
                            (dict(max_lora_rank=0), "max_lora_rank: must be an integer in"),
                            (dict(lora_modules={"a": "/x"}), "lora_modules: needs max_loras > 0"),
                            (dict(max_loras=2, tensor_parallel_size=2), "max_loras: LoRA adapters are served with"),
                            (dict(lora_decode_kernels="sgmv"), "lora_decode_kernels: must be one of")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="m", **fields)
