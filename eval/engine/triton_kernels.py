"""The round's CUDA kernels (Triton): each one computes exactly what a torch function elsewhere defines.

    top_log_probs    eval/engine/tree.py `top_log_probs_torch` for 16-bit logits (radix select + logsumexp + ordering)
    select_tree      eval/engine/tree.py `build_tree` after the top-K (the per-depth staircase selection + final pick,
                     with pruning)
    ancestor_table,  eval/engine/verify.py functions of the same names (walking up the parents instead of
    ancestor_matrix  pointer doubling + concatenation + scatter)
    greedy_walk      eval/engine/walk.py `target_choices` at T = 0 + `walk_tree` + `Walk.host_record`
    compact_path_rows  eval/engine/walk.py function of the same name (the static cache's move of the path's K/V rows)
    tree_attention   eval/engine/target_forward.py attention under the eval/engine/verify.py tree mask (split over keys)

Why: in a CUDA graph each small torch op still costs a kernel of a few microseconds; the torch versions of the
selection and of choices + walk are ~180 and ~22 kernels per round (about 0.45 and 0.09 ms of GPU time at budget
256 on the H200), and torch.topk on [15, 151,936] bf16 logits is ~14 launches, ~60 us. Here (budget 256, random
drafter): top-K ~50 us, selection ~35 us, choices + walk ~35 us.

Pruning (select_tree): the B best depth-1 prefixes form a tree of B nodes, so a deeper prefix that scores no more
than the B-th best depth-1 log-prob is never in the tree (it comes after all B of them in the total order), and
neither is any of its descendants. Such candidates are never written; a depth whose candidates are all pruned
costs one almost empty launch.

Ordering trick (select_tree): a stable descending sort by fp32 score with ties in index order equals a plain
descending order of unique int64 keys `sortable(score) << 32 | reversed index`. Ranks are computed by counting
(rank of key k = #keys > k; unique keys give unique ranks), which parallelises over candidates with no sort.

All of this runs on CUDA with Triton (`available`; a kernel that fails to build or launch switches them all off,
`run`); the torch versions are the reference and the CPU path. tests/eval/test_triton_kernels.py compares each
kernel with its torch version in Triton's CPU interpreter and, on the GPU machine, compiled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from eval.engine import round_record

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch versions run
    triton = None


_FAILED: list[str] = []  # the first kernel failure of this process, if any


def available(device) -> bool:
    """Triton is installed, `device` is CUDA, and no kernel has failed in this process."""
    return triton is not None and not _FAILED and torch.device(device).type == "cuda"


def run(kernel, *args):
    """`kernel(*args)`, or None if it raises (a Triton build or launch failure on this GPU): the failure is logged
    once and every kernel here is switched off for the process, so callers fall back to their torch versions."""
    try:
        return kernel(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler/driver error means: use the torch version
        if not _FAILED:
            from pipeline.log import get_logger

            get_logger("eval.engine.triton_kernels").warning(
                "Triton kernel %s failed (%s: %s): using the torch versions from now on", kernel.__name__,
                type(exc).__name__, exc)
        _FAILED.append(f"{kernel.__name__}: {exc}")
        return None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


SELECT_CONFIG = (8, 1024, 4)  # rank counting: candidates per program, keys per compare step, warps (H200 sweep)


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
    _topk_collect_kernel[grid](logits, V, k, hist, HB, chunk_hist, top, ids, CHUNK=TOP_K_CHUNK, CP=_pow2(C),
                               num_warps=8)
    out_lp = torch.empty(L, k, dtype=torch.float32, device=device)
    out_ids = torch.empty(L, k, dtype=torch.long, device=device)
    _order_top_kernel[(L,)](part_max, part_sum, C, top, ids, k, floor, out_lp, out_ids, CP=_pow2(C), KP=_pow2(k),
                            num_warps=4)
    return out_lp, out_ids


# ----------------------------------------------------------------------------------------------
# Ancestors (eval/engine/verify.py `ancestor_table`, `ancestor_matrix`)
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _ancestor_table_kernel(parents, N, W, table, BLOCK: tl.constexpr):
        """table[i, m] = the ancestor m steps above node i (the root's self-loop absorbs overshoot)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        node = i < N
        cur = i.to(tl.int64)
        for m in range(W):
            tl.store(table + i * W + m, cur, mask=node)
            cur = tl.load(parents + cur, mask=node, other=0)

    @triton.jit
    def _ancestor_matrix_kernel(table, N, W, vis, BLOCK: tl.constexpr):
        """vis[i, table[i, m]] = True for every m (vis zeroed by the caller)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        node = i < N
        for m in range(W):
            a = tl.load(table + i * W + m, mask=node, other=0)
            tl.store(vis + i.to(tl.int64) * N + a, tl.full([BLOCK], 1, tl.int8), mask=node)


def ancestor_table(parents: Tensor, width: int) -> Tensor:
    """eval/engine/verify.py `ancestor_table` with `width` = 2^k columns: int64 [N, width], one launch."""
    N = parents.shape[0]
    table = torch.empty(N, width, dtype=torch.long, device=parents.device)
    _ancestor_table_kernel[(triton.cdiv(N, 128),)](parents, N, width, table, BLOCK=128)
    return table


def ancestor_matrix(table: Tensor) -> Tensor:
    """eval/engine/verify.py `ancestor_matrix` from the table: bool [N, N], a memset and one launch."""
    N, W = table.shape
    vis = torch.zeros(N, N, dtype=torch.bool, device=table.device)
    _ancestor_matrix_kernel[(triton.cdiv(N, 128),)](table, N, W, vis.view(torch.int8), BLOCK=128)
    return vis


# ----------------------------------------------------------------------------------------------
# Greedy choices and the walk
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _argmax_partial_kernel(logits, V, chunk, best, where, BLOCK: tl.constexpr):
        """Row r, chunk c: max and first argmax of logits[r, c*chunk : (c+1)*chunk] -> best/where [r, c]."""
        r, c = tl.program_id(0), tl.program_id(1)
        chunks = tl.num_programs(1)
        lo = c * chunk
        run_max = float("-inf")
        run_idx = lo
        for start in range(lo, tl.minimum(lo + chunk, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits + r.to(tl.int64) * V + cols, mask=cols < tl.minimum(lo + chunk, V),
                        other=float("-inf")).to(tl.float32)
            m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            take = m > run_max  # strict: an equal later maximum keeps the first index
            run_idx = tl.where(take, start + i, run_idx)
            run_max = tl.where(take, m, run_max)
        tl.store(best + r * chunks + c, run_max)
        tl.store(where + r * chunks + c, run_idx.to(tl.int64))

    @triton.jit
    def _argmax_final_kernel(best, where, CH, choices, CHP: tl.constexpr):
        """Row r: the first chunk holding the row maximum gives the row's first argmax."""
        r = tl.program_id(0)
        c = tl.arange(0, CHP)
        part = tl.load(best + r * CH + c, mask=c < CH, other=float("-inf"))
        _, first = tl.max(part, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(choices + r, tl.load(where + r * CH + first))

    @triton.jit
    def _walk_kernel(tokens, parents, depths, ancestors, W, N, L, choices, match_buf,
                     path, accepted_out, bonus_out, last_out, record,
                     NP: tl.constexpr, WP: tl.constexpr, LP: tl.constexpr, HEAD: tl.constexpr):
        i = tl.arange(0, NP)
        node = i < N
        lp = tl.arange(0, LP)
        tl.store(path + lp, tl.zeros([LP], tl.int64), mask=lp <= L)
        tl.debug_barrier()
        par = tl.load(parents + i, mask=node, other=0)
        tok = tl.load(tokens + i, mask=node, other=0)
        match = (tok == tl.load(choices + par, mask=node, other=-1, volatile=True)) | (i == 0)
        tl.store(match_buf + i, match.to(tl.int8), mask=node)
        tl.debug_barrier()
        w = tl.arange(0, WP)
        anc = tl.load(ancestors + i[:, None] * W + w[None, :], mask=node[:, None] & (w[None, :] < W), other=0)
        ok = tl.min(tl.load(match_buf + anc, mask=node[:, None] & (w[None, :] < W), other=1, volatile=True),
                    axis=1) > 0
        ok = ok & node
        depth = tl.load(depths + i, mask=node, other=0)
        accepted = tl.max(tl.where(ok, depth, 0), axis=0)
        tl.store(path + depth, i.to(tl.int64), mask=ok)
        tl.debug_barrier()
        last = tl.load(path + accepted, volatile=True)
        bonus = tl.load(choices + last, volatile=True)
        tl.store(accepted_out, accepted.to(tl.int64))
        tl.store(bonus_out, bonus)
        tl.store(last_out, last)
        tl.store(record, accepted.to(tl.int64))
        tl.store(record + 1, bonus)
        tl.store(record + 2, tl.max(tl.where(node, depth, 0), axis=0).to(tl.int64))
        steps = tl.load(path + lp, mask=lp <= L, other=0, volatile=True)
        tl.store(record + HEAD + lp, steps, mask=lp <= L)
        tl.store(record + HEAD + 1 + L + lp, tl.load(tokens + steps, mask=lp <= L, other=0), mask=lp <= L)


def greedy_choices(logits: Tensor) -> Tensor:
    """eval/engine/walk.py `target_choices` at T = 0: the first argmax of each row of logits [N, V] -> int64 [N]."""
    N, V = logits.shape
    chunk = 4096  # one load of 4096 values per program: memory-parallel, not a serial loop
    chunks = triton.cdiv(V, chunk)
    best = torch.empty(N, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(N, chunks, dtype=torch.long, device=logits.device)
    _argmax_partial_kernel[(N, chunks)](logits.contiguous(), V, chunk, best, where, BLOCK=chunk, num_warps=8)
    choices = torch.empty(N, dtype=torch.long, device=logits.device)
    _argmax_final_kernel[(N,)](best, where, chunks, choices, CHP=_pow2(chunks))
    return choices


def greedy_walk(tokens: Tensor, parents: Tensor, depths: Tensor, ancestors: Tensor, logits: Tensor,
                depth_limit: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """eval/engine/walk.py at T = 0 in three launches: (accepted, path [L+1], bonus, last, the round record of
    eval/engine/round_record.py, packed by the walk kernel at its offsets); accepted/bonus/last are 0-dim int64.
    ancestors: eval/engine/verify.py `ancestor_table` [N, W]."""
    N = tokens.shape[0]
    L = depth_limit
    choices = greedy_choices(logits)
    device = tokens.device
    match = torch.empty(N, dtype=torch.int8, device=device)
    path = torch.empty(L + 1, dtype=torch.long, device=device)
    accepted, bonus, last = (torch.empty((), dtype=torch.long, device=device) for _ in range(3))
    record = torch.empty(round_record.record_size(L), dtype=torch.long, device=device)
    W = ancestors.shape[1]
    _walk_kernel[(1,)](tokens, parents, depths, ancestors.contiguous(), W, N, L, choices, match, path, accepted,
                       bonus, last, record, NP=_pow2(N), WP=_pow2(W), LP=_pow2(L + 1), HEAD=round_record.HEAD,
                       num_warps=4 if N <= 256 else 8)
    return accepted, path, bonus, last, record


# ----------------------------------------------------------------------------------------------
# Path compaction (eval/engine/walk.py `compact_path_rows`)
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _compact_path_kernel(x, R, C, past_ptr, path, LP1, LP: tl.constexpr, BLOCK_C: tl.constexpr):
        """Slice p, columns chunk c of x viewed [P, R, C]: rows past + path[j] -> past + j for j < LP1, all rows
        read before any is written (so no order between the rows is assumed)."""
        p, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        past = tl.load(past_ptr)
        j = tl.arange(0, LP)
        ok = j < LP1
        cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
        m = ok[:, None] & (cols < C)[None, :]
        src = past + tl.load(path + j, mask=ok, other=0)
        base = x + p * R * C
        rows = tl.load(base + src[:, None] * C + cols[None, :], mask=m)
        tl.debug_barrier()
        tl.store(base + (past + j)[:, None] * C + cols[None, :], rows, mask=m)


def compact_path_rows(x: Tensor, dim: int, past: Tensor, path: Tensor) -> Tensor:
    """eval/engine/walk.py `compact_path_rows` for a contiguous x, in place, one launch; returns x."""
    P, R = math.prod(x.shape[:dim]), x.shape[dim]
    C = x.numel() // (P * R)
    block_c = min(_pow2(C), 128)
    LP1 = path.shape[0]
    _compact_path_kernel[(P, triton.cdiv(C, block_c))](x, R, C, past.reshape(1), path, LP1, LP=_pow2(LP1),
                                                       BLOCK_C=block_c)
    return x


# ----------------------------------------------------------------------------------------------
# Tree attention (split over keys)
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _tree_attention_kernel(q, k, v, vis, past_ptr, out, lse, N, GN, stride_kh, stride_kt, kv_chunk, scale,
                               HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """Program (query tile, KV head, key split): online softmax over keys [s*kv_chunk, (s+1)*kv_chunk) that
        exist (< past + N). Key column c is visible to folded row m (token i = m % N) iff c < past, or
        c - past is i or an ancestor of i (vis[i, c - past])."""
        pid_m, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        past = tl.load(past_ptr).to(tl.int32)
        total = past + N
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < GN
        tok = rows % N
        d = tl.arange(0, HD)
        qt = tl.load(q + h * GN * HD + rows[:, None] * HD + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, HD], tl.float32)
        lo = s * kv_chunk
        hi = tl.minimum(total, lo + kv_chunk)
        kbase = k + h.to(tl.int64) * stride_kh
        vbase = v + h.to(tl.int64) * stride_kh
        for start in range(lo, hi, BN):
            cols = start + tl.arange(0, BN)
            col_ok = cols < hi
            kt = tl.load(kbase + cols[:, None] * stride_kt + d[None, :], mask=col_ok[:, None], other=0.0)
            sc = tl.dot(qt, tl.trans(kt)) * scale
            in_tree = col_ok & (cols >= past)
            tv = tl.load(vis + tok[:, None] * N + (cols - past)[None, :], mask=row_ok[:, None] & in_tree[None, :],
                         other=0)
            visible = ((cols < past)[None, :] | (tv != 0)) & col_ok[None, :]
            sc = tl.where(visible, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2((m_i - m_safe) * 1.4426950408889634)
            p = tl.exp2((sc - m_safe[:, None]) * 1.4426950408889634)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(vbase + cols[:, None] * stride_kt + d[None, :], mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        base = (s * tl.num_programs(1) + h) * GN
        tl.store(out + (base + rows[:, None]) * HD + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + base + rows, tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf")), mask=row_ok)


ATTENTION_CONFIG = (64, 64, 4, 2)  # BLOCK_M, BLOCK_N, warps, stages


def tree_attention(q: Tensor, keys: Tensor, values: Tensor, visibility: Tensor, past: Tensor, scale: float,
                   splits: int, config: tuple[int, int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """q [KVH, M, hd] (folded: row m is tree token m % N), keys/values [KVH, kv_len, hd] (row stride free, last dim
    contiguous), visibility bool [N, N] (eval/engine/verify.py ancestor matrix), past 0-dim device int -> per-split outputs
    [S, KVH, M, hd] (q dtype) and log-sum-exps [S, KVH, M] fp32 (-inf where a split saw no key); S = splits, and
    kv_len % (BLOCK_N * S) == 0. Keys at or beyond past + N are never read."""
    H, M, hd = q.shape
    N = visibility.shape[0]
    kv_len = keys.shape[1]
    out = torch.empty(splits, H, M, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(splits, H, M, dtype=torch.float32, device=q.device)
    BM, BN, warps, stages = config or ATTENTION_CONFIG
    _tree_attention_kernel[(triton.cdiv(M, BM), H, splits)](
        q.contiguous(), keys, values, visibility.view(torch.uint8), past, out, lse, N, M, keys.stride(0),
        keys.stride(1), kv_len // splits, scale, HD=hd, BM=BM, BN=BN, num_warps=warps, num_stages=stages)
    return out, lse
