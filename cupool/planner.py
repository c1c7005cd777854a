"""The planner: its NumPy reference model (the specification) and the plan-step launcher.

Shape legend (DESIGN.md): L layers · E experts per layer · N rows per layer at start · R = L·N bank
rows · S staging rows · W lanes of one layer call (T tokens × K, −1 for padding).

`ReferencePlanner` defines what a plan step does; `rawkernels/planner.cu` does the same on the GPU
in one launch and is tested against it after every step. `PlanStep` validates arguments and
launches that kernel on torch's current stream for the tables a `cupool.bank.Bank` holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import numpy as np
import torch

from cupool import _cuda, kernels

# Columns of the per-layer counters [L, 5] (same order in rawkernels/planner.cu).
COUNTERS = ("hits", "misses", "promotions", "steals", "staged")
HITS, MISSES, PROMOTIONS, STEALS, STAGED = range(len(COUNTERS))

# Largest W of one plan step: one lane per thread of the kernel's single block.
MAX_LANES = 1024


class PlanError(enum.IntFlag):
    """Sticky error bits of the planner (`error` on the device, `ReferencePlanner.error`)."""

    NONE = 0
    BAD_ID = 1             # a lane's id was neither -1 nor in [0, E); the lane was padding
    STAGING_OVERFLOW = 2   # a miss needed a staging row but all S were taken; it routed to -1

    def names(self) -> list[str]:
        """The set flags' names, e.g. ['BAD_ID'] (str() of an IntFlag is just the number on
        Python >= 3.11)."""
        return [f.name for f in PlanError if f.value and f.value & self.value]


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


def ring_capacity(num_rows: int) -> int:
    """C of the plan step's LRU ring: the smallest power of two >= 2R (so appends run about R / W
    steps between compactions; any power of two >= R is correct)."""
    return 1 << max(5, (2 * int(num_rows) - 1).bit_length())


def ring_order(ring, pos_of, head: int, span: int) -> tuple[np.ndarray, list[str]]:
    """The rows of the ring's window [head, head + span) in window order, holes (−1) skipped, and
    the problems with the ring (a row out of range, or whose pos_of is not its position)."""
    ring, pos_of = np.asarray(ring), np.asarray(pos_of)
    C, R = ring.size, pos_of.size
    problems = []
    if C & (C - 1) or C < R or not (0 <= head < C and 0 <= span <= C):
        return np.zeros(0, np.int32), [f"ring of {C} entries (a power of two >= R={R}) with head "
                                       f"{head}, span {span} is malformed"]
    pos = (head + np.arange(span)) & (C - 1)
    live = ring[pos] >= 0
    rows, pos = ring[pos][live], pos[live]
    bad = (rows >= R) | (pos_of[np.clip(rows, 0, R - 1)] != pos)
    problems += [f"ring[{p}] = {r} but pos_of[{r}] = {pos_of[r] if r < R else '-'}"
                 for p, r in zip(pos[bad][:8], rows[bad][:8])]
    return rows.astype(np.int32), problems


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
      counters int64 [L, 5] per layer, columns COUNTERS, counted only while the gate is open.
    Initial placement: `initial_placement` (layer l's first N experts, or a given [L, N] order, in
    rows l·N … l·N+N−1).

    step(layer, ids[W]):
      1. A lane whose id is −1 is padding. A lane whose id is outside [0, E) sets BAD_ID and is
         padding.
      2. Duplicate ids are removed, keeping first-occurrence (lane) order. A unique id is a hit if
         its key holds a row at the start of the step, else a miss.
      3. Gate open: clock += 1; every hit row gets last_use = clock.
      4. Misses, in first-occurrence order. Gate open and a victim exists (a row with
         last_use < clock): the victim is the row with the smallest (last_use, row) among them —
         any layer's row, or an empty one. The victim's old key loses its row, the miss's key takes
         it, last_use = clock, and (key, row) joins the copy list. Otherwise (gate closed, or every
         row was used this step) the miss takes staging row R + k, k = number of misses staged
         earlier in this step, for this step only: slot_of is not changed, and (key, R + k) joins
         the copy list so the GEMM reads the right data. If k ≥ S, STAGING_OVERFLOW is set, the
         miss gets no row (its lanes route to −1) and no copy.
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
    """

    def __init__(self, num_layers: int, num_experts: int, rows_per_layer: int,
                 staging_rows: int, initial=None):
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

    def open(self) -> None:
        self.gate = True

    def close(self) -> None:
        self.gate = False

    def _victim(self) -> int:
        """Row with the smallest (last_use, row) among rows with last_use < clock, or −1."""
        cand = np.flatnonzero(self.last_use < self.clock)
        if cand.size == 0:
            return -1
        lu = self.last_use[cand]
        return int(cand[np.argmin(lu)])   # argmin returns the first, i.e. the lowest row, on ties

    def step(self, layer: int, ids) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """One layer call: (routes int32 [W], copies [(key, row), ...] in copy order)."""
        L, E, R, S = self.num_layers, self.num_experts, self.num_rows, self.staging_rows
        if not 0 <= layer < L:
            raise IndexError(f"layer {layer} out of range [0, {L})")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1).astype(np.int64)

        # 1. padding and invalid lanes
        valid = (ids >= 0) & (ids < E)
        if np.any(~valid & (ids != -1)):
            self.error |= PlanError.BAD_ID
        # 2. dedupe in first-occurrence order; classify against the tables at the step's start
        uniq = list(dict.fromkeys(int(layer * E + e) for e in ids[valid]))
        hits = [k for k in uniq if self.slot_of[k] >= 0]
        misses = [k for k in uniq if self.slot_of[k] < 0]
        row_of = {k: int(self.slot_of[k]) for k in hits}
        # 3. recency of hits
        if self.gate:
            self.clock += 1
            for k in hits:
                self.last_use[row_of[k]] = self.clock
        # 4. misses
        copies = []
        promotions = steals = staged = 0
        for k in misses:
            victim = self._victim() if self.gate else -1
            if victim >= 0:
                old = int(self.key_of[victim])
                if old >= 0:
                    self.slot_of[old] = -1
                    steals += old // E != layer
                self.slot_of[k] = victim
                self.key_of[victim] = k
                self.last_use[victim] = self.clock
                row = victim
                promotions += 1
            elif staged < S:
                row = R + staged
                staged += 1
            else:
                self.error |= PlanError.STAGING_OVERFLOW
                row = -1
            if row >= 0:
                copies.append((k, row))
            row_of[k] = row
        # 5. routes
        routes = np.array([row_of[int(layer * E + e)] if ok else -1 for e, ok in zip(ids, valid)],
                          dtype=np.int32)
        if self.gate:
            self.counters[layer] += (len(hits), len(misses), promotions, steals, staged)
        return routes, copies

    def state(self) -> dict:
        """Copies of the tables, under the names `Bank.tables()` uses."""
        return {"slot_of": self.slot_of.copy(), "key_of": self.key_of.copy(),
                "last_use": self.last_use.copy(), "order": lru_order(self.last_use),
                "clock": int(self.clock), "gate": int(self.gate), "error": int(self.error),
                "counters": self.counters.copy()}

    def load(self, state: dict) -> None:
        """Take over a state (e.g. a Bank's `tables()`), so the model can follow from there."""
        self.slot_of = np.asarray(state["slot_of"], dtype=np.int32).copy()
        self.key_of = np.asarray(state["key_of"], dtype=np.int32).copy()
        self.last_use = np.asarray(state["last_use"], dtype=np.int64).copy()
        self.clock = int(state["clock"])
        self.gate = bool(state["gate"])
        self.error = PlanError(int(state["error"]))
        self.counters = np.asarray(state["counters"], dtype=np.int64).copy()

    def check(self) -> list[str]:
        """Problems with the current tables (empty when consistent)."""
        return check_tables(self.num_layers * self.num_experts, self.slot_of, self.key_of,
                            self.last_use, self.clock)


# --- the GPU launcher --------------------------------------------------------------------------

@dataclass
class DeviceTables:
    """The planner's device tensors; every one is allocated once and never moves (graph-safe).

    State: slot_of int32 [L·E] · key_of int32 [R] · last_use int64 [R] · ring int32 [C] (the LRU
    order: the window [head, head + span) mod C holds every row once, sorted by (last_use, row),
    and holes −1; `ring_order` reads it) · pos_of int32 [R] (each row's ring position) · ends
    int32 [2] (head, span) · clock int64 [1] · gate int32 [1] · error int32 [1] · counters int64
    [L, 5].
    Outputs of the last step, reused by every layer call: routes int32 [max_lanes] · lane_addr
    int64 [max_lanes] · lane_fresh int32 [max_lanes] (1 where the copy list fills the lane's row)
    · copies int32 [max_lanes, 2] · n_copies int32 [1].
    """

    slot_of: torch.Tensor
    key_of: torch.Tensor
    last_use: torch.Tensor
    ring: torch.Tensor
    pos_of: torch.Tensor
    ends: torch.Tensor
    clock: torch.Tensor
    gate: torch.Tensor
    error: torch.Tensor
    counters: torch.Tensor
    routes: torch.Tensor
    lane_addr: torch.Tensor
    lane_fresh: torch.Tensor
    copies: torch.Tensor
    n_copies: torch.Tensor

    @classmethod
    def build(cls, key_of: np.ndarray, num_layers: int, num_experts: int, max_lanes: int,
              device, ring: int | None = None) -> "DeviceTables":
        """Tables for the placement `key_of` (from `initial_placement`), all rows unused.
        `ring`: the LRU ring's capacity (default `ring_capacity(R)`; tests pass a small one)."""
        R = key_of.size
        C = ring_capacity(R) if ring is None else int(ring)
        if C & (C - 1) or C < R:
            raise ValueError(f"ring must be a power of two >= R={R}, got {ring}")
        ring_init = np.full(C, -1, dtype=np.int32)
        ring_init[:R] = np.arange(R)                    # all last_use 0: sorted by row
        slot_of = np.full(num_layers * num_experts, -1, dtype=np.int32)
        owned = np.flatnonzero(key_of >= 0)
        slot_of[key_of[owned]] = owned

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return cls(
            slot_of=dev(slot_of), key_of=dev(key_of.astype(np.int32)),
            last_use=torch.zeros(R, dtype=torch.int64, device=device),
            ring=dev(ring_init),
            pos_of=torch.arange(R, dtype=torch.int32, device=device),
            ends=torch.tensor([0, R], dtype=torch.int32, device=device),
            clock=torch.zeros(1, dtype=torch.int64, device=device),
            gate=torch.zeros(1, dtype=torch.int32, device=device),
            error=torch.zeros(1, dtype=torch.int32, device=device),
            counters=torch.zeros(num_layers, len(COUNTERS), dtype=torch.int64, device=device),
            routes=torch.full((max_lanes,), -1, dtype=torch.int32, device=device),
            lane_addr=torch.zeros(max_lanes, dtype=torch.int64, device=device),
            lane_fresh=torch.zeros(max_lanes, dtype=torch.int32, device=device),
            copies=torch.zeros(max_lanes, 2, dtype=torch.int32, device=device),
            n_copies=torch.zeros(1, dtype=torch.int32, device=device))

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    def to_numpy(self) -> dict:
        """Host copies of the state tables (one synchronising read each; not for the hot path).
        "order" is the ring's window read in order (`ring_order`); "ring_problems" lists what is
        wrong with the ring itself."""
        head, span = (int(v) for v in self.ends.cpu())
        order, problems = ring_order(self.ring.cpu().numpy(), self.pos_of.cpu().numpy(), head, span)
        return {"slot_of": self.slot_of.cpu().numpy(), "key_of": self.key_of.cpu().numpy(),
                "last_use": self.last_use.cpu().numpy(), "order": order,
                "ring_problems": problems, "ring_head": head, "ring_span": span,
                "clock": int(self.clock.item()), "gate": int(self.gate.item()),
                "error": int(self.error.item()), "counters": self.counters.cpu().numpy()}


def launch_shape(num_rows: int, max_lanes: int) -> tuple[int, int]:
    """(threads, items) of the plan-step block: enough threads for every lane and at least 128;
    4 ring entries a thread per tile (a step usually finds its victims in the first tile; the
    rare compaction walks the whole window tile by tile). Small banks take a single tile."""
    threads = max(128, 32 * -(-max_lanes // 32))
    items = max(1, min(4, -(-num_rows // threads)))
    return threads, items


def check_ids(ids, max_lanes: int, device: torch.device) -> int:
    """Validate a step's ids before any pointer reaches the kernel; returns W."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch tensor (int32 or int64 on {device}), "
                        f"got {type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    if ids.device != device:
        raise ValueError(f"ids must be on the bank's device {device}, got {ids.device}")
    if not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous (shape {tuple(ids.shape)}, stride "
                         f"{ids.stride()}); pass ids.contiguous()")
    W = ids.numel()
    if W > max_lanes:
        raise ValueError(f"ids has {W} lanes (shape {tuple(ids.shape)}), more than the bank's "
                         f"max_lanes={max_lanes}")
    return W


class PlanStep:
    """Launches `rawkernels/planner.cu` for one set of `DeviceTables` and bank rows.

    Args:
        tables: the planner's device tensors.
        num_layers, num_experts, staging_rows: L, E, S.
        rows: uint8 CUDA tensor [R + S, row_stride] (the bank, then staging); only its address and
            stride reach the kernel (for lane_addr).
        threads, items: block shape (default `launch_shape`); tests use tiny ones to exercise
            the kernel's multi-tile path.
    """

    def __init__(self, tables: DeviceTables, num_layers: int, num_experts: int,
                 staging_rows: int, rows: torch.Tensor, *, threads: int | None = None,
                 items: int | None = None):
        self.tables = tables
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.num_rows, self.staging_rows = tables.key_of.numel(), int(staging_rows)
        self.max_lanes = tables.routes.numel()
        self.device = rows.device
        self.rows_base, self.row_stride = rows.data_ptr(), rows.stride(0)
        d_threads, d_items = launch_shape(self.num_rows, self.max_lanes)
        self.threads, self.items = int(threads or d_threads), int(items or d_items)
        if self.threads % 32 or not 32 <= self.threads <= 1024 or self.threads < self.max_lanes:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024] and >= max_lanes="
                             f"{self.max_lanes}, got {self.threads}")
        if not 1 <= self.items <= 32:
            raise ValueError(f"items must be in [1, 32], got {self.items}")
        # first-lane table [E] + hit and taken bitmaps [ceil(R/32)] each, all 4-byte words
        self.shared_mem = 4 * (self.num_experts + 2 * -(-self.num_rows // 32))
        defines = {"THREADS": self.threads, "ITEMS": self.items}
        dev = self.device.index
        self.kernels = {torch.int32: kernels.function("planner", "plan_step_i32", defines, dev),
                        torch.int64: kernels.function("planner", "plan_step_i64", defines, dev)}
        limit = _shared_mem_limit(dev)
        static = 24 * self.threads + 4 * 64 + 8 * 6 + 12  # planner.cu's __shared__ arrays
        if self.shared_mem + static > limit:
            raise ValueError(f"the plan step needs {self.shared_mem + static} bytes of shared "
                             f"memory (E={self.num_experts}, R={self.num_rows}), more than the "
                             f"device's {limit} per block")

    def __call__(self, layer: int, ids: torch.Tensor) -> int:
        """One plan step for `layer` on torch's current stream; returns W. No host sync."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        W = check_ids(ids, self.max_lanes, self.device)
        t = self.tables
        kernels.launch(self.kernels[ids.dtype], 1, self.threads, (
            ids, kernels.i32(W), kernels.i32(layer), kernels.i32(self.num_experts),
            kernels.i32(self.num_rows), kernels.i32(self.staging_rows),
            t.slot_of, t.key_of, t.last_use, t.ring, t.pos_of, t.ends,
            kernels.i32(t.ring.numel() - 1), t.clock, t.gate, t.error, t.counters,
            t.routes, t.lane_addr, t.lane_fresh, t.copies, t.n_copies,
            kernels.i64(self.rows_base), kernels.i64(self.row_stride)),
            shared_mem=self.shared_mem, device=self.device)
        return W


def _shared_mem_limit(device: int) -> int:
    attrs = _cuda.cupy().cuda.Device(device).attributes
    return int(attrs.get("MaxSharedMemoryPerBlockOptin", attrs.get("MaxSharedMemoryPerBlock", 48 << 10)))
