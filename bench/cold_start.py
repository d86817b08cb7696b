"""Cold start on Ray Serve: seconds from a request to a model at zero replicas to its first token,
split into replica start (scale-up decision, actor process, imports), model load (the ModelServer
constructor: engine and weights, from the converted checkpoint of gateway/model_cache.py) and first token (routing, prefill, first decode step).

    python -m bench.cold_start [--rounds 3] [--json FILE]

Starts a private Ray (2 CPUs) and Serve, deploys the bundled SmolLM2 spec with min_replicas 0 and a
short downscale delay, and for each round waits for zero replicas, then streams one request through
the model's deployment handle (what the gateway does) and reads the replica's own timestamps from the
ReplicaAccepted marker. A last round goes through the HTTP gateway and reports x-tollgate-cold-start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_SECONDS = 10.0
SPEC = Path(__file__).resolve().parent.parent / "platform" / "models" / "smollm2-135m.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


async def one_round(handle: Any) -> dict[str, float]:
    from engine.config import SamplingParams
    from gateway.backends import GenerationRequest
    from gateway.serving.ray_backend import ReplicaAccepted

    request = GenerationRequest(f"bench-{time.time_ns()}", SamplingParams(max_tokens=8, temperature=0.0),
                                messages=[{"role": "user", "content": "Say hello."}])
    sent = time.time()
    accepted: ReplicaAccepted | None = None
    first = None
    async for item in handle.options(stream=True).generate.remote(request):
        if isinstance(item, ReplicaAccepted):
            accepted = item
        elif first is None and item.completion_tokens > 0:
            first = time.time()
    assert accepted is not None and first is not None
    return {"total_s": first - sent, "replica_start_s": accepted.started_at - sent,
            "model_load_s": accepted.ready_at - accepted.started_at, "first_token_s": first - accepted.ready_at}


def wait_for_zero(model: str, timeout: float = 120.0) -> None:
    from gateway.serving.status import replica_states

    deadline = time.monotonic() + timeout
    while replica_states(model):
        if time.monotonic() > deadline:
            raise TimeoutError("the model did not scale to zero")
        time.sleep(0.2)


def http_round(url: str, key: str, model: str) -> dict[str, float]:
    import httpx

    from gateway.serving.ray_backend import COLD_START_HEADER

    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "stream": True, "temperature": 0.0}
    sent = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        header = float(r.headers.get(COLD_START_HEADER, "nan"))
        for line in r.iter_lines():
            if '"content"' in line:
                return {"http_first_token_s": time.monotonic() - sent, "cold_start_header_s": header}
    raise RuntimeError("no token came back")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from ray import serve

    from billing.accounts import create_key, create_tenant
    from billing.db import make_engine
    from billing.migrate import upgrade
    from gateway.serving.deploy import deploy_model
    from gateway.serving.gateway_app import deploy_gateway
    from gateway.serving.model_cache import prepared_source
    from gateway.serving.names import model_app_name
    from gateway.settings import Settings
    from gateway.specs import load_spec
    from tests.gateway.live import free_port

    spec = load_spec(SPEC)
    data = spec.model_dump(mode="json")
    data["engine"].update(max_model_len=512, max_num_seqs=8, cpu_kv_cache_gib=0.25)
    data["autoscaling"].update(min_replicas=0, max_replicas=1, downscale_delay_s=1.0, look_back_period_s=1.0,
                               metrics_interval_s=0.5, upscale_delay_s=0.0)
    spec = spec.model_validate(data)
    home = Path(tempfile.mkdtemp(prefix="tollgate-cold-"))
    db_url = f"sqlite:///{home / 'tollgate.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    settings = Settings(database_url=db_url, home=home, interval_flush_s=30.0, semantic_cache=False)
    t = time.perf_counter()
    prepared_source(spec.source)  # once per node, as `platform up` does (a no-op when already converted)
    print(f"checkpoint conversion (once per node; 0 when cached): {time.perf_counter() - t:.2f} s", flush=True)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    rounds: list[dict[str, float]] = []
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy_model(db, spec, settings)
        deploy_gateway(settings)
        handle = serve.get_app_handle(model_app_name(spec.name))
        for i in range(args.rounds):
            wait_for_zero(spec.name)
            r = asyncio.run(one_round(handle))
            rounds.append(r)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
        create_tenant(db, "bench")
        key = create_key(db, "bench").key
        wait_for_zero(spec.name)
        http = http_round(f"http://127.0.0.1:{port}", key, spec.name)
        print("through the gateway: " + ", ".join(f"{k} {v:.2f}" for k, v in http.items()), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    print(f"goal < {GOAL_SECONDS:g} s: {'met' if median['total_s'] < GOAL_SECONDS else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "median": median, "http": http}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
