"""Routing traces: record what a run routed, replay it in place of the router, make synthetic ones.

Shape legend: S decode steps · L MoE layers · T tokens a step · K top-k · E experts.
A trace is `ids` int16/int32 [S, L, T, K] (expert ids; −1 padding) with E, saved as `.npz`.

Uses:
- `Recorder(pool)`: eager runs append each layer call's ids (a host read per call: for recording
  only, never in a timed or captured run);
- `Replayer(pool, trace)`: benchmarks only — every layer call takes its ids from the trace instead
  of the router's, through a device-side step counter, so a captured graph replays a new step
  every replay with no host work;
- `synthetic(...)`: traces with a stated reuse and skew, e.g. the locality published for
  Qwen3-30B-A3B (about 45% of selections repeat at the next token, 80% within 8 tokens);
- `simulate(trace, rows_per_layer, ...)`: the hit rate the reference planner gets on a trace,
  on the CPU (`python -m cupool simulate`), so users size the bank without a GPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch


@dataclasses.dataclass
class Trace:
    ids: np.ndarray           # [S, L, T, K] expert ids
    num_experts: int
    note: str = ""

    def __post_init__(self):
        if self.ids.ndim != 4:
            raise ValueError(f"trace ids must be [steps, layers, tokens, top_k], got shape "
                             f"{self.ids.shape}")
        bad = (self.ids < -1) | (self.ids >= self.num_experts)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"trace has {int(bad.sum())} ids outside [-1, {self.num_experts}); "
                             f"first at {first}: {int(self.ids[first])}")

    @property
    def steps(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    def save(self, path) -> Path:
        path = Path(path)
        np.savez_compressed(path, ids=self.ids.astype(np.int16 if self.num_experts < 32767 else np.int32),
                            num_experts=self.num_experts, note=self.note)
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path) -> "Trace":
        with np.load(path) as f:
            return cls(ids=f["ids"].astype(np.int32), num_experts=int(f["num_experts"]),
                       note=str(f["note"]) if "note" in f else "")

    def reuse(self, window: int = 1) -> float:
        """Fraction of selections (valid ids) that appeared in the same layer within the previous
        `window` steps (token 0 of each step; batch-1 traces)."""
        hits = total = 0
        S = self.steps
        for layer in range(self.num_layers):
            sets = [set(self.ids[s, layer].reshape(-1).tolist()) - {-1} for s in range(S)]
            for s in range(1, S):
                recent = set().union(*sets[max(0, s - window):s])
                cur = sets[s]
                hits += len(cur & recent)
                total += len(cur)
        return hits / total if total else 0.0


def synthetic(steps: int, num_layers: int, num_experts: int, top_k: int, *, tokens: int = 1,
              reuse_next: float = 0.45, reuse_window: float = 0.80, window: int = 8,
              skew: float = 1.0, seed: int = 0) -> Trace:
    """A trace with locality: each selection repeats one of the previous step's experts with
    probability ≈ `reuse_next`, one from the last `window` steps with probability ≈
    `reuse_window` in all, else draws from a Zipf(`skew`) popularity (per layer, random order of
    experts). Selections within a token are distinct. The achieved figures are in `Trace.note`
    (measure them with `Trace.reuse`).
    """
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > num_experts={num_experts}")
    if not 0 <= reuse_next <= reuse_window <= 1:
        raise ValueError(f"need 0 <= reuse_next ({reuse_next}) <= reuse_window ({reuse_window}) <= 1")
    rng = np.random.default_rng(seed)
    ids = np.empty((steps, num_layers, tokens, top_k), dtype=np.int32)
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    pop = ranks ** -skew if skew > 0 else np.ones(num_experts)
    pop /= pop.sum()
    perms = [rng.permutation(num_experts) for _ in range(num_layers)]
    for layer in range(num_layers):
        history: list[list[int]] = []
        for s in range(steps):
            for t in range(tokens):
                chosen: list[int] = []
                prev = history[-1] if history else []
                older = [e for h in history[-window:-1] for e in h] if len(history) > 1 else []
                while len(chosen) < top_k:
                    u = rng.random()
                    if u < reuse_next and prev:
                        e = prev[rng.integers(len(prev))]
                    elif u < reuse_window and older:
                        e = older[rng.integers(len(older))]
                    else:
                        e = int(perms[layer][rng.choice(num_experts, p=pop)])
                    if e not in chosen:
                        chosen.append(e)
                ids[s, layer, t] = chosen
            history.append(ids[s, layer].reshape(-1).tolist())
    tr = Trace(ids, num_experts)
    tr.note = (f"synthetic: reuse_next={reuse_next} reuse_window={reuse_window}/{window} "
               f"skew={skew} seed={seed}; achieved next={tr.reuse(1):.3f} "
               f"within{window}={tr.reuse(window):.3f}")
    return tr


# Parameters of `synthetic` that give the locality published for Qwen3-30B-A3B decode (measured
# with Trace.reuse on 128-step, 128-expert, top-8 traces: ≈0.46 at the next token, ≈0.79
# within 8 tokens; the Zipf skew adds its own repeats, hence reuse_next below 0.45).
QWEN3_LOCALITY = dict(reuse_next=0.37, reuse_window=0.78, window=8, skew=0.2)


def uniform(steps: int, num_layers: int, num_experts: int, top_k: int, *, tokens: int = 1,
            seed: int = 0) -> Trace:
    """Independent uniform routing (what a random router gives)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((steps, num_layers, tokens, num_experts)), axis=-1)[..., :top_k]
    return Trace(ids.astype(np.int32), num_experts, note=f"uniform seed={seed}")


def simulate(trace: Trace, rows_per_layer: int, *, staging_rows: int | None = None,
             warmup_steps: int = 0) -> dict:
    """Replay `trace` through the reference planner with the gate open.

    Returns the hit rate (hits / (hits + misses)) over the steps after `warmup_steps`, per layer
    too, and the rows each layer owns at the end (shows rows moving between layers).
    """
    from cupool.planner import HITS, MISSES, ReferencePlanner  # noqa: PLC0415
    L, K = trace.num_layers, trace.ids.shape[-1]
    W = trace.ids.shape[2] * K
    if not K <= rows_per_layer <= trace.num_experts:
        raise ValueError(f"rows_per_layer must be in [top_k={K}, E={trace.num_experts}], "
                         f"got {rows_per_layer}")
    ref = ReferencePlanner(L, trace.num_experts, rows_per_layer, staging_rows or W)
    ref.open()
    base = np.zeros_like(ref.counters)
    for s in range(trace.steps):
        if s == warmup_steps:
            base = ref.counters.copy()
        for layer in range(L):
            ref.step(layer, trace.ids[s, layer].reshape(-1))
    c = ref.counters - base
    hits, misses = int(c[:, HITS].sum()), int(c[:, MISSES].sum())
    owned = np.bincount(ref.key_of[ref.key_of >= 0] // trace.num_experts, minlength=L)
    return {"hit_rate": hits / max(1, hits + misses), "hits": hits, "misses": misses,
            "per_layer_hit_rate": [float(c[l, HITS] / max(1, c[l, HITS] + c[l, MISSES]))
                                   for l in range(L)],
            "rows_owned": owned.tolist()}


class Replayer:
    """Feeds a trace to a wrapped model's MoE layers in place of the router's choice.

    Benchmarks only: `install()` makes every PooledExperts call read ids[step, layer] from a
    device copy of the trace; the last layer advances a device step counter (wrapping around),
    so eager runs and graph replays walk the trace with no host work. Router weights are kept.
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

    def install(self) -> None:
        self.pool.replayer = self

    def uninstall(self) -> None:
        self.pool.replayer = None


class Recorder:
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

    def install(self) -> None:
        self.pool.recorder = self

    def uninstall(self) -> None:
        self.pool.recorder = None

    def trace(self) -> Trace:
        full = [s for s in self.steps if len(s) == self.pool.num_layers]
        if not full:
            raise ValueError("no complete decode step was recorded")
        return Trace(np.stack([np.stack(s) for s in full]), self.pool.num_experts,
                     note="recorded")
