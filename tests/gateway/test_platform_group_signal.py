"""`platform up` stopped by a signal to its whole process group (`kill -TERM -- -PGID`, systemd's default way to
stop a service): Ray's own processes get it too and their GCS is gone at once. The platform says so and exits in
seconds, instead of waiting 60 s for the GCS and failing inside Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
OWNER = """
import sys
import ray
from gateway.cli.serve import run_until_stopped
from gateway.settings import Settings
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
print("waiting", flush=True)
sys.exit(run_until_stopped(Settings(), owns_platform=True))
"""


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
                members.append(int(entry.name))
    return members


def test_a_sigterm_to_the_whole_group_stops_the_platform_at_once(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOLLGATE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "waiting"
        time.sleep(2)  # run_until_stopped has its handler in place (before, Ray's own aborts the process)
        started = time.monotonic()
        os.killpg(owner.pid, signal.SIGTERM)
        out, _ = owner.communicate(timeout=45)
        took = time.monotonic() - started
    finally:
        if owner.poll() is None or _session_members(owner.pid):
            os.killpg(owner.pid, signal.SIGKILL)
    assert owner.returncode == 1, out[-3000:]
    assert "stopped with the same signal" in out and took < 15, (took, out[-3000:])
    deadline = time.monotonic() + 30
    while _session_members(owner.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session_members(owner.pid)  # none of Ray's processes outlives it
