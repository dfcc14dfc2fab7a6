"""`drafter train`: train the DFlash drafter on extracted features (or online from the target), with DeepSpeed.

    torchrun --nproc-per-node 8 -m drafter.cli train --config configs/qwen3-8b.yaml      (one node)
    srun python -m drafter.cli train --config ...                                        (SLURM, many nodes)
    drafter train --config configs/tiny.yaml                                             (one process)

`run_train` reads top to bottom: process group (train/distributed.py) -> inputs + fingerprint check
(train/inputs.py) -> stage dir -> `Trainer` (train/trainer.py: data plan, drafter + frozen target pieces, engine;
resume; the loop; final eval, checkpoint, export, replica check) -> manifest. SIGTERM / SIGUSR1 during resume or the
loop stop the run after the step in flight with a checkpoint of it (train/preempt.py): exit status 75, and the same
command resumes.

Outputs (runs/<run>/train/): checkpoints/ (train/checkpoint.py), metrics.jsonl + wandb/ (train/metrics.py),
export/ (z-lab DFlash layout), manifest.json (fingerprint = drafter args + the feature fingerprint trained on).
"""

from __future__ import annotations

import time

from pipeline.config import RunConfig, config_record, hashed_fields
from pipeline.log import get_logger, summary
from pipeline.stage_dir import RankInfo, StageDir
from train.distributed import barrier, init_distributed, rank0_first
from train.inputs import TrainInputs, open_inputs
from train.preempt import Preempted, StopSignals
from train.trainer import Trainer

log = get_logger("train")


def train_config_record(cfg: RunConfig, inputs: TrainInputs) -> tuple[str, dict]:
    """(hash, settings) a finished train stage is compared with: drafter + train sections + the input fingerprint.
    Fields that change how the run is observed or scheduled, not the weights it produces, are declared
    `hashed=False` in pipeline/config.py and stay out of it (so a resumed run may use more workers or log more often)."""
    return config_record(drafter=cfg.drafter, train=hashed_fields(cfg.train), fingerprint=inputs.fingerprint)


def run_train(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    """Train on every rank of the process group (torchrun / SLURM start one process per GPU; `ranks` is only
    checked against it) and return the manifest on every rank."""
    started = time.time()
    dist, device = init_distributed()
    if ranks.world_size not in (1, dist.world_size):
        log.warning("--world-size %d ignored: the process group has %d ranks", ranks.world_size, dist.world_size)
    inputs = open_inputs(cfg)
    stage = StageDir(cfg.run_dir, "train")
    config_hash, settings = train_config_record(cfg, inputs)
    if not rank0_first(lambda: stage.begin(config_hash, force=force, settings=settings), dist.is_main):
        if dist.is_main:
            summary("train", f"already complete at {stage.path} (same config)")
        return stage.manifest()
    barrier()

    trainer = Trainer(cfg, inputs, dist, device, stage.path)
    try:
        with StopSignals() as trainer.stop:  # SIGTERM / SIGUSR1: checkpoint the step in flight, exit 75
            trainer.resume()
            trainer.fit()
        result = trainer.finish()
    except Preempted:
        trainer.abort(Preempted.exit_status)
        raise
    except BaseException:
        trainer.abort()
        raise

    if dist.is_main:
        stage.write_manifest(config_hash=config_hash, fingerprint=inputs.fingerprint,
                             inputs={inputs.stage.stage: inputs.input.ref()}, counts=result.counts,
                             started=started, extra=result.extra)
        fe = result.final_eval
        held_out = f", held-out loss {fe['loss']:.4f} tau_hat {fe['tau_hat']:.3f}" if fe else ""
        summary("train", f"{result.counts['steps']} steps on {dist.world_size} rank(s){held_out}; "
                         f"export at {stage.path / 'export'}")
    barrier()
    return stage.manifest()
