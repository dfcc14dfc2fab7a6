"""Overrides reach into list items by index (`curate.sources[0].weight=2`, `eval.benchmarks[1].num_samples=40`,
`eval.budgets[1]=32`), typed and validated like any other key; a bad index, an index on a key that is no list and
an unknown key are one-line errors naming the override. The fields of list items are in the generated config
reference (docs/config.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, describe_fields, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/qwen3-8b.yaml"  # 37 curate sources, 3 benchmarks (gsm8k, humaneval, mt_bench)


def test_list_item_overrides_change_only_that_item():
    base = load_config(CONFIG)
    cfg = load_config(CONFIG, ["curate.sources[0].weight=2", "eval.benchmarks[1].num_samples=40", "eval.budgets[1]=32"])
    assert cfg.curate.sources[0].weight == 2.0 and isinstance(cfg.curate.sources[0].weight, float)
    assert [s.weight for s in cfg.curate.sources[1:]] == [s.weight for s in base.curate.sources[1:]]
    assert cfg.eval.benchmarks[1].name == "humaneval" and cfg.eval.benchmarks[1].num_samples == 40
    assert cfg.eval.benchmarks[0].num_samples == base.eval.benchmarks[0].num_samples
    assert cfg.eval.budgets == [base.eval.budgets[0], 32, *base.eval.budgets[2:]]


def test_a_list_the_yaml_does_not_set_is_its_default():
    assert load_config(None, ["eval.budgets[0]=8"]).eval.budgets == [8, 64]  # default [16, 64]


def test_a_whole_item_can_be_replaced_and_is_validated_as_a_section():
    cfg = load_config(CONFIG, ["curate.sources[2]={name: extra, hub: org/extra}"])
    assert cfg.curate.sources[2].name == "extra" and cfg.curate.sources[2].weight == 1.0
    with pytest.raises(ConfigError, match=r"eval\.benchmarks\[0\]: expected a section \(mapping\), got int 3"):
        load_config(CONFIG, ["eval.benchmarks[0]=3"])


@pytest.mark.parametrize("override,message", [
    ("curate.sources[37].weight=2",
     r"override 'curate\.sources\[37\]\.weight=2': index 37 is out of range, 'curate\.sources' has 37 items "
     r"\(indices 0-36\)"),
    ("train.lr[0]=1", r"override 'train\.lr\[0\]=1': 'train\.lr' holds float 0\.0006, not a list"),
    ("curate.sourcez[0].weight=1", r"unknown config key 'curate\.sourcez'; did you mean 'curate\.sources'\?"),
    ("curate.sources[0].wieght=2",
     r"unknown config key 'curate\.sources\[0\]\.wieght'; did you mean 'curate\.sources\[0\]\.weight'\?"),
    ("curate.sources[-1].weight=2", r"'sources\[-1\]' is not a key or key\[index\]"),
    ("regen.prompt_formats.gsm8k[0]=x", r"'regen\.prompt_formats\.gsm8k' is not set, so it has no item 0"),
])
def test_bad_list_overrides_are_one_line_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, [override])


def test_values_set_in_a_list_item_are_typed_and_range_checked():
    with pytest.raises(ConfigError, match=r"curate\.sources\[0\]\.weight: expected a number, got str 'heavy'"):
        load_config(CONFIG, ["curate.sources[0].weight=heavy"])
    with pytest.raises(ConfigError, match=r"eval\.benchmarks\[1\]\.num_samples: must be >= 1, got 0"):
        load_config(CONFIG, ["eval.benchmarks[1].num_samples=0"])


def test_the_config_reference_lists_the_fields_of_list_items():
    rows = {key: text for key, _, text in describe_fields()}
    for key in ("curate.sources[].name", "curate.sources[].path", "curate.sources[].weight",
                "curate.sources[].max_samples", "eval.benchmarks[].name", "eval.benchmarks[].path",
                "eval.benchmarks[].num_samples"):
        assert rows.get(key), key
    assert "curate.sources[0].<field>" in rows["curate.sources"]
    doc = (REPO / "docs/config.md").read_text()
    assert "| `eval.benchmarks[].num_samples` | `8` |" in doc and "| `curate.sources[].weight` | `1.0` |" in doc
