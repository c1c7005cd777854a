"""Prefetch inside the decode step: the next MoE layer's predicted experts brought into the bank
while the current layer computes.

Shape legend (ARCHITECTURE.md): L MoE layers · T tokens · H hidden size · E experts · K top-k ·
K' predicted ids a token · W = T·K' lanes of a prefetch.

A decode step that prefetches calls, for each MoE layer l:

    pre.join()                 # before any plan step: the last prefetch's copies have landed
    ...layer l's plan step (and its row copies)...
    pre.issue(l + 1, x)        # x [T, H]: layer l's MoE input
    ...layer l's GEMM, layer l + 1's attention and router...

`issue` forks a side stream from torch's current stream and runs there: the predictor (by
default layer l + 1's own router applied to layer l's input, `RouterPredictor`), the planner's
prefetch step (`Bank.prefetch`: predicted experts without a row take the least recently used
rows that neither this tick nor the one before used) and the row copies of its list
(`Bank.copy_prefetched`). They overlap layer l's GEMM and layer l + 1's attention; `join` makes
the current stream wait for them (an event wait), so the next plan step sees the rows in place.
All of it is device work with no host read, so it is captured into a CUDA graph like the rest of
the step. Layer 0 is never predicted (nothing of the step runs before it). A wrong prediction
costs a copy and a row that LRU reclaims: never a wrong route.

`PooledExperts` makes these calls when the pool's prefetch is on (`Pool.enable_prefetch`); a
decode step of its own (e.g. a fused one) calls `Pool.prefetch` / `Pool.join_prefetch`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cupool.adapters import MoELayerSpec
from cupool.bank import Bank
from cupool.trace import Trace


class RouterPredictor:
    """Predicts layer m's experts from layer m − 1's MoE input: the top-K' scores of layer m's own
    router (its logits, plus its bias where it has one; for a router with a score-correction
    bias, DeepSeek-V3's, sigmoid(logits) + that bias, the scores it selects by). The group limit
    of group-limited routers is left out: this is a prediction, whose misses cost only a copy.

    Args:
        specs: the pool's MoE layers (`cupool.adapters.MoELayerSpec`, their routers are read
            from the blocks: `MoELayerSpec.router`).
        top_k: K' (default: each layer's K).
    Call: (layer m, hidden [T, H]) -> ids int64 [T, K'] on hidden's device (torch ops only).
    """

    def __init__(self, specs: list[MoELayerSpec], top_k: int | None = None):
        self.routers = []
        for spec in specs:
            router = spec.router()
            w = getattr(router, "weight", None)
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != (spec.num_experts, spec.hidden):
                raise ValueError(f"{spec.name}: the router of this layer has no weight "
                                 f"[E={spec.num_experts}, H={spec.hidden}] to predict with (its "
                                 f"block holds {type(router).__name__ if router else 'none'})")
            self.routers.append(router)   # its tensors are read at each call: a model moved
                                          # (or re-materialised) after this keeps working
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                                  or not 1 <= top_k <= min(s.num_experts for s in specs)):
            raise ValueError(f"top_k must be an int in [1, E], got {top_k!r}")
        self.top_k = [top_k or s.top_k for s in specs]

    def __call__(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        router = self.routers[layer]
        w = router.weight
        b, corr = (t if isinstance(t, torch.Tensor) else None for t in
                   (getattr(router, "bias", None), getattr(router, "e_score_correction_bias", None)))
        logits = F.linear(hidden.to(w.dtype), w, b)                              # [T, E]
        scores = logits if corr is None else torch.sigmoid(logits.float()) + corr
        return torch.topk(scores, self.top_k[layer], dim=-1).indices             # [T, K']


class TracePredictor:
    """A trace's predicted ids (`cupool.trace.with_predictions`) at the step its `Replayer` is
    at: what a predictor of a stated accuracy would name, for measuring prefetch where the
    model's own router is not a trained one. Call: (layer, hidden [T, H]) -> ids [T, K']."""

    def __init__(self, replayer, trace: Trace):
        if trace.predicted is None:
            raise ValueError("the trace has no predicted ids (cupool.trace.with_predictions)")
        if trace.ids.shape != replayer.ids.shape:
            raise ValueError(f"the trace's ids {list(trace.ids.shape)} are not the replayed "
                             f"trace's {list(replayer.ids.shape)}")
        self.replayer = replayer
        self.predicted = torch.from_numpy(trace.predicted.astype(np.int64)).to(replayer.ids.device)

    def __call__(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        T = hidden.shape[0]
        row = self.predicted.index_select(0, self.replayer.step)[0, layer]      # [T_trace, K']
        if row.shape[0] < T:
            row = row.repeat(-(-T // row.shape[0]), 1)
        return row[:T]


def check_max_rows(max_rows):
    """`max_rows` of a Prefetcher, checked: None or an int >= 1."""
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int)
                                 or max_rows < 1):
        raise ValueError(f"max_rows must be an int >= 1 or None, got {max_rows!r}")
    return max_rows


class Prefetcher:
    """Issues prefetch steps on a side stream and joins them (see the module docstring).

    Args:
        bank: a Bank built with `prefetch=True`.
        predict: fn(layer, hidden [T, H]) -> ids [T, K'] (int32/int64 on the bank's device,
            T·K' ≤ the bank's max lanes), run on the side stream: `RouterPredictor`,
            `TracePredictor` or any callable of torch ops.
        track_accuracy: also count, for every layer call after a prediction (`observe`), how many
            of its (token, expert) selections the prediction named (device counters, a few more
            small launches a layer; `accuracy()` reads them).
        max_rows: at most this many rows a prefetch brings in (its predicted experts without a
            bank row, the first in the predictor's order: `Bank.prefetch`; None: all). A
            prefetch's copies share the PCIe link with the next layer's misses and must land
            before that layer's plan step, so copying more than fits under a layer's compute
            delays the step instead of hiding the copies (docs/PERFORMANCE.md).
    """

    def __init__(self, bank: Bank, predict, *, track_accuracy: bool = False,
                 max_rows: int | None = None):
        if not isinstance(bank, Bank) or not bank.prefetching:
            raise ValueError("bank must be a cupool Bank built with prefetch=True")
        if not callable(predict):
            raise TypeError(f"predict must be callable, got {type(predict).__name__}")
        self.bank, self.predict = bank, predict
        self.max_rows = check_max_rows(max_rows)
        self.stream = torch.cuda.Stream(bank.device)
        self._pending = None          # (hidden, ids) of the prefetch in flight, kept alive
        self.track_accuracy = bool(track_accuracy)
        dev = bank.device
        self._predicted = torch.full((bank.max_lanes,), -1, dtype=torch.int64, device=dev)
        self._predicted_for = None    # (layer, T, K') of what _predicted holds
        self.right = torch.zeros(1, dtype=torch.int64, device=dev)
        self.total = torch.zeros(1, dtype=torch.int64, device=dev)

    def issue(self, layer: int, hidden: torch.Tensor,
              token_mask: torch.Tensor | None = None, after=()) -> None:
        """Prefetch `layer`'s predicted experts, predicted from `hidden` [T, H] (the previous MoE
        layer's input), on the side stream; nothing for a layer outside [1, L) (layer 0 is not
        predicted; L: past the last). `token_mask` bool [T]: tokens not to predict for (their ids
        become padding). `after`: streams whose work so far the prefetch waits for besides the
        current one's (the previous layer's row copies on another stream: its misses are on the
        critical path, the prefetch's copies would only share PCIe with them). Joins the
        prefetch before it first (one at a time)."""
        self.join()
        if not 1 <= layer < self.bank.num_layers:
            return
        cur = torch.cuda.current_stream(self.bank.device)
        side = self.stream
        side.wait_stream(cur)
        for s in after:
            side.wait_stream(s)
        with torch.cuda.stream(side):
            ids = self.predict(layer, hidden)                                    # [T, K']
            if token_mask is not None:
                ids = ids.masked_fill(~token_mask.reshape(-1, 1), -1)
            ids = ids.contiguous()
            self.bank.prefetch(layer, ids, self.max_rows or 0)
            self.bank.copy_prefetched()
            if self.track_accuracy:
                self._predicted[:ids.numel()].copy_(ids.reshape(-1))
                self._predicted_for = (layer, ids.shape[0], ids.numel() // max(1, ids.shape[0]))
        # hidden was made on the current stream and is read on the side one: keep it (and the
        # ids) alive until join, so the allocator cannot hand its memory out meanwhile
        self._pending = (hidden, ids)

    def join(self) -> None:
        """Make torch's current stream wait for the prefetch in flight (none: nothing)."""
        if self._pending is None:
            return
        torch.cuda.current_stream(self.bank.device).wait_stream(self.stream)
        self._pending = None

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """With `track_accuracy`: count how many of `layer`'s selections ids [T, K] (−1 padding)
        the last prediction named for the same token, if it was for this layer. Device ops;
        call after `join`."""
        if not self.track_accuracy or self._predicted_for is None \
                or self._predicted_for[0] != layer or self._predicted_for[1] != ids.shape[0]:
            return
        _, T, k = self._predicted_for
        pred = self._predicted[:T * k].view(T, k)
        act = ids.reshape(T, -1).long()
        valid = act >= 0
        named = (act[:, :, None] == pred[:, None, :]).any(dim=-1) & valid
        self.right.add_(named.sum())
        self.total.add_(valid.sum())
        self._predicted_for = None

    def accuracy(self) -> float:
        """Fraction of the observed selections the predictions named (NaN before any); a host
        read."""
        total = int(self.total.item())
        return int(self.right.item()) / total if total else float("nan")

    def reset(self) -> None:
        self.right.zero_()
        self.total.zero_()
