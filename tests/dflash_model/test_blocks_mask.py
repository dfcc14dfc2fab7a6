"""The training mask: strict context (t < anchor), bidirectional block in full layers, causal + window in sliding
layers, padded blocks see nothing -- checked against a brute-force loop written from docs/drafter.md ("Training: anchors, packed layout and mask"), and at the
model level by perturbation (leakage): what an anchor may not see changes nothing, what it may see changes it."""

from __future__ import annotations

import pytest
import torch

from dflash_model.blocks import build_block_batch, dense_block_mask, flex_block_mask
from dflash_model.model import DFlashDrafter, DrafterArgs

D, N_TAPS, V, B, MASK = 32, 2, 64, 4, 60


def brute_force_mask(anchors, valid, doc_start, S, B, window):
    """docs/drafter.md's mask rules spelled out as loops."""
    Q = len(anchors) * B
    m = torch.zeros(Q, S + Q, dtype=torch.bool)
    for n, a in enumerate(anchors):
        if not valid[n]:
            continue
        for j in range(B):
            q = n * B + j
            for t in range(S):
                ok = doc_start[n] <= t < a
                if window is not None:
                    ok = ok and t >= a + j - (window - 1)
                m[q, t] = ok
            for jk in range(B):
                ok = True if window is None else (jk <= j and j - jk <= window - 1)
                m[q, S + n * B + jk] = ok
    return m


@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 3), ("sliding_attention", 6)])
def test_dense_mask_matches_the_spec_predicate_exactly(layer_type, window):
    S = 20
    anchors = torch.tensor([0, 3, 4, 9, 12, 14, 0])
    valid = torch.tensor([True] * 6 + [False])
    doc_start = torch.tensor([0, 0, 0, 8, 8, 8, 0])
    got = dense_block_mask(anchors, S, B, layer_type, window, block_valid=valid, doc_start=doc_start)
    want = brute_force_mask(anchors.tolist(), valid.tolist(), doc_start.tolist(), S, B, window)
    assert torch.equal(got, want)


def test_anchor_context_is_strictly_before_anchor():
    m = dense_block_mask(torch.tensor([5]), 10, B, "full_attention", None)
    assert m[:, :5].all() and not m[:, 5:10].any(), "context rows 0..4 visible, the anchor row 5 and later not"
    assert m[:, 10:].all(), "full attention: bidirectional inside the block"


def test_sliding_layers_are_causal_inside_the_block_and_windowed_over_context():
    W, a, S = 3, 8, 12
    m = dense_block_mask(torch.tensor([a]), S, B, "sliding_attention", W)
    for j in range(B):
        ctx = torch.nonzero(m[j, :S]).flatten().tolist()
        assert ctx == [t for t in range(max(0, a + j - (W - 1)), a)], f"slot {j}: window over context"
        blk = torch.nonzero(m[j, S:]).flatten().tolist()
        assert blk == [jk for jk in range(B) if jk <= j and j - jk <= W - 1], f"slot {j}: causal in block"


def test_flex_mask_has_the_same_predicate_as_the_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    S = 20
    anchors = torch.tensor([1, 3, 9, 12, 0])
    valid = torch.tensor([True, True, True, True, False])
    doc_start = torch.tensor([0, 0, 8, 8, 0])
    for layer_type, window in [("full_attention", None), ("sliding_attention", 3)]:
        flex = flex_block_mask(anchors, S, B, layer_type, window, block_valid=valid, doc_start=doc_start)
        dense = dense_block_mask(anchors, S, B, layer_type, window, block_valid=valid, doc_start=doc_start)
        expanded = create_mask(flex.mask_mod, None, None, len(anchors) * B, S + len(anchors) * B, device="cpu")
        assert torch.equal(expanded[0, 0], dense)


# ---- leakage at the model level ---------------------------------------------------------------


def drafter(layer_types, window=None):
    args = DrafterArgs(
        hidden_size=D, num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, block_size=B, mask_token_id=MASK,
        target_layer_ids=[1, 2], num_target_layers=4, layer_types=layer_types, sliding_window=window,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(args).double()
    for p in model.parameters():
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    model.attach_target_head(torch.randn(V, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64))
    return model


def block_outputs(model, ids, feats, anchors):
    batch = build_block_batch(ids, torch.ones(len(ids), dtype=torch.bool), anchors, B, MASK)
    return model.forward_train(feats, batch).view(len(anchors), B, D)


@pytest.mark.parametrize("layer_types,window", [(["full_attention"] * 2, None), (["sliding_attention", "full_attention"], 3)])
def test_changing_tokens_or_features_at_or_after_an_anchor_leaves_its_block_unchanged(layer_types, window):
    model = drafter(layer_types, window)
    S = 16
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (S,), generator=g)
    feats = torch.randn(1, S, N_TAPS * D, generator=g, dtype=torch.float64)
    anchors = torch.tensor([2, 6, 7, 11])
    base = block_outputs(model, ids, feats, anchors)
    for t in range(S):
        f2 = feats.clone()
        f2[0, t] += 1.0
        out = block_outputs(model, ids, f2, anchors)
        for n, a in enumerate(anchors.tolist()):
            changed = not torch.allclose(out[n], base[n], atol=1e-12, rtol=0)
            assert changed == (t < a), f"feature {t} vs anchor {a}: changed={changed}"
        i2 = ids.clone()
        i2[t] = (ids[t] + 1) % 50
        out = block_outputs(model, i2, feats, anchors)
        for n, a in enumerate(anchors.tolist()):
            changed = not torch.allclose(out[n], base[n], atol=1e-12, rtol=0)
            assert changed == (t == a), f"token {t} vs anchor {a}: only the block's own slot-0 token matters"


def test_sliding_only_drafter_slot0_ignores_mask_rows_and_context_outside_the_window():
    W = 3
    model = drafter(["sliding_attention"] * 2, W)
    full = drafter(["full_attention"] * 2)
    S, a = 16, 9
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (S,), generator=g)
    feats = torch.randn(1, S, N_TAPS * D, generator=g, dtype=torch.float64)
    anchors = torch.tensor([a])
    base = block_outputs(model, ids, feats, anchors)[0]
    for t in range(a):
        f2 = feats.clone()
        f2[0, t] += 1.0
        out = block_outputs(model, ids, f2, anchors)[0]
        slot0_changed = not torch.allclose(out[0], base[0], atol=1e-12, rtol=0)
        assert slot0_changed == (t >= a - (W - 1)), f"slot 0 vs context {t}"
        any_changed = not torch.allclose(out, base, atol=1e-12, rtol=0)
        assert any_changed == (t >= a - (W - 1)), "context before the first slot's window reaches no slot"
    # causal inside the block: slot 0 does not see the MASK rows (slots 1..B-1); in full layers it does
    for m, expect in [(model, False), (full, True)]:
        before = block_outputs(m, ids, feats, anchors)[0, 0].clone()
        m.embed_weight = m.embed_weight.clone()
        m.embed_weight[MASK] += 1.0
        after = block_outputs(m, ids, feats, anchors)[0, 0]
        assert (not torch.allclose(before, after, atol=1e-12, rtol=0)) == expect


@pytest.mark.parametrize("tile", [4, 8, 16])
@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 3), ("sliding_attention", 9)])
def test_flex_tiles_cover_every_visible_pair_and_full_tiles_are_fully_visible(tile, layer_type, window):
    """The flex BlockMask's sparsity is derived from the block structure (no dense mask): check it against the
    dense predicate. (CPU flex ignores the tile lists, so this is the test that pins them.)"""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(tile)
    for trial in range(6):
        lens = torch.randint(6, 40, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        S = sum(lens)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        anchors, doc = [], []
        for st, n in zip(starts, lens):
            k = int(torch.randint(0, n, (1,), generator=g))
            picks = sorted(torch.randperm(n, generator=g)[:k].tolist())
            anchors += [st + p for p in picks]
            doc += [st] * len(picks)
        pad = int(torch.randint(0, 3, (1,), generator=g))
        anchors_t = torch.tensor(anchors + [0] * pad, dtype=torch.long)
        doc_t = torch.tensor(doc + [0] * pad, dtype=torch.long)
        valid = torch.tensor([True] * len(anchors) + [False] * pad)
        if anchors_t.numel() == 0:
            continue
        kw = dict(block_valid=valid, doc_start=doc_t)
        dense = dense_block_mask(anchors_t, S, B, layer_type, window, **kw)
        bm = flex_block_mask(anchors_t, S, B, layer_type, window, tile=tile, **kw)
        Q, KV = dense.shape
        nq, nkv = -(-Q // tile), -(-KV // tile)
        padded = torch.zeros(nq * tile, nkv * tile, dtype=torch.bool)
        padded[:Q, :KV] = dense
        per_tile = padded.view(nq, tile, nkv, tile)
        listed = bm.to_dense()[0, 0].bool()[:nq, :nkv]
        assert not (per_tile.any(dim=(1, 3)) & ~listed).any(), "a visible pair lies in an unlisted tile"
        full = torch.zeros(nq, nkv, dtype=torch.bool)
        for qt in range(nq):
            for i in range(int(bm.full_kv_num_blocks[0, 0, qt])):
                full[qt, int(bm.full_kv_indices[0, 0, qt, i])] = True
        assert per_tile.all(dim=(1, 3))[full].all(), "a full tile contains an invisible pair"
        reference = create_block_mask(
            lambda b, h, q, k: dense[q.clamp(max=Q - 1), k.clamp(max=KV - 1)] & (q < Q) & (k < KV),
            None, None, Q, KV, device="cpu", BLOCK_SIZE=tile,
        )
        assert listed.sum() <= reference.to_dense()[0, 0].bool().sum() + nq * 2, "tiles stay close to the minimum"


@pytest.mark.slow
def test_compiled_flex_kernel_with_structural_tiles_equals_dense_attention():
    """The compiled flex kernel (unlike eager) skips unlisted tiles and skips mask_mod on full tiles, so this runs
    the real sparse path on CPU (forward; ~1 min of compilation) against SDPA with the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    Bk, lens = 16, [170, 130]
    S = sum(lens)
    g = torch.Generator().manual_seed(0)
    anchors = torch.cat([torch.randperm(lens[0] - Bk, generator=g)[:20].sort().values,
                         lens[0] + torch.randperm(lens[1] - Bk, generator=g)[:17].sort().values])
    anchors = torch.cat([anchors, torch.zeros(3, dtype=torch.long)])  # + 3 padding blocks
    doc = torch.tensor([0] * 20 + [lens[0]] * 17 + [0] * 3)
    valid = torch.arange(40) < 37
    kw = dict(block_valid=valid, doc_start=doc)
    bm = flex_block_mask(anchors, S, Bk, "sliding_attention", 40, **kw)
    dense = dense_block_mask(anchors, S, Bk, "sliding_attention", 40, **kw)
    Q = 40 * Bk
    q, k, v = torch.randn(1, 4, Q, 16), torch.randn(1, 2, S + Q, 16), torch.randn(1, 2, S + Q, 16)
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm, enable_gqa=True)
    live = dense.any(dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense | ~live[:, None])
    torch.testing.assert_close(out[:, :, live], ref[:, :, live], rtol=1e-4, atol=1e-5)
    assert not out[:, :, ~live].any(), "padded blocks see nothing"
