"""`--home X` means exactly what TOLLGATE_HOME=X means, before or after the subcommand: the state, the models and
the exports go under X, and the user's own ~/.tollgate is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import parser, state_flags_applied
from tollgate import envs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("where", ["before", "after"])
def test_platform_settings_shows_the_home_flag_and_leaves_the_user_home_alone(tmp_path, where):
    user_home, state = tmp_path / "user", tmp_path / "state"
    user_home.mkdir()
    argv = ["--home", str(state), "settings", "--json"] if where == "before" else \
        ["settings", "--json", "--home", str(state)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env.update(HOME=str(user_home), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "gateway.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["TOLLGATE_HOME"]["value"] == str(state) and rows["TOLLGATE_HOME"]["set"]
    assert not (user_home / ".tollgate").exists()


@pytest.mark.parametrize("argv", [["--home", "{h}", "serve", "--local", "--port", "8235"],
                                  ["serve", "--local", "--port", "8235", "--home", "{h}"]])
def test_models_and_exports_of_a_command_go_under_its_home_flag(monkeypatch, tmp_path, argv):
    from cache.embedder import default_model_root
    from cache.semantic_cache import default_cache_dir
    from gateway.serving.model_cache import cache_root

    monkeypatch.delenv("TOLLGATE_HOME", raising=False)
    monkeypatch.delenv("TOLLGATE_MODEL_CACHE_DIR", raising=False)
    args = parser().parse_args([a.format(h=tmp_path) for a in argv])
    with state_flags_applied(args):
        assert envs.home() == tmp_path and envs.model_cache_dir() == tmp_path / "models"
        assert default_model_root() == tmp_path / "models"  # the embedder and the `embedding-models` export
        assert cache_root() == tmp_path / "models" / "checkpoints"  # converted chat models
        assert default_cache_dir() == tmp_path / "cache"
    assert "TOLLGATE_HOME" not in os.environ  # the command's flag does not outlive it


def test_a_home_flag_after_the_subcommand_wins_over_one_before_it(tmp_path):
    args = parser().parse_args(["--home", str(tmp_path / "a"), "keys", "list", "--home", str(tmp_path / "b")])
    assert args.home == str(tmp_path / "b")
    args = parser().parse_args(["--home", str(tmp_path / "a"), "keys", "list"])
    assert args.home == str(tmp_path / "a") and args.database_url is None
