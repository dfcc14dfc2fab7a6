"""Anchor sampling and block construction: slot 0 = real token, slots 1..B-1 = MASK, same-position labels,
slot 0 never a target, positions anchor + j (restarting per packed sequence)."""

from __future__ import annotations

import torch

from dflash_model.blocks import build_block_batch, sample_anchors

MASK = 999


def test_anchors_are_sorted_distinct_supervised_and_leave_room_for_a_full_block():
    S, B = 60, 8
    loss_mask = torch.zeros(S, dtype=torch.bool)
    loss_mask[10:25] = True
    loss_mask[40:] = True  # 53..59 are supervised but too close to the end (> S - B = 52)
    seen = set()
    for seed in range(50):
        a = sample_anchors(loss_mask, B, 12, torch.Generator().manual_seed(seed))
        assert a.dtype == torch.long and a.numel() == 12
        assert torch.equal(a, a.sort().values) and a.unique().numel() == a.numel()
        assert bool(loss_mask[a].all()) and int(a.max()) <= S - B
        seen.update(a.tolist())
    candidates = set(range(10, 25)) | set(range(40, S - B + 1))
    assert seen == candidates, "over many draws every candidate (and nothing else) is chosen"


def test_anchor_count_is_capped_by_candidates_and_deterministic_per_generator():
    loss_mask = torch.zeros(30, dtype=torch.bool)
    loss_mask[5:9] = True
    a = sample_anchors(loss_mask, 4, 512, torch.Generator().manual_seed(0))
    assert a.tolist() == [5, 6, 7, 8]
    long_mask = torch.ones(200, dtype=torch.bool)
    a1 = sample_anchors(long_mask, 16, 20, torch.Generator().manual_seed(7))
    a2 = sample_anchors(long_mask, 16, 20, torch.Generator().manual_seed(7))
    a3 = sample_anchors(long_mask, 16, 20, torch.Generator().manual_seed(8))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    assert sample_anchors(torch.ones(3, dtype=torch.bool), 4, 8, torch.Generator()).numel() == 0


def test_block_slot0_is_the_anchor_token_and_other_slots_are_mask():
    ids = torch.arange(100, 120)
    batch = build_block_batch(ids, torch.ones(20, dtype=torch.bool), torch.tensor([3, 9]), 4, MASK)
    assert batch.block_ids.view(2, 4).tolist() == [[103, MASK, MASK, MASK], [109, MASK, MASK, MASK]]
    assert batch.block_positions.view(2, 4).tolist() == [[3, 4, 5, 6], [9, 10, 11, 12]]
    assert batch.context_positions.tolist() == list(range(20))


def test_labels_are_the_tokens_at_the_same_positions_and_slot0_is_never_a_target():
    ids = torch.arange(100, 120)
    loss_mask = torch.ones(20, dtype=torch.bool)
    loss_mask[11] = False
    batch = build_block_batch(ids, loss_mask, torch.tensor([3, 9, 18]), 4, MASK)
    labels, m = batch.labels.view(3, 4), batch.label_mask.view(3, 4)
    assert labels[0].tolist() == [103, 104, 105, 106], "slot k is labelled with x[anchor + k] (not shifted)"
    assert m[:, 0].eq(False).all(), "slot 0 (the anchor token) is never a target"
    assert m[0].tolist() == [False, True, True, True]
    assert m[1].tolist() == [False, True, False, True], "unsupervised tokens carry no label"
    assert m[2].tolist() == [False, True, False, False], "no label past the end of the sequence"
    assert torch.equal(batch.slots, torch.arange(12) % 4)


def test_packed_sequences_restart_positions_and_never_label_across_a_sequence_end():
    ids = torch.arange(100, 115)
    lens = [6, 9]
    batch = build_block_batch(ids, torch.ones(15, dtype=torch.bool), torch.tensor([4, 6, 8]), 4, MASK, seq_lens=lens)
    assert batch.context_positions.tolist() == list(range(6)) + list(range(9))
    assert batch.doc_start.tolist() == [0, 6, 6]
    assert batch.block_positions.view(3, 4).tolist() == [[4, 5, 6, 7], [0, 1, 2, 3], [2, 3, 4, 5]]
    assert batch.label_mask.view(3, 4)[0].tolist() == [False, True, False, False]


def test_padded_blocks_carry_no_label_and_are_marked_invalid():
    ids = torch.arange(100, 120)
    batch = build_block_batch(ids, torch.ones(20, dtype=torch.bool), torch.tensor([2]), 4, MASK, pad_to=3)
    assert batch.block_valid.tolist() == [True, False, False]
    assert batch.label_mask.view(3, 4)[1:].eq(False).all()
    assert batch.num_blocks == 3 and batch.block_ids.shape == (12,)
