"""Float checkpoints (cupool.checkpoints, format "float"): every published naming of float experts
(Qwen3-MoE, OLMoE, DeepSeek-V3 with dense layers, shared experts and an MTP layer, GLM-4-MoE,
Qwen2-MoE's shared_expert, Mixtral's w1/w3/w2, transformers 5's fused [E, 2I, H], Llama-4's
transposed [E, H, 2I], Qwen3-Next's mtp.*), bf16 / fp16 / fp32: experts read exactly, read_experts
equal to the reference quantizer, dense names / tensors / bytes, config cross-checks, FP8 dense."""

import json

import pytest
import torch
from checkpoint_fixtures import (
    ARCHS,
    deepseek_v3,
    float_experts,
    fp8_dense,
    put_float_experts,
    qwen3_moe,
    same_nvfp4,
    save,
)
from safetensors.torch import load_file

from cupool.checkpoints import (
    CheckpointError,
    ExpertKind,
    FloatCheckpoint,
    open_checkpoint,
    read_experts,
)
from cupool.layout import RowLayout
from cupool.nvfp4 import quantize


def _write(tmp_path, rng, arch_name, dtype=torch.bfloat16, shards=2, style=None, **kw):
    a = ARCHS[arch_name](rng, **kw)
    ex = float_experts(rng, a, dtype)
    t = dict(a.dense)
    put_float_experts(t, a, ex, style=style)
    d = save(tmp_path / arch_name, t, a.config, shards=shards, dtype=dtype)
    return d, a, ex


def _stored(d):
    out = {}
    for f in d.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("arch_name", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_architectures(tmp_path, rng, arch_name, dtype):
    d, a, ex = _write(tmp_path, rng, arch_name, dtype)
    with open_checkpoint(d) as ck:
        assert isinstance(ck, FloatCheckpoint) and ck.format == "float"
        assert ck.moe_layers == a.moe_layers and ck.mtp_layers == sorted(a.mtp)
        assert (ck.num_experts, ck.hidden, ck.intermediate) == (4, 64, 32)
        for layer in ck.moe_layers:
            assert ck.expert_kind(layer) is ExpertKind.FLOAT
            e = ck.experts(layer, 1, 3)
            assert (e.kind, e.layer, e.start, e.stop, e.n) == (ExpertKind.FLOAT, layer, 1, 3, 2)
            for got, want in zip((e.gate, e.up, e.down), ex[layer]):
                assert got.dtype == dtype and torch.equal(got, want[1:3])
            whole = ck.experts(layer)
            assert whole.n == 4 and torch.equal(whole.down, ex[layer][2])
        # dense: everything but routed experts and MTP tensors, as stored
        stored = _stored(d)
        want = set(a.dense) - a.mtp_dense
        assert set(ck.dense_names()) == want
        for name in want:
            assert ck.dense_kind(name) == "plain"
            got = ck.dense_tensor(name, torch.float32)
            assert got.dtype == torch.float32 and torch.equal(got, stored[name].float())
            assert ck.dense_shape(name) == tuple(stored[name].shape)
        assert ck.dense_bytes(torch.bfloat16) == sum(stored[n].numel() * 2 for n in want)
        sizes = ck.expert_sizes()
        L = len(a.moe_layers)
        assert sizes.codes == L * 4 * 3 * 64 * 32 // 2 and sizes.block_scales == L * 4 * 3 * 128
        assert sizes.global_scales == L * 4 * 3 * 4
        assert sizes.row_bytes == RowLayout(64, 32).row_bytes
        assert sizes.store_bytes == L * 4 * -(-sizes.row_bytes // 256) * 256
        assert sizes.checkpoint_bytes == L * 4 * 3 * 64 * 32 * dtype.itemsize
    # read_experts: the reference quantizer's NVFP4 of the stored weights, per expert
    layer = a.moe_layers[-1]
    got = read_experts(d, layer)
    assert len(got) == 4
    for e, mats in enumerate(got):
        for m, w in zip(mats, ex[layer]):
            assert m.packed.dim() == 2 and m.global_scale.shape == ()
            assert same_nvfp4(m, quantize(w[e]))


@pytest.mark.parametrize("arch_name", ["deepseek_v3", "glm4_moe", "qwen3_next"])
def test_mtp_layers_only_when_asked(tmp_path, rng, arch_name):
    d, a, ex = _write(tmp_path, rng, arch_name)
    (mtp_layer,) = a.mtp
    with open_checkpoint(d) as ck:
        assert mtp_layer not in ck.moe_layers and ck.mtp_layers == [mtp_layer]
        assert not set(ck.dense_names()) & a.mtp_dense
        with pytest.raises(CheckpointError, match=rf"layer {mtp_layer} has no routed experts .*"
                                                  rf"MTP layers \[{mtp_layer}\] need include_mtp"):
            ck.experts(mtp_layer, 0, 1)
        with pytest.raises(CheckpointError, match=r"an MTP tensor \(include_mtp=False\)"):
            ck.dense_tensor(min(a.mtp_dense))
    with open_checkpoint(d, include_mtp=True) as ck:
        assert ck.moe_layers == a.moe_layers + [mtp_layer]
        assert set(ck.dense_names()) == set(a.dense)
        e = ck.experts(mtp_layer, 0, 4)
        assert torch.equal(e.gate, ex[mtp_layer][0])
        assert ck.expert_sizes().layers == len(a.moe_layers) + 1
    got = read_experts(d, mtp_layer, include_mtp=True)
    assert same_nvfp4(got[3][1], quantize(ex[mtp_layer][1][3]))


def test_fp32_and_single_file(tmp_path, rng):
    d, _a, ex = _write(tmp_path, rng, "mixtral", torch.float32, shards=1)
    assert (d / "model.safetensors").is_file()
    with open_checkpoint(d) as ck:
        e = ck.experts(1, 0, 4)
        assert e.gate.dtype == torch.float32 and torch.equal(e.up, ex[1][1])
        assert "model.layers.1.block_sparse_moe.gate.weight" in ck.dense_names()
        assert ck.expert_names(0)[0].startswith("model.layers.0.block_sparse_moe.experts.")


def test_fused_views_and_transposed_layout(tmp_path, rng):
    """transformers 5 fused experts: gate = rows [0, I) of gate_up; Llama-4's [E, H, 2I]."""
    d, _a, ex = _write(tmp_path, rng, "qwen3_moe", style="fused")
    stored = _stored(d)
    assert tuple(stored["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 64)
    assert tuple(stored["model.layers.0.mlp.experts.down_proj"].shape) == (4, 64, 32)
    with open_checkpoint(d) as ck:
        e = ck.experts(0, 2, 4)
        assert torch.equal(e.gate, ex[0][0][2:]) and torch.equal(e.up, ex[0][1][2:])
        assert "model.layers.0.mlp.experts.gate_up_proj" not in ck.dense_names()
    d, _a, ex = _write(tmp_path / "l4", rng, "llama4")
    stored = _stored(d)
    gu = stored["language_model.model.layers.1.feed_forward.experts.gate_up_proj"]
    assert tuple(gu.shape) == (4, 64, 64) and torch.equal(gu[:, :, :32].transpose(1, 2), ex[1][0])
    assert tuple(stored["language_model.model.layers.1.feed_forward.experts.down_proj"].shape) \
        == (4, 32, 64)
    with open_checkpoint(d) as ck:
        e = ck.experts(1, 0, 3)
        for got, want in zip((e.gate, e.up, e.down), ex[1]):
            assert torch.equal(got, want[:3]) and got.stride(-1) == 1
        assert "language_model.lm_head.weight" in ck.dense_names()
        assert "vision_model.patch_embedding.linear.weight" in ck.dense_names()


def test_config_cross_checks(tmp_path, rng):
    d, _a, _ = _write(tmp_path, rng, "deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    for key, val, match in (
            ("hidden_size", 96, (r"config.json hidden_size = 96, but the experts of layer 1 "
                                r"\(model.layers.1.mlp.experts\) have H = 64")),
            ("n_routed_experts", 3, (r"model.layers.1.mlp.experts.3.gate_proj.weight is expert 3, "
                                    r"but config.json gives 3 experts")),
            ("n_routed_experts", 6, (r"tensor model.layers.1.mlp.experts.4.gate_proj.weight is "
                                    r"missing: the layer has 4 of 6 experts")),
            ("first_k_dense_replace", 0, (r"first_k_dense_replace=0, moe_layer_freq=1, "
                                         r"num_hidden_layers=3\) makes layers \[0, 1, 2\] MoE "
                                         r"layers, but routed experts are under layers \[1, 2\]: "
                                         r"missing \[0\]"))):
        bad = dict(cfg, **{key: val})
        (d / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=match):
            open_checkpoint(d)
    # a text sub-config gives the values for multimodal checkpoints (Llama-4)
    d, _a, _ = _write(tmp_path / "l4", rng, "llama4")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"text_config.intermediate_size = 64"):
        open_checkpoint(d)


def test_a_missing_moe_layer_is_named(tmp_path, rng):
    a = qwen3_moe(rng, L=3)
    ex = float_experts(rng, a)
    del ex[1]
    t = dict(a.dense)
    put_float_experts(t, a, ex)
    d = save(tmp_path / "c", t, a.config)
    with pytest.raises(CheckpointError, match=r"decoder_sparse_step=1, mlp_only_layers=\[\], "
                                              r"num_hidden_layers=3\) makes layers \[0, 1, 2\] "
                                              r".* missing \[1\], unexpected \[\]"):
        open_checkpoint(d)
    a.config["mlp_only_layers"] = [1]                            # Qwen's way of saying so
    save(tmp_path / "c", t, a.config)
    with open_checkpoint(d) as ck:
        assert ck.moe_layers == [0, 2]


def test_fp8_dense_with_float_experts(tmp_path, rng):
    """quant_method "fp8" (DeepSeek-V3's native form) with float experts: FP8 dense weights with
    block weight_scale_inv (the config's weight_block_size, or 128×128), per-tensor and
    per-channel scales are dequantized; the scales are folded into `.weight`."""
    a = deepseek_v3(rng)
    ex = float_experts(rng, a)
    t = dict(a.dense)
    put_float_experts(t, a, ex)
    big = "model.layers.0.self_attn.kv_b_proj"
    t[f"{big}.weight"] = torch.randn(200, 272) * 0.05            # 2×3 blocks of 128, partial
    want = {big: fp8_dense(t, big, "block", (128, 128), "weight_scale_inv"),
            "model.layers.1.self_attn.q_b_proj": fp8_dense(
                t, "model.layers.1.self_attn.q_b_proj", "block", (32, 16), "weight_scale_inv"),
            "model.layers.0.self_attn.o_proj": fp8_dense(t, "model.layers.0.self_attn.o_proj"),
            "model.layers.2.mlp.shared_experts.down_proj": fp8_dense(
                t, "model.layers.2.mlp.shared_experts.down_proj", "channel")}
    t["model.layers.0.self_attn.k_scale"] = torch.tensor(1.0)    # a KV-cache scale: left out
    cfg = dict(a.config, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [32, 16]})
    d = save(tmp_path / "c", t, cfg)
    with open_checkpoint(d) as ck:
        assert ck.format == "float"
        names = ck.dense_names()
        assert f"{big}.weight" in names and f"{big}.weight_scale_inv" not in names
        assert "model.layers.0.self_attn.o_proj.input_scale" not in names
        assert "model.layers.0.self_attn.k_scale" not in names
        for mod, w in want.items():
            assert ck.dense_kind(f"{mod}.weight") == "fp8"
            got = ck.dense_tensor(f"{mod}.weight", torch.float32)
            assert torch.equal(got, w), mod
        assert ck.dense_tensor(f"{big}.weight").dtype == torch.bfloat16
        assert ck.dense_shape(f"{big}.weight") == (200, 272)


def test_expert_nan_is_named(tmp_path, rng):
    d, a, _ex = _write(tmp_path, rng, "qwen3_moe", shards=1)
    t = _stored(d)
    w = t["model.layers.1.mlp.experts.2.up_proj.weight"].clone()
    w[3, 5] = float("nan")
    t["model.layers.1.mlp.experts.2.up_proj.weight"] = w
    save(d, t, a.config)
    with pytest.raises(CheckpointError, match=r"layer 1, experts \[0, 4\), up: w: 1 non-finite "
                                              r"value\(s\).* at index \(2, 3, 5\)"):
        read_experts(d, 1)


@pytest.mark.parametrize("style", ["per", "fused", "llama4"])
def test_a_window_reads_only_its_experts(tmp_path, rng, monkeypatch, style):
    from cupool.checkpoints import TensorIndex
    arch = "llama4" if style == "llama4" else "qwen3_moe"
    d, _a, ex = _write(tmp_path, rng, arch, style=None if style == "llama4" else style)
    calls = []
    read = TensorIndex.read

    def spy(self, name, start=None, stop=None, *, out=None):
        t = read(self, name, start, stop, out=out)
        calls.append((name, start, stop, t.numel() * t.element_size()))
        return t
    monkeypatch.setattr(TensorIndex, "read", spy)
    with open_checkpoint(d) as ck:
        e = ck.experts(1, 1, 3)
        assert torch.equal(e.down, ex[1][2][1:3])
    assert sum(c[3] for c in calls) == 2 * 3 * 64 * 32 * 2          # 2 experts' bytes, no more
    if style == "per":
        assert all(".experts.1." in c[0] or ".experts.2." in c[0] for c in calls)
    else:
        assert {(c[1], c[2]) for c in calls} == {(1, 3)} and len(calls) == 2
