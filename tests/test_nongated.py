"""Experts without a gate projection (Nemotron-H: down(ReLU(up·x)²)): the activation's float
reference against transformers' relu2, the row layout without gate strips (round trip, batched
packing, sizes), the adapter reading transformers' NemotronHExperts (views, release/restore, its
own forward equal to the reference; a latent MoE, whose router is wider than its experts), and
cupool.wrap refusing them by name until the kernels have a non-gated build."""

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


def test_wrap_names_what_is_missing(nemotron):
    import cupool
    from cupool.adapters import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mixer\.experts: unsupported, "
                                                    r"because its experts have no gate "
                                                    r"\(ReLU\(up\)² \(no gate\)\).*kernels"):
        cupool.wrap(nemotron.to(torch.bfloat16), rows=4)


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
