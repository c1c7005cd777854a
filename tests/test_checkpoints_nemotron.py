"""Nemotron-H checkpoints as NVIDIA publishes them (tests/checkpoint_fixtures.nemotron_release):
bf16, ModelOpt NVFP4 (the Nano release: routed and shared experts and most Mamba projections
NVFP4, KV-cache scales) and ModelOpt MIXED_PRECISION (the Super / Lightning form: W4A16_NVFP4
experts, FP8 Mamba projections, here with a latent MoE). The reader finds the non-gated experts
(`backbone.layers.{l}.mixer.experts.{e}.up_proj` / `down_proj`, no gate), the MoE layers from
hybrid_override_pattern or layers_block_type, the router with its float32 score-correction bias
and the shared experts as dense tensors; the store rows it fills equal the reference's rows
(bit for bit for NVFP4) and compute, through the float reference, what transformers' experts
compute with the dequantized weights; from_pretrained's CPU steps give transformers' own logits
for the same weights, on both transformers releases; from_pretrained gets to the pool (on a
machine without a GPU, to the first thing that needs one)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from checkpoint_fixtures import (
    float_experts,
    nemotron_h,
    nemotron_release,
    put_float_experts,
    put_modelopt_experts,
    reference_nvfp4,
    same_nvfp4,
    save,
)

from cupool import nvfp4
from cupool.checkpoints import (
    CheckpointError,
    ExpertKind,
    fill_store,
    open_checkpoint,
    read_experts,
)
from cupool.layout import RowLayout, pack_row, unpack_row
from cupool.store import HostStore

pytest.importorskip("transformers")

from cupool import pretrained as P  # noqa: E402
from cupool.activation import RELU2  # noqa: E402
from cupool.adapters import find_moe_layers  # noqa: E402
from cupool.reference.moe import reference_moe  # noqa: E402

# (fmt, moe_latent_size, config gives layers_block_type instead of hybrid_override_pattern)
CASES = [("bf16", None, False), ("nvfp4", None, False), ("mixed", 32, True)]
IDS = [c[0] for c in CASES]


def _release(tmp_path, rng, case):
    fmt, latent, layer_list = case
    return nemotron_release(tmp_path, rng, fmt, latent=latent, layer_list=layer_list)


def _stored(d) -> dict:
    from safetensors import safe_open
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_published_names_read_as_experts_without_a_gate(tmp_path, rng, case):
    fmt, latent, _ = case
    d, twin, a, q = _release(tmp_path, rng, case)
    E, H, I = 8, latent or 64, 32
    stored = _stored(d)
    with open_checkpoint(d) as ck:
        assert ck.format == ("float" if fmt == "bf16" else "modelopt-nvfp4")
        assert ck.gated is False and ck.has_bias is False
        assert ck.moe_layers == a.moe_layers == [1, 4]
        assert (ck.num_experts, ck.hidden, ck.intermediate) == (E, H, I)
        kind = ExpertKind.FLOAT if fmt == "bf16" else ExpertKind.NVFP4
        for layer in ck.moe_layers:
            assert ck.expert_kind(layer) is kind
            names = ck.expert_names(layer)
            assert all(f"backbone.layers.{layer}.mixer.experts." in n for n in names)
            assert not any("gate" in n for n in names)
            ex = ck.experts(layer, 2, 7)
            assert ex.gate is None and ex.n == 5
            if fmt == "bf16":
                for proj, got in (("up_proj", ex.up), ("down_proj", ex.down)):
                    want = torch.stack([stored[f"backbone.layers.{layer}.mixer.experts.{e}."
                                               f"{proj}.weight"] for e in range(2, 7)])
                    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
            else:
                assert same_nvfp4(ex.up, q[layer][1][2:7]) and same_nvfp4(ex.down, q[layer][2][2:7])
            trios = read_experts(ck, layer)
            assert len(trios) == E and all(t[0] is None for t in trios)
            assert same_nvfp4(trios[5][1], q[layer][1][5])
            assert same_nvfp4(trios[5][2], q[layer][2][5])
        dense = ck.dense_names()
        for layer in ck.moe_layers:
            m = f"backbone.layers.{layer}.mixer"
            assert ck.dense_kind(f"{m}.gate.weight") == "plain"
            bias = f"{m}.gate.e_score_correction_bias"
            assert stored[bias].dtype == torch.float32
            assert torch.equal(ck.dense_tensor(bias, torch.float32), stored[bias])
            want = "nvfp4" if fmt == "nvfp4" else "plain"
            assert ck.dense_kind(f"{m}.shared_experts.up_proj.weight") == want
            if latent:
                assert ck.dense_shape(f"{m}.fc1_latent_proj.weight") == (latent, 64)
        mamba = {"bf16": "plain", "nvfp4": "nvfp4", "mixed": "fp8"}[fmt]
        assert ck.dense_kind("backbone.layers.0.mixer.in_proj.weight") == mamba
        # the Mamba layer that feeds the attention layer stays bf16 in the NVFP4 release
        assert ck.dense_kind("backbone.layers.2.mixer.out_proj.weight") == \
            ("plain" if fmt == "nvfp4" else mamba)
        assert not any(n.endswith(("k_scale", "v_scale", "input_scale")) for n in dense)
        twin_t = _stored(twin)
        for n in dense:                     # the release's dense tensors are the twin's
            assert torch.equal(ck.dense_tensor(n, torch.float32), twin_t[n].float()), n
        sizes = ck.expert_sizes()
        layout = RowLayout(H, I, gated=False)
        assert sizes.codes == 2 * E * 2 * H * I // 2             # 2 layers, 2 matrices each
        assert sizes.block_scales == 2 * E * 2 * H * I // 16
        assert sizes.global_scales == 2 * E * 2 * 4 and sizes.biases == 0
        assert sizes.row_bytes == layout.row_bytes < RowLayout(H, I).row_bytes
        assert sizes.store_bytes == 2 * E * layout.row_stride


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rows_equal_the_reference_rows(tmp_path, rng, case, window):
    """Rows filled from the release equal pack_row of the reference NVFP4 (the stored NVFP4 bit
    for bit; bf16 experts by the reference quantizer); unpacked and dequantized they are the
    twin's expert weights, and the float reference on them computes what transformers'
    NemotronHExperts computes with those weights."""
    fmt, latent, _ = case
    d, twin, a, q = _release(tmp_path, rng, case)
    H, I, E = latent or 64, 32, 8
    layout = RowLayout(H, I, gated=False)
    store = HostStore(2, E, layout.row_bytes, pinned=False)
    fill_store(store, d, layout, window=window, progress=False)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    specs = find_moe_layers(ref)
    assert [s.name for s in specs] == [f"model.layers.{i}.mixer.experts" for i in (1, 4)]
    gen = torch.Generator().manual_seed(5)
    for li, (layer, spec) in enumerate(zip(a.moe_layers, specs)):
        assert not spec.gated and spec.activation == RELU2 and spec.hidden == H
        deq = []
        for e in range(E):
            row = torch.from_numpy(store.row(li, e).copy())
            assert torch.equal(row, pack_row(layout, None, q[layer][1][e], q[layer][2][e])), \
                (layer, e)
            g, up, down = unpack_row(layout, row)
            assert g is None
            deq.append((None, nvfp4.dequantize(up, torch.float32),
                        nvfp4.dequantize(down, torch.float32)))
            if fmt != "bf16":              # the twin holds the dequantized release exactly
                _, tu, td = spec.expert(e)
                assert torch.equal(deq[e][1], tu) and torch.equal(deq[e][2], td), (layer, e)
        if fmt == "bf16":                  # the reference's weights: the rows' (NVFP4 of bf16)
            spec.restore(deq)
        T, K = 7, spec.top_k
        x = torch.randn(T, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=gen)
        with torch.no_grad():
            want = spec.module(x, ids, w)
        got = reference_moe(x, ids, w, deq, activation=RELU2)
        # float32 both: only the summation order differs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_from_pretrained_cpu_steps_give_transformers_logits(tmp_path, rng, case):
    """skeleton → adapters → match_layers → dense_plan → load_dense on the CPU, the experts put
    back from the checkpoint (dequantized): the logits equal transformers' from_pretrained of
    the twin bit for bit, and every tensor is the twin's, dtypes included (the routers'
    e_score_correction_bias float32 as transformers keeps it, on 5.17 as on 5.24)."""
    from test_pretrained import _load_cpu
    from transformers import AutoModelForCausalLM
    fmt, latent, _ = case
    d, twin, a, _ = _release(tmp_path, rng, case)
    ckpt, model, specs, layers = _load_cpu(d)
    try:
        assert layers == [1, 4] and all(not s.gated and s.activation == RELU2 for s in specs)
        for spec, layer in zip(specs, layers):
            ex = ckpt.experts(layer)
            up, down = ((m if ex.kind is ExpertKind.FLOAT else nvfp4.dequantize(m, torch.float32))
                        for m in (ex.up, ex.down))
            spec.restore([(None, up[e], down[e]) for e in range(ex.n)], "cpu")
    finally:
        ckpt.close()
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.bfloat16).eval()
    mine = model.state_dict()
    for name, t in ref.state_dict().items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name
    assert mine["model.layers.1.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    ids = torch.randint(3, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_from_pretrained_reaches_the_pool(tmp_path, rng):
    """from_pretrained opens the NVFP4 release, builds the model, matches its MoE layers and
    dense tensors and gets to the pool: here, without a GPU, to the first thing that needs one
    (tests/test_gpu_pretrained.py runs the whole path)."""
    import cupool
    from cupool._cuda import NoGPUError
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/test_gpu_pretrained.py loads the release")
    d, *_ = nemotron_release(tmp_path, rng, "nvfp4")
    with pytest.raises(NoGPUError):
        cupool.from_pretrained(d, rows=4, progress=False, load_tokenizer=False)


def test_plan_counts_rows_without_a_gate(tmp_path, rng, capsys):
    from test_cli import run

    from cupool.store import fmt_bytes
    d, *_ = nemotron_release(tmp_path, rng, "nvfp4")
    rc, out, _ = run("plan", "--model", str(d), "--budget", "1GiB", "--context", "64",
                     capsys=capsys)
    assert rc == 0, out
    assert "2 MoE layers of 8 experts (top-2), H=64, I=32" in out
    assert f"rows of {fmt_bytes(RowLayout(64, 32, gated=False).row_bytes)}" in out


# --- refusals ---------------------------------------------------------------------------------
def _bf16(tmp_path, rng, edit=None, config=None):
    a = nemotron_h(rng)
    ex = float_experts(rng, a, torch.bfloat16)
    t = dict(a.dense)
    put_float_experts(t, a, ex)
    if edit:
        edit(t, a, ex)
    cfg = dict(a.config, **(config or {}))
    return save(tmp_path / "ck", t, cfg), a, ex


def test_a_gate_projection_in_a_nemotron_checkpoint_is_named(tmp_path, rng):
    def add_gate(t, a, ex):
        t["backbone.layers.4.mixer.experts.3.gate_proj.weight"] = ex[4][1][3].clone()
    d, *_ = _bf16(tmp_path, rng, add_gate)
    with pytest.raises(CheckpointError, match=r"layers\.4\.mixer\.experts\.3\.gate_proj\.weight: "
                                              r"config.json's model_type 'nemotron_h' has experts "
                                              r"without a gate"):
        open_checkpoint(d)


def test_a_missing_up_projection_is_named(tmp_path, rng):
    def drop(t, a, ex):
        del t["backbone.layers.1.mixer.experts.5.up_proj.weight"]
    d, *_ = _bf16(tmp_path, rng, drop)
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj\.weight is missing"):
        open_checkpoint(d)


def test_fused_stacks_without_a_gate_are_refused(tmp_path, rng):
    def fuse(t, a, ex):
        for e in range(8):
            for p in ("up_proj", "down_proj"):
                del t[f"backbone.layers.4.mixer.experts.{e}.{p}.weight"]
        t["backbone.layers.4.mixer.experts.up_proj"] = ex[4][1].clone()
        t["backbone.layers.4.mixer.experts.down_proj"] = ex[4][2].clone()
    d, *_ = _bf16(tmp_path, rng, fuse)
    with pytest.raises(CheckpointError, match=r"layer 4: fused expert stacks .*experts\.up_proj.*"
                                              r"read per expert"):
        open_checkpoint(d)


def test_biases_on_experts_without_a_gate_are_refused(tmp_path, rng):
    def bias(t, a, ex):
        for e in range(8):
            t[f"backbone.layers.1.mixer.experts.{e}.up_proj.bias"] = torch.zeros(32)
            t[f"backbone.layers.1.mixer.experts.{e}.down_proj.bias"] = torch.zeros(64)
    d, *_ = _bf16(tmp_path, rng, bias)
    with pytest.raises(CheckpointError, match=r"experts without a gate carry no biases"):
        open_checkpoint(d)


@pytest.mark.parametrize("key,value", [("hybrid_override_pattern", "MEM*M-"),
                                       ("layers_block_type",
                                        ["mamba", "moe", "mamba", "attention", "mamba", "mlp"])])
def test_layer_lists_that_disagree_with_the_experts_are_named(tmp_path, rng, key, value):
    config = {key: value}
    if key != "hybrid_override_pattern":
        config["hybrid_override_pattern"] = None
    d, *_ = _bf16(tmp_path, rng, config=config)
    with pytest.raises(CheckpointError, match=rf"{key}.*missing \[\], unexpected \[4\]"):
        open_checkpoint(d)


def test_rows_must_be_laid_out_without_a_gate(tmp_path, rng):
    d, *_ = _bf16(tmp_path, rng)
    store = HostStore(2, 8, RowLayout(64, 32).row_bytes, pinned=False)
    with pytest.raises(CheckpointError, match=r"gated=True but the experts .* have no gate "
                                              r"projection .*RowLayout\(64, 32, gated=False\)"):
        fill_store(store, d, RowLayout(64, 32), progress=False)
    with open_checkpoint(d) as ck:
        _, model = P.skeleton(d, torch.bfloat16)
        specs = find_moe_layers(model)
        assert P.match_layers(specs, ck) == [1, 4]
        wrong = [dataclasses.replace(s, gated=True) for s in specs]
        with pytest.raises(CheckpointError, match=r"have a gate projection \(gated=True\), the "
                                                  r"checkpoint's .* have none \(gated=False\)"):
            P.match_layers(wrong, ck)


def test_gated_families_keep_their_rule(tmp_path, rng):
    """A checkpoint of a gated model type whose experts lack gate_proj is a broken one, not a
    non-gated one: the rule is config.json's model_type."""
    from checkpoint_fixtures import qwen3_moe
    a = qwen3_moe(rng)
    ex = float_experts(rng, a)
    t = dict(a.dense)
    put_float_experts(t, a, {k: (None, u, dn) for k, (g, u, dn) in ex.items()})
    d = save(tmp_path / "q", t, a.config)
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight is missing"):
        open_checkpoint(d)


def test_nvfp4_experts_keep_their_own_global_scales(tmp_path, rng):
    """ModelOpt gives each of an expert's up and down its own weight_scale_2; the rows carry
    them (the header's gate scale 0)."""
    a = nemotron_h(rng)
    q = reference_nvfp4(float_experts(rng, a, torch.float32))
    t = dict(a.dense)
    put_modelopt_experts(t, a, q, style="ep")
    from checkpoint_fixtures import modelopt_hf_quant
    d = save(tmp_path / "m", t, a.config, hf_quant_config=modelopt_hf_quant(
        exclude=["lm_head", "*.mixer.gate"]))
    hq = json.loads((d / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4"
    layout = RowLayout(64, 32, gated=False)
    store = HostStore(2, 8, layout.row_bytes, pinned=False)
    fill_store(store, d, layout, progress=False)
    head = torch.from_numpy(store.row(1, 6)[:12].copy()).view(torch.float32)
    assert head[0] == 0.0
    assert head[1] == q[4][1].global_scale[6] and head[2] == q[4][2].global_scale[6]
    assert q[4][1].global_scale[6] != q[4][2].global_scale[6]
