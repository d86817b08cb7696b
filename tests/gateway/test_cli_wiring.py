"""Every `platform` subcommand that lives in its own module is reachable from the one command."""

from __future__ import annotations

import json

from gateway.cli import main, parser


def test_subcommands_are_registered():
    p = parser()
    assert p.parse_args(["invoice", "--tenant", "acme", "--month", "2026-11"]).func
    assert p.parse_args(["report", "--format", "json"]).func
    assert p.parse_args(["admin", "create-key"]).func
    assert p.parse_args(["cache", "eval", "--pairs", "x.jsonl"]).func


def test_cache_eval_through_platform(monkeypatch, tmp_path, capsys):
    from tollgate import envs

    # --home moves the model cache too: share the extracted embedder with the test process's (no second copy)
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE_DIR", str(envs.model_cache_dir()))
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"a": "How do I reset my password?", "b": "How do I reset my password?", "duplicate": True},
        {"a": "What is the capital of France?", "b": "What is the capital of Peru?", "duplicate": False},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--home", str(tmp_path), "cache", "eval", "--pairs", str(pairs), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pairs"] == 2 and result["hit_rate"] == 1.0 and result["false_hit_rate"] == 0.0
