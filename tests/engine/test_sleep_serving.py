"""Sleep and wake through the serving front (AsyncEngine), with the engine core in a thread and in a process of its
own: requests that arrive while the engine sleeps wake it or wait for a wake, bounded by sleep_wait_timeout_s."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sleep import EngineAsleepError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [1, 5, 9, 33, 7, 2, 8]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def _tokens(engine: AsyncEngine, request_id: str) -> list[int]:
    final = None
    async for out in engine.generate(PROMPT, GREEDY, request_id):
        final = out
    return final.outputs[0].token_ids


@pytest.fixture(scope="module", params=["thread", "process"])
def waiting_engine(request, tiny_llama_dir):
    """Requests to it while asleep wait for an explicit wake, two seconds at most."""
    engine = AsyncEngine.from_config(EngineConfig(model=tiny_llama_dir, device="cpu", num_kv_blocks=24, max_num_seqs=4,
                                                  engine_core=request.param, wake_on_request=False,
                                                  sleep_wait_timeout_s=2.0))
    yield engine
    engine.shutdown()


def test_a_request_to_a_sleeping_engine_waits_for_the_wake_then_answers_as_before(waiting_engine):
    async def main():
        before = await _tokens(waiting_engine, "before")
        assert await waiting_engine.sleep(1) == 1
        assert waiting_engine.sleep_level == 1
        waiting = asyncio.create_task(_tokens(waiting_engine, "waits"))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        with pytest.raises(ValueError, match="unfinished"):  # a waiting request keeps it from sleeping deeper
            await waiting_engine.sleep(2)
        assert await waiting_engine.wake() > 0
        assert await waiting == before

    asyncio.run(main())
    stats = waiting_engine.stats()
    assert stats["sleep_level"] == 0 and stats["kv_blocks_used"] == 0 and stats["num_waiting"] == 0


def test_a_request_that_waits_past_the_bound_gets_a_clear_error_and_leaks_nothing(waiting_engine):
    async def main():
        before = await _tokens(waiting_engine, "before-2")
        await waiting_engine.sleep(2)
        with pytest.raises(EngineAsleepError, match="did not wake within sleep_wait_timeout_s=2"):
            await _tokens(waiting_engine, "too-late")
        stats = waiting_engine.stats()
        assert stats["sleep_level"] == 2 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
        assert stats["asleep_seconds"] > 0
        await waiting_engine.wake()
        assert await _tokens(waiting_engine, "after") == before

    asyncio.run(main())


def test_a_request_wakes_a_sleeping_engine_by_default(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu", num_kv_blocks=24, max_num_seqs=4)))
    try:
        async def main():
            before = await _tokens(engine, "a")
            await engine.sleep(1)
            assert await asyncio.gather(_tokens(engine, "b"), _tokens(engine, "c")) == [before, before]
            assert engine.sleep_level == 0
            assert engine.stats()["last_wake_seconds"] > 0
            assert await engine.wake() == 0.0  # already awake

        asyncio.run(main())
    finally:
        engine.shutdown()
