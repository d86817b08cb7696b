"""Tensor parallelism on CPU: two gloo processes split a tiny model by heads, MLP columns and vocabulary
rows; their gathered logits equal one process's within float32 tolerance and greedy tokens are identical."""

from unittest import mock

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.conftest import tiny_hf_model
from tests.engine.test_hf_parity import run_and_capture_logits

CASES = {
    # 301: the vocabulary does not split evenly, so rank 1 holds a padding row
    "llama-untied-odd-vocab": ("llama", dict(tie_word_embeddings=False, vocab_size=301)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=16, tie_word_embeddings=False)),
}


def _engine(path: str, tp: int, **fields) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=path, device="cpu", tensor_parallel_size=tp, max_num_batched_tokens=24,
                                    num_kv_blocks=64, block_size=16, **fields))
    assert engine.overlap  # async steps: at TP > 1 rank 1 reads each pending input token from rank 0 or its own
    return engine


def _run(path: str, tp: int, prompts: dict[str, list[int]], **quantized):
    """Outputs and logits of greedy requests. The logits are gathered only when the ranks do not pick greedy
    tokens from their shards, so that is turned off here (test_greedy_tokens_picked_on_shards covers it)."""
    engine = _engine(path, tp, tp_greedy_on_shards=False, **quantized)
    try:
        outputs, captured = run_and_capture_logits(engine, prompts, max_tokens=12)
        assert engine.kv.num_used_blocks == 0
        return outputs, captured
    finally:
        engine.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_match_one(case, tmp_path):
    arch, overrides = CASES[case]
    tiny_hf_model(arch, **overrides).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = {"a": torch.randint(0, 300, (37,), generator=gen).tolist(),
               "b": torch.randint(0, 300, (5,), generator=gen).tolist()}
    single_out, single_logits = _run(str(tmp_path), 1, prompts)
    split_out, split_logits = _run(str(tmp_path), 2, prompts)
    for rid in prompts:
        assert split_out[rid].outputs[0].token_ids == single_out[rid].outputs[0].token_ids
        assert len(split_logits[rid]) == len(single_logits[rid]) == 12
        for (n1, one), (n2, two) in zip(single_logits[rid], split_logits[rid]):
            assert n1 == n2 and two.shape == one.shape
            torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def _generate(engine: LLMEngine, requests: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Runs requests that join at the given steps; returns each one's output tokens."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while requests or engine.has_unfinished_requests():
        while requests and requests[0][0] <= step:
            _, rid, prompt, params = requests.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    return tokens


def test_greedy_tokens_picked_on_shards(tmp_path):
    """Two ranks that pick greedy tokens from their vocabulary shards decode the tokens one process decodes. The
    steps change between picking on the shards and gathering logits: a request short of its min_tokens (its end
    tokens banned) and a sampled request that joins later make the batch gather; the steps after a picked one
    read its tokens on each rank, the others get them broadcast."""
    tiny_hf_model("llama", tie_word_embeddings=False, vocab_size=301).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(5)
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    requests = [(0, "a", torch.randint(0, 300, (21,), generator=gen).tolist(), greedy),
                (0, "b", torch.randint(0, 300, (4,), generator=gen).tolist(),
                 SamplingParams(temperature=0, max_tokens=10, min_tokens=4)),
                (7, "c", torch.randint(0, 300, (6,), generator=gen).tolist(),
                 SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True))]
    single = _engine(str(tmp_path), 1)
    try:
        expected = _generate(single, list(requests))
    finally:
        single.close()
    split = _engine(str(tmp_path), 2)
    picked = mock.patch.object(split.runner, "forward_greedy", wraps=split.runner.forward_greedy)
    try:
        with picked as forward_greedy:
            got = _generate(split, list(requests))
        assert split.kv.num_used_blocks == 0
    finally:
        split.close()
    assert got["a"] == expected["a"] and len(got["a"]) == 14
    assert got["b"] == expected["b"]
    assert len(got["c"]) == 3
    assert 4 <= forward_greedy.call_count < split.metrics.num_steps


@pytest.mark.parametrize("quantized", [{"quantization": "int8", "kv_cache_dtype": "fp8"}, {"quantization": "int4"}],
                         ids=["int8-fp8kv", "int4"])
def test_quantized_shards_match_one_process(quantized, tmp_path):
    """Each rank quantizes its own slice and row-parallel quantized layers still sum over the ranks.
    Column-parallel slices quantize exactly as the whole (per output channel); a row-parallel slice gets
    its own scales (per output channel, or smaller int4 groups), a different and finer quantization than
    one process's. So both are compared with the float model: two ranks are no further from it than one."""
    tiny_hf_model("llama", tie_word_embeddings=False, intermediate_size=256).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = {name: torch.randint(0, 300, (n,), generator=gen).tolist() for name, n in (("a", 29), ("b", 7), ("c", 41))}
    _, exact = _run(str(tmp_path), 1, prompts)
    _, single = _run(str(tmp_path), 1, prompts, **quantized)
    _, split = _run(str(tmp_path), 2, prompts, **quantized)

    def error(logits) -> float:  # mean |difference| at each prompt's last position: the same context in every run
        return sum((logits[rid][0][1] - exact[rid][0][1]).abs().mean().item() for rid in prompts) / len(prompts)

    print(f"mean |logit error| vs float: one process {error(single):.4f}, two ranks {error(split):.4f}")
    assert 0 < error(split) <= 1.5 * error(single)


def test_heads_that_do_not_split_are_refused(tmp_path):
    tiny_hf_model("llama", num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's KV heads"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=4, num_kv_blocks=8))


def test_workers_leave_when_the_engine_closes(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=2, num_kv_blocks=8))
    processes = list(engine.workers.processes)
    assert all(p.is_alive() for p in processes)
    engine.close()
    assert not any(p.is_alive() for p in processes)
    assert all(p.exitcode == 0 for p in processes)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_shards_match_one_process(method, tmp_path, monkeypatch):
    """Each rank loads its slice of an AWQ / GPTQ checkpoint: output channels of the column-parallel layers,
    whole K groups of the row-parallel ones. The int4 values dequantize exactly, so two ranks equal one."""
    from tests.engine import test_quantized_checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "GROUP", 64)  # o_proj's 128 inputs split into two shards of one group
    qdir, _, _ = checkpoints.write_checkpoints(tmp_path, method)
    gen = torch.Generator().manual_seed(4)
    prompts = {"a": torch.randint(0, 96, (33,), generator=gen).tolist(),
               "b": torch.randint(0, 96, (6,), generator=gen).tolist()}
    single_out, single_logits = _run(qdir, 1, prompts)
    split_out, split_logits = _run(qdir, 2, prompts)
    for rid in prompts:
        assert split_out[rid].outputs[0].token_ids == single_out[rid].outputs[0].token_ids
        for (n1, one), (n2, two) in zip(single_logits[rid], split_logits[rid]):
            assert n1 == n2
            torch.testing.assert_close(two, one, atol=1e-4, rtol=1e-4)


def test_int4_groups_that_straddle_shards_are_refused(tmp_path):
    from tests.engine.test_quantized_checkpoints import write_checkpoints

    qdir, _, _ = write_checkpoints(tmp_path, "awq")  # groups of 128: o_proj's half of 128 inputs is 64
    with pytest.raises(ValueError, match="quantization_config.group_size: 128 does not divide the 64 input"):
        LLMEngine(EngineConfig(model=qdir, device="cpu", tensor_parallel_size=2, num_kv_blocks=8))
