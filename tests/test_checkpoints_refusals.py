"""What cupool.checkpoints refuses, each with a CheckpointError naming the file or tensor and the
values: FP8 experts without their scales, ModelOpt FP8 experts, int4 AWQ / GPTQ
(config and tensors), gpt-oss MXFP4 tensors in a checkpoint of another quantization, unknown
quant_method / quant_algo, expert biases on part of a layer, missing shards and experts, wrong
dtypes and shapes, layers that disagree, and
implausible NVFP4 scales (NaN / negative block scales; global scales <= 0, NaN, inf; a reciprocal
global scale convention)."""

import json

import pytest
import torch
from checkpoint_fixtures import (
    ct_config_json,
    float_experts,
    modelopt_hf_quant,
    put_ct_experts,
    put_float_experts,
    put_modelopt_experts,
    qwen3_moe,
    reference_nvfp4,
    save,
)
from safetensors.torch import load_file, save_file

from cupool.checkpoints import CheckpointError, open_checkpoint, read_experts
from cupool.checkpoints.base import MAX_IMPLIED_WEIGHT

E, H, I = 4, 64, 32
BASE = "model.layers.0.mlp.experts.1"


def _float_ckpt(tmp_path, rng, **kw):
    a = qwen3_moe(rng, **kw)
    ex = float_experts(rng, a)
    t = dict(a.dense)
    put_float_experts(t, a, ex)
    return a, t, ex


def _edit(d, fn):
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(f))


# --- formats -------------------------------------------------------------------------------------
def test_fp8_experts_without_scales(tmp_path, rng):
    """float8_e4m3fn experts need their weight_scale_inv (or weight_scale) beside them; with one,
    they are read (test_checkpoints_fp8.py)."""
    a, t, _ex = _float_ckpt(tmp_path, rng)
    for k in [k for k in t if ".experts." in k]:
        t[k] = t[k].float().to(torch.float8_e4m3fn)
    cfg = dict(a.config, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                              "quant_method": "fp8",
                                              "weight_block_size": [128, 128]})
    d = save(tmp_path / "ds", t, cfg)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.0.gate_proj: FP8 experts "
                                              r"\(model.layers.0.mlp.experts.0.gate_proj.weight "
                                              r"\(float8_e4m3fn \[32, 64\], model.safetensors\)\) "
                                              r"are not supported here"):
        open_checkpoint(d)


def test_modelopt_fp8(tmp_path, rng):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    for k in [k for k in t if ".experts." in k]:
        w = t.pop(k).float()
        s = w.abs().amax() / 448
        t[k] = (w / s).to(torch.float8_e4m3fn)
        t[k.replace(".weight", ".weight_scale")] = s.reshape(())
        t[k.replace(".weight", ".input_scale")] = torch.tensor(0.1)
    d = save(tmp_path / "fp8", t, a.config, hf_quant_config=modelopt_hf_quant("FP8"))
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: quant_algo 'FP8' quantizes "
                                              r"the experts to FP8, which cupool does not serve"):
        open_checkpoint(d)
    # without the config, the tensors are FP8 experts with per-tensor scales: read as FP8
    # (test_checkpoints_fp8.py), converted to NVFP4 at load
    (d / "hf_quant_config.json").unlink()
    with open_checkpoint(d) as ck:
        assert ck.format == "fp8"


def _int4(t, kind):
    for k in [k for k in t if ".experts." in k]:
        w = t.pop(k)
        n, kk = w.shape
        m = k[:-len(".weight")]
        if kind == "awq":          # AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]
            t[f"{m}.qweight"] = torch.zeros(kk, n // 8, dtype=torch.int32)
            t[f"{m}.qzeros"] = torch.zeros(kk // 32, n // 8, dtype=torch.int32)
            t[f"{m}.scales"] = torch.ones(kk // 32, n, dtype=torch.float16)
        else:                      # GPTQ: qweight [K/8, N], qzeros [K/g, N/8], scales, g_idx [K]
            t[f"{m}.qweight"] = torch.zeros(kk // 8, n, dtype=torch.int32)
            t[f"{m}.qzeros"] = torch.zeros(kk // 32, n // 8, dtype=torch.int32)
            t[f"{m}.scales"] = torch.ones(kk // 32, n, dtype=torch.float16)
            t[f"{m}.g_idx"] = torch.zeros(kk, dtype=torch.int32)


@pytest.mark.parametrize("kind,qc,name", [
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
             "version": "gemm"}, "int4 AWQ"),
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
              "sym": True}, "int4 GPTQ"),
])
def test_int4_awq_gptq(tmp_path, rng, kind, qc, name):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    _int4(t, kind)
    d = save(tmp_path / kind, t, dict(a.config, quantization_config=qc))
    with pytest.raises(CheckpointError, match=rf"config.json quantization_config: quant_method "
                                              rf"'{kind}' \({name}, bits 4, group_size 32\): "
                                              rf"{name} experts \(qweight/qzeros/scales\) are not "
                                              rf"supported"):
        open_checkpoint(d)
    (d / "config.json").write_text(json.dumps(a.config))  # no config: the tensors are refused
    with pytest.raises(CheckpointError, match=r"experts.0.gate_proj: int4 AWQ/GPTQ experts "
                                              r"\(.*qweight \(int32.*qzeros.*scales \(float16"):
        open_checkpoint(d)


def _gpt_oss(tmp_path, rng, *, mxfp4=True):
    """openai/gpt-oss: fused experts with biases; MXFP4 as *_blocks [E, N, K/32, 16] uint8 and
    *_scales [E, N, K/32] uint8 (e8m0)."""
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
           "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 32, "swiglu_limit": 7.0}
    pre = "model.layers.0.mlp"
    t = {"model.embed_tokens.weight": torch.zeros(32, H), "model.norm.weight": torch.ones(H),
         "lm_head.weight": torch.zeros(32, H), f"{pre}.router.weight": torch.zeros(E, H),
         f"{pre}.router.bias": torch.zeros(E),
         f"{pre}.experts.gate_up_proj_bias": torch.zeros(E, 2 * I),
         f"{pre}.experts.down_proj_bias": torch.zeros(E, H)}
    if mxfp4:
        t[f"{pre}.experts.gate_up_proj_blocks"] = torch.zeros(E, 2 * I, H // 32, 16,
                                                              dtype=torch.uint8)
        t[f"{pre}.experts.gate_up_proj_scales"] = torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)
        t[f"{pre}.experts.down_proj_blocks"] = torch.zeros(E, H, I // 32, 16, dtype=torch.uint8)
        t[f"{pre}.experts.down_proj_scales"] = torch.zeros(E, H, I // 32, dtype=torch.uint8)
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    else:
        t[f"{pre}.experts.gate_up_proj"] = torch.zeros(E, 2 * I, H)
        t[f"{pre}.experts.down_proj"] = torch.zeros(E, H, I)
    return save(tmp_path / "oss", t, cfg)


def test_mxfp4_tensors_in_a_checkpoint_of_another_quantization(tmp_path, rng):
    """gpt-oss's *_blocks / *_scales are read by the MXFP4 reader alone (its own tests:
    test_checkpoints_mxfp4.py); a config declaring another quantization does not get them."""
    d = _gpt_oss(tmp_path, rng)
    assert open_checkpoint(d).format == "mxfp4"
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                  "group_size": 16}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.gate_up_proj: MXFP4 "
                                              r"experts \(gpt-oss style .*gate_up_proj_blocks "
                                              r"\(uint8 \[4, 64, 2, 16\].*gate_up_proj_scales "
                                              r"\(uint8 \[4, 64, 2\].*in a modelopt-nvfp4 "
                                              r"checkpoint"):
        open_checkpoint(d)


@pytest.mark.parametrize("drop,there", [("down_proj_bias", "gate_up_proj_bias"),
                                        ("gate_up_proj_bias", "down_proj_bias")])
def test_expert_biases_on_part_of_a_layer(tmp_path, rng, drop, there):
    d = _gpt_oss(tmp_path, rng, mxfp4=False)
    assert open_checkpoint(d).has_bias
    f = d / "model.safetensors"
    tensors = load_file(f)
    del tensors[f"model.layers.0.mlp.experts.{drop}"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"layer 0: tensor model.layers.0.mlp.experts.{drop} "
                                              rf"is missing, but .*{there} \(bfloat16 .* is there"):
        open_checkpoint(d)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"quant_method 'bitsandbytes' is not one cupool serves"),
    ({"quant_method": "hqq"}, r"quant_method 'hqq' is not one cupool serves"),
    ({"bits": 4}, r"no quant_method \(keys: \['bits'\]\)"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP8X"},
     r"quant_algo 'NVFP8X' is not a ModelOpt algorithm cupool knows"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
     r"quant_algo 'W4A8_AWQ': int4 AWQ-style experts"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP4"},
     r"quant_algo 'MXFP4': MXFP4/MXFP8 experts are not yet supported"),
    ({"quant_method": "modelopt", "quant_algo": "INT8_SQ"},
     r"quant_algo 'INT8_SQ': int8 experts are not supported"),
    ({"quant_method": "modelopt"}, r"no quant_algo"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"},
     r"MIXED_PRECISION without a 'quantized_layers' object"),
])
def test_unknown_or_unserved_quantization(tmp_path, rng, qc, match):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    d = save(tmp_path / "c", t, dict(a.config, quantization_config=qc))
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(d)


def test_not_a_checkpoint(tmp_path, rng):
    with pytest.raises(CheckpointError, match=r"no such checkpoint directory"):
        open_checkpoint(tmp_path / "nope")
    a, t, _ex = _float_ckpt(tmp_path, rng)
    d = save(tmp_path / "c", t, a.config)
    with pytest.raises(CheckpointError, match=r"expected a checkpoint directory .* got a file"):
        open_checkpoint(d / "model.safetensors")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config.json"):
        open_checkpoint(d)
    dense = save(tmp_path / "dense", dict(a.dense), a.config)
    with pytest.raises(CheckpointError, match=r"no routed-expert tensors"):
        open_checkpoint(dense)


# --- files, shapes, dtypes ---------------------------------------------------------------------------
def test_missing_shard(tmp_path, rng):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    d = save(tmp_path / "c", t, a.config, shards=4)
    (d / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: shard "
                                              r"'model-00003-of-00004.safetensors' \(holding \d+ "
                                              r"tensors, e.g. '.*'\) does not exist"):
        open_checkpoint(d)


def test_wrong_dtype_and_shape(tmp_path, rng):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    d = save(tmp_path / "c", t, a.config)
    _edit(d, lambda t: t.__setitem__(f"{BASE}.down_proj.weight", t[f"{BASE}.down_proj.weight"]
                                     .to(torch.float16)))
    with pytest.raises(CheckpointError, match=r"experts.1.down_proj.weight \(float16 \[64, 32\].*"
                                              r"expected bfloat16 \[64, 32\] like .*experts.0"
                                              r".gate_proj.weight \(bfloat16 \[32, 64\]"):
        open_checkpoint(d)
    save(d, t, a.config)
    _edit(d, lambda t: t.__setitem__(f"{BASE}.up_proj.weight", t[f"{BASE}.up_proj.weight"][:, :48]))
    with pytest.raises(CheckpointError, match=r"experts.1.up_proj.weight \(bfloat16 \[32, 48\].*"
                                              r"expected bfloat16 \[32, 64\]"):
        open_checkpoint(d)
    save(d, t, a.config)
    _edit(d, lambda t: t.__setitem__(f"{BASE}.gate_proj.weight",
                                     t[f"{BASE}.gate_proj.weight"].to(torch.int8)))
    with pytest.raises(CheckpointError, match=r"experts.1.gate_proj: int8 experts"):
        open_checkpoint(d)


def test_layer_missing_an_expert(tmp_path, rng):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.2.")]:
        del t[k]
    d = save(tmp_path / "c", t, a.config)
    with pytest.raises(CheckpointError, match=r"layer 1: tensor model.layers.1.mlp.experts.2."
                                              r"gate_proj.weight is missing: the layer has 3 of "
                                              r"4 experts \(present: \[0, 1, 3\]\)"):
        open_checkpoint(d)


def test_layers_disagree_on_shapes(tmp_path, rng):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    for e in range(E):
        for p, shape in (("gate_proj", (48, H)), ("up_proj", (48, H)), ("down_proj", (H, 48))):
            t[f"model.layers.1.mlp.experts.{e}.{p}.weight"] = torch.zeros(shape)
    cfg = dict(a.config)
    del cfg["moe_intermediate_size"], cfg["intermediate_size"]
    d = save(tmp_path / "c", t, cfg)
    with pytest.raises(CheckpointError, match=r"layers disagree on their experts' shapes: layer 1 "
                                              r"\(model.layers.1.mlp.experts\) has E=4, H=64, "
                                              r"I=48, layer 0 \(model.layers.0.mlp.experts\) has "
                                              r"E=4, H=64, I=32"):
        open_checkpoint(d)


def test_per_expert_and_fused_in_one_layer(tmp_path, rng):
    a, t, _ex = _float_ckpt(tmp_path, rng)
    t["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(E, 2 * I, H)
    t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(E, H, I)
    d = save(tmp_path / "c", t, a.config)
    with pytest.raises(CheckpointError, match=r"layer 0: experts both per expert .* and fused"):
        open_checkpoint(d)


# --- NVFP4 scales ------------------------------------------------------------------------------------
def _modelopt(tmp_path, rng, style="ep", scale2="half"):
    a = qwen3_moe(rng)
    q = reference_nvfp4(float_experts(rng, a), scale2)
    t = dict(a.dense)
    put_modelopt_experts(t, a, q, style=style, scale2=scale2)
    return save(tmp_path / "mo", t, a.config, hf_quant_config=modelopt_hf_quant()), q


def _set(name, idx, byte=None, value=None):
    def fn(t):
        x = t[name].clone()
        if byte is not None:
            x.view(torch.uint8)[idx] = byte
        else:
            x[idx] = value
        t[name] = x
    return fn


S = f"{BASE}.up_proj.weight_scale"
G = f"{BASE}.up_proj.weight_scale_2"


@pytest.mark.parametrize("edit,match", [
    (_set(S, (3, 1), byte=0x7F), (rf"{S}: block scale nan at \(3, 1\) is NaN; NVFP4 block scales "
                                 rf"are finite and >= 0")),
    (_set(S, (5, 2), byte=0xB8), rf"{S}: block scale -1.0 at \(5, 2\) is negative"),
    (_set(G, (), value=-0.5), rf"{G}: global scale -0.5; NVFP4 global scales are finite and > 0"),
    (_set(G, (), value=float("nan")), rf"{G}: global scale nan"),
    (_set(G, (), value=float("inf")), rf"{G}: global scale inf"),
    (_set(G, (), value=0.0), rf"{G}: global scale 0 with block scales up to 448"),
    (lambda t: t.__setitem__(G, 1 / t[G]),
     (rf"{G}: global scale [\d.e+]+ with block scales up to 448 implies weights up to 6 · 448 · "
     rf"[\d.e+]+ = [\d.e+]+ > 10000, far beyond any trained weight; is weight_scale_2 stored as "
     rf"its reciprocal")),
])
def test_implausible_scales(tmp_path, rng, edit, match):
    d, _q = _modelopt(tmp_path, rng)
    _edit(d, edit)
    with open_checkpoint(d) as ck:              # headers are fine; the values are checked on read
        ck.experts(0, 2, 4)                     # other experts are unaffected
        with pytest.raises(CheckpointError, match=match):
            ck.experts(0, 0, 4)
    with pytest.raises(CheckpointError, match=match):
        read_experts(d, 0)


def test_bound_separates_the_conventions(tmp_path, rng):
    """MAX_IMPLIED_WEIGHT: the largest weight a real (ModelOpt-convention) matrix implies is its
    amax; the reciprocal of a global scale implies 6·448·2688/amax."""
    d, _q = _modelopt(tmp_path, rng)
    with open_checkpoint(d) as ck:
        e = ck.experts(0)
        for m in (e.gate, e.up, e.down):
            implied = 6 * m.block_scale.float().amax(dim=(1, 2)) * m.global_scale
            assert (implied < 1).all()                 # these weights have |w| < 1
            recip = 6 * m.block_scale.float().amax(dim=(1, 2)) / m.global_scale
            assert (recip > MAX_IMPLIED_WEIGHT).all()


def test_all_zero_matrix_is_accepted(tmp_path, rng):
    """An all-zero matrix quantizes to global scale 0 and block scales 0 (cupool.nvfp4.quantize):
    that is consistent, not refused."""
    d, _q = _modelopt(tmp_path, rng)
    from cupool.nvfp4 import quantize
    z = quantize(torch.zeros(H, I, dtype=torch.bfloat16))
    assert float(z.global_scale) == 0

    def fn(t):
        t[f"{BASE}.down_proj.weight"] = z.packed
        t[f"{BASE}.down_proj.weight_scale"] = z.block_scale
        t[f"{BASE}.down_proj.weight_scale_2"] = z.global_scale.reshape(())
    _edit(d, fn)
    with open_checkpoint(d) as ck:
        e = ck.experts(0, 1, 2)
        assert float(e.down.global_scale[0]) == 0 and not e.down.packed.any()


def test_fused_scales_name_the_expert(tmp_path, rng):
    d, _q = _modelopt(tmp_path, rng, style="fused", scale2="expert")
    name = "model.layers.1.mlp.experts.gate_up_proj_weight_scale"
    _edit(d, _set(name, (2, 40, 1), byte=0xFF))
    with open_checkpoint(d) as ck, pytest.raises(
            CheckpointError, match=rf"{name}\[2\] rows \[32, 64\): block scale nan at \(8, 1\)"):
        ck.experts(1, 0, 4)
    d, _q = _modelopt(tmp_path / "g", rng, style="fused", scale2="expert")
    name = "model.layers.0.mlp.experts.down_proj_weight_scale_2"
    _edit(d, _set(name, 3, value=-1.0))
    with open_checkpoint(d) as ck, pytest.raises(
            CheckpointError, match=rf"{name}\[3\]: global scale -1.0"):
        ck.experts(0, 2, 4)


def test_compressed_tensors_non_reciprocal_global(tmp_path, rng):
    """weight_global_scale stored as ModelOpt's weight_scale_2 (not the reciprocal) is caught; a
    zero or negative weight_global_scale is named as such."""
    a = qwen3_moe(rng)
    q = reference_nvfp4(float_experts(rng, a))
    t = dict(a.dense)
    put_ct_experts(t, a, q)
    d = save(tmp_path / "ct", t, ct_config_json(a.config))
    name = f"{BASE}.gate_proj.weight_global_scale"
    _edit(d, lambda t: t.__setitem__(name, 1 / t[name]))
    with open_checkpoint(d) as ck, pytest.raises(
            CheckpointError, match=rf"1 / {name}: global scale .* > 10000, far beyond any trained "
                                   rf"weight; is weight_global_scale stored as ModelOpt's"):
        ck.experts(0, 0, 4)
    _edit(d, lambda t: t.__setitem__(name, torch.zeros(1)))
    with open_checkpoint(d) as ck, pytest.raises(
            CheckpointError, match=rf"{name}: weight_global_scale 0.0; it must be finite and > 0"):
        ck.experts(0, 0, 4)
