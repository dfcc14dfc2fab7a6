"""What a training run reads: the target (location, config, tokenizer), the sample source (stored features, or
tokenized samples whose features the step computes), the drafter architecture, and the fingerprint that ties
them together -- plus the target's frozen embedding and LM head, read without building the target.

The tapped layer ids come from the input that fixed them: the feature manifest (offline; after checking it against
what this config implies) or `extract.layers.configured_layer_ids` (online, the one place that resolves them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from extract.layers import LAYER_CONVENTION, configured_layer_ids
from extract.store import FeatureReader
from pipeline.config import RunConfig, TargetConfig
from pipeline.log import get_logger
from pipeline.runner import StageDir, check_fingerprint
from pipeline.target import load_target, load_tokenizer, materialize_target, target_fingerprint, tokenizer_fingerprint
from train.model import DrafterArgs
from train.online import TokenizedReader

log = get_logger("train")


@dataclass
class TrainInputs:
    location: str  # the materialized target (local dir or hub id)
    args: DrafterArgs
    stage: StageDir  # the input stage: extract (offline) or tokenize (online)
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


def text_config(config):
    """The language-model part of a (possibly multimodal) HF config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def expected_feature_fingerprint(cfg: RunConfig, location: str, tokenizer, target_config) -> dict:
    """What this config implies for the extracted features (the fields `check_fingerprint` compares)."""
    text = text_config(target_config)
    return {
        "target": target_fingerprint(location, cfg.target),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "layer_ids": configured_layer_ids(cfg.extract, text.num_hidden_layers),
        "layer_convention": LAYER_CONVENTION,
        "hidden_size": text.hidden_size,
        "storage_dtype": cfg.extract.storage_dtype,
    }


def open_inputs(cfg: RunConfig) -> TrainInputs:
    """Materialize the target, check the input stage's fingerprint against this config (refusing a mismatch and
    naming the field), open the sample source and fill the drafter architecture."""
    from transformers import AutoConfig

    location = materialize_target(cfg.target, cfg.cache_dir)
    tokenizer = load_tokenizer(location, cfg.target)
    target_config = AutoConfig.from_pretrained(location, revision=cfg.target.revision,
                                               trust_remote_code=cfg.target.trust_remote_code)
    expected = expected_feature_fingerprint(cfg, location, tokenizer, target_config)
    if cfg.train.online:
        stage = StageDir(cfg.run_dir, "tokenize")
        check_fingerprint({k: expected[k] for k in ("target", "tokenizer")}, stage.manifest()["fingerprint"],
                          what=f"tokenized data at {stage.path}", producer="tokenize")
        open_source = functools.partial(TokenizedReader, stage.path)
        features = {**expected, "source": "online"}
    else:
        stage = StageDir(cfg.run_dir, "extract")
        features = stage.manifest()["fingerprint"]
        check_fingerprint(expected, features, what=f"extracted features at {stage.path}", producer="extract")
        open_source = functools.partial(FeatureReader, stage.path)
    args = DrafterArgs.from_run_config(cfg, target_config, len(tokenizer), layer_ids=features["layer_ids"])
    source = open_source()  # offline: checks the index and every shard's size and header (extract/store.py)
    if not cfg.train.online:
        source.verify_shards_in_background()  # every shard's sha256 before a worker opens it, off the critical path
    return TrainInputs(location, args, stage, open_source, source, features)


# ----------------------------------------------------------------------------------------------
# The target's frozen pieces
# ----------------------------------------------------------------------------------------------


def target_head_weights(location: str, target_cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, D], LM head [V, D]) of the target, read from its safetensors without building the
    model (a tied head returns the embedding twice). Falls back to loading the target on CPU."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location, revision=target_cfg.revision,
                                        trust_remote_code=target_cfg.trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=target_cfg.trust_remote_code)
    names: dict[int, list[str]] = {}  # a tied weight has several names; the file holds one of them
    for n, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    emb_param = meta.get_input_embeddings().weight
    head = meta.get_output_embeddings()
    tied = head is None or head.weight is emb_param or bool(getattr(text_config(config), "tie_word_embeddings", False))
    stored: dict[str, torch.Tensor] = {}
    wanted = set(names.get(id(emb_param), [])) | (set(names.get(id(head.weight), [])) if not tied else set())
    for f in _safetensors_files(location, target_cfg):
        with safe_open(str(f), framework="pt") as sf:
            for key in wanted & set(sf.keys()):
                stored[key] = sf.get_tensor(key)
    emb = next((stored[n] for n in names.get(id(emb_param), []) if n in stored), None)
    out = emb if tied else next((stored[n] for n in names.get(id(head.weight), []) if n in stored), None)
    if emb is not None and out is not None:
        return emb, out
    log.warning("embedding/LM head not found by name in the target's safetensors; loading the full target on CPU")
    model = load_target(location, target_cfg, device=torch.device("cpu"))
    emb = model.get_input_embeddings().weight.detach()
    out = model.get_output_embeddings()
    return emb, (out.weight.detach() if out is not None else emb)


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
