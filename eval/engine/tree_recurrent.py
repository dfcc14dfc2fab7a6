"""Tree verify for Gated-DeltaNet (linear-attention) layers: every node computed from its OWN root path, in one pass.

A hybrid target (Qwen3.5/3.6: three of every four layers are Gated DeltaNet) keeps, per linear-attention layer, a
short-convolution window and a recurrent state instead of K/V rows, so the tree mask of the attention layers
(eval/engine/verify.py) cannot keep the branches of a tree apart there. Here each such layer runs over the N nodes of a
tree (eval/engine/tree.py layout: node 0 = root, parents[0] = 0, parents[i] < i; the same node order and positions as the
attention layers) with the recurrence taken along the tree instead of along the flattened order:

    conv     u_i = act(sum_{j<K} w[:, K-1-j] * x_{a_j(i)})   a_0(i) = i, a_j(i) = parent of a_{j-1}(i); a tap farther
                                                             back than the root reads the committed conv window
    state    S_i = exp(g_i) S_p + k_i delta_i^T,   delta_i = beta_i (v_i - (exp(g_i) S_p)^T k_i),   p = parent(i)
    output   o_i = S_i^T q_i                                 (the root's S_p = the committed recurrent state)

with q, k split from u_i, l2-normalised (eps 1e-6 under the root), q scaled by d_k^-1/2, q/k heads shared by
HV/HK value heads, g_i = -exp(A_log) softplus(a_i + dt_bias), beta_i = sigmoid(b_i): exactly one token of HF's
`torch_recurrent_gated_delta_rule` (= fla's `fused_recurrent_gated_delta_rule`), applied to the PARENT's state
instead of the previous row's. So o_i, and the (conv window, S_i) left in the cache, equal running node i's root
path through HF's layer from the committed cache (tests/eval/test_tree_recurrent.py). docs/tree.md, "Hybrid
(recurrent) targets", says where this sits in the decode.

Memory (why node states are not kept). At the Qwen3.6-27B shape (64 layers, 48 of them Gated DeltaNet; 48 value
heads, 16 q/k heads, d_k = d_v = 128, conv kernel 4 over C = 2*16*128 + 48*128 = 10240 channels) one node's state
is 48*128*128 fp32 = 3 MiB per layer. A budget-256 tree has N = 257 nodes: 771 MiB of states per layer, 36.1 GiB
for the 48 layers if every node's state were kept until the walk picks the accepted node (plus 0.7 GiB of conv
windows). Instead:
  * verify keeps only what the walk needs, the outputs o [N, HV, d_v]. The Triton kernel
    (eval/engine/tree_recurrent_triton.py) walks the nodes in depth-first order and keeps one state per DEPTH, not per
    node: (L+1) * 3 MiB = 48 MiB for depth limit L = 15, one buffer reused by every layer; a node's state stays in
    registers for its first child and is stored only when the node has a second child. This torch version (the
    definition, and the CPU path) goes level by level and holds two levels' states at a time.
  * commit recomputes the accepted node's state along its root path (at most L+1 steps of the same recurrence from
    the committed state) from a per-layer record of the node ROWS: conv inputs and outputs [N, C] (model dtype)
    and g, beta [N, HV] fp32 = 10.1 MiB per layer at N = 257 in bf16, 486 MiB for the 48 layers.

API (N nodes; all tensors on one device; host syncs only in the torch versions):
    tree_causal_conv1d(x [N, C], conv_state [C, K], weight [C, K], parents, depths, activation) -> u [N, C]
    tree_gated_delta_rule(q [N, HK, dk], k, v [N, HV, dv], g [N, HV], beta [N, HV], parents, depths,
                          initial_state [HV, dk, dv]) -> o [N, HV, dv]
    path_gated_delta_state(k, v, g, beta, path [n], initial_state) -> S_{path[-1]} [HV, dk, dv] fp32
                          (or with a leading stack of layers on every argument)
    tree_walk(tree, layer) -> the Triton walk's order and scratch, once per tree for all layers (None on CPU)
    tree_gated_delta_net(layer, hidden [1, N, D], tree, conv_state [1, C, K], recurrent_state [1, HV, dk, dv], walk)
        -> (out [1, N, D], TreeLayerRecord)        record.commit(path, conv_state, recurrent_state): in place
    commit_path(layer, rows stacked over B layers, path, conv_states [B, C, K], recurrent_states [B, HV, dk, dv]):
        the same commit for B layers at once (eval/engine/cache/hybrid.py commits a target's layers with it)
    commit_path_steps(layer, rows, path [L+1], n (0-dim device), conv_states, recurrent_states): the same commit
        with fixed shapes and no host value (captured in the round's walk graph)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline import triton_runtime
from eval.engine.tree import Tree

L2_EPS = 1e-6  # HF's l2norm / fla's use_qk_l2norm_in_kernel: x / sqrt(sum(x^2) + eps)


# ----------------------------------------------------------------------------------------------
# Short convolution over the tree
# ----------------------------------------------------------------------------------------------


def conv_window_rows(parents: Tensor, depths: Tensor, kernel_size: int) -> Tensor:
    """int64 [N, K]: where tap j (j steps back; j = 0 is the node) of node i's window comes from, as a row of
    cat([committed window^T (K rows, oldest first), x (N rows)]): K + a_j(i) while j <= depth(i), else the committed
    row K - (j - depth(i)) (the window continues before the root; its oldest row is never reached, as in HF)."""
    node = torch.arange(parents.shape[0], device=parents.device)
    taps = []
    for j in range(kernel_size):
        taps.append(torch.where(depths >= j, kernel_size + node, kernel_size - (j - depths)))
        node = parents[node]
    return torch.stack(taps, dim=1)


def tree_causal_conv1d(x: Tensor, conv_state: Tensor, weight: Tensor, parents: Tensor, depths: Tensor,
                       activation: str | None = "silu") -> Tensor:
    """HF's depthwise causal conv (no bias) with each node's window along its ancestors: x [N, C] conv inputs,
    conv_state [C, K] the committed window (last column = the token before the root), weight [C, K] -> [N, C] in
    x's dtype. As HF: the sum is rounded to the weight dtype before the activation."""
    K = weight.shape[1]
    rows = torch.cat([conv_state.transpose(0, 1).to(x.dtype), x])
    window = rows[conv_window_rows(parents, depths, K)]  # [N, K, C], tap j = j steps back
    u = (window.float() * weight.flip(1).transpose(0, 1).float()).sum(1).to(weight.dtype)
    return _activation(u, activation).to(x.dtype)


def _activation(u: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return u
    if activation not in ("silu", "swish"):
        raise ValueError(f"tree conv: activation {activation!r} not supported (silu or none)")
    return F.silu(u)


def path_conv_state(x_path: Tensor, conv_state: Tensor) -> Tensor:
    """The committed window after the path's conv inputs x_path [..., n, C]: the last K columns of
    cat([conv_state [..., C, K], x_path^T]) -> [..., C, K] (what HF's cache holds after those n tokens; `...` = a
    stack of layers or none)."""
    K = conv_state.shape[-1]
    return torch.cat([conv_state, x_path.transpose(-1, -2).to(conv_state.dtype)], dim=-1)[..., -K:]


# ----------------------------------------------------------------------------------------------
# Gated delta rule over the tree
# ----------------------------------------------------------------------------------------------


def _l2_normalize(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _value_heads(x: Tensor, num_v_heads: int) -> Tensor:
    """[..., HK, dk] fp32, l2-normalised, each q/k head repeated for its HV/HK value heads -> [..., HV, dk]."""
    return _l2_normalize(x.float()).repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def _decay_and_update(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One token of the gated delta rule on a batch: state [..., HV, dk, dv] fp32, k [..., HV, dk] (normalised),
    v [..., HV, dv], g/beta [..., HV] fp32 -> the new state (HF's order of operations)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def tree_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor, depths: Tensor,
                          initial_state: Tensor) -> Tensor:
    """Outputs o [N, HV, dv] (v's dtype) of every node, each node's state = one step from its parent's (module
    docstring). q, k [N, HK, dk] raw (normalised here), v [N, HV, dv], g, beta [N, HV], initial_state [HV, dk, dv]
    (the committed state; fp32 accumulation). Level by level: the states of one depth are computed together from
    the previous depth's, so at most two levels of states exist at once (host reads of the levels)."""
    HV = v.shape[1]
    qn = _value_heads(q, HV) * q.shape[-1] ** -0.5
    kn = _value_heads(k, HV)
    v32, g32, beta32 = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    level_nodes, level_states = None, initial_state.float().unsqueeze(0)
    for d in range(int(depths.max()) + 1):
        nodes = (depths == d).nonzero().squeeze(1)  # ascending
        parent_states = level_states if d == 0 else level_states[torch.searchsorted(level_nodes, parents[nodes])]
        states = _decay_and_update(parent_states, kn[nodes], v32[nodes], g32[nodes], beta32[nodes])
        out[nodes] = (states * qn[nodes].unsqueeze(-1)).sum(-2)
        level_nodes, level_states = nodes, states
    return out.to(v.dtype)


def path_gated_delta_state(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor, initial_state: Tensor) -> Tensor:
    """The state S [..., HV, dk, dv] fp32 of node path[-1]: the recurrence run along path [n] (root first, each
    entry the parent of the next) from initial_state [..., HV, dk, dv]; node rows as in `tree_gated_delta_rule`
    with an optional leading stack of layers (k [..., N, HK, dk], v [..., N, HV, dv], g, beta [..., N, HV])."""
    rows = lambda x, dim: x.index_select(dim, path).float()  # noqa: E731
    kn = _value_heads(rows(k, -3), v.shape[-2])
    v32, g32, beta32 = rows(v, -3), rows(g, -2), rows(beta, -2)
    state = initial_state.float()
    for t in range(path.shape[0]):
        state = _decay_and_update(state, kn[..., t, :, :], v32[..., t, :, :], g32[..., t, :], beta32[..., t, :])
    return state


# ----------------------------------------------------------------------------------------------
# One HF Gated-DeltaNet layer over a tree
# ----------------------------------------------------------------------------------------------


def _kernels(device):
    """The Triton module when its kernels can run on `device` (CUDA, Triton present, nothing failed yet)."""
    if not triton_runtime.available(device):
        return None
    from eval.engine import tree_recurrent_triton

    return tree_recurrent_triton


def _split_heads(u: Tensor, layer) -> tuple[Tensor, Tensor, Tensor]:
    """conv outputs [..., N, C] -> q, k [..., N, HK, dk], v [..., N, HV, dv] (views)."""
    q, k, v = torch.split(u, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    return (q.unflatten(-1, (layer.num_k_heads, layer.head_k_dim)),
            k.unflatten(-1, (layer.num_k_heads, layer.head_k_dim)), v.unflatten(-1, (layer.num_v_heads, layer.head_v_dim)))


@torch.no_grad()
def commit_path(layer, conv_inputs: Tensor, conv_outputs: Tensor, g: Tensor, beta: Tensor, path: Tensor,
                conv_states: Tensor, recurrent_states: Tensor) -> None:
    """Advance B stacked Gated-DeltaNet layers of `layer`'s shape, in place, over the accepted root path `path` [n]
    (node ids, path[0] = 0, each the parent of the next), from their node rows (`TreeLayerRecord` fields with a
    leading layer axis: conv_inputs / conv_outputs [B, N, C], g / beta [B, N, HV]): conv_states [B, C, K] <- the last
    K conv inputs along the path (committed ones first), recurrent_states [B, HV, dk, dv] <- S_{path[-1]} recomputed
    along the path (n steps). The result is the cache HF leaves after running those n tokens from the committed
    state. On CUDA: one launch for the states of all B layers (eval/engine/tree_recurrent_triton.py)."""
    _, k, v = _split_heads(conv_outputs, layer)
    new_windows = path_conv_state(conv_inputs.index_select(1, path), conv_states)
    kernels = _kernels(path.device)
    state = None
    if kernels is not None:  # writes the new states over the committed ones
        state = triton_runtime.run(kernels.path_gated_delta_state, k, v, g, beta, path, recurrent_states,
                                   recurrent_states)
    if state is None:
        recurrent_states.copy_(path_gated_delta_state(k, v, g, beta, path, recurrent_states))
    conv_states.copy_(new_windows)


@torch.no_grad()
def commit_path_steps(layer, conv_inputs: Tensor, conv_outputs: Tensor, g: Tensor, beta: Tensor, path: Tensor,
                      n: Tensor, conv_states: Tensor, recurrent_states: Tensor) -> None:
    """`commit_path` with every shape fixed and no host value, so that a CUDA graph captures it with the walk:
    path [L+1] holds the accepted root path in path[:n] (any node ids after it), n a 0-dim device int64 in 1..L+1.

    On CUDA (eval/engine/tree_recurrent_triton.py `commit_path_steps`) the state kernel reads n and runs n steps
    over the path's rows where the verify left them, and one launch moves the windows: the same kernel, steps and
    order as `commit_path` over path[:n], so the states equal it bit for bit, with no gathered copy of the rows.
    The torch version runs all L+1 steps over gathered rows with the steps t >= n made exact no-ops (g = 0: decay
    exp(0) = 1; beta = 0: no update). Either way the new conv window is columns n..n+K-1 of cat([committed window,
    the path's conv inputs]) (tests/eval/test_hybrid_cache.py: equal to the eager commit bit for bit)."""
    _, k, v = _split_heads(conv_outputs, layer)
    kernels = _kernels(path.device)
    if kernels is not None and triton_runtime.run(kernels.commit_path_steps, k, v, g.float(), beta.float(),
                                                  conv_inputs, path, n, conv_states, recurrent_states) is not None:
        return
    steps = path.shape[0]
    t = torch.arange(steps, device=path.device)
    live = (t < n).unsqueeze(-1)  # [L+1, 1]
    k_p, v_p = k.index_select(-3, path), v.index_select(-3, path)
    g_p = torch.where(live, g.index_select(-2, path).float(), 0.0)
    beta_p = torch.where(live, beta.index_select(-2, path).float(), 0.0)
    K = conv_states.shape[-1]
    rows = torch.cat([conv_states, conv_inputs.index_select(-2, path).transpose(-1, -2).to(conv_states.dtype)], dim=-1)
    new_windows = rows.index_select(-1, n + torch.arange(K, device=path.device))
    recurrent_states.copy_(path_gated_delta_state(k_p, v_p, g_p, beta_p, t, recurrent_states))
    conv_states.copy_(new_windows)


@dataclass
class TreeLayerRecord:
    """What one Gated-DeltaNet layer keeps from a tree verify for the commit: node ROWS, not node states."""

    layer: torch.nn.Module
    conv_inputs: Tensor  # [N, C] in_proj_qkv outputs (model dtype): the committed conv window is made of these
    conv_outputs: Tensor  # [N, C] after the tree conv: q | k | v per node
    g: Tensor  # [N, HV] fp32 log-decay
    beta: Tensor  # [N, HV] fp32

    def commit(self, path: Tensor, conv_state: Tensor, recurrent_state: Tensor) -> None:
        """Advance the layer's committed cache state, in place, over the accepted root path `path` [n]:
        conv_state [1, C, K], recurrent_state [1, HV, dk, dv] (HF's cache tensors) become what HF leaves after
        running those n tokens from the committed state (`commit_path` with one layer)."""
        commit_path(self.layer, self.conv_inputs[None], self.conv_outputs[None], self.g[None], self.beta[None], path,
                    conv_state, recurrent_state)


def tree_walk(tree: Tree, layer) -> tuple[tuple[Tensor, Tensor], Tensor] | None:
    """What the Triton walk of `tree` needs, computed once per tree and shared by every Gated-DeltaNet layer of
    `layer`'s shape: (`walk_order` (order, fork), scratch [L+1, HV, dk, dv] fp32, one state per depth). None where
    the torch version runs (no CUDA / Triton): it needs neither. Fixed shapes, no host read."""
    kernels = _kernels(tree.parents.device)
    if kernels is None:
        return None
    scratch = torch.empty(tree.depth_limit + 1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                          dtype=torch.float32, device=tree.parents.device)
    return kernels.walk_order(tree.parents, tree.depths, tree.depth_limit), scratch


@torch.no_grad()
def tree_gated_delta_net(layer, hidden_states: Tensor, tree: Tree, conv_state: Tensor, recurrent_state: Tensor,
                         walk: tuple[tuple[Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, TreeLayerRecord]:
    """HF `Qwen3_5GatedDeltaNet` `layer` over the tree's N nodes: hidden_states [1, N, D] (the layer's input, after
    its input norm) -> (output [1, N, D], the record that commits a node). conv_state [1, C, K] and recurrent_state
    [1, HV, dk, dv] are the layer's committed cache tensors (HF's `conv_states[0]` / `recurrent_states[0]`); they
    are read, not changed. The layer's own modules do the projections, the gated norm and the output projection.
    walk: `tree_walk(tree, layer)`, computed once per tree for all layers (CUDA path; made here when None)."""
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                 "out_proj"):
        if not hasattr(layer, name):
            raise TypeError(f"tree verify needs a Qwen3.5-style Gated-DeltaNet layer; {type(layer).__name__} has no "
                            f"'{name}'")
    if layer.conv1d.bias is not None:
        raise TypeError("tree verify: a Gated-DeltaNet conv with a bias is not supported (Qwen3.5 has none)")
    hidden = hidden_states[0]
    N = hidden.shape[0]
    mixed = layer.in_proj_qkv(hidden)
    z = layer.in_proj_z(hidden)
    beta = layer.in_proj_b(hidden).sigmoid().float()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden).float() + layer.dt_bias)
    weight = layer.conv1d.weight.squeeze(1)
    kernels = _kernels(hidden.device)
    u = o = None
    if kernels is not None:
        u = triton_runtime.run(kernels.tree_causal_conv1d, mixed, conv_state[0], weight, tree.parents, tree.depths,
                               layer.activation)
    if u is None:
        u = tree_causal_conv1d(mixed, conv_state[0], weight, tree.parents, tree.depths, layer.activation)
    q, k, v = _split_heads(u, layer)
    if kernels is not None:
        order_and_forks, scratch = walk if walk is not None else tree_walk(tree, layer)
        o = triton_runtime.run(kernels.tree_gated_delta_rule, q, k, v, g, beta, tree.parents, tree.depths,
                               recurrent_state[0], order_and_forks, tree.depth_limit, scratch)
    if o is None:
        o = tree_gated_delta_rule(q, k, v, g, beta, tree.parents, tree.depths, recurrent_state[0])
    core = layer.norm(o.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    out = layer.out_proj(core.reshape(1, N, -1))
    return out, TreeLayerRecord(layer, mixed, u, g, beta)
