"""rawkernels/moe_decode.cu run on the CPU against `cupool.reference.moe.reference_moe`.

The kernel's own source (with mma_fp4.cuh's dequantisation, moe_lanes.cuh's grouping of lanes
into units, moe_common.cuh's epilogues and the stage ring) is compiled with g++ against tests/emu,
whose async_copy.cuh copies at once and keeps each mbarrier's arrivals, transaction bytes and
phase as the hardware does; `decode_main.cpp` runs it as one block that takes every item of the
call in order. So a decode call's numbers are checked without a GPU for the builds the launcher
chooses (`cupool.ops.moe_decode.defines`): both copy paths (bulk copies, sm_90+; cp.async
before), each w13 K split, w2 strips split over 2 and 4 warps (Ip = 768), units of 8 and 16
lanes, biases with the clamped SwiGLU, rows without a gate, padding, a NaN router weight, and a
call split into rows in place then fresh rows. What several blocks do to each other (the
ticket, the unit waits, the last arrival's top-k sum) runs here in one order only: the GPU
tests' part (test_gpu_gemm.py). Builds ending in `_xsmem` stage each w13 item's x rows in shared
memory (the XSMEM variant profilers select).
Builds starting with `route` route the call themselves (ROUTE: the RMSNorm, router GEMV and
softmax top-k of the router's launch folded in), checked against `cupool.reference.dense`.
"""

from __future__ import annotations

import _emu_build as emu_build
import numpy as np
import pytest
import torch

from cupool.activation import RELU2, SILU, swiglu_clamp
from cupool.layout import RowLayout
from cupool.ops import moe_decode
from cupool.reference import dense
from cupool.reference.moe import reference_moe
from cupool.synthetic import dequantize_exact, random_biases, random_experts

TOL = 1e-2             # test_gpu_gemm.py's: act handed to w2 in bf16, the bf16 output rounding
DYN_DECL = "extern __shared__ __align__(16) u8 smem[];"
DYN_EMU = "u8* smem = reinterpret_cast<u8*>(emu_dyn_smem);"   # the emulation's dynamic smem
HEADERS = ("mma_fp4.cuh", "moe_common.cuh", "moe_lanes.cuh", "block_scan.cuh", "moe_stages.cuh",
           "route.cuh")
E = 13
SWIGLU = swiglu_clamp(1.702, 7.0)


def _build(nt, split, bulk, bias=False, gated=True, activation=SILU, xsmem=0, route=0,
           w_dtype=0, inter=48, w2_split=0):
    layout = RowLayout(80, inter, bias=bias, gated=gated)   # Hp = 128: H < Hp
    b = moe_decode.Build(nt=nt, maxw=64 if nt == 8 else 256, minb=3, w13_split=split, xalign=1,
                         w_dtype=w_dtype, xsmem=xsmem, route=route, w2_split=w2_split)
    return layout, activation, b, bulk


BUILDS = {
    "silu": _build(8, 4, bulk=0),
    "silu_bulk": _build(8, 2, bulk=1),
    "silu_nt16": _build(16, 1, bulk=1),
    "swiglu_bias": _build(8, 4, bulk=1, bias=True, activation=SWIGLU),
    "relu2": _build(8, 4, bulk=0, gated=False, activation=RELU2),
    "silu_xsmem": _build(8, 2, bulk=1, xsmem=1),
    "relu2_nt16_xsmem": _build(16, 4, bulk=0, gated=False, activation=RELU2, xsmem=1),
    "route": _build(8, 2, bulk=1, route=1),
    "route_nt16_bf16": _build(16, 4, bulk=0, route=1, w_dtype=1),
    # Ip = 768 (12 chunks a w2 strip): the kernel's rule splits a strip over 2 warps (the
    # launcher's choice from two tokens on); a launch of one token's lanes over 4
    # (moe_decode.w2_split_for, plain or ROUTE: the same w2 items), its partials summed by warp 0
    "silu_ip768": _build(8, 4, bulk=1, inter=768),
    "route_ip768_w2split4": _build(8, 4, bulk=1, route=1, inter=768, w2_split=4),
}


def _defines(name: str) -> dict:
    layout, activation, b, bulk = BUILDS[name]
    return {**moe_decode.defines(b, layout, torch.bfloat16, activation), "EMU_BULK": bulk}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("decode_emu")
    emu_build.stage(work, "moe_decode", HEADERS, replace={DYN_DECL: DYN_EMU})
    emu_build.compile_all(work, "decode_main.cpp", {name: _defines(name) for name in BUILDS})
    return work


class Experts:
    """E random experts of a build's layout: their rows (as the bank holds them, one a stride of
    a multiple of 128 bytes) and the exact float32 matrices (and biases) of the reference."""

    def __init__(self, name: str, seed: int):
        layout, activation, _, _ = BUILDS[name]
        gen = torch.Generator().manual_seed(seed)
        self.biases = random_biases(layout, E, gen) if layout.bias else None
        rows, mats = random_experts(layout, E, gen, biases=self.biases)
        self.stride = -(-layout.row_bytes // 128) * 128
        self.rows = torch.zeros(E, self.stride, dtype=torch.uint8)
        self.rows[:, :layout.row_bytes] = rows
        self.deq = [tuple(None if m is None else dequantize_exact(m) for m in trio) for trio in mats]
        self.layout, self.activation = layout, activation

    def reference(self, x, ids, w):
        b = None if self.biases is None else [tuple(t[e] for t in self.biases) for e in range(E)]
        return reference_moe(x, ids, w, self.deq, activation=self.activation, biases=b)


def run_kernel(work, name, ex: Experts, x, lane_rows, weights, topk, parts=(2,), fresh=None):
    """One or more emulated launches of one call (their parts): (out [T, H] bf16, error bits,
    the counters that must be back at zero)."""
    _, _, b, _ = BUILDS[name]
    T, H = x.shape
    W = lane_rows.numel()
    smem = moe_decode.shared_bytes(b, ex.layout.bias, ex.layout.hp)
    head = [T, H, W, topk, smem, E, ex.stride, len(parts), *parts, fresh is not None]
    f32 = np.asarray(weights, dtype=np.float32).view(np.uint32)
    words = [head, ex.rows.numpy().view(np.int64), emu_build.bf16_words(x), lane_rows.numpy()]
    if fresh is not None:
        words.append(np.asarray(fresh))
    got = emu_build.run(work / name, words + [f32])
    assert got.size == T * H + 1 + 2 + W + ex.layout.hp // 16
    out = emu_build.bf16(got[:T * H], (T, H))
    return out, int(got[T * H]), got[T * H + 1:]


def rel_err(out, ref):
    return (torch.linalg.norm(out.double() - ref.double()) / torch.linalg.norm(ref.double())).item()


def _routing(T, K, gen, distinct=True):
    """distinct: True (each token's K experts differ), False (drawn at random), or "crowded"
    (from 3 experts: several hold more lanes than one unit takes)."""
    if distinct is True:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    else:
        ids = torch.randint(0, 3 if distinct == "crowded" else E, (T, K), generator=gen)
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    return ids, w


@pytest.mark.parametrize("name,T,K,distinct", [
    ("silu", 1, 8, True), ("silu", 3, 2, False), ("silu_bulk", 1, 8, True),
    ("silu_bulk", 5, 4, False), ("silu_nt16", 16, 8, False), ("swiglu_bias", 3, 4, True),
    ("relu2", 2, 6, True), ("silu_xsmem", 1, 8, True), ("silu_xsmem", 3, 4, False),
    ("relu2_nt16_xsmem", 9, 4, False), ("silu", 11, 2, "crowded"), ("silu_ip768", 1, 8, True),
    ("silu_nt16", 16, 2, "crowded"), ("silu_bulk", 12, 3, "crowded")])
def test_decode_kernel_source_matches_reference_on_cpu(builds, name, T, K, distinct):
    """Poisoned workspaces and output; the counters back at zero; no error bits. Up to 32
    lanes one warp groups them, past that the block (moe_lanes.cuh); "crowded" lanes fill
    several units of one expert."""
    gen = torch.Generator().manual_seed(T * 97 + K + len(name))
    ex = Experts(name, seed=len(name) + T)
    x = torch.randn(T, 80, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, K, gen, distinct)
    out, err, counters = run_kernel(builds, name, ex, x, ids.reshape(-1), w.reshape(-1), K)
    assert not out.isnan().any(), "an output element was not written"
    assert rel_err(out, ex.reference(x, ids, w)) <= TOL, rel_err(out, ex.reference(x, ids, w))
    assert err == 0 and not counters.any(), (err, counters)


@pytest.mark.parametrize("name", ["silu_bulk", "silu_xsmem"])
def test_decode_padding_nan_weight_and_two_launches_on_cpu(builds, name):
    """A padding lane (row −1) adds nothing; a routed lane with a NaN weight sets error bit 2 and
    counts as padding; a call split into rows in place (part 0) then fresh rows (part 1) gives
    the one launch's bits; a call of padding alone writes zeros."""
    gen = torch.Generator().manual_seed(5)
    ex = Experts(name, seed=11)
    T, K = 4, 3
    x = torch.randn(T, 80, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, K, gen, distinct=False)
    ids[1, 2] = -1
    lanes = ids.reshape(-1)
    weights = w.reshape(-1).clone()
    want = ex.reference(x, ids, w)
    one, err, counters = run_kernel(builds, name, ex, x, lanes, weights, K)
    assert err == 0 and not counters.any()
    assert rel_err(one, want) <= TOL
    fresh = [int(e) % 2 for e in lanes.tolist()]          # odd experts' rows "being copied"
    two, err, counters = run_kernel(builds, name, ex, x, lanes, weights, K, parts=(0, 1),
                                    fresh=fresh)
    assert err == 0 and not counters.any()
    assert torch.equal(one, two), "part 0 then part 1 gave other bits than one launch"
    for every in (0, 1):                                   # no row being copied; every row
        two, err, counters = run_kernel(builds, name, ex, x, lanes, weights, K, parts=(0, 1),
                                        fresh=[every] * len(fresh))
        assert err == 0 and not counters.any() and torch.equal(one, two), every
    weights[0] = float("nan")
    ids_nan = ids.clone()
    ids_nan[0, 0] = -1
    out, err, counters = run_kernel(builds, name, ex, x, lanes, weights, K)
    assert err == 2 and not counters.any()
    assert rel_err(out, ex.reference(x, ids_nan, w)) <= TOL
    out, err, _ = run_kernel(builds, name, ex, x, torch.full((T * K,), -1), weights * 0, K)
    assert err == 0 and torch.equal(out, torch.zeros_like(out))


def test_decode_emulation_sees_a_wrong_dequantisation(tmp_path):
    """The harness can fail: a build whose dequantisation drops the block scale of row g + 8
    (it multiplies by row g's) is off the reference by far more than the tolerance."""
    emu_build.require()
    emu_build.stage(tmp_path, "moe_decode", HEADERS, replace={DYN_DECL: DYN_EMU})
    src = (tmp_path / "mma_fp4.cuh").read_text()
    broken = src.replace("const u32 s_hi = splat<1>(s);", "const u32 s_hi = splat<0>(s);")
    assert broken != src
    (tmp_path / "mma_fp4.cuh").write_text(broken)
    emu_build.compile_all(tmp_path, "decode_main.cpp", {"silu": _defines("silu")})
    gen = torch.Generator().manual_seed(9)
    ex = Experts("silu", seed=3)
    x = torch.randn(1, 80, generator=gen).to(torch.bfloat16)
    ids, w = _routing(1, 8, gen)
    out, _, _ = run_kernel(tmp_path, "silu", ex, x, ids.reshape(-1), w.reshape(-1), 8)
    assert rel_err(out, ex.reference(x, ids, w)) > 10 * TOL


def run_routed(work, name, ex: Experts, h, rw, nw, eps, topk, norm_topk, active, table_rows):
    """One emulated launch of a ROUTE build: a dict of what it wrote."""
    _, _, b, _ = BUILDS[name]
    T, H = h.shape
    W = T * topk
    smem = moe_decode.shared_bytes(b, ex.layout.bias, ex.layout.hp)
    head = [T, H, W, topk, smem, E, ex.stride, E, int(norm_topk), active is not None,
            emu_build.f32_bits(eps)]
    words = [head, ex.rows.numpy().view(np.int64), emu_build.bf16_words(h),
             emu_build.bf16_words(rw), emu_build.bf16_words(nw)]
    if active is not None:
        words.append(active.to(torch.int64).numpy())
    got = emu_build.run(work / name, words + [table_rows.numpy()])
    sizes = {"out": T * H, "error": 1, "sync": 2 + W, "group_done": ex.layout.hp // 16,
             "x": T * H, "logits": T * E, "ids": W, "weights": W, "lanes": W, "count": 1}
    assert got.size == sum(sizes.values())
    res, at = {}, 0
    for key, n in sizes.items():
        res[key] = got[at:at + n]
        at += n
    bits = res["weights"].astype(np.uint32)
    weights = (torch.from_numpy(bits.view(np.float32).copy()) if b.w_dtype == 0 else
               emu_build.bf16(bits.astype(np.int64), (W,)))
    return {"out": emu_build.bf16(res["out"], (T, H)), "error": int(res["error"][0]),
            "counters": np.concatenate([res["sync"], res["group_done"], res["count"]]),
            "x": emu_build.bf16(res["x"], (T, H)),
            "logits": torch.from_numpy(res["logits"].astype(np.uint32).view(np.float32).copy())
            .reshape(T, E),
            "ids": torch.from_numpy(res["ids"].astype(np.int32)).reshape(T, topk),
            "weights": weights.reshape(T, topk), "lanes": torch.from_numpy(res["lanes"].copy())}


def _within_bf16_ulp(got, want):
    """Each element of got within one bf16 unit in the last place of want's."""
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all())


@pytest.mark.parametrize("name,T,K,norm_topk,inactive", [
    ("route", 1, 8, True, None), ("route", 5, 4, False, 3),
    ("route_nt16_bf16", 9, 8, True, 0), ("route_nt16_bf16", 16, 6, True, None),
    ("route_ip768_w2split4", 1, 8, True, None)])
def test_routed_decode_matches_the_router_and_reference_on_cpu(builds, name, T, K, norm_topk,
                                                               inactive):
    """A ROUTE build (one block, which takes every expert's logit): x is the RMSNorm of h, the
    logits its product with the router's weight (each within a bf16 ulp: other sum orders), the
    ids, weights and lane rows the softmax top-k of those logits through the table (exact), and
    out the MoE of x over them; the counters and the route count back at zero, no error bits.
    Everything the kernel writes was poisoned before."""
    gen = torch.Generator().manual_seed(T * 31 + K)
    ex = Experts(name, seed=T + K)
    layout, _, b, _ = BUILDS[name]
    H = layout.hidden
    h = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16)
    rw = (torch.randn(E, H, generator=gen) / H ** 0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16)
    eps = 1e-6
    active = None
    if inactive is not None:
        active = torch.ones(T, dtype=torch.bool)
        active[inactive] = False
    perm = torch.randperm(E, generator=gen)            # expert e's row in the bank
    got = run_routed(builds, name, ex, h, rw, nw, eps, K, norm_topk, active, perm)
    assert got["error"] == 0 and not got["counters"].any(), (got["error"], got["counters"])
    assert _within_bf16_ulp(got["x"], dense.rms_norm(h, nw, eps))
    want_logits = (got["x"].float() @ rw.float().T).to(torch.bfloat16)
    assert _within_bf16_ulp(got["logits"], want_logits)
    w_dtype = torch.float32 if b.w_dtype == 0 else torch.bfloat16
    ids, w = dense.route_topk(got["logits"].to(torch.bfloat16), K, norm_topk, w_dtype, active)
    assert torch.equal(got["ids"], ids)
    torch.testing.assert_close(got["weights"], w, rtol=1e-6 if b.w_dtype == 0 else 0, atol=0)
    rows = torch.where(ids >= 0, perm[ids.clamp(min=0).long()], torch.full_like(ids, -1).long())
    assert torch.equal(got["lanes"], rows.reshape(-1))
    ref = ex.reference(got["x"], rows, w.float())
    assert not got["out"].isnan().any(), "an output element was not written"
    assert rel_err(got["out"], ref) <= TOL, rel_err(got["out"], ref)
