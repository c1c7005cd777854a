"""The fused decode step's kernels against their references (GPU): `dense_gemv.cu` (plain,
residual + RMSNorm prologue, residual and routing epilogues) and `dense_attention.cu` (q/k norm,
rotary, cache write, split-KV attention with windows and sinks), at the Qwen3-30B-A3B shapes and
odd ones, on fresh random inputs with outputs poisoned; then `FusedStep` on wrapped tiny models
against transformers' forward through the same pool, and the engine's greedy tokens.

Tolerances: a bf16 output differs from the reference by its own rounding and the order of float32
sums: relative Frobenius error ≤ GEMV_TOL, every element within ELEM_ULPS bf16 steps of its size
plus ATOL. Sums the kernel must round exactly as torch does (the residual h = in + add) are
compared for equality; the RMSNorm output may differ by one bf16 step where the two rsqrt
implementations straddle a rounding boundary. Routing is checked exactly: the kernel's ids and
weights must be the reference rule applied to the kernel's own logits.

Launch shapes (blocks of 4 warps, K split over blocks) are held to the same tolerances: a split K
sums its partials in another order, which is within the float32 order the tolerances allow for.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from test_fused_step import rel

from cupool.reference import dense as ref

pytestmark = pytest.mark.gpu

GEMV_TOL = 4e-3
ELEM_ULPS = 2 ** -6        # four bf16 steps of the value's size
ATOL = 1e-3
ATTN_TOL = 1e-2


def close(got, want, what: str, size=None):
    """size: the magnitude each element's rounding scales with (default |want|; a residual sum
    rounds at the size of its terms, which may cancel)."""
    assert not got.isnan().any(), f"{what}: NaN left (a poisoned element not written)"
    assert rel(got, want) <= GEMV_TOL, f"{what}: relative error {rel(got, want):.2e}"
    size = want.float().abs() if size is None else size
    bad = (got.float() - want.float()).abs() > size * ELEM_ULPS + ATOL
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, first at {bad.nonzero()[0].tolist()}"


def rand(*shape, scale=1.0, gen=None):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def poison(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


GEMV_CASES = [  # tokens, rows of each matrix, K
    (1, [4096, 512, 512], 2048), (8, [4096, 512, 512], 2048), (16, [2048], 4096),
    (1, [2048], 4096), (3, [100, 37, 37], 136), (13, [33], 4104), (5, [16], 8),
    (2, [20011], 264),                                  # tall: two row tiles a block
]


# launch shapes (DenseGemv's warps, split_k): the Qwen3-30B-A3B QKV / o-projection at the shapes
# CUPOOL_DENSE_SHAPE offers, then K slices of unequal chunks (4096 / 3: 42, 43, 43 chunks), K not
# whole chunks (4104: the last slice ends in a partial chunk; 264 over 8: seven slices of one chunk
# and one of 40 columns), N not whole tiles (174, 33, 20011), two n tiles, two row tiles a block
SHAPE_CASES = [  # tokens, rows of each matrix, K, shape
    (1, [4096, 512, 512], 2048, dict(warps=4)), (8, [4096, 512, 512], 2048, dict(warps=4, split_k=8)),
    (1, [2048], 4096, dict(split_k=2)), (1, [2048], 4096, dict(split_k=3)),
    (16, [2048], 4096, dict(warps=4, split_k=2)), (3, [100, 37, 37], 4104, dict(split_k=3)),
    (13, [33], 4104, dict(split_k=8)), (2, [20011], 264, dict(split_k=8)),
    (5, [16], 8, dict(warps=4)), (13, [33], 4104, dict(warps=4)),
]


def _shape_id(shape: dict) -> str:
    return "".join(f"{k[0]}{v}" for k, v in shape.items()) or "default"


@pytest.mark.parametrize("tokens,rows,K,shape",
                         [(*c, {}) for c in GEMV_CASES] + SHAPE_CASES,
                         ids=[f"B{c[0]}-N{sum(c[1])}-K{c[2]}-{_shape_id(c[3] if len(c) > 3 else {})}"
                              for c in GEMV_CASES + SHAPE_CASES])
@pytest.mark.parametrize("variant", ["plain", "norm", "norm_add", "residual", "bias"])
def test_dense_gemv_matches_reference(tokens, rows, K, shape, variant):
    from cupool.ops.dense_gemv import NORM, PLAIN, RESIDUAL, DenseGemv  # noqa: F401
    # a seed of the case (str hashes change from process to process)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{tokens},{K},{variant}".encode()))
    ws = [rand(n, K, scale=0.05, gen=gen) for n in rows]
    bs = [rand(n, scale=0.5, gen=gen) for n in rows] if variant == "bias" else None
    N = sum(rows)
    norm = variant.startswith("norm")
    epi = RESIDUAL if variant == "residual" else PLAIN
    op = DenseGemv(ws, bs, tokens=tokens, norm=norm, epilogue=epi, **shape)
    x = rand(tokens, K, scale=2.0, gen=gen)
    add = rand(tokens, K, gen=gen) if variant == "norm_add" else None
    nw = rand(K, scale=0.3, gen=gen) + 1 if norm else None
    res = rand(tokens, N, gen=gen) if epi == RESIDUAL else None
    out = poison(tokens, N)
    h_out = poison(tokens, K) if add is not None else None
    x_out = poison(tokens, K) if norm else None
    kw = {}
    if norm:
        kw = dict(add=add, norm_weight=nw, eps=1e-6, h_out=h_out, x_out=x_out)
    op(x, residual=res, out=out, **kw)
    torch.cuda.synchronize()
    if norm:
        h, xin = ref.residual_norm(x, add, nw, 1e-6)
        if add is not None:
            assert torch.equal(h_out, h), "h = in + add must round as torch's bf16 add"
        step = xin.float().abs() * 2 ** -7 + 1e-30
        assert ((x_out.float() - xin.float()).abs() <= step).all(), "x_out off by > 1 bf16 step"
        # the product is checked on the kernel's own normed x (checked above): an element of x
        # a bf16 step apart moves an output near cancellation past its elementwise bound
        xin = x_out
    else:
        xin = x
    check_product(op, out, ws, bs, xin, res, f"{variant} tokens={tokens} rows={rows} K={K} {shape}")


def check_product(op, out, mats, bs, xin, res, what: str) -> None:
    """out against the reference's product of `mats` (float) with xin, biases bs, plus res where
    given (its elements then round at the size of both terms), and a split GEMV's tile tickets
    back at zero."""
    want = ref.gemv(mats, bs, xin)
    size = None
    if res is not None:
        size = res.float().abs() + want.float().abs()
        want = res + want
    close(out, want, what, size)
    if op.split_k > 1:
        assert int(op.tile_tickets.abs().sum()) == 0, "a tile's ticket is not back at zero"


# the (1 + w) RMSNorm (one_plus, the NORM1 build): Qwen3-Next-80B-A3B's QKV (q with its gates
# 2·16·256 rows, k and v 2·256, H = 2048) at the fused step's default shape and at 8 tokens,
# then K past one x tile, K split over blocks, two row tiles a block, K of one chunk
ONE_PLUS_CASES = [  # tokens, rows of each matrix, K, shape
    (1, [8192, 512, 512], 2048, dict(warps=4)), (8, [8192, 512, 512], 2048, {}),
    (3, [100, 37, 37], 4104, {}), (13, [33], 4104, dict(split_k=3)), (2, [20011], 264, {}),
    (5, [16], 8, {}),
]


@pytest.mark.parametrize("tokens,rows,K,shape", ONE_PLUS_CASES,
                         ids=[f"B{c[0]}-N{sum(c[1])}-K{c[2]}-{_shape_id(c[3])}"
                              for c in ONE_PLUS_CASES])
def test_dense_gemv_one_plus_norm_matches_reference(tokens, rows, K, shape):
    """DenseGemv(norm=True, one_plus=True) against GemvReference(one_plus=True): h_out exact,
    x_out within one bf16 step, the product on the kernel's own x; the norm's weight (stored as
    w − 1) random around 0. x is off from transformers' norm on the same inputs (the NORM1
    build is the one launched), and one_plus without norm is refused."""
    from cupool.ops.dense_gemv import DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    ws = [rand(n, K, scale=0.05, gen=gen) for n in rows]
    N = sum(rows)
    op = DenseGemv(ws, tokens=tokens, norm=True, one_plus=True, **shape)
    assert op.one_plus
    x = rand(tokens, K, scale=2.0, gen=gen)
    add = rand(tokens, K, gen=gen)
    nw = rand(K, scale=0.3, gen=gen)
    out, h_out, x_out = poison(tokens, N), poison(tokens, K), poison(tokens, K)
    op(x, add=add, norm_weight=nw, eps=1e-6, h_out=h_out, x_out=x_out, out=out)
    torch.cuda.synchronize()
    want = {"h_out": poison(tokens, K), "x_out": poison(tokens, K), "out": poison(tokens, N)}
    ref.GemvReference(ws, tokens=tokens, norm=True, one_plus=True)(
        x, add=add, norm_weight=nw, eps=1e-6, **want)
    what = f"one_plus tokens={tokens} rows={rows} K={K} {shape}"
    assert torch.equal(h_out, want["h_out"]), "h = in + add must round as torch's bf16 add"
    step = want["x_out"].float().abs() * 2 ** -7 + 1e-30
    assert ((x_out.float() - want["x_out"].float()).abs() <= step).all(), \
        f"{what}: x_out off by > 1 bf16 step"
    check_product(op, out, ws, None, x_out, None, what)
    _, plain = ref.residual_norm(x, add, nw, 1e-6)
    assert ((x_out.float() - plain.float()).abs() > step).any(), "x_out is transformers' norm"
    with pytest.raises(ValueError, match="one_plus=True belongs to a GEMV built with norm=True"):
        DenseGemv(ws, tokens=tokens, one_plus=True)


# the GLU prologue (a gated MLP's down projection on silu(gate) · up): GLM-4.5-Air's dense MLP
# (K = 10944, six x tiles at batch 1) and shared expert (K = 1408, + the routed experts' sum),
# Qwen3-Next's gated shared expert (K = 512), Qwen2-MoE's (K = 5632) at 8 tokens, then K split
# over blocks, two row tiles a block, K of one chunk, and the NVFP4 build
GLU_CASES = [  # tokens, N, K, epilogue ("plain", "residual", "gate"), shape, fp4
    (1, 4096, 10944, "plain", {}, False), (1, 4096, 1408, "residual", {}, False),
    (1, 2048, 512, "gate", {}, False), (8, 2048, 5632, "gate", {}, False),
    (13, 37, 4104, "gate", dict(warps=4, split_k=3), False),
    (3, 20011, 264, "residual", {}, False), (5, 16, 8, "plain", {}, False),
    (1, 4096, 1408, "gate", {}, True), (9, 61, 208, "residual", dict(split_k=2), True),
]


@pytest.mark.parametrize("tokens,N,K,epi,shape,fp4", GLU_CASES,
                         ids=[f"B{c[0]}-N{c[1]}-K{c[2]}-{c[3]}-{_shape_id(c[4])}"
                              f"{'-fp4' * c[5]}" for c in GLU_CASES])
def test_dense_gemv_glu_matches_reference(tokens, N, K, epi, shape, fp4):
    """DenseGemv(glu=True) against GemvReference(glu=True) on fresh random gate and up rows
    (and gate logits), out poisoned: the product, the routed experts' sum added (residual) and
    scaled by the sigmoid gate first (gate), within `close` at the size of the sum's terms. The
    launch is off against the gate and up halves swapped and (gate) without the gate, so the
    check can fail; x of the wrong width and glu with a norm or gate without a residual are
    refused."""
    from cupool import dense_nvfp4, nvfp4
    from cupool.ops.dense_gemv import PLAIN, RESIDUAL, DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    gate = epi == "gate"
    w = rand(N, K, scale=0.05, gen=gen)
    if fp4:
        w = dense_nvfp4.pack(nvfp4.quantize(w.float()))
    kw = dict(tokens=tokens, epilogue=PLAIN if epi == "plain" else RESIDUAL, glu=True,
              glu_gate=gate)
    op = DenseGemv([w], **kw, **shape)
    gu = rand(tokens, 2 * K + gate, scale=2.0, gen=gen)
    res = None if epi == "plain" else rand(tokens, N, gen=gen)
    out = poison(tokens, N)
    op(gu, residual=res, out=out)
    torch.cuda.synchronize()

    def reference(gu, gated):
        want = poison(tokens, N)
        ref.GemvReference([w], **{**kw, "glu_gate": gated})(gu, residual=res, out=want)
        return want

    want = reference(gu, gate)
    what = f"glu tokens={tokens} N={N} K={K} {epi} {shape} nvfp4={fp4}"
    size = None if res is None else res.float().abs() + (want - res).float().abs()
    close(out, want, what, size)
    swapped = torch.cat([gu[:, K:2 * K], gu[:, :K], gu[:, 2 * K:]], dim=1)
    with pytest.raises(AssertionError, match="relative error|elements off"):
        close(out, reference(swapped, gate), f"{what} against silu(up) · gate", size)
    if gate:
        with pytest.raises(AssertionError, match="relative error|elements off"):
            close(out, reference(gu[:, :2 * K].contiguous(), False), f"{what} ungated", size)
    with pytest.raises(ValueError, match=rf"x must be .*\[{tokens}, {2 * K + gate}\]"):
        op(gu[:, :2 * K - 8].contiguous(), residual=res, out=out)
    with pytest.raises(ValueError, match="glu=True takes neither norm=True nor epilogue=ROUTE"):
        DenseGemv([w], tokens=tokens, norm=True, glu=True)
    with pytest.raises(ValueError, match="glu_gate=True belongs to a GEMV built with glu=True "
                                         "and epilogue=RESIDUAL"):
        DenseGemv([w], tokens=tokens, glu=True, glu_gate=True)


# NVFP4 weights (DenseNVFP4 strips): the Qwen3-30B-A3B QKV and o-projection at the fused step's
# default shapes, then N not whole tiles (the last matrix 40 rows), K not whole 64-column chunks
# (208, 4160 = 65 chunks over 3 slices: 21, 22, 22), two x tiles (16 tokens: 1,024 columns a
# tile), two row tiles a block (N ≥ 16,384), one chunk
FP4_CASES = [  # tokens, rows of each matrix, K, shape
    (1, [4096, 512, 512], 2048, dict(warps=4)), (1, [2048], 4096, dict(warps=4, split_k=4)),
    (8, [4096, 512, 512], 2048, {}), (16, [2048], 4096, dict(split_k=2)),
    (3, [96, 32, 40], 208, {}), (13, [33], 4160, dict(split_k=3)), (2, [16400], 256, {}),
    (5, [16], 16, dict(warps=4)), (9, [64, 48], 2112, dict(warps=4)),
]


@pytest.mark.parametrize("tokens,rows,K,shape", FP4_CASES,
                         ids=[f"B{c[0]}-N{sum(c[1])}-K{c[2]}-{_shape_id(c[3])}" for c in FP4_CASES])
@pytest.mark.parametrize("variant", ["plain", "norm_add", "residual", "bias"])
def test_dense_gemv_nvfp4_matches_reference(tokens, rows, K, shape, variant):
    """The NVFP4 build against the reference's product with the dequantized matrices (each its
    own global scale), within the bf16 build's tolerances: the kernel's fragments are exact
    (E2M1 · block scale · 2^-8), so only the order of float32 sums and the final rounding differ."""
    from cupool import dense_nvfp4, nvfp4
    from cupool.ops.dense_gemv import PLAIN, RESIDUAL, DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(
        zlib.crc32(f"fp4,{tokens},{K},{sum(rows)},{variant}".encode()))
    packed = [dense_nvfp4.pack(nvfp4.quantize(
        torch.randn(n, K, device="cuda", generator=gen) * (0.02 * (i + 1))))
        for i, n in enumerate(rows)]
    mats = [p.dequantize(torch.float32) for p in packed]
    bs = [rand(n, scale=0.5, gen=gen) for n in rows] if variant == "bias" else None
    N = sum(rows)
    norm = variant.startswith("norm")
    epi = RESIDUAL if variant == "residual" else PLAIN
    op = DenseGemv(packed, bs, tokens=tokens, norm=norm, epilogue=epi, **shape)
    assert op.nvfp4
    if tokens == 1 and K in (2048, 4096) and torch.cuda.get_device_properties(0) \
            .multi_processor_count >= 132:
        # Qwen3-30B-A3B's QKV and o: 320 and 512 blocks stay resident (H100 / H200) with their
        # chunks dequantised before the wait, so the launcher takes that build
        assert op.pre == (8 if K == 2048 else 4), op.pre
    x = rand(tokens, K, scale=2.0, gen=gen)
    add = rand(tokens, K, gen=gen) if norm else None
    nw = rand(K, scale=0.3, gen=gen) + 1 if norm else None
    res = rand(tokens, N, gen=gen) if epi == RESIDUAL else None
    out = poison(tokens, N)
    kw = {}
    if norm:
        kw = dict(add=add, norm_weight=nw, eps=1e-6, h_out=poison(tokens, K),
                  x_out=poison(tokens, K))
    op(x, residual=res, out=out, **kw)
    torch.cuda.synchronize()
    xin = kw["x_out"] if norm else x
    if norm:
        h, want_x = ref.residual_norm(x, add, nw, 1e-6)
        assert torch.equal(kw["h_out"], h), "h = in + add must round as torch's bf16 add"
        step = want_x.float().abs() * 2 ** -7 + 1e-30
        assert ((xin.float() - want_x.float()).abs() <= step).all(), "x_out off by > 1 bf16 step"
    check_product(op, out, mats, bs, xin, res,
                  f"nvfp4 {variant} tokens={tokens} rows={rows} K={K} {shape}")


def test_dense_gemv_nvfp4_sees_each_strip_byte():
    """The check above can fail: one code byte of one chunk changed moves the rows it holds."""
    from cupool import dense_nvfp4, nvfp4
    from cupool.ops.dense_gemv import DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(5)
    p = dense_nvfp4.pack(nvfp4.quantize(torch.randn(64, 256, device="cuda", generator=gen)))
    x = rand(1, 256, gen=gen)
    out = poison(1, 64)
    DenseGemv([p], tokens=1)(x, out=out)
    bad = dense_nvfp4.DenseNVFP4(p.strips.clone(), p.global_scale, p.rows, p.cols)
    bad.strips[1, 576 + 7] ^= 0x3F                        # strip 1, chunk 1, lane 1's codes
    out2 = poison(1, 64)
    DenseGemv([bad], tokens=1)(x, out=out2)
    torch.cuda.synchronize()
    close(out, ref.gemv([p.dequantize()], None, x), "nvfp4 before the change")
    changed = (out2 != out)[0].nonzero().flatten().tolist()
    assert changed and all(16 <= r < 32 for r in changed), changed


def router_inputs(tokens: int, E: int, H: int, gen):
    """A router GEMV's inputs: the residual stream h [tokens, H], its norm's weights, the tokens'
    active flags (the last inactive where there are several) and a table of E row addresses."""
    h = rand(tokens, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    active = torch.ones(tokens, dtype=torch.bool, device="cuda")
    active[-1] = tokens == 1
    table = torch.randint(1, 2**47, (E,), device="cuda", generator=gen)
    return h, nw, active, table


def poisoned_route(tokens: int, E: int, K: int, wdtype: torch.dtype):
    """A router GEMV's RouteOut buffers, poisoned (NaN logits and weights, ids −7)."""
    from cupool.ops.dense_gemv import RouteOut
    r = RouteOut.allocate(tokens, E, K, wdtype, "cuda")
    r.logits.fill_(float("nan"))
    r.ids.fill_(-7)
    r.weights.fill_(float("nan"))
    return r


@pytest.mark.parametrize("tokens,E,K", [(1, 128, 8), (8, 128, 8), (16, 128, 8), (3, 512, 10),
                                        (5, 60, 4), (2, 200, 6), (2, 640, 8)])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [{}, dict(warps=4), dict(split_k=2), dict(split_k=3),
                                   dict(split_k=8), dict(warps=4, split_k=8)], ids=_shape_id)
def test_dense_gemv_routes(tokens, E, K, norm_topk, wdtype, shape):
    """With split_k the logits come from each tile's last block and the routing block is the
    last of the tiles' last blocks: a routing block that ran before some tile's logits were
    complete would route on poisoned (NaN) logits."""
    from cupool.ops.dense_gemv import ROUTE, DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(E * 31 + tokens)
    H = 2056 if shape.get("split_k", 1) == 3 else 2048     # 3 slices: the last ends in a part chunk
    w = rand(E, H, scale=0.02, gen=gen)
    op = DenseGemv([w], tokens=tokens, norm=True, epilogue=ROUTE, **shape)
    r = poisoned_route(tokens, E, K, wdtype)
    h = rand(tokens, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    active = torch.rand(tokens, device="cuda", generator=gen) > 0.3
    xn = poison(tokens, H)
    for _ in range(2):                     # twice: the ticket must be back at zero
        op(h, norm_weight=nw, eps=1e-6, x_out=xn, route=r, top_k=K, norm_topk=norm_topk,
           active=active)
    torch.cuda.synchronize()
    assert int(r.ticket.item()) == 0
    if op.split_k > 1:
        assert int(op.tile_tickets.abs().sum()) == 0
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    step = xin.float().abs() * 2 ** -7 + 1e-30
    assert ((xn.float() - xin.float()).abs() <= step).all(), "x_out off by > 1 bf16 step"

    want_logits = ref.gemv([w], None, xin)
    close(r.logits.to(torch.bfloat16), want_logits, "router logits")
    ids, wts = ref.route_topk(r.logits.to(torch.bfloat16), K, norm_topk, wdtype, active)
    assert torch.equal(r.ids, ids), (r.ids, ids)
    if wdtype == torch.bfloat16:          # one bf16 step where float division orders differ
        assert torch.allclose(r.weights.float(), wts.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.allclose(r.weights, wts, rtol=1e-6, atol=1e-7)


# GLM-4.5-Air's router (128 experts, top-8, H = 4096), DeepSeek-V3's (256, H = 7168), Kimi K2's
# (384), an odd one; one token and several, K split and not
@pytest.mark.parametrize("tokens,E,K,H,shape", [(1, 128, 8, 4096, {}),
                                                (8, 128, 8, 4096, dict(split_k=8)),
                                                (1, 256, 8, 7168, dict(warps=4, split_k=16)),
                                                (3, 384, 8, 2048, {}), (5, 37, 3, 264, {})])
@pytest.mark.parametrize("norm_topk,scale", [(True, 1.0), (False, 2.5)])
def test_dense_gemv_routes_sigmoid_routers(tokens, E, K, H, shape, norm_topk, scale):
    """The SIG build (a sigmoid router with a correction bias): float32 logits (not rounded to
    bf16), then `ref.route_sigmoid` on them, float32 weights, lane addresses; the biases move
    the choice, so a kernel that left them out would route elsewhere."""
    from cupool.ops.dense_gemv import ROUTE, DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(E * 23 + tokens + H + int(norm_topk))
    w = rand(E, H, scale=0.02, gen=gen)
    sbias = torch.randn(E, device="cuda", generator=gen) * 0.3
    op = DenseGemv([w], tokens=tokens, norm=True, epilogue=ROUTE, lane_addr=True,
                   sigmoid=(sbias, scale), **shape)
    r = poisoned_route(tokens, E, K, torch.float32)
    h, nw, active, table = router_inputs(tokens, E, H, gen)
    lane_addr = torch.full((tokens * K,), -7, dtype=torch.int64, device="cuda")
    for _ in range(2):                     # twice: the tickets must be back at zero
        op(h, norm_weight=nw, eps=1e-6, route=r, top_k=K, norm_topk=norm_topk, active=active,
           table=table, lane_addr=lane_addr)
    torch.cuda.synchronize()
    assert int(r.ticket.item()) == 0
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    want = xin.float() @ w.float().T
    assert torch.allclose(r.logits, want, rtol=1e-3, atol=1e-3), \
        float((r.logits - want).abs().max())
    ids, wts = ref.route_sigmoid(r.logits, sbias, K, norm_topk, scale, torch.float32, active)
    assert torch.equal(r.ids, ids), (r.ids, ids)
    assert torch.allclose(r.weights, wts, rtol=1e-6, atol=1e-7)
    assert torch.equal(lane_addr, ref.lane_addresses(ids, table))
    unbiased, _ = ref.route_sigmoid(r.logits, torch.zeros_like(sbias), K, norm_topk, scale,
                                    torch.float32, active)
    assert not torch.equal(unbiased, ids)


# gpt-oss-120b's router (E = 128, top-4, H = 2880) and gpt-oss-20b's (E = 32), odd ones
@pytest.mark.parametrize("tokens,E,K,H", [(1, 128, 4, 2880), (8, 128, 4, 2880), (1, 32, 4, 2880),
                                          (5, 37, 3, 264)])
@pytest.mark.parametrize("shape", [{}, dict(split_k=5), dict(warps=4, split_k=3)], ids=_shape_id)
@pytest.mark.parametrize("lanes", [False, True], ids=["ids", "lane_addr"])
def test_dense_gemv_routes_with_a_bias(tokens, E, K, H, shape, lanes):
    """A router with a bias (the RBIAS build): logits = bf16(x·W + bias), then the same routing;
    the biases are large beside the products, so logits without them would be far off."""
    from cupool.ops.dense_gemv import ROUTE, DenseGemv
    gen = torch.Generator(device="cuda").manual_seed(E * 17 + tokens + H)
    w = rand(E, H, scale=0.02, gen=gen)
    bias = rand(E, scale=2.0, gen=gen)
    op = DenseGemv([w], [bias], tokens=tokens, norm=True, epilogue=ROUTE, lane_addr=lanes,
                   **shape)
    r = poisoned_route(tokens, E, K, torch.bfloat16)
    h, nw, active, table = router_inputs(tokens, E, H, gen)
    lane_addr = torch.full((tokens * K,), -5, dtype=torch.int64, device="cuda")
    xn = poison(tokens, H)
    kw = dict(table=table, lane_addr=lane_addr) if lanes else {}
    for _ in range(2):                     # twice: the ticket must be back at zero
        op(h, norm_weight=nw, eps=1e-6, x_out=xn, route=r, top_k=K, norm_topk=True,
           active=active, **kw)
    torch.cuda.synchronize()
    assert int(r.ticket.item()) == 0
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    step = xin.float().abs() * 2 ** -7 + 1e-30
    assert ((xn.float() - xin.float()).abs() <= step).all(), "x_out off by > 1 bf16 step"
    xin = xn                                # the product on the kernel's own normed x
    close(r.logits.to(torch.bfloat16), ref.gemv([w], [bias], xin), "router logits with a bias")
    assert rel(r.logits, ref.gemv([w], None, xin).float()) > 0.1
    ids, wts = ref.route_topk(r.logits.to(torch.bfloat16), K, True, torch.bfloat16, active)
    assert torch.equal(r.ids, ids), (r.ids, ids)
    assert torch.allclose(r.weights.float(), wts.float(), rtol=2 ** -7, atol=0)
    if lanes:
        assert torch.equal(lane_addr, ref.lane_addresses(ids, table))


@pytest.mark.parametrize("tokens,E,K,H", [(1, 128, 8, 2048), (4, 128, 8, 2048), (16, 128, 8, 2048),
                                          (5, 60, 4, 264), (13, 37, 3, 4104)])
@pytest.mark.parametrize("shape", [{}, dict(split_k=8), dict(warps=4, split_k=3)], ids=_shape_id)
def test_dense_gemv_route_writes_lane_addresses(tokens, E, K, H, shape):
    """The LANE_ADDR build (CUPOOL_SKIP_PLAN): lane_addr[t·K + k] = table[ids[t, k]], 0 for an
    inactive token's lanes, every poisoned entry overwritten; its logits, ids and weights are the
    plain build's bits, and its routing is the reference rule on its own logits."""
    from cupool.ops.dense_gemv import ROUTE, DenseGemv, RouteOut
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    w = rand(E, H, scale=0.02, gen=gen)
    h = rand(tokens, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    active = torch.rand(tokens, device="cuda", generator=gen) > 0.3
    active[0] = True
    if tokens > 1:
        active[-1] = False
    table = torch.randint(1, 2**47, (E,), device="cuda", generator=gen)
    routes = []
    for lanes in (False, True):
        op = DenseGemv([w], tokens=tokens, norm=True, epilogue=ROUTE, lane_addr=lanes, **shape)
        r = RouteOut.allocate(tokens, E, K, torch.bfloat16, "cuda")
        r.logits.fill_(float("nan"))
        r.ids.fill_(-7)
        r.weights.fill_(float("nan"))
        lane_addr = torch.full((tokens * K,), -7, dtype=torch.int64, device="cuda")
        kw = {"table": table, "lane_addr": lane_addr} if lanes else {}
        for _ in range(2):                     # twice: the tickets must be back at zero
            op(h, norm_weight=nw, eps=1e-6, route=r, top_k=K, norm_topk=True, active=active, **kw)
        torch.cuda.synchronize()
        assert int(r.ticket.item()) == 0
        routes.append((r, lane_addr))
    (plain, _), (r, lane_addr) = routes
    assert torch.equal(r.logits, plain.logits) and torch.equal(r.ids, plain.ids)
    assert torch.equal(r.weights, plain.weights)
    ids, _ = ref.route_topk(r.logits.to(torch.bfloat16), K, True, torch.bfloat16, active)
    assert torch.equal(r.ids, ids), (r.ids, ids)
    want = ref.lane_addresses(r.ids, table)
    assert torch.equal(lane_addr, want), (lane_addr, want)
    assert (lane_addr.view(tokens, K)[~active] == 0).all()
    with pytest.raises(ValueError, match="table must be a contiguous torch.int64"):
        op(h, norm_weight=nw, route=r, top_k=K, table=table.to(torch.int32), lane_addr=lane_addr)
    with pytest.raises(ValueError, match="lane_addr must be a contiguous torch.int64"):
        op(h, norm_weight=nw, route=r, top_k=K, table=table, lane_addr=lane_addr[1:])
    with pytest.raises(ValueError, match="lane_addr=True"):
        DenseGemv([w], tokens=tokens, norm=True, epilogue=ROUTE, **shape)(
            h, norm_weight=nw, route=r, top_k=K, table=table, lane_addr=lane_addr)


@pytest.mark.parametrize("tokens,E,K", [(1, 128, 8), (3, 512, 10), (2, 60, 4), (1, 640, 8)])
@pytest.mark.parametrize("shape", [{}, dict(split_k=8)], ids=_shape_id)
@pytest.mark.parametrize("lanes", [False, True], ids=["ids", "lane_addr"])
def test_dense_gemv_route_ties_and_nan(tokens, E, K, shape, lanes):
    """Experts with equal router rows get equal logits, and the top-k takes the lower expert first
    (a stable descending sort): four tied experts, two in one lane's segment of the top-k and two
    in others, come out in ascending order. A NaN row makes every probability NaN, which counts
    as largest: the top-k is then experts 0 .. K − 1, weights NaN."""
    from cupool.ops.dense_gemv import ROUTE, DenseGemv, RouteOut
    gen = torch.Generator(device="cuda").manual_seed(E * 7 + tokens + K)
    H = 2048
    h = rand(tokens, H, scale=3.0, gen=gen)
    nw = rand(H, scale=0.3, gen=gen) + 1
    _, xin = ref.residual_norm(h, None, nw, 1e-6)
    w = rand(E, H, scale=0.02, gen=gen)
    tied = [E - 1, E // 2 + 3, 5, E // 2]     # E // 2, E // 2 + 3: one segment at E = 128, 512
    w[tied] = (0.05 * xin[0].float().sign()).to(torch.bfloat16)  # the largest logits of token 0
    w_nan = w.clone()
    w_nan[9, 100] = float("nan")
    active = torch.ones(tokens, dtype=torch.bool, device="cuda")
    active[-1] = tokens == 1
    table = torch.randint(1, 2**47, (E,), device="cuda", generator=gen)
    for weights, nan in ((w, False), (w_nan, True)):
        op = DenseGemv([weights], tokens=tokens, norm=True, epilogue=ROUTE, lane_addr=lanes,
                       **shape)
        r = RouteOut.allocate(tokens, E, K, torch.float32, "cuda")
        r.logits.fill_(float("nan"))
        r.ids.fill_(-7)
        r.weights.fill_(-3.0)
        lane_addr = torch.full((tokens * K,), -7, dtype=torch.int64, device="cuda")
        kw = {"table": table, "lane_addr": lane_addr} if lanes else {}
        op(h, norm_weight=nw, eps=1e-6, route=r, top_k=K, norm_topk=True, active=active, **kw)
        torch.cuda.synchronize()
        ids, wts = ref.route_topk(r.logits.to(torch.bfloat16), K, True, torch.float32, active)
        assert torch.equal(r.ids, ids), (nan, r.ids, ids)
        if nan:
            assert r.logits[:, 9].isnan().all()
            assert torch.equal(r.ids[0], torch.arange(K, dtype=torch.int32, device="cuda"))
            assert r.weights[0].isnan().all()
        else:
            assert r.logits[0, tied].unique().numel() == 1, "tied rows gave unequal logits"
            assert r.ids[0, :4].tolist() == sorted(tied), r.ids[0]
            assert torch.allclose(r.weights, wts, rtol=1e-6, atol=1e-7)
        if lanes:
            assert torch.equal(lane_addr, ref.lane_addresses(r.ids, table))


@pytest.mark.parametrize("variant", ["norm_add", "residual", "route"])
@pytest.mark.parametrize("shape", [dict(split_k=2), dict(split_k=3), dict(warps=4, split_k=8)],
                         ids=_shape_id)
def test_split_k_graph_replays_are_identical(variant, shape):
    """A split-K GEMV captured once and replayed: every replay (outputs poisoned before each)
    gives the eager launch's bits, and the tiles' tickets are back at zero after each. A ticket
    left at a count would make no block of its tile the last one: its rows stay NaN."""
    from cupool.ops.dense_gemv import PLAIN, RESIDUAL, ROUTE, DenseGemv, RouteOut
    gen = torch.Generator(device="cuda").manual_seed(11)
    B, K = 3, 4104
    N = 128 if variant == "route" else 1000
    epi = {"norm_add": PLAIN, "residual": RESIDUAL, "route": ROUTE}[variant]
    norm = variant != "residual"
    op = DenseGemv([rand(N, K, scale=0.05, gen=gen)], tokens=B, norm=norm, epilogue=epi, **shape)
    x, add, nw = rand(B, K, gen=gen), rand(B, K, gen=gen), rand(K, scale=0.3, gen=gen) + 1
    res = rand(B, N, gen=gen)
    out, h_out, x_out = poison(B, N), poison(B, K), poison(B, K)
    route = RouteOut.allocate(B, N, 8, torch.float32, "cuda") if epi == ROUTE else None

    def run():
        kw = {}
        if norm:
            kw = dict(norm_weight=nw, eps=1e-6, x_out=x_out)
            if epi == PLAIN:
                kw.update(add=add, h_out=h_out)
        if epi == ROUTE:
            op(x, route=route, top_k=8, norm_topk=True, **kw)
        else:
            op(x, residual=res if epi == RESIDUAL else None, out=out, **kw)

    def outputs():
        if epi == ROUTE:
            return [t.clone() for t in (route.logits, route.ids, route.weights, x_out)]
        return [t.clone() for t in ((out, h_out, x_out) if norm else (out,))]

    def poison_all():
        for t in (out, h_out, x_out) + ((route.logits, route.weights) if route else ()):
            t.fill_(float("nan"))
        if route:
            route.ids.fill_(-7)

    run()
    torch.cuda.synchronize()
    want = outputs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for i in range(3):
        poison_all()
        graph.replay()
        torch.cuda.synchronize()
        assert int(op.tile_tickets.abs().sum()) == 0, f"replay {i}: tile tickets not at zero"
        if route:
            assert int(route.ticket.item()) == 0, f"replay {i}: the routing ticket not at zero"
        for j, (a, b) in enumerate(zip(outputs(), want)):
            assert not (a.isnan().any() if a.is_floating_point() else False), f"replay {i}: {j} NaN"
            assert torch.equal(a, b), f"replay {i}: output {j} differs from the eager launch"


ATTN_CASES = [  # B, nh, hk, D, L, qk_norm, window, sinks
    (1, 32, 4, 128, 4096, True, 0, False),        # Qwen3-30B-A3B
    (4, 32, 4, 128, 700, True, 0, False),
    (3, 8, 8, 64, 300, False, 0, False),
    (5, 16, 2, 128, 257, True, 40, False),
    (2, 8, 2, 64, 200, False, 16, True),          # gpt-oss-like: window and sinks
    (1, 4, 1, 256, 130, True, 0, True),
    (2, 16, 2, 128, 2000, True, 1500, True),     # up to 24 parts: two merge levels, sinks
    (2, 24, 2, 128, 500, True, 0, True),          # G = 12 (GLM-4.5-Air): two MMA n tiles
    (1, 16, 1, 128, 300, False, 40, False),       # G = 16
]


def _attention_inputs(B, nh, hk, D, L, qk_norm, sinks, gen):
    """Random qkv [B, (nh + 2hk)·D], caches [B, hk, L, D], rotary tables [L, D] (random angles),
    q/k norm weights (or None) and sinks (or None)."""
    qkv = rand(B, (nh + 2 * hk) * D, gen=gen)
    kc = rand(B, hk, L, D, gen=gen)
    vc = rand(B, hk, L, D, gen=gen)
    ang = torch.rand(L, D // 2, device="cuda", generator=gen) * 6.3
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    qn = rand(D, scale=0.3, gen=gen) + 1 if qk_norm else None
    kn = rand(D, scale=0.3, gen=gen) + 1 if qk_norm else None
    sk = rand(nh, gen=gen) if sinks else None
    return qkv, kc, vc, cos, sin, qn, kn, sk


@pytest.mark.parametrize("ahead,min_chunk", [(False, 64), (True, 64), (True, 192)])
@pytest.mark.parametrize("B,nh,hk,D,L,qk_norm,window,sinks", ATTN_CASES)
def test_dense_attention_matches_reference(B, nh, hk, D, L, qk_norm, window, sinks, ahead,
                                           min_chunk):
    """Against the reference at the last position, at 0 and at random ones: parts of the
    default 64 positions and of 192 (fewer parts hold positions; the rest do not run)."""
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, parts
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + L)
    qkv, kc, vc, cos, sin, qn, kn, sk = _attention_inputs(B, nh, hk, D, L, qk_norm, sinks, gen)
    pos = torch.randint(0, L, (B,), device="cuda", generator=gen)
    pos[0] = L - 1
    if B > 1:
        pos[1] = 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, sms, min_chunk), "cuda")
    op = DecodeAttention(nh, hk, D, q_norm=qn, k_norm=kn, eps=1e-6, scale=D ** -0.5,
                         window=window, sinks=sk, workspace=ws, ahead=ahead, min_chunk=min_chunk)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kc_ref, vc_ref,
                                D ** -0.5, window, sk)
    for _ in range(2):                      # twice: the merge counters must be back at zero
        out = poison(B, nh * D)
        op(qkv, pos, kc, vc, cos, sin, out)
    torch.cuda.synchronize()
    assert int(ws.count.abs().sum()) == 0
    assert not out.isnan().any()
    for b in range(B):
        assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
    written = torch.zeros(B, L, dtype=torch.bool, device="cuda")
    written[torch.arange(B), pos] = True
    for got, exp in ((kc, kc_ref), (vc, vc_ref)):
        assert torch.equal(got.transpose(1, 2)[~written], exp.transpose(1, 2)[~written])
        new, new_ref = got.transpose(1, 2)[written].float(), exp.transpose(1, 2)[written].float()
        assert ((new - new_ref).abs() <= new_ref.abs() * 2 ** -7 + 1e-30).all()


def _attention_op(B, nh, hk, D, L, qn, kn, sk, window, ahead):
    """(workspace, DecodeAttention) of a step of B tokens, its parts cut for this GPU's SMs."""
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, parts
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, sms), "cuda")
    return ws, DecodeAttention(nh, hk, D, q_norm=qn, k_norm=kn, eps=1e-6, scale=D ** -0.5,
                               window=window, sinks=sk, workspace=ws, ahead=ahead)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("B,nh,hk,D,L,qk_norm,window,sinks", [
    (8, 32, 4, 128, 4096, True, 0, False),        # Qwen3-30B-A3B, serve's 8 slots
    (5, 16, 2, 128, 2000, True, 1500, True),      # window, sinks, two merge levels
    (3, 8, 2, 64, 300, False, 0, False),
])
def test_dense_attention_inactive_slots_write_zeros_and_leave_their_cache(
        B, nh, hk, D, L, qk_norm, window, sinks, ahead):
    """pos -1 (an inactive slot, as the fused step passes it): the slot's out row is zeros over
    the poison and its cache rows keep their bits, long contexts beside it or not; the active
    slots' rows and cache writes match the reference, the merge counters are back at zero."""
    gen = torch.Generator(device="cuda").manual_seed(B * 7 + L)
    qkv, kc, vc, cos, sin, qn, kn, sk = _attention_inputs(B, nh, hk, D, L, qk_norm, sinks, gen)
    pos = torch.randint(0, L, (B,), device="cuda", generator=gen)
    pos[0] = L - 1
    idle = torch.arange(B, device="cuda") % 2 == 1          # every other slot inactive
    pos[idle] = -1
    ws, op = _attention_op(B, nh, hk, D, L, qn, kn, sk, window, ahead)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kc_ref, vc_ref,
                                D ** -0.5, window, sk)
    before_k, before_v = kc[idle].clone(), vc[idle].clone()
    for _ in range(2):
        out = poison(B, nh * D)
        op(qkv, pos, kc, vc, cos, sin, out)
    torch.cuda.synchronize()
    assert int(ws.count.abs().sum()) == 0
    assert (out[idle] == 0).all()
    assert torch.equal(kc[idle], before_k) and torch.equal(vc[idle], before_v)
    assert torch.equal(kc_ref[idle], before_k)                  # the reference agrees
    for b in torch.nonzero(~idle).flatten().tolist():
        assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
        P = int(pos[b])
        for got, exp in ((kc, kc_ref), (vc, vc_ref)):
            keep = torch.ones(L, dtype=torch.bool, device="cuda")
            keep[P] = False
            assert torch.equal(got[b][:, keep], exp[b][:, keep])
            new, new_ref = got[b][:, P].float(), exp[b][:, P].float()
            assert ((new - new_ref).abs() <= new_ref.abs() * 2 ** -7 + 1e-30).all()


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("S,slots,nh,hk,D,L,qk_norm,window,sinks", [
    (8, [5], 32, 4, 128, 4096, True, 0, False),           # one of serve's 8 slots
    (8, [6, 1, 3, 0], 32, 4, 128, 4096, True, 0, False),  # four of them, out of order
    (5, [4, 2], 16, 2, 128, 2000, True, 1500, True),      # window, sinks, two merge levels
    (3, [2, 0], 8, 2, 64, 300, False, 0, False),
])
def test_dense_attention_slot_map_reads_and_writes_the_mapped_slots(
        S, slots, nh, hk, D, L, qk_norm, window, sinks, ahead):
    """A step of fewer tokens than the cache's S slots (the narrow step): token b reads and
    writes slot slots[b] alone, its out row and cache write matching the reference's; the last
    token inactive where there are several (a free slot the map pads with: zeros, its slot
    untouched); every slot the map leaves out keeps its bits."""
    B = len(slots)
    gen = torch.Generator(device="cuda").manual_seed(S * 11 + L + B)
    qkv, kc, vc, cos, sin, qn, kn, sk = _attention_inputs(S, nh, hk, D, L, qk_norm, sinks, gen)
    qkv = qkv[:B].contiguous()
    smap = torch.tensor(slots, dtype=torch.int64, device="cuda")
    pos = torch.randint(0, L, (B,), device="cuda", generator=gen)
    pos[0] = L - 1
    if B > 1:
        pos[-1] = -1
    ws, op = _attention_op(B, nh, hk, D, L, qn, kn, sk, window, ahead)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kc_ref, vc_ref,
                                D ** -0.5, window, sk, slots=smap)
    before_k, before_v = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=f"k_cache has {S} slots for a step of {B} tokens"):
        op(qkv, pos, kc, vc, cos, sin, poison(B, nh * D))
    for _ in range(2):
        out = poison(B, nh * D)
        op(qkv, pos, kc, vc, cos, sin, out, slots=smap)
    torch.cuda.synchronize()
    assert int(ws.count.abs().sum()) == 0
    live = {slots[b] for b in range(B) if pos[b] >= 0}
    for c in range(S):
        if c not in live:
            assert torch.equal(kc[c], before_k[c]) and torch.equal(vc[c], before_v[c]), c
    for b in range(B):
        if pos[b] < 0:
            assert (out[b] == 0).all(), b
            continue
        assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
        c, P = slots[b], int(pos[b])
        keep = torch.ones(L, dtype=torch.bool, device="cuda")
        keep[P] = False
        for got, exp in ((kc, kc_ref), (vc, vc_ref)):
            assert torch.equal(got[c][:, keep], exp[c][:, keep])
            new, new_ref = got[c][:, P].float(), exp[c][:, P].float()
            assert ((new - new_ref).abs() <= new_ref.abs() * 2 ** -7 + 1e-30).all()


@pytest.mark.parametrize("B,nh,hk,D,L,window,sinks,ahead", [
    (1, 16, 2, 256, 4096, 0, False, True),     # Qwen3-Next-80B-A3B: 16 heads over 2 of 256
    (4, 16, 2, 256, 700, 0, False, True),      # several slots, one inactive
    (3, 16, 2, 256, 300, 0, False, False),
    (5, 12, 4, 128, 257, 40, True, True),      # G = 3, window and sinks
    (2, 24, 2, 128, 500, 0, True, True),       # G = 12: two MMA n tiles
])
def test_dense_attention_gated_queries_and_one_plus_norm_match_reference(
        B, nh, hk, D, L, window, sinks, ahead):
    """Qwen3-Next's full attention: DecodeAttention(q_gate=True, one_plus=True, rotary_dims=64)
    against AttentionReference with the same. qkv rows of [(2·nh + 2·hk)·D], each query head's
    gate after it (NaN: the kernel must not read it), the q/k norms stored as w − 1 (random
    around 0), the rotary tables' columns past 64 NaN; the output poisoned, two launches (the
    merge counters back at zero), the cache writes the reference's. qkv of the ungated width
    is refused."""
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, parts
    R = 64
    gen = torch.Generator(device="cuda").manual_seed(B * 31 + L + D)
    qkv = rand(B, (2 * nh + 2 * hk) * D, gen=gen)
    qkv[:, :2 * nh * D].view(B, nh, 2, D)[:, :, 1] = float("nan")     # the gates
    kc, vc = rand(B, hk, L, D, gen=gen), rand(B, hk, L, D, gen=gen)
    ang = torch.rand(L, R // 2, device="cuda", generator=gen) * 6.3
    nan = torch.full((L, D - R), float("nan"), device="cuda")
    cos = torch.cat([ang.cos(), ang.cos(), nan], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin(), nan], -1).to(torch.bfloat16)
    qn, kn = rand(D, scale=0.3, gen=gen), rand(D, scale=0.3, gen=gen)
    sk = rand(nh, gen=gen) if sinks else None
    pos = torch.randint(0, L, (B,), device="cuda", generator=gen)
    pos[0] = L - 1
    if B > 3:
        pos[2] = -1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, sms), "cuda")
    kw = dict(q_norm=qn, k_norm=kn, eps=1e-6, scale=D ** -0.5, window=window, sinks=sk,
              workspace=ws, ahead=ahead, rotary_dims=R, q_gate=True, one_plus=True)
    op = DecodeAttention(nh, hk, D, **kw)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = poison(B, nh * D)
    ref.AttentionReference(nh, hk, D, **kw)(qkv, pos, kc_ref, vc_ref, cos, sin, want)
    for _ in range(2):
        out = poison(B, nh * D)
        op(qkv, pos, kc, vc, cos, sin, out)
    torch.cuda.synchronize()
    assert int(ws.count.abs().sum()) == 0
    assert not out.isnan().any() and not kc.isnan().any()
    for b in range(B):
        if pos[b] < 0:
            assert (out[b] == 0).all(), b
            continue
        assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
    live = pos >= 0
    written = torch.zeros(B, L, dtype=torch.bool, device="cuda")
    written[torch.arange(B, device="cuda")[live], pos[live]] = True
    for got, exp in ((kc, kc_ref), (vc, vc_ref)):
        assert torch.equal(got.transpose(1, 2)[~written], exp.transpose(1, 2)[~written])
        new, new_ref = got.transpose(1, 2)[written].float(), exp.transpose(1, 2)[written].float()
        assert ((new - new_ref).abs() <= new_ref.abs() * 2 ** -7 + 1e-30).all()
    with pytest.raises(ValueError, match=r"qkv must be \[B, \(2·heads \+ 2·kv_heads\)"):
        op(qkv[:, :(nh + 2 * hk) * D].contiguous(), pos, kc, vc, cos, sin, out)


@pytest.mark.parametrize("B,nh,hk,D,L,qk_norm,window,sinks", ATTN_CASES)
def test_dense_attention_ahead_gives_the_same_bits(B, nh, hk, D, L, qk_norm, window, sinks):
    """The AHEAD build only issues its loads earlier: output and cache writes equal the default
    build's bit for bit, at positions spread over the cache (several tiles a part) and at 0."""
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, parts
    gen = torch.Generator(device="cuda").manual_seed(7 * B + L)
    qkv, kc, vc, cos, sin, qn, kn, sk = _attention_inputs(B, nh, hk, D, L, qk_norm, sinks, gen)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    outs = []
    for ahead in (False, True):
        ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, sms), "cuda")
        op = DecodeAttention(nh, hk, D, q_norm=qn, k_norm=kn, eps=1e-6, scale=D ** -0.5,
                             window=window, sinks=sk, workspace=ws, ahead=ahead)
        k, v = kc.clone(), vc.clone()
        got = []
        for p in (L - 1, L // 2 + 3, 0):
            pos = torch.full((B,), p, dtype=torch.int64, device="cuda")
            pos[0] = L - 1 - p // 3
            out = poison(B, nh * D)
            op(qkv, pos, k, v, cos, sin, out)
            got.append(out)
        torch.cuda.synchronize()
        outs.append((got, k, v))
    (base, k0, v0), (ahead, k1, v1) = outs
    for i, (a, b) in enumerate(zip(base, ahead)):
        assert not a.isnan().any()
        assert torch.equal(a, b), (i, rel(b, a))
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_dense_attention_trace_build_gives_the_same_bits():
    """The ATTN_TRACE build (benchmarks/profile_attention.py) writes the default build's output
    and cache bits, and its stamps: each used part's block in phase order, the parts past them
    only a start, one merge a KV head of each token, after every used part's tile loop."""
    from cupool.ops.dense_attention import (
        TRACE_STAMPS,
        AttentionWorkspace,
        DecodeAttention,
        parts,
        trace_buffer,
    )
    B, nh, hk, D, L = 2, 32, 4, 128, 1500
    gen = torch.Generator(device="cuda").manual_seed(43)
    qkv, kc, vc, cos, sin, qn, kn, _ = _attention_inputs(B, nh, hk, D, L, True, False, gen)
    pos = torch.tensor([L - 1, 70], device="cuda")
    ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, 132), "cuda")
    kw = dict(q_norm=qn, k_norm=kn, scale=D ** -0.5, workspace=ws, ahead=True)
    got = []
    stamps = trace_buffer(ws)
    for op in (DecodeAttention(nh, hk, D, **kw), DecodeAttention(nh, hk, D, **kw, trace=True)):
        k, v = kc.clone(), vc.clone()
        out = poison(B, nh * D)
        op(qkv, pos, k, v, cos, sin, out, **({"trace": stamps} if op.trace else {}))
        got.append((out, k, v))
    torch.cuda.synchronize()
    assert not got[0][0].isnan().any()
    for a, b in zip(*got):
        assert torch.equal(a, b)
    st = stamps.view(B, hk, ws.num_parts, TRACE_STAMPS).cpu()
    NS = ws.num_parts
    for b, n in enumerate((L, 71)):
        chunk = max(64, -(-n // NS))
        used = -(-n // chunk)
        s = st[b]
        assert (s[:, :used, :6] > 0).all() and (s[:, used:, 1:] == 0).all()
        assert (s[:, used:, 0] > 0).all()
        assert (s[:, :used, 1:6].diff(dim=-1) >= 0).all()
        merged = s[:, :used, 7] > 0
        assert (merged.sum(dim=1) == 1).all()                  # one last block a KV head
        # every used part's tile loop ended before its ticket, so before the merge ended
        assert (s[:, :used, 7][merged] >= s[:, :used, 4].max(dim=1).values).all()
    with pytest.raises(ValueError, match="trace belongs"):
        DecodeAttention(nh, hk, D, **kw)(qkv, pos, kc, vc, cos, sin, got[0][0], trace=stamps)
    with pytest.raises(ValueError, match="trace must be a contiguous torch.int64"):
        DecodeAttention(nh, hk, D, **kw, trace=True)(qkv, pos, kc, vc, cos, sin, got[0][0],
                                                     trace=stamps[1:])


def test_dense_attention_replays_at_new_positions():
    """Captured once, replayed with pos moved on the device: the parts are cut at run time."""
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, parts
    B, nh, hk, D, L = 2, 32, 4, 128, 1024
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = rand(B, (nh + 2 * hk) * D, gen=gen)
    kc, vc = rand(B, hk, L, D, gen=gen), rand(B, hk, L, D, gen=gen)
    cos = torch.ones(L, D, dtype=torch.bfloat16, device="cuda")
    sin = torch.zeros(L, D, dtype=torch.bfloat16, device="cuda")
    ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, 132), "cuda")
    op = DecodeAttention(nh, hk, D, scale=D ** -0.5, workspace=ws)
    pos = torch.tensor([3, 10], device="cuda")
    out = torch.empty(B, nh * D, dtype=torch.bfloat16, device="cuda")
    op(qkv, pos, kc, vc, cos, sin, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(qkv, pos, kc, vc, cos, sin, out)
    for p in ([100, 1023], [700, 64], [0, 513]):
        pos.copy_(torch.tensor(p))
        out.fill_(float("nan"))
        g.replay()
        kr, vr = kc.clone(), vc.clone()
        want = ref.attention_decode(qkv, nh, hk, None, None, 1e-6, cos, sin, pos, kr, vr,
                                    D ** -0.5)
        torch.cuda.synchronize()
        assert rel(out, want) <= ATTN_TOL, (p, rel(out, want))


# --- the fused step on wrapped tiny models -------------------------------------------------------
def _wrapped(family: str, seed: int, rows=None, **overrides):
    """A tiny model of `family` wrapped with `rows` bank rows a layer (default half the experts;
    "all": every expert)."""
    import cupool
    from test_fused_step import fused_model, gpt_oss_model
    model = (gpt_oss_model(seed, device="cuda") if family == "gpt_oss" and not overrides else
             fused_model(family, seed=seed, device="cuda", **overrides))
    with torch.no_grad():
        for m in model.modules():             # real-model-sized experts (test_gpu_wrap.model_for)
            if hasattr(m, "gate_up_proj") and isinstance(m.gate_up_proj, torch.Tensor):
                m.gate_up_proj.normal_(0, 0.05)
                m.down_proj.normal_(0, 0.05)
    mlp = model.model.layers[0].mlp
    router = mlp.gate if hasattr(mlp, "gate") else mlp.router       # gpt-oss: mlp.router
    E = router.weight.shape[0]
    rows = E if rows == "all" else rows or E // 2
    pool = cupool.wrap(model, rows=rows, max_decode_tokens=4, progress=False)
    return model, pool


DELTA_CASES = [  # B, S (None: B), hk, hv, dk, dv, KC, grouped, positions (-1 inactive)
    (1, None, 16, 32, 128, 128, 4, True, [900]),        # Qwen3-Next-80B-A3B's delta nets
    (8, None, 16, 32, 128, 128, 4, True, [5, -1, 9, 300, 1, 2, -1, 70]),
    (2, None, 16, 32, 128, 128, 4, False, [3, 4]),      # Qwen3.5's in-projection layout
    (5, 9, 3, 9, 64, 32, 4, True, [1, 2, -1, 4, 5]),    # three value heads a key head; slots
    (3, None, 5, 5, 32, 64, 3, False, [8, 0, 2]),       # one a key head (no tickets)
    (13, None, 2, 4, 128, 64, 4, True, list(range(13))),
]


@pytest.mark.parametrize("B,S,hk,hv,dk,dv,KC,grouped,positions", DELTA_CASES)
def test_delta_decode_matches_reference(B, S, hk, hv, dk, dv, KC, grouped, positions):
    """delta_decode.cu against `reference.dense.delta_decode` on fresh random inputs (the output
    poisoned), two steps in a row (the second reads the states the first wrote, and the tickets
    the first put back): outputs, convolution windows and recurrent states, slots of a larger
    cache where S is given, and inactive tokens' rows zeros with their slots untouched."""
    from test_delta_emu import check_launch, delta_inputs

    from cupool.ops.delta_decode import DeltaDecode
    S = S or B
    proj, conv_state, conv_w, state, neg_a, dt_bias, norm_w = (
        t.cuda() for t in delta_inputs(B, S, hk, hv, dk, dv, KC, seed=B * 31 + hv + dk))
    slots = None if S == B else torch.randperm(S, device="cuda")[:B]
    pos = torch.tensor(positions, dtype=torch.int64, device="cuda")
    op = DeltaDecode(hk, hv, dk, dv, grouped=grouped, conv_w=conv_w, neg_a=neg_a,
                     dt_bias=dt_bias, norm_w=norm_w, eps=1e-6, tokens=B)
    conv_ref, st_ref = conv_state.clone(), state.clone()
    for step in range(2):
        if step:
            proj = rand(*proj.shape)
        conv_in, st_in = conv_state.clone(), state.clone()
        out = poison(B, hv * dv)
        op(proj, pos, conv_state, state, out, slots=slots)
        want = ref.delta_decode(proj, hk, hv, dk, dv, grouped, conv_ref, conv_w, st_ref, neg_a,
                                dt_bias, norm_w, 1e-6, pos, slots)
        torch.cuda.synchronize()
        check_launch(out, conv_state, state, op.count, want, conv_ref, st_ref, pos.cpu(),
                     None if slots is None else slots.cpu(), st_in, conv_in)
        conv_ref.copy_(conv_state)         # the next step from the kernel's own states
        st_ref.copy_(state)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"])
def test_fused_step_matches_transformers_through_the_pool(family):
    """One decode step of the fused step's kernels (the pool's experts at half the bank) against
    transformers' forward on the same cache; qwen2_moe's layers add a gated shared expert."""
    from test_fused_step import LOGIT_TOL, compare_step
    model, pool = _wrapped(family, seed=31)
    # the second prompt longer than gpt-oss's window (8)
    fused, want, fc, mc, step = compare_step(model, pool, "kernels",
                                             [[5, 9, 3], [7, 1, 4, 4, 8, 2, 9, 9, 13, 2, 6]],
                                             [11, 13])
    assert step.describe().startswith("fused decode step: 3 of 3 layers"), step.describe()
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    assert pool.errors() == []


def _wrapped_kind(kind: str):
    """The model and pool of a layer kind of test_fused_step_runs_other_layer_kinds."""
    import cupool
    from test_fused_step import dots1_model, glm4_moe_model
    if kind == "qwen2_moe_dense":
        return _wrapped("qwen2_moe", seed=32, mlp_only_layers=[1])
    model = {"dots1": dots1_model, "glm4_moe": glm4_moe_model}[kind](seed=1, device="cuda")
    return model, cupool.wrap(model, rows=4, max_decode_tokens=4, progress=False)


@pytest.mark.parametrize("kind,says", [
    ("qwen2_moe_dense", "; a shared expert in 2 layers; a dense MLP in 1 layer"),
    ("dots1", "; a shared expert in 2 layers; a sigmoid router in 2 layers; a dense MLP in 1 "
              "layer"),
    ("glm4_moe", "; a shared expert in 2 layers; a sigmoid router in 2 layers; a dense MLP in 1 "
                 "layer")])
def test_fused_step_runs_other_layer_kinds_through_the_pool(kind, says):
    """Layer kinds beyond the routed experts, on the fused step's kernels with half the experts
    banked: qwen2_moe's gated shared experts and a dense MLP layer (mlp_only_layers=[1]);
    dots.llm1's sigmoid routers (dense_gemv's SIG build) and ungated shared experts; GLM-4.5-Air's
    partial rotary (dense_attention's ROT build) with the same. One step's logits and cache
    writes match transformers' forward."""
    from test_fused_step import LOGIT_TOL, compare_step
    model, pool = _wrapped_kind(kind)
    fused, want, fc, mc, step = compare_step(model, pool, "kernels",
                                             [[5, 9, 3], [7, 1, 4, 4, 8, 2, 9]], [11, 13])
    assert step.describe().startswith("fused decode step: 3 of 3 layers" + says), \
        step.describe()
    assert step.rotary_dims == (64 if kind == "glm4_moe" else None)
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    assert pool.errors() == []


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_fused_step_and_engine_run_qwen3_next(family):
    """Qwen3-Next's (and Qwen3.5's) layers all on the kernels, half the experts banked: the
    gated full-attention ones (dense_gemv's NORM1 builds for its (1 + w) norms,
    dense_attention's QGATE and NORM1 build over 256-dim heads turning their first 64 dims), the
    gated delta nets on delta_decode (Qwen3-Next's grouped in-projections, Qwen3.5's flat ones)
    with their states in the engine's cache, every MLP half (the router GEMV, the pool, the
    shared expert's GEMVs): one step's logits, cache writes and delta net states against
    transformers' forward, then the engine's default step (fused, captured) giving the
    reference's tokens."""
    import cupool
    from test_fused_step import LOGIT_TOL, compare_step, qwen3_next_model
    from test_gpu_engine import MAX_OFF, _check_against_reference, _prompts

    from cupool.sampling import SamplingParams
    model = qwen3_next_model(seed=4, device="cuda", family=family)
    pool = cupool.wrap(model, rows=4, max_decode_tokens=4, progress=False)
    fused, want, fc, mc, step = compare_step(model, pool, "kernels",
                                             [[5, 9, 3], [7, 1, 4, 4, 8, 2, 9]], [11, 13])
    assert step.describe() == (
        "fused decode step: 4 of 4 layers; gated delta nets in layers [0, 2]; a shared expert in "
        "4 layers; gated attention in 2 layers; (1 + w) RMSNorms"), step.describe()
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for i in (1, 3):
        assert rel(fc[0][i], mc[0][i]) <= 1e-2 and rel(fc[1][i], mc[1][i]) <= 1e-2
    assert len(fc[2]) == 4                      # two layers' convolution and recurrent states
    for s_f, s_m in zip(fc[2], mc[2]):
        assert rel(s_f, s_m) <= 1e-2, rel(s_f, s_m)
    assert pool.errors() == []
    params = [SamplingParams(max_tokens=n) for n in (12, 8, 12)]
    prompts = _prompts([3, 9, 14], seed=2)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[])
    assert eng.step_kind.startswith("fused"), eng.step_kind
    reqs = eng.generate(prompts, params)
    assert [len(r.output_ids) for r in reqs] == [12, 8, 12]
    eng.close()
    assert pool.errors() == []
    # the unfused engine (transformers' forward in the captured step) on the same model: the
    # reference is a whole-sequence forward, whose gated delta nets take the chunked algorithm
    # where a decode step takes the recurrent one, so on this tiny model transformers' own decode
    # is off its argmax at a few steps too (3 of 32 for qwen3_5_moe_text at this seed, on an
    # H100); the fused engine may be off where it is, and at most MAX_OFF steps more
    plain = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[], fused=False)
    assert not plain.step_kind.startswith("fused"), plain.step_kind
    plain_reqs = plain.generate(prompts, params)
    plain.close()
    pool.unwrap()
    off, plain_off = ({(k, i) for k, r in enumerate(rs) for _, i in _check_against_reference(
        model, [r])} for rs in (reqs, plain_reqs))
    assert len(off - plain_off) <= MAX_OFF, \
        f"{family}: tokens off the reference's argmax at {sorted(off)}, unfused {sorted(plain_off)}"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_step_with_nvfp4_projections_matches_transformers(family):
    """q/k/v/o kept packed in NVFP4 (`dense_nvfp4.quantize_linears`, which also sets the Linears'
    weights to the dequantized values): the step's GEMVs read the packed form, and its logits
    match transformers' forward on those weights within the step's tolerance."""
    from test_fused_step import LOGIT_TOL, compare_step

    from cupool import dense_nvfp4
    model, pool = _wrapped(family, seed=37)
    assert dense_nvfp4.quantize_linears(model) == 4 * model.config.num_hidden_layers
    fused, want, fc, mc, step = compare_step(model, pool, "kernels",
                                             [[5, 9, 3], [7, 1, 4, 4, 8, 2, 9, 9, 13]], [11, 13])
    assert "NVFP4 weights for qkv in 3 layers, o in 3 layers" in step.describe(), step.describe()
    assert all(l.qkv.nvfp4 and l.o.nvfp4 for l in step.layers)
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    assert pool.errors() == []


def test_fused_step_with_launch_shapes_from_the_environment(monkeypatch):
    """CUPOOL_DENSE_SHAPE reaches the kernels' launchers: the step built under it runs the shapes
    named (the tiny model's H = 48 takes no split K; its o-projection's K = 256 takes 8) and the
    attention's AHEAD build, and its logits match transformers' as the default shapes' do."""
    from test_fused_step import LOGIT_TOL, compare_step
    monkeypatch.setenv("CUPOOL_DENSE_SHAPE", "qkv=w4,o=w4k8,router=w4,head=w4,attn=ahead")
    model, pool = _wrapped("qwen3_moe", seed=34)
    fused, want, _, _, step = compare_step(model, pool, "kernels", [[5, 9, 3], [7, 1, 4, 4]],
                                           [11, 13])
    layer = step.layers[0]
    assert (layer.qkv.warps, layer.o.warps, layer.o.split_k, layer.router.warps,
            step.head.warps) == (4, 4, 8, 4, 4)
    assert all(l.attn.ahead for l in step.layers)
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    assert pool.errors() == []


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_fused_step_skipping_the_plan_gives_the_same_bits(family, monkeypatch):
    """The plan step skipped (the default) on a pool whose bank holds every expert: the routers write the lane
    addresses the plan step would have (the last layer's, compared with the bank's), and the
    step's logits and cache writes are the bits of the step that plans."""
    from test_fused_step import LOGIT_TOL, compare_step
    model, pool = _wrapped(family, seed=35, rows="all")
    assert pool.bank.holds_every_expert()
    prompts, tok = [[5, 9, 3], [7, 1, 4, 4, 8, 2]], [11, 13]
    monkeypatch.setenv("CUPOOL_SKIP_PLAN", "0")
    base, want, base_cache, _, step = compare_step(model, pool, "kernels", prompts, tok)
    assert not pool.plan_skipped and "plan step" not in step.describe()
    monkeypatch.delenv("CUPOOL_SKIP_PLAN", raising=False)          # on by default
    monkeypatch.delenv("CUPOOL_FUSED_ROUTE", raising=False)        # the router's own launch
    got, _, got_cache, _, step = compare_step(model, pool, "kernels", prompts, tok)
    assert pool.plan_skipped and "plan step and row copies skipped" in step.describe()
    assert "router" not in step.describe(), step.describe()     # off: nothing to say
    # the plan step on the last layer's ids gives the lane addresses its router wrote
    _, planned = pool.bank.step(step.layers[-1].pooled.layer, step.route.ids)
    assert torch.equal(step.lane_addr, planned), (step.lane_addr, planned)
    assert torch.equal(got, base)
    for a, b in zip(got_cache[0] + got_cache[1], base_cache[0] + base_cache[1]):
        assert torch.equal(a, b)
    assert rel(got, want) <= LOGIT_TOL, rel(got, want)
    # the routing inside the decode GEMM (CUPOOL_FUSED_ROUTE=1): its logits' sums run in another
    # order, so the step is held to the reference's tolerance, and its lane addresses are the plan's
    monkeypatch.setenv("CUPOOL_FUSED_ROUTE", "1")
    got, _, _, _, step = compare_step(model, pool, "kernels", prompts, tok)
    if family == "gpt_oss":       # its routers' biases keep their own launch
        assert "the router keeps its own launch: the router has a bias" in step.describe()
        assert torch.equal(got, base)
        assert pool.errors() == []
        return
    assert "routing inside the decode GEMM's launch" in step.describe(), step.describe()
    _, planned = pool.bank.step(step.layers[-1].pooled.layer, step.route.ids)
    assert torch.equal(step.lane_addr, planned), (step.lane_addr, planned)
    assert rel(got, want) <= LOGIT_TOL, rel(got, want)
    assert pool.errors() == []


def test_engine_skipping_the_plan_gives_the_same_tokens(monkeypatch):
    """The captured step with CUPOOL_SKIP_PLAN=1 on a fully banked pool: the same greedy tokens
    as the step that plans, and the pool reports the skipped plan step (hit rate 1.0)."""
    import cupool
    from test_gpu_engine import _prompts

    from cupool.sampling import SamplingParams
    model, pool = _wrapped("qwen3_moe", seed=36, rows="all")
    ps = _prompts([4, 6, 3, 9], seed=4)
    runs = []
    for env in ("0", "1"):
        monkeypatch.setenv("CUPOOL_SKIP_PLAN", env)
        eng = cupool.Engine(model, pool, max_batch=4, max_len=40, eos_token_id=[])
        assert eng.step_kind.startswith("fused"), eng.step_kind
        assert ("plan step and row copies skipped" in eng.step_kind) == (env == "1")
        runs.append([r.output_ids for r in eng.generate(ps, SamplingParams(max_tokens=12))])
        assert pool.plan_skipped == (env == "1")
        eng.close()
    assert runs[0] == runs[1]
    assert pool.hit_rate() == 1.0 and pool.errors() == []


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_engine_fused_greedy_matches_the_reference(family):
    """The engine's default step on a model that fits: fused, captured, gate open, half the
    experts banked; tokens checked as test_gpu_engine checks the unfused engine's."""
    import cupool
    from test_gpu_engine import MAX_OFF, _check_against_reference, _prompts

    from cupool.sampling import SamplingParams
    model, pool = _wrapped(family, seed=32)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[])
    assert eng.step_kind.startswith("fused"), eng.step_kind
    ps = _prompts([3, 9, 14, 5, 7, 2], seed=1)
    reqs = eng.generate(ps, [SamplingParams(max_tokens=n) for n in (16, 12, 16, 6, 10, 16)])
    assert [len(r.output_ids) for r in reqs] == [16, 12, 16, 6, 10, 16]
    assert pool.errors() == []
    assert pool.verify() > 0
    stats = pool.stats()
    assert sum(s["hits"] + s["misses"] for s in stats) > 0
    pool.unwrap()
    off = _check_against_reference(model, reqs)
    assert len(off) <= MAX_OFF, f"{family}: tokens off the reference's argmax at {off}"


@pytest.mark.parametrize("family,rows", [("qwen3_moe", "all"), ("qwen3_moe", None),
                                         ("gpt_oss", None), ("qwen2_moe", "all")])
def test_engine_narrow_steps_match_the_reference_and_the_steps_of_every_slot(family, rows):
    """Requests of different lengths in a 4-slot engine (every expert banked, or half): as they
    finish, the steps of 2 and then 1 active slots run the narrow steps of those widths (a graph
    a width, the slot map choosing the slots), the others' held rows untouched. Tokens are the
    reference's argmax (teacher forcing, as test_gpu_engine checks); seeded sampled requests
    give the same tokens with narrow steps on and off (each row's draw reads its own logits,
    which GEMV builds of another width may round differently only within a tie)."""
    import cupool
    from test_gpu_engine import MAX_OFF, _check_against_reference, _prompts

    from cupool.sampling import SamplingParams
    model, pool = _wrapped(family, seed=26, rows=rows)
    ps = _prompts([3, 9, 14], seed=6)
    eng = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[])
    assert eng.narrow_why is None and "(1, 2 slots)" in eng.step_kind, eng.step_kind
    reqs = eng.generate(ps, [SamplingParams(max_tokens=n) for n in (4, 8, 16)])
    widths = {k.width for k in eng._graphs}
    assert {0, 1, 2} <= widths, widths
    assert [len(r.output_ids) for r in reqs] == [4, 8, 16]
    eng.close()
    assert pool.errors() == []
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=50 + i, max_tokens=n)
               for i, n in enumerate((4, 8, 16))]
    runs = []
    for narrow in (True, False):
        e = cupool.Engine(model, pool, max_batch=4, max_len=48, eos_token_id=[], narrow=narrow)
        runs.append([r.output_ids for r in e.generate(ps, sampled)])
        e.close()
    assert runs[0] == runs[1]
    assert pool.errors() == []
    pool.unwrap()
    off = _check_against_reference(model, reqs)
    assert len(off) <= MAX_OFF, f"{family}: tokens off the reference's argmax at {off}"


def test_engine_narrow_step_refusals_are_said():
    import cupool
    model, pool = _wrapped("qwen3_moe", seed=27, rows="all")
    assert cupool.Engine(model, pool, max_batch=1, max_len=32).narrow_why.startswith(
        "max_batch is 1")
    assert cupool.Engine(model, pool, max_batch=2, max_len=32, narrow=False).narrow_why == \
        "narrow=False"
    assert "model's own forward" in cupool.Engine(model, pool, max_batch=2, max_len=32,
                                                  fused=False).narrow_why
    with pytest.raises(ValueError, match="narrow must be True or False"):
        cupool.Engine(model, pool, max_batch=2, max_len=32, narrow=1)


def test_engine_fused_equals_unfused_sampling_seeded():
    """Seeded sampling through the fused step: the same seed repeats, and greedy tokens of the
    fused and the unfused engine agree on most steps (bf16 noise may flip a near-tie)."""
    import cupool
    from test_gpu_engine import _prompts

    from cupool.sampling import SamplingParams
    model, pool = _wrapped("qwen3_moe", seed=33, rows=8)
    ps = _prompts([4, 6, 3], seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=10)
              for i in range(3)]
    runs = [[r.output_ids for r in cupool.Engine(model, pool, max_batch=3, max_len=32,
                                                 eos_token_id=[]).generate(ps, params)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    a = cupool.Engine(model, pool, max_batch=3, max_len=32, eos_token_id=[], fused=True)
    b = cupool.Engine(model, pool, max_batch=3, max_len=32, eos_token_id=[], fused=False)
    ga = [r.output_ids for r in a.generate(ps, SamplingParams(max_tokens=10))]
    gb = [r.output_ids for r in b.generate(ps, SamplingParams(max_tokens=10))]
    same = sum(x == y for ra, rb in zip(ga, gb) for x, y in zip(ra, rb))
    assert same >= 0.8 * 30, (ga, gb)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("shapes", [{}, {"qkv": dict(warps=4), "o": dict(split_k=2),
                                        "router": dict(split_k=8)},
                                    {"o": dict(warps=4, split_k=2),
                                     "router": dict(warps=4, split_k=8)}],
                         ids=["default", "qkv=w4,o=k2,router=k8", "o=w4k2,router=w4k8"])
def test_dependent_launches_change_no_bit_of_a_captured_chain(tokens, shapes, monkeypatch):
    """The fused step's launch pattern: a torch op writes the input, then QKV (norm prologue) →
    attention → o-projection (+ residual) → router (norm + routing), replayed as one graph on
    new inputs each time. Captured with dependent launches (each kernel's weight loads start
    before the kernel before it has finished) the outputs must equal, bit for bit, the same chain
    captured with ordinary launches: a kernel that read its input before waiting would read the
    previous replay's. (Every kernel of the chain is deterministic: no float atomics; a split K
    adds its partials in a fixed order.) With launch shapes as CUPOOL_DENSE_SHAPE picks them, the
    split-K blocks' partials and tickets are written after the wait, too."""
    from cupool import _cuda
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, parts
    from cupool.ops.dense_gemv import RESIDUAL, ROUTE, DenseGemv, RouteOut

    if _cuda.target().sm < 90:
        pytest.skip("dependent launches need sm_90 code (CUPOOL_ARCH below 90 builds without)")
    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, nh, hk, D, E, L = tokens, 2048, 32, 4, 128, 128, 256
    wq, wk, wv = rand(nh * D, H, scale=0.02, gen=g), rand(hk * D, H, scale=0.02, gen=g), \
        rand(hk * D, H, scale=0.02, gen=g)
    wo, wr = rand(H, nh * D, scale=0.02, gen=g), rand(E, H, scale=0.05, gen=g)
    n1, n2 = rand(H, gen=g) + 1, rand(H, gen=g) + 1
    qn, kn = rand(D, gen=g) + 1, rand(D, gen=g) + 1
    cos, sin = rand(L, D, gen=g), rand(L, D, gen=g)
    inputs = [rand(B, H, gen=g) for _ in range(4)]
    pos_all = [torch.randint(0, L, (B,), device="cuda", generator=g) for _ in range(4)]

    def chain():
        qkv = DenseGemv([wq, wk, wv], tokens=B, norm=True, **shapes.get("qkv", {}))
        ws = AttentionWorkspace(B, nh, hk, D, parts(B, hk, L, _cuda.target().sms), "cuda")
        attn = DecodeAttention(nh, hk, D, q_norm=qn, k_norm=kn, eps=1e-6, scale=D ** -0.5,
                               workspace=ws)
        o = DenseGemv([wo], tokens=B, epilogue=RESIDUAL, **shapes.get("o", {}))
        router = DenseGemv([wr], tokens=B, norm=True, epilogue=ROUTE, **shapes.get("router", {}))
        x, pos = torch.empty_like(inputs[0]), torch.empty_like(pos_all[0])
        kc = rand(B, hk, L, D, gen=torch.Generator(device="cuda").manual_seed(3))
        vc = rand(B, hk, L, D, gen=torch.Generator(device="cuda").manual_seed(4))
        bufs = dict(qkv=poison(B, (nh + 2 * hk) * D), a=poison(B, nh * D), h=poison(B, H),
                    xn=poison(B, H), r=RouteOut.allocate(B, E, 8, torch.bfloat16, "cuda"))

        def step():
            qkv(x, norm_weight=n1, eps=1e-6, out=bufs["qkv"])
            attn(bufs["qkv"], pos, kc, vc, cos, sin, bufs["a"])
            o(bufs["a"], residual=x, out=bufs["h"])
            router(bufs["h"], norm_weight=n2, eps=1e-6, x_out=bufs["xn"], route=bufs["r"],
                   top_k=8, norm_topk=True)

        x.copy_(inputs[0]); pos.copy_(pos_all[0])
        step()                                     # compiles and checks the arguments
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        outs = []
        for i in range(12):
            x.copy_(inputs[i % 4]); pos.copy_(pos_all[i % 4])
            graph.replay()
            outs.append([t.clone() for t in (bufs["qkv"], bufs["a"], bufs["h"], bufs["xn"],
                                             bufs["r"].ids, bufs["r"].weights, kc, vc)])
        torch.cuda.synchronize()
        return outs

    monkeypatch.setenv("CUPOOL_DEPENDENT_LAUNCH", "0")
    assert not _cuda.target().dependent_launch
    want = chain()
    monkeypatch.setenv("CUPOOL_DEPENDENT_LAUNCH", "1")
    assert _cuda.target().dependent_launch
    got = chain()
    names = ["qkv", "attention", "o-projection", "normed x", "ids", "weights", "keys", "values"]
    for i, (gs, ws) in enumerate(zip(got, want)):
        for name, a, b in zip(names, gs, ws):
            assert not a.isnan().any() if a.is_floating_point() else True, f"replay {i}: {name} NaN"
            assert torch.equal(a, b), f"replay {i}: {name} differs with dependent launches"
