"""The quantization benchmarks run end to end on CPU with random:llama-tiny (the H200 run is bench/gpu_suite.sh)."""

from __future__ import annotations

import json

from bench import quantization_quality, quantization_speed


def test_quantization_speed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    result = quantization_speed.main(["--model", "random:llama-tiny", "--device", "cpu", "--prompt-len", "6",
                                      "--output-len", "4", "--repeats", "1", "--max-model-len", "256"])
    assert json.loads((tmp_path / "quantization_speed.json").read_text()) == result
    assert set(result["decode"]) == {"bf16", "int8", "int4", "fp8"}
    assert all(row["decode_tok_s"] > 0 for row in result["decode"].values())
    weights = {mode: row["weight_bytes"] for mode, row in result["decode"].items()}
    assert weights["int4"] < weights["int8"] < weights["bf16"]
    assert result["kv_fp8_block_ratio"] == result["kv_int8_block_ratio"] == 4.0  # float32 on CPU -> 1 byte
    kv = result["kv_cache"]
    assert kv["fp8"]["max_concurrent_seqs"] == 4 * kv["auto"]["max_concurrent_seqs"] > 0


def test_quantization_quality(tmp_path) -> None:
    path = tmp_path / "q.json"
    plain_int4 = quantization_quality.reference.int4_linear
    result = quantization_quality.main(["--models", "random:llama-tiny", "--modes", "int8", "int4", "int4_a8",
                                        "kv_fp8", "--num-prompts", "2", "--max-tokens", "16", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    tiny = result["models"]["random:llama-tiny"]
    assert tiny["positions"] == 30 and set(tiny["modes"]) == {"int8", "int4", "int4_a8", "kv_fp8"}
    assert all(0.0 <= row["top1_agreement"] <= 1.0 and row["perplexity"] > 1.0 for row in tiny["modes"].values())
    assert tiny["modes"]["int4_a8"]["perplexity"] != tiny["modes"]["int4"]["perplexity"]  # the inputs were rounded
    assert quantization_quality.reference.int4_linear is plain_int4  # and the CPU path restored


def test_int4_batched_decode(tmp_path) -> None:
    from bench import int4_batched_decode

    path = tmp_path / "b.json"
    result = int4_batched_decode.main(["--model", "random:llama-tiny", "--device", "cpu", "--num-seqs", "3",
                                       "--prompt-len", "5", "--output-len", "3", "--repeats", "1", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert set(result["tok_s"]) == {"gemm", "dequantize"} and all(v > 0 for v in result["tok_s"].values())
    assert int4_batched_decode.int4_matmul.GEMM_MIN_N == int4_batched_decode.VARIANTS["gemm"]  # restored
