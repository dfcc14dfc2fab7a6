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
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save

from extract.layers import default_layer_ids, validate_layer_ids
from pipeline.config import ConfigError
from pipeline.errors import DamagedFile
from pipeline.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from pipeline.records import BOOL, INT, NUMBER, OBJECT, STR, FieldProblem, check, kind_of, read_record
from pipeline.records import Optional as Maybe
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


# ----------------------------------------------------------------------------------------------
# Reading an export: the one validator (config fields, types, sizes; safetensors headers against the file and the
# config's shapes), run before any tensor is allocated
# ----------------------------------------------------------------------------------------------

REPAIR = ("It is not a complete DFlash drafter in the z-lab layout: export it again (a finished `drafter train` "
          "writes runs/<run>/train/export; `drafter train --force` retrains), or set eval.drafter to such a directory")
MAX_BLOCK_SIZE = 1024  # B: DFlash drafters use 8-16; beyond this every per-round buffer is absurd
MAX_LAYERS = 1024  # draft (and target) decoder layers
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (safetensors' own limit)
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # float weights only: what export_zlab writes
# config.json fields this loader reads (pipeline/records.py shape); others (the Qwen3 extras) are ignored
CONFIG_FIELDS = {
    "architectures": [STR], "model_type": STR, "hidden_size": INT, "num_hidden_layers": INT,
    "num_attention_heads": INT, "num_key_value_heads": Maybe(INT), "head_dim": Maybe(INT),
    "intermediate_size": INT, "vocab_size": INT, "block_size": INT, "num_target_layers": INT,
    "rms_norm_eps": Maybe(NUMBER), "rope_theta": Maybe(NUMBER), "rope_scaling": Maybe(OBJECT),
    "rope_parameters": Maybe({"rope_type": Maybe(STR), "rope_theta": Maybe(NUMBER)}),
    "dflash_config": {"mask_token_id": INT, "target_layer_ids": Maybe([INT])},
    "layer_types": Maybe([STR]), "sliding_window": Maybe(INT), "use_sliding_window": Maybe(BOOL),
    "max_window_layers": Maybe(INT), "hidden_act": Maybe(STR), "attention_bias": Maybe(BOOL),
}
# (field, low, high) of every size; the weights' shapes follow from these and must equal the file's
SIZE_RANGES = [("hidden_size", 1, None), ("num_hidden_layers", 1, MAX_LAYERS), ("num_attention_heads", 1, None),
               ("num_key_value_heads", 1, None), ("head_dim", 1, None), ("intermediate_size", 1, None),
               ("vocab_size", 1, None), ("block_size", 2, MAX_BLOCK_SIZE), ("num_target_layers", 1, MAX_LAYERS),
               ("sliding_window", 1, None), ("max_window_layers", 0, None)]


def args_from_zlab_config(config: dict, path: str | Path = CONFIG_NAME) -> DrafterArgs:
    """DrafterArgs of a z-lab config.json (ours or z-lab's / SpecForge's): every field it reads of its JSON type,
    every size in range, an unsupported variant refused — a DamagedFile naming `path` and the field otherwise."""
    def refuse(problem: str):
        return DamagedFile(path, problem, REPAIR)

    try:
        check(config, CONFIG_FIELDS)
    except FieldProblem as e:
        raise refuse(str(e)) from None
    if ARCHITECTURE not in config["architectures"]:
        raise refuse(f"not a DFlash drafter: architectures {config['architectures']} lack {ARCHITECTURE!r}")
    if config["model_type"] != "qwen3":
        raise refuse(f"DFlash drafters are Qwen3 layouts; got model_type {config['model_type']!r}")
    for key, ok in [("hidden_act", "silu"), ("attention_bias", False)]:
        if config.get(key, ok) != ok:
            raise refuse(f"unsupported {key}={config[key]!r} (expected {ok!r})")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or rope.get("rope_type", "default") != "default":
        raise refuse(f"unsupported RoPE scaling {scaling or rope} (this loader runs the default RoPE only)")
    for key, low, high in SIZE_RANGES:
        value = config.get(key)
        if value is not None and not (low <= value and (high is None or value <= high)):
            raise refuse(f"{key} {value} is out of range (>= {low}" + (f", <= {high})" if high else ")"))
    for key in ("rms_norm_eps", "rope_theta"):
        if config.get(key) is not None and config[key] <= 0:
            raise refuse(f"{key} {config[key]} must be > 0")
    if rope.get("rope_theta") is not None and rope["rope_theta"] <= 0:
        raise refuse(f"rope_parameters.rope_theta {rope['rope_theta']} must be > 0")
    dflash = config["dflash_config"]
    layers = config["num_hidden_layers"]
    try:
        layer_ids = validate_layer_ids(dflash.get("target_layer_ids") or
                                       default_layer_ids(config["num_target_layers"], layers),
                                       config["num_target_layers"])
    except ValueError as e:
        raise refuse(f"dflash_config.target_layer_ids: {e}") from None
    layer_types = config.get("layer_types")
    if not layer_types:  # HF Qwen3 rule: sliding from layer max_window_layers on, when use_sliding_window
        use = config.get("use_sliding_window") and config.get("sliding_window")
        first = config.get("max_window_layers", layers)
        layer_types = [SLIDING if use and i >= first else FULL for i in range(layers)]
    heads = config["num_attention_heads"]
    try:
        return DrafterArgs(
            hidden_size=config["hidden_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or max(1, config["hidden_size"] // heads),
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            vocab_size=config["vocab_size"],
            block_size=config["block_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=layer_ids,
            num_target_layers=config["num_target_layers"],
            layer_types=list(layer_types),
            sliding_window=config.get("sliding_window") if SLIDING in layer_types else None,
        )
    except ConfigError as e:  # DrafterArgs' own rules: heads vs kv heads, layer types, mask id in the vocabulary
        raise refuse(str(e).removeprefix("drafter.")) from None


def zlab_shapes(args: DrafterArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the z-lab layout of `args` and its shape, from the sizes alone (nothing is built):
    DFlashDrafter(args).state_dict() has exactly these (tests/dflash_model/test_export_zlab_layout.py)."""
    D, hd, I = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    shapes = {"fc.weight": (D, args.num_taps * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(args.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
                       p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                       p + "mlp.down_proj.weight": (D, I), p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,)})
    return shapes


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} of a safetensors file, checked against the file before anything is
    read into memory: a regular file, a header of at most MAX_HEADER_BYTES that fits the file, float dtypes, shapes
    of non-negative integers, each tensor's byte range exactly its shape's size, the ranges tiling the data section
    to the last byte (a truncated, extended or lying file is a DamagedFile naming it)."""
    def refuse(problem: str):
        return DamagedFile(path, problem, REPAIR)

    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise refuse("not a regular file")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise refuse(f"{st.st_size} bytes: shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
            raise refuse(f"header length {n:,} bytes does not fit the file ({st.st_size:,} bytes; at most "
                         f"{MAX_HEADER_BYTES:,})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise refuse(f"safetensors header is not JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise refuse(f"safetensors header holds {kind_of(header)}, not an object")
    header.pop("__metadata__", None)
    data_size, ranges = st.st_size - 8 - n, []
    for name, spec in header.items():
        try:
            check(spec, {"dtype": STR, "shape": [INT], "data_offsets": [INT]})
        except FieldProblem as e:
            raise refuse(f"tensor {name!r}: {e}") from None
        shape, offsets = spec["shape"], spec["data_offsets"]
        if spec["dtype"] not in SAFETENSORS_DTYPES:
            raise refuse(f"tensor {name!r}: dtype {spec['dtype']!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
        if any(d < 0 for d in shape) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
            raise refuse(f"tensor {name!r}: shape {shape} / data_offsets {offsets} are not a byte range of a tensor")
        if offsets[1] > data_size:
            raise refuse(f"tensor {name!r}: data_offsets {offsets} end outside the file's {data_size:,} data bytes "
                         "(the file is truncated or extended, or its header lies)")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[spec["dtype"]]:
            raise refuse(f"tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]:,} bytes, its shape "
                         f"{shape} {spec['dtype']} needs {math.prod(shape) * SAFETENSORS_DTYPES[spec['dtype']]:,}")
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for lo, hi, name in sorted(ranges):
        if lo != end:
            raise refuse(f"tensor {name!r} starts at byte {lo:,} of the data, the previous one ends at {end:,} "
                         "(overlapping or a gap)")
        end = hi
    if end != data_size:
        raise refuse(f"the tensors end at data byte {end:,}, the file holds {data_size:,} (truncated or extended)")
    return header


@dataclass(frozen=True)
class ExportFiles:
    """A drafter export checked by `read_export`: its directory, config.json, args and weight files."""

    path: Path
    config: dict
    args: DrafterArgs
    weights: list[Path]


def read_export(path: str | Path) -> ExportFiles:
    """Check a drafter directory in the z-lab layout without allocating a tensor: config.json (fields, types,
    sizes; `args_from_zlab_config`), every *.safetensors header against its file (`read_safetensors_header`), and the
    tensors together against the config: exactly the names of `zlab_shapes(args)`, each of its shape. Every
    refusal is a DamagedFile naming the file and what to do."""
    root = Path(path)
    config_path = root / CONFIG_NAME
    if not config_path.is_file():
        raise DamagedFile(config_path, "missing", REPAIR)
    config = read_record(config_path, OBJECT, repair=REPAIR)
    args = args_from_zlab_config(config, config_path)
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise DamagedFile(root / WEIGHTS_NAME, "missing (no *.safetensors in the directory)", REPAIR)
    expected, found = zlab_shapes(args), {}
    for w in weights:
        for name, spec in read_safetensors_header(w).items():
            if name in found:
                raise DamagedFile(w, f"tensor {name!r} is also in {found[name][0].name}", REPAIR)
            found[name] = (w, tuple(spec["shape"]))
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise DamagedFile(weights[0] if len(weights) == 1 else root, "the weights do not match config.json: "
                          f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                          f"{' ...' if len(unexpected) > 4 else ''}", REPAIR)
    for name, shape in expected.items():
        if found[name][1] != shape:
            raise DamagedFile(found[name][0], f"tensor {name!r} has shape {list(found[name][1])}, config.json "
                              f"implies {list(shape)}", REPAIR)
    return ExportFiles(root, config, args, weights)


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

    `read_export` checks it first (nothing is allocated before the config, the headers and the shapes agree). Returns
    the drafter in the stored dtype, on CPU, without the target head: call `attach_target_head` before running it.
    """
    export = read_export(resolve_drafter_dir(path, revision))
    state: dict[str, torch.Tensor] = {}
    for f in export.weights:
        state.update(load_file(str(f)))
    with torch.device("meta"):
        drafter = DFlashDrafter(export.args)
    drafter.load_state_dict(state, assign=True)
    return drafter, export.args
