"""A prompt set named by its public identity is read from the mirror when a file there has its name, else from the
cache or its source (a hub dataset through `datasets`, offline from a cache filled by `datasets` itself; a URL from a
local HTTP server), with checksums; a set found nowhere is one line that says where it looked and how to get it; the
`use` rule leaves out absent sets and falls back; a finished curate refuses data that changed."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading

import pyarrow.parquet as pq
import pytest
import yaml

import pipeline.datasets as ds_mod
from drafter.cli import main as drafter_main
from pipeline.config import DatasetConfig, SourceConfig, load_config
from pipeline.curate.stage import run_curate
from pipeline.datasets import DatasetMissing, choose, locate
from pipeline.errors import StageError
from tests.conftest import prefill_hub_cache, synthetic_records, write_records

HUB = "testorg/word-problems"


@pytest.fixture(autouse=True)
def _hub_reachable_at_first(monkeypatch):
    """Every test starts as a fresh process does: no hub failure seen yet (each test has its own cache)."""
    monkeypatch.setattr(ds_mod, "_hub_unreachable", None)


def run_config(tmp_path, sources, *, data_dir=None, benchmarks=None, **curate):
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache"),
            "curate": {"sources": sources, "near_dedup": False, **curate}}
    if data_dir is not None:
        data["data_dir"] = str(data_dir)
    if benchmarks is not None:
        data["eval"] = {"benchmarks": benchmarks}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def curated(cfg) -> list[dict]:
    shards = sorted((cfg.run_dir / "curate" / "shards").glob("*.parquet"))
    return [r for p in shards for r in pq.read_table(p).to_pylist()]


def hub_source(**extra) -> dict:
    return {"name": "word_problems", "hub": HUB, "subset": "main", "split": "train", **extra}


def test_a_mirror_file_named_after_the_source_wins_over_the_hub(tmp_path):
    prefill_hub_cache(tmp_path / "cache" / "datasets", HUB, synthetic_records("gsm8k", 30, start=1000), subset="main")
    mirror = tmp_path / "mirror"
    mirror_copy = write_records(mirror / "word_problems.jsonl", synthetic_records("gsm8k", 20))
    cfg = run_config(tmp_path, [hub_source()], data_dir=mirror)
    m = run_curate(cfg)
    rows = curated(cfg)
    assert m["counts"]["read"] == 20 and len(rows) == 20
    assert all(json.loads(r["metadata"])["location"].startswith(f"{mirror_copy}:") for r in rows)
    data = m["data"]["word_problems"]
    assert data["where"] == "mirror" and data["identity"] == f"hub:{HUB} (subset=main, split=train)"
    assert data["checksum"]["sha256"] == {str(mirror_copy): hashlib.sha256(mirror_copy.read_bytes()).hexdigest()}
    # $DRAFTER_DATA_DIR is the same setting when the config has none; `file` names another file in the mirror
    cfg = run_config(tmp_path, [hub_source(file="renamed.parquet")])
    write_records(mirror / "renamed.parquet", synthetic_records("gsm8k", 7))
    found = locate(cfg.curate.sources[0], "word_problems", "s", data_dir=None, cache_dir=tmp_path / "cache")
    assert found.where == "hub"  # no mirror set: the cached hub copy
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTER_DATA_DIR", str(mirror))
        found = locate(cfg.curate.sources[0], "word_problems", "s", data_dir=None, cache_dir=tmp_path / "cache")
    assert found.where == "mirror" and found.files == (("parquet", str(mirror / "renamed.parquet")),)


def test_the_hub_path_reads_datasets_own_cache_offline_when_no_mirror_has_it(tmp_path):
    records = synthetic_records("gsm8k", 30)
    revision_dir = prefill_hub_cache(tmp_path / "cache" / "datasets", HUB, records, subset="main")
    empty_mirror = tmp_path / "mirror"
    empty_mirror.mkdir()
    cfg = run_config(tmp_path, [hub_source(max_samples=25)], data_dir=empty_mirror)
    m = run_curate(cfg)
    assert m["counts"]["read"] == 25 and m["counts"]["malformed"] == 0
    rows = sorted(curated(cfg), key=lambda r: int(r["id"].split("/")[1]))
    assert rows[0]["messages"][0]["content"] == records[0]["question"]
    assert json.loads(rows[0]["metadata"])["location"] == f"hub:{HUB}/train#0"
    data = m["data"]["word_problems"]
    assert data["where"] == "hub" and data["checksum"]["rows"] == 30
    assert data["checksum"]["revision"] == revision_dir.name and data["checksum"]["fingerprint"]


def test_a_pinned_revision_is_read_from_the_cache_only_when_cached_at_that_revision(tmp_path):
    cached = prefill_hub_cache(tmp_path / "cache" / "datasets", HUB, synthetic_records("gsm8k", 5), subset="main")
    pinned = SourceConfig(**hub_source(revision=cached.name))
    assert locate(pinned, "w", "s", data_dir=None, cache_dir=tmp_path / "cache").checksum["revision"] == cached.name
    other = SourceConfig(**hub_source(revision="f" * 40))
    with pytest.raises(DatasetMissing, match=rf"not in the cache .* \(cached at revision {cached.name}, not {'f' * 40}\)"):
        locate(other, "w", "s", data_dir=None, cache_dir=tmp_path / "cache")


def test_after_the_hub_proved_unreachable_cached_datasets_still_load_without_another_attempt(tmp_path, monkeypatch):
    prefill_hub_cache(tmp_path / "cache" / "datasets", HUB, synthetic_records("gsm8k", 12), subset="main")
    monkeypatch.setattr(ds_mod, "_hub_unreachable", "Couldn't reach the hub")
    found = locate(SourceConfig(**hub_source()), "word_problems", "s", data_dir=None, cache_dir=tmp_path / "cache")
    assert found.where == "hub" and found.checksum["rows"] == 12
    with pytest.raises(DatasetMissing, match=r"hub:testorg/absent .* not in the cache .*hub is unreachable "
                                             r"\(Couldn't reach the hub\)"):
        locate(SourceConfig(name="x", hub="testorg/absent"), "x", "s", data_dir=None, cache_dir=tmp_path / "cache")


def test_a_packaged_builder_over_local_files_loads_after_the_hub_proved_unreachable(tmp_path):
    """`hub: json` + data_files needs no hub: an earlier hub failure in the process (another source, another run)
    does not refuse it."""
    with pytest.raises(DatasetMissing, match="hub is unreachable"):  # offline (HF_HUB_OFFLINE=1): the memo is set
        locate(SourceConfig(name="x", hub="testorg/absent"), "x", "s", data_dir=None, cache_dir=tmp_path / "cache")
    assert ds_mod._hub_unreachable is not None
    data = write_records(tmp_path / "qa.jsonl", synthetic_records("gsm8k", 7))
    found = locate(SourceConfig(name="qa", hub="json", data_files=str(data)), "qa", "s", data_dir=None,
                   cache_dir=tmp_path / "cache")
    assert found.where == "hub" and found.checksum["rows"] == 7


def test_a_missing_dataset_is_one_line_that_says_where_it_looked_and_how_to_get_it(tmp_path, capsys):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    cfg = run_config(tmp_path, [{"name": "absent_set", "hub": "testorg/absent", "split": "train"}], data_dir=mirror)
    with pytest.raises(DatasetMissing) as e:
        run_curate(cfg)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("curate.sources[0] 'absent_set': dataset not found: ")
    assert f"not in the mirror {mirror} (as absent_set{{.parquet,.jsonl,.json}})" in text
    assert f"hub:testorg/absent (subset=None, split=train) not in the cache {tmp_path / 'cache' / 'datasets'}" in text
    assert "Get it: put absent_set.parquet/.jsonl/.json in a mirror directory and set DRAFTER_DATA_DIR" in text
    assert "or run once with hub access (docs/data.md)" in text
    # a set that only a mirror holds says so; the CLI prints the same one line, no traceback
    cfg = run_config(tmp_path, [{"name": "derived", "origin": "github:org/repo@abc123 data/x.jsonl"}])
    assert drafter_main(["curate", "--config", str(tmp_path / "cfg.yaml")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "no mirror (data_dir and $DRAFTER_DATA_DIR unset); origin:github:org/repo@abc123 data/x.jsonl is not " \
           "fetched by the pipeline: only a mirror holds it" in err


def test_a_url_is_downloaded_once_into_the_cache_and_checked_against_its_sha256(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the tests run offline; this one downloads from a local HTTP server
    served = tmp_path / "site"
    body = write_records(served / "qa.jsonl", synthetic_records("gsm8k", 9)).read_bytes()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/qa.jsonl"
    digest = hashlib.sha256(body).hexdigest()
    try:
        entry = DatasetConfig(url=url, sha256=digest)
        found = locate(entry, "qa", "s", data_dir=None, cache_dir=tmp_path / "cache")
    finally:
        server.shutdown()
        server.server_close()
    (kind, path), = found.files
    assert found.where == "download" and kind == "jsonl" and open(path, "rb").read() == body
    assert str(tmp_path / "cache" / "datasets" / "downloads") in path
    assert found.checksum == {"sha256": {path: digest}}
    again = locate(entry, "qa", "s", data_dir=None, cache_dir=tmp_path / "cache")  # server gone: the cached copy
    assert again.files == found.files
    with pytest.raises(StageError, match=rf"has sha256 {digest}, not the configured {'0' * 64}"):
        locate(DatasetConfig(url=url, sha256="0" * 64), "qa", "s", data_dir=None, cache_dir=tmp_path / "cache")
    with pytest.raises(DatasetMissing, match=r"url:http://127.0.0.1:\d+/other.jsonl not in the cache .* and not "
                                             r"downloadable \(URLError"):
        locate(DatasetConfig(url=url.replace("qa.jsonl", "other.jsonl")), "o", "s", data_dir=None,
               cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "datasets" / "downloads").rglob(".*"))  # no partial download left
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: the cached copy still, but nothing new is fetched
    assert locate(entry, "qa", "s", data_dir=None, cache_dir=tmp_path / "cache").files == found.files
    with pytest.raises(DatasetMissing, match=r"not in the cache .* and downloads are off \(HF_HUB_OFFLINE\)"):
        locate(DatasetConfig(url=url.replace("qa.jsonl", "other.jsonl")), "o", "s", data_dir=None,
               cache_dir=tmp_path / "cache")


def test_absent_sets_are_left_out_and_reported_and_the_fallback_runs_only_when_nothing_else_does(tmp_path):
    mirror = tmp_path / "mirror"
    write_records(mirror / "present.jsonl", synthetic_records("gsm8k", 15))
    sources = [{"name": "present", "hub": "testorg/present", "use": "if_present"},
               {"name": "absent", "hub": "testorg/absent", "use": "if_present"},
               {"name": "words", "random_words": 40, "use": "fallback"}]
    cfg = run_config(tmp_path, sources, data_dir=mirror)
    m = run_curate(cfg)
    assert {name: d["status"] for name, d in m["data"].items()} == \
        {"present": "used", "absent": "absent", "words": "fallback_unused"}
    assert m["counts"]["read"] == 15 and "dataset not found" in m["data"]["absent"]["reason"]
    report = (cfg.run_dir / "curate" / "report.md").read_text()
    assert "| absent | absent | - | `-` | curate.sources[1] 'absent': dataset not found" in report
    assert "| words | fallback_unused |" in report
    # nothing public found: the fallback is what the run reads
    cfg = run_config(tmp_path / "bare", sources, data_dir=tmp_path / "no-mirror")
    m = run_curate(cfg)
    assert {name: d["status"] for name, d in m["data"].items()} == \
        {"present": "absent", "absent": "absent", "words": "used"}
    assert m["counts"]["read"] == 40 and {r["source"] for r in curated(cfg)} == {"words"}
    # a required set that is absent stops the run; so does a list where nothing at all is available
    with pytest.raises(DatasetMissing, match=r"^curate.sources\[0\] 'absent': dataset not found"):
        run_curate(run_config(tmp_path / "req", [{"name": "absent", "hub": "testorg/absent"}], data_dir=mirror))
    with pytest.raises(DatasetMissing, match=r"^eval.benchmarks: none of the 1 entries is available and none is a "
                                             r"fallback; first: .*'gsm8k': dataset not found"):
        choose([SourceConfig(name="gsm8k", hub="testorg/absent", use="if_present")], "eval.benchmarks",
               lambda i, e: locate(e, e.name, f"eval.benchmarks[{i}]", data_dir=None, cache_dir=tmp_path / "c"))


def test_a_finished_curate_refuses_a_mirror_file_that_changed_naming_the_source(tmp_path):
    mirror = tmp_path / "mirror"
    write_records(mirror / "word_problems.jsonl", synthetic_records("gsm8k", 10))
    cfg = run_config(tmp_path, [hub_source()], data_dir=mirror)
    run_curate(cfg)
    assert run_curate(cfg)["counts"]["read"] == 10  # unchanged: a no-op
    write_records(mirror / "word_problems.jsonl", synthetic_records("gsm8k", 11))
    with pytest.raises(StageError, match=r"(?s)made with another config.*data.word_problems.checksum.sha256"):
        run_curate(cfg)


def test_a_configured_sha256_pins_the_mirror_copy(tmp_path):
    mirror = tmp_path / "mirror"
    copy = write_records(mirror / "word_problems.jsonl", synthetic_records("gsm8k", 5))
    good = hashlib.sha256(copy.read_bytes()).hexdigest()
    assert locate(SourceConfig(**hub_source(sha256=good)), "word_problems", "s", data_dir=str(mirror),
                  cache_dir=tmp_path).where == "mirror"
    with pytest.raises(StageError, match=rf"^s: {copy} has sha256 {good}, not the configured {'1' * 64}"):
        locate(SourceConfig(**hub_source(sha256="1" * 64)), "word_problems", "s", data_dir=str(mirror),
               cache_dir=tmp_path)


def test_a_hub_id_given_as_a_path_says_where_it_belongs(tmp_path):
    from pipeline.config import ConfigError

    cfg = run_config(tmp_path, [{"name": "n", "path": "nvidia/Nemotron-Post-Training-Dataset-v2"}])
    with pytest.raises(ConfigError, match=r"curate.sources\[0\].path: 'nvidia/Nemotron-Post-Training-Dataset-v2' "
                                          r"does not exist; a hub dataset is named with curate.sources\[0\].hub"):
        run_curate(cfg)
