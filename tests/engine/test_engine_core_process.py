"""The engine core in a process of its own (engine/core_process.py): the same tokens as the engine in this process,
bad requests refused without harm, aborts that free blocks, and no core left behind when either side dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError, PromptTooLongError


@pytest.fixture(scope="module")
def process_engine(tiny_llama_dir):
    engine = AsyncEngine.from_config(EngineConfig(model=tiny_llama_dir, num_kv_blocks=30, max_num_seqs=12,
                                                  engine_core="process", device="cpu"))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, prompt, params, request_id):  # type: ignore[no-untyped-def]
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    deltas = [t for out in outs for t in out.outputs[0].delta_token_ids]
    return deltas, outs[-1]


def test_the_process_core_streams_the_tokens_the_engine_makes_in_process(process_engine, tiny_llama_dir):
    prompts = [[1 + i % 5, 7, 9 + i, 3] for i in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=12 + i % 5, ignore_eos=True) for i in range(24)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
    reference = LLM(tiny_llama_dir, num_kv_blocks=64, device="cpu").generate(prompts + [prompts[0]], params + [seeded])

    async def main():  # type: ignore[no-untyped-def]
        jobs = [_collect(process_engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        jobs.append(_collect(process_engine, prompts[0], seeded, "seeded"))
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for (deltas, final), ref in zip(results, reference):
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert deltas == final.outputs[0].token_ids == ref.outputs[0].token_ids
        assert final.prompt_token_ids == ref.prompt_token_ids
    seeded_final = results[-1][1].outputs[0]
    assert [lp.token_id for lp in seeded_final.logprobs] == seeded_final.token_ids
    assert [lp.logprob for lp in seeded_final.logprobs] == pytest.approx(
        [lp.logprob for lp in reference[-1].outputs[0].logprobs], abs=1e-5)
    stats = process_engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["generation_tokens"] >= sum(len(r[0]) for r in results)
    assert stats["busy_seconds"] > 0


def test_bad_requests_are_refused_by_the_front_or_the_core_and_the_core_serves_on(process_engine):
    async def run(prompt, params):  # type: ignore[no-untyped-def]
        return await _collect(process_engine, prompt, params, None)

    with pytest.raises(PromptTooLongError):  # the front knows the context length
        asyncio.run(run([1 + i % 250 for i in range(600)], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="prompt: token ids"):
        asyncio.run(run([10**9], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="KV blocks"):  # only the core knows its pool: refused there, raised here
        asyncio.run(run([1 + i % 250 for i in range(450)], SamplingParams(max_tokens=50)))
    deltas, final = asyncio.run(run([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert len(deltas) == 5 and final.finished
    assert process_engine.stats()["kv_blocks_used"] == 0


def test_a_consumer_that_leaves_aborts_its_request_in_the_core(process_engine):
    async def main() -> bool:
        stream = process_engine.generate(list(range(1, 60)), SamplingParams(max_tokens=400, ignore_eos=True), "gone")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(300):
            stats = process_engine.stats()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_a_model_that_cannot_load_raises_in_the_caller():
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.from_config(EngineConfig(model="/nonexistent/model", engine_core="process"))


def test_a_tokenizer_that_cannot_load_raises_in_the_caller_and_leaves_no_core(tiny_llama_dir, tmp_path,
                                                                               monkeypatch):
    import engine.core_process

    started = []

    def popen(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    real_popen = subprocess.Popen
    monkeypatch.setattr(engine.core_process.subprocess, "Popen", popen)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        AsyncEngine.from_config(EngineConfig(model=tiny_llama_dir, tokenizer=str(tmp_path), engine_core="process"))
    assert len(started) == 1 and started[0].poll() is not None


def test_a_killed_core_fails_every_stream_instead_of_hanging(tiny_llama_dir):
    engine = AsyncEngine.from_config(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, engine_core="process"))

    async def main() -> None:
        params = SamplingParams(max_tokens=450, ignore_eos=True)
        streams = [engine.generate([1, 2, 3 + i], params, f"k{i}") for i in range(3)]
        firsts = [await s.__anext__() for s in streams]
        assert all(not f.finished for f in firsts)
        os.kill(engine.core._process.pid, signal.SIGKILL)
        for s in streams:
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
        with pytest.raises(EngineDeadError):
            await engine.generate([1, 2], params).__anext__()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown()


PARENT = """
import sys, time
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
engine = AsyncEngine.from_config(EngineConfig(model=sys.argv[1], num_kv_blocks=16, engine_core="process"))
print(engine.core._process.pid, flush=True)
time.sleep(600)
"""


def test_a_core_whose_server_is_killed_exits(tiny_llama_dir):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tiny_llama_dir], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_structured_request_crosses_to_the_core_and_comes_back_valid(tmp_path):
    """The constraint travels with its request to the core process, which compiles and enforces it."""
    import json

    from tests.engine.helpers import write_tiny_model_with_smollm2_tokenizer

    model = write_tiny_model_with_smollm2_tokenizer(tmp_path)
    engine = AsyncEngine.from_config(EngineConfig(model=model, device="cpu", engine_core="process"))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=40, structured_outputs={"json": schema})

    async def main():  # type: ignore[no-untyped-def]
        return await _collect(engine, [1, 10, 200, 33], params, "constrained")

    try:
        _, final = asyncio.run(main())
        with pytest.raises(ValueError, match="structured_outputs"):
            asyncio.run(_collect(engine, [1, 2], SamplingParams(structured_outputs={"regex": "("}), "bad"))
    finally:
        engine.shutdown()
    value = json.loads(final.outputs[0].text)
    assert 3 <= value["n"] <= 9 and final.outputs[0].finish_reason == "stop"
