"""The three LoRA decode forms, per projection group, as a decode step runs them (issue 37).

    python -m bench.lora_decode_forms --device cuda --json forms.json   # random:llama-8b on the H200, about a minute
    python -m bench.lora_decode_forms --device cpu --layers 1 --replays 1   # smoke: random:llama-tiny, interpreter
                                                                            # (make install-test: it needs triton)

For each projection group of a Llama decoder layer (qkv, o, gate|up with its SiLU product, down; rank 16, a pool of
--num-slots slots) it times what engine/lora/projection.py launches: the shrink on a side stream beside the base
product, then the expand once the main stream has waited for it. Forms (engine/lora/batch.py decode_form):
- bgmv: one token of one adapter (batch-1 decode);
- grouped and dense: --batch tokens spread over U of the pool's slots, U from --used-slots (the dense expand reads
  every slot's B, so it pays for the pool, not for U: where it starts to win is engine/lora/batch.py's
  DENSE_MIN_SLOTS_USED);
and the base product alone for each batch. bgmv and grouped are timed with B in both layouts the Triton kernels can
read (the slot pool's rank-major storage, which the dense form needs, and the contiguous [S, N, rank]). Each time is
a CUDA graph of --layers launches, each on its own copy of the weights and stacks (L2 cold, as in a step):
microseconds per layer, median of --replays replays. On cpu every form runs once and nothing is timed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import kernels as ops
from bench.lora_kernels import time_us
from engine.lora.targets import group_shapes
from engine.random_models import random_model_config
from kernels.lora_indices import lora_indices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="random:<name> shapes (default llama-8b on cuda, llama-tiny on cpu)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--num-slots", type=int, default=16)
    p.add_argument("--used-slots", default="4,8,12,16")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


class Timer:
    def __init__(self, device: torch.device, layers: int, replays: int) -> None:
        self.device, self.layers, self.replays = device, layers, replays

    def per_layer_us(self, run) -> float | None:
        """Microseconds per layer of run() (all layers), from CUDA graph replays; on cpu run once, untimed."""
        if self.device.type != "cuda":
            run()
            return None
        return time_us("cuda", lambda _: run(), 1, self.replays, per=self.layers)


def _layer(shape, slots: int, rank: int, batch: int, device, dtype) -> dict:
    n, k = sum(shape.slice_widths), shape.in_features
    rank_major = torch.randn(slots, rank, n, device=device, dtype=dtype) * 0.02
    return {"a": torch.randn(slots, len(shape.slice_widths) * rank, k, device=device, dtype=dtype) * 0.02,
            "b": {"rank-major": rank_major.transpose(1, 2), "slot-major": rank_major.transpose(1, 2).contiguous()},
            "w": torch.randn(n, k, device=device, dtype=dtype) * 0.02,
            "x": torch.randn(batch, k, device=device, dtype=dtype)}


def time_group(name: str, shape, args, timer: Timer, device, dtype) -> list[dict]:
    offsets = [0, *np.cumsum(shape.slice_widths).tolist()]
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=device)
    layers = [_layer(shape, args.num_slots, args.rank, args.batch, device, dtype) for _ in range(args.layers)]
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    gated = name == "gate_up"

    def step(indices, tokens: int, layout: str | None):
        dense_rank = args.rank if indices is not None and ops.lora_dense_expand(indices, offsets) else None

        def run() -> None:
            for layer in layers:
                x = layer["x"][:tokens]
                if indices is None:
                    y = F.linear(x, layer["w"])
                    if gated:
                        ops.silu_and_mul(y)
                    continue
                shrunk = ops.lora_shrink(x, layer["a"], indices, stream=side, dense_rank=dense_rank)
                y = F.linear(x, layer["w"])
                if side is not None:
                    torch.cuda.current_stream(device).wait_stream(side)
                b = layer["b"][layout]
                if gated:
                    ops.lora_expand_silu_and_mul(y, shrunk, b, offsets_t, offsets, args.rank, indices)
                else:
                    ops.lora_expand_(y, shrunk, b, offsets_t, offsets, args.rank, indices)
        return run

    rows = []

    def record(form: str, tokens: int, used: int, layout: str | None, indices) -> None:
        us = timer.per_layer_us(step(indices, tokens, layout))
        rows.append({"group": name, "form": form, "tokens": tokens, "used_slots": used, "b_layout": layout,
                     "us_per_layer": us})
        shown = "ran, untimed" if us is None else f"{us:8.2f} us"
        print(f"{name:8s} {form:8s} tokens {tokens:3d} slots used {used:3d} B {layout or '-':10s} {shown}",
              flush=True)

    record("base", 1, 0, None, None)
    one = lora_indices(np.zeros(1, dtype=np.int32), device, True, num_slots=args.num_slots)
    for layout in ("rank-major", "slot-major"):
        record("bgmv", 1, 1, layout, one)
    record("base", args.batch, 0, None, None)
    for used in (int(u) for u in args.used_slots.split(",")):
        slots = (np.arange(args.batch) % used).astype(np.int32)
        for form, layout in (("grouped", "rank-major"), ("grouped", "slot-major"), ("dense", "rank-major")):
            indices = lora_indices(slots, device, True, num_slots=args.num_slots, grouped=True, dense=form == "dense")
            record(form, args.batch, used, layout, indices)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":  # the LoRA kernels in Triton's interpreter, chosen before triton is first imported
        if importlib.util.find_spec("triton") is None:
            raise SystemExit("--device cpu runs the Triton kernels in its interpreter: install triton (make install-test)")
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = random_model_config((args.model or ("random:llama-8b" if device.type == "cuda" else "random:llama-tiny"))
                              .removeprefix("random:"))
    timer = Timer(device, args.layers, args.replays)
    rows = []
    triton_for = ops._triton_for
    if device.type != "cuda":  # the Triton path on CPU tensors (the interpreter), for this run only
        ops._triton_for = lambda t: ops._triton_modules()
    try:
        for name, shape in group_shapes(cfg).items():
            rows += time_group(name, shape, args, timer, device, dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        ops._triton_for = triton_for
    if args.json:
        args.json.write_text(json.dumps({"rank": args.rank, "batch": args.batch, "num_slots": args.num_slots,
                                         "layers": args.layers, "rows": rows}, indent=1))
    summary(rows)
    return rows


def summary(rows: list[dict]) -> None:
    """Per form and slots used, the sum over the four groups (a layer), and x32 layers (a step's share, ms)."""
    totals: dict[tuple, float] = {}
    for r in rows:
        if r["us_per_layer"] is None:
            return  # untimed (cpu)
        key = (r["form"], r["tokens"], r["used_slots"], r["b_layout"])
        totals[key] = totals.get(key, 0.0) + r["us_per_layer"]
    print("\nper decoder layer (all four groups):")
    for (form, tokens, used, layout), us in totals.items():
        print(f"  {form:8s} tokens {tokens:3d} slots used {used:3d} B {layout or '-':10s} {us:8.1f} us "
              f"({us * 32 / 1e3:.3f} ms over 32 layers)")


if __name__ == "__main__":
    main()
