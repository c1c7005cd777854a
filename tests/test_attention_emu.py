"""rawkernels/dense_attention.cu run on the CPU against `cupool.reference.dense.attention_decode`.

The kernel's own source is compiled with g++ against tests/emu (the CUDA features it uses
emulated, every block of its grid run one after another; `attention_main.cpp` drives it), so the
split of a token's positions into parts, the parts past the used ones, the last block's merge,
window, sinks, the q/k norms (Qwen3-Next's (1 + w) kind too), the rotary embedding, the cache
write, inactive slots (pos -1) and qkv rows with each query head's gate (Qwen3-Next's) are
checked without a GPU.
What concurrent blocks do to each other is the GPU tests' part (test_gpu_dense.py).
"""

from __future__ import annotations

import subprocess

import _emu_build as emu_build
import pytest
import torch
from test_fused_step import rel

from cupool.ops.dense_attention import COUNTERS, THREADS, parts
from cupool.reference import dense as ref

ATTN_TOL = 1e-2                 # test_gpu_dense.py's: float32 sums in another order than torch's
BUILDS = {
    "d128g8": {"D": 128, "G": 8, "MINCHUNK": 64, "AHEAD": 1},      # Qwen3-30B-A3B's heads
    "d64g4": {"D": 64, "G": 4, "MINCHUNK": 64, "AHEAD": 0},
    "d128g8c192": {"D": 128, "G": 8, "MINCHUNK": 192, "AHEAD": 1},
    "d128g12": {"D": 128, "G": 12, "MINCHUNK": 64, "AHEAD": 1},     # GLM-4.5-Air's: two MMA n tiles
    "d256g8": {"D": 256, "G": 8, "MINCHUNK": 64, "AHEAD": 0},      # Qwen3-Next's
    # GLM-4.5-Air's partial rotary: the first 64 of 128 dims turn
    "d128g12r64": {"D": 128, "G": 12, "MINCHUNK": 64, "AHEAD": 1, "ROT": 64},
    # Qwen3-Next's full-attention layers: the first 64 of 256 dims turn, each query head's gate
    # after it in the qkv row, the (1 + w) q/k norms
    "d256g8next": {"D": 256, "G": 8, "MINCHUNK": 64, "AHEAD": 1, "ROT": 64, "QGATE": 1,
                   "NORM1": 1},
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    emu_build.require()
    work = tmp_path_factory.mktemp("attention_emu")
    emu_build.stage(work, "dense_attention")
    return work, emu_build.compile_all(work, "attention_main.cpp", BUILDS)


def run_kernel(builds, name, qkv, pos, kc, vc, cos, sin, qn, kn, sinks, nh, hk, window,
               num_parts, eps, scale, slots=None):
    """The emulated launch over grid (num_parts, hk, B): (out, k_cache, v_cache, count);
    slots: each token's slot of the cache (None: token b's is b)."""
    work, exes = builds
    B, S, L, D = qkv.shape[0], kc.shape[0], kc.shape[2], kc.shape[3]
    head = [B, S, nh, hk, L, num_parts, window, qn is not None, kn is not None,
            sinks is not None, slots is not None, emu_build.f32_bits(eps),
            emu_build.f32_bits(scale), *pos.tolist(), *([] if slots is None else slots.tolist())]
    got = emu_build.run(exes[name], [head] + [
        emu_build.bf16_words(t) for t in (qkv, kc, vc, cos, sin, qn, kn, sinks) if t is not None])
    n_out, n_kv = B * nh * D, S * hk * L * D
    assert got.size == n_out + 2 * n_kv + B * hk * COUNTERS
    out = emu_build.bf16(got[:n_out], (B, nh * D))
    k = emu_build.bf16(got[n_out:n_out + n_kv], kc.shape)
    v = emu_build.bf16(got[n_out + n_kv:n_out + 2 * n_kv], vc.shape)
    return out, k, v, got[n_out + 2 * n_kv:]


def _inputs(B, nh, hk, D, L, qk_norm, sinks, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16)  # noqa
    qkv, kc, vc = r(B, (nh + 2 * hk) * D), r(B, hk, L, D), r(B, hk, L, D)
    ang = torch.rand(L, D // 2, generator=gen) * 6.3
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    qn = r(D, scale=0.3) + 1 if qk_norm else None
    kn = r(D, scale=0.3) + 1 if qk_norm else None
    sk = r(nh) if sinks else None
    return qkv, kc, vc, cos, sin, qn, kn, sk


CASES = [  # build, B, nh, hk, L, positions, qk_norm, window, sinks, sm_count (sets NS)
    ("d128g8", 2, 16, 2, 700, [699, 5], True, 0, False, 8),      # 4 parts: all used, one used
    ("d128g8", 1, 8, 1, 2100, [2099], True, 0, False, 64),       # 33 parts of 64 positions
    ("d64g4", 3, 8, 2, 300, [299, 0, 123], False, 40, True, 12),  # window and sinks
    ("d128g8c192", 2, 8, 1, 1000, [999, 100], True, 0, False, 32),  # parts of >= 192 positions
    ("d128g8", 1, 8, 1, 4200, [4199], True, 0, False, 132),    # 64 parts: two merge levels
    ("d64g4", 1, 8, 2, 3000, [2999], False, 2000, True, 64),   # 32 parts, two levels, sinks
    ("d128g12", 2, 24, 2, 500, [499, 40], True, 0, True, 8),   # 4 padding heads; one part; sinks
    ("d256g8", 2, 16, 2, 300, [299, 130], True, 0, False, 8),
    # inactive slots (pos -1, beside long contexts and one part): zeros, their cache untouched
    ("d128g8", 4, 16, 2, 2100, [-1, 2099, -1, 40], True, 0, False, 64),
    ("d64g4", 3, 8, 2, 300, [-1, 299, -1], False, 40, True, 12),
]


@pytest.mark.parametrize("build,B,nh,hk,L,positions,qk_norm,window,sinks,sms", CASES)
def test_attention_kernel_source_matches_reference_on_cpu(builds, build, B, nh, hk, L, positions,
                                                          qk_norm, window, sinks, sms):
    D, G, min_chunk = BUILDS[build]["D"], BUILDS[build]["G"], BUILDS[build]["MINCHUNK"]
    assert nh == G * hk
    qkv, kc, vc, cos, sin, qn, kn, sk = _inputs(B, nh, hk, D, L, qk_norm, sinks, seed=L + B)
    pos = torch.tensor(positions, dtype=torch.int64)
    NS = parts(B, hk, L, sms, min_chunk)
    scale = D ** -0.5
    out, k, v, count = run_kernel(builds, build, qkv, pos, kc, vc, cos, sin, qn, kn, sk, nh,
                                  hk, window, NS, 1e-6, scale)
    kr, vr = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kr, vr, scale,
                                window, sk)
    check_launch(out, k, v, count, want, kr, vr, pos)


def check_launch(out, k, v, count, want, kr, vr, pos):
    """An emulated launch against the reference's output `want` and cache (kr, vr): the merge
    counters back at zero; each active token's row within ATTN_TOL, an inactive one's zeros over
    the poison; the cache rows the step did not write keep their bits, the new values are the
    reference's and the new keys within one bf16 step."""
    B, L = out.shape[0], k.shape[2]
    assert (count == 0).all(), "the merge counters must be back at zero"
    assert not out.isnan().any()
    for b in range(B):
        if pos[b] < 0:                      # an inactive slot's row: zeros over the poison
            assert (out[b] == 0).all(), b
            continue
        assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
    live = pos >= 0
    written = torch.zeros(B, L, dtype=torch.bool)
    written[torch.arange(B)[live], pos[live]] = True
    for got, exp in ((k, kr), (v, vr)):
        assert torch.equal(got.transpose(1, 2)[~written], exp.transpose(1, 2)[~written])
    assert torch.equal(v.transpose(1, 2)[written], vr.transpose(1, 2)[written])
    new, new_ref = k.transpose(1, 2)[written].float(), kr.transpose(1, 2)[written].float()
    assert ((new - new_ref).abs() <= new_ref.abs() * 2 ** -7 + 1e-30).all()


def test_attention_kernel_partial_rotary_matches_reference_on_cpu(builds):
    """ROT = 64 of D = 128 (GLM-4.5-Air's heads: 96 over 8 KV heads, here 24 over 2): the first
    64 dims of q and k turn (rotate_half pairing c and c + 32), the rest pass; the tables'
    columns past 64 are NaN, so a kernel that read them would write NaN. A full rotary on the
    same tables is far off (the test can fail)."""
    B, nh, hk, L, D, R = 2, 24, 2, 400, 128, 64
    qkv, kc, vc, _, _, _, _, sk = _inputs(B, nh, hk, D, L, False, True, seed=11)
    gen = torch.Generator().manual_seed(12)
    ang = torch.rand(L, R // 2, generator=gen) * 6.3
    nan = torch.full((L, D - R), float("nan"))
    cos = torch.cat([ang.cos(), ang.cos(), nan], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin(), nan], -1).to(torch.bfloat16)
    pos = torch.tensor([399, 17])
    NS = parts(B, hk, L, 8, 64)
    out, k, v, count = run_kernel(builds, "d128g12r64", qkv, pos, kc, vc, cos, sin, None, None,
                                  sk, nh, hk, 0, NS, 1e-6, D ** -0.5)
    kr, vr = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, None, None, 1e-6, cos, sin, pos, kr, vr,
                                D ** -0.5, 0, sk, rotary_dims=R)
    assert (count == 0).all()
    assert not out.isnan().any() and not k.isnan().any()
    for b in range(B):
        assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
    written = k.transpose(1, 2)[torch.arange(B), pos].float()
    exp = kr.transpose(1, 2)[torch.arange(B), pos].float()
    assert ((written - exp).abs() <= exp.abs() * 2 ** -7 + 1e-30).all()
    full = torch.cat([cos[:, :R], cos[:, :R]], -1), torch.cat([sin[:, :R], sin[:, :R]], -1)
    other = ref.attention_decode(qkv, nh, hk, None, None, 1e-6, *full, pos, kc.clone(),
                                 vc.clone(), D ** -0.5, 0, sk)
    assert rel(other[0], want[0]) > 10 * ATTN_TOL


@pytest.mark.parametrize("positions,sms", [
    ([699, 130, 5], 8),          # 3 parts: all used, all used (parts of 64), one
    ([699, -1, 40], 64),         # 11 parts of 64 beside an inactive slot and one part
])
def test_attention_kernel_qwen3_next_matches_reference_on_cpu(builds, positions, sms):
    """Qwen3-Next's heads (16 over 2 KV heads of 256; the first 64 dims turn): qkv rows of
    [(2·nh + 2·hk)·D], each query head's D columns followed by its gate's (QGATE), and q/k norms
    stored as w − 1 (NORM1: x·rs·(1 + w), rounded once). The gate columns are NaN and so are the
    rotary tables' columns past 64: a kernel that read either would write NaN. The reference with
    the other norm is far off on the same inputs (the test can fail)."""
    B, nh, hk, L, D, R = len(positions), 16, 2, 700, 256, 64
    gen = torch.Generator().manual_seed(sum(positions) + sms)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16)  # noqa
    qkv, kc, vc = r(B, (2 * nh + 2 * hk) * D), r(B, hk, L, D), r(B, hk, L, D)
    qkv[:, :2 * nh * D].view(B, nh, 2, D)[:, :, 1] = float("nan")      # the gates
    ang = torch.rand(L, R // 2, generator=gen) * 6.3
    nan = torch.full((L, D - R), float("nan"))
    cos = torch.cat([ang.cos(), ang.cos(), nan], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin(), nan], -1).to(torch.bfloat16)
    qn, kn = r(D, scale=0.3), r(D, scale=0.3)     # w − 1: the norms multiply by 1 + w
    assert (qn != 0).any() and (kn != 0).any()
    pos = torch.tensor(positions)
    NS = parts(B, hk, L, sms, 64)
    out, k, v, count = run_kernel(builds, "d256g8next", qkv, pos, kc, vc, cos, sin, qn, kn, None,
                                  nh, hk, 0, NS, 1e-6, D ** -0.5)
    kr, vr = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kr, vr, D ** -0.5,
                                rotary_dims=R, q_gate=True, one_plus=True)
    other = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kc.clone(),
                                 vc.clone(), D ** -0.5, rotary_dims=R, q_gate=True,
                                 one_plus=False)
    check_launch(out, k, v, count, want, kr, vr, pos)
    assert not k.isnan().any()
    for b in range(B):
        if pos[b] >= 0:
            assert rel(other[b], want[b]) > 10 * ATTN_TOL, (b, rel(other[b], want[b]))


@pytest.mark.parametrize("build,positions,slots,sms", [
    ("d128g8", [699, -1, 5], [3, 0, 4], 8),      # a long and a short context, one inactive
    ("d64g4", [299, 123], [1, 0], 12),           # the slots swapped
])
def test_attention_kernel_slot_map_matches_reference_on_cpu(builds, build, positions, slots,
                                                            sms):
    """A step of fewer tokens than the cache has slots: token b reads and writes slot
    slots[b] alone; every other slot (and an inactive token's) keeps its bits."""
    D, G, min_chunk = BUILDS[build]["D"], BUILDS[build]["G"], BUILDS[build]["MINCHUNK"]
    B, S, hk, L = len(positions), 5, 2, 700
    nh = G * hk
    qkv, kc, vc, cos, sin, qn, kn, _ = _inputs(S, nh, hk, D, L, True, False, seed=7 + B)
    qkv = qkv[:B].contiguous()
    pos, smap = torch.tensor(positions), torch.tensor(slots)
    NS = parts(B, hk, L, sms, min_chunk)
    out, k, v, count = run_kernel(builds, build, qkv, pos, kc, vc, cos, sin, qn, kn, None, nh,
                                  hk, 0, NS, 1e-6, D ** -0.5, slots=smap)
    kr, vr = kc.clone(), vc.clone()
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kr, vr, D ** -0.5,
                                slots=smap)
    assert (count == 0).all()
    for b in range(B):
        if pos[b] < 0:
            assert (out[b] == 0).all(), b
        else:
            assert rel(out[b], want[b]) <= ATTN_TOL, (b, rel(out[b], want[b]))
    live = smap[pos >= 0]
    for c in range(S):
        if c not in live:                     # no token of this slot: its rows keep their bits
            assert torch.equal(k[c], kc[c]) and torch.equal(v[c], vc[c]), c
    for b in range(B):
        if pos[b] >= 0:
            c, P = int(smap[b]), int(pos[b])
            assert torch.equal(v[c, :, P], vr[c, :, P]) and not torch.equal(v[c, :, P], vc[c, :, P])
            others = torch.ones(L, dtype=torch.bool)
            others[P] = False
            assert torch.equal(k[c][:, others], kc[c][:, others])


def test_attention_emulation_sees_a_wrong_merge(builds):
    """The check can fail: a merge that leaves out the last of the parts it sums is far from
    the reference (the kernel's merge bound edited in the copied source)."""
    work, _ = builds
    src = (work / "dense_attention.cu").read_text()
    bad = "if (k0 + k < cnt && g < G) {"
    assert bad in src, f"dense_attention.cu's merge sum changed: update {__file__}"
    (work / "dense_attention.cu").write_text(src.replace(bad, bad.replace("< cnt", "< cnt - 1")))
    exe = work / "wrong_merge"
    try:
        cmd = emu_build.command(work, "attention_main.cpp", BUILDS["d128g8"], exe)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        (work / "dense_attention.cu").write_text(src)
    B, nh, hk, D, L = 1, 16, 2, 128, 700
    qkv, kc, vc, cos, sin, qn, kn, _ = _inputs(B, nh, hk, D, L, True, False, seed=3)
    pos = torch.tensor([L - 1])
    out, *_ = run_kernel((work, {"wrong": exe}), "wrong", qkv, pos, kc, vc, cos, sin, qn, kn,
                         None, nh, hk, 0, parts(B, hk, L, 8), 1e-6, D ** -0.5)
    want = ref.attention_decode(qkv, nh, hk, qn, kn, 1e-6, cos, sin, pos, kc.clone(), vc.clone(),
                                D ** -0.5)
    assert rel(out[0], want[0]) > 10 * ATTN_TOL


def test_emulated_block_is_the_launchers():
    assert THREADS == 128            # attention_main.cpp launches the kernel's own THREADS
