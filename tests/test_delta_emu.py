"""rawkernels/delta_decode.cu run on the CPU against `cupool.reference.dense.delta_decode`.

The kernel's own source is compiled with g++ against tests/emu (every block of its grid run one
after another; `delta_main.cpp` drives it), so both in-projection layouts (Qwen3-Next's grouped
one, Qwen3.5's flat one), value heads sharing a key head (the convolution tickets), inactive
tokens, slots of a larger cache and the head dims the kernel is built for are checked without a
GPU. What concurrent blocks do to each other is the GPU tests' part (test_gpu_dense.py).
"""

from __future__ import annotations

import _emu_build as emu_build
import numpy as np
import pytest
import torch
from test_fused_step import rel

from cupool.reference import dense as ref

# The outputs: bf16 values after float32 sums in another order than torch's (a last-bit
# difference in a rounded intermediate moves a row by about 2^-8 of its norm at most).
OUT_TOL = 1e-2
# The recurrent state: float32 throughout, but its inputs q, k, v are rounded convolution outputs,
# whose last bf16 bit a sum in another order can flip.
STATE_TOL = 1e-3

BUILDS = {
    "next": {"DK": 128, "DV": 128, "KC": 4, "GROUPED": 1},      # Qwen3-Next's heads
    "qwen3_5": {"DK": 128, "DV": 128, "KC": 4, "GROUPED": 0},   # Qwen3.5's layout
    "k64v32": {"DK": 64, "DV": 32, "KC": 4, "GROUPED": 1},
    "k32v64c3": {"DK": 32, "DV": 64, "KC": 3, "GROUPED": 0},
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("delta_emu")
    emu_build.stage(work, "delta_decode")
    return work, emu_build.compile_all(work, "delta_main.cpp", BUILDS)


def delta_inputs(B: int, S: int, hk: int, hv: int, dk: int, dv: int, KC: int, seed: int):
    """Random inputs of a gated delta net step, at magnitudes like a trained model's: (proj,
    conv_state, conv_w, state, neg_a, dt_bias, norm_w) on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    bf = torch.bfloat16
    C = 2 * hk * dk + hv * dv
    width = C + hv * dv + 2 * hv
    proj = rn(B, width).to(bf)
    conv_state = rn(S, C, KC).to(bf)
    conv_w = rn(C, KC, scale=0.5).to(bf)
    state = rn(S, hv, dk, dv, scale=0.3)
    # A in (0.01, 16) as transformers initialises A_log; decays from near 1 to near 0
    neg_a = -(torch.rand(hv, generator=gen) * 16 + 0.01)
    dt_bias = rn(hv, scale=0.5) - 2.0
    norm_w = (1 + rn(dv, scale=0.2)).to(bf)
    return proj, conv_state, conv_w, state, neg_a, dt_bias, norm_w


def run_kernel(builds, name, proj, pos, conv_state, conv_w, state, neg_a, dt_bias, norm_w, eps,
               hk, hv, slots=None):
    """The emulated launch over grid (hv, B): (out, conv_state, state, count)."""
    work, exes = builds
    B, S = proj.shape[0], conv_state.shape[0]
    dv = BUILDS[name]["DV"]
    head = [B, S, hk, hv, proj.shape[1], slots is not None, emu_build.f32_bits(eps),
            *pos.tolist(), *([] if slots is None else slots.tolist())]
    f32 = lambda t: t.contiguous().view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF  # noqa
    got = emu_build.run(exes[name], [head] + [emu_build.bf16_words(t) for t in
                                              (proj, conv_state, conv_w, norm_w)]
                        + [f32(t) for t in (state, neg_a, dt_bias)])
    n_out, n_conv, n_state = B * hv * dv, conv_state.numel(), state.numel()
    assert got.size == n_out + n_conv + n_state + B * hk
    out = emu_build.bf16(got[:n_out], (B, hv * dv))
    conv = emu_build.bf16(got[n_out:n_out + n_conv], conv_state.shape)
    st = torch.from_numpy(got[n_out + n_conv:n_out + n_conv + n_state].astype(np.uint32)
                          .view(np.float32).copy()).reshape(state.shape)
    return out, conv, st, got[n_out + n_conv + n_state:]


def check_launch(out, conv, st, count, want, conv_ref, st_ref, pos, slots, state_in, conv_in):
    """An emulated (or GPU) launch against the reference's output and states: tickets back at
    zero; an active token's row within OUT_TOL, an inactive one's zeros over the poison; the
    convolution windows exactly the reference's; the state within STATE_TOL; the slots no token
    used keep their bits."""
    B = out.shape[0]
    assert (torch.as_tensor(count) == 0).all(), "the tickets must be back at zero"
    assert not out.isnan().any()
    used = set()
    for b in range(B):
        c = b if slots is None else int(slots[b])
        if pos[b] < 0:
            assert (out[b] == 0).all(), b
            assert torch.equal(st[c], state_in[c]) and torch.equal(conv[c], conv_in[c]), b
            continue
        used.add(c)
        assert rel(out[b], want[b]) <= OUT_TOL, (b, rel(out[b], want[b]))
        assert torch.equal(conv[c], conv_ref[c]), b
        assert rel(st[c], st_ref[c]) <= STATE_TOL, (b, rel(st[c], st_ref[c]))
    for c in set(range(st.shape[0])) - used:
        assert torch.equal(st[c], state_in[c]) and torch.equal(conv[c], conv_in[c]), c


CASES = [  # build, B, hk, hv, positions, slots (None: token b's slot is b)
    ("next", 2, 2, 4, [7, 100], None),               # two value heads a key head
    ("next", 3, 1, 3, [5, -1, 9], [4, 0, 2]),        # three a key head; an inactive token; slots
    ("qwen3_5", 2, 2, 4, [3, 8], None),
    ("qwen3_5", 2, 3, 3, [-1, 2], [1, 3]),           # one value head a key head (no tickets)
    ("k64v32", 3, 2, 6, [1, 2, 3], None),
    ("k32v64c3", 2, 1, 2, [4, 4], [2, 0]),
]


@pytest.mark.parametrize("build,B,hk,hv,positions,slots", CASES)
def test_delta_kernel_source_matches_reference_on_cpu(builds, build, B, hk, hv, positions,
                                                      slots):
    d = BUILDS[build]
    S = B if slots is None else max(slots) + 2
    proj, conv_state, conv_w, state, neg_a, dt_bias, norm_w = delta_inputs(
        B, S, hk, hv, d["DK"], d["DV"], d["KC"], seed=B * 7 + hv)
    pos = torch.tensor(positions, dtype=torch.int64)
    sl = None if slots is None else torch.tensor(slots, dtype=torch.int64)
    out, conv, st, count = run_kernel(builds, build, proj, pos, conv_state, conv_w, state, neg_a,
                                      dt_bias, norm_w, 1e-6, hk, hv, sl)
    conv_ref, st_ref = conv_state.clone(), state.clone()
    want = ref.delta_decode(proj, hk, hv, d["DK"], d["DV"], bool(d["GROUPED"]), conv_ref, conv_w,
                            st_ref, neg_a, dt_bias, norm_w, 1e-6, pos, sl)
    check_launch(out, conv, st, count, want, conv_ref, st_ref, pos, sl, state, conv_state)


def test_delta_reference_tells_the_layouts_and_the_decay_apart():
    """The checks above can fail: on the same inputs the other in-projection layout, or a state
    that does not decay, is far outside the tolerances."""
    hk, hv, dk, dv = 2, 4, 128, 128
    proj, conv_state, conv_w, state, neg_a, dt_bias, norm_w = delta_inputs(2, 2, hk, hv, dk, dv,
                                                                          4, seed=3)
    pos = torch.tensor([1, 2])

    def go(grouped, na):
        st = state.clone()
        out = ref.delta_decode(proj, hk, hv, dk, dv, grouped, conv_state.clone(), conv_w, st, na,
                               dt_bias, norm_w, 1e-6, pos)
        return out, st

    out, st = go(True, neg_a)
    other, _ = go(False, neg_a)
    assert rel(other, out) > 10 * OUT_TOL
    _, st0 = go(True, torch.zeros_like(neg_a))
    assert rel(st0, st) > 10 * STATE_TOL


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
@torch.inference_mode()
def test_delta_reference_is_transformers_module(family):
    """`reference.dense.delta_decode` is what transformers' gated delta net module computes in a
    decode step (its torch functions: causal_conv1d_update, torch_recurrent_gated_delta_rule, the
    gated RMSNorm), bit for bit on the CPU, in Qwen3-Next's grouped in-projection layout and
    Qwen3.5's flat one: from the states a 5-token prefill left, the new token's output (the
    out-projection's input) and both states."""
    import inspect

    from test_fused_step import qwen3_next_model

    from cupool.slotstate import StateSlotCache
    model = qwen3_next_model(seed=5, family=family)
    la = model.model.layers[0].linear_attn
    with torch.no_grad():                  # gates and decays away from transformers' init
        la.A_log.copy_(torch.rand(la.A_log.shape) * 2 - 1)
        la.dt_bias.copy_(torch.randn(la.dt_bias.shape) * 0.5)
        la.norm.weight.normal_(1, 0.2)
    grouped = hasattr(la, "in_proj_qkvz")
    kw = "cache" if "cache" in inspect.signature(la.forward).parameters else "cache_params"
    hk, hv, dk, dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    B, H = 2, model.config.hidden_size
    got = {}
    la.out_proj.register_forward_pre_hook(lambda m, i: got.__setitem__("o", i[0].clone()))
    names = ("in_proj_qkvz", "in_proj_ba") if grouped else ("in_proj_qkv", "in_proj_z",
                                                            "in_proj_b", "in_proj_a")
    for n in names:
        getattr(la, n).register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o.clone()))
    cache = StateSlotCache(1, B, 16, torch.bfloat16, "cpu")
    for b in range(B):
        cache.prefill_mode(b, 0, 5)
        la(torch.randn(1, 5, H).to(torch.bfloat16), **{kw: cache})
    cache.decode_mode()
    conv, state = cache.layers[0].conv[0].clone(), cache.layers[0].recurrent[0].clone()
    assert state.dtype == torch.float32 and conv.shape == (B, 2 * hk * dk + hv * dv, 4)
    la(torch.randn(B, 1, H).to(torch.bfloat16), **{kw: cache})
    proj = torch.cat([got[n][:, 0] for n in names], -1)
    out = ref.delta_decode(proj, hk, hv, dk, dv, grouped, conv, la.conv1d.weight[:, 0], state,
                           -la.A_log.float().exp(), la.dt_bias.float(), la.norm.weight,
                           la.norm.variance_epsilon, torch.arange(B))
    assert torch.equal(out, got["o"][:, 0])
    assert torch.equal(conv, cache.layers[0].conv[0])
    assert torch.equal(state, cache.layers[0].recurrent[0])
