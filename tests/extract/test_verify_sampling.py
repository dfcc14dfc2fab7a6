"""`extract --verify` checks samples from every shard (every rank's slice), draws them with a seed, decides on the
per-token minimum cosine as well as the mean, and names what it checked.

The damage is what a real bug does: one shard (one rank, one backend path) holds features one layer off, or an
offset hits one percent of the tokens. The features are rewritten in place and their sha256 re-recorded, as a
buggy extractor would have written them, so only the comparison with the HF forward can see it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from extract.layers import forward_taps
from extract.stage import run_extract
from extract.store import INDEX_FILE, Shard, encode_features, read_shard_header
from extract.verify import draw_samples, run_verify
from pipeline.files import read_json, sha256_file
from pipeline.stage_dir import RankInfo
from pipeline.target import load_target, materialize_target
from tests.extract.conftest import DISTINCT_LAYERS, extract_config, write_tokenize_stage

LENGTHS = np.random.default_rng(3).integers(20, 160, size=48).tolist()


def rewrite_features(run_dir, shard_name: str, model, tokens_of=lambda n: slice(None), layer_shift: int = -1) -> None:
    """Replace, in one shard, the features of the tokens `tokens_of(length)` of every sample with the target
    `model`'s features of the layers `layer_shift` away (a tap-index bug), then record the new sha256 in the sidecar
    and the manifest."""
    stage = run_dir / "extract"
    manifest = read_json(stage / "manifest.json")
    layer_ids = [l + layer_shift for l in manifest["fingerprint"]["layer_ids"]]
    path = stage / "shards" / shard_name
    shard = Shard(path)
    spec = shard.header["features"]
    data_start = read_shard_header(path)[1]
    row_bytes = int(np.prod(spec["shape"][1:])) * 2  # bf16
    with open(path, "r+b") as f:
        for r in range(len(shard)):
            a, b = int(shard.offsets[r]), int(shard.offsets[r + 1])
            ids = shard.tensors["input_ids"][a:b].long()
            wrong = forward_taps(model, ids[None], layer_ids)[0]
            data, _ = encode_features(wrong, len(layer_ids), "bfloat16")
            raw = data.contiguous().view(torch.uint8).reshape(b - a, -1).numpy()
            for t in np.arange(b - a)[tokens_of(b - a)]:
                f.seek(data_start + spec["data_offsets"][0] + (a + int(t)) * row_bytes)
                f.write(raw[t].tobytes())
    del shard
    digest = sha256_file(path)
    side = stage / "shards" / shard_name.replace(".safetensors", ".done.json")
    for record in (side, stage / "manifest.json"):
        m = json.loads(record.read_text())
        for entry in m["files"]:
            if entry["name"] == shard_name:
                entry["sha256"] = digest
        record.write_text(json.dumps(m))


@pytest.fixture
def extraction(tmp_path):
    cfg = extract_config(tmp_path, DISTINCT_LAYERS, "extract.shard_tokens=800")
    write_tokenize_stage(cfg, LENGTHS)
    run_extract(cfg)
    return cfg, load_target(materialize_target(cfg.target, cfg.cache_dir), cfg.target)


def shards_of(cfg) -> list[str]:
    return read_json(cfg.run_dir / "extract" / "manifest.json")["storage"]["shards"]


def test_the_draw_takes_one_row_of_every_group_then_random_rows_and_depends_on_the_seed():
    sizes = [5, 0, 3, 7, 1]
    a = draw_samples(sizes, 9, seed=0)
    assert len(a) == 9 and len(set(a)) == 9 and {g for g, _ in a} == {0, 2, 3, 4}
    assert all(0 <= r < sizes[g] for g, r in a)
    assert draw_samples(sizes, 9, seed=0) == a and draw_samples(sizes, 9, seed=1) != a
    assert len(draw_samples(sizes, 2, seed=0)) == 4  # never fewer than one per non-empty group
    assert len(draw_samples(sizes, 100, seed=0)) == sum(sizes)


def test_one_shard_one_layer_off_outside_the_old_fixed_picks_fails_and_is_named(extraction, capsys):
    cfg, model = extraction
    n = len(LENGTHS)
    old_picks = {int(round(x)) for x in np.linspace(0, n - 1, cfg.extract.verify_samples)}  # the former evenly spaced 6
    rows_of = {name: set(json.loads(Shard(cfg.run_dir / "extract" / "shards" / name).header["__metadata__"]["rows"]))
               for name in shards_of(cfg)}
    victim = next(name for name, rows in rows_of.items() if not rows & old_picks)
    rewrite_features(cfg.run_dir, victim, model)
    report = run_verify(cfg, against="stored")
    assert not report["passed"] and report["failed_layers"] == [1, 3, 5]
    assert {c["shard"] for c in report["checked"]} == set(shards_of(cfg))  # every shard was sampled
    assert {c["shard"] for c in report["failed_samples"]} == {victim}
    assert f"FAILED sample {report['failed_samples'][0]['id']} ({victim}#" in capsys.readouterr().out


def test_an_offset_on_one_percent_of_the_tokens_fails_on_the_minimum_though_the_mean_passes(extraction):
    cfg, model = extraction
    for name in shards_of(cfg):
        rewrite_features(cfg.run_dir, name, model, tokens_of=lambda n: np.arange(n) % 128 == 5)  # ~1% of the tokens
    report = run_verify(cfg, against="stored")
    assert all(r["cos_mean"] >= cfg.extract.verify_min_cosine for r in report["layers"]), report["layers"]  # old: pass
    assert all(r["cos_min"] < cfg.extract.verify_min_token_cosine for r in report["layers"])
    assert not report["passed"] and report["failed_layers"] == [1, 3, 5]


def test_the_report_names_the_checked_samples_with_shard_and_rank_and_another_seed_draws_others(tmp_path, capsys):
    cfg = extract_config(tmp_path, "extract.shard_tokens=500")
    write_tokenize_stage(cfg, LENGTHS)
    for r in range(3):
        run_extract(cfg, ranks=RankInfo(r, 3))
    from drafter.cli import merge_stage

    merge_stage("extract", cfg)
    summaries = {r: read_json(cfg.run_dir / "extract" / "ranks" / f"rank-{r:05d}.json")["units"] for r in range(3)}
    a = run_verify(cfg, against="stored", seed=0)
    printed = capsys.readouterr().out
    b = run_verify(cfg, against="stored", seed=1)
    assert a["passed"] and b["passed"]
    assert {c["rank"] for c in a["checked"]} == {0, 1, 2}  # every rank's slice
    for c in a["checked"]:
        assert c["shard"].removesuffix(".safetensors") in summaries[c["rank"]]
    assert {(c["shard"], c["row"]) for c in a["checked"]} != {(c["shard"], c["row"]) for c in b["checked"]}
    assert all(f"{c['id']} ({c['shard']}#{c['row']})" in printed for c in a["checked"])
    assert (cfg.run_dir / "extract" / INDEX_FILE).exists()


def test_a_sample_is_named_failed_only_for_what_also_fails_the_pooled_verdict():
    """One sample's mean cosine below the bound (its tokens all above) is rounding noise the pooled mean judges: on
    the 8B shape on a GPU one sample sat at 0.9988 in a layer whose pooled mean passed; naming it FAILED beside a
    PASSED verdict told the user two things. A token below the bound, or a non-finite value, fails both."""
    from extract.verify import layer_passes, tokens_pass

    noisy = {"finite": True, "cos_mean": 0.9988, "cos_min": 0.9987}
    assert tokens_pass(noisy, 0.99) and not layer_passes(noisy, 0.999, 0.99)
    for bad in ({"finite": True, "cos_mean": 0.9995, "cos_min": 0.95}, {"finite": False, "cos_mean": 1.0, "cos_min": 1.0}):
        assert not tokens_pass(bad, 0.99) and not layer_passes(bad, 0.999, 0.99)
