"""CI's script leaves nothing behind: the fresh clone it tests (with its multi-GB .venv) is removed when the run
ends, failed runs included, so repeated CI runs cannot fill the machine's disk."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_run_removes_its_clone_when_the_tests_fail(tmp_path):
    # A `make` first on PATH stands in for the test run: it records where it ran and fails, as a failing suite does.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "ran_in.txt"
    (bin_dir / "make").write_text(f'#!/bin/sh\npwd > "{record}"\nls > "{record}.files"\nexit 7\n')
    (bin_dir / "make").chmod(0o755)
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(scratch_root),
           "DRAFTER_DATA_DIR": str(tmp_path)}

    run = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=300)

    assert run.returncode == 7, run.stderr  # the suite's failure is CI's failure
    clone = Path(record.read_text().strip())
    assert clone.name == "dflash-pipeline" and clone.parent.parent == scratch_root  # it ran inside a fresh clone
    assert "Makefile" in (Path(f"{record}.files").read_text().split())
    assert not clone.exists() and list(scratch_root.iterdir()) == []  # and the clone is gone
