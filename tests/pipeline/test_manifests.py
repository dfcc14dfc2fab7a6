"""The typed manifest readers of the stage contract (pipeline/manifests.py): every field a later stage reads comes
back typed, and a damaged manifest (not an object, a key missing, a value of another JSON type) is a StageError that
names the file, the field and the command that writes it anew, never a KeyError or TypeError in the consumer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.errors import StageError
from pipeline.manifests import (curate_outputs, extract_outputs, regen_outputs, tokenize_outputs, train_outputs)
from pipeline.stage_dir import StageDir

FINGERPRINTS = {
    "curate": {"schema": "curate.conversation.v1", "sources": {}, "seed": 0},
    "regen": {"target": {"model": "t"}, "tokenizer": {"sha": "x"}, "enable_thinking": False},
    "tokenize": {"target": {"model": "t"}, "tokenizer": {"sha": "x"}, "enable_thinking": False, "max_len": 64},
    "extract": {"target": {"model": "t"}, "tokenizer": {"sha": "x"}, "layer_ids": [1, 3], "last_hidden": True,
                "layer_convention": "dflash:output-of-layer", "hidden_size": 8, "storage_dtype": "bfloat16"},
    "train": {"drafter": {"block_size": 8, "num_hidden_layers": 1},
              "features": {"tokenizer": {"sha": "x"}, "layer_ids": [1, 3]}},
}
COUNTS = {"curate": {"train": 5, "eval": 1}, "regen": {"written": 5}, "tokenize": {"written": 5, "tokens": 80},
          "extract": {"written": 5}, "train": {"steps": 3}}
READERS = {"curate": curate_outputs, "regen": regen_outputs, "tokenize": tokenize_outputs, "extract": extract_outputs,
           "train": lambda run_dir: train_outputs(Path(run_dir) / "train")}


def finished_stage(run_dir: Path, name: str) -> Path:
    """A finished stage as StageDir writes it (two units of shard files, then the manifest); returns the manifest."""
    stage = StageDir(run_dir, name)
    stage.begin("hash-" + name)
    for unit in ("00000", "00001"):
        path = stage.shard_path(unit, "parquet")
        path.write_bytes(b"rows of " + unit.encode())
        stage.finish_unit(unit, [path])
    stage.write_manifest(config_hash="hash-" + name, fingerprint=FINGERPRINTS[name], counts=COUNTS[name],
                         started=time.time())
    return stage.manifest_path


def test_each_reader_returns_the_fields_its_consumers_read(tmp_path):
    for name in READERS:
        finished_stage(tmp_path, name)
    curated = curate_outputs(tmp_path)
    assert (curated.config_hash, curated.train_conversations) == ("hash-curate", 5)
    assert curated.ref() == {"path": str(tmp_path / "curate"), "config_hash": "hash-curate",
                             "fingerprint": FINGERPRINTS["curate"]}
    assert regen_outputs(tmp_path).units == ["00000", "00001"]
    tokenized = tokenize_outputs(tmp_path)
    assert (tokenized.samples, tokenized.tokens, tokenized.fingerprint["max_len"]) == (5, 80, 64)
    features = extract_outputs(tmp_path)
    assert (features.layer_ids, features.last_hidden) == ([1, 3], True)
    trained = train_outputs(tmp_path / "train")
    assert (trained.tokenizer, trained.layer_ids, trained.drafter["block_size"]) == ({"sha": "x"}, [1, 3], 8)


def damage(manifest: Path, edit) -> None:
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_text(json.dumps(data))


DAMAGE = [  # (stage, what is done to its manifest, the field the error names, how it names what is wrong)
    ("curate", lambda m: m.pop("config_hash"), "config_hash", "is missing"),
    ("curate", lambda m: m["counts"].update(train="5"), "counts.train", "is a string, not an integer"),
    ("regen", lambda m: m.update(files={"00000.parquet": {}}), "files", "is an object, not a list"),
    ("tokenize", lambda m: m.update(fingerprint=["target", "tokenizer"]), "fingerprint", "is a list, not an object"),
    ("tokenize", lambda m: m.update(counts=None), "counts", "is missing"),
    ("extract", lambda m: m["fingerprint"].pop("layer_ids"), "fingerprint.layer_ids", "is missing"),
    ("extract", lambda m: m["fingerprint"].update(layer_ids="1,3"), "fingerprint.layer_ids", "is a string, not a list"),
    ("extract", lambda m: m["fingerprint"].update(layer_ids=[1, "3"]), "fingerprint.layer_ids", "not an integer"),
    ("train", lambda m: m["fingerprint"].update(features=[1, 3]), "fingerprint.features", "is a list, not an object"),
    ("train", lambda m: m["fingerprint"].pop("drafter"), "fingerprint.drafter", "is missing"),
]


@pytest.mark.parametrize("stage,edit,field,problem", DAMAGE, ids=[f"{d[0]}-{d[2]}-{i}" for i, d in enumerate(DAMAGE)])
def test_a_damaged_manifest_is_a_stage_error_naming_the_file_the_field_and_what_to_run(tmp_path, stage, edit,
                                                                                        field, problem):
    manifest = finished_stage(tmp_path, stage)
    damage(manifest, edit)
    with pytest.raises(StageError) as e:
        READERS[stage](tmp_path)
    text = str(e.value)
    assert str(manifest) in text and field in text and problem in text, text
    assert f"`drafter {stage}`" in text and f"`drafter {stage} --force`" in text, text


@pytest.mark.parametrize("content", ["[1, 2]", '"a manifest"', "{not json"])
def test_a_manifest_that_is_not_a_json_object_is_refused_naming_it(tmp_path, content):
    manifest = finished_stage(tmp_path, "tokenize")
    manifest.write_text(content)
    with pytest.raises(StageError, match=r"(?s)tokenize/manifest\.json.*drafter tokenize"):
        tokenize_outputs(tmp_path)


def test_a_stage_that_has_not_finished_says_which_command_to_run(tmp_path):
    with pytest.raises(StageError, match=r"stage 'regen' has no manifest .*run `drafter regen` first"):
        regen_outputs(tmp_path)
