"""A py-spy profile of the gateway (and its engine core process) while the serving benchmark's timed runs go on:
where the serving process spends its time under load, summarized per process and thread as the functions with the
most samples (inclusive and self). py-spy samples from outside the process, so the gateway runs unmodified."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any


class GatewayProfile:
    """`with GatewayProfile(pid, out_dir, tag):` records raw stacks of pid and its children into
    out_dir/gateway_stacks_<tag>.txt, and their summary beside it (.json)."""

    def __init__(self, pid: int, out_dir: Path, tag: str, rate_hz: int = 250) -> None:
        self.pid, self.out, self.rate = pid, out_dir / f"gateway_stacks_{tag}.txt", rate_hz
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "GatewayProfile":
        exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if exe is None:
            print("profile: py-spy is not installed; no profile taken", flush=True)
            return self
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([exe, "record", "--pid", str(self.pid), "--subprocesses", "--rate",
                                      str(self.rate), "--format", "raw", "--nonblocking", "--output", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.out.exists():
            summary = summarize_stacks(self.out)
            self.out.with_suffix(".json").write_text(json.dumps(summary, indent=2))


def summarize_stacks(path: Path, top: int = 40) -> dict[str, Any]:
    """Per process-and-thread root: samples, and the functions with the most inclusive and self samples."""
    groups: dict[str, dict[str, Counter]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        root = next((f.split(" -m ")[-1].split()[0] for f in reversed(frames) if f.startswith("process ")), "main")
        g = groups.setdefault(root, {"samples": Counter(), "inclusive": Counter(), "self": Counter()})
        n = int(count)
        g["samples"]["all"] += n
        g["self"][frames[-1]] += n
        for frame in set(frames):
            g["inclusive"][frame] += n
    return {root: {"samples": g["samples"]["all"], "inclusive": g["inclusive"].most_common(top),
                   "self": g["self"].most_common(top)} for root, g in groups.items()}
