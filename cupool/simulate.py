"""The bank's hit rate on a routing trace, from the reference planner on the CPU (no GPU), so a
user can size the bank before loading anything (`python -m cupool simulate`).

Shape legend (ARCHITECTURE.md): S steps · L layers · T tokens a step · K top-k · E experts ·
N rows per layer.
"""

from __future__ import annotations

import numpy as np

from cupool.reference.planner import (
    HITS,
    MISSES,
    PREFETCH_COUNTERS,
    Policy,
    ReferencePlanner,
    default_promote,
)
from cupool.trace import Trace


def simulate(trace: Trace, rows_per_layer: int, *, staging_rows: int | None = None,
             warmup_steps: int = 0, policy: Policy | None = None, prefetch: bool = False,
             prefetch_rows: int = 0) -> dict:
    """Replay `trace` through the reference planner with the gate open.

    Returns the hit rate (hits / (hits + misses)) over the steps after `warmup_steps`, per layer
    too, and the rows each layer owns at the end (shows rows moving between layers). `policy`:
    the victim rule (`cupool.reference.planner.Policy`; the kernel's is LRU with a promotion
    cap); None (default): what a pool does, LRU with `default_promote(rows_per_layer, T·K)` (no
    cap for one token a step). `prefetch`: as the
    pool does in a decode step, right after layer l's step, layer l + 1's predicted ids of the
    same step are prefetched (`ReferencePlanner.prefetch`; needs `trace.predicted`), for
    l = 0 … L − 2 (layer 0 is not predicted: nothing runs before it in a step). Then the result
    also counts rows prefetched, used and wasted (`PREFETCH_COUNTERS`), and the rows still
    marked prefetched at the end ("prefetch_pending"). `prefetch_rows`: at most that many rows a
    prefetch brings in (the Prefetcher's max_rows; 0: all).
    """
    if prefetch and trace.predicted is None:
        raise ValueError("prefetch=True needs a trace with predicted ids "
                         "(cupool.trace.with_predictions)")
    L, K = trace.num_layers, trace.ids.shape[-1]
    W = trace.ids.shape[2] * K
    if isinstance(rows_per_layer, bool) or not isinstance(rows_per_layer, (int, np.integer)) \
            or not K <= rows_per_layer <= trace.num_experts:
        raise ValueError(f"rows_per_layer must be an int in [top_k={K}, E={trace.num_experts}], "
                         f"got {rows_per_layer!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)) \
            or not 0 <= warmup_steps < trace.steps:
        raise ValueError(f"warmup_steps must be an int in [0, steps={trace.steps}), got "
                         f"{warmup_steps!r}: the hit rate needs at least one step after warm-up")
    if policy is None:
        policy = Policy(promote=default_promote(int(rows_per_layer), W))
    ref = ReferencePlanner(L, trace.num_experts, rows_per_layer, staging_rows or W,
                           policy=policy)
    ref.open()
    base = np.zeros_like(ref.counters)
    pbase = np.zeros_like(ref.prefetch_counters)
    for s in range(trace.steps):
        if s == warmup_steps:
            base = ref.counters.copy()
            pbase = ref.prefetch_counters.copy()
        for layer in range(L):
            ref.step(layer, trace.ids[s, layer].reshape(-1))
            if prefetch and layer + 1 < L:        # the next layer's predicted ids, ahead of it
                ref.prefetch(layer + 1, trace.predicted[s, layer + 1].reshape(-1),
                             prefetch_rows)
    c = ref.counters - base
    pc = (ref.prefetch_counters - pbase).sum(axis=0)
    hits, misses = int(c[:, HITS].sum()), int(c[:, MISSES].sum())
    owned = np.bincount(ref.key_of[ref.key_of >= 0] // trace.num_experts, minlength=L)
    return {"hit_rate": hits / max(1, hits + misses), "hits": hits, "misses": misses,
            "per_layer_hit_rate": [float(c[l, HITS] / max(1, c[l, HITS] + c[l, MISSES]))
                                   for l in range(L)],
            "rows_owned": owned.tolist(), "policy": policy.describe(),
            **({name: int(pc[i]) for i, name in enumerate(PREFETCH_COUNTERS)} if prefetch else {}),
            **({"prefetch_pending": int(ref.prefetched.sum())} if prefetch else {})}
