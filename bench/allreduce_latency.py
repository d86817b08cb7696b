"""Latency of the collectives tensor parallelism runs every decode step, on two local ranks:
NCCL all-reduce of one token's hidden state (eager and replayed from a CUDA graph) and the gloo
broadcast that carries each step's inputs from rank 0 (bench/fused_norm_latency.py times the fused
all-reduce + RMSNorm that decode steps run instead of NCCL's).

    python -m bench.allreduce_latency [--hidden 4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import emit
from engine.distributed.workers import free_port


def _rank_main(rank: int, size: int, port: int, hidden: int, out: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(minutes=5), device_id=device)
    gloo = dist.new_group(backend="gloo")
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    result: dict[str, float] = {}

    def per_call_us(fn, calls: int) -> float:
        fn()
        torch.cuda.synchronize()
        dist.barrier(group=gloo)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    result["nccl_eager_us"] = per_call_us(lambda: [dist.all_reduce(x) for _ in range(200)], 200)
    result["nccl_graph_us"] = _graph_us(per_call_us, lambda: dist.all_reduce(x))
    header = torch.zeros(6, dtype=torch.int64)
    result["gloo_broadcast_us"] = per_call_us(lambda: [dist.broadcast(header, src=0, group=gloo) for _ in range(500)],
                                              500)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def _graph_us(per_call_us, all_reduce) -> float:
    """Per call, 64 calls captured in one CUDA graph as a decode step has them. The graph is freed
    before returning: NCCL teardown waits forever on graphs that captured it (pytorch/pytorch#115388)."""
    all_reduce()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(64):
            all_reduce()
    us = per_call_us(lambda: [graph.replay() for _ in range(20)], 20 * 64)
    del graph
    torch.cuda.synchronize()
    return us


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"allreduce_{os.getpid()}.json")
    mp.spawn(_rank_main, args=(2, free_port(), args.hidden, out), nprocs=2)
    with open(out) as f:
        result = {"hidden": args.hidden, **{k: round(v, 2) for k, v in json.load(f).items()}}
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
