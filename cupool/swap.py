"""Swapping a model's expert computation for the pool's, and back.

Two kinds of layer (`cupool.adapters`):
- transformers ≥ 5 experts modules: cupool registers an experts implementation named "cupool" in
  transformers' experts interface and points the module's config at it; the module's own forward
  (and the model's router) then call `PooledExperts` with (hidden, top_k_index, top_k_weights).
- per-expert nn.Linear lists: the MoE block's forward is replaced by one that routes with the
  block's router (`default_route`, or the `route_fn` given to wrap) and calls `PooledExperts`.
`install` records what it changed; `uninstall` puts it back.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from cupool.adapters import KIND_HF, MoELayerSpec
from cupool.layer import PooledExperts, call_pooled

IMPLEMENTATION = "cupool"


def _hf_experts_forward(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """The "cupool" entry of transformers' experts interface."""
    pooled = getattr(module, "_cupool", None)
    if pooled is None:
        raise RuntimeError(f"{type(module).__name__} uses the 'cupool' experts implementation but "
                           f"was not wrapped by cupool.wrap (or was unwrapped)")
    return call_pooled(pooled, hidden_states, top_k_index, top_k_weights)


def register_hf() -> None:
    """Register the "cupool" experts implementation with transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _hf_experts_forward)


def default_route(block, hidden: torch.Tensor, top_k: int):
    """Mixtral-style routing for per-expert Linear lists: softmax over the router logits, top-k,
    renormalised (unless the block says `norm_topk_prob = False`)."""
    logits = block.gate(hidden)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(hidden.dtype)


def _block_forward(layer: PooledExperts, spec: MoELayerSpec, route):
    k = spec.top_k

    def forward(block, hidden_states, *args, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids, w = route(block, x, k)
        return call_pooled(layer, x, ids, w).reshape(shape)
    return forward


def install(specs: list[MoELayerSpec], layers: list[PooledExperts], route_fn=None) -> list:
    """Point each layer's experts at its PooledExperts; returns the record `uninstall` takes."""
    route = route_fn or default_route
    restore: list = []
    if any(s.kind == KIND_HF for s in specs):
        register_hf()
    for spec, layer in zip(specs, layers):
        if spec.kind == KIND_HF:
            cfg = spec.module.config
            restore.append(("hf", spec.module, cfg, cfg._experts_implementation))
            spec.module._cupool = layer
            cfg._experts_implementation_internal = IMPLEMENTATION
        else:
            block = spec.parent
            restore.append(("block", block, block.__dict__.get("forward")))
            block.forward = types.MethodType(_block_forward(layer, spec, route), block)
            block._cupool = layer
    return restore


def uninstall(restore: list) -> None:
    """Undo `install` (in reverse order)."""
    for entry in reversed(restore):
        if entry[0] == "hf":
            _, module, cfg, old = entry
            cfg._experts_implementation_internal = old
            module.__dict__.pop("_cupool", None)
        else:
            _, block, old = entry
            block.__dict__.pop("_cupool", None)
            if old is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = old
    restore.clear()
