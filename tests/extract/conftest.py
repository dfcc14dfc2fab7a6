"""Fixtures of the extract tests: tiny random targets (cached under .cache/targets) and a fake tokenize stage
(the parquet + manifest contract of design.md, built from random token ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

CACHE = Path(__file__).resolve().parents[2] / ".cache"


@pytest.fixture(scope="session")
def random_target():
    """random_target(model_type, **overrides) -> (location, fp32 CPU model) for a 'random:<type>' target."""
    from pipeline.config import TargetConfig
    from pipeline.target import load_target, materialize_target

    cache: dict = {}

    def make(model_type: str, **overrides):
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in cache:
            tcfg = TargetConfig(model=f"random:{model_type}", random_init=dict(overrides), device="cpu", dtype="float32")
            loc = materialize_target(tcfg, CACHE)
            cache[key] = (loc, load_target(loc, tcfg))
        return cache[key]

    return make


def write_tokenize_stage(cfg, lengths, *, seed: int = 0, shard_rows: int = 16, fingerprint_overrides: dict | None = None):
    """Create runs/<run>/tokenize/ like the tokenize stage does: parquet shards + a manifest whose fingerprint
    holds the target and tokenizer fingerprints of `cfg` (random token ids, loss mask on the second half)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.stage_dir import StageDir
    from pipeline.target import load_tokenizer, materialize_target, target_fingerprint, tokenizer_fingerprint

    loc = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(loc, cfg.target)
    rng = np.random.default_rng(seed)
    stage = StageDir(cfg.run_dir, "tokenize")
    started = time.time()
    stage.begin("fake-tokenize", force=True)
    vocab = len(tok)
    total = 0
    for k in range(0, len(lengths), shard_rows):
        rows = []
        for j, n in enumerate(lengths[k : k + shard_rows]):
            ids = rng.integers(3, vocab, size=n).astype(np.int32)
            mask = np.zeros(n, np.uint8)
            mask[n // 2 :] = 1
            rows.append({"id": f"fake/{k + j}", "input_ids": ids.tolist(), "loss_mask": mask.tolist(),
                         "num_tokens": int(n), "num_loss_tokens": int(mask.sum())})
            total += n
        table = pa.Table.from_pylist(rows, schema=pa.schema([
            ("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
            ("num_tokens", pa.int32()), ("num_loss_tokens", pa.int32())]))
        path = stage.shard_path(f"{k // shard_rows:05d}", "parquet")
        pq.write_table(table, path)
        stage.finish_unit(f"{k // shard_rows:05d}", [path], written=len(rows))
    fp = {"target": target_fingerprint(loc, cfg.target), "tokenizer": tokenizer_fingerprint(tok),
          "enable_thinking": cfg.target.enable_thinking, "max_len": cfg.tokenize.max_len}
    fp.update(fingerprint_overrides or {})
    stage.write_manifest(config_hash="fake-tokenize", fingerprint=fp, started=started,
                         counts={"written": len(lengths), "tokens": int(total)})
    return stage


@pytest.fixture
def tokenize_stage():
    """tokenize_stage(cfg, lengths, **kw) -> StageDir of a fake, finished tokenize stage."""
    return write_tokenize_stage


@pytest.fixture(autouse=True)
def _one_torch_thread_for_every_extract_test(one_torch_thread):
    """Every extract test runs on one intra-op thread (see tests/conftest.py)."""
    yield


# A random target whose layers change the residual stream as much as a trained model's do (adjacent-layer
# cosine ~0.95, like SmolLM2): with the default init the x50 embeddings dominate and neighbouring layers
# are nearly identical (cosine > 0.9995), which would hide an off-by-one.
DISTINCT_LAYERS = "target.random_init={initializer_range: 0.2}"


def extract_config(tmp_path, *overrides):
    """configs/tiny.yaml under tmp_path with small extract batches/shards."""
    from tests.conftest import make_config

    return make_config(tmp_path, overrides=["extract.tokens_per_batch=600", "extract.shard_tokens=600",
                                            "extract.verify_samples=6", *overrides])
