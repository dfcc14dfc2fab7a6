"""The drafter's training run on one rank, in the shape of torchtitan's and speculators' trainers:

    trainer = Trainer(cfg, inputs, dist, device, out_dir)    # setup: data plan, drafter + frozen target pieces, engine
    trainer.resume()                                         # the newest COMPLETE checkpoint, if any
    trainer.fit()                                            # steps, logging, held-out evals, checkpoints
    result = trainer.finish()                                # final eval + checkpoint, export, replica check

Every rank builds the same plan (train/data.py) and runs the same number of forwards; rank 0 alone logs
(train/metrics.py). Checkpoints (train/checkpoint.py) hold the engine state and the data position, so a run
killed at any point resumes at the step after its last complete checkpoint and logs exactly the curve of an
uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.config import RunConfig
from pipeline.cuda_graphs import compile_totals
from pipeline.log import get_logger, progress
from pipeline.errors import StageError
from pipeline.files import atomic_write_json, read_json, recover_dir, replace_dir, sha256_file
from pipeline.target import load_target
from train import checkpoint
from train.data import EVAL_EPOCH, MicroBatchDataset, RunPlan, batch_to, make_loader, rank_micro_batches
from train.distributed import DistEnv, all_gather_objects, barrier, rank0_first
from train.engine import TrainForward, build_engine, compile_layers, current_lr, engine_kind
from dflash_model.card import CARD_NAME
from dflash_model.export import export_zlab, load_zlab
from train.inputs import TrainInputs, frozen_pieces_of, read_frozen_target
from train.loss import default_gamma, kl_share
from train.metrics import DrafterShape, MetricsLogger, peak_flops
from dflash_model.model import DFlashDrafter
from train.online import OnlineFeatures
from train.preempt import Preempted, StopSignals, any_rank_stopping
from train.step import StepStats, eval_step, train_step

log = get_logger("train")

BEST_DIR = "best"  # train/best/: the z-lab export of the evaluated step with the lowest held-out loss (train.keep_best)
BEST_RECORD = "best.json"  # in it: {"step", "eval_loss"}


@dataclass
class TrainResult:
    """What the run's manifest records."""

    counts: dict
    extra: dict
    final_eval: dict | None


class Trainer:
    def __init__(self, cfg: RunConfig, inputs: TrainInputs, dist: DistEnv, device: torch.device, out_dir: Path):
        self.cfg, self.train_cfg, self.inputs, self.args = cfg, cfg.train, inputs, inputs.args
        self.dist, self.device, self.out_dir = dist, device, Path(out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        train_cfg = self.train_cfg
        try:
            self.plan = RunPlan.build(inputs.source.ids, inputs.source.lengths, inputs.source.num_loss_tokens,
                                      block_size=self.args.block_size, min_loss_tokens=cfg.min_loss_tokens,
                                      budget=train_cfg.micro_batch_tokens, world_size=dist.world_size,
                                      grad_accum=train_cfg.grad_accum, seed=train_cfg.seed, epochs=train_cfg.epochs,
                                      max_steps=train_cfg.max_steps, eval_fraction=train_cfg.eval_fraction,
                                      eval_max_samples=train_cfg.eval_max_samples,
                                      data_fraction=train_cfg.data_fraction)
        except ValueError as e:
            raise StageError(str(e)) from e
        self.kl = kl_share(train_cfg.loss, train_cfg.kl_weight)  # the KL share of the row loss (0: CE only)
        self.drafter, target, self.final_norm = self._build_drafter()
        self.engine_kind = engine_kind(train_cfg.engine, dist.world_size)
        self.sharded = self.engine_kind == "deepspeed" and train_cfg.zero_stage == 3  # ranks hold parameter shards
        self.engine, _, _ = build_engine(TrainForward(self.drafter), train_cfg, total_steps=self.plan.total_steps,
                                         world_size=dist.world_size, device=device)
        dtype = next(self.engine.module.parameters()).dtype
        if self.final_norm is not None:
            self.final_norm.to(device=device, dtype=dtype)
        self.features_of = features_fn(target, inputs.tap_ids, self.args.hidden_size, device, dtype,
                                        cfg.extract.compile)
        self.ahead = FeaturesAhead(self.features_of, device) if train_cfg.features_ahead and device.type == "cuda" \
            else None
        self.gamma = train_cfg.loss_gamma or default_gamma(self.args.block_size)
        self.shape = DrafterShape.from_args(self.args)
        self.peak = peak_flops(device, train_cfg.precision)
        self.tile = 128 if device.type == "cuda" else None  # flex tile: aligned rows, few distinct shapes to compile
        self.position = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "tokens_seen": 0,
                         "best_step": None, "best_eval_loss": None}  # (train.keep_best: what train/best/ holds)
        self.resumed = False
        self.last_saved = -1
        self.logger: MetricsLogger | None = None
        self.stop: StopSignals | None = None  # set by run_train: fit checks it after every step

    def _build_drafter(self) -> tuple[DFlashDrafter, torch.nn.Module | None, torch.nn.Module | None]:
        """The drafter (seeded init, or `drafter.init_from`) with the target's frozen embedding and LM head attached;
        online, also the target itself (its taps are computed in the step); with distillation, the target's frozen
        final norm."""
        torch.manual_seed(self.train_cfg.seed)
        drafter = DFlashDrafter(self.args)
        if self.cfg.drafter.init_from:
            _init_from(drafter, self.args, self.cfg.drafter.init_from)
        drafter.gradient_checkpointing = self.train_cfg.activation_checkpointing
        if self.train_cfg.compile:
            compile_layers(drafter)
        target = None
        if self.inputs.online:
            target = load_target(self.inputs.target.location, self.cfg.target, device=self.device)
            frozen = frozen_pieces_of(target, final_norm=bool(self.kl))
        else:
            frozen = read_frozen_target(self.inputs.target.location, self.cfg.target, self.inputs.target.config,
                                        final_norm=bool(self.kl))
        drafter.attach_target_head(frozen.embed, frozen.head)
        return drafter, target, frozen.final_norm

    # -- resume, save ----------------------------------------------------------------------------------

    def resume(self) -> None:
        """Drop the debris of a killed save, then load the newest COMPLETE checkpoint (refused if its data plan
        differs); open the metrics log (rank 0), truncated to the resumed step."""
        rank0_first(lambda: checkpoint.remove_incomplete(self.ckpt_dir), self.dist.is_main)
        barrier()
        latest = checkpoint.latest_complete(self.ckpt_dir)
        if latest is not None:
            tag, saved = latest
            checkpoint.check_resumable(saved, self.resume_state())
            state = checkpoint.load(self.engine, self.ckpt_dir, tag, rank=self.dist.rank, device=self.device)
            self.position = {k: state.get(k, v) for k, v in self.position.items()}
            self.resumed, self.last_saved = True, self.position["global_step"]
            if self.dist.is_main:
                log.info("resumed from %s (step %d, epoch %d, step %d of the epoch)", tag, state["global_step"],
                         state["epoch"], state["step_in_epoch"])
        if self.train_cfg.keep_best:  # what train/best/ holds is the truth (a kill may have come after its export
            best_dir = self.out_dir / BEST_DIR  # and before the next checkpoint): the best so far, whatever step
            rank0_first(lambda: recover_dir(best_dir), self.dist.is_main)
            record = read_json(best_dir / BEST_RECORD) if (best_dir / BEST_RECORD).is_file() else {}
            self.position["best_step"], self.position["best_eval_loss"] = record.get("step"), record.get("eval_loss")
        if self.dist.is_main:
            self.logger = MetricsLogger(self.cfg, self.out_dir,
                                        resume_step=self.position["global_step"] if self.resumed else None)
            plan = self.plan
            engine = f"DeepSpeed ZeRO-{self.train_cfg.zero_stage}" if self.engine_kind == "deepspeed" else "torch engine"
            log.info("drafter %.1fM trainable params; %d train / %d held-out samples (%d too short, %d with too "
                     "few supervised tokens, %d outside train.data_fraction); %d steps; %d ranks; %s %s",
                     sum(getattr(p, "ds_numel", p.numel()) for p in self.drafter.parameters()) / 1e6,
                     len(plan.train_idx), len(plan.eval_idx), plan.too_short, plan.too_few_loss_tokens, plan.left_out,
                     plan.total_steps,
                     self.dist.world_size, engine, self.train_cfg.precision)

    def resume_state(self) -> dict:
        """What a checkpoint must match to be resumed by this run (train/checkpoint.py RESUME_FIELDS)."""
        return {**self.plan.state(), "engine": self.engine_kind}

    def save(self) -> None:
        """A complete checkpoint of the current position (collective)."""
        checkpoint.save(self.engine, self.ckpt_dir, {**self.resume_state(), **self.position}, rank=self.dist.rank,
                        device=self.device)
        self.last_saved = self.position["global_step"]

    # -- step, evaluate --------------------------------------------------------------------------------

    def _loader(self, micro_batches: list, epoch: int):
        """This rank's collated micro-batches, in order; with `train.features_ahead` each one's features are
        already on their way (computed one micro-batch ahead on a side stream)."""
        ds = MicroBatchDataset(self.inputs.open_source, micro_batches, block_size=self.args.block_size,
                               num_anchors=self.train_cfg.num_anchors, mask_token_id=self.args.mask_token_id,
                               seed=self.train_cfg.seed, epoch=epoch, tile=self.tile)
        loader = make_loader(ds, self.train_cfg.num_workers, pin_memory=self.device.type == "cuda")
        return self.ahead.launch(loader) if self.ahead is not None else loader

    @property
    def _features(self):
        return self.ahead if self.ahead is not None else self.features_of

    def step(self, micro_batches: list[dict], tokens: int) -> tuple[StepStats, float, float]:
        """One optimizer step over this rank's `grad_accum` micro-batches (`tokens`: real tokens of the step over
        all ranks, from the plan). Returns (stats summed over ranks, grad norm -- both possibly still on the
        device --, the learning rate the step used)."""
        lr = current_lr(self.engine)  # the rate this step uses (the scheduler advances inside engine.step)
        stats, grad_norm = train_step(self.engine, micro_batches, self._features, gamma=self.gamma,
                                      chunk_rows=self.train_cfg.ce_chunk_tokens, attention=self.train_cfg.attention,
                                      world_size=self.dist.world_size, device=self.device, flops_shape=self.shape,
                                      kl=self.kl, final_norm=self.final_norm)
        self.position["global_step"] += 1
        self.position["tokens_seen"] += tokens
        return stats, grad_norm, lr

    def evaluate(self) -> dict | None:
        """Held-out loss / accuracy / tau_hat at the current step (the same anchors at every evaluation), logged
        by rank 0; None without held-out samples."""
        if not self.plan.eval_steps:
            return None
        loader = self._loader(rank_micro_batches(self.plan.eval_steps, self.dist.rank), EVAL_EPOCH)
        stats = eval_step(self.engine, loader, self._features, gamma=self.gamma,
                          chunk_rows=self.train_cfg.ce_chunk_tokens, attention=self.train_cfg.attention,
                          device=self.device, kl=self.kl, final_norm=self.final_norm)
        metrics = stats.metrics()
        if self.logger is not None:
            self.logger.log(self.position["global_step"], "eval", metrics)
        return metrics

    # -- the loop --------------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train to `plan.total_steps` from the current position: log every `log_every` steps (throughput over the
        window since the last log, evaluation and checkpoint time excluded), evaluate every `eval_every`, save every
        `save_every` (the final step's eval and checkpoint are `finish`'s)."""
        train_cfg, pos, total = self.train_cfg, self.position, self.plan.total_steps
        bar = progress(total=total, desc="train", unit="step", disable=None if self.dist.is_main else True)
        bar.update(pos["global_step"])
        if pos["global_step"] == 0 and train_cfg.eval_every:
            self.evaluate()  # the untrained drafter: the baseline of the held-out curve
        window = _Window(time.time())
        while pos["global_step"] < total:
            steps = self.plan.epoch(pos["epoch"])
            batches = iter(self._loader(rank_micro_batches(steps, self.dist.rank, pos["step_in_epoch"]), pos["epoch"]))
            for s in range(pos["step_in_epoch"], len(steps)):
                tokens = sum(mb.tokens for rank in steps[s] for mb in rank)
                stats, grad_norm, lr = self.step([next(batches) for _ in range(train_cfg.grad_accum)], tokens)
                step = pos["global_step"]
                window.add(stats)
                bar.update(1)
                if self.logger is not None and (step % train_cfg.log_every == 0 or step == total or step == 1):
                    metrics = {**stats.metrics(), "lr": lr, "grad_norm": float(grad_norm), "epoch": pos["epoch"],
                               **window.rates(self.peak, self.dist.world_size), "tokens_seen": pos["tokens_seen"]}
                    self.logger.log(step, "train", metrics)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_hat']:.2f}")
                    window = _Window(time.time())
                pos["epoch"], pos["step_in_epoch"] = (pos["epoch"], s + 1) if s + 1 < len(steps) else (pos["epoch"] + 1, 0)
                evaluate = train_cfg.eval_every and step % train_cfg.eval_every == 0 and step < total
                save = train_cfg.save_every and step % train_cfg.save_every == 0 and step < total
                if evaluate or save:  # eval/checkpoint time is not training throughput: keep it out of the window
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # the queued training work counts as training
                    paused = time.time()
                    if evaluate:
                        self.keep_if_best(self.evaluate())
                    if save:
                        self.save()
                    window.start += time.time() - paused
                if self.stop is not None and any_rank_stopping(self.stop.received is not None,
                                                               self.dist.world_size, self.device):
                    self._stop_here(step, total)
                if step >= total:
                    break
            del batches
        bar.close()

    def _stop_here(self, step: int, total: int) -> None:
        """A stop signal reached some rank (train/preempt.py): checkpoint this step (collective) and leave."""
        if self.last_saved != step:
            self.save()
        raise Preempted(f"stopped by {self.stop.received or 'a signal on another rank'} after step {step} of "
                        f"{total}; checkpoint step-{step:08d} saved: run the same command to resume")

    # -- the end ---------------------------------------------------------------------------------------

    def abort(self, exit_code: int = 1) -> None:
        """After a failure inside resume / fit / finish (or a stop signal: exit_code 75): end the W&B run with that
        exit code, so a process that goes on (a test, a notebook) does not keep it open."""
        if self.logger is not None:
            self.logger.finish(exit_code=exit_code)

    def finish(self) -> TrainResult:
        """Final held-out eval, a checkpoint of the last step (unless just saved), the z-lab export (read back and
        compared) and the replica check."""
        final_eval = self.evaluate()
        self.keep_if_best(final_eval)
        if self.last_saved != self.position["global_step"]:
            self.save()
        export_info = self.export_best() if self.train_cfg.keep_best and self.position["best_step"] is not None \
            else self.export(self.out_dir / "export", final_eval)
        replicas = replica_digests(self.drafter, self.out_dir, self.dist.rank, self.dist.world_size, self.sharded)
        last_train = None
        if self.logger is not None:
            rows = [r for r in self.logger.jsonl.rows() if r.get("kind") == "train"]
            last_train = rows[-1] if rows else None
            if export_info is not None:
                self.logger.log_export(Path(export_info["path"]), export_info)
            self.logger.finish()
        plan = self.plan
        counts = {"steps": self.position["global_step"], "train_samples": int(len(plan.train_idx)),
                  "eval_samples": int(len(plan.eval_idx)), "skipped.too_short": plan.too_short,
                  "skipped.too_few_loss_tokens": plan.too_few_loss_tokens,
                  "left_out.data_fraction": plan.left_out,
                  "tokens_seen": int(self.position["tokens_seen"])}
        extra = {"export": export_info, "world_size": self.dist.world_size, "replica_digests": replicas,
                 "final_eval": final_eval, "final_train": last_train}
        return TrainResult(counts, extra, final_eval)

    def keep_if_best(self, metrics: dict | None) -> None:
        """train.keep_best: when `metrics` (this step's held-out evaluation, the same on every rank) has the lowest
        loss so far, export this step to train/best/ (collective; written beside it and renamed over it, so a kill
        leaves the previous best whole) and remember it in the position that checkpoints save."""
        if not self.train_cfg.keep_best or metrics is None:
            return
        loss, best = float(metrics["loss"]), self.position["best_eval_loss"]
        if best is not None and loss >= best:
            return
        step, best_dir = self.position["global_step"], self.out_dir / BEST_DIR
        staging = best_dir.with_name(BEST_DIR + ".tmp")
        if self.dist.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        self.export(staging, metrics)
        if self.dist.is_main:
            atomic_write_json(staging / BEST_RECORD, {"step": step, "eval_loss": loss})
            replace_dir(staging, best_dir)
        barrier()
        self.position["best_step"], self.position["best_eval_loss"] = step, loss

    def export_best(self) -> dict | None:
        """train.keep_best at the end: train/export/ becomes a copy of train/best/ (the lowest held-out loss), read
        back and compared with it file by file. Returns `export`'s record plus the step it holds (rank 0)."""
        if not self.dist.is_main:
            return None
        best_dir, out_dir = self.out_dir / BEST_DIR, self.out_dir / "export"
        staging = out_dir.with_name("export.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(best_dir, staging)
        replace_dir(staging, out_dir)
        files = export_files(out_dir)
        if [f["sha256"] for f in files] != [sha256_file(best_dir / f["name"]) for f in files]:
            raise StageError(f"{out_dir} does not read back equal to {best_dir}")
        return {"path": str(out_dir), "files": files, "verified": True, "step": self.position["best_step"],
                "selected": "lowest held-out loss (train.keep_best)", "eval_loss": self.position["best_eval_loss"]}

    def export(self, out_dir: Path, final_eval: dict | None = None) -> dict | None:
        """Write the z-lab layout with its model card (rank 0), read it back with load_zlab and compare every tensor.
        Returns {"path", "files": [{name, bytes, sha256}] (the drafter's files: config and weights; the card, which
        `drafter eval` rewrites, is not among them), "verified": True} on rank 0, None elsewhere."""
        with full_parameters(self.drafter, self.sharded):
            if not self.dist.is_main:
                return None
            export_zlab(self.drafter, self.args, out_dir, target=self.cfg.target.model,
                        training=self.card_facts(final_eval))
            state = load_zlab(out_dir)[0].state_dict()
            ref = self.drafter.state_dict()
            bad = [k for k in ref if k not in state or not torch.equal(state[k].to(ref[k].dtype).cpu(), ref[k].cpu())]
            if bad or set(state) - set(ref):
                raise StageError(f"exported drafter at {out_dir} does not read back equal: {bad[:5]}")
        files = export_files(out_dir)
        return {"path": str(out_dir), "files": files, "verified": True}

    def card_facts(self, final_eval: dict | None) -> dict:
        """The model card's "Training data" rows: what this run trained on and how long."""
        cfg = self.cfg
        sources = ", ".join(f"{s.name} ({s.weight:g})" for s in cfg.curate.sources if s.weight > 0)
        if cfg.regen.backend == "none":
            answers = "the datasets' own (regen.backend=none)"
        else:
            answers = (f"written by the target ({cfg.regen.backend}, temperature {cfg.regen.temperature:g}, "
                       f"{cfg.regen.samples_per_prompt} per prompt, up to {cfg.regen.max_new_tokens} tokens)")
        facts = {
            "target": cfg.target.model + (f" @ {cfg.target.revision}" if cfg.target.revision else "")
            + f" (thinking {'on' if cfg.target.enable_thinking else 'off'})",
            "prompt sources in the config (weight; curate's report says which were found)": sources or "none",
            "answers": answers,
            "training samples": f"{len(self.plan.train_idx):,} ({len(self.plan.eval_idx):,} held out)",
            "features": "online (the target's forward in every step)" if cfg.train.online
            else f"extracted, stored as {cfg.extract.storage_dtype}",
            "optimizer steps": f"{self.position['global_step']:,} ({int(self.position['tokens_seen']):,} tokens seen, "
                               f"{self.dist.world_size} rank(s))",
            "loss": cfg.train.loss + (f" (KL weight {cfg.train.kl_weight:g})" if cfg.train.loss == "ce+kl" else ""),
        }
        if final_eval:
            facts["held-out loss / τ̂"] = f"{final_eval['loss']:.4f} / {final_eval['tau_hat']:.3f}"
        return facts


def export_files(out_dir: Path) -> list[dict]:
    """[{name, bytes, sha256}] of an export's drafter files (config, weights; not the card, which `drafter eval`
    rewrites)."""
    return [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)}
            for f in sorted(Path(out_dir).iterdir()) if f.is_file() and f.name != CARD_NAME]


def full_parameters(drafter: torch.nn.Module, sharded: bool):
    """Context in which `drafter` holds its full parameters (gathers DeepSpeed ZeRO-3 shards; a no-op unsharded)."""
    if not sharded:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None)


def replica_digests(drafter: torch.nn.Module, out_dir: Path, rank: int, world: int, sharded: bool) -> list[str]:
    """Every rank hashes the weights it holds and writes ranks/rank-XXXXX.json; a mismatch between data-parallel
    replicas (which ZeRO 0-2 keep in sync) fails the stage. ZeRO-3 ranks hash the gathered parameters. Returns the
    digests in rank order (collective)."""
    with full_parameters(drafter, sharded):
        digest = checkpoint.weights_digest(drafter.state_dict())
    atomic_write_json(Path(out_dir) / "ranks" / f"rank-{rank:05d}.json",
                      {"rank": rank, "world_size": world, "weights_sha256": digest})
    digests = all_gather_objects(digest)
    if len(set(digests)) != 1:
        raise StageError(f"data-parallel replicas ended with different weights: {digests}")
    return digests


@dataclass
class _Window:
    """Throughput since the last log: tokens and useful FLOPs over wall time (pauses subtracted from `start`). The
    steps' statistics are summed on the device and read once, when the window is logged. `compiles` / `compile_s`:
    the frames torch.compile compiled since the window opened and their seconds: a slow window with compile_s near
    its stall was recompiling (a held-out evaluation's compiles count too, though its pause is left out of the
    rates)."""

    start: float
    steps: list = field(default_factory=list)
    compiled: tuple = field(default_factory=compile_totals)

    def add(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def rates(self, peak: float | None, world: int) -> dict:
        sums = StepStats.total(self.steps).sums
        dt = max(time.time() - self.start, 1e-9)
        frames, seconds = compile_totals()
        out = {"tokens_per_s": sums["tokens"] / dt, "tflops_per_s": sums["flops"] / dt / 1e12,
               "compiles": frames - self.compiled[0], "compile_s": round(seconds - self.compiled[1], 3)}
        if peak:
            out["mfu"] = sums["flops"] / dt / (peak * world)
        return out


def features_fn(target, tap_ids: list[int], hidden_size: int, device, dtype, compile_setting: str = "off"):
    """mb -> (features [1, S, len(tap_ids)*D] on device, BlockBatch on device): stored features (offline), the
    target's taps computed now (online; its layers compiled per `extract.compile`, as offline extraction does), or
    zeros for a padding micro-batch. Columns: the drafter's taps, then (distillation) the last layer's output
    (extract.layers.stored_tap_ids)."""
    online = None
    if target is not None:
        from extract.hf import compiled_forward

        online = OnlineFeatures(target, tap_ids, forward=compiled_forward(target, tap_ids, compile_setting, device))
    width = len(tap_ids) * hidden_size

    def features_of(mb: dict):
        features, batch = batch_to(mb, device, dtype)
        if mb.get("padding"):
            features = torch.zeros(1, batch.seq_len, width, device=device, dtype=dtype)
        elif online is not None:
            n = len(mb["ids"])  # real sequences; a trailing dummy (tile padding) gets zero features
            features = online(mb["input_ids"][: sum(mb["seq_lens"][:n])], mb["seq_lens"][:n]).to(dtype)
            if mb["pad_tokens"]:
                features = torch.cat([features, features.new_zeros(1, mb["pad_tokens"], width)], dim=1)
        return features, batch

    return features_of


class FeaturesAhead:
    """`train.features_ahead`: each micro-batch's features are computed on a side CUDA stream one micro-batch
    ahead, so the online target forward (or the offline copy to the GPU) of micro-batch k+1 overlaps the drafter's
    step on k. `launch(batches)` yields the micro-batches with their work queued; calling the object with a
    micro-batch (the step's `features_of`) makes the current stream wait for it. The same kernels run, only on
    another stream: the features are identical."""

    def __init__(self, features_of, device: torch.device):
        self.features_of = features_of
        self.stream = torch.cuda.Stream(device)

    def launch(self, batches):
        pending = None
        for mb in batches:
            with torch.cuda.stream(self.stream):  # reads only host copies and frozen target weights
                mb["ahead"] = self.features_of(mb)
                mb["ahead_done"] = self.stream.record_event()
            if pending is not None:
                yield pending
            pending = mb
        if pending is not None:
            yield pending

    def __call__(self, mb: dict):
        current = torch.cuda.current_stream()
        current.wait_event(mb.pop("ahead_done"))
        features, batch = mb.pop("ahead")
        for t in [features, *(v for v in vars(batch).values() if isinstance(v, torch.Tensor))]:
            t.record_stream(current)  # made on the side stream, used (and freed) on this one
        return features, batch


def _init_from(drafter, args, path: str) -> None:
    """Start from a z-lab layout drafter (safetensors only, via dflash_model.export.load_zlab); shapes must match."""
    loaded, loaded_args = load_zlab(path)
    mine, theirs = dataclasses.asdict(args), dataclasses.asdict(loaded_args)
    bad = [k for k in mine if mine[k] != theirs.get(k)]
    if bad:
        raise StageError(f"drafter.init_from={path}: its architecture differs from this config in "
                         + ", ".join(f"{k} ({theirs.get(k)!r} != {mine[k]!r})" for k in bad))
    with torch.no_grad():
        for name, p in drafter.state_dict().items():
            p.copy_(loaded.state_dict()[name])
