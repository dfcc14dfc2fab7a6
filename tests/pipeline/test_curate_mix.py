"""Mixture and held-out split: proportions follow the weights, up-sampled copies get distinct ids, eval
never leaks into train, and the selection is a deterministic function of the seed."""

from __future__ import annotations

import logging
from collections import Counter

import pyarrow.parquet as pq
import yaml

from pipeline.config import load_config
from pipeline.curate.mix import apportion
from pipeline.curate.stage import run_curate
from pipeline.files import sha256_file
import pytest

from tests.conftest import synthetic_records, write_records


@pytest.fixture(scope="module")
def SOURCES(tmp_path_factory):
    """Three made-up sources of different sizes and layouts: 7473 word problems, 2017 instructions, 164 tasks."""
    d = tmp_path_factory.mktemp("mix-sources")
    return [
        {"name": "gsm8k", "path": str(write_records(d / "qa.parquet", synthetic_records("gsm8k", 7473))), "weight": 0.6},
        {"name": "code", "path": str(write_records(d / "code.json", synthetic_records("alpaca", 2017))), "weight": 0.3},
        {"name": "humaneval", "path": str(write_records(d / "tasks.jsonl", synthetic_records("humaneval", 164))),
         "weight": 0.1},
    ]


def curate_config(tmp_path, sources, name="t", seed=0, **curate):
    data = {"name": name, "seed": seed, "runs_dir": str(tmp_path / "runs"), "curate": {"sources": sources, **curate}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def rows(cfg, split):
    shards = sorted((cfg.run_dir / "curate" / "shards").glob(f"{split}-*.parquet"))
    return [r for p in shards for r in pq.read_table(p, columns=["id", "source"]).to_pylist()]


def test_apportion_sums_exactly_and_respects_caps():
    assert apportion(10, [0.5, 0.3, 0.2]) == [5, 3, 2]
    assert apportion(7, [1, 1, 1]) == [3, 2, 2]  # remainder ties go to the earlier source
    assert sum(apportion(913000, [0.30, 0.20, 0.15, 0.10, 0.10, 0.10, 0.05])) == 913000
    assert apportion(100, [0.5, 0.5], caps=[10, 1000]) == [10, 90]
    assert apportion(100, [0.5, 0.5], caps=[10, 20]) == [10, 20]
    assert apportion(5, [0.0, 1.0]) == [0, 5]


def test_mixture_follows_weights_with_up_and_down_sampling(tmp_path, SOURCES):
    cfg = curate_config(tmp_path, SOURCES, total=3000, eval_size=30, shard_size=700)
    m = run_curate(cfg)
    assert m["counts"]["train"] == 3000 and m["counts"]["eval"] == 30
    train, evals = rows(cfg, "train"), rows(cfg, "eval")
    per_source = Counter(r["source"] for r in train)
    assert per_source == {"gsm8k": 1800, "code": 900, "humaneval": 300}
    # eval mirrors the mixture and is taken before mixing
    assert Counter(r["source"] for r in evals) == {"gsm8k": 18, "code": 9, "humaneval": 3}
    h = m["sources"]["humaneval"]
    assert h["unique"] == 164 and h["train"] == 300 and h["repeats"] == 300 - 161
    assert m["sources"]["gsm8k"]["not_selected"] > 0 and m["sources"]["gsm8k"]["repeats"] == 0
    # copies have distinct ids; nothing is duplicated; no eval conversation (or copy of it) is trained on
    ids = [r["id"] for r in train]
    assert len(set(ids)) == len(ids)
    assert any(i.endswith("#r1") for i in ids)
    base = {i.split("#")[0] for i in ids}
    assert base.isdisjoint(r["id"] for r in evals)
    copies = Counter(i.split("#")[0] for i in ids if i.startswith("humaneval/"))
    assert set(copies.values()) == {1, 2}  # 300 = 161 * 1 + 139 extra: every one at least once, none thrice
    # the train order is shuffled across sources (not one source after another)
    assert len({r["source"] for r in train[:100]}) == 3
    report = (cfg.run_dir / "curate" / "report.md").read_text()
    assert "| humaneval |" in report and "up x1.86" in report and "down x" in report


def test_selection_is_deterministic_under_the_seed_and_changes_with_it(tmp_path, SOURCES):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        sources = [dict(s, max_samples=2000) for s in SOURCES[:2]]
        cfg = curate_config(tmp_path, sources, name=name, seed=seed, total=1000, eval_size=10, shard_size=400)
        run_curate(cfg)
        shards = sorted((cfg.run_dir / "curate" / "shards").glob("*.parquet"))
        runs[name] = ([p.name for p in shards], [sha256_file(p) for p in shards], rows(cfg, "train"), rows(cfg, "eval"))
    assert runs["a"][:2] == runs["b"][:2]  # byte-identical shards
    a_ids, c_ids = {r["id"] for r in runs["a"][2]}, {r["id"] for r in runs["c"][2]}
    assert a_ids != c_ids and len(a_ids & c_ids) > 0
    assert Counter(r["source"] for r in runs["a"][2]) == Counter(r["source"] for r in runs["c"][2])
    assert {r["id"] for r in runs["a"][3]} != {r["id"] for r in runs["c"][3]}


def test_without_total_everything_unique_is_kept(tmp_path, SOURCES):
    mt = write_records(tmp_path / "mt.jsonl", synthetic_records("mt_bench", 80))
    cfg = curate_config(tmp_path, [SOURCES[2], {"name": "mt", "path": str(mt)}], eval_size=4)
    m = run_curate(cfg)
    assert m["counts"]["unique"] == 244 and m["counts"]["train"] == 240 and m["counts"]["repeats"] == 0
    assert Counter(r["source"] for r in rows(cfg, "eval")) == {"humaneval": 3, "mt": 1}  # by size: 164 vs 80


def test_a_source_repeated_more_than_a_few_times_is_a_warning_in_the_log(tmp_path, caplog, SOURCES):
    def warnings_of(cfg) -> tuple[dict, list[str]]:
        caplog.clear()
        drafter_log = logging.getLogger("drafter")  # pipeline/log.py stops propagation to caplog's root logger
        drafter_log.addHandler(caplog.handler)
        try:
            m = run_curate(cfg)
        finally:
            drafter_log.removeHandler(caplog.handler)
        return m, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    # humaneval gives 164 unique conversations for a share of 300: repeated less than twice, no warning
    m, warnings = warnings_of(curate_config(tmp_path, [SOURCES[2], dict(SOURCES[1], max_samples=2000)],
                                            name="few", total=1200, eval_size=3))
    assert m["sources"]["humaneval"]["repeats"] > 0 and warnings == []
    # alone with total=3000: every conversation ~18 times
    m, warnings = warnings_of(curate_config(tmp_path, [SOURCES[2]], name="many", total=3000))
    assert m["sources"]["humaneval"]["repeats"] == 3000 - 164
    assert len(warnings) == 1 and "'humaneval'" in warnings[0] and "18.3x" in warnings[0], warnings
