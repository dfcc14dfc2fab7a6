"""Eval-vs-training overlap: planted exact copies, copies wrapped in a prompt format and one-word edits are found;
unrelated training prompts and the benchmark's own format text are not counted."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from eval.overlap import eval_shingles, find_overlap, summarize_overlap, training_prompts
from eval.prompts import FORMAT_AFFIXES, format_content, format_gsm8k
from pipeline.config import BenchmarkConfig
from pipeline.curate.schema import CONVERSATION_SCHEMA
from tests.conftest import PROMPTS, prompt_records


def write_train_shard(path, prompts: dict[str, str]):
    rows = [{"id": k, "source": "t", "metadata": "{}",
             "messages": [{"role": "user", "content": v}, {"role": "assistant", "content": "answer"}]}
            for k, v in prompts.items()]
    pq.write_table(pa.Table.from_pylist(rows, schema=CONVERSATION_SCHEMA), path)
    return path


def gsm8k_eval_sets(n: int) -> tuple[list[str], dict[str, set[int]]]:
    questions = [r["question"] for r in prompt_records("gsm8k_test_100.jsonl")[:n]]
    sets = {f"gsm8k/{i}": eval_shingles(format_content("gsm8k", t) for t in format_gsm8k({"question": q}))
            for i, q in enumerate(questions)}
    return questions, sets


def one_word_changed(text: str) -> str:
    words = text.split(" ")
    words[len(words) // 2] = "zebra"
    return " ".join(words)


def test_planted_duplicates_are_found_and_classified(tmp_path):
    questions, sets = gsm8k_eval_sets(20)
    long = max(range(20), key=lambda i: len(questions[i].split()))  # a one-word edit keeps > 80 % of its 3-grams
    unrelated = {f"gsm8k_train/{i}": r["question"] for i, r in enumerate(prompt_records("gsm8k_train.parquet")[:500])}
    planted = {
        "copy": questions[3],                                                   # exact copy
        "wrapped": f"Answer briefly. {questions[7]} Think first.",             # a prompt_formats template around it
        "edited": one_word_changed(questions[long]),                            # near duplicate
        "same_format_only": "Please reason step by step, and put your final answer within \\boxed{}.",
    }
    shard = write_train_shard(tmp_path / "train-00000.parquet", {**unrelated, **planted})
    hits = find_overlap(sets, training_prompts([shard]))
    best = {h.eval_id: h for h in hits}
    assert best["gsm8k/3"].train_id == "copy" and best["gsm8k/3"].kind == "exact"
    assert best["gsm8k/7"].train_id == "wrapped" and best["gsm8k/7"].kind == "exact"
    if long not in (3, 7):
        assert best[f"gsm8k/{long}"].train_id == "edited" and best[f"gsm8k/{long}"].kind == "near"
    assert not [h for h in hits if h.train_id == "same_format_only"]  # the shared format text is not content
    assert {h.eval_id for h in hits} <= {"gsm8k/3", "gsm8k/7", f"gsm8k/{long}"}
    summary = summarize_overlap(hits, eval_prompts=20, train_conversations=504, against="test shard")
    assert summary["exact"] == 2 and summary["near"] == (0 if long in (3, 7) else 1)
    json.dumps(summary)


def test_the_vendored_training_sets_hold_no_copy_of_the_vendored_eval_prompts(tmp_path):
    """The recipe's training sources (GSM8K train, Code Alpaca, Alpaca seed tasks) against GSM8K test: no exact
    copy (the sets are disjoint by construction); near duplicates, if any, are reported, not hidden."""
    _, sets = gsm8k_eval_sets(100)
    rows = {f"g/{i}": r["question"] for i, r in enumerate(prompt_records("gsm8k_train.parquet"))}
    shard = write_train_shard(tmp_path / "train-00000.parquet", rows)
    hits = find_overlap(sets, training_prompts([shard]))
    assert not [h for h in hits if h.kind == "exact"]


def test_format_content_takes_off_exactly_the_wrapper_each_format_adds():
    from eval.prompts import FORMATS, load_benchmark

    for name, file in [("gsm8k", "gsm8k_test_100.jsonl"), ("humaneval", "humaneval.jsonl"), ("mt_bench", "mt_bench.jsonl"),
                       ("alpaca", "alpaca_seed_tasks.jsonl")]:
        loaded = load_benchmark(BenchmarkConfig(name=name, path=str(PROMPTS / file), num_samples=3))
        raw = prompt_records(file)[:3]
        for p, record in zip(loaded.prompts, raw):
            content = tuple(format_content(name, t) for t in p.turns)
            if name == "gsm8k":
                assert content == (record["question"],)
            elif name == "humaneval":
                assert content == (record["prompt"],)
            else:
                assert content == FORMATS[name](record)  # no wrapper: content is the prompt
    assert set(FORMAT_AFFIXES) == set(FORMATS)
