"""`cupool.wrap(model)`: turn a PyTorch MoE model into one that decodes from the shared bank.

Shape legend: L MoE layers · E experts · K top-k · H hidden · I intermediate · N rows per layer.

wrap():
1. finds the MoE layers (`cupool.adapters`), checks that they agree on E, K, H, I and dtype;
2. quantizes every layer's experts to NVFP4 on the GPU, straight into the pinned host store,
   layer by layer (progress bar), releasing each layer's bf16 expert weights once converted;
   or fills the store from a ModelOpt NVFP4 checkpoint;
3. moves the rest of the model to the GPU and allocates the GEMM workspaces;
4. sizes the bank: `rows` per layer, or what `budget` leaves after the rest of the model, the
   workspaces, staging and the KV-cache reserve (and what NVML says is free);
5. swaps each experts module's computation for `PooledExperts` (transformers ≥ 5: a registered
   experts implementation, "cupool"; per-expert Linear lists: the MoE block's forward).
The gate starts closed (warm-up and capture must not move the placement); `pool.open()` opens it.
"""

from __future__ import annotations

import itertools
import types
import weakref

import torch
import torch.nn.functional as F

from cupool import _cuda
from cupool.adapters import MoELayerSpec, check_consistent, find_moe_layers
from cupool.bank import Bank
from cupool.budget import MemoryReport, parse_bytes, report
from cupool.gemm import MoEGemm
from cupool.layout import RowLayout
from cupool.store import HostStore, fmt_bytes

IMPLEMENTATION = "cupool"


class BudgetError(ValueError):
    """The memory budget cannot hold top-k rows per layer next to the rest of the model."""


class PooledExperts:
    """One MoE layer's experts computed from the pool: `(hidden [T,H], top_k_index [T,K],
    top_k_weights [T,K]) -> [T,H]`, on torch's current stream, graph-capturable in decode.

    Decode (T·K ≤ the bank's max lanes): plan step + row copies + decode GEMM; with the pool's
    `overlap_copies` (off by default) the copies run on a second stream while the GEMM works on
    the experts already in the bank, and the copied experts follow in a second launch. Wider
    batches:
    the partition path (resident experts from the bank, the others from the host store through
    a bounded scratch), which leaves the placement alone.
    """

    def __init__(self, pool: "Pool", layer: int):
        self.pool, self.layer = pool, layer
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        p = self.pool
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.device != p.device:
            raise ValueError(f"layer {self.layer}: hidden_states must be on {p.device}, got "
                             f"{getattr(hidden_states, 'device', type(hidden_states).__name__)}")
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        ids = top_k_index.reshape(x.shape[0], -1)
        w = top_k_weights.reshape(x.shape[0], -1)
        if ids.shape[1] != p.top_k:
            raise ValueError(f"layer {self.layer}: top_k_index has K={ids.shape[1]}, the pool "
                             f"was built for top-{p.top_k}")
        if p.replayer is not None:                       # benchmarks: routing from a trace
            ids = p.replayer.ids_for(self.layer, x.shape[0])
        if p.recorder is not None:
            p.recorder.append(self.layer, ids)
        decode = x.shape[0] * p.top_k <= p.bank.max_lanes
        if p.backend is not None and decode:             # benchmarks: a baseline's decode step
            out = p.backend(self.layer, x, ids, w)
        elif decode and p.overlap_copies:
            _, lane_addr, fresh, join = p.bank.step_split(self.layer, ids)
            out = p.gemm.decode(x, lane_addr, w, lane_fresh=fresh, before_fresh=join)
        elif decode:
            _, lane_addr = p.bank.step(self.layer, ids)
            out = p.gemm.decode(x, lane_addr, w)
        else:
            out = p.gemm.prefill(x, ids, w, p.expert_addresses(self.layer),
                                 host_addr=p.store.address_table(), layer=self.layer)
        if p.replayer is not None and self.layer == p.num_layers - 1:
            p.replayer.advance()
        return out.reshape(hidden_states.shape)


# torch.compile: dynamo cannot trace the raw kernel launches, so under compilation a pooled layer
# is the opaque op cupool::experts (its key names the PooledExperts); the rest of the model is
# compiled around it. Eager calls skip the dispatcher.
_LAYERS: "weakref.WeakValueDictionary[int, PooledExperts]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()            # never reused, unlike id() of a freed layer


@torch.library.custom_op("cupool::experts", mutates_args=())
def experts_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, key: int) -> torch.Tensor:
    """[T, H], [T, K], [T, K] -> [T, H]: the PooledExperts registered under `key`."""
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"cupool::experts: no pooled layer with key {key} (the pool was unwrapped "
                           f"or freed; recompile after wrapping again)")
    return layer(hidden_states, top_k_index, top_k_weights)


@experts_op.register_fake
def _experts_fake(hidden_states, top_k_index, top_k_weights, key):
    return torch.empty_like(hidden_states)


def call_pooled(layer: "PooledExperts", hidden_states, top_k_index, top_k_weights):
    if torch.compiler.is_compiling():
        return experts_op(hidden_states, top_k_index, top_k_weights, layer.key)
    return layer(hidden_states, top_k_index, top_k_weights)


def _hf_experts_forward(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """The "cupool" entry of transformers' experts interface."""
    pooled = getattr(module, "_cupool", None)
    if pooled is None:
        raise RuntimeError(f"{type(module).__name__} uses the 'cupool' experts implementation but "
                           f"was not wrapped by cupool.wrap (or was unwrapped)")
    return call_pooled(pooled, hidden_states, top_k_index, top_k_weights)


def _register_hf() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: PLC0415
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


class Pool:
    """The handle `wrap()` returns: store, bank, GEMM and the swapped layers."""

    def __init__(self, model, specs: list[MoELayerSpec], layout: RowLayout, store: HostStore,
                 bank: Bank, gemm: MoEGemm, device: torch.device, route_fn=None):
        self.model, self.specs, self.layout = model, specs, layout
        self.store, self.bank, self.gemm, self.device = store, bank, gemm, device
        self.num_layers, self.num_experts = store.num_layers, store.num_experts
        self.top_k = specs[0].top_k
        self.rows_per_layer = bank.rows_per_layer
        self.layers = [PooledExperts(self, i) for i in range(len(specs))]
        self._route_fn = route_fn or default_route
        self._restore: list = []
        self.replayer = None     # cupool.trace.Replayer (benchmarks)
        self.recorder = None     # cupool.trace.Recorder
        self.backend = None      # benchmarks: fn(layer, x, ids, w) -> out replacing the pool
        # decode: copies on a second stream beside the GEMM of the rows in place. Off: with the
        # one-launch decode GEMM it bought ~1% at pool-50 and cost ~10% at pool-100 on an H200
        # (the second launch); bench_decode's pool-N vs pool-N-serial rows.
        self.overlap_copies = False

    # --- install / uninstall ------------------------------------------------------------------
    def _install(self) -> None:
        hf = [s for s in self.specs if s.kind == "hf_experts"]
        if hf:
            _register_hf()
        for spec, layer in zip(self.specs, self.layers):
            if spec.kind == "hf_experts":
                cfg = spec.module.config
                self._restore.append(("hf", spec.module, cfg, cfg._experts_implementation))
                spec.module._cupool = layer
                cfg._experts_implementation_internal = IMPLEMENTATION
            else:
                block = spec.parent
                self._restore.append(("block", block, block.__dict__.get("forward")))
                block.forward = types.MethodType(self._block_forward(layer, spec), block)
                block._cupool = layer

    def _block_forward(self, layer: PooledExperts, spec: MoELayerSpec):
        route, k = self._route_fn, spec.top_k

        def forward(block, hidden_states, *args, **kwargs):
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            ids, w = route(block, x, k)
            return call_pooled(layer, x, ids, w).reshape(shape)
        return forward

    def unwrap(self, *, restore_weights: bool = True) -> None:
        """Undo the swap. With `restore_weights`, each experts module gets back its weights as
        the dequantized NVFP4 values (the original bf16 weights were released at wrap time), on
        the pool's device in the model's dtype. The store and bank are freed."""
        from cupool.layout import unpack_row  # noqa: PLC0415
        from cupool.nvfp4 import dequantize  # noqa: PLC0415
        for entry in reversed(self._restore):
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
        self._restore.clear()
        if restore_weights:
            for spec in self.specs:
                mats = [unpack_row(self.layout, self.store.row(spec.index, e))
                        for e in range(self.num_experts)]
                deq = [tuple(dequantize(q).to(spec.dtype) for q in trio) for trio in mats]
                spec.restore(deq, self.device)
        self.bank = None
        self.gemm = None
        self.store.close()

    def resize_bank(self, rows: int) -> None:
        """Replace the bank by one of `rows` rows per layer (initial placement, gate closed,
        counters zero). The old bank's memory is released first. Any captured graph that used the
        old bank must be captured again."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not self.top_k <= rows <= self.num_experts:
            raise ValueError(f"rows must be an int with top_k={self.top_k} <= rows <= "
                             f"E={self.num_experts}, got {rows!r}")
        max_lanes, staging = self.bank.max_lanes, self.bank.staging_rows
        self.bank = None
        torch.cuda.empty_cache()
        self.bank = Bank(self.store, rows, staging_rows=staging, max_lanes=max_lanes,
                         device=self.device)
        self.rows_per_layer = rows

    # --- gate, checks, stats ------------------------------------------------------------------
    def open(self, verify: bool = True, sample: int | None = 64) -> None:
        """Open the gate (placement starts following the routing). Verifies tables and `sample`
        bank rows against the host store first."""
        self.bank.open(verify=verify, sample=sample)

    def close(self) -> None:
        self.bank.close()

    def verify(self, sample: int | None = None) -> int:
        """Tables form a bijection and bank rows equal the host store; returns rows checked."""
        return self.bank.verify(sample)

    def stats(self) -> list[dict]:
        """Per layer: hits, misses, hit rate, promotions, staged, rows owned, bytes copied."""
        return self.bank.stats()[0]

    def stats_table(self) -> str:
        return self.bank.stats()[1]

    def errors(self) -> list[str]:
        """Sticky device error flags (planner and GEMM), decoded. A host read."""
        from cupool.planner import PlanError  # noqa: PLC0415
        err = self.bank.read_error()
        out = [f"planner: {f.name}" for f in PlanError if f and f in err]
        return out + [f"gemm: {e}" for e in self.gemm.read_error()]

    def expert_addresses(self, layer: int) -> torch.Tensor:
        """int64 [E]: device address of layer's experts that own a bank row, 0 for the others."""
        E = self.num_experts
        slot = self.bank.slot_of[layer * E:(layer + 1) * E].to(torch.int64)
        addr = self.bank.rows.data_ptr() + slot * self.bank.row_stride
        return torch.where(slot >= 0, addr, torch.zeros_like(addr))

    def memory_parts(self) -> list[tuple[str, int, str]]:
        parts = list(self.bank.memory_parts()) + list(self.gemm.memory_parts())
        rest = sum(t.numel() * t.element_size() for t in
                   list(self.model.parameters()) + list(self.model.buffers()) if t.is_cuda)
        parts.append(("rest of the model", rest, "gpu"))
        return parts

    def report(self) -> MemoryReport:
        return report(self)

    def __repr__(self) -> str:
        return (f"Pool(L={self.num_layers}, E={self.num_experts}, top_k={self.top_k}, "
                f"rows/layer={self.rows_per_layer}, row={fmt_bytes(self.layout.row_bytes)}, "
                f"gate={'open' if int(self.bank.gate.item()) else 'closed'})")


def _layer_rows(spec: MoELayerSpec, layout: RowLayout, device, chunk: int = 16):
    """uint8 [E, row_bytes] (CPU) of one layer, quantized on the GPU `chunk` experts at a time."""
    from cupool import quantize as q  # noqa: PLC0415
    from cupool.layout import pack_rows  # noqa: PLC0415
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
        rows = pack_rows(layout, q.quantize(g, name=f"{spec.name} gate"),
                         q.quantize(u, name=f"{spec.name} up"),
                         q.quantize(d, name=f"{spec.name} down"))
        out[e0:e1].copy_(rows, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return out


def _rows_from_budget(budget: int | None, row_stride: int, L: int, K: int, E: int,
                      extra: int, device, kv_reserve: int) -> int:
    """Rows per layer: what `budget` leaves after what torch already holds on the device (the
    rest of the model, the GEMM workspaces) and `extra` (staging, tables), capped by what NVML
    says is free. budget None: NVML alone."""
    from cupool.budget import gpu_memory, rows_for_budget  # noqa: PLC0415
    used = torch.cuda.memory_allocated(device)
    free = gpu_memory(device).free
    by_budget = E
    if budget is not None:
        try:
            by_budget = rows_for_budget(budget, fixed=used + extra, row_stride=row_stride,
                                        num_layers=L, top_k=K, num_experts=E, kv_reserve=kv_reserve)
        except ValueError as e:
            raise BudgetError(str(e)) from None
    try:
        by_nvml = rows_for_budget(free, fixed=extra + (256 << 20), row_stride=row_stride,
                                  num_layers=L, top_k=K, num_experts=E, kv_reserve=kv_reserve)
    except ValueError as e:
        raise BudgetError(f"NVML reports {fmt_bytes(free)} free on {device}, not enough: "
                          f"{str(e).replace('budget=', 'free memory ')}") from None
    return min(by_budget, by_nvml)


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
        rows = _rows_from_budget(budget_bytes, row_stride, L, K, E, extra, dev, kv)
    store = HostStore(L, E, layout.row_bytes, device=dev)
    try:
        if checkpoint is not None:
            from cupool.modelopt import fill_store_from_checkpoint  # noqa: PLC0415
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
