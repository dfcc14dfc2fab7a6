"""`drafter eval` end to end on configs/tiny.yaml with a random drafter exported by dflash_model/export.py:
reports written, greedy chain/DDTree reproduce AR, MT-Bench turn 2 follows the target's own answer,
kill -9 resume redoes no finished unit, and mismatched drafters are refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from drafter.cli import merge_stage
from eval.conversation import run_conversation
from eval.engine.decode import decode
from eval.lossless import NEAR_TIE_MARGIN as NEAR_TIE
from eval.prompts import EvalPrompt, chat_prompt_ids
from eval.stage import run_eval
from extract.layers import configured_layer_ids
from pipeline.config import load_config
from pipeline.errors import FingerprintMismatch, StageError
from pipeline.files import read_json
from pipeline.stage_dir import StageDir
from pipeline.target import load_target, load_tokenizer, materialize_target, tokenizer_fingerprint
from dflash_model.export import export_zlab
from dflash_model.model import DFlashDrafter, DrafterArgs
from tests.conftest import synthetic_records, write_records

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
SMALL = ["eval.budgets=[4,12]", "eval.max_new_tokens=12", "eval.warmup_tokens=2", "train.wandb.mode=disabled"]


def benchmarks(tmp_path: Path, gsm8k: int = 1, mt_bench: int | None = 1) -> str:
    """The eval.benchmarks override: made-up GSM8K- and MT-Bench-layout prompt files written under tmp_path (one
    single-turn and one multi-turn benchmark), `gsm8k` / `mt_bench` prompts of each (None: no MT-Bench)."""
    g = write_records(tmp_path / "prompts" / "gsm8k.jsonl", synthetic_records("gsm8k", 8))
    m = write_records(tmp_path / "prompts" / "mt_bench.jsonl", synthetic_records("mt_bench", 4))
    entries = [f"{{name: gsm8k, path: {g}, num_samples: {gsm8k}}}"]
    if mt_bench:
        entries.append(f"{{name: mt_bench, path: {m}, num_samples: {mt_bench}}}")
    return f"eval.benchmarks=[{', '.join(entries)}]"


def make_config(tmp_path: Path, overrides=()):
    """tiny.yaml with two benchmarks (one multi-turn), every method, two budgets: seconds on a CPU."""
    return load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *SMALL,
                                                    benchmarks(tmp_path), *overrides])


def export_random_drafter(cfg, out: Path, *, seed=0, tokenizer_fp: dict | None = None, **arg_overrides) -> Path:
    """A random-init drafter for cfg's target in the z-lab layout, plus the train manifest a train run writes."""
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    target_config = AutoConfig.from_pretrained(location)
    args = DrafterArgs.from_run_config(cfg, target_config, len(tok),
                                       layer_ids=configured_layer_ids(cfg.extract, target_config.num_hidden_layers))
    for k, v in arg_overrides.items():
        setattr(args, k, v)
    torch.manual_seed(seed)
    export_zlab(DFlashDrafter(args), args, out / "export")
    StageDir(out.parent, out.name).write_manifest(
        config_hash="test", started=time.time(),
        fingerprint={"drafter": {"block_size": args.block_size},
                     "features": {"tokenizer": tokenizer_fp or tokenizer_fingerprint(tok)}})
    return out / "export"


@pytest.fixture
def cfg(tmp_path):
    cfg = make_config(tmp_path)
    export_random_drafter(cfg, cfg.run_dir / "train")
    return cfg


@pytest.mark.slow
def test_eval_writes_every_report_and_greedy_speculation_reproduces_ar(cfg, capsys):
    manifest = run_eval(cfg, force=False)
    out = cfg.run_dir / "eval"
    report = json.loads((out / "report.json").read_text())
    labels = {(c["benchmark"], c["label"]) for c in report["cells"]}
    assert labels == {(b, m) for b in ("gsm8k", "mt_bench") for m in ("ar", "chain", "ddtree@4", "ddtree@12")}
    for c in report["cells"]:
        assert c["responses"] == (1 if c["benchmark"] == "gsm8k" else 2)  # mt_bench: 1 prompt x 2 turns
        assert c["ar_match"] == 1.0, f"{c['label']} changed the greedy output"
        assert 1.0 <= c["tau_mean"] <= cfg.drafter.block_size
        assert c["speedup"] is not None and c["tokens_per_second"] > 0
        if c["method"] != "ar":
            assert sum(c["histogram"]) == c["rounds"] and len(c["per_depth"]) == cfg.drafter.block_size - 1
        assert c["verify_paths"] == ["dynamic KV, HF forward"]  # the CPU default; the report says what was timed
    md = (out / "report.md").read_text()
    assert "verify forward: dynamic KV, HF forward" in md and "drafter forward: static context, eager" in md
    assert "captured while timing" not in md  # no CUDA graphs on the CPU, nothing captured late
    assert manifest["counts"]["units"] == 8 and manifest["counts"]["responses"] == 12
    html = (out / "report.html").read_text()
    assert "href=" not in html and html.count("data:image/png;base64,") == 5  # + the speedup plot
    assert (out / "report.md").read_text().split("\n## ")[1].startswith("Verdict")
    card = (cfg.run_dir / "train" / "export" / "README.md").read_text()  # the eval's results in the model card
    results = card.split("<!-- drafter-eval:start -->")[1].split("<!-- drafter-eval:end -->")[0]
    assert "Measured by `drafter eval` (run `tiny`" in results and "| gsm8k |" in results and "τ chain" in results
    printed = capsys.readouterr().out
    assert "[eval]" in printed and "| gsm8k |" in printed and "τ chain (speedup)" in printed
    # a finished eval with the same config is a no-op that prints the table again
    assert run_eval(cfg, force=False)["finished_at"] == manifest["finished_at"]
    assert "| mt_bench |" in capsys.readouterr().out


def test_the_timing_order_interleaves_the_units_per_prompt_and_skips_what_a_unit_journaled():
    from eval.prompts import EvalPrompt
    from eval.units import Unit, interleaved

    units = [Unit("gsm8k", "ar"), Unit("gsm8k", "chain"), Unit("gsm8k", "ddtree", 4)]
    prompts = [EvalPrompt(id=f"p{i}", benchmark="gsm8k", turns=("q",)) for i in range(4)]
    order = [(p.id, [u.label for u in us]) for p, us in interleaved(units, prompts, {u: set() for u in units})]
    assert order == [("p0", ["ar", "chain", "ddtree@4"]), ("p1", ["chain", "ddtree@4", "ar"]),
                     ("p2", ["ddtree@4", "ar", "chain"]), ("p3", ["ar", "chain", "ddtree@4"])]
    resumed = {units[0]: {"p0", "p1"}, units[1]: {"p0"}, units[2]: {"p0", "p1", "p2", "p3"}}  # after a kill
    order = [(p.id, [u.label for u in us]) for p, us in interleaved(units, prompts, resumed)]
    assert order == [("p1", ["chain"]), ("p2", ["ar", "chain"]), ("p3", ["ar", "chain"])]


@pytest.mark.slow
def test_ar_and_the_methods_are_timed_in_turn_prompt_by_prompt(tmp_path):
    """The units of a benchmark are timed interleaved, not one after another: each unit's timed span (first decode
    to last, in its sidecar) overlaps every other unit's."""
    cfg = make_config(tmp_path, ["eval.methods=[ar,chain]", benchmarks(tmp_path, gsm8k=3, mt_bench=None),
                                 "eval.lossless_check=false"])
    export_random_drafter(cfg, cfg.run_dir / "train")
    run_eval(cfg, force=False)
    spans = {name: s["timed"] for name, s in StageDir(cfg.run_dir, "eval").done_units().items()}
    assert set(spans) == {"gsm8k.ar", "gsm8k.chain"}
    (a0, a1), (c0, c1) = spans["gsm8k.ar"], spans["gsm8k.chain"]
    assert a0 < c1 and c0 < a1, spans  # one after the other would give a1 <= c0


@pytest.mark.slow
def test_mt_bench_second_turn_is_asked_after_the_targets_own_first_answer(cfg):
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    target = load_target(location, cfg.target)
    prompt = EvalPrompt(id="mt_bench/1000", benchmark="mt_bench", turns=("Write a haiku.", "Now make it rhyme."))
    gen = lambda ids: decode("ar", target, None, ids, max_new_tokens=12)  # noqa: E731
    (ids1, r1), (ids2, r2) = run_conversation(prompt, tok, gen, enable_thinking=False, max_prompt_tokens=4000)
    # the target's own greedy answer to turn 1, computed independently with HF generate
    hf = target.generate(torch.tensor([ids1]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[0, len(ids1):].tolist()
    assert r1.output_ids == hf[: len(r1.output_ids)]
    answer = tok.decode(r1.output_ids, skip_special_tokens=True)
    expected = chat_prompt_ids(tok, [{"role": "user", "content": "Write a haiku."},
                                     {"role": "assistant", "content": answer},
                                     {"role": "user", "content": "Now make it rhyme."}], enable_thinking=False)
    assert ids2 == expected
    assert ids2[: len(ids1)] == ids1 and tok.decode(ids2[len(ids1):]).startswith(answer + "<|im_end|>")
    # a turn that does not fit the context ends the conversation with a reason
    assert run_conversation(prompt, tok, gen, enable_thinking=False, max_prompt_tokens=10) == ["prompt_too_long"]


@pytest.mark.slow
@pytest.mark.parametrize("target_cache", ["auto", "static"])
def test_hybrid_target_runs_ar_chain_and_tree_aware_ddtree(tmp_path, target_cache):
    cfg = make_config(tmp_path, ["target.model=random:qwen3_5_text", "eval.budgets=[4]",
                                 benchmarks(tmp_path, mt_bench=None), f"eval.target_cache={target_cache}"])
    export_random_drafter(cfg, cfg.run_dir / "train")
    manifest = run_eval(cfg, force=False)
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    assert [c["label"] for c in report["cells"]] == ["ar", "chain", "ddtree@4"]
    assert all(c["ar_match"] == 1.0 for c in report["cells"][1:])
    assert report["skipped_methods"] == [] and manifest["skipped_methods"] == []
    kind = "hybrid: static KV" if target_cache == "static" else "hybrid: dynamic KV"
    assert all(c["verify_paths"] and c["verify_paths"][0].startswith(kind) for c in report["cells"])
    assert "tree-walked Gated-DeltaNet layers" in (cfg.run_dir / "eval" / "report.md").read_text()


def test_a_drafter_for_another_target_is_refused_before_decoding(tmp_path):
    cfg = make_config(tmp_path)
    export_random_drafter(cfg, cfg.run_dir / "train", target_layer_ids=[1, 4, 11], num_target_layers=12)
    with pytest.raises(StageError, match=r"does not fit this target:\n.*target_layer_ids: layer_ids \[1, 4, 11\] "
                                         r"out of range for a target with 8 decoder layers"):
        run_eval(cfg, force=False)
    assert not (cfg.run_dir / "eval").exists()


def test_a_drafter_trained_with_another_tokenizer_is_refused(tmp_path):
    cfg = make_config(tmp_path)
    location = materialize_target(cfg.target, cfg.cache_dir)
    other = dict(tokenizer_fingerprint(load_tokenizer(location, cfg.target)), chat_template_sha="0123456789abcdef")
    export_random_drafter(cfg, cfg.run_dir / "train", tokenizer_fp=other)
    with pytest.raises(FingerprintMismatch, match="tokenizer.chat_template_sha"):
        run_eval(cfg, force=False)


@pytest.mark.slow
def test_kill_9_mid_unit_resumes_at_the_first_prompt_not_written_and_equals_an_uninterrupted_run(tmp_path):
    """A real `drafter eval` subprocess is killed (SIGKILL) while a unit is half done: the rerun decodes neither a
    finished unit nor a prompt already in a unit's journal (their records, timings included, come back unchanged),
    every response appears exactly once, and every unit's responses (tokens, rounds, acceptance: all but the
    timings) and every cell's τ equal those of the same eval never interrupted."""
    bench = benchmarks(tmp_path, gsm8k=5, mt_bench=1)
    overrides = [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *SMALL, "eval.max_new_tokens=48", bench]
    cfg = load_config(REPO / "configs/tiny.yaml", overrides)
    export_random_drafter(cfg, cfg.run_dir / "train")
    shards, work = cfg.run_dir / "eval" / "shards", cfg.run_dir / "eval" / "work"
    cmd = [sys.executable, "-m", "drafter.cli", "eval", "--config", "configs/tiny.yaml", *overrides]
    env = {**os.environ, "DRAFTER_NO_PROGRESS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300

    def half_done_unit() -> bool:  # a journal holds a finished prompt of a unit that is not done
        return any(j.read_bytes().count(b"\n") >= 1 and not (shards / f"{j.stem}.done.json").exists()
                   for j in work.glob("*.jsonl"))

    while not half_done_unit() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cfg.run_dir / "eval" / "manifest.json").exists(), "the eval finished before it could be killed"
    done_before = {p.name: p.read_bytes() for p in shards.glob("*.done.json")}
    journaled = {j.stem: [json.loads(line) for line in j.read_text().split("\n")[:-1]]  # complete lines only
                 for j in work.glob("*.jsonl")}
    assert any(journaled.values()), "no prompt was journaled before the kill"

    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(list(shards.glob("*.done.json"))) == 8 and not list(work.glob("*.jsonl"))
    for name, content in done_before.items():
        assert (shards / name).read_bytes() == content, f"{name} was redone after the kill"
    for unit, entries in journaled.items():
        lines = [json.loads(line) for line in (shards / f"{unit}.jsonl").read_text().splitlines()]
        for entry in entries:  # the journaled responses are in the shard as they were: never decoded again
            assert [r for r in lines if r["prompt_id"] == entry["prompt_id"]] == entry["responses"], unit
        keys = [(r["prompt_id"], r["turn"]) for r in lines]
        assert len(keys) == len(set(keys)), f"{unit}: a response was written twice"
    assert not list((cfg.run_dir / "eval").rglob("*.tmp-*"))
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    assert sum(c["responses"] for c in report["cells"]) == 4 * (5 + 2)
    assert all(c["ar_match"] == 1.0 for c in report["cells"])
    assert re.search(r"\| gsm8k \| [\d.]+ \(", res.stdout)

    clean = make_config(tmp_path / "clean", ["eval.max_new_tokens=48", bench])  # the same prompts, never interrupted
    export_random_drafter(clean, clean.run_dir / "train")  # the same seed: the same drafter
    run_eval(clean)
    assert decoded(clean.run_dir) == decoded(cfg.run_dir)
    clean_report = json.loads((clean.run_dir / "eval" / "report.json").read_text())
    assert [(c["label"], c["benchmark"], c["tau_mean"], c["responses"]) for c in clean_report["cells"]] == \
           [(c["label"], c["benchmark"], c["tau_mean"], c["responses"]) for c in report["cells"]]


def decoded(run_dir: Path) -> dict[str, list[dict]]:
    """Unit name -> its shard's responses in file order, without the wall-clock fields (all that is deterministic)."""
    return {p.name: [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                     for line in p.read_text().splitlines()]
            for p in sorted((run_dir / "eval" / "shards").glob("*.jsonl"))}


@pytest.mark.slow
def test_split_ranks_share_the_units_and_the_last_rank_writes_the_report(tmp_path):
    from pipeline.stage_dir import RankInfo

    cfg = make_config(tmp_path, ["eval.methods=[ar,chain]", benchmarks(tmp_path, mt_bench=None)])
    export_random_drafter(cfg, cfg.run_dir / "train")
    first = run_eval(cfg, force=False, ranks=RankInfo(0, 2))
    assert {k: v for k, v in first.items() if k != "seconds"} == {  # rank 0's summary: its unit; chain is rank 1's
        "stage": "eval", "complete": False, "rank": 0, "world_size": 2, "units": ["gsm8k.ar"]}
    assert read_json(cfg.run_dir / "eval" / "ranks" / "rank-00000.json")["units"] == ["gsm8k.ar"]
    assert not (cfg.run_dir / "eval" / "report.json").exists()
    with pytest.raises(StageError, match=r"eval --merge: 1 of 2 units are not done \(e.g. \['gsm8k.chain'\]\)"):
        merge_stage("eval", cfg)
    manifest = run_eval(cfg, force=False, ranks=RankInfo(1, 2))
    assert merge_stage("eval", cfg) == manifest  # the last rank wrote the report: merging again changes nothing
    assert manifest["num_units"] == 2 and manifest["counts"]["responses"] == 2
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    assert report["cells"][1]["label"] == "chain" and report["cells"][1]["speedup"] > 0


def plant_curated_training_prompts(cfg, conversations: list[list[str]]) -> None:
    """A curate stage whose training split holds `conversations` (user turns, each answered; next to filler) — as
    if the eval sets had leaked in."""
    from pipeline.regen.stage import write_conversations

    stage = StageDir(cfg.run_dir, "curate")
    filler = [["Name three colours of the rainbow."], ["Sort this list: 3, 1, 2."]]
    rows = [{"id": f"leak/{i}", "source": "leak", "metadata": "{}",
             "messages": [m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "x"})]}
            for i, users in enumerate([*conversations, *filler])]
    write_conversations(stage.shards / "train-00000.parquet", rows)
    stage.write_manifest(config_hash="planted", fingerprint={}, counts={"train": len(rows)}, started=time.time())


def test_report_has_the_lossless_check_and_names_eval_prompts_found_in_the_training_set(cfg):
    gsm8k = synthetic_records("gsm8k", 1)[0]["question"]  # the first prompt of each benchmark (`benchmarks`)
    mt = synthetic_records("mt_bench", 1)[0]["turns"]
    plant_curated_training_prompts(cfg, [[f"Please help: {gsm8k}"], mt])
    run_eval(cfg)
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    o = report["overlap"]
    assert o["exact"] == 2 and o["near"] == 0
    assert {e["eval_id"] for e in o["examples"]} == {"gsm8k/0", "mt_bench/1000"}
    assert any("exact" in w and "training prompts" in w for w in report["verdict"]["warnings"])
    for c in report["cells"]:
        if c["method"] == "ar":
            assert c["lossless"] is None
        else:  # fp32 on the CPU: identical, so nothing to classify
            assert c["lossless"]["identical"] == 1.0 and c["lossless"]["identical_or_rounding"] == 1.0
    md = (cfg.run_dir / "eval" / "report.md").read_text()
    assert "## Lossless check" in md and "## Eval prompts in the training set" in md and "gsm8k/0 in leak/0" in md


def test_the_fp32_subset_decodes_the_first_prompts_of_each_benchmark_whole_in_fp32_and_they_equal_ar(tmp_path):
    """eval.fp32_subset = 2: the first two prompts of each benchmark decoded again by AR and every method with fp32
    copies of the target and drafter (here the eval itself is fp32 too): identical, reported per cell and in the
    lossless table. (A decoder fault makes them differ: the fault-injection test below.)"""
    cfg = make_config(tmp_path, ["eval.fp32_subset=2", benchmarks(tmp_path, gsm8k=3, mt_bench=None), "eval.budgets=[4]"])
    export_random_drafter(cfg, cfg.run_dir / "train")
    run_eval(cfg)
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    spec = [c for c in report["cells"] if c["method"] != "ar"]
    assert {c["label"] for c in spec} == {"chain", "ddtree@4"}
    for c in spec:
        sub = c["lossless"]["fp32_subset"]
        assert sub == {"prompts": 2, "max_new_tokens": cfg.eval.max_new_tokens, "identical": 1.0, "not_identical": []}
    assert not any("decoded in fp32" in w for w in report["verdict"]["warnings"])
    md = (cfg.run_dir / "eval" / "report.md").read_text()
    assert "fp32 subset: same as fp32 AR" in md and "| 2 / 2 |" in md


def test_lossless_check_finds_a_planted_divergence_and_replays_the_decoder_in_fp32(cfg):
    """The stage's check rebuilds each response's prompt ids (turn 2 after the shared turn-1 answer) and finds a
    planted divergence to the target's least likely token, at turn 1 of a two-turn prompt: beyond the near-tie
    margin. The fp32 replay re-decodes that prompt with the (correct) decoder, which agrees with AR: the replay
    judges the decoder, not an edited response file (a decoder fault is the next test)."""
    from eval.lossless import check_lossless
    from eval.units import Unit, plan_units, read_unit
    from eval.prompts import load_benchmark
    from pipeline.target import load_target as load

    run_eval(cfg)
    stage = StageDir(cfg.run_dir, "eval")
    units, _ = plan_units(cfg, None)
    chain = Unit("mt_bench", "chain")
    recs = read_unit(stage, chain)
    victim = next(r for r in recs if r.turn == 1)
    benchmarks = {b.name: load_benchmark(b) for b in cfg.eval.benchmarks}
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    first = next(r for r in recs if r.turn == 0)
    messages = [{"role": "user", "content": benchmarks["mt_bench"].prompts[0].turns[0]},
                {"role": "assistant", "content": tok.decode(first.output_ids, skip_special_tokens=True)},
                {"role": "user", "content": benchmarks["mt_bench"].prompts[0].turns[1]}]
    ids = chat_prompt_ids(tok, messages, enable_thinking=False)
    target = load(location, cfg.target)
    with torch.no_grad():
        worst = int(target(input_ids=torch.tensor([ids + victim.output_ids[:3]])).logits[0, -1].argmin())
    victim.output_ids[3] = worst
    path = stage.shard_path(chain.name, "jsonl")
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in recs))
    result = check_lossless(cfg, {u: read_unit(stage, u) for u in units}, benchmarks, tok, location)
    s = result[chain.name]
    assert s["divergences"] == 1 and s["not_near_tie"] == 1 and s["identical_or_near_tie"] == 0.5
    ex = s["not_near_tie_examples"][0]
    assert (ex["prompt_id"], ex["turn"], ex["position"], ex["method_token"]) == ("mt_bench/1000", 1, 3, worst)
    assert ex["fp32_replay"] == "identical" and s["fp32_replay_identical"] == 1 and s["bugs"] == 0
    assert result[Unit("gsm8k", "chain").name]["divergences"] == 0


@pytest.mark.slow
def test_a_decoder_that_commits_a_wrong_token_is_a_bug_the_fp32_replay_reproduces(cfg, monkeypatch):
    """A fault injected into the decoder (the target's choice at the tree root replaced by its least likely token,
    so every round that accepts no drafted token commits it) makes chain and DDTree leave AR's output; the fp32
    replay runs the same faulty decoder, the divergence comes back, and the report calls it a bug."""
    import eval.engine.decode
    from eval.engine.walk import target_choices

    def faulty_choices(logits, temperature, uniforms=None):
        choices = target_choices(logits, temperature, uniforms)
        if logits.shape[0] > 1:  # a drafted round (AR's rounds and every prefill have one row)
            choices = choices.clone()
            choices[0] = logits[0].argmin()
        return choices

    monkeypatch.setattr(eval.engine.decode, "target_choices", faulty_choices)
    cfg.eval.fp32_subset = 1
    run_eval(cfg)
    report = json.loads((cfg.run_dir / "eval" / "report.json").read_text())
    for c in report["cells"]:
        if c["method"] == "ar":
            continue
        s = c["lossless"]
        assert s["bugs"] >= 1 and s["identical_or_rounding"] < 1, c["label"]
        assert s["bug_examples"][0]["fp32_replay"] == "differs" and s["bug_examples"][0]["gap"] > NEAR_TIE
        assert s["fp32_subset"]["identical"] == 0.0 and s["fp32_subset"]["not_identical"][0]["outcome"] == "differs"
    assert any("a bug in speculative decoding" in w for w in report["verdict"]["warnings"])
    assert any("decoded in fp32" in w for w in report["verdict"]["warnings"])
    md = (cfg.run_dir / "eval" / "report.md").read_text()
    assert "fp32 replay differs" in md
