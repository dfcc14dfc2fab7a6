"""Triton kernels of the tree builder: each computes exactly what a torch function of eval/engine/tree.py defines.

    top_log_probs    `top_log_probs_torch` for 16-bit logits (radix select + logsumexp + ordering)
    select_tree      `build_tree` after the top-K (the per-depth staircase selection + final pick, with pruning)

Why kernels: in a CUDA graph each small torch op still costs a kernel launch of a few microseconds, and the torch
selection is a long chain of them per depth; torch.topk over a vocabulary-wide row is itself many launches. Here the
selection is L + 3 launches and the top-K a memset and four (docs/benchmarks.md, "round", has the timings).

Pruning (select_tree): the B best depth-1 prefixes form a tree of B nodes, so a deeper prefix that scores no more
than the B-th best depth-1 log-prob is never in the tree (it comes after all B of them in the total order), and
neither is any of its descendants. Such candidates are never written; a depth whose candidates are all pruned
costs one almost empty launch.

Ordering trick (select_tree): a stable descending sort by fp32 score with ties in index order equals a plain
descending order of unique int64 keys `sortable(score) << 32 | reversed index`. Ranks are computed by counting
(rank of key k = #keys > k; unique keys give unique ranks), which parallelises over candidates with no sort.

eval/engine/tree.py calls these through `triton_runtime` (CUDA only; a failure falls back to the torch version).
tests/eval/test_triton_kernels.py compares each kernel with its torch version in Triton's CPU interpreter and, on
the GPU machine, compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.triton_runtime import pow2, tl, triton

if triton is not None:

    @triton.jit
    def _sortable(x):
        """fp32 -> int64 whose signed order is the float order (+0.0 above -0.0; no NaN here)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)

    INVALID = tl.constexpr(-9223372036854775807 - 1)  # int64 min: below every `_unique_key` of a real score

    @triton.jit
    def _unique_key(score, index, valid):
        """sortable(score) << 32 | reversed index: descending key order = descending score, ties by index
        ascending; int64 min where not valid (below every real key). `_score_of` and `_index_of` invert it."""
        key = (_sortable(score) << 32) | (2147483647 - index).to(tl.int64)
        return tl.where(valid, key, INVALID)

    @triton.jit
    def _score_of(key):
        hi = (key >> 32).to(tl.int32)
        return tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)

    @triton.jit
    def _index_of(key):
        return 2147483647 - (key & 0xFFFFFFFF)

    # ------------------------------------------------------------------------------------------
    # Tree selection
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _select_init_kernel(top_lp, K, M, B, keys, scores, BLOCK: tl.constexpr):
        """Row d, columns block b: keys[d] = the candidate keys of depth d + 1 known before any selection: d = 0 the
        root's children (slot 0, rank j) = staircase index j < min(K, B); deeper rows none yet (INVALID); and
        scores[d + 1] = -inf (slots no candidate fills stay below every real prefix)."""
        d, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        root_child = (cols < tl.minimum(K, B)) & ((cols * 0 + d) == 0)
        lp = tl.load(top_lp + cols, mask=root_child, other=0.0)
        tl.store(keys + d.to(tl.int64) * M + cols, _unique_key(lp, cols, root_child), mask=cols < M)
        tl.store(scores + (d + 1) * B + cols, tl.full([BLOCK], float("-inf"), tl.float32), mask=cols < B)

    @triton.jit
    def _depth_rank_kernel(keys, M, top_lp, K, first, scores, picks, d, L, B,
                           BLOCK: tl.constexpr, TILE: tl.constexpr, CHILDREN: tl.constexpr):
        """Depth d + 1 in one launch from its candidate keys keys[d] (INVALID = pruned or not a prefix). Each
        program ranks its BLOCK candidates against all M (rank = #keys greater; keys are unique) and for the B best
        writes scores[d + 1, rank], picks[d, rank] and, below depth L, the keys of their children into keys[d + 1]
        (staircase (rank, j), j < min(K, B // (rank + 1)), index first[rank] + j). A child scoring <= the B-th best
        depth-1 log-prob is pruned: the B best depth-1 prefixes all come before it, so it is not in the tree."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        row = keys + d * M
        mine = tl.load(row + offs, mask=offs < M, other=INVALID)
        live = mine != INVALID
        if tl.max(live.to(tl.int32), axis=0) > 0:  # a block of pruned candidates has nothing to rank or write
            count = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, M, TILE):
                cols = start + tl.arange(0, TILE)
                other = tl.load(row + cols, mask=cols < M, other=INVALID)
                count += tl.sum((other[None, :] > mine[:, None]).to(tl.int32), axis=1)
            keep = live & (count < B)
            score = _score_of(mine)
            tl.store(scores + (d + 1) * B + count, score, mask=keep)
            tl.store(picks + d * B + count, offs, mask=keep)
            if d + 1 < L:
                theta = tl.load(top_lp + tl.minimum(B, K) - 1)
                theta = tl.where(K >= B, theta, float("-inf"))
                m = tl.where(keep, tl.minimum(K, B // (count + 1)), 0)
                base = tl.load(first + count, mask=keep, other=0)
                lp_row = top_lp + (d + 1) * K
                for j0 in range(0, tl.max(m, axis=0), CHILDREN):
                    j = j0 + tl.arange(0, CHILDREN)
                    child = score[:, None] + tl.load(lp_row + j, mask=j < K, other=float("-inf"))[None, :]
                    write = (j[None, :] < m[:, None]) & (child > theta)
                    index = base[:, None] + j[None, :]
                    tl.store(keys + (d + 1) * M + index, _unique_key(child, index, write), mask=write)

    @triton.jit
    def _final_rank_kernel(scores, LB, B, n, chosen, node_of, BLOCK: tl.constexpr, TILE: tl.constexpr):
        """The n best of the L*B per-depth winners (rows 1..L of scores, flat (depth-1)*B + slot; -inf = no winner)
        in one launch: chosen[rank] = flat index and node_of[flat] = rank + 1 (its node id) for rank < n."""
        flat = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = flat < LB
        s = tl.load(scores + B + flat, mask=valid, other=float("-inf"))
        if tl.max((s > float("-inf")).to(tl.int32), axis=0) > 0:  # a block of empty slots holds no tree node
            mine = _unique_key(s, flat, valid)
            count = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, LB, TILE):
                cols = start + tl.arange(0, TILE)
                ok = cols < LB
                o = tl.load(scores + B + cols, mask=ok, other=0.0)
                other = _unique_key(o, cols, ok)
                count += tl.sum((other[None, :] > mine[:, None]).to(tl.int32), axis=1)
            keep = valid & (count < n)
            tl.store(chosen + count, flat, mask=keep)
            tl.store(node_of + flat, count + 1, mask=keep)

    @triton.jit
    def _tree_arrays_kernel(chosen, picks, slot_of, rank_of, node_of, top_ids, K, B, n, root,
                            tokens, parents, depths, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # node index 0..n
        node = (i >= 1) & (i <= n)
        flat = tl.load(chosen + i - 1, mask=node, other=0)
        depth0 = flat // B
        cand = tl.load(picks + flat, mask=node, other=0)
        has_parent = node & (depth0 > 0)
        parent = tl.load(node_of + (depth0 - 1) * B + tl.load(slot_of + cand, mask=has_parent, other=0),
                         mask=has_parent, other=0)
        token = tl.load(top_ids + depth0 * K + tl.load(rank_of + cand, mask=node, other=0), mask=node, other=0)
        is_root = i == 0
        token = tl.where(is_root, tl.load(root + i * 0, mask=is_root, other=0), token)
        tl.store(tokens + i, token, mask=i <= n)
        tl.store(parents + i, parent.to(tl.int64), mask=i <= n)
        tl.store(depths + i, tl.where(is_root, 0, depth0 + 1).to(tl.int64), mask=i <= n)


SELECT_CONFIG = (8, 1024, 4)  # rank counting: candidates per program, keys per compare step, warps (tuned by
# benchmarks/profile_eval_round.py's sweep)


def select_tree(top_lp: Tensor, top_ids: Tensor, slot_of: Tensor, rank_of: Tensor, first: Tensor, budget: int,
                n: int, root: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, parents, depths) int64 [1 + n] of the tree (eval/engine/tree.py layout and order) from fp32 top_lp [L, K]
    (rows sorted descending), int64 top_ids [L, K], the staircase (slot_of, rank_of [M] in (slot, rank) order;
    first [budget]: index of (slot, 0)) and root int64 [1]. Launches: the candidate keys of depth 1; one rank count
    per depth (which writes the next depth's keys); one over the L*B winners (which also writes their node ids);
    one gather of the arrays: L + 3."""
    L, K = top_lp.shape
    M = slot_of.shape[0]
    device = top_lp.device
    top_lp, top_ids = top_lp.contiguous(), top_ids.contiguous()
    keys = torch.empty(L, M, dtype=torch.long, device=device)  # row d: candidate keys of depth d + 1
    scores = torch.empty(L + 1, budget, dtype=torch.float32, device=device)  # row d: frontier of depth d (row 0 unused)
    picks = torch.empty(L, budget, dtype=torch.int32, device=device)
    chosen = torch.empty(n, dtype=torch.int32, device=device)
    node_of = torch.empty(L * budget, dtype=torch.int32, device=device)
    _select_init_kernel[(L, triton.cdiv(max(M, budget), 1024))](top_lp, K, M, budget, keys, scores, BLOCK=1024)
    BLOCK, TILE, warps = SELECT_CONFIG  # rank counting: [BLOCK, TILE] comparisons per step
    for d in range(L):
        _depth_rank_kernel[(triton.cdiv(M, BLOCK),)](keys, M, top_lp, K, first, scores, picks, d, L, budget,
                                                     BLOCK=BLOCK, TILE=TILE, CHILDREN=128, num_warps=warps)
    LB = L * budget
    _final_rank_kernel[(triton.cdiv(LB, BLOCK),)](scores, LB, budget, n, chosen, node_of, BLOCK=BLOCK, TILE=TILE,
                                                  num_warps=warps)
    tokens, parents, depths = (torch.empty(1 + n, dtype=torch.long, device=device) for _ in range(3))
    _tree_arrays_kernel[(triton.cdiv(n + 1, 128),)](chosen, picks, slot_of, rank_of, node_of, top_ids, K, budget, n,
                                                    root, tokens, parents, depths, BLOCK=128)
    return tokens, parents, depths


if triton is not None:

    @triton.jit
    def _key16(x):
        """16-bit float -> int32 in [0, 65535] ordered as the float order, +0.0 above -0.0 (the order of `_sortable`
        of its fp32 value); the high byte is digit 0 of the radix select, the low byte digit 1."""
        b = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
        return tl.where(b < 0, ~b & 0xFFFF, b | 0x8000)

    @triton.jit
    def _digit_threshold(h, K, above):
        """(digit d* of the row's K-th largest key, #keys above the keys with digit d*) from the histogram h [256] of
        one digit over the keys that tie on all higher digits, `above` keys being greater than all of those."""
        at_least = above + tl.cumsum(h, axis=0, reverse=True)  # [d]: keys greater, or tied with digit >= d
        d_star = tl.sum((at_least >= K).to(tl.int32), axis=0) - 1
        return d_star, above + tl.sum(tl.where(tl.arange(0, 256) > d_star, h, 0), axis=0)

    @triton.jit
    def _topk_digit0_kernel(logits, V, hist, HB, part_max, part_sum, CHUNK: tl.constexpr):
        """Row r, chunk c: histogram of digit 0 of the chunk's keys, added to hist[r, 0]; and the chunk's logsumexp
        partials (max m, sum exp(x - m) in fp32) -> part_max/part_sum [r, c]."""
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        ok = cols < V
        x = tl.load(logits + r * V + cols, mask=ok, other=0.0)
        h = tl.histogram(_key16(x) >> 8, 256, mask=ok)
        tl.atomic_add(hist + r * HB + tl.arange(0, 256), h, sem="relaxed")
        xf = tl.where(ok, x.to(tl.float32), float("-inf"))
        m = tl.max(xf, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(part_max + r * tl.num_programs(1) + c, m)
        tl.store(part_sum + r * tl.num_programs(1) + c, tl.sum(tl.exp(xf - m_safe), axis=0))

    @triton.jit
    def _topk_digit1_kernel(logits, V, K, hist, HB, chunk_hist, CHUNK: tl.constexpr):
        """Row r, chunk c: b* from the complete digit-0 histogram, then the histogram of digit 1 of the chunk's keys
        whose digit 0 is b*: added to hist[r, 1] and kept per chunk in chunk_hist[r, c] (the ties' token order)."""
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        bins = tl.arange(0, 256)
        b_star, _ = _digit_threshold(tl.load(hist + r * HB + bins), K, 0)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        ok = cols < V
        u = _key16(tl.load(logits + r * V + cols, mask=ok, other=0.0))
        h = tl.histogram(u & 255, 256, mask=ok & ((u >> 8) == b_star))
        tl.atomic_add(hist + r * HB + 256 + bins, h, sem="relaxed")
        tl.store(chunk_hist + (r * tl.num_programs(1) + c) * 256 + bins, h)

    @triton.jit
    def _topk_collect_kernel(logits, V, K, hist, HB, chunk_hist, top, ids, CHUNK: tl.constexpr,
                             CP: tl.constexpr):
        """Row r, chunk c: with T the row's K-th largest key, the chunk's keys > T go to slots of top/ids [r] taken
        from a per-row counter (hist[r, 512]; any order), and its keys == T to slots above + (ties in earlier chunks)
        + (rank among the chunk's ties), kept if < K: the ties with the lowest token ids fill the row."""
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        C = tl.num_programs(1)
        bins = tl.arange(0, 256)
        b_star, above0 = _digit_threshold(tl.load(hist + r * HB + bins), K, 0)
        l_star, above = _digit_threshold(tl.load(hist + r * HB + 256 + bins), K, above0)
        t = (b_star << 8) | l_star  # T: keys > T are `above` < K of them; keys == T fill the remaining slots
        earlier = tl.arange(0, CP)
        ties_before = tl.sum(tl.load(chunk_hist + (r * C + earlier) * 256 + l_star, mask=earlier < c, other=0),
                             axis=0)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        ok = cols < V
        x = tl.load(logits + r * V + cols, mask=ok, other=0.0)
        u = _key16(x)
        gt = ok & (u > t)
        tie = ok & (u == t)
        n_gt = tl.sum(gt.to(tl.int32), axis=0)
        base = tl.atomic_add(hist + r * HB + 512, n_gt, sem="relaxed")
        slot = tl.where(gt, base + tl.cumsum(gt.to(tl.int32), axis=0) - 1,
                        above + ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1)
        keep = (gt | tie) & (slot < K)
        tl.store(top + r * K + slot, x, mask=keep)
        tl.store(ids + r * K + slot, cols.to(tl.int64), mask=keep)

    @triton.jit
    def _order_top_kernel(part_max, part_sum, C, top, ids, K, floor, out_lp, out_ids,
                          CP: tl.constexpr, KP: tl.constexpr):
        """Row r: logsumexp from the C chunk partials, then the K (value, id) pairs of the row's unsorted top-K in
        descending value order, ties by id ascending (one sort of unique int64 keys), as log-probs."""
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CP)
        pm = tl.load(part_max + r * C + c, mask=c < C, other=float("-inf"))
        ps = tl.load(part_sum + r * C + c, mask=c < C, other=0.0)
        m = tl.max(pm, axis=0)
        lse = m + tl.log(tl.sum(ps * tl.exp(pm - m), axis=0))
        j = tl.arange(0, KP)
        ok = j < K
        value = tl.load(top + r * K + j, mask=ok, other=0.0).to(tl.float32)
        token = tl.load(ids + r * K + j, mask=ok, other=0)
        key = _unique_key(value, token, ok)
        key = tl.sort(key, descending=True)
        token = _index_of(key)
        tl.store(out_lp + r * K + j, tl.maximum(_score_of(key) - lse, floor), mask=ok)
        tl.store(out_ids + r * K + j, token, mask=ok)


TOP_K_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit keys: two 8-bit radix digits
TOP_K_CHUNK = 4096  # columns per program of the radix passes


def top_log_probs(logits: Tensor, k: int, floor: float) -> tuple[Tensor, Tensor]:
    """eval/engine/tree.py `top_log_probs` for 16-bit logits [L, V] (TOP_K_DTYPES): (fp32 log-probs [L, k] clamped at
    `floor`, int64 ids [L, k]), value descending, equal values by id ascending (ties at the k-th value: lowest ids).

    Radix select on 16-bit keys, with no sort of the row: a memset and four launches.
      digit 0     histogram of each key's high byte (and the logsumexp partials)       [L, chunks] programs
      digit 1     b* = high byte of the K-th largest key T; histogram of the low byte of keys with high byte b*
      collect     T from both histograms; keys > T and the lowest-id ties at T -> k unsorted slots per row
      order       logsumexp; one sort of the row's k unique (value, id) keys         [L] programs
    """
    if logits.dtype not in TOP_K_DTYPES:
        raise TypeError(f"top_log_probs handles {TOP_K_DTYPES}, got {logits.dtype}")
    L, V = logits.shape
    logits = logits.contiguous()
    device = logits.device
    C = triton.cdiv(V, TOP_K_CHUNK)
    HB = 2 * 256 + 1  # per row: digit-0 and digit-1 histograms, the counter of slots taken by keys above T
    hist = torch.zeros(L, HB, dtype=torch.int32, device=device)
    chunk_hist = torch.empty(L, C, 256, dtype=torch.int32, device=device)
    part_max = torch.empty(L, C, dtype=torch.float32, device=device)
    part_sum = torch.empty(L, C, dtype=torch.float32, device=device)
    top = torch.empty(L, k, dtype=logits.dtype, device=device)
    ids = torch.empty(L, k, dtype=torch.long, device=device)
    grid = (L, C)
    _topk_digit0_kernel[grid](logits, V, hist, HB, part_max, part_sum, CHUNK=TOP_K_CHUNK, num_warps=8)
    _topk_digit1_kernel[grid](logits, V, k, hist, HB, chunk_hist, CHUNK=TOP_K_CHUNK, num_warps=8)
    _topk_collect_kernel[grid](logits, V, k, hist, HB, chunk_hist, top, ids, CHUNK=TOP_K_CHUNK, CP=pow2(C),
                               num_warps=8)
    out_lp = torch.empty(L, k, dtype=torch.float32, device=device)
    out_ids = torch.empty(L, k, dtype=torch.long, device=device)
    _order_top_kernel[(L,)](part_max, part_sum, C, top, ids, k, floor, out_lp, out_ids, CP=pow2(C), KP=pow2(k),
                            num_warps=4)
    return out_lp, out_ids
