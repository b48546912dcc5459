"""The bench scripts still run (tiny settings); their numbers are read by people, not asserted."""

import subprocess
import sys

from conftest import ROOT


def test_env_throughput_bench_runs():
    out = subprocess.run([sys.executable, "bench/env_throughput.py", "--env", "textcraft", "--sizes", "4",
                          "--seconds", "0.3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "in-process step rate" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [["single", "4"], ["batch", "4"]]
    assert all(r[5] == "0" for r in rows)  # no errors
