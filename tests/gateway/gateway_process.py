"""A gateway in a process of its own: `platform serve --local` run as a user runs it (serve_local, with the CLI
helpers that set it up), and, for tests that kill it with SIGKILL,
`python -m tests.gateway.gateway_process DATABASE_URL SPILL_DIR PORT`, which serves the bundled model on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from billing.db import make_engine
from gateway.app import create_app
from gateway.backends import LocalEngineBackend
from gateway.settings import Settings
from gateway.specs import load_spec
from tests.gateway.live import free_port
from tollgate import envs

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "smollm2-135m.yaml"
CLI = [sys.executable, "-m", "gateway.cli"]


def cli_env(db_url: str, home: Path) -> dict[str, str]:
    """A home of the test's own, with the test process's model cache: its converted tokenizers and checkpoints,
    the extracted embedder and its ONNX export are keyed by their sources, and a fresh one would make each process
    build them again (7 s for SmolLM2's tokenizer alone; test_serve_model_cache.py and test_tokenizer.py test that
    path)."""
    return {**os.environ, "TOLLGATE_DATABASE_URL": db_url, "TOLLGATE_HOME": str(home), **shared_model_cache()}


def shared_model_cache() -> dict[str, str]:
    return {"TOLLGATE_MODEL_CACHE_DIR": str(envs.model_cache_dir())}


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


@contextmanager
def serve_local(env: dict[str, str], models_dir: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """(the process, its port): `serve --local` of the specs in models_dir on a free loopback port, its stdout and
    stderr together in proc.stdout; killed on the way out if still running."""
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--local", "--port", str(port), "--models-dir", str(models_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.2)


def main(url: str, spill: str, port: int) -> None:
    spec = load_spec(SPEC_PATH)
    spec = spec.model_copy(update={"engine": {**spec.engine, "max_model_len": 1024, "max_num_seqs": 32}})
    settings = Settings(database_url=url, key_cache_ttl_s=0.0, semantic_cache=False, ledger_spill_dir=Path(spill),
                        admission_db_timeout_s=0.3)
    app = create_app(settings, make_engine(url, busy_timeout_s=0.3), {spec.name: LocalEngineBackend(spec)}, [spec],
                     own_backends=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
