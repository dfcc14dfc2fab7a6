"""eval/engine/tree_recurrent_triton.py equals eval/engine/tree_recurrent.py: the walk order on any device, the kernels in Triton's
CPU interpreter (a subprocess, as tests/eval/test_triton_kernels.py), compiled for sm_90 without a GPU, and compiled
at the Qwen3.6-27B shape on a GPU machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.eval.test_tree_recurrent import SHAPES, random_rows, root_path, shapes_and_random_trees, tree_of
from tests.eval.test_triton_kernels import compile_for_sm90, run_interpreted
from tests.eval.test_walk_device import random_tree

pytest.importorskip("triton")

MODULE = "tests.eval.test_tree_recurrent_triton"


def depth_first(parents: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children.get(node, [])))
    return order


def test_walk_order_is_the_depth_first_preorder_and_marks_the_forks():
    from eval.engine.tree_recurrent_triton import walk_order

    gen = torch.Generator().manual_seed(0)
    trees = [tree_of(p) for p in SHAPES.values()]
    trees += [random_tree(gen, int(torch.randint(0, 300, (1,), generator=gen)), int(torch.randint(1, 16, (1,),
                                                                                                   generator=gen)), 6)
              for _ in range(200)]
    for tree in trees:
        order, fork = walk_order(tree.parents, tree.depths, tree.depth_limit)
        parents = tree.parents.tolist()
        assert order.tolist() == depth_first(parents)
        assert fork.tolist() == [int(sum(p == i for p in parents[1:]) >= 2) for i in range(tree.size)]


# ----------------------------------------------------------------------------------------------
# Kernel checks: run in the interpreter on the CPU (device="cpu") or compiled on CUDA
# ----------------------------------------------------------------------------------------------


def check_tree_conv_equals_torch(device: str = "cpu"):
    from eval.engine import tree_recurrent, tree_recurrent_triton

    gen = torch.Generator().manual_seed(1)
    C = 40 if device == "cpu" else 10240  # the 27B conv width on CUDA
    for trial, (name, tree) in enumerate(shapes_and_random_trees(4 if device == "cpu" else 20, seed=2)):
        dtype = torch.float32 if trial % 2 else torch.bfloat16
        rows = torch.randn(tree.size, C + 8, generator=gen).to(device=device, dtype=dtype)
        x = rows[:, 8:]  # a row stride that is not C
        conv_state = torch.randn(1, C, 4, generator=gen).to(device=device, dtype=dtype)
        weight = torch.randn(C, 4, generator=gen).to(device=device, dtype=dtype)
        parents, depths = tree.parents.to(device), tree.depths.to(device)
        for act in ("silu", None):
            got = tree_recurrent_triton.tree_causal_conv1d(x, conv_state[0], weight, parents, depths, act)
            ref = tree_recurrent.tree_causal_conv1d(x, conv_state[0], weight, parents, depths, act)
            tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: 2 ulps (the interpreter rounds toward zero)
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol, msg=name)


def check_tree_gated_delta_equals_torch(device: str = "cpu"):
    """Outputs of the walk equal the level-by-level torch version; the path kernel's state equals the torch path
    state, written in place over the committed state too. CPU: a tiny GQA shape with d_k, d_v that are not powers
    of two (masked blocks); CUDA: the 27B shape (16 q/k heads, 48 value heads, 128 x 128), bf16 and fp32 rows, up
    to a budget-256 tree."""
    from eval.engine import tree_recurrent, tree_recurrent_triton

    gen = torch.Generator().manual_seed(3)
    HK, HV, dk, dv, count = (2, 4, 12, 10, 6) if device == "cpu" else (16, 48, 128, 128, 8)
    trees = shapes_and_random_trees(count, seed=4)
    if device != "cpu":
        trees.append(("budget 256", random_tree(gen, 256, 15, 4)))
    for trial, (name, tree) in enumerate(trees):
        dtype = torch.float32 if trial % 2 else torch.bfloat16
        q, k, v, g, beta, state = (t.to(device) for t in random_rows(tree.size, HK, HV, dk, dv, gen, dtype))
        mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)  # views of one [N, C] block, as in a layer
        q, k, v = (t.unflatten(1, s) for t, s in zip(mixed.split([HK * dk, HK * dk, HV * dv], 1),
                                                     [(HK, dk), (HK, dk), (HV, dv)]))
        parents, depths = tree.parents.to(device), tree.depths.to(device)
        walk = tree_recurrent_triton.walk_order(parents, depths, tree.depth_limit)
        got = tree_recurrent_triton.tree_gated_delta_rule(q, k, v, g, beta, parents, depths, state, walk,
                                                          tree.depth_limit)
        ref = tree_recurrent.tree_gated_delta_rule(q, k, v, g, beta, parents, depths, state)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()),
                                   msg=name)
        leaf = tree.size - 1
        path = [leaf]
        while path[-1] != 0:
            path.append(int(tree.parents[path[-1]]))
        path = torch.tensor(path[::-1], device=device)
        ref_state = tree_recurrent.path_gated_delta_state(k, v, g, beta, path, state)
        got_state = tree_recurrent_triton.path_gated_delta_state(k, v, g, beta, path, state)
        torch.testing.assert_close(got_state, ref_state, rtol=1e-5, atol=1e-5 * float(ref_state.abs().max()), msg=name)
        in_place = state.clone()
        tree_recurrent_triton.path_gated_delta_state(k, v, g, beta, path, in_place, in_place)
        assert torch.equal(in_place, got_state), name


def check_stacked_path_state_equals_each_layer(device: str = "cpu"):
    """The commit of B stacked layers in one launch (a layer grid axis) leaves every layer's state exactly as the
    one-layer kernel does, and as the torch version with the same leading layer axis; in place over the committed
    states too. Rows are views of one [B, N, C] block per layer stack, as the cache keeps them."""
    from eval.engine import tree_recurrent, tree_recurrent_triton

    gen = torch.Generator().manual_seed(5)
    B, HK, HV, dk, dv = (3, 2, 4, 12, 10) if device == "cpu" else (48, 16, 48, 128, 128)
    tree = tree_of(SHAPES["branches at several depths"])
    N = tree.size
    mixed = torch.randn(B, N, 2 * HK * dk + HV * dv, generator=gen).to(device=device, dtype=torch.bfloat16)
    _, k, v = mixed.split([HK * dk, HK * dk, HV * dv], -1)
    k, v = k.unflatten(-1, (HK, dk)), v.unflatten(-1, (HV, dv))
    g = (-torch.rand(B, N, HV, generator=gen) * 0.7).to(device)
    beta = torch.rand(B, N, HV, generator=gen).to(device)
    states = torch.randn(B, HV, dk, dv, generator=gen).to(device)
    path = torch.tensor([0, 2, 4, 8, 11], device=device)  # a root path with siblings skipped on the way
    got = tree_recurrent_triton.path_gated_delta_state(k, v, g, beta, path, states)
    ref = tree_recurrent.path_gated_delta_state(k, v, g, beta, path, states)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for b in range(B):
        one = tree_recurrent_triton.path_gated_delta_state(k[b], v[b], g[b], beta[b], path, states[b])
        assert torch.equal(got[b], one), b
    in_place = states.clone()
    tree_recurrent_triton.path_gated_delta_state(k, v, g, beta, path, in_place, in_place)
    assert torch.equal(in_place, got)


def check_device_commit_equals_the_commit_of_the_accepted_prefix(device: str = "cpu"):
    """The device commit (`commit_path_steps`: path [L+1], the accepted count n read by the kernels from a 0-dim
    device tensor, rows read where the verify left them) leaves every layer's state bit for bit as the path kernel
    over path[:n] does (what the eager commit runs), and the conv windows exactly as `path_conv_state` over those
    rows; for every n in 1..L+1, with node ids after the accepted ones that are no ancestors (the walk leaves the
    rest of its path buffer so). Equal to the torch fixed-shape commit within fp32 rounding. CPU: tiny shape;
    CUDA: the 27B shape (48 layers)."""
    from eval.engine import tree_recurrent, tree_recurrent_triton

    gen = torch.Generator().manual_seed(11)
    B, HK, HV, dk, dv, K = (3, 2, 4, 12, 10, 4) if device == "cpu" else (48, 16, 48, 128, 128, 4)
    tree = tree_of(SHAPES["branches at several depths"])
    N, C = tree.size, 2 * HK * dk + HV * dv
    mixed = torch.randn(B, N, C, generator=gen).to(device=device, dtype=torch.bfloat16)
    conv_inputs = torch.randn(B, N, C, generator=gen).to(device=device, dtype=torch.bfloat16)
    g = (-torch.rand(B, N, HV, generator=gen) * 0.7).to(device)
    beta = torch.rand(B, N, HV, generator=gen).to(device)
    states = torch.randn(B, HV, dk, dv, generator=gen).to(device)
    windows = torch.randn(B, C, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    accepted = [0, 2, 4, 8, 11]  # a root path with siblings skipped on the way
    path = torch.tensor(accepted + [5, 1, 3], device=device)  # L + 1 = 8 entries
    layer = SimpleNamespace(key_dim=HK * dk, value_dim=HV * dv, num_k_heads=HK, head_k_dim=dk, num_v_heads=HV,
                            head_v_dim=dv)  # the dimensions `_split_heads` reads off a Gated-DeltaNet module
    _, k, v = tree_recurrent._split_heads(mixed, layer)
    for n in range(1, len(accepted) + 1):
        got_states, got_windows = states.clone(), windows.clone()
        tree_recurrent_triton.commit_path_steps(k, v, g, beta, conv_inputs, path,
                                                torch.tensor(n, device=device), got_windows, got_states)
        prefix = path[:n]
        assert torch.equal(got_states, tree_recurrent_triton.path_gated_delta_state(k, v, g, beta, prefix, states)), n
        assert torch.equal(got_windows, tree_recurrent.path_conv_state(conv_inputs.index_select(1, prefix), windows)), n
        ref_states, ref_windows = states.clone(), windows.clone()
        tree_recurrent.commit_path_steps(layer, conv_inputs, mixed, g, beta, path, torch.tensor(n, device=device),
                                         ref_windows, ref_states)  # the torch version off CUDA
        assert torch.equal(got_windows, ref_windows), n
        torch.testing.assert_close(got_states, ref_states, rtol=1e-5, atol=1e-5 * float(ref_states.abs().max()))


_GUARDED = []  # the mappings behind guarded() tensors, alive until the process ends


def guarded(t: torch.Tensor, at_end: bool) -> torch.Tensor:
    """A CPU copy of t that starts right after (or, at_end, ends right before) a page the process may not read:
    an unmasked load one element outside it kills the process (SIGSEGV) instead of reading a neighbour's bytes."""
    import ctypes
    import mmap

    page, nbytes = mmap.PAGESIZE, t.numel() * t.element_size()
    body = -(-nbytes // page) * page
    mm = mmap.mmap(-1, body + 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None)
    for at in (base, base + page + body):
        assert libc.mprotect(ctypes.c_void_p(at), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    copy = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=page + (body - nbytes if at_end else 0))
    _GUARDED.append(mm)
    return copy.view(t.shape).copy_(t)


def check_walk_reads_nothing_outside_its_tensors(device: str = "cpu"):
    """Every tensor the walk reads (rows, decays, tree, walk order, states, scratch; and the tree convolution's)
    sits against an unreadable page, before it and then after it: no kernel may load an element outside any of
    them, also on the steps whose prefetched loads are discarded (past the last node the indices wrap to the root).
    Written after the H200 run of 2026-12-02: the wrapped step reloaded the root's "parent" from scratch slot -1 (an
    illegal address at budget 64; unnoticed in the interpreter, whose neighbouring bytes were readable)."""
    from eval.engine import tree_recurrent, tree_recurrent_triton

    gen = torch.Generator().manual_seed(7)
    HK, HV, dk, dv = 2, 4, 12, 10
    for at_end in (False, True):
        for name, tree in [("branches at several depths", tree_of(SHAPES["branches at several depths"])),
                           ("random", random_tree(gen, 40, 6, 3)), ("root only", tree_of([0]))]:
            q, k, v, g, beta, state = random_rows(tree.size, HK, HV, dk, dv, gen, torch.bfloat16)
            mixed = guarded(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1), at_end)
            q, k, v = (t.unflatten(1, s) for t, s in zip(mixed.split([HK * dk, HK * dk, HV * dv], 1),
                                                         [(HK, dk), (HK, dk), (HV, dv)]))
            g, beta, state = (guarded(t.float().contiguous(), at_end) for t in (g, beta, state))
            parents, depths = guarded(tree.parents, at_end), guarded(tree.depths, at_end)
            walk = tuple(guarded(t, at_end) for t in tree_recurrent_triton.walk_order(parents, depths,
                                                                                      tree.depth_limit))
            scratch = guarded(torch.zeros(tree.depth_limit + 1, HV, dk, dv), at_end)
            got = tree_recurrent_triton.tree_gated_delta_rule(q, k, v, g, beta, parents, depths, state, walk,
                                                              tree.depth_limit, scratch)
            ref = tree_recurrent.tree_gated_delta_rule(q, k, v, g, beta, parents, depths, state)
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.float().abs().max()),
                                       msg=name)
            x, conv_state, weight = (guarded(torch.randn(*shape, generator=gen), at_end)
                                     for shape in ((tree.size, 24), (24, 4), (24, 4)))
            torch.testing.assert_close(
                tree_recurrent_triton.tree_causal_conv1d(x, conv_state, weight, parents, depths),
                tree_recurrent.tree_causal_conv1d(x, conv_state, weight, parents, depths), rtol=1e-5, atol=1e-5)
            path = guarded(torch.tensor(root_path(tree, tree.size - 1)), at_end)
            out = guarded(torch.zeros_like(state), at_end)
            tree_recurrent_triton.path_gated_delta_state(k, v, g, beta, path, state, out)
            torch.testing.assert_close(out, tree_recurrent.path_gated_delta_state(k, v, g, beta, path, state),
                                       rtol=1e-5, atol=1e-5 * float(out.abs().max()), msg=name)


CHECKS = ["check_tree_conv_equals_torch", "check_tree_gated_delta_equals_torch",
          "check_stacked_path_state_equals_each_layer", "check_device_commit_equals_the_commit_of_the_accepted_prefix"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernels are checked compiled (below)")
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.slow
def test_kernel_equals_its_torch_reference_in_the_interpreter(check):
    run_interpreted(check, MODULE, group=tuple(CHECKS))


@pytest.mark.skipif(torch.cuda.is_available(), reason="guard pages are host memory: the interpreter reads it")
@pytest.mark.slow
def test_walk_reads_nothing_outside_its_tensors_in_the_interpreter():
    run_interpreted("check_walk_reads_nothing_outside_its_tensors", MODULE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA (run on the GPU machine)")
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_equals_its_torch_reference_on_cuda(check):
    globals()[check](device="cuda")


# The launchers' argument types; constants at the Qwen3.6-27B shape and at the tests' tiny shape.
I, I64 = "i32", "*i64"
WALK = dict(q="*bf16", k="*bf16", v="*bf16", stride_q=I, stride_k=I, stride_v=I, layer_k=I, layer_v=I, layer_gb=I,
            layer_h=I, g="*fp32", beta="*fp32",
            parents=I64, depths=I64, fork="*i8", order=I64, M=I, m_at=I64, h0="*fp32", scratch="*fp32", out="*bf16",
            ht="*fp32", scale="fp32")
COMPILED = [
    ("_tree_conv_kernel", dict(x="*bf16", stride_x=I, conv_state="*bf16", stride_s=I, weight="*bf16", parents=I64,
                               depths=I64, out="*bf16", N=I, C=I), dict(K=4, SILU=True, BN=16, BC=128)),
    *[("_gated_delta_walk_kernel", WALK, dict(HK=hk, HV=hv, DK=d, DV=d, BK=d, BV=8, TREE=tree, M_AT=m_at))
      for hk, hv, d in ((16, 48, 128), (2, 4, 16)) for tree, m_at in ((True, False), (False, False), (False, True))],
    ("_path_conv_window_kernel", dict(x="*bf16", layer_x=I, stride_x=I, window="*bf16", path=I64, n_at=I64, C=I),
     dict(K=4, KP=4, BC=64)),
]


@pytest.mark.parametrize("name,signature,constants", COMPILED, ids=[f"{c[0]}-{i}" for i, c in enumerate(COMPILED)])
def test_kernel_compiles_for_an_sm90_gpu_without_one(name, signature, constants):
    from eval.engine import tree_recurrent_triton

    compile_for_sm90(getattr(tree_recurrent_triton, name), signature, constants)
