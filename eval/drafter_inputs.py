"""Which drafter an eval scores, and whether it fits the target: its directory (`eval.drafter`, or this run's train
export), the train manifest beside it (`pipeline.manifests.train_outputs`), the fit with the target (taps, hidden
size, vocabulary, mask id; the tokenizer it was trained with), and the drafter loaded onto the target.

A drafter that does not fit is refused before anything decodes, with a StageError naming every field that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extract.layers import validate_layer_ids
from pipeline.config import RunConfig
from pipeline.errors import StageError
from pipeline.files import read_json, sha256_file
from pipeline.log import get_logger
from pipeline.manifests import TrainedDrafter, train_outputs
from pipeline.stage_dir import check_fingerprint
from pipeline.target import text_config

log = get_logger("eval")


def drafter_dir(cfg: RunConfig) -> Path:
    """`eval.drafter` (a local dir, or a hub id resolved by dflash_model.export), else this run's train export."""
    if cfg.eval.drafter:
        from dflash_model.export import resolve_drafter_dir

        path = resolve_drafter_dir(cfg.eval.drafter, None)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"eval.drafter: {path} is not a drafter directory (no config.json)")
        return path
    path = cfg.run_dir / "train" / "export"
    if not (path / "config.json").is_file():
        raise StageError(
            f"no drafter to evaluate: {path} does not exist. Run `drafter train` for run '{cfg.name}' first, "
            "or set eval.drafter to a drafter directory in the z-lab DFlash layout"
        )
    return path


def trained_drafter(drafter_path: Path) -> TrainedDrafter | None:
    """The train stage that produced an export dir (runs/<run>/train/export -> runs/<run>/train), if any: its
    manifest read through the stage contract (a damaged one is a StageError naming the file). A manifest of another
    stage beside a drafter directory is not its train manifest."""
    manifest = drafter_path.parent / "manifest.json"
    if drafter_path.name != "export" or not manifest.is_file():
        return None
    m = read_json(manifest)
    if not isinstance(m, dict) or m.get("stage") != "train":
        return None
    return train_outputs(drafter_path.parent)


def drafter_sha(path: Path) -> str:
    files = sorted(path.glob("*.safetensors")) + [path / "config.json"]
    return "".join(sha256_file(f)[:16] for f in files)


def check_drafter_tokenizer(tokenizer_fp: dict, trained: TrainedDrafter | None, drafter_path: Path) -> None:
    """Refuse a drafter trained with another tokenizer than the target's (a FingerprintMismatch naming the field);
    without a train manifest beside the export it cannot be checked, and the log says so."""
    if trained is not None and trained.tokenizer is not None:
        check_fingerprint({"tokenizer": tokenizer_fp}, {"tokenizer": trained.tokenizer},
                          what=f"the drafter's tokenizer (train manifest beside {drafter_path})", producer="train")
    else:
        log.warning("no train manifest beside %s: the drafter's tokenizer cannot be checked against the target's",
                    drafter_path)


def check_drafter_fits_target(drafter_cfg: dict, target_config: Any, trained_layer_ids: list[int] | None) -> list[int]:
    """The target layers the drafter reads (extract/layers.py convention), after refusing a drafter whose taps,
    hidden size or vocabulary do not fit the target (a StageError naming every field).

    The taps are the export's `dflash_config.target_layer_ids`, which training copied from the feature manifest it
    trained on; when the train manifest beside the export records that manifest's `layer_ids` (`trained_layer_ids`,
    `TrainedDrafter.layer_ids`), the two must agree.
    extract.layers.validate_layer_ids (the one layer-id rule) checks them against the target.
    drafter_cfg: the drafter's z-lab config.json (hidden_size, vocab_size?, dflash_config.target_layer_ids,
    dflash_config.mask_token_id, num_target_layers?).
    """
    text = text_config(target_config)
    n_layers, hidden, vocab = text.num_hidden_layers, text.hidden_size, text.vocab_size
    dcfg = drafter_cfg.get("dflash_config") or {}
    problems = []
    layer_ids = dcfg.get("target_layer_ids")
    if not layer_ids:
        problems.append("dflash_config.target_layer_ids: missing from the drafter config")
    else:
        try:
            layer_ids = validate_layer_ids(layer_ids, n_layers)
        except ValueError as e:
            problems.append(f"dflash_config.target_layer_ids: {e}")
        if trained_layer_ids is not None and list(trained_layer_ids) != layer_ids:
            problems.append(f"dflash_config.target_layer_ids: {layer_ids}, but the features it was trained on "
                            f"tapped {trained_layer_ids} (train manifest beside the export)")
    if drafter_cfg.get("num_target_layers") not in (None, n_layers):
        problems.append(f"num_target_layers: drafter was built for {drafter_cfg['num_target_layers']}, "
                        f"the target has {n_layers}")
    if drafter_cfg.get("hidden_size") != hidden:
        problems.append(f"hidden_size: drafter {drafter_cfg.get('hidden_size')}, target {hidden}")
    if drafter_cfg.get("vocab_size") not in (None, vocab):
        problems.append(f"vocab_size: drafter {drafter_cfg['vocab_size']}, target {vocab}")
    mask = dcfg.get("mask_token_id")
    if mask is None or not 0 <= int(mask) < vocab:
        problems.append(f"dflash_config.mask_token_id: {mask} is not a row of the target vocabulary (size {vocab})")
    if problems:
        raise StageError("the drafter does not fit this target:\n  " + "\n  ".join(problems))
    return layer_ids


def load_drafter(path: Path, target, device):
    """The drafter from its z-lab export with the target's embedding and LM head attached (frozen)."""
    from dflash_model.export import load_zlab

    drafter, args = load_zlab(path)
    drafter.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    drafter.to(device=device, dtype=target.dtype).eval().requires_grad_(False)
    return drafter, args
