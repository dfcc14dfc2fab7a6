"""The one layer convention: tap l = output of decoder layer l = HF hidden_states[l+1]; vLLM aux id l+1."""

from __future__ import annotations

import pytest
import torch

from extract.layers import (
    TapHooks, decoder_layers, default_layer_ids, forward_taps, from_vllm_aux_ids, hf_hidden_state_index,
    tap_features, to_vllm_aux_ids,
)

ARCHS = ["qwen3", "llama", "qwen3_5_text"]


def test_default_layer_ids_match_published_dflash_configs():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5/3.6-27B
    assert default_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Qwen3.5-4B/9B
    assert default_layer_ids(40, 5) == [1, 10, 19, 28, 37]  # Qwen3.5-35B-A3B
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2 (Python rounding, as z-lab)
    assert default_layer_ids(8, 3) == [1, 3, 5]
    assert default_layer_ids(36, 1) == [18]


def test_translations_are_plus_one_and_refuse_the_post_norm_entry():
    assert to_vllm_aux_ids([1, 9, 17, 25, 33]) == [2, 10, 18, 26, 34]
    assert from_vllm_aux_ids(to_vllm_aux_ids([0, 5, 7])) == [0, 5, 7]
    assert hf_hidden_state_index(0, 8) == 1
    assert hf_hidden_state_index(6, 8) == 7
    with pytest.raises(ValueError, match="post-final-norm"):
        hf_hidden_state_index(7, 8)
    with pytest.raises(ValueError, match="strictly increasing"):
        default_layer_ids(4, 3)  # L-4 = 0: all taps would be layer 1


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_taps_equal_hf_hidden_states_at_index_plus_one(random_target, arch):
    _, model = random_target(arch)
    L = model.config.num_hidden_layers
    ids = torch.randint(3, 300, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    assert len(hs) == L + 1
    for l in range(L - 1):
        torch.testing.assert_close(forward_taps(model, ids, [l]), hs[l + 1], rtol=0, atol=0)
        # and not the neighbouring entries (the off-by-one this convention exists to prevent)
        assert not torch.allclose(forward_taps(model, ids, [l]), hs[l], atol=1e-3)
    taps = [1, 3, 5]
    torch.testing.assert_close(forward_taps(model, ids, taps), tap_features(hs, taps), rtol=0, atol=0)
    # the last layer: hook output is pre-norm, HF's last entry is norm(it) — vLLM's aux id L semantics
    last = forward_taps(model, ids, [L - 1])
    torch.testing.assert_close(model.model.norm(last), hs[L], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_forward_taps_stops_after_the_deepest_tapped_layer(random_target, arch):
    _, model = random_target(arch)
    calls = []
    handles = [layer.register_forward_hook(lambda m, i, o, k=k: calls.append(k)) for k, layer in enumerate(decoder_layers(model))]
    handles.append(model.model.norm.register_forward_hook(lambda m, i, o: calls.append("norm")))
    handles.append(model.lm_head.register_forward_hook(lambda m, i, o: calls.append("lm_head")))
    try:
        out = forward_taps(model, torch.randint(3, 300, (1, 9)), [1, 3])
    finally:
        for h in handles:
            h.remove()
    assert calls == [0, 1, 2, 3]
    assert out.shape == (1, 9, 2 * model.config.hidden_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_right_padding_leaves_real_tokens_unchanged(random_target, arch):
    """Batched right-padded forward == per-sample forward, per layer, incl. Gated-DeltaNet layers."""
    _, model = random_target(arch)
    g = torch.Generator().manual_seed(1)
    lengths = [23, 17, 5, 40]
    seqs = [torch.randint(3, 300, (n,), generator=g) for n in lengths]
    batch = torch.zeros(len(seqs), max(lengths), dtype=torch.long)  # pad id 0, right padding, no mask
    for b, s in enumerate(seqs):
        batch[b, : len(s)] = s
    taps = list(range(model.config.num_hidden_layers))
    out = forward_taps(model, batch, taps)
    D = model.config.hidden_size
    for b, s in enumerate(seqs):
        ref = forward_taps(model, s[None], taps)[0]
        for j, l in enumerate(taps):
            torch.testing.assert_close(out[b, : len(s), j * D : (j + 1) * D], ref[:, j * D : (j + 1) * D],
                                       rtol=1e-4, atol=1e-4, msg=f"layer {l}, sample {b}")


def test_tap_hooks_record_during_a_full_forward(random_target):
    _, model = random_target("qwen3")
    ids = torch.randint(3, 300, (1, 11))
    with torch.no_grad(), TapHooks(model, [2, 4]) as taps:
        logits = model(ids, output_hidden_states=True)
    assert logits.logits.shape[-1] == model.config.vocab_size  # the forward ran to the end
    torch.testing.assert_close(taps.features(), tap_features(logits.hidden_states, [2, 4]), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_layer_loop_reproduces_forward_taps_exactly_or_is_refused(random_target, arch):
    from extract.layers import forward_taps_loop, plain_decoder_refusal

    _, model = random_target(arch)
    reason = plain_decoder_refusal(model, [1, 3, 5])
    if arch == "qwen3_5_text":  # Gated DeltaNet layers: the loop does not rebuild them
        assert reason is not None and "linear_attention" in reason
        return
    assert reason is None
    ids = torch.randint(3, 300, (3, 29), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(forward_taps_loop(model, ids, [1, 3, 5]), forward_taps(model, ids, [1, 3, 5]), rtol=0, atol=0)
