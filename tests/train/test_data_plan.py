"""Training data plans and loading: rank split disjoint and complete, token budget, balance, resumable position,
held-out split by id, anchors per (seed, epoch, sample id), worker prefetch == in-process loading."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pipeline.sample_ids import prompt_id
from train.data import (MicroBatchDataset, RunPlan, collate, heldout_split, make_loader, plan_epoch, plan_eval,
                        rank_micro_batches, total_steps)

B, MASK = 4, 300


def _lengths(n: int, seed: int = 0, lo: int = 20, hi: int = 400) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi, size=n).astype(np.int64)


def _flat(plan):
    return [mb for step in plan for rank in step for mb in rank]


@pytest.mark.parametrize("world,accum,budget", [(1, 1, 512), (2, 1, 512), (3, 2, 700), (4, 3, 400), (8, 1, 4096)])
def test_every_epoch_splits_train_samples_over_ranks_disjoint_and_complete(world, accum, budget):
    lengths = _lengths(301)
    train = np.arange(0, 301, 1)[np.arange(301) % 7 != 0]  # a held-out-like gap in the indices
    for epoch in (0, 1):
        plan = plan_epoch(lengths, train, budget=budget, world_size=world, grad_accum=accum, seed=3, epoch=epoch)
        assert all(len(step) == world and all(len(r) == accum for r in step) for step in plan)
        seen = [i for mb in _flat(plan) for i in mb.indices]
        assert sorted(seen) == sorted(train.tolist())  # complete and no sample twice
        per_rank = [{i for step in plan for mb in step[r] for i in mb.indices} for r in range(world)]
        assert sum(len(s) for s in per_rank) == len(set().union(*per_rank))  # disjoint across ranks


def test_micro_batches_respect_the_token_budget_and_ranks_get_balanced_loads():
    lengths = _lengths(2000, seed=1, lo=50, hi=3072)
    lengths[5] = 9000  # longer than the budget: a micro-batch of its own
    plan = plan_epoch(lengths, np.arange(2000), budget=8192, world_size=4, grad_accum=2, seed=0, epoch=0)
    for mb in _flat(plan):
        assert mb.tokens == int(lengths[list(mb.indices)].sum())
        assert mb.tokens <= 8192 or mb.indices == (5,)
    fill = np.mean([mb.tokens for mb in _flat(plan) if not mb.padding]) / 8192
    assert fill > 0.95  # best-fit packing wastes little of the budget
    loads = np.array([[sum(mb.tokens for mb in rank) for rank in step] for step in plan[:-1]])
    assert np.median(loads.max(1) / loads.min(1)) < 1.05


def test_a_tail_too_small_for_all_ranks_is_padded_with_label_free_micro_batches():
    lengths = np.array([30, 40, 50], dtype=np.int64)
    plan = plan_epoch(lengths, np.arange(3), budget=1000, world_size=4, grad_accum=1, seed=0, epoch=0)
    assert len(plan) == 1
    mbs = _flat(plan)
    assert sorted(i for mb in mbs for i in mb.indices) == [0, 1, 2]  # the one full bin was split for 3 ranks
    assert sum(mb.padding for mb in mbs) == 1
    padding = collate([], block_size=B, num_anchors=8, mask_token_id=MASK, seed=0, epoch=0)
    assert padding["padding"] and not padding["batch"].label_mask.any() and not padding["batch"].block_valid.any()


def test_plan_is_a_pure_function_of_seed_and_epoch():
    lengths = _lengths(500)
    kw = dict(budget=1024, world_size=2, grad_accum=2)
    a = plan_epoch(lengths, np.arange(500), seed=7, epoch=2, **kw)
    assert a == plan_epoch(lengths, np.arange(500), seed=7, epoch=2, **kw)
    assert a != plan_epoch(lengths, np.arange(500), seed=7, epoch=3, **kw)
    assert a != plan_epoch(lengths, np.arange(500), seed=8, epoch=2, **kw)


def test_resuming_at_a_step_replays_exactly_the_remaining_micro_batches():
    plan = plan_epoch(_lengths(400), np.arange(400), budget=900, world_size=3, grad_accum=2, seed=0, epoch=0)
    for rank in range(3):
        full = rank_micro_batches(plan, rank)
        assert rank_micro_batches(plan, rank, 5) == full[5 * 2 :]


def test_total_steps_counts_whole_and_fractional_epochs_or_takes_max_steps():
    sizes = {0: 10, 1: 11, 2: 12}
    assert total_steps(sizes.__getitem__, 2.0, None) == 21
    assert total_steps(sizes.__getitem__, 2.5, None) == 27
    assert total_steps(sizes.__getitem__, 2.5, 5) == 5


def test_the_plan_skips_samples_too_short_for_a_block_or_with_too_few_supervised_tokens_on_both_sides():
    """Two drafter blocks of supervision is a training rule (RunConfig.min_loss_tokens): the plan skips the samples
    below it, held out or not, and counts the training side's, as it does for samples no longer than a block."""
    ids = [f"s/{i}" for i in range(60)]
    lengths, loss = np.full(60, 64), np.full(60, 32)
    lengths[:4] = 8  # no anchor fits a block of 8
    loss[4:12] = 15  # one supervised token short of 2 x 8
    plan = RunPlan.build(ids, lengths, loss, block_size=8, min_loss_tokens=16, budget=256, world_size=1,
                         grad_accum=1, seed=0, epochs=1, max_steps=None, eval_fraction=0.2, eval_max_samples=None)
    train, held = heldout_split(ids, 0.2)
    assert len(held) and set(plan.train_idx) == {i for i in train if i >= 12}
    assert set(plan.eval_idx) == {i for i in held if i >= 12}
    assert (plan.too_short, plan.too_few_loss_tokens) == (sum(i < 4 for i in train), sum(4 <= i < 12 for i in train))
    looser = RunPlan.build(ids, lengths, loss, block_size=8, min_loss_tokens=15, budget=256, world_size=1,
                           grad_accum=1, seed=0, epochs=1, max_steps=None, eval_fraction=0.2, eval_max_samples=None)
    assert looser.too_few_loss_tokens == 0 and set(looser.train_idx) == {i for i in train if i >= 4}


def test_a_data_fraction_trains_on_nested_prompt_subsets_and_scores_every_run_on_the_same_held_out_samples():
    """train.data_fraction (data-size curves): the training side keeps about that share of its PROMPTS (every
    response and repeat of a prompt together), 25 % inside 50 % inside 100 %, the rest counted; the held-out side is
    the same at every fraction; an empty subset is a clear error."""
    ids = [f"src/{p}#{k}" for p in range(400) for k in range(2)]  # two responses per prompt
    lengths, loss = np.full(len(ids), 64), np.full(len(ids), 32)

    def plan(fraction):
        return RunPlan.build(ids, lengths, loss, block_size=8, min_loss_tokens=16, budget=256, world_size=1,
                             grad_accum=1, seed=0, epochs=1, max_steps=None, eval_fraction=0.1,
                             eval_max_samples=None, data_fraction=fraction)

    full, half, quarter = plan(1.0), plan(0.5), plan(0.25)
    assert full.left_out == 0 and len(full.train_idx) + len(full.eval_idx) == len(ids)
    sets = [set(p.train_idx.tolist()) for p in (quarter, half, full)]
    assert sets[0] < sets[1] < sets[2]
    for p, share in ((half, 0.5), (quarter, 0.25)):
        assert abs(len(p.train_idx) / len(full.train_idx) - share) < 0.08
        assert len(p.train_idx) + p.left_out == len(full.train_idx)
        assert np.array_equal(p.eval_idx, full.eval_idx)
        kept = {prompt_id(ids[i]) for i in p.train_idx}
        assert all(prompt_id(ids[i]) not in kept for i in set(full.train_idx.tolist()) - set(p.train_idx.tolist()))
        assert p.state()["num_train_samples"] == len(p.train_idx)  # a resume at another fraction is refused
    with pytest.raises(ValueError, match="data_fraction"):
        plan(0.0)
    with pytest.raises(ValueError, match="inside train.data_fraction=1e-06"):
        plan(1e-6)


def test_heldout_split_depends_only_on_the_sample_id():
    ids = [f"src/{i}" for i in range(1000)]
    train, held = heldout_split(ids, 0.1)
    assert set(train.tolist()).isdisjoint(held.tolist()) and len(train) + len(held) == 1000
    assert 60 < len(held) < 140
    shuffled = ids[::-1]
    _, held2 = heldout_split(shuffled, 0.1)
    assert {shuffled[i] for i in held2} == {ids[i] for i in held}
    assert len(heldout_split(ids[:5], 0.01)[1]) == 1  # a tiny set still gets one held-out sample
    assert len(heldout_split(ids, 0.0)[1]) == 0


def test_heldout_split_keeps_every_sample_of_one_prompt_on_the_same_side():
    # repeats (#r<k>), sampled responses (#<k>) and turn splits (@t<k>) of one conversation share its prompt: a
    # held-out sample that shares it with a training sample would read the drafter's held-out loss too low
    prompts = [f"src/{i}" for i in range(400)]
    ids = [p + suffix for p in prompts for suffix in ("", "#r1", "#1", "#r1#1@t2", "@t1", "#0@t3")]
    train, held = heldout_split(ids, 0.1)
    held_prompts = {prompt_id(ids[i]) for i in held}
    assert held_prompts.isdisjoint(prompt_id(ids[i]) for i in train)
    assert 20 < len(held_prompts) < 70 and len(held) == 6 * len(held_prompts)
    assert {prompt_id(i) for i in ids} == set(prompts)
    assert prompt_id("src/7.2#r3#1@t4") == "src/7.2" and prompt_id("src/7") == "src/7"


def _sample(i: int, n: int) -> dict:
    g = torch.Generator().manual_seed(i)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[n // 3 :] = True
    return {"id": f"s/{i}", "input_ids": torch.randint(0, 200, (n,), generator=g), "loss_mask": mask,
            "features": torch.randn(n, 6, generator=g)}


def test_anchors_depend_on_seed_epoch_and_id_not_on_packing_neighbours():
    a, b = _sample(0, 60), _sample(1, 50)
    kw = dict(block_size=B, num_anchors=5, mask_token_id=MASK, seed=0)

    def anchors(mb, start=0):
        batch = mb["batch"]
        return [x - start for x in batch.anchors[batch.block_valid].tolist() if x >= start]

    alone = collate([a], epoch=0, **kw)
    packed = collate([b, a], epoch=0, **kw)  # a sits after b's 50 tokens in the packed row
    assert anchors(packed, start=50) == anchors(alone)
    assert anchors(collate([a], epoch=1, **kw)) != anchors(alone)  # re-drawn every epoch
    assert anchors(collate([a], epoch=0, **{**kw, "seed": 1})) != anchors(alone)
    assert packed["seq_lens"] == [50, 60] and packed["features"].shape == (1, 110, 6)
    assert len(anchors(alone)) == 5
    for anchor in anchors(alone):
        assert a["loss_mask"][anchor] and anchor <= 60 - B


def test_worker_processes_prefetch_the_same_micro_batches_as_in_process_loading(tmp_path):
    from extract.store import FeatureReader, write_feature_store

    samples = [_sample(i, int(n)) for i, n in enumerate(_lengths(24, lo=20, hi=90))]
    write_feature_store(tmp_path / "extract", samples, fingerprint={"layer_ids": [1, 2], "hidden_size": 3,
                                                                   "storage_dtype": "float32"}, shard_tokens=300)
    reader = FeatureReader(tmp_path / "extract")
    plan = plan_epoch(reader.lengths, np.arange(len(reader)), budget=200, world_size=2, grad_accum=1, seed=0, epoch=1)
    mbs = rank_micro_batches(plan, 1)
    ds = MicroBatchDataset(functools.partial(FeatureReader, tmp_path / "extract"), mbs, block_size=B, num_anchors=6,
                           mask_token_id=MASK, seed=0, epoch=1)
    in_process = list(make_loader(ds, num_workers=0))
    prefetched = list(make_loader(ds, num_workers=2))
    assert len(in_process) == len(prefetched) == len(mbs)
    for x, y, mb in zip(in_process, prefetched, mbs):
        assert x["ids"] == y["ids"] == [samples[i]["id"] for i in mb.indices]
        assert torch.equal(x["features"], y["features"]) and torch.equal(x["batch"].anchors, y["batch"].anchors)
        assert torch.equal(x["features"][0], torch.cat([samples[i]["features"] for i in mb.indices]))


def test_held_out_plan_covers_every_eval_sample_once_with_one_micro_batch_per_rank_per_step():
    lengths = _lengths(50)
    plan = plan_eval(lengths, np.arange(0, 50, 3), budget=600, world_size=3)
    assert all(len(step) == 3 and all(len(r) == 1 for r in step) for step in plan)
    assert sorted(i for mb in _flat(plan) for i in mb.indices) == list(range(0, 50, 3))


def test_tile_padding_aligns_row_and_query_lengths_without_changing_the_loss():
    from train.loss import dflash_loss
    from dflash_model.model import DFlashDrafter, DrafterArgs

    args = DrafterArgs(hidden_size=3, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                       intermediate_size=8, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=320, block_size=B,
                       mask_token_id=MASK, target_layer_ids=[0, 1], num_target_layers=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(args).double()
    drafter.attach_target_head(torch.randn(320, 3, dtype=torch.float64), torch.randn(320, 3, dtype=torch.float64))
    samples = [_sample(i, n) for i, n in enumerate([37, 20, 51])]
    for s in samples:
        s["features"] = s["features"].double()
    kw = dict(block_size=B, num_anchors=5, mask_token_id=MASK, seed=0, epoch=0)
    plain, tiled = collate(samples, **kw), collate(samples, tile=32, **kw)
    assert tiled["batch"].seq_len % 32 == 0 and tiled["batch"].block_ids.numel() % 32 == 0
    assert tiled["pad_tokens"] == 128 - 108 and tiled["tokens"] == plain["tokens"] == 108
    losses = [dflash_loss(drafter.forward_train(mb["features"], mb["batch"], "dense"), drafter.lm_head_weight,
                          mb["batch"], gamma=2.0)[0] for mb in (plain, tiled)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=1e-12)
