"""Rows of logits and sampling parameters for the sampling kernel's tests (test_sample_emu.py on
the CPU, test_gpu_sampling.py on a GPU), and what `cupool.sampling.sample` makes of them, worked
out in float64: how long the kept prefix of the order is (with the range rounding allows) and the
token a kept prefix of each length draws.
"""

from __future__ import annotations

import dataclasses

import torch

from cupool.sampling import uniform_noise

# A kernel's kept prefix may differ from float64's only where top_p · mass lies this close
# (relative) to the mass ahead of a group: the kernel's exp is float32 (~1e-7), and its fixed
# point rounds each id's probability to 2^-40 of the largest.
MASS_RTOL = 1e-6


@dataclasses.dataclass
class Rows:
    logits: torch.Tensor          # [B, V] bf16 or fp16
    temperature: torch.Tensor     # float32 [B]
    top_k: torch.Tensor           # int64 [B]
    top_p: torch.Tensor           # float32 [B]
    seeds: torch.Tensor           # int64 [B]
    steps: torch.Tensor           # int64 [B]

    def to(self, device) -> "Rows":
        return Rows(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


# (temperature, top_k, top_p) of the rows, cycled: greedy, chat defaults, top-k alone, both,
# everything kept, top-k 1, a tiny top_p, a hot temperature, top-k past the vocabulary
PARAMS = [(0.0, 0, 1.0), (0.8, 0, 0.95), (1.3, 50, 1.0), (0.5, 7, 0.9), (1.0, 0, 1.0),
          (2.0, 1, 1.0), (0.7, 0, 1e-6), (3.0, 0, 0.6), (0.9, 10**9, 0.99)]


def rows(B: int, V: int, seed: int, dtype=torch.bfloat16, ties: bool = False,
         masked: bool = False) -> Rows:
    """B rows of V fresh random logits. `ties`: every other row takes few distinct values (large
    groups of equal logits, which the cuts fall inside). `masked`: a third of each row's ids at
    -inf, as a grammar's token mask leaves them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 2.5
    if ties:
        x[::2] = torch.randint(-6, 4, (len(range(0, B, 2)), V), generator=g).float() * 0.75
    if masked:
        x[torch.rand(B, V, generator=g) < 1 / 3] = float("-inf")
        x[:, 0] = 1.0                                   # one id always allowed
    logits = x.to(dtype)
    ps = [PARAMS[(i + seed) % len(PARAMS)] for i in range(B)]
    return Rows(logits, torch.tensor([p[0] for p in ps], dtype=torch.float32),
                torch.tensor([p[1] for p in ps], dtype=torch.int64),
                torch.tensor([p[2] for p in ps], dtype=torch.float32),
                torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 1000, (B,), generator=g))


def order(row: torch.Tensor) -> torch.Tensor:
    """Ids of one row of logits, larger logit first, equal logits by id."""
    return row.float().sort(descending=True, stable=True).indices


def kept_range(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[int, int]:
    """(fewest, most) ids the kept prefix may hold: float64's count at top_p · (1 ∓ MASS_RTOL)."""
    V = row.numel()
    if not temperature > 0:
        return 1, 1
    ids = order(row)
    x = (row.float() / max(temperature, 1e-6))[ids].double()
    K = min(top_k, V) if top_k > 0 else V
    q = torch.exp(x[:K] - x[0])
    before = torch.cumsum(q, 0) - q
    z = float(q.sum())

    def count(p):
        return K if p >= 1 else max(1, int((before < p * z).sum()))
    return count(top_p * (1 - MASS_RTOL)), count(min(1.0, top_p * (1 + MASS_RTOL)) if top_p < 1 else 1.0)


def draw(row: torch.Tensor, temperature: float, seed: int, step: int, n: int) -> int:
    """The token a kept prefix of n ids draws (sample's Gumbel-max, float32 as it computes it)."""
    ids = order(row)[:n]
    if not temperature > 0:
        return int(ids[0])
    u = uniform_noise(torch.tensor([seed]), torch.tensor([step]), row.numel())[0]
    score = row.float()[ids] / torch.tensor(max(temperature, 1e-6)) - torch.log(-torch.log(u[ids]))
    return int(ids[int(score.argmax())])


def kept_by_cut(row: torch.Tensor, cut_key: int, keep: int) -> int:
    """Ids a kernel's cut (sample.cu: every key above cut_key, and the first `keep` of its
    group) keeps in one row."""
    bits = row.view(torch.int16).to(torch.int64) & 0xFFFF
    keys = torch.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)
    return int((keys > cut_key).sum()) + keep


def check_row(row, temperature, top_k, top_p, seed, step, token, cut_key, keep) -> str | None:
    """What is wrong with a kernel's token and cut for one row (None: nothing)."""
    lo, hi = kept_range(row, temperature, top_k, top_p)
    n = kept_by_cut(row, cut_key, keep)
    if not lo <= n <= hi:
        return f"kept {n} ids, float64 keeps {lo}..{hi} (T {temperature}, k {top_k}, p {top_p})"
    want = draw(row, temperature, seed, step, n)
    if token != want:
        return f"drew {token}, the kept {n} ids draw {want} (T {temperature}, k {top_k}, p {top_p})"
    return None
