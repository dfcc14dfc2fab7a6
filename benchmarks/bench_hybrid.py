"""A Gated-DeltaNet hybrid target on one GPU: the DDTree round (tree-aware vs path-batched verify), the AR step and
extraction, with an attention target of the Qwen3-8B shape timed in the same run as the reference point.

What runs is the project's own code on random-init targets of the real shapes (weights do not change the speed),
initialised directly on the device in the compute dtype:

  hybrid     `--shape qwen3.6-27b`: Qwen3.5/3.6-27B text shape (64 layers, hidden 5120, MLP 17408, vocab 248320;
             every 4th layer full attention: 24 query heads, 4 KV heads, head dim 256, gated output, partial RoPE
             0.25; 48 Gated-DeltaNet layers: 16 q/k heads, 48 value heads, d_k = d_v = 128, conv 4), ~26.9B
             parameters (~54 GB in bf16)
  reference  `qwen3-8b` (benchmarks/bench_eval_overhead.py's shape), after the hybrid is freed

Hybrid, with `--past` committed rows (a prefill of that many tokens), taps = 5 layers (extract.layers default):
  ar_step_ms              decode('ar') wall time per round (HF's one-token step, fla's recurrent kernel)
  chain_verify_ms         the verify forward over a 16-row chain (root + 15 drafted), the default hybrid cache
  tree_verify_ms[b]       the tree-aware verify (eval/engine/cache/hybrid.py HybridTargetCache) of the budget-b tree
  path_batched_verify_ms  the same tree path by path (PathBatchedTargetCache, the reference); skipped with a
                          recorded reason when its replicated cache would not fit in free GPU memory
  overhead_ms[b]          build + walk + the one read + commit (K/V compaction and every Gated-DeltaNet layer's
                          state along a deepest, non-contiguous path) + context gather, in ONE timed region; with
                          --cache static/graphs the commit and gather run inside the walk (its CUDA graph), whose
                          logits are then forced to accept that path
  host_syncs_per_round    1 (the read) + any other sync of a full round (build, verify, walk, commit) seen under
                          torch.cuda.set_sync_debug_mode("warn"); null off CUDA
  gdn_walk_ms[b]          breakdown: the Triton tree conv + walk of all Gated-DeltaNet layers alone (random rows)
  extract_tok_s[dtype]    the extract stage end to end (benchmarks/bench_extract.py run_pipeline: parquet in,
                          batches, forward to the deepest tap, D2H, writes + fsync) for bf16 and fp8 features
  extract_ceiling_tok_s   min(compute roofline, disk ceiling), both measured in this run (bench_extract's
                          matmul rate / FLOPs per token, and parallel pwrite + fsync bandwidth / bytes per token)
Reference (`reference_8b`): chain_verify_ms and tree_verify_ms[256] on the decoder's default path (static KV,
fused forward, CUDA graphs on GPU).

Trees come from `--draft two-way` logits (two likely tokens per depth: every depth of the tree is filled, budget 256
is 8 levels deep with ~129 root->leaf paths; bench_eval_overhead.py `two_way_draft`) or `--draft peaked` (one likely
token per depth and a flat tail: a deep spine with wide shallow fans, fewer paths).

    python benchmarks/bench_hybrid.py --device cuda --shape qwen3.6-27b --out $OUT     (H200: ~5-6 min, ~85 GB)
    python benchmarks/bench_hybrid.py --device cpu --shape tiny --out /tmp/bench-hybrid

Prints a table and writes `summary.json` (the keys of docs/results/hybrid-h200/summary.json, medians in ms,
tokens/s) under --out after every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_eval_overhead import SHAPES as ATTENTION_SHAPES  # noqa: E402
from benchmarks.bench_eval_overhead import deepest_path, two_way_draft  # noqa: E402
from benchmarks.bench_extract import (disk_bandwidth, flops_per_token, length_mix, make_backend,  # noqa: E402
                                      matmul_rate, run_pipeline)
from eval.engine.decode import decode, round_ops, warm_up  # noqa: E402
from eval.engine.cache.hybrid import HybridTargetCache, PathBatchedTargetCache  # noqa: E402
from eval.engine.cache.factory import target_cache  # noqa: E402
from eval.engine.tree import chain_tree  # noqa: E402
from eval.engine.tree_recurrent import tree_walk  # noqa: E402
from extract.layers import default_layer_ids  # noqa: E402
from extract.store import bytes_per_token  # noqa: E402
from pipeline.cuda_graphs import host_syncs  # noqa: E402
from pipeline.target import gated_delta_kernels  # noqa: E402

HYBRID_SHAPES = {
    # Qwen3.5/3.6-27B text config (HF config.json of Qwen/Qwen3.5-27B; the same numbers in slime's qwen3.5-27B model
    # script): 24 heads x 256 with 4 KV heads, gated attention output, partial rotary 0.25, mrope [11, 11, 10]
    "qwen3.6-27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, vocab_size=248320,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
    # pipeline/target.py RANDOM_DEFAULTS["qwen3_5_text"] with a larger vocabulary
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, vocab_size=320, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False),
}
REFERENCE = {"qwen3.6-27b": "qwen3-8b", "tiny": "tiny"}
CHAIN_ROWS = 16  # root + 15 drafted (block size 16)


def hybrid_config(shape: str):
    """The HF config of a hybrid shape: one full-attention layer in four (layers 3, 7, ...)."""
    from transformers import AutoConfig

    spec = dict(HYBRID_SHAPES[shape])
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return AutoConfig.for_model("qwen3_5_text", max_position_embeddings=40960,
                                layer_types=types * (spec["num_hidden_layers"] // 4), **spec)


def random_model(config, device, dtype):
    """A random-init causal LM built directly on `device` in `dtype` (no CPU copy of the weights), its kernels bound
    as `load_target` binds a stage's (a hybrid's short convolutions on fla's Triton kernel on CUDA)."""
    from transformers import AutoModelForCausalLM

    from pipeline.target import bind_kernels

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    bind_kernels(model, device, f"random {config.model_type}")
    return model.eval().requires_grad_(False)


def attention_model(shape: str, device, dtype):
    from transformers import AutoConfig

    spec = dict(ATTENTION_SHAPES[shape])
    return random_model(AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=40960, **spec),
                        device, dtype)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(device, fn, iters: int, warm: int = 1, after=None) -> float:
    """Median wall ms of fn() between two syncs; `after()` (untimed) runs after each call."""
    times = []
    for it in range(warm + iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if it >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            after()
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# Caches: a prefilled state every timed step returns to
# ----------------------------------------------------------------------------------------------


class Rewind:
    """Snapshot of a prefilled cache (length, Gated-DeltaNet states); `()` restores it: K/V rows past the prefill
    are dropped (dynamic) or forgotten (static length), the states copied back."""

    def __init__(self, cache):
        self.cache, self.past = cache, cache.length
        self.states = [t.clone() for t in (getattr(cache, "conv_states", None), getattr(cache, "recurrent_states", None))
                       if t is not None]

    def __call__(self) -> None:
        cache = self.cache
        hybrid = isinstance(cache, HybridTargetCache)
        if getattr(cache, "static", False):
            cache._set_length(self.past)
            if hybrid:
                for live, saved in zip((cache.conv_states, cache.recurrent_states), self.states):
                    live.copy_(saved)
                cache._records = None
            return
        for layer in cache.cache.layers if hybrid else cache.dynamic.layers:
            if getattr(layer, "keys", None) is not None:
                layer.keys, layer.values = layer.keys[:, :, : self.past], layer.values[:, :, : self.past]
        if not hybrid:
            cache._set_length(self.past)
            return
        for live, saved in zip((cache.conv_states, cache.recurrent_states), self.states):
            live.copy_(saved)
        cache.length, cache._rows = self.past, None


def prefilled(cache, prompt, capacity: int) -> Rewind:
    cache.reset(capacity)
    cache.prefill(prompt)
    return Rewind(cache)


def draft_logits(kind: str, L: int, vocab: int, device, dtype) -> torch.Tensor:
    if kind == "two-way":
        return two_way_draft(L, vocab, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)  # "peaked": one likely token per depth, a flat tail
    logits = torch.randn(L, vocab, generator=gen, device=device)
    logits[torch.arange(L, device=device), torch.randint(0, vocab, (L,), generator=gen, device=device)] += 12.0
    return logits.to(dtype)


def leaves(tree) -> int:
    parents = tree.parents.tolist()
    return tree.size - len(set(parents[1:]))


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


def verify_section(target, args, device, dtype, res: dict, save) -> None:
    L, vocab = CHAIN_ROWS - 1, target.get_output_embeddings().weight.shape[0]
    taps = tuple(default_layer_ids(target.config.num_hidden_layers, 5 if args.shape != "tiny" else 3))
    prompt = torch.randint(0, vocab - 1, (args.past,), generator=torch.Generator().manual_seed(0)).to(device)
    capacity = args.past + max(args.budgets) + CHAIN_ROWS + 1
    res["gated_delta_kernels"] = gated_delta_kernels(target)

    impl = args.cache
    warm_up("ar", target, None, max_length=args.past + args.ar_tokens + 1, cache_impl=impl)
    ar = decode("ar", target, None, prompt.tolist(), max_new_tokens=4, phase_timing=False,
                cache_impl=impl)  # warm-up (kernels)
    ar = decode("ar", target, None, prompt.tolist(), max_new_tokens=args.ar_tokens, phase_timing=False,
                cache_impl=impl)
    res["ar_step_ms"] = ar.timings["decode"] / max(ar.num_rounds, 1) * 1e3
    res["verify_path"] = ar.verify_path
    print(f"AR step: {res['ar_step_ms']:.3f} ms/round ({ar.verify_path})", flush=True)

    fast = HybridTargetCache(target, taps, static=impl in ("static", "graphs"), graphs=impl == "graphs")
    res["hybrid_cache"] = impl
    rewind_fast = prefilled(fast, prompt, capacity)
    bonus = torch.tensor([7], device=device)
    logits = draft_logits(args.draft, L, vocab, device, dtype)
    chain = chain_tree(logits, bonus)
    vin = fast.verify_inputs(chain)
    res["chain_verify_ms"] = median_ms(device, lambda: fast.verify(chain, vin), args.iters, after=rewind_fast)
    print(f"chain verify ({CHAIN_ROWS} rows): {res['chain_verify_ms']:.3f} ms", flush=True)
    save()

    ref = PathBatchedTargetCache(target, taps)
    rewind_ref = prefilled(ref, prompt, capacity)
    for key in ("tree_verify_ms", "path_batched_verify_ms", "overhead_ms", "gdn_walk_ms", "tree_shape"):
        res.setdefault(key, {})
    for budget in args.budgets:
        ops = round_ops("ddtree", budget, "device", fast, 0.0, L, vocab, device)
        tree, vin, anc = ops.build(logits, bonus)
        b = str(budget)
        path = deepest_path(tree)
        res["tree_shape"][b] = {"nodes": tree.size, "depth": int(tree.depths.max()), "paths": leaves(tree),
                                "accepted_path": len(path)}
        res["tree_verify_ms"][b] = median_ms(device, lambda: fast.verify(tree, vin), args.iters, after=rewind_fast)
        res["overhead_ms"][b], syncs, sites = overhead(fast, ops, tree, vin, logits, bonus, path, L, device,
                                                       args.iters, rewind_fast)
        res.setdefault("host_syncs_by_budget", {})[b] = syncs
        res.setdefault("sync_sites", {})[b] = sites
        if budget == max(args.budgets):
            res["host_syncs_per_round"] = syncs
            if args.profile_overhead:
                res["overhead_profile"] = profile_overhead(fast, ops, tree, vin, logits, bonus, path, L,
                                                           rewind_fast)
        res["gdn_walk_ms"][b] = gdn_walk(fast, tree, device, args.iters)
        res["path_batched_verify_ms"][b] = path_batched(ref, tree, rewind_ref, device, args, res)
        pb = res["path_batched_verify_ms"][b]
        print(f"budget {budget:>4}: N {tree.size:>4} depth {res['tree_shape'][b]['depth']:>2} paths "
              f"{res['tree_shape'][b]['paths']:>4} | tree-aware {res['tree_verify_ms'][b]:8.3f} ms | path-batched "
              f"{pb if pb is None else f'{pb:8.3f} ms'} | overhead {res['overhead_ms'][b]:.3f} ms | "
              f"GDN walk {res['gdn_walk_ms'][b]:.3f} ms | syncs {syncs}", flush=True)
        save()
    del fast, ref
    gc.collect()


def round_tail(cache, ops, logits, bonus, out, path_t, n: int, forced=None) -> None:
    """What a round does after its verify forward `out`: build (the next tree's), walk, the one read, commit of
    the first `n` nodes of `path_t` (not contiguous) and the context gather of their features. A cache that commits
    on the device (the static hybrid cache: `ops.compacts`) commits and gathers inside the walk, as the decoder
    does (inside the walk's graph under --cache graphs): the walk then gets `forced` logits whose choices accept
    exactly path_t[:n] (`forced_logits`), so it commits the same work as the eager commit of the other caches."""
    tree, _, anc = ops.build(logits, bonus)
    if ops.compacts:
        _, record, _ = ops.walk(tree, anc, forced, None, out.features)
        accepted = ops.read(record).accepted
        assert accepted + 1 == n, f"the forced walk accepted {accepted + 1} nodes, not the path's {n}"
        cache.commit_compacted(n)
        return
    walk, record, _ = ops.walk(tree, anc, out.logits, None, out.features)
    ops.read(record)
    cache.commit(path_t, n, contiguous=False)
    out.features.index_select(0, path_t)


def forced_logits(logits, tree, path: list[int]):
    """Logits [N, V] like `logits` whose greedy choice at path[d] is the token of path[d+1]: the walk accepts exactly
    `path` (siblings carry distinct tokens), and the token after its last node."""
    forced = torch.zeros_like(logits)
    tokens = tree.tokens.tolist()
    for a, b in zip(path, path[1:]):
        forced[a, tokens[b]] = 1.0
    return forced


def overhead(cache, ops, tree, vin, logits, bonus, path, L, device, iters, rewind) -> tuple[float, int | None, list]:
    """(median ms of build + walk + read + commit of `path` + context gather in one timed region, host syncs of a
    full round, where the extra ones were issued). The verify before each region is untimed; the commit takes the
    deepest path, not contiguous."""
    path_t = torch.tensor(path + [0] * (L + 1 - len(path)), device=device)
    times, forced = [], None
    for it in range(iters + 1):
        out = cache.verify(tree, vin)
        if forced is None and ops.compacts:
            forced = forced_logits(out.logits, tree, path)
        sync(device)
        t0 = time.perf_counter()
        round_tail(cache, ops, logits, bonus, out, path_t, len(path), forced)
        sync(device)
        if it:
            times.append((time.perf_counter() - t0) * 1e3)
        rewind()
    return (statistics.median(times),) + count_syncs(cache, ops, logits, bonus, path_t, len(path), device, rewind,
                                                     forced)


def profile_overhead(cache, ops, tree, vin, logits, bonus, path, L, rewind, top: int = 15) -> dict:
    """Where the overhead region's time goes: torch.profiler around 5 regions (after 2 unprofiled; each region's
    verify runs outside the profiler), the top `top` operators by self device time and by self host time, per
    region, the region's host time and its kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    device = logits.device
    path_t = torch.tensor(path + [0] * (L + 1 - len(path)), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dev = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    totals: dict[str, list] = {}  # key -> [calls, self device us, self host us, kernel?]
    n, host_us, forced = 5, [], None
    for it in range(2 + n):
        out = cache.verify(tree, vin)
        if forced is None and ops.compacts:
            forced = forced_logits(out.logits, tree, path)
        sync(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            round_tail(cache, ops, logits, bonus, out, path_t, len(path), forced)
            sync(device)
            wall = (time.perf_counter() - t0) * 1e6
        rewind()
        if it < 2:
            continue
        host_us.append(wall)
        for e in prof.key_averages():
            row = totals.setdefault(e.key, [0, 0.0, 0.0, False])
            row[0] += e.count
            row[1] += dev(e)
            row[2] += e.self_cpu_time_total
            row[3] = row[3] or e.device_type.name == "CUDA"

    def rows(col: int) -> list:
        ranked = sorted(totals.items(), key=lambda kv: kv[1][col], reverse=True)[:top]
        return [{"name": k[:90], "calls": c // n, "self_device_us": d / n, "self_host_us": h / n}
                for k, (c, d, h, _) in ranked]

    result = {"regions": n, "by_device": rows(1), "by_host": rows(2),
              "region_wall_us_profiled": statistics.median(host_us),
              "kernels_per_region": sum(c for c, d, h, kern in totals.values() if kern) / n}
    print(f"overhead profile (per region, under the profiler): wall {result['region_wall_us_profiled']:.0f} us, "
          f"{result['kernels_per_region']:.0f} kernels", flush=True)
    for r in result["by_device"]:
        print(f"  dev {r['self_device_us']:8.1f} us  host {r['self_host_us']:8.1f} us  x{r['calls']:<4} {r['name']}")
    print("  by host time:")
    for r in result["by_host"]:
        print(f"  host {r['self_host_us']:8.1f} us  dev {r['self_device_us']:8.1f} us  x{r['calls']:<4} {r['name']}")
    return result


def count_syncs(cache, ops, logits, bonus, path_t, n, device, rewind, forced=None) -> tuple[int | None, list]:
    """(1 (the round's read) + every sync torch reports in the rest of a full round, where each extra one was
    issued); (None, []) off CUDA."""
    if device.type != "cuda":
        return None, []

    def before_read():
        tree, vin, anc = ops.build(logits, bonus)
        out = cache.verify(tree, vin)
        return out, ops.walk(tree, anc, out.logits if forced is None else forced, None, out.features)[1]

    synced, (out, record) = host_syncs(before_read)
    accepted = ops.read(record).accepted  # the round's one read, not counted

    def after_read():
        if ops.compacts:  # committed inside the walk
            cache.commit_compacted(accepted + 1)
            return
        cache.commit(path_t, n, contiguous=False)
        out.features.index_select(0, path_t)

    synced += host_syncs(after_read)[0]
    rewind()
    root = str(Path(__file__).resolve().parent.parent) + "/"
    return 1 + len(synced), [site.replace(root, "") for site in synced]


def gdn_walk(cache, tree, device, iters) -> float:
    """Median ms of the tree conv + walk of every Gated-DeltaNet layer on random rows of the layer's shape (what
    the tree-aware verify adds over a plain forward; the Triton kernels on CUDA, torch on CPU)."""
    from eval.engine import tree_recurrent, tree_recurrent_triton

    layer = cache.linear[0][1]
    HK, HV, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(tree.size, layer.conv_dim, generator=gen, device=device).to(layer.in_proj_qkv.weight.dtype)
    g = -torch.rand(tree.size, HV, generator=gen, device=device)
    beta = torch.rand(tree.size, HV, generator=gen, device=device)
    weight = layer.conv1d.weight.squeeze(1)
    walk = tree_walk(tree, layer)
    kernels = tree_recurrent if walk is None else tree_recurrent_triton
    extra = () if walk is None else (walk[0], tree.depth_limit, walk[1])

    def all_layers():
        for conv_state, state in zip(cache.conv_states, cache.recurrent_states):
            u = kernels.tree_causal_conv1d(x, conv_state, weight, tree.parents, tree.depths)
            q, k, v = (t.unflatten(1, s) for t, s in zip(u.split([HK * dk, HK * dk, HV * dv], 1),
                                                         [(HK, dk), (HK, dk), (HV, dv)]))
            kernels.tree_gated_delta_rule(q, k, v, g, beta, tree.parents, tree.depths, state, *extra)

    return median_ms(device, all_layers, iters)


def path_batched(ref, tree, rewind, device, args, res) -> float | None:
    """Median ms of the reference verify, or None with the reason in res['path_batched_skipped'] when its
    replicated cache (every K/V row and state once per root->leaf path) would not fit in free GPU memory."""
    paths = leaves(tree)
    per_path = sum(t.numel() * t.element_size() for layer in ref.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
    per_path += sum(t.numel() * t.element_size() for t in (ref.conv_states, ref.recurrent_states))
    need = paths * per_path
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > args.path_batched_memory * free:
            res.setdefault("path_batched_skipped", {})[str(tree.size - 1)] = (
                f"{paths} paths x {per_path / 2**20:.0f} MiB of replicated cache = {need / 2**30:.1f} GiB > "
                f"{args.path_batched_memory:.0%} of {free / 2**30:.1f} GiB free")
            return None
    vin = ref.verify_inputs(tree)
    try:
        return median_ms(device, lambda: ref.verify(tree, vin), max(2, args.iters // 3), after=rewind)
    except torch.OutOfMemoryError as exc:
        res.setdefault("path_batched_skipped", {})[str(tree.size - 1)] = f"out of memory: {exc}"[:300]
        gc.collect()
        torch.cuda.empty_cache()
        return None


def extract_section(target, args, device, res: dict, save) -> None:
    """The extract stage on this target, bf16 and fp8 features, against both ceilings measured here. Shards go to
    --work-dir (removed afterwards), never under --out."""
    out_dir = Path(args.work_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm, mm_desc = matmul_rate(device, dtype)
    disk = disk_bandwidth(out_dir / "disk-probe.bin", args.disk_bytes, args.writer_threads)
    cfg = target.config
    layer_ids = default_layer_ids(cfg.num_hidden_layers, 5 if args.shape != "tiny" else 3)
    lengths = length_mix(args.extract_tokens)
    ctx_mean = float((lengths * (lengths + 1) / 2).sum() / lengths.sum())
    roofline = mm / flops_per_token(target, layer_ids, ctx_mean)
    res.update(matmul_tflops=mm / 1e12, matmul=mm_desc, disk_write_GBps=disk / 1e9, compute_roofline_tok_s=roofline,
               extract_tok_s={}, extract_ceiling_tok_s={}, extract_disk_ceiling_tok_s={})
    def run(storage: str, where: Path):
        """bench_extract's stage path (hf backend, the extractor the stage builds) for `storage` features."""
        bargs = SimpleNamespace(storage_dtype=storage, tokens_per_batch=args.tokens_per_batch,
                                shard_tokens=max(args.extract_tokens // 4, 1), writer_threads=args.writer_threads,
                                staging_buffers=4, parallel_shards=2, compile=args.extract_compile, backend="hf",
                                out_dir=str(where), model_dir=None, gpu_memory_utilization=0.85, eager=False)
        backend = make_backend(bargs, target, device, layer_ids, lengths, storage)
        return run_pipeline(bargs, target, device, layer_ids, where, lengths, backend, storage)

    if args.extract_warmup:  # untimed, over the timed runs' own batches: fla's Triton kernels compile and autotune
        # per sequence shape (docs/benchmarks.md, "hybrid": a warm-up over other lengths left the first timed run
        # compile-bound)
        run("bfloat16", out_dir / "warmup")
        shutil.rmtree(out_dir / "warmup", ignore_errors=True)
    res["extract_warmup"] = "the timed lengths" if args.extract_warmup else None
    res["extract_compile"] = args.extract_compile
    for storage, key in (("bfloat16", "bf16"), ("fp8", "fp8")):
        seconds, tokens, _, _, _ = run(storage, out_dir / key)
        shutil.rmtree(out_dir / key, ignore_errors=True)
        disk_ceiling = disk / bytes_per_token(len(layer_ids), cfg.hidden_size, storage)
        res["extract_tok_s"][key] = tokens / seconds
        res["extract_disk_ceiling_tok_s"][key] = disk_ceiling
        res["extract_ceiling_tok_s"][key] = min(roofline, disk_ceiling)
        print(f"extract {key}: {tokens / seconds:,.0f} tok/s (compute roofline {roofline:,.0f}, disk ceiling "
              f"{disk_ceiling:,.0f}; {100 * tokens / seconds / min(roofline, disk_ceiling):.0f}% of the lower)",
              flush=True)
        save()
    if args.profile_extract:
        res["extract_forward_profile"] = profile_forward(target, min(4096, args.tokens_per_batch), device)
        save()


# Kernel / operator name fragments -> what part of a hybrid's forward it is (first match wins; lower case).
FORWARD_PARTS = (("attention", ("flash", "fmha", "sdpa", "attention")),
                 ("gated delta rule", ("gated_delta", "chunk", "recurrent", "kkt", "solve_tril", "wy_")),
                 ("short convolution", ("conv",)),
                 ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")))


def forward_part(name: str) -> str:
    """Which part of a hybrid's forward the kernel (or CPU operator) `name` belongs to (FORWARD_PARTS), else
    'other' (norms, pointwise, copies)."""
    low = name.lower()
    return next((part for part, keys in FORWARD_PARTS if any(k in low for k in keys)), "other")


def profile_forward(target, tokens: int, device, top: int = 12) -> dict:
    """Where the target's forward over one sequence of `tokens` tokens goes (the extraction's forward, eager, after
    one untimed run): torch.profiler's kernels (CPU operators on a CPU) by self time, summed per part of the forward
    (`forward_part`), beside the forward's wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    vocab = target.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        target(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            target(input_ids=ids, use_cache=False, logits_to_keep=1)
            sync(device)
            wall_ms = 1e3 * (time.perf_counter() - t0)
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or 0) if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type.name == "CUDA"):
            rows.append({"name": e.key[:100], "calls": e.count, "ms": us / 1e3, "part": forward_part(e.key)})
    rows.sort(key=lambda r: -r["ms"])
    parts: dict[str, float] = {}
    for r in rows:
        parts[r["part"]] = parts.get(r["part"], 0.0) + r["ms"]
    total = sum(parts.values())
    result = {"tokens": tokens, "wall_ms": wall_ms, "kernel_ms": total,
              "by_part_ms": dict(sorted(parts.items(), key=lambda kv: -kv[1])), "top": rows[:top]}
    print(f"forward profile, {tokens} tokens: wall {wall_ms:.1f} ms, {'kernels' if cuda else 'CPU ops'} "
          f"{total:.1f} ms: " + ", ".join(f"{p} {ms:.1f} ms ({ms / max(total, 1e-9):.0%})"
                                         for p, ms in result["by_part_ms"].items()), flush=True)
    for r in result["top"]:
        print(f"  {r['ms']:8.2f} ms x{r['calls']:<5} [{r['part']}] {r['name']}")
    return result


def reference_section(args, device, dtype, res: dict, save) -> None:
    """The attention target on the decoder's default cache: chain verify and the largest budget's tree verify."""
    target = attention_model(REFERENCE[args.shape], device, dtype)
    vocab = target.get_output_embeddings().weight.shape[0]
    taps = tuple(default_layer_ids(target.config.num_hidden_layers, 5 if args.shape != "tiny" else 3))
    prompt = torch.randint(0, vocab - 1, (args.past,), generator=torch.Generator().manual_seed(0)).to(device)
    budget = max(args.budgets)
    cache = target_cache(target, taps, "auto")
    rewind = prefilled(cache, prompt, args.past + budget + CHAIN_ROWS + 1)
    logits = draft_logits(args.draft, CHAIN_ROWS - 1, vocab, device, dtype)
    bonus = torch.tensor([7], device=device)
    out = res["reference_8b"] = {"shape": REFERENCE[args.shape], "verify_path": None, "tree_verify_ms": {}}
    for method, b in (("chain", None), ("ddtree", budget)):
        ops = round_ops(method, b, "device", cache, 0.0, CHAIN_ROWS - 1, vocab, device)
        tree, vin, _ = ops.build(logits, bonus)
        ms = median_ms(device, lambda: cache.verify(tree, vin), args.iters, warm=3, after=rewind)
        if method == "chain":
            out["chain_verify_ms"] = ms
        else:
            out["tree_verify_ms"][str(b)] = ms
    out["verify_path"] = cache.describe()
    print(f"reference {REFERENCE[args.shape]}: chain verify {out['chain_verify_ms']:.3f} ms, tree verify @{budget} "
          f"{out['tree_verify_ms'][str(budget)]:.3f} ms ({out['verify_path']})", flush=True)
    save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(HYBRID_SHAPES), default="qwen3.6-27b")
    ap.add_argument("--out", default="bench_hybrid_out", help="where summary.json is written")
    ap.add_argument("--work-dir", default="/tmp/bench-hybrid-extract", help="extraction shards (local disk; removed)")
    ap.add_argument("--past", type=int, default=1024, help="committed rows during the verify")
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ar-tokens", type=int, default=16, help="tokens of the timed AR decode")
    ap.add_argument("--draft", choices=["two-way", "peaked"], default="two-way")
    ap.add_argument("--path-batched-memory", type=float, default=0.8,
                    help="skip the path-batched verify when its replicated cache exceeds this share of free memory")
    ap.add_argument("--extract-tokens", type=int, default=None, help="tokens per extraction run (default 150K GPU)")
    ap.add_argument("--no-extract-warmup", dest="extract_warmup", action="store_false",
                    help="skip the untimed extraction over the timed runs' lengths (first compilations) before them")
    ap.add_argument("--extract-compile", choices=["auto", "on", "off"], default="auto",
                    help="extract.compile of the timed extraction runs")
    ap.add_argument("--tokens-per-batch", type=int, default=None)
    ap.add_argument("--writer-threads", type=int, default=8)
    ap.add_argument("--disk-bytes", type=int, default=None, help="disk probe bytes (default 2 GiB GPU, 64 MiB CPU)")
    ap.add_argument("--sections", default="verify,extract,reference", help="any of verify, extract, reference")
    ap.add_argument("--profile-extract", action="store_true",
                    help="extract section: profile the target's forward over one sequence: time per part (GEMMs, "
                         "attention, Gated-DeltaNet, short convolution, the rest)")
    ap.add_argument("--profile-overhead", action="store_true",
                    help="profile the overhead region at the largest budget: top operators by device / host time")
    ap.add_argument("--cache", choices=["dynamic", "static", "graphs"], default="dynamic",
                    help="the hybrid verify's cache: HF's dynamic cache (the default), the static K/V buffer, or the "
                         "static buffer with every verify a CUDA graph (eval/engine/cache/hybrid.py)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    if not gpu:
        torch.set_num_threads(1)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.extract_tokens = args.extract_tokens or (150_000 if gpu else 20_000)
    args.tokens_per_batch = args.tokens_per_batch or (32768 if gpu else 4096)
    args.disk_bytes = args.disk_bytes or ((2 << 30) if gpu else (64 << 20))
    sections = set(args.sections.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
                 "shape": args.shape, "dtype": str(dtype).replace("torch.", ""), "past": args.past,
                 "draft": args.draft, "iters": args.iters, "date": time.strftime("%Y-%m-%d")}

    def save() -> None:
        (out_dir / "summary.json").write_text(json.dumps(res, indent=2))

    t0 = time.perf_counter()
    if sections & {"verify", "extract"}:
        target = random_model(hybrid_config(args.shape), device, dtype)
        sync(device)
        res["init_s"] = time.perf_counter() - t0
        res["params"] = sum(p.numel() for p in target.parameters())
        print(f"hybrid {args.shape}: {res['params'] / 1e9:.2f}B parameters ({dtype}) on {device} in "
              f"{res['init_s']:.1f} s; Gated-DeltaNet kernels: {gated_delta_kernels(target)}", flush=True)
        save()
        with torch.no_grad():
            if "verify" in sections:
                verify_section(target, args, device, dtype, res, save)
            if "extract" in sections:
                extract_section(target, args, device, res, save)
        del target
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
            res["peak_gpu_gib_hybrid"] = torch.cuda.max_memory_allocated(device) / 2**30
    if "reference" in sections:
        with torch.no_grad():
            reference_section(args, device, dtype, res, save)
    res["wall_s"] = time.perf_counter() - t0
    save()
    print(json.dumps({k: res.get(k) for k in ("chain_verify_ms", "tree_verify_ms", "path_batched_verify_ms",
                                              "overhead_ms", "host_syncs_per_round", "extract_tok_s",
                                              "extract_ceiling_tok_s", "reference_8b")}, indent=1))
    print(f"wrote {out_dir / 'summary.json'} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
