"""Multi-LoRA serving speed: adapters over one base model, against the base model alone.

    python -m bench.lora --model random:llama-8b --device cuda --json FILE       # the H200 run (issue 37)
    python -m bench.lora --model random:llama-tiny --device cpu --batch 4 --num-adapters 4 --output-len 8  # smoke
    python -m bench.lora ... --decode-kernels bgmv     # the per-token LoRA decode kernels only, for comparison

Adapters are a random PEFT directory (rank --rank on all seven projections, written here) served under
--num-adapters names, each in its own device slot. Measures:
- batch-1 decode tok/s with an adapter vs the base model (decode rate from the request's metrics);
- --batch decodes spread over --num-adapters adapters vs the same batch on the base model (output tok/s);
- adapter load time from host memory into a device slot (the copy the first request of an evicted adapter waits
  for), and from disk (read and checked off the engine's thread in serving).
--decode-kernels picks the LoRA kernels of decode steps (EngineConfig.lora_decode_kernels): "auto" (the engine's
default: grouped by adapter slot from two tokens per distinct adapter, with dense expands when the adapters fill
3/4 of the pool's slots, so the batched run's 64 tokens over 16 adapters in 16 slots take the dense form and batch 1
stays per token), "bgmv" (per token always), "grouped" or "dense" (always).
Targets (issue 37): batch-1 >= 0.85x, batch >= 0.80x, host load < 50 ms."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import save_file

from bench.common import emit, log, synchronize
from engine import LLM, SamplingParams
from engine.lora.targets import TARGETS, module_shape
from engine.model_config import ModelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--decode-kernels", choices=("auto", "bgmv", "grouped", "dense"), default="auto",
                   help="the LoRA kernels of decode steps (EngineConfig.lora_decode_kernels)")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def write_random_adapter(cfg: ModelConfig, path: str, rank: int, seed: int) -> int:
    """A PEFT adapter directory with random A and B on every projection of every layer; returns its bytes."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in TARGETS:
            parent = "mlp" if TARGETS[module][0] in ("gate_up", "down") else "self_attn"
            in_features, out_features = module_shape(cfg, module)
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen) / in_features**0.5
                                               ).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(TARGETS),
                   "bias": "none"}, f)
    return sum(t.nbytes for t in tensors.values())


def _decode_rate(llm: LLM, prompt: list[int], params: SamplingParams, lora: str | None) -> float:
    out = llm.generate([prompt], params, lora_name=lora)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)


def _batch_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[str | None]) -> float:
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_name=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)


def _median_ratio(base: list[float], lora: list[float]) -> tuple[float, float, float]:
    b, a = statistics.median(base), statistics.median(lora)
    return b, a, a / b


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    log(f"engine: loading {args.model} on {args.device} with {args.num_adapters} adapter slots of rank {args.rank}, "
        f"{args.decode_kernels} LoRA decode kernels")
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, max_loras=args.num_adapters,
              max_lora_rank=args.rank, max_num_seqs=max(args.batch, 1), lora_decode_kernels=args.decode_kernels)
    cfg = llm.engine.model_config
    names = [f"adapter-{i}" for i in range(args.num_adapters)]
    with tempfile.TemporaryDirectory() as root:
        # one directory served under every name: each name still gets its own slot (its own weight traffic)
        adapter_bytes = write_random_adapter(cfg, os.path.join(root, "adapter"), args.rank, seed=0)
        disk_s = []
        for name in names:
            started = time.perf_counter()
            llm.add_lora(name, os.path.join(root, "adapter"))
            disk_s.append(time.perf_counter() - started)
        rng = random.Random(0)
        vocab = min(10000, cfg.vocab_size)
        prompt = lambda: [rng.randrange(vocab) for _ in range(args.prompt_len)]  # noqa: E731
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
        log("warm-up: base and adapter, batch 1 and batched")
        warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(16, args.output_len))
        llm.generate([prompt()], warm)
        llm.generate([prompt() for _ in range(args.batch)], warm, lora_name=[names[i % len(names)]
                                                                           for i in range(args.batch)])
        base1, lora1 = [], []
        for i in range(args.repeats):
            p = prompt()
            base1.append(_decode_rate(llm, p, params, None))
            lora1.append(_decode_rate(llm, p, params, names[0]))
            log(f"batch 1, run {i + 1}: base {base1[-1]:.1f} tok/s, adapter {lora1[-1]:.1f} tok/s")
        baseb, lorab = [], []
        for i in range(args.repeats):
            prompts = [prompt() for _ in range(args.batch)]
            baseb.append(_batch_rate(llm, prompts, params, [None] * args.batch))
            lorab.append(_batch_rate(llm, prompts, params, [names[j % len(names)] for j in range(args.batch)]))
            log(f"batch {args.batch}, run {i + 1}: base {baseb[-1]:.1f} tok/s, {args.num_adapters} adapters "
                f"{lorab[-1]:.1f} tok/s")
        host_ms = _host_load_ms(llm, names[0], args.device)
    b1, a1, r1 = _median_ratio(base1, lora1)
    bb, ab, rb = _median_ratio(baseb, lorab)
    result = {
        "model": args.model, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "rank": args.rank, "num_adapters": args.num_adapters, "batch": args.batch,
        "decode_kernels": args.decode_kernels,
        "prompt_len": args.prompt_len, "output_len": args.output_len,
        "batch1_base_tok_s": round(b1, 2), "batch1_adapter_tok_s": round(a1, 2), "batch1_ratio": round(r1, 3),
        f"batch{args.batch}_base_tok_s": round(bb, 2), f"batch{args.batch}_adapters_tok_s": round(ab, 2),
        f"batch{args.batch}_ratio": round(rb, 3),
        "adapter_mib": round(adapter_bytes / 2**20, 2),
        "adapter_load_host_ms": round(host_ms, 3),
        "adapter_load_disk_ms": round(1e3 * statistics.median(disk_s), 2),
        "targets": {"batch1_ratio": 0.85, "batch_ratio": 0.80, "adapter_load_host_ms": 50},
    }
    emit(result, args.json)
    return result


def _host_load_ms(llm: LLM, name: str, device: str, repeats: int = 5) -> float:
    """Median time to copy a host-resident adapter into a device slot (one it is not in), synchronized."""
    manager = llm.engine.lora
    entry = manager.resolve(name)
    adapter = manager.registry.host_copy(entry)
    times = []
    for i in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        manager.pool.place([-1 - i], lambda _: adapter)  # an id never resident: a real load into the LRU slot
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


if __name__ == "__main__":
    main()
