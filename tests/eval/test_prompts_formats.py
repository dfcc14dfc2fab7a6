"""Benchmark prompt formats (z-lab/dflash benchmark.py) on the real prompt files: the small jsonl/json subsets
and the full parquet sets vendored in data/prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.prompts import REASON_SUFFIX, chat_prompt_ids, load_benchmark
from pipeline.config import BenchmarkConfig, ConfigError
from pipeline.target import build_byte_tokenizer
from tests.conftest import make_config, prompt_records

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data" / "prompts"
DIRS = [pytest.param("subset", id="subset"), pytest.param("full", id="full")]
GSM8K = {"subset": "gsm8k_test_100.jsonl", "full": "gsm8k_test.parquet"}
CODE_ALPACA = {"subset": "code_alpaca_1k.json", "full": "code_alpaca_2k.parquet"}


def first_row(path: Path) -> dict:
    return prompt_records(path.name)[0]


@pytest.mark.parametrize("root", DIRS)
def test_gsm8k_prompt_is_question_then_boxed_instruction(root):
    path = SHIPPED / GSM8K[root]
    loaded = load_benchmark(BenchmarkConfig(name="gsm8k", path=str(path), num_samples=5))
    assert len(loaded.prompts) == 5 and loaded.read == 5 and not loaded.skipped
    p = loaded.prompts[0]
    assert p.turns == (first_row(path)["question"]
                       + "\nPlease reason step by step, and put your final answer within \\boxed{}.",)
    assert p.id == "gsm8k/0" and p.benchmark == "gsm8k"


def test_humaneval_prompt_wraps_the_code_in_a_python_block():
    path = SHIPPED / "humaneval.jsonl"
    loaded = load_benchmark(BenchmarkConfig(name="humaneval", path=str(path), num_samples=3))
    row = first_row(path)
    assert loaded.prompts[0].turns == (
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        + row["prompt"] + "\n```",)
    assert loaded.prompts[0].id == "humaneval/HumanEval/0"


def test_mt_bench_prompt_keeps_both_user_turns():
    path = SHIPPED / "mt_bench.jsonl"
    loaded = load_benchmark(BenchmarkConfig(name="mt_bench", path=str(path), num_samples=80))
    assert len(loaded.prompts) == 80
    assert all(len(p.turns) == 2 for p in loaded.prompts)
    assert loaded.prompts[0].turns == tuple(first_row(path)["turns"])
    assert loaded.prompts[0].id == "mt_bench/81"


@pytest.mark.parametrize("root", DIRS)
def test_alpaca_prompt_appends_the_input_when_there_is_one(root):
    seed = load_benchmark(BenchmarkConfig(name="alpaca", path=str(SHIPPED / "alpaca_seed_tasks.jsonl"), num_samples=175))
    rows = [json.loads(line) for line in (SHIPPED / "alpaca_seed_tasks.jsonl").read_text().splitlines()]
    assert len(seed.prompts) == 175
    for p, row in zip(seed.prompts, rows):
        inp = row["instances"][0]["input"]
        assert p.turns == ((row["instruction"] + "\n\n" + inp) if inp.strip() else row["instruction"],)
    code = load_benchmark(BenchmarkConfig(name="alpaca", path=str(SHIPPED / CODE_ALPACA[root]), num_samples=2))
    row = first_row(SHIPPED / CODE_ALPACA[root])
    assert code.prompts[0].turns == (row["instruction"] + "\n\n" + row["input"],)


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
    with pytest.raises(ConfigError, match=r"eval.benchmarks\[0\].path: required"):
        make_config(tmp_path, overrides=["eval.benchmarks=[{name: gsm8k, num_samples: 1}]"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_benchmark(BenchmarkConfig(name="gsm8k", path=str(tmp_path / "nope.jsonl"), num_samples=1))


def test_prompt_ids_are_the_chat_template_with_a_generation_prompt_and_the_thinking_flag():
    tok = build_byte_tokenizer()
    prompt = load_benchmark(BenchmarkConfig(name="humaneval", path=str(SHIPPED / "humaneval.jsonl"), num_samples=1))
    messages = [{"role": "user", "content": prompt.prompts[0].turns[0]}]
    ids = chat_prompt_ids(tok, messages, enable_thinking=False)
    assert tok.decode(ids) == f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    # the thinking flag reaches the template (Qwen3-style templates branch on it)
    tok.chat_template = tok.chat_template + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    assert tok.decode(chat_prompt_ids(tok, messages, enable_thinking=False)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(chat_prompt_ids(tok, messages, enable_thinking=True)).endswith("assistant\n")
