"""eval/engine/tree_recurrent.py: a Gated-DeltaNet layer verified over a tree equals HF's layer run along each root path.

Every node's output, and the cache state committed for it, must be what HF's own layer gives when the node's root
path (root .. node) is run from the committed cache: token by token (HF's decode path: causal_conv1d_update +
torch_recurrent_gated_delta_rule) and as one sequence (its chunked path, as the path-batched verify runs it).
"""

from __future__ import annotations

import copy

import pytest
import torch

from eval.engine.tree import Tree
from eval.engine.tree_recurrent import (TreeLayerRecord, conv_window_rows, path_gated_delta_state, tree_causal_conv1d,
                                 tree_gated_delta_net, tree_gated_delta_rule)
from tests.eval.test_walk_device import random_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tree_of(parents: list[int]) -> Tree:
    """A Tree (eval/engine/tree.py layout) from its parent list; parents[0] = 0 is the root."""
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)
    return Tree(as_t([0] * len(parents)), as_t(parents), as_t(depths), len(parents) - 1, max(max(depths), 1), "tree")


def root_path(tree: Tree, node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


# Trees in selection order (not depth-first): a node's predecessor in the flattened order is often not its parent.
SHAPES = {
    "root only": [0],
    "chain": [0, 0, 1, 2, 3, 4, 5],
    "star": [0, 0, 0, 0, 0, 0],
    "branches at several depths": [0, 0, 0, 1, 2, 1, 3, 3, 5, 4, 6, 8, 8, 11, 2],
}


def shapes_and_random_trees(count: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    trees = [(name, tree_of(p)) for name, p in SHAPES.items()]
    for i in range(count):
        L = int(torch.randint(1, 8, (1,), generator=gen))
        trees.append((f"random {i}", random_tree(gen, int(torch.randint(1, 40, (1,), generator=gen)), L, 3)))
    return trees


# ----------------------------------------------------------------------------------------------
# The conv window
# ----------------------------------------------------------------------------------------------


def test_conv_windows_come_from_the_ancestors_then_the_committed_window():
    """With weight = identity over taps (channel j reads tap j only) and no activation, output [i, j] is the value
    at j steps back in node i's window: the node, its parent, grandparent, ..., then the committed window from its
    newest column. A window over the flattened order (node i-1, i-2, ...) gives other values on this tree."""
    tree = tree_of(SHAPES["branches at several depths"])
    N, K = tree.size, 4
    x = (torch.arange(N, dtype=torch.float64) + 1).unsqueeze(1).expand(N, K).contiguous()  # node i carries i + 1
    conv_state = -(torch.arange(K, dtype=torch.float64) + 1).unsqueeze(0).expand(K, K).contiguous()  # col c: -(c+1)
    weight = torch.eye(K, dtype=torch.float64).flip(1)  # channel j: weight[j, K-1-j] = 1 (tap j)
    got = tree_causal_conv1d(x, conv_state, weight, tree.parents, tree.depths, activation=None)
    for i in range(N):
        window = root_path(tree, i)[::-1]  # node, parent, ..., root
        expected = [float(n + 1) for n in window] + [-(K - m + 1) for m in range(1, K)]  # then columns K-1, K-2, ..
        assert got[i].tolist() == expected[:K], i
    flattened = torch.tensor([[float(i - j + 1) if i - j >= 0 else -(K - (j - i) + 1) for j in range(K)] for i in range(N)],
                             dtype=torch.float64)
    assert not torch.equal(got, flattened)
    assert torch.equal(conv_window_rows(tree.parents, tree.depths, K)[0], torch.tensor([K, K - 1, K - 2, K - 3]))


# ----------------------------------------------------------------------------------------------
# The recurrence
# ----------------------------------------------------------------------------------------------


def random_rows(N: int, HK: int, HV: int, dk: int, dv: int, gen: torch.Generator, dtype=torch.float32):
    q = torch.randn(N, HK, dk, generator=gen).to(dtype)
    k = torch.randn(N, HK, dk, generator=gen).to(dtype)
    v = torch.randn(N, HV, dv, generator=gen).to(dtype)
    g = -torch.rand(N, HV, generator=gen) * 0.7  # decays exp(g) in [0.5, 1]: the parent's state matters
    beta = torch.rand(N, HV, generator=gen)
    state = torch.randn(HV, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def hf_torch_recurrence():
    """transformers' torch definition of the recurrent gated delta rule. Where fla-core is installed, transformers
    binds the module-level name to fla's Triton kernel (a hub-kernel wrapper), which cannot take these CPU tensors
    (the failure of the H200 run of 2026-12-02): unwrap it."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)


def test_tree_rule_equals_hf_recurrence_along_every_root_path():
    """o[i] = the last output of HF's torch_recurrent_gated_delta_rule over node i's root path from the committed
    state, and path_gated_delta_state(path) = its final state, on every tree shape (GQA: 2 q/k heads, 4 value
    heads)."""
    torch_recurrent_gated_delta_rule = hf_torch_recurrence()

    gen = torch.Generator().manual_seed(0)
    for name, tree in shapes_and_random_trees(6, seed=1):
        q, k, v, g, beta, state = random_rows(tree.size, 2, 4, 8, 6, gen)
        out = tree_gated_delta_rule(q, k, v, g, beta, tree.parents, tree.depths, state)
        for i in range(tree.size):
            path = torch.tensor(root_path(tree, i))
            rows = [x[path].unsqueeze(0) for x in (q, k, v, g, beta)]
            rows[:2] = [r.repeat_interleave(2, dim=2) for r in rows[:2]]
            ref_out, ref_state = torch_recurrent_gated_delta_rule(*rows[:3], g=rows[3], beta=rows[4],
                                                                  initial_state=state[None], output_final_state=True,
                                                                  use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out[i], ref_out[0, -1], rtol=1e-5, atol=1e-5, msg=f"{name}: node {i}")
            torch.testing.assert_close(path_gated_delta_state(k, v, g, beta, path, state), ref_state[0],
                                       rtol=1e-5, atol=1e-5, msg=f"{name}: state of node {i}")


def test_tree_rule_differs_from_a_recurrence_over_the_flattened_order():
    """The check above can fail: running the rows in flattened order (each node after its predecessor) gives
    other outputs as soon as a predecessor is not the parent."""
    torch_recurrent_gated_delta_rule = hf_torch_recurrence()

    tree = tree_of(SHAPES["branches at several depths"])
    q, k, v, g, beta, state = random_rows(tree.size, 2, 2, 8, 6, torch.Generator().manual_seed(3))
    out = tree_gated_delta_rule(q, k, v, g, beta, tree.parents, tree.depths, state)
    flat, _ = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                               initial_state=state[None], use_qk_l2norm_in_kernel=True)
    same = torch.isclose(out, flat[0], rtol=1e-5, atol=1e-5).flatten(1).all(1)
    assert same[:2].all() and not same[2:].all()  # root and its first child agree; node 2 (a sibling) does not


# ----------------------------------------------------------------------------------------------
# One HF layer
# ----------------------------------------------------------------------------------------------


def tiny_gated_delta_net(dtype=torch.float32, seed: int = 0):
    """A random-init Gated-DeltaNet layer of the project's tiny qwen3_5_text shape (pipeline/target.py), with
    decays in [0.5, 0.95] per step (HF's init draws A up to 16: most heads would forget everything at once)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from pipeline.config import RANDOM_DEFAULTS

    config = AutoConfig.for_model("qwen3_5_text", **RANDOM_DEFAULTS["qwen3_5_text"], vocab_size=320)
    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.05, 0.5).log())
        layer.dt_bias.copy_(torch.randn_like(layer.dt_bias) * 0.3)
        layer.in_proj_a.weight.mul_(0.3)
        layer.norm.weight.copy_(1 + torch.randn_like(layer.norm.weight) * 0.2)
    return config, layer.to(dtype).eval()


def committed_cache(config, layer, prefix_len: int, dtype, gen: torch.Generator):
    """HF's cache after the layer ran `prefix_len` random tokens (a prefill)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    with torch.no_grad():
        layer(torch.randn(1, prefix_len, config.hidden_size, generator=gen).to(layer.A_log.device, dtype),
              cache_params=cache)
    return cache


def layer_states(cache) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA (GPU machine)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("prefix_len", [1, 6])  # shorter and longer than the conv window
def test_tree_layer_equals_hf_layer_run_along_each_root_path(dtype, tol, prefix_len, device):
    """For every node i of every tree shape: output row i == HF's layer over i's root path from the committed cache
    (token by token, and as one sequence), and record.commit(path) leaves exactly the cache HF leaves. A short
    prefix (1 token) makes the windows of shallow nodes reach into HF's zero-padded committed window. On CUDA the
    tree verify and the commit run the Triton kernels."""
    if device == "cuda" and dtype == torch.float32:
        tol = 2e-3  # with fla-core installed the HF layer runs fla's kernels, whose chunked form multiplies in tf32
    config, layer = tiny_gated_delta_net(dtype)
    layer.to(device)
    gen = torch.Generator().manual_seed(prefix_len)
    for name, tree in shapes_and_random_trees(3, seed=prefix_len):
        cache = committed_cache(config, layer, prefix_len, dtype, gen)
        conv_state, recurrent_state = layer_states(cache)
        hidden = torch.randn(1, tree.size, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
        tree = Tree(*(t.to(device) for t in (tree.tokens, tree.parents, tree.depths)), tree.num_nodes,
                    tree.depth_limit, tree.kind)
        saved = conv_state.clone(), recurrent_state.clone()
        out, record = tree_gated_delta_net(layer, hidden, tree, conv_state, recurrent_state)
        assert torch.equal(conv_state, saved[0]) and torch.equal(recurrent_state, saved[1])  # verify reads only
        assert out.shape == hidden.shape and out.dtype == dtype and isinstance(record, TreeLayerRecord)
        for i in range(tree.size):
            path = root_path(tree, i)
            stepped = copy.deepcopy(cache)
            with torch.no_grad():
                for t in path:
                    last = layer(hidden[:, [t]], cache_params=stepped)[0, -1]
                whole = copy.deepcopy(cache)
                last_whole = layer(hidden[:, path], cache_params=whole)[0, -1]
            scale = last.float().abs().max()
            torch.testing.assert_close(out[0, i].float(), last.float(), rtol=tol, atol=tol * scale, msg=f"{name}: {i}")
            torch.testing.assert_close(out[0, i].float(), last_whole.float(), rtol=tol, atol=tol * scale,
                                       msg=f"{name}: {i} (one sequence)")
            conv, rec = (s.clone() for s in saved)
            record.commit(torch.tensor(path, device=device), conv, rec)
            hf_conv, hf_rec = layer_states(stepped)
            torch.testing.assert_close(conv, hf_conv, rtol=tol, atol=tol, msg=f"{name}: conv window of node {i}")
            torch.testing.assert_close(rec, hf_rec, rtol=tol, atol=tol * float(hf_rec.abs().max()),
                                       msg=f"{name}: state of node {i}")
