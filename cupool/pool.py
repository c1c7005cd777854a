"""`Pool`: the handle `cupool.wrap` returns — store, bank, GEMM and the swapped layers.

Shape legend (ARCHITECTURE.md): L MoE layers · E experts · K top-k · N rows per layer.

The gate starts closed (warm-up and graph capture must not move the placement); `open()` opens
it. `stats_table()` and `report()` say what the pool did and holds; `unwrap()` undoes the swap.
`enable_prefetch()` turns on prefetch in decode calls (`cupool.prefetch`; off by default).
`enable_host_experts()` hands some of each decode call's misses to the host's CPU
(`cupool.layer.HostDecode`; off by default).
`promote` caps the misses of one decode call that take a bank row ("auto" by default: a cap once
the call's lanes exceed a layer's rows, i.e. several sequences decoded together).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from cupool import swap
from cupool.adapters import MoELayerSpec
from cupool.bank import Bank
from cupool.budget import MemoryReport, report
from cupool.gemm import MoEGemm, ScratchLists
from cupool.hosttable import is_host_table
from cupool.layer import (
    HostDecode,
    PooledExperts,
    check_host_settings,
    check_prefill_settings,
    prefill_ahead_default,
)
from cupool.layout import RowLayout, unpack_bias, unpack_row
from cupool.nvfp4 import dequantize
from cupool.prefetch import Prefetcher, RouterPredictor, check_max_rows
from cupool.reference.planner import PlanError
from cupool.store import HostStore, fmt_bytes


class Pool:
    """The handle `wrap()` returns: store, bank, GEMM and the swapped layers."""

    def __init__(self, model, specs: list[MoELayerSpec], layout: RowLayout, store: HostStore,
                 bank: Bank, gemm: MoEGemm, device: torch.device, route_fn=None):
        self.model, self.specs, self.layout = model, specs, layout
        self.store, self.bank, self.gemm, self.device = store, bank, gemm, device
        self.num_layers, self.num_experts = store.num_layers, store.num_experts
        self.top_k = specs[0].top_k
        self.rows_per_layer = bank.rows_per_layer
        self.layers = [PooledExperts(self, i) for i in range(len(specs))]
        self._route_fn = route_fn
        self._restore: list = []
        self._routing_hook = None
        self._decode_backend = None
        # None, or a bool device tensor [T]: which tokens of a decode call are real (the others'
        # lanes become padding: no expert reads, no placement change). cupool.Engine sets it to
        # its active slots around each batched decode step.
        self.token_mask: torch.Tensor | None = None
        # True while a prompt is prefilled (`prefilling()`): every layer call takes the partition
        # path, whatever its width, so prompts never move the placement nor count as hits/misses.
        self.prefill_only = False
        # prefill ahead: while prefilling, a call whose lanes cover nearly every expert copies
        # every expert not in the bank by the copy engine, from lists worked out on the host
        # (`scratch_lists`), and issues the next layer's first scratch copies before it returns,
        # so the copy stream works through the layer boundary (`cupool.layer.prefill_plan`).
        # Default from CUPOOL_PREFILL_AHEAD ("1" or unset on; "0" off).
        self.prefill_ahead = prefill_ahead_default()
        # while prefilling: which experts own a bank row ([L, E] bool, read from the device once
        # a prefill) and the `ScratchLists` made from it, per layer
        self._prefill_resident: np.ndarray | None = None
        self._prefill_lists: dict[tuple[int, int], ScratchLists] = {}   # (layer, host experts)
        self._prefill_masks: dict[int, tuple] = {}   # tokens: host_prefill_mask's (device, pinned)
        # decode: copies on a second stream beside the GEMM of the rows in place. Off by default:
        # with the one-launch decode GEMM it bought ~1% at a half-size bank and cost ~10% with
        # every expert resident on an H200 (the second launch; docs/PERFORMANCE.md).
        self.overlap_copies = False
        # None, or the Prefetcher of decode calls (`enable_prefetch`): after layer l's plan step,
        # layer l + 1's predicted experts are brought in on a side stream. Off by default: it
        # pays only where its copies hide under compute and the predictor is right often enough
        # (docs/PERFORMANCE.md; bench_decode --modes pool-prefetch); keep it off where it loses.
        self.prefetcher: Prefetcher | None = None
        # None, or the host's CPU share of decode calls (`enable_host_experts`): a call's last
        # promoted misses computed on the host's cores while their rows are copied behind.
        # Off by default: what it gives depends on the host's cores and the link
        # (docs/PERFORMANCE.md, "Experts on the host's CPU").
        self.host: HostDecode | None = None
        # True inside `plain_decode()`: decode calls take the plain step with host experts on
        self.plain = False
        # True while the decode step last run (or captured) skips the plan step: the fused step
        # on a bank that holds every expert (`cupool.fused`; CUPOOL_SKIP_PLAN=0 keeps the plan
        # step). Its lookups all hit by construction, and the bank's counters do not advance.
        self.plan_skipped = False

    # --- hooks --------------------------------------------------------------------------------
    @property
    def routing_hook(self):
        """None, or fn(layer, ids [T, K]) -> ids [T, K], called by every pooled layer before it
        plans: it may observe the router's choice (`cupool.replay.Recorder`) or replace it
        (`cupool.replay.Replayer`, which feeds a routing trace). Inside a captured graph it must
        stay on the device (no host reads). The router's weights are kept either way."""
        return self._routing_hook

    @routing_hook.setter
    def routing_hook(self, fn) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"routing_hook must be callable or None, got {type(fn).__name__}")
        self._routing_hook = fn

    @property
    def decode_backend(self):
        """None, or fn(layer, x [T, H], ids [T, K], weights [T, K]) -> out [T, H] computing the
        decode calls (T·K ≤ the bank's lanes) instead of the bank and the decode GEMM, so a
        comparison (e.g. every expert read from host memory) runs the same model and routing.
        Prefill calls keep the partition path."""
        return self._decode_backend

    @decode_backend.setter
    def decode_backend(self, fn) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"decode_backend must be callable or None, got {type(fn).__name__}")
        self._decode_backend = fn

    # --- install / uninstall ------------------------------------------------------------------
    def _install(self) -> None:
        self._restore = swap.install(self.specs, self.layers, self._route_fn)

    def unwrap(self, *, restore_weights: bool = True) -> None:
        """Undo the swap. With `restore_weights`, each experts module gets back its weights as
        the dequantized NVFP4 values (the original bf16 weights were released at wrap time), on
        the pool's device in the model's dtype. The store and bank are freed."""
        self.disable_prefetch()
        self.disable_host_experts()
        swap.uninstall(self._restore)
        if restore_weights:
            for spec in self.specs:
                mats = [unpack_row(self.layout, self.store.row(spec.index, e))
                        for e in range(self.num_experts)]
                deq = [tuple(None if q is None else dequantize(q).to(spec.dtype) for q in trio)
                       for trio in mats]
                biases = None
                if self.layout.bias:
                    per = [unpack_bias(self.layout, self.store.row(spec.index, e))
                           for e in range(self.num_experts)]
                    biases = tuple(torch.stack([b[i] for b in per]) for i in range(3))
                spec.restore(deq, self.device, biases)
        self.bank = None
        self.gemm = None
        self.store.close()

    def resize_bank(self, rows: int, *, prefetch: bool | None = None,
                    host: bool | None = None) -> None:
        """Replace the bank by one of `rows` rows per layer (initial placement, gate closed,
        counters zero). The old bank's memory is released first. Any captured graph that used the
        old bank must be captured again. `prefetch` / `host`: build the planner's prefetch or
        host variant (None: as the old bank). Host experts in use are turned off."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not self.top_k <= rows <= self.num_experts:
            raise ValueError(f"rows must be an int with top_k={self.top_k} <= rows <= "
                             f"E={self.num_experts}, got {rows!r}")
        max_lanes, staging = self.bank.max_lanes, self.bank.staging_rows
        promote = self.bank.promote
        prefetch = self.bank.prefetching if prefetch is None else bool(prefetch)
        host = self.bank.hosting if host is None else bool(host)
        self.join_prefetch()
        self.disable_host_experts()
        self.bank = None
        torch.cuda.empty_cache()
        self.bank = Bank(self.store, rows, staging_rows=staging, max_lanes=max_lanes,
                         device=self.device, prefetch=prefetch, promote=promote, host=host)
        self.rows_per_layer = rows
        if self.prefetcher is not None:
            self.prefetcher.bank = self.bank

    # --- policy -------------------------------------------------------------------------------
    @property
    def promote(self) -> int | str:
        """The cap on a decode call's promotions (misses that take a bank row; the others are
        staged: read for that call only). "auto" (default): none while the call's lanes (T·K)
        fit a layer's rows, a quarter of a layer's rows once they do not
        (`cupool.reference.planner.default_promote`): several sequences decoded together then
        ask for more experts a token than the bank holds, and uncapped LRU would evict every row
        before its next use. An int: that cap for every call; 0: no cap. Set it before graph
        capture (`cupool.Engine` captures on its first step): a captured graph keeps the cap of
        its capture."""
        return self.bank.promote

    @promote.setter
    def promote(self, v) -> None:
        self.bank.promote = v

    # --- prefetch -----------------------------------------------------------------------------
    def enable_prefetch(self, predictor=None, *, top_k: int | None = None,
                        track_accuracy: bool = False, max_rows: int | None = None) -> Prefetcher:
        """Turn prefetch on for decode calls (`cupool.prefetch`): after layer l's plan step, layer
        l + 1's predicted experts are brought into the bank on a side stream, joined before the
        next plan step; captured graphs include it. `predictor`: fn(layer, hidden [T, H]) -> ids
        [T, K'] (default `RouterPredictor`: layer l + 1's router on layer l's MoE input, top
        `top_k`, default K). `track_accuracy`: count how often predictions are right
        (`Prefetcher.accuracy`; a few more launches a layer). `max_rows`: at most that many
        rows a prefetch brings in (`Prefetcher`; None: every predicted expert without a row). A
        bank without the planner's prefetch variant is rebuilt with it first (as `resize_bank`:
        placement reset, gate closed): call this before warm-up and capture. Returns the
        Prefetcher."""
        if predictor is not None and not callable(predictor):
            raise TypeError(f"predictor must be callable or None, got {type(predictor).__name__}")
        check_max_rows(max_rows)
        predict = predictor if predictor is not None else RouterPredictor(self.specs, top_k)
        if not self.bank.prefetching:
            self.resize_bank(self.rows_per_layer, prefetch=True)
        self.disable_prefetch()
        self.prefetcher = Prefetcher(self.bank, predict, track_accuracy=track_accuracy,
                                     max_rows=max_rows)
        return self.prefetcher

    def disable_prefetch(self) -> None:
        """Turn prefetch off (the bank keeps its planner variant, which plans alike without
        prefetches). Captured graphs that prefetch must be captured again."""
        if self.prefetcher is not None:
            self.prefetcher.join()
            self.prefetcher = None

    def prefetch(self, layer: int, hidden: torch.Tensor,
                 token_mask: torch.Tensor | None = None) -> None:
        """For a decode step of its own: prefetch `layer`'s predicted experts from `hidden`
        [T, H], the previous MoE layer's input, right after that layer's plan step
        (`Prefetcher.issue`). Call `join_prefetch` before the next plan step."""
        if self.prefetcher is None:
            raise RuntimeError("prefetch is off for this pool: call Pool.enable_prefetch() first")
        self.prefetcher.issue(layer, hidden, token_mask)

    # --- the host's CPU ----------------------------------------------------------------------
    def enable_host_experts(self, tokens: int = 1, *, threads: int | None = None,
                            link_us: float | None = None, cpu_us: float | None = None,
                            cpu_call_us: float | None = None, handoff_us: float = 10.0,
                            leave: bool = False, min_misses: int | None = None,
                            prefill_tokens: int = 0, prefill_costs=None,
                            prefill_link_us: float | None = None) -> HostDecode:
        """Hand some of each decode call's misses to the host's CPU (`HostDecode`): the plan
        step's last promoted misses, as many as make the link and the CPU finish together
        (`cupool.hostexperts.split_table` from a row's time on each and a host call's own
        time `cpu_call_us`, measured here unless given, and the hand-off's `handoff_us`),
        computed by `threads` host threads (default `cupool.hostexperts.default_threads()`)
        while the link copies the others, their rows copied behind the call (with `leave`: the
        host's misses are left out of the bank, nothing copied); calls of fewer than
        `min_misses` misses (None: top_k + 1, so one token's calls) hand nothing over. Steps
        whose calls cannot hand anything over run as plain steps (`HostDecode.hands_over`,
        `plain_decode`: the Engine picks the step's graph by its active slots). Decode calls must
        then have `tokens` tokens (the Engine's slots). With `prefill_tokens` > 0 the host also
        computes some experts without a bank row of prompt prefill calls of up to that many
        tokens (`HostDecode`'s prefill_tokens, prefill_costs and prefill_link_us: a short turn
        after a reused prefix). Not with prefetch. A bank without the planner's host variant is rebuilt with it
        first (as `resize_bank`: placement reset, gate closed): call this before warm-up and
        capture. Returns the HostDecode."""
        if self.prefetcher is not None or self.bank.prefetching:
            raise RuntimeError("host experts and prefetch are separate planner builds: "
                               "disable prefetch and rebuild the bank (resize_bank(..., "
                               "prefetch=False)) first")
        check_host_settings(leave, cpu_call_us, min_misses)     # before the bank is rebuilt
        check_prefill_settings(prefill_tokens, prefill_costs, self.gemm.max_prefill_tokens,
                               prefill_link_us)
        self.disable_host_experts()
        if not self.bank.hosting:
            self.resize_bank(self.rows_per_layer, host=True)
        self.host = HostDecode(self, tokens, threads=threads, link_us=link_us, cpu_us=cpu_us,
                               cpu_call_us=cpu_call_us, handoff_us=handoff_us, leave=leave,
                               min_misses=min_misses, prefill_tokens=prefill_tokens,
                               prefill_costs=prefill_costs, prefill_link_us=prefill_link_us)
        return self.host

    def disable_host_experts(self) -> None:
        """Turn the host's share off (the bank keeps its planner variant, whose plain steps hand
        nothing over). Captured graphs that post to the host must be captured again."""
        if self.host is not None:
            self.host.close()
            self.host = None

    @contextlib.contextmanager
    def plain_decode(self):
        """Inside: decode calls take the plain step even with host experts on (no hand-off
        launches). For steps whose calls cannot hand the host anything (`HostDecode.hands_over`):
        a host step lands its behind copies at the last layer, so no row is pending between
        steps and either kind of step may follow the other."""
        before, self.plain = self.plain, True
        try:
            yield
        finally:
            self.plain = before

    def join_prefetch(self) -> None:
        """Make torch's current stream wait for the prefetch in flight, if any."""
        if self.prefetcher is not None:
            self.prefetcher.join()

    # --- gate, checks, stats ------------------------------------------------------------------
    @contextlib.contextmanager
    def prefilling(self):
        """Inside: layer calls are prompt prefill (the partition path, placement untouched),
        even when they are narrow enough for the decode path. The engine admits requests in it,
        so the bank and its counters follow decode steps alone. Leaving it forgets any scratch
        copies issued ahead (`prefill_ahead`)."""
        before, self.prefill_only = self.prefill_only, True
        try:
            yield
        finally:
            self.prefill_only = before
            if not before:               # the placement may move again: lists made from it go
                self._prefill_resident, self._prefill_lists = None, {}
                self._prefill_masks = {}
            if self.gemm is not None:
                self.gemm.drop_ahead()   # copies issued ahead are for this prefill's calls only

    def scratch_lists(self, layer: int, host: int = 0) -> ScratchLists:
        """`ScratchLists` of `layer`'s prefill calls (prefill ahead), made from the placement,
        which is read from the device once a prefill (a host read: the first call waits for
        the work queued before it) and cannot move until it ends; with `host` > 0, without
        the `host` experts the host's CPU computes instead (`host_prefill_experts`). Only while
        prefilling."""
        if not self.prefill_only:
            raise RuntimeError("scratch lists follow the placement only while the pool is "
                               "prefilling (Pool.prefilling())")
        key = (layer, int(host))
        lists = self._prefill_lists.get(key)
        if lists is None:
            resident = self.prefill_resident(layer)
            if host:
                resident = resident.copy()
                resident[self.host_prefill_experts(layer, host)] = True
            lists = self.gemm.scratch_lists(layer, resident, self.store.host_addresses())
            self._prefill_lists[key] = lists
        return lists

    def prefill_resident(self, layer: int) -> np.ndarray:
        """bool [E]: `layer`'s experts with a bank row, read once a prefill (as `scratch_lists`).
        Only while prefilling."""
        if self._prefill_resident is None:
            E = self.num_experts
            self._prefill_resident = (self.bank.slot_of[:self.num_layers * E] >= 0) \
                .reshape(self.num_layers, E).cpu().numpy()
        return self._prefill_resident[layer]

    def host_prefill_experts(self, layer: int, count: int) -> np.ndarray:
        """The `count` experts of `layer` the host computes in a prefill call with host experts
        (`HostDecode.prefill_share`): the last `count` experts without a bank row, in expert
        order, i.e. those the scratch would take last, so the link's copies end that much
        sooner and the first chunks (and the ones issued ahead) are as without the host."""
        missing = np.flatnonzero(~self.prefill_resident(layer))
        if not 0 < count <= missing.size:
            raise ValueError(f"layer {layer}: count must be in [1, {missing.size}] (its experts "
                             f"without a bank row), got {count}")
        return missing[missing.size - count:]

    def host_prefill_mask(self, tokens: int) -> torch.Tensor:
        """bool [L, E] on the pool's device: the experts the host computes in prefill calls of
        `tokens` tokens (`host_prefill_experts` of each layer's `host_prefill_share`), made
        once a prefill from pinned memory without waiting for the device. Only while
        prefilling."""
        made = self._prefill_masks.get(int(tokens))
        if made is None:
            cpu = torch.zeros(self.num_layers, self.num_experts, dtype=torch.bool).pin_memory()
            for layer in range(self.num_layers):
                share = self.host_prefill_share(layer, tokens)
                if share:
                    cpu[layer, torch.from_numpy(self.host_prefill_experts(layer, share))] = True
            # the pinned source is kept with its copy
            made = self._prefill_masks[int(tokens)] = (cpu.to(self.device, non_blocking=True), cpu)
        return made[0]

    def host_prefill_share(self, layer: int, tokens: int) -> int:
        """How many of `layer`'s experts without a bank row the host computes in a prefill call
        of `tokens` tokens: 0 without host experts or where the split gives the host nothing.
        Only while prefilling."""
        if self.host is None:
            return 0
        return self.host.prefill_share(tokens, int((~self.prefill_resident(layer)).sum()))

    def open(self, verify: bool = True, sample: int | None = 64) -> None:
        """Open the gate (placement starts following the routing). Verifies tables and `sample`
        bank rows against the host store first."""
        self.bank.open(verify=verify, sample=sample)

    def close(self) -> None:
        self.bank.close()

    def verify(self, sample: int | None = None) -> int:
        """Tables form a bijection and bank rows equal the host store; returns rows checked."""
        return self.bank.verify(sample)

    def stats(self) -> list[dict]:
        """Per layer: hits, misses, hit rate, promotions, staged, rows owned, bytes copied, and
        plan_skipped (`plan_skipped`: the hit rate is then 1.0 by construction, the counters
        count only the calls that did plan)."""
        table = self.bank.stats()[0]
        for d in table:
            d["plan_skipped"] = self.plan_skipped
            if self.plan_skipped:
                d["hit_rate"] = 1.0
        return table

    def hit_rate(self, table: list[dict] | None = None) -> float:
        """Hits / lookups of the decode calls over every layer since the counters were reset:
        1.0 by construction while the plan step is skipped (every expert has a bank row), NaN
        before the first lookup otherwise. `table`: a `stats()` the caller already read (else
        the counters are read here)."""
        if self.plan_skipped:
            return 1.0
        table = self.bank.stats()[0] if table is None else table
        hits, misses = sum(d["hits"] for d in table), sum(d["misses"] for d in table)
        return hits / (hits + misses) if hits + misses else float("nan")

    def stats_table(self) -> str:
        text = self.bank.stats()[1]
        if self.plan_skipped:
            text += ("\nplan step skipped (every expert has a bank row): hit rate 1.0 by "
                     "construction; the counters above do not advance")
        return text

    def errors(self) -> list[str]:
        """Sticky device error flags (planner and GEMM), decoded. A host read."""
        err = self.bank.read_error()
        out = [f"planner: {f.name}" for f in PlanError if f and f in err]
        out += self.host.errors() if self.host is not None else []
        return out + [f"gemm: {e}" for e in self.gemm.read_error()]

    def expert_addresses(self, layer: int) -> torch.Tensor:
        """int64 [E]: device address of layer's experts that own a bank row, 0 for the others."""
        E = self.num_experts
        slot = self.bank.slot_of[layer * E:(layer + 1) * E].to(torch.int64)
        addr = self.bank.rows.data_ptr() + slot * self.bank.row_stride
        return torch.where(slot >= 0, addr, torch.zeros_like(addr))

    def memory_parts(self) -> list[tuple[str, int, str]]:
        parts = list(self.bank.memory_parts()) + list(self.gemm.memory_parts())
        gpu = host = 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if is_host_table(t):          # a CUDA tensor over pinned host memory
                host += t.numel() * t.element_size()
            elif t.is_cuda:
                gpu += t.numel() * t.element_size()
        parts.append(("rest of the model", gpu, "gpu"))
        if host:
            parts.append(("host tables", host, "host"))
        return parts

    def report(self) -> MemoryReport:
        return report(self)

    def __repr__(self) -> str:
        return (f"Pool(L={self.num_layers}, E={self.num_experts}, top_k={self.top_k}, "
                f"rows/layer={self.rows_per_layer}, row={fmt_bytes(self.layout.row_bytes)}, "
                f"gate={'open' if int(self.bank.gate.item()) else 'closed'})")
