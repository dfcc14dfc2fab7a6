"""benchmarks/bench_eval_overhead.py runs at the tiny shape on CPU and prints its table (the GPU run uses the same
code at the Qwen3-8B shape)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # runs the benchmark script in a subprocess


def test_overhead_benchmark_prints_a_row_per_budget_and_the_builders_agree():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_eval_overhead.py", "--device", "cpu", "--shape", "tiny", "--past", "64",
         "--budgets", "4,32", "--iters", "1", "--new-tokens", "8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and line.split()[0] in ("4", "32")]
    assert [r[0] for r in rows] == ["4", "32"] and [r[1] for r in rows] == ["5", "33"]
    assert all(r[-1] == "True" for r in rows)  # device builder == heap reference
    assert "ar e2e" in out.stdout and "chain e2e" in out.stdout
