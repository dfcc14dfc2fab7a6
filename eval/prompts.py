"""Benchmark prompt sets and the prompt formats of the DFlash / DDTree evaluations.

One record of a benchmark file becomes one `EvalPrompt`: a tuple of user turns, already formatted.
The formats are those of `z-lab/dflash: dflash/benchmark.py` (also used by `liranringel/ddtree`):

    gsm8k      "{question}\\nPlease reason step by step, and put your final answer within \\\\boxed{}."
    math       "{problem}\\nPlease reason step by step, and put your final answer within \\\\boxed{}."
    humaneval  "Write a solution to the following problem and make sure that it passes the tests:\\n```python\\n{prompt}\\n```"
    mt_bench   the record's `turns` as they are (two user turns; the second is asked after the target's own
               first answer, see `eval.conversation.run_conversation`)
    alpaca     "{instruction}" or "{instruction}\\n\\n{input}" (Stanford-Alpaca seed tasks: the first instance's input)
    held_out   the first user turn of this run's curated eval conversations (`curate/shards/eval-*.parquet`), as it is

A benchmark's dataset is found by `pipeline.datasets` (own `path`, mirror copy, cache or hub; `load_benchmarks`
applies the `use` rule: an absent 'if_present' benchmark is left out, a 'fallback' one runs only when no other does).
Prompts are the first `num_samples` valid records, in file (or split) order (deterministic, no shuffle).
A record that lacks what its format needs, or that does not parse at all (any size, any parser error), is
skipped and counted under a reason with its location; it never crashes the stage.
Rendering goes through `pipeline.target.render_chat` (the one chat-template call, thinking flag included).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import BenchmarkConfig, ConfigError, RunConfig
from pipeline.curate.sources import Unparsed, dataset_records, parse_json, unreadable_file
from pipeline.datasets import Located, choose, load_hub, locate
from pipeline.rejects import Rejected
from pipeline.target import render_chat

REASON_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUB_BLOCK = 256  # hub rows read at once
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"


class MalformedRecord(Rejected):
    """A benchmark record lacks what its prompt format needs; `reason` is the counter key."""


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation conversation: formatted user turns (one, or two for MT-Bench)."""

    id: str  # "<benchmark>/<task id or line index>", stable across runs
    benchmark: str
    turns: tuple[str, ...]


@dataclass
class LoadedBenchmark:
    """The prompts taken from a benchmark file and an account of every record read."""

    name: str
    path: str
    prompts: list[EvalPrompt]
    read: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first record id with it


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise MalformedRecord(f"missing_{key}")
    return value


def format_gsm8k(record: dict) -> tuple[str, ...]:
    return (_text(record, "question") + REASON_SUFFIX,)


def format_math(record: dict) -> tuple[str, ...]:
    """MATH / MATH-500 records carry `problem`; a GSM8K-style `question` is accepted too."""
    key = "problem" if "problem" in record else "question"
    return (_text(record, key) + REASON_SUFFIX,)


def format_humaneval(record: dict) -> tuple[str, ...]:
    return (HUMANEVAL_PREFIX + "```python\n" + _text(record, "prompt") + "\n```",)


def format_mt_bench(record: dict) -> tuple[str, ...]:
    """FastChat `turns` (or HuggingFaceH4/mt_bench_prompts `prompt`): a list of user turns."""
    turns = record.get("turns", record.get("prompt"))
    if not isinstance(turns, list) or not turns:
        raise MalformedRecord("missing_turns")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise MalformedRecord("empty_turn")
    return tuple(turns)


def format_alpaca(record: dict) -> tuple[str, ...]:
    """Alpaca / Code-Alpaca (`instruction`, `input`) or Alpaca seed tasks (`instances[0].input`)."""
    instruction = _text(record, "instruction")
    extra = record.get("input")
    if extra is None and isinstance(record.get("instances"), list) and record["instances"]:
        extra = record["instances"][0].get("input") if isinstance(record["instances"][0], dict) else None
    if extra is not None and not isinstance(extra, str):
        raise MalformedRecord("bad_input")
    return (f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction,)


def format_held_out(record: dict) -> tuple[str, ...]:
    """A curated conversation (`messages`): its first user turn."""
    messages = record.get("messages")
    users = [m.get("content") for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[0], str) or not users[0].strip():
        raise MalformedRecord("missing_user_turn")
    return (users[0],)


# The (prefix, suffix) each format wraps around a record's content; `format_content` takes them off again
# (overlap checks compare content: every prompt of a benchmark shares its wrapper).
FORMAT_AFFIXES = {
    "gsm8k": ("", REASON_SUFFIX),
    "math": ("", REASON_SUFFIX),
    "humaneval": (HUMANEVAL_PREFIX + "```python\n", "\n```"),
    "mt_bench": ("", ""),
    "alpaca": ("", ""),
    "held_out": ("", ""),
}


def format_content(name: str, turn: str) -> str:
    """A formatted user turn of benchmark `name` without the format's wrapper."""
    prefix, suffix = FORMAT_AFFIXES[name]
    if prefix and turn.startswith(prefix):
        turn = turn[len(prefix):]
    if suffix and turn.endswith(suffix):
        turn = turn[: -len(suffix)]
    return turn


FORMATS = {
    "gsm8k": format_gsm8k,
    "math": format_math,
    "humaneval": format_humaneval,
    "mt_bench": format_mt_bench,
    "alpaca": format_alpaca,
    "held_out": format_held_out,
}


def _record_id(name: str, record: Any, index: int) -> str:
    if isinstance(record, dict):
        for key in ("task_id", "question_id", "id", "unique_id"):
            if key in record and isinstance(record[key], (str, int)):
                value = str(record[key])
                return value if value.startswith(f"{name}/") else f"{name}/{value}"
    return f"{name}/{index}"


def _read_records(path: Path) -> list[tuple[str, Any]]:
    """``(location, record)`` of every record of a .jsonl file (``file:line``; a line that does not parse, whatever
    its size, is an `Unparsed`), of a .json array (``file[i]``) or of a .parquet file (``file#row``). A .json or
    .parquet file that cannot be read as a whole is one error naming it."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - ArrowInvalid (corrupt footer), OSError, ...
            raise unreadable_file(str(path), e) from e
        return [(f"{path}#{i}", r) for i, r in enumerate(rows)]
    if path.suffix == ".json":
        data, error = parse_json(path.read_bytes())
        if error:
            raise ConfigError(f"{path}: {error}; expected a JSON array of records")
        if isinstance(data, dict):  # {"data": [...]} / {"train": [...]}
            lists = [v for v in data.values() if isinstance(v, list)]
            data = lists[0] if len(lists) == 1 else None
        if not isinstance(data, list):
            raise ConfigError(f"{path}: expected a JSON array of records")
        return [(f"{path}[{i}]", r) for i, r in enumerate(data)]
    rows = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record, error = parse_json(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            record, error = None, f"invalid UTF-8 at byte {e.start}"
        rows.append((f"{path}:{number}", Unparsed(error) if error else record))
    return rows


def benchmarks_in_use(cfg: RunConfig) -> tuple[RunConfig, dict[str, LoadedBenchmark], dict[str, dict]]:
    """`load_benchmarks`, and `cfg` with `eval.benchmarks` reduced to those in use (what the eval's units and config
    hash are made of)."""
    loaded, data = load_benchmarks(cfg)
    used = [b for b in cfg.eval.benchmarks if b.name in loaded]
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, benchmarks=used)), loaded, data


def load_benchmarks(cfg: RunConfig) -> tuple[dict[str, LoadedBenchmark], dict[str, dict]]:
    """The benchmarks in use after the `use` rule, name -> LoadedBenchmark, and per configured benchmark where its
    prompts came from or why it is absent (report.json's `data`). Raises DatasetMissing for a required benchmark
    found nowhere, StageError for 'held_out' before curate has finished."""
    from pipeline.stage_dir import StageDir

    def find(i: int, bench: BenchmarkConfig) -> Located:
        if bench.name == "held_out":
            curate = StageDir(cfg.run_dir, "curate")
            shards = sorted(curate.shards.glob("eval-*.parquet"))
            return Located(bench.name, "curate eval split", tuple(("parquet", str(p)) for p in shards),
                           f"{curate.shards}/eval-*.parquet", {"curate_config_hash": curate.manifest()["config_hash"]})
        return locate(bench, bench.name, f"eval.benchmarks[{i}]", data_dir=cfg.data_dir, cache_dir=cfg.cache_dir)

    choices = choose(cfg.eval.benchmarks, "eval.benchmarks", find)
    loaded = {c.name: load_benchmark(cfg.eval.benchmarks[c.index], c.located) for c in choices if c.status == "used"}
    return loaded, {c.name: c.record() for c in choices}


def load_benchmark(bench: BenchmarkConfig, located: Located | None = None) -> LoadedBenchmark:
    """The first `bench.num_samples` well-formed prompts of the benchmark's dataset (`located`: what
    `pipeline.datasets` found; None = `bench.path`, a local file) in the `bench.name` format."""
    if located is None:
        path = Path(bench.path)
        if not path.is_file():
            raise FileNotFoundError(f"eval benchmark {bench.name!r}: prompt file {path} does not exist")
        located = Located(bench.name, "path", (("file", str(path)),), str(path))
    fmt = FORMATS[bench.name]
    out = LoadedBenchmark(name=bench.name, path=located.identity, prompts=[])
    for index, (location, record) in enumerate(_located_records(bench, located)):
        if len(out.prompts) >= bench.num_samples:
            break
        out.read += 1
        if isinstance(record, Unparsed):
            out.skipped["bad_json"] += 1
            out.examples.setdefault("bad_json", f"{location}: {record.error}")
            continue
        try:
            rid = _record_id(bench.name, record, index)
            if not isinstance(record, dict):
                raise MalformedRecord("not_a_record")
            turns = fmt(record)
        except MalformedRecord as e:
            out.skipped[e.reason] += 1
            out.examples.setdefault(e.reason, rid)
            continue
        except Exception as e:  # noqa: BLE001 - a record no format foresaw: skipped with its location, never fatal
            out.skipped["bad_record"] += 1
            out.examples.setdefault("bad_record", f"{location}: {type(e).__name__}: {str(e)[:200]}")
            continue
        out.prompts.append(EvalPrompt(id=rid, benchmark=bench.name, turns=turns))
    return out


def _located_records(bench: BenchmarkConfig, located: Located):
    """``(location, record)`` of the dataset's records in order: its files one after the other, or its hub split's
    rows (read lazily: only as many as the prompts need)."""
    for kind, path in located.files:
        if kind == "hub":
            ds = load_hub(bench.hub, bench.subset, bench.split, bench.revision, bench.data_files, located.cache)
            for start in range(0, len(ds), HUB_BLOCK):
                for r in dataset_records(ds, start, min(start + HUB_BLOCK, len(ds)), first=start,
                                         where=f"hub:{path}/{bench.split}"):
                    yield r.location, r.record
        else:
            yield from _read_records(Path(path))


def chat_prompt_ids(tokenizer, messages: list[dict], *, enable_thinking: bool) -> list[int]:
    """Token ids of `messages` rendered with the target's chat template and a generation prompt.

    The template already writes the special tokens (BOS, role markers), so none are added on top.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
