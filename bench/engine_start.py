"""Engine start: a fresh Python process from `LLM(path)` on local safetensors to the first generated token.

    python -m bench.engine_start --model random:llama-8b --device cuda [--json FILE]

First writes the random checkpoint as safetensors under $TMPDIR (or /tmp), untimed, in its own
process, and reuses it when it is already there. Then spawns a fresh interpreter that imports the
engine, builds LLM(path) and generates one token; the clock runs from the spawn, so interpreter
start, imports and CUDA init count. The checkpoint was just written, so it is in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

GOAL_SECONDS = 20.0
_MARK = "ENGINE_START_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-8b", help="random:<name>")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dir", help="checkpoint directory (default: $TMPDIR/tollgate-bench-<name>-<dtype>)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def checkpoint_dir(args: argparse.Namespace, dtype: str) -> str:
    name = args.model.removeprefix("random:")
    return args.dir or os.path.join(tempfile.gettempdir(), f"tollgate-bench-{name}-{dtype}")


def write_checkpoint(name: str, out_dir: str, dtype: str, device: str) -> float:
    """Writes the checkpoint in a separate process (keeps this one off the GPU); returns the seconds it took."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")) and os.path.isfile(os.path.join(out_dir, "config.json")):
        print(f"[engine_start] reusing {out_dir}", file=sys.stderr, flush=True)
        return 0.0
    print(f"[engine_start] writing random:{name} ({dtype}) to {out_dir}", file=sys.stderr, flush=True)
    partial = out_dir + ".partial"
    code = (
        "import sys, torch; from engine.random_models import write_random_checkpoint; "
        "write_random_checkpoint(sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), sys.argv[4])"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, name, partial, dtype, device], check=True)
    os.replace(partial, out_dir)
    return time.perf_counter() - start


def child(path: str, device: str) -> None:
    """Runs in the fresh process: import, construct, first token; prints wall-clock timestamps."""
    started = time.time()
    from engine import LLM, SamplingParams

    imported = time.time()
    llm = LLM(path, device=device)
    constructed = time.time()
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first_token = time.time()
    assert len(out[0].outputs[0].token_ids) == 1
    stamps = {"started": started, "imported": imported, "constructed": constructed, "first_token": first_token,
              "load_seconds": llm.engine.load_seconds, "kv_blocks_total": llm.engine.runner.num_blocks,
              "max_model_len": llm.engine.max_model_len}
    print(_MARK + json.dumps(stamps), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.device)
        return {}
    if not args.model.startswith("random:"):
        raise SystemExit("--model: engine_start writes a random checkpoint; give random:<name>")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    out_dir = checkpoint_dir(args, dtype)
    write_seconds = write_checkpoint(args.model.removeprefix("random:"), out_dir, dtype, args.device)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"[engine_start] spawning a fresh process: LLM({out_dir!r}) to first token", file=sys.stderr, flush=True)
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-m", "bench.engine_start", "--device", args.device, "--child", out_dir],
                          stdout=subprocess.PIPE, text=True)
    done = time.time()
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"engine_start: the child process failed (rc {proc.returncode})")
    s = json.loads(lines[-1].removeprefix(_MARK))
    total = s["first_token"] - spawned
    result = {
        "model": args.model,
        "device": args.device,
        "dtype": dtype,
        "checkpoint": out_dir,
        "checkpoint_bytes": size,
        "checkpoint_write_seconds": round(write_seconds, 1),
        "page_cache": "warm (checkpoint written just before, or reused)",
        "interpreter_start_seconds": round(s["started"] - spawned, 2),
        "import_seconds": round(s["imported"] - s["started"], 2),
        "construct_seconds": round(s["constructed"] - s["imported"], 2),
        "load_seconds": round(s["load_seconds"], 2),
        "first_token_seconds": round(s["first_token"] - s["constructed"], 3),
        "total_seconds": round(total, 2),
        "process_exit_seconds": round(done - s["first_token"], 2),
        "kv_blocks_total": s["kv_blocks_total"],
        "max_model_len": s["max_model_len"],
        "goal_seconds": GOAL_SECONDS,
        "meets_goal": total < GOAL_SECONDS,
    }
    emit_result(result, args.json)
    return result


def emit_result(result: dict, path: str | None) -> None:
    from bench.common import emit

    emit(result, path)


if __name__ == "__main__":
    main()
