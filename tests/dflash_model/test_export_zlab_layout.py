"""z-lab checkpoint layout: export then load gives identical logits; config.json carries the specified fields;
no embedding / LM head tensors are saved; configs of other producers parse; mismatches are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_model.export import args_from_zlab_config, export_zlab, load_zlab, zlab_shapes
from dflash_model.model import DFlashDrafter, DrafterArgs
from pipeline.errors import StageError

D, V, B = 32, 96, 8


def make_args(**kw) -> DrafterArgs:
    base = dict(
        hidden_size=D, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V, block_size=B, mask_token_id=95,
        target_layer_ids=[1, 4, 6], num_target_layers=10,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=6,
    )
    return DrafterArgs(**{**base, **kw})


def trained_like(args: DrafterArgs, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(args)
    for p in model.parameters():  # make the norms non-trivial so a dropped tensor would show
        p.data.normal_(0, 0.1) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    return model


def test_export_then_load_gives_identical_logits(tmp_path):
    args = make_args()
    model = trained_like(args)
    embed, head = torch.randn(V, D), torch.randn(V, D)
    model.attach_target_head(embed, head)
    out = export_zlab(model, args, tmp_path / "export")
    loaded, loaded_args = load_zlab(out)
    loaded.attach_target_head(embed, head)
    assert loaded_args == args
    feats = torch.randn(1, 11, 3 * D)
    a = model.draft_logits(model.new_cache(), feats, 5, 11)
    b = loaded.draft_logits(loaded.new_cache(), feats, 5, 11)
    assert torch.equal(a, b)


def test_saved_tensors_have_the_zlab_names_and_no_embedding_or_lm_head(tmp_path):
    args = make_args(num_hidden_layers=2, layer_types=None, sliding_window=None)
    model = trained_like(args)
    model.attach_target_head(torch.randn(V, D), torch.randn(V, D))
    out = export_zlab(model, args, tmp_path / "export", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    per_layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    ]
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == want
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_config_json_has_the_dflash_fields_and_loads_as_a_qwen3_config(tmp_path):
    from transformers import AutoConfig

    args = make_args()
    out = export_zlab(trained_like(args), args, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == B and cfg["num_target_layers"] == 10 and cfg["num_hidden_layers"] == 3
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 4, 6]}
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert cfg["rope_theta"] == 1e6 and cfg["dtype"] == "float32" and cfg["vocab_size"] == V
    hf = AutoConfig.from_pretrained(out)
    assert hf.model_type == "qwen3" and hf.hidden_size == D and hf.head_dim == 8 and hf.num_key_value_heads == 2
    assert list(hf.layer_types) == cfg["layer_types"] and hf.sliding_window == 6
    assert "num_speculative_tokens\": 7" in (out / "README.md").read_text(), "B-1 speculative tokens per round"


def test_full_attention_export_writes_no_sliding_window(tmp_path):
    args = make_args(layer_types=None, sliding_window=None)
    cfg = json.loads((export_zlab(trained_like(args), args, tmp_path / "e") / "config.json").read_text())
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["layer_types"] == ["full_attention"] * 3


def test_a_published_style_config_parses_including_hf_rope_parameters():
    cfg = {  # the fields of a released Qwen3-8B DFlash config.json (shapes shrunk)
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000}, "sliding_window": None,
        "use_sliding_window": False, "vocab_size": 151936,
    }
    args = args_from_zlab_config(cfg)
    assert args.layer_types == ["full_attention"] * 5 and args.sliding_window is None
    assert args.rope_theta == 1e6 and args.mask_token_id == 151669 and args.target_layer_ids == [1, 9, 17, 25, 33]
    no_ids = {**cfg, "dflash_config": {"mask_token_id": 151669}}
    assert args_from_zlab_config(no_ids).target_layer_ids == [1, 9, 17, 25, 33], "z-lab default spread when absent"
    with pytest.raises(StageError, match="mask_token_id"):
        args_from_zlab_config({**cfg, "dflash_config": {"target_layer_ids": [1]}})
    with pytest.raises(StageError, match="DFlashDraftModel"):
        args_from_zlab_config({**cfg, "architectures": ["Qwen3ForCausalLM"]})


def test_loading_refuses_weights_that_do_not_match_the_config(tmp_path):
    args = make_args()
    out = export_zlab(trained_like(args), args, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["layer_types"] = 2, cfg["layer_types"][:2]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StageError, match="unexpected"):
        load_zlab(out)
    with pytest.raises(FileNotFoundError):
        load_zlab(tmp_path / "missing" / "dir")


def test_export_readme_says_how_each_engine_counts_the_block_and_the_mixed_layout_caveat(tmp_path):
    mixed = make_args(block_size=16)  # [S, S, F]
    text = (export_zlab(trained_like(mixed), mixed, tmp_path / "mixed") / "README.md").read_text()
    assert '"method": "dflash"' in text and '"num_speculative_tokens": 15' in text  # vLLM: B-1
    assert "--speculative-algorithm DFLASH" in text and "--speculative-num-draft-tokens 16" in text  # SGLang: B
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in text and "This drafter mixes them." in text
    assert "--mamba-scheduler-strategy extra_buffer" in text and "mask_token_id" in text
    full = make_args(layer_types=None, sliding_window=None)
    text = (export_zlab(trained_like(full), full, tmp_path / "full") / "README.md").read_text()
    assert "This drafter does not." in text and '"num_speculative_tokens": 7' in text


@pytest.mark.parametrize("kw", [{}, {"num_hidden_layers": 1, "layer_types": ["full_attention"], "head_dim": 16,
                                      "num_key_value_heads": 4, "target_layer_ids": [2]}])
def test_the_shapes_the_export_validator_expects_are_the_models_own(kw):
    """`read_export` checks a file's tensors against `zlab_shapes` before building anything: it must list exactly
    the drafter's parameters, each of its shape."""
    args = make_args(**kw)
    with torch.device("meta"):
        model = DFlashDrafter(args)
    assert zlab_shapes(args) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
