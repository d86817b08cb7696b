"""Each step's time is counted to the requests' accounts by their tokens in the step (GPU time per tenant)."""

import asyncio

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics


def test_a_steps_tokens_are_counted_per_account(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, max_num_seqs=8))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(1, 11)), params, account="tenant-a")
    engine.add_request("b", [1, 2, 3], params, account="tenant-b")
    engine.add_request("c", [4, 5], params)  # no account
    engine.step()
    assert engine.step_tokens_by_account == {"tenant-a": 10, "tenant-b": 3, None: 2}  # the prefill step
    engine.step()
    assert engine.step_tokens_by_account == {"tenant-a": 1, "tenant-b": 1, None: 1}  # a decode step
    while engine.has_unfinished_requests():
        engine.step()


def test_busy_time_is_split_by_token_share():
    m = EngineMetrics()
    m.add_busy(0.4, {"a": 30, "b": 10})
    m.add_busy(0.1, {"a": 1, "b": 1})
    m.add_busy(0.2, {})  # nothing counted: no account
    assert m.busy_seconds == pytest.approx(0.7)
    assert m.busy_seconds_by_account == pytest.approx({"a": 0.35, "b": 0.15, None: 0.2})


def test_async_engine_accounts_add_up_to_its_busy_time(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_seqs=16)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run(prompt, rid, account):
        async for _ in engine.generate(prompt, params, rid, account=account):
            pass

    async def main():
        await asyncio.gather(*(run([1 + i, 2, 3] * (1 + i % 3), f"r{i}", f"t{i % 2}") for i in range(8)))

    try:
        asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    by_account = stats["busy_seconds_by_account"]
    assert set(by_account) <= {"t0", "t1"} and by_account["t0"] > 0 and by_account["t1"] > 0
    assert sum(by_account.values()) == pytest.approx(stats["busy_seconds"], rel=1e-9)
