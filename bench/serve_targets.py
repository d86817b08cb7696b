"""The serving benchmark's three targets on the same requests: offline `LLM.generate` (the anchor), `AsyncEngine`
in this process (each request consumed as a stream), and the HTTP gateway (`platform serve --local` in its own
process: keys, limits, ledger, SSE), driven by client processes that speak the OpenAI streaming protocol."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.serve_report import Progress, RequestResult, distribution
from bench.serve_workload import ServeRequest, salted

MODEL_NAME = "bench"


def _params(output_len: int):  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)


def _free_gpu() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- offline -----------------------------------------------------------------------------------------------

def run_offline(model: str, engine_fields: dict[str, Any], requests: list[ServeRequest], warmup: int,
                repeats: int, vocab_size: int) -> dict[str, Any]:
    """All requests in one LLM.generate; the best of `repeats` timed runs (after a warm-up batch)."""
    from engine import LLM

    llm = LLM(model, **engine_fields)
    try:
        if warmup:
            llm.generate([r.prompt_ids for r in requests[:warmup]], [_params(min(r.output_len, 32))
                                                                     for r in requests[:warmup]])
        best = None
        for i in range(repeats):
            # token ids shifted per run so the prefix cache cannot serve a later run
            prompts = [salted(r.prompt_ids, i + 1, vocab_size) for r in requests]
            _sync()
            start = time.perf_counter()
            outs = llm.generate(prompts, [_params(r.output_len) for r in requests])
            _sync()
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if best is None or seconds < best["duration_s"]:
                best = {"duration_s": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
                        "request_throughput": len(requests) / seconds}
        assert best is not None
        return best
    finally:
        llm.close()
        del llm
        _free_gpu()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- AsyncEngine in this process ---------------------------------------------------------------------------

class AsyncTarget:
    def __init__(self, model: str, engine_fields: dict[str, Any]) -> None:
        from engine import AsyncEngine, EngineConfig

        self.engine = AsyncEngine.from_config(EngineConfig.from_kwargs(model, **engine_fields))

    def run(self, requests: list[ServeRequest], offsets: list[float], max_concurrency: int | None,
            label: str, salt: int, vocab_size: int) -> tuple[list[RequestResult], float]:
        return asyncio.run(self._run(requests, offsets, max_concurrency, label, salt, vocab_size))

    async def _run(self, requests: list[ServeRequest], offsets: list[float], max_concurrency: int | None,
                   label: str, salt: int, vocab_size: int) -> tuple[list[RequestResult], float]:
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        progress = Progress(label, len(requests))
        start = time.perf_counter()

        async def one(i: int, req: ServeRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with limit:  # type: ignore[attr-defined]
                sent = time.perf_counter()
                result = RequestResult(ok=False, expected_tokens=req.output_len)
                last = None
                prompt = salted(req.prompt_ids, salt, vocab_size)
                async for out in self.engine.generate(prompt, _params(req.output_len), f"{label}-{i}"):
                    now = time.perf_counter()
                    if out.outputs[0].delta_token_ids:
                        if last is None:
                            result.ttft = now - sent
                        else:
                            result.itls.append(now - last)
                        last = now
                    if out.finished:
                        result.output_tokens = len(out.outputs[0].token_ids)
                result.e2e = time.perf_counter() - sent
                result.ok = True
                progress.update(result.output_tokens)
                return result

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        return list(results), time.perf_counter() - start

    def close(self) -> None:
        self.engine.shutdown()
        del self.engine
        _free_gpu()


# ---- the HTTP gateway --------------------------------------------------------------------------------------

def _cli(home: Path, *argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "--home", str(home), *argv], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"platform {' '.join(argv)} failed: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip()


class GatewayTarget:
    """`platform serve --local` with one model spec, a tenant and a key with rpm, tpm and budget limits (so every
    request goes through SQL admission and the ledger), in a process of its own."""

    def __init__(self, model: str, engine_fields: dict[str, Any], home: Path, port: int, log_path: Path,
                 use_gpu: bool, start_timeout_s: float = 900.0, api_servers: int = 1) -> None:
        import yaml

        self.home, self.port = home, port
        self.url = f"http://127.0.0.1:{port}"
        specs = home / "specs"
        specs.mkdir(parents=True, exist_ok=True)
        spec = {"name": MODEL_NAME, "source": model, "size": "small", "tasks": ["chat"], "engine": engine_fields,
                "resources": {"num_gpus": 1 if use_gpu else 0},
                "autoscaling": {"min_replicas": 1, "max_replicas": 1},
                "pricing": {"input_per_1m": 0.1, "output_per_1m": 0.4, "gpu_hour": 2.5}}
        (specs / "bench.yaml").write_text(yaml.safe_dump(spec))
        _cli(home, "tenants", "create", "bench", "--budget-usd", "1000000")
        self.key = _cli(home, "keys", "create", "--tenant", "bench", "--rpm", "1000000", "--tpm", "1000000000",
                        "--budget-usd", "100000").splitlines()[-1]
        env = {**os.environ, "TOLLGATE_SEMANTIC_CACHE": "0", "TOLLGATE_LOG_LEVEL": "warning",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--home", str(home), "serve", "--local",
                                      "--port", str(port), "--models-dir", str(specs),
                                      "--api-servers", str(api_servers)], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(start_timeout_s, api_servers)

    def _wait_ready(self, timeout_s: float, api_servers: int) -> None:
        """Until `api_servers` x 4 fresh connections in a row find the model ready (each may reach any process)."""
        deadline = time.monotonic() + timeout_s
        ready = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = Path(self.log.name).read_text()[-3000:]
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}; {self.log.name} ends:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    ready = ready + 1 if json.load(r)["models"].get(MODEL_NAME) == "ready" else 0
                if ready >= 4 * api_servers:
                    return
                if ready:
                    continue
            except OSError:
                ready = 0
            time.sleep(0.5)
        raise RuntimeError(f"the gateway did not get ready in {timeout_s:.0f} s; see {self.log.name}")

    def run(self, requests: list[ServeRequest], offsets: list[float], max_concurrency: int | None, label: str,
            salt: int, vocab_size: int, client_procs: int) -> tuple[list[RequestResult], float]:
        jobs: list[list[tuple[int, float, dict[str, Any], int]]] = [[] for _ in range(client_procs)]
        for i, req in enumerate(requests):
            jobs[i % client_procs].append((i, offsets[i], _body(req, salt, vocab_size), req.output_len))
        per_proc = None if not max_concurrency else max(1, max_concurrency // client_procs)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(client_procs) as pool:
            # every client process started (each holds one place at the barrier) before the clock does: a process
            # still starting would send its first requests late and stretch the run
            barrier = manager.Barrier(client_procs)
            finished = manager.Queue()  # each request's output tokens as it completes: the progress line
            pool.map(_ready, [barrier] * client_procs, chunksize=1)
            start_wall = time.time() + 0.5
            pending = [pool.apply_async(_client_process, (self.url, self.key, job, start_wall, per_proc, finished))
                       for job in jobs]
            progress = Progress(label, len(requests), start=time.perf_counter() + start_wall - time.time())
            while progress.done < len(requests):
                try:
                    progress.update(finished.get(timeout=1.0))
                except queue.Empty:
                    if all(handle.ready() for handle in pending):
                        break  # a client process ended early: its error comes with its results
            results: list[RequestResult | None] = [None] * len(requests)
            for handle in pending:
                for i, raw in handle.get():
                    results[i] = RequestResult(**raw)
        done = [r for r in results if r is not None]
        return done, max((r.end_wall for r in done if r.end_wall is not None), default=start_wall) - start_wall

    def stop_and_reconcile(self, results: list[RequestResult]) -> dict[str, Any]:
        """SIGTERM (the gateway drains and flushes its ledger), then every request the clients completed must have
        exactly one usage event, with the completion tokens the client was told."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        # the engine core's own account of how long it spent handing each step's outputs to the API processes
        marker = "engine core stopping: "
        self.core_hand_off = [line.split(marker, 1)[1] for line in Path(self.log.name).read_text().splitlines()
                              if marker in line]
        for line in self.core_hand_off:
            print(f"gateway's engine core: {line}", flush=True)
        with sqlite3.connect(self.home / "tollgate.db") as db:
            rows = db.execute("SELECT request_id, completion_tokens, status, ttft_s FROM usage_events").fetchall()
        events = {rid: (tokens, status) for rid, tokens, status, _ in rows}
        engine_ttft = {rid: ttft for rid, _, _, ttft in rows if ttft is not None}
        done = [r for r in results if r.ok and r.request_id]
        matched = sum(1 for r in done if events.get(r.request_id) == (r.output_tokens, "ok"))
        # where a request's first token waited: in the engine (from AsyncEngine.generate to its first token, as the
        # ledger has it), or before it (the client, HTTP, admission) and after it (the way back to the client)
        timed = [r for r in done if r.ttft is not None and r.request_id in engine_ttft]
        return {"events": len(rows), "client_completed": len(done), "matched": matched,
                "exact": matched == len(done) == len(rows),
                "ttft_ms_engine": distribution([engine_ttft[r.request_id] for r in timed]),
                "ttft_ms_outside_engine": distribution([r.ttft - engine_ttft[r.request_id] for r in timed]),
                "core_hand_off": self.core_hand_off}


def _body(req: ServeRequest, salt: int, vocab_size: int) -> dict[str, Any]:
    common = {"model": MODEL_NAME, "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}
    if req.text is not None:
        return {**common, "messages": [{"role": "user", "content": f"[{salt}] {req.text}"}]}
    return {**common, "prompt": salted(req.prompt_ids, salt, vocab_size)}


def _ready(barrier: Any) -> bool:
    import aiohttp  # noqa: F401 - imported before the clock starts

    barrier.wait(120)
    return True


def _client_process(url: str, key: str, jobs: list[tuple[int, float, dict[str, Any], int]], start_wall: float,
                    max_concurrency: int | None, finished: Any) -> list[tuple[int, dict[str, Any]]]:
    return asyncio.run(_clients(url, key, jobs, start_wall, max_concurrency, finished))


async def _clients(url: str, key: str, jobs: list[tuple[int, float, dict[str, Any], int]], start_wall: float,
                   max_concurrency: int | None, finished: Any) -> list[tuple[int, dict[str, Any]]]:
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int, offset: float, body: dict[str, Any], expected: int) -> tuple[int, dict[str, Any]]:
            await asyncio.sleep(max(0.0, start_wall + offset - time.time()))
            result: dict[str, Any] = {}
            try:
                return await send(i, body, expected, result)
            finally:
                finished.put(result.get("output_tokens", 0))

        async def send(i: int, body: dict[str, Any], expected: int,
                       result: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with limit:  # type: ignore[attr-defined]
                result.update({"ok": False, "expected_tokens": expected, "itls": []})
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                sent = time.perf_counter()
                last = None
                try:
                    async with session.post(url + path, json=body, headers=headers) as resp:
                        result["request_id"] = resp.headers.get("x-request-id")
                        if resp.status != 200:
                            result["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                            return i, result
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            now = time.perf_counter()
                            chunk = json.loads(line[6:])
                            if chunk.get("choices"):
                                if last is None:
                                    result["ttft"] = now - sent
                                else:
                                    result["itls"].append(now - last)
                                last = now
                            if chunk.get("usage"):
                                result["output_tokens"] = chunk["usage"]["completion_tokens"]
                            if "error" in chunk:
                                result["error"] = str(chunk["error"])[:200]
                    result["e2e"] = time.perf_counter() - sent
                    result["end_wall"] = time.time()
                    result["ok"] = "error" not in result and result.get("output_tokens", 0) > 0
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    result["error"] = f"{type(e).__name__}: {e}"
                return i, result

        return list(await asyncio.gather(*(one(*job) for job in jobs)))
