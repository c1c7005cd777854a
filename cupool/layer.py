"""`PooledExperts`: one MoE layer's experts computed from the pool, and the `cupool::experts` op.

Shape legend (ARCHITECTURE.md): T tokens · K top-k · H hidden · W = T·K lanes.

A layer call is `(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]` on
torch's current stream. Decode (W ≤ the bank's max lanes): plan step + row copies + decode GEMM,
graph-capturable; with the pool's `overlap_copies` the copies run on a second stream while the
GEMM works on the experts already in the bank, and the copied experts follow in a second launch.
With the pool's prefetch on (`Pool.enable_prefetch`), every call first joins the prefetch in
flight, and a decode call issues the next layer's prefetch right after its plan step. With the
host's CPU on (`Pool.enable_host_experts`, a `HostDecode`), a decode call's plan step hands its
last promoted misses to the host (the planner's host step): their lanes are posted to the host's
mailbox before the link's row copies start (the two run side by side), their rows copied behind
on a side stream, the GEMM computes the other lanes, and the host's answer is added to its
output; the last pooled layer's call joins the behind copies and lands them, so a step forks
and joins its side stream within itself (graph capture needs that).
Wider calls (prefill) take the partition path (resident experts from the bank, the others from
the host store through a bounded scratch), which leaves the placement alone; a call wider than
the GEMM's `max_prefill_tokens` runs in chunks of that many tokens (exact: experts act on each
token alone). With the pool's `prefill_ahead` on (CUPOOL_PREFILL_AHEAD), a prompt's prefill
call that routes to nearly every expert copies every expert not in the bank by the copy engine,
from lists the pool works out on the host from the placement, and issues the next pooled layer's
first scratch copies before returning (`prefill_plan`).

Under `torch.compile` a pooled layer is the opaque op `cupool::experts` (dynamo cannot trace the
raw kernel launches); the rest of the model is compiled around it. Eager calls skip the
dispatcher.
"""

from __future__ import annotations

import itertools
import os
import weakref

import numpy as np
import torch

from cupool._env import parse_switch
from cupool.hostexperts import HostExperts, Mailbox, host_split, split_table
from cupool.ops.host_handoff import DTYPES as HANDOFF_DTYPES
from cupool.ops.host_handoff import post, wait


PREFILL_AHEAD_ENV = "CUPOOL_PREFILL_AHEAD"
# a call takes the ALL_HOST copy lists only where its lanes cover nearly every expert anyway:
# T·K ≥ AHEAD_LANES_PER_EXPERT·E (copying an expert no lane routes to is the price)
AHEAD_LANES_PER_EXPERT = 4


def parse_prefill_ahead(text: str | None) -> bool:
    """Whether a CUPOOL_PREFILL_AHEAD value (None: unset) turns prefill ahead on: "1" or unset
    yes, "0" no; anything else raises ValueError naming the variable."""
    return parse_switch(PREFILL_AHEAD_ENV, text, True, "prompt prefill copies by the copy "
                        "engine, the next layer's issued at the end of each call")


def prefill_ahead_default() -> bool:
    """`Pool.prefill_ahead`'s default: the environment's CUPOOL_PREFILL_AHEAD (on if unset)."""
    return parse_prefill_ahead(os.environ.get(PREFILL_AHEAD_ENV))


def prefill_plan(pool, layer: int, tokens: int) -> tuple[bool, int | None]:
    """(host lists, next layer or None) of pooled layer `layer`'s prefill call of `tokens`
    tokens.

    Host lists (the GEMM copies every expert not in the bank, routed or not, by the copy engine
    from `Pool.scratch_lists`: they follow from the placement alone) while the pool's
    `prefill_ahead` is on, the pool is
    prefilling a prompt (`Pool.prefilling`: placement does not move, every call takes this
    path), the call is one GEMM call (tokens ≤ max_prefill_tokens) and its lanes cover nearly
    every expert (T·K ≥ 4·E). The next layer (layer + 1, the pool's next pooled layer; none
    after the last) is the one whose first scratch copies the call issues at its end."""
    if not (pool.prefill_ahead and pool.prefill_only) or tokens > pool.gemm.max_prefill_tokens \
            or tokens * pool.top_k < AHEAD_LANES_PER_EXPERT * pool.num_experts:
        return False, None
    return True, (layer + 1 if layer + 1 < pool.num_layers else None)


def check_prefill_settings(prefill_tokens, costs, widest: int, link_us=None) -> None:
    """ValueError naming the setting for a `prefill_tokens` that is not an int in [0, widest]
    (the GEMM's max_prefill_tokens), `costs` that are not None or `check_prefill_costs`', or a
    `link_us` (prefill_link_us) that is not None or a finite number > 0."""
    if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, (int, np.integer)) \
            or not 0 <= prefill_tokens <= widest:
        raise ValueError(f"prefill_tokens must be an int in [0, {widest}] (the GEMM's "
                         f"max_prefill_tokens), got {prefill_tokens!r}")
    if costs is not None:
        check_prefill_costs(costs)
    if link_us is not None and (isinstance(link_us, bool) or not isinstance(
            link_us, (int, float, np.floating)) or not 0 < link_us < float("inf")):
        raise ValueError(f"prefill_link_us must be a finite number > 0, got {link_us!r}")


def check_prefill_costs(costs) -> list[tuple[int, float, float]]:
    """`HostDecode`'s prefill_costs as given: one or two (tokens, µs a row, µs a call) with
    tokens ascending ints >= 1, a row's µs > 0 and a call's >= 0, all finite; else ValueError
    naming what is wrong."""
    try:
        out = [(int(t), float(r), float(c)) for t, r, c in costs]
        ok = all(t == t0 and t0 >= 1 for (t, _, _), (t0, _, _) in zip(costs, out))
    except (TypeError, ValueError):
        ok = False
    if not ok or not 1 <= len(out) <= 2 or any(
            not (np.isfinite(r) and r > 0 and np.isfinite(c) and c >= 0) for _, r, c in out) \
            or (len(out) == 2 and out[0][0] >= out[1][0]):
        raise ValueError(f"prefill_costs must be one or two (tokens >= 1, µs a row > 0, µs a "
                         f"call >= 0) with tokens ascending, got {costs!r}")
    return out


def check_host_settings(leave, cpu_call_us, min_misses) -> None:
    """ValueError naming the setting for a `leave` that is not a bool, a `cpu_call_us` that is
    not None or a finite number >= 0, or a `min_misses` that is not None or an int >= 0."""
    if not isinstance(leave, bool):
        raise ValueError(f"leave must be a bool, got {leave!r}")
    if cpu_call_us is not None and (isinstance(cpu_call_us, bool) or not isinstance(
            cpu_call_us, (int, float, np.floating)) or not 0 <= cpu_call_us < float("inf")):
        raise ValueError(f"cpu_call_us must be a finite number >= 0, got {cpu_call_us!r}")
    if min_misses is not None and (isinstance(min_misses, bool) or not isinstance(
            min_misses, (int, np.integer)) or min_misses < 0):
        raise ValueError(f"min_misses must be None or an int >= 0, got {min_misses!r}")


class HostDecode:
    """The host's CPU share of a pool's decode calls of `tokens` tokens: a `HostExperts` serving a
    pinned `Mailbox`, the hand-off's error word, the behind copies' stream, and the split table
    the bank's host steps read (`Pool.enable_host_experts` builds it).

    link_us / cpu_us: a row's time on the link (the row-copy kernel) and on the host's CPU;
    cpu_call_us: a host call's own time besides its rows; None measures them here
    (`measure_link_us`, `measure_cpu_us`: both CPU figures; cpu_call_us is 0 where cpu_us is
    given alone). handoff_us: a call's fixed cost of the hand-off. `split`: the table they give
    (`cupool.hostexperts.split_table`, the call's own time added to the hand-off's; nothing
    handed over in calls of fewer than `min_misses` misses; None: top_k + 1, so that one
    token's calls never hand anything over). `hands_over(n)` says whether a call of n active
    tokens can hand anything over; the Engine runs steps that cannot as plain steps.
    leave: the host's misses are left out of the bank (no row, nothing copied behind) instead of
    promoted and copied behind the call (`Bank.set_split`).

    prefill_tokens: 0, or the widest prompt prefill call (at most the GEMM's max_prefill_tokens)
    whose experts without a bank row the host shares with the link: the call's last experts in
    scratch order are computed on the host (`prefill_share`, `Pool.host_prefill_experts`), their
    lanes posted to the same mailbox (sized for the wider of the two calls), the others copied
    and computed as without the host. Its CPU figures, `prefill_costs` ((tokens, µs a row, µs a
    call besides its rows) of one or two widths, ascending), are measured at that width and at a
    quarter of it unless given (`measure_cpu_prefill_us`; `prefill_us`); its link figure,
    `prefill_link_us`, a row's time in the copy engine's scratch copies that such a call makes,
    unless given (`measure_prefill_link_us`; 0 with host prefill off)."""

    def __init__(self, pool, tokens: int, *, threads: int | None = None,
                 link_us: float | None = None, cpu_us: float | None = None,
                 cpu_call_us: float | None = None, handoff_us: float = 10.0,
                 spin_ms: float = 50.0, leave: bool = False, min_misses: int | None = None,
                 prefill_tokens: int = 0, prefill_costs=None,
                 prefill_link_us: float | None = None):
        bank = pool.bank
        if not bank.hosting:
            raise RuntimeError("the pool's bank has no host steps (Pool.enable_host_experts "
                               "rebuilds it with them)")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) \
                or not 1 <= tokens * pool.top_k <= bank.max_lanes:
            raise ValueError(f"tokens must be an int with 1 <= tokens · top_k ({pool.top_k}) <= "
                             f"the bank's max_lanes ({bank.max_lanes}), got {tokens!r}")
        check_host_settings(leave, cpu_call_us, min_misses)
        check_prefill_settings(prefill_tokens, prefill_costs, pool.gemm.max_prefill_tokens,
                               prefill_link_us)
        self.prefill_tokens = int(prefill_tokens)
        self.pool, self.tokens, self.leave = pool, int(tokens), leave
        self.min_misses = resolve_min_misses(pool.top_k, min_misses)
        dev, H, K = pool.device, pool.layout.hidden, pool.top_k
        self.hx = HostExperts(pool.store.host_addresses(), pool.layout, pool.gemm.activation,
                              threads=threads, spin_ms=spin_ms)
        try:
            self.link_us = float(link_us) if link_us is not None else measure_link_us(bank)
            row, call = (float(cpu_us), 0.0) if cpu_us is not None else measure_cpu_us(
                self.hx, H, pool.num_layers * pool.num_experts)
            self.cpu_us = row
            self.cpu_call_us = float(cpu_call_us) if cpu_call_us is not None else call
            self.handoff_us = float(handoff_us)
            self.split = split_table(bank.max_lanes, self.link_us, self.cpu_us,
                                     self.handoff_us + self.cpu_call_us, self.min_misses)
            handing = np.flatnonzero(self.split > 0)
            # the fewest misses a call hands anything over at (None: no call does)
            self.first_handed = int(handing[0]) if handing.size else None
            # (tokens, µs a row, µs a call besides its rows) of prefill calls on the host
            self.prefill_costs: list[tuple[int, float, float]] = []
            self._shares: dict[tuple[int, int], int] = {}
            if self.prefill_tokens and prefill_costs is not None:
                self.prefill_costs = check_prefill_costs(prefill_costs)
            elif self.prefill_tokens:
                for t in sorted({max(1, self.prefill_tokens // 4), self.prefill_tokens}):
                    self.prefill_costs.append((t, *measure_cpu_prefill_us(
                        self.hx, H, pool.num_layers * pool.num_experts, t, K,
                        pool.num_experts)))
            # a row's time on the link in a prefill call: the copy engine's, not the row-copy
            # kernel's (prefill with host experts copies its scratch by lists)
            self.prefill_link_us = 0.0
            if self.prefill_tokens:
                self.prefill_link_us = float(prefill_link_us) if prefill_link_us is not None \
                    else measure_prefill_link_us(pool.gemm, pool.store.host_addresses())
            self.mailbox = Mailbox(max(self.tokens, self.prefill_tokens), K, H, pinned=True,
                                   device=dev)
            self.error = torch.zeros(1, dtype=torch.int32, device=dev)
            self.side = torch.cuda.Stream(dev)
            bank.set_split(self.split, leave)
            self.hx.serve(self.mailbox)
        except BaseException:
            self.hx.close()
            raise

    def hands_over(self, tokens: int) -> bool:
        """Whether a decode call of `tokens` active tokens (each with top_k lanes, so at most
        tokens · top_k misses) can hand the host anything. A step whose calls cannot gains
        nothing from the hand-off and pays its launches, so the Engine runs it as a plain step
        (`Pool.plain_decode`)."""
        return self.first_handed is not None and tokens * self.pool.top_k >= self.first_handed

    def prefill_share(self, tokens: int, missing: int) -> int:
        """How many of a prefill call's `missing` experts (those without a bank row, each
        copied whole) the host computes, for a call of `tokens` tokens: the count k that makes
        the later of the link's (missing − k rows at prefill_link_us) and the host's (the hand-off, the
        call's own time and k rows at `prefill_us(tokens)`) finish soonest (`host_split`); 0
        where that is none, where host prefill is off (prefill_tokens 0) or the call is wider
        than prefill_tokens."""
        if not self.prefill_tokens or not 1 <= tokens <= self.prefill_tokens or missing < 1:
            return 0
        key = (int(tokens), int(missing))
        k = self._shares.get(key)
        if k is None:
            row, call = self.prefill_us(tokens)
            k = self._shares[key] = host_split(int(missing), self.prefill_link_us, row,
                                               self.handoff_us + call)
        return k

    def prefill_us(self, tokens: int) -> tuple[float, float]:
        """(µs a row, µs a call besides its rows) of a prefill call of `tokens` tokens on the
        host: `prefill_costs` interpolated linearly in the tokens (held past the widest, and
        past the narrowest a row at least 5% of the narrowest's); (0, 0) with host prefill off."""
        c = self.prefill_costs
        if not c:
            return 0.0, 0.0
        if len(c) == 1 or tokens >= c[-1][0]:
            return c[-1][1], c[-1][2]
        (t0, r0, k0), (t1, r1, k1) = c[0], c[-1]
        f = (tokens - t0) / (t1 - t0)
        return max(r0 + f * (r1 - r0), 0.05 * r0), max(k0 + f * (k1 - k0), 0.0)

    def errors(self) -> list[str]:
        """The hand-off's sticky error (a wait that gave up, about a second without an answer).
        A host read."""
        out = []
        if int(self.error.item()):
            out.append("host: a call gave up waiting for the host's answer")
        return out

    def close(self) -> None:
        """Land what is in flight, stop serving and free the host pool and the mailbox (the
        bank's plain steps hand nothing over)."""
        torch.cuda.current_stream(self.pool.device).wait_stream(self.side)
        self.pool.bank.land()
        try:
            self.hx.stop_serving()
        finally:
            self.hx.close()
            self.mailbox.close()


def measure_link_us(bank, rows: int = 16, reps: int = 5) -> float:
    """µs a row on the link: the bank's row-copy kernel copying `rows` store rows into staging
    rows (free between steps), the median of `reps` timed launches after one warm-up."""
    n = min(rows, bank.max_lanes, bank.staging_rows,
            bank.store.num_experts * bank.store.num_layers)   # one step's copy list at most
    pairs = torch.tensor([[k, bank.num_rows + k] for k in range(n)], dtype=torch.int32,
                         device=bank.device)
    count = torch.tensor([n], dtype=torch.int32, device=bank.device)
    times = []
    for i in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        bank.copier(pairs, count)
        b.record()
        b.synchronize()
        if i:
            times.append(a.elapsed_time(b) * 1e3 / n)
    return float(np.median(times))


def measure_prefill_link_us(gemm, host_rows, reps: int = 5) -> float:
    """µs a row on the link in a prefill call: the copy engine's scratch copies
    (`MoEGemm.copy_engine_us`) of every other expert of layer 0 (host_rows: the store's
    `host_addresses`), each its own run, as a layer's scattered experts without a bank row
    mostly are."""
    resident = np.ones(gemm.num_experts, dtype=bool)
    resident[1::2] = False
    return gemm.copy_engine_us(gemm.scratch_lists(0, resident, host_rows), reps)


def resolve_min_misses(top_k: int, min_misses: int | None) -> int:
    """The fewest misses a decode call hands the host anything at: `min_misses`, or by default
    top_k + 1, so that one token's calls (at most top_k misses) never do."""
    return int(top_k) + 1 if min_misses is None else int(min_misses)


def _host_cost_us(call_ns, lo: int, hi: int, keys: int, reps: int,
                  rounds: int) -> tuple[float, float]:
    """(µs a row, µs a call besides its rows) from host calls through `lo` and through `hi` rows
    (`call_ns(first_key, rows)` times one, in ns), one of each in turn, `reps` of each in each of
    `rounds` rounds, their first keys spread over the `keys` keys (so not in cache from the call
    before). t_lo and t_hi are the lowest of the rounds' medians, so that a round other threads
    disturbed (the OS running something else on the pool's CPUs for a few ms) does not set the
    split for the pool's life. A row is (t_hi − t_lo) / (hi − lo), at least a twentieth of t_lo;
    the rest of t_lo is the call's own."""
    sizes = (lo, hi) if hi > lo else (lo,)
    starts = np.linspace(0, keys - sizes[-1], len(sizes) * reps * rounds).astype(np.int64)
    best = dict.fromkeys(sizes, float("inf"))
    for r in range(rounds):
        ns: dict[int, list[int]] = {m: [] for m in sizes}
        for i in range(reps):
            for j, m in enumerate(sizes):
                ns[m].append(call_ns(int(starts[(i * len(sizes) + j) * rounds + r]), m))
        for m in sizes:
            best[m] = min(best[m], float(np.median(ns[m])) / 1e3)
    t_lo = best[lo]
    row = max((best[hi] - t_lo) / (hi - lo), 0.05 * t_lo) if hi > lo else t_lo
    return row, max(t_lo - lo * row, 0.0)


def measure_cpu_prefill_us(hx: HostExperts, hidden: int, keys: int, tokens: int, top_k: int,
                           experts: int, reps: int = 5, rounds: int = 3) -> tuple[float, float]:
    """A prefill call's cost on the host's CPU, (µs a row, µs a call besides its rows), by
    `_host_cost_us`: calls of `tokens` tokens whose routed lanes go to 2 and to 10 rows, each row
    with the tokens a prefill call of that width routes to an expert (tokens · top_k / experts,
    at least 1; the other lanes -1, as the call posts them; fewer than 10 where the lanes hold
    fewer). A row's time includes quantizing its tokens' x; a call's own, waking the pool and
    writing every token's answer."""
    T, K = int(tokens), int(top_k)
    m = max(1, min(T, round(T * K / experts)))      # tokens a row
    x = torch.randn(T, hidden)
    w = torch.full((T, K), 1.0 / K)

    def call_ns(k0: int, rows: int) -> int:
        # the T·K lanes in lane-major order, row r taking m of them in a run: m ≤ T tokens,
        # each once
        flat = torch.full((K, T), -1, dtype=torch.int64)
        flat.view(-1)[:rows * m] = k0 + torch.arange(rows).repeat_interleave(m)
        return hx.timed(x, flat.t().contiguous(), w, 1)[0]

    most = min(10, int(keys), T * K // m)            # rows of m tokens the lanes hold
    return _host_cost_us(call_ns, min(2, most), most, int(keys), reps, rounds)


def measure_cpu_us(hx: HostExperts, hidden: int, keys: int, reps: int = 9,
                   rounds: int = 3) -> tuple[float, float]:
    """A decode call's cost on the host's CPU, (µs a row, µs a call besides its rows), by
    `_host_cost_us`: calls of one token through 1 row and through 8 rows. The call's own time is
    waking the pool, quantizing x and the last item's wait. A decode call's host share is split
    by both (`split_table`, the call's part added to the hand-off's)."""
    x = torch.randn(1, hidden)

    def call_ns(k0: int, rows: int) -> int:
        return hx.timed(x, torch.arange(k0, k0 + rows)[None], torch.full((1, rows), 1.0 / rows),
                        1)[0]

    return _host_cost_us(call_ns, 1, min(8, int(keys)), int(keys), reps, rounds)


class PooledExperts:
    """One MoE layer of a `Pool` (see the module docstring)."""

    def __init__(self, pool, layer: int):
        self.pool, self.layer = pool, layer
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        p = self.pool
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.device != p.device:
            raise ValueError(f"layer {self.layer}: hidden_states must be on {p.device}, got "
                             f"{getattr(hidden_states, 'device', type(hidden_states).__name__)}")
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        ids = top_k_index.reshape(x.shape[0], -1)
        w = top_k_weights.reshape(x.shape[0], -1)
        if ids.shape[1] != p.top_k:
            raise ValueError(f"layer {self.layer}: top_k_index has K={ids.shape[1]}, the pool "
                             f"was built for top-{p.top_k}")
        if x.shape[0] * p.top_k <= p.bank.max_lanes and not p.prefill_only:
            out = self.decode(x, ids, w)
        else:
            if p.routing_hook is not None:
                ids = p.routing_hook(self.layer, ids)
            out = self._prefill(x, ids, w)
        return out.reshape(hidden_states.shape)

    def decode(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
               out: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
               ids_masked: bool = False) -> torch.Tensor:
        """The decode path for routing chosen elsewhere (the model's router, or the fused decode
        step's): the routing hook, the token mask (`mask`, else the pool's token_mask: inactive
        tokens' lanes become padding; `ids_masked`: the router did that already, so only ids a
        routing hook replaced are masked), plan step, row copies, decode GEMM into `out` (or a
        new tensor). x [T, H], ids [T, K], w [T, K]; W = T·K at most the bank's lanes."""
        p = self.pool
        if p.prefetcher is not None:
            p.prefetcher.join()            # before anything reads or plans the bank
        hooked = p.routing_hook is not None
        if hooked:
            ids = p.routing_hook(self.layer, ids)
        mask = p.token_mask if mask is None else mask
        if mask is not None and (hooked or not ids_masked):
            if mask.shape != (x.shape[0],):
                raise ValueError(f"layer {self.layer}: the token mask has shape "
                                 f"{list(mask.shape)}, the decode call {x.shape[0]} tokens")
            ids = ids.masked_fill(~mask[:, None], -1)          # inactive tokens: padding lanes
        if p.decode_backend is not None:
            y = p.decode_backend(self.layer, x, ids, w)
            return y if out is None else out.copy_(y)
        if p.host is not None and not p.plain:
            return self._decode_host(p.host, x, ids, w, out)
        pre = p.prefetcher
        if pre is not None:
            pre.observe(self.layer, ids)
        if p.overlap_copies:
            _, lane_addr, fresh, join = p.bank.step_split(self.layer, ids)
            if pre is not None:           # beside this layer's GEMM, after its own row copies
                pre.issue(self.layer + 1, x, mask, after=(p.bank.copy_stream,))
            return p.gemm.decode(x, lane_addr, w, out, lane_fresh=fresh, before_fresh=join)
        _, lane_addr = p.bank.step(self.layer, ids)
        if pre is not None:
            pre.issue(self.layer + 1, x, mask)
        return p.gemm.decode(x, lane_addr, w, out)

    def _decode_host(self, hd: HostDecode, x, ids, w, out):
        """The decode call with the host's CPU (module docstring): host plan, post, the link's
        copies, behind copies (none when the host's misses are left out of the bank), GEMM, the
        host's answer added; the last pooled layer joins and lands. A call of another width than
        the mailbox's takes the plain step (nothing handed over)."""
        p = self.pool
        T = x.shape[0]
        cur = torch.cuda.current_stream(p.device)
        if T != hd.tokens:
            # another width (a short prompt's prefill through the decode path): the plain step,
            # which hands nothing over; no row may be pending then (its hit would be the host's)
            cur.wait_stream(hd.side)
            p.bank.land()
            _, lane_addr = p.bank.step(self.layer, ids)
            return p.gemm.decode(x, lane_addr, w, out)
        # posted between the plan and the link's copies: the host computes its rows while the
        # link brings the others (the split table assumes the two run side by side)
        _, lane_addr, host_keys = p.bank.plan_host(self.layer, ids)
        post(x.contiguous(), host_keys.view(T, -1), w.reshape(T, -1).contiguous(), hd.mailbox)
        p.bank.copy_rows()
        if not hd.leave:
            hd.side.wait_stream(cur)
            p.bank.copy_behind(self.layer, hd.side)
        y = p.gemm.decode(x, lane_addr, w, out)
        wait(hd.mailbox, y, hd.error)           # y += the host's answer, in y's dtype
        if not hd.leave and self.layer == p.num_layers - 1:   # behind copies in: none pending
            cur.wait_stream(hd.side)
            p.bank.land()
        return y

    def _prefill(self, x, ids, w):
        p = self.pool
        if p.prefetcher is not None:
            p.prefetcher.join()            # before anything reads the bank
        resident = p.expert_addresses(self.layer)
        host = p.store.address_table()
        step = p.gemm.max_prefill_tokens
        if x.shape[0] <= step:
            T = x.shape[0]
            listed, nxt = prefill_plan(p, self.layer, T)
            if not listed:
                return p.gemm.prefill(x, ids, w, resident, host_addr=host, layer=self.layer,
                                      host_experts=self._missing())
            # lists from the placement read once a prefill: nothing moves it while the pool is
            # prefilling (decode calls alone plan, and the prefetcher was joined above); with
            # host experts, each layer's without the experts the host takes at this width
            share = p.host_prefill_share(self.layer, T)
            lists = p.scratch_lists(self.layer, share)
            ahead = None if nxt is None else p.scratch_lists(nxt, p.host_prefill_share(nxt, T))
            if share:
                return self._prefill_host(x, ids, w, resident, host, lists, ahead)
            return p.gemm.prefill(x, ids, w, resident, host_addr=host, layer=self.layer,
                                  lists=lists, ahead=ahead)
        out = torch.empty_like(x)
        missing = self._missing()
        for t0 in range(0, x.shape[0], step):
            t1 = min(x.shape[0], t0 + step)
            p.gemm.prefill(x[t0:t1], ids[t0:t1], w[t0:t1], resident, host_addr=host,
                           layer=self.layer, out=out[t0:t1], host_experts=missing)
        return out

    def _missing(self) -> int | None:
        """While the pool is prefilling, how many of this layer's experts lack a bank row (from
        the placement read once a prefill), so a call without host lists runs no scratch chunk
        that no row can fill; None otherwise (the host does not know the placement)."""
        p = self.pool
        return int((~p.prefill_resident(self.layer)).sum()) if p.prefill_only else None

    def _prefill_host(self, x, ids, w, resident, host, lists, ahead):
        """A prompt prefill call whose last experts without a bank row the host's CPU computes
        (`Pool.host_prefill_mask`, this layer's row): their lanes are posted to the host's mailbox
        before the GEMM and taken out of the GPU's routing (padding lanes), the experts marked
        as having a row elsewhere (address 1: no lane reads it) so the GEMM neither ranks nor
        copies them, and the host's answer is added into the call's float32 sum before it is
        rounded (`MoEGemm.prefill`'s accumulate)."""
        p, hd = self.pool, self.pool.host
        E = p.num_experts
        on_host = p.host_prefill_mask(x.shape[0])[self.layer]
        routed = (ids >= 0) & on_host[ids.clamp(min=0)]
        keys = torch.where(routed, ids.to(torch.int64) + self.layer * E, -1)
        weights = w if w.dtype in HANDOFF_DTYPES else w.to(torch.float32)
        post(x, keys.contiguous(), weights.contiguous(), hd.mailbox)
        addr = resident.masked_fill(on_host, 1)
        return p.gemm.prefill(x, ids.masked_fill(routed, -1), w, addr, host_addr=host,
                              layer=self.layer, lists=lists, ahead=ahead,
                              accumulate=lambda y: wait(hd.mailbox, y, hd.error))


_LAYERS: weakref.WeakValueDictionary[int, PooledExperts] = weakref.WeakValueDictionary()
_KEYS = itertools.count()            # never reused, unlike id() of a freed layer


@torch.library.custom_op("cupool::experts", mutates_args=())
def experts_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, key: int) -> torch.Tensor:
    """[T, H], [T, K], [T, K] -> [T, H]: the PooledExperts registered under `key`."""
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"cupool::experts: no pooled layer with key {key} (the pool was unwrapped "
                           f"or freed; recompile after wrapping again)")
    return layer(hidden_states, top_k_index, top_k_weights)


@experts_op.register_fake
def _experts_fake(hidden_states, top_k_index, top_k_weights, key):
    return torch.empty_like(hidden_states)


def call_pooled(layer: PooledExperts, hidden_states, top_k_index, top_k_weights):
    """A pooled layer's call: through the custom op while torch.compile traces, else direct."""
    if torch.compiler.is_compiling():
        return experts_op(hidden_states, top_k_index, top_k_weights, layer.key)
    return layer(hidden_states, top_k_index, top_k_weights)
