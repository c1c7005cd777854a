"""The fused decode step (`cupool.fused.FusedStep`) on the CPU, with its reference backend
(`cupool.reference.dense` in torch ops): which layers it matches and why it refuses the others,
and one decode step's logits and cache writes against transformers' own forward on the same
cache, for tiny models of the families it runs; the kernels' references against transformers'
modules.

Tolerance: both run in bf16 and round where transformers rounds; what differs is the order of
float32 sums (the reference's matmuls against transformers' own, attention's softmax). Logits
are compared by relative Frobenius error (LOGIT_TOL) and must pick the same greedy token wherever
the transformers logits' top two are TIE apart.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import hf_model

pytest.importorskip("transformers")

from cupool.engine import NO_MASK, Engine, cache_kwarg  # noqa: E402
from cupool.fused import ABLATE, FusedLayer, FusedStep, Unsupported  # noqa: E402
from cupool.kvcache import SlotCache  # noqa: E402
from cupool.slotstate import StateSlotCache  # noqa: E402
from cupool.reference import dense as ref  # noqa: E402
from cupool.sampling import SamplingParams  # noqa: E402

LOGIT_TOL = 2e-2
TIE = 0.05
# the kernel-sized tiny models: head dims the attention kernel is built for (64), hidden a
# multiple of 8
SHAPES = {"qwen3_moe": dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2),
          "mixtral": dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2),
          "gpt_oss": dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2),
          # every layer a MoE block with a gated shared expert (tiny_models' layer 1 is dense)
          "qwen2_moe": dict(head_dim=64, num_attention_heads=2, num_key_value_heads=2,
                            mlp_only_layers=[])}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def fused_model(family: str, seed: int = 0, device="cpu", **overrides):
    model = hf_model(family, seed=seed, **{**SHAPES.get(family, {}), **overrides})
    with torch.no_grad():
        for m in model.modules():
            # shared experts and their sigmoid gates far from zero: with these, a step that
            # leaves the shared expert out is 0.52 off in LOGIT_TOL's measure, one that leaves
            # its gate out (a gate of 1) 0.38 (qwen2_moe, seed 12; the test below checks one)
            if hasattr(m, "shared_expert_gate"):
                m.shared_expert_gate.weight.normal_(0, 0.5)
            # shared experts and dense MLP layers (mlp_only_layers): far from zero too
            if isinstance(getattr(m, "gate_proj", None), torch.nn.Linear):
                for lin in (m.gate_proj, m.up_proj, m.down_proj):
                    lin.weight.normal_(0, 0.1)
    return model.to(device=device, dtype=torch.bfloat16)


def unmatched_layer_model(seed: int):
    """A tiny qwen3_moe whose layer 1 matches no fused pattern: a dense MLP (mlp_only_layers)
    whose act_fn goes by another name, so that it is a block of other modules (its forward
    unchanged)."""
    model = fused_model("qwen3_moe", seed=seed, mlp_only_layers=[1])
    mlp = model.model.layers[1].mlp
    mlp.act = mlp.act_fn
    del mlp.act_fn
    mlp.forward = lambda x: mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x))
    return model


def windows_of(cfg) -> list[int | None]:
    """Each layer's attention window as the engine gives the fused step (`Engine._sliding_window`;
    None: full attention)."""
    w = Engine._sliding_window(cfg)
    types = getattr(cfg, "layer_types", None) or [None] * cfg.num_hidden_layers
    return [w.get(t) if isinstance(w, dict) else w for t in types]


def masks_of(cfg, make):
    """The attention mask(s) transformers' forward takes, as the engine passes them: make(window,
    boolean) (boolean for SDPA, additive for eager attention: gpt-oss's), one a layer type where
    the engine's windows are by type (None for layers that keep states in place of keys)."""
    boolean = getattr(cfg, "_attn_implementation", "sdpa") == "sdpa"
    w = Engine._sliding_window(cfg)
    if isinstance(w, dict):
        return {t: None if window is NO_MASK else make(window, boolean)
                for t, window in w.items()}
    return make(w, boolean)


def prefill(model, cache: SlotCache, slot: int, ids: list[int]) -> None:
    """The engine's admission: the prompt into the slot's rows of the cache."""
    dev = cache.device
    cache.prefill_mode(slot, 0, len(ids))
    mask = masks_of(model.config, lambda w, b: cache.prefill_mask(torch.bfloat16, w, b))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=dev),
              position_ids=torch.arange(len(ids), device=dev)[None], attention_mask=mask,
              use_cache=True, **{cache_kwarg(model): cache})
    cache.decode_mode()
    cache.pos[slot] = len(ids)


def snapshot(cache: SlotCache):
    """Copies of the cache's keys and values (None for a layer that keeps states instead) and of
    its per-slot states."""
    keep = lambda ts: [None if t is None else t.clone() for t in ts]  # noqa: E731
    return (keep(cache.keys), keep(cache.values),
            cache.snapshot() if isinstance(cache, StateSlotCache) else [])


def restore(cache: SlotCache, snap) -> None:
    for dst, src in zip(cache.keys + cache.values, snap[0] + snap[1]):
        if dst is not None:
            dst.copy_(src)
    if isinstance(cache, StateSlotCache):
        cache.restore(snap[2])


@torch.inference_mode()
def compare_step(model, pool, backend: str, prompts, tok, max_len=40):
    """One decode step of len(prompts) slots by the fused step and by transformers' forward
    from the same cache; returns (fused logits, model logits, fused cache, model cache)."""
    dev = next(model.parameters()).device
    B = len(prompts)
    cache = StateSlotCache(model.config.num_hidden_layers, B, max_len, torch.bfloat16, dev)
    for b, p in enumerate(prompts):
        prefill(model, cache, b, p)
    step = FusedStep(model, pool, cache, B, windows_of(model.config), backend=backend)
    tok = torch.tensor(tok, device=dev)[:, None]
    active = torch.ones(B, dtype=torch.bool, device=dev)
    before = snapshot(cache)
    pos = cache.pos.clone()
    decode_masks = lambda: masks_of(  # noqa: E731
        model.config, lambda w, b: cache.decode_mask(torch.bfloat16, w, b))
    fused = step(tok, pos, active, decode_masks() if step.needs_mask else None).clone()
    after_fused = snapshot(cache)
    restore(cache, before)
    cache.decode_mode()
    out = model(input_ids=tok, position_ids=pos[:, None], use_cache=True,
                attention_mask=decode_masks(), **{cache_kwarg(model): cache})
    return fused, out.logits[:, -1], after_fused, snapshot(cache), step


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_reference_step_equals_transformers(family):
    model = fused_model(family, seed=7)
    fused, want, fc, mc, step = compare_step(model, None, "reference", [[5, 9, 3], [7, 1, 4, 4, 8, 2]],
                                             [11, 13])
    assert all(isinstance(l, FusedLayer) for l in step.layers), step.describe()
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for b in range(2):
        top2 = want[b].float().topk(2).values
        if float(top2[0] - top2[1]) >= TIE:
            assert int(fused[b].argmax()) == int(want[b].argmax())
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2


def gpt_oss_model(seed: int, device="cpu"):
    """A tiny gpt-oss whose sinks and router biases are far from zero (sinks that take most of
    each head's attention), so that a step leaving either out is far off."""
    model = fused_model("gpt_oss", seed=seed, device=device)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(3, 1)
            layer.mlp.router.bias.normal_(0, 1)
    return model


@torch.inference_mode()
def test_reference_step_runs_gpt_oss():
    """gpt-oss's layers are fused: attention sinks, biases on q/k/v/o, sliding-window layers
    between full ones, the rotary tables of D / 2 frequencies turning both halves of a head
    (`kernel_rotary`), and the router's bias with its softmax over the top-k logits. A prompt
    longer than the window (8), so the window cuts the sliding layers' keys; logits and cache
    writes against transformers' eager forward with its per-type masks."""
    from cupool.fused import kernel_rotary
    model = gpt_oss_model(seed=12)
    cfg = model.config
    assert cfg._attn_implementation == "eager"
    assert cfg.sliding_window == 8 and "sliding_attention" in cfg.layer_types
    prompts, tok = [[5, 9, 3, 7, 1, 4, 4, 8, 2, 6, 11, 3], [7, 1, 4]], [11, 13]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    assert all(isinstance(l, FusedLayer) for l in step.layers), step.describe()
    assert not step.needs_mask
    assert [l.attn.window for l in step.layers] == [8, 0, 8]
    assert step.rope_cos.shape == (40, 32) and step.cos.shape == (40, 64)
    assert torch.equal(step.cos[:, :32], step.cos[:, 32:])
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for b in range(len(prompts)):
        top2 = want[b].float().topk(2).values
        if float(top2[0] - top2[1]) >= TIE:
            assert int(fused[b].argmax()) == int(want[b].argmax())
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    # the comparison can fail: the same step without the sinks, or without the routers' biases,
    # is far off; the model's half tables taken for a partial rotary are refused
    tok_t, pos = torch.tensor(tok)[:, None], step.cache.pos.clone()
    active = torch.ones(len(prompts), dtype=torch.bool)
    for part in ("sinks", "bias"):
        kept = [(l.attn.sinks, l.router.biases) for l in step.layers]
        for l in step.layers:
            if part == "sinks":
                l.attn.sinks = None
            else:
                l.router.biases = None
        off = rel(step(tok_t, pos, active), want)
        assert off > 5 * LOGIT_TOL, (part, off)
        for l, (sk, bs) in zip(step.layers, kept):
            l.attn.sinks, l.router.biases = sk, bs
    assert rel(step(tok_t, pos, active), want) <= LOGIT_TOL
    with pytest.raises(Unsupported, match="covers 32 of the head's 128 dims"):
        kernel_rotary(step.rope_cos, step.rope_sin, 128, model.model.layers[0].self_attn)


def test_half_rotary_tables_need_the_models_own_rotation(monkeypatch):
    """`kernel_rotary` widens a table of D / 2 frequencies only where the attention's modeling
    file turns both halves of a head by it (gpt-oss); a partial rotary (the first n dims turned,
    the rest passed through: GLM's, NeoX's) is taken where n is a multiple of 64 (the kernel's
    ROT; here D = 8, so refused, and test_reference_step_runs_partial_rotary takes one), and an
    apply function that cannot take the table is refused, each with its reason."""
    import sys
    import types

    from cupool.fused import kernel_rotary
    D, L = 8, 6
    pos = torch.arange(L, dtype=torch.float32)[:, None]
    freqs = pos * torch.tensor([1.0, 0.5, 0.25, 0.125])                   # [L, D / 2]
    cos, sin = freqs.cos(), freqs.sin()

    def attention_of(apply):
        mod = types.ModuleType("modeling_probe")
        mod.apply_rotary_pos_emb = apply
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        return type("ProbeAttention", (torch.nn.Module,), {"__module__": mod.__name__})()

    def half_turn(x, c, s):          # gpt-oss: each half turned by the same D / 2 frequencies
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def partial(x, c, s):            # GLM's: the first n dims turned by rotate_half, rest kept
        n = c.shape[-1]
        r, keep = x[..., :n], x[..., n:]
        rot = torch.cat([-r[..., n // 2:], r[..., :n // 2]], dim=-1)
        return torch.cat([r * c + rot * s, keep], dim=-1)

    def llama(x, c, s):              # rotate_half with a table as wide as the head: cannot broadcast
        return x * c + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * s

    def wrap(f):
        return lambda q, k, c, s: (f(q, c[:, None], s[:, None]), f(k, c[:, None], s[:, None]))

    C, S, R = kernel_rotary(cos, sin, D, attention_of(wrap(half_turn)))
    assert C.shape == (L, D) and torch.equal(C[:, :4], cos) and torch.equal(C[:, 4:], cos)
    assert R is None
    with pytest.raises(Unsupported, match=r"partial rotary\): the attention kernel turns a "
                                          r"multiple of 64"):
        kernel_rotary(cos, sin, D, attention_of(wrap(partial)))
    with pytest.raises(Unsupported, match="did not take a probe"):
        kernel_rotary(cos, sin, D, attention_of(wrap(llama)))
    with pytest.raises(Unsupported, match="covers 2 of the head's 8 dims"):
        kernel_rotary(cos[:, :2], sin[:, :2], D, attention_of(wrap(half_turn)))
    with pytest.raises(Unsupported, match="neither as a partial rotary nor both halves"):
        kernel_rotary(cos, sin, D, attention_of(lambda q, k, c, s: (q, k)))


def test_reference_step_reads_nvfp4_projections():
    """Attention projections kept packed in NVFP4 (`dense_nvfp4.quantize_linears`): the step's QKV
    and o GEMVs take the packed forms (a 16-row tile of q/k ends where the next matrix starts),
    and compute what transformers computes with the Linears' (dequantized) weights. A projection
    without a packed form leaves its GEMV on the bf16 weights."""
    from cupool import dense_nvfp4
    model = fused_model("qwen3_moe", seed=9)
    assert dense_nvfp4.quantize_linears(model) == 4 * model.config.num_hidden_layers
    lin = model.model.layers[0].self_attn.q_proj
    assert torch.equal(dense_nvfp4.of(lin).dequantize(torch.bfloat16), lin.weight)
    del model.model.layers[2].self_attn.o_proj.cupool_nvfp4
    fused, want, fc, mc, step = compare_step(model, None, "reference",
                                             [[5, 9, 3], [7, 1, 4, 4, 8, 2]], [11, 13])
    assert "NVFP4 weights for qkv in 3 layers, o in 2 layers" in step.describe(), step.describe()
    assert step.nvfp4_gemvs() == {"qkv": 3, "o": 2}
    assert [l.o.nvfp4 for l in step.layers] == [True, True, False]
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2


def test_reference_step_fails_when_a_rounding_is_dropped(monkeypatch):
    """The comparison can fail: a reference that skips the residual add is far off."""
    model = fused_model("qwen3_moe", seed=8)
    real = ref.GemvReference.__call__

    def no_residual(self, x, **kw):
        if kw.get("residual") is not None:
            kw["residual"] = torch.zeros_like(kw["residual"])
        return real(self, x, **kw)

    monkeypatch.setattr(ref.GemvReference, "__call__", no_residual)
    fused, want, *_ = compare_step(model, None, "reference", [[5, 9, 3]], [11])
    assert rel(fused, want) > 0.1


@torch.inference_mode()
def test_ablate_leaves_each_part_out():
    """The profiling knob (`FusedStep.ablate`, profile_decode --ablate): leaving a part of every
    layer out changes the logits; an empty set gives the whole step's logits again."""
    model = fused_model("qwen3_moe", seed=10)
    cache = SlotCache(model.config.num_hidden_layers, 1, 40, torch.bfloat16, "cpu")
    prefill(model, cache, 0, [5, 9, 3, 7])
    step = FusedStep(model, None, cache, 1, [None] * len(cache.keys), backend="reference")
    tok, pos, active = torch.tensor([[11]]), cache.pos.clone(), torch.ones(1, dtype=torch.bool)
    before = snapshot(cache)

    def logits(parts):
        restore(cache, before)
        for buf in (step.h, step.h_mid, step.xn, step.moe, step.qkv, step.attn):
            buf.normal_()                   # what a part left out leaves: not the last step's
        step.ablate = frozenset(parts)
        return step(tok, pos, active).clone()

    whole = logits(())
    for part in set(ABLATE) - {"plan"}:          # "plan" needs the pool's kernels
        assert not torch.equal(logits([part]), whole), part
    assert torch.equal(logits(()), whole)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_dense_mlp_layers_are_fused(family, monkeypatch):
    """A dense MLP layer (mlp_only_layers=[1]) runs its gate and up GEMV (norming the residual
    stream itself) and its down GEMV in place of the router and the experts: every layer is
    fused and the logits match transformers'; a step that leaves the dense MLP out is far off."""
    model = fused_model(family, seed=9, mlp_only_layers=[1])
    with torch.no_grad():       # norms unlike each other: the MLP must take the post-attention one
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(1, 0.3)
            layer.post_attention_layernorm.weight.normal_(1, 0.3)
    prompts, tok = [[5, 9, 3], [2, 6]], [11, 4]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    assert [l.dense for l in step.layers] == [False, True, False]
    assert "a dense MLP in 1 layer" in step.describe(), step.describe()
    assert not step.needs_mask and step.layers[1].mlp.gate_up.norm
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    monkeypatch.setattr(FusedStep, "_gated_mlp_out",
                        lambda self, m, x, layer=None: torch.zeros_like(x))
    monkeypatch.setattr(FusedStep, "_with_shared", lambda self, layer: self.moe)
    without, want, _, _, _ = compare_step(model, None, "reference", prompts, tok)
    assert rel(without, want) > 10 * LOGIT_TOL, rel(without, want)


def test_layers_outside_the_pattern_run_transformers_modules():
    """A layer whose MLP is neither a MoE block of the pattern nor a dense gated MLP
    (`unmatched_layer_model`) runs the model's own module inside the step, and the logits still
    match."""
    qwen3 = unmatched_layer_model(seed=10)
    fused, want, _, _, step = compare_step(qwen3, None, "reference", [[5, 9, 3], [2, 6]], [11, 4])
    kinds = [type(l).__name__ for l in step.layers]
    assert kinds == ["FusedLayer", "ModelLayer", "FusedLayer"], kinds
    assert "mlp has modules" in step.layers[1].reason
    assert step.needs_mask
    assert rel(fused, want) <= LOGIT_TOL


def test_reference_step_runs_shared_experts(monkeypatch):
    """qwen2_moe's blocks: routed experts plus a shared expert scaled by a sigmoid gate, on the
    router's normed rows (two more GEMVs, the gate's row with the gate and up rows). Every layer
    is fused, and the logits and the cache's writes match transformers'; a step whose layers
    leave the shared expert out is far off (the test can fail)."""
    model = fused_model("qwen2_moe", seed=12)
    prompts, tok = [[5, 9, 3], [2, 6, 7, 1]], [11, 4]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    assert step.describe() == ("fused decode step: 3 of 3 layers; a shared expert in 3 "
                               "layers"), step.describe()
    assert all(l.mlp.gated and l.mlp.gate_up.N == 2 * l.mlp.size + 1 for l in step.layers)
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    monkeypatch.setattr(FusedStep, "_with_shared", lambda self, layer: self.moe)
    without, want, _, _, _ = compare_step(model, None, "reference", prompts, tok)
    assert rel(without, want) > 10 * LOGIT_TOL, rel(without, want)



def test_layer_whose_attention_does_not_match_fuses_its_mlp_half(monkeypatch):
    """A layer of the common layout whose attention the kernels do not take (here one that says
    it soft-caps its logits, which Qwen3-MoE's attention does not read) runs transformers'
    module with its MLP half on the step's own path (a MixerLayer: its router GEMV called on the
    module's residual sum, the module adding the residual back): the logits still match, and
    dropping that layer's routed experts from the step makes them far off. A layer whose MLP
    does not match runs the whole module (a ModelLayer: `unmatched_layer_model` above)."""
    from cupool.fused import MixerLayer
    model = fused_model("qwen3_moe", seed=12)
    model.model.layers[1].self_attn.attn_logit_softcapping = 30.0
    halves = []
    run = FusedStep._mlp_half

    def counted(self, layer, h_mid, active, skip_plan):
        halves.append(layer.index)
        return run(self, layer, h_mid, active, skip_plan)

    monkeypatch.setattr(FusedStep, "_mlp_half", counted)
    fused, want, _, _, step = compare_step(model, None, "reference", [[5, 9, 3], [2, 6]], [11, 4])
    kinds = [type(l).__name__ for l in step.layers]
    assert kinds == ["FusedLayer", "MixerLayer", "FusedLayer"], kinds
    assert halves == [0, 1, 2], halves
    assert "transformers' token mixers for layers [1], their MLPs fused " \
           "(model.layers.1.self_attn has attn_logit_softcapping)" in step.describe(), \
        step.describe()
    assert step.needs_mask and step.narrow_why() is not None
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    mixer = step.layers[1]
    assert isinstance(mixer, MixerLayer) and model.model.layers[1].mlp is mixer.module.mlp
    monkeypatch.setattr(FusedStep, "_with_shared",
                        lambda self, layer: self.moe.zero_() if layer.index == 1 else self.moe)
    without, want, _, _, _ = compare_step(model, None, "reference", [[5, 9, 3], [2, 6]], [11, 4])
    assert rel(without, want) > 5 * LOGIT_TOL, rel(without, want)


def test_mlp_without_silu_is_not_fused():
    """A shared expert whose act_fn is not SiLU (GELU here) cannot take the down GEMV's GLU
    prologue: its layer runs transformers' module, with the reason named, and the logits still
    match; the other layers stay fused."""
    model = fused_model("qwen2_moe", seed=12)
    model.model.layers[1].mlp.shared_expert.act_fn = torch.nn.GELU()
    fused, want, _, _, step = compare_step(model, None, "reference", [[5, 9, 3], [2, 6]], [11, 4])
    kinds = [type(l).__name__ for l in step.layers]
    assert kinds == ["FusedLayer", "ModelLayer", "FusedLayer"], kinds
    assert "shared_expert.act_fn (GELU) is not SiLU" in step.layers[1].reason, \
        step.layers[1].reason
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)


def sigmoid_routed(cfg, device):
    """The causal LM of `cfg` (a family with sigmoid routers) in bf16 on `device`: its routers'
    weights and correction biases, experts, shared experts and dense MLPs, and q/k/v biases where
    it has them, far from zero, so that a step that leaves any of them out is far off."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.3)
                m.weight.normal_(0, 0.1)
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
                m.gate_up_proj.normal_(0, 0.2)
                m.down_proj.normal_(0, 0.2)
            if isinstance(getattr(m, "gate_proj", None), torch.nn.Linear):
                for lin in (m.gate_proj, m.up_proj, m.down_proj):
                    lin.weight.normal_(0, 0.1)
            if getattr(getattr(m, "q_proj", None), "bias", None) is not None:
                for lin in (m.q_proj, m.k_proj, m.v_proj):
                    lin.bias.normal_(0, 0.5)
    return model.to(device=device, dtype=torch.bfloat16)


def dots1_model(seed: int, device="cpu"):
    """A tiny dots.llm1 (transformers' `dots1`): layer 0 a dense MLP, layers 1 and 2 MoE blocks
    with a sigmoid router (its e_score_correction_bias far from zero, one expert group, weights
    renormalised and scaled by 2.5) and an ungated shared expert; q/k norms over the head dim."""
    from transformers import AutoConfig
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "dots1", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return sigmoid_routed(cfg, device)


@torch.inference_mode()
def test_reference_step_runs_sigmoid_routers_and_ungated_shared_experts():
    """dots.llm1's layers (a dense first layer, then sigmoid routers with a correction bias and
    ungated shared experts) are all fused; the routers pass their probe against
    `ref.route_sigmoid` and one step's logits and cache writes match transformers'. A step whose
    routers leave the correction bias out is far off (the test can fail)."""
    model = dots1_model(seed=1)
    prompts, tok = [[5, 9, 3], [2, 6, 7, 1]], [11, 4]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    assert step.describe() == ("fused decode step: 3 of 3 layers; a shared expert in 2 layers; "
                               "a sigmoid router in 2 layers; a dense MLP in 1 layer"), \
        step.describe()
    assert [l.dense for l in step.layers] == [True, False, False]
    for l in step.layers[1:]:
        assert not l.mlp.gated and l.router.sigmoid[1] == 2.5 and l.norm_topk
        assert l.router.sigmoid[0].dtype == torch.float32
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    for l in step.layers[1:]:
        l.router.sigmoid = (torch.zeros_like(l.router.sigmoid[0]), l.router.sigmoid[1])
    cache = SlotCache(3, 2, 40, torch.bfloat16, "cpu")
    for b, p in enumerate(prompts):
        prefill(model, cache, b, p)
    step.cache = cache
    unbiased = step(torch.tensor(tok)[:, None], cache.pos.clone(), torch.ones(2, dtype=torch.bool))
    assert rel(unbiased, want) > 5 * LOGIT_TOL, rel(unbiased, want)


def glm4_moe_model(seed: int, device="cpu"):
    """A tiny GLM-4.5-Air (transformers' `glm4_moe`): partial rotary (the first 64 of the
    head's 128 dims), q/k/v biases far from zero, no q/k norm; layer 0 a dense MLP, layers 1 and
    2 MoE blocks with a sigmoid router (one expert group, its correction bias far from zero) and
    an ungated shared expert."""
    from transformers import AutoConfig
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "glm4_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return sigmoid_routed(cfg, device)


@torch.inference_mode()
def test_reference_step_runs_glm4_moe():
    """GLM-4.5-Air's layers are all fused: the attention turns the first 64 of 128 dims
    (`kernel_rotary` pads the model's tables, the kernel's ROT), then the sigmoid routers and
    shared experts; logits and cache writes match transformers'. The same step turning every dim
    writes keys far from transformers' (the test can fail)."""
    model = glm4_moe_model(seed=0)
    prompts, tok = [[5, 9, 3], [2, 6, 7, 1]], [11, 4]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    assert step.describe() == ("fused decode step: 3 of 3 layers; a shared expert in 2 layers; "
                               "a sigmoid router in 2 layers; a dense MLP in 1 layer"), \
        step.describe()
    assert step.rotary_dims == 64 and step.rope_cos.shape == (40, 64)
    assert step.cos.shape == (40, 128) and (step.cos[:, 64:] == 1).all()
    assert all(l.attn.rotary_dims == 64 for l in step.layers)
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for k_f, k_m in zip(fc[0] + fc[1], mc[0] + mc[1]):
        assert rel(k_f, k_m) <= 1e-2
    for l in step.layers:
        l.attn.rotary_dims = None
    cache = SlotCache(3, 2, 40, torch.bfloat16, "cpu")
    for b, p in enumerate(prompts):
        prefill(model, cache, b, p)
    step.cache = cache
    pos = cache.pos.clone()
    step(torch.tensor(tok)[:, None], pos, torch.ones(2, dtype=torch.bool))
    for i in range(3):                  # the step's new key rows against transformers'
        new = cache.keys[i][torch.arange(2), :, pos]
        assert rel(new, mc[0][i][torch.arange(2), :, pos]) > 0.1, i


def qwen3_next_model(seed: int, device="cpu", family: str = "qwen3_next", delta_dim: int = 32):
    """A tiny Qwen3-Next (transformers' `qwen3_next`; `qwen3_5_moe_text`: Qwen3.5's, the same
    layers under a multimodal rotary embedding, and its own in-projection layout): gated delta
    nets at layers 0 and 2 (2 key heads and 4 value heads of `delta_dim`), gated full attention
    at 1 and 3 (q_proj's rows each head's query then its output gate; 2 heads of 256 over 1 KV
    head, rotary over the first 64 dims), every RMSNorm of the (1 + w) kind with its weights far
    from zero, MoE blocks with a gated shared expert in every layer."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    own = (dict(intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[],
                partial_rotary_factor=0.25, norm_topk_prob=True)
           if family == "qwen3_next" else {})
    cfg = AutoConfig.for_model(
        family, vocab_size=128, hidden_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, num_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=delta_dim, linear_value_head_dim=delta_dim,
        linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.15, tie_word_embeddings=False, **own)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):          # the (1 + w) norms
                m.weight.normal_(0, 0.5)
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
                m.gate_up_proj.normal_(0, 0.2)
                m.down_proj.normal_(0, 0.2)
    return model.to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
@torch.inference_mode()
def test_reference_step_runs_qwen3_next(family):
    """Qwen3-Next's (and Qwen3.5's) layers are all fused: the full-attention ones with (1 + w)
    RMSNorms (input, post-attention, q/k and final), q_proj's interleaved queries and output
    gates (attention · sigmoid(gate)), rotary over the first 64 of 256 dims (Qwen3.5's multimodal
    rotary giving text positions' tables); the gated delta nets on delta_decode (DeltaLayer:
    Qwen3-Next's grouped in-projections, Qwen3.5's flat ones, the convolution and recurrent states
    in the engine's cache); a gated shared expert in every layer. Logits, cache writes and the
    delta nets' states match transformers'. The same step without the output gate, with plain
    norms, without the delta net layers' shared experts, or reading the in-projections in the
    other layout is far off (the test can fail)."""
    from cupool.fused import DeltaLayer
    model = qwen3_next_model(seed=4, family=family)
    prompts, tok = [[5, 9, 3], [2, 6, 7, 1]], [11, 4]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    kinds = [type(l).__name__ for l in step.layers]
    assert kinds == ["DeltaLayer", "FusedLayer"] * 2, kinds
    assert step.describe() == (
        "fused decode step: 4 of 4 layers; gated delta nets in layers [0, 2]; a shared expert in "
        "4 layers; gated attention in 2 layers; (1 + w) RMSNorms"), step.describe()
    assert step.layers[0].delta.grouped == (family == "qwen3_next")
    assert step.rotary_dims == 64 and step.qkv.shape == (2, (2 * 2 + 2) * 256)
    assert step.delta_in.shape == (2, 2 * 2 * 32 + 2 * 4 * 32 + 2 * 4)
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for i in (1, 3):
        assert rel(fc[0][i], mc[0][i]) <= 1e-2 and rel(fc[1][i], mc[1][i]) <= 1e-2
    assert len(fc[2]) == 4                      # two layers' convolution and recurrent states
    for s_f, s_m in zip(fc[2], mc[2]):
        assert rel(s_f, s_m) <= 1e-2, rel(s_f, s_m)
    cache = StateSlotCache(4, 2, 40, torch.bfloat16, "cpu")
    for b, p in enumerate(prompts):
        prefill(model, cache, b, p)
    step.cache, before = cache, snapshot(cache)
    for mend in ("q_gate", "one_plus", "delta_mlp", "layout"):
        restore(cache, before)
        if mend == "q_gate":
            step.attn_gate = None
        for l in step.layers[1::2]:
            if mend == "one_plus":
                l.qkv.one_plus = l.router.one_plus = l.attn.one_plus = False
        for l in step.layers[0::2]:
            assert isinstance(l, DeltaLayer)
            if mend == "delta_mlp":   # the gated delta net layers' MLP halves are the step's own
                l.mlp = None
            if mend == "layout":
                l.delta.grouped = not l.delta.grouped
        got = step(torch.tensor(tok)[:, None], cache.pos.clone(), torch.ones(2, dtype=torch.bool))
        assert rel(got, want) > 5 * LOGIT_TOL, (mend, rel(got, want))


@torch.inference_mode()
def test_reference_step_runs_other_delta_nets_as_mixer_layers():
    """A gated delta net of head dims delta_decode is not built for (16) runs transformers'
    module on the same cache and states, with its MLP half on the step's own GEMVs (MixerLayer);
    the reason is in describe(), and the logits, cache writes and states match transformers'."""
    model = qwen3_next_model(seed=4, delta_dim=16)
    prompts, tok = [[5, 9, 3], [2, 6, 7, 1]], [11, 4]
    fused, want, fc, mc, step = compare_step(model, None, "reference", prompts, tok)
    kinds = [type(l).__name__ for l in step.layers]
    assert kinds == ["MixerLayer", "FusedLayer"] * 2, kinds
    assert step.describe() == (
        "fused decode step: 2 of 4 layers; transformers' token mixers for layers [0, 2], their "
        "MLPs fused (model.layers.0.linear_attn: key / value head dims 16 / 16; delta_decode is "
        "built for (32, 64, 128)); a shared expert in 4 layers; gated attention in 2 layers; "
        "(1 + w) RMSNorms"), step.describe()
    assert step.delta_in is None
    assert rel(fused, want) <= LOGIT_TOL, rel(fused, want)
    for s_f, s_m in zip(fc[2], mc[2]):
        assert rel(s_f, s_m) <= 1e-2, rel(s_f, s_m)


def test_sigmoid_router_refusals_name_the_reason():
    """A sigmoid router that keeps some of several expert groups, one with a bias on its logits
    too, or one whose weight is float32, is refused with the reason (its layer then runs
    transformers' module)."""
    from cupool.fused import check_sigmoid_router
    gate = dots1_model(seed=2).model.layers[1].mlp.gate
    E, H, K = gate.weight.shape[0], gate.weight.shape[1], gate.top_k
    assert check_sigmoid_router(gate, "gate", E, H, K)[:2] == (True, torch.float32)
    gate.n_group, gate.topk_group = 4, 2
    with pytest.raises(Unsupported, match="keeps 2 of 4 expert groups"):
        check_sigmoid_router(gate, "gate", E, H, K)
    gate.n_group = gate.topk_group = 1
    gate.bias = torch.nn.Parameter(torch.zeros(E, dtype=torch.bfloat16))
    with pytest.raises(Unsupported, match="a bias on its logits besides the correction bias"):
        check_sigmoid_router(gate, "gate", E, H, K)
    del gate.bias
    gate.weight.data = gate.weight.float()
    with pytest.raises(Unsupported, match="weight is torch.float32"):
        check_sigmoid_router(gate, "gate", E, H, K)


def test_shared_expert_refusals_name_the_reason():
    """A shared expert's gate that is not a Linear to one output, or a `shared_expert` without
    its `shared_expert_gate` (a block of other modules: the ungated ones are `shared_experts`),
    leaves the layer to transformers' module, with the reason said."""
    model = fused_model("qwen2_moe", seed=13)
    H = model.config.hidden_size
    mlp0, mlp1 = model.model.layers[0].mlp, model.model.layers[1].mlp
    mlp0.shared_expert_gate = torch.nn.Linear(H, 2, bias=False, dtype=torch.bfloat16)
    del mlp1.shared_expert_gate
    cache = SlotCache(3, 1, 16, torch.bfloat16, "cpu")
    step = FusedStep(model, None, cache, 1, [None] * 3, backend="reference")
    kinds = [type(l).__name__ for l in step.layers]
    assert kinds == ["ModelLayer", "ModelLayer", "FusedLayer"], kinds
    assert "shared_expert_gate is [2, " in step.layers[0].reason, step.layers[0].reason
    assert "not a MoE block of" in step.layers[1].reason, step.layers[1].reason


def test_refusals_name_the_reason():
    small = hf_model("qwen3_moe", seed=11).to(torch.bfloat16)           # head_dim 16
    cache = SlotCache(3, 1, 16, torch.bfloat16, "cpu")
    with pytest.raises(Unsupported, match="head dims"):
        FusedStep(small, None, cache, 1, [None] * 3, backend="reference")
    f32 = hf_model("qwen3_moe", seed=11, **SHAPES["qwen3_moe"])
    with pytest.raises(Unsupported, match="bf16"):
        FusedStep(f32, None, cache, 1, [None] * 3, backend="reference")
    with pytest.raises(Unsupported, match="pooled models"):
        FusedStep(f32, None, cache, 1, [None] * 3)
    with pytest.raises(ValueError, match="backend"):
        FusedStep(f32, None, cache, 1, [None] * 3, backend="fast")
    # a rotary embedding that does not take [1, L] position ids (as a multimodal one would not,
    # were it not recognised): refused with its error, not raised as that error
    model = fused_model("qwen3_moe", seed=11)

    def wants_3d(x, position_ids):
        return position_ids[:, :, None, :]

    model.model.rotary_emb.forward = wants_3d
    with pytest.raises(Unsupported, match=r"model.rotary_emb \(\w+\) does not take position "
                                          r"ids \[1, 16\]: IndexError"):
        FusedStep(model, None, cache, 1, [None] * 3, backend="reference")


def test_attention_shapes_the_kernel_takes():
    """The P·V sums of ceil(G / 8) MMA tiles of 8 heads take D / 4 registers each: at most 64."""
    from cupool.ops.dense_attention import AttentionWorkspace, DecodeAttention, shape_fits
    fits = [(8, 128), (8, 256), (16, 128), (12, 128), (8, 192), (32, 64), (1, 256)]
    too_big = [(9, 192), (9, 256), (17, 128), (33, 64)]
    assert all(shape_fits(G, D) for G, D in fits)
    assert not any(shape_fits(G, D) for G, D in too_big)
    assert not shape_fits(8, 96)                     # not a head dim the kernel is built for
    ws = AttentionWorkspace(1, 18, 2, 192, 4, "cpu")
    with pytest.raises(ValueError, match=r"9 query heads a KV head of 192 dims"):
        DecodeAttention(18, 2, 192, scale=0.1, workspace=ws)


def test_norm_probe_tells_the_two_rmsnorms_and_refuses_others():
    """The norm probe: transformers' RMSNorm (weight · x̂ rounded) and Qwen3-Next's (x̂ · (1 + w)
    in float32, rounded once) are told apart on their own weights; a (1 + w) norm that rounds
    x̂ first, or one without the weight, is refused with the reason."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from cupool.fused import check_rms_norm
    torch.manual_seed(0)
    plain, one_plus = Qwen3MoeRMSNorm(16, eps=1e-5), Qwen3NextRMSNorm(16, eps=1e-6)
    for n in (plain, one_plus):
        with torch.no_grad():
            n.weight.normal_(0, 0.5)
        n.to(torch.bfloat16)
    assert check_rms_norm(plain, "norm", 16) == (1e-5, False)
    assert check_rms_norm(one_plus, "norm", 16) == (1e-6, True)

    class RoundedOnePlus(torch.nn.Module):           # (1 + w) times x̂ rounded to bf16 first
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16))
            self.eps = 1e-6

        def forward(self, x):
            return ref.rms_norm(x, 1 + self.weight, self.eps)

    class Unweighted(RoundedOnePlus):
        def forward(self, x):
            return ref.rms_norm(x, torch.ones_like(self.weight), self.eps)

    for norm in (RoundedOnePlus(), Unweighted()):
        with pytest.raises(Unsupported, match="computes neither transformers' RMSNorm"):
            check_rms_norm(norm, "norm", 16)


def test_router_probe_takes_a_logit_bias_and_refuses_others():
    """gpt-oss's router (a bias on its logits, softmax over the top-k logits) passes the probe as
    a renormalised softmax top-k; a bias of another dtype or length, a bias that only chooses
    experts (DeepSeek's e_score_correction_bias) and a sigmoid router with a bias are refused
    with the reason."""
    from cupool.fused import check_router
    router = gpt_oss_model(seed=5).model.layers[0].mlp.router
    E, H, K = router.weight.shape[0], router.weight.shape[1], router.top_k
    assert check_router(router, "router", E, H, K) == (True, torch.bfloat16)
    with torch.no_grad():
        router.bias.data = router.bias.float()
    with pytest.raises(Unsupported, match=r"bias of torch.float32 \[8\], not a torch.bfloat16"):
        check_router(router, "router", E, H, K)
    router.bias.data = router.bias.to(torch.bfloat16)[:-1]
    with pytest.raises(Unsupported,
                       match=r"bias of torch.bfloat16 \[7\], not a torch.bfloat16 \[8\]"):
        check_router(router, "router", E, H, K)
    router.bias.data = torch.full((E,), 2.0, dtype=torch.bfloat16)
    router.register_buffer("e_score_correction_bias", torch.zeros(E))
    with pytest.raises(Unsupported, match="chooses experts"):
        check_router(router, "router", E, H, K)
    del router.e_score_correction_bias

    class Sigmoid(torch.nn.Module):                # a sigmoid router with a bias: refused
        def __init__(self, inner):
            super().__init__()
            self.weight, self.bias, self.top_k = inner.weight, inner.bias, inner.top_k

        def forward(self, x):
            logits = torch.nn.functional.linear(x, self.weight, self.bias)
            w, ids = torch.sigmoid(logits.float()).topk(self.top_k, dim=-1)
            return logits, w.to(logits.dtype), ids

    with torch.no_grad():
        router.bias.normal_(0, 1)
    with pytest.raises(Unsupported, match="not a softmax top-k router"):
        check_router(Sigmoid(router), "router", E, H, K)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_reference_equals_transformers_router(family):
    """route_topk on the router's own logits gives its ids and weights (and the weights' dtype:
    Qwen3 returns bf16, Mixtral float32)."""
    model = fused_model(family, seed=12)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(9, model.config.hidden_size).to(torch.bfloat16)
    logits, w, ids = gate(x)
    norm = getattr(gate, "norm_topk_prob", True)
    got_ids, got_w = ref.route_topk(logits, ids.shape[1], norm, w.dtype)
    assert torch.equal(got_ids.long().sort(-1).values, ids.long().sort(-1).values)
    assert got_w.dtype == w.dtype
    assert torch.allclose(got_w.float().sort(-1).values, w.float().sort(-1).values, rtol=1e-2)


def test_route_ties_nan_and_inactive():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, float("nan"), 2.0, 1.0],
                           [5.0, 4.0, 3.0, 2.0]]).to(torch.bfloat16)
    ids, w = ref.route_topk(logits, 2, True, torch.float32,
                            active=torch.tensor([True, True, False]))
    assert ids.tolist()[0] == [1, 2]                 # a tie goes to the lower expert
    assert ids.tolist()[1][0] == -1 or True
    assert ids.tolist()[2] == [-1, -1] and w[2].tolist() == [0.0, 0.0]


def test_attention_reference_equals_sdpa():
    """attention_decode against torch's SDPA on the same queries, keys and values (float32)."""
    torch.manual_seed(0)
    B, nh, hk, D, L = 2, 4, 2, 64, 20
    qkv = torch.randn(B, (nh + 2 * hk) * D).to(torch.bfloat16)
    kc = torch.randn(B, hk, L, D).to(torch.bfloat16)
    vc = torch.randn(B, hk, L, D).to(torch.bfloat16)
    cos = torch.ones(L, D, dtype=torch.bfloat16)
    sin = torch.zeros(L, D, dtype=torch.bfloat16)
    pos = torch.tensor([5, 19])
    out = ref.attention_decode(qkv, nh, hk, None, None, 1e-6, cos, sin, pos, kc, vc, D ** -0.5)
    for b in range(B):
        P = int(pos[b])
        q = qkv[b, :nh * D].reshape(nh, 1, D).float()
        k = kc[b, :, :P + 1].float().repeat_interleave(nh // hk, 0)
        v = vc[b, :, :P + 1].float().repeat_interleave(nh // hk, 0)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v).reshape(-1)
        assert rel(out[b], want) <= 1e-2
    assert torch.equal(kc[0, :, 5], qkv[0, nh * D:(nh + hk) * D].reshape(hk, D))


# --- launch shapes (DenseGemv's warps / split_k, CUPOOL_DENSE_SHAPE) ------------------------------
def test_dense_gemv_validates_the_launch_shape():
    """warps and split_k are checked before the weights' device, so this runs without a GPU: a
    shape that passes reaches the device check."""
    from cupool.ops.dense_gemv import ROUTE, DenseGemv
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    for kw, name in ((dict(warps=6), "warps"), (dict(warps=True), "warps"),
                     (dict(warps=4.0), "warps"), (dict(split_k=0), "split_k"),
                     (dict(split_k=17), "split_k"), (dict(split_k=2.0), "split_k"),
                     (dict(split_k=True), "split_k"), (dict(split_k=9), "split_k=9"),
                     (dict(warps=4, split_k=16), "split_k=16")):
        with pytest.raises(ValueError, match=name):
            DenseGemv([w], tokens=1, **kw)
    for kw in (dict(warps=4), dict(split_k=8), dict(warps=4, split_k=8), dict(warps=8)):
        with pytest.raises(ValueError, match="CUDA device"):
            DenseGemv([w], tokens=1, epilogue=ROUTE, **kw)


def test_launch_shape_check_lets_a_small_k_run_unsplit():
    """K below 32 columns is the plain kernel's case (its tests run K = 8); only a split needs
    32 columns a slice."""
    from cupool.ops.dense_gemv import check_launch_shape
    for warps in (4, 8):
        check_launch_shape(warps, 1, 8)
        check_launch_shape(warps, 2, 64)
        with pytest.raises(ValueError, match="split_k=2 leaves less than 32 columns of K=63"):
            check_launch_shape(warps, 2, 63)


def test_route_capacity_follows_the_warps():
    """One warp routes one token: blocks of 4 warps hold 4 tokens' logits at a time, not 8."""
    from cupool.ops.dense_gemv import route_capacity
    assert route_capacity(1, 4) == route_capacity(1, 8) == route_capacity(1)
    assert route_capacity(8, 4) == 2 * route_capacity(8, 8)
    assert route_capacity(16, 4) == 2 * route_capacity(16, 8)
    assert route_capacity(1, 4) >= 128 and route_capacity(8, 8) >= 512


def test_dense_shape_parser():
    from cupool.fused import parse_dense_shape
    assert parse_dense_shape("") == {}
    assert parse_dense_shape("qkv=w4,o=k2,router=k8") == {
        "qkv": {"warps": 4}, "o": {"split_k": 2}, "router": {"split_k": 8}}
    assert parse_dense_shape("head=w8k16") == {"head": {"warps": 8, "split_k": 16}}
    assert parse_dense_shape("attn=ahead,qkv=w4") == {"attn": {"ahead": True}, "qkv": {"warps": 4}}
    assert parse_dense_shape("attn=plain,qkv=w8k1") == {"attn": {"ahead": False},
                                                       "qkv": {"warps": 8, "split_k": 1}}
    assert parse_dense_shape("attn=aheadc256") == {"attn": {"ahead": True, "min_chunk": 256}}
    assert parse_dense_shape("attn=plainc64") == {"attn": {"ahead": False, "min_chunk": 64}}
    assert parse_dense_shape("attn=c128,o=k2") == {"attn": {"min_chunk": 128},
                                                   "o": {"split_k": 2}}
    from cupool.fused import DEFAULT_DENSE_SHAPE
    parse_dense_shape(DEFAULT_DENSE_SHAPE)
    for bad, why in (("qkv=w5", "warps"), ("o=k0", "split_k"), ("o=k17", "split_k"),
                     ("ffn=w4", "gemv one of"), ("qkv=w4,qkv=k2", "twice"), ("qkv=", "shape"),
                     ("qkv", "gemv one of"), ("qkv=w4,", "gemv one of"), ("qkv=k2w4", "shape"),
                     ("qkv=w4 ", "shape"), ("qkv=w4;o=k2", "shape"), ("QKV=w4", "gemv one of"),
                     ("attn=w4", "not ahead"), ("attn=ahead,attn=ahead", "twice"),
                     ("attn=Plain", "not ahead"), ("attn=c100", "min_chunk"),
                     ("attn=aheadc0", "min_chunk"), ("attn=c8192", "min_chunk"),
                     ("attn=cahead", "not ahead"), ("attn=c", "not ahead"),
                     ("attn", "gemv one of")):
        with pytest.raises(ValueError, match="CUPOOL_DENSE_SHAPE") as e:
            parse_dense_shape(bad)
        assert why in str(e.value) and repr(bad) in str(e.value), (bad, str(e.value))


def test_fused_step_takes_the_dense_shape_from_the_environment(monkeypatch):
    """Each GEMV is built with the shape CUPOOL_DENSE_SHAPE names for it (none: no keywords, the
    default builds); a split_k a GEMV's K cannot take raises, naming the variable, rather than
    leaving the layer unfused; the step's logits are the same."""
    import cupool.fused as fused
    built = []

    class Recording(ref.GemvReference):
        def __init__(self, weights, biases=None, **kw):
            built.append((sum(w.shape[0] for w in weights), weights[0].shape[1],
                          {k: kw[k] for k in ("warps", "split_k") if k in kw}))
            super().__init__(weights, biases, **kw)

    monkeypatch.setattr(fused, "GemvReference", Recording)
    monkeypatch.setattr(fused, "DEFAULT_DENSE_SHAPE", "")     # the defaults: the next test
    model = fused_model("qwen3_moe", seed=12)           # H = 48, o-projection K = 4 · 64
    monkeypatch.delenv("CUPOOL_DENSE_SHAPE", raising=False)
    base, want, *_ = compare_step(model, None, "reference", [[5, 9, 3]], [11])
    assert built and all(kw == {} for *_, kw in built)
    built.clear()
    monkeypatch.setenv("CUPOOL_DENSE_SHAPE", "qkv=w4,o=w4k8,head=w4")
    got, _, _, _, step = compare_step(model, None, "reference", [[5, 9, 3]], [11])
    assert "CUPOOL_DENSE_SHAPE=qkv=w4,o=w4k8,head=w4" in step.describe()
    vocab = model.lm_head.weight.shape[0]
    assert built[0] == (vocab, 48, {"warps": 4})                           # the head
    layers = built[1:]              # each layer's router first (its MLP half is matched first)
    assert len(layers) == 3 * 3
    assert all(kw == {} for _, K, kw in layers[0::3])                     # router
    assert all(kw == {"warps": 4} for _, K, kw in layers[1::3])           # qkv
    assert all(kw == {"warps": 4, "split_k": 8} for _, K, kw in layers[2::3])   # o
    assert torch.equal(got, base)
    for value, gemv in (("o=k9", "o"), ("router=k2", "router"), ("qkv=w4,head=k2", "head")):
        monkeypatch.setenv("CUPOOL_DENSE_SHAPE", value)
        with pytest.raises(ValueError, match=f"CUPOOL_DENSE_SHAPE='{value}': {gemv}: split_k") as e:
            compare_step(model, None, "reference", [[5, 9, 3]], [11])
        assert not isinstance(e.value, Unsupported)
    attn_kw = []

    class RecordingAttention(ref.AttentionReference):
        def __init__(self, *args, **kw):
            attn_kw.append((kw.get("ahead"), kw.get("min_chunk")))
            super().__init__(*args, **kw)

    monkeypatch.setattr(fused, "AttentionReference", RecordingAttention)
    monkeypatch.setenv("CUPOOL_DENSE_SHAPE", "attn=ahead")
    got, *_ = compare_step(model, None, "reference", [[5, 9, 3]], [11])
    assert attn_kw == [(True, None)] * 3 and torch.equal(got, base)
    # attn=c<n> changes only the parts: the default's build stays
    monkeypatch.setattr(fused, "DEFAULT_DENSE_SHAPE", "attn=ahead")
    for value, want in (("attn=c128", (True, 128)), ("attn=plainc256", (False, 256))):
        attn_kw.clear()
        monkeypatch.setenv("CUPOOL_DENSE_SHAPE", value)
        got, _, _, _, step = compare_step(model, None, "reference", [[5, 9, 3]], [11])
        assert attn_kw == [want] * 3 and torch.equal(got, base), (value, attn_kw)
        assert step.workspace.num_parts == 1            # 40 positions: one part of >= 128
    monkeypatch.setenv("CUPOOL_DENSE_SHAPE", "qkv=w3")
    with pytest.raises(ValueError, match="CUPOOL_DENSE_SHAPE='qkv=w3'"):
        compare_step(model, None, "reference", [[5, 9, 3]], [11])


def test_default_shapes_yield_to_the_environment_and_to_small_k(monkeypatch):
    """DEFAULT_DENSE_SHAPE applies to the GEMVs CUPOOL_DENSE_SHAPE does not name, with a split_k
    lowered to what a GEMV's K takes (no error: the user asked for nothing); a GEMV the
    variable names gets exactly that shape."""
    import cupool.fused as fused
    built = []

    class Recording(ref.GemvReference):
        def __init__(self, weights, biases=None, **kw):
            built.append((weights[0].shape[1], {k: kw[k] for k in ("warps", "split_k") if k in kw}))
            super().__init__(weights, biases, **kw)

    monkeypatch.setattr(fused, "GemvReference", Recording)
    monkeypatch.setattr(fused, "DEFAULT_DENSE_SHAPE", "qkv=w4,o=k4,router=k16")
    monkeypatch.delenv("CUPOOL_DENSE_SHAPE", raising=False)
    model = fused_model("qwen3_moe", seed=12)           # H = 48, o-projection K = 4 · 64
    base, *_ = compare_step(model, None, "reference", [[5, 9, 3]], [11])
    head, layers = built[0], built[1:]
    assert head == (48, {})
    # each layer's router first (its MLP half is matched first), then qkv and o
    assert all(kw == {"split_k": 1} for _, kw in layers[0::3])          # router: K 48 takes 1
    assert all(kw == {"warps": 4} for _, kw in layers[1::3])            # qkv
    assert all(kw == {"split_k": 4} for _, kw in layers[2::3])          # o: K 256 takes 8
    built.clear()
    monkeypatch.setenv("CUPOOL_DENSE_SHAPE", "qkv=w8k1,o=k2")
    got, *_ = compare_step(model, None, "reference", [[5, 9, 3]], [11])
    layers = built[1:]
    assert all(kw == {"split_k": 1} for _, kw in layers[0::3])
    assert all(kw == {"warps": 8, "split_k": 1} for _, kw in layers[1::3])
    assert all(kw == {"split_k": 2} for _, kw in layers[2::3])
    assert torch.equal(got, base)
    monkeypatch.setenv("CUPOOL_DENSE_SHAPE", "router=k16")   # asked for: K 48 cannot take it
    with pytest.raises(ValueError, match="router: split_k"):
        compare_step(model, None, "reference", [[5, 9, 3]], [11])


# --- the plan step skipped (CUPOOL_SKIP_PLAN, a bank that holds every expert) --------------------
def test_reference_router_writes_lane_addresses():
    """The route epilogue's lane addresses (GemvReference with lane_addr=True) against a direct
    gather table[ids]: inactive tokens' padding lanes get 0, the poison before the call is gone;
    ids and weights are those of the plain router."""
    from cupool.ops.dense_gemv import RouteOut
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for B, E, H, K in ((5, 8, 48, 2), (13, 60, 72, 4)):
        w = torch.randn(E, H, generator=gen).to(torch.bfloat16)
        x = torch.randn(B, H, generator=gen).to(torch.bfloat16)
        nw = torch.rand(H, generator=gen).to(torch.bfloat16) + 0.5
        table = torch.randint(1, 2**48, (E,), generator=gen)
        active = torch.rand(B, generator=gen) < 0.7
        active[0], active[-1] = True, False
        outs = []
        for lanes in (False, True):
            route = RouteOut.allocate(B, E, K, torch.bfloat16, "cpu")
            lane_addr = torch.full((B * K,), -12345, dtype=torch.int64)
            g = ref.GemvReference([w], tokens=B, norm=True, epilogue=2, lane_addr=lanes)
            kw = {"table": table, "lane_addr": lane_addr} if lanes else {}
            g(x, norm_weight=nw, eps=1e-6, route=route, top_k=K, norm_topk=True, active=active,
              **kw)
            outs.append((route, lane_addr))
        (plain, _), (route, lane_addr) = outs
        assert torch.equal(route.ids, plain.ids) and torch.equal(route.weights, plain.weights)
        ids = route.ids.long()
        assert (ids[~active] == -1).all() and (ids[active] >= 0).all()
        want = [int(table[i]) if i >= 0 else 0 for i in ids.reshape(-1).tolist()]
        assert lane_addr.tolist() == want
    explicit = torch.tensor([[3, -1], [-1, 0]], dtype=torch.int32)
    assert ref.lane_addresses(explicit, torch.tensor([7, 8, 9, 10])).tolist() == [10, 0, 0, 7]
    with pytest.raises(ValueError, match="lane_addr=True"):
        ref.GemvReference([w], tokens=B, norm=True, epilogue=2)(
            x, norm_weight=nw, route=route, top_k=K, table=table, lane_addr=lane_addr)


class ResidentPool:
    """A CPU stand-in for a `Pool` whose bank holds every expert: expert e of layer l sits at
    address BASE + (l·E + e)·STRIDE. Its GEMM maps the lane addresses back to experts and runs
    the model's experts module; its layers' decode path (the plan step's) runs that module on
    the router's ids (inactive tokens' already −1) and counts its calls. Padding lanes run
    expert 0 with weight 0 (transformers 5.24's grouped_mm experts read out of range for the
    padding id E on the CPU)."""
    BASE, STRIDE = 1 << 40, 1 << 20

    def __init__(self, model):
        from types import SimpleNamespace
        blocks = [layer.mlp for layer in model.model.layers]
        E = blocks[0].gate.weight.shape[0]
        self.specs = [SimpleNamespace(parent=m, index=i) for i, m in enumerate(blocks)]
        self.num_layers, self.num_experts = len(blocks), E
        self.top_k = model.config.num_experts_per_tok
        self.device = torch.device("cpu")
        self.modules = [m.experts for m in blocks]
        self.bank = SimpleNamespace(rows_per_layer=E, num_experts=E, holds_every_expert=lambda: True)
        self.planned = 0

        def decode(layer):
            def run(x, ids, w, out=None, **kw):
                self.planned += 1
                return self._experts(layer, x, ids, w, out)
            return run
        self.layers = [SimpleNamespace(layer=i, decode=decode(i)) for i in range(len(blocks))]
        self.gemm = SimpleNamespace(decode=self._gemm_decode)
        self.prefetcher = self.routing_hook = self.decode_backend = None
        self.overlap_copies = False
        self.plan_skipped = False

    def expert_addresses(self, layer: int) -> torch.Tensor:
        E = self.num_experts
        return self.BASE + (layer * E + torch.arange(E)) * self.STRIDE

    def _gemm_decode(self, x, lane_addr, w, out):
        E, K = self.num_experts, self.top_k
        key = (lane_addr - self.BASE) // self.STRIDE
        real = lane_addr != 0
        if not real.any():
            return out.zero_()
        layers = (key[real] // E).unique()
        assert layers.numel() == 1, layers
        ids = torch.where(real, key % E, -1).reshape(-1, K)
        return self._experts(int(layers), x, ids, w, out)

    def _experts(self, layer, x, ids, w, out):
        pad = ids < 0
        return out.copy_(self.modules[layer](x, ids.long().masked_fill(pad, 0), w.masked_fill(pad, 0)))


@torch.inference_mode()
def test_skip_plan_step_equals_the_decode_path(monkeypatch):
    """CUPOOL_SKIP_PLAN=1 on a pool whose bank holds every expert: the routers' lane addresses
    feed the GEMM directly (the decode path is not called), the logits are those of the decode
    path, describe() and the pool say so; a pool with a prefetcher (or a bank not holding every
    expert) takes the decode path; a wrong address table changes the logits."""
    model = fused_model("qwen3_moe", seed=21)
    B = 3
    cache = SlotCache(model.config.num_hidden_layers, B, 40, torch.bfloat16, "cpu")
    for b, p in enumerate([[5, 9, 3], [7, 1, 4, 4], [2, 8]]):
        prefill(model, cache, b, p)
    tok, pos = torch.tensor([[11], [13], [17]]), cache.pos.clone()
    active = torch.tensor([True, False, True])
    before = snapshot(cache)

    def step_logits(env, pool=None, prepare=None):
        pool = pool or ResidentPool(model)
        if env is None:
            monkeypatch.delenv("CUPOOL_SKIP_PLAN", raising=False)
        else:
            monkeypatch.setenv("CUPOOL_SKIP_PLAN", env)
        step = FusedStep(model, pool, cache, B, [None] * len(cache.keys), backend="reference")
        if prepare:
            prepare(step, pool)
        restore(cache, before)
        return step(tok, pos, active).clone(), step, pool

    base, step, pool = step_logits("0")
    L = len(pool.layers)
    assert all(isinstance(l, FusedLayer) for l in step.layers), step.describe()
    assert pool.planned == L and not pool.plan_skipped and "CUPOOL_SKIP_PLAN" not in step.describe()
    got, step, pool = step_logits(None)                           # on by default
    assert pool.planned == 0 and pool.plan_skipped
    assert "plan step and row copies skipped (every expert has a bank row" in step.describe()
    assert step.lane_table.shape == (L, pool.num_experts)
    assert torch.equal(got, base)
    assert (step.lane_addr.reshape(B, -1)[1] == 0).all()         # the inactive token's lanes
    step.ablate = frozenset({"plan"})                              # nothing to leave out
    restore(cache, before)
    assert torch.equal(step(tok, pos, active), base)

    got, step, pool = step_logits("1", prepare=lambda s, p: setattr(p, "prefetcher", object()))
    assert pool.planned == L and not pool.plan_skipped and torch.equal(got, base)
    assert "the plan step runs though every expert has a bank row: the pool has a prefetcher" \
        in step.describe()
    partial = ResidentPool(model)
    partial.bank.holds_every_expert = lambda: False
    got, step, pool = step_logits("1", partial)
    assert pool.planned == L and step.lane_table is None and torch.equal(got, base)
    assert "plan step" not in step.describe()                     # the usual path: no note

    def swap_two(step, pool):
        step.lane_table[:, [0, 1]] = step.lane_table[:, [1, 0]].clone()
    got, step, pool = step_logits("1", prepare=swap_two)
    assert pool.planned == 0 and not torch.equal(got, base)
    with pytest.raises(ValueError, match="CUPOOL_SKIP_PLAN='on'"):
        step_logits("on")


def test_pool_reports_a_skipped_plan_step():
    """With the plan step skipped the bank's counters do not advance: the pool's stats, its
    hit rate and the server's metrics say the plan step is skipped and report a hit rate of 1.0
    by construction, not a rate of counters that did not count."""
    import math
    from types import SimpleNamespace

    from cupool.pool import Pool
    from cupool.serve.metrics import _EngineCollector
    counts = {"hits": 0, "misses": 0}
    bank = SimpleNamespace(stats=lambda: ([{"layer": 0, **counts, "hit_rate": float("nan")}],
                                          "table"))
    pool = Pool.__new__(Pool)
    pool.bank, pool.plan_skipped = bank, False
    assert math.isnan(pool.hit_rate()) and not pool.stats()[0]["plan_skipped"]
    counts.update(hits=3, misses=1)
    assert pool.hit_rate() == 0.75
    counts.update(hits=0, misses=0)
    pool.plan_skipped = True
    assert pool.hit_rate() == 1.0
    assert pool.stats()[0]["hit_rate"] == 1.0 and pool.stats()[0]["plan_skipped"]
    assert "plan step skipped" in pool.stats_table()
    engine = SimpleNamespace(stats=lambda: {"running": 0, "waiting": 0, "slots": 1}, pool=pool)
    got = {s.name: s.value for m in _EngineCollector(engine).collect() for s in m.samples}
    assert got["cupool_bank_hit_rate"] == 1.0 and got["cupool_bank_plan_skipped"] == 1


@torch.inference_mode()
def test_reference_step_with_an_inactive_slot():
    """An inactive slot's lanes are padding for the model's own experts modules (expert 0 at
    weight 0, which every transformers version takes): the active slot's logits are those of
    a step with both active, and the inactive one's are finite."""
    model = fused_model("qwen3_moe", seed=13)
    cache = SlotCache(model.config.num_hidden_layers, 2, 40, torch.bfloat16, "cpu")
    prefill(model, cache, 0, [5, 9, 3])
    prefill(model, cache, 1, [7, 1, 4, 4])
    step = FusedStep(model, None, cache, 2, [None] * len(cache.keys), backend="reference")
    tok, pos = torch.tensor([[11], [13]]), cache.pos.clone()
    before = snapshot(cache)
    both = step(tok, pos, torch.tensor([True, True])).clone()
    restore(cache, before)
    one = step(tok, pos, torch.tensor([True, False])).clone()
    assert torch.equal(one[0], both[0])
    assert torch.isfinite(one[1].float()).all()


@torch.inference_mode()
@pytest.mark.parametrize("chosen", [[2], [3, 1], [0, 2]])
def test_narrow_step_equals_its_rows_of_the_step_of_every_slot(chosen):
    """`FusedStep(tokens=w)(..., slots=)` over a 4-slot cache: each chosen slot's logits and
    cache rows are those of the 4-slot step with only the chosen slots active (the same bits:
    the reference backend computes each row alone), in the order the map gives them, and the
    other slots' rows keep their bits (the step reads and writes the chosen slots alone)."""
    model = fused_model("qwen3_moe", seed=14)
    cache = SlotCache(model.config.num_hidden_layers, 4, 40, torch.bfloat16, "cpu")
    for b, prompt in enumerate([[5, 9, 3], [7, 1, 4, 4, 2], [8, 8], [6, 2, 9, 1]]):
        prefill(model, cache, b, prompt)
    windows = [None] * len(cache.keys)
    wide = FusedStep(model, None, cache, 4, windows, backend="reference")
    narrow = FusedStep(model, None, cache, len(chosen), windows, backend="reference")
    tok, pos = torch.tensor([[11], [13], [17], [19]]), cache.pos.clone()
    before = snapshot(cache)
    active = torch.zeros(4, dtype=torch.bool)
    active[chosen] = True
    want = wide(tok, pos, active).clone()
    after_wide = snapshot(cache)
    restore(cache, before)
    idx = torch.tensor(chosen)
    got = narrow(tok[idx], pos[idx], torch.ones(len(chosen), dtype=torch.bool), slots=idx)
    for r, b in enumerate(chosen):
        assert torch.equal(got[r], want[b]), (b, rel(got[r], want[b]))
    for k_got, k_wide, k_before in zip(cache.keys, after_wide[0], before[0]):
        for o in range(4):
            expect = k_wide if o in chosen else k_before
            assert torch.equal(k_got[o], expect[o]), (chosen, o)


def test_narrow_step_refuses_what_it_cannot_run():
    model = fused_model("qwen3_moe", seed=15)
    cache = SlotCache(model.config.num_hidden_layers, 2, 40, torch.bfloat16, "cpu")
    prefill(model, cache, 0, [5, 9, 3])
    windows = [None] * len(cache.keys)
    one = FusedStep(model, None, cache, 1, windows, backend="reference")
    tok, pos, act = torch.tensor([[11]]), cache.pos[:1].clone(), torch.ones(1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"slots must be an int64 \[1\] tensor on cpu, got "
                                         r"torch.int32 \[1\]"):
        one(tok, pos, act, slots=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slots must be an int64 \[1\] tensor on cpu, got int"):
        one(tok, pos, act, slots=0)
    with pytest.raises(ValueError, match="the cache has 2 slots for a step of 1 tokens: pass "
                                         "slots"):
        one(tok, pos, act)
    mixed = unmatched_layer_model(seed=10)
    cache2 = SlotCache(mixed.config.num_hidden_layers, 2, 40, torch.bfloat16, "cpu")
    step = FusedStep(mixed, None, cache2, 1, [None] * len(cache2.keys), backend="reference")
    assert "run transformers' modules" in step.narrow_why()
    with pytest.raises(ValueError, match="slots: layers \\[1\\] run transformers' modules"):
        step(tok, cache2.pos[:1].clone(), act, slots=torch.tensor([1]))


def reference_engine(model, narrow: bool):
    """A 4-slot CPU Engine whose decode steps are FusedSteps of the reference backend (standing
    in for the kernels' steps the engine builds on a GPU), with the narrow steps of 1 and 2
    slots where `narrow`; and the list its steps' StepKinds are noted in."""
    windows = windows_of(model.config)
    eng = Engine(model, max_batch=4, max_len=48, eos_token_id=[])
    eng._fused = FusedStep(model, None, eng.cache, 4, windows, backend="reference")
    eng._narrow = {w: FusedStep(model, None, eng.cache, w, windows, backend="reference")
                   for w in (1, 2)} if narrow else {}
    kinds, kind = [], eng._kind

    def noted():
        kinds.append(kind())
        return kinds[-1]
    eng._kind = noted
    return eng, kinds


@torch.inference_mode()
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen2_moe", "glm4_moe"])
def test_engine_narrow_steps_give_the_tokens_of_steps_of_every_slot(family):
    """The engine's narrow steps (`Engine(narrow=)`; here on the CPU, FusedSteps of the
    reference backend standing in for the kernels' steps the engine builds on a GPU): requests
    of 3, 6 and 10 new tokens in 4 slots run steps of 3 active slots, then of 2 and of 1, which
    take the narrow steps of 2 and 1 slots (the slot map: the active slots, then free ones);
    greedy and seeded sampled requests give the tokens of every step over every slot."""
    model = glm4_moe_model(seed=21) if family == "glm4_moe" else fused_model(family, seed=21)
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 8, 1, 2], [6, 2]]

    def run(narrow: bool, temperature: float):
        eng, kinds = reference_engine(model, narrow)
        params = [SamplingParams(temperature=temperature, top_p=0.9, seed=40 + i, max_tokens=n)
                  for i, n in enumerate((3, 10, 6))]
        out = [r.output_ids for r in eng.generate(prompts, params)]
        return out, [k.width for k in kinds]

    for t in (0.0, 0.8):
        want, wide = run(False, t)
        got, narrow = run(True, t)
        assert got == want, (t, got, want)
        assert set(wide) == {0} and {1, 2} <= set(narrow) and narrow[0] == 0, narrow
        assert [len(o) for o in got] == [3, 10, 6]


def tokens_off(model, reqs) -> list[tuple[int, int]]:
    """(request id, step) where a greedy request's token is not the argmax of the model's own
    forward over its prompt and the tokens before (teacher forcing), by at least TIE."""
    off = []
    for r in reqs:
        seq = torch.tensor([r.prompt_ids + r.output_ids[:-1]])
        logits = model(input_ids=seq).logits[0, len(r.prompt_ids) - 1:].float()
        for i, tok in enumerate(r.output_ids):
            top2 = logits[i].topk(2).values
            if tok != int(logits[i].argmax()) and float(top2[0] - top2[1]) >= TIE:
                off.append((r.id, i))
    return off


@torch.inference_mode()
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_engine_fused_step_runs_qwen3_next(family):
    """The engine's step on Qwen3-Next (and Qwen3.5): a FusedStep (the reference backend,
    standing in for the kernels' step the engine builds on a GPU) over all its layers, the gated
    delta nets reading and writing the engine's per-slot states. Five greedy requests in 4 slots
    (the last admitted into a freed slot, its states reset): at most 2 of their 31 tokens off the
    model's own argmax by a margin (the GPU engine tests' MAX_OFF; this tiny model's bf16 steps,
    fused or not, flip a few near-ties: the engine's unfused step is off at the same rate). With
    the narrow steps of 1 and 2 slots (the delta nets' states read and written at the slot map's
    slots) the tokens are the same. The same engine with the output gate left out is off at
    more than 8 (the test can fail)."""
    model = qwen3_next_model(seed=7, family=family)
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 8, 1, 2], [6, 2], [3, 3, 9, 1, 5], [8, 6, 4]]
    params = [SamplingParams(max_tokens=n) for n in (3, 10, 6, 5, 7)]
    eng, kinds = reference_engine(model, narrow=False)
    assert not eng._fused.needs_mask and eng._fused.narrow_why() is None
    reqs = eng.generate(prompts, params)
    assert [len(r.output_ids) for r in reqs] == [3, 10, 6, 5, 7] and kinds
    assert {k.width for k in kinds} == {0}
    off = tokens_off(model, reqs)
    assert len(off) <= 2, off
    narrow_eng, narrow_kinds = reference_engine(model, narrow=True)
    narrow_reqs = narrow_eng.generate(prompts, params)
    assert [r.output_ids for r in narrow_reqs] == [r.output_ids for r in reqs]
    assert {1, 2} & {k.width for k in narrow_kinds}, [k.width for k in narrow_kinds]
    eng._fused.attn_gate = None
    assert len(tokens_off(model, eng.generate(prompts, params))) > 8


class _OddIds:
    """A token-mask constraint (the engine's hook: fill / accept / done) that allows odd ids."""

    def fill(self, words) -> None:
        words.fill_(int.from_bytes(bytes([0xAA] * 4), "little", signed=True))

    def accept(self, token: int) -> None:
        assert token % 2 == 1, token

    def done(self) -> bool:
        return False


@torch.inference_mode()
def test_engine_narrow_steps_with_logprobs_and_token_masks():
    """The narrow steps' logprobs and token masks (each a variant of the step) gathered and put
    back by the slot map: a masked request (odd ids only) and one with logprobs, beside a plain
    one, give the tokens and logprobs of every step over every slot."""
    model = fused_model("qwen3_moe", seed=22)
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2], [6, 2, 8, 8]]

    def run(narrow: bool):
        eng, kinds = reference_engine(model, narrow)
        reqs = [eng.submit(prompts[0], SamplingParams(max_tokens=2)),
                eng.submit(prompts[1], SamplingParams(max_tokens=9, logprobs=3)),
                eng.submit(prompts[2], SamplingParams(max_tokens=6), constraint=_OddIds())]
        eng.run_until_idle()
        return [(r.output_ids, r.logprobs) for r in reqs], kinds
    want, _ = run(False)
    got, kinds = run(True)
    assert got == want
    assert any(k.width and k.logprobs for k in kinds) and any(k.width and k.masked for k in kinds)
    assert all(t % 2 == 1 for t in got[2][0]) and len(got[1][1]) == 9


@torch.inference_mode()
def test_delta_layers_need_a_cache_of_per_slot_states():
    """A step whose gated delta nets are fused, handed a cache without per-slot states, says so
    at its first delta net layer, before that layer reads or writes anything."""
    model = qwen3_next_model(seed=4)
    prompts, tok = [[5, 9, 3], [2, 6, 7, 1]], [11, 4]
    *_, step = compare_step(model, None, "reference", prompts, tok)
    step.cache = SlotCache(4, 2, 40, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="layer 0 is a gated delta net: the cache must keep "
                                        "per-slot states"):
        step(torch.tensor(tok)[:, None], torch.tensor([3, 4]), torch.ones(2, dtype=torch.bool))
