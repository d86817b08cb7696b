"""Offline throughput: random token-id prompts through LLM.generate, optionally against HF transformers.

    python -m bench.throughput --model random:llama-1b --device cuda --num-seqs 256 \
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --seed 0 [--compare-hf]

Greedy, ignore_eos, each sequence generating exactly its drawn output length. The workload runs --repeats times
(default 2) on one engine, its token ids shifted each time so the prefix cache cannot serve a later run; tok_s is
the best run's (the first also compiles Triton kernels for shapes the warm-up did not reach). Prints JSON with
tokens, seconds, tok_s, tok_s_runs (and hf_tok_s, ratio with --compare-hf); --json FILE writes it too.
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

import torch

from bench.common import Workload, add_engine_switches, emit, engine_switches, log, random_workload, synchronize, timed
from engine import LLM, SamplingParams

HF_METHOD = (
    "one left-padded batch of all prompts (attention mask, greedy, sdpa attention; bf16 on CUDA, float32 on CPU), "
    "min_new_tokens = max_new_tokens = the longest drawn output length, so no sequence stops early; "
    "hf_tok_s counts only each sequence's own drawn output length (the engine's token count), "
    "hf_tok_s_all counts every generated token including those past a sequence's length"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a path, pkg:<package> or random:<name>")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true", help="also time HF transformers' generate on the same prompts")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int)
    p.add_argument("--sync-scheduling", action="store_true", help="read each step's tokens before the next step")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    add_engine_switches(p)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of the workload; the best is reported")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"device": args.device}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.sync_scheduling:
        kwargs["async_scheduling"] = False
    return kwargs | engine_switches(args)


def params_for(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)


def run_engine(args: argparse.Namespace, work: Workload) -> tuple[dict[str, Any], Workload]:
    """Times the engine; returns its results and the workload as run (folded into the model's vocabulary)."""
    log(f"engine: loading {args.model} on {args.device}")
    llm = LLM(args.model, **engine_kwargs(args))
    work = work.fit_vocab(llm.engine.model_config.vocab_size)
    log(f"engine: loaded in {llm.engine.load_seconds:.1f} s; warm-up")
    # odd lengths and a shared prefix: prefill, mixed and decode steps of shapes Triton specialises on
    # (multiples of 16 or not) compile here rather than inside the timed run
    warm = [work.prompts[0][:n] for n in (37, 64, 101, 150)] + [p[:29] for p in work.prompts[1:4]]
    llm.generate(warm, [params_for(n) for n in (16, 9, 23, 5, 17, 12, 3)])
    vocab = llm.engine.model_config.vocab_size
    runs = []
    for run in range(args.repeats):
        prompts = [[(t + 7919 * run) % vocab for t in p] for p in work.prompts]  # same shapes, no cached prefix
        before = llm.engine.stats()
        log(f"engine: generating {work.num_output_tokens:,} tokens for {len(prompts)} prompts "
            f"(run {run + 1} of {args.repeats})")
        outputs, seconds = timed(args.device, lambda: llm.generate(prompts, [params_for(n) for n in work.output_lens],
                                                                    use_tqdm=True))
        after = llm.engine.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if tokens != work.num_output_tokens:
            raise RuntimeError(f"engine generated {tokens} tokens, expected {work.num_output_tokens}")
        runs.append((seconds, after["num_steps"] - before["num_steps"],
                     after["num_preemptions"] - before["num_preemptions"]))
        log(f"engine: {tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s")
    seconds, num_steps, num_preemptions = min(runs)
    result = {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_s": round(tokens / seconds, 1),
        "tok_s_runs": [round(tokens / s, 1) for s, _, _ in runs],
        "load_seconds": round(llm.engine.load_seconds, 2),
        "num_steps": num_steps,
        "num_preemptions": num_preemptions,
        "kv_blocks_total": after["kv_blocks_total"],
        "max_model_len": llm.engine.max_model_len,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "ttft_p50_s": after["ttft_p50_s"],  # over every request the engine served, warm-up included
        "tpot_p50_s": after["tpot_p50_s"],
        "tensor_parallel_size": llm.engine.config.tensor_parallel_size,
        "async_scheduling": llm.engine.overlap,
        **engine_switches(args),
    }
    llm.close()
    del llm, outputs
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result, work


def load_hf_model(model: str, device: str) -> tuple[torch.nn.Module, int]:
    """The HF reference model with the engine's weights; returns (model, pad token id)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loader import resolve_model_source

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attn = "sdpa"
    source = resolve_model_source(model)
    if source.startswith("random:"):
        from engine.random_models import random_model_config, random_weights

        config = random_model_config(source.removeprefix("random:"))
        hf_dict = config.to_hf_dict()
        hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn)
        # the engine draws the same tensors from the same seeded generator on the same device and dtype
        state = dict(random_weights(config, device, dtype))
        missing, unexpected = hf.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"HF model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        hf.tie_weights()
        pad = 0
    elif source.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source),
                                                  dtype=dtype, attn_implementation=attn).to(device)
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    else:
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn).to(device)
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    return hf.eval(), int(pad)


def left_padded(prompts: list[list[int]], pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_hf(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    log(f"hf: loading {args.model} on {args.device}")
    hf, pad = load_hf_model(args.model, args.device)
    new_tokens = max(work.output_lens)

    def generate(prompts: list[list[int]], n: int) -> torch.Tensor:
        ids, mask = left_padded(prompts, pad, args.device)
        return hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=pad, eos_token_id=None)

    log("hf: warm-up")
    generate([p[:64] for p in work.prompts[:4]], 16)
    synchronize(args.device)
    log(f"hf: generating {new_tokens} new tokens for each of {len(work.prompts)} prompts in one batch")
    out, seconds = timed(args.device, lambda: generate(work.prompts, new_tokens))
    generated = out.shape[0] * (out.shape[1] - max(len(p) for p in work.prompts))
    if generated != len(work.prompts) * new_tokens:
        raise RuntimeError(f"HF generated {generated} tokens, expected {len(work.prompts) * new_tokens}")
    log(f"hf: {seconds:.1f} s, {work.num_output_tokens / seconds:,.0f} useful tok/s")
    del hf, out
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "hf_method": HF_METHOD,
        "hf_seconds": round(seconds, 3),
        "hf_tokens_generated": generated,
        "hf_tok_s": round(work.num_output_tokens / seconds, 1),
        "hf_tok_s_all": round(generated / seconds, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = random_workload(args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, args.seed)
    result: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "num_seqs": args.num_seqs,
        "input_lens": [args.min_input, args.max_input],
        "output_lens": [args.min_output, args.max_output],
        "seed": args.seed,
        "prompt_tokens": sum(len(p) for p in work.prompts),
        "sampling": "greedy, ignore_eos, max_tokens = drawn output length",
        "torch_threads": torch.get_num_threads(),
    }
    engine_result, work = run_engine(args, work)
    result.update(engine_result)
    if args.compare_hf:
        result.update(run_hf(args, work))
        result["ratio"] = round(result["tok_s"] / result["hf_tok_s"], 2)
        result["ratio_vs_hf_all"] = round(result["tok_s"] / result["hf_tok_s_all"], 2)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
