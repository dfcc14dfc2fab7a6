"""The hybrid device commit, by piece, against its memory floor: what the round pays after the walk to advance every
Gated-DeltaNet layer's state and conv window along the accepted path (eval/engine/tree_recurrent.py
`commit_path_steps`), on random rows of the Qwen3.6-27B shape (48 Gated-DeltaNet layers, 16 q/k heads, 48 value
heads, 128 x 128 states; weights play no part).

Rows of the table, each a median over `--iters` launches between two syncs:

  copy floor         a device-to-device copy of the stacked states (read + write of NL x HV x dk x dv fp32): the
                     bytes the state commit must move at least
  gathers (before)   the torch fixed-shape commit's index_select / where / cat of the path's rows and windows (what
                     the commit paid before the kernels read the rows in place), without its state recurrence
  torch commit       `commit_path_steps`'s torch version of the states (the CPU path)
  state BVxW         the state kernel (`_gated_delta_walk_kernel`, not TREE, steps read on the device) with BV value
                     columns per program and W warps; the engine launches `PATH_BLOCK` (8 x 1 warp)
  conv window        `path_conv_window`, one launch for every layer's window
  commit             `tree_recurrent_triton.commit_path_steps` end to end (what the round runs)

Each state configuration is checked against 8 x 1: "equal" when bit for bit, else the largest
relative difference (a different reduction layout rounds differently).

    python benchmarks/bench_gdn_commit.py --device cuda --json $OUT/gdn_commit.json
    TRITON_INTERPRET=1 python benchmarks/bench_gdn_commit.py --device cpu --shape tiny --iters 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.engine import tree_recurrent  # noqa: E402

SHAPES = {  # layers, q/k heads, value heads, head dim, conv kernel
    "qwen3.6-27b": dict(layers=48, hk=16, hv=48, d=128, k=4),
    "tiny": dict(layers=3, hk=2, hv=4, d=16, k=4),
}
CONFIGS = "8x1,16x1,16x2,32x2,32x4,64x4"


def timed(device, fn, iters: int) -> float:
    """Median microseconds of fn() between two syncs."""
    times = []
    for it in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if it:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def state_kernel(rows, path, n, states, out, bv: int, warps: int) -> None:
    """The engine's state kernel of the commit (eval/engine/tree_recurrent_triton.py) with block (bv, warps)."""
    from eval.engine import tree_recurrent_triton as trt

    k, v, g, beta = rows
    trt._walk(k, k, v, g, beta, path, path, path, path, n, states, out, out, out, False, (bv, warps))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b")
    ap.add_argument("--nodes", type=int, default=257, help="verify rows (a budget-256 tree)")
    ap.add_argument("--path", type=int, default=9, help="accepted nodes (the depth limit + 1: the most a round takes)")
    ap.add_argument("--configs", default=CONFIGS, help="state kernel blocks BVxWARPS, comma-separated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from eval.engine import tree_recurrent_triton as trt

    device = torch.device(args.device)
    s = SHAPES[args.shape]
    B, HK, HV, D, K, N = s["layers"], s["hk"], s["hv"], s["d"], s["k"], args.nodes
    C = 2 * HK * D + HV * D
    gen = torch.Generator().manual_seed(0)
    conv_outputs = torch.randn(B, N, C, generator=gen).to(device=device, dtype=torch.bfloat16)
    conv_inputs = torch.randn(B, N, C, generator=gen).to(device=device, dtype=torch.bfloat16)
    g = (-torch.rand(B, N, HV, generator=gen) * 0.7).to(device)
    beta = torch.rand(B, N, HV, generator=gen).to(device)
    states = torch.randn(B, HV, D, D, generator=gen).to(device)
    windows = torch.randn(B, C, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    layer = SimpleNamespace(key_dim=HK * D, value_dim=HV * D, num_k_heads=HK, head_k_dim=D, num_v_heads=HV,
                            head_v_dim=D)
    _, k, v = tree_recurrent._split_heads(conv_outputs, layer)
    path = torch.arange(0, args.path * 7, 7, device=device) % N  # rows spread over the verify, as a tree's path
    n = torch.tensor(args.path, device=device)
    rows = (k, v, g, beta)
    scratch_states, scratch_windows = states.clone(), windows.clone()
    state_bytes = states.numel() * 4

    def gathers():
        t = torch.arange(path.shape[0], device=device)
        live = (t < n).unsqueeze(-1)
        k.index_select(-3, path), v.index_select(-3, path)
        torch.where(live, g.index_select(-2, path), 0.0), torch.where(live, beta.index_select(-2, path), 0.0)
        cat = torch.cat([windows, conv_inputs.index_select(-2, path).transpose(-1, -2)], dim=-1)
        scratch_windows.copy_(cat.index_select(-1, n + torch.arange(K, device=device)))

    table = [("copy floor", timed(device, lambda: scratch_states.copy_(states), args.iters), "")]
    table.append(("gathers (before)", timed(device, gathers, args.iters), ""))

    def torch_states():
        t = torch.arange(path.shape[0], device=device)
        live = (t < n).unsqueeze(-1)
        g_p = torch.where(live, g.index_select(-2, path), 0.0)
        beta_p = torch.where(live, beta.index_select(-2, path), 0.0)
        scratch_states.copy_(tree_recurrent.path_gated_delta_state(k.index_select(-3, path), v.index_select(-3, path),
                                                                   g_p, beta_p, t, states))

    table.append(("torch commit (states)", timed(device, torch_states, args.iters), ""))
    reference = torch.empty_like(states)
    state_kernel(rows, path, n, states, reference, 8, 1)
    for spec in args.configs.split(","):
        bv, warps = (int(x) for x in spec.split("x"))
        if bv > D:
            continue
        out = torch.empty_like(states)
        us = timed(device, lambda: state_kernel(rows, path, n, states, out, bv, warps), args.iters)
        err = float(((out - reference).abs().max() / reference.abs().max()))
        table.append((f"state {bv}x{warps}", us, "equal" if torch.equal(out, reference) else f"max rel diff {err:.1e}"))
    table.append(("conv window", timed(device, lambda: trt.path_conv_window(conv_inputs, path, n, scratch_windows),
                                       args.iters), ""))
    table.append(("commit", timed(device, lambda: trt.commit_path_steps(k, v, g, beta, conv_inputs, path, n,
                                                                        scratch_windows, scratch_states),
                                  args.iters), ""))
    floor = table[0][1]
    print(f"GDN device commit, {args.shape}: {B} layers, states {state_bytes / 2**20:.0f} MiB, path {args.path} of "
          f"{N} rows, {args.device}")
    print(f"| piece | us | x copy floor | GB/s (2 x states) | check |\n|---|---:|---:|---:|---|")
    for name, us, check in table:
        print(f"| {name} | {us:.1f} | {us / floor:.2f} | {2 * state_bytes / us / 1e3:.0f} | {check} |")
    result = {"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "layers": B, "path": args.path,
              "nodes": N, "state_bytes": state_bytes, "us": {name: us for name, us, _ in table},
              "checks": {name: check for name, _, check in table if check}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
