"""Every schema adapter: on made-up records of each layout, on the real public sets of the prompt mirror (skipped
without $DRAFTER_DATA_DIR), the hub-dataset record path, the prompt-only sets (malformed rows counted with their
reason), and the whole stage on all real files at once: every row obeys the curated schema."""

from __future__ import annotations

import json

import datasets
import pyarrow.parquet as pq
import pytest
import yaml
from tests.conftest import mirror_file, read_records, synthetic_records, write_records

from pipeline.config import load_config
from pipeline.curate.adapters import NotThisFormat, adapt, detect_format
from pipeline.curate.schema import CONVERSATION_SCHEMA, ROLES
from pipeline.curate.sources import dataset_records
from pipeline.curate.stage import run_curate


def curate_config(tmp_path, sources, **curate):
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache"),
            "curate": {"sources": sources, **curate}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_gsm8k_question_answer_becomes_user_then_assistant():
    records = read_records(mirror_file("gsm8k_train.jsonl"))
    assert len(records) == 7473
    for r in records:
        fmt, [(messages, _)] = adapt(r, "auto")
        assert fmt == "gsm8k"
        assert messages == [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]


def test_alpaca_instruction_and_input_join_with_a_blank_line():
    records = read_records(mirror_file("code_alpaca_2k.json"))
    with_input = next(r for r in records if r["input"])
    fmt, [(messages, _)] = adapt(with_input, "auto")
    assert fmt == "alpaca"
    assert messages[0] == {"role": "user", "content": f"{with_input['instruction']}\n\n{with_input['input']}"}
    assert messages[1] == {"role": "assistant", "content": with_input["output"]}
    without = next(r for r in records if not r["input"])
    assert adapt(without, "alpaca")[1][0][0][0]["content"] == without["instruction"]


def test_code_alpaca_new_response_key_is_the_answer():
    records = read_records(mirror_file("code_alpaca_new.json"))
    assert all("response" in r for r in records)
    for r in records[:200]:
        _, [(messages, _)] = adapt(r, "auto")
        assert messages[1]["content"] == r["output"]
    only_response = {k: v for k, v in records[0].items() if k != "output"}
    assert adapt(only_response, "alpaca")[1][0][0][1]["content"] == records[0]["response"]


def test_alpaca_seed_tasks_give_one_conversation_per_instance():
    records = read_records(mirror_file("alpaca_seed_tasks.jsonl"))
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
    records = read_records(mirror_file("humaneval.jsonl"))
    assert len(records) == 164
    for r in records:
        fmt, [(messages, meta)] = adapt(r, "auto")
        assert fmt == "humaneval"
        assert messages == [{"role": "user", "content": r["prompt"]},
                            {"role": "assistant", "content": r["canonical_solution"]}]
        assert meta["task_id"] == r["task_id"] and "test" not in meta


def test_mt_bench_turns_are_user_turns_without_answers():
    records = read_records(mirror_file("mt_bench.jsonl"))
    assert len(records) == 80
    for r in records:
        fmt, [(messages, meta)] = adapt(r, "auto")
        assert fmt == "mt_bench"
        assert [m["role"] for m in messages] == ["user", "user"]
        assert [m["content"] for m in messages] == r["turns"]
        assert meta["category"] == r["category"]


def test_openai_sharegpt_and_prompt_layouts_of_one_record():
    """The same gsm8k record written in each chat layout adapts to the same conversation."""
    r = synthetic_records("gsm8k", 1)[0]
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
    ds = datasets.Dataset.from_list(synthetic_records("mt_bench", 20))
    recs = list(dataset_records(ds, 10, 13, first=10, where="hub:lmsys/mt_bench/train"))
    assert [r.index for r in recs] == [10, 11, 12]
    assert recs[0].location == "hub:lmsys/mt_bench/train#10"
    assert adapt(recs[0].record, "auto")[0] == "mt_bench"


def test_packaged_datasets_builder_as_hub_id_reads_local_files(tmp_path):
    """`hub: json` + data_files is `datasets.load_dataset("json", data_files=...)`: datasets' packaged json builder,
    offline, cached under the run's cache_dir."""
    data = write_records(tmp_path / "data" / "qa.jsonl", synthetic_records("gsm8k", 400))
    source = {"name": "via_datasets", "hub": "json", "split": "train", "max_samples": 300, "data_files": str(data)}
    cfg = curate_config(tmp_path, [source])
    m = run_curate(cfg)
    assert m["counts"]["read"] == 300 and m["counts"]["malformed"] == 0
    assert list((tmp_path / "cache" / "datasets").glob("json/*"))  # datasets' cache, inside the run's cache_dir
    row = pq.read_table(cfg.run_dir / "curate" / "shards" / "train-00000.parquet").slice(0, 1).to_pylist()[0]
    assert json.loads(row["metadata"])["location"].startswith("hub:json/train#")
    assert json.loads(row["metadata"])["format"] == "gsm8k"


def test_prompt_only_sets_keep_their_fields_and_count_malformed_rows(tmp_path):
    """The mirror's prompt-only layout (prompt, source, category, an id): each row one user turn, the other fields
    kept as metadata; a row without a usable prompt is counted with its reason, never dropped silently."""
    rows = synthetic_records("prompt", 30)
    rows[3]["prompt"] = None                    # no text: clean drops it as non_string_content
    rows[5]["prompt"] = "   "                   # whitespace: empty_turn
    rows[7] = {"source": "synthetic", "category": "chat", "id": 7, "text": "no prompt field"}  # malformed
    path = write_records(tmp_path / "set.jsonl", rows)
    cfg = curate_config(tmp_path, [{"name": "set", "path": str(path), "format": "prompt"}], near_dedup=False)
    m = run_curate(cfg)
    c = m["counts"]
    assert c["read"] == 30 and c["malformed"] == 1
    assert c["dropped.non_string_content"] == 1 and c["dropped.empty_turn"] == 1
    assert c["train"] == 27
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    assert stats["malformed"]["examples"][0]["error"] == "prompt record has no 'prompt' field (keys: ['category', " \
        "'id', 'source', 'text'])"
    assert stats["malformed"]["examples"][0]["location"] == f"{path}:8"
    table = pq.read_table(cfg.run_dir / "curate" / "shards" / "train-00000.parquet").to_pylist()
    row = next(r for r in table if r["id"] == "set/0")
    assert row["messages"] == [{"role": "user", "content": rows[0]["prompt"]}]
    assert {k: json.loads(row["metadata"])[k] for k in ("category", "id", "format")} == \
        {"category": "chat", "id": 0, "format": "prompt"}


MIRROR_PROMPT_SETS = {  # the prompt-only sets of the mirror and their rows (docs/data.md)
    "self_instruct_t0_per_template.parquet": 52008, "sharegpt_v3_openers.parquet": 8732,
    "gpteacher_toolformer.parquet": 7653, "gpteacher_roleplay.parquet": 1923,
    "hh_rlhf_harmless_base_test.parquet": 2177, "nl2bash.parquet": 11322, "mbpp.parquet": 974,
    "mathematics_dataset_train.parquet": 55957, "simplerl_mmlu_stem_test.parquet": 3000,
}


@pytest.mark.parametrize("name", sorted(MIRROR_PROMPT_SETS))
def test_mirror_prompt_sets_adapt_row_for_row(name):
    records = read_records(mirror_file(name))
    assert len(records) == MIRROR_PROMPT_SETS[name]
    for r in records:
        fmt, [(messages, meta)] = adapt(r, "prompt")
        assert messages == [{"role": "user", "content": r["prompt"]}]
        assert meta["category"] in ("chat", "math", "code")


def test_all_real_prompt_files_curate_into_the_schema(tmp_path):
    files = {name: mirror_file(name) for name in ("gsm8k_train.jsonl", "code_alpaca_2k.json", "code_alpaca_new.json",
                                                   "alpaca_seed_tasks.jsonl", "humaneval.jsonl", "mt_bench.jsonl")}
    sources = [
        {"name": "gsm8k", "path": str(files["gsm8k_train.jsonl"])},
        {"name": "code_alpaca_2k", "path": str(files["code_alpaca_2k.json"])},
        {"name": "code_alpaca_new", "path": str(files["code_alpaca_new.json"])},
        {"name": "seed", "path": str(files["alpaca_seed_tasks.jsonl"])},
        {"name": "humaneval", "path": str(files["humaneval.jsonl"]), "format": "humaneval"},
        {"name": "mt_bench", "path": str(files["mt_bench.jsonl"]), "format": "mt_bench"},
    ]
    cfg = curate_config(tmp_path, sources, eval_size=50, shard_size=4000)
    m = run_curate(cfg)
    c = m["counts"]
    sizes = [len(read_records(files[f])) for f in ("code_alpaca_2k.json", "code_alpaca_new.json")]
    assert c["read"] == 7473 + sum(sizes) + 175 + 164 + 80 and c["malformed"] == 0
    dropped = sum(v for k, v in c.items() if k.startswith("dropped."))
    assert c["conversations"] == dropped + c["unique"]  # every conversation accounted for
    assert c["unique"] == c["train"] + c["eval"]          # total unset: everything kept
    empty = sum(1 for f in ("code_alpaca_2k.json", "code_alpaca_new.json") for r in read_records(files[f])
                if not str(r.get("output", r.get("response")) or "").strip())
    assert c["dropped.empty_turn"] == empty               # records with an empty output, each counted
    assert c["dropped.near_duplicate"] > 0                # e.g. a GSM8K problem restated with one word changed
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
            assert meta["location"].startswith(str(files["gsm8k_train.jsonl"].parent))
    assert len(ids) == c["train"] + c["eval"]
    mt = [json.loads(r) for r in pq.read_table(shard).column("metadata").to_pylist()]
    assert all("format" in x for x in mt)
