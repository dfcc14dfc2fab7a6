"""Triton kernels of the Gated-DeltaNet tree verify: each equals a torch function of eval/engine/tree_recurrent.py.

    tree_causal_conv1d       `tree_causal_conv1d`: one program per (node block, channel block) walks each node's
                             K-1 ancestors up the parent pointers (then the committed window), fused with SiLU
    tree_gated_delta_rule    `tree_gated_delta_rule`: one program per (value block, value head) walks ALL nodes in
                             depth-first order (`walk_order`) with the state block [d_k, BV] in registers
    path_gated_delta_state   `path_gated_delta_state`: the same kernel along one root path, writing the final state
                             (the commit; in place over the committed state is allowed), for a stack of layers in
                             one launch (a layer grid axis: the commit of every Gated-DeltaNet layer of a target)
    commit_path_steps        `commit_path_steps` (the device commit inside the walk's CUDA graph): that kernel reads
                             the path's rows where the verify left them (no gather) for the accepted count of steps
                             read from the device, and one launch moves every layer's conv window

The walk. In depth-first pre-order a node usually follows its parent, whose post-update state is still in the
registers; otherwise its parent has an earlier child and was stored in `scratch[depth(parent)]` (a node with two or
more children, a "fork", stores its state at its depth; the nodes visited between a fork and its later children
are its descendants, which only write deeper slots). So the working set is one state per depth,
scratch [L+1, HV, d_k, d_v] fp32 (48 MiB at the Qwen3.6-27B shape with L = 15, reused by every layer), and no
node's state is kept once the walk has passed it. A root path has no forks: the commit runs the same steps in the
same order as the verify did for that node (fp32 stores and reloads in between are exact).

Cost model: the walk is sequential over the N nodes (each step: two l2 norms over d_k, a decay, two reductions
over d_k on a [d_k, BV] block), parallel over HV * d_v / BV programs (48 * 16 = 768 at the 27B shape, BV = 8 as
fla's decode kernel). Without the prefetch below a step waits on its loads (node index, then that node's rows,
then a forked parent's state) rather than on its arithmetic (docs/benchmarks.md, "hybrid", has the timings).

Prefetch. Each step therefore computes on inputs loaded during the step before and issues the next step's loads
(and the index of the one after) before its own arithmetic; a reload of a forked parent's state is loaded one step
early too (safe: that parent is a strict ancestor of the current node, so the current node's own fork store goes to
a deeper slot). Past the last node the prefetch indices wrap to the root, which never reloads; no load of the
walk leaves its tensors (tests/eval/test_tree_recurrent_triton.py puts every tensor against an unreadable page).
A chunked form over the ancestor mask (UT transform restricted to ancestors) would replace the N sequential steps by
matrix products if the walk stays latency-bound.

`walk_order` is torch (fixed shapes, no host sync: CUDA-graph friendly) and runs on any device.
tests/eval/test_tree_recurrent_triton.py runs the kernels in Triton's CPU interpreter and compiles them for sm_90.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.triton_runtime import tl, triton  # None on CPU installs: eval/engine/tree_recurrent.py runs torch
from eval.engine.verify import ancestor_table

BV = 8  # value columns per program (fla's fused_recurrent decode kernel uses the same), one warp
PATH_BLOCK = (8, 1)  # (BV, warps) of the path walk (the commit): benchmarks/bench_gdn_commit.py times others


def walk_order(parents: Tensor, depths: Tensor, depth_limit: int) -> tuple[Tensor, Tensor]:
    """The kernel's walk of a tree (eval/engine/tree.py layout): (order int64 [N], fork int8 [N]).

    order: depth-first pre-order, children in index order; order[0] = 0 (the root); every subtree contiguous.
    fork[i] = 1 iff node i has two or more children (its state is stored for the later ones).
    Built with fixed-shape tensor ops from the ancestor table: subtree sizes, each node's offset among its siblings
    (sizes of the earlier siblings), and pre-order index = sum over the path's non-root nodes of (1 + offset)."""
    N = parents.shape[0]
    device = parents.device
    anc = ancestor_table(parents, depth_limit)  # [N, W]: column m = ancestor m steps up, W > depth_limit
    steps = torch.arange(anc.shape[1], device=device).unsqueeze(0)
    size = torch.zeros(N, dtype=torch.long, device=device).scatter_add_(
        0, anc.flatten(), (steps <= depths.unsqueeze(1)).long().flatten())
    children = torch.zeros(N, dtype=torch.long, device=device).scatter_add_(0, parents[1:], torch.ones_like(parents[1:]))
    size = torch.where(torch.arange(N, device=device) == 0, 0, size)  # the root is no sibling of its children
    by_parent = torch.sort(parents, stable=True).indices  # siblings together, in index order
    sizes = size[by_parent]
    before = sizes.cumsum(0) - sizes  # total size of everything earlier in the grouped order
    group_start = torch.zeros(N, dtype=torch.long, device=device).scatter_reduce_(
        0, parents[by_parent], before, "amin", include_self=False)
    offset = torch.empty(N, dtype=torch.long, device=device).scatter_(
        0, by_parent, before - group_start[parents[by_parent]])
    pre = ((1 + offset)[anc] * (steps < depths.unsqueeze(1))).sum(1)  # columns 0..depth-1: the non-root path
    order = torch.empty(N, dtype=torch.long, device=device).scatter_(0, pre, torch.arange(N, device=device))
    return order, (children >= 2).to(torch.int8)


if triton is not None:

    @triton.jit
    def _tree_conv_kernel(x, stride_x, conv_state, stride_s, weight, parents, depths, out, N, C,
                          K: tl.constexpr, SILU: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
        """Nodes block r, channels block c: out[i] = act(round(sum_j weight[:, K-1-j] * tap_j(i))), tap j = x of the
        ancestor j steps up while j <= depth(i), else committed column K - (j - depth(i))."""
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        row_ok, col_ok = rows < N, cols < C
        depth = tl.load(depths + rows, mask=row_ok, other=0)
        src = rows.to(tl.int64)
        acc = tl.zeros([BN, BC], tl.float32)
        for j in tl.static_range(K):
            w = tl.load(weight + cols * K + (K - 1 - j), mask=col_ok, other=0.0).to(tl.float32)
            in_tree = depth >= j
            from_x = tl.load(x + src[:, None] * stride_x + cols[None, :],
                             mask=(row_ok & in_tree)[:, None] & col_ok[None, :], other=0.0)
            from_state = tl.load(conv_state + cols[None, :] * stride_s + (K - (j - depth))[:, None],
                                 mask=(row_ok & ~in_tree)[:, None] & col_ok[None, :], other=0.0)
            acc += w[None, :] * tl.where(in_tree[:, None], from_x.to(tl.float32), from_state.to(tl.float32))
            src = tl.load(parents + src, mask=row_ok, other=0)
        u = acc.to(weight.dtype.element_ty).to(tl.float32)
        if SILU:
            u = u * tl.sigmoid(u)
        tl.store(out + rows[:, None].to(tl.int64) * C + cols[None, :], u.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _gated_delta_walk_kernel(q, k, v, stride_q, stride_k, stride_v, layer_k, layer_v, layer_gb, layer_h, g, beta,
                                 parents, depths, fork, order, M, m_at, h0, scratch, out, ht, scale,
                                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                                 BK: tl.constexpr, BV: tl.constexpr, TREE: tl.constexpr, M_AT: tl.constexpr):
        """Value block iv of value head hv of layer il, steps t < M over nodes order[t] (order[0] = root 0). TREE: the
        verify walk (module docstring; one layer): reload from scratch when the parent is not the previous node,
        write o, store forks. Not TREE: order is one root path; write the last state to ht. State block h [BK, BV]
        fp32 = S[:, block]. layer_*: element strides between layers of k, v, g/beta and h0/ht (the commit of every
        Gated-DeltaNet layer in one launch). M_AT: the step count is read from the device (m_at, int64, 1..len(order))
        instead of M (the device commit: the accepted count is known only on the device).

        Software-pipelined ("Prefetch" in the module docstring): step t computes on node inputs loaded during step
        t-1 and issues the loads of step t+1 (its rows, and under TREE its parent, depth, fork flag and, when it
        reloads, its parent's stored state) and the index of step t+2, so no step waits on a global load."""
        iv, hv, il = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        if M_AT:
            M = tl.load(m_at).to(tl.int32)
        k += il * layer_k
        v += il * layer_v
        g += il * layer_gb
        beta += il * layer_gb
        h0 += il * layer_h
        ht += il * layer_h
        hk = hv // (HV // HK)
        dk = tl.arange(0, BK)
        dv = iv * BV + tl.arange(0, BV)
        k_ok, v_ok = dk < DK, dv < DV
        h_ok = k_ok[:, None] & v_ok[None, :]
        h_at = hv * DK * DV + dk[:, None] * DV + dv[None, :]  # the block in a [HV, DK, DV] state
        h = tl.load(h0 + h_at, mask=h_ok, other=0.0).to(tl.float32)
        # step 0's inputs (the root never reloads), and the index of step 1
        node = tl.load(order)
        kt = tl.load(k + node * stride_k + hk * DK + dk, mask=k_ok, other=0.0).to(tl.float32)
        vt = tl.load(v + node * stride_v + hv * DV + dv, mask=v_ok, other=0.0).to(tl.float32)
        gt = tl.load(g + node * HV + hv)
        bt = tl.load(beta + node * HV + hv)
        if TREE:
            qt = tl.load(q + node * stride_q + hk * DK + dk, mask=k_ok, other=0.0).to(tl.float32)
            depth = tl.load(depths + node)
            forks = tl.load(fork + node)
            reload = depth < 0  # False
            stored = h
        nxt = tl.load(order + (1 % M))
        for t in range(0, M):
            # issue step t+1's loads (node nxt), then step t+2's index; past the end the indices wrap to valid
            # nodes whose loads are never used
            k1 = tl.load(k + nxt * stride_k + hk * DK + dk, mask=k_ok, other=0.0)
            v1 = tl.load(v + nxt * stride_v + hv * DV + dv, mask=v_ok, other=0.0)
            g1 = tl.load(g + nxt * HV + hv)
            b1 = tl.load(beta + nxt * HV + hv)
            if TREE:
                q1 = tl.load(q + nxt * stride_q + hk * DK + dk, mask=k_ok, other=0.0)
                depth1 = tl.load(depths + nxt)
                forks1 = tl.load(fork + nxt)
                # an earlier sibling's subtree ran in between: the parent forked and sits at depth1 - 1 (a strict
                # ancestor of `node`, so step t's own fork store goes to a deeper slot than this load reads). The
                # root (depth 0) never reloads: past the last node the walk wraps to it, and its "parent" would be
                # scratch slot -1, outside the buffer: an illegal address on a GPU
                reload1 = (tl.load(parents + nxt) != node) & (depth1 > 0)
                stored1 = tl.load(scratch + (depth1 - 1) * HV * DK * DV + h_at, mask=tl.where(reload1, h_ok, False),
                                  other=0.0)  # (a scalar & block mask is refused by the interpreter: where)
            nxt2 = tl.load(order + (t + 2) % M)
            # step t
            if TREE:
                h = tl.where(reload, stored, h)
            kt = kt / tl.sqrt(tl.sum(kt * kt) + 1e-6)
            h = h * tl.exp(gt)
            delta = (vt - tl.sum(h * kt[:, None], 0)) * bt
            h = h + kt[:, None] * delta[None, :]
            if TREE:
                qt = qt / tl.sqrt(tl.sum(qt * qt) + 1e-6) * scale
                o = tl.sum(h * qt[:, None], 0)
                tl.store(out + (node * HV + hv) * DV + dv, o.to(out.dtype.element_ty), mask=v_ok)
                if forks != 0:
                    tl.store(scratch + depth * HV * DK * DV + h_at, h, mask=h_ok)
                qt, depth, forks, reload, stored = q1.to(tl.float32), depth1, forks1, reload1, stored1
            node, kt, vt, gt, bt, nxt = nxt, k1.to(tl.float32), v1.to(tl.float32), g1, b1, nxt2
        if not TREE:
            tl.store(ht + h_at, h, mask=h_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_causal_conv1d(x: Tensor, conv_state: Tensor, weight: Tensor, parents: Tensor, depths: Tensor,
                       activation: str | None = "silu") -> Tensor:
    """eval/engine/tree_recurrent.py `tree_causal_conv1d`: x [N, C] (row stride free, channels contiguous), conv_state
    [C, K] (channel stride free), weight [C, K] -> [N, C] in x's dtype."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"tree conv: activation {activation!r} not supported (silu or none)")
    N, C = x.shape
    K = weight.shape[1]
    assert x.stride(1) == 1 and conv_state.stride(1) == 1
    out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    BN, BC = 16, 128
    _tree_conv_kernel[(triton.cdiv(N, BN), triton.cdiv(C, BC))](
        x, x.stride(0), conv_state, conv_state.stride(0), weight.contiguous(), parents, depths, out, N, C,
        K=K, SILU=activation is not None, BN=BN, BC=BC)
    return out


def _walk(q, k, v, g, beta, parents, depths, fork, order, steps, h0, scratch, out, ht, tree: bool,
          block: tuple[int, int] = (BV, 1)) -> None:
    """q, k [B, N, HK, dk], v [B, N, HV, dv] (B layers; rows and layers at any stride), g, beta [B, N, HV],
    h0 / ht [B, HV, dk, dv] fp32 contiguous; steps: an int, or a 0-dim int64 device tensor read by the kernel: one
    program per (value block, value head, layer); block = (value columns per program, warps)."""
    B = k.shape[0]
    HK, DK = k.shape[2:]
    HV, DV = v.shape[2:]
    for t in (q, k, v):
        assert t.stride(3) == 1 and t.stride(2) == t.shape[3], "rows [N, heads, dim]: heads packed, dim contiguous"
    g, beta = g.float().contiguous(), beta.float().contiguous()
    on_device = isinstance(steps, Tensor)
    bv, warps = block
    _gated_delta_walk_kernel[(triton.cdiv(DV, bv), HV, B)](
        q, k, v, q.stride(1), k.stride(1), v.stride(1), k.stride(0), v.stride(0), g.stride(0), HV * DK * DV, g, beta,
        parents, depths, fork, order, order.shape[0] if on_device else steps, steps.reshape(1) if on_device else order,
        h0, scratch, out, ht, DK ** -0.5, HK=HK, HV=HV, DK=DK, DV=DV, BK=_pow2(DK), BV=bv, TREE=tree, M_AT=on_device,
        num_warps=warps)


def tree_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor, depths: Tensor,
                          initial_state: Tensor, walk: tuple[Tensor, Tensor], depth_limit: int,
                          scratch: Tensor | None = None) -> Tensor:
    """eval/engine/tree_recurrent.py `tree_gated_delta_rule` in one launch: q, k [N, HK, dk], v [N, HV, dv] (row stride
    free: views of the conv output), g, beta [N, HV], initial_state [HV, dk, dv] fp32 contiguous, walk =
    `walk_order(parents, depths, depth_limit)` -> o [N, HV, dv] in v's dtype. scratch: [depth_limit + 1, HV, dk, dv]
    fp32 to reuse across layers (allocated when None)."""
    N, HV, DV = v.shape
    DK = k.shape[2]
    order, fork = walk
    if scratch is None:
        scratch = torch.empty(depth_limit + 1, HV, DK, DV, dtype=torch.float32, device=v.device)
    out = torch.empty(N, HV, DV, dtype=v.dtype, device=v.device)
    _walk(q[None], k[None], v[None], g[None], beta[None], parents, depths, fork, order, N, initial_state, scratch, out,
          initial_state, True)  # one layer; ht unwritten
    return out


def path_gated_delta_state(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor, initial_state: Tensor,
                           out: Tensor | None = None, steps: Tensor | None = None) -> Tensor:
    """eval/engine/tree_recurrent.py `path_gated_delta_state` in one launch: the state [..., HV, dk, dv] fp32 of path[-1]
    after the root path `path` [n] from initial_state (fp32 contiguous), for one layer (k [N, HK, dk], ...) or a
    stack of layers (k [B, N, HK, dk], v [B, N, HV, dv], g, beta [B, N, HV], initial_state [B, HV, dk, dv]);
    written into `out` (may BE initial_state). steps: a 0-dim int64 device tensor m in 1..n: the path is
    path[:m] (read by the kernel, no host sync); the result equals the call with path[:m] bit for bit."""
    out = torch.empty_like(initial_state) if out is None else out
    if k.dim() == 3:
        k, v, g, beta = k[None], v[None], g[None], beta[None]
    unread = path  # q, parents, depths, fork, scratch and o are not read on a root path
    _walk(k, k, v, g, beta, unread, unread, unread, path, path.shape[0] if steps is None else steps, initial_state,
          out, out, out, False, PATH_BLOCK)
    return out


if triton is not None:

    @triton.jit
    def _path_conv_window_kernel(x, layer_x, stride_x, window, path, n_at, C, K: tl.constexpr, KP: tl.constexpr,
                                 BC: tl.constexpr):
        """Layer il, channels block c: window[il, c, j] <- column n + j of cat([window[il, c, :], x[il, path[:n], c]^T])
        for j < K (n read from n_at), in place: every load of the block lands before the barrier, every store after."""
        il = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        j = tl.arange(0, KP)
        n = tl.load(n_at)
        src = n + j  # column of the concatenation
        col_ok, j_ok = cols < C, j < K
        old = src < K
        at = window + il * C * K + cols[:, None] * K
        kept = tl.load(at + src[None, :], mask=col_ok[:, None] & (j_ok & old)[None, :], other=0.0)
        node = tl.load(path + tl.where(old, 0, src - K), mask=j_ok & ~old, other=0)
        new = tl.load(x + il * layer_x + node[None, :] * stride_x + cols[:, None],
                      mask=col_ok[:, None] & (j_ok & ~old)[None, :], other=0.0)
        moved = tl.where(old[None, :], kept, new.to(kept.dtype))
        tl.debug_barrier()
        tl.store(at + j[None, :], moved, mask=col_ok[:, None] & j_ok[None, :])


def path_conv_window(conv_inputs: Tensor, path: Tensor, n: Tensor, conv_states: Tensor) -> Tensor:
    """In place, one launch: conv_states [B, C, K] (contiguous) <- columns n..n+K-1 of cat([conv_states,
    conv_inputs[:, path]^T]): the window after the accepted path[:n] (path [L+1] device int64, n 0-dim int64 in
    1..L+1; conv_inputs [B, N, C], channels contiguous). eval/engine/tree_recurrent.py `commit_path_steps`'s window."""
    B, C, K = conv_states.shape
    assert conv_states.is_contiguous() and conv_inputs.stride(2) == 1
    BC = 64
    _path_conv_window_kernel[(B, triton.cdiv(C, BC))](conv_inputs, conv_inputs.stride(0), conv_inputs.stride(1),
                                                       conv_states, path, n.reshape(1), C, K=K, KP=_pow2(K), BC=BC)
    return conv_states


def commit_path_steps(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, conv_inputs: Tensor, path: Tensor, n: Tensor,
                      conv_states: Tensor, recurrent_states: Tensor) -> Tensor:
    """eval/engine/tree_recurrent.py `commit_path_steps` in two launches, no gather: k [B, N, HK, dk], v [B, N, HV, dv]
    (views of the verify's conv outputs), g, beta [B, N, HV] fp32, conv_inputs [B, N, C], path [L+1], n 0-dim: the
    states along path[:n] (the kernel reads n) and the windows, both in place. Returns recurrent_states."""
    path_gated_delta_state(k, v, g, beta, path, recurrent_states, recurrent_states, steps=n)
    path_conv_window(conv_inputs, path, n, conv_states)
    return recurrent_states
