"""`cupool.wrap(model)`: turn a PyTorch MoE model into one that decodes from the shared bank.

Shape legend (ARCHITECTURE.md): L MoE layers · E experts · K top-k · H hidden · I intermediate ·
N rows per layer.

wrap():
1. finds the MoE layers (`cupool.adapters`), checks that they agree on E, K, H, I, dtype, biases
   and activation (the row layout carries the biases, the GEMM compiles the activation in);
2. sizes the bank before anything is converted: `rows` per layer, or what `budget` leaves after
   the rest of the model, the workspaces, staging and the KV-cache reserve (and what NVML says is
   free), so a budget that cannot work fails before any memory is taken; where the bank then
   cannot hold every expert, the input embedding goes to host memory and the bank takes its room
   (`rows_and_host`);
3. quantizes every layer's experts to NVFP4 on the GPU, straight into the pinned host store,
   layer by layer (progress bar), releasing each layer's bf16 expert weights once converted;
   or fills the store from a checkpoint, or from rows the caller makes (synthetic models);
4. moves the rest of the model to the GPU, builds the bank and the GEMM workspaces;
5. swaps each experts module's computation for `PooledExperts` (`cupool.swap`).
The gate starts closed (warm-up and capture must not move the placement); `pool.open()` opens it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from cupool import _cuda, dense_nvfp4
from cupool.adapters import MoELayerSpec, check_consistent, find_moe_layers
from cupool.bank import Bank
from cupool.budget import (MARGIN_BYTES, Reserve, parse_bytes, reserve_bytes, rows_and_host,
                           rows_for_device, staging_and_tables_bytes)
from cupool.gemm import MoEGemm
from cupool.hosttable import host_table_names, input_embedding_name, place_host_tables
from cupool.layout import RowLayout, pack_rows
from cupool.ops.nvfp4_quant import quantize as gpu_quantize
from cupool.pool import Pool
from cupool.store import HostStore, fmt_bytes

log = logging.getLogger("cupool")


def _layer_rows(spec: MoELayerSpec, layout: RowLayout, device, chunk: int = 16):
    """uint8 [E, row_bytes] (CPU) of one layer, quantized on the GPU `chunk` experts at a time."""
    E = spec.num_experts
    out = torch.empty(E, layout.row_bytes, dtype=torch.uint8).pin_memory()
    stacked, biases = spec.stacked(), spec.biases()
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        if stacked is not None:
            g, u, d = (None if t is None else t[e0:e1].to(device, non_blocking=True).contiguous()
                       for t in stacked)
        else:
            mats = [spec.expert(e) for e in range(e0, e1)]
            g, u, d = (torch.stack([m[i] for m in mats]).to(device) for i in range(3))
        bias = None if biases is None else tuple(b[e0:e1].to(device) for b in biases)
        qg = None if g is None else gpu_quantize(g, name=f"{spec.name} gate")
        rows = pack_rows(layout, qg, gpu_quantize(u, name=f"{spec.name} up"),
                         gpu_quantize(d, name=f"{spec.name} down"), bias=bias)
        out[e0:e1].copy_(rows, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return out


@dataclasses.dataclass
class PoolPlan:
    """What `plan` decided for a pool before any expert is converted: the row layout, the GEMM
    (its workspaces allocated), rows per layer, the device and the decode lanes."""
    layout: RowLayout
    gemm: MoEGemm
    rows: int
    device: torch.device
    max_lanes: int
    num_layers: int
    num_experts: int
    embedding_on_host: bool = False   # the input embedding goes to host memory (`rows_and_host`)


def check_specs(specs: list[MoELayerSpec]) -> MoELayerSpec:
    """The first spec, after checking that all agree and that the experts are bf16/fp16."""
    check_consistent(specs)
    s0 = specs[0]
    if s0.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{s0.name}: experts are {s0.dtype}; cupool serves bf16/fp16 models "
                        f"(convert first: model.to(torch.bfloat16))")
    return s0


def plan(specs: list[MoELayerSpec], *, pending_bytes: int, rows=None, budget=None,
         device="cuda", kv_reserve=0, max_decode_tokens: int = 16,
         max_prefill_tokens: int = 4096, scratch_rows: int = 32,
         scratch_buffers: int = 2, host_optional_bytes: int = 0) -> PoolPlan:
    """Check the arguments, build the GEMM and decide the rows per layer (see `wrap`), before any
    expert is converted, so a budget that cannot work fails here, holding only the GEMM's
    workspaces. `pending_bytes`: what the rest of the model will add on the device (its dense
    part, not there yet). `host_optional_bytes`: the input embedding's bytes, which go to host
    memory where the bank cannot hold every expert (`rows_and_host`; with `rows` given, where
    rows < E); 0: it stays where the model puts it."""
    if rows is not None and budget is not None:
        raise ValueError(f"give rows or budget, not both (rows={rows}, budget={budget!r})")
    s0 = check_specs(specs)
    L, E, K, H, I = len(specs), s0.num_experts, s0.top_k, s0.hidden, s0.intermediate
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not K <= rows <= E):
        raise ValueError(f"rows must be an int with top_k={K} <= rows <= E={E}, got {rows!r}")
    budget_bytes = parse_bytes(budget, "budget") if budget is not None else None
    kv = kv_reserve if isinstance(kv_reserve, Reserve) else reserve_bytes(kv_reserve)
    if isinstance(max_decode_tokens, bool) or not isinstance(max_decode_tokens, int) \
            or max_decode_tokens < 1:
        raise ValueError(f"max_decode_tokens must be an int >= 1, got {max_decode_tokens!r}")
    if max_decode_tokens * K > 1024:
        raise ValueError(f"max_decode_tokens={max_decode_tokens} x top_k={K} exceeds 1024 lanes")
    if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) \
            or max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
    _cuda.require_gpu("cupool.wrap")
    dev = torch.device("cuda", _cuda.device_index(device))
    layout = RowLayout(H, I, bias=s0.bias, gated=s0.gated)
    max_lanes = max_decode_tokens * K
    gemm = MoEGemm(layout, K, s0.dtype, max_decode_tokens=max_decode_tokens,
                   max_prefill_tokens=max_prefill_tokens, num_experts=E,
                   scratch_rows=scratch_rows, scratch_buffers=scratch_buffers,
                   activation=s0.activation, device=dev)
    if rows is None:
        extra = (pending_bytes + staging_and_tables_bytes(L, E, max_lanes, layout.row_stride)
                 + MARGIN_BYTES)
        rows, on_host = rows_and_host(
            lambda x: rows_for_device(budget_bytes, layout.row_stride, L, K, E, x, dev, kv),
            extra, host_optional_bytes, E)
    else:
        on_host = host_optional_bytes > 0 and rows < E
        if on_host:
            log.info("cupool: the input embedding (%s) goes to pinned host memory, where a "
                     "decode step reads its rows: rows=%d of E=%d", fmt_bytes(host_optional_bytes),
                     rows, E)
    return PoolPlan(layout, gemm, rows, dev, max_lanes, L, E, on_host)


def assemble(model, specs: list[MoELayerSpec], p: PoolPlan, fill, *, route_fn=None,
             before_bank=None) -> Pool:
    """Make the pinned store, fill it (`fill(store)`), seal it, run `before_bank()` (e.g. move
    the dense part to the GPU), build the bank and swap the layers. On any error the store is
    freed before the error propagates."""
    store = HostStore(p.num_layers, p.num_experts, p.layout.row_bytes, device=p.device)
    try:
        fill(store)
        store.seal()
        if before_bank is not None:
            before_bank()
        bank = Bank(store, p.rows, staging_rows=p.max_lanes, max_lanes=p.max_lanes,
                    device=p.device, promote="auto")
    except BaseException:
        store.close()
        raise
    pool = Pool(model, specs, p.layout, store, bank, p.gemm, p.device, route_fn)
    pool._install()
    return pool


def wrap(model: torch.nn.Module, rows: int | None = None, budget=None, device="cuda", *,
         kv_reserve=0, max_decode_tokens: int = 16, max_prefill_tokens: int = 4096,
         scratch_rows: int = 32, scratch_buffers: int = 2, checkpoint=None, expert_rows=None,
         layers=None, route_fn=None, progress: bool = True) -> Pool:
    """Wrap `model`'s MoE layers into a pool. Returns the `Pool` handle (gate closed).

    Args:
        rows: bank rows per layer at start (K ≤ rows ≤ E). Exclusive with `budget`.
        budget: GPU memory the whole model may use (bytes or '48GiB'); rows follow from it.
            Neither given: rows from what NVML says is free after the rest of the model. Where
            the rows are fewer than E (given or not), an untied input embedding goes to pinned
            mapped host memory and, with rows not given, the bank takes its room
            (`cupool.budget.rows_and_host`).
        kv_reserve: bytes (or a string like '2GiB') kept free for the KV cache, or a
            `cupool.budget.Reserve` (`cupool.kvcache.engine_reserve`: the KV cache, the slots'
            recurrent states and the resume points of an engine), whose parts a budget too small
            for it names.
        max_decode_tokens: largest batch of one decode step (T·K lanes ≤ 1024).
        max_prefill_tokens: largest T of one prefill GEMM call; longer calls run in chunks of it.
        scratch_rows: rows of the prefill scratch for experts not in the bank (default 32: 85 MB
            of Qwen3-30B-A3B rows).
        scratch_buffers: buffers the scratch is split into, one chunk of experts each: later
            chunks are copied while the GEMM reads earlier ones (default 2; MoEGemm says more).
        checkpoint: a checkpoint directory (any format `cupool.checkpoints` reads) to fill the
            store from instead of the model's own expert weights.
        expert_rows: fn(layer) -> uint8 [E, row_bytes] rows in the kernel layout (any device):
            experts made directly as NVFP4 rows (synthetic models); the model's expert weights
            are not read (they may already be released).
        layers: the MoE layer specs, if found (and maybe released) before; default: found here.
        route_fn: routing for per-expert Linear lists: fn(block, hidden [T,H], K) -> (ids, w).
    """
    if checkpoint is not None and expert_rows is not None:
        raise ValueError("give checkpoint or expert_rows, not both")
    if any(hasattr(m, "_cupool") for m in model.modules()):
        raise ValueError("this model is already wrapped by cupool (call pool.unwrap() first)")
    specs = list(layers) if layers is not None else find_moe_layers(model)
    s0 = check_specs(specs)
    E = s0.num_experts
    dev = torch.device("cuda", _cuda.device_index(device)) if torch.cuda.is_available() else None
    expert_params = {id(p) for s in specs for p in s.module.parameters()}
    named = dict(model.named_parameters())
    tables = {id(named[n]) for n in host_table_names(model)}     # stay in host memory
    pending = sum(t.numel() * t.element_size()
                  for t in list(model.parameters()) + list(model.buffers())
                  if id(t) not in expert_params | tables and t.device != dev)
    pending += dense_nvfp4.packed_bytes(model, elsewhere=dev)     # moved beside the weights
    embedding = input_embedding_name(model) if dev is not None else None
    optional = 0
    if embedding is not None:
        w = named[embedding]
        optional = w.numel() * w.element_size()
    p = plan(specs, pending_bytes=pending, rows=rows, budget=budget, device=device,
             kv_reserve=kv_reserve, max_decode_tokens=max_decode_tokens,
             max_prefill_tokens=max_prefill_tokens, scratch_rows=scratch_rows,
             scratch_buffers=scratch_buffers, host_optional_bytes=optional)
    layout = p.layout

    def fill(store):
        if checkpoint is not None:
            from cupool.checkpoints import fill_store, open_checkpoint
            with open_checkpoint(checkpoint) as ckpt:
                fill_store(store, ckpt, layout, device=p.device, progress=progress)
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
                r = _layer_rows(specs[layer], layout, p.device)
                specs[layer].release()
                return r
            store.fill(make_layer, progress=progress, desc="quantize experts -> NVFP4 store")

    def dense():
        # before .to(): they never touch the GPU (nor the input embedding, where the plan put it
        # in host memory)
        place_host_tables(model, p.device, also=[embedding] if p.embedding_on_host else [])
        model.to(p.device)
        dense_nvfp4.move(model, p.device)           # packed projections go with their weights

    return assemble(model, specs, p, fill, route_fn=route_fn, before_bank=dense)
