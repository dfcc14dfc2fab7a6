"""Damaged features never reach training, and `drafter extract --repair` fixes exactly what is damaged.

Real extractions of the tiny config are damaged the ways disks and copies damage files (a flipped byte, a
truncated shard, a deleted index, a manifest that is not JSON); training refuses each one naming the file and the
repair command; the repair re-extracts only the damaged shard, byte-identical to a clean run, and leaves the good
shards' bytes and mtimes alone; `extract --verify` reports a truncated shard as a finding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from drafter.cli import merge_stage
from extract.stage import repair_extract, run_extract
from extract.store import FeatureReader, check_store
from extract.verify import run_verify
from pipeline.errors import StageError
from pipeline.files import sha256_file
from tests.conftest import CACHE, REPO, make_config
from tests.extract.conftest import write_tokenize_stage

LENGTHS = np.random.default_rng(7).integers(24, 200, size=24).tolist()
TRAIN = ["train.max_steps=null", "train.epochs=1", "train.eval_every=0", "train.save_every=0", "train.log_every=1",
         "train.micro_batch_tokens=512", "train.num_workers=0", "train.eval_fraction=0",
         "train.wandb.mode=disabled"]  # a run that fails in this process leaves no W&B run open for the next test


def config(tmp_path, *overrides):
    return make_config(tmp_path, overrides=["extract.tokens_per_batch=600", "extract.shard_tokens=600", *TRAIN,
                                            *overrides])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One clean extraction of the tiny config (several shards), copied by every test."""
    root = tmp_path_factory.mktemp("clean")
    cfg = config(root)
    write_tokenize_stage(cfg, LENGTHS)
    run_extract(cfg)
    return cfg.run_dir


def copy_run(clean, tmp_path):
    cfg = config(tmp_path)
    shutil.copytree(clean, cfg.run_dir)
    return cfg


def shard_state(run_dir) -> dict[str, tuple[str, int]]:
    return {p.name: (sha256_file(p), p.stat().st_mtime_ns)
            for p in sorted((run_dir / "extract" / "shards").glob("*.safetensors"))}


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the features, same size
    path.write_bytes(bytes(data))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


DAMAGE = {
    "flipped_byte": (lambda shard, run: flip_byte(shard), "sha256 differs from the manifest"),
    "truncated": (lambda shard, run: truncate(shard), "truncated or damaged"),
    "index_deleted": (lambda shard, run: (run / "extract" / "index.parquet").unlink(), "missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_train_refuses_damaged_features_naming_the_file_and_the_repair(clean, tmp_path, damage, one_torch_thread):
    from train.stage import run_train

    cfg = copy_run(clean, tmp_path)
    shard = sorted((cfg.run_dir / "extract" / "shards").glob("*.safetensors"))[1]
    make, symptom = DAMAGE[damage]
    make(shard, cfg.run_dir)
    named = "index.parquet" if damage == "index_deleted" else shard.name
    with pytest.raises(StageError, match=rf"(?s){named}.*{symptom}.*`drafter extract --repair`"):
        run_train(cfg)
    assert not (cfg.run_dir / "train" / "manifest.json").exists()
    assert not (cfg.run_dir / "train" / "metrics.jsonl").exists() or damage == "flipped_byte"
    # a re-run of extract does not call the damaged extraction complete
    if damage != "flipped_byte":  # sizes and headers are checked on every start; a full re-hash is --repair's job
        with pytest.raises(StageError, match=r"(?s)damaged.*--repair"):
            run_extract(cfg)
        with pytest.raises(StageError, match=r"(?s)damaged.*--repair"):
            merge_stage("extract", cfg)  # not "already merged"


@pytest.mark.slow
def test_through_the_cli_a_corrupt_shard_met_in_a_data_loader_worker_is_one_line(clean, tmp_path):
    from tests.train.test_stage_train import subprocess_env

    cfg = copy_run(clean, tmp_path)
    shard = sorted((cfg.run_dir / "extract" / "shards").glob("*.safetensors"))[1]
    flip_byte(shard)
    overrides = ["extract.tokens_per_batch=600", "extract.shard_tokens=600", *TRAIN, "train.num_workers=1"]
    done = subprocess.run([sys.executable, "-m", "drafter.cli", "train", "--config", "configs/tiny.yaml",
                           f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *overrides], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"drafter train: error: {shard}: sha256 differs from the manifest (corrupted); run `drafter extract --repair` "
        "with this run's config (it re-extracts only the damaged shards)")


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_repair_redoes_exactly_the_damaged_shard_byte_identical_and_leaves_good_shards_untouched(clean, tmp_path,
                                                                                                   damage):
    cfg = copy_run(clean, tmp_path)
    before = shard_state(cfg.run_dir)
    assert len(before) >= 3
    shard = sorted((cfg.run_dir / "extract" / "shards").glob("*.safetensors"))[1]
    DAMAGE[damage][0](shard, cfg.run_dir)
    manifest = repair_extract(cfg)
    after = shard_state(cfg.run_dir)
    assert {n: sha for n, (sha, _) in after.items()} == {n: sha for n, (sha, _) in before.items()}  # byte-identical
    touched = {n for n in after if after[n][1] != before[n][1]}
    assert touched == (set() if damage == "index_deleted" else {shard.name})
    assert check_store(cfg.run_dir / "extract") == {}
    assert manifest["counts"]["written"] == len(LENGTHS)
    assert FeatureReader(cfg.run_dir / "extract").ids == [f"fake/{i}" for i in range(len(LENGTHS))]
    # nothing left to repair: a no-op that writes nothing
    again = shard_state(cfg.run_dir)
    index_mtime = (cfg.run_dir / "extract" / "index.parquet").stat().st_mtime_ns
    repair_extract(cfg)
    assert shard_state(cfg.run_dir) == again
    assert (cfg.run_dir / "extract" / "index.parquet").stat().st_mtime_ns == index_mtime


def test_a_manifest_that_is_not_json_is_named_and_repair_rewrites_it(clean, tmp_path):
    cfg = copy_run(clean, tmp_path)
    before = shard_state(cfg.run_dir)
    manifest = cfg.run_dir / "extract" / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    with pytest.raises(StageError, match=rf"{manifest}: not valid JSON"):
        FeatureReader(cfg.run_dir / "extract")
    repair_extract(cfg)
    assert shard_state(cfg.run_dir) == before
    assert json.loads(manifest.read_text())["counts"]["written"] == len(LENGTHS)


def test_verify_reports_a_truncated_shard_as_a_finding_and_checks_the_others(clean, tmp_path, capsys):
    cfg = copy_run(clean, tmp_path)
    shards = sorted((cfg.run_dir / "extract" / "shards").glob("*.safetensors"))
    truncate(shards[1])
    report = run_verify(cfg, against="stored")
    assert not report["passed"] and report["failed_layers"] == []
    assert list(report["file_problems"]) == [str(shards[1])]
    assert {c["shard"] for c in report["checked"]} == {p.name for p in shards} - {shards[1].name}
    out = capsys.readouterr().out
    assert f"damaged: {shards[1]}" in out and "--repair" in out


def test_a_checksum_failure_found_by_verify_says_what_to_run(clean, tmp_path, capsys):
    cfg = copy_run(clean, tmp_path)
    shard = sorted((cfg.run_dir / "extract" / "shards").glob("*.safetensors"))[0]
    flip_byte(shard)
    report = run_verify(cfg, against="stored")
    assert not report["passed"] and "sha256" in report["file_problems"][str(shard)]
    assert "run `drafter extract --repair`" in capsys.readouterr().out
    os.utime(shard)  # (the mtime changes nothing: the repair goes by the bytes)
    repair_extract(cfg)
    assert run_verify(cfg, against="stored")["passed"]
