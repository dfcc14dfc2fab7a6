"""ONE decode loop for autoregressive, DFlash-chain and DDTree decoding (batch 1) against an HF target.

Every method is the same round on a different tree (eval/engine/tree.py layout; root = the bonus token):

    prefill   target on the prompt -> first bonus token (the first new token) and the prompt's tap features
    round     draft       the drafter's forward (eval/engine/draft_forward.py): context K/V of the rows the last round
                          committed + the block [bonus, MASK...] -> logits [L, V]  (L = B-1; skipped for AR)
              tree_build  AR: root only | chain: argmax of each row | DDTree: best-first top-`budget` prefixes;
                          then verify positions (start + depth) and the 4-D ancestor mask
              verify      one target forward over the 1+n tree rows (logits + taps)
              walk_commit target choice per row (argmax / one sample per row), device walk, ONE host read
                          (the round record, eval/engine/round_record.py), KV compaction to the accepted path, the
                          drafter's next context = target features gathered at the L+1 path nodes
    emits     accepted drafted tokens + the new bonus; tau = 1 + accepted (AR: 1)

Lossless: at T = 0 the output equals AR greedy decoding token for token; at T > 0 each row is sampled from
softmax(logits / T) with one uniform per row position (drawn for a fixed maximum row count per round from a
seeded generator, so the stream does not depend on the tree's shape) and the same walk rule applies.
The prefill (target and drafter) is timed separately and excluded from `timings["decode"]`. On the GPU every
step of a round (drafter, tree build, verify, walk) replays a CUDA graph per shape bucket; `warm_up` captures them
all before timing.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from eval.engine import walk_triton
from pipeline import triton_runtime
from eval.engine.cache.factory import target_cache
from eval.engine.draft_forward import draft_forward
from eval.engine.round_record import RoundRecord, parse_record, record_size
from eval.engine.cache.interface import TargetCache, TreeUnsupportedError, VerifyInputs, tree_unsupported_reason
from eval.engine.tree import Tree, build_tree, build_tree_heap, chain_tree, root_tree, tree_size
from eval.engine.verify import ancestor_table
from eval.engine.walk import Walk, target_choices, walk_tree
from pipeline.cuda_graphs import CudaGraphFn

METHODS = ("ar", "chain", "ddtree")
BUILDERS = {"device": build_tree, "heap": build_tree_heap}
PHASES = ("draft", "tree_build", "verify", "walk_commit")


@dataclass
class DecodeResult:
    """One decoded response (the unit `eval/stage.py` aggregates into τ, acceptance and speed)."""

    method: str
    budget: int | None
    temperature: float
    prompt_len: int
    output_ids: list[int]  # new tokens only; includes the stop token that ended decoding; <= max_new_tokens
    num_new_tokens: int
    num_rounds: int  # verify rounds after the prefill
    accept_lengths: list[int]  # tau per round = 1 + accepted drafted tokens (AR: 1)
    accepted_drafts: list[int]  # tau - 1 per round
    draft_depths: list[int]  # deepest drafted depth offered per round (AR 0, chain B-1, DDTree the tree's depth)
    tree_sizes: list[int]  # drafted nodes verified per round (root excluded)
    timings: dict[str, float] = field(default_factory=dict)  # prefill, decode; + PHASES with phase timing
    stop_reason: str = "max_new_tokens"  # or "stop_token"
    verify_path: str = ""  # eval.engine.cache.interface TargetCache.describe(): the verify forward these timings come from
    draft_path: str = ""  # eval.engine.draft_forward DraftForward.describe(): the drafter's forward ('' for AR)


class _Clock:
    """Phase timer; on CUDA each boundary synchronizes so the time lands in the phase that spent it."""

    def __init__(self, device: torch.device, phases: bool):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.phases = phases
        self.totals = {p: 0.0 for p in PHASES}
        self._t = 0.0

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def start(self) -> None:
        if self.phases:
            self._t = self.now()

    def lap(self, phase: str) -> None:
        if self.phases:
            t = self.now()
            self.totals[phase] += t - self._t
            self._t = t


def _prompt_tensor(prompt_ids, device) -> Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(device)
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty")
    return ids


def decode(method: str, target, drafter, prompt_ids: Sequence[int] | Tensor, *, max_new_tokens: int,
           budget: int | None = None, temperature: float = 0.0, seed: int = 0, stop_token_ids: Sequence[int] = (),
           tree_builder: str = "device", cache_impl: str = "auto", phase_timing: bool = True) -> DecodeResult:
    """Decode one response with `method` ('ar' | 'chain' | 'ddtree'); see the module docstring.

    target: HF causal LM (sdpa/eager attention for 'ddtree'). drafter: dflash_model.model.DFlashDrafter with the target
    head attached, run by eval.engine.draft_forward (or an object implementing DraftForward's calls); unused for 'ar'.
    budget: DDTree node budget. tree_builder: 'device' (default) or 'heap' (the
    CPU reference, identical trees). cache_impl: eval.engine.cache.factory.target_cache impl ('auto': CUDA graphs on GPU,
    dynamic KV on CPU). phase_timing: synchronize at phase boundaries to fill the per-phase timings.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    if method == "ddtree":
        if budget is None or int(budget) < 1:
            raise ValueError(f"method 'ddtree' needs budget >= 1, got {budget}")
        reason = tree_unsupported_reason(target.config)
        if reason:
            raise TreeUnsupportedError(reason)
        if tree_builder not in BUILDERS:
            raise ValueError(f"tree_builder must be one of {sorted(BUILDERS)}, got {tree_builder!r}")
    with torch.no_grad():
        return _decode(method, target, drafter, prompt_ids, max_new_tokens, budget if method == "ddtree" else None,
                       float(temperature), seed, set(int(t) for t in stop_token_ids), tree_builder, cache_impl,
                       phase_timing)


def _capacity(length: int, rows_max: int, L: int) -> int:
    """Rows a decode up to `length` committed rows may ever hold: its last verify (rows_max rows) and the L+1
    rows a compaction writes past the committed ones, + 1."""
    return length + max(rows_max, L + 1) + 1


def drafted_nodes(method: str, budget: int | None, L: int, vocab: int) -> int:
    """Drafted nodes a round verifies (fixed per method and budget): AR 0, chain L, DDTree its tree size."""
    return {"ar": 0, "chain": L, "ddtree": tree_size(budget or 0, L, vocab)}[method]


@dataclass
class _Decoder:
    """What a decode of one (method, target, drafter, settings) uses: the target cache, the drafter's forward and
    the round's device ops (each reused across decode calls, with their buffers and CUDA graphs)."""

    method: str
    budget: int | None
    tree_builder: str
    temperature: float
    cache: TargetCache
    draft: object  # eval.engine.draft_forward.DraftForward (or a drafter implementing its calls); None for AR
    L: int  # drafted depth limit: B-1 (0 for AR)
    vocab: int
    device: torch.device

    @classmethod
    def of(cls, method, target, drafter, budget, tree_builder, cache_impl, temperature) -> "_Decoder":
        L = 0 if method == "ar" else drafter.args.block_size - 1
        taps = () if method == "ar" else tuple(drafter.args.target_layer_ids)
        cache = target_cache(target, taps, cache_impl)
        draft = None if method == "ar" else draft_forward(drafter, graphs=cache.graphs)
        return cls(method, budget, tree_builder, temperature, cache, draft, L,
                   target.get_output_embeddings().weight.shape[0], target.get_input_embeddings().weight.device)

    @property
    def rows_max(self) -> int:
        """Verify rows of a round: the root + the drafted nodes."""
        return 1 + drafted_nodes(self.method, self.budget, self.L, self.vocab)

    def reset(self, length: int) -> "RoundOps":
        """Empty caches with room for `length` committed rows (buffers only grow: graphs survive); returns the
        round ops for the cache's buffers as they now are (fetched after a reset, which may reallocate them)."""
        capacity = _capacity(length, self.rows_max, self.L)
        self.cache.reset(capacity)
        if self.draft is not None:
            self.draft.reset(capacity)
        return round_ops(self.method, self.budget, self.tree_builder, self.cache, self.temperature, self.L,
                         self.vocab, self.device)


def _decode(method, target, drafter, prompt_ids, max_new_tokens, budget, temperature, seed, stop, tree_builder,
            cache_impl, phase_timing) -> DecodeResult:
    device = target.get_input_embeddings().weight.device
    prompt = _prompt_tensor(prompt_ids, device)
    dec = _Decoder.of(method, target, drafter, budget, tree_builder, cache_impl, temperature)
    cache, draft, rows_max = dec.cache, dec.draft, dec.rows_max
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None

    def uniforms() -> Tensor | None:  # one uniform per row position, fixed count per round
        return None if generator is None else torch.rand(rows_max, generator=generator, device=device)

    clock = _Clock(device, phase_timing)
    t0 = clock.now()
    ops = dec.reset(prompt.numel() + max_new_tokens)
    out = cache.prefill(prompt)
    bonus_dev = target_choices(out.logits[-1:], temperature, uniforms())  # [1]
    bonus = int(bonus_dev)
    if draft is not None:
        draft.prefill(out.features)
    new_rows = None  # target features of the rows the last round committed (the drafter's new context)
    t1 = clock.now()

    output: list[int] = []
    result = DecodeResult(method, budget, temperature, prompt.numel(), output, 0, 0, [], [], [], [])

    def emit(tokens: list[int]) -> bool:
        """Append new tokens; True when decoding must stop (stop token or max_new_tokens)."""
        for t in tokens:
            output.append(t)
            if t in stop:
                result.stop_reason = "stop_token"
                return True
            if len(output) >= max_new_tokens:
                return True
        return False

    done = emit([bonus])
    while not done:
        clock.start()
        draft_logits = None if draft is None else draft(new_rows, bonus_dev, cache.length)
        clock.lap("draft")
        tree, vin, ancestors = ops.build(draft_logits, bonus_dev)
        clock.lap("tree_build")
        out = cache.verify(tree, vin)
        clock.lap("verify")
        walk, record, path_features = ops.walk(tree, ancestors, out.logits, uniforms(), out.features)
        record = ops.read(record)  # the round's one host sync
        accepted, bonus = record.accepted, record.bonus
        if ops.compacts:  # the walk already moved the path's K/V rows to the front, advanced the device length
            cache.commit_compacted(accepted + 1)  # and gathered the path's features
            new_rows = path_features
        else:
            cache.commit(walk.path, accepted + 1, contiguous=record.contiguous)
            if out.features is not None:
                new_rows = out.features.index_select(0, walk.path)
        bonus_dev = walk.bonus
        result.accept_lengths.append(accepted + 1)
        result.accepted_drafts.append(accepted)
        result.draft_depths.append(record.depth)
        result.tree_sizes.append(tree.num_nodes)
        done = emit(record.accepted_tokens + [bonus])
        clock.lap("walk_commit")
    t2 = clock.now()

    result.num_new_tokens = len(output)
    result.num_rounds = len(result.accept_lengths)
    result.timings = {"prefill": t1 - t0, "decode": t2 - t1, **(clock.totals if phase_timing else {})}
    result.verify_path = cache.describe()
    result.draft_path = "" if draft is None else draft.describe()
    return result


def warm_up(method: str, target, drafter, *, max_length: int, budget: int | None = None, temperature: float = 0.0,
            tree_builder: str = "device", cache_impl: str = "auto") -> int:
    """Capture, before anything is timed, every CUDA graph that decoding up to `max_length` committed rows (the
    longest prompt + max_new_tokens) can use, so that timed decoding runs at steady state: the buffers are sized
    for max_length once (they only grow, so no later decode reallocates them and drops graphs), then with CUDA
    graphs one single-round decode runs at every context length where the target's verify or the drafter's step
    enters a new key bucket (`TargetCache.bucket_lengths`, `DraftForward.bucket_lengths`).
    Returns the number of decodes run (0 without CUDA graphs)."""
    budget = budget if method == "ddtree" else None
    dec = _Decoder.of(method, target, drafter, budget, tree_builder, cache_impl, temperature)
    dec.reset(max_length + 2)  # room for the warm-up decodes below (2 tokens past their prompt)
    if not dec.cache.graphs:
        return 0
    lengths = set(dec.cache.bucket_lengths(dec.rows_max, max_length))
    if dec.draft is not None:
        lengths |= set(dec.draft.bucket_lengths(max_length))
    for length in sorted(lengths):  # `length` committed rows, the bonus, then exactly one round
        decode(method, target, drafter, [0] * length, max_new_tokens=2, budget=budget, temperature=temperature,
               tree_builder=tree_builder, cache_impl=cache_impl, phase_timing=False)
    return len(lengths)


# ----------------------------------------------------------------------------------------------
# The round's device work around the verify forward (plain calls, or CUDA graphs on the static cache)
# ----------------------------------------------------------------------------------------------


WALK_GRAPHS = 64  # walk graphs per round configuration: one per verify graph (key bucket) whose outputs it reads


class RoundOps:
    """build(draft logits, bonus) -> (tree, verify inputs), walk(tree, logits, uniforms) -> (walk, record) and
    read(record) -> the record on the host (eval/engine/round_record.py).

    With a graph-enabled static cache both run as CUDA graphs keyed by the round's static shape (so a round
    launches: drafter, build graph, verify graph, walk graph (which also copies the record into pinned host
    memory), then waits once for the stream). Tree fields that are host
    values (num_nodes, depth_limit, kind) are fixed per method/budget and restored around the graphs.
    """

    def __init__(self, method, budget, builder, cache, temperature, L, vocab, device):
        self.method, self.budget, self.cache, self.temperature = method, budget, cache, temperature
        self.builder, self.device = builder, device
        self.num_nodes = drafted_nodes(method, budget, L, vocab)
        self.depth_limit = 0 if method == "ar" else L
        self.kind = {"ar": "root", "chain": "chain", "ddtree": "tree"}[method]
        graphs = cache.graphs
        # a cache that commits on the device: the walk also compacts (all L+1 path rows, a fixed shape) and gathers
        # the path's features, so the round's device work after the verify is one graph
        self.compacts = cache.device_commit
        # the walk's record also lands in pinned host memory inside its graph: the read is then a stream sync
        self._host = torch.empty(record_size(self.depth_limit), dtype=torch.long, pin_memory=True) \
            if device.type == "cuda" else None
        capturable_build = not (method == "ddtree" and builder is build_tree_heap)  # the heap reads the host
        self._build = CudaGraphFn(self._build_eager, f"{method} tree build") if graphs and capturable_build \
            else self._build_eager
        self._walk_state = (lambda: cache.compaction_state(self.depth_limit + 1)) if self.compacts else None
        self._walks: dict[tuple, CudaGraphFn] | None = {} if graphs else None  # producer buffers -> walk graph

    def _tree(self, tokens, parents, depths) -> Tree:
        return Tree(tokens, parents, depths, self.num_nodes, self.depth_limit, self.kind)

    def _build_eager(self, draft_logits, bonus):
        if self.method == "ar":
            tree = root_tree(bonus, self.device)
        elif self.method == "chain":
            tree = chain_tree(draft_logits, bonus)
        else:
            tree = self.builder(draft_logits, self.budget, bonus)
        ancestors = ancestor_table(tree.parents, tree.depth_limit)  # shared by the mask and the walk
        vin = self.cache.verify_inputs(tree, ancestors)
        return (tree.tokens, tree.parents, tree.depths, ancestors), (vin.positions, vin.mask, vin.visibility)

    def build(self, draft_logits, bonus):
        """-> (tree, verify inputs, ancestor table)."""
        (tokens, parents, depths, ancestors), (positions, mask, vis) = self._build(draft_logits, bonus.reshape(1))
        return self._tree(tokens, parents, depths), VerifyInputs(positions, mask, vis), ancestors

    def _walk_eager(self, tokens, parents, depths, ancestors, logits, uniforms, features):
        walked = None
        if self.temperature <= 0 and triton_runtime.available(self.device):  # the same walk in three launches
            walked = triton_runtime.run(walk_triton.greedy_walk, tokens, parents, depths, ancestors, logits,
                                        self.depth_limit)
        if walked is not None:
            accepted, path, bonus, last, record = walked
        else:
            tree = self._tree(tokens, parents, depths)
            walk = walk_tree(tree, target_choices(logits, self.temperature, uniforms), ancestors)
            accepted, path, bonus, last, record = walk.accepted, walk.path, walk.bonus, walk.last, \
                walk.host_record(tree)
        if self._host is not None:
            self._host.copy_(record, non_blocking=True)
        path_features = None
        if self.compacts:
            self.cache.compact_path(path, accepted)
            if features is not None:
                path_features = features.index_select(0, path)
        return (accepted, path, bonus, last), record, path_features

    def walk(self, tree, ancestors, logits, uniforms, features=None):
        """-> (walk, the round record on the device, features of the L+1 path rows or None). With `compacts` the K/V
        rows of the path are also moved to the front and the cache's device length advanced (the caller then
        calls `commit_compacted`)."""
        (accepted, path, bonus, last), record, path_features = self._walk_fn(logits, features)(
            tree.tokens, tree.parents, tree.depths, ancestors, logits, uniforms, features)
        return Walk(accepted, path, bonus, last), record, path_features

    def _walk_fn(self, logits, features):
        """The walk, as the CUDA graph captured on these very `logits` / `features` buffers. The static caches
        capture one verify graph per key bucket; the fused forward writes all of one tree size into shared buffers
        (one walk graph results), but HF's forward (hybrids) returns each graph's own: a walk graph per producer
        reads them where they are, where one shared graph would copy the verify's logits into its own buffer every
        round (N x vocab: 127 MB for a budget-256 tree of a 248K vocabulary). Inputs that are no graph's static
        buffers (an eager verify: a new tensor each round) would capture a graph per round, so past WALK_GRAPHS
        producers the first graph takes them, copying them in."""
        if self._walks is None:
            return self._walk_eager
        key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (logits, features) if t is not None)
        fn = self._walks.get(key)
        if fn is None:
            if len(self._walks) >= WALK_GRAPHS:
                return next(iter(self._walks.values()))
            fn = self._walks[key] = CudaGraphFn(self._walk_eager, f"{self.method} walk #{len(self._walks)}",
                                                state=self._walk_state)
        return fn

    def read(self, record: Tensor) -> RoundRecord:
        """The round's one host sync: the walk's record (from `walk`) on the host."""
        if self._host is None:
            return parse_record(record.tolist(), self.depth_limit)
        torch.cuda.current_stream(self.device).synchronize()
        return parse_record(self._host.tolist(), self.depth_limit)


_ROUND_OPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # cache -> (its generation, {config: ops})


def round_ops(method, budget, tree_builder, cache, temperature, L, vocab, device) -> RoundOps:
    """One RoundOps (and its CUDA graphs) per cache object and static round configuration, reused across calls;
    rebuilt when the cache reallocates its buffers (`TargetCache.generation`), which the graphs captured."""
    generation, store = _ROUND_OPS.get(cache, (None, None))
    if generation != cache.generation:
        store = {}
        _ROUND_OPS[cache] = (cache.generation, store)
    key = (method, budget, tree_builder, temperature, L, vocab)  # temperature is a constant inside the graphs
    if key not in store:
        store[key] = RoundOps(method, budget, BUILDERS[tree_builder], cache, temperature, L, vocab, device)
    return store[key]
