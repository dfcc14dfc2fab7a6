"""The installed `drafter` command in a process of its own, on the probes that used to hang or crash the
interpreter (a FIFO as --config, an alias bomb, YAML nested past Python's recursion limit), a bad value, a launcher
variable, a damaged export handed to eval and a report written over its input: exit 2, one error line on stderr, no
traceback, within the wall-clock bound, every input as it was. (The same classes in process, one case each:
test_one_error_line.py; generated: test_fuzz_*.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.report import write_report
from tests.conftest import CACHE, REPO
from tests.eval.test_report_files import make_report
from tests.reliability.fuzz import assert_one_error_line, digest
from tests.reliability.test_one_error_line import bomb, export_dir, gsm8k_benchmark

TINY = str(REPO / "configs" / "tiny.yaml")
BOUND = 30  # seconds: a process start that imports torch on a loaded 2-core machine, plus the refusal


def drafter(argv: list[str], env: dict | None = None) -> tuple[int, str, float]:
    """Run the console script (`python -m drafter.cli` where it is not installed): (exit status, stderr, seconds).
    A command still running after BOUND seconds is killed and fails the test: it hung."""
    script = Path(sys.executable).parent / "drafter"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "drafter.cli"]
    started = time.monotonic()
    try:
        res = subprocess.run(cmd + argv, cwd=REPO, env={**os.environ, "DRAFTER_NO_PROGRESS": "1", **(env or {})},
                             capture_output=True, text=True, timeout=BOUND, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"drafter {' '.join(argv)} did not answer within {BOUND} s")
    return res.returncode, res.stderr, time.monotonic() - started


def config_case(tmp_path: Path, name: str) -> tuple[list[str], dict, Path, str]:
    """(argv, environment, the input to keep unchanged, what the line says) of a config-side probe."""
    runs = f"runs_dir={tmp_path / 'runs'}"
    path = tmp_path / "run.yaml"
    if name == "fifo":
        os.mkfifo(path)
        return ["tokenize", "--config", str(path), runs], {}, tmp_path, "is a FIFO, not a config file"
    if name in ("alias_bomb", "deep_nesting"):
        path.write_text(bomb() if name == "alias_bomb" else "x: " + "[" * 50000 + "]" * 50000 + "\n")
        says = "through YAML aliases" if name == "alias_bomb" else "nested more than 32 levels deep"
        return ["tokenize", "--config", str(path), runs], {}, path, says
    shutil.copy(TINY, path)
    if name == "inf":
        return ["tokenize", "--config", str(path), runs, "train.lr=inf"], {}, path, "train.lr: inf is not a finite"
    return (["tokenize", "--merge", "--config", str(path), runs], {"RANK": "abc", "WORLD_SIZE": "2"}, path,
            "RANK='abc' is not an integer")


@pytest.mark.parametrize("name", ["fifo", "alias_bomb", "deep_nesting", "inf", "rank_not_an_integer"])
def test_a_config_probe_is_one_line_from_the_installed_command_within_seconds(tmp_path, name):
    argv, env, keep, says = config_case(tmp_path, name)
    before = digest(keep) if keep.is_file() else None
    rc, stderr, seconds = drafter(argv, env)
    line = assert_one_error_line(argv[0], rc, stderr)
    assert says in line and seconds < BOUND, (line, seconds)
    assert before is None or digest(keep) == before
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_eval_of_a_damaged_export_and_a_report_over_its_input_are_one_line_from_the_installed_command(tmp_path):
    out = export_dir(tmp_path)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "block_size": 10 ** 9}))  # would allocate ~TB
    before = digest(out)
    rc, stderr, _ = drafter(["eval", "--config", TINY, f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}",
                             f"eval.drafter={out}", "train.wandb.mode=disabled", gsm8k_benchmark(tmp_path)])
    assert "block_size 1000000000 is out of range" in assert_one_error_line("eval", rc, stderr)
    assert digest(out) == before and not (tmp_path / "runs" / "tiny" / "eval").exists()

    a, b = tmp_path / "a" / "eval", tmp_path / "b" / "eval"
    write_report(make_report("a", [[2, 3]], [[3, 4]]), a)
    write_report(make_report("b", [[1, 2]], [[2, 5]]), b)
    before = digest(a, b)
    rc, stderr, _ = drafter(["report", str(a), str(b), "--out", str(b)])
    assert "would overwrite that run's report.json" in assert_one_error_line("report", rc, stderr)
    assert digest(a, b) == before
