"""Split extraction over N independent ranks (one GPU each, like a SLURM array), then one merge.

    W=/tmp/bench-multi-gpu-extract
    python benchmarks/bench_multi_gpu_extract.py prepare --work-dir $W --shape qwen3-8b --device cuda \\
        --tokens-per-rank 150000 --world-size 8
    for r in 0..7: CUDA_VISIBLE_DEVICES=$r RANK=$r WORLD_SIZE=8 python benchmarks/bench_multi_gpu_extract.py rank --work-dir $W &
    wait; python benchmarks/bench_multi_gpu_extract.py merge --work-dir $W --json out/extract.json

`prepare` writes a tokenize-stage directory of random token ids (benchmarks/bench_extract.py's lognormal length
mix and writer) and the settings every later step reads (settings.json), so all ranks plan the same units.
`rank` finds its rank the way `drafter extract` does (pipeline.stage_dir.rank_from_env: --rank flags, torchrun
RANK/WORLD_SIZE, SLURM_ARRAY_TASK_ID/COUNT, SLURM_PROCID/NTASKS), builds a random-init target of the named shape
on its device (bench_extract.build_target: weights do not change the speed), takes `units_for_rank` of the
stage's deterministic plan and runs the stage's own code (`extract.stage.extract_units` -> `extract.hf.HFExtractor`
-> `extract.store.ShardWriter`) into the ONE shared stage directory, timing only the extraction (after a
warm-up forward and a start barrier over the ranks, through files in the work dir: the ranks share no process
group, as array tasks do not). `merge` runs the stage's merge (`extract.stage._finalize`: every unit done,
accounting, index.parquet + manifest), then checks that the merged index holds every tokenized sample exactly once
and that the ranks' units were disjoint and covered the plan, and prints aggregate tokens/s =
(tokens of all ranks) / (last rank's end - first rank's start).

Only the target is synthetic; a `random:` target would have to be written to disk first (32 GB at the 8B
shape), which is why this script builds the model in memory and calls the stage's pieces instead of the CLI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

from benchmarks.bench_extract import SHAPES, build_target, length_mix, write_tokens  # noqa: E402

SETTINGS = "settings.json"


# ----------------------------------------------------------------------------------------------
# Shared by the three steps
# ----------------------------------------------------------------------------------------------


def target_dims(shape: str, cache_dir: str) -> tuple[int, int, int]:
    """(num_hidden_layers, hidden_size, vocab_size) of the named target shape, without building the model."""
    if SHAPES[shape] is not None:
        s = SHAPES[shape]
        return s["num_hidden_layers"], s["hidden_size"], s["vocab_size"]
    from transformers import AutoConfig

    from pipeline.config import TargetConfig
    from pipeline.target import materialize_target

    c = AutoConfig.from_pretrained(materialize_target(TargetConfig(model="random:qwen3"), cache_dir))
    return c.num_hidden_layers, c.hidden_size, c.vocab_size


def stage_config(s: dict, device: str = "cpu"):
    """The RunConfig of the benchmark run (runs_dir = the work dir, run name 'bench')."""
    from pipeline.config import load_config

    return load_config(None, [f"runs_dir={s['work_dir']}", "name=bench", f"cache_dir={s['cache_dir']}",
                              f"target.device={device}", "extract.backend=hf",
                              f"extract.storage_dtype={s['storage_dtype']}",
                              f"extract.tokens_per_batch={s['tokens_per_batch']}",
                              f"extract.shard_tokens={s['shard_tokens']}", f"extract.writer_threads={s['writer_threads']}",
                              f"extract.parallel_shards={s['parallel_shards']}"])


def plan(s: dict):
    """(cfg, ExtractContext, extract StageDir, TokenizedIndex, units): identical on every rank and in the merge."""
    from extract.layers import LAYER_CONVENTION, default_layer_ids
    from extract.inputs import ExtractContext, plan_units, read_tokenized_index, screen_index
    from pipeline.stage_dir import StageDir

    cfg = stage_config(s, s.get("device", "cpu"))
    layers, hidden, vocab = s["num_layers"], s["hidden_size"], s["vocab_size"]
    layer_ids = default_layer_ids(layers, s["taps"])
    fingerprint = {"target": {"bench": s["shape"]}, "layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION,
                   "hidden_size": hidden, "storage_dtype": s["storage_dtype"]}
    tok = StageDir(cfg.run_dir, "tokenize")
    ctx = ExtractContext(location=f"bench:{s['shape']}", layer_ids=layer_ids, tap_ids=list(layer_ids),
                         num_layers=layers, hidden_size=hidden, vocab_rows=vocab, fingerprint=fingerprint,
                         config_hash=f"bench-{s['shape']}-{s['storage_dtype']}", settings={}, tok_stage=tok)
    index = read_tokenized_index(tok)
    keep, _, _ = screen_index(index)
    units = plan_units(index.lengths, keep, s["shard_tokens"])
    return cfg, ctx, StageDir(cfg.run_dir, "extract"), index, units


def read_settings(work_dir: Path) -> dict:
    path = work_dir / SETTINGS
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `{Path(__file__).name} prepare --work-dir {work_dir}` first")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------
# prepare
# ----------------------------------------------------------------------------------------------


def prepare(a) -> dict:
    """Fresh work dir: tokenized input of `tokens_per_rank * world_size` tokens + settings.json."""
    from extract.store import bytes_per_token
    from pipeline.files import atomic_write_json

    work = Path(a.work_dir).resolve()
    shutil.rmtree(work / "bench", ignore_errors=True)
    for sub in ("ready", "failed", "timing"):
        shutil.rmtree(work / sub, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    gpu = a.device == "cuda"
    layers, hidden, vocab = target_dims(a.shape, a.cache_dir)
    total = a.tokens_per_rank * a.world_size
    bpt = bytes_per_token(a.taps, hidden, a.storage_dtype)
    free = shutil.disk_usage(work).free
    if total * bpt > 0.8 * free:
        raise SystemExit(f"{total:,} tokens x {bpt:,} B/token = {total * bpt / 1e9:.1f} GB does not fit in 80% of "
                         f"the {free / 1e9:.1f} GB free at {work}: lower --tokens-per-rank or use fp8")
    s = {"work_dir": str(work), "cache_dir": str(Path(a.cache_dir).resolve()), "shape": a.shape, "device": a.device,
         "world_size": a.world_size, "tokens_per_rank": a.tokens_per_rank, "taps": a.taps,
         "storage_dtype": a.storage_dtype, "num_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
         "tokens_per_batch": a.tokens_per_batch or (65536 if gpu else 4096),
         # 2 units per rank: both shards in flight at once (parallel_shards 2), equal work per rank
         "shard_tokens": a.shard_tokens or max(total // (2 * a.world_size), 1),
         "writer_threads": a.writer_threads, "parallel_shards": a.parallel_shards, "bytes_per_token": bpt,
         "barrier_timeout_s": a.barrier_timeout}
    lengths = length_mix(total, seed=a.seed, hi=a.max_len)
    started = time.time()
    tok = write_tokens(stage_config(s).run_dir, lengths, vocab, seed=a.seed)
    tok.write_manifest(config_hash=f"bench-tokens-{a.seed}", fingerprint={"target": {"bench": a.shape}},
                       counts={"written": len(lengths), "tokens": int(lengths.sum())}, started=started)
    atomic_write_json(work / SETTINGS, s)
    print(f"prepared {len(lengths):,} samples / {int(lengths.sum()):,} tokens ({a.shape}, {a.storage_dtype}, "
          f"{int(lengths.sum()) * bpt / 1e9:.1f} GB of features) for {a.world_size} ranks in {work}", flush=True)
    return s


# ----------------------------------------------------------------------------------------------
# rank
# ----------------------------------------------------------------------------------------------


def wait_for_all(work: Path, rank: int, world: int, timeout: float) -> None:
    """File barrier: announce this rank ready, return once all `world` ranks are (array tasks share no process
    group). Gives up when another rank has failed (work/failed/) or after `timeout` seconds."""
    from pipeline.files import atomic_write_text

    ready = work / "ready"
    atomic_write_text(ready / f"rank-{rank:05d}", str(time.time()))
    deadline = time.time() + timeout
    while len(list(ready.glob("rank-*"))) < world:
        failed = sorted(p.name for p in (work / "failed").glob("rank-*"))
        if failed:
            raise SystemExit(f"rank {rank}: giving up, {failed} failed")
        if time.time() > deadline:
            raise SystemExit(f"rank {rank}: only {len(list(ready.glob('rank-*')))} of {world} ranks became ready "
                             f"within {timeout:.0f} s")
        time.sleep(0.05)


def run_rank(a) -> dict:
    """Extract this rank's units into the shared stage dir; write timing/rank-XXXXX.json. Returns that record."""
    from extract.hf import HFExtractor, plan_batches
    from extract.inputs import read_samples
    from extract.stage import extract_units
    from pipeline.log import progress
    from pipeline.files import atomic_write_json
    from pipeline.stage_dir import rank_from_env, units_for_rank

    work = Path(a.work_dir).resolve()
    s = read_settings(work)
    ranks = rank_from_env(a.rank, a.world_size)
    if ranks.world_size != s["world_size"]:
        raise SystemExit(f"world size {ranks.world_size} from the environment, but prepared for {s['world_size']}")
    device = torch.device("cuda" if s["device"] == "cuda" else "cpu")  # CUDA_VISIBLE_DEVICES picks the GPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg, ctx, stage, index, units = plan(s)
    stage.begin(ctx.config_hash, ranks=ranks)  # every rank: same hash, keeps the others' work; a lock per rank
    mine = units_for_rank(units, ranks)
    todo = [u for u in mine if stage.unit_done(u.name) is None]

    t_load = time.time()
    model, desc = build_target(s["shape"], device, dtype, s["cache_dir"])
    backend = HFExtractor(ctx.location, cfg.target, cfg.extract, ctx.layer_ids, model=model, device=device)
    load_s = time.time() - t_load
    if todo:  # warm-up: the first (largest) batch of this rank's first unit, computed and dropped
        rows = np.asarray(todo[0].rows)
        data = read_samples(index, rows)
        lens = [len(data[int(r)][0]) for r in rows]
        a0, b0 = plan_batches(lens, s["tokens_per_batch"])[0]
        backend.features([data[int(r)][0] for r in rows[a0:b0]])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)

    wait_for_all(work, ranks.rank, ranks.world_size, s["barrier_timeout_s"])
    start = time.time()
    tokens = sum(u.tokens for u in todo)
    try:
        bar = progress(total=tokens, desc=f"extract rank {ranks.rank}", unit="tok")
        extract_units(stage, ctx, cfg, backend, index, todo, bar)  # returns after every shard is renamed + sidecar
        bar.close()
    finally:
        backend.close()
    end = time.time()
    record = {"rank": ranks.rank, "world_size": ranks.world_size, "target": desc,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "units": [u.name for u in mine],
              "units_done_now": len(todo), "tokens": tokens, "start": start, "end": end, "seconds": end - start,
              "tokens_per_s": tokens / max(end - start, 1e-9), "load_seconds": load_s,
              "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    # the stage's own per-rank summary (what run_extract writes) and this benchmark's timing
    atomic_write_json(stage.path / "ranks" / f"rank-{ranks.rank:05d}.json",
                      {"rank": ranks.rank, "world_size": ranks.world_size, "units": record["units"],
                       "tokens": int(sum(u.tokens for u in mine)), "seconds": round(end - start, 3)})
    atomic_write_json(work / "timing" / f"rank-{ranks.rank:05d}.json", record)
    print(f"rank {ranks.rank}/{ranks.world_size} ({record['device']}, CUDA_VISIBLE_DEVICES="
          f"{record['cuda_visible_devices']}): {len(todo)} units, {tokens:,} tokens in {end - start:.2f} s = "
          f"{record['tokens_per_s']:,.0f} tok/s", flush=True)
    return record


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------


def merge(a) -> dict:
    """The stage's merge, the exactly-once check of the merged index, aggregate tokens/s. Returns the result."""
    from extract.stage import _finalize
    from extract.store import FeatureReader, check_store

    work = Path(a.work_dir).resolve()
    s = read_settings(work)
    cfg, ctx, stage, index, units = plan(s)
    timing = [json.loads(p.read_text()) for p in sorted((work / "timing").glob("rank-*.json"))]
    t = time.time()
    manifest = _finalize(cfg, ctx, stage, index, units, min([t] + [r["start"] for r in timing]))
    merge_s = time.time() - t

    reader = FeatureReader(stage.path)
    counts = collections.Counter(reader.ids)
    expected = collections.Counter(index.ids)
    dup = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(expected) - set(counts))
    extra = sorted(set(counts) - set(expected))
    owners = collections.Counter(u for r in timing for u in r["units"])
    unit_names = {u.name for u in units}
    ranks_disjoint = all(n == 1 for n in owners.values()) and set(owners) == unit_names
    first = reader.sample(0)
    problems = check_store(stage.path, full=False)  # sizes and headers of every shard + index (no re-hash)
    exactly_once = not dup and not missing and not extra and len(reader) == len(index.ids)
    tokens = sum(r["tokens"] for r in timing)
    span = max(r["end"] for r in timing) - min(r["start"] for r in timing) if timing else float("nan")
    res = {
        "shape": s["shape"], "storage_dtype": s["storage_dtype"], "world_size": s["world_size"],
        "ranks_reported": len(timing), "devices": [r["device"] for r in timing],
        "samples": len(index.ids), "samples_in_index": len(reader), "units": len(units),
        "tokens": tokens, "manifest_tokens": manifest["counts"]["tokens"], "span_seconds": span,
        "aggregate_tokens_per_s": tokens / span if span > 0 else None,
        "per_rank_tokens_per_s": [r["tokens_per_s"] for r in timing],
        "per_rank_seconds": [r["seconds"] for r in timing], "load_seconds": [r["load_seconds"] for r in timing],
        "peak_gpu_gib": [r["peak_gpu_gib"] for r in timing], "merge_seconds": merge_s,
        "bytes": manifest["total_bytes"], "write_Bps": manifest["total_bytes"] / span if span > 0 else None,
        "duplicates": dup[:5], "missing": missing[:5], "unexpected": extra[:5],
        "exactly_once": exactly_once, "ranks_disjoint_and_cover": ranks_disjoint,
        "features_finite": bool(torch.isfinite(first["features"].float()).all()), "file_problems": [f"{p}: {why}" for p, why in problems.items()][:5],
    }
    res["passed"] = bool(exactly_once and ranks_disjoint and res["features_finite"] and not problems
                         and len(timing) == s["world_size"] and tokens == manifest["counts"]["tokens"])
    print(format_result(res), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    if not a.keep:
        shutil.rmtree(stage.shards, ignore_errors=True)  # the features are large; the index and manifest stay
    return res


def format_result(r: dict) -> str:
    rows = [
        ("ranks", f"{r['ranks_reported']} of {r['world_size']} reported ({', '.join(sorted(set(r['devices'])))})"),
        ("samples / units", f"{r['samples']:,} samples, {r['units']} units, {r['tokens']:,} tokens "
                            f"({r['storage_dtype']}, {r['bytes'] / 1e9:.2f} GB)"),
        ("per-rank tok/s", ", ".join(f"{x:,.0f}" for x in r["per_rank_tokens_per_s"])),
        ("per-rank seconds", ", ".join(f"{x:.2f}" for x in r["per_rank_seconds"])),
        ("AGGREGATE tok/s", f"{r['aggregate_tokens_per_s']:,.0f} (over {r['span_seconds']:.2f} s, writes "
                            f"{(r['write_Bps'] or 0) / 1e9:.2f} GB/s)"),
        ("merge (index + manifest)", f"{r['merge_seconds']:.2f} s"),
        ("merged index: every sample once", "yes" if r["exactly_once"] else
         f"NO (duplicates {r['duplicates']}, missing {r['missing']}, unexpected {r['unexpected']})"),
        ("rank slices disjoint, cover plan", "yes" if r["ranks_disjoint_and_cover"] else "NO"),
        ("files match manifest sizes", "yes" if not r["file_problems"] else f"NO {r['file_problems']}"),
        ("result", "PASS" if r["passed"] else "FAIL"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join([f"split extraction, {r['shape']} target, {r['world_size']} ranks", "-" * (w + 50)]
                     + [f"{k:<{w}}  {v}" for k, v in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the tokenized input and settings.json (fresh work dir)")
    pr = sub.add_parser("rank", help="extract this rank's units (rank/world from flags or the environment)")
    pm = sub.add_parser("merge", help="merge, check exactly-once coverage, print aggregate tokens/s")
    for q in (pp, pr, pm):
        q.add_argument("--work-dir", required=True, help="stage dirs + shards (local disk; NOT the results dir)")
    pp.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    pp.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    pp.add_argument("--world-size", type=int, required=True)
    pp.add_argument("--tokens-per-rank", type=int, default=20000)
    pp.add_argument("--max-len", type=int, default=4096, help="longest sample")
    pp.add_argument("--taps", type=int, default=5)
    pp.add_argument("--storage-dtype", choices=["bfloat16", "fp8", "float32"], default="bfloat16")
    pp.add_argument("--tokens-per-batch", type=int, default=None, help="default: 65536 on cuda, 4096 on cpu")
    pp.add_argument("--shard-tokens", type=int, default=None, help="default: total / (2 x world size)")
    pp.add_argument("--writer-threads", type=int, default=8)
    pp.add_argument("--parallel-shards", type=int, default=2)
    pp.add_argument("--barrier-timeout", type=float, default=600.0, help="seconds a rank waits for the others")
    pp.add_argument("--cache-dir", default=".cache")
    pp.add_argument("--seed", type=int, default=0)
    pr.add_argument("--rank", type=int, default=None, help="default: from the environment")
    pr.add_argument("--world-size", type=int, default=None, help="default: from the environment")
    pm.add_argument("--json", default=None, help="also write the result here")
    pm.add_argument("--keep", action="store_true", help="keep the feature shards (default: delete after checking)")
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a)
        return 0
    if a.cmd == "rank":
        try:
            run_rank(a)
        except BaseException as e:  # tell the ranks waiting at the start barrier
            from pipeline.files import atomic_write_text
            from pipeline.stage_dir import rank_from_env

            try:
                r = rank_from_env(a.rank, a.world_size).rank
            except Exception:  # noqa: BLE001 — the rank itself is what failed
                r = os.getpid()
            atomic_write_text(Path(a.work_dir) / "failed" / f"rank-{r:05d}", repr(e)[:2000])
            raise
        return 0
    return 0 if merge(a)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
