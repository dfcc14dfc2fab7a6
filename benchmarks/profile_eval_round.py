"""Where the GPU time of a DDTree round goes: kernel tables (torch.profiler) of the verify forward and of the
round's tree build and walk, and the matmul floor of the verify, on a random-init target of a real shape.

    python benchmarks/profile_eval_round.py --shape qwen3-8b --past 1024 --budget 256

Prints, for one budget:
  * verify forward time per implementation (HF forward static eager / HF + CUDA graph / fused eager /
    fused compiled + CUDA graph) and the time of the same matmuls alone in a CUDA graph (the floor);
  * the top kernels (by GPU time) of the eager HF verify, the eager fused verify, the tree build and the walk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_eval_overhead import SHAPES, build_drafter, build_target  # noqa: E402
from eval.engine.cache.kv import KVTargetCache  # noqa: E402
from eval.engine.cache.factory import target_cache  # noqa: E402
from eval.engine.decode import round_ops  # noqa: E402
from eval.engine.target_forward import VerifyForward  # noqa: E402
from eval.engine.tree import build_tree, build_tree_heap, top_log_probs  # noqa: E402


def gpu_ms(fn, iters: int = 20) -> float:
    """Median GPU milliseconds of fn() (CUDA events), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::index_copy_", "aten::cat", "aten::stack",
            "aten::_to_copy", "aten::repeat_interleave", "aten::expand")


def kernel_table(title: str, fn, rows: int = 15, copies: bool = False) -> None:
    """GPU kernels of one call of fn, by total time; with `copies` also the host ops that copy tensors (with their
    input shapes), which says where device-to-device memcpys come from."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=copies) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    count = sum(e.count for e in events)
    print(f"\n== {title}: {count} kernels, {total / 1e3:.3f} ms of GPU time")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:6d}x  {e.key[:110]}")
    if copies:
        ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in COPY_OPS]
        print("  host ops that copy (count, op, input shapes):")
        for e in sorted(ops, key=lambda e: -e.count)[:12]:
            print(f"    {e.count:5d}x  {e.key:24s} {str(e.input_shapes)[:120]}")


def graph_ms(fn) -> float:
    """GPU ms of fn captured in a CUDA graph (kernel time + in-graph gaps, no host launch cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_ms(graph.replay)


def matmul_floor(target, rows: int) -> float:
    """GPU ms of the verify's matmuls alone (fused qkv, o, gate/up, down per layer + the LM head), one CUDA graph."""
    fwd = VerifyForward(target, [])
    x = torch.randn(rows, target.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    inter = target.config.intermediate_size
    h = target.config.num_attention_heads * fwd.head_dim
    a = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
    head = target.get_output_embeddings().weight

    def run():
        for w in fwd.layers:
            F.linear(x, w.w_qkv)
            F.linear(a, w.w_o)
            F.linear(x, w.w_gate_up)
            F.linear(m, w.w_down)
        F.linear(x, head)

    run()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        run()
    return gpu_ms(graph.replay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--past", type=int, default=1024)
    ap.add_argument("--budgets", default="16,256")
    ap.add_argument("--profile-budget", type=int, default=256)
    ap.add_argument("--best-file", default=None, help="write the fastest attention mode at --profile-budget here")
    ap.add_argument("--no-tables", action="store_true", help="only the verify table")
    ap.add_argument("--wall", action="store_true", help="also print wall-clock verify times (sync, call, sync)")
    ap.add_argument("--drafter-logits", action="store_true", help="draft with the random drafter, not randn * 4")
    ap.add_argument("--attention", default="64,64,4,2",
                    help="Triton tree-attention variants 'BLOCK_M,BLOCK_N,warps,stages[,splits]' separated by ';'")
    args = ap.parse_args()
    device = torch.device("cuda")
    target = build_target(args.shape, device, torch.bfloat16)
    drafter = build_drafter(target, args.shape, 16)
    taps = tuple(drafter.args.target_layer_ids)
    prompt = torch.randint(0, target.config.vocab_size - 1, (args.past,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    caches = {
        "hf eager": target_cache(target, taps, "static"),
        "hf graph": KVTargetCache(target, taps, static=True, graphs=True),
        "fused eager": target_cache(target, taps, "fused"),
        "fused graph": target_cache(target, taps, "graphs"),
    }
    for mode in ("sdpa", "sdpa_gqa"):
        cache = KVTargetCache(target, taps, static=True, graphs=True, fused=True)
        cache.fused.attention = mode
        caches[f"fused+{mode} graph"] = cache
    for variant in [v for v in args.attention.split(";") if v]:  # "BM,BN,warps,stages[,splits]"
        numbers = [int(x) for x in variant.split(",")]
        cache = KVTargetCache(target, taps, static=True, graphs=True, fused=True)
        cache.fused.attention_config = tuple(numbers[:4])
        cache.fused.splits = numbers[4] if len(numbers) > 4 else None
        caches[f"tri {variant}"] = cache
    capacity = args.past + 2048
    L, vocab = 15, target.config.vocab_size
    torch.manual_seed(0)
    draft_logits = torch.randn(L, vocab, device=device) * 4
    if args.drafter_logits:  # the random drafter's own (flat, bf16) logits, as bench_eval_overhead drafts them
        with torch.no_grad():
            c0 = target_cache(target, taps, "static")
            c0.reset(args.past + 2048)
            ctx = c0.prefill(prompt).features.unsqueeze(0)
            draft_logits = drafter.draft_logits(drafter.new_cache(), ctx, 7, args.past)
    bonus = torch.tensor([7], device=device)
    with torch.no_grad():
        for c in caches.values():
            c.reset(capacity)
            c.prefill(prompt)
        print(f"{args.shape} bf16, past {args.past}")
        print(f"{'budget':>6} {'N':>5} " + " ".join(f"{k:>16}" for k in caches) + f" {'matmuls':>8}")
        for budget in [int(b) for b in args.budgets.split(",")]:
            row = []
            for name, c in caches.items():
                ops = round_ops("ddtree", budget, "device", c, 0.0, L, vocab, device)
                tree, vin, _ = ops.build(draft_logits, bonus)
                c.verify(tree, vin)  # capture / compile / check outside the timing
                row.append(gpu_ms(lambda: c.verify(tree, vin)))
                if args.wall:
                    walls = []
                    for _ in range(10):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        c.verify(tree, vin)
                        torch.cuda.synchronize()
                        walls.append((time.perf_counter() - t0) * 1e3)
                    print(f"  {name}: wall {statistics.median(walls):.3f} ms, events {row[-1]:.3f} ms")
            if budget == args.profile_budget:
                timings = dict(zip(caches, row))
            print(f"{budget:>6} {tree.size:>5} " + " ".join(f"{t:16.3f}" for t in row)
                  + f" {matmul_floor(target, tree.size):8.3f}")
        modes = {f"fused+{m} graph": m for m in ("sdpa", "sdpa_gqa")}
        modes.update({k: "triton" for k in caches if k.startswith("tri ")})
        best = min(modes, key=lambda k: timings[k])
        print(f"fastest attention at budget {args.profile_budget}: {modes[best]} ({timings[best]:.3f} ms)")
        if args.best_file:
            Path(args.best_file).write_text(modes[best])
        fg = caches["fused graph"]
        print("fused graph uses the fused forward:", fg.fused is not None,
              {n: fg.fused.attention_splits(4 * n, 1536) for n in (1, 17, 65, 257, 1025)} if fg.fused else "")

        if args.no_tables:
            return
        budget = args.profile_budget
        compiled = VerifyForward(target, taps, compile=True)
        c = caches["fused eager"]
        ops = round_ops("ddtree", budget, "device", c, 0.0, L, vocab, device)
        tree, vin, anc = ops.build(draft_logits, bonus)
        c.fused, eager_fused = compiled, c.fused
        kernel_table(f"verify, fused compiled (no graph), budget {budget}", lambda: c.verify(tree, vin), rows=25,
                     copies=True)
        c.fused = eager_fused
        c = caches["hf eager"]
        ops = round_ops("ddtree", budget, "device", c, 0.0, L, vocab, device)
        tree, vin, anc = ops.build(draft_logits, bonus)
        out = c.verify(tree, vin)
        kernel_table(f"tree build + mask, budget {budget}", lambda: ops.build(draft_logits, bonus), rows=25)
        kernel_table(f"walk, budget {budget}", lambda: ops.walk(tree, anc, out.logits, None, out.features))
        g = caches["fused graph"]
        gops = round_ops("ddtree", budget, "device", g, 0.0, L, vocab, device)
        print(f"\nbuild graph replay {gpu_ms(lambda: gops.build(draft_logits, bonus)):.3f} ms GPU; "
              f"walk graph {gpu_ms(lambda: gops.walk(tree, anc, out.logits, None, out.features)):.3f} ms GPU")
        print(f"selection configs at budget {budget} (candidates per program, keys per step, warps): GPU ms of "
              f"build_tree in a CUDA graph")
        from eval.engine import tree_triton
        default = tree_triton.SELECT_CONFIG
        bf16_logits = draft_logits.to(torch.bfloat16)
        for cfg in ((2, 1024, 4), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (8, 1024, 2), (8, 1024, 4), (8, 2048, 8),
                    (16, 1024, 4), (32, 512, 4)):
            tree_triton.SELECT_CONFIG = cfg
            try:
                ms = graph_ms(lambda: build_tree(bf16_logits, budget, bonus))
                same = all(torch.equal(x, y) for x, y in zip(
                    (lambda t: (t.tokens, t.parents, t.depths))(build_tree(bf16_logits, budget, bonus)),
                    (lambda t: (t.tokens, t.parents, t.depths))(build_tree_heap(bf16_logits, budget, bonus))))
                print(f"  {cfg}: {ms:.4f} ms, = heap: {same}")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not a crash
                print(f"  {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
        tree_triton.SELECT_CONFIG = default
        for b in (16, 64, 256, 1024):
            k = min(b, vocab)
            t_top = gpu_ms(lambda: top_log_probs(draft_logits.to(torch.bfloat16), k))
            t_tree = gpu_ms(lambda: build_tree(draft_logits.to(torch.bfloat16), b, bonus))
            same = all(all(torch.equal(x, y) for x, y in zip(
                (t.tokens, t.parents, t.depths), (h.tokens, h.parents, h.depths)))
                for t, h in ((build_tree(lg, b, 3), build_tree_heap(lg, b, 3))
                             for lg in (torch.randn(L, vocab, device=device).mul(3).to(torch.bfloat16),
                                        torch.randn(L, vocab, device=device).mul(4))))
            print(f"budget {b}: top_log_probs {t_top:.3f} ms, build_tree eager {t_tree:.3f} ms, kernel = heap: {same}")


if __name__ == "__main__":
    main()
