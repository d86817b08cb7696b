import json

from cache.eval import main

PAIRS = [
    {"a": "How can I improve my public speaking skills?", "b": "How do I get better at public speaking?", "duplicate": True},
    {"a": "What is the best way to learn Spanish quickly?", "b": "How can I learn Spanish fast?", "duplicate": True},
    {"a": "What is 15% of 200?", "b": "What is 15% of 300?", "duplicate": False},
    {"a": "What is the capital of France?", "b": "What is the capital of Germany?", "duplicate": False},
]


def test_eval_cli_prints_json(tmp_path, capsys, embedder):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    assert main(["--pairs", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"pairs", "max_false_hit_rate", "threshold", "hit_rate", "false_hit_rate", "false_hits",
                        "duplicates", "non_duplicates"}
    assert out["pairs"] == 4
    assert out["false_hit_rate"] == 0.0
    assert out["hit_rate"] >= 0.5


def test_a_rate_with_no_pairs_of_its_kind_is_null_not_zero(tmp_path, capsys, embedder):
    path = tmp_path / "different.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PAIRS if not p["duplicate"]) + "\n")
    assert main(["--pairs", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hit_rate"] is None and out["duplicates"] == 0 and out["false_hit_rate"] == 0.0
    assert main(["--pairs", str(path)]) == 0
    assert "hit rate        n/a" in capsys.readouterr().out


def test_eval_cli_rejects_bad_lines(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": "x"}\n')
    assert main(["--pairs", str(path)]) == 2
    assert "needs a, b and duplicate" in capsys.readouterr().err
