"""The bank: GPU rows of expert weights shared by every MoE layer, and the planner's tables.

Shape legend (ARCHITECTURE.md): L layers · E experts per layer · N rows per layer at start · R = L·N bank
rows · S staging rows · W lanes of one layer call.

One uint8 tensor `rows` [R + S, row_stride] holds the bank rows (0 … R−1) and the staging rows
(R … R+S−1); it and every table are allocated once, through torch, when the Bank is built, so their
addresses never change and a captured CUDA graph keeps working. A layer call (`step`) is two
launches on torch's current stream — the plan step (`rawkernels/planner.cu`) and the row copies
(`rawkernels/rowcopy.cu`) — with no host sync; the GEMM then reads each lane's weights at
`lane_addr`. Everything else here (open with verification, stats, errors) reads the device and
belongs outside the hot path. A Bank built with `prefetch=True` also runs prefetch steps
(`prefetch` + `copy_prefetched`: a predicted layer's experts brought in ahead of its step, with
their own copy list; `cupool.prefetch.Prefetcher` issues them on a side stream). A Bank built with
`host=True` runs host steps (`step_host`: the planner's HOST_SPLIT build hands a call's last
promoted misses to the host's CPU as `set_split` says, `copy_behind` copies their rows behind the
call, `land` ends their pending state once those copies are in; or, set_split's `leave`, its last
misses, left out of the bank: nothing behind). `promote` caps
the misses of one step that take a bank row (the rest are staged): a fixed cap, or "auto", the
pool's default (`cupool.reference.planner.default_promote`: none for a step whose lanes fit a
layer's rows).
"""

from __future__ import annotations

import numpy as np
import torch

from cupool import _cuda, kernels
from cupool.ops.planner import MAX_LANES, DeviceTables, PlanStep, check_layer
from cupool.ops.rowcopy import MODES, RowCopier
from cupool.reference.planner import (
    COUNTERS,
    PREFETCH_COUNTERS,
    PlanError,
    check_tables,
    default_promote,
    initial_placement,
)
from cupool.store import HostStore, fmt_bytes


class BankVerifyError(RuntimeError):
    """The bank's tables or rows are wrong. `problems`: table inconsistencies (strings);
    `mismatches`: dicts (row, key, layer, expert, first_diff) of rows differing from the store."""

    def __init__(self, message: str, problems: list[str], mismatches: list[dict]):
        super().__init__(message)
        self.problems, self.mismatches = problems, mismatches


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _positive_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return int(v)


def check_promote(v) -> int | str:
    """A promotion-cap setting: "auto", or an int >= 0 (0: no cap)."""
    if isinstance(v, str) and v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2**31:
        raise ValueError(f"promote must be 'auto' or an int >= 0 (0: no cap), got {v!r}")
    return int(v)


class Bank:
    """R = L·N GPU rows of the store's row size + S staging rows, and the planner tables.

    Args:
        store: the pinned HostStore holding every (layer, expert) row.
        rows_per_layer: N, bank rows per layer at build (layers grow and shrink from there).
        staging_rows: S ≥ max_lanes (with the gate closed every lane may miss and need one).
        max_lanes: largest W of one `step` (≤ 1024).
        initial: [L, N] expert ids per layer (−1: empty row); default experts 0 … N−1.
        device: CUDA device (default: the store's).
        threads, items: plan-step block shape (default `cupool.ops.planner.launch_shape`).
        ring: capacity of the plan step's LRU ring, a power of two ≥ R (default
            `cupool.ops.planner.ring_capacity`; a tight one compacts often, which tests use).
        copy_mode: the row-copy kernel (`cupool.ops.rowcopy.RowCopier` modes): "bulk" (Hopper bulk
            copies, sm_90+), "ld" (SM loads, any GPU), or "auto" (default): "bulk" where the
            kernels are built for sm_90 or newer, else "ld" (`cupool._cuda.target`, which
            CUPOOL_ARCH sets). The choice is `copy_mode` on the bank.
        copy_blocks: the copy kernel's fixed grid (default: the RowCopier default).
        prefetch: build the planner's PREFETCH variant and its tables, for `prefetch` steps
            (default False: the plain planner).
        host: build the planner's HOST_SPLIT variant and its tables, for `step_host` (default
            False; not with prefetch).
        promote: the promotion cap of a step (`Policy.promote`): at most that many of its misses
            take a bank row, the others are staged (read for that step only). 0 (default): no
            cap, every miss that finds a victim takes it; "auto": `default_promote(N, W)` for a
            step of W lanes (what a pool uses). Settable later (`bank.promote`); a captured
            graph keeps the cap of its capture.
    The gate starts closed: steps route correctly through staging but move nothing until `open()`.
    """

    def __init__(self, store: HostStore, rows_per_layer: int, staging_rows: int,
                 max_lanes: int, initial=None, device=None, *, threads: int | None = None,
                 items: int | None = None, ring: int | None = None, copy_mode: str = "auto",
                 copy_blocks: int | None = None, prefetch: bool = False,
                 promote: int | str = 0, host: bool = False):
        if not isinstance(store, HostStore):
            raise TypeError(f"store must be a cupool.HostStore, got {type(store).__name__}")
        if copy_mode not in MODES:
            raise ValueError(f"copy_mode must be one of {MODES}, got {copy_mode!r}")
        self._promote = check_promote(promote)
        if prefetch and host:
            raise ValueError("prefetch and host are separate planner builds; pick one")
        L, E = store.num_layers, store.num_experts
        N = _positive_int("rows_per_layer", rows_per_layer)
        S = _positive_int("staging_rows", staging_rows)
        W = _positive_int("max_lanes", max_lanes)
        if W > MAX_LANES:
            raise ValueError(f"max_lanes must be <= {MAX_LANES} (one lane per thread of the plan "
                             f"step's block), got {W}; wider batches take the partition path")
        if S < W:
            raise ValueError(f"staging_rows (S={S}) must be >= max_lanes ({W}): with the gate "
                             f"closed every lane of a step can miss and needs a staging row")
        if L * max(E, N) >= 2**31:
            raise ValueError(f"L*E and L*N must fit int32 keys and rows, got L={L}, E={E}, N={N}")
        key_of = initial_placement(L, E, N, initial)
        if not store.pinned:
            raise ValueError("store must be pinned (HostStore(..., pinned=True)): the bank reads "
                             "its rows through their UVA device addresses")
        _cuda.require_gpu("a Bank")
        idx = _cuda.device_index(store.device if device is None else device)
        dev = torch.device("cuda", idx)

        self.store = store
        self.num_layers, self.num_experts, self.rows_per_layer = L, E, N
        self.num_rows, self.staging_rows, self.max_lanes = L * N, S, W
        self.row_bytes, self.row_stride = store.row_bytes, store.row_stride
        self.device = dev
        self.initial_key_of = key_of
        self.rows = torch.zeros((self.num_rows + S, self.row_stride), dtype=torch.uint8,
                                device=dev)
        self.tables = DeviceTables.build(key_of, L, E, W, dev, ring=ring, prefetch=bool(prefetch),
                                         host=bool(host))
        t = self.tables
        self.slot_of, self.key_of, self.last_use = t.slot_of, t.key_of, t.last_use
        self.ring, self.pos_of, self.ring_ends = t.ring, t.pos_of, t.ends
        self.clock, self.gate, self.error, self.counters = t.clock, t.gate, t.error, t.counters
        self.routes, self.lane_addr, self.lane_fresh = t.routes, t.lane_addr, t.lane_fresh
        self.copies, self.n_copies = t.copies, t.n_copies
        self.src_of_key = store.address_table(idx)
        self._plan = PlanStep(t, L, E, S, self.rows, threads=threads, items=items)
        self._copy_stream = None   # step_split's, made on first use
        # the step's row copies; an attribute, so that another grid can replace it before capture
        self.copier = RowCopier(self.src_of_key, self.row_bytes, self.rows, W, mode=copy_mode,
                                blocks=copy_blocks)
        # the prefetch's copies run beside the step's kernels, not on its critical path: the same
        # launcher by default, replaceable in the same way
        self.prefetch_copier = self.copier if prefetch else None
        # a host step's behind copies: the same launcher, on the stream copy_behind is given
        self.behind_copier = self.copier if host else None
        self._compare = kernels.function("planner", "compare_rows", self._plan.defines, idx)
        owned = np.flatnonzero(key_of >= 0)
        if owned.size:
            fill = torch.from_numpy(np.stack([key_of[owned], owned], 1).astype(np.int32)).to(dev)
            RowCopier(self.src_of_key, self.row_bytes, self.rows, owned.size)(
                fill, torch.tensor([owned.size], dtype=torch.int32, device=dev))

    @property
    def plan_block(self) -> tuple[int, int]:
        """(threads, items) of the plan-step launch (one block)."""
        return self._plan.threads, self._plan.items

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream `step_split` copies on (None before its first call)."""
        return self._copy_stream

    @property
    def prefetching(self) -> bool:
        """Whether this bank runs prefetch steps (built with `prefetch=True`)."""
        return self.tables.prefetch

    @property
    def hosting(self) -> bool:
        """Whether this bank runs host steps (built with `host=True`)."""
        return self.tables.host

    @property
    def promote(self) -> int | str:
        """The promotion-cap setting: an int (0: no cap) or "auto" (`promotion_cap`)."""
        return self._promote

    @promote.setter
    def promote(self, v) -> None:
        self._promote = check_promote(v)

    def promotion_cap(self, lanes: int) -> int:
        """The cap a step of `lanes` lanes launches with (0: none)."""
        if self._promote == "auto":
            return default_promote(self.rows_per_layer, int(lanes))
        return self._promote

    def _cap(self, ids) -> int:
        return self.promotion_cap(ids.numel()) if isinstance(ids, torch.Tensor) else 0

    @property
    def copy_mode(self) -> str:
        """The row-copy kernel in use: "bulk" or "ld" ("auto" resolved for the target)."""
        return self.copier.mode

    @property
    def copy_grid(self) -> tuple[int, int]:
        """(blocks, threads) of the row-copy launch (fixed at build)."""
        return self.copier.blocks, self.copier.threads

    # --- the hot path --------------------------------------------------------------------------
    def plan(self, layer: int, ids: torch.Tensor) -> int:
        """Plan step only (fills routes, lane_addr, copies, n_copies); returns W."""
        return self._plan(layer, ids, self._cap(ids))

    def copy_rows(self) -> None:
        """Copy the rows listed by the last plan step (fixed grid; length read on the device)."""
        self.copier(self.copies, self.n_copies)

    def step(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer call: plan + copy on torch's current stream, no host sync, graph-capturable.

        ids: int32/int64 CUDA tensor of any shape with W = numel ≤ max_lanes (−1 padding).
        Returns views (routes int32 [W], lane_addr int64 [W]) of buffers that the next call
        overwrites: the physical row of each lane (−1 padding) and its device address (0 padding).
        """
        W = self._plan(layer, ids, self._cap(ids))
        self.copier(self.copies, self.n_copies)
        return self.routes[:W], self.lane_addr[:W]

    def prefetch(self, layer: int, ids: torch.Tensor, max_rows: int = 0) -> int:
        """Prefetch step for `layer` (`ReferencePlanner.prefetch`): `ids` (int32/int64 CUDA, any
        shape, W ≤ max_lanes, −1 padding) are its predicted experts; the misses (the first
        `max_rows` of them; 0: all) take eligible victims and fill the prefetch copy list
        (`tables.pf_copies`, `tables.pf_n_copies`), which `copy_prefetched` copies. Writes none
        of the plan step's outputs, so a GEMM reading the last step's `lane_addr` and that
        step's row copies may run beside it. Returns W; no host sync; graph-capturable. Nothing
        may plan (a step or another prefetch) until its copies have landed."""
        return self._plan.prefetch(layer, ids, _positive_int("max_rows", max_rows, 0))

    def copy_prefetched(self, stream: torch.cuda.Stream | None = None) -> None:
        """Copy the rows listed by the last prefetch step (the row-copy kernel, fixed grid, the
        list's length read on the device) on `stream` (default: torch's current stream)."""
        t = self.tables
        if not t.prefetch:
            raise RuntimeError("this bank was built without prefetch (Bank(..., prefetch=True))")
        self.prefetch_copier(t.pf_copies, t.pf_n_copies, stream=stream)

    def set_split(self, split, leave: bool = False) -> None:
        """The host's share of each step's misses (`PlanStep.set_split`: split[M] of M, max_lanes
        + 1 entries), promoted and copied behind the call or, with `leave`, left out of the bank.
        Outside graph capture; captured graphs read the tables at every replay."""
        self._plan.set_split(split, leave)

    def step_host(self, layer: int, ids: torch.Tensor):
        """One layer call whose last promoted misses the host computes (`ReferencePlanner.
        step_host`): plan, then the copies the GEMM needs, on torch's current stream; no host
        sync, graph-capturable.

        Returns views (routes int32 [W], lane_addr int64 [W], host_keys int64 [W]) of buffers the
        next call overwrites: the host's lanes route −1 (lane_addr 0) and carry their key in
        host_keys (else −1), what `cupool.ops.host_handoff.post` hands the host. The host
        misses' rows are promoted and pending; `copy_behind(layer)` copies them (before this
        layer's next host step, which rewrites its list), and `land` must follow those copies
        before a later step could need a pending row as a victim. With set_split's `leave` the
        host's misses take no row and the behind list is empty."""
        out = self.plan_host(layer, ids)
        self.copy_rows()
        return out

    def plan_host(self, layer: int, ids: torch.Tensor):
        """`step_host` without its copies: the plan alone, on torch's current stream. The host's
        keys are known once it has run, so the request can be posted to the host before
        `copy_rows` starts the link's copies and the two run side by side."""
        t = self.tables
        if not t.host:
            raise RuntimeError("this bank was built without host steps (Bank(..., host=True))")
        W = self._plan(layer, ids, self._cap(ids), host=True)
        return self.routes[:W], self.lane_addr[:W], t.host_keys[:W]

    def copy_behind(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Copy the rows layer `layer`'s last host step promoted for the host (that layer's behind
        list; fixed grid, the length read on the device) on `stream` (default: torch's current
        stream). Each layer has a list of its own, so these copies may still run while later
        layers' steps plan; the list is rewritten by the layer's next host step."""
        t = self.tables
        if not t.host:
            raise RuntimeError("this bank was built without host steps (Bank(..., host=True))")
        check_layer(layer, self.num_layers)
        self.behind_copier(t.behind[layer], t.n_behind[layer:layer + 1], stream=stream)

    def land(self) -> None:
        """The behind copies have landed: no row is pending (a memset on torch's current stream;
        graph-capturable)."""
        self._plan.land()

    def step_split(self, layer: int, ids: torch.Tensor):
        """`step` with the copies on the bank's copy stream, so work on the rows already in place
        can run while they land. Graph-capturable (the copy stream forks from and joins torch's
        current stream).

        Returns (routes, lane_addr, lane_fresh, join): lane_fresh int32 [W] is 1 where the lane's
        row is among this step's copies; `join()` makes the current stream wait for them and
        must be called before anything reads a fresh row and before the next step (the copy
        list is reused). The copies only write rows no lane of this step reads in place (victims
        are never rows used this step; staging rows belong to this step's misses).
        """
        W = self._plan(layer, ids, self._cap(ids))
        cur = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        side = self._copy_stream
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            self.copier(self.copies, self.n_copies)
        return self.routes[:W], self.lane_addr[:W], self.lane_fresh[:W], \
            lambda: cur.wait_stream(side)

    # --- gate ------------------------------------------------------------------------------------
    def open(self, verify: bool = True, sample: int | None = 64) -> None:
        """Open the gate (a device scalar: captured graphs see it). With `verify`, first check the
        tables and `sample` bank rows (None: all) against the store; raises BankVerifyError.
        Call it outside graph capture: the captured graph reads the gate, it must not set it."""
        if _capturing():
            raise RuntimeError("Bank.open() during CUDA graph capture would record the gate write "
                               "into the graph; open the gate before or after capture")
        if verify:
            self.verify(sample)
        self.gate.fill_(1)

    def close(self) -> None:
        """Close the gate: later steps stage their misses and leave the placement alone."""
        if _capturing():
            raise RuntimeError("Bank.close() during CUDA graph capture would record the gate write "
                               "into the graph; close the gate before or after capture")
        self.gate.fill_(0)

    # --- checks and statistics (host reads; outside the hot path) -------------------------------
    def state(self) -> dict:
        """Host copies of the tables (keys as `ReferencePlanner.state()`)."""
        return self.tables.to_numpy()

    def verify(self, sample: int | None = None, generator: np.random.Generator | None = None) -> int:
        """Check the tables (owned rows ↔ keys a bijection, last_use ≤ clock, the LRU ring's
        window holds every row once, sorted, at its pos_of) and compare bank rows with their
        store rows byte for byte on the GPU: all owned rows, or a random `sample` of them.
        Returns the number of rows compared; raises BankVerifyError."""
        if _capturing():
            raise RuntimeError("Bank.verify() reads the tables back to the host; call it outside "
                               "CUDA graph capture")
        st = self.state()
        L, E = self.num_layers, self.num_experts
        problems = st["ring_problems"] + check_tables(
            L * E, st["slot_of"], st["key_of"], st["last_use"], st["clock"], st["order"])
        if "touched" in st:                 # the prefetch tables
            last = int((st["last_use"] == st["clock"]).sum()) if st["clock"] else 0
            if st["touched"] != last:
                problems.append(f"touched = {st['touched']}, but {last} rows were stamped at "
                                f"clock {st['clock']}")
            empty = np.flatnonzero((st["prefetched"] != 0) & (st["key_of"] < 0))
            problems += [f"row {r} is marked prefetched but holds no key" for r in empty[:8]]
        if "pending" in st:                 # the host tables
            empty = np.flatnonzero((st["pending"] != 0) & (st["key_of"] < 0))
            problems += [f"row {r} is pending but holds no key" for r in empty[:8]]
        key_of = st["key_of"]
        rows = np.flatnonzero((key_of >= 0) & (key_of < L * E))
        if sample is not None and sample < rows.size:
            rng = generator if generator is not None else np.random.default_rng()
            rows = np.sort(rng.choice(rows, size=int(sample), replace=False))
        mismatches = []
        if rows.size:
            pairs = torch.from_numpy(np.stack([key_of[rows], rows], 1).astype(np.int32))
            pairs = pairs.to(self.device)
            first_diff = torch.full((rows.size,), self.row_bytes, dtype=torch.int64,
                                    device=self.device)
            kernels.launch(self._compare, min(int(rows.size), 1024), 256, (
                self.src_of_key, pairs, kernels.i32(rows.size), self.rows,
                kernels.i64(self.row_stride), kernels.i64(self.row_bytes), first_diff),
                device=self.device)
            diff = first_diff.cpu().numpy()
            for i in np.flatnonzero(diff < self.row_bytes):
                r, k = int(rows[i]), int(key_of[rows[i]])
                mismatches.append({"row": r, "key": k, "layer": k // E, "expert": k % E,
                                   "first_diff": int(diff[i])})
        if problems or mismatches:
            lines = [f"bank verification failed ({len(problems)} table problem(s), "
                     f"{len(mismatches)} of {rows.size} rows differ from the host store)"]
            lines += [f"  table: {p}" for p in problems[:16]]
            lines += [f"  row {m['row']} (layer {m['layer']}, expert {m['expert']}): first "
                      f"difference at byte {m['first_diff']}" for m in mismatches[:16]]
            raise BankVerifyError("\n".join(lines), problems, mismatches)
        return int(rows.size)

    def holds_every_expert(self) -> bool:
        """Whether every (layer, expert) owns a bank row (N ≥ E and no key without a row; a host
        read of slot_of). Then no lookup misses, nothing is evicted, and each expert's row
        address stays where it is."""
        return self.rows_per_layer >= self.num_experts and bool((self.slot_of >= 0).all())

    def read_error(self) -> PlanError:
        """The sticky error flags (a host read of the device scalar)."""
        return PlanError(int(self.error.item()))

    def clear_error(self) -> None:
        self.error.zero_()

    def reset_stats(self) -> None:
        self.counters.zero_()
        if self.tables.prefetch:
            self.tables.pf_counters.zero_()
        if self.tables.host:
            self.tables.host_counters.zero_()

    def stats(self) -> tuple[list[dict], str]:
        """Per-layer counters (counted while the gate is open) and rows owned now: a list of dicts
        (layer, hits, misses, hit_rate, promotions, steals, staged, rows_owned, bytes_copied;
        a prefetching bank adds prefetched, prefetch_used, prefetch_wasted and bytes_prefetched;
        a host-step bank adds host, the unique ids handed to the host) and the same as a
        formatted table."""
        c = self.counters.cpu().numpy()
        pf = self.tables.pf_counters.cpu().numpy() if self.tables.prefetch else None
        hc = self.tables.host_counters.cpu().numpy() if self.tables.host else None
        key_of = self.key_of.cpu().numpy()
        owned = np.bincount(key_of[key_of >= 0] // self.num_experts, minlength=self.num_layers)
        table = []
        for layer in range(self.num_layers):
            d = {name: int(c[layer, i]) for i, name in enumerate(COUNTERS)}
            looked_up = d["hits"] + d["misses"]
            table.append({"layer": layer, **d,
                          "hit_rate": d["hits"] / looked_up if looked_up else float("nan"),
                          "rows_owned": int(owned[layer]),
                          "bytes_copied": (d["promotions"] + d["staged"]) * self.row_bytes})
            if pf is not None:
                table[-1].update({name: int(pf[layer, i])
                                  for i, name in enumerate(PREFETCH_COUNTERS)},
                                 bytes_prefetched=int(pf[layer, 0]) * self.row_bytes)
            if hc is not None:
                table[-1]["host"] = int(hc[layer])
        head = (f"{'layer':>5} {'hits':>10} {'misses':>10} {'hit rate':>8} {'promotions':>10} "
                f"{'steals':>8} {'staged':>8} {'rows':>6} {'copied':>11}")
        lines = [head]
        for d in table:
            lines.append(f"{d['layer']:>5} {d['hits']:>10} {d['misses']:>10} {d['hit_rate']:>8.3f} "
                         f"{d['promotions']:>10} {d['steals']:>8} {d['staged']:>8} "
                         f"{d['rows_owned']:>6} {fmt_bytes(d['bytes_copied']):>11}")
        tot = {k: sum(d[k] for d in table) for k in (*COUNTERS, "rows_owned", "bytes_copied")}
        looked_up = tot["hits"] + tot["misses"]
        rate = tot["hits"] / looked_up if looked_up else float("nan")
        lines.append(f"{'all':>5} {tot['hits']:>10} {tot['misses']:>10} {rate:>8.3f} "
                     f"{tot['promotions']:>10} {tot['steals']:>8} {tot['staged']:>8} "
                     f"{tot['rows_owned']:>6} {fmt_bytes(tot['bytes_copied']):>11}")
        if pf is not None:
            n = pf.sum(axis=0)
            lines.append(f"prefetch: {n[0]} rows ({fmt_bytes(int(n[0]) * self.row_bytes)}), "
                         f"{n[1]} used, {n[2]} wasted (evicted unused), "
                         f"{n[0] - n[1] - n[2]} waiting")
        if hc is not None:
            lines.append(f"host: {int(hc.sum())} experts computed on the host's CPU")
        return table, "\n".join(lines)

    def memory_parts(self) -> list[tuple[str, int, str]]:
        """What the bank holds, for `cupool.report` (the store's address table counts as a table)."""
        return [("bank", self.num_rows * self.row_stride, "gpu"),
                ("staging", self.staging_rows * self.row_stride, "gpu"),
                ("planner tables", self.tables.nbytes() + self.src_of_key.nbytes, "gpu"),
                ("host store", self.store.nbytes, "host")]

    def __repr__(self) -> str:
        return (f"Bank(L={self.num_layers}, E={self.num_experts}, N={self.rows_per_layer}, "
                f"R={self.num_rows}, S={self.staging_rows}, max_lanes={self.max_lanes}, "
                f"row={fmt_bytes(self.row_bytes)}, {self.device}"
                f"{', prefetch' if self.tables.prefetch else ''}"
                f"{', host' if self.tables.host else ''}"
                f"{f', promote={self._promote}' if self._promote else ''})")
