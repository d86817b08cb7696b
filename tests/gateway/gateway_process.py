"""A gateway in a process of its own, for tests that kill it with SIGKILL:
`python -m tests.gateway.gateway_process DATABASE_URL SPILL_DIR PORT` serves the bundled model on loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from billing.db import make_engine
from gateway.app import create_app
from gateway.backends import LocalEngineBackend
from gateway.settings import Settings
from gateway.specs import load_spec

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "smollm2-135m.yaml"


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
