"""eval input checks that need no decoding: drafter/target fit, hybrid-target DDTree skip, unit plan,
drafter location and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from eval.engine.cache.interface import tree_unsupported_reason
from eval.drafter_inputs import check_drafter_fits_target, drafter_dir, trained_drafter
from eval.stage import run_eval
from eval.units import Unit, plan_units
from pipeline.config import ConfigError, TargetConfig, load_config
from pipeline.errors import StageError
from pipeline.target import materialize_target

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"


def make_config(tmp_path: Path, overrides: list[str] = ()):
    return load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *overrides])


def target_config(model: str):
    return AutoConfig.from_pretrained(materialize_target(TargetConfig(model=model), CACHE))


def zlab_config(**over):
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "vocab_size": 320, "num_target_layers": 8,
           "block_size": 8, "dflash_config": {"mask_token_id": 259, "target_layer_ids": [1, 4, 6]}}
    cfg.update(over)
    return cfg


def test_a_drafter_built_for_this_target_is_accepted_and_its_taps_are_the_exports():
    assert check_drafter_fits_target(zlab_config(), target_config("random:qwen3"), None) == [1, 4, 6]
    assert check_drafter_fits_target(zlab_config(), target_config("random:qwen3"), [1, 4, 6]) == [1, 4, 6]


def test_an_export_whose_taps_differ_from_the_features_it_was_trained_on_is_refused():
    with pytest.raises(StageError, match=r"target_layer_ids: \[1, 4, 6\], but the features it was trained on "
                                         r"tapped \[1, 3, 6\]"):
        check_drafter_fits_target(zlab_config(), target_config("random:qwen3"), [1, 3, 6])


@pytest.mark.parametrize("over, field", [
    ({"hidden_size": 128}, "hidden_size: drafter 128, target 64"),
    ({"vocab_size": 151936}, "vocab_size: drafter 151936, target 320"),
    ({"num_target_layers": 36}, "num_target_layers: drafter was built for 36, the target has 8"),
    ({"dflash_config": {"mask_token_id": 259, "target_layer_ids": [1, 17, 33]}},
     "target_layer_ids: layer_ids [1, 17, 33] out of range for a target with 8 decoder layers"),
    ({"dflash_config": {"mask_token_id": 259, "target_layer_ids": [4, 1, 6]}},
     "target_layer_ids: layer_ids [4, 1, 6] must be strictly increasing"),
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 4, 6]}},
     "mask_token_id: 151669 is not a row of the target vocabulary"),
])
def test_a_drafter_for_another_target_is_refused_naming_the_field(over, field):
    with pytest.raises(StageError, match="does not fit this target") as e:
        check_drafter_fits_target(zlab_config(**over), target_config("random:qwen3"), None)
    assert field in str(e.value)


def test_ddtree_is_refused_with_a_reason_only_where_no_tree_can_be_verified():
    assert tree_unsupported_reason(target_config("random:qwen3")) is None
    assert tree_unsupported_reason(target_config("random:qwen3_5_text")) is None  # hybrids: walked along the tree
    for name in ("random:qwen3", "random:qwen3_5_text"):  # a hybrid's attention layers take the tree mask too
        flash = target_config(name)
        flash._attn_implementation = "flash_attention_2"  # no arbitrary 4-D masks
        assert "cannot take a 4-D tree mask" in tree_unsupported_reason(flash)


def test_units_cover_every_benchmark_method_and_budget(tmp_path):
    three = "eval.benchmarks=[{name: gsm8k, path: a.jsonl}, {name: humaneval, path: b.jsonl}, {name: held_out}]"
    cfg = make_config(tmp_path, overrides=[three])  # 3 benchmarks x ar, chain, ddtree@{4,16} (tiny)
    units, skipped = plan_units(cfg, None)
    assert [u.name for u in units[:4]] == ["gsm8k.ar", "gsm8k.chain", "gsm8k.ddtree-b4", "gsm8k.ddtree-b16"]
    assert len(units) == 3 * 4 and not skipped
    units, skipped = plan_units(cfg, "flash attention")
    assert {u.method for u in units} == {"ar", "chain"}
    assert skipped == [{"method": "ddtree", "budget": 4, "reason": "flash attention"},
                       {"method": "ddtree", "budget": 16, "reason": "flash attention"}]
    assert Unit("mt_bench", "ddtree", 64).label == "ddtree@64"


def test_missing_drafter_and_bad_eval_config_are_clear_errors(tmp_path):
    cfg = make_config(tmp_path)
    with pytest.raises(StageError, match="Run `drafter train` for run 'tiny' first"):
        drafter_dir(cfg)
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        drafter_dir(make_config(tmp_path, overrides=[f"eval.drafter={tmp_path}"]))
    with pytest.raises(ConfigError, match="eval.benchmarks: at least one"):
        run_eval(make_config(tmp_path, overrides=["eval.benchmarks=[]"]))
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens: must be >= 1, got 0"):
        make_config(tmp_path, overrides=["eval.max_new_tokens=0"])


def test_the_train_manifest_beside_an_export_is_read_typed_and_a_damaged_one_is_refused_naming_it(tmp_path):
    import json

    train = tmp_path / "train"
    (train / "export").mkdir(parents=True)
    manifest = {"stage": "train", "config_hash": "h", "counts": {}, "files": [],
                "fingerprint": {"drafter": {"block_size": 8}, "features": {"layer_ids": [1, 4, 6], "tokenizer": {}}}}
    (train / "manifest.json").write_text(json.dumps(manifest))
    assert trained_drafter(train / "export").layer_ids == [1, 4, 6]
    (train / "manifest.json").write_text(json.dumps({**manifest, "stage": "extract"}))
    assert trained_drafter(train / "export") is None  # another stage's manifest is not the drafter's
    manifest["fingerprint"]["features"] = "layers 1, 4, 6"
    (train / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StageError, match=r"(?s)train/manifest\.json: fingerprint\.features is a string, not an "
                                         r"object.*`drafter train --force`"):
        trained_drafter(train / "export")
