"""eval/triton_kernels.py equals the torch functions it replaces, run on the CPU through Triton's interpreter.

The kernels are compiled for CUDA on the GPU machine (tests/eval/test_tree_builder.py, test_walk_device.py and
test_target_forward.py repeat these checks there); here `TRITON_INTERPRET=1` executes the same kernel code with
NumPy, in a subprocess because the switch is read when the kernels are defined (at import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", f"from tests.eval.test_triton_kernels import {check}; {check}()"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def check_select_tree_equals_heap():
    from eval import triton_kernels
    from eval.tree import _staircase, build_tree_heap, top_log_probs, tree_size

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        L = int(torch.randint(1, 8, (1,), generator=gen))
        V = int(torch.randint(2, 40, (1,), generator=gen))
        budget = int(torch.randint(1, 70, (1,), generator=gen))
        logits = torch.randn(L, V, generator=gen) * 3
        if trial % 3 == 0:  # exact ties between log-probs and between prefix sums
            logits = torch.randint(0, 3, (L, V), generator=gen).float() * 40
        ref = build_tree_heap(logits, budget, 3)
        k = min(budget, V)
        lp, ids = top_log_probs(logits, k)
        slot_of, rank_of, _ = _staircase(budget, k, "cpu")
        tokens, parents, depths = triton_kernels.select_tree(lp, ids, slot_of, rank_of, budget,
                                                             tree_size(budget, L, V), torch.tensor([3]))
        assert (tokens.tolist(), parents.tolist(), depths.tolist()) == \
            (ref.tokens.tolist(), ref.parents.tolist(), ref.depths.tolist()), trial


def check_greedy_walk_equals_walk_tree():
    from eval import triton_kernels
    from eval.verify import ancestor_table
    from eval.walk import target_choices, walk_tree
    from tests.eval.test_walk_device import random_tree

    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        L = int(torch.randint(1, 16, (1,), generator=gen))
        V = int(torch.randint(2, 9, (1,), generator=gen))
        tree = random_tree(gen, int(torch.randint(0, 60, (1,), generator=gen)), L, V)
        logits = torch.randn(tree.size, 5000, generator=gen)
        logits[:, :V] = torch.randint(0, 3, (tree.size, V), generator=gen).float() * 20 + 40  # ties: first wins
        anc = ancestor_table(tree.parents, L)
        ref = walk_tree(tree, target_choices(logits, 0.0), anc)
        accepted, path, bonus, last, record = triton_kernels.greedy_walk(tree.tokens, tree.parents, tree.depths,
                                                                         anc, logits, L)
        assert (int(accepted), path.tolist(), int(bonus), int(last)) == \
            (int(ref.accepted), ref.path.tolist(), int(ref.bonus), int(ref.last)), trial
        assert record.tolist() == ref.host_record(tree).tolist()


def check_tree_attention_equals_sdpa():
    from eval import triton_kernels
    from eval.target_forward import merge_splits
    from eval.tree import build_tree
    from eval.verify import ancestor_matrix, visibility_attention_mask

    for N in (1, 17, 70):
        gen = torch.Generator().manual_seed(N)
        KVH, G, hd, kv_len, past = 2, 2, 16, 256, 100
        tree = build_tree(torch.randn(15, 64, generator=gen) * 3, N - 1, 5)
        vis = ancestor_matrix(tree)
        past_t = torch.tensor(past)
        q = torch.randn(KVH, G * N, hd, generator=gen)
        cache = torch.randn(2, KVH, 512, hd, generator=gen)
        keys, values = cache[0].narrow(1, 0, kv_len), cache[1].narrow(1, 0, kv_len)  # strided, as the KV buffer
        mask = visibility_attention_mask(vis, (tree.depths + past).unsqueeze(0), past_t, kv_len, torch.float32)
        mask = mask.reshape(1, N, kv_len).expand(G, N, kv_len).reshape(1, 1, G * N, kv_len)
        ref = torch.nn.functional.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                                               scale=hd ** -0.5)[0]
        for splits in (1, 2, 4):
            out, lse = triton_kernels.tree_attention(q, keys, values, vis, past_t, hd ** -0.5, splits)
            got = out[0] if splits == 1 else merge_splits(out, lse)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def check_ancestors_equal_pointer_doubling():
    import math

    from eval import triton_kernels
    from eval.verify import ancestor_matrix, ancestor_table
    from tests.eval.test_walk_device import random_tree

    gen = torch.Generator().manual_seed(2)
    for trial in range(40):
        L = int(torch.randint(0, 16, (1,), generator=gen))
        tree = random_tree(gen, int(torch.randint(0, 200, (1,), generator=gen)), max(L, 1), 5)
        ref = ancestor_table(tree.parents, tree.depth_limit)  # CPU: pointer doubling
        width = 1 << max(1, math.ceil(math.log2(tree.depth_limit + 1)))
        table = triton_kernels.ancestor_table(tree.parents, width)
        assert torch.equal(table, ref), trial
        assert torch.equal(triton_kernels.ancestor_matrix(table), ancestor_matrix(tree, ref)), trial


@pytest.mark.parametrize("check", ["check_select_tree_equals_heap", "check_ancestors_equal_pointer_doubling", "check_greedy_walk_equals_walk_tree",
                                   "check_tree_attention_equals_sdpa"])
def test_kernel_equals_its_torch_reference_in_the_interpreter(check):
    run_interpreted(check)
