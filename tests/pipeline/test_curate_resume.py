"""Stage contract of curate: kill -9 at any point and re-run gives byte-identical output with nothing
lost or duplicated; a finished stage re-runs as a no-op; another config is refused without --force."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config import load_config
from pipeline.curate.stage import run_curate
from pipeline.curate.synthetic import write_synthetic
from pipeline.errors import StageError
from pipeline.files import read_json, sha256_file
from tests.reliability.kill9 import kill_when
from tests.reliability.kill9 import start_cli as start_drafter

REPO = Path(__file__).resolve().parents[2]
N = 30000


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("curate_resume")
    return root, write_synthetic(root / "data", N, seed=3)


def write_config(root: Path, name: str, sources: list, **curate) -> Path:
    data = {"name": name, "runs_dir": str(root / "runs"),
            "curate": {"sources": sources, "total": 25000, "eval_size": 300, "read_chunk": 2500,
                       "shard_size": 800, **curate}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_cli(config: Path, *extra: str) -> subprocess.Popen:
    return start_drafter(["curate", "--config", str(config), *extra])


def output(run_dir: Path) -> dict[str, str]:
    shards = run_dir / "curate" / "shards"
    return {p.name: sha256_file(p) for p in sorted(shards.glob("*.parquet"))}


def all_ids(run_dir: Path) -> list[str]:
    shards = sorted((run_dir / "curate" / "shards").glob("*.parquet"))
    return [i for p in shards for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()]


@pytest.mark.slow
def test_kill_9_while_reading_and_while_writing_then_resume_gives_identical_output(synthetic):
    root, data = synthetic
    sources = data["sources"]
    # the reference: one uninterrupted run, in this process, one worker
    ref_cfg = load_config(write_config(root, "ref", sources, num_workers=1))
    ref_manifest = run_curate(ref_cfg)
    reference = output(ref_cfg.run_dir)
    assert len(reference) == 32 + 1  # 25000/800 train shards + 1 eval shard
    ids = all_ids(ref_cfg.run_dir)
    assert len(ids) == len(set(ids)) == 25300

    # killed during the reading phase, after the first chunk was checkpointed (2 workers this time)
    cfg_path = write_config(root, "killed_read", sources, num_workers=2)
    stage = root / "runs" / "killed_read" / "curate"
    proc = start_cli(cfg_path)
    kill_when(proc, lambda: any((stage / "work" / "shards").glob("*.done.json")), "a chunk was done")
    done_chunks = len(list((stage / "work" / "shards").glob("*.done.json")))
    assert 1 <= done_chunks < 12 and not (stage / "manifest.json").exists()
    proc = start_cli(cfg_path)
    assert proc.wait() == 0, proc.stderr.read().decode()[-2000:]
    assert output(stage.parent) == reference

    # killed during the writing phase, after the first output shard was done
    cfg_path = write_config(root, "killed_write", sources, num_workers=1)
    stage = root / "runs" / "killed_write" / "curate"
    proc = start_cli(cfg_path)
    kill_when(proc, lambda: (stage / "shards" / "train-00000.done.json").exists(), "an output shard was done")
    written = len(list((stage / "shards").glob("*.done.json")))
    assert 1 <= written < len(reference) and not (stage / "manifest.json").exists()
    proc = start_cli(cfg_path)
    assert proc.wait() == 0, proc.stderr.read().decode()[-2000:]
    assert output(stage.parent) == reference
    manifest = read_json(stage / "manifest.json")
    assert manifest["counts"] == ref_manifest["counts"]
    assert {f["name"]: f["sha256"] for f in manifest["files"]} == reference
    assert not (stage / "work").exists()  # the work files are removed once the manifest is written


@pytest.mark.slow
def test_finished_stage_reruns_as_a_noop_and_refuses_another_config(synthetic):
    root, data = synthetic
    sources = [dict(s, max_samples=4000) for s in data["sources"]]
    cfg = load_config(write_config(root, "noop", sources, total=8000, eval_size=50))
    run_curate(cfg)
    stage = cfg.run_dir / "curate"

    def files():  # config.yaml is the CLI's copy of the resolved config, rewritten on every call
        return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in stage.rglob("*")
                if p.is_file() and p.name != "config.yaml"}

    before = files()
    proc = start_cli(root / "noop.yaml")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"already complete" in out
    assert files() == before

    changed = load_config(write_config(root, "noop", sources, total=7000, eval_size=50))
    with pytest.raises(StageError, match=r"made with another config, changed:\n  curate.total: 8000 -> 7000\n"
                                         r"pass --force"):
        run_curate(changed)
    assert run_curate(changed, force=True)["counts"]["train"] == 7000


@pytest.mark.slow
def test_a_second_curate_on_the_same_run_is_refused_naming_the_first_and_a_killed_runs_lock_is_taken_over(synthetic):
    root, data = synthetic
    cfg_path = write_config(root, "twice", data["sources"])
    stage = root / "runs" / "twice" / "curate"
    first = start_cli(cfg_path)
    lock = stage / "lock"
    deadline = time.time() + 120
    while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()):
        assert first.poll() is None and time.time() < deadline, first.stderr.read().decode()[-2000:]
        time.sleep(0.005)
    os.killpg(first.pid, signal.SIGSTOP)  # the first run holds the lock, mid-way, for as long as the test needs
    try:
        second = subprocess.run([sys.executable, "-m", "drafter.cli", "curate", "--config", str(cfg_path)],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"stage 'curate' at {stage} is in use by pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert "wait for that run to finish" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # now the holder dies without releasing its lock
        first.wait()
    assert not (stage / "manifest.json").exists()
    third = start_cli(cfg_path)
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err.decode()[-2000:]
    assert f"taking over the lock of pid {first.pid}" in err.decode()
    counts = read_json(stage / "manifest.json")["counts"]
    assert (counts["train"], counts["eval"]) == (25000, 300)
    ids = all_ids(stage.parent)
    assert len(ids) == len(set(ids)) == 25300
