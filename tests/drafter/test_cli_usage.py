"""`drafter` explains itself: every command has a description and an example, `--version` works, help points at
`config-reference`, commands show only the flags they use, `plan` needs a config and writes nothing (estimating
from the sources when curate.total is unset), one value for a list key is a one-item list, and dotted overrides
may come before or after flags."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from drafter.cli import COMMANDS, build_parser, main as drafter_main, parse_args
from drafter.plan import estimate, source_records
from pipeline.config import ConfigError, load_config
from tests.conftest import synthetic_records, write_records

REPO = Path(__file__).resolve().parents[2]


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        drafter_main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_a_description_an_example_and_the_config_reference_pointer(capsys):
    parser_commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert parser_commands == set(COMMANDS)
    top = help_text(capsys)
    assert "drafter config-reference" in top
    for name, (text, example) in COMMANDS.items():
        assert text in " ".join(top.split()), name  # listed with its description
        page = help_text(capsys, name)
        assert text in page and f"example:\n  {example}" in page and "drafter config-reference" in page
        assert example.startswith(f"drafter {name}")


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        drafter_main(["--version"])
    assert done.value.code == 0
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"drafter {version}"


def test_only_commands_that_use_force_and_rank_show_them(capsys):
    for name in COMMANDS:
        page = help_text(capsys, name)
        uses = name in ("curate", "regen", "tokenize", "extract", "train", "eval", "run")
        assert ("--force" in page) == uses and ("--rank" in page) == uses and ("--world-size" in page) == uses, name
    with pytest.raises(SystemExit):
        parse_args(["plan", "--config", "configs/tiny.yaml", "--force"])
    assert "unrecognized arguments: --force" in capsys.readouterr().err


def test_plan_requires_a_config(capsys):
    with pytest.raises(SystemExit) as done:
        drafter_main(["plan"])
    assert done.value.code == 2 and "the following arguments are required: --config" in capsys.readouterr().err


def test_plan_writes_nothing_and_estimates_from_the_sources_without_curate_total(tmp_path, capsys):
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    argv = ["plan", "--config", "configs/tiny.yaml", f"cache_dir={cache}", f"runs_dir={runs}", "curate.total=null"]
    assert drafter_main(argv) == 0
    out = capsys.readouterr().out
    assert not cache.exists() and not runs.exists()  # the random target is described in memory
    cfg = load_config(REPO / "configs/tiny.yaml", argv[3:])
    # tiny.yaml: 400 random-word prompts (nothing to fetch)
    assert source_records(cfg) == (400, [])
    est = estimate(cfg)  # minus the 8 held out, capped by regen.max_samples (64)
    assert est["samples"] == min(400 - cfg.curate.eval_size, cfg.regen.max_samples) * cfg.regen.samples_per_prompt > 0
    assert "from the sources' records (curate.total unset" in out and f"samples                 {est['samples']:,}" in out
    # runs_dir in tmp_path: a checkout where `make demo` ran has runs/smollm2-135m, whose curate manifest plan reads
    mirror = tmp_path / "mirror"  # made-up files under the names of the demo's public sets
    write_records(mirror / "gsm8k_train.jsonl", synthetic_records("gsm8k", 1200))
    write_records(mirror / "code_alpaca_2k.json", synthetic_records("alpaca", 1100))
    write_records(mirror / "alpaca_seed_tasks.jsonl", synthetic_records("alpaca", 175))
    smol = ["curate.total=null", "regen.max_samples=null", f"runs_dir={runs}"]
    big = estimate(load_config(REPO / "configs/smollm2-135m.yaml", [*smol, f"data_dir={mirror}"]))
    assert big["samples"] == (1000 + 1000 + 175 - 16) * 1 and big["gpu_hours"]["extract"] > 0  # max_samples 1000
    alone = estimate(load_config(REPO / "configs/smollm2-135m.yaml", smol))  # no mirror: the synthesized fallback
    assert alone["samples"] == 64 - 16
    assert "not counted (not local): gsm8k_train, code_alpaca_2k, alpaca_seed_tasks" in alone["samples_from"]
    with_total = estimate(load_config(REPO / "configs/tiny.yaml", ["curate.total=100", f"runs_dir={runs}"]))
    assert with_total["samples_from"] == "curate.total"


def test_a_single_value_for_a_list_key_is_a_one_item_list():
    cfg = load_config(REPO / "configs/tiny.yaml", ["eval.budgets=16", "eval.methods=chain", "extract.layer_ids=3"])
    assert cfg.eval.budgets == [16] and cfg.eval.methods == ["chain"] and cfg.extract.layer_ids == [3]
    with pytest.raises(ConfigError, match="eval.budgets\\[0\\]: expected an integer"):
        load_config(REPO / "configs/tiny.yaml", ["eval.budgets=many"])


def test_overrides_and_flags_in_any_order():
    args = parse_args(["train", "--config", "configs/tiny.yaml", "train.lr=1e-3", "--force", "train.max_steps=3"])
    assert args.force and args.config == "configs/tiny.yaml"
    assert args.overrides == ["train.lr=1e-3", "train.max_steps=3"]
    args = parse_args(["eval", "eval.budgets=16", "--config", "configs/tiny.yaml", "--rank", "0", "seed=3"])
    assert args.overrides == ["eval.budgets=16", "seed=3"] and args.rank == 0
    cfg = load_config(args.config, args.overrides)
    assert cfg.eval.budgets == [16] and cfg.seed == 3
    with pytest.raises(SystemExit):
        parse_args(["train", "--config", "configs/tiny.yaml", "a=1", "--force", "stray"])
    with pytest.raises(ConfigError):  # a lone word before any override is read as one, and refused
        load_config("configs/tiny.yaml", parse_args(["train", "--config", "configs/tiny.yaml", "--force", "stray"]).overrides)
