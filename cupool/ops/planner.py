"""Launcher of `rawkernels/planner.cu`: the plan step on the GPU, and the tables it works on.

Shape legend (ARCHITECTURE.md): L layers · E experts per layer · R bank rows · S staging rows ·
W lanes of one layer call · C the LRU ring's capacity.

`DeviceTables` are the planner's state at fixed device addresses; `PlanStep` validates a step's
arguments and launches the kernel on torch's current stream. The semantics are those of
`cupool.reference.planner.ReferencePlanner`, which the GPU tests compare the kernel with.
With `prefetch=True` both use the kernel's PREFETCH build: three more tables and a prefetch list,
and `PlanStep.prefetch` (`ReferencePlanner.prefetch`); with `host=True` the HOST_SPLIT build (a
step hands its last promoted misses to the host's CPU, `ReferencePlanner.step_host`: a split
table, pending rows, the host lanes' keys and a list of copies made behind the call; or, with the
leave flag, its last misses, left out of the bank); without
either the kernel is the plain build.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from cupool import _cuda, kernels
from cupool.reference.planner import COUNTERS, PREFETCH_COUNTERS

# Largest W of one plan step: one lane per thread of the kernel's single block.
MAX_LANES = 1024


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
    Prefetch tables (None unless built with `prefetch=True`): touched int32 [1] (rows stamped by
    the last open tick: the ring window's last entries) · pf_flag int32 [R] (1: filled by a
    prefetch, not used since) · pf_counters int64 [L, 3] (`PREFETCH_COUNTERS`) · pf_copies int32
    [max_lanes, 2] and pf_n_copies int32 [1] (the last prefetch's copy list).
    Host tables (None unless built with `host=True`): split int32 [max_lanes + 1] (of M misses
    the host takes split[M]; zeros: none) · host_leave int32 [1] (1: the host's misses are left
    out of the bank, `ReferencePlanner.step_host`'s leave; 0: promoted, copied behind) ·
    pending int32 [R] (1: promoted by a host step, its copy not landed) · host_counters int64
    [L] · host_keys int64 [max_lanes] (the last step's lanes' keys where the host computes them,
    else −1) · behind int32 [L, max_lanes, 2] and
    n_behind int32 [L] (each layer's last step's copies made behind the call: a layer of its
    own, so the copies of layer l, still running on a side stream, never read a list that layer
    l + 1's step is writing).
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
    touched: torch.Tensor | None = field(default=None)
    pf_flag: torch.Tensor | None = field(default=None)
    pf_counters: torch.Tensor | None = field(default=None)
    pf_copies: torch.Tensor | None = field(default=None)
    pf_n_copies: torch.Tensor | None = field(default=None)
    split: torch.Tensor | None = field(default=None)
    host_leave: torch.Tensor | None = field(default=None)
    pending: torch.Tensor | None = field(default=None)
    host_counters: torch.Tensor | None = field(default=None)
    host_keys: torch.Tensor | None = field(default=None)
    behind: torch.Tensor | None = field(default=None)
    n_behind: torch.Tensor | None = field(default=None)

    @property
    def prefetch(self) -> bool:
        """Whether these tables have the prefetch tables (the PREFETCH build's)."""
        return self.pf_flag is not None

    @property
    def host(self) -> bool:
        """Whether these tables have the host tables (the HOST_SPLIT build's)."""
        return self.pending is not None

    @classmethod
    def build(cls, key_of: np.ndarray, num_layers: int, num_experts: int, max_lanes: int,
              device, ring: int | None = None, prefetch: bool = False,
              host: bool = False) -> DeviceTables:
        """Tables for the placement `key_of` (from `initial_placement`), all rows unused.
        `ring`: the LRU ring's capacity (default `ring_capacity(R)`; tests pass a small one).
        `prefetch`: add the prefetch tables (zero: nothing prefetched, no tick yet).
        `host`: add the host tables (a zero split: nothing handed over until one is set)."""
        if prefetch and host:
            raise ValueError("prefetch and host are separate planner builds; pick one")
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
            n_copies=torch.zeros(1, dtype=torch.int32, device=device),
            **({} if not prefetch else dict(
                touched=torch.zeros(1, dtype=torch.int32, device=device),
                pf_flag=torch.zeros(R, dtype=torch.int32, device=device),
                pf_counters=torch.zeros(num_layers, len(PREFETCH_COUNTERS), dtype=torch.int64,
                                        device=device),
                pf_copies=torch.zeros(max_lanes, 2, dtype=torch.int32, device=device),
                pf_n_copies=torch.zeros(1, dtype=torch.int32, device=device))),
            **({} if not host else dict(
                split=torch.zeros(max_lanes + 1, dtype=torch.int32, device=device),
                host_leave=torch.zeros(1, dtype=torch.int32, device=device),
                pending=torch.zeros(R, dtype=torch.int32, device=device),
                host_counters=torch.zeros(num_layers, dtype=torch.int64, device=device),
                host_keys=torch.full((max_lanes,), -1, dtype=torch.int64, device=device),
                behind=torch.zeros(num_layers, max_lanes, 2, dtype=torch.int32, device=device),
                n_behind=torch.zeros(num_layers, dtype=torch.int32, device=device))))

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self)
                   if getattr(self, f.name) is not None)

    def to_numpy(self) -> dict:
        """Host copies of the state tables (one synchronising read each; not for the hot path).
        "order" is the ring's window read in order (`ring_order`); "ring_problems" lists what is
        wrong with the ring itself. With the prefetch tables also "touched", "prefetched" (the
        flags) and "prefetch_counters" (`ReferencePlanner.prefetch_state`'s names)."""
        head, span = (int(v) for v in self.ends.cpu())
        order, problems = ring_order(self.ring.cpu().numpy(), self.pos_of.cpu().numpy(), head, span)
        out = {"slot_of": self.slot_of.cpu().numpy(), "key_of": self.key_of.cpu().numpy(),
               "last_use": self.last_use.cpu().numpy(), "order": order,
               "ring_problems": problems, "ring_head": head, "ring_span": span,
               "clock": int(self.clock.item()), "gate": int(self.gate.item()),
               "error": int(self.error.item()), "counters": self.counters.cpu().numpy()}
        if self.prefetch:
            out.update(touched=int(self.touched.item()), prefetched=self.pf_flag.cpu().numpy(),
                       prefetch_counters=self.pf_counters.cpu().numpy())
        if self.host:
            out.update(pending=self.pending.cpu().numpy(),
                       host_counters=self.host_counters.cpu().numpy())
        return out


def launch_shape(num_rows: int, max_lanes: int) -> tuple[int, int]:
    """(threads, items) of the plan-step block: enough threads for every lane and at least 128;
    4 ring entries a thread per tile (a step usually finds its victims in the first tile; the
    rare compaction walks the whole window tile by tile). Small banks take a single tile."""
    threads = max(128, 32 * -(-max_lanes // 32))
    items = max(1, min(4, -(-num_rows // threads)))
    return threads, items


def check_layer(layer, num_layers: int) -> None:
    """Validate a layer index before it selects a table or reaches the kernel."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
            or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")


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
    The kernel's PREFETCH build when `tables` has the prefetch tables (`DeviceTables.prefetch`):
    then plan steps also keep them, and `prefetch` launches the prefetch mode. The HOST_SPLIT
    build when it has the host tables (`DeviceTables.host`): a step launched with `host=True`
    hands over what the split table (`set_split`) says, any other with an all-zero table
    (nothing handed over), and `land` clears the pending rows.
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
        self.defines = {"THREADS": self.threads, "ITEMS": self.items}
        if tables.prefetch:
            self.defines["PREFETCH"] = 1
        if tables.host:
            self.defines["HOST_SPLIT"] = 1
        # the table a step that hands nothing over reads
        self._no_split = torch.zeros_like(tables.split) if tables.host else None
        dev = self.device.index
        fn = lambda name: kernels.function("planner", name, self.defines, dev)  # noqa: E731
        self.kernels = {torch.int32: fn("plan_step_i32"), torch.int64: fn("plan_step_i64")}
        self.prefetch_kernels = {torch.int32: fn("prefetch_step_i32"),
                                 torch.int64: fn("prefetch_step_i64")} if tables.prefetch else None
        limit = _shared_mem_limit(dev)
        # planner.cu's __shared__ arrays (and the PREFETCH build's two more ints, the HOST_SPLIT
        # build's s_host [THREADS] and one int)
        static = 24 * self.threads + 4 * 64 + 8 * 6 + 12 + (8 if tables.prefetch else 0) \
            + ((4 * self.threads + 4) if tables.host else 0)
        if self.shared_mem + static > limit:
            raise ValueError(f"the plan step needs {self.shared_mem + static} bytes of shared "
                             f"memory (E={self.num_experts}, R={self.num_rows}), more than the "
                             f"device's {limit} per block")

    def __call__(self, layer: int, ids: torch.Tensor, promote: int = 0,
                 host: bool = False) -> int:
        """One plan step for `layer` on torch's current stream; returns W. No host sync.
        `promote`: the promotion cap (`Policy.promote`): at most that many of the step's misses
        take a bank row, the others are staged; 0 (default): no cap. A launch argument: a
        captured graph keeps the cap it was captured with. `host` (HOST_SPLIT build only): a
        host step (`ReferencePlanner.step_host` with the split table); else nothing is handed
        over (a hit on a pending row still is: `land` first where none may be)."""
        if isinstance(promote, bool) or not isinstance(promote, (int, np.integer)) \
                or not 0 <= promote < 2**31:
            raise ValueError(f"promote must be an int >= 0 (0: no cap), got {promote!r}")
        if host and not self.tables.host:
            raise RuntimeError("this plan step was built without the host tables "
                               "(DeviceTables.build(..., host=True))")
        return self._launch(self.kernels, layer, ids, self.tables.copies, self.tables.n_copies,
                            int(promote), host)

    def prefetch(self, layer: int, ids: torch.Tensor, max_rows: int = 0) -> int:
        """One prefetch step for `layer` (ids: its predicted experts, any shape, −1 padding; at
        most `max_rows` of its misses take rows, 0: all) on torch's current stream: fills the
        tables' pf_copies / pf_n_copies and writes none of the plan step's outputs; returns W.
        No host sync. Needs the prefetch tables."""
        if self.prefetch_kernels is None:
            raise RuntimeError("this plan step was built without the prefetch tables "
                               "(DeviceTables.build(..., prefetch=True))")
        t = self.tables
        return self._launch(self.prefetch_kernels, layer, ids, t.pf_copies, t.pf_n_copies,
                            max_rows)

    def set_split(self, split, leave: bool = False) -> None:
        """The host's share of a step's misses: split[M] of M (an int sequence of max_lanes + 1
        entries, 0 <= split[M] <= M; `cupool.hostexperts.split_table` from measured rates), and
        what becomes of them: promoted into the bank and copied behind the call, or with `leave`
        left out of it (`ReferencePlanner.step_host`). Copied to the device tables the kernel
        reads (synchronous copies: not inside a captured graph; a graph reads them at every
        replay, so a new split applies to the next replay)."""
        t = self.tables
        if not t.host:
            raise RuntimeError("this plan step was built without the host tables "
                               "(DeviceTables.build(..., host=True))")
        a = np.asarray(split)
        n = self.max_lanes + 1
        if a.dtype.kind not in "iu" or a.shape != (n,):
            raise ValueError(f"split must be {n} integers (one for each miss count 0 ... "
                             f"{self.max_lanes}), got {a.dtype} {list(a.shape)}")
        bad = np.flatnonzero((a < 0) | (a > np.arange(n)))
        if bad.size:
            raise ValueError(f"split[{bad[0]}] = {a[bad[0]]} is not in [0, {bad[0]}]")
        if not isinstance(leave, (bool, np.bool_)):
            raise ValueError(f"leave must be a bool, got {leave!r}")
        t.split.copy_(torch.from_numpy(a.astype(np.int32)))
        t.host_leave.fill_(int(leave))

    def land(self) -> None:
        """Every copy of the behind lists has landed: no row is pending (a memset on torch's
        current stream; graph-capturable). Call it after those copies, before a later step may
        need their rows as victims."""
        if not self.tables.host:
            raise RuntimeError("this plan step was built without the host tables")
        self.tables.pending.zero_()

    def _launch(self, fns: dict, layer: int, ids: torch.Tensor, copies: torch.Tensor,
                n_copies: torch.Tensor, promote: int, host: bool = False) -> int:
        check_layer(layer, self.num_layers)
        W = check_ids(ids, self.max_lanes, self.device)
        t = self.tables
        extra = (t.touched, t.pf_flag, t.pf_counters) if t.prefetch else \
            (t.split if host else self._no_split, t.host_leave, t.pending, t.host_keys,
             t.behind[layer], t.n_behind[layer:layer + 1], t.host_counters) if t.host else ()
        kernels.launch(fns[ids.dtype], 1, self.threads, (
            ids, kernels.i32(W), kernels.i32(layer), kernels.i32(self.num_experts),
            kernels.i32(self.num_rows), kernels.i32(self.staging_rows), kernels.i32(promote),
            t.slot_of, t.key_of, t.last_use, t.ring, t.pos_of, t.ends,
            kernels.i32(t.ring.numel() - 1), t.clock, t.gate, t.error, t.counters,
            t.routes, t.lane_addr, t.lane_fresh, copies, n_copies,
            kernels.i64(self.rows_base), kernels.i64(self.row_stride), *extra),
            shared_mem=self.shared_mem, device=self.device)
        return W


def _shared_mem_limit(device: int) -> int:
    attrs = _cuda.cupy().cuda.Device(device).attributes
    return int(attrs.get("MaxSharedMemoryPerBlockOptin", attrs.get("MaxSharedMemoryPerBlock", 48 << 10)))
