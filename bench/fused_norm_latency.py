"""Per-layer cost of a row-parallel projection and its all-reduce + residual add + RMSNorm at batch-1 decode, on two
local GPUs set up as the engine sets them up: a chain of 64 (o_proj-shaped GEMV -> all-reduce + add + norm) links,
captured in a CUDA graph and replayed, per link:

- fused: the GEMV, then the fused kernel (kernels/all_reduce_norm.py) sends its row, waits, sums and norms;
- nccl: the GEMV, NCCL's all-reduce, add_rms_norm;
- local: the GEMV and add_rms_norm with no exchange at all (the floor).

    python -m bench.fused_norm_latency [--hidden 4096] [--k 2048] [--json FILE]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import emit
from engine.distributed.workers import free_port

LINKS = 64


def _timed_link_us(graph: torch.cuda.CUDAGraph, cpu_group, replays: int = 20, repeats: int = 5) -> tuple[float, float]:
    """(best, median) microseconds per link over `repeats` timings of `replays` graph replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        dist.barrier(group=cpu_group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays / LINKS)
    return min(times), sorted(times)[len(times) // 2]


def _rank_main(rank: int, port: int, hidden: int, k: int, queue) -> None:
    import kernels as ops
    from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from engine.distributed.peer_exchange import try_fused_all_reduce_norm

    device = torch.device("cuda", rank)
    tp = init_tensor_parallel(rank, 2, port, device)
    try:
        dtype = torch.bfloat16
        fused = try_fused_all_reduce_norm(tp, device, hidden, dtype)
        if fused is None:
            raise RuntimeError("the fused all-reduce + RMSNorm failed its start-up check")
        gen = torch.Generator(device=device).manual_seed(rank)
        linear = (torch.randn(hidden, k, generator=gen, device=device) / k ** 0.5).to(dtype)
        weight = torch.ones(hidden, device=device, dtype=dtype)

        def nccl(x, r):
            partial = ops.linear(x, linear)
            dist.all_reduce(partial, group=tp.device_group)
            return ops.add_rms_norm(partial, r, weight, 1e-5)

        links = {
            "fused": lambda x, r: fused(ops.linear(x, linear), r, weight, 1e-5),
            "nccl": nccl,
            "local": lambda x, r: ops.add_rms_norm(ops.linear(x, linear), r, weight, 1e-5),
        }
        results = {}
        for name, link in links.items():
            x0 = torch.randn(1, k, generator=gen, device=device).to(dtype)
            r0 = torch.randn(1, hidden, generator=gen, device=device).to(dtype)

            def chain():  # each link's GEMV reads the last link's output where it is wide enough
                h, r = link(x0, r0)
                for _ in range(LINKS - 1):
                    h, r = link(h[:, :k] if k <= hidden else x0, r)
                return h

            chain()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            results[name] = _timed_link_us(graph, tp.cpu_group)
            del graph
            if rank == 0:
                print(f"  {name:7s} {results[name][0]:6.2f} us a link (median {results[name][1]:.2f})", flush=True)
        if fused.failed_waits():
            raise RuntimeError(f"{fused.failed_waits()} waits gave up")
        queue.put((rank, results, None))
    except Exception as e:  # reported to the parent, not swallowed
        queue.put((rank, None, repr(e)))
    finally:
        destroy_tensor_parallel(tp)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--k", type=int, default=2048, help="the GEMV's input width (Llama-3-8B's o_proj at TP = 2)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    print(f"fused all-reduce + norm, {LINKS} links of GEMV [{args.hidden} x {args.k}] -> exchange + norm:", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, args.hidden, args.k, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    reports = sorted(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(60)
    errors = [f"rank {rank}: {error}" for rank, _, error in reports if error]
    if errors:
        raise SystemExit("; ".join(errors))
    result = {
        "hidden": args.hidden, "k": args.k, "links": LINKS,
        "per_link_us": {name: {"best": best, "median": median, "rank1_best": reports[1][1][name][0]}
                        for name, (best, median) in reports[0][1].items()},
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
