"""compressed-tensors nvfp4-pack-quantized checkpoints (format "compressed-tensors-nvfp4"): the
reciprocal global scale, bit-exactness against the ModelOpt reading where the reciprocal is exact
(and ≤ 1 ulp apart where it is not), the `ignore` list with re: patterns (ignored layers float),
NVFP4 / FP8 dense layers, and the formats it refuses."""

import json

import pytest
import torch
from checkpoint_fixtures import (
    ct_config_json,
    float_experts,
    fp8_dense,
    nvfp4_dense,
    put_ct_experts,
    put_float_experts,
    put_modelopt_experts,
    qwen3_moe,
    reference_nvfp4,
    same_nvfp4,
    save,
)
from safetensors.torch import load_file

from cupool.checkpoints import (
    CheckpointError,
    CompressedTensorsCheckpoint,
    ExpertKind,
    open_checkpoint,
    read_experts,
)
from cupool.nvfp4 import NVFP4Tensor, dequantize, e2m1_decode, unpack_codes

PRE = "model.layers.0.mlp.experts.2.gate_proj"


def _write(tmp_path, rng, *, pow2=False, ignore=("lm_head", "re:.*mlp.gate$"), float_layers=(),
           cfg_kw=None, dense=None):
    a = qwen3_moe(rng, L=3)
    ex = float_experts(rng, a)
    if pow2:
        # make each matrix's amax 2688 · 2^-k: its global scale amax / 2688 is a power of two,
        # so 1 / global is exact in float32
        for mats in ex.values():
            for w in mats:
                for e in range(w.shape[0]):
                    amax = 2688 * 2.0 ** -(10 + e)            # 2.625 · 2^-e: exact in bf16
                    w[e] = (torch.rand(w.shape[1:]) * 1.8 - 0.9) * amax
                    w[e, 0, 0] = amax
    q = reference_nvfp4(ex)
    t = dict(a.dense)
    put_ct_experts(t, a, q, layers=[x for x in a.moe_layers if x not in float_layers])
    put_float_experts(t, a, {x: ex[x] for x in float_layers})
    if dense:
        dense(t)
    d = save(tmp_path / "ct", t, ct_config_json(a.config, ignore=list(ignore), **(cfg_kw or {})))
    return d, a, ex, q


def test_reads_as_modelopt_convention(tmp_path, rng):
    d, _a, _ex, q = _write(tmp_path, rng)
    stored = load_file(str(d / "model.safetensors"))
    assert stored[f"{PRE}.weight_packed"].dtype == torch.uint8
    assert stored[f"{PRE}.weight_scale"].dtype == torch.float8_e4m3fn
    assert tuple(stored[f"{PRE}.weight_global_scale"].shape) == (1,)
    with open_checkpoint(d) as ck:
        assert isinstance(ck, CompressedTensorsCheckpoint)
        assert ck.format == "compressed-tensors-nvfp4"
        for layer in ck.moe_layers:
            e = ck.experts(layer, 0, 4)
            for got, want in zip((e.gate, e.up, e.down), q[layer]):
                assert torch.equal(got.packed, want.packed)                  # passed through
                assert torch.equal(got.block_scale.view(torch.uint8),
                                   want.block_scale.view(torch.uint8))
                gs = torch.ones(4) / want.global_scale                      # what was stored
                assert torch.equal(got.global_scale, torch.ones(4) / gs)    # 1 / stored, exactly
                ulp = torch.nextafter(want.global_scale, torch.full_like(gs, 1)) \
                    - want.global_scale
                assert ((got.global_scale - want.global_scale).abs() <= ulp).all()


def test_bit_exact_where_the_reciprocal_is_exact(tmp_path, rng):
    """Global scales that are powers of two: reading equals the ModelOpt reading bit for bit, and
    dequantizing equals compressed-tensors' own x · (weight_scale / weight_global_scale)."""
    d, a, _ex, q = _write(tmp_path, rng, pow2=True)
    mo = tmp_path / "mo"
    t = dict(a.dense)
    put_modelopt_experts(t, a, q)
    save(mo, t, a.config, hf_quant_config={"quantization": {"quant_algo": "NVFP4"}})
    stored = load_file(str(d / "model.safetensors"))
    with open_checkpoint(d) as ck, open_checkpoint(mo) as ref:
        for layer in ck.moe_layers:
            got, want = ck.experts(layer, 0, 4), ref.experts(layer, 0, 4)
            for g, w in zip((got.gate, got.up, got.down), (want.gate, want.up, want.down)):
                assert same_nvfp4(g, w)
                assert torch.equal(dequantize(g), dequantize(w))
        # compressed-tensors' dequantization of one module, by its formula
        e = ck.experts(0, 2, 3).gate
        assert e.global_scale[0] == 2.0 ** -12
        vals = e2m1_decode(unpack_codes(stored[f"{PRE}.weight_packed"]))          # [32, 64]
        s = stored[f"{PRE}.weight_scale"].float() / stored[f"{PRE}.weight_global_scale"]
        ct = (vals.reshape(32, 4, 16) * s[..., None]).reshape(32, 64)
        assert torch.equal(dequantize(e[0]), ct)
    assert same_nvfp4(read_experts(d, 1)[3][2], q[1][2][3])


def test_ignored_layers_are_float(tmp_path, rng):
    d, _a, ex, q = _write(tmp_path, rng, float_layers=(1,),
                         ignore=("lm_head", "re:.*mlp.gate$", r"re:model\.layers\.1\.mlp\..*"))
    with open_checkpoint(d) as ck:
        assert [ck.expert_kind(i) for i in ck.moe_layers] == \
            [ExpertKind.NVFP4, ExpertKind.FLOAT, ExpertKind.NVFP4]
        assert torch.equal(ck.experts(1, 1, 3).up, ex[1][1][1:3])
        assert same_nvfp4(ck.experts(2, 1, 3).up, _ct_ref(q[2][1][1:3]))
    assert same_nvfp4(read_experts(d, 1)[2][0], q[1][0][2])   # float layer: the reference quantizer
    # an ignored module whose tensors are quantized contradicts the config
    d, _a, ex, q = _write(tmp_path / "bad", rng, ignore=("lm_head", r"re:.*experts\.3\..*"))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.3.gate_proj: .*ignore "
                                              r"entry 're:\.\*experts.*' declares it float, but "
                                              r"its tensors are nvfp4"):
        open_checkpoint(d)


def _ct_ref(w: NVFP4Tensor) -> NVFP4Tensor:
    """What reading a compressed-tensors copy of `w` gives: global 1 / (1 / g)."""
    gs = torch.ones_like(w.global_scale) / w.global_scale
    return NVFP4Tensor(w.packed, w.block_scale, torch.ones_like(gs) / gs)


def _dense(t):
    _dense.want = {
        "model.layers.0.self_attn.q_proj": nvfp4_dense(t, "model.layers.0.self_attn.q_proj", ct=True),
        "model.layers.1.self_attn.o_proj": fp8_dense(t, "model.layers.1.self_attn.o_proj",
                                                     "channel")}


def test_dense_nvfp4_and_fp8(tmp_path, rng):
    fp8_group = {"targets": ["re:.*o_proj$"], "format": "float-quantized",
                 "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                             "symmetric": True, "dynamic": False}}
    d, _a, _ex, _q = _write(tmp_path, rng, dense=_dense)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["format"] = "mixed-precision"
    qc["config_groups"]["group_1"] = fp8_group
    (d / "config.json").write_text(json.dumps(cfg))
    with open_checkpoint(d) as ck:
        names = ck.dense_names()
        assert "model.layers.0.self_attn.q_proj.weight" in names
        assert not any(n.endswith(("weight_packed", "weight_global_scale", "input_global_scale",
                                   "weight_scale", "input_scale")) for n in names)
        for mod, want in _dense.want.items():
            assert torch.equal(ck.dense_tensor(f"{mod}.weight", torch.float32), want), mod
        assert ck.dense_kind("model.layers.0.self_attn.q_proj.weight") == "nvfp4"
        assert ck.dense_shape("model.layers.0.self_attn.q_proj.weight") == (64, 64)


@pytest.mark.parametrize("edit,match", [
    (lambda qc: qc.update(format="float-quantized"),
     r"format 'float-quantized': FP8 experts are not supported"),
    (lambda qc: qc.update(format="pack-quantized"),
     r"format 'pack-quantized': int4 experts are not supported"),
    (lambda qc: qc.update(format="mxfp4-pack-quantized"),
     r"format 'mxfp4-pack-quantized': MXFP4 experts are not yet supported"),
    (lambda qc: qc.update(format="sparse-bitmask"), r"format 'sparse-bitmask' is not one cupool"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=32),
     r"config_groups\['group_0'\].weights: \{'group_size': 32\} but nvfp4-pack-quantized is"),
    (lambda qc: qc.update(config_groups={}), r"no config_groups"),
    (lambda qc: (qc.update(format="mixed-precision"),
                 qc["config_groups"]["group_0"].update(format="pack-quantized")),
     r"no nvfp4-pack-quantized group"),
])
def test_config_refusals(tmp_path, rng, edit, match):
    d, _a, _ex, _q = _write(tmp_path, rng)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(d)


def test_tensor_refusals(tmp_path, rng):
    d, _a, _ex, q = _write(tmp_path, rng)
    t = load_file(str(d / "model.safetensors"))
    t[f"{PRE}.weight_packed"] = torch.zeros(32, 8, dtype=torch.int32)
    from safetensors.torch import save_file
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts.2.gate_proj: int4 compressed-tensors "
                                              r"pack-quantized experts \(.*int32 \[32, 8\]"):
        open_checkpoint(d)
    t[f"{PRE}.weight_packed"] = q[0][0].packed[2]
    del t[f"{PRE}.weight_global_scale"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"is not NVFP4 \(needs weight_global_scale"):
        open_checkpoint(d)
