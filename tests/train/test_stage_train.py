"""The train stage end to end on the tiny config: real DeepSpeed (gloo on CPU), the real feature store written
with features of the real tiny random Qwen3 target, real W&B (offline). Fingerprint refusal, logging, export
round trip, online == offline. (Two ranks: test_deepspeed_two_ranks.py; kill -9: test_resume_kill9.py.)"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import CACHE, DIST_VARS, make_config, md5_b64, wandb_artifact_files, wandb_offline_records

FAST = ["train.max_steps=6", "train.log_every=1", "train.eval_every=3", "train.save_every=3",
        "train.micro_batch_tokens=512", "train.num_workers=0"]


@pytest.fixture(autouse=True)
def _dist_env(monkeypatch):
    """In-process runs export the torch rendezvous variables: give them back after each test. One intra-op
    thread, like the subprocesses (OMP_NUM_THREADS=1): identical float reductions, and no thread thrashing on a
    shared 2-core machine (a tiny linear is ~50x slower with 2 threads when the cores are busy)."""
    from train.distributed import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port())}.items():
        monkeypatch.setenv(k, v)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _samples(n: int, seed: int, lo: int = 48, hi: int = 160) -> list[dict]:
    """Token sequences that repeat a short random motif (learnable), loss on the last three quarters."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(lo, hi))
        motif = rng.integers(3, 40, size=int(rng.integers(3, 7)))
        ids = torch.tensor(np.resize(motif, length), dtype=torch.long)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 4 :] = True
        out.append({"id": f"synthetic/{i}", "input_ids": ids, "loss_mask": mask})
    return out


def write_extract_stage(cfg, n: int = 32, seed: int = 0, **fp_overrides) -> list[dict]:
    """A finished extract stage for `cfg`: the tiny target's real tap features of synthetic samples (the drafter's
    taps, then the last layer's with `extract.last_hidden`), stored in `cfg.extract.storage_dtype`."""
    from extract.layers import forward_taps, stored_tap_ids
    from extract.store import write_feature_store
    from pipeline.target import load_target, open_target
    from train.inputs import expected_feature_fingerprint

    target = open_target(cfg.target, cfg.cache_dir)
    num_layers = target.text.num_hidden_layers
    taps = stored_tap_ids(expected_feature_fingerprint(cfg, target)["layer_ids"], num_layers, cfg.extract.last_hidden)
    fp = {**expected_feature_fingerprint(cfg, target), "last_hidden": len(taps) > cfg.extract.num_taps, **fp_overrides}
    taps = stored_tap_ids(fp["layer_ids"], num_layers, fp["last_hidden"])
    model = load_target(target.location, cfg.target, device=torch.device("cpu"))
    samples = _samples(n, seed)
    for s in samples:
        s["features"] = forward_taps(model, s["input_ids"][None], taps)[0]
    write_feature_store(cfg.run_dir / "extract", samples, fingerprint=fp, shard_tokens=1500)
    return samples


def write_tokenize_stage(cfg, samples: list[dict]) -> None:
    """A finished tokenize stage (design.md contract) holding `samples`' ids, tokens and loss masks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.stage_dir import StageDir
    from pipeline.target import load_tokenizer, materialize_target, target_fingerprint, tokenizer_fingerprint

    loc = materialize_target(cfg.target, cfg.cache_dir)
    stage = StageDir(cfg.run_dir, "tokenize")
    stage.begin("test-tokenize", force=True)
    rows = [{"id": s["id"], "input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].to(torch.uint8).tolist(),
             "num_tokens": len(s["input_ids"]), "num_loss_tokens": int(s["loss_mask"].sum())} for s in samples]
    path = stage.shard_path("00000", "parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
        ("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()), ("num_loss_tokens", pa.int32())])), path)
    stage.finish_unit("00000", [path], written=len(rows))
    fp = {"target": target_fingerprint(loc, cfg.target), "tokenizer": tokenizer_fingerprint(load_tokenizer(loc, cfg.target)),
          "enable_thinking": cfg.target.enable_thinking, "max_len": cfg.tokenize.max_len}
    stage.write_manifest(config_hash="test-tokenize", fingerprint=fp, started=time.time(), counts={"written": len(rows)})


def rows(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# ----------------------------------------------------------------------------------------------


def test_train_refuses_features_extracted_from_other_layers(tmp_path):
    from pipeline.errors import FingerprintMismatch
    from train.stage import run_train

    cfg = make_config(tmp_path, overrides=FAST)
    write_extract_stage(cfg, n=4, layer_ids=[0, 2, 4])
    with pytest.raises(FingerprintMismatch, match="layer_ids"):
        run_train(cfg)
    assert not (cfg.run_dir / "train" / "manifest.json").exists()


def test_train_refuses_features_stored_in_another_dtype_than_the_config_says(tmp_path):
    from pipeline.errors import FingerprintMismatch
    from train.stage import run_train

    write_extract_stage(make_config(tmp_path, overrides=FAST), n=4)  # bfloat16, as configs/tiny.yaml says
    cfg = make_config(tmp_path, overrides=FAST + ["extract.storage_dtype=fp8"])
    with pytest.raises(FingerprintMismatch, match="storage_dtype: this config wants 'fp8', extract has 'bfloat16'"):
        run_train(cfg)
    assert not (cfg.run_dir / "train" / "manifest.json").exists()


@pytest.mark.slow
def test_train_logs_jsonl_and_wandb_offline_and_exports_a_drafter_that_loads_back(tmp_path):
    from safetensors.torch import load_file

    from train.checkpoint import weights_digest
    from dflash_model.export import load_zlab
    from train.stage import run_train

    cfg = make_config(tmp_path, overrides=FAST)
    write_extract_stage(cfg)
    manifest = run_train(cfg)

    train_rows, eval_rows = rows(cfg.run_dir), rows(cfg.run_dir, "eval")
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    B = cfg.drafter.block_size
    for key in ["loss", "lr", "grad_norm", "tokens_per_s", "tau_hat", "accept_len"] + [f"acc_{k}" for k in range(1, B)]:
        assert all(np.isfinite(r[key]) for r in train_rows), key
    assert [r["step"] for r in eval_rows] == [0, 3, 6]
    assert all(1.0 <= r["tau_hat"] <= B for r in eval_rows)
    assert train_rows[0]["lr"] == pytest.approx(cfg.train.lr)  # 4% warmup of 6 steps = 1 step
    records = wandb_offline_records(cfg.run_dir / "train" / "wandb")
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.run_group == cfg.name and run.job_type == "train"  # beside the eval run of the same pipeline run
    (model,) = [r for r in records if r.HasField("artifact") and r.artifact.type == "model"]
    assert model.artifact.name == f"{cfg.name}-drafter"
    export = cfg.run_dir / "train" / "export"
    # the drafter is its config and weights (the model card, which eval rewrites, is no part of the artifact)
    assert wandb_artifact_files(model) == {f: md5_b64(export / f) for f in ("config.json", "model.safetensors")}

    card = (export / "README.md").read_text()  # the model card: what the drafter was trained on
    assert "| optimizer steps | 6 (" in card and "| tapped target layers | [1, 3, 5] of" in card
    assert "| held-out loss / τ̂ |" in card and "No eval has run on this drafter yet" in card
    assert [f["name"] for f in manifest["export"]["files"]] == ["config.json", "model.safetensors"]

    drafter, args = load_zlab(cfg.run_dir / "train" / "export")
    assert args.target_layer_ids == manifest["fingerprint"]["features"]["layer_ids"] == [1, 3, 5]
    assert args.mask_token_id == manifest["fingerprint"]["drafter"]["mask_token_id"]
    exported = load_file(str(cfg.run_dir / "train" / "export" / "model.safetensors"))
    assert weights_digest(exported) == manifest["replica_digests"][0]
    assert manifest["export"]["verified"] and manifest["counts"]["steps"] == 6
    assert run_train(cfg)["finished_at"] == manifest["finished_at"]  # same config again: a no-op


@pytest.mark.slow
def test_online_features_give_the_same_loss_curve_as_stored_features(tmp_path):
    """Same data, seed and plan: online (target taps inside the step) and offline (stored fp32 features) runs log
    the same loss at every step."""
    from train.stage import run_train

    overrides = FAST + ["train.max_steps=3", "train.eval_every=0", "train.save_every=0", "extract.storage_dtype=float32"]
    offline = make_config(tmp_path / "offline", overrides=overrides)
    samples = write_extract_stage(offline, n=16)
    run_train(offline)
    online = make_config(tmp_path / "online", overrides=overrides + ["train.online=true"])
    write_tokenize_stage(online, samples)
    manifest = run_train(online)
    assert manifest["fingerprint"]["features"]["source"] == "online"
    a, b = rows(offline.run_dir), rows(online.run_dir)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), ra["step"]
        assert rb["acc"] == pytest.approx(ra["acc"], abs=1e-9)


def test_torch_engine_run_resumed_from_its_last_complete_checkpoint_logs_the_uninterrupted_curve(tmp_path):
    """Without DeepSpeed (train.engine=torch): a run that lost its last checkpoint and manifest resumes from the
    step-3 checkpoint and logs exactly the straight run's steps 4-6 and held-out evals, ending with the same
    weights."""
    import shutil

    from train.stage import run_train

    cfg = make_config(tmp_path, overrides=FAST + ["train.engine=torch"])
    write_extract_stage(cfg)
    straight = run_train(cfg)
    reference, reference_eval = rows(cfg.run_dir), rows(cfg.run_dir, "eval")
    train_dir = cfg.run_dir / "train"
    assert sorted(p.name for p in (train_dir / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    (train_dir / "manifest.json").unlink()
    shutil.rmtree(train_dir / "checkpoints" / "step-00000006")
    resumed = run_train(cfg)
    assert [r["step"] for r in rows(cfg.run_dir)] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "acc", "tau_hat"):
        assert [r[key] for r in rows(cfg.run_dir)] == [r[key] for r in reference], key
    assert [(r["step"], r["loss"]) for r in rows(cfg.run_dir, "eval")] == [(r["step"], r["loss"]) for r in reference_eval]
    assert resumed["replica_digests"] == straight["replica_digests"]


@pytest.mark.slow
def test_train_runs_where_deepspeed_is_not_installed(tmp_path):
    """A process in which `import deepspeed` fails (the GPU image without its wheel): train.engine=auto picks the
    torch engine and the CLI trains, checkpoints and exports."""
    import subprocess
    import sys

    from tests.conftest import REPO

    overrides = FAST + [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}"]
    write_extract_stage(make_config(tmp_path, overrides=FAST), n=16)
    program = ("import sys; sys.modules['deepspeed'] = None; from drafter.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", program, "train", "--config", "configs/tiny.yaml", *overrides],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "torch engine" in done.stderr
    manifest = json.loads((tmp_path / "runs" / "tiny" / "train" / "manifest.json").read_text())
    assert manifest["counts"]["steps"] == 6 and manifest["export"]["verified"]


def subprocess_env() -> dict:
    # not this process's rendezvous, nor its wandb-core service (a killed run would keep its run id "in use" there)
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and k != "WANDB_SERVICE"}
    env.update(DS_ACCELERATOR="cpu", DRAFTER_NO_PROGRESS="1", WANDB_MODE="offline", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.parametrize("tied", [False, True])
def test_frozen_embedding_lm_head_and_final_norm_are_read_from_the_target_safetensors(tied, tmp_path):
    from pipeline.config import TargetConfig
    from pipeline.target import hf_config, load_target, open_target
    from train.inputs import read_frozen_target

    random_cfg = TargetConfig(model="random:llama", random_init={"tie_word_embeddings": tied}, device="cpu",
                              dtype="float32")
    model = load_target(open_target(random_cfg, CACHE).location, random_cfg)
    with torch.no_grad():  # a final norm that is not all ones: proves it is read, not initialised
        model.model.norm.weight.copy_(torch.rand_like(model.model.norm.weight) + 0.5)
    model.save_pretrained(tmp_path / "target")
    target_cfg = TargetConfig(model=str(tmp_path / "target"), device="cpu", dtype="float32")
    location = str(tmp_path / "target")
    frozen = read_frozen_target(location, target_cfg, hf_config(location, target_cfg), final_norm=True)
    assert torch.equal(frozen.embed, model.get_input_embeddings().weight)
    assert torch.equal(frozen.head, model.get_output_embeddings().weight)
    assert (frozen.embed is frozen.head) == tied
    x = torch.randn(5, model.config.hidden_size)
    assert torch.equal(frozen.final_norm(x), model.model.norm(x))
    assert not any(p.requires_grad for p in frozen.final_norm.parameters())


def test_a_training_that_fails_before_its_export_ends_its_wandb_run_as_failed(tmp_path, monkeypatch):
    """A failure after the loop and before finish() (injected into Trainer.fit) must not leave the W&B run open in
    the process: it ends with exit code 1, and the next run in the same process starts and finishes cleanly."""
    from train.stage import run_train
    from train.trainer import Trainer

    fit = Trainer.fit

    def fit_then_fail(self):
        fit(self)
        raise RuntimeError("injected failure before the export")

    cfg = make_config(tmp_path, overrides=FAST)
    write_extract_stage(cfg)
    monkeypatch.setattr(Trainer, "fit", fit_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_train(cfg)
    exits = [r.exit.exit_code for r in wandb_offline_records(cfg.run_dir / "train" / "wandb") if r.HasField("exit")]
    assert exits == [1]
    monkeypatch.setattr(Trainer, "fit", fit)
    again = make_config(tmp_path / "again", overrides=FAST)
    write_extract_stage(again)
    assert run_train(again)["counts"]["steps"] == 6


def test_keep_best_exports_the_evaluated_step_of_lowest_held_out_loss_and_a_killed_swap_resumes_to_it(tmp_path,
                                                                                                      monkeypatch):
    """train.keep_best with held-out losses scripted so that step 3 (of 3 and 6) is the best: train/best/ and the
    final train/export/ hold step 3's weights (equal to its checkpoint's), best.json and the manifest say so. A run
    killed inside the swap of train/best/ (only best.old left) and before its last checkpoint resumes, puts
    best.old back and exports step 3 again."""
    import shutil

    from safetensors.torch import load_file

    import train.trainer as trainer_module
    from dflash_model.export import load_zlab
    from train.stage import run_train

    scripted = {0: 9.0, 3: 1.0, 6: 2.0}
    real = trainer_module.Trainer.evaluate

    def evaluate(self):
        metrics = real(self)
        return {**metrics, "loss": scripted[self.position["global_step"]]} if metrics is not None else None

    monkeypatch.setattr(trainer_module.Trainer, "evaluate", evaluate)
    cfg = make_config(tmp_path, overrides=FAST + ["train.engine=torch", "train.keep_best=true"])
    write_extract_stage(cfg)
    manifest = run_train(cfg)
    train_dir = cfg.run_dir / "train"
    best, export = train_dir / "best", train_dir / "export"
    assert json.loads((best / "best.json").read_text()) == {"step": 3, "eval_loss": 1.0}
    assert manifest["export"]["step"] == 3 and manifest["export"]["eval_loss"] == 1.0
    exported = load_zlab(export)[0].state_dict()
    step3 = load_file(train_dir / "checkpoints" / "step-00000003" / "model.safetensors")
    step6 = load_file(train_dir / "checkpoints" / "step-00000006" / "model.safetensors")
    for name, tensor in exported.items():
        key = next(k for k in step3 if k == name or k.endswith("." + name))
        assert torch.equal(tensor.to(step3[key].dtype), step3[key]), name
    assert any(not torch.equal(step3[k], step6[k]) for k in step3)  # (the last step's weights are other ones)
    files = sorted(f.name for f in best.iterdir())
    assert files == sorted(f.name for f in export.iterdir())
    assert all((best / f).read_bytes() == (export / f).read_bytes() for f in files)

    (train_dir / "manifest.json").unlink()
    shutil.rmtree(train_dir / "checkpoints" / "step-00000006")
    best.rename(train_dir / "best.old")  # killed between replace_dir's two renames
    shutil.rmtree(export)
    resumed = run_train(cfg)
    assert json.loads((best / "best.json").read_text()) == {"step": 3, "eval_loss": 1.0}
    assert resumed["export"]["step"] == 3 and not (train_dir / "best.old").exists()
    assert all((best / f).read_bytes() == (export / f).read_bytes() for f in files)


def test_a_log_window_counts_the_torch_compile_work_done_inside_it():
    """The logged `compiles` / `compile_s` of a window are the frames torch.compile compiled between its start and
    its log (a recompilation for a new input rank, here), not those compiled before it: what tells a stall of the
    training curve that was recompiling from one that was not."""
    from train.step import SCALAR_STATS, StepStats
    from train.trainer import _Window

    f = torch.compile(lambda x: x.sin() + 1, backend="eager", dynamic=False)
    f(torch.ones(3))  # compiled before the window opens
    stats = StepStats(torch.ones(len(SCALAR_STATS) + 2 + 2 * 3, dtype=torch.float64), block_size=4)
    window = _Window(time.time())
    window.add(stats)
    f(torch.ones(3))
    assert window.rates(None, 1)["compiles"] == 0
    f(torch.ones(3, 5))  # a new rank: compiled again, inside the window
    rates = window.rates(None, 1)
    assert rates["compiles"] >= 1 and rates["compile_s"] > 0
