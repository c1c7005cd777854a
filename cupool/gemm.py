"""`MoEGemm`: one expert shape's NVFP4 MoE GEMM, its workspaces and its two paths.

Shape legend (ARCHITECTURE.md): T tokens · K top-k · W = T·K lanes · H hidden · I intermediate ·
E experts.

This module checks arguments, owns the fixed device workspaces and picks the path and kernel of
each call; the launches are `cupool.ops.moe_decode` (one-launch decode) and `cupool.ops.moe_gemm`
(moe_align + moe_gemm: prefill and the two-launch decode); the float reference is
`cupool.reference.moe.reference_moe`.

Two paths, both with fixed grids and sizes read on the device:
- `decode(x, lane_addr, topk_weights)`: lanes come with the address of their expert's row (what
  the plan step writes: bank row, staging row, or a host UVA address; 0 = padding). Memory-bound;
  a deterministic sum over top-k. Graph-capturable. One launch (moe_decode) up to 256 lanes;
  otherwise route_decode, then w13 and w2 launches.
- `prefill(x, topk_ids, topk_weights, expert_addr, ...)`: the partition path. Experts whose row is
  on the GPU (expert_addr[e] ≠ 0) are computed from there; the others are copied once per call
  into a bounded scratch of `scratch_rows` rows, chunk by chunk, and computed from the scratch;
  the copies run on a second stream, ahead of the GEMM (two chunk buffers). Given `lists` (prefill
  ahead, `Pool.prefill_ahead`: `ScratchLists`, the copies worked out on the host from the layer's
  placement) the copies are the copy engine's (cudaMemcpyAsync), and with `ahead` a call also
  issues the next layer's first chunk copies, so the copy stream works through the layer
  boundary (`AheadCopies`).

Both return out [T, H] in x's dtype (bf16 or fp16) on torch's current stream.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from cupool import _cuda, kernels
from cupool.activation import SILU, Activation
from cupool.layout import RowLayout
from cupool.ops import ACT_DTYPES, W_DTYPES, check_experts
from cupool.ops.moe_decode import MAX_LANES as FUSED_MAX_LANES
from cupool.ops.moe_decode import DecodeKernel, route_fits
from cupool.ops.moe_gemm import PAIR_SMALL, PAIR_WIDE, PREFILL, GemmConfig, GemmKernels

# Sticky error bits of the GEMM's `error` word: 1 and 2 are set by moe_lanes.cuh (moe_align.cu,
# moe_decode.cu), 4 by align_experts, 8 by moe_decode.cu's wait_count.
ERR_BAD_ID = 1
ERR_BAD_WEIGHT = 2
ERR_CHUNKS = 4
ERR_STALL = 8
ERROR_NAMES = {ERR_BAD_ID: "expert id outside [0, E)", ERR_BAD_WEIGHT: "non-finite router weight",
               ERR_CHUNKS: "more host experts than scratch chunks (internal)",
               ERR_STALL: "moe_decode waited over a second for a unit's w13 items (internal)"}


def check_activations(x: torch.Tensor, hidden: int, name: str = "hidden_states") -> None:
    """x must be a contiguous CUDA bf16/fp16 tensor [T, H]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if not x.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {x.device}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{name} must have shape [T, {hidden}], got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_routing(topk_weights: torch.Tensor, tokens: int, device, topk_ids=None) -> int:
    """Validate router outputs [T, K]; returns K. Values (NaN, range) are checked on the device."""
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating-point tensor, got "
                        f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)}")
    if topk_weights.dim() != 2 or topk_weights.shape[0] != tokens:
        raise ValueError(f"topk_weights must have shape [T={tokens}, K], got {list(topk_weights.shape)}")
    if topk_weights.device != device:
        raise ValueError(f"topk_weights is on {topk_weights.device}, hidden_states on {device}")
    if topk_ids is not None:
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if tuple(topk_ids.shape) != tuple(topk_weights.shape):
            raise ValueError(f"topk_ids shape {list(topk_ids.shape)} differs from topk_weights "
                             f"shape {list(topk_weights.shape)}")
        if topk_ids.device != device:
            raise ValueError(f"topk_ids is on {topk_ids.device}, hidden_states on {device}")
    return int(topk_weights.shape[1])


# The one-launch decode kernel (moe_decode.cu) or the two-launch pair (moe_align.cu + moe_gemm.cu).
DECODE_KERNELS = ("auto", "fused", "pair")


def resolve_decode_kernel(kind: str) -> str:
    """The decode kernel for `kind`: "auto" is "fused" on every architecture cupool builds for
    (moe_decode stages its weights with bulk copies on sm_90+ and with cp.async before, and
    multiplies bf16 pairs with fma where sm_80-89 have no bf16x2 multiply)."""
    if kind not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {kind!r}")
    return "fused" if kind == "auto" else kind


def decode_form(kind: str = "auto") -> str:
    """In words, the decode GEMM a `decode_kernel` value gives (`cupool info`)."""
    if resolve_decode_kernel(kind) == "fused":
        return (f"one launch (moe_decode) up to {FUSED_MAX_LANES} lanes, two launches (moe_w13, "
                f"moe_w2) past that")
    return "two launches (route_decode, moe_w13, moe_w2)"


def scratch_chunks(scratch_rows: int, scratch_buffers: int, num_experts: int) -> tuple[int, int, int]:
    """(buffers, experts a chunk, chunks) of the prefill scratch: as many buffers as asked for, at
    most one a row; each chunk fills one buffer; enough chunks for every expert of a layer."""
    nbuf = min(scratch_buffers, scratch_rows)
    chunk = scratch_rows // nbuf
    return nbuf, chunk, -(-num_experts // chunk)


def workspace_shapes(layout: RowLayout, topk: int, max_decode_tokens: int,
                     max_prefill_tokens: int, num_experts: int, scratch_rows: int = 32,
                     scratch_buffers: int = 2, prefill_config: GemmConfig = PREFILL):
    """({name: (shape, dtype)} of the decode workspaces, the same of the prefill ones; {} for
    prefill when max_prefill_tokens is 0). MoEGemm allocates exactly these; `workspace_bytes`
    sums them without a GPU (`python -m cupool plan`)."""
    hp, ip = layout.hp, layout.ip
    i32, i64, f32, f16, bf16 = torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16
    T, W = max_decode_tokens, max_decode_tokens * topk
    decode = dict(
        xh=((T, hp), f16), xscale=((T,), f32),
        range=((5,), i32),                             # moe_align.cu: in place, fresh, all
        unit_addr=((W,), i64), unit_lanes=((W * PAIR_WIDE.nt,), i32), unit_count=((W,), i32),
        lane_w=((W,), f32),
        act=((W, ip), bf16),                           # act(gate, up) rows
        yw=((W, hp), f32),
        group_done=((hp // 16,), i32),
        sync=((2 + W,), i32),                          # moe_decode: ticket, finished, per unit
    )
    if not max_prefill_tokens:
        return decode, {}
    P, WP = max_prefill_tokens, max_prefill_tokens * topk
    _, chunk, nchunks = scratch_chunks(scratch_rows, scratch_buffers, num_experts)
    max_units = WP // prefill_config.nt + num_experts
    prefill = dict(
        xh=((P, hp), f16), xscale=((P,), f32),
        phase_off=((nchunks + 2,), i32),
        unit_addr=((max_units,), i64), unit_lanes=((max_units * prefill_config.nt,), i32),
        unit_count=((max_units,), i32),
        lane_w=((WP,), f32), lane_e=((WP,), i32),
        act=((WP, ip), bf16),
        out32=((P, hp), f32),
        copies=((nchunks * chunk, 2), i32), n_copies=((nchunks,), i32),
        scratch=((scratch_rows, layout.row_stride), torch.uint8),
    )
    return decode, prefill


def scratch_runs(layer: int, resident, host_rows, scratch_base: int, scratch_stride: int,
                 row_bytes: int, chunk: int, nbuf: int, nchunks: int) -> tuple:
    """Per chunk, the scratch copies of a layer whose experts with a bank row are `resident`
    (bool [E]), as (dst, src, bytes) runs for the copy engine: those align_experts' ALL_HOST
    build lists for the same placement. Every expert without a bank row is ranked in expert
    order; rank r goes to scratch row (r // chunk % nbuf)·chunk + r % chunk from host_rows[layer·E
    + e] (host addresses, int64 [L·E]). Ranks whose rows follow each other at the scratch stride
    in the store and in the scratch are one run. More experts than nchunks·chunk: ValueError."""
    resident = np.asarray(resident, dtype=bool)
    E = resident.shape[0]
    host = np.flatnonzero(~resident)
    if host.size > nchunks * chunk:
        raise ValueError(f"layer {layer}: {host.size} experts without a bank row, the scratch "
                         f"takes {nchunks} chunks of {chunk}")
    src_of = np.asarray(host_rows, dtype=np.int64)[layer * E:(layer + 1) * E]
    out = []
    for c in range(nchunks):
        runs: list[list[int]] = []                       # [dst, src, rows]
        for i, e in enumerate(host[c * chunk:(c + 1) * chunk]):
            dst = scratch_base + scratch_stride * (i + (c % nbuf) * chunk)
            src = int(src_of[e])
            if runs and dst == runs[-1][0] + runs[-1][2] * scratch_stride \
                    and src == runs[-1][1] + runs[-1][2] * scratch_stride:
                runs[-1][2] += 1
            else:
                runs.append([dst, src, 1])
        out.append(tuple((d, s, (n - 1) * scratch_stride + row_bytes) for d, s, n in runs))
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class ScratchLists:
    """One layer's prefill scratch copies, worked out on the host from its placement
    (`MoEGemm.scratch_lists`): `chunks[c]` holds chunk c's (dst, src, bytes) runs, which the
    copy engine moves (cudaMemcpyAsync on the copy stream). A prefill call given them runs
    align_experts' ALL_HOST build, whose units read the rows where these runs put them."""
    layer: int
    chunks: tuple
    experts: int            # experts copied


class AheadCopies:
    """Which chunk copies of the next prefill call one call issued (prefill ahead).

    A call with `ahead` (the next call's `ScratchLists`) issues, at its end, their first chunk
    copies (`issued`); the next call asks `take` how many of its first chunks are already on the
    copy stream: all of them when its lists are those very lists, otherwise none, and the
    copies in flight are dropped (`dropped` counts them). Dropped copies are harmless: they run
    on the in-order copy stream, write only scratch buffers whose readers they waited for, and
    any later copy into those buffers, and the GEMM reading it, come after them
    (`MoEGemm.prefill`)."""

    def __init__(self):
        self.lists: ScratchLists | None = None   # the lists whose first chunks are in flight
        self.chunks = 0
        self.used = 0                     # calls that found their first chunks issued
        self.dropped = 0                  # issued chunk sets no call used

    def issued(self, lists: ScratchLists, chunks: int) -> None:
        self.lists, self.chunks = lists, int(chunks)

    def take(self, lists: ScratchLists | None) -> int:
        """How many of this call's first chunks were issued ahead for it (its `lists`, None
        for a call without); clears what was issued."""
        if self.lists is None:
            return 0
        if lists is not self.lists:
            self.drop()
            return 0
        got = self.chunks
        self.used += 1
        self._clear()
        return got

    def drop(self) -> None:
        """Forget what was issued (the copies still run); counted in `dropped`."""
        if self.lists is not None:
            self.dropped += 1
        self._clear()

    def _clear(self) -> None:
        self.lists, self.chunks = None, 0


def workspace_bytes(*args, **kwargs) -> int:
    """Bytes of every workspace `workspace_shapes` lists (the same arguments)."""
    total = 0
    for shapes in workspace_shapes(*args, **kwargs):
        for shape, dtype in shapes.values():
            total += math.prod(shape) * dtype.itemsize
    return total


class MoEGemm:
    """Workspaces and compiled kernels for one expert shape, dtype and device.

    Args:
        layout: the row layout (H, I).
        topk: K.
        dtype: activation/output dtype (torch.bfloat16 or torch.float16).
        max_decode_tokens: largest T of `decode` (sizes the decode workspaces; W ≤ 1024).
        max_prefill_tokens: largest T of `prefill` (0: no prefill workspaces).
        num_experts: E (needed for prefill).
        scratch_rows: rows of the prefill scratch for experts not on the GPU (≥ 1), split into
            `scratch_buffers` buffers (at most one a row) of scratch_rows // scratch_buffers
            rows, one chunk of experts each: later chunks are copied while the GEMM works on the
            resident experts or on an earlier chunk, and a chunk's copy waits only for the GEMM
            of the chunk scratch_buffers before it. More buffers: smaller chunks and a shorter
            last GEMM after the last copy, but more launches a call (host time). Default 32 rows
            in 2 buffers: chunks of 16 experts.
        decode_kernel: "fused": one launch groups the lanes and does w13 (weights dequantised
            to the model's dtype), SiLU·up, w2 and the top-k sum (moe_decode.cu), for calls of
            up to 256 lanes (T·K); wider calls, and "pair", use route_decode, then a w13 and a
            w2 launch (moe_align.cu, moe_gemm.cu). "auto" (default): "fused";
            `decode_kernel` holds the choice. Both are deterministic and hand SiLU·up from w13 to w2 in bf16, but they are
            not bit-identical (the pair multiplies x as fp16 scaled per token, moe_decode as it is,
            and their sums run in different orders).
        prefill_config: the launch config of prefill's moe_w13 / moe_w2
            (`cupool.ops.moe_gemm.PREFILL` by default; tuning sweeps pass others).
        activation: what the experts compute between w13 and w2 (`cupool.activation`): SiLU
            (default) or gpt-oss's clamped SwiGLU for a gated layout, ReLU(up)² (`RELU2`) for a
            layout without a gate (`RowLayout(gated=False)`, Nemotron-H); another pairing is a
            ValueError. Biases come with the rows (`layout.bias`).
    """

    def __init__(self, layout: RowLayout, topk: int, dtype=torch.bfloat16, *,
                 max_decode_tokens: int = 16, max_prefill_tokens: int = 0, num_experts: int = 0,
                 scratch_rows: int = 32, scratch_buffers: int = 2, decode_kernel: str = "auto",
                 prefill_config: GemmConfig = PREFILL, activation: Activation = SILU,
                 device=None):
        _cuda.require_gpu("the MoE GEMM")
        if not isinstance(activation, Activation):
            raise TypeError(f"activation must be a cupool.activation.Activation, got "
                            f"{type(activation).__name__}")
        if not isinstance(layout, RowLayout):
            raise TypeError(f"layout must be a cupool.layout.RowLayout, got {type(layout).__name__}")
        check_experts(layout, activation)
        if dtype not in ACT_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if max_decode_tokens * topk > 1024:
            raise ValueError(f"decode handles at most 1024 lanes: max_decode_tokens={max_decode_tokens} "
                             f"x topk={topk} = {max_decode_tokens * topk}")
        if isinstance(scratch_rows, bool) or not isinstance(scratch_rows, int) or scratch_rows < 1:
            raise ValueError(f"scratch_rows must be an int >= 1, got {scratch_rows!r}")
        if (isinstance(scratch_buffers, bool) or not isinstance(scratch_buffers, int)
                or scratch_buffers < 1):
            raise ValueError(f"scratch_buffers must be an int >= 1, got {scratch_buffers!r}")
        if not isinstance(prefill_config, GemmConfig):
            raise TypeError(f"prefill_config must be a cupool.ops.moe_gemm.GemmConfig, got "
                            f"{type(prefill_config).__name__}")
        if max_prefill_tokens and not 0 < num_experts <= 1024:
            raise ValueError(f"prefill needs num_experts in [1, 1024], got {num_experts}")
        self.layout, self.topk, self.dtype = layout, int(topk), dtype
        self.prefill_config = prefill_config
        self.activation = activation
        self.device = torch.device("cuda", _cuda.device_index(device))
        dev = self.device
        self.decode_kernel = resolve_decode_kernel(decode_kernel)
        self.sms = _cuda.target(dev).sms
        self.max_decode_tokens = int(max_decode_tokens)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)
        self.num_experts = int(num_experts)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.scratch_rows = int(scratch_rows)
        self._nbuf, self._chunk, nchunks = scratch_chunks(self.scratch_rows, int(scratch_buffers),
                                                           self.num_experts)
        shapes_d, shapes_p = workspace_shapes(layout, self.topk, self.max_decode_tokens,
                                              self.max_prefill_tokens, self.num_experts,
                                              self.scratch_rows, scratch_buffers, prefill_config)
        alloc = lambda shapes: {k: torch.zeros(sh, dtype=dt, device=dev)  # noqa: E731
                                for k, (sh, dt) in shapes.items()}
        self._d = alloc(shapes_d)
        self._p = None
        if max_prefill_tokens:
            self._p = dict(alloc(shapes_p), nchunks=nchunks)
            # per chunk c: its GEMM's unit range, its copy list and count (views made once: a
            # call walks every chunk, and a view costs microseconds of host time)
            p = self._p
            p["chunk_views"] = [(p["phase_off"][c + 1:c + 3],
                                 p["copies"][c * self._chunk:(c + 1) * self._chunk],
                                 p["n_copies"][c:c + 1]) for c in range(nchunks)]
        self._copier = None
        self._copy_stream = None          # prefill's scratch copies (made on first use)
        self._events: list = []           # per chunk: (copied, free), made on first use
        self._ahead = AheadCopies()       # the next call's chunk copies issued by this one
        self.decoder = DecodeKernel(layout, dtype, dev, activation)   # moe_decode builds, launches
        self._kernels = GemmKernels(layout, self.topk, dtype, dev, activation)

    @property
    def decode_workspaces(self) -> dict:
        """The decode workspaces (fixed device buffers). With `decoder` (the moe_decode launcher,
        `cupool.ops.moe_decode.DecodeKernel`) they let a profiler launch a build of its own
        choosing (`decoder.launch(build, ..., work=decode_workspaces, ...)`) as `decode` would."""
        return self._d

    def _out(self, x, out):
        if out is None:
            return torch.empty_like(x)
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device \
                or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor {list(x.shape)} on "
                             f"{x.device}, got {out.dtype} {list(out.shape)} on {out.device}")
        return out

    # --- decode ---------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, lane_addr: torch.Tensor, topk_weights: torch.Tensor,
               out: torch.Tensor | None = None, *, lane_fresh: torch.Tensor | None = None,
               before_fresh=None) -> torch.Tensor:
        """out[t] = Σ_k w[t,k] · expert(lane t·K+k)(x[t]) with weights read at lane_addr.

        lane_fresh: int32 [T·K] (the plan step's), 1 where the lane's row is still being copied
        in. The experts of the other lanes run first; then `before_fresh()` (e.g. make this
        stream wait for the copy stream) and the fresh experts, so the copies overlap the GEMM
        of the rows already in place. Without it, one pass over every lane.
        """
        check_activations(x, self.layout.hidden)
        if x.dtype != self.dtype:
            raise TypeError(f"hidden_states dtype {x.dtype} differs from the GEMM's {self.dtype}")
        T = x.shape[0]
        K = check_routing(topk_weights, T, x.device)
        if K != self.topk:
            raise ValueError(f"topk_weights has K={K}, the GEMM was built for top-{self.topk}")
        if T > self.max_decode_tokens:
            raise ValueError(f"decode takes at most {self.max_decode_tokens} tokens, got T={T} "
                             f"(use prefill for wide batches)")
        if lane_addr.dtype != torch.int64 or lane_addr.numel() != T * K or lane_addr.device != x.device:
            raise ValueError(f"lane_addr must be int64 [{T * K}] on {x.device}, got "
                             f"{lane_addr.dtype} {list(lane_addr.shape)} on {lane_addr.device}")
        if lane_fresh is not None and (
                lane_fresh.dtype != torch.int32 or lane_fresh.numel() != T * K
                or lane_fresh.device != x.device or not lane_fresh.is_contiguous()):
            raise ValueError(f"lane_fresh must be a contiguous int32 [{T * K}] tensor on "
                             f"{x.device}, got {lane_fresh.dtype} {list(lane_fresh.shape)} on "
                             f"{lane_fresh.device}")
        if before_fresh is not None and not callable(before_fresh):
            raise TypeError(f"before_fresh must be callable, got {type(before_fresh).__name__}")
        out = self._out(x, out)
        w = topk_weights.reshape(-1)
        if w.dtype not in W_DTYPES or not w.is_contiguous():
            w = w.to(torch.float32).contiguous()
        lane_addr = lane_addr.reshape(-1)
        if self.decode_kernel == "fused" and T * K <= FUSED_MAX_LANES:
            build = self.decoder.choose(T * K, x, w)
            run = self.decoder.launch
            if lane_fresh is None:
                run(build, x, lane_addr, None, w, K, 2, self._d, out, self.error)
            else:
                run(build, x, lane_addr, lane_fresh, w, K, 0, self._d, out, self.error)  # in place
                if before_fresh is not None:
                    before_fresh()
                run(build, x, lane_addr, lane_fresh, w, K, 1, self._d, out, self.error)  # copied
            return out
        cfg = PAIR_SMALL if T * K <= 64 else PAIR_WIDE
        d, ops = self._d, self._kernels
        # one thread a lane and at least one warp a token (up to 32): a small block starts and
        # synchronises faster than the 1024 threads the kernel allows
        threads = min(1024, max(64, 32 * -(-(T * K) // 32), 32 * min(T, 32)))
        kernels.launch(ops.align(cfg.nt, "route_decode", x, w_dtype=W_DTYPES[w.dtype]), 1,
                       threads, (
            x, kernels.i32(T), kernels.i32(self.layout.hidden), d["xh"], d["xscale"],
            lane_addr, kernels.NULL if lane_fresh is None else lane_fresh, w,
            kernels.i32(T * K), d["range"], d["unit_addr"],
            d["unit_lanes"], d["unit_count"], d["lane_w"], self.error), device=self.device)
        r = d["range"]
        args = (d["unit_addr"], d["unit_lanes"], d["unit_count"], d["xh"], d["xscale"], d["act"],
                d["lane_w"], T, self.error)
        kw = dict(out=out, yw=d["yw"], group_done=d["group_done"], all_rng=r[3:5])
        ops.run(cfg, r[0:2], *args, **kw)                      # rows in place (all, if no split)
        if lane_fresh is not None:
            if before_fresh is not None:
                before_fresh()
            ops.run(cfg, r[1:3], *args, **kw)                  # rows the copies bring in
        return out

    def routes_decode(self, tokens: int, experts: int) -> str | None:
        """Why `decode_routed` cannot take a step of `tokens` tokens over `experts` experts (None:
        it can): it needs the one-launch decode GEMM (decode_kernel "fused") with its lanes, bf16
        activations and shared memory for the logits (`cupool.ops.moe_decode.route_fits`)."""
        if self.decode_kernel != "fused":
            return f"the decode GEMM is {self.decode_kernel!r}, not the one-launch 'fused'"
        if self.dtype != torch.bfloat16:
            return f"the GEMM's activations are {self.dtype}, the routing reads bf16"
        if tokens * self.topk > FUSED_MAX_LANES:
            return f"{tokens} tokens of top-{self.topk} exceed {FUSED_MAX_LANES} lanes"
        if tokens > self.max_decode_tokens:
            return f"decode takes at most {self.max_decode_tokens} tokens, the step has {tokens}"
        return route_fits(tokens, experts, self.layout.hp)

    def decode_routed(self, h: torch.Tensor, router: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, norm_topk: bool, table: torch.Tensor, *, x_out: torch.Tensor,
                      logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      lane_addr: torch.Tensor, count: torch.Tensor,
                      active: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode step's routing and MoE in one launch, for a bank that holds every expert at
        a fixed row: x = rmsnorm(h) · norm_weight (into x_out), logits = x · routerᵀ (float32
        [T, E], each rounded to bf16), softmax top-k (renormalised when norm_topk) → ids int32
        [T, K] and weights [T, K] (float32 or bf16, the router's dtype), lane_addr int64 [T·K] =
        table[id] (table int64 [E], each expert's bank row address), then out = Σ_k w · expert(x)
        (`decode`'s). Tokens whose `active` (bool [T]) is False get ids −1 and add nothing. count:
        int32 [1], zero at rest (the launch puts it back). Launched as a dependent of the kernel
        that writes h. `routes_decode` says where it applies."""
        check_activations(h, self.layout.hidden, "h")
        T, dev = h.shape[0], h.device
        K = self.topk
        E = router.shape[0] if isinstance(router, torch.Tensor) and router.dim() == 2 else -1
        why = self.routes_decode(T, E)
        if why is not None:
            raise ValueError(f"decode_routed: {why}")
        H = self.layout.hidden

        def need(name, t, shape, dtypes, align=False):
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.device != dev \
                    or tuple(t.shape) != shape or not t.is_contiguous() \
                    or (align and t.data_ptr() % 16):
                got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                want = " or ".join(str(d) for d in dtypes)
                raise ValueError(f"{name} must be a contiguous{' 16-byte aligned' if align else ''}"
                                 f" {want} tensor {list(shape)} on {dev}, got {got}")

        bf = torch.bfloat16
        need("h", h, (T, H), (bf,), align=True)
        need("router", router, (E, H), (bf,), align=True)
        need("norm_weight", norm_weight, (H,), (bf,), align=True)
        need("table", table, (E,), (torch.int64,))
        need("x_out", x_out, (T, H), (bf,), align=True)
        need("logits", logits, (T, E), (torch.float32,))
        need("ids", ids, (T, K), (torch.int32,))
        need("weights", weights, (T, K), (torch.float32, bf))
        need("lane_addr", lane_addr, (T * K,), (torch.int64,))
        need("count", count, (1,), (torch.int32,))
        if active is not None:
            need("active", active, (T,), (torch.bool, torch.uint8))
        if not isinstance(eps, float) or not eps > 0:
            raise ValueError(f"eps must be a positive float, got {eps!r}")
        out = self._out(h, out)
        build = self.decoder.choose(T * K, x_out, weights, route=True)
        self.decoder.launch_routed(build, h, router, norm_weight, eps, norm_topk, active, table,
                                   x_out, logits, ids, weights, lane_addr, count, self._d, out,
                                   self.error)
        return out

    # --- prefill --------------------------------------------------------------------------
    def prefill(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                expert_addr: torch.Tensor, *, host_addr: torch.Tensor | None = None,
                layer: int = 0, out: torch.Tensor | None = None,
                lists: ScratchLists | None = None,
                ahead: ScratchLists | None = None, accumulate=None,
                host_experts: int | None = None) -> torch.Tensor:
        """The partition path. expert_addr: int64 [E], the GPU address of each resident expert's
        row, 0 for the others, which are read from `host_addr[layer·E + e]` (the store's UVA
        address table) into the scratch in chunks of scratch_rows // scratch_buffers, on a second
        stream: the first chunks' copies overlap the resident experts' GEMM, and chunk c + B's
        copy (B buffers) overlaps the GEMMs of chunks c + 1 ... (it waits for chunk c's GEMM,
        which read the same buffer). The copy lists are align_experts' (routed experts only),
        copied by the row-copy kernel.

        lists: None, or this layer's `ScratchLists` (`scratch_lists`, from the expert_addr
        given here: the caller guarantees they agree). Then every expert not on the GPU is
        copied, routed or not (align_experts' ALL_HOST build), by the copy engine from these
        lists, which need nothing from the device (host_addr is not read). ahead: None, or the
        next call's `ScratchLists` (needs lists): this call issues their first min(B, chunks)
        chunk copies at its end, each after this call's last GEMM on that buffer, so the copy
        stream keeps working while the model computes what lies between the two calls. A next
        call given those very lists uses them; any other next call drops them
        (`ahead_dropped`).

        accumulate: None, or a callable given the call's float32 sum [T, H] after the last GEMM
        and before it is rounded into `out`, on the current stream, to add what was computed
        elsewhere (the host's experts: `PooledExperts`' host prefill).

        host_experts: None, or how many of the layer's experts have no bank row (expert_addr 0),
        as the caller knows without reading the device (`Pool.prefill_resident`); it must agree
        with expert_addr. A call runs only the chunks that can hold a row: with lists, those
        their experts fill; else those min(host_experts, T·K) routed experts can fill (all of
        them when None). A chunk's GEMM and copy cost the host tens of µs each, which a short
        prompt's call, whose routed experts mostly have bank rows, would spend on empty chunks."""
        if self._p is None:
            raise RuntimeError("this MoEGemm was built without prefill workspaces "
                               "(max_prefill_tokens=0)")
        check_activations(x, self.layout.hidden)
        if x.dtype != self.dtype:
            raise TypeError(f"hidden_states dtype {x.dtype} differs from the GEMM's {self.dtype}")
        T = x.shape[0]
        K = check_routing(topk_weights, T, x.device, topk_ids)
        if K != self.topk:
            raise ValueError(f"top-k is {K}, the GEMM was built for top-{self.topk}")
        if T > self.max_prefill_tokens:
            raise ValueError(f"prefill takes at most {self.max_prefill_tokens} tokens, got T={T}")
        self._check_expert_addr(expert_addr, x.device, "expert_addr")
        for name, given in (("lists", lists), ("ahead", ahead)):
            if given is not None and not isinstance(given, ScratchLists):
                raise TypeError(f"{name} must be None or a cupool.gemm.ScratchLists "
                                f"(MoEGemm.scratch_lists), got {type(given).__name__}")
        if lists is not None and lists.layer != layer:
            raise ValueError(f"lists are layer {lists.layer}'s, the call is layer {layer}'s")
        if ahead is not None and lists is None:
            raise ValueError("ahead needs lists (the next call's copies are issued before its "
                             "routing exists, so both calls copy every expert not on the GPU)")
        out = self._out(x, out)
        p, cfg, ops = self._p, self.prefill_config, self._kernels
        ids = topk_ids.reshape(-1)
        w = topk_weights.reshape(-1)
        if w.dtype not in W_DTYPES or not w.is_contiguous():
            w = w.to(torch.float32).contiguous()
        if host_experts is not None and (isinstance(host_experts, bool)
                                         or not isinstance(host_experts, int)
                                         or not 0 <= host_experts <= self.num_experts):
            raise ValueError(f"host_experts must be None or an int in [0, {self.num_experts}], "
                             f"got {host_experts!r}")
        nchunks = 0
        if lists is not None:
            nchunks = self._chunks_for(lists.experts)
        elif host_addr is not None:
            nchunks = self._chunks_for(None if host_experts is None
                                       else min(host_experts, T * K))
        nbuf = self._nbuf
        first = min(nbuf, nchunks)               # chunks copied before the first chunk GEMM
        issued = self._ahead.take(lists)         # == first when the call before issued them
        ahead_first = 0 if ahead is None else min(nbuf, self._chunks_for(ahead.experts))
        main = torch.cuda.current_stream(self.device)
        side = self._side_stream() if nchunks or ahead_first else None
        if side is not None and lists is not None:
            side.wait_stream(main)               # earlier calls' GEMMs on the scratch buffers
        kernels.launch(ops.align(cfg.nt, "prep_x", x), -(-T // 8), 256,
                       (x, kernels.i32(T), kernels.i32(self.layout.hidden), p["xh"], p["xscale"]),
                       device=self.device)
        self._align(x, ids, w, T * K, layer, expert_addr, nchunks, lists is not None)
        out32 = p["out32"][:T]
        out32.zero_()
        args = (p["unit_addr"], p["unit_lanes"], p["unit_count"], p["xh"], p["xscale"], p["act"],
                p["lane_w"], T, self.error)
        views = p["chunk_views"]
        copier = self._scratch_copier(host_addr) if nchunks and lists is None else None

        def copy(c, src=lists):                  # chunk c into buffer c % nbuf, on `side`
            if src is None:
                copier(views[c][1], views[c][2], stream=side)
            else:
                self._copy_engine(src.chunks[c], side)
            self._events[c][0].record(side)

        if not nchunks:
            ops.run(cfg, p["phase_off"][0:2], *args, out32=out32)
        else:
            if lists is None:
                side.wait_stream(main)           # the copy lists from align_experts
            # Chunks [0, issued) were issued by the previous call from these very lists.
            for c in range(issued, first):
                copy(c)
            ops.run(cfg, p["phase_off"][0:2], *args, out32=out32)   # resident experts
            for c in range(nchunks):
                main.wait_event(self._events[c][0])
                ops.run(cfg, views[c][0], *args, out32=out32)
                if c + nbuf < nchunks:               # buffer c % nbuf is free after this GEMM
                    self._events[c][1].record(main)
                    side.wait_event(self._events[c][1])
                    copy(c + nbuf)
                elif ahead is not None:              # this call's last GEMM on buffer c % nbuf
                    self._events[c][1].record(main)
            main.wait_stream(side)                   # this call's copies (not the ahead ones)
        if ahead is not None:
            # Chunk b of the next layer goes into buffer b after the last GEMM here that read
            # it; a buffer no chunk here read waits for nothing more than the earlier calls'
            # GEMMs, which `side` waited for above. The copy stream is in order: these copies
            # follow this call's, and whatever the next call copies into a buffer follows them.
            for b in range(ahead_first):
                if b < nchunks:
                    last = b + nbuf * ((nchunks - 1 - b) // nbuf)
                    side.wait_event(self._events[last][1])
                copy(b, ahead)
            self._ahead.issued(ahead, ahead_first)
        if accumulate is not None:
            H = self.layout.hidden
            if out32.shape[1] == H:
                accumulate(out32)
            else:             # the sum's rows are padded past H: accumulate sees [T, H] alone
                part = torch.zeros(T, H, dtype=torch.float32, device=out32.device)
                accumulate(part)
                out32[:, :H] += part
        ops.finish(cfg, out32, T, out)
        return out

    def scratch_lists(self, layer: int, resident, host_rows) -> ScratchLists:
        """`ScratchLists` of `layer` for `prefill(lists=)`: resident, bool [E] (numpy or a
        sequence), the experts with a bank row (those whose expert_addr ≠ 0); host_rows, int64
        [L·E], the host address of each (layer, expert) row (`HostStore.host_addresses`)."""
        if self._p is None:
            raise RuntimeError("this MoEGemm was built without prefill workspaces "
                               "(max_prefill_tokens=0)")
        resident = np.asarray(resident)
        if resident.dtype != np.bool_ or resident.shape != (self.num_experts,):
            raise ValueError(f"resident must be bool [{self.num_experts}], got {resident.dtype} "
                             f"{list(resident.shape)}")
        host_rows = np.asarray(host_rows)
        E = self.num_experts
        if host_rows.dtype != np.int64 or host_rows.ndim != 1 or host_rows.size < (layer + 1) * E:
            raise ValueError(f"host_rows must be int64 [L*{E}] covering layer {layer}, got "
                             f"{host_rows.dtype} {list(host_rows.shape)}")
        scratch = self._p["scratch"]
        chunks = scratch_runs(layer, resident, host_rows, scratch.data_ptr(), scratch.stride(0),
                              self.layout.row_bytes, self._chunk, self._nbuf, self._p["nchunks"])
        return ScratchLists(int(layer), chunks, int((~resident).sum()))

    def copy_engine_us(self, lists: ScratchLists, reps: int = 5) -> float:
        """µs a row of `lists`' copies as a prefill call with lists makes them (the copy
        engine's cudaMemcpyAsync runs into the scratch, on the copy stream): the median of `reps`
        timed passes over all its chunks after one warm-up. Not while a prefill is in flight:
        the copies overwrite the scratch, so what a call issued ahead is dropped first."""
        if not lists.experts:
            raise ValueError(f"layer {lists.layer}'s lists copy no rows: nothing to time")
        if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
            raise ValueError(f"reps must be an int >= 1, got {reps!r}")
        side, main = self._side_stream(), torch.cuda.current_stream(self.device)
        self.drop_ahead()
        side.wait_stream(main)                      # earlier GEMMs reading the scratch
        times = []
        for i in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(side)
            for runs in lists.chunks:
                self._copy_engine(runs, side)
            b.record(side)
            b.synchronize()
            if i:
                times.append(a.elapsed_time(b) * 1e3 / lists.experts)
        main.wait_stream(side)
        return float(np.median(times))

    def _chunks_for(self, experts: int | None) -> int:
        """Scratch chunks a call needs for `experts` rows without a bank row (align_experts ranks
        them in order, chunk c taking ranks c·chunk ...); None: all of them."""
        n = self._p["nchunks"]
        return n if experts is None else min(n, -(-int(experts) // self._chunk))

    def _side_stream(self) -> torch.cuda.Stream:
        """The copy stream of the scratch copies and their per-chunk events, made on first use."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._events = [(torch.cuda.Event(), torch.cuda.Event())
                            for _ in range(self._p["nchunks"])]
        return self._copy_stream

    def _copy_engine(self, runs, stream) -> None:
        """Each (dst, src, bytes) run as one cudaMemcpyAsync on `stream` (a DMA engine's copy:
        no SM takes part)."""
        cp = _cuda.cupy()
        rt, handle = cp.cuda.runtime, stream.cuda_stream
        with cp.cuda.Device(self.device.index):      # the stream's device is the current one
            for dst, src, nbytes in runs:
                rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, handle)

    def _check_expert_addr(self, addr, device, name: str) -> None:
        E = self.num_experts
        if (not isinstance(addr, torch.Tensor) or addr.dtype != torch.int64 or addr.numel() != E
                or addr.device != device):
            raise ValueError(f"{name} must be int64 [{E}] on {device}, got "
                             f"{getattr(addr, 'dtype', type(addr).__name__)} "
                             f"{list(getattr(addr, 'shape', []))} on {getattr(addr, 'device', '-')}")

    def _align(self, x, ids, w, lanes: int, layer: int, expert_addr, nchunks: int,
               all_host: bool) -> None:
        """align_experts over `lanes` lanes into the prefill workspaces (phase offsets, units,
        lane tables, copy lists); `all_host`: its ALL_HOST build."""
        p, nt = self._p, self.prefill_config.nt
        kernels.launch(self._kernels.align(nt, "align_experts", x,
                                           int(ids.dtype == torch.int64), W_DTYPES[w.dtype],
                                           all_host), 1, 1024, (
            ids, w, kernels.i32(lanes), kernels.i32(self.num_experts), kernels.i32(layer),
            expert_addr, kernels.i64(p["scratch"].data_ptr()),
            kernels.i64(p["scratch"].stride(0)), kernels.i32(self._chunk),
            kernels.i32(self._nbuf), kernels.i32(nchunks), p["phase_off"], p["unit_addr"],
            p["unit_lanes"], p["unit_count"], p["lane_w"], p["lane_e"], p["copies"],
            p["n_copies"], self.error), device=self.device)

    @property
    def ahead_used(self) -> int:
        """Prefill calls that found their first chunk copies issued by the call before."""
        return self._ahead.used

    @property
    def ahead_dropped(self) -> int:
        """Chunk copies a prefill call issued ahead that the next call did not use (another
        layer, a call without those lists, or `drop_ahead`)."""
        return self._ahead.dropped

    def drop_ahead(self) -> None:
        """Forget the chunk copies issued ahead (the pool's prefill ends): a later call never
        takes them, whatever moved in between."""
        self._ahead.drop()

    def _scratch_copier(self, host_addr: torch.Tensor):
        from cupool.ops.rowcopy import RowCopier
        if self._copier is None or self._copier.src_of_key is not host_addr:
            self._copier = RowCopier(host_addr, self.layout.row_bytes, self._p["scratch"],
                                     self._chunk)
        return self._copier

    def read_error(self) -> list[str]:
        """Decoded sticky error flags of the align kernels (a host read: not for the hot path)."""
        v = int(self.error.item())
        return [msg for bit, msg in ERROR_NAMES.items() if v & bit]

    def clear_error(self) -> None:
        self.error.zero_()

    def memory_parts(self) -> list[tuple[str, int, str]]:
        tensors = list(self._d.values()) + ([v for v in self._p.values()
                                             if isinstance(v, torch.Tensor)] if self._p else [])
        return [("GEMM workspaces", sum(t.numel() * t.element_size() for t in tensors), "gpu")]
