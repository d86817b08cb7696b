"""bench/gateway.py end to end on the bundled model with a handful of requests (the BENCHMARKS.md runs use 150)."""
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "gateway.py"


def test_gateway_benchmark_runs_every_key_path_against_a_bare_route():
    done = subprocess.run([sys.executable, str(BENCH), "--requests", "3", "--concurrency", "2", "--seconds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "key without limits" in done.stdout and "budget leases" in done.stdout
    assert "a SQL reservation per request" in done.stdout
    assert "bare HTTP route" in done.stdout
    assert done.stdout.count("added over the engine") == 4
    assert done.stdout.count("added over the bare route") == 3
    assert "sustained:" in done.stdout
