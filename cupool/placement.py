"""The memory plan of a model split over several GPUs, each with its own bank.

Shape legend (ARCHITECTURE.md): D devices · L decoder layers · M MoE layers (M_d on device d) ·
E experts · K top-k · N_d bank rows a MoE layer on device d.

Placement is a pipeline: device d holds a contiguous run of decoder layers, their dense weights,
their KV cache, and for their MoE layers its own bank (N_d rows a layer), planner tables, staging
rows and GEMM workspaces. The pinned host store is one for all devices (its UVA addresses serve
every GPU). The first device also holds the input embeddings and the rotary tables, the last one
the final norm and the output head (tied embeddings: both, on the last device, since a tied
weight lives on one device). Modules registered after the decoder layers (the final norm, the
output head, in most transformers families the rotary tables) count as the tail. A decode step then crosses each device boundary once with one
hidden-state row.

`split` decides where each layer goes: the largest N such that every device can give each of its
MoE layers at least N rows (searched over [K, E]; for a given N the layers are packed greedily
from the first device on), then each device's own N_d from what it has left (at least N). A
budget that cannot hold top-k rows a layer next to everything else fails with the numbers of the
device that overflowed.

`plan_model` measures a (meta-device) transformers model for `split`, and `SplitPlan.device_map`
is the placement in transformers' `device_map` form. This module plans; no GPU is touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from cupool.budget import BudgetError
from cupool.store import fmt_bytes


@dataclasses.dataclass(frozen=True)
class Segment:
    """What one device holds."""
    device: int                  # the device (as given)
    layers: tuple[int, ...]      # decoder layers, in order
    moe_layers: tuple[int, ...]  # the pool's MoE layer numbers among them
    dense_bytes: int             # weights that are not routed experts (head/tail included)
    kv_bytes: int                # KV cache of its layers
    pool_bytes: int              # workspaces, staging rows, tables, margin
    rows_per_layer: int          # N_d (0 without MoE layers)
    row_stride: int
    budget_bytes: int

    @property
    def bank_bytes(self) -> int:
        return len(self.moe_layers) * self.rows_per_layer * self.row_stride

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.pool_bytes + self.bank_bytes


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    segments: tuple[Segment, ...]
    layer_names: tuple[str, ...] = ()   # module name of each decoder layer (plan_model)
    head_names: tuple[str, ...] = ()    # embeddings, rotary tables
    tail_names: tuple[str, ...] = ()    # final norm, output head

    def device_of_layer(self, layer: int) -> int:
        for s in self.segments:
            if layer in s.layers:
                return s.device
        raise IndexError(f"layer {layer} is in no segment")

    def device_map(self) -> dict[str, int]:
        """{module name: device} for every decoder layer, head and tail module (transformers'
        device_map form; needs plan_model's names)."""
        if not self.layer_names:
            raise ValueError("device_map() needs the module names of plan_model")
        first, last = self.segments[0].device, self.segments[-1].device
        out = {n: first for n in self.head_names}
        out.update({n: self.device_of_layer(i) for i, n in enumerate(self.layer_names)})
        out.update({n: last for n in self.tail_names})
        return out

    def table(self) -> str:
        lines = [f"{'device':>6} {'layers':>11} {'MoE':>4} {'rows':>5} {'dense':>10} {'KV':>10} "
                 f"{'pool':>10} {'bank':>10} {'total':>10} {'budget':>10}"]
        for s in self.segments:
            span = f"{s.layers[0]}-{s.layers[-1]}" if s.layers else "-"
            lines.append(f"{s.device!s:>6} {span:>11} {len(s.moe_layers):>4} {s.rows_per_layer:>5} "
                         f"{fmt_bytes(s.dense_bytes):>10} {fmt_bytes(s.kv_bytes):>10} "
                         f"{fmt_bytes(s.pool_bytes):>10} {fmt_bytes(s.bank_bytes):>10} "
                         f"{fmt_bytes(s.total_bytes):>10} {fmt_bytes(s.budget_bytes):>10}")
        return "\n".join(lines)


def _check_ints(name: str, values, low: int) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}[{i}] must be an int >= {low}, got {v!r}")
        out.append(v)
    return out


def split(layer_bytes, moe_layer, *, devices, budgets, head_bytes: int, tail_bytes: int,
          kv_bytes_per_layer: int, row_stride: int, num_experts: int, top_k: int,
          pool_bytes: Callable[[int], int]) -> SplitPlan:
    """Place L decoder layers over the devices (see the module docstring).

    layer_bytes[i]: dense bytes of decoder layer i (routed experts excluded); moe_layer[i]: its
    MoE layer number, or None for a dense layer; budgets[d]: bytes device d may use;
    pool_bytes(m): a device's pool overhead for m MoE layers (0 for m = 0).
    """
    L = len(layer_bytes)
    if L == 0 or len(moe_layer) != L:
        raise ValueError(f"layer_bytes and moe_layer must have one entry per decoder layer, "
                         f"got {L} and {len(moe_layer)}")
    layer_bytes = _check_ints("layer_bytes", layer_bytes, 0)
    budgets = _check_ints("budgets", budgets, 1)
    devices = list(devices)
    if len(devices) != len(budgets) or not devices:
        raise ValueError(f"devices and budgets must be as many and not empty, got {devices} and "
                         f"{len(budgets)} budgets")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices must be distinct, got {devices}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    kv = int(kv_bytes_per_layer)
    D = len(devices)

    def need(d: int, lo: int, hi: int, rows: int) -> int:
        m = sum(moe_layer[i] is not None for i in range(lo, hi))
        b = sum(layer_bytes[lo:hi]) + (hi - lo) * kv + (pool_bytes(m) if m else 0)
        b += m * rows * row_stride
        if d == 0:
            b += head_bytes
        if hi == L:
            b += tail_bytes
        return b

    def pack(rows: int):
        """Cut points [0 = c_0 ≤ c_1 ≤ ... ≤ c_D = L] packing greedily at `rows`, or None."""
        cuts, lo = [0], 0
        for d in range(D):
            hi = lo
            while hi < L and need(d, lo, hi + 1, rows) <= budgets[d]:
                hi += 1
            if d == D - 1 and hi < L:
                return None
            if need(d, lo, hi, rows) > budgets[d]:    # even its fixed part (head/tail) overflows
                return None
            cuts.append(hi)
            lo = hi
        return cuts if lo == L else None

    lo_r, hi_r = top_k, num_experts
    if pack(lo_r) is None:
        raise BudgetError(_overflow(devices, budgets, top_k,
                                    sum(layer_bytes) + L * kv + head_bytes + tail_bytes))
    while lo_r < hi_r:                                # the largest rows every device can give
        mid = (lo_r + hi_r + 1) // 2
        if pack(mid) is not None:
            lo_r = mid
        else:
            hi_r = mid - 1
    cuts = pack(lo_r)
    segments = []
    for d in range(D):
        a, b = cuts[d], cuts[d + 1]
        moe = tuple(moe_layer[i] for i in range(a, b) if moe_layer[i] is not None)
        rows = 0
        if moe:                                       # this device's own rows: what it has left
            fixed = need(d, a, b, 0)
            rows = min(num_experts, (budgets[d] - fixed) // (len(moe) * row_stride))
        dense = sum(layer_bytes[a:b]) + (head_bytes if d == 0 else 0) + \
            (tail_bytes if b == L else 0)
        segments.append(Segment(devices[d], tuple(range(a, b)), moe, dense, (b - a) * kv,
                                pool_bytes(len(moe)) if moe else 0, int(rows), row_stride,
                                budgets[d]))
    return SplitPlan(tuple(segments))


def _overflow(devices, budgets, K: int, minimum: int) -> str:
    total_budget = sum(budgets)
    return (f"the budgets {[fmt_bytes(b) for b in budgets]} of devices {devices} cannot hold the "
            f"model with top-k={K} rows a MoE layer: its dense part and KV cache alone are "
            f"{fmt_bytes(minimum)} of {fmt_bytes(total_budget)}, and each device also needs its "
            f"pool (workspaces, staging, tables) and K rows for each of its MoE layers")


# --- from a transformers model ---------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> tuple[str, list[str]]:
    """(stack name, [layer module names]) of the model's decoder layers: the ModuleList named
    `layers` holding the most modules."""
    best = None
    for name, m in model.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(m, nn.ModuleList):
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        raise ValueError(f"{type(model).__name__}: no ModuleList named 'layers' (decoder layers) "
                         f"was found")
    return best[0], [f"{best[0]}.{i}" for i in range(len(best[1]))]


def plan_model(model: nn.Module, specs, *, devices, budgets, kv_bytes_per_layer: int,
               row_stride: int, pool_bytes: Callable[[int], int], dtype_bytes: int = 2) -> SplitPlan:
    """`split` for a transformers causal LM (on the meta device or anywhere): dense bytes per
    decoder layer from its parameters and buffers at `dtype_bytes` per floating element (routed
    experts excluded: they live in the host store), the MoE layers from `specs`
    (`cupool.adapters.find_moe_layers`), head = everything before the layers (embeddings, rotary
    tables), tail = everything after (final norm, output head)."""
    specs = list(specs)
    if not specs:
        raise ValueError("specs: no MoE layers")
    stack, names = decoder_layers(model)
    expert_ids = {id(p) for s in specs for p in s.module.parameters()}
    layer_of = {}
    for s in specs:
        owner = _layer_index(s.name, stack)
        if owner is None:
            raise ValueError(f"MoE layer {s.index} ({s.name}) is in no decoder layer of {stack}")
        layer_of[owner] = s.index
    sizes = [0] * len(names)
    head, tail = 0, 0
    head_names, tail_names = set(), set()
    seen = set()
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}   # registration order
    tied_embed = None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and out is not None and getattr(out, "weight", None) is \
            getattr(emb, "weight", None):
        tied_embed = emb

    def nbytes(t) -> int:
        return t.numel() * (dtype_bytes if t.is_floating_point() else t.element_size())

    for full, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if id(t) in expert_ids or id(t) in seen:
            continue
        seen.add(id(t))
        m = _layer_index(full, stack)
        if m is not None:
            sizes[m] += nbytes(t)
            continue
        top = _top_module(full.rpartition(".")[0], stack)
        before = order.get(top, len(order)) < order[stack]   # embeddings before the layers
        if before and not (tied_embed is not None and t is tied_embed.weight):
            head += nbytes(t)
            head_names.add(top)
        else:
            tail += nbytes(t)
            tail_names.add(top)
    if tied_embed is not None:                       # the tied weight's modules sit together
        for n, m in model.named_modules():
            if m is tied_embed or m is out:
                head_names.discard(n)
                tail_names.add(n)
    plan = split(sizes, [layer_of.get(i) for i in range(len(names))], devices=devices,
                 budgets=budgets, head_bytes=head, tail_bytes=tail,
                 kv_bytes_per_layer=kv_bytes_per_layer, row_stride=row_stride,
                 num_experts=specs[0].num_experts, top_k=specs[0].top_k, pool_bytes=pool_bytes)
    return dataclasses.replace(plan, layer_names=tuple(names), head_names=tuple(sorted(head_names)),
                               tail_names=tuple(sorted(tail_names)))


def _top_module(module: str, stack: str) -> str:
    """The module directly under the stack's parent (e.g. 'model.embed_tokens', 'lm_head')."""
    parent = stack.rpartition(".")[0]
    if parent and module.startswith(parent + "."):
        rest = module[len(parent) + 1:].split(".")[0]
        return f"{parent}.{rest}"
    return module.split(".")[0] if module else module


def _layer_index(name: str, stack: str) -> int | None:
    """i for a tensor of decoder layer `{stack}.{i}.`, else None."""
    if not name.startswith(stack + "."):
        return None
    head = name[len(stack) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None
