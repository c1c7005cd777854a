"""rawkernels/dense_gemv.cu run on the CPU against `cupool.reference.dense`, within
test_gpu_dense.py's bound (its `close`).

The kernel's own source is compiled with g++ against tests/emu (the CUDA features it uses
emulated, every block of its grid run one after another; `gemv_main.cpp` drives it), so the
fused step's GEMVs are checked without a GPU: the three matrices side by side, biases, the
residual sum and RMSNorm prologue (h read once where K is one x tile, staged tile by tile past
it; transformers' norm and the (1 + w) one, NORM1), the GLU prologue of a gated MLP's down
projection (silu(gate) · up; a shared expert's sigmoid gate, GATE), the residual epilogue, K split
over blocks with the tiles' tickets, two row tiles a block,
and the router's softmax top-k with its ties, NaN rule, inactive tokens and lane addresses. The
NVFP4 builds (WFP4: weights as `cupool.layout.dense_strips`, dequantised by mma_fp4.cuh, each
matrix's sums times its global scale) are checked the same way against the reference on the
dequantized matrices. What concurrent blocks do to each other is the GPU tests' part
(test_gpu_dense.py).
"""

from __future__ import annotations

import dataclasses
import zlib

import _emu_build as emu_build
import numpy as np
import pytest
import torch
from test_gpu_dense import close

from cupool import dense_nvfp4, nvfp4
from cupool.reference import dense as ref

# NB, MODE (1: norm, 2: GLU), EPI (0 plain, 1 + residual, 2 route), WARPS, RT, KS, LANE_ADDR; WFP4 = 1:
# NVFP4 weights (absent: bf16)
BUILDS = {
    "plain": dict(NB=3, MODE=0, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0),
    "norm": dict(NB=3, MODE=1, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0),
    # the (1 + w) RMSNorm (Qwen3-Next's, Gemma's: NORM1)
    "norm1": dict(NB=3, MODE=1, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0, NORM1=1),
    "residual": dict(NB=13, MODE=0, EPI=1, WARPS=4, RT=2, KS=3, LANE_ADDR=0),
    "route": dict(NB=1, MODE=1, EPI=2, WARPS=8, RT=1, KS=1, LANE_ADDR=1),   # Qwen3-30B-A3B's
    "route_split": dict(NB=5, MODE=1, EPI=2, WARPS=4, RT=1, KS=3, LANE_ADDR=1),
    # a router with a bias (gpt-oss's): the bias added to the sums before the logits' rounding
    "route_bias": dict(NB=3, MODE=1, EPI=2, WARPS=8, RT=1, KS=1, LANE_ADDR=0, RBIAS=1),
    "route_bias_split": dict(NB=1, MODE=1, EPI=2, WARPS=8, RT=1, KS=5, LANE_ADDR=1, RBIAS=1),
    # sigmoid routing with a correction bias (DeepSeek-V3's, GLM-4.5's routers: SIG)
    "route_sigmoid": dict(NB=3, MODE=1, EPI=2, WARPS=8, RT=1, KS=1, LANE_ADDR=1, SIG=1),
    "route_sigmoid_split": dict(NB=1, MODE=1, EPI=2, WARPS=4, RT=1, KS=3, LANE_ADDR=0, SIG=1),
    # the GLU prologue (MODE 2: a gated MLP's down projection on silu(gate) · up): a dense
    # layer's MLP; a shared expert added to the routed experts' sum; one with a sigmoid gate
    # (GATE: rows of 2K + 1 columns, read a column at a time)
    "glu": dict(NB=3, MODE=2, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0),
    "glu_residual": dict(NB=5, MODE=2, EPI=1, WARPS=4, RT=1, KS=3, LANE_ADDR=0),
    "glu_gate": dict(NB=3, MODE=2, EPI=1, WARPS=8, RT=2, KS=1, LANE_ADDR=0, GATE=1),
    "fp4_glu_gate": dict(NB=2, MODE=2, EPI=1, WARPS=4, RT=1, KS=2, LANE_ADDR=0, WFP4=1, GATE=1),
    "fp4_plain": dict(NB=3, MODE=0, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0, WFP4=1),
    # 9 to 16 tokens: two MMA n tiles, x tiles of KT = 1024 columns
    "fp4_norm_nb10": dict(NB=10, MODE=1, EPI=0, WARPS=8, RT=1, KS=1, LANE_ADDR=0, WFP4=1),
    "fp4_residual": dict(NB=13, MODE=0, EPI=1, WARPS=4, RT=2, KS=3, LANE_ADDR=0, WFP4=1),
    # Qwen3-30B-A3B's decode launches (cupool.fused.DEFAULT_DENSE_SHAPE): qkv, o-projection
    "fp4_qkv": dict(NB=1, MODE=1, EPI=0, WARPS=4, RT=1, KS=1, LANE_ADDR=0, WFP4=1),
    "fp4_o": dict(NB=1, MODE=0, EPI=1, WARPS=4, RT=1, KS=4, LANE_ADDR=0, WFP4=1),
    # the same launches as the launcher builds them (ops.dense_gemv.predequant_chunks: 8 and 4
    # chunks a warp dequantised before the wait), and an odd one: uneven slices of 10, 11, 11
    # chunks (K = 2000, the last chunk a part), 2 chunks a warp
    "fp4_qkv_pre": dict(NB=1, MODE=1, EPI=0, WARPS=4, RT=1, KS=1, LANE_ADDR=0, WFP4=1, PRE=8),
    "fp4_o_pre": dict(NB=1, MODE=0, EPI=1, WARPS=4, RT=1, KS=4, LANE_ADDR=0, WFP4=1, PRE=4),
    "fp4_residual_pre": dict(NB=5, MODE=0, EPI=1, WARPS=8, RT=1, KS=3, LANE_ADDR=0, WFP4=1,
                             PRE=2),
}
NAN16 = 0x7FC0
# the rawkernels headers dense_gemv.cu includes besides common.cuh
HEADERS = ("route.cuh", "mma_fp4.cuh")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("gemv_emu")
    emu_build.stage(work, "dense_gemv", HEADERS)
    emu_build.compile_all(work, "gemv_main.cpp", BUILDS)
    return work


def run_kernel(work, name, ws, bs, x, add=None, nw=None, res=None, eps=1e-6, topk=0,
               norm_topk=True, w_f32=False, active=None, table=None, sbias=None, sscale=1.0):
    """The emulated launch over grid (tiles, KS): a dict of what it wrote (poisoned where not).
    ws: bf16 matrices, or `DenseNVFP4` ones for a WFP4 build; sbias (float32 [N]) and sscale
    for a SIG build."""
    b = BUILDS[name]
    fp4 = b.get("WFP4", 0) == 1
    NB, K = b["NB"], ws[0].cols if fp4 else ws[0].shape[1]
    # x: [NB, K], or a gated MLP's gate and up output [NB, 2K (+ 1)] for the GLU prologue
    assert x.shape == (NB, 2 * K + b.get("GATE", 0) if b["MODE"] == 2 else K)
    rows = [w.rows if fp4 else w.shape[0] for w in ws] + [0] * (3 - len(ws))
    N = sum(rows)
    head = [*rows, K, bs is not None, add is not None, res is not None, emu_build.f32_bits(eps),
            topk, int(norm_topk), int(w_f32), active is not None]
    if fp4:
        head += [emu_build.f32_bits(w.global_scale) for w in ws] + [0] * (3 - len(ws))
        weights = [w.strips.contiguous().numpy().reshape(-1).view(np.int64) for w in ws]
    else:
        weights = [emu_build.bf16_words(w) for w in ws]
    tensors = [*(bs or []), x, add, nw if b["MODE"] == 1 else None, res]
    words = [head, *weights] + [emu_build.bf16_words(t) for t in tensors if t is not None]
    if active is not None:
        words.append(active.to(torch.int64).numpy())
    if b["LANE_ADDR"]:
        words.append(table.numpy())
    if b.get("SIG"):
        words.append(sbias.to(torch.float32).numpy().view(np.uint32).astype(np.int64))
        words.append([emu_build.f32_bits(sscale)])
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


# gpt-oss-120b's router (128 experts, top-4, H = 2880: past one x tile) and an odd one
@pytest.mark.parametrize("name,E,K,H", [("route_bias", 128, 4, 2880), ("route_bias", 37, 3, 264),
                                        ("route_bias_split", 128, 4, 2880)])
def test_route_bias_kernel_source_matches_reference_on_cpu(builds, name, E, K, H):
    """RBIAS: logits = bf16(x·W + bias) as a Linear with a bias rounds, then the same top-k.
    The biases are large beside the products, so a kernel that left them out would route
    elsewhere (checked: the logits without them differ)."""
    gen = torch.Generator().manual_seed(E * 13 + K + H)
    NB = BUILDS[name]["NB"]
    w = rand(E, H, scale=0.02, gen=gen)
    bias = rand(E, scale=2.0, gen=gen)
    h = rand(NB, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    active = torch.ones(NB, dtype=torch.bool)
    table = torch.randint(1, 2**47, (E,), generator=gen)
    got = run_kernel(builds, name, [w], [bias], h, nw=nw, topk=K, norm_topk=True, w_f32=False,
                     active=active, table=table)
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    want = ref.gemv([w], [bias], xin)
    close(got["logits"].to(torch.bfloat16), want, "router logits with a bias")
    assert rel_err(got["logits"], ref.gemv([w], None, xin).float()) > 0.1
    ids, wts = ref.route_topk(got["logits"].to(torch.bfloat16), K, True, torch.bfloat16, active)
    assert torch.equal(got["ids"], ids), (got["ids"], ids)
    assert torch.allclose(got["weights"].float(), wts.float(), rtol=2 ** -7, atol=0)
    assert got["ticket"] == 0 and not got["tile_tickets"].any()


# GLM-4.5-Air's router (128 experts, top-8, H = 4096: past one x tile), DeepSeek-V3's (256), Kimi
# K2's (384: 12 a lane), and odd ones (37: a short last segment; K split over 3 blocks)
@pytest.mark.parametrize("name,E,K,H", [("route_sigmoid", 128, 8, 4096),
                                        ("route_sigmoid", 256, 8, 264),
                                        ("route_sigmoid", 384, 8, 264),
                                        ("route_sigmoid", 37, 3, 264),
                                        ("route_sigmoid_split", 160, 6, 2048)])
@pytest.mark.parametrize("norm_topk,scale,w_f32", [(True, 1.0, True), (False, 2.5, True),
                                                   (True, 2.5, False)])
def test_route_sigmoid_kernel_source_matches_reference_on_cpu(builds, name, E, K, H, norm_topk,
                                                              scale, w_f32):
    """SIG: sigmoid scores, the top-k of scores + the correction bias, weights the chosen scores
    (normalised or not, times the scale), as `ref.route_sigmoid` on the kernel's logits; two
    experts with equal rows and biases come out in ascending order; inactive tokens get −1 and 0.
    The biases move the choice (checked: without them the ids differ), so a kernel that left
    them out would fail."""
    gen = torch.Generator().manual_seed(E * 17 + K + H + int(norm_topk) + int(w_f32))
    NB = BUILDS[name]["NB"]
    w = rand(E, H, scale=0.02, gen=gen)
    h = rand(NB, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    w[[E - 2, 1]] = (0.05 * xin[0].float().sign()).to(torch.bfloat16)   # tied, token 0's top
    sbias = torch.randn(E, generator=gen) * 0.3
    sbias[[E - 2, 1]] = 2.0                   # above every other score + bias
    active = torch.ones(NB, dtype=torch.bool)
    active[-1] = NB == 1
    table = torch.randint(1, 2**47, (E,), generator=gen)
    got = run_kernel(builds, name, [w], None, h, nw=nw, topk=K, norm_topk=norm_topk,
                     w_f32=w_f32, active=active, table=table, sbias=sbias, sscale=scale)
    want = xin.float() @ w.float().T                    # float32 logits, not rounded to bf16
    assert torch.allclose(got["logits"], want, rtol=1e-4, atol=1e-4), \
        float((got["logits"] - want).abs().max())
    assert not torch.equal(got["logits"], got["logits"].to(torch.bfloat16).float())
    wdtype = torch.float32 if w_f32 else torch.bfloat16
    ids, wts = ref.route_sigmoid(got["logits"], sbias, K, norm_topk, scale, wdtype, active)
    assert torch.equal(got["ids"], ids), (got["ids"], ids)
    assert got["ids"][0, :2].tolist() == [1, E - 2], got["ids"][0]
    unbiased, _ = ref.route_sigmoid(got["logits"], torch.zeros(E), K, norm_topk, scale, wdtype,
                                    active)
    assert not torch.equal(unbiased, ids)
    if w_f32:
        assert torch.allclose(got["weights"], wts, rtol=1e-6, atol=1e-7)
    else:                          # one bf16 step where float rounding orders differ
        assert torch.allclose(got["weights"].float(), wts.float(), rtol=2 ** -7, atol=0)
    if BUILDS[name]["LANE_ADDR"]:
        assert torch.equal(got["lane_addr"], ref.lane_addresses(ids, table))
    assert got["ticket"] == 0 and not got["tile_tickets"].any()


def test_route_sigmoid_nan_on_cpu(builds):
    """A NaN logit's score counts as largest: that expert comes first, its weight NaN, and with
    norm_topk every weight of the token NaN (their sum is); the other tokens route as usual."""
    gen = torch.Generator().manual_seed(5)
    E, K, H, NB = 128, 8, 264, BUILDS["route_sigmoid"]["NB"]
    w = rand(E, H, scale=0.02, gen=gen)
    h = rand(NB, H, scale=3.0, gen=gen)
    h[1, 7] = float("nan")                     # token 1's every logit NaN: experts 0 … K − 1
    nw = rand(H, scale=0.3, gen=gen) + 1
    sbias = torch.randn(E, generator=gen) * 0.3
    active = torch.ones(NB, dtype=torch.bool)
    table = torch.randint(1, 2**47, (E,), generator=gen)
    for norm in (True, False):
        got = run_kernel(builds, "route_sigmoid", [w], None, h, nw=nw, topk=K, norm_topk=norm,
                         w_f32=True, active=active, table=table, sbias=sbias, sscale=1.0)
        ids, wts = ref.route_sigmoid(got["logits"], sbias, K, norm, 1.0, torch.float32, active)
        assert torch.equal(got["ids"], ids), (got["ids"], ids)
        assert got["ids"][1].tolist() == list(range(K))
        assert got["weights"][1].isnan().all()
        assert torch.allclose(got["weights"][0], wts[0], rtol=1e-6, atol=1e-7)


# the (1 + w) RMSNorm (NORM1): K past one x tile (staged tile by tile), an odd K of one tile,
# Qwen3-Next-80B-A3B's QKV at H = 2048 (q with its gates 2·16·256 rows, k and v 2·256: h read
# once)
@pytest.mark.parametrize("rows,K", [([40, 9], 4104), ([33], 264), ([8192, 512, 512], 2048)])
def test_gemv_one_plus_norm_matches_reference_on_cpu(builds, rows, K):
    """NORM1 against GemvReference(one_plus=True) on fresh random inputs (the norm's weight,
    stored as w − 1, random around 0; h = in + add), within the normed tests' bounds above: h
    exact, x within one bf16 step, the product (on the kernel's own x) within `close`. The
    check can fail: the same launch is off beyond those bounds against transformers' norm
    (x̂ rounded, then times the stored weight), and x matches the one-rounding reference in far
    more elements than the same norm rounded twice, bf16(bf16(1 + w) · bf16(x̂))."""
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    what = f"norm1 rows={rows} K={K} seed={seed}"
    NB, N = BUILDS["norm1"]["NB"], sum(rows)
    ws = [rand(n, K, scale=0.05, gen=gen) for n in rows]
    x = rand(NB, K, scale=2.0, gen=gen)
    add = rand(NB, K, gen=gen)
    nw = rand(K, scale=0.3, gen=gen)
    got = run_kernel(builds, "norm1", ws, None, x, add=add, nw=nw)

    def reference(one_plus):
        want = {k: torch.full((NB, n), float("nan"), dtype=torch.bfloat16)
                for k, n in (("out", N), ("h_out", K), ("x_out", K))}
        ref.GemvReference(ws, tokens=NB, norm=True, one_plus=one_plus)(
            x, add=add, norm_weight=nw, eps=1e-6, **want)
        return want

    want = reference(True)
    assert torch.equal(got["h_out"], want["h_out"]), f"{what}: h = in + add must round as torch's"
    step = want["x_out"].float().abs() * 2 ** -7 + 1e-30
    off = (got["x_out"].float() - want["x_out"].float()).abs() > step
    assert not off.any(), f"{what}: x_out off by > 1 step at {off.nonzero()[:4].tolist()}"
    product = torch.full((NB, N), float("nan"), dtype=torch.bfloat16)
    ref.GemvReference(ws, tokens=NB)(got["x_out"], out=product)
    close(got["out"], product, what)
    assert not got["tile_tickets"].any(), "a tile's ticket is not back at zero"

    # transformers' norm on the same inputs: x, and so the output, far off
    plain = reference(False)
    assert ((got["x_out"].float() - plain["x_out"].float()).abs() > step).any()
    with pytest.raises(AssertionError, match="relative error|elements off"):
        close(got["out"], plain["out"], f"{what} against transformers' norm")
    # one rounding, not two: x equals the reference almost everywhere (where the two rsqrt
    # and sums do not straddle a rounding boundary), the twice-rounded norm far less often
    h = want["h_out"].float()
    xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    twice = (1.0 + nw.float()).to(torch.bfloat16) * xhat.to(torch.bfloat16)
    once_off = float((got["x_out"] != want["x_out"]).float().mean())
    twice_off = float((got["x_out"] != twice).float().mean())
    assert once_off < 0.02 < 0.1 < twice_off, (what, once_off, twice_off)


# a dense layer's MLP (K a partial chunk; K past one x tile), GLM-4.5-Air's shared expert
# (K = 1408) over 3 K slices, gated shared experts of Qwen2-MoE's size (K = 5632, three x tiles)
# and an odd one, and the NVFP4 build (K one tile; K a partial chunk)
@pytest.mark.parametrize("name,rows,K", [
    ("glu", [37], 264), ("glu", [64], 4104), ("glu_residual", [61], 1408),
    ("glu_gate", [100], 5632), ("glu_gate", [33], 520),
    ("fp4_glu_gate", [48], 1408), ("fp4_glu_gate", [37], 208)])
def test_gemv_glu_matches_reference_on_cpu(builds, name, rows, K):
    """The GLU prologue against GemvReference(glu=True, glu_gate=GATE) on fresh random gate and
    up rows (and gate logits) of a spread that covers silu's bend, with the residual (the routed
    experts' sum) for EPI 1, within `close` at the size of the sum's terms. The check can fail:
    the same launch is off beyond the bound against the gate and up halves swapped, and (GATE)
    against the product without its sigmoid gate."""
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    b = BUILDS[name]
    NB, N, gate = b["NB"], sum(rows), b.get("GATE", 0) == 1
    fp4 = b.get("WFP4", 0) == 1
    what = f"{name} rows={rows} K={K} seed={seed}"
    ws = [fp4_matrix(n, K, 0.05, gen) if fp4 else rand(n, K, scale=0.05, gen=gen) for n in rows]
    gu = rand(NB, 2 * K + gate, scale=2.0, gen=gen)
    res = rand(NB, N, gen=gen) if b["EPI"] == 1 else None
    got = run_kernel(builds, name, ws, None, gu, res=res)

    def reference(gu, glu_gate):
        want = torch.full((NB, N), float("nan"), dtype=torch.bfloat16)
        ref.GemvReference(ws, tokens=NB, epilogue=b["EPI"], glu=True, glu_gate=glu_gate)(
            gu, residual=res, out=want)
        return want

    want = reference(gu, gate)
    size = None if res is None else res.float().abs() + (want - res).float().abs()
    close(got["out"], want, what, size)
    assert not got["tile_tickets"].any(), "a tile's ticket is not back at zero"
    swapped = torch.cat([gu[:, K:2 * K], gu[:, :K], gu[:, 2 * K:]], dim=1)
    with pytest.raises(AssertionError, match="relative error|elements off"):
        close(got["out"], reference(swapped, gate), f"{what} against silu(up) · gate", size)
    if gate:
        with pytest.raises(AssertionError, match="relative error|elements off"):
            close(got["out"], reference(gu[:, :2 * K].contiguous(), False),
                  f"{what} without its gate", size)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


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


def fp4_matrix(n, K, scale, gen):
    """A DenseNVFP4 [n, K] of random normal weights times `scale` (the global scale follows it),
    checked to hold the very values its NVFP4Tensor dequantizes to: the reference then does not
    rest on the strips alone."""
    q = nvfp4.quantize(torch.randn(n, K, generator=gen) * scale)
    w = dense_nvfp4.pack(q)
    assert torch.equal(w.dequantize(torch.float32), nvfp4.dequantize(q, torch.float32))
    return w


def fp4_case(name, rows, K, bias, add, seed):
    """Inputs of an NVFP4 build: matrices of `rows` with global scales a decade apart, their
    biases (bias), x, the residual stream's addend (add), the norm's weight (MODE 1) and res2
    (EPI 1)."""
    gen = torch.Generator().manual_seed(seed)
    b = BUILDS[name]
    NB = b["NB"]
    ws = [fp4_matrix(n, K, 0.05 * 10.0 ** (i - 1), gen) for i, n in enumerate(rows)]
    bs = [rand(n, scale=0.5, gen=gen) for n in rows] if bias else None
    x = rand(NB, K, scale=2.0, gen=gen)
    norm = b["MODE"] == 1
    return dict(ws=ws, bs=bs, x=x, add=rand(NB, K, gen=gen) if add else None,
                nw=rand(K, scale=0.3, gen=gen) + 1 if norm else None,
                res=rand(NB, sum(rows), gen=gen) if b["EPI"] == 1 else None)


def fp4_check(got, name, c, what):
    """The emulated NVFP4 launch `got` against GemvReference on the dequantized matrices (the
    normed x checked as the bf16 test does, and the product taken on the kernel's own x)."""
    b = BUILDS[name]
    xin = c["x"]
    if b["MODE"] == 1:
        h, want_x = ref.residual_norm(c["x"], c["add"], c["nw"], 1e-6)
        if c["add"] is not None:
            assert torch.equal(got["h_out"], h), "h = in + add must round as torch's bf16 add"
        step = want_x.float().abs() * 2 ** -7 + 1e-30
        off = (got["x_out"].float() - want_x.float()).abs() > step
        assert not off.any(), "x_out off by > 1 step"
        xin = got["x_out"]
    want = torch.empty_like(got["out"])
    ref.GemvReference(c["ws"], c["bs"], tokens=b["NB"])(xin, out=want)
    size = None
    if c["res"] is not None:         # a residual sum rounds at the size of its terms
        size = c["res"].float().abs() + want.float().abs()
        want = c["res"] + want
    close(got["out"], want, what, size)
    assert not got["tile_tickets"].any(), "a tile's ticket is not back at zero"


# name, rows of each matrix, K, biases, add (norm builds)
FP4_CASES = [
    ("fp4_plain", [40], 208, False, False),           # last row tile partial, K a partial chunk
    ("fp4_plain", [48, 16, 37], 208, True, False),    # three matrices, each its global scale
    ("fp4_qkv", [64, 32, 40], 2048, True, True),      # K one x tile: h read once
    ("fp4_qkv", [16, 24], 80, False, False),          # K one chunk and a part, no add
    ("fp4_norm_nb10", [32, 24], 1088, True, True),    # K past one x tile (KT = 1024)
    ("fp4_residual", [61], 3088, False, False),       # K over 3 (16, 16, 17 chunks, the last a
                                                      # part chunk and past an x tile)
    # Qwen3-30B-A3B: qkv (q 4096, k and v 512 rows of K = 2048) and the o-projection (2048 rows
    # of K = 4096), full size
    ("fp4_qkv", [4096, 512, 512], 2048, False, True),
    ("fp4_o", [2048], 4096, False, False),
    # the fragments dequantised before the wait
    ("fp4_qkv_pre", [64, 32, 40], 2048, True, True),
    ("fp4_qkv_pre", [16, 24], 80, False, False),
    ("fp4_qkv_pre", [4096, 512, 512], 2048, False, True),
    ("fp4_o_pre", [2048], 4096, False, False),
    ("fp4_o_pre", [61], 4000, True, False),           # slices of 15, 16, 16, 16 chunks
    ("fp4_residual_pre", [48, 13], 2000, True, False),
]


@pytest.mark.parametrize("name,rows,K,bias,add", FP4_CASES)
def test_gemv_nvfp4_kernel_source_matches_reference_on_cpu(builds, name, rows, K, bias, add):
    c = fp4_case(name, rows, K, bias, add, zlib.crc32(f"{name},{rows},{K},{bias},{add}".encode()))
    got = run_kernel(builds, name, c["ws"], c["bs"], c["x"], add=c["add"], nw=c["nw"],
                     res=c["res"])
    if BUILDS[name]["MODE"] == 1 and c["add"] is None:
        assert got["h_out"].isnan().all(), "h_out written without an add"
    fp4_check(got, name, c, f"{name} rows={rows} K={K} bias={bias} add={add}")


def test_gemv_nvfp4_nan_x_reaches_the_output_on_cpu(builds):
    """A NaN in one token's x makes every output of that token NaN (an E2M1 code of zero times
    NaN is NaN, as in the reference's product); the other tokens are unaffected. NVFP4 weights
    themselves hold no NaN (the launcher refuses non-finite scales)."""
    name, rows, K = "fp4_plain", [48, 16, 37], 208
    c = fp4_case(name, rows, K, True, False, 11)
    c["x"][1, 100] = float("nan")
    got = run_kernel(builds, name, c["ws"], c["bs"], c["x"])
    want = ref.gemv([w.dequantize(torch.float32) for w in c["ws"]], c["bs"], c["x"])
    assert got["out"][1].isnan().all() and want[1].isnan().all()
    keep = [0, 2]
    close(got["out"][keep], want[keep], "the tokens without a NaN")


def test_gemv_nvfp4_emulation_sees_one_wrong_strip_byte(builds):
    """The NVFP4 comparison can fail: one block scale byte of the strips changed by a factor
    2^8 puts the output row it scales (for every token) outside the bound, and no other row."""
    name, rows, K = "fp4_plain", [40], 208
    c = fp4_case(name, rows, K, False, False, 5)
    w = c["ws"][0]
    strips = w.strips.clone()
    # strip 1, chunk 0, scale byte 2·lane + 1 of lane 4 (g 1, t 0): row 16 + g + 8 = 25,
    # columns 0 … 15; the exponent's top bit
    strips[1, 512 + 2 * 4 + 1] ^= 0x40
    bad = dataclasses.replace(w, strips=strips)
    got = run_kernel(builds, name, [bad], None, c["x"])
    want = ref.gemv([w.dequantize(torch.float32)], None, c["x"])
    with pytest.raises(AssertionError, match="elements off|relative error"):
        close(got["out"], want, "one wrong strip byte")
    off = (got["out"].float() - want.float()).abs() > want.float().abs() * 2 ** -6 + 1e-3
    assert off[:, 25].all() and off.sum() == off.shape[0], off.nonzero().tolist()
