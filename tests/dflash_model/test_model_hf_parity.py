"""Our layer math (RMSNorm in fp32, per-head q/k norm, rotate-half RoPE at theta, GQA, SwiGLU, final norm) equals
HF transformers' Qwen3 layers loaded with the same weights -- the z-lab drafter is a Qwen3 layout, so a RoPE-layout
or norm mismatch here would silently collapse acceptance in serving engines. With no context rows, the drafter
block is exactly a bidirectional Qwen3 stack over [bonus, MASK x (B-1)]."""

from __future__ import annotations

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash_model.model import DFlashDrafter, DrafterArgs

D, V, B, MASK = 64, 100, 6, 99


def test_drafter_block_without_context_equals_hf_qwen3_bidirectional_layers():
    args = DrafterArgs(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V, block_size=B, mask_token_id=MASK,
        target_layer_ids=[1], num_target_layers=4,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(args).double()
    for p in drafter.parameters():
        p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    embed, head = torch.randn(V, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    drafter.attach_target_head(embed, head)
    ours = drafter.draft_logits(drafter.new_cache(), torch.zeros(1, 0, D, dtype=torch.float64), 17, 0)

    cfg = Qwen3Config(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V,
                      attn_implementation="eager")
    layers = [Qwen3DecoderLayer(cfg, i).double() for i in range(2)]
    for i, layer in enumerate(layers):
        layer.load_state_dict({k.split(f"layers.{i}.", 1)[1]: v for k, v in drafter.state_dict().items()
                               if k.startswith(f"layers.{i}.")})
        layer.self_attn.is_causal = False  # DFlash full-attention layers are bidirectional
    norm = Qwen3RMSNorm(D, eps=1e-6).double()
    norm.weight.data.copy_(drafter.norm.weight.data)
    ids = torch.tensor([[17] + [MASK] * (B - 1)])
    x = embed[ids]
    pos = torch.arange(B)[None]
    pe = Qwen3RotaryEmbedding(cfg)(x, pos)
    with torch.no_grad():
        for layer in layers:
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        theirs = (norm(x) @ head.T)[0, 1:]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
