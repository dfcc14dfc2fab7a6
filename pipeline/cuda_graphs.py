"""One CUDA-graph helper for every fixed-shape step the project replays: regen's static decode step
(pipeline/regen/static_decode.py) and eval's round (verify forward, tree build, walk, drafter forward).

`CudaGraphFn(fn, name)` captures `fn` once, replays it on later calls, and checks its first replay against an
eager call of `fn` (`check`): a failed capture or check logs a warning and `fn` runs eagerly from then on, so a
graph is never silently wrong. `host_syncs(run)` counts the host syncs of a call, the other half of "a round
costs one read": what benchmarks report and CUDA tests bound. `GRAPH_LOG` and `compile_totals()` count what this
process captured and torch.compile'd so far: a stage records the difference over a unit or a logging window, so a
slow one says whether it was compiling or capturing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from pipeline.log import get_logger

log = get_logger("cuda_graphs")


def rounding_tolerance(dtype: torch.dtype) -> float:
    """Largest relative L2 error between two computations of one forward (a replay and an eager run, or a fused
    forward and HF's) that is still rounding: fp32 sums in another order; bf16/fp16 round each kernel differently
    through every layer, a few percent over a deep model (docs/benchmarks.md, "eval"). A wrong graph gives ~1, so
    0.1 keeps the two apart."""
    return 1e-4 if dtype == torch.float32 else 0.1


def relative_error(got: Tensor, ref: Tensor) -> float:
    """||got - ref|| / ||ref|| in fp32 (0 when equal; ~1 for unrelated tensors, e.g. a graph that replays stale
    inputs)."""
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@dataclass
class GraphLog:
    """What this process's CUDA graphs did, for benchmarks, tests and the eval stage's warm-up check."""

    captured: int = 0  # first calls that captured a graph and passed its check
    fallbacks: list[str] = field(default_factory=list)  # names of graphs that run eagerly (capture or check failed)
    copied_bytes: int = 0  # bytes replays copied into captured input buffers (inputs that were not those buffers)


GRAPH_LOG = GraphLog()


def compile_totals() -> tuple[int, float]:
    """(frames, seconds): what torch.compile has compiled in this process so far, recompilations included, and the
    time it took (dynamo's own timing of each frame's compile)."""
    from torch._dynamo.utils import compilation_time_metrics

    times = compilation_time_metrics.get("_compile.compile_inner", [])
    return len(times), float(sum(times))


def _same_buffer(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class CudaGraphFn:
    """`fn(*args)` (args/outputs: tensors, or tuples/dicts of them, or constants) captured once as a CUDA graph.

    The first call warms up, captures with the given tensors as the graph's input buffers (kept by reference) and
    replays. Later calls copy each input into its captured buffer unless it IS that buffer (graph outputs chained
    into the next graph cost nothing), replay, and return the captured outputs (overwritten by the next replay).
    Pass only tensors the caller no longer needs, or this graph's/other graphs' static buffers.
    The first replay is checked against an eager call on the same inputs (`check(graph_out, eager_out)`; exact
    equality by default); a failed check or capture logs a warning and `fn` runs eagerly from then on. If fn also
    changes other tensors in place (`state`), those are restored between the first call's runs.
    Host values inside `fn` (shapes, budgets) are frozen at capture: key one instance per static configuration.
    """

    def __init__(self, fn, name: str, check=None, state=None):
        self.fn, self.name = fn, name
        self.check = check or (lambda g, e: all(torch.equal(a, b) for a, b in zip(_leaves(g), _leaves(e))))
        self.state = state or (lambda: [])  # () -> tensors fn changes in place besides its outputs
        self.graph = None
        self.disabled = False
        self.copied_bytes = 0  # by replays, into the captured input buffers

    def __call__(self, *args):
        if self.disabled:
            return self.fn(*args)
        if self.graph is None:
            return self._first_call(args)
        for buf, x in zip(self.buffers, _leaves(args) if self.nested else [a for a in args if a is not None]):
            if buf is not x and not _same_buffer(buf, x):
                buf.copy_(x)
                nbytes = x.numel() * x.element_size()
                self.copied_bytes += nbytes
                GRAPH_LOG.copied_bytes += nbytes
        self.graph.replay()
        return self.out

    def _first_call(self, args):
        """Warm up, capture, replay, and check the replay against an eager run. fn runs four times here (two
        warm-ups, the replay, the eager check): the `state` tensors are put back before each run after the first,
        so the call leaves them as one run of fn does."""
        saved = [t.clone() for t in self.state()]

        def restore():
            for t, s in zip(self.state(), saved):
                t.copy_(s)

        try:
            self._capture(args, restore)
        except Exception as exc:  # e.g. a host sync inside fn
            log.warning("CUDA-graph capture of %s failed (%s): running eagerly", self.name, exc)
            self.disabled = True
            GRAPH_LOG.fallbacks.append(self.name)
            restore()
            return self.fn(*args)
        restore()
        self.graph.replay()
        replayed = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, self.out)
        restore()
        eager = self.fn(*self.args)  # (fn may write into the same buffers the graph does: compare a copy)
        if not self.check(replayed, eager):
            log.warning("CUDA-graph %s differs from eager: running eagerly from now on", self.name)
            self.disabled = True
            GRAPH_LOG.fallbacks.append(self.name)
            return eager
        GRAPH_LOG.captured += 1
        return self.out

    def _capture(self, args, restore) -> None:
        self.args = args
        self.buffers = _leaves(args)  # the graph's input tensors, flattened once
        self.nested = not all(a is None or isinstance(a, Tensor) for a in args)  # flat args skip the pytree walk
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(2):  # warm-up outside the graph (allocator, cuBLAS handles, lazy caches)
                if i:
                    restore()
                self.fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.fn(*args)
        self.graph = graph


def _leaves(tree) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


# torch warns once per process, on the first set_sync_debug_mode call, that the mode is a prototype: that notice
# names "synchronizing operations" but is no sync (it made the first budget a benchmark timed read 2 syncs).
_SYNC_DEBUG_NOTICE = "synchronization debug mode is a prototype feature"


def sync_reports(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    """The warnings among `caught` that report a host sync under torch.cuda.set_sync_debug_mode("warn") (every
    stream or device synchronize and every implicit one: .item(), a copy to pageable memory, ...), without torch's
    one-time prototype notice."""
    out = []
    for w in caught:
        text = str(w.message).lower()
        if "synchroniz" in text and not text.startswith(_SYNC_DEBUG_NOTICE):
            out.append(w)
    return out


def host_syncs(run) -> tuple[list[str], object]:
    """(one "message @ file:line" per host sync torch reports while `run()` runs, run's result); CUDA only."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.message} @ {w.filename}:{w.lineno}" for w in sync_reports(caught)], result
