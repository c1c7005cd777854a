"""ModelOpt NVFP4 checkpoints (cupool.checkpoints.modelopt, format "modelopt-nvfp4"): every config
form (hf_quant_config.json nested and flat, config.json quantization_config, MIXED_PRECISION),
both per-expert name orders, fused 3-D exports (per-expert, per-half and shared global scales;
Llama-4's transposed [E, H/2, 2I] packing), Mixtral spelling, MTP heads, NVFP4 / FP8 dense layers,
exclusions; bit-exact against the reference NVFP4 of the same weights; and every guard the old
cupool.modelopt reader had."""

import json

import pytest
import torch
from checkpoint_fixtures import (
    float_experts,
    fp8_dense,
    llama4,
    mixtral,
    modelopt_config_json,
    modelopt_hf_quant,
    nvfp4_dense,
    put_float_experts,
    put_modelopt_experts,
    qwen3_moe,
    qwen3_next,
    reference_nvfp4,
    same_nvfp4,
    save,
)
from safetensors.torch import load_file

from cupool.checkpoints import (
    CheckpointError,
    ExpertKind,
    ModelOptCheckpoint,
    open_checkpoint,
    read_experts,
)
from cupool.checkpoints.modelopt import read_quant_config

BASE = "model.layers.0.mlp.experts.1"


def _write(tmp_path, rng, arch=qwen3_moe, *, style="ep", scale2="half", config="hf_quant",
           shards=1, algo="NVFP4", dense=None, **kw):
    a = arch(rng, **kw)
    q = reference_nvfp4(float_experts(rng, a), scale2)
    t = dict(a.dense)
    put_modelopt_experts(t, a, q, style=style, scale2=scale2)
    if dense:
        dense(t)
    cfg = a.config
    hq = None
    if config in ("hf_quant", "both"):
        hq = modelopt_hf_quant(algo)
    if config == "flat":
        hq = modelopt_hf_quant(algo, flat=True)
    if config in ("config_json", "both"):
        cfg = modelopt_config_json(cfg, algo)
    d = save(tmp_path / "ck", t, cfg, shards=shards, hf_quant_config=hq)
    return d, a, q


def _check_all(d, a, q, layers=None):
    with open_checkpoint(d) as ck:
        assert isinstance(ck, ModelOptCheckpoint) and ck.format == "modelopt-nvfp4"
        for layer in layers or a.moe_layers:
            assert ck.expert_kind(layer) is ExpertKind.NVFP4
            e = ck.experts(layer, 1, 4)
            for got, want in zip((e.gate, e.up, e.down), q[layer]):
                assert same_nvfp4(got, want[1:4])
    for layer in layers or a.moe_layers:
        got = read_experts(d, layer)
        for ex, mats in enumerate(got):
            for m, want in zip(mats, q[layer]):
                assert m.global_scale.shape == () and same_nvfp4(m, want[ex])


@pytest.mark.parametrize("config", ["hf_quant", "flat", "config_json", "both"])
@pytest.mark.parametrize("style", ["ep", "pe"])
def test_per_expert_exports(tmp_path, rng, config, style):
    d, a, q = _write(tmp_path, rng, style=style, config=config, shards=3)
    _check_all(d, a, q)
    stored = {}
    for f in d.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    name = f"{BASE}.gate_proj" if style == "ep" else "model.layers.0.mlp.experts.gate_proj.1"
    assert stored[f"{name}.weight"].dtype == torch.uint8
    assert tuple(stored[f"{name}.weight"].shape) == (32, 32)
    assert stored[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
    assert tuple(stored[f"{name}.weight_scale"].shape) == (32, 4)
    assert stored[f"{name}.weight_scale_2"].dtype == torch.float32
    assert stored[f"{name}.weight_scale_2"].shape == ()


@pytest.mark.parametrize("style,scale2", [("fused", "expert"), ("fused", "half"),
                                          ("fused", "shared"), ("fused_t", "expert"),
                                          ("fused_t", "shared")])
def test_fused_exports(tmp_path, rng, style, scale2):
    arch = llama4 if style == "fused_t" else qwen3_moe
    d, a, q = _write(tmp_path, rng, arch, style=style, scale2=scale2, shards=2)
    pre = a.prefix(0)
    with open_checkpoint(d) as ck:
        gu = ck.index[f"{pre}.gate_up_proj"]
        # which axis is packed: [E, 2I, H/2] (K = H last) or Llama-4's [E, H/2, 2I] (K along dim 1)
        assert gu.shape == ((4, 64, 32) if style == "fused" else (4, 32, 64))
        assert ck.index[f"{pre}.gate_up_proj_weight_scale"].shape == \
            ((4, 64, 4) if style == "fused" else (4, 4, 64))
        assert ck.index[f"{pre}.down_proj"].shape == ((4, 64, 16) if style == "fused"
                                                      else (4, 16, 64))
        assert not any("gate_up_proj" in n for n in ck.dense_names())
    _check_all(d, a, q)


def test_mixtral_spelling_and_exclusions(tmp_path, rng):
    """exclude_modules keeps a layer's experts float: that layer reads as float, the rest NVFP4;
    excluded modules whose tensors are NVFP4 are refused."""
    a = mixtral(rng, L=3)
    ex = float_experts(rng, a)
    q = reference_nvfp4(ex)
    t = dict(a.dense)
    put_modelopt_experts(t, a, {k: v for k, v in q.items() if k != 1})
    put_float_experts(t, a, {1: ex[1]})
    hq = modelopt_hf_quant(exclude=["lm_head", "*block_sparse_moe.gate",
                                    "model.layers.1.block_sparse_moe.experts*"])
    d = save(tmp_path / "c", t, a.config, hf_quant_config=hq)
    with open_checkpoint(d) as ck:
        assert [ck.expert_kind(i) for i in ck.moe_layers] == \
            [ExpertKind.NVFP4, ExpertKind.FLOAT, ExpertKind.NVFP4]
        assert torch.equal(ck.experts(1, 0, 2).gate, ex[1][0][:2])
        assert same_nvfp4(ck.experts(2, 0, 2).down, q[2][2][:2])
    assert same_nvfp4(read_experts(d, 1)[3][0], reference_nvfp4({1: ex[1]})[1][0][3])
    hq["quantization"]["exclude_modules"].append("model.layers.2.block_sparse_moe.experts.*")
    save(d, t, a.config, hf_quant_config=hq)
    with pytest.raises(CheckpointError, match=r"model.layers.2.block_sparse_moe.experts.0.w1: "
                                              r".*hf_quant_config.json exclude pattern "
                                              r"'model.layers.2.block_sparse_moe.experts.\*' "
                                              r"declares it float, but its tensors are nvfp4"):
        open_checkpoint(d)


def test_mtp_head_is_ignored_unless_asked(tmp_path, rng):
    d, _a, q = _write(tmp_path, rng, qwen3_next, shards=2)
    with open_checkpoint(d) as ck:
        assert ck.moe_layers == [0, 1] and ck.mtp_layers == [2]
        assert not any(n.startswith("mtp.") for n in ck.dense_names())
    with open_checkpoint(d, include_mtp=True) as ck:
        assert ck.moe_layers == [0, 1, 2]
        assert "mtp.fc.weight" in ck.dense_names()
        e = ck.experts(2, 0, 4)
        assert same_nvfp4(e.up, q[2][1])


def _mixed_dense(t):
    """FP8 attention (ModelOpt FP8 per tensor), an NVFP4 dense MLP-ish Linear, KV-cache scales."""
    _mixed_dense.want = {
        "model.layers.0.self_attn.q_proj": fp8_dense(t, "model.layers.0.self_attn.q_proj"),
        "model.layers.1.self_attn.o_proj": nvfp4_dense(t, "model.layers.1.self_attn.o_proj"),
        "model.layers.1.self_attn.v_proj": fp8_dense(t, "model.layers.1.self_attn.v_proj",
                                                     "block", (128, 128), "weight_scale_inv")}
    t["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    t["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(1.0)


def test_mixed_precision_dense_fp8_and_nvfp4(tmp_path, rng):
    layers = {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
              "model.layers.1.self_attn.o_proj": {"quant_algo": "NVFP4", "group_size": 16},
              "model.layers.*.mlp.experts.*": {"quant_algo": "NVFP4", "group_size": 16}}
    d, a, q = _write(tmp_path, rng, dense=_mixed_dense, config="none")
    (d / "hf_quant_config.json").write_text(json.dumps(modelopt_hf_quant(
        "MIXED_PRECISION", quantized_layers=layers, kv_cache_quant_algo="FP8")))
    _check_all(d, a, q)
    with open_checkpoint(d) as ck:
        names = ck.dense_names()
        assert not any(n.endswith(("weight_scale", "weight_scale_2", "input_scale", "k_scale",
                                   "v_scale", "weight_scale_inv")) for n in names)
        for mod, want in _mixed_dense.want.items():
            assert f"{mod}.weight" in names
            assert torch.equal(ck.dense_tensor(f"{mod}.weight", torch.float32), want), mod
        assert ck.dense_kind("model.layers.1.self_attn.o_proj.weight") == "nvfp4"
        assert ck.dense_shape("model.layers.1.self_attn.o_proj.weight") == (64, 64)
        assert ck.dense_kind("model.layers.0.self_attn.q_proj.weight") == "fp8"
        assert ck.dense_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    # keys naming experts otherwise: dotted parts of the name, exact module names
    for key in ("mlp.experts", "experts.1.gate_proj", f"{BASE}.down_proj"):
        hq = modelopt_hf_quant("MIXED_PRECISION", quantized_layers={key: {"quant_algo": "FP8"}})
        (d / "hf_quant_config.json").write_text(json.dumps(hq))
        with pytest.raises(CheckpointError, match=rf"quantized_layers\['{key}'\] \('FP8'\) "
                                                  rf"declares it FP8, but its tensors are nvfp4"):
            open_checkpoint(d)
    hq = modelopt_hf_quant("MIXED_PRECISION", quantized_layers={
        f"{BASE}.up_proj": {"quant_algo": "NVFP4", "group_size": 32}})
    (d / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match=r"quantized_layers\['model.layers.0.mlp.experts.1"
                                              r".up_proj'\]: group_size is 32"):
        open_checkpoint(d)


def test_no_quantization_config_is_recognised_from_tensors(tmp_path, rng):
    d, a, q = _write(tmp_path, rng, config="none")
    assert not (d / "hf_quant_config.json").exists()
    _check_all(d, a, q)


def test_config_variants(tmp_path, rng):
    d, a, _q = _write(tmp_path, rng)
    hq = d / "hf_quant_config.json"
    assert read_quant_config(d).quant_algo == "NVFP4"
    hq.write_text(json.dumps({"producer": {}, "quantization": {"quant_algo": "NVFP4",
                                                                "group_size": 32}}))
    with pytest.raises(CheckpointError, match=r"group_size is 32; NVFP4 block scales cover 16"):
        open_checkpoint(d)
    hq.write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(CheckpointError, match=r"no 'quantization' object and no top-level "
                                              r"quant_algo"):
        open_checkpoint(d)
    hq.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: not readable JSON"):
        open_checkpoint(d)
    hq.write_text(json.dumps(modelopt_hf_quant("W4A16_NVFP4")))
    assert open_checkpoint(d).format == "modelopt-nvfp4"
    hq.write_text(json.dumps(modelopt_hf_quant("NVFP4")))
    cfg = modelopt_config_json(a.config, "FP8")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"quant_algo 'FP8' quantizes the experts to FP8"):
        open_checkpoint(d)
    cfg = modelopt_config_json(a.config, "nvfp4", weights={"group_size": 16})
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_quant_config(d).quant_algo == "NVFP4"
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json is ModelOpt's, but .* has "
                                              r"quant_method 'compressed-tensors'"):
        open_checkpoint(d)
    hq.unlink()
    cfg = modelopt_config_json(a.config, "NVFP4")
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_quant_config(d).source.endswith("config.json quantization_config")
    with open_checkpoint(d) as ck:
        assert ck.format == "modelopt-nvfp4"


# --- guards kept from cupool.modelopt --------------------------------------------------------------
def _rewrite(d, fn):
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in t.items()}, str(f))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.__setitem__(f"{BASE}.gate_proj.weight", t[f"{BASE}.gate_proj.weight"][:, :-8]),
     r"gate_proj.weight \(uint8 \[32, 24\].*expected uint8 \[32, 32\]"),
    (lambda t: t.__setitem__(f"{BASE}.gate_proj.weight_scale",
                             t[f"{BASE}.gate_proj.weight_scale"][:-1]),
     r"gate_proj.weight_scale \(float8_e4m3fn \[31, 4\].*expected float8_e4m3fn \[32, 4\]"),
    (lambda t: t.__setitem__(f"{BASE}.down_proj.weight", torch.zeros(64, 8, dtype=torch.uint8)),
     r"down_proj.weight \(uint8 \[64, 8\].*expected uint8 \[64, 16\]"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight", torch.zeros(32, 64, dtype=torch.bfloat16)),
     r"layer 0: experts of different kinds, e.g. .*experts.1.up_proj float"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight_scale",
                             t[f"{BASE}.up_proj.weight_scale"].view(torch.uint8)),
     r"up_proj.weight_scale \(uint8 \[32, 4\].*expected float8_e4m3fn"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight_scale_2", torch.ones(2)),
     r"up_proj.weight_scale_2 \(float32 \[2\].*expected a float32 scalar"),
    (lambda t: t.__setitem__(f"{BASE}.up_proj.weight_scale_2", torch.ones((), dtype=torch.float16)),
     r"up_proj.weight_scale_2 \(float16 \[\].*expected a float32 scalar"),
    (lambda t: t.pop(f"{BASE}.up_proj.weight_scale"),
     r"experts.1.up_proj: .*uint8 \[32, 32\].* is packed NVFP4 but \['weight_scale'\] is missing"),
    (lambda t: [t.pop(k) for k in [k for k in t if k.startswith(f"{BASE}.down_proj.")]],
     r"tensor model.layers.0.mlp.experts.1.down_proj.weight is missing: the layer has 4 of 4"),
])
def test_wrong_shapes_and_dtypes_are_named(tmp_path, rng, edit, match):
    d, _a, _q = _write(tmp_path, rng)
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(d)


def test_scale_2_of_shape_one_and_no_input_scale(tmp_path, rng):
    d, a, q = _write(tmp_path, rng)

    def edit(t):
        for k in [k for k in t if k.endswith("input_scale")]:
            del t[k]
        t[f"{BASE}.up_proj.weight_scale_2"] = t[f"{BASE}.up_proj.weight_scale_2"].reshape(1)
    _rewrite(d, edit)
    _check_all(d, a, q)
