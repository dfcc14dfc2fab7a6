"""The whole speculative round at steady state against one AR step: drafter, tree build + walk, verify, as
`eval.engine.decode.decode` runs them, after `eval.engine.decode.warm_up` has captured every CUDA graph the decodes use.

Two modes, one command each:

  shape mode (default): a random-init target of a real shape and a random-init drafter of the production recipe
  (`--shape qwen3-8b`: Qwen3-8B dims, bf16, the drafter of configs/qwen3-8b.yaml: 5 layers, block 16, its taps);
  random prompt of `--past` tokens, `--new-tokens` decoded per method. Weights do not change the speed.

      python benchmarks/bench_round.py --device cuda --shape qwen3-8b --budgets 16,64,256 --out qwen3_8b.json

  export mode (`--export DIR`): a trained drafter (z-lab export) with the target of `--config`, decoding the
  first `--prompts` GSM8K prompts (chat template) per method: AR step, chain round, DDTree round at `--budgets`,
  with τ and the speedup over AR on those prompts.

      python benchmarks/bench_round.py --device cuda --config configs/smollm2-135m.yaml \
          --export runs/smollm2-135m/train/export --budgets 64 --out smollm2.json

Per method (medians over `--repeats` decodes):
  round      decode wall time / rounds with phase timing off (one host sync per round): what a user gets
  drafter, build+walk, verify
             the same decode with phase timing on (a sync at every phase boundary), per round: the breakdown
             (build+walk = tree build + walk, the round's one read, commit: the overhead around the forwards)
  syncs      host syncs per round: the round's one read + any other (torch.cuda.set_sync_debug_mode), CUDA only
  x AR       round / AR step
`--out` writes the JSON the docs record (docs/results/round-h200/summary.json): under the mode's name
("qwen3_8b" / "tiny" / `--name`), ar_step_ms, verify_ms / round_ms per budget (+ round_ms chain), drafter_ms and
overhead_ms at the largest budget, host_syncs_per_round, and every row in "rows". `--profile-drafter STEPS`
adds where a draft step's time goes: its kernels (CPU ops on a CPU) per step, their total, the step's wall time
and the bound weight bytes / measured copy bandwidth ("drafter_profile" in the JSON). CPU smoke run (seconds):

      python benchmarks/bench_round.py --device cpu --shape tiny --budgets 4,16 --past 32 --new-tokens 16 --out x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_eval_overhead import build_target  # noqa: E402
from eval.engine.decode import decode, warm_up  # noqa: E402
from pipeline.config import BenchmarkConfig, load_config  # noqa: E402
from pipeline.cuda_graphs import GRAPH_LOG, host_syncs  # noqa: E402
from dflash_model.model import DFlashDrafter, DrafterArgs  # noqa: E402

RECIPES = {"qwen3-8b": "configs/qwen3-8b.yaml", "tiny": "configs/tiny.yaml"}  # the drafter recipe of each shape


def recipe_drafter(target, shape: str) -> DFlashDrafter:
    """A random-init drafter of the shape's production recipe (its config's drafter + extract taps)."""
    from extract.layers import configured_layer_ids

    cfg = load_config(REPO / RECIPES[shape])
    config = target.config
    args = DrafterArgs.from_run_config(cfg, config, config.vocab_size - 1,
                                       layer_ids=configured_layer_ids(cfg.extract, config.num_hidden_layers))
    if args.mask_token_id >= config.vocab_size:
        args.mask_token_id = config.vocab_size - 1
    torch.manual_seed(1)
    weight = target.get_input_embeddings().weight
    drafter = DFlashDrafter(args).to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
    drafter.attach_target_head(weight, target.get_output_embeddings().weight)
    return drafter


def count_syncs(run) -> tuple[int, object]:
    """(host syncs during `run()`, its result): pipeline.cuda_graphs.host_syncs."""
    syncs, res = host_syncs(run)
    return len(syncs), res


def host_syncs_per_round(decode_to) -> float:
    """Host syncs per round of a decode, CUDA only: those of a full decode less those of a decode without rounds
    (prefill read, clock reads), per round. The round's own read is one of them: 1.00 is the target."""
    fixed, _ = count_syncs(lambda: decode_to(1))
    total, res = count_syncs(lambda: decode_to(None))
    return (total - fixed) / max(res.num_rounds, 1)


def measure(method: str, budget, target, drafter, prompts: list[list[int]], new_tokens: int, repeats: int,
            cuda: bool) -> dict:
    """One row: medians per round over `repeats` passes over `prompts` (each decoded to `new_tokens`)."""
    max_length = max(len(p) for p in prompts) + new_tokens
    warm_up(method, target, drafter, max_length=max_length, budget=budget)
    captured, fallbacks = GRAPH_LOG.captured, len(GRAPH_LOG.fallbacks)

    def run(prompt, phases: bool, max_new: int | None = None):
        return decode(method, target, drafter, prompt, max_new_tokens=max_new or new_tokens, budget=budget,
                      phase_timing=phases)

    rounds, per_phase, tokens, taus = [], {p: [] for p in ("draft", "tree_build", "verify", "walk_commit")}, [], []
    decode_s = 0.0
    for _ in range(repeats):
        for prompt in prompts:
            res = run(prompt, False)
            rounds.append(res.timings["decode"] / max(res.num_rounds, 1))
            decode_s += res.timings["decode"]
            tokens.append(res.num_new_tokens)
            taus.extend(res.accept_lengths)
            phased = run(prompt, True)
            for p in per_phase:
                per_phase[p].append(phased.timings[p] / max(phased.num_rounds, 1))
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    row = {"method": method, "budget": budget, "label": method if budget is None else f"{method}@{budget}",
           "round_ms": ms(rounds), "drafter_ms": ms(per_phase["draft"]),
           "overhead_ms": ms([b + w for b, w in zip(per_phase["tree_build"], per_phase["walk_commit"])]),
           "verify_ms": ms(per_phase["verify"]), "tau": sum(taus) / max(len(taus), 1),
           "seconds_per_token": decode_s / max(sum(tokens), 1),
           "host_syncs_per_round": host_syncs_per_round(lambda n: run(prompts[0], False, n)) if cuda else None,
           "graphs_captured_while_timed": GRAPH_LOG.captured - captured,
           "graph_fallbacks": GRAPH_LOG.fallbacks[fallbacks:], "verify_path": res.verify_path,
           "draft_path": res.draft_path}
    return row


def print_rows(rows: list[dict], title: str) -> None:
    ar = next(r for r in rows if r["method"] == "ar")["round_ms"]
    print(title)
    head = (f"{'method':>11} {'round ms':>9} {'x AR':>6} {'drafter':>8} {'build+walk':>10} {'verify':>8} "
            f"{'tau':>5} {'speedup':>7} {'syncs':>5} {'late':>4}  paths")
    print(head + "\n" + "-" * len(head))
    ar_spt = next(r for r in rows if r["method"] == "ar")["seconds_per_token"]
    for r in rows:
        syncs = "n/a" if r["host_syncs_per_round"] is None else f"{r['host_syncs_per_round']:.2f}"
        late = r["graphs_captured_while_timed"] + len(r["graph_fallbacks"])
        print(f"{r['label']:>11} {r['round_ms']:9.3f} {r['round_ms'] / ar:6.2f} {r['drafter_ms']:8.3f} "
              f"{r['overhead_ms']:10.3f} {r['verify_ms']:8.3f} {r['tau']:5.2f} "
              f"{ar_spt / r['seconds_per_token']:7.2f} {syncs:>5} {late:>4}  {r['verify_path']}"
              + (f" | drafter: {r['draft_path']}" if r["draft_path"] else ""))
    print("round: phase timing off (what decoding costs); drafter / build+walk / verify: the same decodes with a sync "
          "at every phase boundary, per round. late: graphs captured or fallen back during timing (should be 0).")


def summary(rows: list[dict], budgets: list[int], mode: str) -> dict:
    """The JSON docs/results/round-h200/summary.json records for this mode."""
    by = {r["label"]: r for r in rows}
    top = by[f"ddtree@{max(budgets)}"]
    syncs = [r["host_syncs_per_round"] for r in rows if r["host_syncs_per_round"] is not None]
    out = {"ar_step_ms": by["ar"]["round_ms"],
           "verify_ms": {str(b): by[f"ddtree@{b}"]["verify_ms"] for b in budgets},
           "round_ms": {**{str(b): by[f"ddtree@{b}"]["round_ms"] for b in budgets}, "chain": by["chain"]["round_ms"]},
           "drafter_ms": top["drafter_ms"], "overhead_ms": top["overhead_ms"],
           "host_syncs_per_round": max(syncs) if syncs else None, "rows": rows}
    if mode == "export":  # speed on real prompts: what the eval stage's speedup column measures
        ar = by["ar"]["seconds_per_token"]
        out["round_ms"].update({f"ddtree@{b}": by[f"ddtree@{b}"]["round_ms"] for b in budgets})
        out["speedup_gsm8k"] = ar / top["seconds_per_token"]
        out["tau_gsm8k"] = top["tau"]
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of one device-to-device copy of `nbytes` (read + write counted): the memory a bandwidth-bound
    kernel can hope to stream, measured in this run."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def drafter_bytes(drafter: DFlashDrafter) -> int:
    """Weight bytes one draft step reads: every drafter parameter (layers, fc, norms) and the LM head it shares
    with the target (the embedding rows it gathers are negligible)."""
    own = sum(p.numel() * p.element_size() for p in drafter.parameters())
    head = drafter.lm_head_weight
    return own + head.numel() * head.element_size()


def profile_drafter(drafter: DFlashDrafter, past: int, steps: int, device: torch.device, top: int = 15) -> dict:
    """Where a draft step's time goes: the step (compiled pieces where the round compiles them, no CUDA graph, so
    the profiler sees every kernel) at a context of `past` rows, `steps` times under torch.profiler. Per kernel
    (CPU op on a CPU): calls and time per step; totals: kernels per step, their time, the step's wall time with a
    sync after it, and the lower bound weight bytes / copy bandwidth."""
    from torch.profiler import ProfilerActivity, profile

    from eval.engine.draft_forward import STEP_FNS, DraftForward

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    B, F = drafter.args.block_size, drafter.args.num_taps * drafter.args.hidden_size
    new = 4  # context rows each step appends (a round that accepted 3 tokens)
    draft = DraftForward(drafter, graphs=False, compile="inductor" if cuda else None)
    draft.reset(past + new * (steps + 8) + B)
    gen = torch.Generator(device=device).manual_seed(0)
    draft.prefill(torch.randn(past, F, generator=gen, device=device, dtype=draft.dtype))
    rows = torch.randn(B, F, generator=gen, device=device, dtype=draft.dtype)
    bonus = torch.zeros(1, dtype=torch.long, device=device)
    for _ in range(4):  # compile (and check) outside the profile
        draft(rows, bonus, draft.length + new)
    sync()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        draft(rows, bonus, draft.length + new)
        sync()
        walls.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            draft(rows, bonus, draft.length + new)
        sync()
    kernels = []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if us > 0 and (not cuda or getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU):
            kernels.append({"kernel": e.key, "calls_per_step": e.count / steps, "us_per_step": us / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    total_us = sum(k["us_per_step"] for k in kernels)
    nbytes, bw = drafter_bytes(drafter), copy_bandwidth(device)
    return {"past": past, "steps": steps, "compiled": draft.fns is not STEP_FNS,
            "kernels_per_step": sum(k["calls_per_step"] for k in kernels), "kernel_ms": total_us / 1e3,
            "step_wall_ms": 1e3 * statistics.median(walls), "weight_bytes": nbytes, "copy_bandwidth_gbs": bw / 1e9,
            "weight_read_ms": 1e3 * nbytes / bw, "top": kernels[:top]}


def print_profile(p: dict) -> None:
    print(f"\ndraft step profile: context {p['past']} rows, {p['steps']} steps, no CUDA graph "
          f"({'compiled pieces' if p['compiled'] else 'plain pieces'})")
    print(f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel")
    for k in p["top"]:
        print(f"{k['us_per_step']:9.1f} {k['us_per_step'] / 1e3 / max(p['kernel_ms'], 1e-9):6.1%} "
              f"{k['calls_per_step']:6.1f}  {k['kernel'][:110]}")
    print(f"{p['kernels_per_step']:.0f} kernels per step, {p['kernel_ms']:.3f} ms of kernel time; step wall (synced) "
          f"{p['step_wall_ms']:.3f} ms; weights {p['weight_bytes'] / 1e9:.2f} GB at the measured copy bandwidth "
          f"{p['copy_bandwidth_gbs']:.0f} GB/s = {p['weight_read_ms']:.3f} ms (the bound)")


def gsm8k_prompts(tokenizer, n: int, enable_thinking: bool) -> list[list[int]]:
    from eval.prompts import chat_prompt_ids, load_benchmark
    from pipeline.datasets import locate

    gsm8k = BenchmarkConfig(name="gsm8k", hub="openai/gsm8k", subset="main", split="test", file="gsm8k_test.jsonl",
                            num_samples=n)  # the mirror's copy ($DRAFTER_DATA_DIR), else the hub's (docs/data.md)
    bench = load_benchmark(gsm8k, locate(gsm8k, "gsm8k", "gsm8k", data_dir=None, cache_dir=REPO / ".cache"))
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}], enable_thinking=enable_thinking)
            for p in bench.prompts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(RECIPES), default="qwen3-8b", help="shape mode: the target shape")
    ap.add_argument("--export", help="export mode: a trained drafter's z-lab export dir (target from --config)")
    ap.add_argument("--config", help="export mode: the run config whose target the drafter was trained for")
    ap.add_argument("--name", default=None, help="key of the JSON (default: qwen3_8b / tiny / smollm2)")
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--past", type=int, default=1024, help="shape mode: prompt tokens (committed context)")
    ap.add_argument("--prompts", type=int, default=8, help="export mode: GSM8K prompts decoded per method")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompts per method")
    ap.add_argument("--profile-drafter", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS draft steps kernel by kernel (no CUDA graph) at the context of the "
                         "first prompt; 0 = off")
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args()

    device = torch.device(args.device)
    budgets = [int(b) for b in args.budgets.split(",")]
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.export:
        from eval.drafter_inputs import load_drafter
        from pipeline.target import load_target, open_target

        if not args.config:
            ap.error("--export needs --config (the run config of the drafter's target)")
        cfg = load_config(args.config)
        opened = open_target(cfg.target, REPO / cfg.cache_dir)  # (an absolute cache_dir stays as it is)
        target = load_target(opened.location, cfg.target, device=device)
        drafter, _ = load_drafter(Path(args.export), target, device)
        prompts = gsm8k_prompts(opened.tokenizer, args.prompts, cfg.target.enable_thinking)
        mode, name = "export", args.name or "smollm2"
        title = (f"{cfg.target.model} ({target.dtype}) on {device} with the drafter {args.export}: {len(prompts)} "
                 f"GSM8K prompts x {args.repeats}, {args.new_tokens} new tokens each")
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        target = build_target(args.shape, device, dtype)
        drafter = recipe_drafter(target, args.shape)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab_size - 1, (args.past,), generator=gen).tolist()]
        mode, name = "shape", args.name or args.shape.replace("-", "_")
        title = (f"random-init {args.shape} target ({dtype}) on {device}, drafter of {RECIPES[args.shape]} "
                 f"({drafter.args.num_hidden_layers} layers, block {drafter.args.block_size}), past {args.past}, "
                 f"{args.new_tokens} new tokens x {args.repeats}")
    cuda = device.type == "cuda"
    with torch.inference_mode():
        rows = [measure(m, b, target, drafter, prompts, args.new_tokens, args.repeats, cuda)
                for m, b in [("ar", None), ("chain", None)] + [("ddtree", b) for b in budgets]]
    print_rows(rows, title)
    result = {name: summary(rows, budgets, mode)}
    if args.profile_drafter > 0:
        with torch.inference_mode():
            prof = profile_drafter(drafter, len(prompts[0]), args.profile_drafter, device)
        print_profile(prof)
        result[name]["drafter_profile"] = prof
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
