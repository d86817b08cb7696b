"""bench/lora_kernels.py's CPU mode (random:llama-tiny in Triton's interpreter): every configuration of a small grid
checked against the reference and timed, a wrong one and one that fails to launch reported and never picked."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the CPU mode runs the LoRA kernels in Triton's interpreter")


def test_the_lora_kernel_sweep_checks_times_and_reports_each_config(tmp_path, monkeypatch) -> None:
    pytest.importorskip("triton")
    from bench import lora_kernels
    from kernels import punica_expand, punica_shrink

    grouped_shrink, bgmv_expand_ = punica_shrink.grouped_shrink, punica_expand.bgmv_expand_

    def wrong_with_two_warps(*args, **kwargs):  # a configuration whose output is wrong
        shrunk = grouped_shrink(*args, **kwargs)
        if kwargs.get("num_warps") == 2:
            shrunk.partials.mul_(2)
        return shrunk

    def no_launch_with_two_warps(*args, **kwargs):  # and one that fails to launch
        if kwargs.get("num_warps") == 2:
            raise RuntimeError("out of resources")
        return bgmv_expand_(*args, **kwargs)

    monkeypatch.setattr(punica_shrink, "grouped_shrink", wrong_with_two_warps)
    monkeypatch.setattr(punica_expand, "bgmv_expand_", no_launch_with_two_warps)
    path = tmp_path / "sweep.json"
    result = lora_kernels.main(["--device", "cpu", "--batch", "4", "--num-adapters", "2", "--projections", "qkv",
                                "gate_up", "--split-k", "1", "2", "--block-k", "32", "--num-warps", "4", "2",
                                "--json", str(path)])
    assert json.loads(path.read_text()) == result
    rows = result["rows"]
    assert {(r["form"], r["kernel"]) for r in rows} == {
        ("grouped", "grouped_shrink"), ("grouped", "grouped_expand_"), ("grouped", "grouped_expand_silu_and_mul"),
        ("bgmv", "bgmv_shrink"), ("bgmv", "bgmv_expand_"), ("bgmv", "bgmv_expand_silu_and_mul")}
    assert all(r["fused_norm"] == (r["form"] == "bgmv") for r in rows)  # batch 1 fuses the norms, batches do not
    wrong = [r for r in rows if r["kernel"] == "grouped_shrink" and r["config"]["num_warps"] == 2]
    failed = [r for r in rows if r["kernel"] == "bgmv_expand_" and r["config"]["num_warps"] == 2]
    assert wrong and all(r["us"] is None and r["error"].startswith("wrong output") for r in wrong)
    assert failed and all(r["us"] is None and "out of resources" in r["error"] for r in failed)
    good = [r for r in rows if r["error"] is None]
    assert all(r["us"] > 0 and r["rel_err"] < 1e-3 for r in good)
    assert {r["num_splits"] for r in good if r["kernel"] == "bgmv_expand_"} == {1, 2}  # at each split of a shrink
    for form in ("grouped", "bgmv"):
        summary = result["forms"][form]
        for proj in ("qkv", "gate_up"):
            s = summary["projections"][proj]
            assert s["shrink_default"]["overrides"] == {} and s["expand_default"]["overrides"] == {}
            assert s["shrink_best"]["us"] <= s["shrink_default"]["us"]
            best = s["pair_best"]
            assert best["shrink"]["num_splits"] == best["expand"]["num_splits"]
            assert best["sum_us"] <= s["pair_default_sum_us"]
            assert best["shrink"]["overrides"].get("num_warps") != 2 or form == "bgmv"
            assert best["expand"]["overrides"].get("num_warps") != 2 or form == "grouped" or proj == "gate_up"
        step = summary["step"]
        assert step["best_sum_ms"] <= step["default_sum_ms"] and step["default_chained_ms"] > 0
