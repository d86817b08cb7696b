"""Two models taking turns on one GPU (issue 36): two engines in one process, each in its share of the device's
memory; every few seconds the one awake goes to sleep (level 1) and the other wakes to answer a request. Reports
each switch's time to the first token (from the sleep of the one to the first token of the other) and checks that
each model's greedy tokens never change.

    python -m bench.model_switch --model random:llama-8b --device cuda --switches 6 [--json FILE]
    python -m bench.model_switch --model random:llama-tiny --device cpu --switches 2      # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 16
GOAL_SWITCH_S = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b", help="a path, pkg:<package> or random:<name>")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--switches", type=int, default=6)
    p.add_argument("--pause-s", type=float, default=2.0, help="the time between two switches")
    p.add_argument("--memory-share", type=float, default=0.4, help="each engine's gpu_memory_utilization")
    p.add_argument("--no-sleep-mode", action="store_true",
                   help="leave EngineConfig.enable_sleep_mode off: the first sleep pins its host buffer")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from engine import LLM, SamplingParams

    fields: dict[str, Any] = dict(device=args.device, max_model_len=1024, max_num_seqs=8)
    if args.device == "cuda":
        fields["gpu_memory_utilization"] = args.memory_share
        fields["enable_sleep_mode"] = not args.no_sleep_mode
    else:
        fields["num_kv_blocks"] = 64
    engines = [LLM(args.model, **fields), LLM(args.model, **fields)]
    vocab = engines[0].engine.model_config.vocab_size
    prompts = [[(7 + 13 * i + 31 * k) % vocab for i in range(PROMPT_TOKENS)] for k in range(2)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    expected = [engines[k].generate([prompts[k]], params)[0].outputs[0].token_ids for k in range(2)]
    engines[1].sleep(1)
    switches, unchanged = [], True
    awake = 0
    for n in range(args.switches):
        time.sleep(args.pause_s)
        start = time.monotonic()
        engines[awake].sleep(1)
        slept = time.monotonic()
        awake = 1 - awake
        wake_s = engines[awake].wake()
        out = engines[awake].generate([prompts[awake]], params)[0]
        first = out.metrics.first_token_time
        tokens = out.outputs[0].token_ids
        unchanged &= tokens == expected[awake]
        switches.append({"switch": n + 1, "to": awake, "sleep_s": round(slept - start, 4), "wake_s": round(wake_s, 4),
                         "to_first_token_s": round(first - start, 4), "tokens_unchanged": tokens == expected[awake]})
        print(f"switch {n + 1} to model {awake}: sleep {slept - start:.3f} s, wake {wake_s:.3f} s, first token "
              f"{first - start:.3f} s after the switch began; tokens unchanged: {tokens == expected[awake]}",
              flush=True)
    firsts = [s["to_first_token_s"] for s in switches]
    result = {
        "model": args.model, "device": args.device, "memory_share": args.memory_share, "prompt_tokens": PROMPT_TOKENS,
        "switches": switches, "to_first_token_s": {"max": max(firsts), "median": statistics.median(firsts)},
        "tokens_unchanged": unchanged, "goal_s": GOAL_SWITCH_S,
        "goal_met": unchanged and max(firsts) < GOAL_SWITCH_S,
    }
    print(f"model switch {args.model} {args.device}: {len(switches)} switches, to first token median "
          f"{result['to_first_token_s']['median']:.3f} s, max {max(firsts):.3f} s (goal < {GOAL_SWITCH_S} s); greedy "
          f"tokens unchanged: {unchanged}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
