"""cupool.checkpoints.fill_store: every row of a HostStore equals pack_row of the reference NVFP4
of the same experts (float checkpoints: the reference quantizer; NVFP4 ones: bit-exact), for
every format and window size; rows are written window by window; argument guards; the GPU path
equals the CPU one."""

import numpy as np
import pytest
import torch
from checkpoint_fixtures import (
    ct_config_json,
    float_experts,
    llama4,
    mixtral,
    modelopt_hf_quant,
    put_ct_experts,
    put_float_experts,
    put_modelopt_experts,
    qwen3_moe,
    reference_nvfp4,
    save,
)

from cupool.checkpoints import (
    WINDOW_BYTES,
    CheckpointError,
    default_window,
    expert_temp_bytes,
    fill_store,
    open_checkpoint,
)
from cupool.layout import RowLayout, pack_row
from cupool.store import HostStore

H, I = 80, 48        # neither a multiple of 64: the rows carry padding


def _ckpt(tmp_path, rng, fmt, arch=qwen3_moe, **kw):
    a = arch(rng, L=3, E=5, H=H, I=I, **kw)
    ex = float_experts(rng, a)
    q = reference_nvfp4(ex, "expert" if fmt == "modelopt-fused" else "half")
    t = dict(a.dense)
    cfg, hq = a.config, None
    if fmt == "float":
        put_float_experts(t, a, ex)
        want = reference_nvfp4(ex)
    elif fmt.startswith("modelopt"):
        put_modelopt_experts(t, a, q, style={"modelopt": "ep", "modelopt-fused": "fused_t"
                                             if arch is llama4 else "fused"}[fmt],
                             scale2="expert" if fmt == "modelopt-fused" else "half")
        hq, want = modelopt_hf_quant(), q
    else:                                                  # compressed-tensors, layer 1 ignored
        put_ct_experts(t, a, q, layers=[0, 2])
        put_float_experts(t, a, {1: ex[1]})
        cfg = ct_config_json(cfg, ignore=["lm_head", r"re:model\.layers\.1\.mlp\.experts.*"])
        g = {k: v for k, v in q.items()}
        for layer in (0, 2):       # what a reading gives: global 1 / (1 / g)
            g[layer] = tuple(type(m)(m.packed, m.block_scale,
                                     torch.ones_like(m.global_scale)
                                     / (torch.ones_like(m.global_scale) / m.global_scale))
                             for m in q[layer])
        want = g
    d = save(tmp_path / fmt, t, cfg, shards=2, hf_quant_config=hq)
    return d, a, want


def _expect_rows(store, layout, want, layers):
    for li, layer in enumerate(layers):
        g, u, dn = want[layer]
        for e in range(store.num_experts):
            np.testing.assert_array_equal(store.row(li, e),
                                          pack_row(layout, g[e], u[e], dn[e]).numpy(),
                                          err_msg=f"layer {layer} expert {e}")


@pytest.mark.parametrize("fmt", ["float", "modelopt", "modelopt-fused", "compressed-tensors"])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_rows_equal_the_reference(tmp_path, rng, fmt, window):
    d, _a, want = _ckpt(tmp_path, rng, fmt)
    layout = RowLayout(H, I)
    store = HostStore(3, 5, layout.row_bytes, pinned=False)
    with open_checkpoint(d) as ck:
        fill_store(store, ck, layout, window=window, progress=False)
    _expect_rows(store, layout, want, [0, 1, 2])


def test_mixtral_llama4_and_a_path(tmp_path, rng):
    layout = RowLayout(H, I)
    for arch, fmt in ((mixtral, "float"), (llama4, "float"), (llama4, "modelopt-fused")):
        d, _a, want = _ckpt(tmp_path / arch.__name__, rng, fmt, arch)
        store = HostStore(3, 5, layout.row_bytes, pinned=False)
        fill_store(store, d, layout, window=2, progress=False)       # a directory: opened here
        _expect_rows(store, layout, want, [0, 1, 2])


def test_layer_map_and_progress(tmp_path, rng, capsys):
    d, _a, want = _ckpt(tmp_path, rng, "modelopt")
    layout = RowLayout(H, I)
    store = HostStore(2, 5, layout.row_bytes, pinned=False)
    fill_store(store, d, layout, layers=[2, 0], window=2, progress=True)
    _expect_rows(store, layout, want, [2, 0])
    err = capsys.readouterr().err
    assert "modelopt-nvfp4 experts -> host store" in err and "10/10" in err


def test_rows_are_written_window_by_window(tmp_path, rng):
    d, _a, _want = _ckpt(tmp_path, rng, "float")
    layout = RowLayout(H, I)
    events = []

    class Spy(HostStore):
        def write_row(self, layer, expert, data):
            events.append(("write", layer, expert))
            super().write_row(layer, expert, data)

    store = Spy(3, 5, layout.row_bytes, pinned=False)
    with open_checkpoint(d) as ck:
        read = ck.experts

        def spy_read(layer, start=0, stop=None):
            events.append(("read", layer, start, stop))
            return read(layer, start, stop)
        ck.experts = spy_read
        fill_store(store, ck, layout, window=2, progress=False)
    want_events = []
    for li in range(3):
        for lo in (0, 2, 4):
            hi = min(5, lo + 2)
            want_events.append(("read", li, lo, hi))
            want_events += [("write", li, e) for e in range(lo, hi)]
    assert events == want_events


def test_guards(tmp_path, rng):
    d, _a, _want = _ckpt(tmp_path, rng, "float")
    layout = RowLayout(H, I)
    with open_checkpoint(d) as ck:
        with pytest.raises(CheckpointError, match=r"layout is H=64, I=48 but the experts of .* are "
                                                  r"H=80, I=48"):
            fill_store(HostStore(3, 5, RowLayout(64, 48).row_bytes, pinned=False), ck,
                       RowLayout(64, 48))
        with pytest.raises(ValueError, match=r"store rows are 112 bytes but the layout's rows are"):
            fill_store(HostStore(3, 5, 112, pinned=False), ck, layout)
        with pytest.raises(ValueError, match=r"the store has 4 experts a layer, the checkpoint 5"):
            fill_store(HostStore(3, 4, layout.row_bytes, pinned=False), ck, layout)
        with pytest.raises(ValueError, match=r"layers: 3 checkpoint layers for a store of 2 layers"):
            fill_store(HostStore(2, 5, layout.row_bytes, pinned=False), ck, layout)
        with pytest.raises(CheckpointError, match=r"layer 7 has no routed experts"):
            fill_store(HostStore(1, 5, layout.row_bytes, pinned=False), ck, layout, layers=[7])
        store = HostStore(3, 5, layout.row_bytes, pinned=False)
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=r"window must be a positive int"):
                fill_store(store, ck, layout, window=bad)
        with pytest.raises(ValueError, match=r"device must be None, 'cpu' or a CUDA device"):
            fill_store(store, ck, layout, device="meta")
        store.seal()
        with pytest.raises(RuntimeError, match=r"sealed"):
            fill_store(store, ck, layout)


def test_default_window_bound():
    """The docstring's numbers: the default window keeps n · expert_temp_bytes ≤ 1 GiB."""
    big = RowLayout(2048, 2048)
    assert default_window(big, 2) == 3
    assert default_window(RowLayout(2048, 768), 2) == 9
    assert default_window(RowLayout(7168, 2048), 2) == 1           # DeepSeek-V3: one at a time
    assert expert_temp_bytes(RowLayout(7168, 2048), 2) > WINDOW_BYTES
    for lay in (big, RowLayout(2048, 768), RowLayout(4096, 1536), RowLayout(80, 48)):
        for item in (1, 2, 4):
            n = default_window(lay, item)
            assert n * expert_temp_bytes(lay, item) <= WINDOW_BYTES or n == 1
            assert (n + 1) * expert_temp_bytes(lay, item) > WINDOW_BYTES


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["float", "modelopt-fused"])
def test_gpu_path_equals_cpu(tmp_path, rng, fmt):
    d, _a, want = _ckpt(tmp_path, rng, fmt)
    layout = RowLayout(H, I)
    cpu = HostStore(3, 5, layout.row_bytes, pinned=False)
    gpu = HostStore(3, 5, layout.row_bytes, pinned=False)
    fill_store(cpu, d, layout, window=2, progress=False)
    fill_store(gpu, d, layout, window=2, device="cuda", progress=False)
    for li in range(3):
        for e in range(5):
            np.testing.assert_array_equal(gpu.row(li, e), cpu.row(li, e))
    _expect_rows(gpu, layout, want, [0, 1, 2])


def test_a_layout_without_gate_is_refused_for_gated_experts(tmp_path, rng):
    """A checkpoint whose experts have a gate does not fill rows without one."""
    d, _a, _want = _ckpt(tmp_path, rng, "float")
    store = HostStore(3, 5, RowLayout(H, I, gated=False).row_bytes, pinned=False)
    with pytest.raises(CheckpointError, match=r"layout has gated=False but the experts of .* have gate "
                                            r"projection \(gated=True\)"):
        fill_store(store, d, RowLayout(H, I, gated=False), progress=False)
