"""The run config: every shipped config parses; unknown keys and wrong types are errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, describe_fields, load_config, section_hash

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "qwen3-8b", "qwen3.6-27b"])
def test_every_shipped_config_parses(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert isinstance(cfg, RunConfig)
    assert cfg.name == name


def test_unknown_key_names_the_key_and_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'; did you mean 'train\.lr'"):
        load_config(REPO / "configs/tiny.yaml", ["train.lrr=3e-4"])


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'; did you mean 'train'"):
        load_config(None, ["trian.lr=1"])


def test_unknown_key_inside_a_list_of_sections(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("curate:\n  sources:\n    - {name: a, path: x.jsonl, wieght: 2}\n")
    with pytest.raises(ConfigError, match=r"curate\.sources\[0\]\.wieght.*did you mean 'curate\.sources\[0\]\.weight'"):
        load_config(p)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"train\.lr: expected a number, got str 'fast'"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"drafter\.num_layers: expected an integer"):
        load_config(None, ["drafter.num_layers=2.5"])
    with pytest.raises(ConfigError, match=r"target\.trust_remote_code: expected true/false"):
        load_config(None, ["target.trust_remote_code=1"])


def test_literal_value_suggests_the_closest_choice():
    with pytest.raises(ConfigError, match=r"extract\.backend: 'vlm' is not one of \['hf', 'vllm'\] \(did you mean 'vllm'\?\)"):
        load_config(None, ["extract.backend=vlm"])


def test_dotted_overrides_parse_yaml_scalars():
    cfg = load_config(REPO / "configs/tiny.yaml", ["train.lr=3e-4", "eval.budgets=[1,2,3]", "target.enable_thinking=true"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.eval.budgets == [1, 2, 3]
    assert cfg.target.enable_thinking is True


def test_yaml_exponent_floats_are_numbers(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 6e-4\n")  # PyYAML alone would read this as a string
    assert load_config(p).train.lr == pytest.approx(6e-4)


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="drafter.layer_types: has 1 entries but drafter.num_layers is 5"):
        load_config(None, ["drafter.layer_types=[full_attention]"])
    with pytest.raises(ConfigError, match="drafter.sliding_window: required"):
        load_config(None, ["drafter.num_layers=1", "drafter.layer_types=[sliding_attention]"])


@pytest.mark.parametrize("name", ["../../x", "a/b", "/abs", ".hidden", "..", "x y"])
def test_run_name_outside_the_safe_set_is_refused(name, tmp_path):
    with pytest.raises(ConfigError, match=r"^name: .* is not a run name"):
        load_config(None, [f"runs_dir={tmp_path / 'runs'}", f"name={name}"])
    assert not (tmp_path / "x").exists()


def test_trust_remote_code_is_off_by_default():
    assert load_config(None).target.trust_remote_code is False


def test_section_hash_changes_with_the_section_only():
    a = load_config(REPO / "configs/tiny.yaml")
    b = load_config(REPO / "configs/tiny.yaml", ["train.lr=1e-5"])
    assert section_hash(a.curate) == section_hash(b.curate)
    assert section_hash(a.train) != section_hash(b.train)


def test_every_field_is_documented():
    rows = describe_fields()
    undocumented = [key for key, _, text in rows if not text]
    assert not undocumented, undocumented
    assert any(key == "train.wandb.mode" for key, _, _ in rows)


def test_docs_config_reference_is_in_sync_with_the_schema():
    from pipeline.config import reference_markdown

    assert (REPO / "docs/config.md").read_text() == reference_markdown(), (
        "docs/config.md is stale: run `drafter config-reference --markdown > docs/config.md`")


def test_on_off_switches_survive_yaml_booleans(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("extract:\n  compile: off\n")  # YAML 1.1 reads this as False
    assert load_config(p).extract.compile == "off"
    assert load_config(None, ["extract.compile=on"]).extract.compile == "on"
