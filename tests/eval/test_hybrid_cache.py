"""eval/engine/cache/hybrid.py: the tree-aware hybrid verify equals the path-batched reference, round after round.

Both caches run the same random-init qwen3_5-style hybrid (Gated-DeltaNet + attention layers) on the same trees:
the tree-aware one in ONE forward over the tree's rows (attention under the tree mask, Gated-DeltaNet layers walked
along the tree), the reference with every root->leaf path as its own batch row through HF's forward. Every node's
logits and taps must agree, and after committing an accepted path (the tree-aware one from its kept rows, the
reference by re-running the path through HF) so must the committed conv windows, recurrent states, K/V rows and the
next round's outputs.
"""

from __future__ import annotations

import pytest
import torch

from eval.engine.cache.hybrid import HybridTargetCache, PathBatchedTargetCache
from eval.engine.cache.factory import target_cache
from eval.engine.tree import Tree
from tests.eval.test_decode_greedy import TAPS, prompts, tiny_target
from tests.eval.test_tree_recurrent import SHAPES, root_path, tree_of
from tests.eval.test_walk_device import random_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid():
    return tiny_target("qwen3_5_text")


def trees(gen: torch.Generator, vocab: int, device) -> list[Tree]:
    """Hand-made shapes (several branches at several depths, a star, a chain) with random tokens, then random
    trees of up to 40 nodes and depth 7."""
    out = []
    for parents in SHAPES.values():
        t = tree_of(parents)
        out.append(Tree(torch.randint(vocab, (t.size,), generator=gen), t.parents, t.depths, t.num_nodes,
                        t.depth_limit, "tree"))
    for _ in range(4):
        out.append(random_tree(gen, int(torch.randint(2, 40, (1,), generator=gen)),
                               int(torch.randint(1, 8, (1,), generator=gen)), vocab))
    return [Tree(*(x.to(device) for x in (t.tokens, t.parents, t.depths)), t.num_nodes, t.depth_limit, t.kind)
            for t in out]


def attention_rows(cache) -> list[torch.Tensor]:
    """The committed K rows [1, KVH, length, hd] of every attention layer (HF's dynamic cache, or the static buffer)."""
    if cache.static:
        return [cache.kv[j, 0, :, :, : cache.length] for j in range(cache.kv.shape[0])]
    return [layer.keys for layer in cache.cache.layers if getattr(layer, "keys", None) is not None]


def check_tree_aware_verify_equals_path_batched(target, tol: float, *, static: bool = False) -> None:
    device = target.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(0)
    fast, ref = HybridTargetCache(target, TAPS, static=static), PathBatchedTargetCache(target, TAPS)
    prompt = torch.tensor(prompts(1, 3)[0], device=device)
    for cache in (fast, ref):
        cache.reset(256)
        cache.prefill(prompt)
    non_chain_commits = 0
    for r, tree in enumerate(trees(gen, target.config.vocab_size, device)):
        got = fast.verify(tree, fast.verify_inputs(tree))
        want = ref.verify(tree, ref.verify_inputs(tree))
        scale = float(want.logits.abs().max())
        torch.testing.assert_close(got.logits, want.logits, rtol=tol, atol=tol * scale, msg=f"round {r}: logits")
        torch.testing.assert_close(got.features, want.features, rtol=tol, atol=tol * float(want.features.abs().max()),
                                   msg=f"round {r}: taps")
        # accept the root path of the last node (deep, and past siblings in most shapes)
        path = root_path(tree, tree.size - 1)
        contiguous = path == list(range(len(path)))
        non_chain_commits += not contiguous
        path_t = torch.tensor(path + [0] * (tree.depth_limit + 1 - len(path)), device=device)
        for cache in (fast, ref):
            cache.commit(path_t, len(path), contiguous)
        assert fast.length == ref.length
        torch.testing.assert_close(fast.conv_states, ref.conv_states, rtol=tol, atol=tol, msg=f"round {r}: conv")
        torch.testing.assert_close(fast.recurrent_states, ref.recurrent_states, rtol=tol,
                                   atol=tol * float(ref.recurrent_states.abs().max()), msg=f"round {r}: states")
        for a, b in zip(attention_rows(fast), attention_rows(ref)):
            assert a.shape == b.shape and a.shape[2] == fast.length
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()), msg=f"round {r}: K rows")
    assert non_chain_commits >= 3


def test_tree_aware_verify_and_commit_equal_the_path_batched_reference_round_after_round(hybrid):
    check_tree_aware_verify_equals_path_batched(hybrid, 1e-4)


def test_the_static_kv_verify_and_commit_equal_the_path_batched_reference_round_after_round(hybrid):
    """The static hybrid cache (attention K/V in one preallocated buffer, the mask built from the ancestor matrix and
    the device length, fixed shapes per (N, key bucket): what CUDA graphs capture) gives the same rows."""
    check_tree_aware_verify_equals_path_batched(hybrid, 1e-4, static=True)


def check_device_commit_equals_eager_commit(target, rounds: int = 12) -> int:
    """Two static hybrid caches verify the same rounds (random and hand-made trees, chains, AR roots) and commit the
    same accepted paths: one eagerly (`commit`: the accepted prefix path[:n], a host length), the other as the
    decoder's graphed walk does (`compact_path` with the path padded to L+1 and a device `accepted`, then
    `commit_compacted`). After every round the committed conv windows, recurrent states, K/V rows, host and device
    lengths must be EQUAL (bit for bit), and so must the next round's logits. Returns the non-contiguous commits."""
    device = target.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(3)
    eager, fixed = HybridTargetCache(target, TAPS, static=True), HybridTargetCache(target, TAPS, static=True)
    assert fixed.device_commit and not HybridTargetCache(target, TAPS).device_commit
    prompt = torch.tensor(prompts(1, 6)[0], device=device)
    for cache in (eager, fixed):
        cache.reset(512)
        cache.prefill(prompt)
    vocab = target.config.vocab_size
    shapes = trees(gen, vocab, device)
    chain = Tree(torch.randint(vocab, (8,), generator=gen).to(device), torch.arange(-1, 7, device=device).clamp(min=0),
                 torch.arange(8, device=device), 7, 7, "chain")
    root = Tree(torch.randint(vocab, (1,), generator=gen).to(device), torch.zeros(1, dtype=torch.long, device=device),
                torch.zeros(1, dtype=torch.long, device=device), 0, 0, "root")
    schedule = [shapes[0], chain, root, *shapes[1:], chain, root][:rounds]
    non_contiguous = 0
    for r, tree in enumerate(schedule):
        got = fixed.verify(tree, fixed.verify_inputs(tree))
        want = eager.verify(tree, eager.verify_inputs(tree))
        assert torch.equal(got.logits, want.logits), f"round {r}: logits"
        end = 1 + int(torch.randint(tree.size, (1,), generator=gen))  # accept the root path of a random node
        path = root_path(tree, end - 1)
        contiguous = path == list(range(len(path)))
        non_contiguous += not contiguous
        padded = torch.tensor(path + [0] * (tree.depth_limit + 1 - len(path)), device=device)
        eager.commit(padded, len(path), contiguous)
        fixed.compact_path(padded, torch.tensor(len(path) - 1, device=device))
        fixed.commit_compacted(len(path))
        assert fixed.length == eager.length and int(fixed.past) == int(eager.past) == eager.length
        assert torch.equal(fixed.conv_states, eager.conv_states), f"round {r} ({tree.kind}): conv windows"
        assert torch.equal(fixed.recurrent_states, eager.recurrent_states), f"round {r} ({tree.kind}): states"
        assert torch.equal(fixed.kv[..., : fixed.length, :], eager.kv[..., : eager.length, :]), f"round {r}: K/V"
    return non_contiguous


def test_the_fixed_shape_device_commit_equals_the_eager_commit_bit_for_bit(hybrid):
    """The commit restructured for the walk's CUDA graph (K/V compaction of all L+1 path rows, every Gated-DeltaNet
    layer's state walked L+1 steps with the steps past the accepted ones as no-ops, the conv window picked at a
    device offset) leaves exactly what the eager commit leaves, round after round."""
    assert check_device_commit_equals_eager_commit(hybrid) >= 3


def test_the_static_cache_keeps_its_buffers_across_prompts_and_reallocates_only_to_grow(hybrid):
    cache = HybridTargetCache(hybrid, TAPS, static=True)
    cache.reset(64)
    cache.prefill(torch.tensor(prompts(1, 4)[0]))
    buffers = (cache.kv.data_ptr(), cache.conv_states.data_ptr(), cache.recurrent_states.data_ptr())
    first = cache.recurrent_states.clone()
    cache.reset(100)  # still inside the 2048-row bucket
    cache.prefill(torch.tensor(prompts(2, 4)[1]))
    assert (cache.kv.data_ptr(), cache.conv_states.data_ptr(), cache.recurrent_states.data_ptr()) == buffers
    assert not torch.equal(first, cache.recurrent_states) and cache.generation == 1  # new prompt, same addresses
    cache.reset(5000)
    assert cache.kv.shape[4] == 6144 and cache.generation == 2  # grown: graphs on the old buffer are stale


def test_hybrid_targets_get_the_tree_aware_cache_by_default_and_the_reference_on_request(hybrid):
    assert type(target_cache(hybrid, TAPS)) is HybridTargetCache and not target_cache(hybrid, TAPS).static
    for impl in ("static", "fused", "graphs"):  # static K/V (+ CUDA graphs for 'graphs', on CUDA only)
        assert target_cache(hybrid, TAPS, impl).static and not target_cache(hybrid, TAPS, impl).graphs
    assert type(target_cache(hybrid, TAPS, "paths")) is PathBatchedTargetCache
    with pytest.raises(ValueError, match="hybrid targets only"):
        target_cache(tiny_target("qwen3"), TAPS, "paths")


def test_hf_cache_holds_views_of_the_stacked_states_so_hf_decode_steps_advance_them(hybrid):
    """After the prefill every Gated-DeltaNet layer's HF state is a view of the stacked buffers: an AR step (HF's
    own in-place decode path) changes the stacked buffers, and the next tree verify reads them."""
    cache = HybridTargetCache(hybrid, ())
    cache.reset(64)
    cache.prefill(torch.tensor(prompts(1, 4)[0]))
    for j, (i, _) in enumerate(cache.linear):
        layer = cache.cache.layers[i]
        assert layer.conv_states[0].data_ptr() == cache.conv_states[j].data_ptr()
        assert layer.recurrent_states[0].data_ptr() == cache.recurrent_states[j].data_ptr()
    before = cache.recurrent_states.clone()
    root = Tree(torch.tensor([7]), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0, 0, "root")
    cache.verify(root, cache.verify_inputs(root))
    cache.commit(torch.zeros(1, dtype=torch.long), 1, True)
    assert not torch.equal(before, cache.recurrent_states) and cache.length == len(prompts(1, 4)[0]) + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton walk and commit run on CUDA (GPU machine)")
def test_tree_aware_verify_on_cuda_equals_the_reference_with_no_host_sync():
    """On CUDA the verify (Triton conv + walk) and the commit (one launch for all layers' states) equal the
    reference, and neither reads the device (the round's one sync is the decoder's)."""
    target = tiny_target("qwen3_5_text", device="cuda")
    check_tree_aware_verify_equals_path_batched(target, 3e-3)  # the reference's chunked kernel may run in tf32
    cache = HybridTargetCache(target, TAPS)
    cache.reset(256)
    cache.prefill(torch.tensor(prompts(1, 5)[0], device="cuda"))
    tree = trees(torch.Generator().manual_seed(1), target.config.vocab_size, "cuda")[3]
    path = torch.tensor(root_path(tree, tree.size - 1), device="cuda")
    cache.verify(tree, cache.verify_inputs(tree))  # compiles the kernels
    cache.commit(path, path.shape[0], False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        vin = cache.verify_inputs(tree)
        cache.verify(tree, vin)
        cache.commit(path, path.shape[0], False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_the_graphed_round_commits_inside_its_walk_graph_on_cuda_equal_to_eager_with_one_sync_per_round():
    """On CUDA (Triton commit and compaction) the fixed-shape commit still equals the eager one bit for bit; under
    cache impl 'graphs' the decoder's walk graph holds the hybrid commit and the K/V compaction (`compacts`), no
    graph falls back, DDTree and chain give AR's greedy output, and a decode syncs the host once per round (plus
    the prefill's few)."""
    from eval.engine.decode import decode, round_ops
    from pipeline.cuda_graphs import GRAPH_LOG, host_syncs
    from tests.eval.test_decode_greedy import BLOCK, OracleDrafter, naive_greedy

    target = tiny_target("qwen3_5_text", device="cuda")
    assert check_device_commit_equals_eager_commit(target) >= 3
    cache = target_cache(target, TAPS, "graphs")
    assert cache.device_commit and round_ops("ddtree", 16, "device", cache, 0.0, BLOCK - 1,
                                             target.config.vocab_size, torch.device("cuda")).compacts
    fallbacks = len(GRAPH_LOG.fallbacks)
    prompt = prompts(1, 12)[0]
    greedy = naive_greedy(target, prompt, 40 + BLOCK)
    oracle = OracleDrafter(target, prompt, greedy, seed=0)
    ar = decode("ar", target, None, prompt, max_new_tokens=40, cache_impl="graphs")
    assert ar.output_ids == greedy[:40]
    assert decode("chain", target, oracle, prompt, max_new_tokens=40, cache_impl="graphs").output_ids == ar.output_ids
    for budget in (16, 64):
        assert decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=budget,
                      cache_impl="graphs").output_ids == ar.output_ids
    assert GRAPH_LOG.fallbacks[fallbacks:] == []
    oracle = OracleDrafter(target, prompt, greedy, seed=0, host_checks=False)
    syncs, res = host_syncs(lambda: decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=16,
                                           cache_impl="graphs", phase_timing=False))
    assert len(syncs) <= res.num_rounds + 5, syncs[:5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_a_decode_across_key_buckets_walks_each_verify_graphs_logits_where_they_are():
    """Each key bucket's verify graph has its own output buffers; the walk graph reading them is captured per
    producer, so a decode that crosses buckets copies no logits into a walk graph (one shared walk graph copied
    N x vocab logits every round after the first bucket), and stays equal to AR."""
    from eval.engine.cache.kv import KV_BUCKET
    from eval.engine.decode import decode, round_ops
    from tests.eval.test_decode_greedy import BLOCK, OracleDrafter, naive_greedy

    target = tiny_target("qwen3_5_text", device="cuda")
    prompt = torch.randint(3, 259, (KV_BUCKET - 20,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = naive_greedy(target, prompt, 2 * KV_BUCKET + BLOCK)
    ar = decode("ar", target, None, prompt, max_new_tokens=2 * KV_BUCKET, cache_impl="graphs")
    assert ar.output_ids == greedy[:2 * KV_BUCKET]
    oracle = OracleDrafter(target, prompt, greedy, seed=0)
    out = decode("ddtree", target, oracle, prompt, max_new_tokens=2 * KV_BUCKET, budget=16, cache_impl="graphs")
    assert out.output_ids == ar.output_ids
    # the decoder's cache and round ops (kept per target, taps and round configuration) are what it used
    cache = target_cache(target, tuple(oracle.args.target_layer_ids), "graphs")
    ops = round_ops("ddtree", 16, "device", cache, 0.0, oracle.args.block_size - 1,
                    target.get_output_embeddings().weight.shape[0], torch.device("cuda"))
    assert len(ops._walks) >= 3, "a walk graph per key bucket the decode reached"
    assert [w.copied_bytes for w in ops._walks.values()] == [0] * len(ops._walks)
