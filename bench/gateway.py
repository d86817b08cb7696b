"""How much latency the gateway adds over calling the engine directly, and the request rate it
sustains. Each request's engine time is measured inside the backend (first call to last chunk), so
`added = HTTP round trip - engine time` is exact per request even when the engine's own speed varies.

    .venv/bin/python bench/gateway.py [--requests 200] [--concurrency 8] [--seconds 15] [--max-tokens 1]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from billing.accounts import create_key, create_tenant  # noqa: E402
from billing.db import make_engine  # noqa: E402
from billing.field_checks import MAX_SQL_INT  # noqa: E402
from billing.migrate import upgrade  # noqa: E402
from engine.config import SamplingParams  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.backends import BackendInfo, GenerationChunk, GenerationRequest, LocalEngineBackend  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.specs import load_spec  # noqa: E402
from tollgate import envs  # noqa: E402

SPEC = Path(__file__).resolve().parent.parent / "platform" / "models" / "smollm2-135m.yaml"
PROMPT = "The capital of France is"


class TimedBackend:
    """Wraps a backend and notes each request's time inside it."""

    def __init__(self, inner: LocalEngineBackend) -> None:
        self.inner = inner
        self.engine_s: dict[str, float] = {}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        start = time.perf_counter()
        async for chunk in self.inner.generate(request):
            if chunk.finished:
                self.engine_s[request.request_id] = time.perf_counter() - start
            yield chunk

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def info(self) -> BackendInfo:
        return self.inner.info()

    def stats(self) -> dict:
        return self.inner.stats()


class ServerClock:
    """ASGI wrapper: each request's time inside the server, from arrival to the last byte handed to uvicorn."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.app = app
        self.server_s: dict[str, float] = {}

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        rid = ""

        async def timed_send(message) -> None:  # type: ignore[no-untyped-def]
            nonlocal rid
            if message["type"] == "http.response.start":
                rid = dict(message["headers"]).get(b"x-request-id", b"").decode()
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and rid:
                self.server_s[rid] = time.perf_counter() - start

        await self.app(scope, receive, timed_send)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def post(conn: http.client.HTTPConnection, key: str, body: bytes) -> tuple[float, str]:
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - start
    assert resp.status == 200, data
    return elapsed, resp.getheader("x-request-id") or ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=1)
    args = ap.parse_args()

    import uvicorn

    tmp = tempfile.mkdtemp(prefix="tollgate-bench-")
    url = envs.get("TOLLGATE_DATABASE_URL") or f"sqlite:///{tmp}/bench.db"
    upgrade(url)
    db = make_engine(url)
    # the plain key's tenant has no budget either, so its requests skip SQL admission entirely
    create_tenant(db, f"bench-plain-{os.getpid()}")
    create_tenant(db, f"bench-{os.getpid()}", budget_usd=1e9)
    plain_key = create_key(db, f"bench-plain-{os.getpid()}").key
    limited_key = create_key(db, f"bench-{os.getpid()}", rpm=10**9, tpm=MAX_SQL_INT, budget_usd=1e9).key

    spec = load_spec(SPEC)
    spec = spec.model_copy(update={"engine": {**spec.engine, "max_model_len": 1024}})
    inner = LocalEngineBackend(spec)
    t0 = time.perf_counter()
    asyncio.run(inner.start())
    print(f"model loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    backend = TimedBackend(inner)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    async def direct(n: int) -> list[float]:
        times = []
        for i in range(n):
            start = time.perf_counter()
            async for _ in inner.generate(GenerationRequest(f"direct-{i}", params, prompt=PROMPT)):
                pass
            times.append(time.perf_counter() - start)
        return times

    direct_s = asyncio.run(direct(args.requests))

    def serve(port: int, **settings: object) -> tuple[ServerClock, uvicorn.Server, threading.Thread]:
        app = ServerClock(create_app(Settings(database_url=url, log_level="warning", **settings), db,
                                     {spec.name: backend}, [spec]))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        return app, server, thread

    port = 18000 + os.getpid() % 1000
    app, server, thread = serve(port)
    # the same limits with one SQL reservation per request, the way every request was admitted before leases
    sql_app, sql_server, sql_thread = serve(port + 1, budget_leases=False)

    body = json.dumps({"model": spec.name, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    results = {}
    for label, key, clock, at in (
            ("key without limits", plain_key, app, port),
            ("key with rpm+tpm+budgets (admitted from budget leases)", limited_key, app, port),
            ("key with rpm+tpm+budgets, a SQL reservation per request (TOLLGATE_BUDGET_LEASES=0)", limited_key,
             sql_app, port + 1)):
        conn = http.client.HTTPConnection("127.0.0.1", at)
        for _ in range(5):
            post(conn, key, body)  # warm-up
        added, total, server_added = [], [], []
        for _ in range(args.requests):
            elapsed, rid = post(conn, key, body)
            while rid not in clock.server_s:  # its last byte is handed to uvicorn just after the client has it
                time.sleep(0)
            total.append(elapsed)
            added.append(elapsed - backend.engine_s[rid])
            server_added.append(clock.server_s[rid] - backend.engine_s[rid])
        conn.close()
        results[label] = (added, total, server_added)

    done = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + args.seconds

    def client() -> None:
        nonlocal done
        conn = http.client.HTTPConnection("127.0.0.1", port)
        while time.perf_counter() < stop_at:
            post(conn, limited_key, body)
            with lock:
                done += 1
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = done / (time.perf_counter() - start)
    for s, t in ((server, thread), (sql_server, sql_thread)):
        s.should_exit = True
        t.join(30)
    inner.stop()

    ms = 1000.0
    print(f"\nmachine: {os.cpu_count()} CPU cores; prompt {PROMPT!r}, max_tokens={args.max_tokens}, "
          f"{args.requests} sequential requests per row, database {url.split(':')[0]}")
    print(f"engine called directly (no HTTP):     p50 {statistics.median(direct_s) * ms:8.2f} ms   "
          f"p99 {pct(direct_s, 0.99) * ms:8.2f} ms")
    for label, (added, total, server_added) in results.items():
        print(f"through the gateway, {label}:")
        print(f"  end to end                          p50 {statistics.median(total) * ms:8.2f} ms   "
              f"p99 {pct(total, 0.99) * ms:8.2f} ms")
        print(f"  added by the gateway (incl. HTTP)   p50 {statistics.median(added) * ms:8.2f} ms   "
              f"p99 {pct(added, 0.99) * ms:8.2f} ms")
        print(f"  added inside the server process     p50 {statistics.median(server_added) * ms:8.2f} ms   "
              f"p99 {pct(server_added, 0.99) * ms:8.2f} ms")
    print(f"sustained: {rate:.1f} req/s with {args.concurrency} concurrent clients for {args.seconds:.0f}s "
          f"(engine-bound: each request runs the model)")


if __name__ == "__main__":
    main()
