"""The GPU recipe's scripts run end to end on the CPU (so a GPU session cannot fail on a typo): the offline bundle
collects its parts over several calls and unpacks them byte for byte, refusing a damaged part; quality_gpu.sh runs every stage and the
loss ablation on configs/tiny.yaml, over two calls as a device session splits it, and prints its table;
hybrid_gpu.sh takes every hybrid measurement at toy size over calls and summarizes it in the hybrid results' keys;
speed_gpu.sh times the recipe's regen and training levers at toy size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO


def bundle(*args, cwd=REPO):
    return subprocess.run(["bash", "benchmarks/offline_bundle.sh", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable})


def test_offline_bundle_unpacks_once_every_part_arrived_and_refuses_a_damaged_one(tmp_path):
    """Parts travel one per device call: `receive` keeps what arrived, unpacks when the set is complete (the GGUF
    and the data files byte for byte) and says so on every later call; a damaged part is refused, nothing unpacked."""
    blob = tmp_path / "model.gguf"
    blob.write_bytes(os.urandom(3 << 20))  # incompressible: xz keeps ~3 MiB, so 1 MiB parts make several
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "gsm8k_test.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n')
    out = bundle("pack", "--out", tmp_path / "b", "--gguf-from", blob, "--part-mib", 1, "--no-wheels",
                 "--data-dir", mirror, "--data", "gsm8k_test.jsonl", "--xz-level", "-0")
    assert out.returncode == 0, out.stderr
    parts = sorted((tmp_path / "b").glob("part-*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= 1 << 20 for p in parts)
    node, call = tmp_path / "node", tmp_path / "call"
    for k, part in enumerate(parts):  # one part per call, SHA256SUMS with each
        shutil.rmtree(call, ignore_errors=True)
        call.mkdir()
        shutil.copy(tmp_path / "b" / "SHA256SUMS", call)
        shutil.copy(part, call)
        got = bundle("receive", "--from", call, "--to", node)
        assert got.returncode == 0, got.stderr
        last = k == len(parts) - 1
        assert got.stdout.strip() == ("ready" if last else f"have {k + 1} of {len(parts)} parts")
    assert (node / "smol.gguf").read_bytes() == blob.read_bytes()
    assert (node / "data" / "gsm8k_test.jsonl").read_bytes() == (mirror / "gsm8k_test.jsonl").read_bytes()
    assert bundle("receive", "--from", call, "--to", node).stdout.strip() == "ready"

    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "b", damaged)
    raw = bytearray(parts[1].read_bytes())
    raw[100] ^= 0xFF
    (damaged / parts[1].name).write_bytes(bytes(raw))
    broken = bundle("receive", "--from", damaged, "--to", tmp_path / "node2")
    assert broken.returncode == 1 and "damaged" in broken.stderr
    assert not (tmp_path / "node2" / "smol.gguf").exists() and not (tmp_path / "node2" / ".ready").exists()


@pytest.mark.slow
def test_quality_recipe_runs_every_stage_and_the_ablation_on_the_tiny_config_over_two_calls(tmp_path):
    # one device call runs at most 10 minutes: the recipe is the same command per call, `--stop-after` ending one
    def call(*extra):
        return subprocess.run(
            ["bash", "benchmarks/quality_gpu.sh", "--out", tmp_path / "q", "--runs-dir", tmp_path / "runs",
             "--config", "configs/tiny.yaml", "--device", "cpu", "--ablation-steps", "2", "--train-steps", "2",
             "--ablation-micro-batch-tokens", "2048", "--ablation-losses", "kl,ce+kl", "--quick", "--data-curve", "50",
             "--curve-steps", "2", *extra,
             "--", "train.online=true", f"cache_dir={REPO / '.cache'}"],
            cwd=REPO, capture_output=True, text=True, timeout=1500,
            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})

    assert call("--stop-after", "nonsense").returncode == 2
    assert call("--data-curve", "0").returncode == 2 and call("--curve-steps", "x").returncode == 2
    assert call("--ablation-losses", "ce,mse").returncode == 2 and call("--ablation-losses", "").returncode == 2
    first = call("--stop-after", "regen")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "stopped after regen" in first.stdout and not (tmp_path / "runs" / "tiny" / "train").exists()
    kept = sorted(p.name for p in (tmp_path / "q").glob("manifest-*.json"))  # what the cut call brings back
    assert kept == ["manifest-curate.json", "manifest-regen.json", "manifest-tokenize.json"]
    out = call()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (tmp_path / "q" / "stage_seconds.txt").read_text().splitlines()
    labels = [line.split()[0] for line in lines]
    assert labels[:4] == ["curate", "regen", "curate", "regen"]  # the second call's are no-ops, appended
    assert set(labels) == {"curate", "regen", "train", "eval", "train[kl]", "train[ce+kl]", "eval[kl]", "eval[ce+kl]",
                           "train[data-50]", "eval[data-50]"}  # the losses asked for (all three by default)
    summary = json.loads((tmp_path / "q" / "summary.json").read_text())
    regen_seconds = sum(int(line.split()[1]) for line in lines if line.startswith("regen "))
    assert summary["stages"]["regen"] == {"seconds": regen_seconds, "exit": 0}  # a stage's time sums its calls
    assert set(summary["ablation"]) == {"kl", "ce+kl"}
    for loss in ("kl", "ce+kl"):  # each ablation run trained with its loss at the micro-batch it was given
        manifest = json.loads((tmp_path / "runs" / f"tiny-abl-{loss.replace('+', '-')}" / "train" / "manifest.json")
                              .read_text())
        train = manifest["settings"]["train"]
        assert (train["loss"], train["micro_batch_tokens"]) == (loss, 2048)
    assert summary["train"]["steps"] == 2 and summary["data"]["regen"]["written"] > 0
    assert "held_out/chain" in summary["eval"] and (tmp_path / "q" / "report.md").exists()  # no mirror: held-out
    assert "## Loss ablation" in out.stdout
    assert {"manifest-train.json", "manifest-eval.json"} <= {p.name for p in (tmp_path / "q").glob("manifest-*.json")}
    (row,) = summary["data_curve"]  # the 50 % run: half the main run's training samples (by prompt), equal steps
    main_train = json.loads((tmp_path / "runs" / "tiny" / "train" / "manifest.json").read_text())["counts"]
    assert row["percent"] == 50 and row["steps"] == 2 and row["held_out_loss"] is not None
    assert 0 < row["train_samples"] < main_train["train_samples"] and row["tau"]["held_out/chain"] > 0
    assert "## Data-size curve" in out.stdout


@pytest.mark.slow
def test_a_sigterm_to_the_recipe_reaches_its_training_which_checkpoints_the_step_in_flight_and_resumes_there(tmp_path):
    """`timeout -s TERM` / a scheduler's limit signals the script: the stage in flight gets the signal and the
    script waits for it, so the trainer saves the step in flight (exit 75), no later stage starts, nothing is left
    running, and the checkpoint the same command resumes from is that step's. (Before, the shell died at once and its trainer was killed
    with the job before its checkpoint was written.)"""
    import signal
    import time

    runs = tmp_path / "runs"

    def start(*extra):
        return subprocess.Popen(
            ["bash", "benchmarks/quality_gpu.sh", "--out", tmp_path / "q", "--runs-dir", runs, "--config",
             "configs/tiny.yaml", "--device", "cpu", "--ablation-steps", "0", "--train-steps", "100000", *extra,
             "--", "train.online=true", "train.save_every=100000", "train.eval_every=0", "train.zero_stage=0",
             f"cache_dir={REPO / '.cache'}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})

    first = start()
    log = tmp_path / "q" / "train.log"
    deadline = time.monotonic() + 900
    while not (log.exists() and "trainable params" in log.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.5)
    time.sleep(3)  # some steps in
    first.send_signal(signal.SIGTERM)  # the script alone, as `timeout --foreground` or SLURM's batch shell gets it
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM during train" in out, out[-3000:]
    assert "train" in [line.split()[0] for line in (tmp_path / "q" / "stage_seconds.txt").read_text().splitlines()
                       if line.split()[2] == "75"]
    assert not (runs / "tiny" / "eval").exists()
    ckpts = sorted((runs / "tiny" / "train" / "checkpoints").glob("step-*/COMPLETE"))
    assert ckpts, "no complete checkpoint of the step in flight"
    saved = int(ckpts[-1].parent.name.split("-")[1])
    assert saved > 0
    leftover = subprocess.run(["pgrep", "-f", str(runs)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes of the run still alive: {leftover}"
    from train.checkpoint import latest_complete

    tag, state = latest_complete(runs / "tiny" / "train" / "checkpoints")  # what the same command resumes from
    assert tag == ckpts[-1].parent.name and state["global_step"] == saved


def test_vllm_gpu_script_refuses_a_call_without_out_or_bundle_and_its_summary_reads_the_step_results(tmp_path):
    """benchmarks/vllm_gpu.sh's argument errors are one line with exit 2; benchmarks/vllm_gpu_summary.py turns the
    step results a run leaves in its work dir into the keys docs/results/vllm-h200/summary.json keeps (a step that
    failed or did not run is named)."""
    from benchmarks.vllm_gpu_summary import summarize

    for args in ([], ["--out", str(tmp_path / "o")], ["--cpu-smoke", "--out", str(tmp_path / "o"), "--skip", "serv"]):
        run = subprocess.run(["bash", "benchmarks/vllm_gpu.sh", *args], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "DRAFTER_DATA_DIR": str(tmp_path)})
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    # a step an earlier session measured is left out with --skip: here every one, so the call runs none
    steps = ["env", "verify8b", "hybrid", "smol", "serve", "regen32", "regen", "regencurve", "extract"]
    run = subprocess.run(["bash", "benchmarks/vllm_gpu.sh", "--cpu-smoke", "--out", str(tmp_path / "o"), "--work",
                          str(tmp_path / "w"), *[a for s in steps for a in ("--skip", s)]], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "DRAFTER_DATA_DIR": str(tmp_path)})
    assert run.returncode == 0 and "all steps done" in run.stdout and " step " not in run.stdout, run.stdout
    assert (tmp_path / "w" / "results.jsonl").read_text() == ""
    work = tmp_path / "work"
    (work / "json").mkdir(parents=True)
    (work / "results.jsonl").write_text("\n".join(json.dumps({"step": s, "rc": rc, "seconds": 5}) for s, rc in
                                                  [("env", 0), ("regen", 0), ("extract", 0), ("serve", 1)]) + "\n")
    (work / "json" / "bench_regen.json").write_text(json.dumps({"env": {"device_name": "GPU X"}, "rows": [
        {"mode": "static", "batch": 256, "prompts": 8, "tok_s": 10.0, "same_as_ref": "ref"},
        {"mode": "static", "batch": 512, "prompts": 8, "tok_s": 20.0, "same_as_ref": "8/8"},
        {"mode": "vllm", "batch": "engine", "prompts": 8, "tok_s": 30.0, "same_as_ref": "7/8",
         "prefix_agreement": 0.97}]}))
    (work / "json" / "bench_regen_fp32.json").write_text(json.dumps({"env": {}, "rows": [
        {"mode": "static", "batch": 4, "prompts": 4, "tok_s": 1.0, "same_as_ref": "ref"},
        {"mode": "vllm", "batch": "engine", "prompts": 4, "tok_s": 2.0, "same_as_ref": "3/4", "prefix_agreement": 0.9,
         "divergences": [{"prompt": 2, "position": 7, "gap": 1e-5, "logit_scale": 20.0}], "ended_apart": 0,
         "max_gap": 1e-5}]}))
    (work / "json" / "bench_regen_curve.json").write_text(json.dumps({"env": {}, "rows": [
        {"mode": "static", "batch": 256, "tok_s": 5.0}, {"mode": "static", "batch": 512, "tok_s": 9.0},
        {"mode": "static", "batch": 1024, "error": "CUDA out of memory"}]}))
    for backend, dtype, tps in [("vllm", "bfloat16", 100.0), ("vllm", "fp8", 120.0), ("hf", "bfloat16", 90.0)]:
        (work / "json" / f"bench_extract-{backend}-s-{dtype}-cuda.json").write_text(json.dumps(
            {"backend": backend, "storage_dtype": dtype, "end_to_end_tps": tps, "shape": "s", "vllm": "0.26.0",
             "compute_roofline_tps": 500.0, "full_model_roofline_tps": 400.0, "disk_ceiling_tps": 300.0}))
    s = summarize(work)
    assert s["vllm_version"] == "0.26.0" and s["device"] == "GPU X"
    assert s["regen_tok_s"] == {"vllm": 30.0, "hf": 20.0, "hf_batch": 512} and s["regen_same_as_hf"] == "7/8"
    assert s["regen_prefix_agreement"] == 0.97
    assert s["extract_tok_s"] == {"vllm": 100.0, "hf": 90.0} and s["extract_tok_s_fp8"] == {"vllm": 120.0}
    assert s["regen_fp32_same_as_hf"] == "3/4" and s["regen_fp32_prefix_agreement"] == 0.9
    assert s["regen_fp32_divergences"]["max_gap"] == 1e-5 and s["regen_fp32_divergences"]["at"][0]["position"] == 7
    assert s["regen_curve"] == [{"mode": "static", "batch": 256, "tok_s": 5.0}, {"mode": "static", "batch": 512, "tok_s": 9.0}]
    assert s["failed"] == ["serve"] and s["missing"] == ["hybrid", "regen32", "regencurve", "smol", "verify8b"]
    assert "serve_full" not in s and "extract_verify_passed" not in s


def _hybrid(*args, env=None):
    return subprocess.run(["bash", "benchmarks/hybrid_gpu.sh", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})})


def test_hybrid_gpu_script_refuses_bad_arguments_and_its_summary_keeps_the_hybrid_results_keys(tmp_path):
    """benchmarks/hybrid_gpu.sh's argument errors are one line with exit 2; benchmarks/hybrid_gpu_summary.py turns
    the steps' JSON into docs/results/hybrid-h200/summary.json's keys: regen at the largest batch both modes ran,
    the first training variant's rate and split, the largest micro-batch; a failed or missing step is named and
    leaves its keys out; --record keeps the summary it replaces under that one's date."""
    from benchmarks.hybrid_gpu_summary import main, record, summarize

    for args in ([], ["--out", tmp_path / "o", "--retry", "nonsense"], ["--out", tmp_path / "o", "--skip", "nonsense"],
                 ["--out", tmp_path / "o", "--bogus"]):
        run = _hybrid(*args)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    work = tmp_path / "work"
    (work / "json").mkdir(parents=True)
    steps = [("env", 0), ("tests", 0), ("regen", 0), ("round", 0), ("extract", 1), ("train", 0)]
    (work / "results.jsonl").write_text("".join(json.dumps({"step": s, "rc": rc, "seconds": 3}) + "\n"
                                                for s, rc in steps))
    (work / "json" / "regen.json").write_text(json.dumps({"env": {"shape": "qwen3.6-27b"}, "rows": [
        {"mode": "generate", "batch": 64, "tok_s": 100.0}, {"mode": "generate", "batch": 256, "tok_s": 300.0},
        {"mode": "static", "batch": 64, "tok_s": 900.0}, {"mode": "static", "batch": 256, "tok_s": 2500.0},
        {"mode": "static", "batch": 512, "tok_s": 3000.0}]}))
    (work / "json" / "round.json").write_text(json.dumps(
        {"date": "2031-01-02", "chain_verify_ms": 25.0, "tree_verify_ms": {"256": 50.0}, "overhead_ms": {"256": 0.4}}))
    (work / "json" / "extract.json").write_text(json.dumps({"extract_tok_s": {"bf16": 1.0, "fp8": 2.0}}))
    (work / "json" / "train.json").write_text(json.dumps([
        {"variant": "a", "ok": False, "error": "OOM"},
        {"variant": "b", "ok": True, "seqs": 16, "tokens_per_s": 5000.0, "ms_per_seq": 600.0,
         "target_forward_ms": 6000.0, "drafter_step_ms": 3600.0, "peak_mem_gib": 120.0, "mfu": 0.2},
        {"variant": "c", "ok": True, "seqs": 16, "tokens_per_s": 6000.0, "ms_per_seq": 500.0}]))
    s = summarize(work)
    assert s["regen_tok_s"] == {"generate": 300.0, "static": 2500.0} and s["regen_batch"] == 256
    assert s["chain_verify_ms"] == 25.0 and s["overhead_ms"] == {"256": 0.4}
    assert "extract_tok_s" not in s  # its step failed
    assert s["train_tok_s"] == 5000.0 and s["train"]["variant"] == "b" and s["train"]["ms_per_step"] == 9600.0
    assert "train_max_micro_batch" not in s
    assert s["steps"]["failed"] == ["extract"] and s["steps"]["missing"] == ["commit", "trainmax"]

    recorded = tmp_path / "results" / "summary.json"
    recorded.parent.mkdir()
    recorded.write_text(json.dumps({"date": "2030-05-06", "chain_verify_ms": 30.0}))
    assert main(["--work", str(work), "--out", str(tmp_path / "out.json"), "--record", str(recorded)]) == 0
    assert json.loads(recorded.read_text()) == json.loads((tmp_path / "out.json").read_text())
    assert json.loads((recorded.parent / "2030-05-06" / "summary.json").read_text())["chain_verify_ms"] == 30.0
    record(s, recorded)  # the same date again: nothing more kept
    assert sorted(p.name for p in recorded.parent.iterdir()) == ["2030-05-06", "summary.json"]


def test_hybrid_gpu_script_skip_leaves_steps_out_and_the_summary_names_them_missing(tmp_path):
    """`--skip STEP` marks a step done without running it (a later call of the same --work does not run it either),
    and the summary lists it under missing, not failed: here every step but env is skipped."""
    skipped = ["tests", "regen", "round", "commit", "extract", "train", "trainmax"]
    args = ["--cpu-smoke", "--out", tmp_path / "out", "--work", tmp_path / "work"]
    for s in skipped:
        args += ["--skip", s]
    run = _hybrid(*args, env={"DRAFTER_DATA_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"]["missing"] == skipped and summary["steps"]["failed"] == []
    assert list(summary["steps"]["seconds"]) == ["env"]
    assert all((tmp_path / "work" / f"done.{s}").read_text().strip() == "skipped" for s in skipped)
    again = _hybrid("--cpu-smoke", "--out", tmp_path / "out", "--work", tmp_path / "work",
                    env={"DRAFTER_DATA_DIR": str(tmp_path)})
    assert again.returncode == 0 and "step regen" not in again.stdout and "step env" not in again.stdout


def test_hybrid_gpu_script_first_runs_the_named_steps_ahead_of_the_rest(tmp_path):
    """`--first trainmax,commit` tries trainmax (last by default) before commit: with 100 s, trainmax is skipped for
    time (it needs ~300) before commit runs; a step --first names that does not exist is a one-line error."""
    bad = _hybrid("--out", tmp_path / "o", "--first", "commit,nonsense")
    assert bad.returncode == 2 and "no such step: nonsense" in bad.stderr and bad.stderr.count("\n") == 1
    args = ["--cpu-smoke", "--out", tmp_path / "out", "--work", tmp_path / "work", "--budget-s", 100,
            "--first", "trainmax,commit"]
    for s in ("tests", "regen", "round", "extract", "train"):
        args += ["--skip", s]
    run = _hybrid(*args, env={"DRAFTER_DATA_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.index("skip trainmax: ") < run.stdout.index("step commit") < run.stdout.index("commit rc=0")
    assert not (tmp_path / "work" / "done.trainmax").exists()  # skipped for time: a later call runs it


@pytest.mark.slow
def test_hybrid_gpu_script_takes_every_measurement_at_toy_size_on_the_cpu_over_calls_and_retries_a_step(tmp_path):
    """`hybrid_gpu.sh --cpu-smoke`: the GPU command's every step (regen, round, extract, online training, the
    largest micro-batch) at toy size. A call short of time runs what fits and the next call goes on from the
    markers; --retry runs one step again; the summary has the hybrid results' keys and the new ones."""
    from tests.conftest import mirror_file

    mirror = {"DRAFTER_DATA_DIR": str(mirror_file("gsm8k_train.jsonl").parent)}  # regen's real prompts
    out, work = tmp_path / "out", tmp_path / "work"
    first = _hybrid("--cpu-smoke", "--out", out, "--work", work, "--budget-s", 100, env=mirror)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "skip tests: " in first.stdout
    assert json.loads((out / "summary.json").read_text())["steps"]["missing"] == [
        "tests", "regen", "round", "extract", "train", "trainmax"]  # commit (90 s) fit in the 100 s
    second = _hybrid("--cpu-smoke", "--out", out, "--work", work, env=mirror)
    assert second.returncode == 0 and "all steps done" in second.stdout, second.stdout[-3000:]
    third = _hybrid("--cpu-smoke", "--out", out, "--work", work, "--retry", "train", env=mirror)
    assert third.returncode == 0, third.stdout[-3000:]
    ran = [json.loads(line)["step"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert ran == ["env", "commit", "tests", "regen", "round", "extract", "train", "trainmax", "train"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "results.jsonl", "steps.log", "summary.json",
                                                     "summary.md"]
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"]["failed"] == [] and s["steps"]["missing"] == []
    for key in ("chain_verify_ms", "ar_step_ms", "train_tok_s"):
        assert s[key] > 0, key
    for key in ("tree_verify_ms", "overhead_ms", "path_batched_verify_ms"):
        assert set(s[key]) == {"4", "16"} and all(v > 0 for v in s[key].values()), key
    for key in ("extract_tok_s", "extract_ceiling_tok_s"):
        assert set(s[key]) == {"bf16", "fp8"} and all(v > 0 for v in s[key].values()), key
    assert set(s["regen_tok_s"]) == {"generate", "static"} and s["regen_batch"] == 8
    assert all(r["same_as_ref"] in ("ref", "8/8") for r in s["regen_rows"])
    assert s["train"]["target_forward_ms"] > 0 and s["train"]["variant"] == "trainer-dense-online-row2"
    assert s["train_max_micro_batch"] == {"variant": "trainer-dense-online", "sequences": 2, "peak_mem_gib": None}
    assert s["commit_us"]["commit"] > 0 and s["commit_checks"] == {"state 8x1": "equal", "state 16x2": "equal"}


def test_regen_agreement_counts_identical_responses_and_the_shared_prefix_of_those_that_part():
    """bench_regen's comparison of a mode with the reference: whole responses identical, and the share of the
    reference's tokens written identically before the first difference (greedy bf16 engines part at near ties)."""
    from benchmarks.bench_regen import agreement

    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [9]]  # identical; parts after 2 of 4; stops early after 1 of 2
    assert agreement(got, ref) == {"same_as_ref": "1/3", "prefix_agreement": round(7 / 10, 4)}
    assert agreement(ref, ref) == {"same_as_ref": "3/3", "prefix_agreement": 1.0}
    assert agreement([[0, 2, 3, 4]], ref[:1])["prefix_agreement"] == 0.0


def _speed(*args, env=None):
    return subprocess.run(["bash", "benchmarks/speed_gpu.sh", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@pytest.mark.slow
def test_speed_gpu_script_times_regen_and_training_levers_at_toy_size_and_refuses_bad_arguments(tmp_path):
    """`speed_gpu.sh` (issue 29's regen and training speeds in one device call): argument errors are one line with
    exit 2; `--cpu-smoke` runs every step at toy size on the CPU: regen's fused-attention and GEMM-attention modes
    decode the same greedy tokens, the recipe's sampling is timed, both training variants (CE, CE+KL) report
    tokens/s; a second call of the same
    --work runs nothing again, and --retry runs one step again."""
    from tests.conftest import mirror_file

    for args in ([], ["--out", tmp_path / "o", "--retry", "nonsense"], ["--out", tmp_path / "o", "--bogus"],
                 ["--out", tmp_path / "o", "--data", tmp_path / "missing"],
                 ["--out", tmp_path / "o", "--tokenizer", tmp_path]):  # a folder without tokenizer.json
        run = _speed(*args)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    data = mirror_file("gsm8k_train.jsonl").parent
    out, work = tmp_path / "out", tmp_path / "work"
    first = _speed("--cpu-smoke", "--out", out, "--work", work, "--data", data, env={"OMP_NUM_THREADS": "1"})
    assert first.returncode == 0 and "all steps done" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    ran = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rc"]) for r in ran] == [("env", 0), ("tests", 0), ("regen", 0), ("sampled", 0),
                                                   ("train", 0)]
    regen = json.loads((out / "json" / "regen.json").read_text())
    assert {r["mode"] for r in regen["rows"]} == {"static-sdpa", "static"}
    assert all(r["same_as_ref"] in ("ref", "8/8") and r["tok_s"] > 0 for r in regen["rows"])
    sampled = json.loads((out / "json" / "regen-sampled.json").read_text())
    assert sampled["env"]["sampling"] == {"temperature": 0.7, "top_p": 0.95, "top_k": 0}
    assert sampled["env"]["answer_lengths"] == "recipe" and sampled["env"]["answer_tokens_mean"] < 8  # some stop early
    assert [r["mode"] for r in sampled["rows"]] == ["static"] and sampled["rows"][0]["tok_s"] > 0
    train = json.loads((out / "json" / "train.json").read_text())
    assert [r["variant"] for r in train] == ["trainer-dense-online", "trainer-dense-online-kl"]
    assert all(r["ok"] and r["tokens_per_s"] > 0 for r in train)
    again = _speed("--cpu-smoke", "--out", out, "--work", work, "--data", data, "--retry", "train")
    assert again.returncode == 0 and "step train" in again.stdout and "step regen" not in again.stdout
