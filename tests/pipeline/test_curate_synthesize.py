"""Prompts the target writes itself (Magpie-style): the user prefix is found in ChatML, Qwen-style and Llama-3-style
templates (and a template that hides the user's text is refused), every generation is kept or dropped under one
reason, the units resume after kill -9 with identical output, and the real SmolLM2 writes unique, clean prompts that
are the same under the same seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config import SynthesizeConfig, load_config
from pipeline.curate.synthesize import REASONS, judge, template_markers, user_prefix
from pipeline.errors import StageError
from pipeline.files import sha256_file
from pipeline.stage_dir import StageDir
from pipeline.target import build_byte_tokenizer, open_target
from tests.conftest import CACHE, REPO

QWEN25_TEMPLATE = (  # Qwen2.5's shape: a default system turn when the conversation has none
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
QWEN3_TEMPLATE = (  # Qwen3's shape: no default system turn, the thinking flag at the generation prompt
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n'"
    " + message.content + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")


def tokenizer_with(template: str, specials: list[str] = ()):
    tok = build_byte_tokenizer()
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok


def test_the_user_prefix_of_chatml_qwen_and_llama3_templates():
    chatml = tokenizer_with(build_byte_tokenizer().chat_template)
    p = user_prefix(chatml, system=None, enable_thinking=False)
    assert p.text == "<|im_start|>user\n" and p.end_of_turn == "<|im_end|>"
    assert chatml.convert_tokens_to_ids("<|im_end|>") in p.stop_ids and chatml.decode(p.ids) == p.text
    p = user_prefix(chatml, system="You write Python.", enable_thinking=False)
    assert p.text == "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n"

    qwen25 = tokenizer_with(QWEN25_TEMPLATE)
    p = user_prefix(qwen25, system=None, enable_thinking=False)
    assert p.text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                      "<|im_end|>\n<|im_start|>user\n") and p.end_of_turn == "<|im_end|>"
    qwen3 = tokenizer_with(QWEN3_TEMPLATE)
    for thinking in (False, True):  # the flag shapes only the assistant's turn, never the user prefix
        assert user_prefix(qwen3, system=None, enable_thinking=thinking).text == "<|im_start|>user\n"

    llama3 = tokenizer_with(LLAMA3_TEMPLATE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    p = user_prefix(llama3, system=None, enable_thinking=False)
    assert p.text == "<|im_start|><|start_header_id|>user<|end_header_id|>\n\n"  # bos is <|im_start|> here
    assert p.end_of_turn == "<|eot_id|>" and llama3.convert_tokens_to_ids("<|eot_id|>") in p.stop_ids
    assert "<|eot_id|>" in template_markers(llama3)


def test_a_template_that_does_not_show_the_users_text_is_refused():
    hiding = tokenizer_with("{%- for message in messages %}{{ message.role + ': ' + message.content | upper }}"
                            "{%- endfor %}")
    with pytest.raises(StageError, match="does not render a user message's text as it is"):
        user_prefix(hiding, system=None, enable_thinking=False)


@pytest.mark.parametrize("text, finish, reason", [
    ("How do I sort a list in Python?", "length", "truncated"),
    ("How do I sort<|im_start|>assistant a list?", "stop", "template_tokens"),
    ("   \n ", "stop", "empty"),
    ("How do I sort \ufffd a list in Python?", "stop", "undecodable"),
    ("How do I sort \x07 a list in Python?", "stop", "control_chars"),
    ("Sort it?", "stop", "too_short"),
    ("Sort " * 1000, "stop", "too_long"),
    ("12 + 34 = ? ### 56 * 78 = ?? (90)", "stop", "few_letters"),
    ("请问如何在 Python 中对列表进行排序呢", "stop", "not_latin"),
    ("Tell me more about the history of Rome, pleeeeeeeeeeeeeeeeeeease", "stop", "repetitive"),
    ("tell me tell me tell me tell me tell me tell me tell me", "stop", "repetitive"),
    ("How do I sort a list of dictionaries by one key in Python?", "stop", None),
    ("Wie sortiere ich eine Liste in Python? Ça marche où?", "stop", None),
])
def test_every_bad_generation_is_dropped_under_its_own_reason(text, finish, reason):
    s = SynthesizeConfig(min_chars=16, max_chars=2000)
    assert judge(text, finish, s, template_markers(build_byte_tokenizer())) == reason
    assert reason is None or reason in REASONS


def test_script_any_keeps_other_scripts_and_min_letter_share_zero_keeps_symbols():
    markers = template_markers(build_byte_tokenizer())
    assert judge("请问如何在 Python 中对列表进行排序呢", "stop", SynthesizeConfig(script="any"), markers) is None
    assert judge("12 + 34 = ? ### 56 * 78 = ?? (90)", "stop", SynthesizeConfig(min_letter_share=0), markers) is None


SYNTH = ("{name: self, synthesize: {count: 12, max_attempts: 48, batch_size: 8, max_new_tokens: 12, min_chars: 1, "
         "min_letter_share: 0, script: any}}")


def tiny_overrides(runs: Path, seed: int = 0) -> list[str]:
    """tiny.yaml with a synthesized source beside its random words (the random target's text fails the filters)."""
    return [f"runs_dir={runs}", f"cache_dir={CACHE}", f"seed={seed}", "curate.total=null", "curate.eval_size=4",
            f"curate.sources=[{{name: words, random_words: 40}}, {SYNTH}]"]


def synthesized(cfg) -> tuple[dict, list[str]]:
    """(the synthesized source's block of stats.json, sha256 of every curated shard)."""
    stage = StageDir(cfg.run_dir, "curate")
    stats = json.loads((stage.path / "stats.json").read_text())
    return stats["data"]["self"]["synthesized"], [sha256_file(p) for p in sorted(stage.shards.glob("*.parquet"))]


@pytest.mark.slow
def test_tiny_target_units_resume_after_kill_9_with_identical_output(tmp_path):
    """A real `drafter curate` is killed (SIGKILL) once a unit of generations is written: the rerun redoes no finished
    unit and the stage ends exactly as an uninterrupted run with the same seed (every attempt counted once, each drop
    under its reason); another seed writes other text."""
    from pipeline.curate.stage import run_curate

    runs = tmp_path / "killed"
    cfg = load_config(REPO / "configs/tiny.yaml", tiny_overrides(runs))
    cmd = [sys.executable, "-m", "drafter.cli", "curate", "--config", "configs/tiny.yaml", *tiny_overrides(runs)]
    env = {**os.environ, "DRAFTER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    units = cfg.run_dir / "curate" / "work" / "synth-self" / "shards"
    deadline = time.time() + 300
    while not list(units.glob("unit-*.done.json")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cfg.run_dir / "curate" / "manifest.json").exists(), "curate finished before it could be killed"
    finished = {p.name: p.read_bytes() for p in units.glob("unit-*")}
    assert finished, "no unit was finished before the kill"
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]

    reference = load_config(REPO / "configs/tiny.yaml", tiny_overrides(tmp_path / "whole"))
    run_curate(reference)
    killed, whole = synthesized(cfg), synthesized(reference)
    assert killed[1] == whole[1]  # the curated shards, byte for byte
    assert {k: v for k, v in killed[0].items() if k != "seconds"} == {k: v for k, v in whole[0].items() if k != "seconds"}
    s = whole[0]
    assert s["attempts"] == 48 and s["units"] == 6 and s["prefix"] == "<|im_start|>user\n"
    assert s["attempts"] == s["kept"] + sum(s["dropped"].values()) + s.get("not_needed", 0)
    assert set(s["dropped"]) <= set(REASONS) and all(s["examples"][r] for r in s["dropped"])
    report = (cfg.run_dir / "curate" / "report.md").read_text()
    assert "### self: prompts the target wrote" in report and "User prefix given to the target" in report
    other = load_config(REPO / "configs/tiny.yaml", tiny_overrides(tmp_path / "seed1", seed=1))
    run_curate(other)
    assert synthesized(other)[0]["examples"] != s["examples"]


@pytest.mark.slow
def test_smollm2_writes_unique_clean_prompts_the_same_under_the_same_seed(tmp_path, smollm2_dir):
    """The real SmolLM2, given only its template's user prefix (after its default system turn), writes prompts that
    pass every filter, are unique, hold no template token, and are the same text again under the same seed."""
    from pipeline.curate.synthesize import synthesize

    target = open_target(load_config(REPO / "configs/smollm2-135m.yaml").target, CACHE)  # one load for the 3 runs

    def run(name: str, seed: int) -> tuple[list[str], dict]:
        cfg = load_config(REPO / "configs/smollm2-135m.yaml", [
            f"runs_dir={tmp_path / name}", f"cache_dir={CACHE}", f"seed={seed}",
            "curate.sources=[{name: self, synthesize: {count: 4, batch_size: 4, max_new_tokens: 48}}]"])
        files, stats = synthesize(cfg, 0, target, StageDir(cfg.run_dir / "curate", "work"))
        prompts = [json.loads(line)["prompt"] for _, f in files for line in Path(f).read_text().splitlines()]
        return prompts, stats

    prompts, stats = run("a", 0)
    assert stats["prefix"].startswith("<|im_start|>system\n") and stats["prefix"].endswith("<|im_start|>user\n")
    assert stats["end_of_turn"] == "<|im_end|>"
    assert len(prompts) == 4 == stats["kept"] and len({p.lower() for p in prompts}) == 4
    markers = template_markers(target.tokenizer)
    s = SynthesizeConfig()
    assert all(judge(p, "stop", s, markers) is None for p in prompts), prompts
    assert stats["attempts"] == stats["kept"] + sum(stats["dropped"].values()) + stats.get("not_needed", 0)
    again, _ = run("b", 0)
    assert again == prompts
    other, _ = run("c", 1)
    assert other != prompts


@pytest.mark.slow
def test_the_demo_without_any_dataset_curates_and_holds_out_what_smollm2_wrote(tmp_path, smollm2_dir):
    """configs/smollm2-135m.yaml on a machine with neither a mirror nor the hub: every public set is absent (and
    said so), the synthesized fallback is the mix, and its held-out split is what eval scores (held_out)."""
    from eval.prompts import load_benchmarks
    from pipeline.curate.stage import run_curate

    data = yaml.safe_load((REPO / "configs/smollm2-135m.yaml").read_text())
    data["curate"]["sources"][3]["synthesize"] = {"count": 6, "batch_size": 4, "max_new_tokens": 48}
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(tmp_path / "demo.yaml", [f"runs_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}",
                                               "curate.eval_size=2", f"target.model={smollm2_dir}"])
    m = run_curate(cfg)
    status = {name: d["status"] for name, d in m["data"].items()}
    assert status == {"gsm8k_train": "absent", "code_alpaca_2k": "absent", "alpaca_seed_tasks": "absent",
                      "self_prompts": "used"}
    assert m["counts"]["train"] + m["counts"]["eval"] == 6 and m["counts"]["eval"] == 2
    benchmarks, data = load_benchmarks(cfg)
    assert list(benchmarks) == ["held_out"] and len(benchmarks["held_out"].prompts) == 2
    assert {n: d["status"] for n, d in data.items()} == {"gsm8k": "absent", "humaneval": "absent",
                                                          "mt_bench": "absent", "held_out": "used"}
    held = {r["messages"][0]["content"] for p in (cfg.run_dir / "curate" / "shards").glob("eval-*.parquet")
            for r in pq.read_table(p).to_pylist()}
    assert {p.turns[0] for p in benchmarks["held_out"].prompts} == held
