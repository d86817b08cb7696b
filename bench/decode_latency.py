"""Batch-1 decode speed and model-bandwidth utilisation (MBU).

    python -m bench.decode_latency --model random:llama-8b --device cuda [--json FILE]

One 128-token random prompt, 256 greedy tokens (ignore_eos), repeated; decode tok/s comes from
the request's metrics: (tokens - 1) / (finish - first token). MBU = weight bytes x tok/s / the
device-to-device copy bandwidth measured in the same run (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import torch

from bench.common import add_engine_switches, copy_bandwidth, emit, engine_switches, log
from engine import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--quantization", choices=("int8", "int4", "fp8"), help="weights quantized on load")
    p.add_argument("--sync-scheduling", action="store_true", help="read each step's tokens before the next step")
    add_engine_switches(p)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter bytes, bytes a decode step reads: without the input embedding table unless it is tied)."""
    total = read = 0
    tied = getattr(model, "lm_head", None) is None  # the engine's model drops lm_head when it is tied
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if "embed_tokens" not in name or tied:
            read += size
    return total, read


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    bandwidth = None
    if args.device == "cuda":
        log("copy bandwidth: 4 GiB device-to-device copy")
        bandwidth = copy_bandwidth()
        log(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    log(f"engine: loading {args.model} on {args.device}")
    kwargs: dict[str, Any] = {"device": args.device, "max_model_len": args.max_model_len}
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.sync_scheduling:
        kwargs["async_scheduling"] = False
    if args.quantization:
        kwargs["quantization"] = args.quantization
    kwargs |= engine_switches(args)
    llm = LLM(args.model, **kwargs)
    vocab = min(10000, llm.engine.model_config.vocab_size)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    log("engine: warm-up")
    llm.generate([[rng.randrange(vocab) for _ in range(args.prompt_len)]], SamplingParams(temperature=0.0,
                 ignore_eos=True, max_tokens=min(32, args.output_len)))
    rates = []
    for i in range(args.repeats):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        out = llm.generate([prompt], params)[0]
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        rate = (n - 1) / (m.finished_time - m.first_token_time)
        rates.append(rate)
        log(f"run {i + 1}/{args.repeats}: {n} tokens, decode {rate:.1f} tok/s, ttft {m.ttft * 1e3:.1f} ms")
    tok_s = statistics.median(rates)
    tp = args.tensor_parallel_size
    total, read = (tp * b for b in weight_bytes(llm.engine.runner.model))  # rank 0's shard, times the ranks
    llm.close()
    result: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "tensor_parallel_size": tp,
        "quantization": args.quantization,
        "async_scheduling": llm.engine.overlap,
        **engine_switches(args),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "decode_tok_s": round(tok_s, 2),
        "decode_tok_s_runs": [round(r, 2) for r in rates],
        "ms_per_token": round(1e3 / tok_s, 3),
        "weight_bytes": total,
        "weight_bytes_read_per_token": read,
        "load_seconds": round(llm.engine.load_seconds, 2),
    }
    if bandwidth is not None:
        result["copy_bandwidth_bytes_s"] = round(bandwidth)
        result["mbu"] = round(total * tok_s / (tp * bandwidth), 4)  # each GPU streams its shard at its bandwidth
        result["mbu_read_bytes"] = round(read * tok_s / (tp * bandwidth), 4)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
