"""gpt-oss checkpoints: MXFP4 (openai/gpt-oss-20b's *_blocks / *_scales) converted to NVFP4 at
load, and bf16 (gate/up interleaved along 2I), both with expert biases.

The reference is the format's definition, written here independently of the reader
(`checkpoint_fixtures.dequantize_mxfp4`: e2m1 · 2^(s − 127)): exact blocks must dequantize to
the same float32 bits; blocks more than 17 exponents below their matrix's largest are
requantized onto the E2M1 grid (round to nearest, ties to even, hand-computed codes here),
counted and reported through the `cupool` logger. Also: the exactness rule on hand-made
scales, NaN scales, wrong shapes and dtypes, missing biases, the bf16 layout against
transformers' GptOssExperts, fill_store rows (biases included), `cupool plan` with biases, and
from_pretrained's CPU steps on a gpt-oss MXFP4 checkpoint (the pool itself needs a GPU:
test_gpu_pretrained.py)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from checkpoint_fixtures import (
    dequantize_mxfp4,
    float_experts,
    gpt_oss,
    gpt_oss_biases,
    gpt_oss_model_mxfp4,
    hf_gpt_oss,
    llama4,
    mxfp4_config_json,
    mxfp4_copy,
    mxfp4_experts,
    put_float_experts,
    put_gpt_oss_float_experts,
    put_mxfp4_experts,
    qwen3_moe,
    save,
    set_gpt_oss_experts,
)
from safetensors.torch import load_file, save_file

from cupool.checkpoints import (
    CheckpointError,
    ExpertKind,
    Mxfp4Checkpoint,
    fill_store,
    mxfp4_exactness,
    open_checkpoint,
)
from cupool.checkpoints.mxfp4 import codes_nonzero, to_nvfp4, top_exponents
from cupool.layout import RowLayout, pack_row, unpack_bias, unpack_row
from cupool.nvfp4 import dequantize, quantize, unpack_codes
from cupool.store import HostStore

PRE = "model.layers.{l}.mlp.experts"
DIMS = [(64, 64), (96, 160)]            # H, I: powers of two and not (rows padded to 64)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def _mxfp4(tmp_path, rng, H=64, I=64, L=2, E=4, exponents=(118, 127), *, config=True,
           mutate=None, edit_mx=None, not_convert=None):
    a = gpt_oss(rng, L=L, E=E, H=H, I=I)
    mx = mxfp4_experts(rng, a, exponents)
    if edit_mx is not None:
        edit_mx(mx)
    b = gpt_oss_biases(rng, a)
    t = dict(a.dense)
    put_mxfp4_experts(t, a, mx, b)
    if mutate is not None:
        mutate(t)
    cfg = a.config
    if config:
        cfg = mxfp4_config_json(cfg) if not_convert is None else \
            mxfp4_config_json(cfg, not_convert)
    return save(tmp_path / "mxfp4", t, cfg), a, mx, b


def _top(blocks, scales):
    """Per matrix, the largest exponent of a block with a nonzero code (-1: none), from numpy."""
    b, s = blocks.numpy(), scales.numpy().astype(np.int64)
    nz = ((b & 0x77) != 0).any(axis=-1)
    return np.where(nz, s, -1).reshape(s.shape[0], -1).max(axis=1)


# --- opening -------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [True, False])
def test_opens_as_mxfp4_with_biases(tmp_path, rng, config):
    d, _a, _mx, _b = _mxfp4(tmp_path, rng, H=96, I=160, config=config)
    with open_checkpoint(d) as ck:
        assert isinstance(ck, Mxfp4Checkpoint) and ck.format == "mxfp4"
        assert (ck.moe_layers, ck.num_experts, ck.hidden, ck.intermediate) == ([0, 1], 4, 96, 160)
        assert ck.has_bias and ck.expert_kind(0) is ExpertKind.NVFP4
        pre = PRE.format(l=0)
        assert sorted(ck.expert_names(0)) == sorted(
            f"{pre}.{p}_{leaf}" for p in ("gate_up_proj", "down_proj")
            for leaf in ("blocks", "scales", "bias"))
        dense = ck.dense_names()
        for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                     "model.layers.0.mlp.router.weight", "model.layers.0.self_attn.o_proj.bias"):
            assert name in dense
        assert not [n for n in dense if ".experts." in n]
        sizes = ck.expert_sizes()
        layout = RowLayout(96, 160, bias=True)
        assert sizes.row_bytes == layout.row_bytes > RowLayout(96, 160).row_bytes
        assert sizes.biases == 2 * 4 * (2 * 160 + 96) * 4
        assert sizes.store_bytes == 2 * 4 * layout.row_stride


# --- the format ----------------------------------------------------------------------------------
def test_exactness_on_the_formats_definition():
    s = torch.tensor([[[127, 110, 109, 200]],           # top 127: 110 = top − 17 exact, 109 not
                      [[5, 250, 3, 7]],                 # top from nonzero blocks only: 7
                      [[254, 0, 9, 1]]], dtype=torch.uint8)   # all zero: every block exact
    nz = torch.tensor([[[True, True, True, False]],
                       [[True, False, True, True]],
                       [[False, False, False, False]]])
    assert top_exponents(s, nz).tolist() == [127, 7, -1]
    assert mxfp4_exactness(s, nz).tolist() == [[[True, True, False, True]],
                                                [[True, True, True, True]],
                                                [[True, True, True, True]]]
    # a batch against a brute-force reading of the rule, matrix by matrix
    g = torch.Generator().manual_seed(3)
    s = torch.randint(90, 140, (3, 5, 4), generator=g, dtype=torch.uint8)
    nz = torch.rand(3, 5, 4, generator=g) < 0.7
    got = mxfp4_exactness(s, nz)
    for m in range(3):
        top = max((int(v) for v, z in zip(s[m].flatten(), nz[m].flatten()) if z), default=-1)
        for i in range(5):
            for j in range(4):
                assert bool(got[m, i, j]) == (not nz[m, i, j] or int(s[m, i, j]) >= top - 17)
    with pytest.raises(ValueError, match="codes_nonzero: expected bool"):
        mxfp4_exactness(s, nz.int())


def test_codes_nonzero_ignores_signed_zero():
    b = torch.zeros(1, 3, 16, dtype=torch.uint8)
    b[0, 1, 5] = 0x88                                  # -0, -0
    b[0, 2, 15] = 0x10                                 # high nibble 0.5
    assert codes_nonzero(b[None]).tolist() == [[[False, False, True]]]


def _force_span(mx, lo=110, hi=127):
    """Every matrix gets a nonzero block at exponent hi and one at lo (a span of exactly 17)."""
    for gb, gs, db, ds in mx.values():
        for b, s in ((gb, gs), (db, ds)):
            b[:, :, 0, 0] = 0x77
            s[:, :, 0] = hi
            b[:, :, 1, 0] = 0x31
            s[:, :, 1] = lo


def _zero_matrix(mx):
    """Layer 0, expert 1: an all-zero down matrix (±0 codes, any exponents)."""
    db = mx[0][2]
    db[1] = torch.where(db[1] & 0x08 > 0, 0x88, 0x08).to(torch.uint8)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("H,I", DIMS)
def test_exact_conversion_is_the_mxfp4_value_bit_for_bit(tmp_path, rng, H, I, window):
    def edit(mx):
        _force_span(mx)
        _zero_matrix(mx)

    d, _a, mx, b = _mxfp4(tmp_path, rng, H=H, I=I, exponents=(110, 127), edit_mx=edit)
    with open_checkpoint(d) as ck:
        total = 0
        for layer in ck.moe_layers:
            gb, gs, db, ds = mx[layer]
            ref_gu, ref_dn = dequantize_mxfp4(gb, gs), dequantize_mxfp4(db, ds)
            w = window or 4
            for lo in range(0, 4, w):
                hi = min(4, lo + w)
                ex = ck.experts(layer, lo, hi)
                assert ex.kind is ExpertKind.NVFP4
                for q, ref, blocks, scales in (
                        (ex.gate, ref_gu[lo:hi, 0::2], gb[lo:hi, 0::2], gs[lo:hi, 0::2]),
                        (ex.up, ref_gu[lo:hi, 1::2], gb[lo:hi, 1::2], gs[lo:hi, 1::2]),
                        (ex.down, ref_dn[lo:hi], db[lo:hi], ds[lo:hi])):
                    n, N = blocks.shape[:2]
                    assert torch.equal(q.packed, blocks.reshape(n, N, -1))      # codes as stored
                    assert torch.equal(_bits(dequantize(q)), _bits(ref))       # signed zeros too
                    top = _top(blocks, scales)
                    want_g = [0.0 if t < 0 else 2.0 ** (int(t) - 135) for t in top]
                    assert q.global_scale.tolist() == want_g
                gu_b, dn_b = b[layer]
                assert torch.equal(ex.bias[0], gu_b[lo:hi, 0::2])
                assert torch.equal(ex.bias[1], gu_b[lo:hi, 1::2])
                assert torch.equal(ex.bias[2], dn_b[lo:hi])
                assert all(x.dtype == torch.float32 for x in ex.bias)
            total += gs.numel() + ds.numel()
        assert ck.conversion.blocks == total and ck.conversion.lossy == []
        z = ck.experts(0, 1, 2).down                                    # the all-zero matrix
        assert float(z.global_scale[0]) == 0.0 and not z.block_scale.float().any()


def _lossy_block_codes():
    """Codes of a block at exponent top − 18 (each value halves on the requantized grid) and the
    E2M1 codes they must become: round to nearest, ties to the even code, sign kept."""
    orig = list(range(16)) * 2
    become = {0: 0, 1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 6: 4, 7: 5,     # .5→.25→0, 1.5→.75→1 (ties)
              8: 8, 9: 8, 10: 9, 11: 10, 12: 10, 13: 11, 14: 12, 15: 13}
    codes = torch.tensor(orig, dtype=torch.uint8)
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed, torch.tensor([become[c] for c in orig], dtype=torch.uint8)


def _with_lossy(mx):
    """Layer 0, expert 1, gate row 0 (stored row 0): block 0 nonzero at 127 (the top), block 1
    at 109 = top − 18 with every code, block 2 at 90 (all of it rounds to ±0)."""
    gb, gs = mx[0][0], mx[0][1]
    gs[1].clamp_(max=127)
    gb[1, 0, 0] = 0x77
    gs[1, 0, 0] = 127
    gb[1, 0, 1], _ = _lossy_block_codes()
    gs[1, 0, 1] = 109
    gb[1, 0, 2] = torch.tensor([0x7F] * 16, dtype=torch.uint8)
    gs[1, 0, 2] = 90


def test_lossy_blocks_are_requantized_counted_and_bounded(tmp_path, rng):
    d, _a, mx, _b = _mxfp4(tmp_path, rng, H=96, exponents=(118, 127), edit_mx=_with_lossy)
    gb, gs = mx[0][0], mx[0][1]
    gate_b, gate_s = gb[:, 0::2], gs[:, 0::2]
    exact = mxfp4_exactness(gate_s, codes_nonzero(gate_b))
    assert (~exact).nonzero().tolist() == [[1, 0, 1], [1, 0, 2]]
    with open_checkpoint(d) as ck:
        q = ck.experts(0).gate
        assert float(q.global_scale[1]) == 2.0 ** (127 - 135)
        codes = unpack_codes(q.packed[1, 0])
        _, want = _lossy_block_codes()
        assert torch.equal(codes[32:64], want)
        assert not (codes[64:96] & 0x7).any() and torch.equal(codes[64:96] & 0x8,
                                                               unpack_codes(gb[1, 0, 2]) & 0x8)
        assert q.block_scale[1, 0, 2:6].view(torch.uint8).tolist() == [1, 1, 1, 1]
        got, ref = dequantize(q).double(), dequantize_mxfp4(gate_b, gate_s)
        err = (got - ref).abs()
        lossy = torch.zeros_like(err, dtype=torch.bool)
        lossy[1, 0, 32:96] = True
        assert torch.equal(_bits(got[~lossy]), _bits(ref[~lossy]))      # the rest stays exact
        assert float(err.max()) == 2.0 ** -19              # the ties: half a grid step of 2^-17
        # nearest: no E2M1 value times 2^(top − 144) is closer to any requantized value
        grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64) * 2.0 ** -17
        nearest = (ref[1, 0, 32:96].abs()[:, None] - grid).abs().min(dim=1).values
        assert torch.equal(err[1, 0, 32:96], nearest)
        t = ck.conversion
        assert t.lossy_blocks == 2 and len(t.lossy) == 1
        m = t.lossy[0]
        assert m.tensor == f"{PRE.format(l=0)}.gate_up_proj_blocks[1] rows 0::2 (gate)"
        assert (m.blocks, m.max_abs_error) == (2, 2.0 ** -19)


def test_fill_reports_its_conversion_through_the_logger(tmp_path, rng, caplog):
    d, _a, mx, _b = _mxfp4(tmp_path, rng, H=96, exponents=(118, 127), edit_mx=_with_lossy)
    blocks = sum(t.numel() for gb, gs, db, ds in mx.values() for t in (gs, ds))
    layout = RowLayout(96, 64, bias=True)
    with open_checkpoint(d) as ck:
        ck.experts(0)                          # read before: the fill reports its own reading
        store = HostStore(2, 4, layout.row_bytes, pinned=False)
        with caplog.at_level(logging.INFO, logger="cupool"):
            fill_store(store, ck, layout, window=3, progress=False)
        layer0 = mx[0][1].numel() + mx[0][3].numel()
        assert ck.conversion.blocks == blocks + layer0          # the running tally has both
        assert ck.conversion.lossy_blocks == 4
    recs = [r for r in caplog.records if r.name == "cupool" and "MXFP4" in r.getMessage()]
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    assert recs[0].getMessage() == (
        f"cupool: MXFP4 → NVFP4: {blocks - 2} of {blocks} blocks exact; 2 blocks "
        f"({PRE.format(l=0)}.gate_up_proj_blocks[1] rows 0::2 (gate): 2) requantized, max abs "
        f"error 1.91e-06")


def test_an_exact_fill_logs_at_info(tmp_path, rng, caplog):
    d, _a, mx, _b = _mxfp4(tmp_path, rng, exponents=(110, 127))
    blocks = sum(t.numel() for gb, gs, db, ds in mx.values() for t in (gs, ds))
    layout = RowLayout(64, 64, bias=True)
    with caplog.at_level(logging.INFO, logger="cupool"):
        fill_store(HostStore(2, 4, layout.row_bytes, pinned=False), d, layout, progress=False)
    recs = [r for r in caplog.records if "MXFP4" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in recs] == [
        (logging.INFO, (f"cupool: MXFP4 → NVFP4: {blocks} of {blocks} blocks exact; 0 blocks "
                        f"requantized"))]


def test_nan_scales_are_refused_with_the_tensor_and_index(tmp_path, rng):
    def edit(mx):
        mx[1][1][2, 5, 1] = 255
    d, _a, _mx, _b = _mxfp4(tmp_path, rng, edit_mx=edit)
    name = f"{PRE.format(l=1)}.gate_up_proj_scales"
    with open_checkpoint(d) as ck:
        ck.experts(1, 0, 2)                                             # the NaN is not in there
        for lo in (0, 2):
            with pytest.raises(CheckpointError, match=rf"{name}: E8M0 scale 255 \(NaN\) at "
                                                      rf"\[2, 5, 1\] \(1 such block"):
                ck.experts(1, lo, 4)
    with pytest.raises(ValueError, match=r"scales: E8M0 255 \(NaN\) at \[0, 0, 0\]"):
        to_nvfp4(torch.zeros(1, 1, 1, 16, dtype=torch.uint8), torch.full((1, 1, 1), 255,
                                                                         dtype=torch.uint8))


def _set(name, fn):
    def mutate(t):
        key = f"{PRE.format(l=0)}.{name}"
        out = fn(t[key])
        if out is None:
            del t[key]
        else:
            t[key] = out
    return mutate


@pytest.mark.parametrize("mutate,match", [
    (_set("gate_up_proj_blocks", lambda x: x.to(torch.int8)),
     r"gate_up_proj_blocks \(int8 \[4, 128, 2, 16\].*expected uint8 \[E, N, K/32, 16\]"),
    (_set("gate_up_proj_blocks", lambda x: x.reshape(4, 128, 4, 8)),
     r"gate_up_proj_blocks \(uint8 \[4, 128, 4, 8\].*expected uint8 \[E, N, K/32, 16\]"),
    (_set("gate_up_proj_scales", lambda x: x.float()),
     r"gate_up_proj_scales \(bfloat16 \[4, 128, 2\].*expected uint8 E8M0 scales \[4, 128, 2\]"),
    (_set("down_proj_scales", lambda x: x[:, :, :1].contiguous()),
     r"down_proj_scales \(uint8 \[4, 64, 1\].*expected uint8 E8M0 scales \[4, 64, 2\]"),
    (lambda t: [_set("down_proj_blocks", lambda x: x[:, :, :1].contiguous())(t),
                _set("down_proj_scales", lambda x: x[:, :, :1].contiguous())(t)],
     (r"holds \[E, 128, 64\] weights and .*down_proj_blocks .* \[E, 64, 32\]; expected "
      r"\[E, 2I, H\]")),
    (lambda t: [_set("down_proj_blocks", lambda x: x[:3].contiguous())(t),
                _set("down_proj_scales", lambda x: x[:3].contiguous())(t),
                _set("down_proj_bias", lambda x: x[:3].contiguous())(t)],
     r"hold 4 and 3 experts; config.json gives 4"),
    (_set("gate_up_proj_bias", lambda x: x[:, :64].contiguous()),
     r"gate_up_proj_bias \(bfloat16 \[4, 64\].*expected a bf16/fp16/fp32 bias \[4, 128\]"),
    (_set("down_proj_bias", lambda x: x.to(torch.int32)),
     r"down_proj_bias \(int32 \[4, 64\].*expected a bf16/fp16/fp32 bias \[4, 64\]"),
    (_set("down_proj_bias", lambda x: None),
     (r"layer 0: tensor model.layers.0.mlp.experts.down_proj_bias is missing, but "
      r".*gate_up_proj_bias \(bfloat16 \[4, 128\].* is there")),
    (_set("gate_up_proj_scales", lambda x: None),
     r"layer 0: tensor model.layers.0.mlp.experts.gate_up_proj_scales is missing"),
    (lambda t: t.update({f"{PRE.format(l=0)}.gate_up_proj": torch.zeros(4, 64, 128)}),
     r"gate_up_proj \(bfloat16 \[4, 64, 128\].* beside the MXFP4 .*gate_up_proj_blocks"),
    (lambda t: [_set("gate_up_proj_bias", lambda x: None)(t),
                _set("down_proj_bias", lambda x: None)(t)],
     (r"layers disagree on expert biases: layer 1 \(model.layers.1.mlp.experts\) has them, "
      r"layer 0 \(model.layers.0.mlp.experts\) has none")),
])
def test_wrong_tensors_are_named(tmp_path, rng, mutate, match):
    d, _a, _mx, _b = _mxfp4(tmp_path, rng, mutate=mutate)
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(d)


def test_experts_kept_in_bf16_by_the_config_must_be_bf16(tmp_path, rng):
    d, _a, _mx, _b = _mxfp4(tmp_path, rng, not_convert=["model.layers.*.mlp.experts", "lm_head"])
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.gate_up_proj: .*"
                                              r"modules_to_not_convert pattern "
                                              r"'model.layers.\*.mlp.experts' keeps it in bf16, "
                                              r"but its tensors are MXFP4"):
        open_checkpoint(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = "lm_head"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"modules_to_not_convert = 'lm_head': expected a "
                                              r"list"):
        open_checkpoint(d)


def test_nonfinite_biases_are_named_when_read(tmp_path, rng):
    def mutate(t):
        t[f"{PRE.format(l=0)}.gate_up_proj_bias"][1, 7] = float("nan")
    d, _a, _mx, _b = _mxfp4(tmp_path, rng, mutate=mutate)
    with open_checkpoint(d) as ck:
        ck.experts(0, 2, 4)
        with pytest.raises(CheckpointError, match=r"gate_up_proj_bias: bias nan at \[1, 7\]"):
            ck.experts(0, 0, 2)


# --- bf16 gpt-oss --------------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [True, False])
def test_bf16_gpt_oss_takes_interleaved_gate_and_up_apart(tmp_path, rng, transposed):
    a = gpt_oss(rng, E=4, H=64, I=96)
    ex_in = float_experts(rng, a, include_mtp=False)
    b = gpt_oss_biases(rng, a)
    t = dict(a.dense)
    put_gpt_oss_float_experts(t, a, ex_in, b, transposed=transposed)
    stored = {k: v for k, v in t.items() if ".experts." in k}
    d = save(tmp_path / "bf16", t, a.config)
    with open_checkpoint(d) as ck:
        assert ck.format == "float" and ck.has_bias
        for layer in ck.moe_layers:
            pre = PRE.format(l=layer)
            gu = stored[f"{pre}.gate_up_proj"]
            gu = gu.transpose(1, 2) if transposed else gu               # [E, 2I, H]
            ex = ck.experts(layer, 1, 3)
            assert torch.equal(ex.gate, gu[1:3, ::2]) and torch.equal(ex.up, gu[1:3, 1::2])
            bias = stored[f"{pre}.gate_up_proj_bias"]
            assert torch.equal(ex.bias[0], bias[1:3, ::2]) and torch.equal(ex.bias[1],
                                                                         bias[1:3, 1::2])
            assert torch.equal(ex.bias[2], stored[f"{pre}.down_proj_bias"][1:3])
    if transposed:
        _matches_gpt_oss_experts(d, stored)


def _matches_gpt_oss_experts(d, stored):
    """transformers' GptOssExperts on the stored tensors computes what the reader's gate, up,
    down and biases compute under gpt-oss's activation."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from cupool.activation import swiglu_clamp
    cfg = AutoConfig.from_pretrained(d)
    cfg._experts_implementation = "eager"
    module = GptOssExperts(cfg).float()
    pre = PRE.format(l=0)
    with torch.no_grad():
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(module, n).copy_(stored[f"{pre}.{n}"].float())
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    # the module's own alpha and limit: transformers >= 5.24 takes them from the config
    # (swiglu_alpha, swiglu_limit), earlier releases fix them in the module
    act = swiglu_clamp(module.alpha, module.limit)
    with open_checkpoint(d) as ck:
        ex = ck.experts(0)
        for e in range(ex.n):
            want = module(x, torch.full((5, 1), e), torch.ones(5, 1))
            h = act(x @ ex.gate[e].float().T + ex.bias[0][e],
                    x @ ex.up[e].float().T + ex.bias[1][e])
            torch.testing.assert_close(h @ ex.down[e].float().T + ex.bias[2][e], want,
                                       rtol=1e-5, atol=1e-5)


def test_nvfp4_fused_gpt_oss_rows_are_interleaved_too(tmp_path, rng):
    """The one rule covers every fused gate_up of a gpt-oss checkpoint: ModelOpt NVFP4 rows
    (packed codes, block scales; global scales per expert and half) are taken apart the same."""
    from checkpoint_fixtures import interleave, modelopt_hf_quant, same_nvfp4
    a = gpt_oss(rng, E=4, H=64, I=96)
    ex_in = float_experts(rng, a, include_mtp=False)
    t = dict(a.dense)
    want = {}
    for layer, (g, u, dn) in ex_in.items():
        qg, qu, qd = quantize(g), quantize(u), quantize(dn)
        want[layer] = (qg, qu, qd)
        pre = PRE.format(l=layer)
        t[f"{pre}.gate_up_proj"] = interleave(qg.packed, qu.packed)
        t[f"{pre}.gate_up_proj_weight_scale"] = interleave(qg.block_scale, qu.block_scale)
        t[f"{pre}.gate_up_proj_weight_scale_2"] = torch.stack([qg.global_scale, qu.global_scale], 1)
        t[f"{pre}.down_proj"] = qd.packed
        t[f"{pre}.down_proj_weight_scale"] = qd.block_scale
        t[f"{pre}.down_proj_weight_scale_2"] = qd.global_scale
    d = save(tmp_path / "nvfp4", t, a.config, hf_quant_config=modelopt_hf_quant())
    with open_checkpoint(d) as ck:
        assert ck.format == "modelopt-nvfp4" and not ck.has_bias
        for layer in ck.moe_layers:
            ex = ck.experts(layer, 1, 4)
            for got, q in zip((ex.gate, ex.up, ex.down), want[layer]):
                assert same_nvfp4(got, q[1:4])


def test_transposed_concatenated_experts_of_other_families_stay_gate_first(tmp_path, rng):
    a = llama4(rng, E=4, H=64, I=32)
    ex_in = float_experts(rng, a)
    t = dict(a.dense)
    put_float_experts(t, a, ex_in)                     # [E, H, 2I], gate columns first
    with open_checkpoint(save(tmp_path / "l4", t, a.config)) as ck:
        assert not ck.has_bias
        ex = ck.experts(0)
        assert ex.bias is None
        assert torch.equal(ex.gate, ex_in[0][0]) and torch.equal(ex.up, ex_in[0][1])
        assert torch.equal(ex.down, ex_in[0][2])


def test_per_expert_biases(tmp_path, rng):
    """`experts.<e>.<proj>.bias` on every projection: read like the fused ones; on part of the
    layer: refused, naming the missing tensor and one that is there."""
    a = qwen3_moe(rng, L=2, E=4, H=64, I=32)
    ex_in = float_experts(rng, a)
    t = dict(a.dense)
    put_float_experts(t, a, ex_in)
    want = {}
    for layer in a.moe_layers:
        for e in range(4):
            for proj, n in zip(("gate_proj", "up_proj", "down_proj"), (32, 32, 64)):
                b = torch.randn(n, generator=torch.Generator().manual_seed(layer * 9 + e))
                want[layer, e, proj] = b.to(torch.bfloat16).float()
                t[f"{PRE.format(l=layer)}.{e}.{proj}.bias"] = want[layer, e, proj]
    with open_checkpoint(save(tmp_path / "per", t, a.config)) as ck:
        assert ck.has_bias
        ex = ck.experts(1, 1, 3)
        for i, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            assert torch.equal(ex.bias[i], torch.stack([want[1, e, proj] for e in (1, 2)]))
    del t[f"{PRE.format(l=0)}.2.down_proj.bias"]
    with pytest.raises(CheckpointError, match=r"layer 0: tensor model.layers.0.mlp.experts.2."
                                              r"down_proj.bias is missing, but "
                                              r"model.layers.0.mlp.experts.0.gate_proj.bias is "
                                              r"there"):
        open_checkpoint(save(tmp_path / "part", t, a.config))
    t[f"{PRE.format(l=0)}.2.down_proj.bias"] = torch.zeros(32)
    with pytest.raises(CheckpointError, match=r"experts.2.down_proj.bias \(bfloat16 \[32\].*"
                                              r"expected a bf16/fp16/fp32 bias \[64\]"):
        open_checkpoint(save(tmp_path / "shape", t, a.config))


# --- fill_store ----------------------------------------------------------------------------------
@pytest.mark.parametrize("H,I", DIMS)
def test_rows_carry_the_converted_experts_and_the_biases(tmp_path, rng, H, I):
    d, _a, mx, b = _mxfp4(tmp_path, rng, H=H, I=I, exponents=(110, 127), edit_mx=_force_span)
    layout = RowLayout(H, I, bias=True)
    store = HostStore(2, 4, layout.row_bytes, pinned=False)
    fill_store(store, d, layout, window=3, progress=False)
    for layer in (0, 1):
        gb, gs, db, ds = mx[layer]
        ref_gu, ref_dn = dequantize_mxfp4(gb, gs), dequantize_mxfp4(db, ds)
        for e in range(4):
            row = store.row(layer, e)
            g, u, dn = unpack_row(layout, row)
            assert torch.equal(_bits(dequantize(g)), _bits(ref_gu[e, 0::2]))
            assert torch.equal(_bits(dequantize(u)), _bits(ref_gu[e, 1::2]))
            assert torch.equal(_bits(dequantize(dn)), _bits(ref_dn[e]))
            bg, bu, bd = unpack_bias(layout, row)
            assert torch.equal(bg, b[layer][0][e, 0::2]) and torch.equal(bu, b[layer][0][e, 1::2])
            assert torch.equal(bd, b[layer][1][e])


def test_bf16_gpt_oss_rows(tmp_path, rng):
    a = gpt_oss(rng, E=4, H=64, I=96)
    ex_in = float_experts(rng, a, include_mtp=False)
    b = gpt_oss_biases(rng, a)
    t = dict(a.dense)
    put_gpt_oss_float_experts(t, a, ex_in, b)
    d = save(tmp_path / "bf16", t, a.config)
    layout = RowLayout(64, 96, bias=True)
    store = HostStore(2, 4, layout.row_bytes, pinned=False)
    fill_store(store, d, layout, window=2, progress=False)
    for layer in (0, 1):
        g, u, dn = ex_in[layer]
        for e in range(4):
            bias = (b[layer][0][e, 0::2], b[layer][0][e, 1::2], b[layer][1][e])
            want = pack_row(layout, quantize(g[e]), quantize(u[e]), quantize(dn[e]), bias=bias)
            np.testing.assert_array_equal(store.row(layer, e), want.numpy())


def test_a_layout_that_disagrees_on_biases_is_refused_before_any_row(tmp_path, rng):
    writes = []

    class Spy(HostStore):
        def write_row(self, layer, expert, data):
            writes.append((layer, expert))
            super().write_row(layer, expert, data)

    d, _a, _mx, _b = _mxfp4(tmp_path / "oss", rng)
    plain = RowLayout(64, 64)
    with pytest.raises(CheckpointError, match=r"layout has bias=False but the experts of .* have "
                                              r"biases \(has_bias=True\): their rows need "
                                              r"RowLayout\(64, 64, bias=True\)"):
        fill_store(Spy(2, 4, plain.row_bytes, pinned=False), d, plain, progress=False)
    a = qwen3_moe(rng, L=2, E=4, H=64, I=32)
    t = dict(a.dense)
    put_float_experts(t, a, float_experts(rng, a))
    q = save(tmp_path / "qwen", t, a.config)
    biased = RowLayout(64, 32, bias=True)
    with pytest.raises(CheckpointError, match=r"layout has bias=True but the experts of .* have "
                                              r"no biases \(has_bias=False\)"):
        fill_store(Spy(2, 4, biased.row_bytes, pinned=False), q, biased, progress=False)
    assert writes == []


# --- cupool plan ---------------------------------------------------------------------------------
def test_plan_counts_rows_with_biases(tmp_path, rng, capsys):
    pytest.importorskip("transformers")
    from cupool import __main__ as cli
    from cupool.store import fmt_bytes
    d, _a, _mx, _b = _mxfp4(tmp_path, rng, H=96, I=160)
    rc = cli.main(["plan", "--model", str(d), "--budget", "1GiB", "--context", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    layout = RowLayout(96, 160, bias=True)
    assert "model        gpt_oss, checkpoint mxfp4: 2 MoE layers of 4 experts (top-4)" in out
    assert f"(2 x 4 rows of {fmt_bytes(layout.row_bytes)}, NVFP4 + biases)" in out
    assert fmt_bytes(2 * 4 * layout.row_stride) in out
    assert "4 rows per layer (100% of the experts" in out


# --- from_pretrained's CPU steps -----------------------------------------------------------------
def _hf_mxfp4(tmp_path, rng):
    """(model, checkpoint dir): a transformers gpt-oss model whose experts are the dequantized
    MXFP4 experts of the checkpoint written from it."""
    model = hf_gpt_oss(seed=11)
    mx = gpt_oss_model_mxfp4(rng, model)
    set_gpt_oss_experts(model, mx)
    model.save_pretrained(tmp_path / "bf16")
    return model, mxfp4_copy(tmp_path / "bf16", tmp_path / "mxfp4", mx)


def test_from_pretrained_steps_on_a_gpt_oss_mxfp4_checkpoint(tmp_path, rng):
    pytest.importorskip("transformers")
    from cupool import pretrained as P
    from cupool.adapters import find_moe_layers
    ref, d = _hf_mxfp4(tmp_path, rng)
    ckpt = open_checkpoint(d)
    try:
        assert ckpt.format == "mxfp4" and ckpt.has_bias
        _, model = P.skeleton(d, torch.bfloat16)
        assert not hasattr(model.config, "quantization_config")
        specs = find_moe_layers(model)
        assert all(s.bias for s in specs)
        layers = P.match_layers(specs, ckpt)
        mapping = P.dense_plan(model, specs, ckpt)
        for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                     "model.layers.1.self_attn.o_proj.bias"):
            assert mapping[name] == name
        assert not [n for n in mapping if ".experts." in n]
        for s in specs:
            s.release()
        P.load_dense(model, mapping, ckpt, "cpu")
        for spec, layer in zip(specs, layers):                 # experts back from the checkpoint
            ex = ckpt.experts(layer)
            g, u, dn = (dequantize(q) for q in ex.nvfp4())
            spec.restore([(g[e], u[e], dn[e]) for e in range(ex.n)], "cpu", ex.bias)
    finally:
        ckpt.close()
    want = dict(ref.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name
    ids = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_from_pretrained_refuses_experts_without_the_biases_the_model_has(tmp_path, rng):
    pytest.importorskip("transformers")
    from cupool import pretrained as P
    from cupool.adapters import find_moe_layers
    _, d = _hf_mxfp4(tmp_path, rng)
    f = d / "model.safetensors"
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith("_proj_bias")]:
        del tensors[name]
    save_file(tensors, f, metadata={"format": "pt"})
    with open_checkpoint(d) as ckpt:
        assert not ckpt.has_bias
        _, model = P.skeleton(d, torch.bfloat16)
        with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts: the model's "
                                                  r"experts have biases \(bias=True\), the "
                                                  r"checkpoint's .* have none"):
            P.match_layers(find_moe_layers(model), ckpt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the pool gets built")
def test_from_pretrained_reaches_the_gpu_step(tmp_path, rng):
    """Without a GPU, loading a gpt-oss MXFP4 checkpoint gets through every header step and stops
    where the pool's planning needs CUDA."""
    pytest.importorskip("transformers")
    from cupool import pretrained as P
    from cupool._cuda import NoGPUError
    _, d = _hf_mxfp4(tmp_path, rng)
    with pytest.raises(NoGPUError, match="needs a CUDA GPU"):
        P.from_pretrained(d, rows=4, progress=False)
