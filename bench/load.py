"""A bounded load run against a running platform (`platform up`), then a reconciliation against the
usage ledger: every request a client completed must have exactly one usage event, with the tokens
the client was given.

    platform --home H up --port 8471 &            # or `make up`
    python -m bench.load --url http://127.0.0.1:8471 --home H --seconds 90 --concurrency 6

Concurrent clients over several tenants (created through the `platform` CLI, one with a low rpm so
that 429s happen by design) alternate streaming and whole chat completions; some repeat a question
so that the semantic cache answers part of the load. After --seconds no new request starts and the
ones in flight finish. Reports requests/s, latency and TTFT percentiles, statuses, the ledger check,
a JSON file and an SVG of throughput and latency over time (bench/load_chart.py).

--lock-sqlite-for D adds a database outage from --lock-sqlite-at on: the platform must keep serving
and the ledger must still reconcile once the lock is gone (its events wait and spill to disk)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_chart import load_svg  # noqa: E402
from bench.load_ledger import reconcile  # noqa: E402

ACCEPTABLE = {200, 429, 503}  # 429 and 503 are the platform saying "later", by design
TOPICS = ["rivers", "bread", "chess", "volcanoes", "owls", "tides", "copper", "jazz", "glaciers", "bees",
          "lighthouses", "maple trees", "comets", "sailing", "paper", "salt"]


@dataclass
class Result:
    tenant: str
    stream: bool
    repeat: bool
    start: float  # seconds since the run began
    end: float
    status: int  # HTTP status; 0: transport error
    request_id: str | None = None
    ttft_s: float | None = None  # streams: first content token
    usage: dict[str, int] | None = None
    error: str | None = None
    cache: str | None = None
    warmup: bool = False  # before the measured window; reconciled with the ledger, left out of the figures

    @property
    def latency_s(self) -> float:
        return self.end - self.start


@dataclass
class Tenant:
    name: str
    key: str
    rpm: int | None = None


@dataclass
class Run:
    args: dict[str, Any]
    tenants: list[str]
    duration_s: float
    results: list[Result] = field(default_factory=list)
    warmup: Result | None = None

    @property
    def all_results(self) -> list[Result]:
        """The measured requests and the warm-up: every request the ledger should know about."""
        return self.results + ([self.warmup] if self.warmup else [])


def platform_cli(home: str | None, db_url: str | None, *argv: str) -> str:
    cmd = [sys.executable, "-m", "gateway.cli"]
    if home:
        cmd += ["--home", home]
    if db_url:
        cmd += ["--database-url", db_url]
    out = subprocess.run(cmd + list(argv), capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"platform {' '.join(argv)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


def make_tenants(n: int, limited_rpm: int, home: str | None, db_url: str | None) -> list[Tenant]:
    run = uuid.uuid4().hex[:6]
    tenants = []
    for i in range(n):
        name = f"load-{run}-{i}"
        rpm = limited_rpm if i == n - 1 and limited_rpm > 0 else None
        platform_cli(home, db_url, "tenants", "create", name)
        key_args = ["keys", "create", "--tenant", name, "--name", "load"] + (["--rpm", str(rpm)] if rpm else [])
        tenants.append(Tenant(name, platform_cli(home, db_url, *key_args).splitlines()[-1], rpm))
    return tenants


def question(rng: random.Random, repeat_fraction: float) -> tuple[str, bool]:
    if rng.random() < repeat_fraction:
        return f"In one sentence, what are {rng.choice(TOPICS[:4])}?", True
    return f"In one sentence, what are {rng.choice(TOPICS)}? (ref {uuid.uuid4().hex[:8]})", False


async def one_request(client: httpx.AsyncClient, model: str, tenant: Tenant, stream: bool, text: str, repeat: bool,
                      max_tokens: int, t0: float) -> Result:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {tenant.key}"}
    res = Result(tenant.name, stream, repeat, time.perf_counter() - t0, 0.0, 0)
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            res.status, res.cache = r.status_code, r.headers.get("x-tollgate-cache")
            if r.status_code == 200:
                data = r.json()
                res.request_id, res.usage = data["id"], data["usage"]
            else:
                res.error = r.text[:300]
        else:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                res.status, res.cache = r.status_code, r.headers.get("x-tollgate-cache")
                if r.status_code != 200:
                    res.error = (await r.aread()).decode()[:300]
                else:
                    await _read_stream(r, res, t0)
    except httpx.HTTPError as e:
        res.status, res.error = 0, f"{type(e).__name__}: {e}"
    res.end = time.perf_counter() - t0
    return res


async def _read_stream(r: httpx.Response, res: Result, t0: float) -> None:
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:  # an error after the headers: the stream failed mid-way
            res.status, res.error = 500, json.dumps(chunk)[:300]
            continue
        res.request_id = chunk["id"]
        if chunk.get("usage"):
            res.usage = chunk["usage"]
        if res.ttft_s is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
            res.ttft_s = time.perf_counter() - t0 - res.start
    if not done or res.usage is None:
        res.status, res.error = res.status if res.status != 200 else 500, res.error or "stream ended without usage/[DONE]"


async def client_loop(worker: int, client: httpx.AsyncClient, args: argparse.Namespace, tenants: list[Tenant],
                      deadline: float, t0: float, out: list[Result]) -> None:
    rng = random.Random(args.seed * 1000 + worker)
    stream = worker % 2 == 0  # half the clients stream
    i = 0
    while time.perf_counter() < deadline:
        tenant = tenants[(worker + i) % len(tenants)]
        text, repeat = question(rng, args.repeat_fraction)
        res = await one_request(client, args.model, tenant, stream, text, repeat, args.max_tokens, t0)
        out.append(res)
        i += 1
        if res.status in (429, 503):  # "later": wait a little as a polite client would
            await asyncio.sleep(min(2.0, 0.5 + rng.random()))


async def warm_up(client: httpx.AsyncClient, model: str, tenant: Tenant, timeout_s: float) -> Result:
    """One request until it succeeds: the model may be at zero replicas (a cold start)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        r = await one_request(client, model, tenant, False, f"Say hi ({uuid.uuid4().hex[:6]}).", False, 2,
                              time.perf_counter())
        r.warmup = True
        if r.status == 200:
            return r
        if time.perf_counter() > deadline:
            raise SystemExit(f"warm-up failed: {r.status} {r.error}")
        await asyncio.sleep(1.0)


async def lock_sqlite(path: str, at_s: float, for_s: float, t0: float) -> None:
    """A database outage in the middle of the run: hold an exclusive transaction on the SQLite file (every
    writer waits for its busy timeout, then fails; readers still read in WAL mode)."""
    import sqlite3

    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print(f"database locked at {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        await asyncio.sleep(for_s)
    finally:
        conn.execute("ROLLBACK")
        conn.close()
        print(f"database unlocked at {time.perf_counter() - t0:.1f} s", flush=True)


async def run_load(args: argparse.Namespace, tenants: list[Tenant]) -> Run:
    limits = httpx.Limits(max_connections=args.concurrency + 2, max_keepalive_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout, limits=limits) as client:
        warm = await warm_up(client, args.model, tenants[0], 300)
        results: list[Result] = []
        t0 = time.perf_counter()
        deadline = t0 + args.seconds
        outage = []
        if getattr(args, "lock_sqlite_for", 0) > 0:
            from gateway.settings import Settings

            url = Settings.load(home=args.home, database_url=args.database_url).db_url
            if not url.startswith("sqlite:///"):
                raise SystemExit("--lock-sqlite-for needs the platform's SQLite database")
            outage = [lock_sqlite(url.split("///", 1)[1], args.lock_sqlite_at, args.lock_sqlite_for, t0)]
        await asyncio.gather(*(client_loop(w, client, args, tenants, deadline, t0, results)
                               for w in range(args.concurrency)), *outage)
        duration = time.perf_counter() - t0
    return Run({k: v for k, v in vars(args).items() if k != "func"}, [t.name for t in tenants], duration, results,
               warm)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summary(run: Run) -> dict[str, Any]:
    ok = [r for r in run.results if r.status == 200]
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    statuses = Counter(str(r.status) for r in run.results)
    completion = sum((r.usage or {}).get("completion_tokens", 0) for r in ok)
    return {
        "duration_s": round(run.duration_s, 2), "requests": len(run.results), "completed": len(ok),
        "requests_per_s": round(len(ok) / run.duration_s, 3),
        "completion_tokens_per_s": round(completion / run.duration_s, 2),
        "latency_p50_s": _r(pct(lat, 0.5)), "latency_p99_s": _r(pct(lat, 0.99)),
        "ttft_p50_s": _r(pct(ttft, 0.5)), "ttft_p99_s": _r(pct(ttft, 0.99)),
        "streamed": sum(r.stream for r in ok), "cache_hits": sum(r.cache == "hit" for r in ok),
        "statuses": dict(statuses),
        "unexpected": [asdict(r) for r in run.results if r.status not in ACCEPTABLE][:20],
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--home", help="the platform's --home (its SQLite ledger and the CLI's database)")
    p.add_argument("--database-url", help="the platform's database URL, when not the SQLite file under --home")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--limited-rpm", type=int, default=20, help="rpm of the last tenant's key (0: unlimited)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeat-fraction", type=float, default=0.2, help="share of questions asked before")
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lock-sqlite-at", type=float, default=30.0, help="when the database outage starts (s)")
    p.add_argument("--lock-sqlite-for", type=float, default=0.0,
                   help="hold an exclusive lock on the platform's SQLite file this long (0: no outage)")
    p.add_argument("--json-out", type=Path, default=Path("load.json"))
    p.add_argument("--chart", type=Path, default=Path("docs/load.svg"))
    args = p.parse_args(argv)

    tenants = make_tenants(args.tenants, args.limited_rpm, args.home, args.database_url)
    print(f"tenants: {', '.join(t.name + (f' (rpm {t.rpm})' if t.rpm else '') for t in tenants)}", flush=True)
    run = asyncio.run(run_load(args, tenants))
    report = summary(run)
    report["ledger"] = reconcile(run.all_results, run.tenants, args.home, args.database_url)
    print(json.dumps({k: v for k, v in report.items() if k != "unexpected"}, indent=2))
    for bad in report["unexpected"]:
        print("unexpected:", bad, file=sys.stderr)
    args.json_out.write_text(json.dumps({"summary": report, "args": run.args,
                                         "results": [asdict(r) for r in run.all_results]}, indent=1,
                                        default=str))
    args.chart.parent.mkdir(parents=True, exist_ok=True)
    args.chart.write_text(load_svg(run.results, run.duration_s, report))
    print(f"wrote {args.json_out} and {args.chart}")
    ok = not report["unexpected"] and report["ledger"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
