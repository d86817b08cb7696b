"""bench/serve.py on CPU with random:llama-tiny: the three targets on the same requests, the ledger reconciled with
what the HTTP clients received, and the arrival schedule (the GPU runs are bench/gpu_suite.sh)."""

from __future__ import annotations

import json

import pytest

from bench import serve
from bench.serve_report import RequestResult, latency_chart, percentile, summarize, tick_label
from bench.serve_workload import arrival_offsets, nano_requests, sharegpt_requests


def test_the_three_targets_serve_the_same_requests_and_the_ledger_reconciles(tmp_path) -> None:
    # the gateway as two API processes over one engine core: the ledger reconciles across both
    out, chart = tmp_path / "serve.json", tmp_path / "serve.svg"
    serve.main(["--model", "random:llama-tiny", "--device", "cpu", "--dataset", "random", "--num-prompts", "6",
                "--random-input", "24", "--random-output", "8", "--random-range-ratio", "0.5", "--request-rate",
                "inf,0.5x", "--warmup", "2", "--client-procs", "1", "--max-num-seqs", "8", "--max-model-len", "128",
                "--offline-repeats", "1", "--port", "18653", "--api-servers", "2", "--json", str(out),
                "--chart", str(chart)])
    report = json.loads(out.read_text())
    assert report["api_servers"] == 2
    asked = report["output_tokens_asked"]
    assert report["offline"]["output_tokens"] == asked
    runs = {(r["target"], r["rate"]): r for r in report["runs"]}
    assert {t for t, _ in runs} == {"async", "http"} and len(runs) == 4
    for run in runs.values():
        assert run["completed"] == 6 and run["failed"] == 0 and run["short"] == 0
        assert run["output_tokens"] == asked and run["ratio_to_offline"] > 0
        assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] >= run["e2e_ms"]["p50"]
    # every request the HTTP clients completed (warm-up included) left exactly one usage event with their tokens
    ledger = report["ledger"]
    assert {k: ledger[k] for k in ("events", "client_completed", "matched", "exact")} == {
        "events": 14, "client_completed": 14, "matched": 14, "exact": True}
    assert 0 < ledger["ttft_ms_engine"]["p50"] <= ledger["ttft_ms_engine"]["p99"]
    assert ledger["ttft_ms_outside_engine"]["p50"] > 0  # HTTP, admission and the client take some time
    [hand_off] = ledger["core_hand_off"]  # the engine core's time handing outputs to its spawner and 2 API processes
    assert "handed to its spawner and 2 API processes" in hand_off
    assert chart.read_text().startswith("<svg")


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate() -> None:
    offsets = arrival_offsets(4000, 20.0, seed=3)
    assert offsets == arrival_offsets(4000, 20.0, seed=3) and offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert 4000 / offsets[-1] == pytest.approx(20.0, rel=0.05)
    assert arrival_offsets(5, float("inf"), seed=3) == [0.0] * 5
    assert sum(r.output_len for r in nano_requests(256, 0)) == 133_966  # nano-vllm's workload


def test_figures_follow_vllm_bench_serve() -> None:
    results = [RequestResult(True, output_tokens=11, expected_tokens=11, ttft=0.1, e2e=1.1, itls=[0.1] * 10),
               RequestResult(True, output_tokens=5, expected_tokens=5, ttft=0.3, e2e=0.7, itls=[0.1] * 4),
               RequestResult(False, error="HTTP 429")]
    s = summarize(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=None)
    assert s["completed"] == 2 and s["failed"] == 1 and s["output_tok_s"] == 8.0
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0) and s["goodput_req_s"] == 0.5
    assert percentile([1, 2, 3, 4], 50) in (2, 3) and percentile([], 99) is None


def test_profile_summary_splits_the_gateway_from_its_engine_core(tmp_path):
    """py-spy's raw stacks (root frames name each process) come out per process, with inclusive and self counts."""
    from bench.serve_profile import summarize_stacks

    gateway = 'process 10:"python -m gateway.cli serve --local"'
    core = 'process 11:"python -m engine.core_process 5"'
    raw = tmp_path / "stacks.txt"
    raw.write_text(f"{gateway};run (uvicorn);reserve (billing) 3\n"
                   f"{gateway};run (uvicorn);send (sse) 2\n"
                   f"{gateway};{core};step (engine) 7\n")
    summary = summarize_stacks(raw)
    assert summary["gateway.cli"]["samples"] == 5 and summary["engine.core_process"]["samples"] == 7
    assert dict(summary["gateway.cli"]["inclusive"])["run (uvicorn)"] == 5
    assert dict(summary["gateway.cli"]["self"]) == {"reserve (billing)": 3, "send (sse)": 2}


def test_sharegpt_rows_are_read_whole_even_with_line_separators_in_a_prompt(tmp_path) -> None:
    """Rows end at newlines only: a prompt holding U+2028 (which str.splitlines would split at) stays one row; a missing
    file names the flags that point to it."""
    from engine.tokenizer import Tokenizer
    from tests.engine.helpers import write_byte_level_tokenizer

    tokenizer = Tokenizer.from_source(write_byte_level_tokenizer(tmp_path))
    prompts = ["first line\u2028second line of one prompt", "another prompt, plain", "a third\u2029one"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    requests = sharegpt_requests(path, 3, tokenizer, (4, 8), 200, seed=0)
    assert sorted(r.text for r in requests) == sorted(prompts)
    with pytest.raises(SystemExit, match="--dataset-path or set TOLLGATE_DATA_DIR"):
        sharegpt_requests(tmp_path / "absent.jsonl", 3, tokenizer, (4, 8), 200, seed=0)


def test_the_context_defaults_to_the_models_own_limit_where_it_is_below_4096() -> None:
    assert serve.parse_args(["--model", "random:llama-tiny"]).max_model_len == 2048
    assert serve.parse_args(["--model", "random:llama-1b"]).max_model_len == 4096
    assert serve.parse_args(["--model", "random:llama-tiny", "--max-model-len", "256"]).max_model_len == 256


def test_the_report_prints_goodput_under_an_slo_and_the_chart_labels_its_scale(capsys) -> None:
    results = [RequestResult(True, output_tokens=11, expected_tokens=11, ttft=0.1, e2e=1.1, itls=[0.1] * 10)]
    run = {"target": "http", "rate": "inf", **summarize(results, 1.0, slo_ttft_ms=200, slo_tpot_ms=None)}
    serve.print_table({"runs": [run], "slo": {"ttft_ms": 200, "tpot_ms": None}})
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "TTFT <= 200 ms" in out
    assert tick_label(1.45) == "1.45" and tick_label(2.9) == "2.9" and tick_label(1234.5) == "1234"
    chart = latency_chart([run])
    assert ">0<" in chart
