"""Adapters added to a serving AsyncEngine while a base request streams; requests name them with lora_name. Both
engine cores: a thread of this process and a process of its own."""

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, SamplingParams
from tests.engine.conftest import tiny_hf_model
from tests.engine.lora_helpers import ALL_TARGETS, write_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [4, 8, 15, 16, 23, 42]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    base = tiny_hf_model("llama")
    root = tmp_path_factory.mktemp("lora-async")
    base.save_pretrained(root / "base")
    return str(root / "base"), write_peft_adapter(base, str(root / "a"), 8, 16, ALL_TARGETS, seed=3)


async def _tokens(engine: AsyncEngine, lora_name=None) -> list[int]:
    out = None
    async for out in engine.generate(PROMPT, GREEDY, lora_name=lora_name):
        pass
    return out.outputs[0].token_ids


@pytest.mark.parametrize("core", ["thread", "process"])
def test_adapter_added_at_run_time_serves_its_tokens(base_and_adapter, core):
    base_dir, adapter = base_and_adapter
    engine = AsyncEngine.from_config(EngineConfig(model=base_dir, num_kv_blocks=32, max_loras=1, engine_core=core))
    try:
        async def scenario():
            base_run = asyncio.create_task(_tokens(engine))
            await engine.add_lora("a", adapter)  # while the base request runs
            assert engine.list_loras() == ["a"]
            tokens = await _tokens(engine, "a")
            with pytest.raises(ValueError, match="lora_name: unknown adapter 'b'"):
                await _tokens(engine, "b")
            with pytest.raises(ValueError, match="lora_path"):
                await engine.add_lora("c", base_dir)
            assert await engine.remove_lora("a") and engine.list_loras() == []
            return await base_run, tokens

        base_tokens, tokens = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert tokens != base_tokens
    assert tokens == _llm_tokens(base_dir, adapter)


def _llm_tokens(base_dir, adapter):
    from engine.llm import LLM

    llm = LLM(base_dir, num_kv_blocks=32, max_loras=1, lora_modules={"a": adapter})
    return llm.generate([PROMPT], GREEDY, lora_name="a")[0].outputs[0].token_ids
