"""AsyncEngine: many concurrent streams, deltas that add up, cancellation that frees blocks."""

import asyncio

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture
def tiny_async(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_seqs=64)))
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id):
    tokens, finals = [], []
    async for out in engine.generate(prompt, params, request_id):
        tokens.extend(out.outputs[0].delta_token_ids)
        finals.append(out)
    return tokens, finals[-1]


def test_fifty_concurrent_streams_finish(tiny_async):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        jobs = [collect(tiny_async, [1 + i % 7, 2, 3 + i], params, f"s{i}") for i in range(50)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert len(results) == 50
    for tokens, final in results:
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert tokens == final.outputs[0].token_ids and len(tokens) == 16
    stats = tiny_async.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["busy_seconds"] > 0


def test_cancelled_stream_frees_its_blocks(tiny_async):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        seen = 0
        stream = tiny_async.generate(list(range(1, 100)), params, "doomed")
        async for _ in stream:
            seen += 1
            if seen == 3:
                assert tiny_async.stats()["kv_blocks_used"] > 0
                break
        await stream.aclose()
        for _ in range(200):
            if tiny_async.stats()["kv_blocks_used"] == 0 and tiny_async.stats()["num_running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_task_cancel_aborts(tiny_async):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        task = asyncio.create_task(collect(tiny_async, list(range(1, 50)), params, "cancel-me"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if tiny_async.stats()["kv_blocks_used"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_stream_deltas_add_up_to_text(smollm2):
    engine = AsyncEngine(smollm2.engine)
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello in Japanese and in French."}])

    async def main():
        text, last = "", None
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=24), "jp"):
            assert "\ufffd" not in out.outputs[0].delta_text
            text += out.outputs[0].delta_text
            last = out
        return text, last

    try:
        text, last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert last.finished and text == last.outputs[0].text
    # a character cut off by max_tokens is dropped, never sent as U+FFFD
    assert last.outputs[0].text == smollm2.tokenizer.decode(last.outputs[0].token_ids).rstrip("\ufffd")


def test_stream_interval_hands_tokens_over_in_groups_after_the_first(tiny_llama_dir):
    """stream_interval=4: the engine hands over the first token at once, then groups of 4, the rest at the end; the
    async stream (which may merge groups when its reader lags) carries the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    grouped = LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, stream_interval=4))
    grouped.add_request("g", [4, 5, 6], params)
    sizes = []
    while grouped.has_unfinished_requests():
        sizes += [len(delta[2][0][2]) for delta in grouped.step_deltas()]
    assert sizes == [1, 4, 4, 4, 1]

    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, stream_interval=4)))

    async def main():
        return [out async for out in engine.generate([4, 5, 6], params, "grouped")]

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 14
    reference = LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    reference.add_request("r", [4, 5, 6], params, stream=False)
    while reference.has_unfinished_requests():
        done = reference.step()
    assert outs[-1].outputs[0].token_ids == done[0].outputs[0].token_ids
