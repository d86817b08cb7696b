"""How much latency the gateway adds over calling the engine directly, and the request rate it
sustains. Each request's engine time is measured inside the backend (first call to last chunk), so
`added = HTTP round trip - engine time` is exact per request even when the engine's own speed varies. The same
engine behind a bare HTTP route (no auth, limits or ledger) is the baseline of a direct call, as LiteLLM measures its
proxy against calling the provider's API directly: "added over the bare route" is the gateway's own cost. The rows take
turns request by request, so a change in the box's load falls on each alike.

    .venv/bin/python bench/gateway.py [--requests 200] [--concurrency 8] [--seconds 15] [--max-tokens 1]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
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

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

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


def bare_app(backend: TimedBackend):  # type: ignore[no-untyped-def]
    """The engine behind a bare HTTP route, the way a client calls a provider directly (LiteLLM's "raw OpenAI API"
    baseline): it parses the same body and answers the same JSON, with no auth, limits, ledger or metrics."""
    app = FastAPI()
    counter = itertools.count()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        rid = f"bare-{next(counter)}"
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                ignore_eos=body["ignore_eos"])
        text, usage = [], (0, 0)
        async for chunk in backend.generate(GenerationRequest(rid, params, prompt=body["prompt"])):
            text.extend(choice.text for choice in chunk.choices)
            usage = (chunk.prompt_tokens, chunk.completion_tokens)
        return JSONResponse({"id": rid, "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": "".join(text), "finish_reason": "length"}],
                             "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}},
                            headers={"x-request-id": rid})

    return app


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
    ap.add_argument("--engine-core", choices=["auto", "thread", "process"], default="auto",
                    help="where the engine core runs (EngineConfig.engine_core; auto is a thread on a CPU)")
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
    spec = spec.model_copy(update={"engine": {**spec.engine, "max_model_len": 1024,
                                                          "engine_core": args.engine_core}})
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

    def serve(port: int, app) -> tuple[ServerClock, uvicorn.Server, threading.Thread]:  # type: ignore[no-untyped-def]
        clock = ServerClock(app)
        server = uvicorn.Server(uvicorn.Config(clock, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        return clock, server, thread

    def gateway(**settings: object):  # type: ignore[no-untyped-def]
        return create_app(Settings(database_url=url, log_level="warning", **settings), db, {spec.name: backend},
                          [spec])

    port = 18000 + os.getpid() % 1000
    app, server, thread = serve(port, gateway())
    # the same limits with one SQL reservation per request, the way every request was admitted before leases
    sql_app, sql_server, sql_thread = serve(port + 1, gateway(budget_leases=False))
    bare, bare_server, bare_thread = serve(port + 2, bare_app(backend))

    body = json.dumps({"model": spec.name, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    rows = (("the engine behind a bare HTTP route (no gateway: the baseline of a direct call)", "none", bare, port + 2),
            ("key without limits", plain_key, app, port),
            ("key with rpm+tpm+budgets (admitted from budget leases)", limited_key, app, port),
            ("key with rpm+tpm+budgets, a SQL reservation per request (TOLLGATE_BUDGET_LEASES=0)", limited_key,
             sql_app, port + 1))
    conns = [http.client.HTTPConnection("127.0.0.1", at) for *_, at in rows]
    for conn, (_, key, _, _) in zip(conns, rows):
        for _ in range(5):
            post(conn, key, body)  # warm-up
    results: dict[str, tuple[list[float], list[float], list[float]]] = {label: ([], [], []) for label, *_ in rows}
    for _ in range(args.requests):  # the rows take turns, request by request, so a change in the box's load hits all
        for conn, (label, key, clock, _) in zip(conns, rows):
            elapsed, rid = post(conn, key, body)
            while rid not in clock.server_s:  # its last byte is handed to uvicorn just after the client has it
                time.sleep(0)
            added, total, server_added = results[label]
            total.append(elapsed)
            added.append(elapsed - backend.engine_s[rid])
            server_added.append(clock.server_s[rid] - backend.engine_s[rid])
    for conn in conns:
        conn.close()

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
    for s, t in ((server, thread), (sql_server, sql_thread), (bare_server, bare_thread)):
        s.should_exit = True
        t.join(30)
    inner.stop()

    ms = 1000.0
    print(f"\nmachine: {os.cpu_count()} CPU cores; prompt {PROMPT!r}, max_tokens={args.max_tokens}, "
          f"{args.requests} sequential requests per row, database {url.split(':')[0]}")
    print(f"engine called directly (no HTTP):     p50 {statistics.median(direct_s) * ms:8.2f} ms   "
          f"p99 {pct(direct_s, 0.99) * ms:8.2f} ms")
    baseline = statistics.median(results[rows[0][0]][0])
    for label, (added, total, server_added) in results.items():
        print(f"through {label}:" if label == rows[0][0] else f"through the gateway, {label}:")
        print(f"  end to end                          p50 {statistics.median(total) * ms:8.2f} ms   "
              f"p99 {pct(total, 0.99) * ms:8.2f} ms")
        print(f"  added over the engine (incl. HTTP)  p50 {statistics.median(added) * ms:8.2f} ms   "
              f"p99 {pct(added, 0.99) * ms:8.2f} ms")
        print(f"  added inside the server process     p50 {statistics.median(server_added) * ms:8.2f} ms   "
              f"p99 {pct(server_added, 0.99) * ms:8.2f} ms")
        if label != rows[0][0]:
            print(f"  added over the bare route          p50 {(statistics.median(added) - baseline) * ms:8.2f} ms")
    print(f"sustained: {rate:.1f} req/s with {args.concurrency} concurrent clients for {args.seconds:.0f}s "
          f"(engine-bound: each request runs the model)")


if __name__ == "__main__":
    main()
