"""DrafterArgs.from_run_config: fields from the target where the config leaves them None, the taps it is given
(extract/layers.py resolves a config's), and an explicit, reserved MASK row (never a silent fallback)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Qwen3Config

from extract.layers import configured_layer_ids, default_layer_ids
from pipeline.config import ConfigError
from pipeline.target import load_tokenizer, materialize_target
from tests.conftest import CACHE, make_config
from dflash_model.model import DFlashDrafter, DrafterArgs


def test_args_from_the_tiny_run_config_and_its_real_target(tmp_path):
    cfg = make_config(tmp_path)
    location = materialize_target(cfg.target, CACHE)
    target_cfg = AutoConfig.from_pretrained(location)
    tok = load_tokenizer(location, cfg.target)
    layer_ids = configured_layer_ids(cfg.extract, target_cfg.num_hidden_layers)
    args = DrafterArgs.from_run_config(cfg, target_cfg, len(tok), layer_ids=layer_ids)
    assert args.hidden_size == target_cfg.hidden_size and args.head_dim == target_cfg.head_dim
    assert args.num_attention_heads == target_cfg.num_attention_heads
    assert args.num_key_value_heads == target_cfg.num_key_value_heads
    assert args.intermediate_size == target_cfg.intermediate_size and args.vocab_size == target_cfg.vocab_size
    assert args.num_hidden_layers == cfg.drafter.num_layers and args.block_size == cfg.drafter.block_size
    assert args.num_target_layers == target_cfg.num_hidden_layers
    assert args.target_layer_ids == default_layer_ids(target_cfg.num_hidden_layers, cfg.extract.num_taps)
    assert args.mask_token_id == len(tok) < target_cfg.vocab_size, "MASK = first unused row past the tokenizer"
    assert args.layer_types == ["full_attention"] * cfg.drafter.num_layers
    drafter = DFlashDrafter(args)
    assert drafter.fc.in_features == cfg.extract.num_taps * target_cfg.hidden_size


def test_explicit_drafter_fields_and_layer_ids_override_the_target(tmp_path):
    cfg = make_config(tmp_path, overrides=[
        "drafter.num_attention_heads=2", "drafter.num_key_value_heads=1", "drafter.head_dim=32",
        "drafter.intermediate_size=96", "drafter.mask_token_id=300", "extract.layer_ids=[0,3,5]",
        "drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=64",
    ])
    target_cfg = Qwen3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=320)
    args = DrafterArgs.from_run_config(cfg, target_cfg, 259, layer_ids=configured_layer_ids(cfg.extract, 8))
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.intermediate_size) == (2, 1, 32, 96)
    assert args.mask_token_id == 300 and args.target_layer_ids == [0, 3, 5]
    assert args.layer_types == ["sliding_attention", "full_attention"] and args.sliding_window == 64


def test_no_unused_vocab_row_is_a_clear_config_error(tmp_path):
    cfg = make_config(tmp_path)
    target_cfg = Qwen3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=259)
    with pytest.raises(ConfigError, match="drafter.mask_token_id"):
        DrafterArgs.from_run_config(cfg, target_cfg, 259, layer_ids=[1, 3, 5])
    bad = make_config(tmp_path, overrides=["extract.layer_ids=[3,1]"])
    with pytest.raises(ConfigError, match="extract.layer_ids"):
        configured_layer_ids(bad.extract, target_cfg.num_hidden_layers)


def test_target_head_is_frozen_unsaved_and_outside_the_parameters(tmp_path):
    args = DrafterArgs(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       intermediate_size=32, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=40, block_size=4,
                       mask_token_id=39, target_layer_ids=[1], num_target_layers=4)
    drafter = DFlashDrafter(args)
    embed = torch.randn(40, 16, requires_grad=True)
    drafter.attach_target_head(embed, torch.randn(40, 16))
    assert drafter.embed_weight.data_ptr() == embed.data_ptr(), "a reference, not a copy"
    assert not drafter.embed_weight.requires_grad and not drafter.lm_head_weight.requires_grad
    assert all(p is not drafter.embed_weight for p in drafter.parameters())
    assert not any("embed" in k or "lm_head" in k for k in drafter.state_dict())
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter.attach_target_head(torch.randn(39, 16), torch.randn(40, 16))
