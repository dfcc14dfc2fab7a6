"""Which target cache a decode gets: one object per (target, taps, impl), reused across decode calls (its buffers
and CUDA graphs persist). The interface is eval/engine/cache/interface.py; the implementations are eval/engine/cache/kv.py
(attention-only targets) and eval/engine/cache/hybrid.py (Gated-DeltaNet hybrids)."""

from __future__ import annotations

import weakref
from typing import Sequence

from eval.engine.cache.kv import KVTargetCache
from eval.engine.cache.hybrid import HybridTargetCache, PathBatchedTargetCache
from eval.engine.cache.interface import TargetCache, recurrent_layer_types

_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
IMPLS = ("auto", "dynamic", "static", "fused", "graphs", "paths")


def target_cache(target, tap_ids: Sequence[int] = (), impl: str = "auto") -> TargetCache:
    """The target's cache object. impl: 'dynamic' (reference, HF forward), 'static' (HF forward on the static
    buffer), 'fused' (static + eval.engine.target_forward, eager), 'graphs' (fused with compiled pointwise ops where the
    target allows, else HF's forward, + CUDA graphs; CUDA only), or 'auto' (graphs on CUDA, dynamic on CPU).
    Hybrid targets get `HybridTargetCache` for every impl but 'paths' (the path-batched reference, hybrids only):
    dynamic for 'dynamic' and for 'auto' on a CPU, static K/V for 'static' and 'fused', static + CUDA graphs for
    'graphs' and for 'auto' on CUDA."""
    if impl not in IMPLS:
        raise ValueError(f"cache impl must be one of {IMPLS}, got {impl!r}")
    device = target.get_input_embeddings().weight.device
    recurrent = bool(recurrent_layer_types(target.config))
    if impl == "paths" and not recurrent:
        raise ValueError("cache impl 'paths' (path-batched tree verify) is for hybrid targets only")
    if impl == "auto":  # on CUDA the graphed verify: HF's eager forward is launch-bound there (docs/benchmarks.md)
        impl = "graphs" if device.type == "cuda" else "dynamic"
    if recurrent and impl == "fused":  # no fused forward for hybrids: HF's forward on the static cache
        impl = "static"
    key = (("hybrid-" + impl) if recurrent else impl, tuple(tap_ids))
    per_target = _CACHES.setdefault(target, {})
    if key not in per_target:
        if recurrent and impl == "paths":
            per_target[key] = PathBatchedTargetCache(target, tap_ids)
        elif recurrent:
            per_target[key] = HybridTargetCache(target, tap_ids, static=impl in ("static", "graphs"),
                                                graphs=impl == "graphs")
        else:
            per_target[key] = KVTargetCache(target, tap_ids, static=impl in ("static", "fused", "graphs"),
                                            graphs=impl == "graphs", fused=impl in ("fused", "graphs"))
    return per_target[key]
