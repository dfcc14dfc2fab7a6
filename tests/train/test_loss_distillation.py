"""Logit distillation (train.loss 'kl' / 'ce+kl'): the chunked head loss equals the full-logits KL and CE (values,
argmax, input and weight gradients), and on a real tiny target the trainer's KL -- the stored last hidden state at
row a_n + j - 1 through the frozen final norm and LM head -- equals KL against the target's own next-token
distribution, computed directly from its logits, with the same gradient; the offline feature set must carry the
last hidden state (a set without it is refused, naming the field)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import make_config
from tests.train.test_stage_train import FAST, _dist_env, rows, write_extract_stage, write_tokenize_stage  # noqa: F401
from train.loss import chunked_head_loss, decay_weights, dflash_loss, kl_share, target_hidden


def _direct(h, W, labels, t, a):
    """Per-row (1 - a) CE + a KL(softmax(t W^T) || softmax(h W^T)), CE and KL from the full logits."""
    logq = F.log_softmax(h @ W.T, dim=-1)
    logp = F.log_softmax(t @ W.detach().T, dim=-1)  # the target's distribution: no gradient
    ce = -logq.gather(1, labels[:, None]).squeeze(1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return (1 - a) * ce + a * kl, ce, kl


@pytest.mark.parametrize("a", [1.0, 0.3])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_chunked_kl_equals_the_full_logits_kl_value_and_input_gradient(a, dtype, tol):
    M, D, V = 23, 8, 50
    torch.manual_seed(1)
    h = torch.randn(M, D, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, dtype=dtype)  # frozen, like the target's LM head buffer
    t = torch.randn(M, D, dtype=dtype)
    labels = torch.randint(0, V, (M,))
    row_w = torch.rand(M, dtype=dtype)
    loss, ce, kl, pred = chunked_head_loss(h, W, labels, chunk_rows=5, target_hidden=t, kl=a)
    (loss * row_w).sum().backward()
    got_grad = h.grad.clone()
    h.grad = None
    ref, ref_ce, ref_kl = _direct(h, W, labels, t, a)
    (ref * row_w).sum().backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ce, ref_ce.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(kl, ref_kl.detach(), rtol=tol, atol=tol)
    assert torch.equal(pred, (h @ W.T).argmax(-1))
    torch.testing.assert_close(got_grad, h.grad, rtol=tol, atol=tol)
    assert (kl > 0).all(), "different distributions: every row diverges"


def test_chunked_kl_with_a_trainable_head_gives_the_weight_gradient_too():
    M, D, V = 17, 6, 30
    torch.manual_seed(2)
    h = torch.randn(M, D, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    t, labels = torch.randn(M, D, dtype=torch.float64), torch.randint(0, V, (M,))
    loss, _, _, _ = chunked_head_loss(h, W, labels, chunk_rows=4, target_hidden=t, kl=0.6)
    gh, gw = torch.autograd.grad(loss.sum(), (h, W))
    ref, _, _ = _direct(h, W, labels, t, 0.6)
    rh, rw = torch.autograd.grad(ref.sum(), (h, W))
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


def test_target_rows_by_position_give_the_per_row_loss_and_gradients_with_fewer_target_rows_multiplied():
    """Distillation with one target row per position (`target_rows` naming each labelled row's, as dense anchors
    share positions): the same loss, statistics and input / weight gradients as the per-row form; the chunks whose
    rows span fewer positions than they hold multiply that span once (`position_spans`), the others row by row."""
    from train.loss import position_spans

    torch.manual_seed(4)
    S, D, V = 40, 6, 30
    dense = torch.arange(10).repeat_interleave(3)  # rows naming positions 0, 0, 0, 1, 1, 1, ...
    sparse = torch.tensor([1, 13, 25, 39, 7, 31, 18, 2])  # 8 rows over 39 positions
    rows = torch.cat([dense[:24], sparse, dense[:8] + 20, dense[:3] + 30])  # chunks of 8, the last of 3
    assert position_spans(rows, 8) == [(0, 2), (2, 5), (5, 7), None, (20, 22), (30, 30)]
    assert position_spans(rows[:0], 8) == []
    th = torch.randn(S, D, dtype=torch.float64)
    labels = torch.randint(0, V, (rows.shape[0],))
    for trainable in (False, True):
        h = torch.randn(rows.shape[0], D, dtype=torch.float64, requires_grad=True)
        W = torch.randn(V, D, dtype=torch.float64, requires_grad=trainable)
        got = chunked_head_loss(h, W, labels, chunk_rows=8, target_hidden=th, kl=0.4, target_rows=rows)
        ref = chunked_head_loss(h, W, labels, chunk_rows=8, target_hidden=th[rows], kl=0.4)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        inputs = (h, W) if trainable else (h,)
        for a, b in zip(torch.autograd.grad(got[0].sum(), inputs), torch.autograd.grad(ref[0].sum(), inputs)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="target_rows"):
        chunked_head_loss(h, W, labels, target_rows=rows)


def test_kl_of_identical_distributions_is_zero_and_ce_only_needs_no_target():
    torch.manual_seed(3)
    h, W, labels = torch.randn(9, 4), torch.randn(20, 4), torch.randint(0, 20, (9,))
    _, _, kl, _ = chunked_head_loss(h, W, labels, chunk_rows=4, target_hidden=h.clone(), kl=1.0)
    torch.testing.assert_close(kl, torch.zeros(9), atol=1e-5, rtol=0)
    loss, ce, kl, _ = chunked_head_loss(h, W, labels, chunk_rows=4)
    assert kl is None and torch.equal(loss, ce)
    with pytest.raises(ValueError, match="target"):
        chunked_head_loss(h, W, labels, kl=0.5)
    assert (kl_share("ce", 0.7), kl_share("kl", 0.7), kl_share("ce+kl", 0.7)) == (0.0, 1.0, 0.7)


@pytest.mark.parametrize("a", [1.0, 0.5])
def test_trainer_kl_on_a_tiny_target_equals_kl_to_the_targets_own_logits(tmp_path, a):
    """The real tiny target: its last hidden state (tap L-1) at the packed rows a_n + j - 1, through its frozen
    final norm and LM head, is its next-token distribution for row (n, j)'s label; dflash_loss's value and the
    drafter-side gradient equal the decay-weighted mean of (1 - a) CE + a KL computed from the target's logits."""
    from extract.layers import forward_taps
    from pipeline.target import load_target, open_target
    from dflash_model.blocks import build_block_batch, sample_anchors
    from train.inputs import frozen_pieces_of

    cfg = make_config(tmp_path)
    target = open_target(cfg.target, cfg.cache_dir)
    model = load_target(target.location, cfg.target, device=torch.device("cpu"))
    L, D = target.text.num_hidden_layers, target.text.hidden_size
    B = 4
    torch.manual_seed(0)
    seqs = [torch.randint(3, 250, (n,)) for n in (37, 29)]  # two sequences packed in one row
    ids = torch.cat(seqs)
    loss_mask = torch.ones(len(ids), dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    anchors = torch.cat([sample_anchors(torch.ones(37, dtype=torch.bool), B, 6, g),
                         sample_anchors(torch.ones(29, dtype=torch.bool), B, 6, g) + 37])
    batch = build_block_batch(ids, loss_mask, anchors, B, mask_token_id=300, seq_lens=[37, 29])
    last = torch.cat([forward_taps(model, s[None], [L - 1])[0] for s in seqs])  # [S, D], per sequence
    frozen = frozen_pieces_of(model, final_norm=True)
    drafter_hidden = torch.randn(batch.labels.shape[0], D, requires_grad=True)

    loss, stats = dflash_loss(drafter_hidden, frozen.head, batch, gamma=2.0, chunk_rows=7,
                              target=target_hidden(frozen.final_norm, last, batch), kl=a)
    (got_grad,) = torch.autograd.grad(loss, drafter_hidden)

    with torch.no_grad():
        logits = torch.cat([model(s[None]).logits[0] for s in seqs])  # the target's own next-token logits
    rows_ = torch.nonzero(batch.label_mask).flatten()
    n, j = rows_ // B, rows_ % B
    src = anchors[n] + j - 1  # the position whose output predicts the label at anchors[n] + j
    assert torch.equal(batch.labels[rows_], ids[anchors[n] + j])
    logq = F.log_softmax(drafter_hidden[rows_] @ frozen.head.T, dim=-1)
    logp = F.log_softmax(logits[src], dim=-1)
    per_row = (1 - a) * -logq.gather(1, batch.labels[rows_][:, None]).squeeze(1) + a * (logp.exp() * (logp - logq)).sum(-1)
    w = decay_weights(B, 2.0)[j]
    ref = (w * per_row).sum() / w.sum()
    (ref_grad,) = torch.autograd.grad(ref, drafter_hidden)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert stats["kl_rows"] == len(rows_) and stats["kl_sum"] > 0


# ----------------------------------------------------------------------------------------------
# The train stage
# ----------------------------------------------------------------------------------------------


def test_kl_training_refuses_features_without_the_last_hidden_state_naming_the_field(tmp_path):
    from pipeline.config import ConfigError
    from pipeline.errors import FingerprintMismatch
    from train.stage import run_train

    cfg = make_config(tmp_path, overrides=FAST + ["train.loss=kl", "extract.last_hidden=true"])
    write_extract_stage(cfg, n=4, last_hidden=False)  # extracted before the config asked for it
    with pytest.raises(FingerprintMismatch, match="last_hidden"):
        run_train(cfg)
    no_tap = make_config(tmp_path, overrides=FAST + ["train.loss=ce+kl"])
    with pytest.raises(ConfigError, match="extract.last_hidden"):
        run_train(no_tap)
    assert not (cfg.run_dir / "train" / "manifest.json").exists()


def test_ce_plus_kl_online_and_offline_give_the_same_loss_curve(tmp_path):
    """Same data, seed and plan: distillation from stored features (extract.last_hidden) and from the target run
    inside the step log the same loss, CE and KL at every step; CE alone on the same store logs another loss."""
    from train.stage import run_train

    overrides = FAST + ["train.max_steps=3", "train.eval_every=0", "train.save_every=0", "train.loss=ce+kl",
                        "train.kl_weight=0.5", "extract.storage_dtype=float32"]
    offline = make_config(tmp_path / "offline", overrides=overrides + ["extract.last_hidden=true"])
    samples = write_extract_stage(offline, n=16)
    run_train(offline)
    online = make_config(tmp_path / "online", overrides=overrides + ["train.online=true"])
    write_tokenize_stage(online, samples)
    manifest = run_train(online)
    assert manifest["fingerprint"]["features"]["last_hidden"] is True
    a, b = rows(offline.run_dir), rows(online.run_dir)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "kl"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5), (ra["step"], key)
    ce_only = make_config(tmp_path / "ce", overrides=FAST + ["train.max_steps=3", "train.eval_every=0",
                                                             "train.save_every=0", "extract.last_hidden=true",
                                                             "extract.storage_dtype=float32"])
    write_extract_stage(ce_only, n=16)
    run_train(ce_only)  # the same store trains CE too (the extra tap is not fed to the drafter)
    c = rows(ce_only.run_dir)
    assert "kl" not in c[0] and c[0]["ce"] == pytest.approx(a[0]["ce"], rel=1e-5)
