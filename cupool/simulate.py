"""The bank's hit rate on a routing trace, from the reference planner on the CPU (no GPU), so a
user can size the bank before loading anything (`python -m cupool simulate`).

Shape legend (ARCHITECTURE.md): S steps · L layers · T tokens a step · K top-k · E experts ·
N rows per layer.
"""

from __future__ import annotations

import heapq

import numpy as np

from cupool.hostexperts import host_split
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


def simulate_host_split(trace: Trace, rows_per_layer: int, *, link_us: float, cpu_us: float,
                        handoff_us: float, warmup_steps: int = 0, defer: bool = False,
                        rest_us: float | None = None) -> dict:
    """A bank whose misses are split between the link and the host's CPU, replayed through the
    reference planner (the pool's LRU, uncapped: the pool's default while a step's lanes fit a
    layer's rows). A step may have several tokens (several streams, `cupool.trace.streams`); a
    row's CPU time is cpu_us whatever its tokens (at several streams most missed rows serve one),
    and "per token" below means per step.

    Per layer call with n distinct misses, `host_split` picks m of them for the CPU: the last m
    in first-use order. The call waits max((n − m) · link_us, m · cpu_us + handoff_us) for its
    misses, the link and the CPU started together after the plan step. What becomes of the m:
    - defer False: neither copied nor promoted, left out of the bank (`ReferencePlanner.
      step_host` with leave, as the kernel's host build with its `host_leave` flag); the other
      n − m are promoted as usual;
    - defer True: promoted too, their rows copied over the link behind the call (no layer waits
      for them): the planner's host step (`ReferencePlanner.step_host`, whose pending rows are
      not evicted until their copies land at the end of the token), so the bank evolves almost
      as the plain pool's; the link then carries every miss, and the estimate holds only while
      that fits the step (`link_busy_ms_per_token`).
    A cpu_us larger than any link time gives the plain pool (m = 0 always), for comparison.

    Returns the hit rate, the rows a token the calls wait for on the link and on the CPU, the
    misses' waited time a token (ms, the sum of the calls' maxima), the link's busy time a token
    (every row it carries), and how often a layer call had 0, 1, 2, ... misses
    ("miss_histogram", fractions of calls), over the steps after `warmup_steps`.

    With `rest_us` (a layer's work outside its misses, µs) also "timeline_ms_per_token": a token
    laid out in time, the link one queue. Layer by layer: rest_us of work; the call's copies
    start when the link is free (behind copies of earlier calls still crossing delay them); the
    CPU starts at once (after handoff_us); the call ends when both are done; its behind copies
    (defer) then queue on the link. The token ends when the last call has and, with defer, when
    the link has carried every behind copy (the decode step joins them at its end)."""
    _check(trace, rows_per_layer, warmup_steps)
    for name, v in (("link_us", link_us), ("cpu_us", cpu_us), ("handoff_us", handoff_us)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    L, E = trace.num_layers, trace.num_experts
    ref = ReferencePlanner(L, E, int(rows_per_layer), trace.ids.shape[-1], policy=Policy())
    ref.open()
    hits = link_rows = cpu_rows = behind = 0
    miss_us = 0.0
    hist: dict[int, int] = {}
    if rest_us is not None and not rest_us >= 0:
        raise ValueError(f"rest_us must be >= 0, got {rest_us!r}")
    W = trace.ids[0, 0].size
    split = np.array([host_split(n, link_us, cpu_us, handoff_us) for n in range(W + 1)])
    timeline_us = 0.0
    for s in range(trace.steps):
        counted = s >= warmup_steps
        t = link_free = 0.0                  # this token's clock and when the link is free
        for layer in range(L):
            ids = np.asarray(trace.ids[s, layer]).reshape(-1).astype(np.int64)
            uniq = list(dict.fromkeys(int(e) for e in ids if 0 <= e < E))
            miss = [e for e in uniq if ref.slot_of[layer * E + e] < 0]
            n = len(miss)
            m = int(split[n])
            ref.step_host(layer, ids, split, leave=not defer)
            if counted:
                hits += len(uniq) - n
                link_rows += n - m
                cpu_rows += m
                behind += m if defer else 0
                miss_us += max((n - m) * link_us, m * cpu_us + handoff_us if m else 0.0)
                hist[n] = hist.get(n, 0) + 1
            if rest_us is not None:
                t += rest_us
                waited_end = max(t, link_free) + (n - m) * link_us
                link_free = waited_end if n > m else link_free
                if defer and m:
                    link_free = max(link_free, t) + m * link_us     # behind, after the waited
                t = max(waited_end if n > m else t, t + handoff_us + m * cpu_us if m else t)
        ref.land()                       # the behind copies land by the token's end
        if counted and rest_us is not None:
            timeline_us += max(t, link_free)
    steps = trace.steps - warmup_steps
    calls = steps * L
    out = {"hit_rate": hits / max(1, hits + link_rows + cpu_rows),
           "link_rows_per_token": link_rows / steps, "cpu_rows_per_token": cpu_rows / steps,
           "miss_ms_per_token": miss_us / steps / 1e3,
           "link_busy_ms_per_token": (link_rows + behind) * link_us / steps / 1e3,
           "miss_histogram": {n: c / calls for n, c in sorted(hist.items())}}
    if rest_us is not None:
        out["timeline_ms_per_token"] = timeline_us / steps / 1e3
    return out


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
