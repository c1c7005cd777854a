"""Routing hooks that record a run's routing or replay a trace in place of the router's.

Shape legend (ARCHITECTURE.md): S steps · L layers · T tokens a step · K top-k · E experts.

Both install themselves as `Pool.routing_hook`, the one place where the pool lets outside code
see or change a layer call's expert ids.
"""

from __future__ import annotations

import numpy as np
import torch

from cupool.trace import Trace


class _Hook:
    """Installs itself as its pool's routing hook (`install`) and removes itself (`uninstall`)."""
    pool = None

    def install(self) -> None:
        self.pool.routing_hook = self

    def uninstall(self) -> None:
        if self.pool.routing_hook is self:
            self.pool.routing_hook = None


class Replayer(_Hook):
    """Feeds a trace to a wrapped model's MoE layers in place of the router's choice.

    `install()` sets itself as the pool's routing hook: every pooled layer call reads
    ids[step, layer] from a device copy of the trace, and the last layer's call advances a device
    step counter (wrapping around), so eager runs and graph replays walk the trace with no host
    work. Router weights are kept. For measuring a trace's routing on a model whose own router
    does not behave like a trained one (benchmarks, synthetic models).
    """

    def __init__(self, pool, trace: Trace):
        if trace.num_layers != pool.num_layers or trace.num_experts != pool.num_experts \
                or trace.ids.shape[-1] != pool.top_k:
            raise ValueError(f"trace is [layers={trace.num_layers}, E={trace.num_experts}, "
                             f"K={trace.ids.shape[-1]}], the pool is [layers={pool.num_layers}, "
                             f"E={pool.num_experts}, K={pool.top_k}]")
        self.pool = pool
        self.ids = torch.from_numpy(trace.ids.astype(np.int64)).to(pool.device)
        self.step = torch.zeros(1, dtype=torch.int64, device=pool.device)
        self.steps = trace.steps

    def ids_for(self, layer: int, tokens: int) -> torch.Tensor:
        """ids [T, K] of the current step for `layer` (device gather; graph-safe)."""
        row = self.ids.index_select(0, self.step)[0, layer]              # [T_trace, K]
        if row.shape[0] < tokens:
            row = row.repeat(-(-tokens // row.shape[0]), 1)
        return row[:tokens]

    def advance(self) -> None:
        self.step.add_(1).remainder_(self.steps)

    def __call__(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """The routing hook: the trace's ids for this call (the step advances after the last
        layer, on the device; the ids of this call are gathered before that)."""
        got = self.ids_for(layer, ids.shape[0])
        if layer == self.pool.num_layers - 1:
            self.advance()
        return got



class Recorder(_Hook):
    """Records each layer call's ids of an eager run (a host read per call: recording only).

    `trace()` returns the Trace of the decode steps recorded (calls with `tokens` tokens; prefill
    calls of other widths are skipped)."""

    def __init__(self, pool, tokens: int = 1):
        self.pool, self.tokens = pool, tokens
        self.steps: list[list[np.ndarray]] = []

    def append(self, layer: int, ids: torch.Tensor) -> None:
        if ids.shape[0] != self.tokens:
            return
        if layer == 0:
            self.steps.append([])
        if self.steps:
            self.steps[-1].append(ids.detach().cpu().numpy().astype(np.int32))

    def __call__(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """The routing hook: records and keeps the router's ids."""
        self.append(layer, ids)
        return ids

    def trace(self) -> Trace:
        full = [s for s in self.steps if len(s) == self.pool.num_layers]
        if not full:
            raise ValueError("no complete decode step was recorded")
        return Trace(np.stack([np.stack(s) for s in full]), self.pool.num_experts,
                     note="recorded")
