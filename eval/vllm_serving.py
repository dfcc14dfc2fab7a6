"""Serving our DFlash export in vLLM's engine, checked against this project's own model and decoding.

The export users deploy (`train/export.py`, the z-lab layout) is served by vLLM with
``speculative_config={"method": "dflash", "model": <export>, "num_speculative_tokens": B-1}``. `serve` runs that
engine (or the plain target, ``drafter_dir=None``) in a child process of this module — vLLM's CPU worker pins the
threads of the process it runs in, and the drafter capture needs the engine in-process — on prompts given as token
ids, one request at a time (prefix caching off), greedy, and reads back a `Served`:

    outputs          [[token ids]] per prompt (the stop token included when one ended the response)
    seconds          [wall seconds] per prompt (after `warmup` untimed requests)
    accepted, drafts, drafted  [int] per prompt: vLLM's spec-decode counters over that request (accepted draft
                     tokens, verify steps, drafted tokens); per_position [[int]]: accepted tokens per draft position
    per_step_accepted  [[int]] per prompt and verify step, where the engine reports it (vLLM >= 0.32), else None
    calls            [(prompt index, block start position)] of every drafter forward (with ``capture``)
    hidden           {"call{i}.hidden": [B, D]}: the drafter's final-normed hidden states of each captured forward
                     (the bonus row + B-1 mask rows), from vLLM's own drafter model (``capture``: eager engines only,
                     a CUDA graph replays without calling the Python forward)

and, against our drafter on the same contexts:

    logits_on_served_contexts(drafter, target, prompts, served) -> [(i, start, ours [B-1, V], vLLM's [B-1, V])]
    relative_error(pairs)   mean over forwards of max |ours - vLLM| / max |ours| (the logit scale)
    near_tie_flips(pairs)   drafted slots compared, and argmax flips that are not near ties
    semantics_check(...)    the trained attention semantics against their nearest wrong neighbours (window W-1 / W+1,
                            causal / bidirectional swapped): vLLM's drafter must be closest to the trained one

vLLM's acceptance length is ``1 + accepted / drafts`` (eval.metrics' tau over the same verify steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Served:
    outputs: list[list[int]]
    seconds: list[float]
    accepted: list[int]
    drafts: list[int]
    drafted: list[int]
    per_position: list[list[int]]
    per_step_accepted: list[list[int]] | None
    calls: list[tuple[int, int]]
    hidden: dict
    engine: dict  # vLLM version, runner, eager, dtype: what served

    @property
    def acceptance_length(self) -> float:
        """Pooled over all verify steps: 1 + accepted drafts / steps (tau); 1.0 without drafts."""
        steps = sum(self.drafts)
        return 1.0 + sum(self.accepted) / steps if steps else 1.0

    @property
    def position_rates(self) -> list[float]:
        """Per draft position k: the share of verify steps that accepted a k-th drafted token."""
        steps = sum(self.drafts)
        width = max((len(p) for p in self.per_position), default=0)
        return [sum(p[k] for p in self.per_position if k < len(p)) / steps if steps else 0.0 for k in range(width)]


def serve(target_dir: str, prompts: Sequence[Sequence[int]], out_dir: Path, *, drafter_dir: str | None = None,
          max_tokens: int, stop: Sequence[int] = (), device: str = "cpu", eager: bool = True, capture: bool = False,
          v2_runner: bool = False, warmup: int = 0, gpu_memory_utilization: float = 0.3,
          timeout: float = 1800) -> Served:
    """Serve ``prompts`` with vLLM in a child process (see the module doc); raises RuntimeError with vLLM's last
    error lines when the engine refuses or fails."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prompts.json").write_text(json.dumps([list(map(int, p)) for p in prompts]))
    args = [sys.executable, "-m", "eval.vllm_serving", "--target", str(target_dir), "--prompts",
            str(out_dir / "prompts.json"), "--max-tokens", str(max_tokens), "--out", str(out_dir), "--device", device,
            "--warmup", str(warmup), "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--stop", *map(str, stop)]
    if drafter_dir is not None:
        args += ["--drafter", str(drafter_dir)]
    args += ["--eager"] if eager else []
    args += ["--capture"] if capture else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    if v2_runner:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    (out_dir / "engine.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        raise RuntimeError("vLLM could not serve: " + " | ".join(lines[-3:]))
    result = json.loads((out_dir / "result.json").read_text())
    hidden = load_file(str(out_dir / "capture.safetensors")) if capture else {}
    return Served(hidden=hidden, **{f.name: result[f.name] for f in dataclasses.fields(Served) if f.name != "hidden"})


# ----------------------------------------------------------------------------------------------
# Our drafter on vLLM's contexts
# ----------------------------------------------------------------------------------------------


def logits_on_served_contexts(drafter, target, prompts: Sequence[Sequence[int]], served: Served) -> list[tuple]:
    """Per captured drafter forward (prompt i, block start s): (i, s, ours [B-1, V], vLLM's [B-1, V]), fp32 on CPU.

    Ours: `draft_logits` on the HF target's taps of the response's tokens before s with bonus = token s. vLLM's: its
    drafter's final-normed hidden states of slots 1..B-1 through the same (target) LM head, as vLLM computes them.
    Forwards whose block starts past the returned tokens (the drafts after the last step) are skipped.
    """
    from extract.layers import forward_taps

    device = target.get_input_embeddings().weight.device
    dtype = next(drafter.parameters()).dtype
    pairs, feats = [], {}
    for call, (i, start) in enumerate(served.calls):
        tokens = list(prompts[i]) + served.outputs[i]
        if start >= len(tokens):
            continue
        if i not in feats:
            feats[i] = forward_taps(target, torch.tensor(tokens, device=device)[None], drafter.args.target_layer_ids)
        with torch.no_grad():
            ours = drafter.draft_logits(drafter.new_cache(), feats[i][:, :start].to(dtype), tokens[start], start)
            theirs = drafter.logits(served.hidden[f"call{call}.hidden"][1:].to(device, dtype))
        pairs.append((i, start, ours.float().cpu(), theirs.float().cpu()))
    return pairs


def relative_error(pairs) -> float:
    """Mean over forwards of max |ours - vLLM| / max |ours| (the logit scale)."""
    return sum(float((o - t).abs().max() / o.abs().max()) for _, _, o, t in pairs) / max(len(pairs), 1)


def near_tie_flips(pairs) -> tuple[int, list]:
    """(drafted slots compared, slots whose argmax differs without being a near tie: our two candidates' logit gap
    above twice |ours - vLLM| at that slot)."""
    compared, unexplained = 0, []
    for i, start, ours, theirs in pairs:
        a, b = ours.argmax(-1), theirs.argmax(-1)
        compared += len(a)
        for k in torch.nonzero(a != b).flatten().tolist():
            gap = float(ours[k, a[k]] - ours[k, b[k]])
            if gap > 2 * float((ours[k] - theirs[k]).abs().max()):
                unexplained.append((i, start, k + 1, gap))
    return compared, unexplained


def with_semantics(drafter, target, **changes):
    """The same weights under other attention settings (`DrafterArgs` fields: layer_types / sliding_window)."""
    from dflash_model.model import DFlashDrafter

    other = DFlashDrafter(replace(drafter.args, **changes)).to(next(drafter.parameters()))
    other.load_state_dict(drafter.state_dict())
    other.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return other.eval().requires_grad_(False)


def nearest_wrong_semantics(args) -> dict[str, dict]:
    """The attention settings one mistake away from ``args`` (`DrafterArgs`), by name: a window one shorter / one
    longer, the sliding layers run as full (bidirectional) attention; a drafter of full layers only: run causally
    (a window longer than any sequence)."""
    from dflash_model.blocks import FULL, SLIDING

    types = list(args.layer_types)
    if SLIDING not in types:
        return {"full as causal": dict(layer_types=[SLIDING] * len(types), sliding_window=10 ** 6)}
    return {"window W-1": dict(sliding_window=args.sliding_window - 1),
            "window W+1": dict(sliding_window=args.sliding_window + 1),
            "sliding as bidirectional": dict(layer_types=[FULL] * len(types), sliding_window=None)}


def semantics_check(drafter, target, prompts, served: Served) -> dict:
    """vLLM's drafter logits against ours under the trained semantics and under each `nearest_wrong_semantics`:
    relative error of each, and on how many captured forwards vLLM is closer to the trained one than to each
    neighbour. ``passed``: every neighbour is farther on >= 90 % of the forwards and >= 1.4x farther on average
    (a window off by one or a causal/bidirectional swap inside the engine fails it)."""
    pairs = logits_on_served_contexts(drafter, target, prompts, served)
    err = relative_error(pairs)
    report = {"forwards": len(pairs), "relative_error": err, "neighbours": {}, "passed": bool(pairs)}
    for name, changes in nearest_wrong_semantics(drafter.args).items():
        other = logits_on_served_contexts(with_semantics(drafter, target, **changes), target, prompts, served)
        closer = sum(float((t - o).abs().max()) < float((t - a).abs().max())
                     for (_, _, o, t), (_, _, a, _) in zip(pairs, other))
        e = relative_error(other)
        ok = closer >= 0.9 * len(pairs) and e >= 1.4 * err
        report["neighbours"][name] = {"relative_error": e, "trained_closer": closer, "passed": ok}
        report["passed"] = report["passed"] and ok
    compared, unexplained = near_tie_flips(pairs)
    report.update(slots_compared=compared, unexplained_flips=len(unexplained))
    return report


# ----------------------------------------------------------------------------------------------
# The child process: one engine, prompts one at a time
# ----------------------------------------------------------------------------------------------


def _counters(llm) -> dict:
    """vLLM's spec-decode counters now: {"num_drafts": n, "num_accepted_tokens": n, "num_accepted_tokens_per_pos": [..]}."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            out[m.name[len("vllm:spec_decode_"):]] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _worker(args) -> None:
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:  # vLLM's torch sampler, not its FlashInfer one it can't import
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    calls: list[tuple[int, int]] = []
    hidden: dict[str, torch.Tensor] = {}
    request = [-1]  # start-up runs dummy drafter forwards: not captured
    if args.capture:
        from vllm.model_executor.models import qwen3_dflash

        forward = qwen3_dflash.DFlashQwen3ForCausalLM.forward

        def capture(self, input_ids, positions, inputs_embeds=None):  # observe vLLM's own drafter forward
            out = forward(self, input_ids, positions, inputs_embeds)
            if request[0] >= 0:
                hidden[f"call{len(calls)}.hidden"] = out.detach().float().cpu().clone()
                calls.append((request[0], int(positions[0])))
            return out

        qwen3_dflash.DFlashQwen3ForCausalLM.forward = capture
    longest = max(len(p) for p in prompts) + args.max_tokens
    kwargs = dict(model=args.target, dtype="float32" if args.device == "cpu" else "bfloat16",
                  max_model_len=longest + 64, max_num_seqs=1, enforce_eager=args.eager, seed=0,
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                  disable_log_stats=False)
    if args.device == "cpu":  # an explicit KV cache: the default share of a NUMA node's memory can be below zero
        kwargs["kv_cache_memory_bytes"] = 256 << 20
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    if args.drafter:
        block_size = json.loads((Path(args.drafter) / "config.json").read_text())["block_size"]
        kwargs["speculative_config"] = {"method": "dflash", "model": args.drafter,
                                        "num_speculative_tokens": block_size - 1}
        if "per_request_spec_decode_metrics" in fields:  # per-step arrays (vLLM >= 0.32)
            kwargs["per_request_spec_decode_metrics"] = "detailed"
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=args.stop, detokenize=False)
    for ids in prompts[: args.warmup]:
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    result = {k: [] for k in ("outputs", "seconds", "accepted", "drafts", "drafted", "per_position")}
    per_step = [] if "per_request_spec_decode_metrics" in kwargs else None
    for i, ids in enumerate(prompts):
        before = _counters(llm) if args.drafter else {}
        request[0] = i
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        result["seconds"].append(time.perf_counter() - t)
        request[0] = -1
        c = out.outputs[0]
        result["outputs"].append(list(c.token_ids))
        after = _counters(llm) if args.drafter else {}
        result["accepted"].append(int(after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)))
        result["drafts"].append(int(after.get("num_drafts", 0) - before.get("num_drafts", 0)))
        result["drafted"].append(int(after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)))
        result["per_position"].append([int(a - b) for a, b in zip(after.get("num_accepted_tokens_per_pos", []),
                                                                   before.get("num_accepted_tokens_per_pos", []))])
        if per_step is not None:
            metrics = getattr(c, "spec_decode_metrics", None)
            per_step.append(list(metrics.per_step_accepted) if metrics else [])
    result.update(per_step_accepted=per_step, calls=calls,
                  engine={"vllm": vllm.__version__, "device": args.device, "eager": args.eager,
                          "dtype": kwargs["dtype"], "v2_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1",
                          "speculative": bool(args.drafter)})
    out_dir = Path(args.out)
    if args.capture:
        save_file(hidden, str(out_dir / "capture.safetensors"))
    (out_dir / "result.json").write_text(json.dumps(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="serve prompts with vLLM (used by eval.vllm_serving.serve)")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--stop", type=int, nargs="*", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--capture", action="store_true")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    _worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
