"""rawkernels/dense_gemv.cu run on the CPU against `cupool.reference.dense`, within
test_gpu_dense.py's bound (its `close`).

The kernel's own source is compiled with g++ against tests/emu (the CUDA features it uses
emulated, every block of its grid run one after another; `gemv_main.cpp` drives it), so the
fused step's GEMVs are checked without a GPU: the three matrices side by side, biases, the
residual sum and RMSNorm prologue (h read once where K is one x tile, staged tile by tile past
it), the residual epilogue, K split over blocks with the tiles' tickets, two row tiles a block,
and the router's softmax top-k with its ties, NaN rule, inactive tokens and lane addresses. What
concurrent blocks do to each other is the GPU tests' part (test_gpu_dense.py).
"""

from __future__ import annotations

import zlib

import _emu_build as emu_build
import numpy as np
import pytest
import torch
from test_gpu_dense import close

from cupool.reference import dense as ref

BUILDS = {   # NB, MODE (1: norm), EPI (0 plain, 1 + residual, 2 route), WARPS, RT, KS, LANE_ADDR
    "plain": dict(NB=3, MODE=0, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0),
    "norm": dict(NB=3, MODE=1, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0),
    "residual": dict(NB=13, MODE=0, EPI=1, WARPS=4, RT=2, KS=3, LANE_ADDR=0),
    "route": dict(NB=1, MODE=1, EPI=2, WARPS=8, RT=1, KS=1, LANE_ADDR=1),   # Qwen3-30B-A3B's
    "route_split": dict(NB=5, MODE=1, EPI=2, WARPS=4, RT=1, KS=3, LANE_ADDR=1),
}
NAN16 = 0x7FC0
HEADERS = ("route.cuh",)   # the rawkernels headers dense_gemv.cu includes besides common.cuh


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("gemv_emu")
    emu_build.stage(work, "dense_gemv", HEADERS)
    emu_build.compile_all(work, "gemv_main.cpp", BUILDS)
    return work


def run_kernel(work, name, ws, bs, x, add=None, nw=None, res=None, eps=1e-6, topk=0,
               norm_topk=True, w_f32=False, active=None, table=None):
    """The emulated launch over grid (tiles, KS): a dict of what it wrote (poisoned where not)."""
    b = BUILDS[name]
    NB, K = b["NB"], x.shape[1]
    assert x.shape[0] == NB
    rows = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    N = sum(rows)
    head = [*rows, K, bs is not None, add is not None, res is not None, emu_build.f32_bits(eps),
            topk, int(norm_topk), int(w_f32), active is not None]
    tensors = [*ws, *(bs or []), x, add, nw if b["MODE"] == 1 else None, res]
    words = [head] + [emu_build.bf16_words(t) for t in tensors if t is not None]
    if active is not None:
        words.append(active.to(torch.int64).numpy())
    if b["LANE_ADDR"]:
        words.append(table.numpy())
    got = emu_build.run(work / name, words)
    tiles = -(-N // (16 * b["RT"]))
    sizes = {"out": NB * N, "h_out": NB * K, "x_out": NB * K, "logits": NB * N,
             "ids": NB * topk, "weights": NB * topk, "lane_addr": NB * topk, "ticket": 1,
             "tile_tickets": tiles}
    assert got.size == sum(sizes.values())
    res_, at = {}, 0
    for key, n in sizes.items():
        res_[key] = got[at:at + n]
        at += n
    out = {"out": emu_build.bf16(res_["out"], (NB, N)), "h_out": emu_build.bf16(res_["h_out"], (NB, K)),
           "x_out": emu_build.bf16(res_["x_out"], (NB, K)),
           "logits": torch.from_numpy(res_["logits"].astype(np.uint32).view(np.float32).copy())
           .reshape(NB, N),
           "ids": torch.from_numpy(res_["ids"].astype(np.int32)).reshape(NB, topk),
           "lane_addr": torch.from_numpy(res_["lane_addr"].copy()),
           "ticket": int(res_["ticket"][0]), "tile_tickets": res_["tile_tickets"]}
    if w_f32:
        out["weights"] = torch.from_numpy(
            res_["weights"].astype(np.uint32).view(np.float32).copy()).reshape(NB, topk)
    else:
        out["weights"] = emu_build.bf16(res_["weights"], (NB, topk))
    return out


def rand(*shape, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("name,rows,K,variant", [
    ("plain", [100, 37, 37], 136, "plain"),      # three matrices, N and K not whole tiles
    ("plain", [100, 37, 37], 136, "bias"),
    ("norm", [40, 9], 4104, "norm_add"),         # K past one x tile: staged tile by tile
    ("norm", [64, 16, 16], 2048, "norm_add"),    # K one x tile: h read once
    ("norm", [33], 264, "norm"),
    ("residual", [61], 4104, "residual"),        # K over 3 (42, 43, 43 chunks + a part chunk)
])
def test_gemv_kernel_source_matches_reference_on_cpu(builds, name, rows, K, variant):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name},{rows},{K},{variant}".encode()))
    NB = BUILDS[name]["NB"]
    ws = [rand(n, K, scale=0.05, gen=gen) for n in rows]
    bs = [rand(n, scale=0.5, gen=gen) for n in rows] if variant == "bias" else None
    x = rand(NB, K, scale=2.0, gen=gen)
    add = rand(NB, K, gen=gen) if variant == "norm_add" else None
    nw = rand(K, scale=0.3, gen=gen) + 1 if variant.startswith("norm") else None
    res = rand(NB, sum(rows), gen=gen) if variant == "residual" else None
    got = run_kernel(builds, name, ws, bs, x, add=add, nw=nw, res=res)
    if nw is not None:
        h, xin = ref.residual_norm(x, add, nw, 1e-6)
        if add is not None:
            assert torch.equal(got["h_out"], h), "h = in + add must round as torch's bf16 add"
        else:
            assert got["h_out"].isnan().all(), "h_out written without an add"
        step = xin.float().abs() * 2 ** -7 + 1e-30
        assert ((got["x_out"].float() - xin.float()).abs() <= step).all(), "x_out off by > 1 step"
        xin = got["x_out"]            # the product on the kernel's own normed x (test_gpu_dense)
    else:
        xin = x
    want = ref.gemv(ws, bs, xin)
    size = None
    if res is not None:
        size = res.float().abs() + want.float().abs()
        want = res + want
    close(got["out"], want, f"{name} {variant} rows={rows} K={K}", size)
    assert not got["tile_tickets"].any(), "a tile's ticket is not back at zero"


# route.cuh's segments of 4 experts a lane (128, 96), 7 (200: the last lane's segment cut
# short), 2 (60), 16 (512) and 20 (640)
@pytest.mark.parametrize("name,E,K,H", [("route", 128, 8, 2048), ("route", 200, 6, 264),
                                        ("route_split", 60, 4, 264), ("route_split", 96, 6, 264),
                                        ("route_split", 512, 10, 2048),
                                        ("route_split", 640, 8, 264)])   # more than 512
@pytest.mark.parametrize("w_f32", [False, True])
def test_route_kernel_source_matches_reference_on_cpu(builds, name, E, K, H, w_f32):
    """Logits, the top-k of the reference rule on them, the weights, the lane addresses
    (table[id], 0 for an inactive token), and both tickets back at zero."""
    gen = torch.Generator().manual_seed(E * 31 + K + H + w_f32)
    NB = BUILDS[name]["NB"]
    w = rand(E, H, scale=0.02, gen=gen)
    h = rand(NB, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    active = torch.rand(NB, generator=gen) > 0.3
    active[0] = True
    active[-1] = NB == 1
    table = torch.randint(1, 2**47, (E,), generator=gen)
    got = run_kernel(builds, name, [w], None, h, nw=nw, topk=K, norm_topk=True, w_f32=w_f32,
                     active=active, table=table)
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    close(got["logits"].to(torch.bfloat16), ref.gemv([w], None, xin), "router logits")
    wdtype = torch.float32 if w_f32 else torch.bfloat16
    ids, wts = ref.route_topk(got["logits"].to(torch.bfloat16), K, True, wdtype, active)
    assert torch.equal(got["ids"], ids), (got["ids"], ids)
    if w_f32:
        assert torch.allclose(got["weights"], wts, rtol=1e-6, atol=1e-7)
    else:                          # one bf16 step where float division orders differ
        assert torch.allclose(got["weights"].float(), wts.float(), rtol=2 ** -7, atol=0)
    assert torch.equal(got["lane_addr"], ref.lane_addresses(ids, table))
    assert got["ticket"] == 0 and not got["tile_tickets"].any()


@pytest.mark.parametrize("name,E,K", [("route", 128, 8), ("route", 200, 6), ("route_split", 96, 6),
                                      ("route_split", 512, 10), ("route_split", 640, 8)])
def test_route_ties_and_nan_on_cpu(builds, name, E, K):
    """Four experts with equal router rows (two in one lane's segment of the top-k) come out in
    ascending order; a NaN in one row makes every probability NaN, which counts as largest: the
    top-k is then experts 0 … K − 1 with NaN weights (test_gpu_dense.py's case)."""
    gen = torch.Generator().manual_seed(E * 7 + K)
    NB, H = BUILDS[name]["NB"], 2048
    h = rand(NB, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    w = rand(E, H, scale=0.02, gen=gen)
    tied = [E - 1, E // 2 + 3, 5, E // 2]
    w[tied] = (0.05 * xin[0].float().sign()).to(torch.bfloat16)   # token 0's largest logits
    w_nan = w.clone()
    w_nan[9, 100] = float("nan")
    active = torch.ones(NB, dtype=torch.bool)
    table = torch.randint(1, 2**47, (E,), generator=gen)
    for weights, nan in ((w, False), (w_nan, True)):
        got = run_kernel(builds, name, [weights], None, h, nw=nw, topk=K, norm_topk=True,
                         w_f32=True, active=active, table=table)
        ids, _ = ref.route_topk(got["logits"].to(torch.bfloat16), K, True, torch.float32, active)
        assert torch.equal(got["ids"], ids), (nan, got["ids"], ids)
        if nan:
            assert got["logits"][:, 9].isnan().all()
            assert got["ids"][0].tolist() == list(range(K))
            assert got["weights"][0].isnan().all()
        else:
            assert got["logits"][0, tied].unique().numel() == 1, "tied rows gave unequal logits"
            assert got["ids"][0, :4].tolist() == sorted(tied), got["ids"][0]
        assert torch.equal(got["lane_addr"], ref.lane_addresses(got["ids"], table))


def test_gemv_emulation_sees_a_missing_tile(tmp_path):
    """The harness can fail: a kernel whose last row tile is never written leaves its poison,
    which the bound above reports."""
    emu_build.require()
    emu_build.stage(tmp_path, "dense_gemv", HEADERS, replace={
        "const i32 r0 = blockIdx.x * (RT * 16);":
            "if (blockIdx.x + 1 == gridDim.x) return;\n    const i32 r0 = blockIdx.x * (RT * 16);"})
    emu_build.compile_all(tmp_path, "gemv_main.cpp", {"plain": BUILDS["plain"]})
    gen = torch.Generator().manual_seed(3)
    ws, x = [rand(40, 64, scale=0.05, gen=gen)], rand(3, 64, gen=gen)
    got = run_kernel(tmp_path, "plain", ws, None, x)
    assert got["out"][:, 32:].isnan().all() and not got["out"][:, :32].isnan().any()
    with pytest.raises(AssertionError, match="NaN left"):
        close(got["out"], ref.gemv(ws, None, x), "broken")
