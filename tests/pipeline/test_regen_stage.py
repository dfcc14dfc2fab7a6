"""The regen stage: turn-by-turn regeneration against the target's own turns, failure accounting,
resume after kill -9, rank slicing, and `drafter regen` (and `drafter regen --merge`) ending with tokenized data."""

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

from pipeline.regen.conversation import end_of_turn_ids, prompt_ids
from pipeline.regen.generator import Sampling
from pipeline.regen.hf import HFGenerator
from pipeline.regen.stage import run_regen, write_conversations
from pipeline.errors import StageError
from pipeline.stage_dir import RankInfo, StageDir
from pipeline.target import load_target, load_tokenizer, materialize_target
from tests.conftest import CACHE, REPO, make_config, synthetic_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")


QUESTIONS = [r["question"] for r in synthetic_records("gsm8k", 100)]  # made-up word problems


def write_curated(run_dir: Path, conversations: list[list[dict]], per_shard: int = 1000) -> None:
    """Curate-stage output as design.md specifies it: train-NNNNN.parquet + manifest.json."""
    stage = StageDir(run_dir, "curate")
    rows = [{"id": f"test/{i}", "source": "test", "messages": m, "metadata": json.dumps({"i": i})}
            for i, m in enumerate(conversations)]
    for k in range(0, len(rows), per_shard):
        write_conversations(stage.shards / f"train-{k // per_shard:05d}.parquet", rows[k: k + per_shard])
    stage.write_manifest(config_hash="curated-for-tests", fingerprint={}, counts={"train": len(rows)},
                         started=time.time())


def single_turn(n: int, offset: int = 0) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[offset + i]}] for i in range(n)]


def short_questions(n: int, offset: int = 0) -> list[list[dict]]:
    return [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(offset, offset + n)]


def regen_rows(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "regen" / "shards").glob("*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def test_multi_turn_is_regenerated_turn_by_turn_against_the_targets_own_answers(tmp_path):
    cfg = make_config(tmp_path, overrides=["regen.max_new_tokens=24", "regen.max_samples=null"])
    conversations = [
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "DATASET ANSWER 1"},
         {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "DATASET ANSWER 2"},
         {"role": "user", "content": "And their sum?"}],
        [{"role": "user", "content": "MT-Bench style: first turn, no answer."},
         {"role": "user", "content": "Second turn, still no answer."}],
        [{"role": "user", "content": QUESTIONS[0]}],
    ]
    write_curated(cfg.run_dir, conversations)
    run_regen(cfg)
    rows = {r["id"]: r for r in regen_rows(cfg.run_dir)}
    assert sorted(rows) == ["test/0", "test/1", "test/2"]

    first = rows["test/0"]["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in first if m["role"] != "assistant"] == [
        "You are terse.", "Name a prime.", "Another one?", "And their sum?"]
    assert not any(m["content"].startswith("DATASET ANSWER") for m in first)
    assert [m["role"] for m in rows["test/1"]["messages"]] == ["user", "assistant", "user", "assistant"]
    meta = json.loads(rows["test/0"]["metadata"])
    assert meta["i"] == 0 and meta["regen"]["backend"] == "hf" and len(meta["regen"]["finish_reasons"]) == 3

    # Replay: each stored answer is exactly the greedy answer to the history of the *regenerated* turns.
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    gen = HFGenerator(load_target(location, cfg.target), pad_id=tok.pad_token_id, vocab_limit=len(tok),
                      stop_ids=end_of_turn_ids(tok, location), sampling=Sampling(), batch_size=1)
    for k, i in enumerate(j for j, m in enumerate(first) if m["role"] == "assistant"):
        out = gen.generate([prompt_ids(tok, first[:i], enable_thinking=False)], [24])[0]
        body = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        assert tok.decode(body, skip_special_tokens=False) == first[i]["content"], f"turn {k}"
        assert meta["regen"]["finish_reasons"][k] == out.finish_reason


def test_failures_are_recorded_with_reasons_and_every_input_is_accounted_for(tmp_path):
    cfg = make_config(tmp_path, overrides=["regen.max_new_tokens=8", "regen.max_model_len=200",
                                           "regen.shard_size=3", "regen.max_samples=7"])
    conversations = short_questions(3) + [
        [{"role": "user", "content": "x" * 400}],                          # prompt longer than max_model_len
        [{"role": "assistant", "content": "an answer before any question"}],  # malformed
        [{"role": "user", "content": "short"}, {"role": "user", "content": "y" * 300}],  # overflows at turn 1
        [{"role": "user", "content": "fine"}],
    ] + short_questions(2, offset=5)  # beyond max_samples: skipped
    write_curated(cfg.run_dir, conversations, per_shard=4)  # units straddle curate shards
    m = run_regen(cfg)
    c = m["counts"]
    assert c["input"] == 9 and c["skipped.max_samples"] == 2
    assert c["failed.context_overflow"] == 2 and c["failed.malformed"] == 1
    assert c["written"] == 4 and c["written"] + c["failed"] + c["skipped.max_samples"] == c["input"]
    ids = [r["id"] for r in regen_rows(cfg.run_dir)]
    assert ids == ["test/0", "test/1", "test/2", "test/6"]
    failures = {f["id"]: f for f in m["failure_examples"]}
    assert failures["test/3"]["reason"] == "context_overflow" and "max_model_len" in failures["test/3"]["detail"]
    assert failures["test/5"]["detail"].startswith("turn 1")
    assert failures["test/4"]["reason"] == "malformed"
    # every unit says how much of its time the backend took; the manifest adds them up beside the units' wall time
    sidecars = [json.loads(p.read_text()) for p in sorted((cfg.run_dir / "regen" / "shards").glob("*.done.json"))]
    assert len(sidecars) == 3 and all(0 < s["backend_seconds"] <= s["seconds"] for s in sidecars)
    assert m["backend_seconds"] == pytest.approx(sum(s["backend_seconds"] for s in sidecars), abs=1e-2)
    assert 0 < m["backend_seconds"] <= m["generation_seconds"] + 1e-2
    # regen.compile's auto is off on a CPU: nothing compiled, no CUDA graph
    assert all(s["compile_seconds"] == 0 and s["graphs_captured"] == 0 for s in sidecars)
    assert (m["compile_seconds"], m["graphs_captured"]) == (0, 0)


def test_the_backend_clock_counts_the_compiles_inside_its_generate_calls_only():
    """A unit's `compile_seconds`: torch.compile's time inside the backend's `generate` calls (a first call of a new
    shape compiles; a second of the same shape does not; a compile outside the calls is not the unit's)."""
    import torch

    from pipeline.regen.stage import BackendClock

    def double(x):
        return x * 2

    class Compiling:  # a backend whose step is torch.compile'd (dynamo's own frame compile: no C++ build)
        def __init__(self):
            self.step = torch.compile(double, backend="eager", dynamic=False)

        def generate(self, prompts, max_new_tokens, seeds=None):
            return [self.step(torch.tensor(p)).tolist() for p in prompts]

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # outside: not counted
    clock = BackendClock(Compiling())
    assert clock.generate([[1, 2, 3]], [4]) == [[2, 4, 6]]
    first = clock.compile_seconds
    assert first > 0 and clock.graphs_captured == 0
    clock.generate([[4, 5, 6]], [4])  # the same shape: no new compile
    assert clock.compile_seconds == first and clock.compile_seconds <= clock.seconds

def test_backend_none_keeps_dataset_answers_and_fails_prompts_without_one(tmp_path):
    cfg = make_config(tmp_path, overrides=["regen.backend=none", "regen.max_samples=null"])
    write_curated(cfg.run_dir, [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "dataset a"}],
                                [{"role": "user", "content": "unanswered"}], [{"role": "user", "content": "neither"}]])
    m = run_regen(cfg)
    assert m["fingerprint"]["off_policy"] is True
    assert m["counts"]["failed.no_answer"] == 2  # a count other than samples_per_prompt: the accounting adds up
    assert m["counts"]["written"] + m["counts"]["failed"] == m["counts"]["input"] == 3
    (row,) = regen_rows(cfg.run_dir)
    assert row["messages"][1]["content"] == "dataset a"


def test_rank_slices_are_disjoint_complete_and_the_last_rank_writes_the_manifest(tmp_path):
    cfg = make_config(tmp_path, overrides=["regen.backend=none", "regen.shard_size=2", "regen.max_samples=null"])
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * 20}]
             for i in range(11)]
    write_curated(cfg.run_dir, convs)
    stage = StageDir(cfg.run_dir, "regen")
    with pytest.raises(StageError, match="--force with several ranks"):
        run_regen(cfg, force=True, ranks=RankInfo(0, 3))
    seen = {}
    for rank in (2, 0, 1):
        out = run_regen(cfg, ranks=RankInfo(rank, 3))
        before = set(seen)
        seen.update({u: rank for u in stage.done_units() if u not in before})
        assert stage.is_complete() == (rank == 1), "only the rank that completes the last unit writes the manifest"
        if rank != 1:
            assert out["complete"] is False
    assert sorted(seen) == [f"{k:05d}" for k in range(6)]
    assert {u: r for u, r in seen.items()} == {f"{k:05d}": k % 3 for k in range(6)}  # round-robin, no overlap
    ids = [r["id"] for r in regen_rows(cfg.run_dir)]
    assert sorted(ids) == sorted(f"test/{i}" for i in range(11)) and len(ids) == len(set(ids))
    assert not StageDir(cfg.run_dir, "tokenize").is_complete()  # split ranks: tokenize is run on its own

    from drafter.cli import merge_stage
    from pipeline.tokenize import run_tokenize

    summary = run_tokenize(cfg, ranks=RankInfo(1, 2))
    assert summary["complete"] is False and summary["units"] == ["00001", "00003", "00005"]
    with pytest.raises(StageError, match=r"tokenize --merge: 3 of 6 units are not done"):
        merge_stage("tokenize", cfg)
    tm = run_tokenize(cfg, ranks=RankInfo(0, 2))
    assert tm["counts"]["input"] == 11 and tm["num_units"] == 6
    assert merge_stage("tokenize", cfg) == tm == StageDir(cfg.run_dir, "tokenize").manifest()


def kill_regen_after_units(tmp_path: Path, cfg, overrides: list[str], units: int) -> StageDir:
    """Run `drafter regen` on configs/tiny.yaml + overrides in a subprocess and kill -9 it once `units` units are
    done; returns the regen StageDir."""
    cmd = [sys.executable, "-m", "drafter.cli", "regen", "--config", str(REPO / "configs/tiny.yaml"),
           f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *overrides]
    env = {**os.environ, "DRAFTER_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shards = cfg.run_dir / "regen" / "shards"
    deadline = time.time() + 240
    while len(list(shards.glob("*.done.json"))) < units:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return StageDir(cfg.run_dir, "regen")


@pytest.mark.slow
def test_kill_9_during_regen_then_rerun_loses_and_duplicates_nothing(tmp_path):
    overrides = ["regen.max_new_tokens=24", "regen.shard_size=2", "regen.max_samples=null", "regen.batch_size=2"]
    cfg = make_config(tmp_path, overrides=overrides)
    write_curated(cfg.run_dir, single_turn(24))
    stage = kill_regen_after_units(tmp_path, cfg, overrides, 3)
    done_before = set(stage.done_units())
    assert not stage.is_complete() and 3 <= len(done_before) < 12, "the kill must land mid-run"

    manifest = run_regen(cfg)  # resume in-process
    assert manifest["counts"]["written"] == 24 and manifest["num_units"] == 12
    resumed = regen_rows(cfg.run_dir)
    ids = [r["id"] for r in resumed]
    assert sorted(ids) == sorted(f"test/{i}" for i in range(24)) and len(set(ids)) == 24
    assert not list(cfg.run_dir.rglob("*.tmp-*"))

    clean = make_config(tmp_path / "clean", overrides=overrides)  # the same run, never interrupted
    write_curated(clean.run_dir, single_turn(24))
    run_regen(clean)
    assert regen_rows(clean.run_dir) == resumed


@pytest.mark.slow
@pytest.mark.parametrize("shard,batch", [(2, 2), (5, 2)], ids=["a batch per unit", "three batches per unit"])
def test_kill_9_during_a_hybrid_static_decode_regen_then_rerun_loses_and_duplicates_nothing(tmp_path, shard, batch):
    """The same on the hybrid fast path: a Qwen3.5-layout Gated-DeltaNet target (`random:qwen3_5`) decoded by the
    static loop (`regen.hf_decode=static`: fixed K/V and state buffers), killed mid-run, resumed in-process, equals
    an uninterrupted run row for row; also where a unit is generated in several batches (the GPU recipes' shape:
    4,096-conversation units in batches of 512), the last one smaller, all on the unit's one static state."""
    overrides = ["target.model=random:qwen3_5", "regen.hf_decode=static", "regen.max_new_tokens=16",
                 f"regen.shard_size={shard}", "regen.max_samples=null", f"regen.batch_size={batch}"]
    cfg = make_config(tmp_path, overrides=overrides)
    write_curated(cfg.run_dir, single_turn(16))
    units = -(-16 // shard)
    stage = kill_regen_after_units(tmp_path, cfg, overrides, 1 if shard > 2 else 2)
    done_before = set(stage.done_units())
    assert not stage.is_complete() and 1 <= len(done_before) < units, "the kill must land mid-run"

    manifest = run_regen(cfg)
    assert manifest["counts"]["written"] == 16 and manifest["num_units"] == units
    resumed = regen_rows(cfg.run_dir)
    ids = [r["id"] for r in resumed]
    assert sorted(ids) == sorted(f"test/{i}" for i in range(16)) and len(set(ids)) == 16
    assert not list(cfg.run_dir.rglob("*.tmp-*"))

    clean = make_config(tmp_path / "clean", overrides=overrides)
    write_curated(clean.run_dir, single_turn(16))
    run_regen(clean)
    assert regen_rows(clean.run_dir) == resumed


@pytest.mark.slow
def test_kill_9_during_a_continuous_decode_regen_then_rerun_writes_what_generate_writes(tmp_path):
    """The continuous loop (`regen.hf_decode=continuous`: two rows refilled as answers end, four conversations a
    unit), killed mid-run and resumed in-process: every conversation once, and row for row what `model.generate`
    writes in an uninterrupted run (greedy)."""
    overrides = ["regen.hf_decode=continuous", "regen.max_new_tokens=16", "regen.shard_size=4",
                 "regen.max_samples=null", "regen.batch_size=2"]
    cfg = make_config(tmp_path, overrides=overrides)
    write_curated(cfg.run_dir, single_turn(16))
    stage = kill_regen_after_units(tmp_path, cfg, overrides, 1)
    assert not stage.is_complete() and 1 <= len(set(stage.done_units())) < 4, "the kill must land mid-run"

    manifest = run_regen(cfg)
    assert manifest["counts"]["written"] == 16 and manifest["num_units"] == 4
    resumed = regen_rows(cfg.run_dir)
    assert sorted(r["id"] for r in resumed) == sorted(f"test/{i}" for i in range(16))
    for unit, sidecar in StageDir(cfg.run_dir, "regen").done_units().items():  # the loop's own counts, per unit
        assert sidecar["decode"]["tokens"] == sidecar["generated_tokens"] > 0, unit
        assert sidecar["decode"]["row_steps"] >= sidecar["decode"]["steps"] > 0, unit
    assert not list(cfg.run_dir.rglob("*.tmp-*"))

    plain = [o.replace("continuous", "generate") for o in overrides]
    clean = make_config(tmp_path / "clean", overrides=plain)
    write_curated(clean.run_dir, single_turn(16))
    run_regen(clean)
    assert regen_rows(clean.run_dir) == resumed


def test_a_request_the_model_cannot_run_fails_alone_with_its_reason(tmp_path):
    from pipeline.regen.conversation import skeleton
    from pipeline.regen.stage import regenerate

    cfg = make_config(tmp_path, overrides=["regen.max_new_tokens=8"])
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    model = load_target(location, cfg.target)
    extra = [f"<extra_{i}>" for i in range(model.config.vocab_size - len(tok) + 1)]
    tok.add_tokens(extra)  # the last one has no embedding row: the forward raises IndexError on it
    gen = HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=model.config.vocab_size,
                      stop_ids=end_of_turn_ids(tok, location), sampling=Sampling(), batch_size=4)
    items = [("ok/0", skeleton([{"role": "user", "content": "fine"}])),
             ("bad", skeleton([{"role": "user", "content": f"unknown {extra[-1]} token"}])),
             ("ok/1", skeleton([{"role": "user", "content": "also fine"}]))]
    done, failures = regenerate(gen, tok, items, cfg)
    assert sorted(done) == ["ok/0", "ok/1"] and all(len(a.answers) == 1 for a in done.values())
    assert failures["bad"][0] == "generation_error" and "IndexError" in failures["bad"][1]


def test_merge_refuses_missing_rank_work_then_writes_the_manifest_and_drafter_regen_merge_tokenizes(tmp_path):
    from drafter.cli import main as drafter_main
    from drafter.cli import merge_stage

    overrides = ["regen.backend=none", "regen.shard_size=2", "regen.max_samples=null"]
    cfg = make_config(tmp_path, overrides=overrides)
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * 20}]
             for i in range(5)]
    write_curated(cfg.run_dir, convs)
    run_regen(cfg, ranks=RankInfo(0, 2))
    with pytest.raises(StageError, match=r"regen --merge: 1 of 3 units are not done"):
        merge_stage("regen", cfg)
    run_regen(cfg, ranks=RankInfo(1, 2))
    merge_stage("regen", cfg)
    assert StageDir(cfg.run_dir, "regen").is_complete()
    assert not StageDir(cfg.run_dir, "tokenize").is_complete()  # run_regen and the regen merge: the regen stage only
    assert drafter_main(["regen", "--merge", "--config", str(REPO / "configs/tiny.yaml"),
                         f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *overrides]) == 0
    assert StageDir(cfg.run_dir, "tokenize").manifest()["counts"]["input"] == 5


def test_drafter_regen_runs_tokenize_after_a_single_rank_regen(tmp_path):
    from drafter.cli import main as drafter_main

    overrides = ["regen.backend=none", "regen.max_samples=null"]
    cfg = make_config(tmp_path, overrides=overrides)
    write_curated(cfg.run_dir, [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * 20}]
                                for i in range(3)])
    assert drafter_main(["regen", "--config", str(REPO / "configs/tiny.yaml"), f"runs_dir={tmp_path / 'runs'}",
                         f"cache_dir={CACHE}", *overrides]) == 0
    assert StageDir(cfg.run_dir, "regen").is_complete()
    assert StageDir(cfg.run_dir, "tokenize").manifest()["counts"]["input"] == 3
