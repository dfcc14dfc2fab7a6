"""Benchmark the DFlash drafter: training step (mask build, forward, chunked CE, backward) with dense vs flex
attention, and the inference `draft_logits` round latency. Random weights; no target needed.

CPU smoke (seconds):
    .venv/bin/python benchmarks/bench_drafter.py
GPU, Qwen3-8B-shaped drafter (D 4096, 5 layers, 5 taps, B 16, 512 anchors/sequence, length 3072):
    python benchmarks/bench_drafter.py --device cuda --preset qwen3-8b --seqs 1,4,8 --attention flex,dense

Prints one table row per (attention, packed sequences): ms per phase, context tokens/s, peak GPU memory; then the
inference round latency per context length. Also checks flex vs dense loss/grad-norm agreement on the first config.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_model.blocks import build_block_batch, dense_block_mask, flex_block_mask, sample_anchors  # noqa: E402
from train.loss import dflash_loss  # noqa: E402
from dflash_model.model import DFlashDrafter, DrafterArgs  # noqa: E402

PRESETS = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=320, taps=3, block=8,
                 anchors=32, seq_len=256, num_target_layers=8),
    "qwen3-8b": dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, inter=12288, vocab=151936, taps=5,
                     block=16, anchors=512, seq_len=3072, num_target_layers=36),
    "qwen3-4b": dict(hidden=2560, layers=5, heads=32, kv_heads=8, head_dim=128, inter=9728, vocab=151936, taps=5,
                     block=16, anchors=512, seq_len=3072, num_target_layers=36),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - t) * 1000


def make_drafter(p, device, dtype, layer_types, window):
    args = DrafterArgs(
        hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], intermediate_size=p["inter"], rms_norm_eps=1e-6,
        rope_theta=1e6, vocab_size=p["vocab"], block_size=p["block"], mask_token_id=p["vocab"] - 1,
        target_layer_ids=list(range(1, 1 + p["taps"])), num_target_layers=p["num_target_layers"],
        layer_types=layer_types, sliding_window=window,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(args).to(device=device, dtype=dtype)
    drafter.attach_target_head(torch.randn(p["vocab"], p["hidden"], device=device, dtype=dtype) * 0.02,
                               torch.randn(p["vocab"], p["hidden"], device=device, dtype=dtype) * 0.02)
    return drafter, args


def make_row(p, seqs, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, B = p["seq_len"], p["block"]
    ids, masks, anchors = [], [], []
    for i in range(seqs):
        loss_mask = torch.zeros(S, dtype=torch.bool)
        loss_mask[S // 5:] = True  # prompt 20%, response 80%
        ids.append(torch.randint(0, p["vocab"] - 2, (S,), generator=g))
        masks.append(loss_mask)
        anchors.append(sample_anchors(loss_mask, B, p["anchors"], g) + i * S)
    batch = build_block_batch(torch.cat(ids), torch.cat(masks), torch.cat(anchors), B, p["vocab"] - 1,
                              seq_lens=[S] * seqs, pad_to=seqs * p["anchors"])
    feats = torch.randn(1, seqs * S, p["taps"] * p["hidden"], generator=g).to(device=device, dtype=dtype)
    return feats, batch.to(device)


def train_step(drafter, feats, batch, attention, chunk_rows):
    drafter.zero_grad(set_to_none=True)
    device = feats.device
    hidden, t_fwd = timed(device, lambda: drafter.forward_train(feats, batch, attention))
    (loss, stats), t_ce = timed(device, lambda: dflash_loss(hidden, drafter.lm_head_weight, batch, None, chunk_rows))
    _, t_bwd = timed(device, lambda: loss.backward())
    gnorm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in drafter.parameters() if p.grad is not None))
    return dict(loss=float(loss.detach()), gnorm=float(gnorm), fwd=t_fwd, ce=t_ce, bwd=t_bwd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (cuda default) or float32 (cpu default)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seqs", default="1,2", help="packed sequences per row, comma list")
    ap.add_argument("--attention", default="dense,flex", help="comma list of dense/flex")
    ap.add_argument("--sliding", type=int, default=0, help="make all but the last layer sliding with this window")
    ap.add_argument("--chunk-rows", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--context-lens", default="256,2048", help="inference: context lengths for draft_logits")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--anchors", type=int, default=None)
    a = ap.parse_args()

    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    p = dict(PRESETS[a.preset])
    p["seq_len"] = a.seq_len or p["seq_len"]
    p["anchors"] = a.anchors or p["anchors"]
    layer_types = None
    window = None
    if a.sliding:
        layer_types = ["sliding_attention"] * (p["layers"] - 1) + ["full_attention"]
        window = a.sliding
    drafter, args = make_drafter(p, device, dtype, layer_types, window)
    drafter.gradient_checkpointing = a.checkpointing
    print(f"device {device} dtype {dtype} preset {a.preset} params {drafter.num_trainable_parameters() / 1e6:.1f}M "
          f"S {p['seq_len']} anchors {p['anchors']} B {p['block']} layer_types {args.layer_types}")

    header = f"{'attention':>9} {'seqs':>4} {'Q rows':>8} {'mask ms':>8} {'fwd ms':>8} {'ce ms':>8} {'bwd ms':>8} " \
             f"{'step ms':>8} {'ctx tok/s':>10} {'peak GiB':>8} {'loss':>8} {'gnorm':>8}"
    print(header)
    print("-" * len(header))
    first = {}
    for seqs in [int(s) for s in a.seqs.split(",")]:
        feats, batch = make_row(p, seqs, device, dtype)
        for attention in a.attention.split(","):
            if attention == "flex" and device.type == "cpu":
                print(f"{attention:>9} {seqs:>4}  skipped: flex_attention has no backward on CPU")
                continue
            try:
                builder = flex_block_mask if attention == "flex" else dense_block_mask
                _, t_mask = timed(device, lambda: [builder(batch.anchors, batch.seq_len, batch.block_size, t, window,
                                                            block_valid=batch.block_valid, doc_start=batch.doc_start)
                                                    for t in set(args.layer_types)])
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                train_step(drafter, feats, batch, attention, a.chunk_rows)  # warm-up (compiles flex)
                runs = [train_step(drafter, feats, batch, attention, a.chunk_rows) for _ in range(a.steps)]
            except torch.OutOfMemoryError:
                print(f"{attention:>9} {seqs:>4}  out of memory")
                torch.cuda.empty_cache()
                continue
            r = {k: sum(x[k] for x in runs) / len(runs) for k in runs[0]}
            step = r["fwd"] + r["ce"] + r["bwd"]
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            print(f"{attention:>9} {seqs:>4} {batch.block_ids.numel():>8} {t_mask:>8.1f} {r['fwd']:>8.1f} "
                  f"{r['ce']:>8.1f} {r['bwd']:>8.1f} {step:>8.1f} {seqs * p['seq_len'] / step * 1000:>10.0f} "
                  f"{peak:>8.2f} {r['loss']:>8.4f} {r['gnorm']:>8.4f}")
            first.setdefault(seqs, {})[attention] = r
    for seqs, r in first.items():
        if "flex" in r and "dense" in r:
            print(f"parity seqs={seqs}: |loss flex - dense| = {abs(r['flex']['loss'] - r['dense']['loss']):.2e}, "
                  f"grad-norm {r['flex']['gnorm']:.4f} vs {r['dense']['gnorm']:.4f}")

    print(f"\n{'context':>8} {'draft_logits ms':>16}   (inference round: append 8 new rows + one block)")
    drafter.eval()
    with torch.inference_mode():
        for L in [int(x) for x in a.context_lens.split(",")]:
            feats = torch.randn(1, L + 8 * (a.steps + 1), p["taps"] * p["hidden"], device=device, dtype=dtype)
            cache = drafter.new_cache()
            drafter.append_context(cache, feats[:, :L])
            times = []
            for i in range(a.steps + 1):
                start = cache.length + 8
                _, t = timed(device, lambda: drafter.draft_logits(cache, feats[:, cache.length:start], 5, start))
                times.append(t)
            print(f"{L:>8} {sum(times[1:]) / max(len(times) - 1, 1):>16.2f}")


if __name__ == "__main__":
    main()
