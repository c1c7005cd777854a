"""Experts without a gate projection (Nemotron-H: down(ReLU(up·x)²)) on the CPU: the activation's
float reference against transformers' relu2, the row layout without gate strips (round trip,
batched packing, sizes, synthetic rows), the float reference of such rows, the launchers' rules
and -D macros for them (the builds tests/kernel_builds.py registers), the pairing of layout and
activation, and the adapter reading transformers' NemotronHExperts (views, release/restore, its
own forward equal to the reference; a latent MoE, whose router is wider than its experts).
The kernels themselves: tests/test_gpu_nongated.py; checkpoints: tests/test_checkpoints_nemotron.py."""

from __future__ import annotations

import pytest
import torch

from tiny_models import HYBRID_FAMILIES, hybrid_model, moe_reference

from cupool import nvfp4
from cupool.activation import RELU2, SILU
from cupool.layout import HEADER_BYTES, RowLayout, pack_row, pack_rows, unpack_row
from cupool.reference.moe import reference_moe


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_relu2_reference():
    pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    x = _rand(7, 33) * 4
    torch.testing.assert_close(RELU2(None, x), ACT2FN["relu2"](x), rtol=0, atol=0)
    assert not RELU2.gated and SILU.gated
    assert RELU2.defines() == {"ACT": 2} and SILU.defines() == {}
    with pytest.raises(ValueError, match="gate must be None"):
        RELU2(x, x)
    with pytest.raises(ValueError, match="gate must be a tensor"):
        SILU(None, x)


@pytest.mark.parametrize("H,I", [(48, 32), (80, 48)])
def test_nongated_rows_round_trip(H, I):
    lay = RowLayout(H, I, gated=False)
    gated = RowLayout(H, I)
    assert lay.w2_offset == HEADER_BYTES + (lay.ip // 16) * 9 * lay.hp
    assert lay.row_bytes == HEADER_BYTES + 18 * lay.hp * lay.ip // 16
    assert gated.row_bytes - lay.row_bytes == 9 * lay.hp * lay.ip // 16   # the gate strips
    assert lay.defines()["ROW_GATED"] == 0 and "ROW_GATED" not in gated.defines()
    E = 3
    up = nvfp4.quantize(_rand(E, I, H, seed=1))
    down = nvfp4.quantize(_rand(E, H, I, seed=2))
    rows = pack_rows(lay, None, up, down)
    assert rows.shape == (E, lay.row_bytes)
    for e in range(E):
        row = pack_row(lay, None, up[e], down[e])
        assert torch.equal(rows[e], row)
        g, u, d = unpack_row(lay, row)
        assert g is None
        for got, want in ((u, up[e]), (d, down[e])):
            assert torch.equal(got.packed, want.packed)
            assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
            assert torch.equal(got.global_scale.reshape(()), want.global_scale.reshape(()))
        assert row[:4].view(torch.float32).item() == 0.0          # no gate global scale
    with pytest.raises(ValueError, match="no gate .*pass gate=None"):
        pack_row(lay, up[0], up[0], down[0])
    with pytest.raises(ValueError, match="gated .*pass the gate matrices"):
        pack_rows(gated, None, up, down)
    with pytest.raises(ValueError, match="carry no biases"):
        RowLayout(H, I, bias=True, gated=False)


@pytest.fixture(scope="module")
def nemotron():
    pytest.importorskip("transformers")
    return hybrid_model("nemotron_h", seed=3)


def test_adapter_reads_nemotron_h_experts(nemotron):
    from cupool.adapters import find_moe_layers
    layers, E, K, H, I, path = HYBRID_FAMILIES["nemotron_h"][1]
    specs = find_moe_layers(nemotron)
    assert [s.name for s in specs] == [path.format(i=i) for i in layers]
    s = specs[0]
    assert (s.gated, s.activation, s.num_experts, s.top_k, s.hidden, s.intermediate) == \
        (False, RELU2, E, K, H, I)
    g, up, down = s.stacked()
    assert g is None
    for e in range(E):
        ge, ue, de = s.expert(e)
        assert ge is None and torch.equal(ue, s.module.up_proj[e]) and torch.equal(de, down[e])
    x = _rand(6, H, seed=4)
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K]
                       for t in range(6)])
    w = torch.rand(6, K, generator=torch.Generator().manual_seed(5))
    for impl in ("eager", "batched_mm"):
        old = s.module.config._experts_implementation
        s.module.config._experts_implementation = impl
        try:
            with torch.no_grad():
                got = s.module(x, ids, w)
        finally:
            s.module.config._experts_implementation = old
        torch.testing.assert_close(got, moe_reference(s, x, ids, w), rtol=1e-5, atol=1e-5)
    # the GEMM's float reference computes the same from (None, up, down)
    torch.testing.assert_close(reference_moe(x, ids, w, s.expert, activation=RELU2),
                               moe_reference(s, x, ids, w), rtol=1e-5, atol=1e-5)
    # release / restore put the weights back in up_proj / down_proj
    trios = [tuple(None if t is None else t.clone() for t in s.expert(e)) for e in range(E)]
    s.release()
    assert s.module.up_proj.numel() == 0
    s.restore(trios)
    assert torch.equal(s.module.up_proj, torch.stack([t[1] for t in trios]))
    with pytest.raises(ValueError, match="gate must be None"):
        s.restore([(t[1], t[1], t[2]) for t in trios])


@pytest.fixture(scope="module")
def nemotron_bf16():
    pytest.importorskip("transformers")
    return hybrid_model("nemotron_h", seed=3, dtype=torch.bfloat16)


def test_wrap_no_longer_refuses_them(nemotron_bf16):
    """wrap goes past the specs to the GPU (the refusal of non-gated experts is gone); on a
    machine without one, that is the first thing it misses, and the model is left as it was."""
    import cupool
    from cupool._cuda import NoGPUError
    from cupool.adapters import find_moe_layers
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/test_gpu_nongated.py wraps the model")
    with pytest.raises(NoGPUError, match="cupool.wrap needs a CUDA GPU"):
        cupool.wrap(nemotron_bf16, rows=4, progress=False)
    assert not any(s.released for s in find_moe_layers(nemotron_bf16))


# --- the references and synthetic rows --------------------------------------------------------
def test_reference_of_rows_without_gate():
    """reference_moe from a non-gated row's unpacked contents (what the GPU tests compare with)
    is Σ w · down(ReLU(up·x)²), lane by lane; ReLU without the square is something else."""
    from cupool.synthetic import dequantize_exact, random_experts
    layout = RowLayout(48, 32, gated=False)
    gen = torch.Generator().manual_seed(6)
    rows, mats = random_experts(layout, 4, gen)
    assert all(m[0] is None for m in mats) and rows.shape == (4, layout.row_bytes)
    deq = [tuple(None if m is None else dequantize_exact(m) for m in trio) for trio in mats]
    for e in range(4):                                   # the rows hold exactly these experts
        g, u, d = unpack_row(layout, rows[e])
        assert g is None
        assert torch.equal(dequantize_exact(u), deq[e][1])
        assert torch.equal(dequantize_exact(d), deq[e][2])
    x = torch.randn(5, 48, generator=gen) * 3
    ids = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 3], [-1, -1]])
    w = torch.rand(5, 2, generator=gen)
    ref = reference_moe(x, ids, w, deq, activation=RELU2, dtype=torch.float64)
    want = torch.zeros(5, 48, dtype=torch.float64)
    for t in range(5):
        for k in range(2):
            e = int(ids[t, k])
            if e >= 0:
                _, u, d = (None if m is None else m.double() for m in deq[e])
                want[t] += w[t, k].double() * (d @ torch.clamp(u @ x[t].double(), min=0) ** 2)
    torch.testing.assert_close(ref, want)
    assert (ref[4] == 0).all()
    relu = reference_moe(x, ids, w, deq, activation=lambda g, u: torch.relu(u), dtype=torch.float64)
    assert not torch.allclose(relu, want, rtol=1e-2)


def test_synthetic_fast_rows_without_gate():
    from cupool.synthetic import dequantize_exact, random_rows_fast
    layout = RowLayout(128, 64, gated=False)
    rows = random_rows_fast(layout, 2, torch.Generator().manual_seed(7))
    assert rows.shape == (2, layout.row_bytes)
    for r in rows:
        g, u, d = unpack_row(layout, r)
        assert g is None and r[:4].view(torch.float32).item() == 0.0
        for m in (u, d):                                 # valid, finite, non-zero weights
            v = dequantize_exact(m)
            assert torch.isfinite(v).all() and v.abs().sum() > 0


# --- launchers: the pairing of layout and activation, rules, -D macros -------------------------
NEMOTRON = RowLayout(2688, 1856, gated=False)      # Nemotron-3-Nano-30B-A3B: H=2688, I=1856, K=6


def test_layout_and_activation_must_pair():
    from cupool.activation import swiglu_clamp
    from cupool.ops import check_experts, moe_decode, moe_gemm
    gated = RowLayout(2688, 1856)
    check_experts(NEMOTRON, RELU2)
    for act in (SILU, swiglu_clamp(1.702, 7.0)):
        check_experts(gated, act)
        with pytest.raises(ValueError, match=rf"activation '{act.kind}' .* is for experts with a "
                                             r"gate, but the row layout has gated=False .*"
                                             r"ReLU\(up\)²"):
            check_experts(NEMOTRON, act)
    with pytest.raises(ValueError, match=r"activation 'relu2' .* without a gate, but the row "
                                         r"layout has gated=True"):
        check_experts(gated, RELU2)
    with pytest.raises(TypeError, match="activation must be a cupool.activation.Activation"):
        check_experts(NEMOTRON, "relu2")
    b = moe_decode.Build(nt=8, maxw=64, minb=3, w13_split=4, xalign=1, w_dtype=0)
    with pytest.raises(ValueError, match="gated=False"):
        moe_decode.defines(b, NEMOTRON, torch.bfloat16)            # the default activation: SiLU
    with pytest.raises(ValueError, match="gated=True"):
        moe_gemm.defines(moe_gemm.PREFILL, gated, torch.bfloat16, RELU2)


def test_act_strips_and_items():
    """An item of w13_split warps a strip makes 8 / w13_split strips: strip pairs, or up strips
    alone (twice the act strips) in rows without a gate."""
    from cupool.ops import moe_decode
    gated = RowLayout(2688, 1856)
    assert [moe_decode.act_strips_per_item(gated, s) for s in (1, 2, 4)] == [4, 2, 1]
    assert [moe_decode.act_strips_per_item(NEMOTRON, s) for s in (1, 2, 4)] == [8, 4, 2]
    assert moe_decode.w13_items(gated, 6, 4) == 6 * 116
    assert moe_decode.w13_items(NEMOTRON, 6, 4) == 6 * 116 // 2
    with pytest.raises(ValueError, match="w13_split must be 1, 2 or 4, got 3"):
        moe_decode.act_strips_per_item(gated, 3)
    # the gated rules are those of strip pairs: unchanged (tests/test_nvcc_compile.py)
    qwen = RowLayout(2048, 768)
    assert moe_decode.blocks_per_sm(qwen, 132, 8, 8) == 3 and moe_decode.blocks_per_sm(qwen, 132, 8, 32) == 4
    assert moe_decode.w13_split(qwen, 132, 24, 4) == 2 and moe_decode.w13_split(qwen, 132, 16, 4) == 4
    # without a gate a call has half the items: T=1 (6 lanes) 348 < 528, T=2 696
    assert moe_decode.blocks_per_sm(NEMOTRON, 132, 8, 6) == 3
    assert moe_decode.blocks_per_sm(NEMOTRON, 132, 8, 12) == 4
    assert moe_decode.w13_split(NEMOTRON, 132, 48, 4) == 4       # Hp = 2688 > 2048: never 2


def _registered(name):
    from kernel_builds import BUILDS
    return {tuple(d.split()) for n, d in BUILDS if n == name}


def _flags(defines: dict) -> tuple:
    return tuple(f"-D{k}={v}" for k, v in defines.items())


def test_nemotron_builds_the_launchers_make_are_registered():
    """The moe_decode builds the per-call rules choose at Nemotron-3-Nano dims (top-6, 1 to 42
    tokens: every call of the one-launch decode) and the prefill build are in
    tests/kernel_builds.BUILDS (compiled for every architecture, hashed by kernel_cubins.py)."""
    from cupool.ops import moe_decode, moe_gemm
    decode = _registered("moe_decode")
    x = torch.zeros(42, 2688, dtype=torch.bfloat16)
    seen = set()
    for T in range(1, 43):
        b = moe_decode.choose(NEMOTRON, 132, T * 6, x[:T], torch.zeros(T * 6))
        d = moe_decode.defines(b, NEMOTRON, torch.bfloat16, RELU2)
        assert d["ROW_GATED"] == 0 and d["ACT"] == 2 and "ROW_BIAS" not in d
        seen.add(_flags(d))
    assert len(seen) == 3 and seen <= decode, sorted(seen - decode)
    prefill = _flags(moe_gemm.defines(moe_gemm.PREFILL, NEMOTRON, torch.bfloat16, RELU2))
    assert prefill in _registered("moe_gemm")


def test_w13_shared_memory_without_gate():
    """moe_w13's K-split partials hold one strip a warp without a gate, two (gate, up) with."""
    from cupool.ops.moe_gemm import PAIR_SMALL, PREFILL, shared_bytes
    gated = RowLayout(2688, 1856)
    def red(ns):                                    # [KSPLIT - 1][ns][NT/8 · 4][32] floats
        return (PAIR_SMALL.ksplit - 1) * ns * (PAIR_SMALL.nt // 8) * 4 * 32 * 4
    assert shared_bytes(PAIR_SMALL, gated, "moe_w13") - shared_bytes(PAIR_SMALL, NEMOTRON,
                                                                      "moe_w13") == red(2) - red(1)
    assert shared_bytes(PAIR_SMALL, gated, "moe_w2") == shared_bytes(PAIR_SMALL, NEMOTRON, "moe_w2")
    assert shared_bytes(PREFILL, gated, "moe_w13") == shared_bytes(PREFILL, NEMOTRON, "moe_w13")


def test_adapter_reads_a_latent_moe():
    """Nemotron-3-Super's latent MoE (moe_latent_size): the experts work in the latent size, the
    router scores the block's input of hidden_size; the experts module's own forward equals the
    reference on the latent inputs. A router of any other width is still refused."""
    pytest.importorskip("transformers")
    from cupool.adapters import UnsupportedModelError, find_moe_layers
    model = hybrid_model("nemotron_h", seed=6, moe_latent_size=16)
    s = find_moe_layers(model)[0]
    assert (s.hidden, s.intermediate, s.gated) == (16, 32, False)
    assert tuple(s.router().weight.shape) == (8, 48)
    x = _rand(5, 16, seed=7)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:2]
                       for t in range(5)])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = s.module(x, ids, w)
    torch.testing.assert_close(got, reference_moe(x, ids, w, s.expert, activation=RELU2),
                               rtol=1e-5, atol=1e-5)
    gate = model.model.layers[1].mixer.gate
    gate.weight = torch.nn.Parameter(torch.zeros(8, 40))
    with pytest.raises(UnsupportedModelError, match=r"router model\.layers\.1\.mixer\.gate has "
                                                    r"weight \[8, 40\], expected \[E=8, H=16\] or "
                                                    r"\[E=8, hidden_size=48\]"):
        find_moe_layers(model)
