"""Every class of issue 33's careless-user probes, one named case each, through the real CLI entry in process
(`drafter.cli.main`): one error line that names the culprit and the repair, exit 2, no traceback, nothing written —
and the other side of the boundary: a bug keeps its traceback and asks for a report.

(The same classes, generated: test_fuzz_*.py; the installed CLI in a subprocess: test_cli_subprocess.py.)"""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch

from drafter.cli import REPORT_A_BUG, run_command
from eval.report import write_report
from pipeline.config import BenchmarkConfig, ConfigError
from tests.conftest import CACHE, REPO, synthetic_records, write_records
from tests.eval.test_report_files import make_report
from tests.reliability.fuzz import assert_one_error_line, digest, run_cli

TINY = str(REPO / "configs" / "tiny.yaml")


def merge_argv(config: str, tmp_path, *extra: str) -> list[str]:
    """`drafter tokenize --merge` on an empty runs_dir: config, launcher and flags are read, then the first stage input
    is missing (what a config that passes every check ends in)."""
    return ["tokenize", "--merge", "--config", config, f"runs_dir={tmp_path / 'runs'}", *extra]


def bomb(depth: int = 9, width: int = 9) -> str:
    return "\n".join(["a0: &a0 [x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]"
                                        for i in range(1, depth + 1)]) + "\n"


CONFIG_FILES = {  # name -> (file content, what the line says)
    "yaml_syntax_error": (b"name: tiny\ntrain: {lr: 1\n", "not valid YAML: while parsing a flow mapping"),
    "not_utf8": (b"# caf\xe9\nname: tiny\n", "not UTF-8 text (byte 0xe9 on line 1)"),
    "utf16": ("name: tiny\n".encode("utf-16"), "not UTF-8 text"),
    "deep_nesting": (("x: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nested more than 32 levels deep"),
    "alias_bomb": (bomb().encode(), "through YAML aliases"),
    "recursive_anchor": (b"a: &a [*a]\n", "recursive anchor"),
    "duplicate_key": (b"train: {lr: 1.0e-3}\ntrain: {epochs: 2}\n", "key 'train' appears twice"),
    "python_tag": (b"train: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
    "too_large": (b"#" + b"x" * (2 << 20), "a run config is a few KiB"),
    "top_level_list": (b"- a\n", "the top level must be a mapping"),
}


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_a_damaged_config_file_is_one_line_naming_it(tmp_path, name):
    content, says = CONFIG_FILES[name]
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    started = time.monotonic()
    line = assert_one_error_line("tokenize", *run_cli(merge_argv(str(path), tmp_path)))
    assert time.monotonic() - started < 5 and line.startswith(f"drafter tokenize: error: {path}: ") and says in line
    assert path.read_bytes() == content and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "missing"])
def test_a_config_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path, kind):
    """A FIFO would block the read forever, a device (/dev/zero) never ends: refused on stat, never opened."""
    path = {"fifo": tmp_path / "fifo.yaml", "directory": REPO / "configs", "device": "/dev/zero",
            "missing": tmp_path / "nope.yaml"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    line = assert_one_error_line("tokenize", *run_cli(merge_argv(str(path), tmp_path)))
    says = {"fifo": "is a FIFO, not a config file", "directory": "is a directory, not a config file",
            "device": "is a device, not a config file", "missing": "no such config file"}[kind]
    assert says in line, line


VALUES = {  # override -> what the line says
    "train.lr=inf": "train.lr: inf is not a finite number",
    "train.lr=1e999": "train.lr: inf is not a finite number",
    "train.epochs=.inf": "train.epochs: inf is not a finite number",
    "eval.temperature=inf": "eval.temperature: inf is not a finite number",
    "drafter.rope_theta=inf": "drafter.rope_theta: inf is not a finite number",
    "train.grad_clip=inf": "train.grad_clip: inf is not a finite number",
    "train.lr=nan": "train.lr: nan is not a finite number",
    "target.random_init={rope_theta: .inf}": "target.random_init.rope_theta: inf is not a finite number",
    "regen.prompt_formats={gsm8kk: ['{prompt}']}": "regen.prompt_formats.gsm8kk: no curate source is named 'gsm8kk'",
    "target.model=random:qwen4": "'random:qwen4' is not a random target type",
    "target.model=pkg:other": "unknown package target 'pkg:other'",
    "eval.budgets=[1,": "not valid YAML",
}


@pytest.mark.parametrize("override", VALUES)
def test_a_meaningless_value_is_one_line_naming_the_key(tmp_path, override):
    line = assert_one_error_line("tokenize", *run_cli(merge_argv(TINY, tmp_path, override)))
    assert VALUES[override] in line, line


def test_a_typo_in_a_dict_option_names_the_closest_key(tmp_path):
    line = assert_one_error_line("tokenize", *run_cli(merge_argv(TINY, tmp_path,
                                                                 "regen.prompt_formats={wrods: ['{prompt}']}")))
    assert line.endswith("did you mean 'words'?"), line  # tiny.yaml's one curate source is 'words'
    line = assert_one_error_line("plan", *run_cli(["plan", "--config", TINY, f"cache_dir={CACHE}",
                                                   "target.random_init={hidden_sizee: 64}"]))
    assert "target.random_init.hidden_sizee: not a field of the qwen3 config; did you mean " \
           "'target.random_init.hidden_size'?" in line, line


LAUNCHER = {  # (environment, flags) -> what the line says
    "RANK=abc": ({"RANK": "abc", "WORLD_SIZE": "2"}, [], "RANK='abc' is not an integer"),
    "WORLD_SIZE=two": ({"RANK": "0", "WORLD_SIZE": "two"}, [], "WORLD_SIZE='two' is not an integer"),
    "WORLD_SIZE=0": ({"RANK": "0", "WORLD_SIZE": "0"}, [], "world size 0 (from torchrun)"),
    "SLURM_ARRAY_TASK_ID=x": ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, [],
                              "SLURM_ARRAY_TASK_ID='x' is not an integer"),
    "SLURM_PROCID=1.5": ({"SLURM_PROCID": "1.5", "SLURM_NTASKS": "2"}, [], "SLURM_PROCID='1.5' is not an integer"),
    "--world-size 0": ({}, ["--world-size", "0"], "--world-size 0: the number of workers must be >= 1"),
    "--rank 2 --world-size 2": ({}, ["--rank", "2", "--world-size", "2"], "rank 2 is outside world size 2"),
}


@pytest.mark.parametrize("case", LAUNCHER)
def test_launcher_variables_and_flags_that_are_no_rank_are_one_line(tmp_path, monkeypatch, case):
    env, flags, says = LAUNCHER[case]
    for k in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    line = assert_one_error_line("tokenize", *run_cli(merge_argv(TINY, tmp_path, *flags)))
    assert says in line, line


def test_duplicate_prompt_ids_in_a_benchmark_are_refused_naming_both_records(tmp_path):
    from eval.prompts import load_benchmark

    rows = synthetic_records("humaneval", 3)
    rows[2]["task_id"] = rows[0]["task_id"]
    path = write_records(tmp_path / "dup.jsonl", rows)
    with pytest.raises(ConfigError, match=rf"prompt id 'humaneval/{rows[0]['task_id']}' appears twice \({path}:1 and "
                                          rf"{path}:3\)"):
        load_benchmark(BenchmarkConfig(name="humaneval", path=str(path), num_samples=3))


# -- exports ---------------------------------------------------------------------------------------------------

def export_dir(tmp_path):
    from dflash_model.export import export_zlab
    from dflash_model.model import DFlashDrafter, DrafterArgs

    args = DrafterArgs(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=96, block_size=8,
                       mask_token_id=95, target_layer_ids=[1, 3], num_target_layers=6)
    torch.manual_seed(0)
    return export_zlab(DFlashDrafter(args), args, tmp_path / "export")


def header_edit(edit):
    def apply(data: bytes) -> bytes:
        n = struct.unpack("<Q", data[:8])[0]
        header, body = json.loads(data[8:8 + n]), data[8 + n:]
        header, body = edit(header, body)
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + body
    return apply


def first_2d(header):
    return next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)


EXPORTS = {  # name -> (file, edit, what the message says)
    "config_missing_a_field": ("config.json", lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"},
                               "field 'num_hidden_layers' is missing"),
    "config_wrong_type": ("config.json", lambda c: {**c, "hidden_size": "32"},
                          "field 'hidden_size' is a string, not an integer"),
    "unknown_rope_scaling": ("config.json", lambda c: {**c, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                             "unsupported RoPE scaling"),
    "absurd_block_size": ("config.json", lambda c: {**c, "block_size": 10 ** 9}, "block_size 1000000000 is out of range"),
    "absurd_hidden_size": ("config.json", lambda c: {**c, "hidden_size": 2 ** 20}, "config.json implies"),
    "absurd_layer_count": ("config.json", lambda c: {**c, "num_hidden_layers": 10 ** 6, "layer_types": None},
                           "num_hidden_layers 1000000 is out of range"),
    "heads_zero": ("config.json", lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads 0 is out of range"),
    "huge_header_length": ("model.safetensors", lambda b: struct.pack("<Q", 2 ** 60) + b[8:],
                           "does not fit the file"),
    "huge_header": ("model.safetensors", header_edit(lambda h, b: ({**h, "__metadata__": {"x": "y" * (101 << 20)}}, b)),
                    "does not fit the file"),
    "lying_offsets": ("model.safetensors", header_edit(lambda h, b: ({**h, first_2d(h): {
        **h[first_2d(h)], "data_offsets": [h[first_2d(h)]["data_offsets"][0], 10 ** 12]}}, b)), "outside the file"),
    "truncated": ("model.safetensors", lambda b: b[:-4], "truncated or extended"),
    "wrongly_shaped_tensor": ("model.safetensors", header_edit(lambda h, b: ({**h, first_2d(h): {
        **h[first_2d(h)], "shape": h[first_2d(h)]["shape"][::-1]}}, b)), "config.json implies"),
    "extra_tensor": ("model.safetensors", header_edit(lambda h, b: ({**h, "lm_head.weight": {
        "dtype": "F32", "shape": [2], "data_offsets": [len(b), len(b) + 8]}}, b + bytes(8))), "unexpected ['lm_head"),
    "unknown_dtype": ("model.safetensors", header_edit(lambda h, b: ({**h, first_2d(h): {
        **h[first_2d(h)], "dtype": "F99"}}, b)), "dtype 'F99'"),
}


@pytest.mark.parametrize("name", EXPORTS)
def test_a_damaged_export_is_refused_naming_the_file_before_any_allocation(tmp_path, name):
    from dflash_model.export import load_zlab
    from pipeline.errors import DamagedFile

    out = export_dir(tmp_path)
    file, edit, says = EXPORTS[name]
    data = (out / file).read_bytes()
    (out / file).write_bytes(json.dumps(edit(json.loads(data))).encode() if file == "config.json" else edit(data))
    before = digest(out)
    started = time.monotonic()
    with pytest.raises(DamagedFile) as e:
        load_zlab(out)
    assert time.monotonic() - started < 5
    assert says in str(e.value) and str(out) in str(e.value) and "export it again" in str(e.value), str(e.value)
    assert digest(out) == before


def gsm8k_benchmark(tmp_path, records: list[dict] | None = None) -> str:
    """The eval.benchmarks override of one made-up GSM8K-layout file under tmp_path (tiny.yaml's own benchmark is
    the held-out split, which needs a curated run)."""
    path = write_records(tmp_path / "prompts" / "gsm8k.jsonl", records or synthetic_records("gsm8k", 3))
    return f"eval.benchmarks=[{{name: gsm8k, path: {path}, num_samples: 3}}]"


def test_drafter_eval_refuses_a_damaged_export_in_one_line_before_its_stage_begins(tmp_path):
    out = export_dir(tmp_path)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "block_size": 10 ** 9}))
    runs = tmp_path / "runs"
    line = assert_one_error_line("eval", *run_cli(["eval", "--config", TINY, f"runs_dir={runs}", f"cache_dir={CACHE}",
                                                   f"eval.drafter={out}", "train.wandb.mode=disabled",
                                                   gsm8k_benchmark(tmp_path)]))
    assert f"{out / 'config.json'}: block_size 1000000000 is out of range" in line, line
    assert not (runs / "tiny" / "eval").exists()


def test_drafter_eval_refuses_duplicate_prompt_ids_in_one_line_before_any_model_is_loaded(tmp_path):
    records = synthetic_records("humaneval", 3)
    records[2]["task_id"] = records[0]["task_id"]
    path = write_records(tmp_path / "prompts" / "dup.jsonl", records)
    runs = tmp_path / "runs"
    line = assert_one_error_line("eval", *run_cli(["eval", "--config", TINY, f"runs_dir={runs}", f"cache_dir={CACHE}",
                                                   f"eval.benchmarks=[{{name: humaneval, path: {path}}}]",
                                                   f"eval.drafter={tmp_path / 'no-drafter'}"]))
    assert f"prompt id 'humaneval/{records[0]['task_id']}' appears twice ({path}:1 and {path}:3)" in line, line
    assert not (runs / "tiny" / "eval").exists()


# -- drafter report ------------------------------------------------------------------------------------------

@pytest.fixture
def two_runs(tmp_path):
    for run in ("a", "b"):
        write_report(make_report(run, [[2, 3]], [[3, 4]]), tmp_path / run / "eval")
    return tmp_path / "a" / "eval", tmp_path / "b" / "eval"


def test_report_refuses_an_output_directory_that_is_an_input_and_leaves_it_as_it_was(two_runs):
    a, b = two_runs
    before = digest(a, b)
    line = assert_one_error_line("report", *run_cli(["report", str(a), str(b), "--out", str(a)]))
    assert f"--out {a} is the input {a}: the comparison would overwrite that run's report.json" in line, line
    assert digest(a, b) == before


@pytest.mark.parametrize("case", ["one_directory", "the_same_run_twice", "out_is_a_file", "missing_input",
                                  "report_of_the_wrong_shape", "not_json"])
def test_report_misuse_is_one_line(two_runs, tmp_path, case):
    a, b = two_runs
    (tmp_path / "file").write_text("x")
    if case == "report_of_the_wrong_shape":
        (b / "report.json").write_text(json.dumps([{"cells": []}]))
    if case == "not_json":
        (b / "report.json").write_text('{"cells": [')
    argv, says = {
        "one_directory": ([a], "1 eval directory given; it compares two or more"),
        "the_same_run_twice": ([a, a.parent / ".." / "a" / "eval"], "are the same eval run"),
        "out_is_a_file": ([a, b, "--out-file"], "is a file, not a directory"),
        "missing_input": ([a, tmp_path / "nope"], "does not exist"),
        "report_of_the_wrong_shape": ([a, b], "holds a list, not an object"),
        "not_json": ([a, b], "not valid JSON"),
    }[case]
    out = tmp_path / ("file" if "--out-file" in argv else "cmp")
    argv = [str(x) for x in argv if x != "--out-file"]
    line = assert_one_error_line("report", *run_cli(["report", *argv, "--out", str(out)]))
    assert says in line, line
    assert not (tmp_path / "cmp").exists()


# -- the other side of the boundary: a bug is never hidden -----------------------------------------------------

def test_an_unexpected_exception_keeps_its_traceback_and_asks_for_a_report(capsys):
    def command_with_a_bug():
        return {}["a key no code writes"]

    assert run_command("train", command_with_a_bug) == 70
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "KeyError: 'a key no code writes'" in err
    assert err.strip().splitlines()[-1] == f"drafter train: internal error: {REPORT_A_BUG}"


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    assert run_command("regen", interrupted) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("drafter regen: interrupted")


def test_a_refusal_listing_several_fields_indents_them_under_the_one_error_line(capsys):
    from pipeline.errors import FingerprintMismatch

    def mismatch():
        raise FingerprintMismatch("the tokenized data does not match this config (fields differ):\n"
                                  "  target.model: this config wants 'a', tokenize has 'b'\nRe-run 'drafter tokenize'")

    assert run_command("extract", mismatch) == 2
    lines = capsys.readouterr().err.strip().split("\n")
    assert lines[0].startswith("drafter extract: error: the tokenized data does not match")
    assert lines[1:] == ["  target.model: this config wants 'a', tokenize has 'b'", "  Re-run 'drafter tokenize'"]


def test_a_damaged_file_raised_in_a_worker_process_reaches_the_stage_whole():
    """tokenize's workers raise to the stage's process through pickle: a DamagedFile comes back with its path,
    problem and repair (it has three parts, so the default exception pickling could not rebuild it)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from pipeline.errors import DamagedFile

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        with pytest.raises(DamagedFile) as raised:
            pool.submit(_raise_damaged, "/run/regen/shards/00001.parquet").result()
    e = raised.value
    assert (e.path, e.problem, e.repair) == ("/run/regen/shards/00001.parquet", "not readable parquet", "run it again")
    assert str(e) == "/run/regen/shards/00001.parquet: not readable parquet: the file is damaged. run it again"


def _raise_damaged(path: str) -> None:
    from pipeline.errors import DamagedFile

    raise DamagedFile(path, "not readable parquet", "run it again")


def test_a_shard_the_system_refuses_to_read_is_not_called_damaged(tmp_path):
    """`StageDir.reading_shard`: pyarrow's own failures (errno unset: a thrift error, a short read) make a
    DamagedFile with its repair; the system's refusals (errno set: permissions, I/O) pass through to the CLI's
    OSError message, since the file itself may be intact."""
    import errno

    from pipeline.errors import DamagedFile
    from pipeline.stage_dir import StageDir

    stage = StageDir(tmp_path, "regen")
    path = stage.shard_path("00001", "parquet")
    with pytest.raises(PermissionError):
        with stage.reading_shard(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
    with pytest.raises(DamagedFile, match="Couldn't deserialize thrift.*Delete it, its sidecar"):
        with stage.reading_shard(path):
            raise OSError("Couldn't deserialize thrift: TProtocolException: Invalid data")
