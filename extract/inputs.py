"""What the extract stage reads and how it cuts it into units, shared by the stage, `extract --verify` and the tap
check: the tokenize stage's parquet index and samples, the screening of bad samples (counted with a reason), the
deterministic plan of units, the resolved context (target, taps, fingerprint, config hash) and the backend.

The plan is a pure function of the sample lengths: sort by length (longest first, ties by tokenize order) and cut
into runs of about ``extract.shard_tokens`` tokens, so every rank computes the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from extract.layers import LAYER_CONVENTION, configured_layer_ids, stored_tap_ids
from pipeline.config import RunConfig, config_record
from pipeline.errors import DamagedFile, StageError
from pipeline.manifests import tokenize_outputs
from pipeline.stage_dir import StageDir, check_fingerprint
from pipeline.tokenize import TOKENIZED_SCHEMA

MAX_FAILURE_EXAMPLES = 5


# ----------------------------------------------------------------------------------------------
# Input: the tokenize stage's parquet shards
# ----------------------------------------------------------------------------------------------


@dataclass
class TokenizedIndex:
    """What planning needs from the tokenize output: one entry per sample, in tokenize order."""

    files: list[Path]
    file_of: np.ndarray  # int32 [N] which parquet file
    row_in_file: np.ndarray  # int64 [N]
    ids: list[str]
    lengths: np.ndarray  # int64 [N]
    stage: StageDir  # the tokenize stage the files belong to (its reader names a damaged shard)
    verified: set = field(default_factory=set)  # files checked against their sidecars by `read_samples` so far


def read_tokenized_index(tok_stage: StageDir, max_samples: int | None = None) -> TokenizedIndex:
    """Ids and lengths of every tokenized sample (reads only the small columns; each shard's schema is checked: a
    damaged one is a DamagedFile naming it and what to run). The whole files are checked against their sidecars
    where their samples are read (`read_samples`), by the rank that reads them."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = sorted(tok_stage.shards.glob("*.parquet"))
    if not files:
        raise StageError(f"no tokenized shards in {tok_stage.shards}")
    file_of, rows, ids, lengths = [], [], [], []
    for k, f in enumerate(files):
        with tok_stage.reading_shard(f):
            schema = pq.read_schema(f)
        tok_stage.check_columns(f, schema, TOKENIZED_SCHEMA, ["id", "input_ids", "loss_mask"])
        if "num_tokens" in schema.names:
            t = tok_stage.read_shard(f, columns=["id", "num_tokens"], schema=TOKENIZED_SCHEMA)
            n = t.column("num_tokens").to_numpy()
        else:
            t = tok_stage.read_shard(f, columns=["id", "input_ids"], schema=TOKENIZED_SCHEMA)
            n = pc.list_value_length(t.column("input_ids")).to_numpy(zero_copy_only=False)
        ids += t.column("id").to_pylist()
        lengths.append(np.asarray(n, dtype=np.int64))
        file_of.append(np.full(len(n), k, dtype=np.int32))
        rows.append(np.arange(len(n), dtype=np.int64))
        if max_samples is not None and len(ids) >= max_samples:
            break
    index = TokenizedIndex(files, np.concatenate(file_of), np.concatenate(rows), ids, np.concatenate(lengths),
                           tok_stage)
    if max_samples is not None:
        index.file_of, index.row_in_file = index.file_of[:max_samples], index.row_in_file[:max_samples]
        index.ids, index.lengths = index.ids[:max_samples], index.lengths[:max_samples]
    return index


def read_samples(index: TokenizedIndex, rows: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{row: (input_ids int32 [S], loss_mask uint8 [S])}`` for the requested global rows. A file is checked against
    its sidecar the first time it is read (a damaged page can still decode, into other tokens)."""
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    rows = np.asarray(rows)
    for k in np.unique(index.file_of[rows]):
        mine = rows[index.file_of[rows] == k]
        if k not in index.verified:
            index.stage.verify_shard(index.files[k])
            index.verified.add(k)
        table = index.stage.read_shard(index.files[k], columns=["input_ids", "loss_mask"], schema=TOKENIZED_SCHEMA)
        if int(index.row_in_file[mine].max()) >= len(table):  # the file changed since the index read it
            raise DamagedFile(index.files[k], f"{len(table)} rows, fewer than when the index read it",
                              index.stage.repair_shard(index.files[k]))
        table = table.take(index.row_in_file[mine])
        ids_col, mask_col = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        for j, r in enumerate(mine):
            a, m = ids_col[j].values, mask_col[j].values
            out[int(r)] = (np.asarray(a.to_numpy(zero_copy_only=False), dtype=np.int32),
                           np.asarray(m.to_numpy(zero_copy_only=False), dtype=np.uint8))
    return out


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    name: str
    rows: tuple[int, ...]  # global tokenize rows, longest first
    tokens: int


def plan_units(lengths: np.ndarray, keep: np.ndarray, shard_tokens: int) -> list[Unit]:
    """Deterministic units: kept samples sorted longest first (ties: tokenize order), cut every ~shard_tokens."""
    rows = np.flatnonzero(keep)
    order = rows[np.lexsort((rows, -lengths[rows]))]
    units, cur, tok = [], [], 0
    for r in order:
        cur.append(int(r))
        tok += int(lengths[r])
        if tok >= shard_tokens:
            units.append(Unit(f"{len(units):05d}", tuple(cur), tok))
            cur, tok = [], 0
    if cur:
        units.append(Unit(f"{len(units):05d}", tuple(cur), tok))
    return units


def screen_index(index: TokenizedIndex) -> tuple[np.ndarray, dict[str, int], dict[str, list]]:
    """Samples planning can reject from ids/lengths alone: empty, duplicate id. Returns (keep, counts, examples)."""
    keep = np.ones(len(index.ids), dtype=bool)
    counts: dict[str, int] = {}
    examples: dict[str, list] = {}

    def drop(i: int, reason: str):
        keep[i] = False
        counts[reason] = counts.get(reason, 0) + 1
        examples.setdefault(reason, [])
        if len(examples[reason]) < MAX_FAILURE_EXAMPLES:
            examples[reason].append(index.ids[i])

    seen: set[str] = set()
    for i, (sid, n) in enumerate(zip(index.ids, index.lengths)):
        if n <= 0:
            drop(i, "empty")
        elif sid in seen:
            drop(i, "duplicate_id")
        else:
            seen.add(sid)
    return keep, counts, examples


def check_sample(input_ids: np.ndarray, loss_mask: np.ndarray, vocab_rows: int) -> str | None:
    """The reason a sample cannot be extracted, or None."""
    if len(input_ids) == 0:
        return "empty"
    if len(input_ids) != len(loss_mask):
        return "mask_length_mismatch"
    if input_ids.min() < 0 or input_ids.max() >= vocab_rows:
        return "token_id_out_of_range"
    return None


# ----------------------------------------------------------------------------------------------
# Context shared by run, repair and verify
# ----------------------------------------------------------------------------------------------


@dataclass
class ExtractContext:
    location: str
    layer_ids: list[int]  # the drafter's taps
    tap_ids: list[int]  # the taps stored per token, in column order (extract.layers.stored_tap_ids)
    num_layers: int
    hidden_size: int
    vocab_rows: int
    fingerprint: dict
    config_hash: str
    settings: dict  # what config_hash hashes, by name (pipeline.config.config_record)
    tok_stage: StageDir


def extract_context(cfg: RunConfig) -> ExtractContext:
    """Resolve the target, the taps and the fingerprint; refuse a tokenize output made for another target."""
    from pipeline.target import open_target

    tok_stage = StageDir(cfg.run_dir, "tokenize")
    tokenized = tokenize_outputs(cfg.run_dir)
    target = open_target(cfg.target, cfg.cache_dir)
    check_fingerprint(target.fingerprint, tokenized.fingerprint,
                      what=f"tokenize output {tok_stage.path}", producer="tokenize")
    text = target.text
    e = cfg.extract
    layer_ids = configured_layer_ids(e, text.num_hidden_layers)
    tap_ids = stored_tap_ids(layer_ids, text.num_hidden_layers, e.last_hidden)
    fingerprint = {
        **target.fingerprint,
        "layer_ids": layer_ids,
        "last_hidden": len(tap_ids) > len(layer_ids),  # one more tap, L-1, after the drafter's
        "layer_convention": LAYER_CONVENTION,
        "hidden_size": int(text.hidden_size),
        "storage_dtype": e.storage_dtype,
    }
    target_out = {k: v for k, v in vars(cfg.target).items() if k != "device"}  # same features on any device
    config_hash, settings = config_record(
        target=target_out, fingerprint=fingerprint, tokenize_output=tokenized.config_hash,
        extract={"backend": e.backend, "shard_tokens": e.shard_tokens, "max_samples": e.max_samples})
    return ExtractContext(target.location, layer_ids, tap_ids, int(text.num_hidden_layers), int(text.hidden_size),
                          int(text.vocab_size), fingerprint, config_hash, settings, tok_stage)


def make_backend(cfg: RunConfig, ctx: ExtractContext, backend: str | None = None, *, max_len: int = 4096):
    """The extraction backend (`hf` or `vllm`); ``max_len`` = longest sample it will see (vLLM sizes its engine)."""
    backend = backend or cfg.extract.backend
    if backend == "hf":
        from extract.hf import HFExtractor

        return HFExtractor(ctx.location, cfg.target, cfg.extract, ctx.tap_ids)
    if backend == "vllm":
        from extract.vllm import VLLMExtractor

        return VLLMExtractor(ctx.location, cfg.target, cfg.extract, ctx.tap_ids, max_len=max_len)
    raise StageError(f"extract.backend: unknown backend {backend!r}")
