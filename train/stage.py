"""`drafter train`: train the DFlash drafter on extracted features (or online from the target), with DeepSpeed.

    torchrun --nproc-per-node 8 -m drafter.cli train --config configs/qwen3-8b.yaml      (one node)
    srun python -m drafter.cli train --config ...                                        (SLURM, many nodes)
    drafter train --config configs/tiny.yaml                                              (one process)

Top to bottom, `run_train` does: process group -> input + fingerprint check -> stage dir -> data plan ->
drafter (+ frozen target embedding/LM head) -> DeepSpeed engine -> resume from the newest COMPLETE checkpoint ->
the loop (step, log, held-out eval, checkpoint) -> z-lab export (read back and compared) -> manifest.

Outputs (runs/<run>/train/): checkpoints/ (train/checkpoint.py), metrics.jsonl + wandb/ (train/metrics.py),
export/ (z-lab DFlash layout), manifest.json (fingerprint = drafter args + the feature fingerprint trained on).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.config import RunConfig, section_hash
from pipeline.log import get_logger, progress, summary
from pipeline.runner import RankInfo, StageDir, StageError, check_fingerprint, input_ref, sha256_file

log = get_logger("train")


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def expected_feature_fingerprint(cfg: RunConfig, location: str, tokenizer, target_config) -> dict:
    """What this config implies for the extracted features (the fields `check_fingerprint` compares)."""
    from extract.layers import LAYER_CONVENTION, resolve_layer_ids
    from pipeline.target import target_fingerprint, tokenizer_fingerprint

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return {
        "target": target_fingerprint(location, cfg.target),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "layer_ids": resolve_layer_ids(cfg.extract.layer_ids, cfg.extract.num_taps, text.num_hidden_layers),
        "layer_convention": LAYER_CONVENTION,
        "hidden_size": text.hidden_size,
    }


def target_head_weights(location: str, tcfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, D], LM head [V, D]) of the target, read from its safetensors without building the
    model (a tied head returns the embedding twice). Falls back to loading the target on CPU."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location, revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=tcfg.trust_remote_code)
    names: dict[int, list[str]] = {}  # a tied weight has several names; the file holds one of them
    for n, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    emb_param = meta.get_input_embeddings().weight
    head = meta.get_output_embeddings()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = head is None or head.weight is emb_param or bool(getattr(text, "tie_word_embeddings", False))
    stored: dict[str, torch.Tensor] = {}
    wanted = set(names.get(id(emb_param), [])) | (set(names.get(id(head.weight), [])) if not tied else set())
    for f in _safetensors_files(location, tcfg):
        with safe_open(str(f), framework="pt") as sf:
            for key in wanted & set(sf.keys()):
                stored[key] = sf.get_tensor(key)
    emb = next((stored[n] for n in names.get(id(emb_param), []) if n in stored), None)
    out = emb if tied else next((stored[n] for n in names.get(id(head.weight), []) if n in stored), None)
    if emb is not None and out is not None:
        return emb, out
    from pipeline.target import load_target

    log.warning("embedding/LM head not found by name in the target's safetensors; loading the full target on CPU")
    model = load_target(location, tcfg, device=torch.device("cpu"))
    emb = model.get_input_embeddings().weight.detach()
    out = model.get_output_embeddings()
    return emb, (out.weight.detach() if out is not None else emb)


def _safetensors_files(location: str, tcfg) -> list[Path]:
    p = Path(location)
    if p.is_dir():
        return sorted(p.glob("*.safetensors"))
    from huggingface_hub import hf_hub_download

    try:
        index = hf_hub_download(location, "model.safetensors.index.json", revision=tcfg.revision)
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    except Exception:  # noqa: BLE001 - a single-file checkpoint has no index
        shards = ["model.safetensors"]
    return [Path(hf_hub_download(location, s, revision=tcfg.revision)) for s in shards]


def _rank0_first(fn, is_main: bool):
    """Run `fn` on rank 0, then share its result (or its error) with every rank."""
    result: list = [None]
    if is_main:
        try:
            result[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            result[0] = ("error", e)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status == "error":
        raise value if isinstance(value, Exception) else StageError(str(value))
    return value


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def run_train(cfg: RunConfig, *, force: bool = False, ranks: RankInfo | None = None) -> dict:
    from extract.store import FeatureReader
    from pipeline.target import load_target, load_tokenizer, materialize_target
    from train import checkpoint
    from train.data import (EVAL_EPOCH, MicroBatchDataset, batch_to, heldout_split, make_loader, plan_epoch,
                            plan_eval, rank_micro_batches, total_steps)
    from train.engine import (TrainForward, barrier, build_engine, compile_layers, current_lr, eval_step,
                              init_distributed, train_step)
    from train.loss import default_gamma
    from train.metrics import DrafterShape, MetricsLogger, peak_flops
    from train.model import DFlashDrafter, DrafterArgs
    from transformers import AutoConfig

    started = time.time()
    tcfg = cfg.train
    dist, device = init_distributed()
    rank, world = dist.rank, dist.world_size
    if ranks is not None and ranks.world_size not in (1, world):
        log.warning("--world-size %d ignored: the process group has %d ranks", ranks.world_size, world)

    # -- input and fingerprint ------------------------------------------------------------------------
    location = materialize_target(cfg.target, cfg.cache_dir)
    tokenizer = load_tokenizer(location, cfg.target)
    target_config = AutoConfig.from_pretrained(location, revision=cfg.target.revision,
                                               trust_remote_code=cfg.target.trust_remote_code)
    expected = expected_feature_fingerprint(cfg, location, tokenizer, target_config)
    if tcfg.online:
        from train.online import TokenizedReader

        in_stage = StageDir(cfg.run_dir, "tokenize")
        check_fingerprint({k: expected[k] for k in ("target", "tokenizer")}, in_stage.manifest()["fingerprint"],
                          what=f"tokenized data at {in_stage.path}", producer="tokenize")
        open_source = functools.partial(TokenizedReader, in_stage.path)
        input_fp = {**expected, "source": "online"}
    else:
        in_stage = StageDir(cfg.run_dir, "extract")
        reader_fp = in_stage.manifest()["fingerprint"]
        check_fingerprint(expected, reader_fp, what=f"extracted features at {in_stage.path}", producer="extract")
        open_source = functools.partial(FeatureReader, in_stage.path)
        input_fp = reader_fp
    source = open_source()
    args = DrafterArgs.from_run_config(cfg, target_config, len(tokenizer))
    fingerprint = {"drafter": dataclasses.asdict(args), "features": input_fp}
    # fields that change how the run is observed or scheduled, not the weights it produces, stay out of the hash
    # (so a resumed run may use more workers or log more often)
    operational = dict(wandb=None, num_workers=0, log_every=0, eval_every=0, save_every=0, eval_max_samples=0,
                       compile=False, activation_checkpointing=False)
    config_hash = section_hash(cfg.drafter, dataclasses.replace(tcfg, **operational), fingerprint)

    stage = StageDir(cfg.run_dir, "train")
    fresh = _rank0_first(lambda: stage.begin(config_hash, force=force), dist.is_main)
    if not fresh:
        if dist.is_main:
            summary("train", f"already complete at {stage.path} (same config)")
        return stage.manifest()
    barrier()

    # -- data plan ------------------------------------------------------------------------------------
    lengths = np.asarray(source.lengths, dtype=np.int64)
    train_idx, eval_idx = heldout_split(source.ids, tcfg.eval_fraction)
    too_short = lengths[train_idx] <= args.block_size
    skipped = int(too_short.sum())
    train_idx = train_idx[~too_short]
    eval_idx = eval_idx[lengths[eval_idx] > args.block_size][: tcfg.eval_max_samples]  # never trained on, either way
    if len(train_idx) == 0:
        raise StageError(f"no training sample is longer than block_size={args.block_size} tokens")
    plan_kw = dict(budget=tcfg.micro_batch_tokens, world_size=world, grad_accum=tcfg.grad_accum, seed=tcfg.seed)
    plan = functools.lru_cache(maxsize=2)(lambda e: plan_epoch(lengths, train_idx, epoch=e, **plan_kw))
    n_total = total_steps(lambda e: len(plan(e)), tcfg.epochs, tcfg.max_steps)
    eval_plan = plan_eval(lengths, eval_idx, budget=tcfg.micro_batch_tokens, world_size=world) if len(eval_idx) else []
    plan_state = {"world_size": world, "micro_batch_tokens": tcfg.micro_batch_tokens, "grad_accum": tcfg.grad_accum,
                  "seed": tcfg.seed, "num_train_samples": int(len(train_idx))}

    # -- model + engine -------------------------------------------------------------------------------
    torch.manual_seed(tcfg.seed)
    drafter = DFlashDrafter(args)
    if cfg.drafter.init_from:
        _init_from(drafter, args, cfg.drafter.init_from)
    drafter.gradient_checkpointing = tcfg.activation_checkpointing
    if tcfg.compile:
        compile_layers(drafter)
    target = None
    if tcfg.online:
        target = load_target(location, cfg.target, device=device)
        emb = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        drafter.attach_target_head(emb, head.weight if head is not None else emb)
    else:
        drafter.attach_target_head(*target_head_weights(location, cfg.target))
    engine, _, _ = build_engine(TrainForward(drafter), tcfg, total_steps=n_total, world_size=world, device=device)
    compute_dtype = next(engine.module.parameters()).dtype
    attention = tcfg.attention
    gamma, chunk = (tcfg.loss_gamma or default_gamma(args.block_size)), tcfg.ce_chunk_tokens
    shape = DrafterShape.from_args(args)
    peak = peak_flops(device, tcfg.precision)
    features_of = _features_fn(target, args, device, compute_dtype, batch_to)
    tile = 128 if device.type == "cuda" else None  # flex tile: aligned rows, few distinct shapes to compile

    # -- resume ---------------------------------------------------------------------------------------
    ckpt_dir = stage.path / "checkpoints"
    _rank0_first(lambda: checkpoint.remove_incomplete(ckpt_dir), dist.is_main)
    barrier()
    state = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "tokens_seen": 0, **plan_state}
    latest = checkpoint.latest_complete(ckpt_dir)
    if latest is not None:
        tag, saved = latest
        checkpoint.check_resumable(saved, plan_state)
        state = checkpoint.load(engine, ckpt_dir, tag, rank=rank, device=device)
        if dist.is_main:
            log.info("resumed from %s (step %d, epoch %d, step %d of the epoch)", tag, state["global_step"],
                     state["epoch"], state["step_in_epoch"])
    logger = MetricsLogger(cfg, stage.path, resume_step=state["global_step"] if latest else None) if dist.is_main else None
    if dist.is_main:
        log.info("drafter %.1fM trainable params; %d train / %d held-out samples (%d too short); %d steps; "
                 "%d ranks; ZeRO-%d %s", sum(getattr(p, "ds_numel", p.numel()) for p in drafter.parameters()) / 1e6, len(train_idx), len(eval_idx),
                 skipped, n_total, world, tcfg.zero_stage, tcfg.precision)

    def run_eval(step: int) -> dict | None:
        if not eval_plan:
            return None
        ds = MicroBatchDataset(open_source, rank_micro_batches(eval_plan, rank), block_size=args.block_size,
                               num_anchors=tcfg.num_anchors, mask_token_id=args.mask_token_id, seed=tcfg.seed,
                               epoch=EVAL_EPOCH, tile=tile)
        loader = make_loader(ds, tcfg.num_workers, pin_memory=device.type == "cuda")
        stats = eval_step(engine, loader, features_of, gamma=gamma, chunk_rows=chunk, attention=attention,
                          device=device)
        metrics = stats.metrics()
        if logger is not None:
            logger.log(step, "eval", metrics)
        return metrics

    def save(st: dict) -> None:
        checkpoint.save(engine, ckpt_dir, st, rank=rank, device=device)

    # -- the loop -------------------------------------------------------------------------------------
    step, epoch, start = state["global_step"], state["epoch"], state["step_in_epoch"]
    tokens_seen = state.get("tokens_seen", 0)
    last_saved = step if latest else -1
    bar = progress(total=n_total, desc="train", unit="step", disable=None if dist.is_main else True)
    bar.update(step)
    if step == 0 and tcfg.eval_every:
        run_eval(0)  # the untrained drafter: the baseline of the held-out curve
    window_t, window_tokens, window_flops = time.time(), 0.0, 0.0
    while step < n_total:
        steps = plan(epoch)
        ds = MicroBatchDataset(open_source, rank_micro_batches(steps, rank, start), block_size=args.block_size,
                               num_anchors=tcfg.num_anchors, mask_token_id=args.mask_token_id, seed=tcfg.seed,
                               epoch=epoch, tile=tile)
        batches = iter(make_loader(ds, tcfg.num_workers, pin_memory=device.type == "cuda"))
        for s in range(start, len(steps)):
            mbs = [next(batches) for _ in range(tcfg.grad_accum)]
            lr = current_lr(engine)  # the rate this step uses (the scheduler advances inside engine.step)
            stats, grad_norm = train_step(engine, mbs, features_of, gamma=gamma, chunk_rows=chunk,
                                          attention=attention, world_size=world, device=device, flops_shape=shape)
            step += 1
            tokens_seen += int(stats.sums["tokens"])
            window_tokens += stats.sums["tokens"]
            window_flops += stats.sums["flops"]
            bar.update(1)
            if logger is not None and (step % tcfg.log_every == 0 or step == n_total or step == 1):
                dt = max(time.time() - window_t, 1e-9)
                metrics = {**stats.metrics(), "lr": lr, "grad_norm": grad_norm, "epoch": epoch,
                           "tokens_per_s": window_tokens / dt, "tflops_per_s": window_flops / dt / 1e12,
                           "tokens_seen": tokens_seen}
                if peak:
                    metrics["mfu"] = window_flops / dt / (peak * world)
                logger.log(step, "train", metrics)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_hat']:.2f}")
                window_t, window_tokens, window_flops = time.time(), 0.0, 0.0
            nxt = (epoch, s + 1) if s + 1 < len(steps) else (epoch + 1, 0)
            paused = time.time()  # eval/checkpoint time is not training throughput: keep it out of the window
            if tcfg.eval_every and step % tcfg.eval_every == 0 and step < n_total:
                run_eval(step)
            if tcfg.save_every and step % tcfg.save_every == 0 and step < n_total:
                save({**plan_state, "global_step": step, "epoch": nxt[0], "step_in_epoch": nxt[1],
                      "tokens_seen": tokens_seen})
                last_saved = step
            window_t += time.time() - paused
            if step >= n_total:
                break
        del batches
        epoch, start = nxt
    bar.close()

    final_eval = run_eval(step)
    if last_saved != step:
        save({**plan_state, "global_step": step, "epoch": epoch, "step_in_epoch": start, "tokens_seen": tokens_seen})
    export_info = _export(engine, args, stage.path / "export", tcfg.zero_stage, dist.is_main)
    replicas = _replica_digests(engine, stage.path, rank, world, tcfg.zero_stage)
    manifest = None
    if dist.is_main:
        last_train = [r for r in logger.jsonl.rows() if r.get("kind") == "train"]
        manifest = stage.write_manifest(
            config_hash=config_hash, fingerprint=fingerprint, inputs={in_stage.stage: input_ref(in_stage)},
            counts={"steps": step, "train_samples": int(len(train_idx)), "eval_samples": int(len(eval_idx)),
                    "skipped.too_short": skipped, "tokens_seen": int(tokens_seen)},
            started=started,
            extra={"export": export_info, "world_size": world, "replica_digests": replicas, "final_eval": final_eval,
                   "final_train": last_train[-1] if last_train else None},
        )
        logger.finish()
        fe = f", held-out loss {final_eval['loss']:.4f} tau_hat {final_eval['tau_hat']:.3f}" if final_eval else ""
        summary("train", f"{step} steps on {world} rank(s){fe}; export at {stage.path / 'export'}")
    barrier()
    return manifest if manifest is not None else stage.manifest()


def _replica_digests(engine, train_dir: Path, rank: int, world: int, zero_stage: int) -> list[str]:
    """Every rank hashes the weights it holds and writes ranks/rank-XXXXX.json; a mismatch between data-parallel
    replicas (which ZeRO 0-2 keep in sync) fails the stage. ZeRO-3 ranks hold shards, so they hash the gathered
    parameters. Returns the digests in rank order."""
    import contextlib

    from pipeline.runner import atomic_write_json
    from train.checkpoint import weights_digest

    drafter = engine.module.drafter
    gather = contextlib.nullcontext()
    if zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None)
    with gather:
        digest = weights_digest(drafter.state_dict())
    atomic_write_json(train_dir / "ranks" / f"rank-{rank:05d}.json", {"rank": rank, "world_size": world,
                                                                      "weights_sha256": digest})
    digests = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(digests, digest)
    else:
        digests = [digest]
    if len(set(digests)) != 1:
        raise StageError(f"data-parallel replicas ended with different weights: {digests}")
    return digests


def _features_fn(target, args, device, dtype, batch_to):
    """mb -> (features [1, S, n*D] on device, BlockBatch on device): stored features (offline), the target's taps
    computed now (online), or zeros for a padding micro-batch."""
    from train.online import OnlineFeatures

    online = OnlineFeatures(target, args.target_layer_ids) if target is not None else None
    width = args.num_taps * args.hidden_size

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


def _init_from(drafter, args, path: str) -> None:
    """Start from a z-lab layout drafter (safetensors only, via train.export.load_zlab); shapes must match."""
    from train.export import load_zlab

    loaded, loaded_args = load_zlab(path)
    mine, theirs = dataclasses.asdict(args), dataclasses.asdict(loaded_args)
    bad = [k for k in mine if mine[k] != theirs.get(k)]
    if bad:
        raise StageError(f"drafter.init_from={path}: its architecture differs from this config in "
                         + ", ".join(f"{k} ({theirs.get(k)!r} != {mine[k]!r})" for k in bad))
    with torch.no_grad():
        for name, p in drafter.state_dict().items():
            p.copy_(loaded.state_dict()[name])


def _export(engine, args, out_dir: Path, zero_stage: int, is_main: bool) -> dict | None:
    """Write the z-lab layout (rank 0; ZeRO-3 gathers the full parameters first), read it back with load_zlab and
    compare every tensor. Returns {"path", "files": [{name, bytes, sha256}], "verified": True}."""
    import contextlib

    from train.export import export_zlab, load_zlab

    drafter = engine.module.drafter
    gather = contextlib.nullcontext()
    if zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None)
    with gather:
        if not is_main:
            return None
        export_zlab(drafter, args, out_dir)
        state = load_zlab(out_dir)[0].state_dict()
        ref = drafter.state_dict()
        bad = [k for k in ref if k not in state or not torch.equal(state[k].to(ref[k].dtype).cpu(), ref[k].cpu())]
        if bad or set(state) - set(ref):
            raise StageError(f"exported drafter at {out_dir} does not read back equal: {bad[:5]}")
    files = [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(Path(out_dir).iterdir()) if f.is_file()]
    return {"path": str(out_dir), "files": files, "verified": True}
