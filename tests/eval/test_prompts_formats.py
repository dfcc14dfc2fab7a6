"""Benchmark prompt formats (z-lab/dflash benchmark.py): on made-up files of each layout (jsonl/json and parquet)
and on the real public sets of the prompt mirror (skipped without $DRAFTER_DATA_DIR)."""

from __future__ import annotations

import json

import pytest

from eval.prompts import REASON_SUFFIX, chat_prompt_ids, load_benchmark
from pipeline.config import BenchmarkConfig, ConfigError
from pipeline.target import build_byte_tokenizer
from tests.conftest import make_config, mirror_file, read_records, synthetic_records, write_records

KINDS = ["made_up", "made_up_parquet", "mirror"]
MIRROR_NAMES = {"gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl", "mt_bench": "mt_bench.jsonl",
                "alpaca": "code_alpaca_2k.json", "seed": "alpaca_seed_tasks.jsonl"}


def prompt_file(kind: str, layout: str, tmp_path):
    """A file of `layout` records: made up by the test (as jsonl/json or parquet), or the mirror's real set."""
    if kind == "mirror":
        return mirror_file(MIRROR_NAMES[layout])
    suffix = ".parquet" if kind == "made_up_parquet" else (".json" if layout == "alpaca" else ".jsonl")
    return write_records(tmp_path / f"{layout}{suffix}", synthetic_records(layout, 200))


@pytest.mark.parametrize("kind", KINDS)
def test_gsm8k_prompt_is_question_then_boxed_instruction(kind, tmp_path):
    path = prompt_file(kind, "gsm8k", tmp_path)
    loaded = load_benchmark(BenchmarkConfig(name="gsm8k", path=str(path), num_samples=5))
    assert len(loaded.prompts) == 5 and loaded.read == 5 and not loaded.skipped
    p = loaded.prompts[0]
    assert p.turns == (read_records(path)[0]["question"]
                       + "\nPlease reason step by step, and put your final answer within \\boxed{}.",)
    assert p.id == "gsm8k/0" and p.benchmark == "gsm8k"


@pytest.mark.parametrize("kind", KINDS)
def test_humaneval_prompt_wraps_the_code_in_a_python_block(kind, tmp_path):
    path = prompt_file(kind, "humaneval", tmp_path)
    loaded = load_benchmark(BenchmarkConfig(name="humaneval", path=str(path), num_samples=3))
    row = read_records(path)[0]
    assert loaded.prompts[0].turns == (
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        + row["prompt"] + "\n```",)
    assert loaded.prompts[0].id == f"humaneval/{row['task_id']}"


@pytest.mark.parametrize("kind", KINDS)
def test_mt_bench_prompt_keeps_both_user_turns(kind, tmp_path):
    path = prompt_file(kind, "mt_bench", tmp_path)
    loaded = load_benchmark(BenchmarkConfig(name="mt_bench", path=str(path), num_samples=80))
    assert len(loaded.prompts) == 80
    assert all(len(p.turns) == 2 for p in loaded.prompts)
    row = read_records(path)[0]
    assert loaded.prompts[0].turns == tuple(row["turns"])
    assert loaded.prompts[0].id == f"mt_bench/{row['question_id']}"


def test_alpaca_seed_task_prompt_appends_the_first_instance_input():
    path = mirror_file(MIRROR_NAMES["seed"])
    seed = load_benchmark(BenchmarkConfig(name="alpaca", path=str(path), num_samples=175))
    rows = read_records(path)
    assert len(seed.prompts) == 175
    for p, row in zip(seed.prompts, rows):
        inp = row["instances"][0]["input"]
        assert p.turns == ((row["instruction"] + "\n\n" + inp) if inp.strip() else row["instruction"],)


@pytest.mark.parametrize("kind", KINDS)
def test_alpaca_prompt_appends_the_input_when_there_is_one(kind, tmp_path):
    path = prompt_file(kind, "alpaca", tmp_path)
    rows = read_records(path)
    code = load_benchmark(BenchmarkConfig(name="alpaca", path=str(path), num_samples=20))
    for p, row in zip(code.prompts, rows):
        assert p.turns == ((row["instruction"] + "\n\n" + row["input"]) if row["input"] else row["instruction"],)
    seed = {"instruction": "Name a colour.", "instances": [{"input": "Think of the sky.", "output": "Blue."}]}
    assert load_benchmark(BenchmarkConfig(name="alpaca", path=str(write_records(tmp_path / "seed.jsonl", [seed])),
                                          num_samples=1)).prompts[0].turns == ("Name a colour.\n\nThink of the sky.",)


def test_math_prompt_uses_the_problem_field(tmp_path):
    path = tmp_path / "math500.jsonl"
    path.write_text(json.dumps({"problem": "What is $1+1$?", "answer": "2", "unique_id": "test/algebra/1.json"}) + "\n")
    loaded = load_benchmark(BenchmarkConfig(name="math", path=str(path), num_samples=4))
    assert loaded.prompts[0].turns == ("What is $1+1$?" + REASON_SUFFIX,)
    assert loaded.prompts[0].id == "math/test/algebra/1.json"


def test_malformed_records_are_skipped_counted_and_do_not_use_up_samples(tmp_path):
    path = tmp_path / "gsm.jsonl"
    lines = ['{"question": "q1"}', "not json", '{"answer": "no question"}', '["a list"]', '{"question": "q2"}']
    path.write_text("\n".join(lines) + "\n")
    loaded = load_benchmark(BenchmarkConfig(name="gsm8k", path=str(path), num_samples=2))
    assert [p.turns[0].split("\n")[0] for p in loaded.prompts] == ["q1", "q2"]
    assert loaded.read == 5
    assert dict(loaded.skipped) == {"bad_json": 1, "missing_question": 1, "not_a_record": 1}
    assert loaded.examples["missing_question"] == "gsm8k/2"


def test_a_line_of_any_size_that_does_not_parse_is_skipped_with_file_and_line(tmp_path):
    path = tmp_path / "gsm.jsonl"
    lines = [b'{"question": "q1"}', b"[" * 100_000, b'{"question": "q2", "n": ' + b"7" * 5000 + b"}",
             b'{"question": "caf\xe9"}', b'{"question": "q3"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    loaded = load_benchmark(BenchmarkConfig(name="gsm8k", path=str(path), num_samples=2))
    assert [p.turns[0].split("\n")[0] for p in loaded.prompts] == ["q1", "q3"]
    assert loaded.read == 5 and dict(loaded.skipped) == {"bad_json": 3}
    assert loaded.examples["bad_json"].startswith(f"{path}:2: unparseable JSON: RecursionError")


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_an_unreadable_prompt_file_is_one_error_naming_it(tmp_path, suffix):
    from pipeline.errors import StageError

    path = tmp_path / f"gsm{suffix}"
    if suffix == ".json":
        path.write_bytes(b"[" * 100_000)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"question": ["q1", "q2"]}), path)
        path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises((ConfigError, StageError), match=rf"{path}.*(RecursionError|magic bytes)"):
        load_benchmark(BenchmarkConfig(name="gsm8k", path=str(path), num_samples=2))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.benchmarks\[0\]: name the dataset by exactly one public identity "
                                          r"\(hub, url or origin\), or give your own file as path"):
        make_config(tmp_path, overrides=["eval.benchmarks=[{name: gsm8k, num_samples: 1}]"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_benchmark(BenchmarkConfig(name="gsm8k", path=str(tmp_path / "nope.jsonl"), num_samples=1))


def test_prompt_ids_are_the_chat_template_with_a_generation_prompt_and_the_thinking_flag(tmp_path):
    tok = build_byte_tokenizer()
    path = write_records(tmp_path / "h.jsonl", synthetic_records("humaneval", 1))
    prompt = load_benchmark(BenchmarkConfig(name="humaneval", path=str(path), num_samples=1))
    messages = [{"role": "user", "content": prompt.prompts[0].turns[0]}]
    ids = chat_prompt_ids(tok, messages, enable_thinking=False)
    assert tok.decode(ids) == f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    # the thinking flag reaches the template (Qwen3-style templates branch on it)
    tok.chat_template = tok.chat_template + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    assert tok.decode(chat_prompt_ids(tok, messages, enable_thinking=False)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(chat_prompt_ids(tok, messages, enable_thinking=True)).endswith("assistant\n")
