"""The z-lab DFlash checkpoint layout, in and out (what vLLM / SGLang / z-lab's `dflash` load).

    <dir>/config.json        Qwen3 config + architectures ["DFlashDraftModel"], block_size, num_target_layers,
                             dflash_config {mask_token_id, target_layer_ids}, layer_types / sliding_window /
                             use_sliding_window
    <dir>/model.safetensors  fc.weight, hidden_norm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
                             layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
                             layers.{i}.{input,post_attention}_layernorm.weight, norm.weight
                             -- never the embedding or the LM head (the target's are used at runtime)
    <dir>/README.md          the model card (dflash_model/card.py): Hub metadata, layout, tapped layers, training data,
                             how vLLM / SGLang serve it, the eval results (rewritten by `drafter eval`)

Parameter names are `DFlashDrafter`'s own (dflash_model/model.py uses the z-lab names), so this module maps 1:1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save

from extract.layers import default_layer_ids
from pipeline.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from dflash_model.blocks import FULL, SLIDING
from dflash_model.card import CARD_NAME, model_card
from dflash_model.model import DFlashDrafter, DrafterArgs

ARCHITECTURE = "DFlashDraftModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# RoPE has no table, so this only tells serving engines how long a context the drafter accepts.
MAX_POSITION_EMBEDDINGS = 262144
FROZEN_NAMES = ("embed_tokens", "lm_head", "embed_weight", "lm_head_weight")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def zlab_config(args: DrafterArgs, dtype: torch.dtype) -> dict:
    """config.json of the z-lab layout for `args` (tensors stored in `dtype`)."""
    sliding = SLIDING in args.layer_types
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": args.block_size,
        "dflash_config": {"mask_token_id": args.mask_token_id, "target_layer_ids": list(args.target_layer_ids)},
        "dtype": DTYPE_NAMES[dtype],
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": args.intermediate_size,
        "layer_types": list(args.layer_types),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_hidden_layers": args.num_hidden_layers,
        "num_key_value_heads": args.num_key_value_heads,
        "num_target_layers": args.num_target_layers,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": args.rope_theta,
        "sliding_window": args.sliding_window if sliding else None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": sliding,
        "vocab_size": args.vocab_size,
    }


def export_zlab(drafter: DFlashDrafter, args: DrafterArgs, out_dir: str | Path, dtype: Optional[torch.dtype] = None,
                *, target: str | None = None, training: dict | None = None) -> Path:
    """Write `drafter` (full, un-partitioned parameters) to `out_dir` in the z-lab layout with its model card; returns
    the dir.

    Files are written atomically, config.json last (its presence marks a complete export). `dtype` casts the
    stored tensors (default: the parameters' dtype). `target` (the target model it drafts for) and `training` (what
    it was trained on: `dflash_model.card.model_card`) go into the card.
    """
    out = Path(out_dir)
    state = drafter.state_dict()
    leaked = [k for k in state if any(f in k for f in FROZEN_NAMES)]
    if leaked:
        raise ValueError(f"refusing to export frozen target tensors: {leaked}")
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}
    atomic_write_bytes(out / WEIGHTS_NAME, save(tensors, metadata={"format": "pt"}))
    atomic_write_text(out / CARD_NAME, model_card(args, target=target, training=training))
    atomic_write_json(out / CONFIG_NAME, zlab_config(args, dtype))
    return out


def args_from_zlab_config(config: dict) -> DrafterArgs:
    """DrafterArgs of a z-lab config.json (ours or z-lab's / SpecForge's); unsupported variants raise."""
    if ARCHITECTURE not in config.get("architectures", []):
        raise ValueError(f"not a DFlash drafter: architectures {config.get('architectures')} lack {ARCHITECTURE!r}")
    if config.get("model_type") != "qwen3":
        raise ValueError(f"DFlash drafters are Qwen3 layouts; got model_type {config.get('model_type')!r}")
    for key, ok in [("hidden_act", "silu"), ("attention_bias", False)]:
        if config.get(key, ok) != ok:
            raise ValueError(f"unsupported {key}={config[key]!r} (expected {ok!r})")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported RoPE scaling {scaling or rope}")
    dflash = config.get("dflash_config") or {}
    if dflash.get("mask_token_id") is None:
        raise ValueError("dflash_config.mask_token_id is missing: the mask token must be explicit")
    layers = config["num_hidden_layers"]
    layer_ids = dflash.get("target_layer_ids") or default_layer_ids(config["num_target_layers"], layers)
    layer_types = config.get("layer_types")
    if not layer_types:  # HF Qwen3 rule: sliding from layer max_window_layers on, when use_sliding_window
        use = config.get("use_sliding_window") and config.get("sliding_window")
        first = config.get("max_window_layers", layers)
        layer_types = [SLIDING if use and i >= first else FULL for i in range(layers)]
    return DrafterArgs(
        hidden_size=config["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        vocab_size=config["vocab_size"],
        block_size=config["block_size"],
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=[int(i) for i in layer_ids],
        num_target_layers=config["num_target_layers"],
        layer_types=list(layer_types),
        sliding_window=config.get("sliding_window") if SLIDING in layer_types else None,
    )


def resolve_drafter_dir(path: str | Path, revision: Optional[str]) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    if p.exists() or str(path).startswith((".", "/")) or str(path).count("/") != 1:
        raise FileNotFoundError(f"{path}: not a drafter directory (expected {CONFIG_NAME} + {WEIGHTS_NAME})")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), revision=revision, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # offline, unknown repo, gated: say what was tried
        raise FileNotFoundError(f"{path}: no local directory and the hub download failed ({e})") from e


def load_zlab(path: str | Path, revision: Optional[str] = None) -> tuple[DFlashDrafter, DrafterArgs]:
    """Load a drafter in the z-lab layout from a local dir or a hub id (safetensors only, no code execution).

    The parameter set must match exactly (missing/unexpected names raise). Returns the drafter in the stored
    dtype, on CPU, without the target head: call `attach_target_head` before running it.
    """
    root = resolve_drafter_dir(path, revision)
    config = json.loads((root / CONFIG_NAME).read_text())
    args = args_from_zlab_config(config)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    with torch.device("meta"):
        drafter = DFlashDrafter(args)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{root}: weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in drafter.state_dict().items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{root}: {name} has shape {tuple(state[name].shape)}, config implies {tuple(tensor.shape)}")
    drafter.load_state_dict(state, assign=True)
    return drafter, args
