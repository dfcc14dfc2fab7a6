"""Stage contract of tokenize under kill -9: a real `drafter tokenize` killed after some units, run again, gives
shards byte-identical to an uninterrupted run of the same regen output, with nothing lost or duplicated and no
finished unit redone (the kill -9 harness of tests/reliability/kill9.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.files import sha256_file
from pipeline.regen.stage import run_regen, write_conversations
from pipeline.stage_dir import StageDir
from pipeline.tokenize import run_tokenize
from tests.conftest import CACHE, REPO, make_config
from tests.reliability.kill9 import kill_when, start_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# regen.backend=none keeps the curated answers (no decoding); one conversation per unit: many small units
OVERRIDES = ["regen.backend=none", "regen.shard_size=1", "regen.max_samples=null"]
CONVERSATIONS = 100


def regenerated_run(root: Path):
    """The config of a run under `root` whose regen stage is complete: CONVERSATIONS made-up two-turn conversations
    (every third one multi-turn), one per unit."""
    cfg = make_config(root, overrides=OVERRIDES)
    rows = []
    for i in range(CONVERSATIONS):
        messages = [{"role": "user", "content": f"question {i}: what is {i} + {i}?"},
                    {"role": "assistant", "content": f"{i} + {i} = {2 * i}. " * (1 + i % 5)}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "and times two?"},
                         {"role": "assistant", "content": f"{4 * i}."}]
        rows.append({"id": f"t/{i}", "source": "t", "metadata": "{}", "messages": messages})
    curate = StageDir(cfg.run_dir, "curate")
    write_conversations(curate.shards / "train-00000.parquet", rows)
    curate.write_manifest(config_hash="curated-for-tests", fingerprint={}, started=time.time())
    run_regen(cfg)
    return cfg


def shards(run_dir: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted((run_dir / "tokenize" / "shards").glob("*.parquet"))}


@pytest.mark.slow
def test_kill_9_during_tokenize_then_rerun_equals_an_uninterrupted_run(tmp_path):
    clean = regenerated_run(tmp_path / "clean")
    cfg = make_config(tmp_path / "killed", overrides=OVERRIDES)  # the same regen output, copied before tokenize
    shutil.copytree(clean.run_dir, cfg.run_dir)
    reference_manifest = run_tokenize(clean)
    reference = shards(clean.run_dir)
    assert len(reference) == CONVERSATIONS

    stage = StageDir(cfg.run_dir, "tokenize")
    argv = ["tokenize", "--config", str(REPO / "configs/tiny.yaml"), f"runs_dir={tmp_path / 'killed' / 'runs'}",
            f"cache_dir={CACHE}", *OVERRIDES]
    kill_when(start_cli(argv), lambda: len(list(stage.shards.glob("*.done.json"))) >= 3, "3 units were done")
    done_before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in stage.shards.glob("*.done.json")}
    assert 3 <= len(done_before) < CONVERSATIONS and not stage.is_complete(), "the kill must land mid-run"

    proc = start_cli(argv)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert shards(cfg.run_dir) == reference  # byte for byte
    for name, (content, mtime) in done_before.items():  # a unit finished before the kill is not redone
        assert (stage.shards / name).read_bytes() == content and (stage.shards / name).stat().st_mtime_ns == mtime
    manifest = stage.manifest()
    assert manifest["counts"] == reference_manifest["counts"] and manifest["counts"]["input"] == CONVERSATIONS
    ids = [i for p in sorted(stage.shards.glob("*.parquet")) for i in pq.read_table(p, columns=["id"])["id"].to_pylist()]
    assert len(ids) == len(set(ids)) == manifest["counts"]["written"]
    assert not list(cfg.run_dir.rglob("*.tmp-*"))


def test_tokenize_in_worker_processes_writes_the_shards_of_one_process_byte_for_byte(tmp_path):
    """`tokenize.workers`: units tokenized by several forked processes at once are the units one process writes
    (byte-identical shards, the same counts), each once, and a worker's failure stops the stage with its error."""
    one = regenerated_run(tmp_path / "one")
    many = make_config(tmp_path / "many", overrides=OVERRIDES + ["tokenize.workers=3"])
    shutil.copytree(one.run_dir, many.run_dir)
    reference_manifest = run_tokenize(make_config(tmp_path / "one", overrides=OVERRIDES + ["tokenize.workers=1"]))
    manifest = run_tokenize(many)
    assert shards(many.run_dir) == shards(one.run_dir) and len(shards(one.run_dir)) == CONVERSATIONS
    assert manifest["counts"] == reference_manifest["counts"]

    broken = make_config(tmp_path / "broken", overrides=OVERRIDES + ["tokenize.workers=2"])
    shutil.copytree(one.run_dir, broken.run_dir)
    shutil.rmtree(broken.run_dir / "tokenize")
    (broken.run_dir / "regen" / "shards" / "00042.parquet").write_bytes(b"not parquet")
    with pytest.raises(Exception, match="00042|parquet|Parquet"):
        run_tokenize(broken)
    assert not (broken.run_dir / "tokenize" / "manifest.json").exists()
