"""Eval-vs-training overlap: planted exact copies, copies wrapped in a prompt format and one-word edits are found;
unrelated training prompts and the benchmark's own format text are not counted."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eval.overlap import eval_shingles, find_overlap, find_overlap_reference, summarize_overlap, training_prompts
from eval.prompts import FORMAT_AFFIXES, format_content, format_gsm8k
from pipeline.config import BenchmarkConfig
from pipeline.curate.schema import CONVERSATION_SCHEMA
from pipeline.stage_dir import StageDir
from tests.conftest import mirror_file, read_records, synthetic_records, write_records


def write_train_shard(path, prompts: dict[str, str]):
    rows = [{"id": k, "source": "t", "metadata": "{}",
             "messages": [{"role": "user", "content": v}, {"role": "assistant", "content": "answer"}]}
            for k, v in prompts.items()]
    pq.write_table(pa.Table.from_pylist(rows, schema=CONVERSATION_SCHEMA), path)
    return path


def made_up_questions(n: int, seed: int) -> list[str]:
    """n made-up questions of 12-60 words from a small vocabulary (unrelated to each other beyond chance)."""
    gen = np.random.default_rng(seed)
    vocab = [w + s for w in ("apple", "crate", "train", "river", "coin", "garden", "ticket", "baker", "marble", "lamp",
                             "stone", "cloud", "wheel", "paper", "bottle")
             for s in ("", "s", "ed", "ing", "er", "ly", "ful", "ness", "ish", "ward")] + [str(i) for i in range(200)]
    return [" ".join(gen.choice(vocab, int(gen.integers(12, 61)))).capitalize() + "?" for _ in range(n)]


def gsm8k_eval_sets(questions: list[str]) -> dict[str, set[int]]:
    return {f"gsm8k/{i}": eval_shingles(format_content("gsm8k", t) for t in format_gsm8k({"question": q}))
            for i, q in enumerate(questions)}


def one_word_changed(text: str) -> str:
    words = text.split(" ")
    words[len(words) // 2] = "zebra"
    return " ".join(words)


def test_planted_duplicates_are_found_and_classified(tmp_path):
    questions = made_up_questions(20, seed=0)
    sets = gsm8k_eval_sets(questions)
    long = max((i for i in range(20) if i not in (3, 7)), key=lambda i: len(questions[i].split()))  # an edit keeps
    # more than 80 % of a long question's 3-grams
    unrelated = {f"train/{i}": q for i, q in enumerate(made_up_questions(500, seed=1))}
    planted = {
        "copy": questions[3],                                                   # exact copy
        "wrapped": f"Answer briefly. {questions[7]} Think first.",             # a prompt_formats template around it
        "edited": one_word_changed(questions[long]),                            # near duplicate
        "same_format_only": "Please reason step by step, and put your final answer within \\boxed{}.",
    }
    shard = write_train_shard(tmp_path / "train-00000.parquet", {**unrelated, **planted})
    hits = find_overlap(sets, training_prompts(StageDir(tmp_path, "curate"), [shard]))
    best = {h.eval_id: h for h in hits}
    assert best["gsm8k/3"].train_id == "copy" and best["gsm8k/3"].kind == "exact"
    assert best["gsm8k/7"].train_id == "wrapped" and best["gsm8k/7"].kind == "exact"
    assert best[f"gsm8k/{long}"].train_id == "edited" and best[f"gsm8k/{long}"].kind == "near"
    assert not [h for h in hits if h.train_id == "same_format_only"]  # the shared format text is not content
    assert {h.eval_id for h in hits} <= {"gsm8k/3", "gsm8k/7", f"gsm8k/{long}"}
    summary = summarize_overlap(hits, eval_prompts=20, train_conversations=504, against="test shard")
    assert summary["exact"] == 2 and summary["near"] == 1
    json.dumps(summary)


def test_the_indexed_search_equals_every_pair_intersected(tmp_path):
    """`find_overlap` (inverted index over the candidates) equals `find_overlap_reference` (every pair), hits and
    containments alike, at several thresholds: planted copies, one-word edits, partial copies (one repeated: a
    shingle counts once) and unrelated prompts, over several batches, with eval prompts of a few shingles among them."""
    questions = made_up_questions(40, seed=2) + ["Apples and coins", "Crate of marbles now"]
    sets = gsm8k_eval_sets(questions)
    gen = np.random.default_rng(3)
    train = {f"train/{i}": q for i, q in enumerate(made_up_questions(300, seed=4))}
    for i, q in enumerate(questions[:30]):
        words = q.split(" ")
        cut = int(gen.integers(len(words) // 2, len(words) + 1))
        part = " ".join(words[:len(words) // 2])
        train[f"copy/{i}"] = [q, one_word_changed(q), " ".join(words[:cut]), f"Say it: {q} Now.",
                              f"{part} {part} {part}"][i % 5]  # the last: half the prompt, its shingles repeated
    shard = write_train_shard(tmp_path / "train-00000.parquet", train)
    for threshold in (0.5, 0.8, 1.0):
        batches = list(training_prompts(StageDir(tmp_path, "curate"), [shard]))
        small = [(ids[k:k + 37], texts[k:k + 37]) for ids, texts in batches for k in range(0, len(ids), 37)]
        fast = find_overlap(sets, small, threshold)
        assert fast == find_overlap_reference(sets, small, threshold)
        assert len({h.eval_id for h in fast}) >= 12  # the exact copies at least: not an empty agreement


MIRROR_EVAL = {"gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl", "mt_bench": "mt_bench.jsonl"}
MIRROR_TRAIN = ("gsm8k_train.jsonl", "code_alpaca_2k.json", "code_alpaca_new.json", "alpaca_seed_tasks.jsonl",
                "self_instruct_t0_per_template.parquet", "sharegpt_v3_openers.parquet", "gpteacher_toolformer.parquet",
                "gpteacher_roleplay.parquet", "hh_rlhf_harmless_base_test.parquet", "nl2bash.parquet", "mbpp.parquet",
                "mathematics_dataset_train.parquet", "simplerl_mmlu_stem_test.parquet", "simplerl_asdiv_test.parquet",
                "simplerl_mawps_test.parquet", "simplerl_svamp_test.parquet", "simplerl_college_math_test.parquet")


@pytest.mark.slow
def test_the_public_training_sets_hold_no_copy_of_the_eval_prompts(tmp_path):
    """The training sets of the mirror (the production mix: GSM8K train, Code Alpaca, Alpaca seed tasks and the
    prompt-only sets) against every GSM8K test, HumanEval and MT-Bench prompt: no exact copy (the sets are disjoint
    by construction); near duplicates are reported, not hidden, and stay few."""
    from eval.prompts import load_benchmark

    sets = {}
    for name, file in MIRROR_EVAL.items():
        loaded = load_benchmark(BenchmarkConfig(name=name, path=str(mirror_file(file)), num_samples=10_000))
        sets.update({p.id: eval_shingles(format_content(name, t) for t in p.turns) for p in loaded.prompts})
    assert len(sets) == 1319 + 164 + 80
    rows = {}
    for file in MIRROR_TRAIN:
        for i, r in enumerate(read_records(mirror_file(file))):
            text = r.get("prompt") or r.get("question") or r.get("instruction")
            rows[f"{file}/{i}"] = text + (f"\n\n{r['input']}" if r.get("input") else "")
    assert len(rows) > 160_000
    shard = write_train_shard(tmp_path / "train-00000.parquet", rows)
    hits = find_overlap(sets, training_prompts(StageDir(tmp_path, "curate"), [shard]))
    summary = summarize_overlap(hits, eval_prompts=len(sets), train_conversations=len(rows), against="mirror")
    assert summary["exact"] == 0, summary["examples"]
    assert summary["near"] <= 0.01 * len(sets), summary["examples"]


def test_format_content_takes_off_exactly_the_wrapper_each_format_adds(tmp_path):
    from eval.prompts import FORMATS, load_benchmark

    for name, layout, file in [("gsm8k", "gsm8k", "q.jsonl"), ("humaneval", "humaneval", "h.jsonl"),
                               ("mt_bench", "mt_bench", "m.jsonl"), ("alpaca", "alpaca", "a.json")]:
        raw = synthetic_records(layout, 3)
        path = write_records(tmp_path / file, raw)
        loaded = load_benchmark(BenchmarkConfig(name=name, path=str(path), num_samples=3))
        for p, record in zip(loaded.prompts, raw):
            content = tuple(format_content(name, t) for t in p.turns)
            if name == "gsm8k":
                assert content == (record["question"],)
            elif name == "humaneval":
                assert content == (record["prompt"],)
            else:
                assert content == FORMATS[name](record)  # no wrapper: content is the prompt
    assert set(FORMAT_AFFIXES) == set(FORMATS)
