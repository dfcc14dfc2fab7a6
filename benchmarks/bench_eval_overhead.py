"""Per-round cost of DDTree around the target forward, and of the verify forward itself, per budget.

What runs is the decoder's own code (eval.engine.decode round helpers, eval.engine.cache.interface target caches) on a random-init target
of the real shape (weights do not change the speed) with a random-init DFlash drafter:

  build+mask   tree build on the device (top-K, best-first selection) + verify positions + ancestor matrix
  walk+read    target choices, device tree walk, the round's single D2H read (accepted count, bonus, path)
  compact+ctx  dynamic cache only: KV compaction of an accepted path of depth min(L, tree depth) that is NOT
               contiguous (the worst case) + drafter context gather; the static cache does both inside the walk
               for all L+1 path rows (fixed shape, part of walk+read), so the column shows '-'
               (these three are timed separately, each between two syncs: a breakdown, not a sum)
  overhead     the three in ONE timed region, as a round runs them (one sync: the read)
               (reference, DDTree authors' code on H200: 0.89 / 1.02 / 1.52 / 4.28 ms at budgets 16/64/256/1024)
  verify       the target forward over 1+n rows with ~`--past` committed rows: the decoder's default on CUDA
               (static KV + eval.engine.target_forward fused forward + Triton tree attention + CUDA graphs), then
               HF's forward on the static KV in CUDA graphs, static KV eager, and the dynamic-cache reference path
               (reference code: ~29 ms up to budget 256, 48 ms at 1024)
  round        end-to-end decode: decode wall time / rounds (includes the drafter), phase timing off
Host syncs: the overhead steps and the verify run once under torch.cuda.set_sync_debug_mode("error") with only
the round's one read outside it; the `syncs` column says whether that passed. `graphs`: the build and walk
CUDA graphs (and the verify's) passed capture and their eager self-check; `fused`: the verify runs the fused
forward (it passed its check against HF's forward). `dev=heap`: the device builder equals the CPU heap
reference on this device (5 random drafts per budget).

    python benchmarks/bench_eval_overhead.py --device cuda --shape qwen3-8b --past 1024 \\
        --budgets 16,32,64,128,256,512,1024 --iters 30
    python benchmarks/bench_eval_overhead.py --device cpu --shape tiny --past 128 --budgets 16,64,256 --iters 3

`--draft two-way` replaces the random drafter's logits (whose trees are one level deep, so the selection prunes
every deeper depth) by two likely tokens per depth, which keeps every depth of the selection busy: the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.engine.cache.kv import KVTargetCache  # noqa: E402
from eval.engine.cache.factory import target_cache  # noqa: E402
from eval.engine.decode import decode, round_ops, warm_up  # noqa: E402
from eval.engine.tree import build_tree, build_tree_heap  # noqa: E402
from extract.layers import default_layer_ids  # noqa: E402
from dflash_model.model import DFlashDrafter, DrafterArgs  # noqa: E402

SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False, rope_theta=1e6),
    "tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=320,
                 tie_word_embeddings=False),
}
DRAFT_LAYERS = {"qwen3-8b": 5, "tiny": 2}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_target(shape: str, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=40960, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def build_drafter(target, shape: str, block_size: int) -> DFlashDrafter:
    cfg = target.config
    args = DrafterArgs(hidden_size=cfg.hidden_size, num_hidden_layers=DRAFT_LAYERS[shape],
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=1e-6,
                       rope_theta=1e6, vocab_size=cfg.vocab_size, block_size=block_size,
                       mask_token_id=cfg.vocab_size - 1,
                       target_layer_ids=default_layer_ids(cfg.num_hidden_layers, 5 if shape != "tiny" else 3),
                       num_target_layers=cfg.num_hidden_layers)
    torch.manual_seed(1)
    weight = target.get_input_embeddings().weight
    with torch.device(weight.device):
        drafter = DFlashDrafter(args).to(dtype=weight.dtype).eval()
    drafter.attach_target_head(weight, target.get_output_embeddings().weight)
    return drafter


def timed(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def deepest_path(tree) -> list[int]:
    """Root path to the first deepest node (host read outside the timed region)."""
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    node = max(range(len(depths)), key=lambda i: (depths[i], -i))
    path = [node]
    while node:
        node = parents[node]
        path.append(node)
    return path[::-1]


def two_way_draft(L: int, vocab: int, device, dtype) -> torch.Tensor:
    """Draft logits [L, V] with two likely tokens per depth (p ~ 0.5 each, every other token ~e-30): the tree fills
    depth after depth and every depth keeps live candidates, so no depth of the selection is pruned away."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.full((L, vocab), -30.0, device=device) + torch.randn(L, vocab, generator=gen, device=device) * 0.1
    likely = torch.randint(0, vocab, (L, 2), generator=gen, device=device)
    logits.scatter_(1, likely, torch.randn(L, 2, generator=gen, device=device) * 0.1)
    return logits.to(dtype)


def measure_budget(target, drafter, cache, prompt, budget: int, iters: int, device, draft: str = "drafter") -> dict:
    """Median seconds per step for one budget on `cache` (which holds the prefilled prompt)."""
    past = prompt.numel()
    L = drafter.args.block_size - 1
    vocab = target.get_output_embeddings().weight.shape[0]
    ops = round_ops("ddtree", budget, "device", cache, 0.0, L, vocab, device)
    rewind(cache, past)  # an end-to-end decode may have run on this cache (same prompt rows, longer length)
    draft_cache = drafter.new_cache()
    draft_logits = drafter.draft_logits(draft_cache, _FEATURES["ctx"], 7, past)
    if draft == "two-way":
        draft_logits = two_way_draft(L, vocab, device, draft_logits.dtype)
    bonus = torch.tensor([7], device=device)
    samples = {k: [] for k in ("build", "walk", "compact", "verify", "overhead")}
    syncs_ok = None
    for it in range(iters + 3):
        # the whole overhead as one region, as a round runs it: build, walk on the verify's logits, the one read,
        # compaction of a non-contiguous deepest path and the drafter context gather
        tree, vin, anc = ops.build(draft_logits, bonus)
        out = cache.verify(tree, vin)
        path = deepest_path(tree)
        path_t = torch.tensor(path + [0] * (L + 1 - len(path)), device=device)
        rewind(cache, past)
        sync(device)
        t0 = time.perf_counter()
        tree, vin, anc = ops.build(draft_logits, bonus)
        walk, record, ctx = ops.walk(tree, anc, out.logits, None, out.features)
        accepted = ops.read(record).accepted
        if ops.compacts:  # done inside the walk (every path row, whatever the path)
            cache.commit_compacted(accepted + 1)
        else:
            cache.commit(path_t, len(path), contiguous=False)
            out.features.index_select(0, path_t[: len(path)])
        sync(device)
        t_overhead = time.perf_counter() - t0
        rewind(cache, past)
        (tree, vin, anc), t_build = timed(device, lambda: ops.build(draft_logits, bonus))
        out, t_verify = timed(device, lambda: cache.verify(tree, vin))
        (walk, record), t_walk = timed(device, lambda: (lambda w: (w[0], ops.read(w[1])))(
            ops.walk(tree, anc, out.logits, None, out.features)))
        t_compact = None  # inside the walk on the static cache
        if not ops.compacts:
            _, t_compact = timed(device, lambda: (cache.commit(path_t, len(path), contiguous=False),
                                                  out.features.index_select(0, path_t[: len(path)])))
        rewind(cache, past)
        if it >= 3:
            for k, v in zip(("build", "walk", "compact", "verify", "overhead"),
                            (t_build, t_walk, t_compact, t_verify, t_overhead)):
                samples[k].append(v)
        if it == 2 and device.type == "cuda":
            syncs_ok = one_sync_round(ops, cache, draft_logits, bonus, path_t, len(path), past)
    med = {k: statistics.median(v) if None not in v else None for k, v in samples.items()}
    med["N"] = tree.size
    med["depth"] = int(tree.depths.max())
    med["syncs_ok"] = syncs_ok
    fns = [ops._build, *(ops._walks or {None: ops._walk_eager}).values()] + list(getattr(cache, "_verify_fns", {}).values())
    med["graphs"] = all(not getattr(f, "disabled", True) for f in fns)
    med["fused"] = getattr(cache, "fused", None) is not None
    med["builders"] = builders_agree(budget, L, vocab, device)
    return med


def builders_agree(budget: int, L: int, vocab: int, device, trials: int = 5) -> bool:
    """The device builder equals the heap reference on this device (random peaked draft logits)."""
    gen = torch.Generator(device=device).manual_seed(budget)
    for _ in range(trials):
        logits = torch.randn(L, vocab, generator=gen, device=device) * 4
        a, b = build_tree(logits, budget, 0), build_tree_heap(logits, budget, 0)
        if not all(torch.equal(x, y) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.depths, b.depths))):
            return False
    return True


def one_sync_round(ops, cache, draft_logits, bonus, path_t, n, past) -> bool:
    """A full round with sync debug mode 'error' except around the one host read."""
    try:
        torch.cuda.set_sync_debug_mode("error")
        tree, vin, anc = ops.build(draft_logits, bonus)
        out = cache.verify(tree, vin)
        walk, record, _ = ops.walk(tree, anc, out.logits, None, out.features)
        torch.cuda.set_sync_debug_mode(0)
        accepted = ops.read(record).accepted  # the read
        torch.cuda.set_sync_debug_mode("error")
        if ops.compacts:
            cache.commit_compacted(accepted + 1)
        else:
            cache.commit(path_t, n, contiguous=False)
            out.features.index_select(0, path_t[:n])
        ok = True
    except RuntimeError as exc:
        print(f"  hidden host sync: {exc}", file=sys.stderr)
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode(0)
        rewind(cache, past)
    return ok


def rewind(cache, past: int) -> None:
    """Back to `past` committed rows (the timing loop verifies at the same position every iteration)."""
    if not cache.static:
        for layer in cache.dynamic.layers:
            layer.keys, layer.values = layer.keys[:, :, :past], layer.values[:, :, :past]
    cache._set_length(past)


_FEATURES: dict = {}  # "ctx": the prompt's tap features [1, past, F] from the first prefill


def prefill(cache, prompt, capacity):
    cache.reset(capacity)
    out = cache.prefill(prompt)
    _FEATURES.setdefault("ctx", out.features.unsqueeze(0))


def verify_only(cache, target, drafter, prompt, budget, iters, device) -> float:
    """Median seconds of the verify forward alone on `cache` (eager static or dynamic reference)."""
    L = drafter.args.block_size - 1
    vocab = target.get_output_embeddings().weight.shape[0]
    ops = round_ops("ddtree", budget, "device", cache, 0.0, L, vocab, device)
    rewind(cache, prompt.numel())
    draft_logits = drafter.draft_logits(drafter.new_cache(), _FEATURES["ctx"], 7, prompt.numel())
    tree, vin, _ = ops.build(draft_logits, torch.tensor([7], device=device))
    times = []
    for it in range(iters + 2):
        _, t = timed(device, lambda: cache.verify(tree, vin))
        rewind(cache, prompt.numel())
        if it >= 2:
            times.append(t)
    return statistics.median(times)


def end_to_end(method, target, drafter, prompt, budget, new_tokens, impl) -> tuple[float, float]:
    """(seconds per round, mean tau) of a real decode (phase timing off: one sync per round)."""
    warm_up(method, target, drafter, max_length=prompt.numel() + new_tokens, budget=budget, cache_impl=impl)
    res = decode(method, target, drafter, prompt.tolist(), max_new_tokens=new_tokens, budget=budget, cache_impl=impl,
                 phase_timing=False)
    return res.timings["decode"] / max(res.num_rounds, 1), sum(res.accept_lengths) / max(res.num_rounds, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    ap.add_argument("--past", type=int, default=1024, help="committed context rows during the verify")
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens of the end-to-end decode per budget (0 = skip)")
    ap.add_argument("--skip-reference", action="store_true", help="skip the eager-static and dynamic verify columns")
    ap.add_argument("--attention", default="auto", help="eval.engine.target_forward.ATTENTIONS mode of the fused verify")
    ap.add_argument("--draft", choices=["drafter", "two-way"], default="drafter",
                    help="draft logits of the overhead columns: the random drafter's (its trees are one level deep: "
                         "pruning skips the deeper depths), or two likely tokens per depth (every depth selects)")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    target = build_target(args.shape, device, dtype)
    drafter = build_drafter(target, args.shape, args.block_size)
    taps = tuple(drafter.args.target_layer_ids)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size - 1, (args.past,), generator=gen).to(device)
    capacity = args.past + args.new_tokens + max(budgets) + 2
    fast = "graphs" if device.type == "cuda" else "fused"
    caches = {impl: target_cache(target, taps, impl) for impl in ([fast] + ([] if args.skip_reference else
                                                                             ["static", "dynamic"]))}
    if getattr(caches[fast], "fused", None) is not None:
        caches[fast].fused.attention = args.attention
    if device.type == "cuda" and not args.skip_reference:  # HF's forward on the static buffer, in CUDA graphs
        caches["hf-graphs"] = KVTargetCache(target, taps, static=True, graphs=True)
    with torch.no_grad():
        for cache in caches.values():
            prefill(cache, prompt, capacity)
        print(f"target {args.shape} ({dtype}) on {device}, past {args.past}, block {args.block_size}, "
              f"fast path: {fast}, attention: {args.attention}, draft: {args.draft}")
        head = (f"{'budget':>6} {'N':>5} {'depth':>5} {'build+mask':>10} {'walk+read':>9} {'compact':>8} {'overhead':>8} "
                f"{'verify':>8} {'v.hf-graph':>10} {'v.static':>8} {'v.dynamic':>9} {'round':>8} {'tau':>5} "
                f"{'graphs':>6} {'fused':>5} {'syncs':>5} {'dev=heap':>8}")
        print(head + "\n" + "-" * len(head))
        ms = lambda s: f"{s * 1e3:8.3f}" if s is not None else f"{'-':>8}"
        for budget in budgets:
            m = measure_budget(target, drafter, caches[fast], prompt, budget, args.iters, device, args.draft)
            v_static = v_dyn = v_hf_graph = None
            if not args.skip_reference:
                v_static = verify_only(caches["static"], target, drafter, prompt, budget, args.iters, device)
            if "hf-graphs" in caches:
                v_hf_graph = verify_only(caches["hf-graphs"], target, drafter, prompt, budget, args.iters, device)
            if not args.skip_reference:
                v_dyn = verify_only(caches["dynamic"], target, drafter, prompt, budget, args.iters, device)
            round_s, tau = (end_to_end("ddtree", target, drafter, prompt, budget, args.new_tokens, "auto")
                            if args.new_tokens else (None, float("nan")))
            syncs = {True: "1", False: "MORE", None: "n/a"}[m["syncs_ok"]]
            print(f"{budget:>6} {m['N']:>5} {m['depth']:>5} {ms(m['build']):>10} {ms(m['walk']):>9} {ms(m['compact'])} "
                  f"{ms(m['overhead'])} {ms(m['verify'])} {ms(v_hf_graph):>10} {ms(v_static)} {ms(v_dyn):>9} "
                  f"{ms(round_s)} {tau:5.2f} {str(m['graphs']):>6} {str(m['fused']):>5} {syncs:>5} "
                  f"{str(m['builders']):>8}")
        if args.new_tokens:
            for method in ("ar", "chain"):
                round_s, tau = end_to_end(method, target, drafter, prompt, None, args.new_tokens, "auto")
                print(f"{method:>6} e2e: {round_s * 1e3:.3f} ms/round, tau {tau:.2f}")
    print("reference (DDTree authors' code, H200): overhead 0.89/1.02/1.52/4.28 ms at budgets 16/64/256/1024; "
          "verify ~29 ms up to 256, 48 ms at 1024. Targets: overhead <= 0.3 ms and verify <= 10 ms at 256.")


if __name__ == "__main__":
    main()
