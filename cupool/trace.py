"""Routing traces: what a run routed, per decode step and layer, saved as `.npz`.

Shape legend (ARCHITECTURE.md): S decode steps · L MoE layers · T tokens a step · K top-k ·
E experts. A trace is `ids` int16/int32 [S, L, T, K] (expert ids; −1 padding) with E.

- `Trace.load` / `Trace.save`: files, validated when read;
- `synthetic(...)`: traces with a stated reuse and skew, e.g. the locality published for
  Qwen3-30B-A3B (about 45% of selections repeat at the next token, 80% within 8 tokens);
  `uniform(...)`: what a random router gives;
- `with_predictions(trace, accuracy)`: the same trace carrying, beside each step's actual ids,
  the ids a predictor would have named for that step and layer before it ran (`predicted`
  [S, L, T, K]), a stated fraction of them right; the wrong ones are drawn from the trace's own
  per-layer popularity. What a prefetch is measured against where the model's own predictor
  cannot be (a synthetic model's router predicts nothing a trained one would).
Traces are recorded and replayed through the pool's routing hook (`cupool.replay`) and replayed
on the CPU through the reference planner (`cupool.simulate`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace file or array that is not a routing trace (the message says what is wrong)."""


@dataclasses.dataclass
class Trace:
    ids: np.ndarray           # [S, L, T, K] expert ids
    num_experts: int
    note: str = ""
    predicted: np.ndarray | None = None   # [S, L, T, K'] predicted ids (−1: none), or None

    def __post_init__(self):
        ids = np.asarray(self.ids)
        if ids.dtype.kind not in "iu":
            raise TraceError(f"trace ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 4 or 0 in ids.shape:
            raise TraceError(f"trace ids must be [steps, layers, tokens, top_k], none of them 0, "
                             f"got shape {ids.shape}")
        n = self.num_experts
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n < 2**31:
            raise TraceError(f"num_experts must be an int in [1, 2^31), got {n!r}")
        self.ids = ids
        bad = (self.ids < -1) | (self.ids >= self.num_experts)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise TraceError(f"trace has {int(bad.sum())} ids outside [-1, {self.num_experts}); "
                             f"first at {first}: {int(self.ids[first])}")
        self.ids = self.ids.astype(np.int32)
        if self.predicted is not None:
            p = np.asarray(self.predicted)
            if p.dtype.kind not in "iu":
                raise TraceError(f"predicted ids must be integers, got dtype {p.dtype}")
            if p.ndim != 4 or p.shape[:3] != self.ids.shape[:3]:
                raise TraceError(f"predicted ids must be [steps, layers, tokens, k] with the ids' "
                                 f"{list(self.ids.shape[:3])} first, got {list(p.shape)}")
            bad = (p < -1) | (p >= self.num_experts)
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                raise TraceError(f"predicted ids outside [-1, {self.num_experts}): first at "
                                 f"{first}: {int(p[first])}")
            self.predicted = p.astype(np.int32)

    @property
    def steps(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    def save(self, path) -> Path:
        path = Path(path)
        small = np.int16 if self.num_experts < 32767 else np.int32
        extra = {} if self.predicted is None else {"predicted": self.predicted.astype(small)}
        np.savez_compressed(path, ids=self.ids.astype(small), num_experts=self.num_experts,
                            note=self.note, **extra)
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path) -> Trace:
        """Read a trace written by `save`; TraceError naming the file for anything else (a missing,
        truncated or foreign file, non-integer or out-of-range ids)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such trace file")
        try:
            # the file is ours to close, whatever np.load makes of it (or fails on)
            with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as f:
                names = set(f.files)
                if not {"ids", "num_experts"} <= names:
                    raise TraceError(f"{path}: not a cupool routing trace (it holds "
                                     f"{sorted(names)[:6]}, a trace holds 'ids' and "
                                     f"'num_experts')")
                ids, n = f["ids"], f["num_experts"]
                note = str(f["note"]) if "note" in names else ""
                predicted = f["predicted"] if "predicted" in names else None
        except TraceError:
            raise
        except Exception as e:  # noqa: BLE001 (zip, pickle and format errors all mean the same)
            raise TraceError(f"{path}: not a readable .npz trace ({type(e).__name__}: {e})") from None
        if n.shape != () or n.dtype.kind not in "iu":
            raise TraceError(f"{path}: num_experts must be an integer scalar, got {n.dtype} "
                             f"{list(n.shape)}")
        try:
            return cls(ids=ids, num_experts=int(n), note=note, predicted=predicted)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None

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


def streams(steps: int, num_layers: int, num_experts: int, top_k: int, count: int, *,
            seed: int = 0, **locality) -> Trace:
    """`count` independent sequences decoded together: token t of every step is its own
    one-token `synthetic` trace (seed + t), so each sequence has the locality of a single
    stream, and token 0 is exactly `synthetic(..., seed=seed)`. (A `synthetic` trace of several
    tokens is one routing history shared by all of them: one of its tokens alone reuses far
    less than a single stream does.)"""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    parts = [synthetic(steps, num_layers, num_experts, top_k, seed=seed + t, **locality)
             for t in range(count)]
    ids = np.concatenate([p.ids for p in parts], axis=2)
    return Trace(ids, num_experts, note=f"{count} independent streams; stream 0: {parts[0].note}")


def uniform(steps: int, num_layers: int, num_experts: int, top_k: int, *, tokens: int = 1,
            seed: int = 0) -> Trace:
    """Independent uniform routing (what a random router gives)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((steps, num_layers, tokens, num_experts)), axis=-1)[..., :top_k]
    return Trace(ids.astype(np.int32), num_experts, note=f"uniform seed={seed}")


def with_predictions(trace: Trace, accuracy: float, *, seed: int = 0) -> Trace:
    """`trace` with `predicted` ids at `accuracy`: for each step, layer and token, each of the K
    actual ids is named with probability `accuracy` (so that fraction of the K predicted ids is
    right, in expectation); each other slot names an expert that is not among the actual ones,
    drawn from that layer's popularity over the whole trace (its own statistics). A token's
    predicted ids are in random order (a second generator, so the sets do not depend on it):
    no ranking is modelled, so a prefetch that takes only the first few (`Prefetcher`'s
    max_rows) gets right and wrong ones alike. The note says the accuracy achieved."""
    if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) \
            or not 0 <= accuracy <= 1:
        raise ValueError(f"accuracy must be a number in [0, 1], got {accuracy!r}")
    ids = trace.ids
    S, L, T, K = ids.shape
    E = trace.num_experts
    rng = np.random.default_rng(seed)
    order = np.random.default_rng([seed, 1])          # the order of a token's predicted ids
    pred = np.full_like(ids, -1)
    right = total = 0
    for layer in range(L):
        sel = ids[:, layer].reshape(-1)
        pop = np.bincount(sel[sel >= 0], minlength=E).astype(np.float64) + 1e-9
        for s in range(S):
            for t in range(T):
                actual = [int(e) for e in ids[s, layer, t] if e >= 0]
                keep = [e for e in actual if rng.random() < accuracy]
                others = pop.copy()
                others[actual] = 0.0
                n = min(len(actual) - len(keep), int((others > 0).sum()))
                wrong = (rng.choice(E, size=n, replace=False, p=others / others.sum()).tolist()
                         if n else [])
                row = keep + wrong
                order.shuffle(row)
                pred[s, layer, t, :len(row)] = row
                right += len(keep)
                total += len(actual)
    note = (f"{trace.note}; predicted ids at accuracy {accuracy:g} (achieved "
            f"{right / max(1, total):.3f}, seed {seed})")
    return Trace(ids, E, note=note, predicted=pred)
