"""Adapters (cupool.adapters): finding MoE layers, the weight views they hand out, and every guard.

CPU only. The views are checked against the experts modules' own forward (transformers' code for
the fused families, the block's loop for linear lists), so a wrong slice, transpose or gate/up swap
shows up as a wrong output, not only as a shape.
"""

import dataclasses
import gc
import types
import weakref

import pytest
import torch
from tiny_models import (
    FAMILIES,
    GateUpDownExpert,
    ListMoEModel,
    ReluExpert,
    W123Expert,
    hf_model,
    moe_reference,
)
from torch import nn

from cupool.activation import SILU, swiglu_clamp
from cupool.adapters import (
    KIND_HF,
    KIND_LIST,
    MoELayerSpec,
    UnsupportedModelError,
    check_consistent,
    find_moe_layers,
)


def _routing(E, K, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])        # [T, K]
    w = torch.rand(T, K, generator=g)                                                # [T, K]
    return ids, w


# --- transformers families -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_models():
    pytest.importorskip("transformers")
    return {f: hf_model(f) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_detected(hf_models, family):
    model = hf_models[family]
    layers, E, K, H, I = FAMILIES[family][1]
    specs = find_moe_layers(model)
    assert [s.name for s in specs] == [f"model.layers.{i}.mlp.experts" for i in layers]
    assert [s.index for s in specs] == list(range(len(layers)))
    for s, i in zip(specs, layers):
        assert (s.kind, s.num_experts, s.top_k, s.hidden, s.intermediate) == (KIND_HF, E, K, H, I)
        assert (s.dtype, s.device) == (torch.float32, torch.device("cpu"))
        assert s.module is model.model.layers[i].mlp.experts
        assert s.parent is model.model.layers[i].mlp
        gpt_oss = family == "gpt_oss"             # interleaved, transposed, biased, clamped
        assert (s.concatenated, s.transposed, s.bias) == \
            ((False, True, True) if gpt_oss else (True, False, False))
        assert s.activation == (swiglu_clamp(1.702, 7.0) if gpt_oss else SILU)
    check_consistent(specs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_views(hf_models, family):
    """expert(e) is the fused parameters' slice, stacked() agrees, and both are views."""
    for s in find_moe_layers(hf_models[family]):
        I = s.intermediate
        gate_up, down = s.module.gate_up_proj, s.module.down_proj
        sg, su, sd = s.stacked()
        assert sg.shape == su.shape == (s.num_experts, I, s.hidden)
        assert sd.shape == (s.num_experts, s.hidden, I)
        if s.transposed:                          # gpt-oss: [E, H, 2I] / [E, I, H]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        for e in range(s.num_experts):
            g, u, d = s.expert(e)
            if s.concatenated:
                assert torch.equal(g, gate_up[e, :I]) and torch.equal(u, gate_up[e, I:])
            else:                                 # interleaved rows g0, u0, g1, u1, ...
                assert torch.equal(g, gate_up[e, 0::2]) and torch.equal(u, gate_up[e, 1::2])
            assert torch.equal(d, down[e])
            assert torch.equal(g, sg[e]) and torch.equal(u, su[e]) and torch.equal(d, sd[e])
            # a view: same storage, no copy, and no autograd history attached
            assert g.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
            assert not g.requires_grad


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_family_views_compute_the_module(hf_models, family, impl):
    """The experts module's own forward (transformers' code) equals the SwiGLU of expert(e)."""
    spec = find_moe_layers(hf_models[family])[-1]
    old = spec.module.config._experts_implementation
    spec.module.config._experts_implementation = impl
    try:
        T = 5
        x = torch.randn(T, spec.hidden, generator=torch.Generator().manual_seed(1))
        ids, w = _routing(spec.num_experts, spec.top_k, T, seed=2)
        with torch.no_grad():
            got = spec.module(x, ids, w)
        torch.testing.assert_close(got, moe_reference(spec, x, ids, w), rtol=1e-5, atol=1e-5)
    finally:
        spec.module.config._experts_implementation = old


def test_dense_and_shared_experts_stay():
    """DeepSeek-V3's dense layer 0 and shared experts, Qwen2-MoE's shared expert: not specs, and
    release() leaves them alone."""
    pytest.importorskip("transformers")
    ds = hf_model("deepseek_v3")
    specs = find_moe_layers(ds)
    assert all(s.name != "model.layers.0.mlp.experts" for s in specs)
    shared = ds.model.layers[1].mlp.shared_experts
    before = {n: p.clone() for n, p in shared.named_parameters()}
    dense = ds.model.layers[0].mlp.gate_proj.weight.clone()
    for s in specs:
        s.release()
    assert all(torch.equal(p, before[n]) for n, p in shared.named_parameters())
    assert torch.equal(ds.model.layers[0].mlp.gate_proj.weight, dense)

    q2 = hf_model("qwen2_moe")
    specs = find_moe_layers(q2)
    assert not any("shared_expert" in s.name for s in specs)
    assert specs[0].parent.shared_expert.gate_proj.weight.numel() > 0


def test_release_frees_and_is_idempotent():
    pytest.importorskip("transformers")
    model = hf_model("qwen3_moe")
    spec = find_moe_layers(model)[1]
    old = weakref.ref(spec.module.gate_up_proj)
    dtype, device = spec.module.gate_up_proj.dtype, spec.module.gate_up_proj.device
    spec.release()
    spec.release()                                         # idempotent
    gc.collect()
    assert old() is None, "the old gate_up_proj is still referenced after release()"
    for p in (spec.module.gate_up_proj, spec.module.down_proj):
        assert p.numel() == 0 and p.dim() == 3 and (p.dtype, p.device) == (dtype, device)
    assert sum(p.numel() for p in spec.module.parameters()) == 0
    assert (spec.num_experts, spec.hidden, spec.intermediate) == (8, 48, 32)   # still described
    with pytest.raises(RuntimeError, match="after release"):
        spec.expert(0)
    with pytest.raises(RuntimeError, match="after release"):
        spec.stacked()
    # other layers are untouched
    assert find_moe_layers(hf_model("qwen3_moe"))[0].module.gate_up_proj.numel() > 0


def _release_restore_round_trip(spec, x, ids, w):
    """release() then restore(expert copies) gives back the same parameters and the same output."""
    shapes = [tuple(p.shape) for p in spec.module.parameters()]
    copies = [tuple(t.clone() for t in spec.expert(e)) for e in range(spec.num_experts)]
    biases = None if not spec.bias else tuple(b.clone() for b in spec.biases())
    with torch.no_grad():
        before = spec.module(x, ids, w) if spec.kind == KIND_HF else spec.parent(x)
    spec.release()
    spec.restore(copies, biases=biases)
    assert not spec.released and [tuple(p.shape) for p in spec.module.parameters()] == shapes
    for e in range(spec.num_experts):
        assert all(torch.equal(a, b) for a, b in zip(spec.expert(e), copies[e]))
    with torch.no_grad():
        after = spec.module(x, ids, w) if spec.kind == KIND_HF else spec.parent(x)
    assert torch.equal(before, after)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_restore_round_trip_family(family):
    pytest.importorskip("transformers")
    spec = find_moe_layers(hf_model(family))[0]
    x = torch.randn(4, spec.hidden, generator=torch.Generator().manual_seed(7))
    _release_restore_round_trip(spec, x, *_routing(spec.num_experts, spec.top_k, 4, seed=8))
    biases = spec.biases()
    with pytest.raises(ValueError, match=r"restore needs E=8"):
        spec.restore([], biases=biases)
    bad = [tuple(t.clone() for t in spec.expert(e)) for e in range(spec.num_experts)]
    with pytest.raises(ValueError, match=r"restore needs biases exactly when"):
        spec.restore(bad, biases=None if biases is not None else bad[0])
    bad[3] = (bad[3][0].t(), bad[3][1], bad[3][2])
    with pytest.raises(ValueError, match=rf"expert 3: expected gate, up \[I={spec.intermediate}, H=48\]"):
        spec.restore(bad, biases=biases)


def test_expert_index_checked(hf_models):
    spec = find_moe_layers(hf_models["mixtral"])[0]
    with pytest.raises(IndexError, match="out of range"):
        spec.expert(spec.num_experts)
    spec.expert(torch.tensor(1))              # 0-d integer tensors index like ints


# --- hand-made transformers experts modules: transposed and interleaved layouts ----------------------
def _hf_experts_class(**flags):
    """An experts class decorated like transformers' own, with the layout the flags describe."""
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
            self.num_experts = E
            gu = (E, H, 2 * I) if flags.get("is_transposed") else (E, 2 * I, H)
            dn = (E, I, H) if flags.get("is_transposed") else (E, H, I)
            self.gate_up_proj = nn.Parameter(torch.randn(gu) * 0.2)
            self.down_proj = nn.Parameter(torch.randn(dn) * 0.2)
            if flags.get("has_bias"):
                self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
                self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError("tests dispatch to transformers' batched_mm / grouped_mm")

    return use_experts_implementation(Experts, **flags)


def _interleaved_gate(self, gate_up_out):
    # what an interleaved SwiGLU must do: even columns are gate, odd ones up
    return self.act_fn(gate_up_out[..., 0::2]) * gate_up_out[..., 1::2]


def _clamped_gate(self, gate_up_out):
    # gpt-oss's SwiGLU: clamped, sigmoid(1.702·g), (up + 1): not what cupool computes
    gate, up = gate_up_out[..., 0::2].clamp(max=7.0), gate_up_out[..., 1::2].clamp(-7.0, 7.0)
    return gate * torch.sigmoid(gate * 1.702) * (up + 1)


class _Block(nn.Module):
    def __init__(self, experts_cls, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.top_k = config.num_experts_per_tok
        self.experts = experts_cls(config)


def _hf_config(impl="batched_mm", hidden_act="silu", E=6, H=48, I=16, K=2):
    return types.SimpleNamespace(_experts_implementation=impl, hidden_act=hidden_act, num_experts=E,
                                 hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=K)


def _hand_made(apply_gate=None, config=None, layers=2, **flags):
    pytest.importorskip("transformers")
    cls = _hf_experts_class(**flags)
    if apply_gate is not None:
        cls._apply_gate = apply_gate
    config = config or _hf_config()
    torch.manual_seed(3)
    return nn.Sequential(*[_Block(cls, config) for _ in range(layers)])


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("transposed,concatenated", [(True, True), (False, False), (True, False)])
def test_hand_made_layouts(impl, transposed, concatenated):
    gate = None if concatenated else _interleaved_gate
    model = _hand_made(gate, _hf_config(impl), is_transposed=transposed, is_concatenated=concatenated)
    specs = find_moe_layers(model)
    assert [s.name for s in specs] == ["0.experts", "1.experts"]
    s = specs[0]
    assert (s.transposed, s.concatenated) == (transposed, concatenated)
    assert (s.num_experts, s.top_k, s.hidden, s.intermediate) == (6, 2, 48, 16)
    sg, su, sd = s.stacked()
    for e in range(s.num_experts):
        g, u, d = s.expert(e)
        assert g.shape == u.shape == (16, 48) and d.shape == (48, 16)
        assert torch.equal(g, sg[e]) and torch.equal(u, su[e]) and torch.equal(d, sd[e])
    # transformers' own implementation on these weights equals our reading of them
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(4))
    ids, w = _routing(6, 2, 7, seed=5)
    with torch.no_grad():
        got = s.module(x, ids, w)
    torch.testing.assert_close(got, moe_reference(s, x, ids, w), rtol=1e-5, atol=1e-5)
    _release_restore_round_trip(s, x, ids, w)
    s.release()
    assert s.module.gate_up_proj.numel() == 0


def test_interleaved_flag_with_default_gate_is_refused():
    # is_concatenated=False but the default _apply_gate splits halves: the two disagree
    with pytest.raises(UnsupportedModelError, match=r"0\.experts: unsupported, because .*_apply_gate"):
        find_moe_layers(_hand_made(is_concatenated=False))


def test_clamped_gate_without_its_parameters_is_refused():
    # the clamped SwiGLU is only a candidate where the module carries alpha and limit
    with pytest.raises(UnsupportedModelError, match=r"computes none of the activations .*SiLU"):
        find_moe_layers(_hand_made(_clamped_gate, is_concatenated=False))


def test_clamped_gate_with_its_parameters_is_found():
    model = _hand_made(_clamped_gate, is_concatenated=False)
    for blk in model:
        blk.experts.alpha, blk.experts.limit = 1.702, 7.0
    assert {s.activation for s in find_moe_layers(model)} == {swiglu_clamp(1.702, 7.0)}
    for blk in model:                         # parameters that disagree with what it computes
        blk.experts.limit = 5.0
    with pytest.raises(UnsupportedModelError, match=r"limit = 5.*differs|computes none"):
        find_moe_layers(model)


def _gptoss_gate(self, gate_up_out):
    # transformers' GptOssExperts._apply_gate, reading alpha and limit from the module
    gate, up = gate_up_out[..., ::2], gate_up_out[..., 1::2]
    gate = gate.clamp(min=None, max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_hf_biases_are_read(impl):
    """Biased, interleaved, transposed experts (gpt-oss's layout): biases() is the parameters'
    de-interleaved view and transformers' own implementation equals the reference built from
    what the adapter hands out."""
    model = _hand_made(_gptoss_gate, _hf_config(impl), has_bias=True, is_concatenated=False,
                       is_transposed=True)
    g = torch.Generator().manual_seed(8)
    for blk in model:
        blk.experts.alpha, blk.experts.limit = 1.702, 7.0
        with torch.no_grad():
            blk.experts.gate_up_proj_bias.copy_(torch.randn(6, 32, generator=g))
            blk.experts.down_proj_bias.copy_(torch.randn(6, 48, generator=g))
    s = find_moe_layers(model)[0]
    assert s.bias and s.activation == swiglu_clamp(1.702, 7.0)
    bg, bu, bd = s.biases()
    assert torch.equal(bg, s.module.gate_up_proj_bias[:, 0::2])
    assert torch.equal(bu, s.module.gate_up_proj_bias[:, 1::2])
    assert torch.equal(bd, s.module.down_proj_bias)
    x = torch.randn(7, 48, generator=g) * 3
    ids, w = _routing(6, 2, 7, seed=9)
    with torch.no_grad():
        got = s.module(x, ids, w)
    want = moe_reference(s, x, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _release_restore_round_trip(s, x, ids, w)


def test_hf_bias_shapes_checked():
    model = _hand_made(_gptoss_gate, has_bias=True, is_concatenated=False, is_transposed=True)
    for blk in model:
        blk.experts.alpha, blk.experts.limit = 1.702, 7.0
    model[0].experts.down_proj_bias = nn.Parameter(torch.zeros(6, 47))
    with pytest.raises(UnsupportedModelError, match=r"0\.experts: .*down_proj_bias is \[6, 47\], "
                                                   r"expected \[6, 48\]"):
        find_moe_layers(model)
    model[0].experts.down_proj_bias = None
    with pytest.raises(UnsupportedModelError, match=r"has_bias=True but down_proj_bias is NoneType"):
        find_moe_layers(model)


def test_hf_no_gate_needs_up_proj():
    """has_gate=False reads up_proj (test_nongated.py); a module declaring it without one is
    refused."""
    with pytest.raises(UnsupportedModelError, match="because its experts have no gate, and "
                                                    "up_proj / down_proj are not two 3-D tensors"):
        find_moe_layers(_hand_made(has_gate=False))


def test_hf_non_silu_refused():
    pytest.importorskip("transformers")
    # through the config (the module's act_fn follows it)
    with pytest.raises(UnsupportedModelError,
                       match=r"model\.layers\.0\.mlp\.experts: unsupported, because .*'gelu'"):
        find_moe_layers(hf_model("qwen3_moe", hidden_act="gelu"))
    # a replaced act_fn, config still saying silu
    model = hf_model("olmoe")
    model.model.layers[2].mlp.experts.act_fn = nn.GELU()
    with pytest.raises(UnsupportedModelError,
                       match=r"layers\.2\.mlp\.experts: unsupported, because .*act_fn is GELU"):
        find_moe_layers(model)


def test_hf_quantized_or_odd_weights_refused():
    model = _hand_made()
    model[1].experts.down_proj = nn.Parameter(torch.zeros(6, 48, 16, dtype=torch.uint8),
                                              requires_grad=False)
    with pytest.raises(UnsupportedModelError, match=r"1\.experts: .*torch\.uint8"):
        find_moe_layers(model)
    model = _hand_made()
    model[0].experts.down_proj = nn.Parameter(torch.zeros(6, 16, 48))      # transposed by mistake
    with pytest.raises(UnsupportedModelError, match=r"down_proj is \[6, 16, 48\]"):
        find_moe_layers(model)


def test_router_must_match_experts():
    model = _hand_made()
    model[1].gate = nn.Linear(48, 5, bias=False)
    model[1].gate.top_k = 2
    with pytest.raises(UnsupportedModelError, match=r"1\.experts: .*router 1\.gate .*\[E=6, H=48\]"):
        find_moe_layers(model)


def test_top_k_sources():
    pytest.importorskip("transformers")
    # Mixtral keeps top_k on the block and on the router; both agree with the config
    assert find_moe_layers(hf_model("mixtral"))[0].top_k == 2
    model = hf_model("mixtral")
    model.model.layers[1].mlp.gate.top_k = 3
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.experts: .*ambiguous.*gate\.top_k = 3"):
        find_moe_layers(model)
    # only the config knows (no router attribute, no block attribute)
    config = _hf_config(K=3)
    model = _hand_made(config=config)
    for blk in model:
        del blk.gate.top_k
    assert {s.top_k for s in find_moe_layers(model)} == {3}
    config.num_experts_per_tok = 7
    with pytest.raises(UnsupportedModelError, match=r"top-k 7 .* not in \[1, E=6\]"):
        find_moe_layers(model)
    config.num_experts_per_tok = None
    with pytest.raises(UnsupportedModelError, match="no top-k was found"):
        find_moe_layers(model)


def test_fused_params_without_decorator_refused():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 32, 48))
            self.down_proj = nn.Parameter(torch.zeros(4, 48, 16))

    model = nn.Sequential(nn.Linear(48, 48), Fused())
    with pytest.raises(UnsupportedModelError, match=r"^1: unsupported, because Fused holds fused .*"
                                                   r"not decorated"):
        find_moe_layers(model)


# --- per-expert nn.Linear lists ----------------------------------------------------------------------
@pytest.mark.parametrize("expert_cls,names", [(GateUpDownExpert, ("gate_proj", "up_proj", "down_proj")),
                                              (W123Expert, ("w1", "w3", "w2"))])
def test_linear_list(expert_cls, names):
    model = ListMoEModel(L=3, H=48, I=32, E=6, K=2, expert_cls=expert_cls)
    specs = find_moe_layers(model)
    assert [s.name for s in specs] == [f"layers.{i}.mlp.experts" for i in range(3)]
    for i, s in enumerate(specs):
        block = model.layers[i]["mlp"]
        assert (s.kind, s.module, s.parent) == (KIND_LIST, block.experts, block)
        assert (s.num_experts, s.top_k, s.hidden, s.intermediate) == (6, 2, 48, 32)
        assert s.linear_names == names and s.stacked() is None
        g, u, d = s.expert(4)
        gate, up, down = (getattr(block.experts[4], n).weight for n in names)
        assert g is not gate and torch.equal(g, gate) and not g.requires_grad
        assert g.data_ptr() == gate.data_ptr() and torch.equal(u, up) and torch.equal(d, down)
    check_consistent(specs)
    # the block's own forward equals the SwiGLU of expert(e) under the block's routing
    block, spec = model.layers[1]["mlp"], specs[1]
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ids, w = block.route(x)
        torch.testing.assert_close(block(x), moe_reference(spec, x, ids, w), rtol=1e-5, atol=1e-5)
    _release_restore_round_trip(spec, x, None, None)
    spec.release()
    spec.release()
    assert sum(p.numel() for p in block.experts.parameters()) == 0
    assert block.gate.weight.numel() == 6 * 48                          # the router stays
    assert specs[0].expert(0)[0].numel() == 32 * 48                     # other layers keep theirs


def test_linear_list_top_k_from_num_experts_per_tok():
    model = ListMoEModel(L=1)
    blk = model.layers[0]["mlp"]
    del blk.top_k
    blk.num_experts_per_tok = 3
    assert find_moe_layers(model)[0].top_k == 3


def test_linear_list_guards():
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp\.experts\.0\.gate_proj: unsupported, "
                                                   r"because it has a bias"):
        find_moe_layers(ListMoEModel(bias=True))
    with pytest.raises(UnsupportedModelError, match=r"experts\.0: unsupported, because its activation "
                                                   r"act_fn is GELU"):
        find_moe_layers(ListMoEModel(act=nn.GELU()))
    # ReLU hidden in the forward, no attribute to read: the probe catches it
    with pytest.raises(UnsupportedModelError, match=r"experts\.0: unsupported, because its forward does "
                                                   r"not compute w2\(SiLU\(w1\(x\)\)·w3\(x\)\)"):
        find_moe_layers(ListMoEModel(expert_cls=ReluExpert))
    # mismatched shapes inside one list
    model = ListMoEModel(L=2, H=48, I=32, E=6)
    model.layers[1]["mlp"].experts[3] = GateUpDownExpert(48, 16)
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.experts\.3\.gate_proj: .*\[16, 48\].*"
                                                   r"same shapes"):
        find_moe_layers(model)
    # router without the experts' E
    model = ListMoEModel(L=2, E=6)
    model.layers[0]["mlp"].gate = nn.Linear(48, 8, bias=False)
    with pytest.raises(UnsupportedModelError, match=r"router layers\.0\.mlp\.gate maps 48 -> 8"):
        find_moe_layers(model)
    # no top-k anywhere
    model = ListMoEModel(L=1)
    del model.layers[0]["mlp"].top_k
    with pytest.raises(UnsupportedModelError, match="no top-k was found"):
        find_moe_layers(model)


def test_unknown_experts_list_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(48, 32)
            self.fc2 = nn.Linear(32, 48)

    model = ListMoEModel(L=2)
    model.layers[1]["mlp"].experts = nn.ModuleList(Odd() for _ in range(6))
    with pytest.raises(UnsupportedModelError) as info:
        find_moe_layers(model)
    msg = str(info.value)
    assert msg.startswith("layers.1.mlp.experts: unsupported, because its experts are Odd modules")
    assert "fc1: Linear" in msg and "(w1, w3, w2)" in msg
    # a module named experts that is not a list at all
    model = ListMoEModel(L=1)
    model.layers[0]["mlp"].experts = nn.Linear(48, 48)
    with pytest.raises(UnsupportedModelError, match=r"because it is named experts but is a Linear"):
        find_moe_layers(model)


def test_no_moe_at_all():
    model = nn.Sequential(nn.Embedding(64, 48), nn.Linear(48, 48), nn.Linear(48, 64))
    with pytest.raises(UnsupportedModelError,
                       match=r"^Sequential \(the whole model\): unsupported, because no MoE layers "
                             r"were found: looked for transformers>=5 experts modules .*w1, w3, w2"):
        find_moe_layers(model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        find_moe_layers("not a model")


def test_dense_transformers_model_has_no_moe():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM .*no MoE layers were found"):
        find_moe_layers(AutoModelForCausalLM.from_config(cfg))


# --- check_consistent --------------------------------------------------------------------------------
def test_consistent_intermediate_differs():
    pytest.importorskip("transformers")
    model = hf_model("qwen3_moe")
    ex = model.model.layers[1].mlp.experts
    ex.gate_up_proj = nn.Parameter(torch.randn(8, 2 * 16, 48))
    ex.down_proj = nn.Parameter(torch.randn(8, 48, 16))
    specs = find_moe_layers(model)
    assert specs[1].intermediate == 16
    with pytest.raises(ValueError, match=r"^MoE layer 1 \(model\.layers\.1\.mlp\.experts\) differs from "
                                         r"layer 0 \(model\.layers\.0\.mlp\.experts\): I = 16 there, 32"):
        check_consistent(specs)


def test_consistent_experts_differ():
    pytest.importorskip("transformers")
    model = hf_model("qwen3_moe")
    blk = model.model.layers[2].mlp
    blk.experts.gate_up_proj = nn.Parameter(torch.randn(6, 64, 48))
    blk.experts.down_proj = nn.Parameter(torch.randn(6, 48, 32))
    blk.experts.num_experts = blk.gate.num_experts = 6
    blk.gate.weight = nn.Parameter(torch.zeros(6, 48))
    with pytest.raises(ValueError, match=r"MoE layer 2 \(model\.layers\.2\.mlp\.experts\).*E = 6 there, 8"):
        check_consistent(find_moe_layers(model))


def test_consistent_top_k_and_dtype_differ():
    model = ListMoEModel(L=3)
    model.layers[2]["mlp"].top_k = 3
    model.layers[1]["mlp"].to(torch.bfloat16)
    specs = find_moe_layers(model)
    assert specs[1].dtype == torch.bfloat16                # the probe tolerates bf16 rounding
    # the FIRST differing layer is named, with the field and both values
    with pytest.raises(ValueError, match=r"MoE layer 1 .*dtype = torch\.bfloat16 there, torch\.float32"):
        check_consistent(specs)
    with pytest.raises(ValueError, match=r"MoE layer 2 .*top_k = 3 there, 2"):
        check_consistent([specs[0], specs[2]])
    with pytest.raises(ValueError, match="no MoE layers"):
        check_consistent([])
    one = dataclasses.replace(specs[0], hidden=64, index=5, name="x")
    with pytest.raises(ValueError, match=r"MoE layer 5 \(x\).*H = 64 there, 48"):
        check_consistent([specs[0], one])


def test_spec_repr_is_short():
    spec = find_moe_layers(ListMoEModel(L=1))[0]
    r = repr(spec)
    assert "Linear" not in r and "num_experts=6" in r and isinstance(spec, MoELayerSpec)
