"""Every schema adapter on the real prompt files vendored in data/prompts, the hub-dataset record path,
and the whole stage on all real files at once: every row obeys the curated schema."""

from __future__ import annotations

import json

import datasets
import pyarrow.parquet as pq
import pytest
import yaml
from tests.conftest import PROMPTS, prompt_records

from pipeline.config import load_config
from pipeline.curate.adapters import NotThisFormat, adapt, detect_format
from pipeline.curate.schema import CONVERSATION_SCHEMA, ROLES
from pipeline.curate.sources import dataset_records
from pipeline.curate.stage import run_curate
from pipeline.errors import StageError


def curate_config(tmp_path, sources, **curate):
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "curate": {"sources": sources, **curate}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_gsm8k_question_answer_becomes_user_then_assistant():
    records = prompt_records("gsm8k_train.parquet")
    assert len(records) == 7473
    for r in records:
        fmt, [(messages, _)] = adapt(r, "auto")
        assert fmt == "gsm8k"
        assert messages == [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]


def test_alpaca_instruction_and_input_join_with_a_blank_line():
    records = prompt_records("code_alpaca_2k.parquet")
    with_input = next(r for r in records if r["input"])
    fmt, [(messages, _)] = adapt(with_input, "auto")
    assert fmt == "alpaca"
    assert messages[0] == {"role": "user", "content": f"{with_input['instruction']}\n\n{with_input['input']}"}
    assert messages[1] == {"role": "assistant", "content": with_input["output"]}
    without = next(r for r in records if not r["input"])
    assert adapt(without, "alpaca")[1][0][0][0]["content"] == without["instruction"]


def test_code_alpaca_new_response_key_is_the_answer():
    records = prompt_records("code_alpaca_new.parquet")
    assert all("response" in r for r in records)
    for r in records[:200]:
        _, [(messages, _)] = adapt(r, "auto")
        assert messages[1]["content"] == r["output"]
    only_response = {k: v for k, v in records[0].items() if k != "output"}
    assert adapt(only_response, "alpaca")[1][0][0][1]["content"] == records[0]["response"]


def test_alpaca_seed_tasks_give_one_conversation_per_instance():
    records = prompt_records("alpaca_seed_tasks.jsonl")
    assert len(records) == 175
    for r in records:
        fmt, convs = adapt(r, "auto")
        assert fmt == "alpaca" and len(convs) == len(r["instances"])
        (messages, meta), inst = convs[0], r["instances"][0]
        assert messages[0]["content"].startswith(r["instruction"])
        assert messages[1]["content"] == inst["output"]
        assert meta["id"] == r["id"] and meta["name"] == r["name"]  # short scalar fields kept
    multi = dict(records[0], instances=[{"input": "a", "output": "x"}, {"input": "b", "output": "y"}])
    convs = adapt(multi, "alpaca")[1]
    assert [c[0][1]["content"] for c in convs] == ["x", "y"] and [c[1]["instance"] for c in convs] == [0, 1]


def test_humaneval_prompt_with_canonical_solution():
    records = prompt_records("humaneval.jsonl")
    assert len(records) == 164
    for r in records:
        fmt, [(messages, meta)] = adapt(r, "auto")
        assert fmt == "humaneval"
        assert messages == [{"role": "user", "content": r["prompt"]},
                            {"role": "assistant", "content": r["canonical_solution"]}]
        assert meta["task_id"] == r["task_id"] and "test" not in meta


def test_mt_bench_turns_are_user_turns_without_answers():
    records = prompt_records("mt_bench.jsonl")
    assert len(records) == 80
    for r in records:
        fmt, [(messages, meta)] = adapt(r, "auto")
        assert fmt == "mt_bench"
        assert [m["role"] for m in messages] == ["user", "user"]
        assert [m["content"] for m in messages] == r["turns"]
        assert meta["category"] == r["category"]


def test_openai_sharegpt_and_prompt_layouts_of_real_records():
    """The same real gsm8k record written in each chat layout adapts to the same conversation."""
    r = prompt_records("gsm8k_train.parquet")[0]
    expected = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
    layouts = {
        "openai": {"messages": expected},
        "sharegpt": {"conversations": [{"from": "human", "value": r["question"]}, {"from": "gpt", "value": r["answer"]}]},
        "prompt": {"prompt": r["question"], "response": r["answer"]},
    }
    for fmt, record in layouts.items():
        assert detect_format(record) == fmt
        assert adapt(record, fmt)[1][0][0] == expected
    system = {"conversations": [{"from": "system", "value": "Be brief."}, *layouts["sharegpt"]["conversations"]]}
    assert adapt(system, "sharegpt")[1][0][0][0] == {"role": "system", "content": "Be brief."}
    odd = {"conversations": [{"from": "narrator", "value": "x"}]}
    assert adapt(odd, "sharegpt")[1][0][0][0]["role"] == "narrator"  # left for clean to drop as unknown_role


def test_record_without_its_layout_fields_is_not_this_format():
    with pytest.raises(NotThisFormat, match="no 'question'"):
        adapt({"prompt": "x"}, "gsm8k")
    with pytest.raises(NotThisFormat, match="not a list"):
        adapt({"messages": "hello"}, "openai")
    with pytest.raises(NotThisFormat, match="no adapter recognizes"):
        adapt({"text": "hello"}, "auto")
    with pytest.raises(NotThisFormat, match="not an object"):
        adapt([1, 2], "auto")


def test_hub_dataset_rows_become_records_with_locations():
    ds = datasets.Dataset.from_list(prompt_records("mt_bench.jsonl"))
    recs = list(dataset_records(ds, 10, 13, first=10, where="hub:lmsys/mt_bench/train"))
    assert [r.index for r in recs] == [10, 11, 12]
    assert recs[0].location == "hub:lmsys/mt_bench/train#10"
    assert adapt(recs[0].record, "auto")[0] == "mt_bench"


def test_unreachable_hub_dataset_fails_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = curate_config(tmp_path, [{"name": "remote", "path": "no-such-org/no-such-dataset", "split": "chat"}])
    with pytest.raises(StageError, match="cannot load hub dataset 'no-such-org/no-such-dataset'.*split='chat'"):
        run_curate(cfg)


def test_non_local_path_goes_through_datasets_load_dataset(tmp_path, monkeypatch):
    """`path: json` is not a local file, so it is a `datasets.load_dataset(path, subset, split=...,
    data_files=...)` id -- here datasets' packaged json builder, which works offline."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    source = {"name": "via_datasets", "path": "json", "split": "train", "max_samples": 300,
              "data_files": str(PROMPTS / "gsm8k_train_1k.jsonl")}
    cfg = curate_config(tmp_path, [source])
    m = run_curate(cfg)
    assert m["counts"]["read"] == 300 and m["counts"]["malformed"] == 0
    row = pq.read_table(cfg.run_dir / "curate" / "shards" / "train-00000.parquet").slice(0, 1).to_pylist()[0]
    assert json.loads(row["metadata"])["location"].startswith("hub:json/train#")
    assert json.loads(row["metadata"])["format"] == "gsm8k"


def test_all_real_prompt_files_curate_into_the_schema(tmp_path):
    sources = [
        {"name": "gsm8k", "path": str(PROMPTS / "gsm8k_train.parquet")},
        {"name": "code_alpaca_2k", "path": str(PROMPTS / "code_alpaca_2k.parquet")},
        {"name": "code_alpaca_new", "path": str(PROMPTS / "code_alpaca_new.parquet")},
        {"name": "seed", "path": str(PROMPTS / "alpaca_seed_tasks.jsonl")},
        {"name": "humaneval", "path": str(PROMPTS / "humaneval.jsonl"), "format": "humaneval"},
        {"name": "mt_bench", "path": str(PROMPTS / "mt_bench.jsonl"), "format": "mt_bench"},
    ]
    cfg = curate_config(tmp_path, sources, eval_size=50, shard_size=4000)
    m = run_curate(cfg)
    c = m["counts"]
    sizes = [len(prompt_records(f)) for f in ("code_alpaca_2k.parquet", "code_alpaca_new.parquet")]
    assert c["read"] == 7473 + sum(sizes) + 175 + 164 + 80 and c["malformed"] == 0
    dropped = sum(v for k, v in c.items() if k.startswith("dropped."))
    assert c["conversations"] == dropped + c["unique"]  # every conversation accounted for
    assert c["unique"] == c["train"] + c["eval"]          # total unset: everything kept
    assert c["dropped.empty_turn"] == 2                   # two code_alpaca_2k records have an empty output
    assert c["dropped.near_duplicate"] > 0                # e.g. gsm8k/6691 restates gsm8k/2483
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    assert stats["sources"]["code_alpaca_new"]["formats"] == {"alpaca": 4535}
    assert stats["sources"]["mt_bench"]["formats"] == {"mt_bench": 80}
    ids = set()
    for shard in sorted((cfg.run_dir / "curate" / "shards").glob("*.parquet")):
        table = pq.read_table(shard)
        assert table.schema.equals(CONVERSATION_SCHEMA)
        for row in table.to_pylist():
            roles = [t["role"] for t in row["messages"]]
            assert set(roles) <= set(ROLES)
            assert roles[1 if roles[0] == "system" else 0] == "user"
            assert row["id"].startswith(row["source"] + "/") and row["id"] not in ids
            ids.add(row["id"])
            meta = json.loads(row["metadata"])
            assert meta["location"].startswith(str(PROMPTS))
    assert len(ids) == c["train"] + c["eval"]
    mt = [json.loads(r) for r in pq.read_table(shard).column("metadata").to_pylist()]
    assert all("format" in x for x in mt)
