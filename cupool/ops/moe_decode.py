"""Launcher of `rawkernels/moe_decode.cu`: a decode layer's NVFP4 MoE GEMM in one launch.

Shape legend (ARCHITECTURE.md): T tokens · K top-k · W = T·K lanes · H hidden · I intermediate;
Hp, Ip are H and I rounded up to 64 (`RowLayout.hp`, `.ip`).

This module is the one Python owner of what the kernel's build depends on: its block shape and
stage ring (mirrors of the kernel's constants, checked by the kernel's static_asserts and by
tests/test_nvcc_compile.py), the shared memory of `carve()`, and the per-call rules that pick a
build (`Build`): units of 8 or 16 lane slots, blocks per SM, warps splitting a w13 strip. A call
is `choose(...)` then `launch(...)`; `cupool.gemm.MoEGemm.decode` does both. Profilers choose a
build themselves (e.g. with `trace=True`, the DECODE_TRACE build that stamps each item's phases
with the GPU's globaltimer into a caller's buffer) and call `launch` with the same workspaces.
"""

from __future__ import annotations

import dataclasses

import torch

from cupool import _cuda, kernels
from cupool.activation import SILU, Activation
from cupool.layout import CHUNK_BYTES, RowLayout
from cupool.ops import ACT_DTYPES, W_DTYPES, check_experts

MAX_LANES = 256          # the kernel groups the call's lanes one a thread of its 256-thread block
WARPS = 8                # moe_decode.cu's WARPS
STAGE = 4                # chunks a stage (moe_decode.cu's STAGE)
NBUF = 2                 # stage buffers a warp (moe_decode.cu's NBUF)
TRACE_ITEMS = 8192       # moe_decode.cu's TRACE_ITEMS: item stamps, then two stamps a block


@dataclasses.dataclass(frozen=True)
class Build:
    """The compile-time choices of one moe_decode build (see `choose`)."""
    nt: int                  # lane slots of a unit: 8 (calls of ≤ 64 lanes) or 16
    maxw: int                # most lanes of a call the build takes: 64 or 256
    minb: int                # blocks per SM its registers must allow (__launch_bounds__)
    w13_split: int           # warps splitting the K of a w13 strip: 4 (one strip pair an item)
                             # or 2 (two pairs an item)
    xalign: int              # 1: x 16-byte aligned (a lane reads its 16 columns as two words)
    w_dtype: int             # router weights' dtype (W_DTYPES)
    trace: bool = False      # the DECODE_TRACE profiling build
    xsmem: int = 0           # 1: a w13 item first stages its unit's x rows in shared memory
    # (XSMEM; a profiler's variant, never chosen: on an H200 at Qwen3-30B-A3B dims the layer
    # alone took 18.5 µs against 19.0 at T=1 and 40.5 against 43.0 at T=4 (profile_gemm
    # --sweep), but the fused decode step at 16 positions took 2.92-2.94 ms against 2.78-2.79
    # (profile_decode, two rounds a tree): inside the step the kernel took 20.6-20.8 µs against
    # 19.8 and the next kernel's early start no longer overlapped it (32 KB more a block))
    route: int = 0           # 1: the launch routes the step itself (ROUTE, `route_fits`)
    blocks: int = 0          # blocks an SM the launch runs: 0 as many as fit (`kernels.
    # resident_grid`, the rules' choice); n > 0 at most n, a profiler's variant for timing a
    # grid apart from the register bound (a build of MINB 3 may still fit 4 blocks an SM)
    w2_split: int = 0        # warps splitting the K of a w2 strip: 0 the kernel's rule
    # (`w2_ksplit`); 1, 2, 4 or 8 set (W2_KSPLIT): `w2_split_for`'s choice at one token's lanes,
    # or any of them forced by a profiler


def stage_ring_bytes() -> int:
    """Shared memory of one warp's stage ring (moe_stages.cuh's WarpStages): NBUF barriers and the
    parity word padded to 16 bytes, then NBUF buffers of STAGE chunks of the row layout."""
    return (8 * NBUF + 4 + 15) // 16 * 16 + NBUF * STAGE * CHUNK_BYTES


BIAS_FLOATS = 128         # moe_decode.cu's BIAS_FLOATS: an item's biases (rows with biases only)
ROUTE_TOKENS = 16         # most tokens a ROUTE build routes (its per-token sums in shared memory)
ROUTE_LOGITS_AT = 8192    # moe_decode.cu's ROUTE_LOGITS_AT: where the table and logits start
ROUTE_MAX_HP = 4096       # widest rows a ROUTE build routes (wider: its 16-lane build spills)


def route_fits(tokens: int, experts: int, hp: int) -> str | None:
    """Why a ROUTE build cannot route `tokens` tokens over `experts` experts for rows of Hp = `hp`
    (None: it can): Hp at most ROUTE_MAX_HP, at most ROUTE_TOKENS tokens, and the table of row
    addresses (int64 [E]) and min(tokens, WARPS) tokens' float32 logits must fit the stage rings
    past ROUTE_LOGITS_AT."""
    if hp > ROUTE_MAX_HP:
        return (f"rows of Hp = {hp} are wider than the {ROUTE_MAX_HP} the routing build takes "
                f"without spilling")
    if not 1 <= tokens <= ROUTE_TOKENS:
        return f"it routes 1 to {ROUTE_TOKENS} tokens, the step has {tokens}"
    need = ROUTE_LOGITS_AT + 8 * experts + 4 * min(tokens, WARPS) * experts
    have = WARPS * stage_ring_bytes()
    if need > have:
        return (f"{experts} experts' row addresses and logits of {min(tokens, WARPS)} tokens "
                f"need {need} bytes of shared memory, the stage rings hold {have}")
    return None


def shared_bytes(build: Build, bias: bool = False, hp: int = 0) -> int:
    """Dynamic shared memory of a block (moe_decode.cu's `carve`): the warps' stage rings, the
    K-split partial sums [WARPS][NT/8 · 4][32] floats, the SlotInfo (NT lanes and scales), then
    the unit table of the call: unit_addr [MAXW] i64, lane_w [MAXW] f32, unit_lanes [MAXW][NT]
    u8, unit_count [MAXW] u8; then, for rows with biases, BIAS_FLOATS f32; then, for an xsmem
    build, at the next 16 bytes, the unit's x rows [NT][Hp + 8] 16-bit (`hp`: Hp)."""
    nt, maxw = build.nt, build.maxw
    base = (WARPS * stage_ring_bytes() + WARPS * (nt // 8) * 4 * 32 * 4 + nt * 8
            + maxw * (8 + 4 + nt + 1) + (4 * BIAS_FLOATS if bias else 0))
    if not build.xsmem:
        return base
    if hp <= 0:
        raise ValueError(f"the shared memory of an xsmem build depends on Hp: pass hp, got {hp}")
    return (base + 15) // 16 * 16 + nt * (hp + 8) * 2


def w2_ksplit(layout: RowLayout) -> int:
    """Warps splitting the K of a w2 strip (moe_decode.cu's KS2): one where a strip's chunks fit
    the stage ring at once (Ip ≤ 512), else 2 up to 32 chunks, then 4, then 8."""
    nc2 = layout.ip // 64
    return 1 if nc2 <= NBUF * STAGE else 2 if nc2 <= 32 else 4 if nc2 <= 64 else 8


def w2_split_for(layout: RowLayout, lanes: int) -> int:
    """Warps splitting the K of a w2 strip that a call of `lanes` lanes sets (`Build.w2_split`;
    0: the kernel's rule, `w2_ksplit`): 4 for a call of one token's 8 lanes or fewer where the
    rule would give 2 warps a strip of at most 16 chunks (Ip 576–1024), so each warp takes 3–4
    chunks, one stage, instead of 5–8.

    In a decode step the w2 phase is the tail of the launch that the next layer's QKV GEMV waits
    for. Qwen3-30B-A3B's dims (Ip 768, 12 chunks), batch 1, `bench_serve.py --streams 1`, on an
    H100, one machine start: every expert resident (the plain launch after the router's), two
    runs each alternated, 368.9 / 368.3 tok/s against 365.1 / 364.4 with 2 warps; at a 50% bank
    (row copies before the launch), one run each, 161.7 against 161.8. An earlier A/B meant for
    the ROUTE build (router and MoE in one launch, `CUPOOL_FUSED_ROUTE=1`, off by default;
    whether its runs set it is not recorded) gave 368.2 / 368.5 against 362.9 / 363.2 on another
    H100 start. The layer alone is slower (`profile_gemm.py --sweep`: 22.7 µs against 20.7 at T=1;
    48.2 against 47.6 at T=4), so launches of more lanes keep the rule; other Ip were not
    measured inside the step and keep it too (docs/PERFORMANCE.md, Experiments)."""
    return 4 if lanes <= 8 and w2_ksplit(layout) == 2 and layout.ip // 64 <= 16 else 0


def w2_items(layout: RowLayout, w2_split: int = 0) -> int:
    """w2 items of one unit (moe_decode.cu's G2): Hp/16 output strips, WARPS / KS2 an item
    (KS2: `w2_split`, or the kernel's rule where 0)."""
    return -(-(layout.hp // 16) // (WARPS // (w2_split or w2_ksplit(layout))))


def act_strips_per_item(layout: RowLayout, w13_split: int) -> int:
    """Act strips (16 columns of act: a (gate, up) strip pair, or one up strip in rows without a
    gate) one w13 item makes when `w13_split` warps split the K of a strip (moe_decode.cu's PPI):
    the block's WARPS warps take WARPS / w13_split strips."""
    if w13_split not in (1, 2, 4):
        raise ValueError(f"w13_split must be 1, 2 or 4, got {w13_split!r}")
    return WARPS // w13_split // (2 if layout.gated else 1)


def w13_items(layout: RowLayout, lanes: int, w13_split: int) -> int:
    """w13 items of a call of `lanes` lanes, one unit a lane (an upper bound: lanes of one expert
    share a unit): Ip/16 act strips a unit, `act_strips_per_item` an item."""
    return lanes * (layout.ip // 16) // act_strips_per_item(layout, w13_split)


def w13_items_fill(layout: RowLayout, sms: int, lanes: int, w13_split: int,
                   blocks_per_sm: int) -> bool:
    """Whether the w13 items of a call of `lanes` lanes at `w13_split` (`w13_items`) fill a grid of
    `blocks_per_sm` blocks on each of `sms` SMs."""
    return w13_items(layout, lanes, w13_split) >= blocks_per_sm * sms


def call_items(layout: RowLayout, lanes: int, w13_split: int, w2_split: int = 0) -> int:
    """Items of a call of `lanes` lanes, one unit a lane (an upper bound): its w13 items at
    `w13_split` and its units' w2 items at `w2_split` (0: the kernel's rule)."""
    return w13_items(layout, lanes, w13_split) + lanes * w2_items(layout, w2_split)


def blocks_per_sm(layout: RowLayout, sms: int, nt: int, lanes: int, w2_split: int = 0) -> int:
    """Blocks per SM a build's registers must allow, for a call of `lanes` lanes whose w2 strips
    are split over `w2_split` warps (`w2_split_for`; 0: the kernel's rule), which `call_items`
    counts.

    4 (at most 64 registers; 32 warps an SM) where the call's w13 items alone, at 4 warps a strip
    (one strip pair an item; two up strips in rows without a gate), fill a grid of 4 blocks per
    SM; else 3 (at most 80 registers). On an H200 (K=8, same
    output bits) 4 measured 6–12% faster where the items fill the grid (H=2048 T=4, H=4096 T=1
    and T=4) and 5% slower at H=2048 T=1 (384 items for 528 blocks). Units of 16 lanes spill at
    64 registers and keep 3 (tests/test_nvcc_compile.py checks both facts).

    Where the w13 items fill the 4-block grid less than twice, the waves of the whole call's items
    (`call_items`) decide: 3 where a 3-block grid's waves leave fewer block slots empty, else 4.
    At gpt-oss's T=1 (4 units: 720 w13 and 360 w2 items, 132 SMs) that is 3 waves of 396 blocks
    against 3 of 528: on an H100 (profile_gemm --sweep, two calls of two rounds) 3 blocks an SM
    took 38.8–39.5 µs a layer against 45.4–48.1 with 4; at H=4096 T=1 (768 and 512 items) both
    leave 304 slots empty and 4 stays (52.2–52.7 against 55.1–55.4 with 3). In the same sweep
    the rule's choice was the faster one, or within 1%, at gpt-oss T=2–4, H=2048 T=1–2 and
    Nemotron-H T=2–3 (rows without a gate: T=3 now takes 3, 55.9–56.3 against 56.7 µs).

    The value is the build's register bound (MINB); the grid is what fits (`kernels.
    resident_grid`). gpt-oss's MINB 3 build takes 66 registers (nvcc 13, sm_90), so 3 blocks an
    SM; Qwen3-30B-A3B's (64) and Nemotron-H's (61) still fit 4, so there the two builds differ in
    their code, not their grid, and the slot count above is the rule's model, not the launch."""
    if nt != 8 or not w13_items_fill(layout, sms, lanes, 4, 4):
        return 3
    if w13_items(layout, lanes, 4) >= 2 * 4 * sms:
        return 4

    def empty_slots(minb: int) -> int:
        grid = minb * sms
        n = call_items(layout, lanes, w13_split(layout, sms, lanes, minb), w2_split)
        return -(-n // grid) * grid - n

    return 3 if empty_slots(3) < empty_slots(4) else 4


def w13_split(layout: RowLayout, sms: int, lanes: int, minb: int) -> int:
    """Warps splitting the K of a w13 strip for a call of `lanes` lanes at `minb` blocks per SM.

    2 (items of twice the strips: twice the chunks a warp, one start and one set of barriers for
    them) where a strip is at most 32 chunks (Hp ≤ 2048) and the call's w13 items at that split
    still fill the grid; else 4 (one strip pair an item, two up strips in rows without a gate). On an H200 (K=8) 2 measured 4–8% faster
    at H=2048 for T = 4, 8, 16, the same at T=3 and slower at T ≤ 2; at H=4096 never faster."""
    fills = w13_items_fill(layout, sms, lanes, 2, minb)
    return 2 if layout.hp <= 2048 and fills else 4


def choose(layout: RowLayout, sms: int, lanes: int, x: torch.Tensor,
           weights: torch.Tensor, route: bool = False) -> Build:
    """The build of a call of `lanes` lanes (≤ MAX_LANES) for activations `x` and router weights
    `weights` (one of W_DTYPES). Depends only on shapes, dtypes and x's alignment, so a captured
    graph keeps its choice. route: the ROUTE build (`route_fits`)."""
    nt, maxw = (8, 64) if lanes <= 64 else (16, MAX_LANES)
    w2 = w2_split_for(layout, lanes)
    minb = blocks_per_sm(layout, sms, nt, lanes, w2)
    return Build(nt=nt, maxw=maxw, minb=minb, w13_split=w13_split(layout, sms, lanes, minb),
                 xalign=int(x.data_ptr() % 16 == 0), w_dtype=W_DTYPES[weights.dtype],
                 route=int(route), w2_split=w2)


def defines(build: Build, layout: RowLayout, dtype: torch.dtype,
            activation: Activation = SILU) -> dict:
    """The -D macros moe_decode.cu is compiled with for a build, layout, activation dtype and
    expert activation (one the layout's experts take: `cupool.ops.check_experts`)."""
    check_experts(layout, activation)
    d = {**layout.defines(), **activation.defines(), "NT": build.nt, "MAXW": build.maxw, "OUT_BF16": ACT_DTYPES[dtype],
         "IN_BF16": ACT_DTYPES[dtype], "W_DTYPE": build.w_dtype, "XALIGN": build.xalign,
         "HFULL": int(layout.hidden == layout.hp), "MINB": build.minb,
         "W13_KSPLIT": build.w13_split}
    if build.w2_split:
        if build.w2_split not in (1, 2, 4, 8) or build.w2_split > layout.ip // 64:
            raise ValueError(f"w2_split must be 1, 2, 4 or 8 and at most the {layout.ip // 64} "
                             f"chunks of a w2 strip, got {build.w2_split}")
        d["W2_KSPLIT"] = build.w2_split
    if build.xsmem:
        d["XSMEM"] = 1
    if build.route:
        d["ROUTE"] = 1
    if build.trace:
        d["DECODE_TRACE"] = 1
    return d


TRACE_BLOCKS = 4096      # moe_decode.cu's TRACE_BLOCKS: where a ROUTE build's block stamps start


def trace_buffer(device, blocks: int = TRACE_BLOCKS) -> torch.Tensor:
    """int64 stamps a DECODE_TRACE build writes: [TRACE_ITEMS][4] per item (start, waits done, K
    loop done, end), then [blocks][2] per block (start, lanes grouped), then [blocks][5] per block
    of a ROUTE build (waited for the kernel before, logits out, every logit seen, the first
    tokens' logits read, routed). Zero it before a call."""
    if not 1 <= blocks <= TRACE_BLOCKS:
        raise ValueError(f"blocks must be in [1, {TRACE_BLOCKS}], got {blocks}")
    return torch.zeros(TRACE_ITEMS * 4 + TRACE_BLOCKS * 2 + blocks * 5, dtype=torch.int64,
                       device=device)


class DecodeKernel:
    """moe_decode for one row layout, activation dtype and device: compiled builds (cached) and
    their persistent grids."""

    def __init__(self, layout: RowLayout, dtype: torch.dtype, device: torch.device,
                 activation: Activation = SILU):
        if dtype not in ACT_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        check_experts(layout, activation)
        self.layout, self.dtype, self.device = layout, dtype, torch.device(device)
        self.activation = activation
        self.sms = _cuda.target(self.device).sms
        self._compiled: dict[Build, tuple] = {}

    def choose(self, lanes: int, x: torch.Tensor, weights: torch.Tensor,
               route: bool = False) -> Build:
        return choose(self.layout, self.sms, lanes, x, weights, route)

    def _compile(self, build: Build) -> tuple:
        got = self._compiled.get(build)
        if got is None:
            fn = kernels.function("moe_decode", "moe_decode",
                                  defines(build, self.layout, self.dtype, self.activation),
                                  self.device)
            smem = shared_bytes(build, self.layout.bias, self.layout.hp)
            grid = kernels.resident_grid(fn, 32 * WARPS, smem, self.device)
            if build.blocks > 0:                  # fewer blocks are still resident at once
                grid = min(grid, build.blocks * self.sms)
            got = self._compiled[build] = (fn, grid, smem)
        return got

    def launch(self, build: Build, x: torch.Tensor, lane_addr: torch.Tensor,
               lane_fresh: torch.Tensor | None, weights: torch.Tensor, topk: int, part: int,
               work: dict, out: torch.Tensor, error: torch.Tensor,
               trace: torch.Tensor | None = None) -> None:
        """One launch on torch's current stream. x [T, H]; lane_addr int64 [W] (0: padding);
        lane_fresh int32 [W] or None; weights [W] contiguous (W_DTYPES); part 0 rows in place, 1
        rows being copied (lane_fresh), 2 all; work: the decode workspaces (`act` [W, Ip] bf16,
        `yw` [W, Hp] f32, `group_done` [Hp/16] i32, `sync` [2 + W] i32, zero at rest); out [T, H];
        error: int32 [1] sticky bits; trace: `trace_buffer()` for a trace build."""
        if build.trace != (trace is not None):
            raise ValueError("a trace build needs a trace buffer (trace_buffer()) and only it")
        if build.route:
            raise ValueError("a ROUTE build is launched by launch_routed")
        fn, grid, smem = self._compile(build)
        T = x.shape[0]
        kernels.launch(fn, grid, 32 * WARPS, (
            x, kernels.i32(T), kernels.i32(self.layout.hidden), lane_addr,
            kernels.NULL if lane_fresh is None else lane_fresh, weights,
            kernels.i32(lane_addr.numel()), kernels.i32(topk), kernels.i32(part), work["act"],
            work["yw"], work["group_done"], work["sync"], out, error,
            kernels.NULL if trace is None else trace), shared_mem=smem, device=self.device)

    def launch_routed(self, build: Build, h: torch.Tensor, router: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, norm_topk: bool,
                      active: torch.Tensor | None, table: torch.Tensor, x: torch.Tensor,
                      logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      lane_addr: torch.Tensor, count: torch.Tensor, work: dict, out: torch.Tensor,
                      error: torch.Tensor, trace: torch.Tensor | None = None) -> None:
        """One launch of a ROUTE build on torch's current stream, as a dependent of the kernel
        that writes h (checked by the caller: `cupool.gemm.MoEGemm.decode_routed`). h [T, H] the
        residual stream; router [E, H] bf16; norm_weight [H]; active uint8/bool [T] or None;
        table int64 [E] each expert's bank row; out: x [T, H] (the normed rows), logits float32
        [T, E], ids int32 [T, K], weights [T, K] (the build's w_dtype), lane_addr int64 [T·K];
        count int32 [1] (zero at rest); work, out, error, trace as `launch`."""
        if not build.route:
            raise ValueError("launch_routed launches a ROUTE build (choose(..., route=True))")
        if build.trace != (trace is not None):
            raise ValueError("a trace build needs a trace buffer (trace_buffer()) and only it")
        fn, grid, smem = self._compile(build)
        T, K = ids.shape
        kernels.launch(fn, grid, 32 * WARPS, (
            x, kernels.i32(T), kernels.i32(self.layout.hidden), kernels.NULL, kernels.NULL,
            kernels.NULL, kernels.i32(T * K), kernels.i32(K), kernels.i32(2), work["act"],
            work["yw"], work["group_done"], work["sync"], out, error,
            kernels.NULL if trace is None else trace,
            h, router, norm_weight, kernels.f32(eps), kernels.i32(router.shape[0]),
            kernels.i32(int(norm_topk)), kernels.NULL if active is None else active, table, x,
            logits, ids, weights, lane_addr, count), shared_mem=smem, device=self.device,
            dependent=True)
