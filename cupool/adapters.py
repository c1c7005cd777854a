"""Find the MoE layers of a PyTorch model: which module holds each layer's routed experts, and how.

Shape legend (ARCHITECTURE.md): L MoE layers · E experts per layer · K top-k · H hidden size ·
I expert intermediate size. Weights are returned in the `F.linear` convention ([out, in]):
gate and up [I, H], down [H, I]; an expert computes down(act(gate·x + b_g, up·x + b_u)) + b_d,
act SiLU(gate)·up for most families (biases absent), gpt-oss's clamped SwiGLU for gpt-oss.

Two kinds of layer are recognised, both by what a module *is*, never by the model's class name:

- ``hf_experts``: a transformers ≥ 5 experts module, i.e. a class decorated with
  ``use_experts_implementation``. The decorator sets ``has_gate``, ``has_bias``, ``is_transposed``,
  ``is_concatenated`` and ``config`` on every instance; the weights are two 3-D parameters,
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] ([E, H, 2I] / [E, I, H] when
  transposed). Every experts implementation transformers dispatches to (eager, grouped_mm,
  batched_mm, ...) computes linear(gate_up) → ``_apply_gate`` → linear(down), so the flags plus
  ``_apply_gate`` define what the module computes; ``_apply_gate`` is checked on a probe input.
- ``linear_list``: a hand-written block whose ``experts`` is an ``nn.ModuleList`` of modules with
  bias-free ``nn.Linear`` children (gate_proj, up_proj, down_proj) or Mixtral's (w1, w3, w2) =
  (gate, up, down), next to a router ``gate`` = ``nn.Linear(H, E, bias=False)`` and a ``top_k``
  (or ``num_experts_per_tok``) attribute. Expert 0's forward is checked on a probe input.

How the families of transformers 5.17 map. The experts module is always the block's `.experts`
(kind hf_experts, class <Family>Experts); K is read from every source present, which must agree:

    family       block (parent)          E (config)         K from                    left as they are
    -----------  ----------------------  -----------------  ------------------------  ----------------------
    Qwen3-MoE    Qwen3MoeSparseMoeBlock  num_experts        gate.top_k, config        dense layers (1)
    Qwen2-MoE    Qwen2MoeSparseMoeBlock  num_experts        gate.top_k, config        shared_expert (+ its
                                                                                      sigmoid gate), dense (1)
    Mixtral      MixtralSparseMoeBlock   num_local_experts  block.top_k, gate.top_k,  -
                                                            config
    OLMoE        OlmoeSparseMoeBlock     num_experts        gate.top_k, config        -
    DeepSeek-V3  DeepseekV3MoE           n_routed_experts   gate.top_k, config        shared_experts; layers
                                                                                      < first_k_dense_replace
    hand-written any block with          len(experts)       block.top_k or            everything but the
                 .experts ModuleList                        num_experts_per_tok       experts list
                 (kind linear_list)

    (1) layers in mlp_only_layers or off the decoder_sparse_step grid hold a dense <Family>MLP.
    "config" is `num_experts_per_tok` of the experts module's `config` (the decorator stores the
    model's config on every experts module) and of the block's, where it has one.

The router ("gate") always stays the model's own: DeepSeek-V3's group-limited sigmoid routing with
its ``routed_scaling_factor``, Qwen's optional renormalisation and Mixtral's softmax all happen
before the experts module is called, and reach it as (top_k_index, top_k_weights).

Other transformers families whose experts modules carry the decorator with the default flags
(Qwen3-Next, Qwen3.5-MoE, GLM-4-MoE, DeepSeek-V2, Jamba, PhiMoE, MiniMax, ERNIE-4.5-MoE, ...)
are found the same way; only the five above are in the tests.

Experts with biases and a clamped SwiGLU (gpt-oss: ``has_bias``, interleaved gate/up, transposed,
``_apply_gate`` = (clamp(up) + 1) · g · σ(alpha · g), g = min(gate, limit), alpha and limit on the
module) are served: the activation is whichever of `cupool.activation`'s the probe of
``_apply_gate`` matches (SiLU, or the clamped SwiGLU with the module's own alpha and limit), and
the biases go into each expert's row.

Experts without a gate (``has_gate=False``: Nemotron-H's ``up_proj`` [E, I, H] and ``down_proj``,
down(act_fn(up·x))) are read with ``gated=False`` and ``expert(e)`` = (None, up, down) when their
``act_fn`` measures as ReLU² (`cupool.activation.RELU2`); with a latent MoE (Nemotron-3-Super's
``moe_latent_size``) H is the latent size the experts work in, the block's router scoring its
input of hidden_size before ``fc1_latent_proj``; their rows are ``RowLayout(gated=False)`` and the
kernels' ROW_GATED=0 builds compute them.

Not supported (an ``UnsupportedModelError`` "<module path>: unsupported, because ..." rather than
wrong output): experts whose outputs are normalised (has_post_expert_norm), non-gated experts with
another act_fn or with biases, an ``_apply_gate`` that computes neither activation (the message gives the difference from each), biases on per-expert nn.Linear lists,
expert
weights that are not float (already quantized), fused 3-D experts without the decorator (Llama-4,
LongCat-Flash: their layout cannot be known), experts lists with unequal shapes or whose forward is
not SwiGLU, and anything else named ``experts`` (including an experts module cupool already
swapped in). `find_moe_layers` raises instead of skipping such a module: a partly wrapped model would
keep most of its expert weights where they are, which is what cupool exists to avoid.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch import nn

from cupool.activation import RELU2, SILU, Activation, swiglu_clamp
from cupool.checkpoints.base import join_gate_up, split_gate_up

KIND_HF = "hf_experts"
KIND_LIST = "linear_list"

# (gate, up, down) attribute names of one expert in a linear list, in the order they are tried.
LINEAR_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_ACT_ATTRS = ("act_fn", "act", "activation", "activation_fn")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# Probe inputs are scaled so that pre-activations reach a few units: large enough that SiLU,
# GELU and ReLU differ clearly and that clamps like gpt-oss's (limit 7) engage.
_PROBE_SCALE = 4.0


class UnsupportedModelError(ValueError):
    """A module that looks like part of an MoE layer but that cupool cannot serve exactly."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: unsupported, because {reason}")

    def __reduce__(self):  # pickles (e.g. across worker processes) with both fields, not args
        return type(self), (self.path, self.reason)


@dataclasses.dataclass(eq=False)
class MoELayerSpec:
    """One MoE layer: where its routed experts live and their shapes.

    `concatenated`, `transposed` (hf_experts) and `linear_names` (linear_list) say how the weights
    sit in `module`; `expert`, `stacked` and `release` read them.
    """
    index: int                 # 0..L-1 in model order
    name: str                  # qualified name of the experts module
    module: nn.Module = dataclasses.field(repr=False)   # the experts module that gets swapped
    parent: nn.Module = dataclasses.field(repr=False)   # the MoE block (router, shared experts)
    kind: str                  # KIND_HF | KIND_LIST
    num_experts: int           # E
    top_k: int                 # K
    hidden: int                # H
    intermediate: int          # I
    dtype: torch.dtype
    device: torch.device
    concatenated: bool = True  # hf_experts: gate rows first (True) or interleaved g0, u0, g1, ... (False)
    transposed: bool = False   # hf_experts: stored [E, H, 2I] / [E, I, H] instead of [E, 2I, H] / [E, H, I]
    linear_names: tuple[str, str, str] = LINEAR_NAMES[0]   # linear_list: (gate, up, down) attributes
    bias: bool = False         # hf_experts: gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]
    activation: Activation = SILU   # what `_apply_gate` computes (found by probe)
    gated: bool = True         # hf_experts: gate_up_proj; False: up_proj alone (Nemotron-H)
    released: bool = False

    def _live(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"{self.name}: {what}() after release(): the expert weights are gone")

    def _split(self, gate_up: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [..., 2I (dim), ...] -> (gate, up) views along `dim`."""
        return split_gate_up(gate_up, not self.concatenated, dim)

    def expert(self, e) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) of expert `e`, detached views of the module's
        weights (non-contiguous for transposed or interleaved layouts); gate None for non-gated
        experts."""
        self._live("expert")
        e = operator.index(e)
        if not 0 <= e < self.num_experts:
            raise IndexError(f"{self.name}: expert {e} out of range [0, {self.num_experts})")
        if self.kind == KIND_LIST:
            m = self.module[e]
            return tuple(getattr(m, n).weight.detach() for n in self.linear_names)
        if not self.gated:
            up = self.module.up_proj.detach()[e]                # [I, H] or [H, I]
            down = self.module.down_proj.detach()[e]
            return (None, up.t(), down.t()) if self.transposed else (None, up, down)
        gate_up = self.module.gate_up_proj.detach()[e]          # [2I, H] or [H, 2I]
        down = self.module.down_proj.detach()[e]                # [H, I] or [I, H]
        if self.transposed:
            gate_up, down = gate_up.t(), down.t()
        gate, up = self._split(gate_up, 0)
        return gate, up, down

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate [E, I, H], up [E, I, H], down [E, H, I]) as detached views, or None where the
        experts are separate tensors (linear_list) and stacking them would copy. gate and up are
        never contiguous as a whole (they share gate_up_proj); call .contiguous() per chunk."""
        self._live("stacked")
        if self.kind == KIND_LIST:
            return None
        if not self.gated:
            up, down = self.module.up_proj.detach(), self.module.down_proj.detach()
            if self.transposed:
                up, down = up.transpose(1, 2), down.transpose(1, 2)
            return None, up, down
        gate_up = self.module.gate_up_proj.detach()             # [E, 2I, H] or [E, H, 2I]
        down = self.module.down_proj.detach()                   # [E, H, I] or [E, I, H]
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        gate, up = self._split(gate_up, 1)
        return gate, up, down

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate [E, I], up [E, I], down [E, H]) bias views, or None for bias-free experts."""
        if not self.bias:
            return None
        self._live("biases")
        gate_up = self.module.gate_up_proj_bias.detach()        # [E, 2I], laid out as the weights
        gate, up = self._split(gate_up, 1)
        return gate, up, self.module.down_proj_bias.detach()

    def _weight_slots(self) -> list[tuple[nn.Module, str]]:
        if self.kind == KIND_LIST:
            return [(getattr(m, n), "weight") for m in self.module for n in self.linear_names]
        slots = [(self.module, "gate_up_proj" if self.gated else "up_proj"),
                 (self.module, "down_proj")]
        if self.bias:
            slots += [(self.module, "gate_up_proj_bias"), (self.module, "down_proj_bias")]
        return slots

    def release(self) -> None:
        """Replace the expert weights by 0-element parameters (same dtype, device and rank), so
        their memory is freed once nothing else (views from `expert`/`stacked`, an optimizer)
        holds it. Shapes stay readable on the spec; `expert`/`stacked` refuse afterwards."""
        if self.released:
            return
        for owner, attr in self._weight_slots():
            old = getattr(owner, attr)
            empty = torch.empty((0,) * old.dim(), dtype=old.dtype, device=old.device)
            setattr(owner, attr, nn.Parameter(empty, requires_grad=False))
        self.released = True

    def router(self) -> nn.Module | None:
        """The block's router module (`gate` or `router` of `parent`), or None: what computes the
        routing this layer's experts receive (`cupool.prefetch.RouterPredictor` reads its
        weight [E, H] to predict this layer's experts from the previous layer's input)."""
        return router_of(self.parent)[1]

    def restore(self, weights, device=None, biases=None) -> None:
        """The inverse of `release`: put E (gate [I, H], up [I, H], down [H, I]) tuples back into
        the module in its own layout (fused, interleaved, transposed as it was) and in `dtype`, on
        `device` (default: where the weights were); for experts with biases also `biases`
        (gate [E, I], up [E, I], down [E, H]). Used by unwrap to hand back dequantized weights;
        the new parameters do not require grad."""
        if self.bias != (biases is not None):
            raise ValueError(f"{self.name}: restore needs biases exactly when the experts have "
                             f"them (bias={self.bias})")
        weights = list(weights)
        E, H, I = self.num_experts, self.hidden, self.intermediate
        if len(weights) != E:
            raise ValueError(f"{self.name}: restore needs E={E} (gate, up, down) tuples, got {len(weights)}")
        for e, trio in enumerate(weights):
            if (trio[0] is None) == self.gated:
                raise ValueError(f"{self.name}: expert {e}: gate must be "
                                 f"{'a tensor' if self.gated else 'None (non-gated experts)'}")
            shapes = [tuple(t.shape) if t is not None else (I, H) for t in trio]
            if shapes != [(I, H), (I, H), (H, I)]:
                raise ValueError(f"{self.name}: expert {e}: expected gate, up [I={I}, H={H}] and down "
                                 f"[H, I], got {[list(s) for s in shapes]}")
        device = torch.device(device) if device is not None else self.device

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().to(device=device, dtype=self.dtype).contiguous(),
                                requires_grad=False)

        if self.kind == KIND_LIST:
            for m, trio in zip(self.module, weights):
                for n, w in zip(self.linear_names, trio):
                    getattr(m, n).weight = param(w)
        elif not self.gated:
            up, down = (torch.stack([trio[i] for trio in weights]) for i in (1, 2))
            if self.transposed:
                up, down = up.transpose(1, 2), down.transpose(1, 2)
            self.module.up_proj = param(up)
            self.module.down_proj = param(down)
        else:
            gate, up, down = (torch.stack([trio[i] for trio in weights]) for i in range(3))
            gate_up = join_gate_up(gate, up, not self.concatenated)             # [E, 2I, H]
            if self.transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            self.module.gate_up_proj = param(gate_up)
            self.module.down_proj = param(down)
            if biases is not None:
                bg, bu, bd = biases
                self.module.gate_up_proj_bias = param(join_gate_up(bg, bu, not self.concatenated))
                self.module.down_proj_bias = param(bd)
        self.device = device
        self.released = False


# --- checks shared by both kinds -------------------------------------------------------------------
def _silu_types() -> tuple[type, ...]:
    types: tuple[type, ...] = (nn.SiLU,)
    try:  # transformers is optional; without it no hf_experts module can exist anyway
        from transformers.activations import SiLUActivation
        types += (SiLUActivation,)
    except ImportError:
        pass
    return types


def _is_silu(act) -> bool:
    return isinstance(act, _silu_types()) or act is F.silu


def _act_name(act) -> str:
    return type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", repr(act))


def _check_activation(path: str, module: nn.Module) -> None:
    """Raise unless every activation `module` declares is SiLU (absent ones are checked by probe)."""
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    if isinstance(hidden_act, str) and hidden_act.lower() not in ("silu", "swish"):
        raise UnsupportedModelError(
            path, f"its config.hidden_act is {hidden_act!r}; cupool's expert GEMM computes "
                  f"SiLU(gate)·up only")
    for attr in _ACT_ATTRS:
        act = getattr(module, attr, None)
        if act is not None and callable(act) and not _is_silu(act):
            raise UnsupportedModelError(
                path, f"its activation {attr} is {_act_name(act)}, not SiLU; cupool's expert GEMM "
                      f"computes SiLU(gate)·up only")


def _probe_device(t: torch.Tensor) -> torch.device:
    # Meta tensors hold no values; probe on the CPU instead (pure elementwise code runs anywhere).
    return torch.device("cpu") if t.device.type == "meta" else t.device


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """Whether `got` matches `want` to the rounding of `dtype`, and the largest difference."""
    if got.shape != want.shape:
        return False, float("inf")
    got, want = got.float(), want.float()
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-6)
    # float32 differs only in how SiLU is evaluated (x·sigmoid(x) vs fused): ~1e-6 relative;
    # half types round every intermediate to 8 or 11 bits, so allow a few of their ulps of the max.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return diff <= tol * scale, diff


ROUTER_NAMES = ("gate", "router")     # a MoE block's router module: `gate`, or gpt-oss's `router`


def router_of(block: nn.Module) -> tuple[str | None, nn.Module | None]:
    """(attribute name, module) of a MoE block's router (ROUTER_NAMES, the first present), or
    (None, None) where the block has none."""
    for n in ROUTER_NAMES:
        m = getattr(block, n, None)
        if isinstance(m, nn.Module):
            return n, m
    return None, None


def _find_top_k(path: str, parent_path: str, module: nn.Module, parent: nn.Module, E: int) -> int:
    """K from the block, its router and the experts' config; all that are present must agree."""
    found = []
    for attr in ("top_k", "num_experts_per_tok"):
        found.append((f"{parent_path}.{attr}", getattr(parent, attr, None)))
    rname, router = router_of(parent)
    if router is not None:
        for attr in ("top_k", "num_experts_per_tok"):
            found.append((f"{parent_path}.{rname}.{attr}", getattr(router, attr, None)))
    for where, owner in (("experts", module), ("block", parent)):
        cfg = getattr(owner, "config", None)
        found.append((f"{where} config.num_experts_per_tok", getattr(cfg, "num_experts_per_tok", None)))
    # bool is an int subclass; a flag is never a top-k.
    found = [(w, int(v)) for w, v in found if isinstance(v, int) and not isinstance(v, bool)]
    if not found:
        raise UnsupportedModelError(
            path, f"no top-k was found: looked for top_k / num_experts_per_tok on the block "
                  f"{parent_path or '(model)'} and its router (gate/router), and num_experts_per_tok "
                  f"on the config")
    values = sorted({v for _, v in found})
    if len(values) > 1:
        listed = ", ".join(f"{w} = {v}" for w, v in found)
        raise UnsupportedModelError(path, f"its top-k is ambiguous: {listed}")
    K = values[0]
    if not 1 <= K <= E:
        raise UnsupportedModelError(path, f"top-k {K} (from {found[0][0]}) is not in [1, E={E}]")
    return K


def _check_router(path: str, parent_path: str, parent: nn.Module, E: int, H: int,
                  block_in: int | None = None) -> None:
    """The router must score exactly the experts this module holds (routing ids index rows).
    Its weight is [E, H], or [E, block_in] where the block's input is not the experts' (a latent
    MoE projects the block's input of size block_in to the experts' H after routing it)."""
    rname, router = router_of(parent)
    if router is None:
        return
    where = f"{parent_path}.{rname}" if parent_path else rname
    n = getattr(router, "num_experts", None)
    w = getattr(router, "weight", None)
    if isinstance(n, int) and n != E:
        raise UnsupportedModelError(
            path, f"the router {where} has num_experts = {n} but the experts module holds E = {E}")
    ok = {(E, H)} | ({(E, block_in)} if block_in is not None else set())
    if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) not in ok:
        want = " or ".join(f"[E={E}, {x}]" for x in [f"H={H}"] + (
            [f"hidden_size={block_in}"] if block_in is not None else []))
        raise UnsupportedModelError(
            path, f"the router {where} has weight {list(w.shape)}, expected {want}")


# --- transformers >= 5 experts modules ---------------------------------------------------------------
_HF_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def _is_hf_experts(module: nn.Module) -> bool:
    # `use_experts_implementation` sets all four flags in __init__; nothing else does.
    return all(hasattr(module, f) for f in _HF_FLAGS)


def _has_fused_params(module: nn.Module) -> bool:
    return any(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() == 3
               for n in ("gate_up_proj", "down_proj", "up_proj"))


def _number(owner, names) -> tuple[str | None, float | None]:
    """(name, value) of the first attribute of `owner` in `names` that is a real number."""
    for n in names:
        v = getattr(owner, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return n, float(v)
    return None, None


def _activation_candidates(module: nn.Module) -> list[tuple[Activation, str]]:
    """What `_apply_gate` may compute, each with where its parameters came from: SiLU(gate)·up,
    and the clamped SwiGLU where the module (or its config) carries an alpha and a limit."""
    out = [(SILU, "")]
    cfg = getattr(module, "config", None)
    wa, alpha = _number(module, ("alpha",))
    wl, limit = _number(module, ("limit",))
    if alpha is None:
        wa, alpha = _number(cfg, ("swiglu_alpha",))
        wa = wa and f"config.{wa}"
    if limit is None:
        wl, limit = _number(cfg, ("swiglu_limit",))
        wl = wl and f"config.{wl}"
    if alpha is not None and limit is not None and limit > 0:
        out.append((swiglu_clamp(alpha, limit), f" ({wa} = {alpha:g}, {wl} = {limit:g})"))
    return out


def _check_apply_gate(path: str, module: nn.Module, I: int, concatenated: bool,
                      device: torch.device) -> Activation:
    """`_apply_gate` maps [S, 2I] -> [S, I]; it must compute one of the activations the kernels
    have (`cupool.activation`) for the declared layout. Returns that activation."""
    apply = getattr(module, "_apply_gate", None)
    if apply is None:
        raise UnsupportedModelError(path, "it has no _apply_gate, so how gate and up combine is unknown")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 2 * I, generator=g) * _PROBE_SCALE).to(device)
    gate, up = (x[:, :I], x[:, I:]) if concatenated else (x[:, 0::2], x[:, 1::2])
    try:
        with torch.no_grad():
            got = apply(x.clone())
    except Exception as exc:  # any failure means we cannot vouch for its output
        raise UnsupportedModelError(
            path, f"its _apply_gate failed on a probe input [3, 2I={2 * I}] ({type(exc).__name__}: "
                  f"{exc})") from exc
    tried = []
    for act, where in _activation_candidates(module):
        ok, diff = _close(got, act(gate, up), torch.float32)
        if ok:
            return act
        tried.append(f"{act.describe()}{where} by up to {diff:.3g}")
    layout = "gate rows first" if concatenated else "gate/up interleaved"
    qual = getattr(getattr(type(module), "_apply_gate", None), "__qualname__", "_apply_gate")
    raise UnsupportedModelError(
        path, f"its _apply_gate ({qual}) computes none of the activations cupool's kernels have, "
              f"with {layout} (is_concatenated={concatenated}): on a probe input it differs from "
              f"{'; from '.join(tried)}")


def _check_biases(path: str, module: nn.Module, E: int, H: int, I: int) -> bool:
    """Whether the experts have biases; if so they must be gate_up_proj_bias [E, 2I] (laid out
    as gate_up_proj's rows) and down_proj_bias [E, H], float."""
    declared = bool(module.has_bias)
    names = [n for n, _ in module.named_parameters(recurse=False) if n.endswith("_bias")]
    if not declared and not names:
        return False
    want = {"gate_up_proj_bias": (E, 2 * I), "down_proj_bias": (E, H)}
    extra = sorted(set(names) - set(want))
    if extra:
        raise UnsupportedModelError(path, f"it has bias parameters {extra} beyond gate_up_proj_bias "
                                          f"and down_proj_bias")
    for n, shape in want.items():
        b = getattr(module, n, None)
        if not isinstance(b, torch.Tensor):
            raise UnsupportedModelError(
                path, f"has_bias={declared} but {n} is {type(b).__name__}, not a tensor "
                      f"{list(shape)}")
        if tuple(b.shape) != shape:
            raise UnsupportedModelError(path, f"{n} is {list(b.shape)}, expected {list(shape)}")
        if b.dtype not in _FLOATS:
            raise UnsupportedModelError(path, f"{n} is {b.dtype}, not a float dtype")
    return True


# Activations of experts without a gate (act(up·x)) that rows and references have.
_NONGATED = (RELU2,)


def _nongated_spec(path: str, parent_path: str, module: nn.Module, parent: nn.Module) -> dict:
    """An experts module with has_gate=False: up_proj [E, I, H] ([E, H, I] transposed) and
    down_proj [E, H, I] ([E, I, H]); it computes down(act_fn(up·x)), act_fn measured on a probe
    (ReLU², Nemotron-H's). With a latent MoE (config moe_latent_size, Nemotron-3-Super) H is the
    latent size: the block routes its input [.., hidden_size] and projects it to H for the
    experts (fc1_latent_proj) and back (fc2_latent_proj), both left to the block."""
    up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)
            and up.dim() == 3 and down.dim() == 3):
        shapes = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                  for t in (up, down)]
        raise UnsupportedModelError(
            path, f"its experts have no gate, and up_proj / down_proj are not two 3-D tensors "
                  f"(got {shapes[0]} / {shapes[1]})")
    transposed = bool(module.is_transposed)
    E = up.shape[0]
    I, H = (up.shape[2], up.shape[1]) if transposed else (up.shape[1], up.shape[2])
    want = (E, I, H) if transposed else (E, H, I)
    if tuple(down.shape) != want:
        raise UnsupportedModelError(path, f"down_proj is {list(down.shape)} but up_proj "
                                          f"{list(up.shape)} implies {list(want)}")
    if module.has_bias:
        raise UnsupportedModelError(path, "its experts have no gate but have biases; rows of "
                                          "non-gated experts carry none")
    if up.dtype not in _FLOATS or down.dtype != up.dtype:
        raise UnsupportedModelError(
            path, f"its expert weights are {up.dtype} / {down.dtype}, not one of float32, float16, "
                  f"bfloat16 (already quantized? load the model unquantized)")
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None:
        raise UnsupportedModelError(path, "its experts have no gate and no act_fn to measure")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * _PROBE_SCALE
    dev = _probe_device(up)
    x = x.to(dev)
    with torch.no_grad():
        got = act_fn(x.to(up.dtype)).float()
    diffs = []
    for act in _NONGATED:
        ok, err = _close(got, act(None, x.to(up.dtype)).float(), up.dtype)
        if ok:
            cfg = getattr(module, "config", None)
            latent = getattr(cfg, "moe_latent_size", None)
            block_in = getattr(cfg, "hidden_size", None) if latent is not None else None
            _check_router(path, parent_path, parent, E, H, block_in)
            K = _find_top_k(path, parent_path, module, parent, E)
            return dict(kind=KIND_HF, num_experts=E, top_k=K, hidden=H, intermediate=I,
                        dtype=up.dtype, device=up.device, concatenated=True,
                        transposed=transposed, bias=False, activation=act, gated=False)
        diffs.append(f"{act.describe()}: max error {err:.3g}")
    raise UnsupportedModelError(
        path, f"its experts have no gate and their act_fn ({_act_name(act_fn)}) computes none of "
              f"the non-gated activations cupool has ({'; '.join(diffs)})")


def _hf_spec(path: str, parent_path: str, module: nn.Module, parent: nn.Module) -> dict:
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedModelError(
            path, "its experts normalise each expert's output (has_post_expert_norm=True), which "
                  "cupool's expert GEMM does not compute")
    if not module.has_gate:
        return _nongated_spec(path, parent_path, module, parent)
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3):
        shapes = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                  for t in (gate_up, down)]
        raise UnsupportedModelError(
            path, f"gate_up_proj / down_proj are not two 3-D tensors (got {shapes[0]} / {shapes[1]})")
    transposed, concatenated = bool(module.is_transposed), bool(module.is_concatenated)
    E = gate_up.shape[0]
    H, I2 = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    if I2 % 2:
        raise UnsupportedModelError(path, f"gate_up_proj {list(gate_up.shape)} has an odd gate+up size {I2}")
    I = I2 // 2
    want = (E, I, H) if transposed else (E, H, I)
    if tuple(down.shape) != want:
        raise UnsupportedModelError(
            path, f"down_proj is {list(down.shape)} but gate_up_proj {list(gate_up.shape)} with "
                  f"is_transposed={transposed} implies {list(want)}")
    n = getattr(module, "num_experts", None)
    if isinstance(n, int) and n != E:
        raise UnsupportedModelError(
            path, f"num_experts = {n} but its parameters hold {E} experts ({list(gate_up.shape)})")
    if gate_up.dtype not in _FLOATS or down.dtype != gate_up.dtype:
        raise UnsupportedModelError(
            path, f"its expert weights are {gate_up.dtype} / {down.dtype}, not one of float32, float16, "
                  f"bfloat16 (already quantized? load the model unquantized)")
    if down.device != gate_up.device:
        raise UnsupportedModelError(
            path, f"gate_up_proj is on {gate_up.device} but down_proj on {down.device}")
    bias = _check_biases(path, module, E, H, I)
    _check_activation(path, module)
    activation = _check_apply_gate(path, module, I, concatenated, _probe_device(gate_up))
    _check_router(path, parent_path, parent, E, H)
    K = _find_top_k(path, parent_path, module, parent, E)
    return dict(kind=KIND_HF, num_experts=E, top_k=K, hidden=H, intermediate=I, dtype=gate_up.dtype,
                device=gate_up.device, concatenated=concatenated, transposed=transposed,
                bias=bias, activation=activation)


# --- per-expert nn.Linear lists --------------------------------------------------------------------
def _child_summary(m: nn.Module) -> str:
    kids = [f"{n}: {type(c).__name__}" for n, c in m.named_children()]
    return "{" + ", ".join(kids) + "}" if kids else "no children"


def _check_expert_forward(path: str, expert: nn.Module, names: tuple[str, str, str]) -> None:
    """Expert 0 must compute down(SiLU(gate·x)·(up·x)): its forward is ours to replace only then."""
    gate, up, down = (getattr(expert, n).weight for n in names)
    if gate.device.type == "meta":
        return  # nothing to compute with; the shape and activation checks still ran
    H = gate.shape[1]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, H, generator=g) * _PROBE_SCALE).to(device=gate.device, dtype=gate.dtype)
    try:
        with torch.no_grad():
            got = expert(x)
            want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    except Exception as exc:  # a forward we cannot call is a forward we cannot vouch for
        raise UnsupportedModelError(
            path, f"calling it on a probe input [2, H={H}] failed ({type(exc).__name__}: {exc})") from exc
    if not isinstance(got, torch.Tensor):
        raise UnsupportedModelError(path, f"its forward returned {type(got).__name__}, not a tensor")
    ok, diff = _close(got, want, gate.dtype)
    if not ok:
        g_, u_, d_ = names
        raise UnsupportedModelError(
            path, f"its forward does not compute {d_}(SiLU({g_}(x))·{u_}(x)): on a probe input it "
                  f"differs by up to {diff:.3g}")


def _list_spec(path: str, parent_path: str, experts: nn.ModuleList, parent: nn.Module) -> dict:
    if len(experts) == 0:
        raise UnsupportedModelError(path, "the experts list is empty")
    first = experts[0]
    names = next((ns for ns in LINEAR_NAMES
                  if all(isinstance(getattr(first, n, None), nn.Linear) for n in ns)), None)
    if names is None:
        raise UnsupportedModelError(
            path, f"its experts are {type(first).__name__} modules ({_child_summary(first)}) without "
                  f"nn.Linear (gate_proj, up_proj, down_proj) or (w1, w3, w2)")
    g0, u0, d0 = (getattr(first, n).weight for n in names)
    I, H = g0.shape
    shapes = {names[0]: (I, H), names[1]: (I, H), names[2]: (H, I)}
    for e, m in enumerate(experts):
        epath = f"{path}.{e}"
        if type(m) is not type(first):
            raise UnsupportedModelError(
                epath, f"expert {e} is a {type(m).__name__} but expert 0 a {type(first).__name__}")
        for n in names:
            lin = getattr(m, n, None)
            if not isinstance(lin, nn.Linear):
                raise UnsupportedModelError(f"{epath}.{n}", f"it is {type(lin).__name__}, not nn.Linear")
            if lin.bias is not None:
                raise UnsupportedModelError(
                    f"{epath}.{n}", "it has a bias; cupool reads expert biases from transformers "
                                    "experts modules (gate_up_proj_bias, down_proj_bias) only")
            if tuple(lin.weight.shape) != shapes[n]:
                raise UnsupportedModelError(
                    f"{epath}.{n}", f"its weight is {list(lin.weight.shape)} but expert 0's "
                                    f"{names[0]} [I={I}, H={H}] implies {list(shapes[n])}; every "
                                    f"expert of a layer must have the same shapes")
            if lin.weight.dtype != g0.dtype or lin.weight.device != g0.device:
                raise UnsupportedModelError(
                    f"{epath}.{n}", f"its weight is {lin.weight.dtype} on {lin.weight.device}, expert "
                                    f"0's {g0.dtype} on {g0.device}")
    if g0.dtype not in _FLOATS:
        raise UnsupportedModelError(
            path, f"its expert weights are {g0.dtype}, not one of float32, float16, bfloat16")
    E = len(experts)
    rname, router = router_of(parent)
    where = f"{parent_path}.{rname}" if parent_path else (rname or "gate")
    if not isinstance(router, nn.Linear):
        raise UnsupportedModelError(
            path, f"its block has no router gate = nn.Linear(H, E, bias=False) (found "
                  f"{type(router).__name__ if router is not None else 'nothing'})")
    if router.bias is not None:
        raise UnsupportedModelError(path, f"its router {where} has a bias")
    if (router.in_features, router.out_features) != (H, E):
        raise UnsupportedModelError(
            path, f"its router {where} maps {router.in_features} -> {router.out_features}, expected "
                  f"H={H} -> E={E}")
    _check_activation(f"{path}.0", first)
    _check_expert_forward(f"{path}.0", first, names)
    K = _find_top_k(path, parent_path, experts, parent, E)
    return dict(kind=KIND_LIST, num_experts=E, top_k=K, hidden=H, intermediate=I, dtype=g0.dtype,
                device=g0.device, linear_names=names)


# --- the model walk --------------------------------------------------------------------------------
def _looked_for() -> str:
    return ("transformers>=5 experts modules (decorated with use_experts_implementation: "
            "gate_up_proj [E, 2I, H], down_proj [E, H, I]) and blocks whose `experts` is an "
            "nn.ModuleList of (gate_proj, up_proj, down_proj) or (w1, w3, w2) nn.Linear experts "
            "with a router `gate` and a `top_k`")


def find_moe_layers(model: nn.Module) -> list[MoELayerSpec]:
    """Every MoE layer of `model`, in model order. Raises UnsupportedModelError if none is found
    or if any module that looks like part of an MoE layer cannot be served exactly."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    root = type(model).__name__
    modules = dict(model.named_modules())
    found: list[tuple[str, nn.Module, nn.Module, dict]] = []
    problems: list[UnsupportedModelError] = []
    claimed: list[str] = []       # experts modules already judged: their insides are not looked at
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        is_hf = _is_hf_experts(module)
        is_list = name.rpartition(".")[2] == "experts" and isinstance(module, nn.ModuleList)
        looks_moe = is_hf or is_list or _has_fused_params(module) or name.rpartition(".")[2] == "experts"
        if not looks_moe:
            continue
        claimed.append(name)
        path = name or root
        if not name:
            problems.append(UnsupportedModelError(
                root, "the model itself is an experts module; pass the model that holds it, so its "
                      "block (router, top-k) can be found"))
            continue
        parent_path = name.rpartition(".")[0]
        parent = modules[parent_path]
        try:
            if is_hf:
                info = _hf_spec(path, parent_path, module, parent)
            elif is_list:
                info = _list_spec(path, parent_path, module, parent)
            elif _has_fused_params(module):
                raise UnsupportedModelError(
                    path, f"{type(module).__name__} holds fused 3-D expert parameters but is not "
                          f"decorated with transformers' use_experts_implementation, so their layout "
                          f"(gate first or interleaved, transposed or not) is unknown")
            else:
                raise UnsupportedModelError(
                    path, f"it is named experts but is a {type(module).__name__} "
                          f"({_child_summary(module)}), neither a transformers experts module nor "
                          f"an nn.ModuleList of per-expert nn.Linear")
        except UnsupportedModelError as exc:
            problems.append(exc)
            continue
        found.append((name, module, parent, info))
    if problems:
        first = problems[0]
        more = ""
        if len(problems) > 1:
            others = ", ".join(p.path for p in problems[1:4]) + (", ..." if len(problems) > 4 else "")
            more = f" (and {len(problems) - 1} more MoE-looking modules are unsupported: {others})"
        raise UnsupportedModelError(first.path, first.reason + more)
    if not found:
        hints = [f"{n} ({type(m).__name__})" for n, m in modules.items()
                 if n and ("expert" in n.rpartition(".")[2].lower() or "moe" in type(m).__name__.lower())]
        seen = (f"; modules that mention experts/MoE: {', '.join(hints[:5])}" if hints
                else f"; none of its {len(modules)} modules mention experts")
        raise UnsupportedModelError(
            f"{root} (the whole model)", f"no MoE layers were found: looked for {_looked_for()}{seen}")
    return [MoELayerSpec(index=i, name=name, module=module, parent=parent, **info)
            for i, (name, module, parent, info) in enumerate(found)]


_CONSISTENT_FIELDS = (("num_experts", "E"), ("top_k", "top_k"), ("hidden", "H"),
                      ("intermediate", "I"), ("dtype", "dtype"), ("bias", "bias"),
                      ("activation", "activation"))


def check_consistent(specs: list[MoELayerSpec]) -> None:
    """Raise ValueError naming the first layer whose E, top_k, H, I, dtype, biases or activation
    differs from layer 0's:
    one bank row layout and one GEMM serve every layer."""
    specs = list(specs)
    if not specs:
        raise ValueError("specs: no MoE layers to check")
    ref = specs[0]
    for s in specs[1:]:
        for attr, label in _CONSISTENT_FIELDS:
            got, want = getattr(s, attr), getattr(ref, attr)
            if got != want:
                raise ValueError(
                    f"MoE layer {s.index} ({s.name}) differs from layer {ref.index} ({ref.name}): "
                    f"{label} = {got} there, {want} in layer {ref.index}; every MoE layer must have "
                    f"the same E, top_k, H, I, dtype, biases and activation")
