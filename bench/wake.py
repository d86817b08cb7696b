"""Wake from sleep and load from disk: how fast a scaled-to-zero model answers again (issue 36).

    python -m bench.wake --model random:llama-8b --device cuda --repeats 3 [--json FILE]
    python -m bench.wake --model random:llama-tiny --device cpu --repeats 1     # the CPU smoke run

Writes the random checkpoint as safetensors first (reused when there; bf16 on CUDA). Then, in one run:
- read rates of the checkpoint's files, cold (each file's pages dropped from the page cache first with
  posix_fadvise DONTNEED) and warm: a plain sequential read (the floor), safetensors.torch.load_file to the
  device, and the engine's reader (engine/safetensors_reader.py) to the device;
- a fresh process (interpreter, imports, LLM(path), first token), cold; it reads the checkpoint ahead from its
  start, while it imports torch, as the engine core process does;
- in this process, to the first token of a 128-token prompt: wake from level 1, and from level 2 cold and warm.
Each timing --repeats times; the JSON has every run, the summary line the best of each against its goal."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.engine_start import write_checkpoint

PROMPT_TOKENS = 128
GOAL_WAKE_L1_S = 1.5
GOAL_WAKE_L2_WARM_S = 4.0
GOAL_L2_COLD_OVER_FLOOR = 1.2
GOAL_FRESH_OVER_FLOOR_S = 4.0
_MARK = "WAKE_CHILD_RESULT "
READ_BLOCK = 64 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b", help="random:<name>")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096, help="capped at the model's own")
    p.add_argument("--dir", help="checkpoint directory (default: $TMPDIR/tollgate-bench-<name>-<dtype>)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def checkpoint_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def drop_page_cache(files: list[str]) -> None:
    """Asks the kernel to forget the files' pages (they are clean: fsync'd once after writing)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(files: list[str]) -> int:
    """Every byte, in order, through one buffer: the floor any loader stands on."""
    buffer = bytearray(min(READ_BLOCK, max(os.path.getsize(f) for f in files)))
    view, total = memoryview(buffer), 0
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def load_file_read(files: list[str], device: str) -> int:
    import torch
    from safetensors.torch import load_file

    total = 0
    for file in files:
        tensors = load_file(file, device=device)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return total


def engine_reader_read(files: list[str], device: str) -> int:
    import torch

    from engine.safetensors_reader import iter_safetensors

    total = sum(t.numel() * t.element_size() for _, t in iter_safetensors(files, None, device))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return total


def timed_reads(files: list[str], device: str, repeats: int) -> dict[str, Any]:
    readers = {"plain_read": plain_read, "load_file": lambda f: load_file_read(f, device),
               "engine_reader": lambda f: engine_reader_read(f, device)}
    out: dict[str, Any] = {}
    for name, read in readers.items():
        for cache in ("cold", "warm"):
            runs = []
            for _ in range(repeats):
                if cache == "cold":
                    drop_page_cache(files)
                else:
                    read(files)  # the pages in, untimed
                started = time.perf_counter()
                nbytes = read(files)
                seconds = time.perf_counter() - started
                runs.append({"seconds": round(seconds, 4), "bytes": nbytes, "gb_per_s": round(nbytes / seconds / 1e9, 2)})
            out[f"{name}_{cache}"] = {"runs": runs, "best_seconds": min(r["seconds"] for r in runs),
                                      "best_gb_per_s": max(r["gb_per_s"] for r in runs)}
    return out


def prompt_ids(vocab_size: int) -> list[int]:
    return [(7 + 31 * i) % vocab_size for i in range(PROMPT_TOKENS)]


def child(path: str, device: str, max_model_len: int) -> None:
    """In a fresh process: import, build, first token of the prompt; prints wall-clock stamps. It starts reading the
    checkpoint ahead before it imports torch, as the engine core process does (engine/core_process.py)."""
    started = time.time()
    from engine.checkpoint_prefetch import prefetch_checkpoint

    prefetch_checkpoint(path)
    from engine import LLM, SamplingParams

    imported = time.time()
    llm = LLM(path, device=device, max_model_len=max_model_len)
    built = time.time()
    llm.generate([prompt_ids(llm.engine.model_config.vocab_size)], SamplingParams(temperature=0, max_tokens=1))
    done = time.time()
    print(_MARK + json.dumps({"started": started, "imported": imported, "built": built, "first_token": done,
                              "load_seconds": llm.engine.load_seconds}), flush=True)


def fresh_start(path: str, args: argparse.Namespace, files: list[str]) -> dict[str, Any]:
    drop_page_cache(files)
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-m", "bench.wake", "--device", args.device, "--max-model-len",
                           str(args.max_model_len), "--child", path], stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"wake: the fresh process failed (rc {proc.returncode})")
    s = json.loads(lines[-1].removeprefix(_MARK))
    return {"seconds": round(s["first_token"] - spawned, 3), "interpreter_and_imports_seconds":
            round(s["imported"] - spawned, 3), "load_seconds": round(s["load_seconds"], 3),
            "first_token_seconds": round(s["first_token"] - s["built"], 3)}


def timed_wakes(path: str, args: argparse.Namespace, files: list[str]) -> dict[str, Any]:
    from engine import LLM, SamplingParams

    llm = LLM(path, device=args.device, max_model_len=args.max_model_len)
    prompt = prompt_ids(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1)
    expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    out: dict[str, Any] = {}
    for label, level, cold in (("level1", 1, False), ("level2_cold", 2, True), ("level2_warm", 2, False)):
        runs = []
        for _ in range(args.repeats):
            llm.sleep(level)
            if cold:
                drop_page_cache(files)
            started = time.perf_counter()
            wake_seconds = llm.wake()
            got = llm.generate([prompt], params)[0].outputs[0].token_ids
            seconds = time.perf_counter() - started
            if got != expected:
                raise SystemExit(f"wake: after a {label} wake the first token is {got}, before it was {expected}")
            runs.append({"seconds": round(seconds, 3), "wake_seconds": round(wake_seconds, 3)})
        out[label] = {"runs": runs, "best_seconds": min(r["seconds"] for r in runs)}
    llm.sleep(2)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.device, args.max_model_len)
        return {}
    if not args.model.startswith("random:"):
        raise SystemExit("--model: give random:<name>; the benchmark writes its checkpoint")
    from bench.common import emit

    name = args.model.removeprefix("random:")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    import tempfile

    path = args.dir or os.path.join(tempfile.gettempdir(), f"tollgate-bench-{name}-{dtype}")
    write_checkpoint(name, path, dtype, args.device)
    from engine.loader import read_model_config

    args.max_model_len = min(args.max_model_len, read_model_config(path).max_position_embeddings)
    files = checkpoint_files(path)
    nbytes = sum(os.path.getsize(f) for f in files)
    reads = timed_reads(files, args.device, args.repeats)
    fresh = [fresh_start(path, args, files) for _ in range(args.repeats)]
    wakes = timed_wakes(path, args, files)
    floor = reads["plain_read_cold"]["best_seconds"]
    best = {
        "plain_read_cold_gb_per_s": reads["plain_read_cold"]["best_gb_per_s"],
        "load_file_cold_gb_per_s": reads["load_file_cold"]["best_gb_per_s"],
        "engine_reader_cold_gb_per_s": reads["engine_reader_cold"]["best_gb_per_s"],
        "engine_reader_warm_gb_per_s": reads["engine_reader_warm"]["best_gb_per_s"],
        "wake_level1_seconds": wakes["level1"]["best_seconds"],
        "wake_level2_cold_seconds": wakes["level2_cold"]["best_seconds"],
        "wake_level2_warm_seconds": wakes["level2_warm"]["best_seconds"],
        "fresh_process_seconds": min(r["seconds"] for r in fresh),
        "cold_read_floor_seconds": floor,
    }
    goals = {
        "wake_level1": best["wake_level1_seconds"] < GOAL_WAKE_L1_S,
        "wake_level2_cold": best["wake_level2_cold_seconds"] < GOAL_L2_COLD_OVER_FLOOR * floor,
        "wake_level2_warm": best["wake_level2_warm_seconds"] < GOAL_WAKE_L2_WARM_S,
        "fresh_process": best["fresh_process_seconds"] < floor + GOAL_FRESH_OVER_FLOOR_S,
    }
    result = {"model": args.model, "device": args.device, "dtype": dtype, "checkpoint": path,
              "checkpoint_bytes": nbytes, "prompt_tokens": PROMPT_TOKENS, "repeats": args.repeats,
              "reads": reads, "fresh_process": fresh, "wakes": wakes, "best": best, "goals_met": goals}
    emit(result, args.json)
    print(f"wake {args.model} {args.device}: {nbytes / 1e9:.1f} GB; cold read floor {floor:.2f} s "
          f"({best['plain_read_cold_gb_per_s']} GB/s), load_file {best['load_file_cold_gb_per_s']} GB/s, ours "
          f"{best['engine_reader_cold_gb_per_s']} GB/s cold / {best['engine_reader_warm_gb_per_s']} warm; to first "
          f"token: level 1 {best['wake_level1_seconds']:.2f} s, level 2 {best['wake_level2_cold_seconds']:.2f} s "
          f"cold / {best['wake_level2_warm_seconds']:.2f} s warm, fresh process {best['fresh_process_seconds']:.2f} s;"
          f" goals met: {sum(goals.values())}/{len(goals)} {goals}", flush=True)
    return result


if __name__ == "__main__":
    main()
