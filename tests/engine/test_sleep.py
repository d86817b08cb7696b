"""Sleep and wake of an idle engine (engine/sleep.py): the weights and the KV pool really leave the device, and the
woken engine answers exactly as before, from host memory (level 1) or from the checkpoint again (level 2)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sleep import EngineAsleepError
from engine.weight_offload import network_tensors

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7] * 5, [3, 4, 5], [11, 12] * 9]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _assert_released(llm: LLM) -> None:
    engine = llm.engine
    assert all(t.numel() == 0 for t in engine.runner.model.parameters())
    assert engine.runner.kv_caches == [] and engine.runner.graphs is None
    assert engine.kv.num_used_blocks == 0 and not engine.kv.pool.cached


@pytest.fixture(scope="module")
def tiny_dir_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, device="cpu", num_kv_blocks=48, max_num_seqs=8)


@pytest.mark.parametrize("level", [1, 2])
def test_a_woken_engine_answers_with_the_same_greedy_tokens(tiny_dir_llm, level):
    before = _greedy(tiny_dir_llm)
    _greedy(tiny_dir_llm)  # leaves prefix-cached blocks, which sleep must forget
    tiny_dir_llm.sleep(level)
    assert tiny_dir_llm.engine.sleep_level == level
    _assert_released(tiny_dir_llm)
    assert tiny_dir_llm.wake() > 0
    assert tiny_dir_llm.engine.sleep_level == 0
    assert _greedy(tiny_dir_llm) == before
    assert tiny_dir_llm.engine.kv.num_used_blocks == 0


def test_sleep_deepens_from_level_1_to_level_2_and_wakes_from_the_checkpoint(tiny_dir_llm):
    before = _greedy(tiny_dir_llm)
    tiny_dir_llm.sleep(1)
    assert tiny_dir_llm.engine.sleep_mode._host_buffer is not None
    tiny_dir_llm.sleep(2)
    assert tiny_dir_llm.engine.sleep_mode._host_buffer is None
    tiny_dir_llm.sleep(1)  # already deeper: stays at 2
    assert tiny_dir_llm.engine.sleep_level == 2
    _assert_released(tiny_dir_llm)
    assert _greedy(tiny_dir_llm) == before  # generate wakes it


def test_the_stats_say_what_memory_the_engine_holds_awake_and_at_each_level(tiny_dir_llm):
    """The node's memory record reads these (gateway/serving/node_memory.py): on CPU no host copy is kept awake."""
    engine = tiny_dir_llm.engine
    weights = sum(t.numel() * t.element_size() for t in network_tensors(engine.runner.model))
    awake = engine.stats()
    assert awake["weights_bytes"] >= weights and awake["host_copy_bytes"] == 0
    assert awake["kv_cache_bytes"] == engine.runner.num_blocks * engine.runner.bytes_per_block > 0
    tiny_dir_llm.sleep(1)
    assert engine.stats()["host_copy_bytes"] == awake["weights_bytes"]
    tiny_dir_llm.sleep(2)
    assert engine.stats()["host_copy_bytes"] == 0 and engine.stats()["weights_bytes"] == awake["weights_bytes"]
    tiny_dir_llm.wake()
    tiny_dir_llm.sleep(1)
    tiny_dir_llm.wake()
    assert engine.stats()["host_copy_bytes"] == 0  # the level-1 copy went with the wake
    assert "device_free_bytes" not in engine.stats()


def test_sleep_is_refused_while_a_request_is_unfinished_and_nothing_changes(tiny_dir_llm):
    engine = tiny_dir_llm.engine
    engine.add_request("running", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="1 request"):
        engine.sleep(1)
    assert engine.sleep_level == 0
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)


def test_a_request_added_while_asleep_waits_and_runs_after_wake(tiny_dir_llm):
    engine = tiny_dir_llm.engine
    expected = _greedy(tiny_dir_llm, PROMPTS[:1])
    engine.sleep(1)
    engine.add_request("waits", PROMPTS[0], GREEDY)
    with pytest.raises(EngineAsleepError, match="asleep"):
        engine.step()
    engine.wake()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].token_ids == expected[0]
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_engine_wakes_from_both_levels_with_the_same_tokens(tiny_llama_dir, quantization):
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=32, max_num_seqs=4, quantization=quantization)
    before = _greedy(llm)
    for level in (1, 2):
        llm.sleep(level)
        _assert_released(llm)
        llm.wake()
        assert _greedy(llm) == before


def test_smollm2_wakes_from_both_levels_with_the_same_tokens(smollm2):
    prompts = ["The capital of France is"]
    before = _greedy(smollm2, prompts)
    for level in (1, 2):
        smollm2.sleep(level)
        _assert_released(smollm2)
        smollm2.wake()
        assert _greedy(smollm2, prompts) == before


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_the_weights_and_the_kv_pool_and_decode_steps_capture_the_graphs_again(level):
    llm = LLM("random:llama-1b", device="cuda", max_model_len=1024, max_num_seqs=16, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    prompts = [torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 130)]
    before = _greedy(llm, prompts)
    captured = set(runner.graphs.graphs)
    assert captured  # by the decode steps
    free_awake, _ = torch.cuda.mem_get_info()
    weights = sum(t.numel() * t.element_size() for t in network_tensors(runner.model))
    kv_pool = runner.num_blocks * runner.bytes_per_block
    llm.sleep(level)
    free_asleep, _ = torch.cuda.mem_get_info()
    _assert_released(llm)
    # the device was given the weights and the KV pool back (and the graphs' pool), not only PyTorch's cache
    assert free_asleep - free_awake >= 0.99 * (weights + kv_pool)
    # what the node's memory record reads (gateway/serving/node_memory.py): asleep, next to nothing stays reserved
    stats = llm.engine.stats()
    assert stats["weights_bytes"] >= weights and stats["kv_cache_bytes"] == kv_pool
    assert stats["device_reserved_bytes"] < 0.05 * (weights + kv_pool)
    assert abs(stats["device_free_bytes"] - torch.cuda.mem_get_info()[0]) < 0.01 * stats["device_total_bytes"]
    assert stats["host_copy_bytes"] == (stats["weights_bytes"] if level == 1 else 0)
    assert llm.wake() > 0
    assert runner.graphs is not None and not runner.graphs.graphs  # the first token waits for no capture
    assert _greedy(llm, prompts) == before
    assert set(runner.graphs.graphs) == captured  # the same decode steps captured the same shapes again
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.gpu
def test_a_level_1_wake_takes_its_weights_from_the_host_copy_in_one_transfer():
    llm = LLM("random:llama-1b", device="cuda", max_model_len=1024, max_num_seqs=4, gpu_memory_utilization=0.3)
    before = _greedy(llm, PROMPTS)
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    llm.sleep(1)
    offload = llm.engine.sleep_mode._offload
    assert offload.nbytes >= weights and offload.has_host_copy and offload.host.is_pinned()
    llm.wake()
    flat = {t.untyped_storage().data_ptr() for t in llm.engine.runner.model.parameters()}
    assert len(flat) == 1  # every weight a view of the one device buffer the host copy went into
    assert _greedy(llm, PROMPTS) == before


@pytest.mark.gpu
def test_sleep_mode_pins_the_host_buffer_at_start_and_the_first_sleep_copies_into_it():
    llm = LLM("random:llama-1b", device="cuda", max_model_len=1024, max_num_seqs=4, gpu_memory_utilization=0.3,
              enable_sleep_mode=True)
    before = _greedy(llm, PROMPTS)
    sleep = llm.engine.sleep_mode
    sleep._pinning.join(120)
    pinned = sleep._host_buffer
    assert pinned is not None and pinned.is_pinned()
    llm.sleep(1)
    assert sleep._offload.host.data_ptr() == pinned.data_ptr()  # copied into the buffer pinned ahead
    llm.wake()
    assert _greedy(llm, PROMPTS) == before
    llm.sleep(1)
    assert sleep._offload.host.data_ptr() == pinned.data_ptr()  # and kept for the next sleep
    llm.wake()
    assert _greedy(llm, PROMPTS) == before


@pytest.mark.gpu
def test_two_engines_share_one_gpu_each_in_its_memory_share_and_take_turns_awake():
    shape = dict(device="cuda", max_model_len=1024, max_num_seqs=16, gpu_memory_utilization=0.3)
    first, second = LLM("random:llama-1b", **shape), LLM("random:llama-1b", **shape)
    # each sized its KV pool from its own share, not from what the other one holds
    assert second.engine.runner.num_blocks >= 0.8 * first.engine.runner.num_blocks
    prompt = [list(range(5, 40))]
    expected = [_greedy(first, prompt), _greedy(second, prompt)]
    for _ in range(2):
        first.sleep(1)
        assert _greedy(second, prompt) == expected[1]
        second.sleep(1)
        first.wake()
        assert _greedy(first, prompt) == expected[0]
    assert first.engine.kv.num_used_blocks == second.engine.kv.num_used_blocks == 0


def test_sleep_is_refused_with_lora_adapters_naming_why(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=16, max_num_seqs=2, max_loras=1)
    with pytest.raises(ValueError, match="sleep: not supported with LoRA"):
        llm.sleep(1)
    assert llm.engine.sleep_level == 0
