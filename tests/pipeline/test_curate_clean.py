"""Bad input is counted under a reason, kept as an example and never kills the job -- until the
malformed rate passes `curate.max_error_rate`. Config mistakes fail fast with the key path."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from drafter.cli import main as cli_main
from pipeline.config import ConfigError, load_config
from pipeline.curate.clean import CLEAN_REASONS
from pipeline.curate.stage import run_curate
from pipeline.errors import StageError
from tests.conftest import synthetic_records, write_records

Q = "What is the capital of France? Answer in one sentence."
A = "The capital of France is Paris."


def curate_config(tmp_path, sources, **curate):
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "curate": {"sources": sources, **curate}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def chat(*turns) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}).encode()


# one line per drop reason (+ a good record, an empty-system fix, two malformed lines and a blank line)
LINES = {
    "good": chat(("user", Q), ("assistant", A)),
    "unknown_role": chat(("user", Q), ("tool", A)),
    "non_string_content": json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": Q}]}]}).encode(),
    "invalid_utf8": b'{"messages": [{"role": "user", "content": "caf\xe9 ' + Q.encode() + b'"}]}',
    "invalid_utf8_escape": chat(("user", Q + " \ud800")),
    "control_chars": chat(("user", Q + "\x07"), ("assistant", A)),
    "empty_turn": chat(("user", Q), ("assistant", "  \n ")),
    "not_user_first": chat(("assistant", A), ("user", Q)),
    "too_short": chat(("user", "hi")),
    "too_long": chat(("user", "lorem " * 1000)),
    "empty_system_fixed": chat(("system", ""), ("user", "Which river flows through Paris?"), ("assistant", "The Seine.")),
    "malformed_json": b'{"messages": [{"role": "user", "content": "cut',
    "blank": b"   ",
    "not_an_object": b"[1, 2, 3]",
    "good2": chat(("system", "Be terse."), ("user", "Name three primary colours, please."), ("assistant", "Red, blue, yellow.")),
}


@pytest.fixture
def defects(tmp_path):
    path = tmp_path / "defects.jsonl"
    path.write_bytes(b"\n".join(LINES.values()) + b"\n")
    return path


def line_of(key: str) -> int:
    return list(LINES).index(key) + 1


def test_every_drop_reason_is_counted_with_an_example(tmp_path, defects):
    cfg = curate_config(tmp_path, [{"name": "d", "path": str(defects)}], min_chars=5, max_chars=4000,
                        max_error_rate=0.5)
    m = run_curate(cfg)
    c = m["counts"]
    assert c["read"] == len(LINES) - 1  # the blank line is not a record
    assert c["malformed"] == 2
    for reason in CLEAN_REASONS:
        expected = 2 if reason == "invalid_utf8" else 1  # raw bytes and a \ud800 escape
        assert c[f"dropped.{reason}"] == expected, reason
    assert c["train"] == 3 and c["eval"] == 0  # good, good2 and the fixed one
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    for reason in CLEAN_REASONS:
        ex = stats["drops"][reason]["examples"][0]
        assert ex["location"] == f"{defects}:{line_of(reason)}", reason
        assert ex["id"] == f"d/{line_of(reason) - 1}" and ex["detail"]
    assert stats["fixes"] == {"empty_system_removed": 1}
    report = (cfg.run_dir / "curate" / "report.md").read_text()
    for reason in CLEAN_REASONS:
        assert f"### {reason}" in report


def test_malformed_lines_are_reported_with_file_and_line(tmp_path, defects):
    cfg = curate_config(tmp_path, [{"name": "d", "path": str(defects)}], max_error_rate=0.5)
    run_curate(cfg)
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    where = {e["location"]: e["error"] for e in stats["malformed"]["examples"]}
    assert where[f"{defects}:{line_of('malformed_json')}"].startswith("invalid JSON")
    assert "not an object" in where[f"{defects}:{line_of('not_an_object')}"]
    report = (cfg.run_dir / "curate" / "report.md").read_text()
    assert f"{defects}:{line_of('malformed_json')}: invalid JSON" in report


def test_malformed_rate_above_the_limit_fails_and_resumes_with_a_higher_limit(tmp_path, defects, capsys):
    sources = [{"name": "d", "path": str(defects)}]
    cfg = curate_config(tmp_path, sources, max_error_rate=0.1)  # 2 of 14 records malformed = 14%
    with pytest.raises(StageError, match=r"2 of 14 raw records are malformed .*max_error_rate") as err:
        run_curate(cfg)
    assert f"{defects}:{line_of('malformed_json')}: invalid JSON" in str(err.value)
    assert not (cfg.run_dir / "curate" / "manifest.json").exists()
    # through the CLI: a clear message and exit status 2, not a traceback
    rc = cli_main(["curate", "--config", str(tmp_path / "cfg.yaml")])
    assert rc == 2 and "malformed" in capsys.readouterr().err
    # the limit is not part of the config hash: the finished chunks are reused, no --force needed
    cfg = curate_config(tmp_path, sources, max_error_rate=0.2)
    assert run_curate(cfg)["counts"]["malformed"] == 2


def test_json_array_file_that_does_not_parse_is_one_malformed_record(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"question": Q, "answer": A}, {"question": Q + "?", "answer": A}]))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"question": "a", "answer": "b"},\n {"question": ')
    cfg = curate_config(tmp_path, [{"name": "ok", "path": str(good)}, {"name": "bad", "path": str(broken)}],
                        max_error_rate=0.5)
    m = run_curate(cfg)
    assert m["counts"]["malformed"] == 1 and m["sources"]["bad"]["malformed"] == 1
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    assert stats["malformed"]["examples"][0]["location"] == f"{broken}[0]"
    assert "line 2" in stats["malformed"]["examples"][0]["error"]


HOSTILE = {
    "deep_nesting": b"[" * 100_000,  # json.loads raises RecursionError
    "huge_integer": b'{"messages": [{"role": "user", "content": "hi there"}], "n": ' + b"7" * 5000 + b"}",  # ValueError
    "deep_but_closed": b"[" * 50_000 + b"]" * 50_000,
}


def test_a_record_of_any_size_that_does_not_parse_is_malformed_with_file_and_line(tmp_path):
    path = tmp_path / "hostile.jsonl"
    lines = [chat(("user", f"Question number {i} about rivers?"), ("assistant", A)) for i in range(20)]
    lines[3:3] = HOSTILE.values()
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = curate_config(tmp_path, [{"name": "h", "path": str(path)}], max_error_rate=0.2)
    m = run_curate(cfg)
    assert m["counts"]["read"] == 23 and m["counts"]["malformed"] == 3 and m["counts"]["train"] == 20
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    where = {e["location"]: e["error"] for e in stats["malformed"]["examples"]}
    assert "RecursionError" in where[f"{path}:4"] and "RecursionError" in where[f"{path}:6"]
    assert "ValueError" in where[f"{path}:5"] and "digits" in where[f"{path}:5"]
    # the error-rate threshold still applies: 3 of 23 is above 10%
    (tmp_path / "strict").mkdir()
    with pytest.raises(StageError, match=r"3 of 23 raw records are malformed"):
        run_curate(curate_config(tmp_path / "strict", [{"name": "h", "path": str(path)}], max_error_rate=0.1))


def test_json_array_file_too_deep_to_parse_is_one_malformed_record(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 100_000)
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"\n".join(chat(("user", f"Question number {i}?"), ("assistant", A)) for i in range(10)))
    cfg = curate_config(tmp_path, [{"name": "ok", "path": str(good)}, {"name": "deep", "path": str(deep)}],
                        max_error_rate=0.5)
    m = run_curate(cfg)
    assert m["sources"]["deep"]["malformed"] == 1 and m["counts"]["train"] == 10
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    assert stats["malformed"]["examples"][0]["location"] == f"{deep}[0]"
    assert "RecursionError" in stats["malformed"]["examples"][0]["error"]


def test_an_unreadable_parquet_source_is_one_error_naming_the_file(tmp_path, capsys):
    broken = tmp_path / "broken.parquet"
    pq.write_table(pa.table({"question": [Q] * 50, "answer": [A] * 50}), broken)
    broken.write_bytes(broken.read_bytes()[:-12])  # the footer and its magic bytes are gone
    cfg = curate_config(tmp_path, [{"name": "p", "path": str(broken)}])
    with pytest.raises(StageError, match=rf"cannot read {broken}: ArrowInvalid: .*magic bytes"):
        run_curate(cfg)
    rc = cli_main(["curate", "--config", str(tmp_path / "cfg.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot read {broken}" in err and "Traceback" not in err


def test_directory_source_reads_jsonl_json_lines_and_parquet_in_sorted_order(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_bytes(chat(("user", "First question about rivers?")) + b"\n")
    (d / "b.json").write_text(json.dumps({"prompt": "Second question about lakes?"}) + "\n")  # JSON lines in .json
    pq.write_table(pa.table({"question": ["Third question about seas?"], "answer": ["Salty."]}), d / "c.parquet")
    cfg = curate_config(tmp_path, [{"name": "mix", "path": str(d)}])
    run_curate(cfg)
    rows = pq.read_table(cfg.run_dir / "curate" / "shards" / "train-00000.parquet").to_pylist()
    got = {r["id"]: (json.loads(r["metadata"])["location"], r["messages"][0]["content"]) for r in rows}
    assert got == {
        "mix/0": (f"{d / 'a.jsonl'}:1", "First question about rivers?"),
        "mix/1": (f"{d / 'b.json'}:1", "Second question about lakes?"),
        "mix/2": (f"{d / 'c.parquet'}#0", "Third question about seas?"),
    }


def test_wrong_format_name_is_a_config_error_with_a_suggestion(tmp_path, capsys):
    data = write_records(tmp_path / "alpaca.json", synthetic_records("alpaca", 10))
    with pytest.raises(ConfigError, match=r"curate.sources\[0\].format: 'alpacca' .*did you mean 'alpaca'"):
        curate_config(tmp_path, [{"name": "x", "path": str(data), "format": "alpacca"}])
    rc = cli_main(["curate", "--config", str(tmp_path / "cfg.yaml")])
    assert rc == 2 and "did you mean 'alpaca'" in capsys.readouterr().err


def test_format_that_does_not_fit_the_records_makes_them_malformed(tmp_path):
    data = write_records(tmp_path / "qa.jsonl", synthetic_records("gsm8k", 1000))
    cfg = curate_config(tmp_path, [{"name": "x", "path": str(data), "format": "sharegpt"}])
    with pytest.raises(StageError, match=r"(?s)1000 of 1000 raw records are malformed.*qa.jsonl:1: sharegpt record has no 'conversations'"):
        run_curate(cfg)


@pytest.mark.parametrize("source, message", [
    ({"name": "x", "path": "README.md"}, r"sources\[0\].path: .*not a .jsonl/.json/.parquet file"),
    ({"name": "x", "path": "missing/prompts.jsonl"}, r"sources\[0\].path: .*does not exist"),
    ({"name": "bad name", "path": "README.md"}, r"sources\[0\].name: 'bad name'"),
])
def test_bad_source_is_a_config_error_naming_the_key(tmp_path, source, message):
    with pytest.raises(ConfigError, match=message):
        run_curate(curate_config(tmp_path, [source]))


def test_two_sources_with_one_name_are_refused(tmp_path):
    s = {"name": "same", "path": str(write_records(tmp_path / "mt.jsonl", synthetic_records("mt_bench", 3)))}
    with pytest.raises(ConfigError, match=r"sources\[1\].name: 'same' is used by two sources"):
        run_curate(curate_config(tmp_path, [s, s]))
