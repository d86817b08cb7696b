"""One engine core behind several API processes (engine/core_process.py spawn_core / AsyncEngine.attach): each front
gets its own requests' tokens, a front that dies has its requests aborted while the others run on, and the core
ends with its spawner."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core_process import spawn_core
from engine.errors import EngineDeadError


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, num_kv_blocks=48, max_num_seqs=12, engine_core="process", device="cpu")


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    process, control, fronts = spawn_core(_config(tiny_llama_dir), fronts=4)
    yield process, control, fronts
    control.close()
    process.wait(30)


async def _tokens(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    return [t async for out in engine.generate(prompt, params, request_id) for t in out.outputs[0].delta_token_ids]


def test_two_fronts_over_one_core_each_stream_their_own_requests_tokens(core, tiny_llama_dir):
    _, _, fronts = core
    a = AsyncEngine.attach(_config(tiny_llama_dir), Connection(fronts[0].detach()))
    b = AsyncEngine.attach(_config(tiny_llama_dir), Connection(fronts[1].detach()))
    prompts = [[1 + i % 5, 7, 9 + i, 3] for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 7, ignore_eos=True) for i in range(12)]
    reference = LLM(tiny_llama_dir, num_kv_blocks=64, device="cpu").generate(prompts, params)

    async def main() -> list[list[int]]:
        # the same request ids on both fronts would collide in the core: each front's ids are its own
        jobs = [_tokens(a if i % 2 else b, p, sp, f"{'a' if i % 2 else 'b'}{i}")
                for i, (p, sp) in enumerate(zip(prompts, params))]
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(main())
        assert results == [ref.outputs[0].token_ids for ref in reference]
        assert a.stats()["kv_blocks_used"] == 0 and b.stats()["generation_tokens"] >= sum(map(len, results))
    finally:
        a.shutdown()  # detaches: the core serves the other front on
        try:
            after = asyncio.run(_tokens(b, prompts[0], params[0], "after-detach"))
            assert after == reference[0].outputs[0].token_ids
        finally:
            b.shutdown()


def test_a_request_id_another_front_is_running_is_refused_and_the_running_one_finishes(core, tiny_llama_dir):
    _, _, fronts = core
    a = AsyncEngine.attach(_config(tiny_llama_dir), Connection(fronts[2].detach()))
    b = AsyncEngine.attach(_config(tiny_llama_dir), Connection(fronts[3].detach()))

    async def main() -> list[int]:
        long = a.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "same")
        first = await long.__anext__()
        # the other front cannot know the id is taken: the core refuses it
        with pytest.raises(ValueError, match="already running"):
            await _tokens(b, [9, 9], SamplingParams(max_tokens=2), "same")
        return first.outputs[0].delta_token_ids + [t async for out in long for t in out.outputs[0].delta_token_ids]

    try:
        assert len(asyncio.run(main())) == 20
        assert b.stats()["kv_blocks_used"] == 0
    finally:
        a.shutdown()
        b.shutdown()


FRONT = """
import asyncio, sys
from multiprocessing.connection import Connection
from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
engine = AsyncEngine.attach(EngineConfig(model=sys.argv[1], num_kv_blocks=48, max_num_seqs=12, engine_core="process",
                                         device="cpu"), Connection(int(sys.argv[2])))
async def main():
    async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), "doomed"):
        print("streaming", flush=True)
asyncio.run(main())
"""


def test_a_front_killed_mid_stream_frees_its_requests_blocks_and_the_core_serves_the_others(tiny_llama_dir):
    process, control, (theirs, ours) = spawn_core(_config(tiny_llama_dir), fronts=2)
    child = subprocess.Popen([sys.executable, "-c", FRONT, tiny_llama_dir, str(theirs.fileno())],
                             pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    theirs.close()
    front = AsyncEngine.attach(_config(tiny_llama_dir), Connection(ours.detach()))
    try:
        assert child.stdout.readline().strip() == "streaming"
        assert front.stats()["num_running"] == 1  # the other front's request, mid-stream
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        for _ in range(100):  # the core notices at its next look at its inbox
            stats = front.stats()
            if stats["num_running"] == 0:
                break
            time.sleep(0.05)
        assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
        tokens = asyncio.run(_tokens(front, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                     "survivor"))
        assert len(tokens) == 5
    finally:
        front.shutdown()
        child.kill()
        control.close()
        process.wait(30)


def test_the_core_ends_with_its_spawner_and_its_fronts_hear_it(tiny_llama_dir):
    process, control, (theirs,) = spawn_core(_config(tiny_llama_dir), fronts=1)
    front = AsyncEngine.attach(_config(tiny_llama_dir), Connection(theirs.detach()))
    try:
        control.close()  # the spawner went away (killed, say)
        assert process.wait(30) == 0
        with pytest.raises(EngineDeadError):
            asyncio.run(_tokens(front, [1, 2], SamplingParams(max_tokens=30), "orphan"))
    finally:
        front.shutdown(timeout=2)


def test_a_model_that_cannot_load_fails_each_attached_front_with_its_error(tmp_path):
    process, control, (theirs,) = spawn_core(_config(str(tmp_path / "missing")), fronts=1)
    try:
        with pytest.raises(ValueError):
            AsyncEngine.attach(_config(str(tmp_path / "missing")), Connection(theirs.detach()))
    finally:
        control.close()
        process.wait(30)
