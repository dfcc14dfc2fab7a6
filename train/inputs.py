"""What a training run reads: the target (location, config, tokenizer), the sample source (stored features, or
tokenized samples whose features the step computes), the drafter architecture, and the fingerprint that ties
them together -- plus the target's frozen embedding, LM head and (logit distillation) final norm, read without
building the target.

The tapped layer ids come from the input that fixed them: the feature manifest (offline; after checking it against
what this config implies) or `extract.layers.configured_layer_ids` (online, the one place that resolves them).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from extract.layers import LAYER_CONVENTION, configured_layer_ids, stored_tap_ids
from extract.store import FeatureReader
from pipeline.config import ConfigError, RunConfig, TargetConfig
from pipeline.log import get_logger
from pipeline.manifests import StageOutputs, extract_outputs, tokenize_outputs
from pipeline.stage_dir import StageDir, check_fingerprint
from pipeline.target import OpenedTarget, base_model, load_target, open_target, text_config
from train.loss import kl_share
from dflash_model.model import DrafterArgs
from train.online import TokenizedReader

log = get_logger("train")


@dataclass
class TrainInputs:
    target: OpenedTarget  # location, tokenizer, HF config, identity (pipeline.target.open_target)
    args: DrafterArgs
    tap_ids: list[int]  # the taps of the features the step receives, in column order (drafter's first)
    stage: StageDir  # the input stage: extract (offline) or tokenize (online)
    input: StageOutputs  # its manifest, typed (pipeline/manifests.py)
    open_source: Callable[[], Any]  # opens the sample source (train/data.py: `ids`, `lengths`, `sample(i)`)
    source: Any  # one opened source (ids and lengths for the plan)
    features: dict  # the feature fingerprint trained on (the extract manifest's, or what online computes)

    @property
    def online(self) -> bool:
        return self.stage.stage == "tokenize"

    @property
    def fingerprint(self) -> dict:
        """The train manifest's fingerprint: the drafter architecture and the features it was trained on."""
        return {"drafter": dataclasses.asdict(self.args), "features": self.features}


def expected_feature_fingerprint(cfg: RunConfig, target: OpenedTarget) -> dict:
    """What this config implies for the extracted features (the fields `check_fingerprint` compares). A loss with
    a KL term needs the target's last hidden state after the drafter's taps (`last_hidden`), unless the drafter
    taps the last layer itself."""
    num_layers = target.text.num_hidden_layers
    layer_ids = configured_layer_ids(cfg.extract, num_layers)
    expected = {
        **target.fingerprint,
        "layer_ids": layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "hidden_size": target.text.hidden_size,
        "storage_dtype": cfg.extract.storage_dtype,
    }
    if kl_share(cfg.train.loss, cfg.train.kl_weight) and len(stored_tap_ids(layer_ids, num_layers, True)) > len(layer_ids):
        expected["last_hidden"] = True
    return expected


def open_inputs(cfg: RunConfig) -> TrainInputs:
    """Open the target, check the input stage's fingerprint against this config (refusing a mismatch and naming the
    field), open the sample source and fill the drafter architecture."""
    target = open_target(cfg.target, cfg.cache_dir)
    num_layers = target.text.num_hidden_layers
    expected = expected_feature_fingerprint(cfg, target)
    distil = bool(kl_share(cfg.train.loss, cfg.train.kl_weight))
    if cfg.train.online:
        stage = StageDir(cfg.run_dir, "tokenize")
        outputs = tokenize_outputs(cfg.run_dir)
        check_fingerprint(target.fingerprint, outputs.fingerprint,
                          what=f"tokenized data at {stage.path}", producer="tokenize")
        open_source = functools.partial(TokenizedReader, stage.path)
        tap_ids = stored_tap_ids(expected["layer_ids"], num_layers, distil)
        features = {**{k: v for k, v in expected.items() if k != "storage_dtype"}, "source": "online",
                    "last_hidden": len(tap_ids) > len(expected["layer_ids"])}
    else:
        if expected.get("last_hidden") and not cfg.extract.last_hidden:
            raise ConfigError(f"train.loss={cfg.train.loss!r} distils the target's distribution, which offline "
                              "training reads from the stored features: set extract.last_hidden=true (and re-run "
                              "extract), or compute the features in the step with train.online=true")
        stage = StageDir(cfg.run_dir, "extract")
        outputs = extract_outputs(cfg.run_dir)
        features = outputs.fingerprint
        check_fingerprint(expected, features, what=f"extracted features at {stage.path}", producer="extract")
        open_source = functools.partial(FeatureReader, stage.path)
        tap_ids = stored_tap_ids(outputs.layer_ids, num_layers, outputs.last_hidden)
    args = DrafterArgs.from_run_config(cfg, target.config, len(target.tokenizer), layer_ids=features["layer_ids"])
    source = open_source()  # offline: checks the index and every shard's size and header (extract/store.py)
    if not cfg.train.online:
        source.verify_shards_in_background()  # every shard's sha256 before a worker opens it, off the critical path
    return TrainInputs(target, args, tap_ids, stage, outputs, open_source, source, features)


# ----------------------------------------------------------------------------------------------
# The target's frozen pieces
# ----------------------------------------------------------------------------------------------


@dataclass
class FrozenTarget:
    """What the drafter's training borrows from the target, frozen: the input embedding [V, D] and LM head [V, D]
    (the same tensor when tied), and for logit distillation the final norm applied to its last hidden state."""

    embed: torch.Tensor
    head: torch.Tensor
    final_norm: torch.nn.Module | None = None


def final_norm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The norm a HF causal LM applies to its last layer's output before the LM head (`model.norm` of the base)."""
    norm = getattr(base_model(model), "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ConfigError(f"train.loss: cannot find the final norm of {type(model).__name__} (its base model has no "
                          "`norm`), which logit distillation applies to the last hidden state; use train.loss=ce")
    return norm


def frozen_pieces_of(model: torch.nn.Module, *, final_norm: bool) -> FrozenTarget:
    """`FrozenTarget` of a loaded target (online training: the target runs in the step anyway)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    norm = copy.deepcopy(final_norm_of(model)).requires_grad_(False) if final_norm else None  # the step may recast it
    return FrozenTarget(emb, head.weight if head is not None else emb, norm)


def read_frozen_target(location: str, target_cfg: TargetConfig, config, *, final_norm: bool) -> FrozenTarget:
    """`FrozenTarget` read from the target's safetensors without building the model (`config`: its HF config); a
    tied head is the embedding itself. Falls back to loading the target on CPU when a piece is not found by name."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=target_cfg.trust_remote_code)
    names: dict[int, list[str]] = {}  # a tied weight has several names; the file holds one of them
    for n, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    emb_param = meta.get_input_embeddings().weight
    head = meta.get_output_embeddings()
    tied = head is None or head.weight is emb_param or bool(getattr(text_config(config), "tie_word_embeddings", False))
    wanted = set(names.get(id(emb_param), [])) | (set(names.get(id(head.weight), [])) if not tied else set())
    norm, norm_keys = None, {}
    if final_norm:
        norm = final_norm_of(meta)
        prefix = next(n for n, m in meta.named_modules() if m is norm)
        norm_keys = {f"{prefix}.{k}": k for k in norm.state_dict()}
        wanted |= set(norm_keys)
    stored: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(location, target_cfg):
        with safe_open(str(f), framework="pt") as sf:
            for key in wanted & set(sf.keys()):
                stored[key] = sf.get_tensor(key)
    emb = next((stored[n] for n in names.get(id(emb_param), []) if n in stored), None)
    out = emb if tied else next((stored[n] for n in names.get(id(head.weight), []) if n in stored), None)
    if emb is None or out is None or not set(norm_keys) <= set(stored):
        log.warning("embedding/LM head/final norm not found by name in the target's safetensors; loading the full "
                    "target on CPU")
        model = load_target(location, target_cfg, device=torch.device("cpu"))
        pieces = frozen_pieces_of(model, final_norm=final_norm)
        return FrozenTarget(pieces.embed.detach(), pieces.head.detach(), pieces.final_norm)
    if norm is not None:
        norm = copy.deepcopy(norm).to_empty(device="cpu")
        norm.load_state_dict({k: stored[key] for key, k in norm_keys.items()})
        norm.requires_grad_(False)
    return FrozenTarget(emb, out, norm)


def _safetensors_files(location: str, target_cfg: TargetConfig) -> list[Path]:
    p = Path(location)
    if p.is_dir():
        return sorted(p.glob("*.safetensors"))
    from huggingface_hub import hf_hub_download

    try:
        index = hf_hub_download(location, "model.safetensors.index.json", revision=target_cfg.revision)
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    except Exception:  # noqa: BLE001 - a single-file checkpoint has no index
        shards = ["model.safetensors"]
    return [Path(hf_hub_download(location, s, revision=target_cfg.revision)) for s in shards]
