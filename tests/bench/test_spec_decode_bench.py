"""The speculative-decoding benchmark's oracle mode runs end to end on CPU with random:llama-tiny (the H200 run
is bench/gpu_suite.sh; the n-gram mode is measured on SmolLM2, BENCHMARKS.md)."""

from __future__ import annotations

import json

import torch

from bench import spec_decode


def test_oracle_mode_writes_its_json_to_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        result = spec_decode.main(["--mode", "oracle", "--model", "random:llama-tiny", "--device", "cpu", "-k", "3",
                                   "--prompt-len", "16", "--output-len", "24", "--max-model-len", "256",
                                   "--max-num-seqs", "4", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "spec_decode.json").read_text()) == result
    assert result["outputs_identical"] and result["acceptance_rate"] == 1.0
    assert result["verify_overhead"] > 0 and result["oracle_speedup"] > 0
    assert result["verify_steps"] >= 5  # 23 decode tokens at up to 4 per verification


def test_ngram_prompts_ask_to_repeat_their_text() -> None:
    conversations = spec_decode.chat_prompts(10)
    assert len(conversations) == 10
    assert all(text in c[0]["content"] for c, (_, text) in zip(conversations, spec_decode.PROMPTS))
