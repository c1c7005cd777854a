"""The bank's hit rate on a routing trace, from the reference planner on the CPU (no GPU), so a
user can size the bank before loading anything (`python -m cupool simulate`).

Shape legend (ARCHITECTURE.md): S steps · L layers · T tokens a step · K top-k · E experts ·
N rows per layer.
"""

from __future__ import annotations

import heapq

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


def _check(trace: Trace, rows_per_layer, warmup_steps) -> None:
    """ValueError unless top_k ≤ rows_per_layer ≤ E and 0 ≤ warmup_steps < the trace's steps."""
    K = trace.ids.shape[-1]
    if isinstance(rows_per_layer, bool) or not isinstance(rows_per_layer, (int, np.integer)) \
            or not K <= rows_per_layer <= trace.num_experts:
        raise ValueError(f"rows_per_layer must be an int in [top_k={K}, E={trace.num_experts}], "
                         f"got {rows_per_layer!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)) \
            or not 0 <= warmup_steps < trace.steps:
        raise ValueError(f"warmup_steps must be an int in [0, steps={trace.steps}), got "
                         f"{warmup_steps!r}: the hit rate needs at least one step after warm-up")


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
    _check(trace, rows_per_layer, warmup_steps)
    L, K = trace.num_layers, trace.ids.shape[-1]
    W = trace.ids.shape[2] * K
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


def simulate_opt(trace: Trace, rows_per_layer: int, *, warmup_steps: int = 0) -> dict:
    """The hit rate of the offline optimum on `trace`: Belady's rule, a miss evicting the row
    whose key is next needed furthest ahead (never one the same layer call needs), on a bank of
    L·N rows shared by the layers that starts as a pool's does (layer l's experts 0 … N − 1).
    It knows the trace's future, so no eviction policy without prefetch can beat it: the ceiling
    of what a better policy could give. Counted as `simulate` counts (each distinct expert of a
    layer call once, the steps after `warmup_steps`); staging and promotion caps play no part.
    Returns {"hit_rate", "hits", "misses"}."""
    _check(trace, rows_per_layer, warmup_steps)
    L, E, N = trace.num_layers, trace.num_experts, int(rows_per_layer)
    calls = [(s, sorted({layer * E + int(e) for e in trace.ids[s, layer].reshape(-1) if e >= 0}))
             for s in range(trace.steps) for layer in range(L)]
    never = len(calls)
    nxt: list[dict] = [{} for _ in calls]          # per call: each key's next call after it
    seen: dict[int, int] = {}
    for i in range(len(calls) - 1, -1, -1):
        for k in calls[i][1]:
            nxt[i][k] = seen.get(k, never)
            seen[k] = i
    held = {layer * E + e for layer in range(L) for e in range(min(N, E))}
    due = {k: seen.get(k, never) for k in held}      # each held key's next call
    heap = [(-c, k) for k, c in due.items()]       # furthest first; stale entries skipped
    heapq.heapify(heap)
    hits = misses = 0
    for i, (s, keys) in enumerate(calls):
        for k in keys:
            counted = s >= warmup_steps
            if k in held:
                hits += counted
            else:
                misses += counted
                if len(held) >= L * N and not _evict(heap, held, due, keys):
                    continue                            # every row is this call's: staged
                held.add(k)
            due[k] = nxt[i][k]
            heapq.heappush(heap, (-due[k], k))
    return {"hit_rate": hits / max(1, hits + misses), "hits": hits, "misses": misses}


def _evict(heap: list, held: set, due: dict, keys) -> bool:
    """Drop from `held` the key needed furthest ahead that `keys` (the call's) do not hold;
    False if there is none. `heap` holds (−next call, key), stale entries skipped."""
    kept, found = [], False
    while heap:
        c, v = heapq.heappop(heap)
        if v not in held or due[v] != -c:
            continue                                    # stale
        if v in keys:
            kept.append((c, v))                         # needed by this call
            continue
        held.discard(v)
        found = True
        break
    for entry in kept:
        heapq.heappush(heap, entry)
    return found
