"""Several sampled responses per conversation: each sample its own id and seed, every sample accounted for,
kill -9 resume with nothing lost or duplicated, and prompt-format augmentation of the first user turn."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError
from pipeline.regen.stage import run_regen
from pipeline.stage_dir import StageDir
from pipeline.tokenize import run_tokenize
from tests.conftest import make_config
from tests.pipeline.test_regen_stage import kill_regen_after_units, regen_rows, single_turn, write_curated

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLED = ["regen.max_new_tokens=12", "regen.max_samples=null", "regen.temperature=1.0", "regen.samples_per_prompt=3"]


def test_each_conversation_gets_n_distinct_samples_with_their_own_ids(tmp_path):
    cfg = make_config(tmp_path, overrides=SAMPLED)
    write_curated(cfg.run_dir, single_turn(4))
    manifest = run_regen(cfg)
    rows = regen_rows(cfg.run_dir)
    assert sorted(r["id"] for r in rows) == sorted(f"test/{i}#{k}" for i in range(4) for k in range(3))
    c = manifest["counts"]
    assert c["input"] == 12 and c["written"] == 12 and c["failed"] == 0
    by_conv: dict[str, list[str]] = {}
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert json.loads(r["metadata"])["regen"]["sample"] == int(r["id"].rsplit("#", 1)[1])
        by_conv.setdefault(r["id"].rsplit("#", 1)[0], []).append(r["messages"][1]["content"])
    # three draws at T=1 from a random model over a vocabulary of hundreds: identical triples would mean one seed
    assert all(len(set(answers)) > 1 for answers in by_conv.values())
    run_tokenize(cfg)
    assert StageDir(cfg.run_dir, "tokenize").manifest()["counts"]["input"] == 12


def test_prompt_formats_rewrite_the_first_user_turn_of_sample_k(tmp_path):
    formats = json.dumps({"test": ["{prompt}", "Answer briefly. {prompt}"]})
    cfg = make_config(tmp_path, overrides=[*SAMPLED, f"regen.prompt_formats={formats}",  # keyed by a source name
                                           "curate.sources=[{name: test, path: data/prompts/gsm8k_train_1k.jsonl}]"])
    write_curated(cfg.run_dir, single_turn(2))
    run_regen(cfg)
    rows = {r["id"]: r["messages"][0]["content"] for r in regen_rows(cfg.run_dir)}
    from tests.pipeline.test_regen_stage import QUESTIONS

    for i in range(2):
        assert rows[f"test/{i}#0"] == QUESTIONS[i]
        assert rows[f"test/{i}#1"] == f"Answer briefly. {QUESTIONS[i]}"
        assert rows[f"test/{i}#2"] == QUESTIONS[i]  # template 2 mod 2 = 0


def test_samples_and_formats_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="regen.samples_per_prompt: 3 samples need regen.temperature > 0"):
        make_config(tmp_path, overrides=["regen.samples_per_prompt=3"])
    with pytest.raises(ConfigError, match="regen.samples_per_prompt: must be >= 1"):
        make_config(tmp_path, overrides=["regen.samples_per_prompt=0"])
    with pytest.raises(ConfigError, match=r"regen.prompt_formats.gsm8k\[0\]: a template must hold"):
        make_config(tmp_path, overrides=['regen.prompt_formats={"gsm8k": ["no placeholder"]}'])


def test_changing_the_number_of_samples_changes_the_config_hash(tmp_path):
    from pipeline.manifests import CuratedData
    from pipeline.regen.stage import regen_config_record

    one = make_config(tmp_path, overrides=["regen.temperature=1.0"])
    three = make_config(tmp_path, overrides=["regen.temperature=1.0", "regen.samples_per_prompt=3"])
    curated = CuratedData(tmp_path / "curate", config_hash="x", fingerprint={}, counts={}, files=[],
                          train_conversations=None)
    assert regen_config_record(one, curated)[0] != regen_config_record(three, curated)[0]


@pytest.mark.slow
def test_kill_9_during_sampled_regen_then_rerun_loses_and_duplicates_nothing(tmp_path):
    overrides = [*SAMPLED, "regen.shard_size=2", "regen.batch_size=3"]
    cfg = make_config(tmp_path, overrides=overrides)
    write_curated(cfg.run_dir, single_turn(16))
    stage = kill_regen_after_units(tmp_path, cfg, overrides, 2)
    assert not stage.is_complete() and 2 <= len(stage.done_units()) < 8, "the kill must land mid-run"

    manifest = run_regen(cfg)
    assert manifest["counts"]["written"] == 48 and manifest["num_units"] == 8
    resumed = regen_rows(cfg.run_dir)
    ids = [r["id"] for r in resumed]
    assert sorted(ids) == sorted(f"test/{i}#{k}" for i in range(16) for k in range(3)) and len(set(ids)) == 48

    clean = make_config(tmp_path / "clean", overrides=overrides)
    write_curated(clean.run_dir, single_turn(16))
    run_regen(clean)
    assert regen_rows(clean.run_dir) == resumed  # same samples, byte for byte: seeds do not depend on the kill
