"""Every TOLLGATE_* variable is declared once, in tollgate/envs.py, and read nowhere else."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.settings import Settings, env_name
from tollgate import envs

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("tollgate", "engine", "kernels", "cache", "billing", "gateway", "bench", "tests", "migrations")
REGISTRY = ROOT / "tollgate" / "envs.py"


def _reads_of_environment(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) for each read of a TOLLGATE_* variable: os.environ[...], .get(...), .setdefault(...),
    os.getenv(...). Writes (monkeypatch.setenv, os.environ[...] = ..., patch.dict) are not reads."""
    found = []

    def environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" or \
            isinstance(node, ast.Name) and node.id == "environ"

    constants = {t.id: n.value.value for n in getattr(tree, "body", []) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}

    def tollgate_name(node: ast.AST | None) -> str | None:
        value = constants.get(node.id) if isinstance(node, ast.Name) else getattr(node, "value", None)
        return value if isinstance(value, str) and value.startswith("TOLLGATE_") else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and environ(node.value) and isinstance(node.ctx, ast.Load):
            if (name := tollgate_name(node.slice)) is not None:
                found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            reader = (isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault", "pop") and environ(f.value)) or \
                (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv")
            if reader and (name := tollgate_name(node.args[0])) is not None:
                found.append((node.lineno, name))
    return found


def test_no_module_but_the_registry_reads_a_tollgate_variable():
    offenders = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == REGISTRY:
                continue
            for line, name in _reads_of_environment(ast.parse(path.read_text(), str(path))):
                offenders.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not offenders, "read these through tollgate.envs:\n" + "\n".join(offenders)


def test_the_scan_finds_each_way_of_reading():
    src = ("import os\nfrom os import environ, getenv\n"
           "a = os.environ['TOLLGATE_A']\nb = os.environ.get('TOLLGATE_B')\nc = os.getenv('TOLLGATE_C')\n"
           "d = environ.setdefault('TOLLGATE_D', '1')\ne = getenv('TOLLGATE_E')\n"
           "os.environ['TOLLGATE_W'] = '1'\nos.environ.get('HOME')\nVAR = 'TOLLGATE_F'\nf = os.environ.get(VAR)\n")
    assert [n for _, n in _reads_of_environment(ast.parse(src))] == [f"TOLLGATE_{c}" for c in "ABCDEF"]


def test_every_setting_is_a_declared_variable_with_a_default_of_its_type():
    for field in Settings.model_fields:
        if field == "ledger_max_batch":
            continue
        var = envs.variable(env_name(field))  # KeyError names an undeclared one
        assert var.help and var.group
    defaults = Settings()  # the registry's defaults pass the settings' own checks
    assert defaults.port == envs.variable("TOLLGATE_PORT").default


def test_values_are_parsed_and_a_bad_one_names_its_variable(monkeypatch):
    monkeypatch.setenv("TOLLGATE_PORT", "8100")
    monkeypatch.setenv("TOLLGATE_SEMANTIC_CACHE", "off")
    monkeypatch.setenv("TOLLGATE_DRAIN_S", "2.5")
    s = Settings.load()
    assert (s.port, s.semantic_cache, s.drain_s) == (8100, False, 2.5)
    assert Settings.load(port=9000).port == 9000  # a flag wins over the environment
    monkeypatch.setenv("TOLLGATE_PORT", "eighty")
    with pytest.raises(ValueError, match="TOLLGATE_PORT"):
        Settings.load()
    monkeypatch.setenv("TOLLGATE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="TOLLGATE_KERNELS: one of"):
        envs.get("TOLLGATE_KERNELS")


def test_one_state_directory_holds_what_is_not_set_elsewhere(monkeypatch, tmp_path):
    from cache.embedder import default_model_root
    from cache.semantic_cache import default_cache_dir
    from gateway.serving.model_cache import cache_root

    monkeypatch.setenv("TOLLGATE_HOME", str(tmp_path))
    monkeypatch.delenv("TOLLGATE_MODEL_CACHE_DIR", raising=False)
    assert Settings.load().db_url == f"sqlite:///{tmp_path / 'tollgate.db'}"
    assert default_cache_dir() == tmp_path / "cache"
    assert default_model_root() == tmp_path / "models" and cache_root() == tmp_path / "models" / "checkpoints"
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_root() == tmp_path / "elsewhere" / "checkpoints"


def test_platform_settings_lists_every_variable_with_its_value(monkeypatch, capsys):
    monkeypatch.setenv("TOLLGATE_PORT", "8123")
    monkeypatch.setenv("TOLLGATE_ADMIN_KEY", "tg-secret-admin")
    assert main(["settings", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(envs.VARIABLES)
    assert rows["TOLLGATE_PORT"]["value"] == 8123 and rows["TOLLGATE_PORT"]["set"]
    assert rows["TOLLGATE_ADMIN_KEY"]["value"] == "(set)"  # secrets are not printed
    monkeypatch.delenv("TOLLGATE_DATABASE_URL", raising=False)
    assert main(["settings"]) == 0
    text = capsys.readouterr().out
    assert "TOLLGATE_DRAIN_S" in text and "tg-secret-admin" not in text
    unset = next(line for line in text.splitlines() if line.startswith("TOLLGATE_DATABASE_URL "))
    assert unset.split()[2:5] == ["(none)", "(none)", "no"]  # an unset variable reads as unset, not as ""
