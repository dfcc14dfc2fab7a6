"""eval/engine/target_forward.py: the fused verify forward computes HF's forward (fp32, CPU), and the cache only uses it
after checking that on the first verify."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eval.engine.cache.factory import target_cache
from eval.engine.decode import decode
from eval.engine.target_forward import _are_row_views, fuse_projections, refusal
from eval.engine.tree import build_tree
from eval.engine.verify import ancestor_table

from tests.eval.test_decode_greedy import BLOCK, TAPS, OracleDrafter, naive_greedy, prompts, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def qwen2_with_biases():
    config = AutoConfig.for_model("qwen2", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, vocab_size=320,
                                  max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    for layer in model.model.layers:  # non-zero q/k/v biases, so a dropped or misplaced bias shows
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    return model.requires_grad_(False)


TARGETS = {"qwen3": lambda: tiny_target("qwen3"), "llama": lambda: tiny_target("llama"), "qwen2": qwen2_with_biases}


def verify_once(cache, prompt, logits, budget):
    cache.reset(256)
    cache.prefill(torch.tensor(prompt))
    tree = build_tree(logits, budget, 7)
    vin = cache.verify_inputs(tree, ancestor_table(tree.parents, tree.depth_limit))
    out = cache.verify(tree, vin)
    rows = cache.kv.kv[:, :, :, :, cache.length: cache.length + tree.size].clone()
    return out, rows


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fused_verify_equals_hf_forward_on_a_tree(name):
    target = TARGETS[name]()
    assert refusal(target) is None
    hf, fused = target_cache(target, TAPS, "static"), target_cache(target, TAPS, "fused")
    prompt = prompts(1, 4)[0]
    draft = torch.randn(BLOCK - 1, target.config.vocab_size, generator=torch.Generator().manual_seed(1)) * 3
    for attention in ("sdpa", "sdpa_gqa"):
        fused.fused.attention = attention
        for budget in (1, 16, 40):
            ref, ref_rows = verify_once(hf, prompt, draft, budget)
            got, got_rows = verify_once(fused, prompt, draft, budget)
            assert fused.fused is not None, "the first-verify check against HF rejected the fused forward"
            torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.features, ref.features, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_rows, ref_rows, rtol=1e-5, atol=1e-5)  # the K/V the next round reads


def test_fuse_projections_changes_no_output_and_adds_no_buffer():
    target = tiny_target("qwen3")
    ids = torch.tensor([prompts(1, 8)[0]])
    before = target(ids).logits
    attn = target.model.layers[0].self_attn
    fuse_projections(target)
    fuse_projections(target)  # idempotent
    assert _are_row_views([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(target(ids).logits, before)


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_fused_cache_decodes_exactly_like_ar(name):
    target = TARGETS[name]()
    for i, prompt in enumerate(prompts(2, 12)):
        greedy = naive_greedy(target, prompt, 30 + BLOCK)
        oracle = OracleDrafter(target, prompt, greedy, seed=i)
        assert decode("ar", target, None, prompt, max_new_tokens=30, cache_impl="fused").output_ids == greedy[:30]
        assert decode("chain", target, oracle, prompt, max_new_tokens=30, cache_impl="fused").output_ids == greedy[:30]
        for budget in (2, 32):
            res = decode("ddtree", target, oracle, prompt, max_new_tokens=30, budget=budget, cache_impl="fused")
            assert res.output_ids == greedy[:30] and (budget < 32 or max(res.accept_lengths) > 3)
    cache = target_cache(target, TAPS, "fused")
    assert cache.fused is not None and cache.describe() == "static KV, fused forward (sdpa attention)"
    assert target_cache(target, TAPS, "static").describe() == "static KV, HF forward"


def _wrong_scale(fused):
    fused.scale *= 2.0  # a wrong attention scale: what a broken rebuild of the layer would look like


def _raising(fused):
    fused.layers = None  # what a compile or kernel error looks like from here: the call raises


@pytest.mark.parametrize("breakage, seed", [(_wrong_scale, 13), (_raising, 14)], ids=["disagrees_with_hf", "fails"])
def test_a_broken_fused_forward_is_dropped_and_decoding_stays_exact(breakage, seed, caplog):
    target = tiny_target("llama")
    cache = target_cache(target, TAPS, "fused")
    breakage(cache.fused)
    prompt = prompts(1, seed)[0]
    greedy = naive_greedy(target, prompt, 20 + BLOCK)
    oracle = OracleDrafter(target, prompt, greedy, seed=0)
    with caplog.at_level("WARNING"):
        res = decode("ddtree", target, oracle, prompt, max_new_tokens=20, budget=16, cache_impl="fused")
    assert cache.fused is None and res.output_ids == greedy[:20]
    if breakage is _wrong_scale:  # the warning says which outputs differ: the logits, every tap, the worst rows
        line = next(r.getMessage() for r in caplog.records if "differs from HF's" in r.getMessage())
        assert "logits " in line and "worst rows " in line
        assert len(line.split("taps ")[1].split(";")[0].split()) == len(TAPS)


def test_the_disagreement_report_names_the_first_tap_and_the_rows_that_differ():
    """A forward wrong from the second tap's layer on and only in tree rows 2-3 (what a mask error past the bonus
    row looks like) is reported that way: tap 0 equal, taps 1.. not; rows 2 and 3 the worst."""
    from eval.engine.cache.kv import disagreement

    g = torch.Generator().manual_seed(0)
    logits, features = torch.randn(5, 32, generator=g), torch.randn(5, 3 * 8, generator=g)
    bad_logits, bad_features = logits.clone(), features.clone()
    bad_logits[2:4] += 5.0
    bad_features[:, 8:] += 1.0
    text = disagreement((bad_logits, bad_features), (logits, features), 3)
    taps = [float(x) for x in text.split("taps ")[1].split(";")[0].split()]
    assert taps[0] == 0.0 and taps[1] > 0.1 and taps[2] > 0.1
    worst = text.split("worst rows ")[1].split(", ")
    assert {w.split(":")[0] for w in worst[:2]} == {"2", "3"} and worst[2].endswith("0.00e+00")


def test_targets_the_fused_forward_cannot_rebuild_are_refused_and_use_hf():
    sliding = tiny_target("qwen3", use_sliding_window=True, sliding_window=5, max_window_layers=2)
    assert "sliding" in refusal(sliding)
    assert "qwen3_5_text" in refusal(tiny_target("qwen3_5_text"))
    cache = target_cache(sliding, TAPS, "fused")
    assert cache.fused is None and cache.static
    prompt = prompts(1, 21)[0]
    greedy = naive_greedy(sliding, prompt, 20 + BLOCK)
    oracle = OracleDrafter(sliding, prompt, greedy, seed=1)
    assert decode("ddtree", sliding, oracle, prompt, max_new_tokens=20, budget=16,
                  cache_impl="fused").output_ids == greedy[:20]


@pytest.mark.slow
def test_compiled_fused_forward_equals_eager_with_one_graph_for_every_n_and_layer():
    """torch.compile'd pre/post (what the CUDA-graph cache runs), here by inductor on the CPU: the same logits,
    taps and K/V rows as the eager fused forward at several tree sizes, and each function compiled at most twice
    (N dynamic; never once per layer, whose cache slices and weights are arguments)."""
    import eval.engine.target_forward as tf

    torch._dynamo.reset()
    target = tiny_target("qwen3")
    eager, compiled = target_cache(target, TAPS, "fused"), target_cache(target, TAPS, "fused")
    compiled.fused = tf.VerifyForward(target, TAPS, compile=True)
    prompt = prompts(1, 4)[0]
    draft = torch.randn(BLOCK - 1, target.config.vocab_size, generator=torch.Generator().manual_seed(2)) * 3
    for budget in (1, 9, 16, 40):
        ref, ref_rows = verify_once(eager, prompt, draft, budget)
        got, got_rows = verify_once(compiled, prompt, draft, budget)
        assert compiled.fused is not None and compiled.fused.compiled, "the compiled forward failed its check"
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.features, ref.features, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_rows, ref_rows, rtol=1e-5, atol=1e-5)
    for fn in (tf.pre_attention, tf.post_attention):
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
        assert 1 <= len(entries) <= 2, f"{fn.__name__} compiled {len(entries)} times"


def test_verifies_of_one_tree_size_return_the_same_buffers_whatever_the_key_bucket():
    """So the walk's CUDA graph, captured on the first verify's outputs, never copies [N, V] logits when a longer
    past brings a new verify graph (eval/engine/cache/kv.py KV_BUCKET); the values still equal HF's forward."""
    from eval.engine.cache.kv import KV_BUCKET

    target = tiny_target("qwen3")
    hf, fused = target_cache(target, TAPS, "static"), target_cache(target, TAPS, "fused")
    draft = torch.randn(BLOCK - 1, target.config.vocab_size, generator=torch.Generator().manual_seed(3)) * 3
    seen = []
    gen = torch.Generator().manual_seed(4)
    for prompt_len in (4, KV_BUCKET + 20):  # two different key buckets, the same tree size
        prompt = torch.randint(3, 259, (prompt_len,), generator=gen).tolist()
        ref, _ = verify_once(hf, prompt, draft, 16)
        got, _ = verify_once(fused, prompt, draft, 16)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.features, ref.features, rtol=1e-4, atol=1e-4)
        seen.append((got.logits.data_ptr(), got.features.data_ptr(), sorted(fused._verify_fns)))
    assert seen[0][:2] == seen[1][:2]
    assert seen[1][2] == [(17, KV_BUCKET), (17, 2 * KV_BUCKET)]  # two verify functions: two buckets
