"""NVFP4 attention projections from a checkpoint, kept packed (CPU).

ModelOpt exports whose exclude_modules do not name self_attn store q/k/v/o_proj as NVFP4 (weight,
weight_scale, weight_scale_2, input_scale); compressed-tensors ones as weight_packed, weight_scale
and the reciprocal weight_global_scale. `Checkpoint.dense_nvfp4` gives such a matrix as written
(bit for bit; the reciprocal inverted) and refuses any other dense tensor by name;
`pretrained.load_dense` attaches it to the Linear (`cupool.dense_nvfp4`) with the very weights
the dequantize-only load gives (logits equal bit for bit); an export that excludes self_attn
attaches nothing; from_pretrained plans the packed bytes beside the dense part.

from_pretrained itself needs a GPU from its plan step on (tests/test_gpu_pretrained.py), so these
tests run its CPU steps (`test_pretrained._load_cpu`: skeleton, dense_plan, load_dense) and stop
from_pretrained at its plan call.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from checkpoint_fixtures import (
    ct_config_json,
    float_experts,
    modelopt_hf_quant,
    nvfp4_dense,
    put_ct_experts,
    put_modelopt_experts,
    qwen3_moe,
    reference_nvfp4,
    save,
)

from cupool import dense_nvfp4
from cupool.adapters import find_moe_layers
from cupool.checkpoints import CheckpointError, open_checkpoint
from cupool.nvfp4 import NVFP4Tensor, dequantize, quantize

pytest.importorskip("transformers")

from cupool import pretrained as P  # noqa: E402

PROJ = dense_nvfp4.ATTENTION_PROJECTIONS
FORMATS = ("modelopt", "compressed-tensors")


def _export(tmp_path, rng, fmt: str = "modelopt", *, attention: bool = True):
    """A tiny Qwen3-MoE export in `fmt`, routed experts NVFP4. attention: q/k/v/o_proj of every
    layer NVFP4 as well (their float weights rounded to bf16 first, as an exporter reads them);
    else self_attn is excluded and stays bf16. H = 48: o_proj is [48, 64] (3 strips), q_proj
    [64, 48] and k/v [32, 48] (K = 48 padded to Kp = 64 in the strips).

    Returns (directory, {checkpoint weight name: NVFP4Tensor as written, ModelOpt's global scale
    for compressed-tensors too})."""
    a = qwen3_moe(rng, H=48)
    q = reference_nvfp4(float_experts(rng, a))
    t = dict(a.dense)
    written = {}
    if attention:
        L = a.config["num_hidden_layers"]
        for mod in (f"model.layers.{li}.self_attn.{p}" for li in range(L) for p in PROJ):
            nvfp4_dense(t, mod, ct=fmt != "modelopt")
            if fmt == "modelopt":
                g = t[f"{mod}.weight_scale_2"]
                written[f"{mod}.weight"] = NVFP4Tensor(t[f"{mod}.weight"],
                                                       t[f"{mod}.weight_scale"], g)
            else:
                g = (torch.ones(1) / t[f"{mod}.weight_global_scale"]).reshape(())
                written[f"{mod}.weight"] = NVFP4Tensor(t[f"{mod}.weight_packed"],
                                                       t[f"{mod}.weight_scale"], g)
    if fmt == "modelopt":
        put_modelopt_experts(t, a, q)
        exclude = ["lm_head"] + ([] if attention else ["model.layers.*.self_attn*"])
        d = save(tmp_path / fmt, t, a.config, hf_quant_config=modelopt_hf_quant(exclude=exclude))
    else:
        put_ct_experts(t, a, q)
        ignore = ["lm_head", "re:.*mlp.gate$"] + ([] if attention else ["re:.*self_attn.*"])
        d = save(tmp_path / fmt, t, ct_config_json(a.config, ignore=ignore))
    return d, written


def _strip_bytes(n: int, k: int) -> int:
    """Bytes of one matrix's strips: ceil(N/16) strips of 9·roundup(K, 64) bytes."""
    return -(-n // 16) * 9 * (-(-k // 64) * 64)


def _same_bits(a: NVFP4Tensor, b: NVFP4Tensor) -> bool:
    return (a.packed.dtype == b.packed.dtype == torch.uint8 and torch.equal(a.packed, b.packed)
            and a.block_scale.dtype == b.block_scale.dtype == torch.float8_e4m3fn
            and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
            and a.global_scale.dtype == b.global_scale.dtype == torch.float32
            and a.global_scale.shape == b.global_scale.shape == ()
            and torch.equal(a.global_scale.view(torch.int32), b.global_scale.view(torch.int32)))


def _restore_experts(ckpt, specs, layers) -> None:
    for spec, layer in zip(specs, layers):
        g, u, d = (dequantize(m) for m in ckpt.experts(layer).nvfp4())
        spec.restore([(g[e], u[e], d[e]) for e in range(g.shape[0])], "cpu")


def _load_whole(d, **kw):
    """The model `test_pretrained._load_cpu` loads from `d` (kw: its quantize_attention), with
    its experts put back from the checkpoint, so that it runs a forward."""
    from test_pretrained import _load_cpu
    ckpt, model, specs, layers = _load_cpu(d, **kw)
    try:
        _restore_experts(ckpt, specs, layers)
    finally:
        ckpt.close()
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_nvfp4_gives_the_stored_matrix(tmp_path, rng, fmt):
    d, written = _export(tmp_path, rng, fmt)
    with open_checkpoint(d) as ck:
        for name, want in written.items():
            assert ck.dense_kind(name) == "nvfp4"
            got = ck.dense_nvfp4(name)
            assert _same_bits(got, want), name
            # dense_tensor is the same matrix dequantized (float32, then the dtype asked for)
            assert torch.equal(ck.dense_tensor(name, torch.float32), dequantize(want))
            assert torch.equal(ck.dense_tensor(name, torch.bfloat16),
                               dequantize(want).to(torch.bfloat16))
        assert ck.dense_nvfp4_bytes(written) == sum(
            _strip_bytes(*ck.dense_shape(n)) for n in written)
        norm = "model.layers.0.input_layernorm.weight"
        with pytest.raises(CheckpointError, match=rf"'{norm}' .* plain dense tensor, not an NVFP4"):
            ck.dense_nvfp4(norm)
        with pytest.raises(CheckpointError, match=rf"'{norm}' .* plain dense tensor"):
            ck.dense_nvfp4_bytes([norm])
        with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.x_proj.weight' is "
                                                  r"not a dense tensor"):
            ck.dense_nvfp4("model.layers.0.self_attn.x_proj.weight")


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_dense_keeps_the_projections_packed_with_the_same_weights(tmp_path, rng, fmt,
                                                                        monkeypatch, caplog):
    d, written = _export(tmp_path, rng, fmt)
    with caplog.at_level(logging.INFO, logger="cupool"):
        model = _load_whole(d)
    with open_checkpoint(d) as ckpt:
        assert ckpt.dense_nvfp4_bytes(written) == dense_nvfp4.packed_bytes(model)
    assert "8 NVFP4 dense Linears (model.layers.N.self_attn.k_proj" in caplog.text
    linears = {n: m for n, m in model.named_modules() if n.rpartition(".")[2] in PROJ}
    assert len(linears) == len(written) == 8
    for name, lin in linears.items():
        p = dense_nvfp4.of(lin)
        q = written[f"{name}.weight"]
        assert p is not None and p.shape == tuple(lin.weight.shape) == tuple(q.shape), name
        assert p.device == lin.weight.device and p.global_scale == float(q.global_scale)
        assert lin.weight.dtype == torch.bfloat16
        assert torch.equal(p.dequantize(torch.bfloat16), lin.weight), name
        assert torch.equal(lin.weight, dequantize(q).to(torch.bfloat16)), name
    assert not [n for n, m in model.named_modules()
                if dense_nvfp4.of(m) is not None and n not in linears]

    # the same checkpoint read as before: every dense weight dequantized, nothing attached
    monkeypatch.setattr(P, "packed_projections", lambda *args: {})
    plain = _load_whole(d)
    assert dense_nvfp4.packed_bytes(plain) == 0
    want = plain.state_dict()
    for name, t in model.state_dict().items():
        assert t.dtype == want[name].dtype and torch.equal(t, want[name]), name
    ids = torch.randint(3, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # the same weights, the same forward: bit for bit
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_excluded_self_attn_attaches_nothing(tmp_path, rng, fmt):
    from test_pretrained import _load_cpu
    d, written = _export(tmp_path, rng, fmt, attention=False)
    assert not written
    ckpt, model, _, _ = _load_cpu(d)
    try:
        assert ckpt.dense_kind("model.layers.0.self_attn.q_proj.weight") == "plain"
        with pytest.raises(CheckpointError, match=r"q_proj.weight' .* plain dense tensor"):
            ckpt.dense_nvfp4("model.layers.0.self_attn.q_proj.weight")
    finally:
        ckpt.close()
    assert dense_nvfp4.packed_bytes(model) == 0
    assert not any(dense_nvfp4.of(m) is not None for m in model.modules())


def test_other_nvfp4_linears_are_dequantized_only(tmp_path, rng):
    """An NVFP4 Linear outside the attention projections (lm_head here) is dequantized as
    before, without a packed form."""
    from test_pretrained import _load_cpu
    a = qwen3_moe(rng, H=48)
    q = reference_nvfp4(float_experts(rng, a))
    t = dict(a.dense)
    want = nvfp4_dense(t, "lm_head")
    put_modelopt_experts(t, a, q)
    d = save(tmp_path / "ck", t, a.config, hf_quant_config=modelopt_hf_quant(exclude=[]))
    ckpt, model, _, _ = _load_cpu(d)
    try:
        assert ckpt.dense_kind("lm_head.weight") == "nvfp4"
    finally:
        ckpt.close()
    assert dense_nvfp4.of(model.lm_head) is None and dense_nvfp4.packed_bytes(model) == 0
    assert torch.equal(model.lm_head.weight, want.to(torch.bfloat16))


class _Planned(Exception):
    """Raised by the stand-in for `plan`: from_pretrained stops there (no GPU needed)."""


@pytest.mark.parametrize("attention", [True, False])
def test_from_pretrained_plans_the_packed_bytes(tmp_path, rng, monkeypatch, attention):
    d, written = _export(tmp_path, rng, attention=attention)
    seen = {}

    def plan(specs, *, pending_bytes, **kw):
        seen["pending"] = pending_bytes
        raise _Planned

    monkeypatch.setattr(P, "plan", plan)
    with pytest.raises(_Planned):
        P.from_pretrained(d, rows=2, progress=False, load_tokenizer=False)
    with open_checkpoint(d) as ck:
        dense = ck.dense_bytes(torch.bfloat16)
        packed = sum(_strip_bytes(*ck.dense_shape(n)) for n in written)
    # q [64, 48]: 4 strips of 576 B; k, v [32, 48]: 2 each; o [48, 64]: 3; two layers
    assert packed == (2 * (4 + 2 + 2 + 3) * 576 if attention else 0)
    assert seen["pending"] == dense + packed


@pytest.mark.parametrize("attention", [True, False])
def test_cupool_plan_counts_the_packed_bytes(tmp_path, rng, capsys, attention):
    """`cupool plan` puts the packed projections on the GPU beside the dense part, and says so."""
    from cupool import __main__ as cli
    from cupool.store import fmt_bytes
    d, written = _export(tmp_path, rng, attention=attention)
    rc = cli.main(["plan", "--model", str(d), "--budget", "1GiB", "--context", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    with open_checkpoint(d) as ck:
        dense = ck.dense_bytes(torch.bfloat16)
    packed = 2 * (4 + 2 + 2 + 3) * 576 if attention else 0
    line = next(l for l in out.splitlines() if l.startswith("dense part"))
    assert fmt_bytes(dense + packed) in line, line
    assert ("8 NVFP4 attention projections also kept packed" in line) == attention, line


# --- quantize_attention: bf16 projections quantized to NVFP4 at load ------------------------------
def _bf16_projections(d) -> dict[str, torch.Tensor]:
    """{module name: bf16 weight} of the attention projections a checkpoint stores in bf16."""
    from safetensors.torch import load_file
    t = {}
    for f in sorted(d.glob("*.safetensors")):
        t.update(load_file(f))
    return {n.removesuffix(".weight"): w for n, w in t.items()
            if dense_nvfp4.is_projection_weight(n)}


def test_quantize_attention_packs_the_bf16_projections(tmp_path, rng, caplog):
    """Each bf16 projection is quantized as `cupool.nvfp4.quantize` quantizes it and attached:
    the packed form and the Linear's weight (its dequantized values) both the quantized matrix;
    the model equals one loaded plain whose projections `quantize_linears` quantized after."""
    d, written = _export(tmp_path, rng, attention=False)
    stored = _bf16_projections(d)
    assert len(stored) == 8 and all(w.dtype == torch.bfloat16 for w in stored.values())
    with caplog.at_level(logging.INFO, logger="cupool"):
        model = _load_whole(d, quantize_attention=True)
    assert "8 NVFP4 dense Linears" in caplog.text and "8 of them quantized at load" in caplog.text
    linears = {n: m for n, m in model.named_modules() if n.rpartition(".")[2] in PROJ}
    assert sorted(linears) == sorted(stored)
    for name, lin in linears.items():
        q = quantize(stored[name])
        p = dense_nvfp4.of(lin)
        assert p is not None and p.shape == tuple(lin.weight.shape), name
        assert torch.equal(p.strips, dense_nvfp4.pack(q).strips), name
        assert p.global_scale == float(q.global_scale), name
        assert lin.weight.dtype == torch.bfloat16
        assert torch.equal(lin.weight, dequantize(q).to(torch.bfloat16)), name
        assert not torch.equal(lin.weight, stored[name]), name      # it did change the weights
    assert dense_nvfp4.packed_bytes(model) == 2 * (4 + 2 + 2 + 3) * 576

    plain = _load_whole(d)
    assert dense_nvfp4.packed_bytes(plain) == 0
    assert dense_nvfp4.quantize_linears(plain) == 8
    ids = torch.randint(3, 32, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_quantize_attention_keeps_the_checkpoints_nvfp4_as_written(tmp_path, rng, caplog):
    from test_pretrained import _load_cpu
    d, written = _export(tmp_path, rng)
    with caplog.at_level(logging.INFO, logger="cupool"):
        ckpt, model, _, _ = _load_cpu(d, quantize_attention=True)
    ckpt.close()
    assert "8 NVFP4 dense Linears" in caplog.text and "quantized at load" not in caplog.text
    for name, q in written.items():
        lin = model.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(dense_nvfp4.of(lin).strips, dense_nvfp4.pack(q).strips), name
        assert torch.equal(lin.weight, dequantize(q).to(torch.bfloat16)), name


def test_quantize_attention_refuses_what_nvfp4_cannot_hold(tmp_path, rng):
    """A projection whose inner dim is not a multiple of 16 is named before anything is read;
    a NaN in a bf16 projection is named when it is quantized."""
    from safetensors.torch import load_file, save_file
    from test_pretrained import _load_cpu
    d, _ = _export(tmp_path, rng, attention=False)
    with open_checkpoint(d) as ck:
        _, model = P.skeleton(d, torch.bfloat16)
        specs = find_moe_layers(model)
        P.match_layers(specs, ck)
        mapping = P.dense_plan(model, specs, ck)
        with torch.device("meta"):
            model.model.layers[1].self_attn.q_proj = torch.nn.Linear(40, 64, bias=False)
        with pytest.raises(P.QuantizeError, match=r"quantize_attention: model\.layers\.1\."
                                                  r"self_attn\.q_proj\.weight is \[64, 40\]; "
                                                  r"NVFP4 needs its inner dim to be a multiple "
                                                  r"of 16"):
            P.quantized_projections(model, mapping, P.packed_projections(model, mapping, ck))
        # without quantize_attention nothing is asked of that Linear
        assert P.dense_gpu_bytes(model, mapping, ck, torch.bfloat16) == \
            ck.dense_bytes(torch.bfloat16)
    f = next(d.glob("*.safetensors"))
    t = load_file(f)
    name = "model.layers.0.self_attn.k_proj.weight"
    t[name][3, 5] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(P.QuantizeError, match=rf"quantize_attention: {re.escape(name)}: .*NaN"):
        _load_cpu(d, quantize_attention=True)
    # the same checkpoint loads as it is without quantize_attention
    ckpt, model, _, _ = _load_cpu(d)
    ckpt.close()
    assert torch.isnan(model.get_parameter(name)).any()


def test_step_projection_weights_are_those_of_attention_with_all_four():
    names = [f"model.layers.0.self_attn.{p}.weight" for p in PROJ] + [
        "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate.weight",
        "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",                 # MLA: o_proj alone
        "model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
        "model.layers.2.self_attn.v_proj.weight",                 # no o_proj
        "model.layers.3.self_attn.o_proj.bias"] + \
        [f"model.layers.3.self_attn.{p}.weight" for p in reversed(PROJ)]
    assert dense_nvfp4.step_projection_weights(names) == \
        [f"model.layers.0.self_attn.{p}.weight" for p in PROJ] + \
        [f"model.layers.3.self_attn.{p}.weight" for p in reversed(PROJ)]
    assert dense_nvfp4.step_projection_weights([]) == []


def test_quantize_attention_leaves_an_mla_attention_as_it_is(tmp_path, caplog, capsys):
    """DeepSeek-V3's MLA attention has an o_proj but no k_proj or v_proj: the fused step reads
    none of it, so quantize_attention leaves it in bf16 (nothing quantized or planned), and
    `cupool plan --quantize-attention` counts nothing for it."""
    from test_pretrained import _load_cpu, _saved

    from cupool import __main__ as cli
    _, d = _saved(tmp_path, "deepseek_v3")
    with caplog.at_level(logging.INFO, logger="cupool"):
        ckpt, model, _, _ = _load_cpu(d, quantize_attention=True)
    ckpt.close()
    o = [m for n, m in model.named_modules() if n.endswith("self_attn.o_proj")]
    assert o and all(dense_nvfp4.of(m) is None and m.weight.dtype == torch.bfloat16 for m in o)
    assert dense_nvfp4.packed_bytes(model) == 0 and "quantized at load" not in caplog.text
    for flag in ([], ["--quantize-attention"]):
        rc = cli.main(["plan", "--model", str(d), "--budget", "1GiB", "--context", "64", *flag])
        out = capsys.readouterr().out
        assert rc == 0, out
        line = next(l for l in out.splitlines() if l.startswith("dense part"))
        assert "packed" not in line and "quantized" not in line, line


def test_from_pretrained_plans_the_quantized_bytes(tmp_path, rng, monkeypatch):
    d, _ = _export(tmp_path, rng, attention=False)
    seen = []

    def plan(specs, *, pending_bytes, **kw):
        seen.append(pending_bytes)
        raise _Planned

    monkeypatch.setattr(P, "plan", plan)
    for q in (False, True):
        with pytest.raises(_Planned):
            P.from_pretrained(d, rows=2, progress=False, load_tokenizer=False,
                              quantize_attention=q)
    with open_checkpoint(d) as ck:
        dense = ck.dense_bytes(torch.bfloat16)
    assert seen == [dense, dense + 2 * (4 + 2 + 2 + 3) * 576]
    with pytest.raises(TypeError, match=r"quantize_attention must be a bool, got 'yes'"):
        P.from_pretrained(d, rows=2, progress=False, quantize_attention="yes")


def test_cupool_plan_quantize_attention(tmp_path, rng, capsys):
    from cupool import __main__ as cli
    from cupool.store import fmt_bytes
    d, _ = _export(tmp_path, rng, attention=False)
    lines = {}
    for flag in ([], ["--quantize-attention"]):
        rc = cli.main(["plan", "--model", str(d), "--budget", "1GiB", "--context", "64",
                       "--gpu", "H200", *flag])
        out = capsys.readouterr().out
        assert rc == 0, out
        lines[bool(flag)] = out
    with open_checkpoint(d) as ck:
        dense = ck.dense_bytes(torch.bfloat16)
    packed = 2 * (4 + 2 + 2 + 3) * 576
    line = next(l for l in lines[True].splitlines() if l.startswith("dense part"))
    assert fmt_bytes(dense + packed) in line, line
    assert "8 NVFP4 attention projections also kept packed" in line, line
    assert "8 of them quantized at load" in line, line
    line = next(l for l in lines[False].splitlines() if l.startswith("dense part"))
    assert fmt_bytes(dense) in line and "packed" not in line, line

    def read(out):        # a token's bytes read, from the speed estimate
        m = re.search(r"a token reads ([0-9.]+) (\w+)", out)
        return float(m.group(1)), m.group(2)
    assert read(lines[True]) != read(lines[False])


def test_cupool_plan_quantize_attention_refuses_what_nvfp4_cannot_hold(tmp_path, rng, capsys):
    """A bf16 projection whose inner dim is not a multiple of 16 (o_proj of 5 heads of 8: K = 40)
    under --quantize-attention: one line, exit code 2, naming it; without the flag the plan is
    made."""
    from cupool import __main__ as cli
    a = qwen3_moe(rng, H=48)
    a.config.update(num_attention_heads=5, num_key_value_heads=1, head_dim=8)
    t = dict(a.dense)
    for li in range(a.config["num_hidden_layers"]):
        pre = f"model.layers.{li}.self_attn"
        for name, shape in (("q_proj", (40, 48)), ("k_proj", (8, 48)), ("v_proj", (8, 48)),
                            ("o_proj", (48, 40)), ("q_norm", (8,)), ("k_norm", (8,))):
            t[f"{pre}.{name}.weight"] = torch.randn(shape).to(torch.bfloat16)
    q = reference_nvfp4(float_experts(rng, a))
    put_modelopt_experts(t, a, q)
    d = save(tmp_path / "k40", t, a.config, hf_quant_config=modelopt_hf_quant())
    argv = ["plan", "--model", str(d), "--budget", "1GiB", "--context", "64"]
    assert cli.main(argv) == 0, capsys.readouterr()
    capsys.readouterr()
    assert cli.main([*argv, "--quantize-attention"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quantize-attention: model.layers.0.self_attn.o_proj.weight is " \
        "[48, 40]; NVFP4 needs its inner dim to be a multiple of 16" in err[0], err
