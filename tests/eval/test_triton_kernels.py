"""The engine's Triton kernels (eval/engine/{tree,verify,walk,target_forward}_triton.py) equal the torch functions they
replace, run on the CPU through Triton's interpreter.

On the CPU `TRITON_INTERPRET=1` executes the kernel code with NumPy, in a subprocess because the switch is read
when the kernels are defined (at import). On the GPU machine the same checks run compiled for CUDA, at real sizes
(`test_kernel_equals_its_torch_reference_on_cuda`; tests/eval/test_tree_builder.py also runs the builder tests on
CUDA). Every kernel is also compiled here for an sm_90 GPU (`test_kernel_compiles_for_an_sm90_gpu_without_one`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


_INTERPRETED: dict[tuple[str, str], str | None] = {}  # (module, check) -> None (passed) or the failure


def run_interpreted(check: str, module: str = "tests.eval.test_triton_kernels", group: tuple[str, ...] = ()) -> None:
    """`module.check()` in a subprocess with TRITON_INTERPRET=1 (read when the kernels are defined, at import).

    The checks of `group` (a file's parametrized checks) run in ONE subprocess the first time any of them is asked
    for, each reporting its own outcome, so a file pays one Python + torch + Triton start instead of one per check;
    a check that subprocess did not report (it died on an earlier one) runs again alone, as before."""
    if (module, check) not in _INTERPRETED:
        _INTERPRETED.update(_interpret(module, group or (check,), timeout=300 * max(1, len(group))))
    if (module, check) not in _INTERPRETED:
        _INTERPRETED.update(_interpret(module, (check,), timeout=300))
    failure = _INTERPRETED.get((module, check), f"{check}: the interpreter subprocess reported nothing")
    assert failure is None, failure


def _interpret(module: str, checks: tuple[str, ...], timeout: int) -> dict[tuple[str, str], str | None]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = (f"import json, traceback\nimport {module} as m\nfor name in {list(checks)!r}:\n"
            "    try:\n        getattr(m, name)()\n        out = None\n"
            "    except BaseException:\n        out = traceback.format_exc()[-3000:]\n"
            "    print('CHECK ' + json.dumps([name, out]), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CHECK "):
            name, out = json.loads(line[len("CHECK "):])
            results[(module, name)] = out
    if proc.returncode != 0 and len(checks) == 1 and (module, checks[0]) not in results:
        results[(module, checks[0])] = proc.stderr[-3000:]  # it died: its own stderr is the finding
    return results


def check_select_tree_equals_heap(device: str = "cpu"):
    from eval.engine import tree_triton
    from eval.engine.tree import _staircase, build_tree_heap, top_log_probs, tree_size

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        L = int(torch.randint(1, 8, (1,), generator=gen))
        V = int(torch.randint(2, 40, (1,), generator=gen))
        budget = int(torch.randint(1, 70, (1,), generator=gen))
        logits = torch.randn(L, V, generator=gen) * 3
        if trial % 3 == 0:  # exact ties between log-probs and between prefix sums
            logits = torch.randint(0, 3, (L, V), generator=gen).float() * 40
        if trial % 3 == 1:  # one confident token per row: deep trees, pruning at some depths and not others
            logits[torch.arange(L), torch.randint(0, V, (L,), generator=gen)] += float(torch.rand(1, generator=gen)) * 12
        logits = logits.to(device)
        ref = build_tree_heap(logits, budget, 3)
        k = min(budget, V)
        lp, ids = top_log_probs(logits, k)
        slot_of, rank_of, first, _ = _staircase(budget, k, device)
        tokens, parents, depths = tree_triton.select_tree(lp, ids, slot_of, rank_of, first, budget,
                                                             tree_size(budget, L, V), torch.tensor([3], device=device))
        assert (tokens.tolist(), parents.tolist(), depths.tolist()) == \
            (ref.tokens.tolist(), ref.parents.tolist(), ref.depths.tolist()), trial


def check_top_log_probs_equals_torch(device: str = "cpu"):
    from eval.engine import tree_triton
    from eval.engine.tree import LOGPROB_FLOOR, top_log_probs_torch

    gen = torch.Generator().manual_seed(4)
    big = device != "cpu"  # compiled: the real vocabulary and budgets up to 1024
    for trial in range(40 if big else 8):
        L = int(torch.randint(1, 16 if big else 5, (1,), generator=gen))
        V = int(torch.randint(2, 152_000 if big else 9000, (1,), generator=gen))  # > one 4096-wide chunk
        k = int(torch.randint(1, min(V, 1024 if big else 300) + 1, (1,), generator=gen))
        logits = torch.randn(L, V, generator=gen) * 4
        if trial % 3 == 0:  # many exact ties, +0.0 and -0.0 included: the ids decide the set and the order
            logits = torch.randint(-2, 3, (L, V), generator=gen).float()
            logits[logits == 0] = torch.where(torch.rand(int((logits == 0).sum()), generator=gen) < 0.5, 0.0, -0.0)
        if trial % 5 == 1:  # one value everywhere: every key is the threshold
            logits = torch.full((L, V), 1.5)
        logits = logits.to(torch.bfloat16 if trial % 2 else torch.float16).to(device)
        got_lp, got_ids = tree_triton.top_log_probs(logits, k, LOGPROB_FLOOR)
        ref_lp, ref_ids = top_log_probs_torch(logits, k)
        assert torch.equal(got_ids, ref_ids), trial
        torch.testing.assert_close(got_lp, ref_lp, rtol=0, atol=2e-5)


def check_compact_path_rows_equals_torch(device: str = "cpu"):
    from eval.engine import walk_triton
    from eval.engine.walk import compact_path_rows

    gen = torch.Generator().manual_seed(5)
    for trial in range(10):
        shape = [2, 3, 1, 2, 64, 16] if trial % 2 else [3, 40, 200]  # the static cache's layout; a plain one
        dim = 4 if trial % 2 else 1
        x = torch.randn(shape, generator=gen).to(device)
        past = torch.tensor(int(torch.randint(0, 10, (1,), generator=gen)), device=device)
        L1 = int(torch.randint(1, 12, (1,), generator=gen))
        if trial % 3 == 0:  # any rows, repeats and backward moves included: all reads happen before the writes
            path = torch.randint(0, 20, (L1,), generator=gen)
        else:  # a walk's path: 0, increasing node ids, zeros after the accepted part
            accepted = int(torch.randint(0, L1, (1,), generator=gen))
            path = torch.zeros(L1, dtype=torch.long)
            path[1: accepted + 1] = torch.randperm(20, generator=gen)[:accepted].add(1).sort().values
        path = path.to(device)
        ref = x.cpu().clone()
        compact_path_rows(ref, dim, past.cpu(), path.cpu())  # on the CPU: the torch version
        walk_triton.compact_path_rows(x, dim, past, path)
        assert torch.equal(x.cpu(), ref), trial


def check_greedy_walk_equals_walk_tree(device: str = "cpu"):
    from eval.engine import walk_triton
    from eval.engine.tree import Tree
    from eval.engine.verify import ancestor_table
    from eval.engine.walk import target_choices, walk_tree
    from tests.eval.test_walk_device import random_tree

    gen = torch.Generator().manual_seed(1)
    nodes, vocab, dtype = (60, 5000, torch.float32) if device == "cpu" else (300, 50_000, torch.bfloat16)
    for trial in range(60 if device == "cpu" else 400):
        L = int(torch.randint(1, 16, (1,), generator=gen))
        V = int(torch.randint(2, 9, (1,), generator=gen))
        tree = random_tree(gen, int(torch.randint(0, nodes, (1,), generator=gen)), L, V)
        tree = Tree(tree.tokens.to(device), tree.parents.to(device), tree.depths.to(device), tree.num_nodes, L, "tree")
        logits = torch.randn(tree.size, vocab, generator=gen)
        logits[:, :V] = torch.randint(0, 3, (tree.size, V), generator=gen).float() * 20 + 40  # ties: first wins
        logits = logits.to(device=device, dtype=dtype)
        anc = ancestor_table(tree.parents, L)
        ref = walk_tree(tree, target_choices(logits, 0.0), anc)
        accepted, path, bonus, last, record = walk_triton.greedy_walk(tree.tokens, tree.parents, tree.depths,
                                                                         anc, logits, L)
        assert (int(accepted), path.tolist(), int(bonus), int(last)) == \
            (int(ref.accepted), ref.path.tolist(), int(ref.bonus), int(ref.last)), trial
        assert record.tolist() == ref.host_record(tree).tolist()


def check_tree_attention_equals_sdpa(device: str = "cpu"):
    from eval.engine import target_forward_triton
    from eval.engine.target_forward import merge_splits
    from eval.engine.tree import build_tree
    from eval.engine.verify import ancestor_matrix, visibility_attention_mask

    # CPU interpreter: small fp32 shapes; CUDA: the real head size and key count, bf16
    KVH, G, hd, kv_len, past, sizes, dtype, tol = (2, 2, 16, 256, 100, (1, 17, 70), torch.float32, 1e-5) \
        if device == "cpu" else (2, 4, 128, 1536, 1000, (1, 17, 257), torch.bfloat16, 2e-2)
    for N in sizes:
        gen = torch.Generator().manual_seed(N)
        tree = build_tree(torch.randn(15, 64, generator=gen) * 3, N - 1, 5)
        vis = ancestor_matrix(tree).to(device)
        past_t = torch.tensor(past, device=device)
        q = torch.randn(KVH, G * N, hd, generator=gen).to(device=device, dtype=dtype)
        cache = torch.randn(2, KVH, 2 * kv_len, hd, generator=gen).to(device=device, dtype=dtype)
        keys, values = cache[0].narrow(1, 0, kv_len), cache[1].narrow(1, 0, kv_len)  # strided, as the KV buffer
        positions = (tree.depths.to(device) + past).unsqueeze(0)
        mask = visibility_attention_mask(vis, positions, past_t, kv_len, torch.float32)
        mask = mask.reshape(1, N, kv_len).expand(G, N, kv_len).reshape(1, 1, G * N, kv_len)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float()[None], keys.float()[None],
                                                               values.float()[None], attn_mask=mask,
                                                               scale=hd ** -0.5)[0]
        for splits in (1, 2, 4, 8):
            out, lse = target_forward_triton.tree_attention(q, keys, values, vis, past_t, hd ** -0.5, splits)
            got = out[0] if splits == 1 else merge_splits(out, lse)
            torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def check_ancestors_equal_pointer_doubling(device: str = "cpu"):
    import math

    from eval.engine import verify_triton
    from eval.engine.verify import ancestor_matrix, ancestor_table
    from tests.eval.test_walk_device import random_tree

    gen = torch.Generator().manual_seed(2)
    for trial in range(40):
        L = int(torch.randint(0, 16, (1,), generator=gen))
        tree = random_tree(gen, int(torch.randint(0, 200, (1,), generator=gen)), max(L, 1), 5)
        ref = ancestor_table(tree.parents, tree.depth_limit)  # on the CPU: pointer doubling
        width = 1 << max(1, math.ceil(math.log2(tree.depth_limit + 1)))
        table = verify_triton.ancestor_table(tree.parents.to(device), width)
        assert torch.equal(table.cpu(), ref), trial
        assert torch.equal(verify_triton.ancestor_matrix(table).cpu(), ancestor_matrix(tree, ref)), trial


CHECKS = ["check_top_log_probs_equals_torch", "check_compact_path_rows_equals_torch", "check_select_tree_equals_heap", "check_ancestors_equal_pointer_doubling",
          "check_greedy_walk_equals_walk_tree", "check_tree_attention_equals_sdpa"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernels are checked compiled (below); the "
                    "GPU image's Triton 3.6 interpreter cannot run loops with a runtime bound under NumPy 2.4")
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.slow
def test_kernel_equals_its_torch_reference_in_the_interpreter(check):
    run_interpreted(check, group=tuple(CHECKS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA (run on the GPU machine)")
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_equals_its_torch_reference_on_cuda(check):
    globals()[check](device="cuda")


# Every kernel with the argument types and constants its launcher passes on the GPU (ints equal to 0 or 1 are
# specialized to constants by Triton's launcher, so the depth index is also compiled as 0 and 1).
P, I, I64, F = "*fp32", "i32", "*i64", "fp32"
COMPILED = [
    ("tree", "_topk_digit0_kernel", dict(logits="*bf16", V=I, hist="*i32", HB=I, part_max=P, part_sum=P), dict(CHUNK=4096)),
    ("tree", "_topk_digit1_kernel", dict(logits="*bf16", V=I, K=I, hist="*i32", HB=I, chunk_hist="*i32"), dict(CHUNK=4096)),
    ("tree", "_topk_collect_kernel", dict(logits="*fp16", V=I, K=I, hist="*i32", HB=I, chunk_hist="*i32", top="*fp16",
                                  ids=I64), dict(CHUNK=4096, CP=64)),
    ("tree", "_order_top_kernel", dict(part_max=P, part_sum=P, C=I, top="*bf16", ids=I64, K=I, floor=F, out_lp=P,
                               out_ids=I64), dict(CP=64, KP=256)),
    ("tree", "_select_init_kernel", dict(top_lp=P, K=I, M=I, B=I, keys=I64, scores=P), dict(BLOCK=1024)),
    *[("tree", "_depth_rank_kernel", dict(keys=I64, M=I, top_lp=P, K=I, first=I64, scores=P, picks="*i32", d=d, L=I, B=I),
       dict(BLOCK=8, TILE=1024, CHILDREN=128, **({} if d == I else {"d": int(d)}))) for d in (I, "0", "1")],
    ("tree", "_final_rank_kernel", dict(scores=P, LB=I, B=I, n=I, chosen="*i32", node_of="*i32"), dict(BLOCK=8, TILE=1024)),
    ("tree", "_tree_arrays_kernel", dict(chosen="*i32", picks="*i32", slot_of=I64, rank_of=I64, node_of="*i32", top_ids=I64,
                                 K=I, B=I, n=I, root=I64, tokens=I64, parents=I64, depths=I64), dict(BLOCK=128)),
    ("verify", "_ancestor_table_kernel", dict(parents=I64, N=I, W=I, table=I64), dict(BLOCK=128)),
    ("verify", "_ancestor_matrix_kernel", dict(table=I64, N=I, W=I, vis="*i8"), dict(BLOCK=128)),
    ("walk", "_argmax_partial_kernel", dict(logits="*bf16", V=I, chunk=I, best=P, where=I64), dict(BLOCK=4096)),
    ("walk", "_argmax_final_kernel", dict(best=P, where=I64, CH=I, choices=I64), dict(CHP=64)),
    ("walk", "_walk_kernel", dict(tokens=I64, parents=I64, depths=I64, ancestors=I64, W=I, N=I, L=I, choices=I64,
                          match_buf="*i8", path=I64, accepted_out=I64, bonus_out=I64, last_out=I64, record=I64),
     dict(NP=512, WP=16, LP=16, HEAD=3)),
    ("walk", "_compact_path_kernel", dict(x="*bf16", R=I, C=I, past_ptr=I64, path=I64, LP1=I), dict(LP=16, BLOCK_C=128)),
    ("target_forward", "_tree_attention_kernel", dict(q="*bf16", k="*bf16", v="*bf16", vis="*u8", past_ptr=I64, out="*bf16", lse=P,
                                    N=I, GN=I, stride_kh=I, stride_kt=I, kv_chunk=I, scale=F), dict(HD=128, BM=64, BN=64)),
]


def compile_for_sm90(kernel, signature: dict, constants: dict) -> None:
    """Triton's whole compiler (to PTX and cubin with its bundled ptxas) on this CPU machine: catches what the
    interpreter lets through (e.g. a method on an argument the launcher turns into a constant)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{k: "constexpr" for k in constants}}
    assert list(signature) == kernel.arg_names, "the test's signature is out of date"
    triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("module,name,signature,constants", COMPILED, ids=[f"{c[1]}-{i}" for i, c in enumerate(COMPILED)])
def test_kernel_compiles_for_an_sm90_gpu_without_one(module, name, signature, constants):
    import importlib

    compile_for_sm90(getattr(importlib.import_module(f"eval.engine.{module}_triton"), name), signature, constants)


def test_a_failing_kernel_switches_every_kernel_off_with_a_warning(caplog):
    from pipeline import triton_runtime

    def broken_kernel():
        raise RuntimeError("PTX assembly failed")  # what a Triton build error on an unsupported GPU raises

    drafter_log = logging.getLogger("drafter")  # pipeline/log.py stops propagation to the root (caplog's) logger
    drafter_log.addHandler(caplog.handler)
    try:
        assert triton_runtime.run(broken_kernel) is None
        assert not triton_runtime.available("cuda")
        assert "broken_kernel" in caplog.text and "torch versions" in caplog.text
    finally:
        drafter_log.removeHandler(caplog.handler)
        triton_runtime._FAILED.clear()
