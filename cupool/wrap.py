"""`cupool.wrap(model)`: turn a PyTorch MoE model into one that decodes from the shared bank.

Shape legend (ARCHITECTURE.md): L MoE layers · E experts · K top-k · H hidden · I intermediate ·
N rows per layer.

wrap():
1. finds the MoE layers (`cupool.adapters`), checks that they agree on E, K, H, I and dtype;
2. sizes the bank before anything is converted: `rows` per layer, or what `budget` leaves after
   the rest of the model, the workspaces, staging and the KV-cache reserve (and what NVML says is
   free), so a budget that cannot work fails before any memory is taken;
3. quantizes every layer's experts to NVFP4 on the GPU, straight into the pinned host store,
   layer by layer (progress bar), releasing each layer's bf16 expert weights once converted;
   or fills the store from a checkpoint, or from rows the caller makes (synthetic models);
4. moves the rest of the model to the GPU, builds the bank and the GEMM workspaces;
5. swaps each experts module's computation for `PooledExperts` (`cupool.swap`).
The gate starts closed (warm-up and capture must not move the placement); `pool.open()` opens it.
"""

from __future__ import annotations

import torch

from cupool import _cuda
from cupool.adapters import MoELayerSpec, check_consistent, find_moe_layers
from cupool.bank import Bank
from cupool.budget import parse_bytes, rows_for_device
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout, pack_rows
from cupool.ops.nvfp4_quant import quantize as gpu_quantize
from cupool.pool import Pool
from cupool.store import HostStore


def _layer_rows(spec: MoELayerSpec, layout: RowLayout, device, chunk: int = 16):
    """uint8 [E, row_bytes] (CPU) of one layer, quantized on the GPU `chunk` experts at a time."""
    E = spec.num_experts
    out = torch.empty(E, layout.row_bytes, dtype=torch.uint8).pin_memory()
    stacked = spec.stacked()
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        if stacked is not None:
            g, u, d = (t[e0:e1].to(device, non_blocking=True) for t in stacked)
        else:
            mats = [spec.expert(e) for e in range(e0, e1)]
            g, u, d = (torch.stack([m[i] for m in mats]).to(device) for i in range(3))
        rows = pack_rows(layout, gpu_quantize(g, name=f"{spec.name} gate"),
                         gpu_quantize(u, name=f"{spec.name} up"),
                         gpu_quantize(d, name=f"{spec.name} down"))
        out[e0:e1].copy_(rows, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return out


def wrap(model: torch.nn.Module, rows: int | None = None, budget=None, device="cuda", *,
         kv_reserve=0, max_decode_tokens: int = 16, max_prefill_tokens: int = 4096,
         scratch_rows: int = 32, scratch_buffers: int = 2, checkpoint=None, expert_rows=None,
         layers=None, route_fn=None, progress: bool = True) -> Pool:
    """Wrap `model`'s MoE layers into a pool. Returns the `Pool` handle (gate closed).

    Args:
        rows: bank rows per layer at start (K ≤ rows ≤ E). Exclusive with `budget`.
        budget: GPU memory the whole model may use (bytes or '48GiB'); rows follow from it.
            Neither given: rows from what NVML says is free after the rest of the model.
        kv_reserve: bytes (or string) kept free for the KV cache.
        max_decode_tokens: largest batch of one decode step (T·K lanes ≤ 1024).
        max_prefill_tokens: largest T of a wide (prefill) call.
        scratch_rows: rows of the prefill scratch for experts not in the bank (default 32: 85 MB
            of Qwen3-30B-A3B rows).
        scratch_buffers: buffers the scratch is split into, one chunk of experts each: later
            chunks are copied while the GEMM reads earlier ones (default 2; MoEGemm says more).
        checkpoint: a ModelOpt NVFP4 safetensors file/dir to fill the store from (experts
            already NVFP4) instead of quantizing the model's weights.
        expert_rows: fn(layer) -> uint8 [E, row_bytes] rows in the kernel layout (any device):
            experts made directly as NVFP4 rows (synthetic models); the model's expert weights
            are not read (they may already be released).
        layers: the MoE layer specs, if found (and maybe released) before; default: found here.
        route_fn: routing for per-expert Linear lists: fn(block, hidden [T,H], K) -> (ids, w).
    """
    if rows is not None and budget is not None:
        raise ValueError(f"give rows or budget, not both (rows={rows}, budget={budget!r})")
    if checkpoint is not None and expert_rows is not None:
        raise ValueError("give checkpoint or expert_rows, not both")
    if any(hasattr(m, "_cupool") for m in model.modules()):
        raise ValueError("this model is already wrapped by cupool (call pool.unwrap() first)")
    specs = list(layers) if layers is not None else find_moe_layers(model)
    check_consistent(specs)
    s0 = specs[0]
    L, E, K, H, I = len(specs), s0.num_experts, s0.top_k, s0.hidden, s0.intermediate
    if s0.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{s0.name}: experts are {s0.dtype}; cupool serves bf16/fp16 models "
                        f"(convert first: model.to(torch.bfloat16))")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not K <= rows <= E):
        raise ValueError(f"rows must be an int with top_k={K} <= rows <= E={E}, got {rows!r}")
    budget_bytes = parse_bytes(budget, "budget") if budget is not None else None
    kv = parse_bytes(kv_reserve, "kv_reserve") if kv_reserve else 0
    if max_decode_tokens * K > 1024:
        raise ValueError(f"max_decode_tokens={max_decode_tokens} x top_k={K} exceeds 1024 lanes")
    _cuda.require_gpu("cupool.wrap")
    dev = torch.device("cuda", _cuda.device_index(device))
    layout = RowLayout(H, I)
    max_lanes = max_decode_tokens * K
    gemm = MoEGemm(layout, K, s0.dtype, max_decode_tokens=max_decode_tokens,
                   max_prefill_tokens=max_prefill_tokens, num_experts=E,
                   scratch_rows=scratch_rows, scratch_buffers=scratch_buffers, device=dev)
    row_stride = -(-layout.row_bytes // 256) * 256
    if rows is None:
        # Decide before anything is converted, so a budget that is too small leaves the model
        # as it was. "pending": the rest of the model, not yet on the GPU, that will be.
        expert_params = {id(p) for s in specs for p in s.module.parameters()}
        pending = sum(t.numel() * t.element_size()
                      for t in list(model.parameters()) + list(model.buffers())
                      if id(t) not in expert_params and t.device != dev)
        extra = pending + max_lanes * row_stride + 64 * L * E + (1 << 20)
        rows = rows_for_device(budget_bytes, row_stride, L, K, E, extra, dev, kv)
    store = HostStore(L, E, layout.row_bytes, device=dev)
    try:
        if checkpoint is not None:
            from cupool.modelopt import fill_store_from_checkpoint
            fill_store_from_checkpoint(store, checkpoint, layout, progress=progress)
            for spec in specs:
                spec.release()
        elif expert_rows is not None:
            def given_rows(layer: int):
                r = expert_rows(layer)
                if not isinstance(r, torch.Tensor) or r.dtype != torch.uint8 or \
                        tuple(r.shape) != (E, layout.row_bytes):
                    raise ValueError(f"expert_rows({layer}) must be a uint8 tensor [E={E}, "
                                     f"row_bytes={layout.row_bytes}], got "
                                     f"{getattr(r, 'dtype', type(r).__name__)} "
                                     f"{list(getattr(r, 'shape', []))}")
                specs[layer].release()
                return r.cpu()
            store.fill(given_rows, progress=progress, desc="NVFP4 rows -> host store")
        else:
            def make_layer(layer: int):
                r = _layer_rows(specs[layer], layout, dev)
                specs[layer].release()
                return r
            store.fill(make_layer, progress=progress, desc="quantize experts -> NVFP4 store")
        store.seal()
        model.to(dev)
        bank = Bank(store, rows, staging_rows=max_lanes, max_lanes=max_lanes, device=dev)
    except BaseException:
        store.close()
        raise
    pool = Pool(model, specs, layout, store, bank, gemm, dev, route_fn)
    pool._install()
    return pool
