"""The extract stage end to end on tiny random targets: per-layer parity, verify, fingerprints, bad input,
rank slices + merge, kill -9 resume, corruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from extract.layers import forward_taps
from drafter.cli import merge_stage
from extract.stage import check_disk_space, run_extract
from extract.store import FeatureReader, bytes_per_token, check_store
from extract.verify import run_verify
from pipeline.errors import FingerprintMismatch, StageError
from pipeline.files import read_json
from pipeline.stage_dir import RankInfo
from pipeline.target import load_target, materialize_target
from tests.extract.conftest import DISTINCT_LAYERS, extract_config, write_tokenize_stage

LENGTHS = [300, 7, 129, 64, 64, 250, 1, 33, 180, 90, 12, 75, 200, 45]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5_text"])
def test_batched_extraction_equals_unbatched_forward_per_layer(tmp_path, arch):
    cfg = extract_config(tmp_path, f"target.model=random:{arch}", DISTINCT_LAYERS, "extract.storage_dtype=float32",
                         "extract.verify_min_cosine=0.99999")
    write_tokenize_stage(cfg, LENGTHS)
    manifest = run_extract(cfg)
    assert manifest["counts"]["written"] == len(LENGTHS) and manifest["num_units"] > 1
    reader = FeatureReader(cfg.run_dir / "extract")
    assert reader.layer_ids == [1, 3, 5] and reader.fingerprint["layer_convention"] == "dflash:output-of-layer"
    model = load_target(materialize_target(cfg.target, cfg.cache_dir), cfg.target)
    D = model.config.hidden_size
    for i in range(len(reader)):
        s = reader.sample(i)
        ref = forward_taps(model, s["input_ids"][None], reader.layer_ids)[0]
        for j in range(3):  # per layer, against the canonical convention
            torch.testing.assert_close(s["features"][:, j * D:(j + 1) * D], ref[:, j * D:(j + 1) * D], rtol=1e-4, atol=1e-4)
    report = run_verify(cfg, against="stored")
    assert report["passed"] and all(r["rel"] < 1e-5 for r in report["layers"])


def test_last_hidden_is_stored_as_one_more_tap_after_the_drafters_and_verified(tmp_path):
    """extract.last_hidden: the features end with tap L-1 (the last layer's pre-norm output, whose final norm + LM
    head is the target's distribution), the fingerprint says so, and verify checks that column too."""
    cfg = extract_config(tmp_path, DISTINCT_LAYERS, "extract.storage_dtype=float32", "extract.last_hidden=true",
                         "extract.verify_min_cosine=0.99999")
    write_tokenize_stage(cfg, LENGTHS[:6])
    manifest = run_extract(cfg)
    reader = FeatureReader(cfg.run_dir / "extract")
    model = load_target(materialize_target(cfg.target, cfg.cache_dir), cfg.target)
    D, L = model.config.hidden_size, model.config.num_hidden_layers
    assert reader.layer_ids == [1, 3, 5] and reader.fingerprint["last_hidden"] is True
    assert reader.feature_dim == 4 * D and manifest["storage"]["bytes_per_token"] == bytes_per_token(4, D, "float32")
    s = reader.sample(0)
    with torch.no_grad():
        out = model.model(s["input_ids"][None])  # post-norm last hidden state
    torch.testing.assert_close(model.model.norm(s["features"][:, -D:]), out.last_hidden_state[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s["features"][:, -D:], forward_taps(model, s["input_ids"][None], [L - 1])[0])
    report = run_verify(cfg, against="stored")
    assert report["passed"] and [r["layer"] for r in report["layers"]] == [1, 3, 5, L - 1]


def test_verify_detects_an_off_by_one_layer_set(tmp_path):
    """Features of layers [0, 2, 4] labelled as the config's [1, 3, 5] (the classic +1 bug) must fail."""
    cfg = extract_config(tmp_path, DISTINCT_LAYERS, "extract.layer_ids=[0,2,4]")
    write_tokenize_stage(cfg, LENGTHS)
    run_extract(cfg)
    manifest_path = cfg.run_dir / "extract" / "manifest.json"
    manifest = read_json(manifest_path)
    manifest["fingerprint"]["layer_ids"] = [1, 3, 5]  # what a buggy backend would claim
    manifest_path.write_text(json.dumps(manifest))
    cfg_right = extract_config(tmp_path, DISTINCT_LAYERS, "extract.layer_ids=[1,3,5]")
    report = run_verify(cfg_right, against="stored")
    assert not report["passed"] and report["failed_layers"] == [1, 3, 5]
    assert max(r["cos_mean"] for r in report["layers"]) < 0.99
    # the honest extraction of [1, 3, 5] passes
    run_extract(cfg_right, force=True)
    assert run_verify(cfg_right, against="stored")["passed"]


def test_verify_against_the_hf_backend_checks_batching(tmp_path):
    cfg = extract_config(tmp_path, DISTINCT_LAYERS)
    write_tokenize_stage(cfg, LENGTHS)
    report = run_verify(cfg, against="hf")
    assert report["passed"] and report["samples"] == 6
    assert all(r["cos_min"] > 0.9999 for r in report["layers"])  # bf16 storage vs fp32 reference


def test_corrupted_shard_fails_verify(tmp_path):
    cfg = extract_config(tmp_path)
    write_tokenize_stage(cfg, LENGTHS)
    run_extract(cfg)
    shard = sorted((cfg.run_dir / "extract" / "shards").glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x55]))
    report = run_verify(cfg, against="stored")
    assert not report["passed"]
    assert list(report["file_problems"]) == [str(shard)] and "sha256" in report["file_problems"][str(shard)]


def test_refuses_tokenize_output_made_with_another_tokenizer(tmp_path):
    cfg = extract_config(tmp_path)
    stage = write_tokenize_stage(cfg, LENGTHS)
    m = read_json(stage.manifest_path)
    m["fingerprint"]["tokenizer"]["vocab_sha"] = "0123456789abcdef"
    stage.manifest_path.write_text(json.dumps(m))
    with pytest.raises(FingerprintMismatch, match="tokenizer.vocab_sha"):
        run_extract(cfg)
    assert not (cfg.run_dir / "extract" / "manifest.json").exists()


def test_a_damaged_tokenize_manifest_is_refused_naming_it_not_a_type_error(tmp_path):
    """The stage reads its input's manifest through the typed reader (pipeline/manifests.py): a fingerprint that is
    not a JSON object is a StageError naming the file, the field and what to run, before any unit starts."""
    cfg = extract_config(tmp_path)
    stage = write_tokenize_stage(cfg, LENGTHS)
    m = read_json(stage.manifest_path)
    m["fingerprint"] = list(m["fingerprint"])
    stage.manifest_path.write_text(json.dumps(m))
    with pytest.raises(StageError, match=r"(?s)tokenize/manifest\.json: field 'fingerprint' is a list, not an "
                                         r"object.*`drafter tokenize --force`"):
        run_extract(cfg)
    assert not (cfg.run_dir / "extract").exists()


def test_a_finished_extraction_refuses_another_config_naming_the_changed_keys(tmp_path):
    cfg = extract_config(tmp_path)
    write_tokenize_stage(cfg, LENGTHS[:4])
    run_extract(cfg)
    changed = extract_config(tmp_path, "extract.shard_tokens=300", "extract.layer_ids=[0,2,4]")
    with pytest.raises(StageError, match=r"another config, changed:\n  extract.shard_tokens: 600 -> 300\n"
                                         r"  fingerprint.layer_ids: \[1, 3, 5\] -> \[0, 2, 4\]\npass --force"):
        run_extract(changed)


def test_bad_samples_are_counted_with_reasons_not_crashing(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = extract_config(tmp_path)
    stage = write_tokenize_stage(cfg, LENGTHS)
    bad = pa.Table.from_pylist([
        {"id": "bad/oov", "input_ids": [5, 99999, 6], "loss_mask": [0, 1, 1], "num_tokens": 3, "num_loss_tokens": 2},
        {"id": "bad/mask", "input_ids": [5, 6, 7], "loss_mask": [1], "num_tokens": 3, "num_loss_tokens": 1},
        {"id": "bad/empty", "input_ids": [], "loss_mask": [], "num_tokens": 0, "num_loss_tokens": 0},
        {"id": "fake/0", "input_ids": [5, 6], "loss_mask": [1, 1], "num_tokens": 2, "num_loss_tokens": 2},
    ], schema=pq.read_schema(next(stage.shards.glob("*.parquet"))))
    pq.write_table(bad, stage.shards / "99999.parquet")
    manifest = run_extract(cfg)
    c = manifest["counts"]
    assert c["input"] == len(LENGTHS) + 4 and c["written"] == len(LENGTHS)
    assert (c["dropped.token_id_out_of_range"], c["dropped.mask_length_mismatch"], c["dropped.empty"],
            c["dropped.duplicate_id"]) == (1, 1, 1, 1)
    assert manifest["failure_examples"]["token_id_out_of_range"] == ["bad/oov"]


def test_disjoint_rank_slices_cover_every_sample_exactly_once_after_merge(tmp_path):
    cfg = extract_config(tmp_path, "extract.shard_tokens=300")
    write_tokenize_stage(cfg, LENGTHS)
    summaries = [run_extract(cfg, ranks=RankInfo(0, 3)), run_extract(cfg, ranks=RankInfo(2, 3))]
    with pytest.raises(StageError, match="not done"):
        merge_stage("extract", cfg)  # rank 1 has not run
    summaries.append(run_extract(cfg, ranks=RankInfo(1, 3)))
    units = [u for s in summaries for u in s["units"]]
    assert len(units) == len(set(units)) and len(units) > 3
    manifest = merge_stage("extract", cfg)
    reader = FeatureReader(cfg.run_dir / "extract")
    assert sorted(reader.ids) == sorted(f"fake/{i}" for i in range(len(LENGTHS)))
    assert reader.ids == [f"fake/{i}" for i in range(len(LENGTHS))]  # index order = tokenize order
    assert manifest["counts"]["tokens"] == sum(LENGTHS) == int(reader.lengths.sum())
    assert merge_stage("extract", cfg)["finished_at"] == manifest["finished_at"]  # idempotent
    assert run_extract(cfg)["finished_at"] == manifest["finished_at"]  # a finished stage is a no-op


def test_disk_space_check_names_the_numbers(tmp_path):
    per_token = bytes_per_token(5, 4096, "bfloat16")
    with pytest.raises(StageError, match="not enough disk space.*storage_dtype=fp8"):
        check_disk_space(tmp_path, remaining_tokens=10 ** 15, per_token=per_token)
    assert check_disk_space(tmp_path, remaining_tokens=1000, per_token=per_token) > 0


@pytest.mark.slow
def test_kill_9_then_rerun_resumes_with_nothing_lost_or_duplicated(tmp_path):
    from pipeline.config import save_config

    cfg = extract_config(tmp_path, "extract.shard_tokens=2000", "extract.tokens_per_batch=512",
                         "target.random_init={hidden_size: 256, intermediate_size: 768, num_attention_heads: 4, head_dim: 64}")
    lengths = np.random.default_rng(0).integers(20, 400, size=160).tolist()
    write_tokenize_stage(cfg, lengths)
    cfg_path = tmp_path / "cfg.yaml"
    save_config(cfg, cfg_path)
    materialize_target(cfg.target, cfg.cache_dir)  # build the target here, not inside the timed child
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTER_NO_PROGRESS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "drafter.cli", "extract", "--config", str(cfg_path)],
                             cwd=os.getcwd(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shards = cfg.run_dir / "extract" / "shards"
    deadline = time.time() + 120
    while len(list(shards.glob("*.done.json"))) < 2:
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done_before = {p.name: p.stat().st_mtime_ns for p in shards.glob("*.done.json")}
    assert not (cfg.run_dir / "extract" / "manifest.json").exists(), "the child finished before it was killed"
    total_units = int(np.ceil(sum(lengths) / 2000))
    assert len(done_before) < total_units
    manifest = run_extract(cfg)  # resume in-process
    assert {p.name: p.stat().st_mtime_ns for p in shards.glob("*.done.json") if p.name in done_before} == done_before
    assert not list(shards.glob("*.tmp-*"))
    reader = FeatureReader(cfg.run_dir / "extract")
    assert reader.ids == [f"fake/{i}" for i in range(len(lengths))]
    assert reader.lengths.tolist() == lengths
    assert manifest["counts"]["written"] == len(lengths)
    assert check_store(cfg.run_dir / "extract") == {}
