"""Expert activations (cupool.activation), biased row layouts and the float reference with both
(CPU)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cupool import nvfp4
from cupool.activation import SILU, Activation, swiglu_clamp
from cupool.layout import RowLayout, pack_row, pack_rows, unpack_bias, unpack_row
from cupool.reference.moe import reference_moe
from cupool.synthetic import dequantize_exact, random_biases, random_experts


def gptoss_apply_gate(gate_up, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts._apply_gate, written out (interleaved gate/up)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def test_silu_is_silu_glu():
    g, u = torch.randn(5, 7), torch.randn(5, 7)
    assert torch.equal(SILU(g, u), F.silu(g) * u)
    assert SILU.defines() == {}


def test_swiglu_clamp_equals_gpt_oss():
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)) * 6    # clamps engage
    act = swiglu_clamp(1.702, 7.0)
    got = act(x[..., ::2], x[..., 1::2])
    torch.testing.assert_close(got, gptoss_apply_gate(x), rtol=1e-6, atol=1e-6)
    assert (x[..., ::2] > 7).any() and (x[..., 1::2].abs() > 7).any()
    # a different limit or alpha computes something else on the same probe
    assert not torch.allclose(swiglu_clamp(1.702, 5.0)(x[..., ::2], x[..., 1::2]), got)
    assert not torch.allclose(swiglu_clamp(1.0, 7.0)(x[..., ::2], x[..., 1::2]), got)


def test_defines_are_exact_float32_literals():
    act = swiglu_clamp(1.702, 7.0)
    d = act.defines()
    assert d["ACT"] == 1
    for key, v in (("ACT_ALPHA", 1.702), ("ACT_LIMIT", 7.0)):
        lit = d[key]
        assert lit.endswith("f")
        assert float.fromhex(lit[:-1]) == float(np.float32(v))       # the float32 the kernel uses
    assert act.alpha == float(np.float32(1.702))


@pytest.mark.parametrize("kw,match", [
    (dict(kind="gelu"), "kind must be one of"),
    (dict(kind="silu", alpha=1.0), "takes no alpha"),
    (dict(kind="swiglu_clamp", alpha=1.7, limit=None), "limit must be a finite number"),
    (dict(kind="swiglu_clamp", alpha=math.nan, limit=7.0), "alpha must be a finite number"),
    (dict(kind="swiglu_clamp", alpha=1.7, limit=-1.0), "limit must be > 0"),
    (dict(kind="swiglu_clamp", alpha=True, limit=7.0), "alpha must be a finite number"),
])
def test_activation_guards(kw, match):
    with pytest.raises(ValueError, match=match):
        Activation(**kw)


# --- rows with biases ------------------------------------------------------------------------------
@pytest.mark.parametrize("H,I", [(80, 48), (2880, 2880), (48, 32)])
def test_bias_layout_sizes(H, I):
    plain, biased = RowLayout(H, I), RowLayout(H, I, bias=True)
    assert biased.bias_offset == plain.row_bytes
    assert biased.row_bytes == plain.row_bytes + 4 * (2 * plain.ip + plain.hp)
    assert biased.row_bytes % 16 == 0 and biased.bias_offset % 16 == 0
    assert plain.defines() == {"HP": plain.hp, "IP": plain.ip, "ROW_W2_OFFSET": plain.w2_offset}
    assert biased.defines() == {**plain.defines(), "ROW_BIAS": 1}
    if (H, I) == (2880, 2880):                 # gpt-oss: no padding, 13.4 MiB a row
        assert (plain.hp, plain.ip, biased.row_bytes) == (2880, 2880, 14_031_616)


def test_bias_round_trip_and_padding_zero():
    layout = RowLayout(80, 48, bias=True)                  # Hp = 128, Ip = 64: padded
    gen = torch.Generator().manual_seed(1)
    bg, bu, bd = random_biases(layout, 3, gen)
    rows, mats = random_experts(layout, 3, gen, biases=(bg, bu, bd))
    for e in range(3):
        got = unpack_bias(layout, rows[e])
        for a, b in zip(got, (bg[e], bu[e], bd[e])):
            assert torch.equal(a, b.float())
        g, u, d = unpack_row(layout, rows[e])             # the weights are unchanged by biases
        assert torch.equal(g.packed, mats[e][0].packed) and torch.equal(d.packed, mats[e][2].packed)
        f = rows[e, layout.bias_offset:].clone().view(torch.float32)
        assert torch.all(f[48:64] == 0) and torch.all(f[64 + 48:128] == 0) and torch.all(f[128 + 80:] == 0)
    # the batched packer gives the same bytes
    st = [nvfp4.NVFP4Tensor(torch.stack([m[i].packed for m in mats]),
                            torch.stack([m[i].block_scale for m in mats]),
                            torch.stack([m[i].global_scale.reshape(()) for m in mats]))
          for i in range(3)]
    assert torch.equal(pack_rows(layout, *st, bias=(bg, bu, bd)), rows)


def test_bias_guards():
    layout, plain = RowLayout(80, 48, bias=True), RowLayout(80, 48)
    gen = torch.Generator().manual_seed(2)
    _, mats = random_experts(plain, 1, gen)
    g, u, d = mats[0]
    ok = (torch.zeros(48), torch.zeros(48), torch.zeros(80))
    with pytest.raises(ValueError, match="the layout has biases"):
        pack_row(layout, g, u, d)
    with pytest.raises(ValueError, match="the layout has no biases"):
        pack_row(plain, g, u, d, bias=ok)
    with pytest.raises(ValueError, match=r"bias down: expected shape \[80\], got \[79\]"):
        pack_row(layout, g, u, d, bias=(ok[0], ok[1], torch.zeros(79)))
    with pytest.raises(ValueError, match="bias up: holds NaN or Inf"):
        pack_row(layout, g, u, d, bias=(ok[0], torch.full((48,), math.nan), ok[2]))
    with pytest.raises(TypeError, match="bias gate: expected a float tensor"):
        pack_row(layout, g, u, d, bias=(torch.zeros(48, dtype=torch.int32), ok[1], ok[2]))
    with pytest.raises(ValueError, match="bias must be a bool"):
        RowLayout(80, 48, bias=1)


# --- the float reference ---------------------------------------------------------------------------
def test_reference_with_biases_and_clamp_equals_gpt_oss_loop():
    """reference_moe(activation=, biases=) is the loop of transformers' GptOssExperts.forward."""
    gen = torch.Generator().manual_seed(3)
    T, K, E, H, I = 6, 4, 8, 48, 32
    gate_up = torch.randn(E, H, 2 * I, generator=gen) * 0.5     # [E, H, 2I] interleaved
    gate_up_b = torch.randn(E, 2 * I, generator=gen)
    down = torch.randn(E, I, H, generator=gen) * 0.5
    down_b = torch.randn(E, H, generator=gen)
    x = torch.randn(T, H, generator=gen) * 2
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = gptoss_apply_gate(x[t] @ gate_up[e] + gate_up_b[e])
            want[t] += (h @ down[e] + down_b[e]) * w[t, k]
    experts = [(gate_up[e][:, ::2].T, gate_up[e][:, 1::2].T, down[e].T) for e in range(E)]
    biases = [(gate_up_b[e, ::2], gate_up_b[e, 1::2], down_b[e]) for e in range(E)]
    got = reference_moe(x, ids, w, experts, activation=swiglu_clamp(1.702, 7.0), biases=biases)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # counter-check: without the biases, or with SiLU, it is something else
    assert not torch.allclose(reference_moe(x, ids, w, experts, activation=swiglu_clamp(1.702, 7.0)),
                              want, atol=1e-3)
    assert not torch.allclose(reference_moe(x, ids, w, experts, biases=biases), want, atol=1e-3)


def test_reference_of_rows_with_biases():
    """The reference from a biased row's unpacked contents: what the GPU tests compare with."""
    layout = RowLayout(48, 32, bias=True)
    gen = torch.Generator().manual_seed(4)
    b = random_biases(layout, 4, gen)
    rows, mats = random_experts(layout, 4, gen, biases=b)
    deq = [tuple(dequantize_exact(m) for m in trio) for trio in mats]
    x = torch.randn(3, 48, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]])
    w = torch.rand(3, 2, generator=gen)
    act = swiglu_clamp(1.702, 7.0)
    ref = reference_moe(x, ids, w, deq, activation=act, biases=[tuple(t[e] for t in b) for e in range(4)])
    # token 2's second lane is padding: its output is lane 1 of expert 1 alone
    g, u, d = deq[1]
    h = act(g @ x[2] + b[0][1], u @ x[2] + b[1][1])
    torch.testing.assert_close(ref[2], (d @ h + b[2][1]) * w[2, 0], rtol=1e-5, atol=1e-5)
