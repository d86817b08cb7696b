"""Engine-level generation features: n, seeds in any batch, stop conditions, logprobs, penalties, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import choice_seed

PROMPT = [5, 17, 42, 99, 120, 7, 33, 250, 61]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_tokens(tiny: LLM) -> list[int]:
    return tiny.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def first_new_token_index(tokens: list[int], start: int, avoid: frozenset[int] = frozenset()) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in avoid)


def test_n_completions_are_distinct_and_indexed(tiny: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    out = tiny.generate(PROMPT, params)[0]
    assert out.finished
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = tiny.generate(PROMPT, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_neighbouring_seeds_share_no_choice(tiny: LLM) -> None:
    """Choice 0 keeps the request's seed (n=1 answers do not change with n); the other choices' seeds are drawn
    from (seed, index), so seed 11's choices are not seed 12's shifted by one."""
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    first = [tuple(c.token_ids) for c in tiny.generate(PROMPT, params)[0].outputs]
    second = [tuple(c.token_ids) for c in tiny.generate(PROMPT, dataclasses.replace(params, seed=12))[0].outputs]
    assert not set(first) & set(second)
    alone = tiny.generate(PROMPT, dataclasses.replace(params, n=1))[0].outputs[0].token_ids
    assert tuple(alone) == first[0]
    seeds = {choice_seed(seed, i) for seed in range(-50, 50) for i in range(8)}
    assert len(seeds) == 800 and all(-(2**63) <= s < 2**64 for s in seeds)  # torch.Generator.manual_seed's range


def test_seeded_request_ignores_the_rest_of_the_batch(tiny: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tiny.generate(PROMPT, seeded)[0].outputs[0].token_ids
    rng = random.Random(0)
    for position in (0, 3, 5):
        others = [[rng.randrange(300) for _ in range(rng.randint(3, 70))] for _ in range(5)]
        other_params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 20), ignore_eos=True)
                        for _ in range(5)]
        prompts = others[:position] + [PROMPT] + others[position:]
        params = other_params[:position] + [seeded] + other_params[position:]
        outs = tiny.generate(prompts, params)
        assert outs[position].outputs[0].token_ids == alone, f"differs at batch position {position}"


def test_stop_token_ids_end_the_sequence(tiny: LLM, greedy_tokens: list[int]) -> None:
    k = first_new_token_index(greedy_tokens, 2, avoid=tiny.engine.eos_token_ids)
    stop = greedy_tokens[k]
    out = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                               stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == greedy_tokens[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop

    # min_tokens holds the stop id back: the sequence goes on past where it would have stopped
    out = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=k + 3,
                                               stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids[:k] == greedy_tokens[:k]
    assert stop not in out.token_ids[: k + 3]
    assert len(out.token_ids) >= k + 3
    assert out.finish_reason == "length" or (out.token_ids[-1] == stop and out.stop_reason == stop)


def test_max_tokens_gives_length(tiny: LLM, greedy_tokens: list[int]) -> None:
    out = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy_tokens[:5] and out.finish_reason == "length" and out.stop_reason is None


def test_max_model_len_gives_length(tiny_llama_dir: str) -> None:
    llm = LLM(tiny_llama_dir, max_model_len=48, num_kv_blocks=8)
    prompt = list(range(10, 50))
    for max_tokens in (None, 100):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 8
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.kv.num_used_blocks == 0


@pytest.fixture(scope="module")
def eos_model(tiny_llama_dir: str, greedy_tokens: list[int], tmp_path_factory) -> tuple[LLM, int]:
    """The tiny model with its EOS id set to a token that greedy decoding reaches; returns (LLM, k)."""
    k = first_new_token_index(greedy_tokens, 3)
    path = tmp_path_factory.mktemp("tiny-eos")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                data = json.load(f)
            data["eos_token_id"] = greedy_tokens[k]
            with open(file, "w") as f:
                json.dump(data, f)
    return LLM(str(path), num_kv_blocks=64), k


def test_eos_ends_unless_ignored(eos_model: tuple[LLM, int], greedy_tokens: list[int]) -> None:
    llm, k = eos_model
    eos = greedy_tokens[k]
    assert llm.engine.eos_token_ids == {eos}
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == greedy_tokens[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None

    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy_tokens and out.finish_reason == "length"

    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, min_tokens=k + 3))[0].outputs[0]
    assert out.token_ids[:k] == greedy_tokens[:k]
    assert eos not in out.token_ids[: k + 3]
    assert len(out.token_ids) >= k + 3
    assert llm.engine.kv.num_used_blocks == 0


def hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-softmax of HF's logits at the positions that predicted each output token."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output)]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_match_hf_log_softmax(tiny: LLM, hf_tiny) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    prompts = [PROMPT, PROMPT[:5], list(range(40, 75)), PROMPT]
    outs = tiny.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        completion = out.outputs[0]
        if p.logprobs is None:
            assert completion.logprobs is None
            continue
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        ref = hf_logprobs(hf_tiny, prompt, completion.token_ids)
        for pos, (token, lp) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
            assert len(lp.top) == p.logprobs
            ref_values, ref_ids = ref[pos].topk(p.logprobs) if p.logprobs else (ref[pos, :0], ref[pos, :0])
            assert [t for t, _ in lp.top] == ref_ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(ref_values.tolist(), abs=1e-4)
            if p.temperature == 0 and p.logprobs:
                assert lp.top[0][0] == token


def hf_greedy_with_penalties(hf_model, prompt: list[int], steps: int, frequency: float, presence: float) -> list[int]:
    """OpenAI's penalties over the output so far, applied to HF's logits, then argmax."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        logits = logits - counts * frequency - (counts > 0).float() * presence
        out.append(int(logits.argmax()))
    return out


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.mark.parametrize("frequency,presence", [(2.0, 0.0), (0.0, 2.0)])
def test_penalties_change_greedy_output_as_expected(tiny: LLM, hf_tiny, greedy_tokens: list[int],
                                                    frequency: float, presence: float) -> None:
    assert repeats(greedy_tokens) > 0  # the unpenalised run repeats itself
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence)
    # in a batch with an unpenalised request, which must not be affected
    outs = tiny.generate([PROMPT, PROMPT], [params, GREEDY])
    penalised = outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == greedy_tokens
    assert penalised == hf_greedy_with_penalties(hf_tiny, PROMPT, 24, frequency, presence)
    assert repeats(penalised) < repeats(greedy_tokens)


def test_stats_after_a_run(tiny_llama_dir: str) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [PROMPT, list(range(1, 40)), [3, 4]]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"m{i}", prompt, params)
    engine.step()
    mid = engine.stats()
    assert mid["kv_blocks_used"] > 0 and mid["kv_blocks_used"] + mid["kv_blocks_free"] == 32
    assert mid["num_running"] == 3 and mid["num_waiting"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "generation_tokens_per_s",
                "kv_blocks_used", "kv_blocks_free", "kv_blocks_total", "kv_cache_usage", "busy_seconds",
                "idle_seconds", "num_requests_finished", "prompt_tokens_computed", "prompt_tokens_cached"):
        assert key in stats, key
    assert stats["num_requests_finished"] == 3
    assert stats["generation_tokens"] == 24
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts))
    assert 0 < stats["ttft_p50_s"] <= stats["ttft_p99_s"] < 60
    assert 0 < stats["tpot_p50_s"] <= stats["tpot_p99_s"] < 60
    assert stats["generation_tokens_per_s"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"] == 32
    assert stats["kv_cache_usage"] == 0.0
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_async_engine_counts_busy_and_idle_seconds(tiny_llama_dir: str) -> None:
    started = time.monotonic()
    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=32)))

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        async for _ in engine.generate(PROMPT, params, "busy"):
            pass

    try:
        time.sleep(0.1)
        asyncio.run(main())
        time.sleep(0.3)  # idle now, with no request in sight
        stats = engine.stats()
    finally:
        engine.shutdown()
    elapsed = time.monotonic() - started
    assert stats["busy_seconds"] > 0
    assert stats["idle_seconds"] >= 0.35  # both idle spells, the current one included
    assert stats["busy_seconds"] + stats["idle_seconds"] <= elapsed + 0.05
    assert stats["num_requests_finished"] == 1 and stats["ttft_p50_s"] > 0


# ---- text: SmolLM2 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_greedy(smollm2: LLM):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    return prompt, out


def test_stop_token_is_in_token_ids_not_in_text(smollm2: LLM, smol_greedy) -> None:
    prompt, greedy = smol_greedy
    tokens = greedy.token_ids
    k = first_new_token_index(tokens, 3, avoid=smollm2.engine.eos_token_ids)
    decode = smollm2.tokenizer.decode
    assert decode(tokens[: k + 1]) != decode(tokens[:k])
    out = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  stop_token_ids=[tokens[k]]))[0].outputs[0]
    assert out.token_ids == tokens[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[k]
    assert out.text == decode(tokens[:k])


def pick_stop_string(tokenizer, tokens: list[int], text: str) -> tuple[str, int]:
    """A stop string made of two whole output tokens, first occurring where they are; returns it and its offset."""
    for i in range(2, len(tokens) - 2):
        start = len(tokenizer.decode(tokens[:i]))
        mid = len(tokenizer.decode(tokens[: i + 1]))
        stop = tokenizer.decode(tokens[: i + 2])[start:]
        if len(stop.strip()) >= 3 and start < mid < start + len(stop) and text.find(stop) == start:
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_is_never_streamed(smollm2: LLM, smol_greedy) -> None:
    prompt, greedy = smol_greedy
    stop, at = pick_stop_string(smollm2.tokenizer, greedy.token_ids, greedy.text)
    expected = greedy.text[:at]
    engine = AsyncEngine(smollm2.engine)

    async def main() -> tuple[list[str], object]:
        deltas, last = [], None
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
        async for out in engine.generate(prompt, params, "stop-stream"):
            deltas.append(out.outputs[0].delta_text)
            last = out
        return deltas, last

    try:
        deltas, last = asyncio.run(main())
    finally:
        engine.shutdown()
    final = last.outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == expected and "".join(deltas) == expected
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert expected.startswith(streamed), f"streamed past the stop string: {streamed!r}"
    assert smollm2.engine.kv.num_used_blocks == 0


def test_include_stop_str_in_output(smollm2: LLM, smol_greedy) -> None:
    prompt, greedy = smol_greedy
    stop, at = pick_stop_string(smollm2.tokenizer, greedy.token_ids, greedy.text)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    out = smollm2.generate(prompt, params)[0].outputs[0]
    assert out.text == greedy.text[: at + len(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
