"""bench/wake.py's CPU mode: every timing is there, the woken engine's first token is checked inside the run."""

from __future__ import annotations

import json

from bench import wake


def test_the_wake_benchmark_reports_reads_wakes_and_a_fresh_start(tmp_path):
    path = tmp_path / "wake.json"
    result = wake.main(["--model", "random:llama-tiny", "--device", "cpu", "--repeats", "1",
                        "--dir", str(tmp_path / "ckpt"), "--json", str(path)])
    assert json.loads(path.read_text()) == result
    size = result["checkpoint_bytes"]
    for name in ("plain_read", "load_file", "engine_reader"):
        for cache in ("cold", "warm"):
            run = result["reads"][f"{name}_{cache}"]["runs"][0]
            # the plain read counts the header too; the loaders the tensors' bytes
            assert run["gb_per_s"] > 0 and (run["bytes"] == size if name == "plain_read" else
                                            0.99 * size < run["bytes"] < size)
    assert set(result["wakes"]) == {"level1", "level2_cold", "level2_warm"}
    assert all(r["runs"][0]["wake_seconds"] > 0 for r in result["wakes"].values())
    assert result["fresh_process"][0]["seconds"] > result["fresh_process"][0]["load_seconds"] > 0
    assert set(result["goals_met"]) == {"wake_level1", "wake_level2_cold", "wake_level2_warm", "fresh_process"}
