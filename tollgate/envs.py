"""Every environment variable Tollgate reads, declared once: its type, default and one line of help.

Nothing else in the project reads a `TOLLGATE_*` variable (tests/gateway/test_settings_registry.py fails if
one does). Values are read when asked for, so a test that sets a variable sees it at once. This
module imports only the standard library: the engine, the kernels, the cache and billing all use it.

`platform settings` prints the table with the values in effect."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"one of {sorted(_TRUE | _FALSE)} expected")


def _path(text: str) -> Path:
    return Path(text).expanduser()


@dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], Any]  # str -> the value; raises ValueError on a bad one
    default: Any  # None: unset (the reader decides, and the help says what then happens)
    help: str
    group: str
    secret: bool = False
    choices: tuple[str, ...] | None = None

    @property
    def type_name(self) -> str:
        if self.choices:
            return "|".join(self.choices)
        return {_bool: "bool", _path: "path", int: "int", float: "float", str: "str"}.get(self.parse, "str")


_REPO_ROOT = Path(__file__).resolve().parent.parent

_DECLARED = [
    # ---- where state lives ----------------------------------------------------------------------
    Variable("TOLLGATE_HOME", _path, Path("~/.tollgate").expanduser(),
             "state directory: the SQLite database, converted models, the embedder export, the cache index", "state"),
    Variable("TOLLGATE_DATABASE_URL", str, None,
             "SQLAlchemy URL of the ledger database (unset: SQLite file TOLLGATE_HOME/tollgate.db)", "state",
             secret=True),
    Variable("TOLLGATE_MODEL_CACHE_DIR", _path, None,
             "converted checkpoints and tokenizers for fast cold starts (unset: TOLLGATE_HOME/models)", "state"),
    Variable("TOLLGATE_MODELS_DIR", _path, _REPO_ROOT / "platform" / "models",
             "directory of model specs that `platform serve` deploys", "state"),
    Variable("TOLLGATE_MODEL_ROOTS", str, "/models",
             f"directories ({os.pathsep}-separated) that a spec's model paths may lie under, besides the spec's "
             "own directory and the Hugging Face cache", "state"),
    Variable("TOLLGATE_LEDGER_SPILL_DIR", _path, None,
             "the admission journal, and where usage events wait as JSONL while the database is unreachable "
             "(unset: TOLLGATE_HOME/ledger-spill)",
             "state"),
    # ---- the gateway ----------------------------------------------------------------------------
    Variable("TOLLGATE_HOST", str, "127.0.0.1", "address the gateway listens on", "gateway"),
    Variable("TOLLGATE_PORT", int, 8000, "port the gateway listens on", "gateway"),
    Variable("TOLLGATE_ADMIN_KEY", str, None,
             "an admin key that needs no database row (for /admin, the admin API and Prometheus)", "gateway",
             secret=True),
    Variable("TOLLGATE_LOG_LEVEL", str, "info", "log level of the gateway and uvicorn", "gateway",
             choices=("debug", "info", "warning", "error")),
    Variable("TOLLGATE_MAX_BODY_BYTES", int, 4 * 1024 * 1024, "largest request body accepted (413 above)", "gateway"),
    Variable("TOLLGATE_KEY_CACHE_TTL_S", float, 1.0,
             "seconds a process keeps a key it checked: how long a revoked key may still pass there", "gateway"),
    Variable("TOLLGATE_AUTH_FAIL_LIMIT", int, 20,
             "failed authentications one client address may make per window before it gets 429", "gateway"),
    Variable("TOLLGATE_AUTH_FAIL_WINDOW_S", float, 60.0, "the window of TOLLGATE_AUTH_FAIL_LIMIT", "gateway"),
    Variable("TOLLGATE_ADMISSION_DB_TIMEOUT_S", float, 2.0,
             "how long key lookups and limit checks wait for an unreachable database", "gateway"),
    Variable("TOLLGATE_BUDGET_LEASES", _bool, True,
             "admit a key's requests from memory, out of a slice of its budgets and rpm / tpm reserved in SQL, while it "
             "is far from every limit (billing/budget_leases.py); off: one SQL reservation per request", "gateway"),
    Variable("TOLLGATE_LEDGER_MAX_BUFFER", int, 10_000,
             "usage events held in memory while the database is unreachable, before they spill to disk", "gateway"),
    Variable("TOLLGATE_BUDGET_ALERT_WEBHOOK", str, None,
             "URL that gets a JSON POST when a tenant, key, end-user or tag budget reaches its soft limit (--alert-at); "
             "unset: logged only",
             "gateway"),
    Variable("TOLLGATE_API_SERVERS", int, 1,
             "`serve --local`: gateway processes on the port in front of one engine core per model (vLLM's "
             "--api-server-count); more than one needs the semantic cache off", "gateway"),
    Variable("TOLLGATE_DRAIN_S", float, 30.0,
             "on SIGTERM or Ctrl-C: how long in-flight requests may run on before the gateway exits", "gateway"),
    # ---- the semantic cache ---------------------------------------------------------------------
    Variable("TOLLGATE_SEMANTIC_CACHE", _bool, True, "answer repeated questions from the semantic cache", "cache"),
    Variable("TOLLGATE_CACHE_TTL_S", float, 7 * 24 * 3600.0, "seconds a cached answer may be served", "cache"),
    Variable("TOLLGATE_CACHE_MAX_ENTRIES", int, 200_000, "cached answers kept (least recently hit go first)", "cache"),
    Variable("TOLLGATE_CACHE_EXPLORE", float, 0.05,
             "share of would-be semantic-cache hits the model answers anyway, to teach the tenant's threshold", "cache"),
    Variable("TOLLGATE_EMBEDDER_BACKEND", str, None,
             "runtime of the prompt embedder (unset: onnx on a CPU, torch on a GPU)", "cache", choices=("onnx", "torch")),
    Variable("TOLLGATE_EMBEDDER_THREADS", int, None,
             "most ONNX Runtime threads one prompt's embedding may use (unset: 2 where the host has 2 cores)", "cache"),
    # ---- the Ray Serve platform -----------------------------------------------------------------
    Variable("RAY_ADDRESS", str, None, "the Ray cluster to join (unset: the local one, started if none runs)",
             "platform"),
    Variable("TOLLGATE_COLD_START_TIMEOUT_S", float, 120.0,
             "how long a request waits for a replica of a model at zero replicas before a 503", "platform"),
    Variable("TOLLGATE_RETRY_AFTER_S", int, 10, "the Retry-After of a 503 from a model that is starting", "platform"),
    Variable("TOLLGATE_INTERVAL_FLUSH_S", float, 60.0, "how often replicas write their alive/busy interval rows",
             "platform"),
    Variable("TOLLGATE_REGISTRY_REFRESH_S", float, 1.0,
             "how often gateways look for deployed or deleted models (and the processes of `serve --local "
             "--api-servers N` for adapters another one added or removed)", "platform"),
    Variable("TOLLGATE_NODE_MEMORY_BUDGET_GIB", float, None,
             "on a node without a GPU, the memory the model replicas on it may hold together (awake: weights and KV "
             "pool; asleep at level 1: the weights' host copy); a wake past it first pushes the least recently used "
             "level-1 sleeper down to level 2, and gets a 503 when none is left (unset: no bound; a GPU's bound is "
             "its free memory)", "platform"),
    # ---- the engine and kernels -----------------------------------------------------------------
    Variable("TOLLGATE_KERNELS", str, "auto",
             "reference: run the PyTorch reference ops even where the Triton kernels could run (debugging)", "engine",
             choices=("auto", "reference")),
    # ---- tests and benchmarks -------------------------------------------------------------------
    Variable("TOLLGATE_TEST_DATABASE_URL", str, None,
             "tests that touch the database also run against this one (CI: the local PostgreSQL)", "development",
             secret=True),
    Variable("TOLLGATE_DASHBOARD_SCREENSHOT", _path, None,
             "the dashboard browser test also copies its screenshot here", "development"),
    Variable("TOLLGATE_DATA_DIR", _path, _REPO_ROOT.parent / "shared" / "data",
             "data sets of the cache benchmarks", "development"),
    Variable("TOLLGATE_MINILM_DIR", _path, None,
             "an all-MiniLM-L6-v2 directory for the embedder benchmarks (unset: extracted from its package)",
             "development"),
    Variable("TOLLGATE_EMB_CACHE", _path, Path("/tmp/tollgate_emb_cache"),
             "where the cache benchmarks keep computed embeddings", "development"),
    Variable("TOLLGATE_EMB_DEVICE", str, "cpu", "device of the cache benchmarks' embedder", "development"),
]

VARIABLES: dict[str, Variable] = {v.name: v for v in _DECLARED}


def variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared setting (tollgate/envs.py)") from None


def is_set(name: str) -> bool:
    return bool(os.environ.get(variable(name).name, "").strip())


def get(name: str) -> Any:
    """The variable's value: parsed from the environment when set (and not empty), else its default.
    A value that does not parse is a ValueError naming the variable."""
    var = variable(name)
    text = os.environ.get(name, "").strip()
    if not text:
        return var.default
    if var.choices and text.lower() not in var.choices:
        raise ValueError(f"{name}: one of {list(var.choices)} expected, got {text!r}")
    try:
        value = var.parse(text.lower() if var.choices else text)
    except ValueError as e:
        raise ValueError(f"{name}: {e if str(e) else 'invalid'} (got {text!r})") from None
    return value


@contextmanager
def overridden(**values: str | None) -> Iterator[None]:
    """Within the block each named variable (TOLLGATE_HOME=...) holds its value, as if the environment had set it
    (a None leaves it as it is): how a command-line flag means exactly what its variable means, for this process
    and for the processes it starts. The environment is as it was after the block."""
    before = {name: os.environ.get(variable(name).name) for name, value in values.items() if value is not None}
    try:
        for name in before:
            os.environ[name] = str(values[name])
        yield
    finally:
        for name, old in before.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def home() -> Path:
    return Path(get("TOLLGATE_HOME")).expanduser()


def model_cache_dir() -> Path:
    """Converted checkpoints and tokenizers (TOLLGATE_MODEL_CACHE_DIR, else TOLLGATE_HOME/models)."""
    return get("TOLLGATE_MODEL_CACHE_DIR") or home() / "models"


def table() -> list[dict[str, Any]]:
    """Every declared variable with its type, default, the value in effect and its help (secrets masked)."""
    rows = []
    for var in _DECLARED:
        try:
            value: Any = get(var.name)
        except ValueError as e:
            value = f"invalid: {e}"
        if var.secret and value is not None and is_set(var.name):
            value = "(set)"
        rows.append({"name": var.name, "group": var.group, "type": var.type_name,
                     "default": var.default, "value": value, "set": is_set(var.name), "help": var.help})
    return rows
