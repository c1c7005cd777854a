"""`FusedStep`: the decode step of a transformers MoE decoder run by cupool's own kernels, a few
launches a layer, for the engine to capture in its CUDA graph.

Shape legend (ARCHITECTURE.md): B tokens of the step (one a slot) · H hidden · V vocabulary ·
E experts · K top-k · nh / hk query / KV heads · D head dim · L_max positions a slot holds.

A decoder layer of the common pattern — RMSNorm → attention (q/k/v/o projections with or without
biases, q/k RMSNorm over the head dim or none, rotary embedding over the whole head or its first
dims (GLM-4.5's and Qwen3-Next's partial rotary, `kernel_rotary`), grouped-query, full or sliding
window, with or without sinks, with or without Qwen3-Next's output gate) → residual → RMSNorm →
softmax top-k router (its logits with or without a bias), or a sigmoid router with a correction
bias and one expert group → pooled experts, plus a shared expert where the block has one →
residual; Qwen3-MoE, Mixtral, gpt-oss, Qwen2-MoE, GLM-4.5, dots.llm1, and Qwen3-Next's and
Qwen3.5's full-attention layers — runs as:

    dense_gemv (norm)   h = h_mid + moe of the layer before; x = rmsnorm(h); qkv = x·Wqkv (+ b)
    dense_attention     q/k norm, rotary, k and v into the slot cache at pos, split-KV attention
                        (sinks: exp(sink) joins each head's softmax sum); an inactive slot's
                        blocks return at once (its cache untouched, its row zeros)
    dense_gemv (resid)  h_mid = h + attn·Wo (+ b)
    dense_gemv (route)  xn = rmsnorm(h_mid); logits = xn·Wr (+ b); softmax top-k → ids, weights
    plan, row copies, moe_decode    the pool's decode path on (xn, ids, weights) → moe

seven launches a layer (the last three are the pool's), then one dense_gemv (norm) for the final
norm and the output head. A MoE block with a shared expert (gate_proj, up_proj, down_proj and
a SiLU act_fn: Qwen2-MoE's and Qwen3-Next's `shared_expert`, scaled by `shared_expert_gate`, a
Linear to one output; DeepSeek's, GLM-4.5's and dots.llm1's `shared_experts`, ungated) adds,
after the pool's launches:

    dense_gemv          [g | u | sg] = xn·[Wg; Wu; Wsg]   (the gate's row, where there is one,
                                                          as a third matrix)
    dense_gemv (GLU)    moe = moe + sigmoid(sg) · (silu(g) · u)·Wd    (moe + (silu(g) · u)·Wd
                                                          ungated)

each op in bf16 where transformers' block rounds (the down GEMV's GLU prologue and its GATE
epilogue), so the sum is the block's. Gated attention (q_proj's rows each head's query followed
by its output gate, twice the o-projection's width) keeps that layout in the QKV GEMV's output,
which the attention kernel reads (its QGATE build); after it, torch ops multiply the output by
sigmoid(gate), rounded as the model does. Every RMSNorm is transformers' weight · x̂ or the
(1 + w) form of Qwen3-Next (x̂ · (1 + w) in float32, rounded once), which the GEMVs' and the
attention's NORM1 builds compute. The residual stream is never materialised between a layer's
MoE and the next layer: the next QKV GEMV adds it in its prologue. A dense MLP layer (`mlp` of
gate_proj, up_proj, down_proj and a SiLU act_fn: Qwen2-MoE's mlp_only_layers, DeepSeek's and
GLM-4.5's first layers) runs the same two GEMVs in place of the router and the pool's launches,
its gate and up GEMV norming the residual stream (the down GEMV's output, silu(g) · u times Wd,
is then what the next layer adds). An MLP whose act_fn is not SiLU does not match.

A gated delta net layer (Qwen3-Next's and Qwen3.5's `linear_attn`: key and value head dims in
`cupool.ops.delta_decode.HEAD_DIMS`, a causal depthwise convolution of 2 to 8 positions without
bias, SiLU, its output norm the gated RMSNorm by a probe, Qwen3-Next's in_proj_qkvz / in_proj_ba
laid out as its own fix_query_key_value_ordering splits them by a probe, or Qwen3.5's
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) with an MLP half of the pattern runs as a
`DeltaLayer`, in place of the attention's three launches:

    dense_gemv (norm)   h = h_mid + moe; x = rmsnorm(h); proj = x·[in-projections]
    delta_decode        the convolution with its window state, the gates, the recurrent state's
                        update and read-out, the gated norm (`cupool.ops.delta_decode`), on the
                        slot's states in the engine's cache (`StateSlotCache.layers[i]`)
    dense_gemv (resid)  h_mid = h + o·W_out

then its MLP half as above (Qwen3.5's in_proj_b and in_proj_a are copied into one matrix once
per module pair, shared by every step of the model: a GEMV takes up to three). Every delta net
layer of a model shares its head shape.

A layer that does not match runs transformers' own module on the same cache and per-slot states,
with the mask and rotary embedding the engine would pass: where only its token mixer does not
match (another attention, a delta net of other dims) and the rest is an input norm, the
post-attention RMSNorm and an MLP of the pattern, the module runs with that norm and MLP stood in
for by the step's own MLP half (`MixerLayer`: the router GEMV norms the mixer's residual sum,
then the pool's launches and the shared expert's GEMVs, the module adding the residual); else
(another router, another MLP) the whole module runs. Which layers matched and why the others did
not is in `FusedStep.layers` / `describe()`.

What is checked before any kernel runs: the model's structure (embedding, final norm, output head,
a rotary embedding that does not change with the length; a table of D / 2 frequencies only where
a probe shows the model turns both halves of a head by it, `kernel_rotary`), each norm by a probe
(it must compute one of the two RMSNorms above exactly), each router by a probe against
`cupool.reference.dense.route_topk` on its own logits (softmax top-k, with or without
renormalisation, weights in the dtype it returns; gpt-oss's softmax over its top-k logits is the
renormalised one) or, for a router with an e_score_correction_bias, `route_sigmoid` (its logits
float32, as those routers compute them), bf16 weights on the pool's device.
A model that does not fit raises `Unsupported` with the reason; the engine then runs the model's
own forward.

Launch shapes: every GEMV runs the shape DEFAULT_DENSE_SHAPE gives it (none named: `DenseGemv`'s
warps=8, split_k=1) unless CUPOOL_DENSE_SHAPE names another, read when a FusedStep is built:
comma-separated `gemv=shape` entries, gemv one of qkv, o, router, head, mlp (a shared expert's
or a dense MLP's gate and up rows), mlp_down, and shape `w<warps>`, `k<split_k>` or both (`w4k2`),
e.g. `CUPOOL_DENSE_SHAPE=qkv=w4,o=k2,router=k8` (`w8k1` asks for the kernel's plain build);
the entry `attn=ahead` picks the attention build that issues a tile's loads ahead of their use
(`DecodeAttention(ahead=True)`), `attn=plain` the other one, either optionally followed by
`c<positions>`, the fewest positions a split-KV part (`DecodeAttention(min_chunk=...)`, e.g.
`attn=aheadc256`), or `attn=c<positions>` alone. A
malformed value, or a split_k a GEMV's K cannot take (fewer than 32 columns a block), raises
ValueError naming the variable: a shape asked for is never dropped silently. A default's split_k
is lowered to what a small K takes.

Skipping the plan step (`CUPOOL_SKIP_PLAN`, read when a FusedStep is built; "1" or unset: on,
"0" off, anything else a ValueError naming the variable): when
the pool's bank holds a row for every expert of every layer (checked once, at build), nothing can
miss, so nothing is evicted and each expert's row address is fixed. Each layer's router then
also writes the decode GEMM's lane addresses from a table of those addresses ([L, E], built
once), and the step calls the GEMM directly: no plan step and no row copies (two launches a
layer fewer). Only while the pool has no prefetcher, routing hook or decode backend and
overlap_copies is off (checked at each call, i.e. at capture); else the pool's decode path runs
as always. The bank's hit/miss counters then do not advance: the pool reports its plan step
skipped and a hit rate of 1.0 by construction (`Pool.plan_skipped`). `describe()` says which
applies.

Routing inside the decode GEMM (`CUPOOL_FUSED_ROUTE`, read when a FusedStep is built; "1" on,
"0" or unset off: on an H200 the step measured the same either way, and on an H100 batch 1
resident decoded 0.964× the router's own launch in `bench_serve.py`): with the plan step
skipped, each layer's router launch and decode GEMM launch become one
(`MoEGemm.decode_routed`: the RMSNorm, router GEMV and softmax top-k run in the decode GEMM's
blocks, which then group their lanes without a second exchange), where the GEMM takes the step
(`MoEGemm.routes_decode`: the one-launch decode GEMM, bf16, the logits fit its shared memory)
and the router returns float32 or bf16 weights. The layer is then four launches; xn, the route's
ids, weights and logits, and the lane addresses are written as the two launches wrote them.
`describe()` says whether it applies and why not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import weakref

import torch
from torch import nn

from cupool import _cuda, dense_nvfp4, graphsafe
from cupool._env import parse_switch
from cupool.adapters import ROUTER_NAMES, router_of
from cupool.engine import cache_kwarg
from cupool.ops.dense_attention import (
    HEAD_DIMS,
    MINCHUNK,
    AttentionWorkspace,
    DecodeAttention,
    check_min_chunk,
    parts,
)
from cupool.ops.dense_attention import (
    shape_fits as attention_shape_fits,
)
from cupool.ops.delta_decode import HEAD_DIMS as DELTA_DIMS
from cupool.ops.delta_decode import KERNELS as CONV_KERNELS
from cupool.ops.delta_decode import DeltaDecode
from cupool.ops.dense_gemv import (
    PLAIN,
    RESIDUAL,
    ROUTE,
    WARPS,
    DenseGemv,
    RouteOut,
    check_launch_shape,
    chunk_cols,
)
from cupool.reference.dense import (
    AttentionReference,
    DeltaReference,
    GemvReference,
    delta_projection,
    gated_rms_norm,
    rms_norm,
    route_sigmoid,
    route_topk,
)
from cupool.reference.dense import rope as rope_reference
from cupool.slotstate import StateSlotCache

log = logging.getLogger("cupool")
ATTENTION_TYPES = ("full_attention", "sliding_attention")
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
# a gated delta net's in-projections: Qwen3-Next's (grouped by key head) and Qwen3.5's
_DELTA_GROUPED = ("in_proj_qkvz", "in_proj_ba")
_DELTA_FLAT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
# a MoE block's modules: its router (adapters.ROUTER_NAMES) and its experts
_MOE_CHILDREN = tuple({name, "experts"} for name in ROUTER_NAMES)
# a shared expert beside the routed ones, scaled by a sigmoid gate (Qwen2-MoE's and Qwen3-Next's
# blocks), or ungated (DeepSeek's, GLM-4.5's and dots.llm1's `shared_experts`)
_SHARED = {"shared_expert", "shared_expert_gate"}
_SHARED_UNGATED = {"shared_experts"}
# a dense MLP layer's `mlp` (Qwen2-MoE's mlp_only_layers, DeepSeek's first_k_dense_replace)
_DENSE_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# attention modules with these attributes compute something else than the pattern (latent
# attention, logit soft-capping, gated outputs)
_ATTN_REFUSE = ("q_a_proj", "kv_a_proj_with_mqa", "attn_logit_softcapping", "gate_proj")


DENSE_SHAPE_ENV = "CUPOOL_DENSE_SHAPE"
SKIP_PLAN_ENV = "CUPOOL_SKIP_PLAN"
FUSED_ROUTE_ENV = "CUPOOL_FUSED_ROUTE"
# the parts of a fused layer `FusedStep.ablate` can leave out: a launch each, "plan" the pool's
# plan step and row copies (its decode GEMM then reads the lane addresses the last plan left),
# "moe" all three of the pool's launches (with the plan step skipped, CUPOOL_SKIP_PLAN, "plan" has
# nothing to leave out and "moe" is the decode GEMM; with the routing inside it,
# CUPOOL_FUSED_ROUTE, "router" has nothing of its own and "moe" is their one launch)
ABLATE = ("qkv", "attention", "o", "router", "plan", "moe")
DENSE_GEMVS = ("qkv", "o", "router", "head", "mlp", "mlp_down")
# the launch shapes where CUPOOL_DENSE_SHAPE names none (the same format): the fastest step of
# `benchmarks/run_gpu.sh ab-dense` on the H200 (docs/PERFORMANCE.md, "What each part costs")
DEFAULT_DENSE_SHAPE = "qkv=w4,o=w4k4,attn=ahead"
_SHAPE = re.compile(r"(?:w([0-9]+))?(?:k([0-9]+))?")
_ATTN_SHAPE = re.compile(r"(ahead|plain)?(?:c([0-9]+))?")


def parse_dense_shape(text: str) -> dict[str, dict]:
    """{gemv: DenseGemv launch-shape keywords} of a CUPOOL_DENSE_SHAPE value (the module
    docstring gives the format), with "attn": {"ahead": True} for the entry attn=ahead
    ({"ahead": False} for attn=plain, {"min_chunk": 256} for attn=c256, both for
    attn=aheadc256); "" names none. Strict: an unknown GEMV, a GEMV named twice, a shape other
    than w<n>, k<n>, w<n>k<n> ([ahead|plain][c<n>] for attn), a warps / split_k DenseGemv does
    not take or a min_chunk DecodeAttention does not take raises ValueError naming the variable
    and the value."""
    shapes: dict[str, dict] = {}
    if text == "":
        return shapes
    for entry in text.split(","):
        name, eq, shape = entry.partition("=")
        try:
            shapes[name] = _entry_shape(name, eq, shape, entry, shapes)
        except ValueError as e:
            raise ValueError(f"{DENSE_SHAPE_ENV}={text!r}: {e}") from None
    return shapes


def _entry_shape(name: str, eq: str, shape: str, entry: str, seen: dict) -> dict:
    """The keywords of one CUPOOL_DENSE_SHAPE entry `name=shape`; ValueError saying what is
    wrong with it."""
    if not eq or name not in DENSE_GEMVS + ("attn",):
        raise ValueError(f"entry {entry!r} is not <gemv>=<shape> with gemv one of "
                         f"{', '.join(DENSE_GEMVS)}, or attn=[ahead|plain][c<positions>]")
    if name in seen:
        raise ValueError(f"{name} is named twice")
    if name == "attn":
        m = _ATTN_SHAPE.fullmatch(shape)
        if m is None or shape == "":
            raise ValueError(f"attn's shape {shape!r} is not ahead or plain, optionally "
                             f"followed by c<positions>, or c<positions>")
        kw = {} if m.group(1) is None else {"ahead": m.group(1) == "ahead"}
        if m.group(2) is not None:
            try:
                kw["min_chunk"] = check_min_chunk(int(m.group(2)))
            except ValueError as e:
                raise ValueError(f"attn: {e}") from None
        return kw
    m = _SHAPE.fullmatch(shape)
    if m is None or shape == "":
        raise ValueError(f"{name}'s shape {shape!r} is not w<warps>, k<split_k> or "
                         f"w<warps>k<split_k>")
    kw = {}
    if m.group(1) is not None:
        kw["warps"] = int(m.group(1))
    if m.group(2) is not None:
        kw["split_k"] = int(m.group(2))
    try:
        check_launch_shape(kw.get("warps", WARPS), kw.get("split_k", 1), None)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return kw


def parse_skip_plan(text: str | None) -> bool:
    """Whether a CUPOOL_SKIP_PLAN value (None: unset) asks to skip the plan step: "1" or unset
    yes, "0" no; anything else raises ValueError naming the variable."""
    return parse_switch(SKIP_PLAN_ENV, text, True,
                        "skip the plan step where the bank holds every expert")


def parse_fused_route(text: str | None) -> bool:
    """Whether a CUPOOL_FUSED_ROUTE value (None: unset) asks to route inside the decode GEMM's
    launch where the plan step is skipped: "1" yes, "0" or unset no (on an H200 the step measured
    the same either way, docs/PERFORMANCE.md); anything else raises ValueError naming the
    variable."""
    return parse_switch(FUSED_ROUTE_ENV, text, False,
                        "route inside the decode GEMM's launch where the plan step is skipped")


def resident_table(pool) -> torch.Tensor | None:
    """int64 [L, E] device address of every expert's bank row when the pool's bank holds every
    expert; None otherwise (no pool, or a bank of fewer rows: the plan step runs, as always).
    Host reads: call it outside the hot path."""
    if pool is None or not pool.bank.holds_every_expert():
        return None
    return torch.stack([pool.expert_addresses(l) for l in range(pool.num_layers)])


class Unsupported(ValueError):
    """The model (or a layer of it) is not one the fused step runs; the message says why."""


class _MLPUnsupported(Unsupported):
    """A layer's MLP half does not match (its token mixer need not be tried alone)."""


def _eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        v = getattr(norm, name, None)
        if isinstance(v, float):
            return v
    raise Unsupported(f"{type(norm).__name__} has no epsilon attribute (variance_epsilon or eps)")


def check_rms_norm(norm: nn.Module, what: str, size: int) -> tuple[float, bool]:
    """(epsilon, one_plus) of the norm, after a probe shows it computes one of transformers'
    RMSNorms exactly on a random input: weight · x̂ with x̂ rounded first (one_plus False), or
    Qwen3-Next's and Gemma's x̂ · (1 + weight) in float32, rounded once (one_plus True; the
    kernels' NORM1 builds); Unsupported otherwise."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.shape != (size,):
        raise Unsupported(f"{what} ({type(norm).__name__}) has no weight [{size}]")
    if getattr(norm, "bias", None) is not None:
        raise Unsupported(f"{what} ({type(norm).__name__}) has a bias")
    eps = _eps(norm)
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(3, size, generator=gen, device=w.device).to(w.dtype) * 3
    with torch.no_grad():
        got = norm(x)
    for one_plus in (False, True):
        if torch.equal(got, rms_norm(x, w, eps, one_plus)):
            return eps, one_plus
    raise Unsupported(f"{what} ({type(norm).__name__}) computes neither transformers' RMSNorm "
                      f"weight · x / rms(x) nor its (1 + weight) form (a probe differs)")


def check_silu(act: nn.Module, what: str, device) -> None:
    """Unsupported unless the activation `act` computes SiLU (torch's silu, bf16 in and out)
    exactly on a probe over its bend and tails: what the down GEMV's GLU prologue computes."""
    x = torch.linspace(-20, 20, 801, device=device).to(torch.bfloat16)
    with torch.no_grad():
        got = act(x)
    if not (isinstance(got, torch.Tensor) and got.dtype == x.dtype
            and torch.equal(got, nn.functional.silu(x))):
        raise Unsupported(f"{what} ({type(act).__name__}) is not SiLU (a probe differs): its "
                          f"MLP is not fused")


def check_gated_norm(norm: nn.Module, what: str, size: int) -> float:
    """The epsilon of a gated delta net's output norm, after a probe shows it computes
    `cupool.reference.dense.gated_rms_norm` exactly (weight · rmsnorm(o), rounded, times silu(z)
    in float32, rounded: delta_decode.cu's); Unsupported otherwise."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.shape != (size,) or w.dtype != torch.bfloat16:
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise Unsupported(f"{what} ({type(norm).__name__}) has weight {got}, not bf16 [{size}]")
    eps = _eps(norm)
    gen = torch.Generator(device=w.device).manual_seed(0)
    o, z = (torch.randn(3, size, generator=gen, device=w.device).to(w.dtype) * 3
            for _ in range(2))
    try:
        with torch.no_grad():
            got = norm(o, z)
    except (TypeError, RuntimeError) as e:
        raise Unsupported(f"{what} ({type(norm).__name__}) does not take (o, z): "
                          f"{type(e).__name__}: {e}") from None
    if not (isinstance(got, torch.Tensor) and torch.equal(got, gated_rms_norm(o, z, w, eps))):
        raise Unsupported(f"{what} ({type(norm).__name__}) is not the gated RMSNorm weight · "
                          f"rmsnorm(o) · silu(z) (a probe differs)")
    return eps


def check_router(gate: nn.Module, what: str, experts: int, hidden: int, top_k: int):
    """(norm_topk, weight dtype) of a softmax top-k router, found by a probe; Unsupported for
    any other router. Its logits may carry a bias (`gate.bias`, bf16 [E]: gpt-oss's router, whose
    softmax over the top-k logits is softmax → top-k → renormalised); a bias that only chooses
    the experts (DeepSeek's e_score_correction_bias) makes a sigmoid router
    (`check_sigmoid_router`)."""
    w = getattr(gate, "weight", None)
    if not isinstance(w, torch.Tensor) or w.shape != (experts, hidden):
        raise Unsupported(f"{what} ({type(gate).__name__}) has no weight [{experts}, {hidden}]")
    if hasattr(gate, "e_score_correction_bias"):
        raise Unsupported(f"{what} ({type(gate).__name__}) has a bias that chooses experts: not "
                          f"a plain softmax router")
    b = getattr(gate, "bias", None)
    if b is not None and not (isinstance(b, torch.Tensor) and b.shape == (experts,)
                              and b.dtype == w.dtype and b.device == w.device):
        got = f"{b.dtype} {list(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__
        raise Unsupported(f"{what} ({type(gate).__name__}) has a bias of {got}, not a "
                          f"{w.dtype} [{experts}] beside its weight")
    found = _probe_router(gate, what, hidden, top_k,
                          lambda logits, norm, dt: route_topk(logits, top_k, norm, dt))
    if found is None:
        raise Unsupported(f"{what} ({type(gate).__name__}) is not a softmax top-k router (a "
                          f"probe differs from softmax → top-k with and without "
                          f"renormalisation)")
    return found


def _probe_router(gate: nn.Module, what: str, hidden: int, top_k: int, route):
    """(norm_topk, weight dtype) for which `route(logits, norm_topk, weight dtype)` (ids,
    weights) gives what `gate` returns on 5 random rows (the same experts, weights within 1%),
    trying norm_topk True then False; None if neither does."""
    w = gate.weight
    gen = torch.Generator(device=w.device).manual_seed(1)
    x = torch.randn(5, hidden, generator=gen, device=w.device).to(w.dtype)
    with torch.no_grad():
        got = gate(x)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise Unsupported(f"{what} ({type(gate).__name__}) does not return (logits, weights, ids)")
    logits, weights, ids = got
    if ids.shape != (5, top_k):
        raise Unsupported(f"{what} routes to {tuple(ids.shape)[-1]} experts, the pool to {top_k}")
    for norm_topk in (True, False):
        want_ids, want_w = route(logits, norm_topk, weights.dtype)
        same_ids = torch.equal(torch.sort(want_ids.long(), -1).values,
                               torch.sort(ids.long(), -1).values)
        order = torch.argsort(ids.long(), -1)
        mine = torch.argsort(want_ids.long(), -1)
        if same_ids and torch.allclose(want_w.gather(1, mine).float(),
                                       weights.gather(1, order).float(), rtol=1e-2, atol=1e-6):
            return norm_topk, weights.dtype
    return None


def check_sigmoid_router(gate: nn.Module, what: str, experts: int, hidden: int, top_k: int):
    """(norm_topk, weight dtype, (bias float32 [E], scale)) of a sigmoid router with a correction
    bias (DeepSeek-V3's, GLM-4.5's, dots.llm1's: `e_score_correction_bias`, `n_group`,
    `topk_group`, `routed_scaling_factor`, `norm_topk_prob`), found by a probe against
    `cupool.reference.dense.route_sigmoid`; Unsupported for another router, one that limits the
    experts to some of several groups, or one whose weight is not bf16."""
    name = f"{what} ({type(gate).__name__})"
    w = getattr(gate, "weight", None)
    if not isinstance(w, torch.Tensor) or w.shape != (experts, hidden):
        raise Unsupported(f"{name} has no weight [{experts}, {hidden}]")
    if w.dtype != torch.bfloat16:
        raise Unsupported(f"{name}'s weight is {w.dtype}: the router GEMV reads bf16")
    bias = getattr(gate, "e_score_correction_bias", None)
    if not (isinstance(bias, torch.Tensor) and bias.shape == (experts,)
            and bias.dtype.is_floating_point):
        raise Unsupported(f"{name} has no float e_score_correction_bias [{experts}]")
    if getattr(gate, "bias", None) is not None:
        raise Unsupported(f"{name} has a bias on its logits besides the correction bias")
    groups, kept = getattr(gate, "n_group", 1), getattr(gate, "topk_group", 1)
    if groups != kept:
        raise Unsupported(f"{name} keeps {kept} of {groups} expert groups: group-limited "
                          f"routing is not fused")
    scale = getattr(gate, "routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not 0 < scale < float("inf"):
        raise Unsupported(f"{name} has routed_scaling_factor {scale!r}, not a positive number")
    bias32 = bias.detach().to(torch.float32).contiguous()
    found = _probe_router(gate, what, hidden, top_k, lambda logits, norm, dt: route_sigmoid(
        logits.to(torch.float32), bias32, top_k, norm, float(scale), dt))
    if found is not None:
        return (*found, (bias32, float(scale)))
    raise Unsupported(f"{name} is not a sigmoid top-k router with a correction bias (a probe "
                      f"differs from sigmoid → top-k of score + bias, with and without "
                      f"renormalisation)")


def kernel_rotary(cos: torch.Tensor, sin: torch.Tensor, D: int, attn: nn.Module):
    """(cos, sin, rotary_dims): the rotary tables [L, D] that the attention kernel (and its
    reference) apply as x·cos + rotate_half(x)·sin over the first rotary_dims dims of a head
    (None: all D), from the model's own cos / sin [L, n]. Where n = D they are the model's.
    Otherwise a probe of the function the attention's module applies them with
    (`apply_rotary_pos_emb` of its modeling file) decides: where n = D / 2 and it turns both
    halves of a head by the same D / 2 frequencies (gpt-oss: first·cos − second·sin, second·cos
    + first·sin), each table is set beside itself; where it turns the first n dims as a
    rotate_half pair and passes the rest (partial rotary: GLM-4.5's), the tables are the model's
    padded to D (columns past n never read) and rotary_dims is n, which the kernel takes in
    multiples of 64. Anything else raises Unsupported."""
    n = cos.shape[-1]
    if n == D:
        return cos, sin, None
    why = f"the rotary embedding covers {n} of the head's {D} dims"
    module = sys.modules.get(type(attn).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if not callable(apply):
        raise Unsupported(f"{why}, and the attention's module has no apply_rotary_pos_emb to "
                          f"probe")
    L = cos.shape[0]
    rows = torch.tensor([0, L // 2, L - 1], device=cos.device)
    gen = torch.Generator(device=cos.device).manual_seed(2)
    q = torch.randn(1, 2, 3, D, generator=gen, device=cos.device)
    k = torch.randn(1, 1, 3, D, generator=gen, device=cos.device)
    c, s = cos[rows].float()[None], sin[rows].float()[None]                 # [1, 3, n]
    try:
        with torch.no_grad():
            got_q, got_k = apply(q, k, c, s)
    except (TypeError, ValueError, RuntimeError) as e:
        raise Unsupported(f"{why}: {module.__name__}.apply_rotary_pos_emb did not take a probe "
                          f"({e})") from None

    def turns(want) -> bool:
        return all(torch.allclose(got.float(), want(x), rtol=1e-5, atol=1e-5)
                   for x, got in ((q, got_q), (k, got_k)))

    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    if 2 * n == D and turns(lambda x: rope_reference(x, full_cos[rows].float(),
                                                     full_sin[rows].float())):
        return full_cos.contiguous(), full_sin.contiguous(), None
    if n < D and turns(lambda x: rope_reference(x, c[0], s[0], n)):
        if n % 64:
            raise Unsupported(f"{why} (partial rotary): the attention kernel turns a multiple "
                              f"of 64 dims")
        pad = (L, D - n)
        return (torch.cat([cos, torch.ones(pad, dtype=cos.dtype, device=cos.device)], -1)
                .contiguous(),
                torch.cat([sin, torch.zeros(pad, dtype=sin.dtype, device=sin.device)], -1)
                .contiguous(), n)
    raise Unsupported(f"{why}: {module.__name__}.apply_rotary_pos_emb turns them neither as a "
                      f"partial rotary nor both halves of a head by the table (a probe differs)")


class _ModelExperts:
    """A MoE layer's experts computed by the model's own experts module (the reference backend
    without a pool): `PooledExperts.decode`'s interface."""

    def __init__(self, module: nn.Module, num_experts: int):
        self.module, self.num_experts = module, num_experts

    def decode(self, x, ids, w, out=None, *, mask=None, ids_masked=False):
        ids = ids.to(torch.int64)
        if mask is not None:
            ids = ids.masked_fill(~mask.to(torch.bool)[:, None], -1)
        # a padding lane runs expert 0 with weight 0: transformers' experts modules take no −1,
        # and not every version skips the id E (5.24's reads past the experts for it on the CPU)
        pad = ids < 0
        y = self.module(x, ids.masked_fill(pad, 0), w.masked_fill(pad, 0))
        return y if out is None else out.copy_(y)


@dataclasses.dataclass(kw_only=True)
class MLPHalf:
    """The MLP half of a decoder layer on cupool's kernels: post-attention norm → router →
    pooled experts (+ a shared expert), or a dense MLP (`router` None: `mlp` is the whole MLP).
    FusedLayer, DeltaLayer and MixerLayer have one, beside their own token mixer."""
    router: DenseGemv | None    # with the router's bias where it has one (gpt-oss)
    top_k: int
    norm_topk: bool
    post_norm: torch.Tensor
    post_eps: float
    pooled: object              # cupool.layer.PooledExperts (or _ModelExperts); None: dense
    mlp: GatedMLP | None = None   # a MoE block's shared expert, or a dense layer's MLP

    @property
    def dense(self) -> bool:
        """A dense MLP layer (no router, no pooled experts: `mlp` is its whole MLP)."""
        return self.router is None


@dataclasses.dataclass
class FusedLayer(MLPHalf):
    """A decoder layer run by cupool's kernels."""
    index: int
    qkv: DenseGemv
    attn: DecodeAttention | dict    # the launcher (its arguments while the model is matched)
    o: DenseGemv
    in_norm: torch.Tensor
    in_eps: float


@dataclasses.dataclass
class GatedMLP:
    """down(silu(gate(x)) · up(x)): a MoE block's shared expert, run on the router's normed
    rows, scaled by its sigmoid gate (`gated`: the gate's logit is the last row of `gate_up`) and
    added to the routed experts' sum by `down`'s epilogue, or a dense layer's MLP, whose
    `gate_up` norms the residual stream itself (its `norm`). `down` takes `gate_up`'s output
    whole (its GLU prologue)."""
    gate_up: DenseGemv
    down: DenseGemv
    gu: torch.Tensor            # gate_up's output [B, gate_up.N] (bf16), made once
    out: torch.Tensor           # down's output [B, H] (bf16), made once

    @property
    def size(self) -> int:
        """Its intermediate size (the down GEMV's K)."""
        return self.down.K

    @property
    def gated(self) -> bool:
        """A shared expert with a sigmoid gate (the down GEMV's GATE epilogue)."""
        return self.down.glu_gate


@dataclasses.dataclass
class ModelLayer:
    """A decoder layer run by transformers' own module (`reason`: why it did not match)."""
    index: int
    module: nn.Module
    layer_type: str | None
    reason: str
    cache_kw: str = "past_key_values"   # the keyword its forward takes the cache under


@dataclasses.dataclass(kw_only=True)
class MixerLayer(ModelLayer, MLPHalf):
    """A decoder layer whose token mixer (`reason`: why it is not fused; a gated delta net, an
    attention of another kind) runs in transformers' module, and whose MLP half runs on
    cupool's kernels: the module's post-attention norm and MLP are stood in for while it runs,
    so that the router GEMV norms the mixer's residual sum itself and the MLP's output goes back
    to the module, which adds the residual."""


@dataclasses.dataclass(kw_only=True)
class DeltaLayer(MLPHalf):
    """A decoder layer whose token mixer is a gated delta net (Qwen3-Next's and Qwen3.5's
    linear attention), run by cupool's kernels: `proj` (its in-projections, one GEMV norming the
    residual stream), `delta` (delta_decode: convolution, gates, the recurrent state's update,
    the gated norm), `out` (the out-projection, adding the residual); then its MLP half."""
    index: int
    proj: DenseGemv
    delta: DeltaDecode
    out: DenseGemv
    in_norm: torch.Tensor
    in_eps: float


class _StandIn(nn.Module):
    """A module that calls `fn` (a MixerLayer's MLP half, or the identity for its norm)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _linear(m, name: str, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    lin = getattr(m, name, None)
    if not isinstance(lin, nn.Linear):
        raise Unsupported(f"{where}.{name} is not an nn.Linear")
    return lin.weight, lin.bias


def _packed(m, names: tuple[str, ...]) -> list | None:
    """The NVFP4 forms kept beside the Linears `names` of m (`cupool.dense_nvfp4.attach`), if
    every one has one and each but the last has whole 16-row tiles (a GEMV's row tile lies in
    one matrix); else None: the GEMV reads the bf16 weights."""
    packed = [dense_nvfp4.of(getattr(m, n)) for n in names]
    if any(p is None for p in packed) or any(p.rows % 16 for p in packed[:-1]):
        return None
    return packed


# Qwen3.5's in_proj_b and in_proj_a joined into one matrix, made once per module pair (every
# FusedStep of a model, the narrow ones too, reads the same copy; dropped with the module)
_JOINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _joined(b: nn.Linear, a: nn.Linear) -> torch.Tensor:
    got = _JOINED.get(b)
    if got is None or got[0] is not b.weight or got[1] is not a.weight:
        with torch.no_grad():
            got = _JOINED[b] = (b.weight, a.weight, torch.cat([b.weight.detach(),
                                                               a.weight.detach()]))
    return got[2]


class FusedStep:
    """See the module docstring.

    Args:
        model: a transformers causal LM (bf16, on the pool's CUDA device) wrapped by `pool`.
        pool: its `cupool.Pool` (with backend="reference" also None: the model's own experts
            modules then compute the MoE).
        cache: the engine's `SlotCache` (its layers' buffers are read at each call: they exist
            once a prefill has run).
        tokens: B, the slots of the step.
        windows: the attention window of each layer (None: full attention).
        backend: "kernels" (cupool's kernels, CUDA) or "reference" (`cupool.reference.dense` in
            torch ops on any device: the same matching and data flow, for tests).
    """

    def __init__(self, model, pool, cache, tokens: int, windows: list[int | None], *,
                 backend: str = "kernels"):
        if backend not in ("kernels", "reference"):
            raise ValueError(f"backend must be 'kernels' or 'reference', got {backend!r}")
        self.backend = backend
        if backend == "kernels":
            if pool is None:
                raise Unsupported("the fused step runs pooled models (cupool.wrap / "
                                  "from_pretrained)")
            if pool.device.type != "cuda":
                raise Unsupported(f"the fused step runs on a CUDA device, the pool is on "
                                  f"{pool.device}")
        self._gemv = DenseGemv if backend == "kernels" else GemvReference
        self._attention = DecodeAttention if backend == "kernels" else AttentionReference
        self._delta_op = DeltaDecode if backend == "kernels" else DeltaReference
        base = getattr(model, "model", None)
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(base, name):
                raise Unsupported(f"the model has no model.{name} (not a decoder of the common "
                                  f"layout)")
        head = getattr(model, "lm_head", None)
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise Unsupported("the model's lm_head is not an nn.Linear without bias")
        embed = base.embed_tokens
        dev = pool.device if pool is not None else embed.weight.device
        if type(embed) is not nn.Embedding:
            raise Unsupported(f"model.embed_tokens is a {type(embed).__name__}, not a plain "
                              f"nn.Embedding (scaled embeddings are not fused)")
        cfg = model.config
        if embed.weight.dtype != torch.bfloat16:
            raise Unsupported(f"the fused step runs bf16 models, this one is {embed.weight.dtype}")
        if embed.weight.device != dev:
            raise Unsupported(f"the model is on {embed.weight.device}, the pool on {dev}")
        for name in ("final_logit_softcapping", "logits_scaling", "embedding_multiplier"):
            if getattr(cfg, name, None) not in (None, 1, 1.0):
                raise Unsupported(f"config.{name} = {getattr(cfg, name)} is not fused")
        rope = base.rotary_emb
        kind = str(getattr(rope, "rope_type", "default"))
        if graphsafe.rope_changes_with_length(kind):
            raise Unsupported(f"rotary embedding of kind {kind!r} changes with the length")
        H = embed.weight.shape[1]
        self.model, self.pool, self.cache, self.device = model, pool, cache, dev
        self.tokens, self.hidden = int(tokens), H
        self._shape_env = os.environ.get(DENSE_SHAPE_ENV, "")
        self._shape_asked = parse_dense_shape(self._shape_env)
        default = parse_dense_shape(DEFAULT_DENSE_SHAPE)
        self.dense_shape = {**default, **self._shape_asked}
        # an attn entry changes what it names (attn=c256 keeps the default's build)
        self.dense_shape["attn"] = {**default.get("attn", {}), **self._shape_asked.get("attn", {})}
        self.skip_plan_asked = parse_skip_plan(os.environ.get(SKIP_PLAN_ENV))
        # [L, E] int64 row addresses of a bank that holds every expert (CUPOOL_SKIP_PLAN on),
        # and the bank they are in; None where the plan step runs
        self.lane_table = resident_table(pool) if self.skip_plan_asked else None
        self._table_bank = None if self.lane_table is None else pool.bank
        self.final_eps, final_one_plus = check_rms_norm(base.norm, "model.norm", H)
        self.final_norm = base.norm.weight
        self.embed = embed.weight
        self.head = self._gemv([head.weight], tokens=tokens, norm=True, epilogue=PLAIN,
                               one_plus=final_one_plus, **self._shape("head", H))
        self.vocab = head.weight.shape[0]
        by_parent = {} if pool is None else {id(s.parent): s.index for s in pool.specs}
        layer_types = getattr(cfg, "layer_types", None)
        self.layers: list[FusedLayer | DeltaLayer | ModelLayer] = []
        # what every fused layer must share, set by the first one matched
        self._attn_shape = self._w_dtype = self._experts = self._top_k = None
        self._q_gate = None
        # what every DeltaLayer must share: (hk, hv, dk, dv, in-projection width)
        self._delta_shape = None
        for i, layer in enumerate(base.layers):
            lt = layer_types[i] if layer_types else None
            try:
                self.layers.append(self._fuse(i, layer, lt, windows[i], by_parent))
            except _MLPUnsupported as e:
                self.layers.append(ModelLayer(i, layer, lt, str(e), cache_kwarg(layer)))
            except Unsupported as e:      # its token mixer: the MLP half may still be fused
                self.layers.append(self._mixer(i, layer, lt, str(e), by_parent))
        if not any(isinstance(l, FusedLayer) for l in self.layers):
            reasons = sorted({l.reason for l in self.layers})
            raise Unsupported("no decoder layer matches the fused pattern: " + "; ".join(reasons[:3]))
        if self._experts is None:
            reasons = sorted({l.reason for l in self.layers if isinstance(l, ModelLayer)})
            raise Unsupported("no MoE layer matches the fused pattern (only dense MLP layers "
                              "do): " + "; ".join(reasons[:3]))
        B = self.tokens
        bf = torch.bfloat16
        nh, hk, D = self._attn_shape
        with torch.no_grad():
            L = cache.max_len
            probe = torch.zeros(1, 1, H, dtype=bf, device=dev)
            ids = torch.arange(L, device=dev)[None]
            if getattr(rope, "mrope_section", None) is not None:
                # a multimodal rotary embedding (Qwen3.5's): a text token's position is the
                # same in each of its three sections, and the tables those give are text's
                ids = ids[None].expand(3, 1, L)
            try:
                cos, sin = rope(probe, ids)
            except (IndexError, RuntimeError, TypeError, ValueError) as e:
                raise Unsupported(f"model.rotary_emb ({type(rope).__name__}) does not take "
                                  f"position ids {list(ids.shape)}: {type(e).__name__}: "
                                  f"{e}") from None
        # the model's own tables (transformers' layers take these), and the kernel's [L, D]
        self.rope_cos, self.rope_sin = cos[0].contiguous(), sin[0].contiguous()
        first = next(l for l in self.layers if isinstance(l, FusedLayer))
        self.cos, self.sin, self.rotary_dims = kernel_rotary(
            self.rope_cos, self.rope_sin, D, base.layers[first.index].self_attn)
        sms = _cuda.target(dev).sms if dev.type == "cuda" else 1
        attn_shape = self.dense_shape.get("attn", {})
        self.workspace = AttentionWorkspace(
            B, nh, hk, D, parts(B, hk, cache.max_len, sms,
                                attn_shape.get("min_chunk", MINCHUNK)), dev)
        for l in self.layers:
            if isinstance(l, FusedLayer):
                l.attn = self._attention(nh, hk, D, workspace=self.workspace, **l.attn,
                                         rotary_dims=self.rotary_dims, **attn_shape)
        # profiling only: parts of every fused layer the step leaves out (`ABLATE` names them;
        # `benchmarks/profile_decode.py --ablate` captures the step without each to time what it
        # costs inside the graph; the logits are then meaningless)
        self.ablate: frozenset[str] = frozenset()
        self.h = torch.empty(B, H, dtype=bf, device=dev)
        self.h_mid = torch.empty(B, H, dtype=bf, device=dev)
        self.xn = torch.empty(B, H, dtype=bf, device=dev)
        self.moe = torch.empty(B, H, dtype=bf, device=dev)
        self.qkv = torch.empty(B, ((2 if self._q_gate else 1) * nh + 2 * hk) * D, dtype=bf,
                               device=dev)
        self.attn = torch.empty(B, nh * D, dtype=bf, device=dev)
        # the gated delta nets' in-projection output and their out-projection's input
        self.delta_in = self.delta_out = None
        if self._delta_shape is not None:
            hk_d, hv_d, dk_d, dv_d, width = self._delta_shape
            self.delta_in = torch.empty(B, width, dtype=bf, device=dev)
            self.delta_out = torch.empty(B, hv_d * dv_d, dtype=bf, device=dev)
        # gated attention (every fused layer's or none): the output by heads [B, nh, D] and the
        # gates' columns of qkv [B, nh, D] (each head's after its query), views made once
        self.attn_gate = None if not self._q_gate else (
            self.attn.view(B, nh, D), self.qkv[:, :2 * nh * D].view(B, nh, 2, D)[:, :, 1])
        self.logits = torch.empty(B, self.vocab, dtype=bf, device=dev)
        self.route = RouteOut.allocate(B, self._experts, self._top_k, self._w_dtype, dev)
        # the lanes' row addresses the routers write when the plan step is skipped: int64 [B·K]
        self.lane_addr = (None if self.lane_table is None else
                          torch.zeros(B * self._top_k, dtype=torch.int64, device=dev))
        # the routing inside the decode GEMM (CUPOOL_FUSED_ROUTE): whether it runs where the plan
        # step is skipped, and why not
        self.fused_route_asked = parse_fused_route(os.environ.get(FUSED_ROUTE_ENV))
        self.fused_route_why = self._fused_route_why()

    # --- matching ---------------------------------------------------------------------------
    def _fuse(self, i: int, layer: nn.Module, layer_type, window, by_parent) -> FusedLayer:
        where = f"model.layers.{i}"
        children = {n for n, _ in layer.named_children()}
        if children != _LAYER_CHILDREN:
            raise Unsupported(f"{where} has modules {sorted(children)}, not "
                              f"{sorted(_LAYER_CHILDREN)}")
        if layer_type is not None and layer_type not in ATTENTION_TYPES:
            raise Unsupported(f"{where} is a {layer_type} layer")
        H = self.hidden
        attn = layer.self_attn
        for name in _ATTN_REFUSE:
            if getattr(attn, name, None) is not None:
                raise Unsupported(f"{where}.self_attn has {name}")
        try:
            mlp_fields, mlp_commit = self._match_mlp(i, layer, by_parent)
        except Unsupported as e:
            raise _MLPUnsupported(str(e)) from None
        D = getattr(attn, "head_dim", None)
        wq, bq = _linear(attn, "q_proj", f"{where}.self_attn")
        wk, bk = _linear(attn, "k_proj", f"{where}.self_attn")
        wv, bv = _linear(attn, "v_proj", f"{where}.self_attn")
        wo, bo = _linear(attn, "o_proj", f"{where}.self_attn")
        if not isinstance(D, int) or wq.shape[0] % D or wk.shape[0] % D or wk.shape != wv.shape:
            raise Unsupported(f"{where}.self_attn: head_dim {D!r} does not divide the projections "
                              f"{list(wq.shape)}, {list(wk.shape)}, {list(wv.shape)}")
        nh, hk = wq.shape[0] // D, wk.shape[0] // D
        # gated attention (Qwen3-Next's): q_proj twice as wide as the o-projection takes, each
        # head's query followed by its output gate; the output is attention · sigmoid(gate)
        q_gate = wo.shape[1] * 2 == wq.shape[0]
        if q_gate:
            nh //= 2
        if wq.shape[1] != H or wo.shape != (H, nh * D):
            raise Unsupported(f"{where}.self_attn: projections {list(wq.shape)} / "
                              f"{list(wo.shape)} do not fit hidden {H} with {nh} heads of {D}")
        if not attention_shape_fits(nh // max(hk, 1), D):
            raise Unsupported(f"{where}.self_attn: {nh} heads of {D} dims over {hk} KV heads is "
                              f"not a shape the attention kernel is built for (head dims "
                              f"{HEAD_DIMS}, ceil(query heads a KV head / 8) · D <= 256)")
        groups = getattr(attn, "num_key_value_groups", nh // hk)
        if nh % hk or groups != nh // hk:
            raise Unsupported(f"{where}.self_attn: {nh} query heads over {hk} KV heads")
        if self._attn_shape not in (None, (nh, hk, D)):
            raise Unsupported(f"{where}.self_attn has (heads, kv heads, head dim) {(nh, hk, D)}, "
                              f"other layers {self._attn_shape}")
        if self._q_gate not in (None, q_gate):
            raise Unsupported(f"{where}.self_attn is {'' if q_gate else 'not '}gated, other "
                              f"layers are{'' if self._q_gate else ' not'}")
        qn = getattr(attn, "q_norm", None)
        kn = getattr(attn, "k_norm", None)
        if (qn is None) != (kn is None):
            raise Unsupported(f"{where}.self_attn has only one of q_norm / k_norm")
        eps_qk, qk_one_plus = 1e-6, False
        if qn is not None:
            eps_qk, qk_one_plus = check_rms_norm(qn, f"{where}.self_attn.q_norm", D)
            if check_rms_norm(kn, f"{where}.self_attn.k_norm", D) != (eps_qk, qk_one_plus):
                raise Unsupported(f"{where}.self_attn: q_norm and k_norm differ in epsilon or "
                                  f"kind")
        scale = getattr(attn, "scaling", None)
        if not isinstance(scale, float):
            raise Unsupported(f"{where}.self_attn has no float `scaling`")
        # attention sinks (gpt-oss): a logit a head whose exp(sink) joins the softmax's sum
        sinks = getattr(attn, "sinks", None)
        if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.shape == (nh,)
                                      and sinks.dtype == torch.bfloat16
                                      and sinks.device == wq.device and sinks.is_contiguous()):
            got = (f"{sinks.dtype} {list(sinks.shape)} on {sinks.device}"
                   if isinstance(sinks, torch.Tensor) else type(sinks).__name__)
            raise Unsupported(f"{where}.self_attn.sinks is {got}, not a contiguous bf16 [{nh}] "
                              f"beside the projections")
        in_eps, in_one_plus = check_rms_norm(layer.input_layernorm, f"{where}.input_layernorm", H)
        B = self.tokens
        # NVFP4 projections kept packed (a checkpoint's, or quantize_linears'): their GEMVs read
        # those, a quarter of the bf16 bytes
        pqkv = _packed(attn, ("q_proj", "k_proj", "v_proj"))
        po = _packed(attn, ("o_proj",))
        shapes = {"qkv": self._shape("qkv", H, pqkv is not None),
                  "o": self._shape("o", nh * D, po is not None)}
        try:
            qkv = self._gemv(pqkv or [wq, wk, wv], None if bq is None else [bq, bk, bv],
                             tokens=B, norm=True, epilogue=PLAIN, one_plus=in_one_plus,
                             **shapes["qkv"])
            o = self._gemv(po or [wo], None if bo is None else [bo], tokens=B, epilogue=RESIDUAL,
                           **shapes["o"])
            # the attention launcher is made once every layer is matched (they share a workspace
            # of the heads' shape)
            att = {"q_norm": None if qn is None else qn.weight,
                   "k_norm": None if kn is None else kn.weight, "eps": eps_qk, "scale": scale,
                   "window": int(window or 0), "sinks": sinks, "q_gate": q_gate,
                   "one_plus": qk_one_plus}
        except (ValueError, TypeError) as e:
            raise Unsupported(f"{where}: {e}") from None
        self._attn_shape, self._q_gate = (nh, hk, D), q_gate
        self._commit_mlp(mlp_commit)
        return FusedLayer(i, qkv, att, o, in_norm=layer.input_layernorm.weight, in_eps=in_eps,
                          **mlp_fields)

    def _mixer(self, i: int, layer: nn.Module, layer_type, reason: str, by_parent) -> ModelLayer:
        """Decoder layer i, whose token mixer did not match (`reason`), as a MixerLayer where its
        MLP half does (an input norm, one mixer module, a post-attention norm and an MLP of the
        pattern), else as a ModelLayer (with `reason`)."""
        children = {n for n, _ in layer.named_children()}
        rest = children - {"input_layernorm", "post_attention_layernorm", "mlp"}
        if len(rest) != 1 or len(children) != 4:
            return ModelLayer(i, layer, layer_type, reason, cache_kwarg(layer))
        try:
            fields, commit = self._match_mlp(i, layer, by_parent)
        except Unsupported as e:
            return ModelLayer(i, layer, layer_type, f"{reason}; its MLP: {e}", cache_kwarg(layer))
        if rest == {"linear_attn"}:
            try:
                mixer = self._delta(i, layer)
            except Unsupported as e:
                reason = str(e)           # why the delta net is not on the kernels
            else:
                self._commit_mlp(commit)
                return DeltaLayer(index=i, **mixer, **fields)
        self._commit_mlp(commit)
        return MixerLayer(i, layer, layer_type, reason, cache_kwarg(layer), **fields)

    def _delta(self, i: int, layer: nn.Module) -> dict:
        """The DeltaLayer fields proj, delta, out, in_norm, in_eps of decoder layer i's gated
        delta net (`layer.linear_attn`: Qwen3-Next's or Qwen3.5's), or Unsupported with the
        reason it does not match."""
        where = f"model.layers.{i}.linear_attn"
        la, H, B = layer.linear_attn, self.hidden, self.tokens
        names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
        dims = [getattr(la, n, None) for n in names]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dims):
            raise Unsupported(f"{where} ({type(la).__name__}) has no int {', '.join(names)}: "
                              f"not a gated delta net")
        hk, hv, dk, dv = dims
        if hv % hk:
            raise Unsupported(f"{where}: {hv} value heads over {hk} key heads")
        if dk not in DELTA_DIMS or dv not in DELTA_DIMS:
            raise Unsupported(f"{where}: key / value head dims {dk} / {dv}; delta_decode is "
                              f"built for {DELTA_DIMS}")
        if getattr(la, "activation", None) != "silu":
            raise Unsupported(f"{where}'s convolution activation is "
                              f"{getattr(la, 'activation', None)!r}, not 'silu'")
        C = 2 * hk * dk + hv * dv
        conv = getattr(la, "conv1d", None)
        KC = conv.kernel_size[0] if isinstance(conv, nn.Conv1d) else None
        if not (isinstance(conv, nn.Conv1d) and conv.in_channels == conv.out_channels == C
                and conv.groups == C and conv.bias is None and conv.stride == (1,)
                and conv.dilation == (1,) and conv.padding == (KC - 1,)):
            raise Unsupported(f"{where}.conv1d is not a causal depthwise Conv1d of {C} channels "
                              f"without bias")
        if KC not in CONV_KERNELS:
            raise Unsupported(f"{where}.conv1d's kernel is {KC}; delta_decode takes "
                              f"{CONV_KERNELS.start} to {CONV_KERNELS.stop - 1}")
        grouped = all(isinstance(getattr(la, n, None), nn.Linear) for n in _DELTA_GROUPED)
        names = _DELTA_GROUPED if grouped else _DELTA_FLAT
        mats = [_linear(la, n, where) for n in names]
        if any(b is not None for _, b in mats):
            raise Unsupported(f"{where}'s in-projections have biases")
        rows = [2 * hk * dk + 2 * hv * dv, 2 * hv] if grouped else [C, hv * dv, hv, hv]
        if [tuple(w.shape) for w, _ in mats] != [(n, H) for n in rows]:
            raise Unsupported(f"{where}: {', '.join(names)} are "
                              f"{[list(w.shape) for w, _ in mats]}, not rows {rows} of hidden {H}")
        if grouped:
            self._check_grouped_layout(la, where, hk, hv, dk, dv)
        wo, bo = _linear(la, "out_proj", where)
        if bo is not None or tuple(wo.shape) != (H, hv * dv):
            raise Unsupported(f"{where}.out_proj is {list(wo.shape)}"
                              f"{' with a bias' if bo is not None else ''}, not [{H}, {hv * dv}] "
                              f"without bias")
        vecs = [getattr(la, n, None) for n in ("A_log", "dt_bias")]
        if not all(isinstance(v, torch.Tensor) and v.shape == (hv,) and v.is_floating_point()
                   for v in vecs):
            raise Unsupported(f"{where} has no float A_log and dt_bias [{hv}]")
        norm_eps = check_gated_norm(getattr(la, "norm", None), f"{where}.norm", dv)
        in_eps, in_one_plus = check_rms_norm(layer.input_layernorm,
                                             f"model.layers.{i}.input_layernorm", H)
        width = 2 * hk * dk + 2 * hv * dv + 2 * hv
        if self._delta_shape not in (None, (hk, hv, dk, dv, width)):
            raise Unsupported(f"{where} has (key heads, value heads, key dim, value dim) "
                              f"{(hk, hv, dk, dv)}, other layers {self._delta_shape[:4]}")
        weights = [w for w, _ in mats]
        if not grouped:          # b and a as one matrix (a DenseGemv takes up to three)
            weights = weights[:2] + [_joined(la.in_proj_b, la.in_proj_a)]
        try:
            proj = self._gemv(weights, None, tokens=B, norm=True, epilogue=PLAIN,
                              one_plus=in_one_plus, **self._shape("qkv", H))
            out = self._gemv([wo], None, tokens=B, epilogue=RESIDUAL,
                             **self._shape("o", hv * dv))
            with torch.no_grad():
                neg_a = -la.A_log.detach().float().exp()
                dt_bias = la.dt_bias.detach().float().contiguous()
            delta = self._delta_op(hk, hv, dk, dv, grouped=grouped,
                                   conv_w=conv.weight.detach().squeeze(1), neg_a=neg_a,
                                   dt_bias=dt_bias, norm_w=la.norm.weight.detach(),
                                   eps=norm_eps, tokens=B)
        except (ValueError, TypeError) as e:
            raise Unsupported(f"{where}: {e}") from None
        self._delta_shape = (hk, hv, dk, dv, width)
        return dict(proj=proj, delta=delta, out=out, in_norm=layer.input_layernorm.weight,
                    in_eps=in_eps)

    @staticmethod
    def _check_grouped_layout(la: nn.Module, where: str, hk: int, hv: int, dk: int,
                              dv: int) -> None:
        """Unsupported unless the module's own fix_query_key_value_ordering splits in_proj_qkvz's
        and in_proj_ba's outputs as `cupool.reference.dense.delta_projection` (grouped) does: a
        probe on column numbers."""
        fix = getattr(la, "fix_query_key_value_ordering", None)
        n1 = 2 * hk * dk + 2 * hv * dv
        cols = torch.arange(n1 + 2 * hv, dtype=torch.float32)[None]
        try:
            got = fix(cols[:, None, :n1], cols[:, None, n1:])
        except (TypeError, RuntimeError) as e:
            raise Unsupported(f"{where}.fix_query_key_value_ordering does not split a probe: "
                              f"{type(e).__name__}: {e}") from None
        mixed, z, b, a = delta_projection(cols, hk, hv, dk, dv, True)
        want = (mixed[:, :hk * dk], mixed[:, hk * dk:2 * hk * dk], mixed[:, 2 * hk * dk:], z,
                b, a)
        if not (isinstance(got, tuple) and len(got) == 6 and all(
                torch.equal(g.reshape(-1), w.reshape(-1)) for g, w in zip(got, want))):
            raise Unsupported(f"{where}.fix_query_key_value_ordering lays in_proj_qkvz / "
                              f"in_proj_ba out otherwise than Qwen3-Next's grouped layout (a "
                              f"probe differs)")

    def _match_mlp(self, i: int, layer: nn.Module, by_parent) -> tuple[dict, tuple | None]:
        """The MLP half of decoder layer i on the kernels: post-attention norm → router → pooled
        experts (+ a shared expert), or a dense MLP. Returns (the FusedLayer / MixerLayer fields
        router, top_k, norm_topk, post_norm, post_eps, pooled, mlp; what `_commit_mlp` records
        once the whole layer matched: None for a dense MLP); Unsupported where it does not
        match."""
        where = f"model.layers.{i}"
        H = self.hidden
        mlp = layer.mlp
        moe_children = {n for n, _ in mlp.named_children()}
        dense = moe_children == _DENSE_MLP
        shared = next((s for s in (_SHARED, _SHARED_UNGATED) if s <= moe_children), set())
        if not dense and moe_children - shared not in _MOE_CHILDREN:
            raise Unsupported(f"{where}.mlp has modules {sorted(moe_children)}, not a MoE block "
                              f"of {' or '.join(str(sorted(c)) for c in _MOE_CHILDREN)} (with "
                              f"{sorted(_SHARED)} or {sorted(_SHARED_UNGATED)}), or a dense MLP "
                              f"of {sorted(_DENSE_MLP)}")
        gname = gate = moe = None
        experts = top_k = 0
        if not dense:
            gname, gate = router_of(mlp)
            pool = self.pool
            if pool is not None:
                spec = by_parent.get(id(mlp))
                if spec is None:
                    raise Unsupported(f"{where}.mlp is not one of the pool's MoE layers")
                experts, top_k, moe = pool.num_experts, pool.top_k, pool.layers[spec]
            else:
                gw = getattr(gate, "weight", None)
                experts = gw.shape[0] if isinstance(gw, torch.Tensor) else -1
                top_k = int(getattr(gate, "top_k", 0))
                moe = _ModelExperts(mlp.experts, experts)
            if self._experts is not None and (self._experts, self._top_k) != (experts, top_k):
                raise Unsupported(f"{where}.mlp has {experts} experts, top-{top_k}; other layers "
                                  f"{self._experts}, top-{self._top_k}")
        post_eps, post_one_plus = check_rms_norm(layer.post_attention_layernorm,
                                                 f"{where}.post_attention_layernorm", H)
        norm_topk, w_dtype, sigmoid = False, None, None
        if not dense:
            check = check_sigmoid_router if hasattr(gate, "e_score_correction_bias") \
                else check_router
            norm_topk, w_dtype, *sig = check(gate, f"{where}.mlp.{gname}", experts, H, top_k)
            sigmoid = sig[0] if sig else None
            if self._w_dtype not in (None, w_dtype):
                raise Unsupported(f"{where}.mlp.{gname} returns {w_dtype} weights, other layers "
                                  f"{self._w_dtype}")
        shape = self._shape("router", H)      # a ValueError naming the variable, not Unsupported
        try:
            router = None
            if not dense:
                gbias = getattr(gate, "bias", None)
                router = self._gemv([gate.weight], None if gbias is None else [gbias],
                                    tokens=self.tokens, norm=True, epilogue=ROUTE,
                                    lane_addr=self.lane_table is not None, sigmoid=sigmoid,
                                    one_plus=post_one_plus, **shape)
            if dense:
                gmlp = self._gated_mlp(mlp, None, f"{where}.mlp", norm=True,
                                       one_plus=post_one_plus)
            elif shared == _SHARED:
                gmlp = self._gated_mlp(mlp.shared_expert, mlp.shared_expert_gate,
                                       f"{where}.mlp.shared_expert", norm=False)
            elif shared:
                gmlp = self._gated_mlp(mlp.shared_experts, None, f"{where}.mlp.shared_experts",
                                       norm=False)
            else:
                gmlp = None
        except (ValueError, TypeError) as e:
            raise Unsupported(f"{where}: {e}") from None
        fields = dict(router=router, top_k=top_k, norm_topk=norm_topk,
                      post_norm=layer.post_attention_layernorm.weight, post_eps=post_eps,
                      pooled=moe, mlp=gmlp)
        return fields, None if dense else (w_dtype, experts, top_k)

    def _commit_mlp(self, commit: tuple | None) -> None:
        """Record what every MoE layer must share, once a layer's match is complete."""
        if commit is not None:
            self._w_dtype, self._experts, self._top_k = commit

    def _gated_mlp(self, mlp: nn.Module, gate: nn.Module | None, where: str,
                   norm: bool, one_plus: bool = False) -> GatedMLP:
        """The GEMVs of a gated MLP `mlp` (gate_proj, up_proj, down_proj, a SiLU act_fn): with
        `gate`, a shared expert's sigmoid gate (a Linear of the hidden size to one output), whose
        row joins the gate and up rows; with `norm`, the gate and up GEMV norms its input (a
        dense layer's post-attention norm, of `one_plus`'s kind), else (a shared expert) the down
        GEMV adds the routed experts' sum."""
        H = self.hidden
        act = getattr(mlp, "act_fn", None)
        if not isinstance(act, nn.Module):
            raise Unsupported(f"{where} has no act_fn module (not a gated MLP of gate_proj, "
                              f"up_proj, down_proj)")
        check_silu(act, f"{where}.act_fn", self.device)
        wg, bg = _linear(mlp, "gate_proj", where)
        wu, bu = _linear(mlp, "up_proj", where)
        wd, bd = _linear(mlp, "down_proj", where)
        size = wg.shape[0]
        if wg.shape != (size, H) or wu.shape != (size, H) or wd.shape != (H, size):
            raise Unsupported(f"{where}: gate_proj / up_proj / down_proj {list(wg.shape)} / "
                              f"{list(wu.shape)} / {list(wd.shape)} do not fit hidden {H}")
        weights, biases = [wg, wu], [bg, bu]
        if gate is not None:
            if not isinstance(gate, nn.Linear) or gate.weight.shape != (1, H):
                got = (list(gate.weight.shape) if isinstance(gate, nn.Linear)
                       else type(gate).__name__)
                raise Unsupported(f"{where}_gate is {got}, not a Linear of hidden {H} to one "
                                  f"output")
            weights.append(gate.weight)
            biases.append(gate.bias)
        B = self.tokens
        gate_up = self._gemv(weights, None if all(b is None for b in biases) else biases,
                             tokens=B, norm=norm, epilogue=PLAIN, one_plus=one_plus,
                             **self._shape("mlp", H))
        # silu(g) · u in the down GEMV's prologue; a shared expert's sigmoid gate and the routed
        # experts' sum in its epilogue
        down = self._gemv([wd], None if bd is None else [bd], tokens=B,
                          epilogue=PLAIN if norm else RESIDUAL, glu=True,
                          glu_gate=gate is not None, **self._shape("mlp_down", size))
        bf, dev = torch.bfloat16, wg.device
        return GatedMLP(gate_up, down, torch.empty(B, gate_up.N, dtype=bf, device=dev),
                        torch.empty(B, H, dtype=bf, device=dev))

    def _shape(self, gemv: str, K: int, nvfp4: bool = False) -> dict[str, int]:
        """The launch-shape keywords of `gemv` (K: its inner dim; nvfp4: its weights are NVFP4,
        chunks of 64 columns): CUPOOL_DENSE_SHAPE's, checked here so that a shape the GEMV cannot
        take raises rather than unfusing the layer, else DEFAULT_DENSE_SHAPE's with split_k
        lowered to what K takes."""
        chunk = chunk_cols(nvfp4)
        kw = dict(self.dense_shape.get(gemv, {}))
        if gemv not in self._shape_asked and "split_k" in kw:
            kw["split_k"] = max(1, min(kw["split_k"], K // chunk))
        try:
            check_launch_shape(kw.get("warps", WARPS), kw.get("split_k", 1), K, chunk)
        except ValueError as e:
            raise ValueError(f"{DENSE_SHAPE_ENV}={self._shape_env!r}: {gemv}: {e}") from None
        return kw

    def describe(self) -> str:
        """One line: how many layers are fused (and the launch shapes asked for), and why the
        others are not."""
        fused = sum(isinstance(l, (FusedLayer, DeltaLayer)) for l in self.layers)
        text = f"fused decode step: {fused} of {len(self.layers)} layers"
        if self._shape_env:
            text += f" ({DENSE_SHAPE_ENV}={self._shape_env})"
        if self.lane_table is not None:        # asked for, and the bank holds every expert
            why = self._plan_needed()
            text += ("; plan step and row copies skipped (every expert has a bank row; "
                     f"{SKIP_PLAN_ENV}=0 keeps them)" if why is None else
                     f"; the plan step runs though every expert has a bank row: {why}")
            if why is None and self.fused_route_asked:
                text += ("; routing inside the decode GEMM's launch" if self.fused_route_why is None
                         else f"; the router keeps its own launch: {self.fused_route_why}")
        fl = [l for l in self.layers if isinstance(l, FusedLayer)]
        deltas = [l for l in self.layers if isinstance(l, DeltaLayer)]
        mixers = [l for l in self.layers if isinstance(l, MixerLayer)]
        if deltas:
            text += f"; gated delta nets in layers {[l.index for l in deltas]}"
        if mixers:
            text += (f"; transformers' token mixers for layers {[l.index for l in mixers]}, "
                     f"their MLPs fused ({mixers[0].reason})")
        halves = [l for l in self.layers if isinstance(l, MLPHalf)]   # MLP halves on the kernels
        shared = sum(l.mlp is not None and not l.dense for l in halves)
        if shared:
            text += f"; a shared expert in {shared} layer{'s' * (shared != 1)}"
        sig = sum(not l.dense and l.router.sigmoid is not None for l in halves)
        if sig:
            text += f"; a sigmoid router in {sig} layer{'s' * (sig != 1)}"
        dense = sum(l.dense for l in halves)
        if dense:
            text += f"; a dense MLP in {dense} layer{'s' * (dense != 1)}"
        if self.attn_gate is not None:          # every fused layer's, as they share the heads
            text += f"; gated attention in {len(fl)} layer{'s' * (len(fl) != 1)}"
        if self.head.one_plus:
            text += "; (1 + w) RMSNorms"
        nv = [f"{name} in {n} layers" for name, n in self.nvfp4_gemvs().items() if n]
        if nv:
            text += f"; NVFP4 weights for {', '.join(nv)}"
        others = [l for l in self.layers
                  if isinstance(l, ModelLayer) and not isinstance(l, MixerLayer)]
        if others:
            text += f"; transformers' modules for layers {[l.index for l in others]} ({others[0].reason})"
        return text

    def nvfp4_gemvs(self) -> dict[str, int]:
        """{"qkv": n, "o": n}: in how many fused layers that GEMV reads NVFP4 weights (a
        checkpoint's, or those `from_pretrained(quantize_attention=True)` made)."""
        fl = [l for l in self.layers if isinstance(l, FusedLayer)]
        return {name: sum(getattr(l, name).nvfp4 for l in fl) for name in ("qkv", "o")}

    @property
    def needs_mask(self) -> bool:
        """Whether some layer runs transformers' module (it takes the engine's masks)."""
        return any(isinstance(l, ModelLayer) for l in self.layers)

    def narrow_why(self) -> str | None:
        """Why this step cannot run some slots of a cache of more (`__call__(slots=)`), or None:
        every layer must be fused (transformers' modules take every slot's cache and states)."""
        if self.needs_mask:
            others = [l.index for l in self.layers if isinstance(l, ModelLayer)]
            return f"layers {others} run transformers' modules, which take every slot"
        return None

    def _fused_route_why(self) -> str | None:
        """Why the router keeps its own launch where the plan step is skipped (None: the decode
        GEMM routes); where the plan step always runs, the reason that says so."""
        if self.lane_table is None:
            return "the plan step runs"
        if self.backend != "kernels":
            return "the reference backend routes with torch ops"
        if not self.fused_route_asked:
            return f"{FUSED_ROUTE_ENV} is not 1"
        if self._w_dtype not in (torch.float32, torch.bfloat16):
            return f"the router returns {self._w_dtype} weights (float32 or bf16 are routed)"
        if any(isinstance(l, MLPHalf) and not l.dense
               and (l.router.biases or [None])[0] is not None
               for l in self.layers):
            return "the router has a bias (the decode GEMM's routing adds none)"
        if any(isinstance(l, MLPHalf) and not l.dense and l.router.sigmoid is not None
               for l in self.layers):
            return "the router is a sigmoid router (the decode GEMM's routing is softmax top-k)"
        if any(isinstance(l, MLPHalf) and not l.dense and l.router.one_plus
               for l in self.layers):
            return ("the post-attention norm is a (1 + w) one (the decode GEMM's routing norms "
                    "with w)")
        # (each router's weight is a contiguous, aligned bf16 matrix: its DenseGemv checked it)
        return self.pool.gemm.routes_decode(self.tokens, self._experts)

    def _plan_needed(self) -> str | None:
        """Why the pool's decode path must run although the bank holds every expert (None: the
        plan step can be skipped): something of the pool's that the plan step serves."""
        p = self.pool
        if p.bank is not self._table_bank:
            return "the pool's bank was replaced after the step was built"
        for name in ("prefetcher", "routing_hook", "decode_backend"):
            if getattr(p, name) is not None:
                return f"the pool has a {name}"
        if p.overlap_copies:
            return "the pool's overlap_copies is on"
        return None

    # --- the step ---------------------------------------------------------------------------
    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, active: torch.Tensor,
                 masks=None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] (bf16) of tokens tok [B, 1] at positions pos [B] (int64), the cache
        taking their keys and values; active [B] bool marks the real tokens (the others' lanes
        are padding). masks: the attention mask(s) transformers' modules take (only for layers
        that run them). slots: int64 [B] on the step's device, token b's slot of a cache of more
        slots than B (distinct slots: their values are the caller's, not checked on the
        device), which alone are read and written (`narrow_why` says where this cannot run);
        None: token b's slot is b, the cache has B slots.
        Device work only: capturable."""
        B = self.tokens
        if tok.shape != (B, 1) or pos.shape != (B,) or active.shape != (B,):
            raise ValueError(f"tok, pos, active must be [{B}, 1], [{B}], [{B}]; got "
                             f"{list(tok.shape)}, {list(pos.shape)}, {list(active.shape)}")
        if slots is not None:
            if (why := self.narrow_why()) is not None:
                raise ValueError(f"slots: {why}")
            if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 \
                    or slots.shape != (B,) or slots.device != pos.device:
                got = (f"{slots.dtype} {list(slots.shape)} on {slots.device}"
                       if isinstance(slots, torch.Tensor) else type(slots).__name__)
                raise ValueError(f"slots must be an int64 [{B}] tensor on {pos.device}, got {got}")
        elif self.cache.slots != B:
            raise ValueError(f"the cache has {self.cache.slots} slots for a step of {B} tokens: "
                             f"pass slots, each token's slot")
        x = nn.functional.embedding(tok[:, 0], self.embed)             # [B, H]
        # the attention's positions: -1 for an inactive slot, which then reads and writes none of
        # its cache (a free slot keeps a finished request's context for reuse, however long)
        apos = torch.where(active, pos, -1)
        res, add = x, None            # the residual stream is res (+ add, when add is not None)
        cache = self.cache
        rotary = None        # the step's cos / sin rows, gathered once for transformers' layers
        skip_plan = self.lane_table is not None and self._plan_needed() is None
        if self.pool is not None:
            self.pool.plan_skipped = skip_plan
        for layer in self.layers:
            if isinstance(layer, ModelLayer):
                h = res if add is None else res + add
                mask = masks.get(layer.layer_type) if isinstance(masks, dict) else masks
                if rotary is None:
                    rotary = (self.rope_cos.index_select(0, pos)[:, None],
                              self.rope_sin.index_select(0, pos)[:, None])
                kw = dict(attention_mask=mask, position_ids=pos[:, None],
                          position_embeddings=rotary, use_cache=True, **{layer.cache_kw: cache})
                out = (self._run_mixer(layer, h, active, skip_plan, **kw)
                       if isinstance(layer, MixerLayer) else layer.module(h[:, None], **kw))
                out = out[0] if isinstance(out, tuple) else out
                res, add = out[:, 0].contiguous(), None
                continue
            h = self.h if add is not None else res
            if isinstance(layer, DeltaLayer):
                if not isinstance(cache, StateSlotCache):
                    raise TypeError(f"layer {layer.index} is a gated delta net: the cache must "
                                    f"keep per-slot states (a StateSlotCache), got "
                                    f"{type(cache).__name__}")
                states = cache.layers[layer.index]
                conv_state, state = states.conv.get(0), states.recurrent.get(0)
                if conv_state is None or state is None:
                    raise RuntimeError(f"layer {layer.index}'s convolution and recurrent states "
                                       f"are not allocated yet: run a prefill through the cache "
                                       f"before the first decode step")
                layer.proj(res, add=add, norm_weight=layer.in_norm, eps=layer.in_eps,
                           h_out=self.h if add is not None else None, out=self.delta_in)
                layer.delta(self.delta_in, apos, conv_state, state, self.delta_out, slots=slots)
                layer.out(self.delta_out, residual=h, out=self.h_mid)
                res, add = self.h_mid, self._mlp_half(layer, self.h_mid, active, skip_plan)
                continue
            k_cache, v_cache = cache.keys[layer.index], cache.values[layer.index]
            if k_cache is None:
                raise RuntimeError(f"layer {layer.index}'s KV cache is not allocated yet: run a "
                                   f"prefill through the cache before the first decode step")
            skip = self.ablate
            if "qkv" not in skip:
                layer.qkv(res, add=add, norm_weight=layer.in_norm, eps=layer.in_eps,
                          h_out=self.h if add is not None else None, out=self.qkv)
            if "attention" not in skip:
                layer.attn(self.qkv, apos, k_cache, v_cache, self.cos, self.sin, self.attn,
                           slots=slots)
            if self.attn_gate is not None:     # attention · sigmoid(gate), each op rounded
                a, gate = self.attn_gate
                torch.mul(a, torch.sigmoid(gate), out=a)
            if "o" not in skip:
                layer.o(self.attn, residual=h, out=self.h_mid)
            res, add = self.h_mid, self._mlp_half(layer, self.h_mid, active, skip_plan)
        self.head(res, add=add, norm_weight=self.final_norm, eps=self.final_eps, out=self.logits)
        return self.logits

    def _mlp_half(self, layer: MLPHalf, h_mid: torch.Tensor,
                  active: torch.Tensor, skip_plan: bool) -> torch.Tensor:
        """The MLP half of a FusedLayer, DeltaLayer or MixerLayer on h_mid [B, H] (the residual
        stream after the mixer): its output [B, H], which the residual stream adds next."""
        skip = self.ablate
        if layer.dense:                # its gate and up GEMV norms h_mid itself
            return self._gated_mlp_out(layer.mlp, h_mid, layer)
        r = self.route
        if skip_plan and self.fused_route_why is None:     # router and MoE: one launch
            if "moe" not in skip:
                self.pool.gemm.decode_routed(
                    h_mid, layer.router.weights[0], layer.post_norm, layer.post_eps,
                    layer.norm_topk, self.lane_table[layer.pooled.layer], x_out=self.xn,
                    logits=r.logits, ids=r.ids, weights=r.weights, lane_addr=self.lane_addr,
                    count=r.ticket, active=active, out=self.moe)
            return self._with_shared(layer)
        # with the plan step skipped the router writes the lanes' row addresses too
        lanes = ({"table": self.lane_table[layer.pooled.layer], "lane_addr": self.lane_addr}
                 if skip_plan else {})
        if "router" not in skip:
            layer.router(h_mid, norm_weight=layer.post_norm, eps=layer.post_eps,
                         x_out=self.xn, route=r, top_k=layer.top_k,
                         norm_topk=layer.norm_topk, active=active, **lanes)
        if skip_plan:             # no plan step to leave out ("plan"): only "moe" applies
            if "moe" not in skip:
                self.pool.gemm.decode(self.xn, self.lane_addr, r.weights, self.moe)
        elif "plan" in skip:
            W = r.ids.numel()
            self.pool.gemm.decode(self.xn, self.pool.bank.lane_addr[:W], r.weights, self.moe)
        elif "moe" not in skip:
            layer.pooled.decode(self.xn, r.ids, r.weights, self.moe, mask=active,
                                ids_masked=True)
        return self._with_shared(layer)

    def _run_mixer(self, layer: MixerLayer, h: torch.Tensor, active: torch.Tensor,
                   skip_plan: bool, **kw) -> torch.Tensor:
        """Transformers' decoder layer of a MixerLayer on h [B, H] (kw: its forward's other
        arguments), with its post-attention norm stood in for by the identity and its MLP by
        `_mlp_half` (which norms the mixer's residual sum itself), put back after."""
        mods = layer.module._modules
        saved = mods["post_attention_layernorm"], mods["mlp"]
        mods["post_attention_layernorm"] = _StandIn(lambda x: x)
        mods["mlp"] = _StandIn(
            lambda x: self._mlp_half(layer, x[:, 0], active, skip_plan)[:, None])
        try:
            return layer.module(h[:, None], **kw)
        finally:
            mods["post_attention_layernorm"], mods["mlp"] = saved

    def _with_shared(self, layer: MLPHalf) -> torch.Tensor:
        """A MoE layer's MLP output: the routed experts' (self.moe), plus its shared expert's on
        the router's normed rows (self.xn) where it has one, rounded where transformers' block
        rounds."""
        if layer.mlp is None:
            return self.moe
        return self._gated_mlp_out(layer.mlp, self.xn)

    def _gated_mlp_out(self, m: GatedMLP, x: torch.Tensor,
                       layer: MLPHalf | None = None) -> torch.Tensor:
        """Two launches: down(silu(gate(x)) · up(x)); a shared expert's times sigmoid of the
        gate's logit where `m.gated`, plus the routed experts' sum (self.moe). A GatedMLP whose
        gate and up GEMV norms (a dense layer's) takes the norm of `layer`."""
        if m.gate_up.norm:
            m.gate_up(x, norm_weight=layer.post_norm, eps=layer.post_eps, out=m.gu)
            m.down(m.gu, out=m.out)
        else:
            m.gate_up(x, out=m.gu)
            m.down(m.gu, residual=self.moe, out=m.out)
        return m.out
