"""The planner's specification: a NumPy reference model of the plan step.

Shape legend (ARCHITECTURE.md): L layers · E experts per layer · N rows per layer at start · R = L·N
bank rows · S staging rows · W lanes of one layer call (T tokens × K, −1 for padding).

`ReferencePlanner` defines what a plan step, a prefetch step and a plan step that hands misses to
the host's CPU (`step_host`) do; `rawkernels/planner.cu`,
launched by `cupool.ops.planner.PlanStep`, does the same on the GPU in one launch each and is
tested against it after every step. The error bits (`PlanError`) and the counter columns
(`COUNTERS`, `PREFETCH_COUNTERS`) are shared with the kernel, which defines the same values
(ERR_BAD_ID, ERR_STAGING_OVERFLOW, NUM_COUNTERS, NUM_PF_COUNTERS).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

# Columns of the per-layer counters [L, 5] (same order in rawkernels/planner.cu).
COUNTERS = ("hits", "misses", "promotions", "steals", "staged")
HITS, MISSES, PROMOTIONS, STEALS, STAGED = range(len(COUNTERS))

class PlanError(enum.IntFlag):
    """Sticky error bits of the planner (`error` on the device, `ReferencePlanner.error`)."""

    NONE = 0
    BAD_ID = 1             # a lane's id was neither -1 nor in [0, E); the lane was padding
    STAGING_OVERFLOW = 2   # a miss needed a staging row but all S were taken; it routed to -1

    def names(self) -> list[str]:
        """The set flags' names, e.g. ['BAD_ID'] (str() of an IntFlag is just the number on
        Python >= 3.11)."""
        return [f.name for f in PlanError if f.value and f.value & self.value]


POLICIES = ("lru", "lfru")
# Columns of the per-layer prefetch counters [L, 3] (same order in rawkernels/planner.cu's
# PREFETCH build), counted for the layer of the prefetched key.
PREFETCH_COUNTERS = ("prefetched", "prefetch_used", "prefetch_wasted")
PREFETCHED, PREFETCH_USED, PREFETCH_WASTED = range(len(PREFETCH_COUNTERS))


@dataclasses.dataclass(frozen=True)
class HostStep:
    """What `ReferencePlanner.step_host` returns.

    routes: int32 [W], as `step`'s, with −1 on the host's lanes (the GPU's GEMM skips them);
    copies: [(key, row), ...] the copies the step's GEMM waits for (victims, then staged rows);
    behind: [(key, row), ...] the host misses' promotions, copied behind the call (no GEMM waits
        for them; their rows stay pending until `land`);
    host_keys: int64 [W], lane i's key (layer·E + expert) where the host computes lane i's
        expert, else −1 (what `host_post` hands the host)."""
    routes: np.ndarray
    copies: list
    behind: list
    host_keys: np.ndarray


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a miss picks its victim among the rows not used in the current step.

    - "lru" (the kernel's): the smallest (last_use, row).
    - "lfru" (frequency-weighted LRU): the smallest (last_use + weight · freq, row), freq a use
      count that halves every `half_life` clock ticks (freq ← freq · 2^(−Δ/half_life) + 1 at each
      use, Δ the ticks since the last one): a row used often may be older than a row used once.
      With `protect` > 0, rows used within the last `protect` ticks are never victims while any
      other row not used this step exists (a protect-recent variant: frequency cannot evict a
      row that was just brought in).
    Clock ticks are plan steps of any layer: L ticks a decoded token. weight 0 is LRU.
    `promote` > 0 (either kind) caps the misses of one step that take a bank row: the first
    `promote` misses in order take victims, the rest are staged (read for this step only, the
    bank untouched). Several sequences decoded together can ask for more experts in one step
    than a bank holds; uncapped, LRU then evicts every row before its next use.
    """
    kind: str = "lru"
    weight: float = 0.0
    half_life: float = math.inf
    protect: int = 0
    promote: int = 0

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"policy kind must be one of {POLICIES}, got {self.kind!r}")
        if self.kind == "lru" and (self.weight or self.protect or self.half_life != math.inf):
            raise ValueError("the 'lru' policy takes no weight, half_life or protect")
        if isinstance(self.promote, bool) or not isinstance(self.promote, int) or self.promote < 0:
            raise ValueError(f"promote must be an int >= 0 (0: no cap), got {self.promote!r}")
        if not (self.weight >= 0 and self.half_life > 0 and self.protect >= 0):
            raise ValueError(f"lfru needs weight >= 0, half_life > 0, protect >= 0; got "
                             f"weight={self.weight}, half_life={self.half_life}, "
                             f"protect={self.protect}")

    def describe(self) -> str:
        cap = f", at most {self.promote} promotions a step" if self.promote else ""
        if self.kind == "lru":
            return f"LRU{cap}"
        p = f", protect {self.protect}" if self.protect else ""
        return f"LFRU(weight {self.weight:g}, half-life {self.half_life:g}{p}{cap})"


LRU = Policy()


def default_promote(rows_per_layer: int, lanes: int) -> int:
    """The promotion cap a pool gives a plan step of `lanes` lanes over a bank of
    `rows_per_layer` rows a layer (0: no cap): none while a step's lanes fit a layer's rows, a
    quarter of a layer's rows once they do not.

    A step cannot ask for more experts than it has lanes. While lanes ≤ rows per layer, every
    layer's working set can stay resident, and a cap would only turn promotions into repeated
    staging (Qwen3-30B-A3B's shape and locality, a 25% bank, 4 streams of top-8: hit rate 0.538
    uncapped, 0.485 at N/4). Past that, several sequences together ask for more experts a token
    than the bank holds, and uncapped LRU evicts every row before its next use; a cap keeps most
    rows resident long enough to be used again (16 streams at a 50% bank: 0.000 → 0.583; 8 at a
    25% bank: 0.000 → 0.313). N/4 is the best of N/2 … N/16 at 16 streams on 25% and 50% banks
    and within 0.05 of the best elsewhere; N/2 turns too many rows over (0.394). Figures:
    `benchmarks/sim_policies.py --parts promote`, docs/PERFORMANCE.md. One stream (lanes = top-k
    ≤ rows) is never capped.
    """
    for name, v, lo in (("rows_per_layer", rows_per_layer, 1), ("lanes", lanes, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return 0 if lanes <= rows_per_layer else max(1, int(rows_per_layer) // 4)


def initial_placement(num_layers: int, num_experts: int, rows_per_layer: int,
                      initial=None) -> np.ndarray:
    """key_of at build time, int32 [R]: row l·N + i holds key l·E + initial[l, i] (or −1 if empty).

    `initial` is an int array [L, N] of expert ids per layer, −1 for an empty row; each layer's ids
    must be distinct and in [0, E). Default: layer l's experts 0 … min(N, E)−1, then empty rows.
    """
    L, E, N = int(num_layers), int(num_experts), int(rows_per_layer)
    if initial is None:
        init = np.full((L, N), -1, dtype=np.int64)
        init[:, :min(N, E)] = np.arange(min(N, E))
    else:
        init = np.asarray(initial)
        if init.dtype.kind not in "iu":
            raise TypeError(f"initial must be an integer array [L, N], got dtype {init.dtype}")
        if init.shape != (L, N):
            raise ValueError(f"initial must have shape [L, N] = {(L, N)}, got {init.shape}")
        init = init.astype(np.int64)
        bad = (init < -1) | (init >= E)
        if bad.any():
            l, i = np.argwhere(bad)[0]
            raise ValueError(f"initial[{l}, {i}] = {init[l, i]} is not an expert id in [0, {E}) "
                             f"or -1 (empty row)")
        for l in range(L):
            placed = init[l][init[l] >= 0]
            if np.unique(placed).size != placed.size:
                vals, n = np.unique(placed, return_counts=True)
                raise ValueError(f"initial[{l}] places expert {vals[n > 1][0]} in more than one row")
    key_of = np.where(init >= 0, np.arange(L)[:, None] * E + init, -1)
    return key_of.reshape(-1).astype(np.int32)


def lru_order(last_use: np.ndarray) -> np.ndarray:
    """int32 [R]: rows sorted by (last_use, row) — the LRU order the kernel's ring holds."""
    return np.lexsort((np.arange(last_use.size), last_use)).astype(np.int32)


def check_tables(num_keys: int, slot_of, key_of, last_use, clock: int, order=None) -> list[str]:
    """Problems with a planner state (empty when consistent): owned rows and keys must form a
    bijection, last_use ≤ clock, and `order` (when given) must be `lru_order(last_use)`."""
    slot_of, key_of = np.asarray(slot_of), np.asarray(key_of)
    last_use = np.asarray(last_use)
    R = key_of.size
    problems = []
    if slot_of.size != num_keys:
        problems.append(f"slot_of has {slot_of.size} entries, expected {num_keys}")
        return problems
    bad = np.flatnonzero((key_of < -1) | (key_of >= num_keys))
    problems += [f"key_of[{r}] = {key_of[r]} is not a key in [0, {num_keys}) or -1" for r in bad[:8]]
    bad = np.flatnonzero((slot_of < -1) | (slot_of >= R))
    problems += [f"slot_of[{k}] = {slot_of[k]} is not a row in [0, {R}) or -1" for k in bad[:8]]
    if problems:
        return problems
    for r in np.flatnonzero(key_of >= 0):
        k = key_of[r]
        if slot_of[k] != r:
            problems.append(f"row {r} holds key {k}, but slot_of[{k}] = {slot_of[k]}")
    for k in np.flatnonzero(slot_of >= 0):
        r = slot_of[k]
        if key_of[r] != k:
            problems.append(f"slot_of[{k}] = {r}, but row {r} holds key {key_of[r]}")
    late = np.flatnonzero(last_use > clock)
    problems += [f"last_use[{r}] = {last_use[r]} is after clock {clock}" for r in late[:8]]
    if order is not None:
        order = np.asarray(order)
        want = lru_order(last_use)
        if order.size != R or np.any(order != want):
            i = int(np.flatnonzero(order != want)[0]) if order.size == R else 0
            problems.append(f"LRU order is not the rows sorted by (last_use, row): first "
                            f"difference at position {i} (holds {order[i] if order.size else '-'}, "
                            f"expected {want[i]})")
    return problems[:32]


class ReferencePlanner:
    """The planner's specification, in NumPy. The GPU kernel must match it on every input.

    State (the same tables the Bank keeps at fixed device addresses):
      key of (layer l, expert e) = l·E + e;
      slot_of int32 [L·E]  row holding the key, or −1;
      key_of  int32 [R]    key held by the row, or −1 (empty row);
      last_use int64 [R]   clock of the row's last use (0 at build);
      clock   int          advanced once per step while the gate is open (0 at build);
      gate    bool         closed (False) at build;
      error   PlanError    sticky bits, never cleared by a step;
      counters int64 [L, 5] per layer, columns COUNTERS, counted only while the gate is open;
      prefetched bool [R]  rows a prefetch filled that no step has used since (False at build);
      prefetch_counters int64 [L, 3]  columns PREFETCH_COUNTERS, by the prefetched key's layer;
      pending bool [R]     rows a host step promoted whose copy has not landed (False at build);
      host_counters int64 [L]  unique ids a host step handed to the host, by layer.
    Initial placement: `initial_placement` (layer l's first N experts, or a given [L, N] order, in
    rows l·N … l·N+N−1).

    step(layer, ids[W]):
      1. A lane whose id is −1 is padding. A lane whose id is outside [0, E) sets BAD_ID and is
         padding.
      2. Duplicate ids are removed, keeping first-occurrence (lane) order. A unique id is a hit if
         its key holds a row at the start of the step, else a miss.
      3. Gate open: clock += 1; every hit row gets last_use = clock.
      4. Misses, in first-occurrence order. Gate open, fewer than `policy.promote` misses of
         this step promoted so far (any number when it is 0), and a victim exists (a row with
         last_use < clock): the victim is the row with the smallest (last_use, row) among them —
         any layer's row, or an empty one. The victim's old key loses its row, the miss's key takes
         it, last_use = clock, and (key, row) joins the copy list. Otherwise (gate closed, the
         cap reached, or every row was used this step) the miss takes staging row R + k, k =
         number of misses staged earlier in this step, for this step only: slot_of is not
         changed, and (key, R + k) joins the copy list so the GEMM reads the right data. If k ≥ S,
         STAGING_OVERFLOW is set, the miss gets no row (its lanes route to −1) and no copy.
      5. routes[i] = the row of lane i's expert (bank row, staging row, or −1 for padding).
    Consequences: rows used in the step are never evicted in it; the copy list holds the victims
    first (miss order), then the staged misses (miss order), at most W entries; with the gate closed
    nothing but `error` changes. Evictions copy nothing back (the host store is the backing copy).

    Counters (gate open only; a closed gate is warm-up and graph capture, not serving):
      hits        unique ids that were hits;
      misses      unique ids that were misses (= promotions + staged + overflowed);
      promotions  misses that took a bank row (a victim);
      steals      promotions whose victim held another layer's key (the cross-layer growth);
      staged      misses that took a staging row (no victim).

    prefetch(layer, ids[W], max_rows=0) — a plan step in which the ids are a prediction of
    `layer`'s next step (issued while an earlier layer still computes; the kernel's prefetch
    mode):
      1. As step 1 (−1 padding; an id outside [0, E) sets BAD_ID, whatever the gate) and step 2
         (dedupe in first-occurrence order; hit or miss against the tables at the start).
      2. Gate closed: nothing else happens (no copies).
      3. Gate open: clock += 1 (a tick of its own, like a step); every hit row gets
         last_use = clock (a predicted row moves to the LRU tail; whether it was prefetched is
         unchanged).
      4. Misses, in order: a row is *eligible* if last_use < max(clock − 1, 1), i.e. it was used
         neither in this prefetch nor at the tick before it (the step of the layer still
         computing, whose GEMM may be reading its rows while the prefetch's copies land); at
         clock 1 every row is eligible, nothing having been used. The victim is the eligible row
         with the smallest (last_use, row) (the policy's victim among eligible rows); the
         victim's old key loses its row, the predicted key takes it, last_use = clock, the row
         is marked prefetched, and (key, row) joins the prefetch's copy list. No eligible row:
         the predicted id is skipped — never staged, never an error. With max_rows > 0 only the
         first max_rows misses are considered; the others are skipped alike (a prefetch's copies
         must land under the compute of the layers before its layer to hide).
      5. No routes, and `counters` do not change; the prefetch's copy list (victims in miss
         order, at most W entries) is its own.
    A prefetched row is an ordinary bank row: the next step of its layer finds it as a hit, and
    LRU evicts it last among rows not used since (its last_use is the prefetch's tick), which is
    all the protection a prediction gets. A wrong prediction costs a copy and a row that LRU
    reclaims in time: never a wrong route.

    Prefetch counters (gate open only), by the layer of the prefetched key:
      prefetched       rows a prefetch filled (its copy-list entries);
      prefetch_used    prefetched rows that a step then found as hits (the flag is cleared);
      prefetch_wasted  prefetched rows taken as victims (by a step or a prefetch) before any use.
    prefetched − prefetch_used − prefetch_wasted = rows still marked prefetched.

    step_host(layer, ids, split) — a plan step that hands some misses to the host's CPU (the
    kernel's HOST_SPLIT build), so they are computed beside the link instead of waited for:
      1.–4. As step, except that a *pending* row (one whose copy has not landed) is never a
         victim: the victim is the smallest (last_use, row) among rows with last_use < clock
         that are not pending.
      5. h = min(split[M], V), M the step's misses, V those that took a bank row (the first V in
         miss order): the last h of the V, misses V − h … V − 1, are the host's. Each keeps its
         bank row (the tables as step leaves them, last_use = clock), but its (key, row) goes to
         the `behind` list instead of the copy list, and its row is marked pending. A hit on a
         pending row is the host's too (the row is stamped as any hit).
      6. Routes as step's, with −1 on every lane whose expert is the host's; host_keys[i] =
         its key on those lanes, else −1.
      The copy list holds the other victims (miss order), then the staged misses (miss order);
      host_counters[layer] counts the host's unique ids (gate open).
    step_host(layer, ids, split, leave=True) — the host's misses left out of the bank instead:
      h = split[M] (gate open; 0 when closed) of the M misses, the last h in miss order, are the
      host's before any row is given: they take no row, are neither copied nor staged, and the
      bank is left as it was for them. The first M − h misses are a step's misses (the cap
      counts them alone: the first min(M − h, promote) may take rows). Nothing goes behind and
      no row becomes pending; hits on pending rows (left by earlier steps) are the host's as
      above. The misses counter counts all M; host_counters[layer] the host's unique ids.
    land() — every behind copy has landed: no row is pending any more.
    A pending row is ordinary otherwise (it ages and is hit as any row); it only cannot be
    evicted while its copy may still be in flight.

    Policies: `policy` replaces the victim rule of step 4 and prefetch step 4 (`Policy`); the
    kernel implements LRU with the promotion cap (`promote`, a launch argument), the other kinds
    are the reference model's and the simulator's only. The policy's cap applies to plan steps,
    never to a prefetch, which has its own (max_rows, the same launch argument). A prefetch's
    hits and victims set last_use only: a prediction is not a use for a frequency count.
    """

    def __init__(self, num_layers: int, num_experts: int, rows_per_layer: int,
                 staging_rows: int, initial=None, policy: Policy = LRU):
        for name, v, lo in (("num_layers", num_layers, 1), ("num_experts", num_experts, 1),
                            ("rows_per_layer", rows_per_layer, 1), ("staging_rows", staging_rows, 0)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.rows_per_layer, self.staging_rows = int(rows_per_layer), int(staging_rows)
        self.num_rows = self.num_layers * self.rows_per_layer
        self.key_of = initial_placement(self.num_layers, self.num_experts, self.rows_per_layer,
                                        initial)
        self.slot_of = np.full(self.num_layers * self.num_experts, -1, dtype=np.int32)
        owned = np.flatnonzero(self.key_of >= 0)
        self.slot_of[self.key_of[owned]] = owned
        self.last_use = np.zeros(self.num_rows, dtype=np.int64)
        self.clock = 0
        self.gate = False
        self.error = PlanError.NONE
        self.counters = np.zeros((self.num_layers, len(COUNTERS)), dtype=np.int64)
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
        self.policy = policy
        self.freq = np.zeros(self.num_rows, dtype=np.float64)      # lfru: decayed use counts
        self.prefetched = np.zeros(self.num_rows, dtype=bool)
        self.prefetch_counters = np.zeros((self.num_layers, len(PREFETCH_COUNTERS)),
                                          dtype=np.int64)
        self.pending = np.zeros(self.num_rows, dtype=bool)
        self.host_counters = np.zeros(self.num_layers, dtype=np.int64)

    def open(self) -> None:
        self.gate = True

    def close(self) -> None:
        self.gate = False

    def _victim(self, below: int) -> int:
        """The policy's victim among rows with last_use < `below` that are not pending, or −1
        (LRU: the smallest (last_use, row))."""
        cand = np.flatnonzero((self.last_use < below) & ~self.pending)
        if cand.size == 0:
            return -1
        pol = self.policy
        if pol.kind == "lru":
            return int(cand[np.argmin(self.last_use[cand])])   # argmin: the lowest row on ties
        if pol.protect:
            old = cand[self.last_use[cand] < self.clock - pol.protect]
            cand = old if old.size else cand
        age = (self.clock - self.last_use[cand]) / pol.half_life
        score = self.last_use[cand] + pol.weight * self.freq[cand] * np.exp2(-age)
        return int(cand[np.argmin(score)])

    def _use(self, row: int) -> None:
        """Row `row` used by a step at the current clock (a hit, or taken by a miss)."""
        if self.policy.kind == "lfru":
            dt = self.clock - self.last_use[row]
            self.freq[row] = self.freq[row] * 2.0 ** (-dt / self.policy.half_life) + 1.0
        self.last_use[row] = self.clock

    def _take(self, victim: int, key: int) -> int:
        """`key` takes row `victim`; returns the layer of the key it held (−1: empty row).
        A prefetched victim was wasted."""
        old = int(self.key_of[victim])
        if old >= 0:
            self.slot_of[old] = -1
            if self.prefetched[victim]:
                self.prefetch_counters[old // self.num_experts, PREFETCH_WASTED] += 1
        self.prefetched[victim] = False
        self.slot_of[key] = victim
        self.key_of[victim] = key
        self.freq[victim] = 0.0
        return old // self.num_experts if old >= 0 else -1

    def _keys(self, layer: int, ids) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Checks; (ids int64 [W], valid bool [W], unique keys in first-occurrence order).
        Sets BAD_ID for an id that is neither −1 nor in [0, E)."""
        L, E = self.num_layers, self.num_experts
        if not 0 <= layer < L:
            raise IndexError(f"layer {layer} out of range [0, {L})")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1).astype(np.int64)
        valid = (ids >= 0) & (ids < E)
        if np.any(~valid & (ids != -1)):
            self.error |= PlanError.BAD_ID
        return ids, valid, list(dict.fromkeys(int(layer * E + e) for e in ids[valid]))

    def step(self, layer: int, ids) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """One layer call: (routes int32 [W], copies [(key, row), ...] in copy order)."""
        r = self.step_host(layer, ids, None)
        return r.routes, r.copies

    def step_host(self, layer: int, ids, split, leave: bool = False) -> HostStep:
        """One layer call whose last promoted misses go to the host (the class docstring's
        step_host; with `leave`, its last misses, left out of the bank). split: int sequence
        indexed by the step's miss count M (length > W), with 0 <= split[M] <= M; None hands
        nothing over (then this is `step`)."""
        E, R, S = self.num_experts, self.num_rows, self.staging_rows
        if split is not None:
            split = np.asarray(split)
            if split.dtype.kind not in "iu" or split.ndim != 1:
                raise TypeError(f"split must be a 1-D integer array, got {split.dtype} "
                                f"{list(split.shape)}")
            W = np.asarray(ids).size
            if split.size <= W:
                raise ValueError(f"split has {split.size} entries; a step of {W} lanes needs one "
                                 f"for every miss count 0 ... {W}")
            bad = np.flatnonzero((split < 0) | (split > np.arange(split.size)))
            if bad.size:
                m = int(bad[0])
                raise ValueError(f"split[{m}] = {int(split[m])} is not in [0, {m}] (the host's "
                                 f"share of {m} misses)")
        # 1., 2. padding, invalid lanes, dedupe; classify against the tables at the step's start
        ids, valid, uniq = self._keys(layer, ids)
        hits = [k for k in uniq if self.slot_of[k] >= 0]
        misses = [k for k in uniq if self.slot_of[k] < 0]
        row_of = {k: int(self.slot_of[k]) for k in hits}
        # 3. recency of hits
        if self.gate:
            self.clock += 1
            for k in hits:
                r = row_of[k]
                self._use(r)
                if self.prefetched[r]:
                    self.prefetch_counters[layer, PREFETCH_USED] += 1
                    self.prefetched[r] = False
        # 4. misses (with `leave`, the host's last ones first set aside)
        n_left = int(split[len(misses)]) if leave and split is not None and self.gate else 0
        own, left = misses[:len(misses) - n_left], misses[len(misses) - n_left:]
        copies = []
        promotions = steals = staged = 0
        cap = self.policy.promote or len(own)
        promoted = []
        for k in own:
            victim = self._victim(self.clock) if self.gate and promotions < cap else -1
            if victim >= 0:
                old_layer = self._take(victim, k)
                steals += old_layer >= 0 and old_layer != layer
                self._use(victim)
                row = victim
                promotions += 1
                promoted.append(k)
            elif staged < S:
                row = R + staged
                staged += 1
            else:
                self.error |= PlanError.STAGING_OVERFLOW
                row = -1
            if row >= 0:
                copies.append((k, row))
            row_of[k] = row
        # 5. the host's misses: the last h promoted (or those left out); hits on pending rows
        h = min(int(split[len(misses)]), promotions) if split is not None and not leave else 0
        host = set(promoted[promotions - h:]) | set(left) \
            | {k for k in hits if self.pending[row_of[k]]}
        behind = [(k, r) for k, r in copies if k in host]
        copies = [(k, r) for k, r in copies if k not in host]
        for k, _ in behind:
            self.pending[row_of[k]] = True
        # 6. routes
        routes = np.array([row_of[int(layer * E + e)] if ok and layer * E + e not in host else -1
                           for e, ok in zip(ids, valid)], dtype=np.int32)
        host_keys = np.array([layer * E + e if ok and layer * E + e in host else -1
                              for e, ok in zip(ids, valid)], dtype=np.int64)
        if self.gate:
            self.counters[layer] += (len(hits), len(misses), promotions, steals, staged)
            self.host_counters[layer] += len(host)
        return HostStep(routes, copies, behind, host_keys)

    def land(self) -> None:
        """Every behind copy has landed: no row is pending."""
        self.pending[:] = False

    def prefetch(self, layer: int, ids, max_rows: int = 0) -> list[tuple[int, int]]:
        """Bring the predicted experts `ids` of the next step of `layer` in (the class
        docstring's prefetch rule; at most `max_rows` of them, 0: no cap); returns the
        prefetch's copy list [(key, row), ...]."""
        if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) \
                or max_rows < 0:
            raise ValueError(f"max_rows must be an int >= 0 (0: no cap), got {max_rows!r}")
        _, _, uniq = self._keys(layer, ids)
        if not self.gate:
            return []
        hits = [k for k in uniq if self.slot_of[k] >= 0]
        misses = [k for k in uniq if self.slot_of[k] < 0]
        self.clock += 1
        for k in hits:
            self.last_use[self.slot_of[k]] = self.clock
        below = max(self.clock - 1, 1)          # not used now nor at the tick before
        copies = []
        for k in misses[:max_rows or len(misses)]:
            victim = self._victim(below)
            if victim < 0:
                continue                          # skipped: a prefetch never stages
            self._take(victim, k)
            self.last_use[victim] = self.clock
            self.prefetched[victim] = True
            copies.append((k, victim))
        self.prefetch_counters[layer, PREFETCHED] += len(copies)
        return copies

    def state(self) -> dict:
        """Copies of the tables, under the names `Bank.tables()` uses."""
        return {"slot_of": self.slot_of.copy(), "key_of": self.key_of.copy(),
                "last_use": self.last_use.copy(), "order": lru_order(self.last_use),
                "clock": int(self.clock), "gate": int(self.gate), "error": int(self.error),
                "counters": self.counters.copy()}

    def prefetch_state(self) -> dict:
        """Copies of the prefetch tables (a prefetching Bank's `state()` holds them too):
        "prefetched" int32 [R] (1 where marked) and "prefetch_counters" int64 [L, 3]."""
        return {"prefetched": self.prefetched.astype(np.int32),
                "prefetch_counters": self.prefetch_counters.copy()}

    def load(self, state: dict) -> None:
        """Take over a state (e.g. a Bank's `state()`), so the model can follow from there. The
        prefetch tables are taken when the state holds them, else cleared."""
        self.slot_of = np.asarray(state["slot_of"], dtype=np.int32).copy()
        self.key_of = np.asarray(state["key_of"], dtype=np.int32).copy()
        self.last_use = np.asarray(state["last_use"], dtype=np.int64).copy()
        self.clock = int(state["clock"])
        self.gate = bool(state["gate"])
        self.error = PlanError(int(state["error"]))
        self.counters = np.asarray(state["counters"], dtype=np.int64).copy()
        R, L = self.num_rows, self.num_layers
        self.prefetched = (np.asarray(state["prefetched"]) != 0).copy() \
            if "prefetched" in state else np.zeros(R, dtype=bool)
        self.prefetch_counters = np.asarray(state["prefetch_counters"], dtype=np.int64).copy() \
            if "prefetch_counters" in state else np.zeros((L, len(PREFETCH_COUNTERS)), np.int64)

    def check(self) -> list[str]:
        """Problems with the current tables (empty when consistent)."""
        return check_tables(self.num_layers * self.num_experts, self.slot_of, self.key_of,
                            self.last_use, self.clock)
