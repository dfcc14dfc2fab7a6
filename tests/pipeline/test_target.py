"""pipeline.target: one function opens a target (location, tokenizer, config, identity) and one helper returns the
language-model config, for text-only targets and multimodal wrappers alike."""

from __future__ import annotations

from pathlib import Path

from pipeline.target import (load_tokenizer, materialize_target, open_target, target_fingerprint, text_config,
                             tokenizer_fingerprint)


def test_text_config_is_the_nested_language_model_of_a_multimodal_wrapper_and_the_config_itself_otherwise():
    from transformers import AutoConfig

    wrapper = AutoConfig.for_model("qwen3_5")  # Qwen3.5/3.6: vision + text, the layers live in text_config
    assert text_config(wrapper) is wrapper.text_config and not hasattr(wrapper, "num_hidden_layers")
    plain = AutoConfig.for_model("qwen3")
    assert text_config(plain) is plain


def test_open_target_gives_location_tokenizer_text_config_and_the_stage_fingerprint(tiny_cfg):
    target = open_target(tiny_cfg.target, tiny_cfg.cache_dir)
    location = materialize_target(tiny_cfg.target, tiny_cfg.cache_dir)
    assert target.location == location and Path(location, "config.json").is_file()
    assert target.tokenizer.pad_token is not None and target.tokenizer.padding_side == "left"
    assert target.text.num_hidden_layers == 8 and target.text is text_config(target.config)
    # the two fields every stage fingerprint starts with, equal to what each function gives on its own
    assert target.fingerprint == {"target": target_fingerprint(location, tiny_cfg.target),
                                  "tokenizer": tokenizer_fingerprint(load_tokenizer(location, tiny_cfg.target))}
