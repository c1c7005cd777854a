"""NVFP4 MoE GEMM: launchers of rawkernels/moe_decode.cu, moe_align.cu + moe_gemm.cu, and the
float reference.

Shape legend: T tokens · K top-k · W = T·K lanes · H hidden · I intermediate · E experts.

Two paths, both with fixed grids and sizes read on the device:
- `decode(x, lane_addr, topk_weights)`: lanes come with the address of their expert's row (what
  the plan step writes: bank row, staging row, or a host UVA address; 0 = padding). Memory-bound;
  a deterministic sum over top-k. Graph-capturable. One launch (moe_decode, compute capability
  9.0+) up to 256 lanes; otherwise route_decode, then w13 and w2 launches.
- `prefill(x, topk_ids, topk_weights, expert_addr, ...)`: the partition path. Experts whose row is
  on the GPU (expert_addr[e] ≠ 0) are computed from there; the others are copied once per call
  into a bounded scratch of `scratch_rows` rows, chunk by chunk, and computed from the scratch;
  the copies run on a second stream, ahead of the GEMM (two chunk buffers).

Both return out [T, H] in x's dtype (bf16 or fp16) on torch's current stream.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from cupool import _cuda, kernels
from cupool.layout import CHUNK_BYTES, RowLayout

ERR_BAD_ID = 1
ERR_BAD_WEIGHT = 2
ERR_CHUNKS = 4
ERR_STALL = 8
ERROR_NAMES = {ERR_BAD_ID: "expert id outside [0, E)", ERR_BAD_WEIGHT: "non-finite router weight",
               ERR_CHUNKS: "more host experts than scratch chunks (internal)",
               ERR_STALL: "moe_decode waited over a second for a unit's w13 items (internal)"}

_DTYPES = {torch.bfloat16: 1, torch.float16: 0}
_W_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # route_decode's W_DTYPE


def check_activations(x: torch.Tensor, hidden: int, name: str = "hidden_states") -> None:
    """x must be a contiguous CUDA bf16/fp16 tensor [T, H]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
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


@dataclasses.dataclass(frozen=True)
class _Config:
    nt: int          # lane slots per unit
    ksplit: int      # warps splitting K of a strip
    warps_m: int     # warps on different strips of a unit
    kc: int          # activation columns staged at a time
    nb: int          # 64-column chunks in flight per warp
    reduce: int      # 0: deterministic last-block top-k sum, 1: fp32 atomics
    prefetch_w2: int
    minb: int = 1    # blocks per SM the kernels' register use must allow
    kc2: int = 0     # w2's staged columns; 0: all of I where that fits W2_WHOLE_BYTES, else kc
    w2_ns: int = 1   # output strips of w2 per warp (1 or 2)
    ntg: int = 4     # n-tiles whose B fragments a warp holds at once (ntg·strips other mma
                     # between an accumulator's two updates); 4 measured fastest for PREFILL


# Largest staging of all of w2's K for one block: w2 then stages a unit's act rows once for all
# its items (two such blocks still share an SM: 2 x 100 KiB of an H100/H200 SM's 228 KiB).
W2_WHOLE_BYTES = 100 * 1024


# The pair's decode (route_decode, moe_w13, moe_w2; "pair" or over 256 lanes): one token per
# unit is typical, so K is split over 8 warps, the whole K range staged at once (one barrier pair
# per item) and registers capped for 3 blocks per SM, so that every item of a Qwen3-30B-A3B layer
# (8 units x 48 strip pairs) has a block from the start; w13 pulls w2's rows into L2 for moe_w2.
# Chosen by a sweep of these configs in an earlier session (H200: 29.9 us/layer against 31.7 for
# KSPLIT 4 / NB 8 / KC 1024); `profile_gemm.py --sweep` now sweeps moe_decode.
DECODE_SMALL = _Config(nt=8, ksplit=8, warps_m=1, kc=2048, nb=2, reduce=0, prefetch_w2=1, minb=3)
DECODE_WIDE = _Config(nt=16, ksplit=4, warps_m=1, kc=1024, nb=8, reduce=0, prefetch_w2=1)
# Prefill: 64 lanes a unit share each dequantized fragment over 8 mma n-tiles. One chunk in
# flight a warp keeps moe_w13 at 127 registers, so 2 blocks (16 warps) share an SM: measured on
# the H200 (`profile_gemm.py --prefill-sweep`) 10-14% faster than 4 chunks at 1 block per SM
# (T=2048 resident 1.60-1.66 ms against 1.86-1.91 in the same calls). Two output strips a w2
# warp (moe_w2 then at 128 registers, like w13 two strips a warp): T=2048 1.091 ms median
# against 1.173 for one strip (six rounds in one call). With the chunk layout's 16-byte B loads a
# warp holds the B fragments of 4 n-tiles at once (ntg): T=2048 1.069-1.084 ms against
# 1.074-1.184 for 2 and 1.102-1.178 for 1 (one call). test_kernels_compile checks that this
# config compiles without spills and that its staging fits two blocks an SM.
PREFILL = _Config(nt=64, ksplit=1, warps_m=8, kc=256, nb=1, reduce=1, prefetch_w2=0, minb=2,
                  w2_ns=2)


def w2_cols(cfg: _Config, layout: RowLayout) -> int:
    """Columns of act that moe_w2 stages at a time (W2_KC)."""
    if cfg.kc2:
        return min(cfg.kc2, layout.ip)
    return layout.ip if cfg.nt * (layout.ip + 8) * 2 <= W2_WHOLE_BYTES else min(cfg.kc, layout.ip)


def config_defines(cfg: _Config, layout: RowLayout, dtype=torch.bfloat16) -> dict:
    """The -D macros moe_gemm.cu is compiled with for a config, layout and output dtype."""
    return {**layout.defines(), "NT": cfg.nt, "KSPLIT": cfg.ksplit, "WARPS_M": cfg.warps_m,
            "KC": min(cfg.kc, layout.hp), "W2_KC": w2_cols(cfg, layout), "NB": cfg.nb,
            "OUT_BF16": _DTYPES[dtype], "REDUCE": cfg.reduce, "PREFETCH_W2": cfg.prefetch_w2,
            "MINB": cfg.minb, "W2_NS": cfg.w2_ns, "NTG": cfg.ntg}


def gemm_smem(cfg: _Config, layout: RowLayout, kernel: str) -> int:
    """Dynamic shared memory of moe_w13 or moe_w2 (moe_gemm.cu's Staging, red_buffer and
    slot_info): the staging buffers (two where K takes more than one stage), the K-split
    partials, the per-slot data."""
    kp, cols, ns = ((layout.hp, min(cfg.kc, layout.hp), 2) if kernel == "moe_w13"
                    else (layout.ip, w2_cols(cfg, layout), cfg.w2_ns))
    nbuf = 2 if kp > cols else 1
    red = (cfg.ksplit - 1) * cfg.warps_m * ns * (cfg.nt // 8) * 4 * 32 * 4
    return nbuf * cfg.nt * (cols + 8) * 2 + red + cfg.nt * 8


# The one-launch decode kernel (moe_decode.cu): its block shape is fixed in the source, and the
# shared memory it needs is worked out from the same numbers in MoEGemm._fused.
DECODE_KERNELS = ("auto", "fused", "pair")
_FUSED_MAX_LANES = 256                             # moe_decode groups one lane per thread
_FUSED_WARPS = 8


def _fused_stage_bytes(stage: int = 4, nbuf: int = 2) -> int:
    """Shared memory of one moe_decode warp's stage ring (WarpStages): nbuf barriers and the
    parity word padded to 16 bytes, then nbuf buffers of `stage` chunks of the row layout."""
    return (8 * nbuf + 4 + 15) // 16 * 16 + nbuf * stage * CHUNK_BYTES


def _w13_items_fill(layout: RowLayout, sms: int, lanes: int, pairs_per_item: int,
                    blocks_per_sm: int) -> bool:
    """Whether moe_decode's w13 items for a call of `lanes` lanes (lanes · Ip/16 strip pairs, an
    upper bound: lanes of one expert share a unit) fill a grid of `blocks_per_sm` blocks on each
    of `sms` SMs."""
    return lanes * (layout.ip // 16) // pairs_per_item >= blocks_per_sm * sms


def resolve_decode_kernel(kind: str, capability: tuple[int, int]) -> str:
    """The decode kernel for `kind` on a GPU of `capability`: "auto" is "fused" on compute
    capability 9.0 and newer (moe_decode uses Hopper bulk copies and bf16x2 multiplies), else
    "pair"; "fused" on an older GPU is an error."""
    if kind not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {kind!r}")
    hopper = tuple(capability) >= (9, 0)
    if kind == "auto":
        return "fused" if hopper else "pair"
    if kind == "fused" and not hopper:
        raise ValueError(f"decode_kernel='fused' needs compute capability 9.0 or newer, the GPU "
                         f"has {capability[0]}.{capability[1]}; use 'pair' or 'auto'")
    return kind


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
            to the model's dtype), SiLU·up, w2 and the top-k sum (moe_decode.cu; compute
            capability 9.0+), for calls of up to 256 lanes (T·K); wider calls, and "pair", use
            route_decode, then a w13 and a w2 launch (moe_align.cu, moe_gemm.cu). "auto"
            (default): "fused" where the GPU has it, else "pair"; `decode_kernel` holds the
            choice. Both are deterministic and hand SiLU·up from w13 to w2 in bf16, but they are
            not bit-identical (the pair multiplies x as fp16 scaled per token, moe_decode as it is,
            and their sums run in different orders).
    """

    def __init__(self, layout: RowLayout, topk: int, dtype=torch.bfloat16, *,
                 max_decode_tokens: int = 16, max_prefill_tokens: int = 0, num_experts: int = 0,
                 scratch_rows: int = 32, scratch_buffers: int = 2, decode_kernel: str = "auto",
                 device=None):
        _cuda.require_gpu("the MoE GEMM")
        if dtype not in _DTYPES:
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
        if max_prefill_tokens and not 0 < num_experts <= 1024:
            raise ValueError(f"prefill needs num_experts in [1, 1024], got {num_experts}")
        self.layout, self.topk, self.dtype = layout, int(topk), dtype
        self.device = torch.device("cuda", _cuda.device_index(device))
        dev = self.device
        self.decode_kernel = resolve_decode_kernel(decode_kernel,
                                                   torch.cuda.get_device_capability(dev))
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        hp, ip = layout.hp, layout.ip
        i32 = dict(dtype=torch.int32, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        self.max_decode_tokens = int(max_decode_tokens)
        wd = self.max_decode_tokens * self.topk
        # decode workspaces (units <= lanes)
        self._d = dict(
            xh=torch.zeros(self.max_decode_tokens, hp, dtype=torch.float16, device=dev),
            xscale=torch.zeros(self.max_decode_tokens, **f32),
            range=torch.zeros(5, **i32),          # moe_align.cu: in place, fresh, all
            unit_addr=torch.zeros(wd, dtype=torch.int64, device=dev),
            unit_lanes=torch.zeros(wd * DECODE_WIDE.nt, **i32),
            unit_count=torch.zeros(wd, **i32),
            lane_w=torch.zeros(wd, **f32),
            act=torch.zeros(wd, ip, dtype=torch.bfloat16, device=dev),   # SiLU·up rows
            yw=torch.zeros(wd, hp, **f32),
            group_done=torch.zeros(hp // 16, **i32),
            sync=torch.zeros(2 + wd, **i32),      # moe_decode: ticket, finished, per unit
        )
        self.error = torch.zeros(1, **i32)
        self.num_experts = int(num_experts)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.scratch_rows = int(scratch_rows)
        # chunk buffers (as many as asked for, at most one a row) and experts a chunk (C)
        self._nbuf = min(int(scratch_buffers), self.scratch_rows)
        self._chunk = self.scratch_rows // self._nbuf
        self._p = None
        if max_prefill_tokens:
            wp = self.max_prefill_tokens * self.topk
            max_units = wp // PREFILL.nt + self.num_experts
            nchunks = -(-self.num_experts // self._chunk)
            stride = -(-layout.row_bytes // 256) * 256
            self._p = dict(
                xh=torch.zeros(self.max_prefill_tokens, hp, dtype=torch.float16, device=dev),
                xscale=torch.zeros(self.max_prefill_tokens, **f32),
                phase_off=torch.zeros(nchunks + 2, **i32),
                unit_addr=torch.zeros(max_units, dtype=torch.int64, device=dev),
                unit_lanes=torch.zeros(max_units * PREFILL.nt, **i32),
                unit_count=torch.zeros(max_units, **i32),
                lane_w=torch.zeros(wp, **f32),
                lane_e=torch.zeros(wp, **i32),
                act=torch.zeros(wp, ip, dtype=torch.bfloat16, device=dev),
                out32=torch.zeros(self.max_prefill_tokens, hp, **f32),
                copies=torch.zeros(nchunks * self._chunk, 2, **i32),
                n_copies=torch.zeros(nchunks, **i32),
                scratch=torch.zeros(self.scratch_rows, stride, dtype=torch.uint8, device=dev),
                nchunks=nchunks,
            )
            # per chunk c: its GEMM's unit range, its copy list and count (views made once: a
            # call walks every chunk, and a view costs microseconds of host time)
            p = self._p
            p["chunk_views"] = [(p["phase_off"][c + 1:c + 3],
                                 p["copies"][c * self._chunk:(c + 1) * self._chunk],
                                 p["n_copies"][c:c + 1]) for c in range(nchunks)]
        self._copier = None
        self._copy_stream = None          # prefill's scratch copies (made on first use)
        self._events: list = []           # per chunk: (copied, free), made on first use
        self._grids: dict[tuple, int] = {}
        self._pairs: dict = {}            # per config: resolved kernels, grids, shared memory
        self._fused_extra: dict = {}      # extra moe_decode defines (benchmark sweeps only)
        self._trace = None                # moe_decode's DECODE_TRACE stamps (profile_gemm only)

    # --- compiled kernels -----------------------------------------------------------------
    def _defines(self, cfg: _Config) -> dict:
        return config_defines(cfg, self.layout, self.dtype)

    def _gemm(self, cfg: _Config, name: str):
        return kernels.function("moe_gemm", name, self._defines(cfg), self.device)

    def _align(self, cfg: _Config, name: str, x: torch.Tensor, ids64: int = 1, w_dtype: int = 0):
        # 16-byte loads of x where its rows allow them (H % 8 == 0, 16-byte aligned base)
        xvec = int(self.layout.hidden % 8 == 0 and x.data_ptr() % 16 == 0)
        d = {"NT": cfg.nt, "HP": self.layout.hp, "IN_BF16": _DTYPES[self.dtype], "IDS64": ids64,
             "XVEC": xvec, "W_DTYPE": w_dtype}
        return kernels.function("moe_align", name, d, self.device)

    def _grid(self, fn, threads: int, smem: int) -> int:
        """Persistent grid: as many blocks as fit on the GPU at once (registers, shared memory,
        threads), so every block starts at once and loops over the items."""
        key = (id(fn), threads, smem)
        if key in self._grids:
            return self._grids[key]
        props = torch.cuda.get_device_properties(self.device)
        regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
        regs = -(-max(fn.num_regs, 1) // 8) * 8
        by_regs = regs_sm // (regs * threads)
        by_smem = smem_sm // (smem + fn.shared_size_bytes + 1024)
        per_sm = max(1, min(by_regs, by_smem, threads_sm // threads, 32))
        self._grids[key] = self.sms * per_sm
        return self._grids[key]

    def _gemm_pair(self, cfg: _Config) -> tuple:
        """(threads, w13, grid, smem, w2, grid, smem) of a config, resolved once: prefill launches
        a pair per scratch chunk, and the host's time per launch bounds how fast small chunks go."""
        got = self._pairs.get(cfg)
        if got is None:
            threads = 32 * cfg.ksplit * cfg.warps_m
            w13, w2 = self._gemm(cfg, "moe_w13"), self._gemm(cfg, "moe_w2")
            s13 = gemm_smem(cfg, self.layout, "moe_w13")
            s2 = gemm_smem(cfg, self.layout, "moe_w2")
            got = self._pairs[cfg] = (threads, w13, self._grid(w13, threads, s13), s13,
                                      w2, self._grid(w2, threads, s2), s2)
        return got

    def _run_gemm(self, cfg, rng, unit_addr, unit_lanes, unit_count, xh, xscale, act,
                  lane_w, tokens, out, yw=None, group_done=None, out32=None, all_rng=None):
        threads, w13, g13, s13, w2, g2, s2 = self._gemm_pair(cfg)
        kernels.launch(w13, g13, threads, (
            rng, unit_addr, unit_lanes, unit_count, xh, xscale, kernels.i32(self.topk), act),
            shared_mem=s13, device=self.device)
        dummy = self.error
        kernels.launch(w2, g2, threads, (
            rng, rng if all_rng is None else all_rng, unit_addr, unit_lanes, unit_count, act,
            lane_w, kernels.i32(self.topk), kernels.i32(tokens), kernels.i32(self.layout.hidden),
            yw if yw is not None else dummy, group_done if group_done is not None else dummy,
            out if out is not None else dummy, out32 if out32 is not None else dummy),
            shared_mem=s2, device=self.device)

    def _fused_minb(self, nt: int, lanes: int) -> int:
        """Blocks per SM moe_decode's register use must allow for a call of `lanes` lanes.

        4 (at most 64 registers; 32 warps an SM) where the call's w13 items alone, one strip pair an
        item, fill a grid of 4 blocks per SM; else 3 (at most 80 registers). Measured on the H200
        (session 10, same outputs bit for bit): 4 is 10%, 6% and 12% faster at H=2048 T=4 (1,536
        items), H=4096 T=1 (768) and T=4 (3,072), K=8, and 5% slower at H=2048 T=1 (384 items, fewer
        than the 528 blocks).
        Units of 16 lanes (calls of more than 64 lanes) spill at 64 registers and keep 3.
        """
        if "MINB" in self._fused_extra:
            return self._fused_extra["MINB"]
        return 4 if nt == 8 and _w13_items_fill(self.layout, self.sms, lanes, 1, 4) else 3

    def _fused_w13_split(self, lanes: int, minb: int) -> int:
        """Warps splitting the K of a w13 strip in moe_decode (W13_KSPLIT) for a call of `lanes`
        lanes at `minb` blocks per SM.

        2 (items of two strip pairs: twice the chunks a warp, one start and one set of barriers for
        both) where a strip is at most 32 chunks (Hp ≤ 2048) and the call's w13 items at two pairs
        an item still fill the grid; else 4 (one pair an item). Measured on the H200 (session 11,
        K=8): at H=2048, 2 is 4–8% faster at T=4, 8 and 16, the same at T=3, slower at T=2 (384
        items for 528 blocks) and T=1; at H=4096, 2 is no faster at T=4 and slower at T=1 beside
        w2's split of 2 (50.5 against 47.5 µs).
        """
        if "W13_KSPLIT" in self._fused_extra:
            return self._fused_extra["W13_KSPLIT"]
        fills = _w13_items_fill(self.layout, self.sms, lanes, 2, minb)
        return 2 if self.layout.hp <= 2048 and fills else 4

    def _fused(self, nt: int, maxw: int, x: torch.Tensor, w_dtype: int, minb: int,
               w13_split: int) -> tuple:
        """(kernel, grid, shared memory) of moe_decode for units of nt lanes, calls of ≤ maxw
        lanes, x's dtype and alignment, the router weights' dtype, `minb` blocks per SM and
        `w13_split` warps a w13 strip."""
        xalign = int(x.data_ptr() % 16 == 0)       # a lane reads 16 columns as two 16-byte words
        key = ("fused", nt, maxw, xalign, w_dtype, minb, w13_split)
        got = self._pairs.get(key)
        if got is None:
            ring = _fused_stage_bytes(self._fused_extra.get("STAGE", 4),
                                      self._fused_extra.get("NBUF", 2))
            smem = (_FUSED_WARPS * ring + _FUSED_WARPS * (nt // 8) * 4 * 32 * 4
                    + nt * 8 + maxw * (8 + 4 + nt + 1))      # moe_decode.cu's carve
            d = {**self.layout.defines(), "NT": nt, "MAXW": maxw, "OUT_BF16": _DTYPES[self.dtype],
                 "IN_BF16": _DTYPES[self.dtype], "W_DTYPE": w_dtype, "XALIGN": xalign,
                 "HFULL": int(self.layout.hidden == self.layout.hp), "MINB": minb,
                 "W13_KSPLIT": w13_split, **self._fused_extra}
            fn = kernels.function("moe_decode", "moe_decode", d, self.device)
            got = self._pairs[key] = (fn, self._grid(fn, 32 * _FUSED_WARPS, smem), smem)
        return got

    def _run_fused(self, x, lane_addr, lane_fresh, w, part, out):
        T, K = x.shape[0], self.topk
        W = T * K
        nt, maxw = (8, 64) if W <= 64 else (16, 256)
        minb = self._fused_minb(nt, W)
        fn, grid, smem = self._fused(nt, maxw, x, _W_DTYPES[w.dtype], minb,
                                     self._fused_w13_split(W, minb))
        d = self._d
        kernels.launch(fn, grid, 32 * _FUSED_WARPS, (
            x, kernels.i32(T), kernels.i32(self.layout.hidden), lane_addr,
            kernels.NULL if lane_fresh is None else lane_fresh, w, kernels.i32(W), kernels.i32(K),
            kernels.i32(part), d["act"], d["yw"], d["group_done"],
            d["sync"], out, self.error,
            kernels.NULL if self._trace is None else self._trace), shared_mem=smem, device=self.device)

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
        if w.dtype not in _W_DTYPES or not w.is_contiguous():
            w = w.to(torch.float32).contiguous()
        lane_addr = lane_addr.reshape(-1)
        if self.decode_kernel == "fused" and T * K <= _FUSED_MAX_LANES:
            if lane_fresh is None:
                self._run_fused(x, lane_addr, None, w, 2, out)
            else:
                self._run_fused(x, lane_addr, lane_fresh, w, 0, out)      # rows in place
                if before_fresh is not None:
                    before_fresh()
                self._run_fused(x, lane_addr, lane_fresh, w, 1, out)      # rows copied in
            return out
        cfg = DECODE_SMALL if T * K <= 64 else DECODE_WIDE
        d = self._d
        # one thread a lane and at least one warp a token (up to 32): a small block starts and
        # synchronises faster than the 1024 threads the kernel allows
        threads = min(1024, max(64, 32 * -(-(T * K) // 32), 32 * min(T, 32)))
        kernels.launch(self._align(cfg, "route_decode", x, w_dtype=_W_DTYPES[w.dtype]), 1,
                       threads, (
            x, kernels.i32(T), kernels.i32(self.layout.hidden), d["xh"], d["xscale"],
            lane_addr, kernels.NULL if lane_fresh is None else lane_fresh, w,
            kernels.i32(T * K), d["range"], d["unit_addr"],
            d["unit_lanes"], d["unit_count"], d["lane_w"], self.error), device=self.device)
        r = d["range"]
        args = (d["unit_addr"], d["unit_lanes"], d["unit_count"], d["xh"], d["xscale"], d["act"],
                d["lane_w"], T, out)
        kw = dict(yw=d["yw"], group_done=d["group_done"], all_rng=r[3:5])
        self._run_gemm(cfg, r[0:2], *args, **kw)               # rows in place (all, if no split)
        if lane_fresh is not None:
            if before_fresh is not None:
                before_fresh()
            self._run_gemm(cfg, r[1:3], *args, **kw)           # rows the copies bring in
        return out

    # --- prefill --------------------------------------------------------------------------
    def prefill(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                expert_addr: torch.Tensor, *, host_addr: torch.Tensor | None = None,
                layer: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """The partition path. expert_addr: int64 [E], the GPU address of each resident expert's
        row, 0 for the others, which are read from `host_addr[layer·E + e]` (the store's UVA
        address table) into the scratch in chunks of scratch_rows // scratch_buffers, on a second
        stream: the first chunks' copies overlap the resident experts' GEMM, and chunk c + B's
        copy (B buffers) overlaps the GEMMs of chunks c + 1 ... (it waits for chunk c's GEMM,
        which read the same buffer)."""
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
        E = self.num_experts
        if expert_addr.dtype != torch.int64 or expert_addr.numel() != E or expert_addr.device != x.device:
            raise ValueError(f"expert_addr must be int64 [{E}] on {x.device}, got "
                             f"{expert_addr.dtype} {list(expert_addr.shape)} on {expert_addr.device}")
        out = self._out(x, out)
        p, cfg = self._p, PREFILL
        ids = topk_ids.reshape(-1)
        w = topk_weights.reshape(-1)
        if w.dtype not in _W_DTYPES or not w.is_contiguous():
            w = w.to(torch.float32).contiguous()
        nchunks = p["nchunks"] if host_addr is not None else 0
        kernels.launch(self._align(cfg, "prep_x", x), -(-T // 8), 256,
                       (x, kernels.i32(T), kernels.i32(self.layout.hidden), p["xh"], p["xscale"]),
                       device=self.device)
        kernels.launch(self._align(cfg, "align_experts", x, int(ids.dtype == torch.int64),
                                   _W_DTYPES[w.dtype]), 1, 1024, (
            ids, w, kernels.i32(T * K), kernels.i32(E), kernels.i32(layer), expert_addr,
            kernels.i64(p["scratch"].data_ptr()), kernels.i64(p["scratch"].stride(0)),
            kernels.i32(self._chunk), kernels.i32(self._nbuf), kernels.i32(nchunks),
            p["phase_off"], p["unit_addr"],
            p["unit_lanes"], p["unit_count"], p["lane_w"], p["lane_e"], p["copies"],
            p["n_copies"], self.error), device=self.device)
        out32 = p["out32"][:T]
        out32.zero_()
        args = (p["unit_addr"], p["unit_lanes"], p["unit_count"], p["xh"], p["xscale"], p["act"],
                p["lane_w"], T, None)
        if not nchunks:
            self._run_gemm(cfg, p["phase_off"][0:2], *args, out32=out32)
        else:
            copier, nbuf, views = self._scratch_copier(host_addr), self._nbuf, p["chunk_views"]
            main = torch.cuda.current_stream(self.device)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
                self._events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(nchunks)]
            side = self._copy_stream
            side.wait_stream(main)                   # the copy lists from align_experts

            def copy(c):                             # chunk c into buffer c % nbuf, on `side`
                copier(views[c][1], views[c][2], stream=side)
                self._events[c][0].record(side)

            for c in range(min(nbuf, nchunks)):
                copy(c)
            self._run_gemm(cfg, p["phase_off"][0:2], *args, out32=out32)   # resident experts
            for c in range(nchunks):
                main.wait_event(self._events[c][0])
                self._run_gemm(cfg, views[c][0], *args, out32=out32)
                if c + nbuf < nchunks:               # buffer c % nbuf is free after this GEMM
                    self._events[c][1].record(main)
                    side.wait_event(self._events[c][1])
                    copy(c + nbuf)
            main.wait_stream(side)
        kernels.launch(self._gemm(cfg, "moe_finish"), self.sms * 4, 256, (
            out32, kernels.i32(T), kernels.i32(self.layout.hidden), out), device=self.device)
        return out

    def _scratch_copier(self, host_addr: torch.Tensor):
        from cupool.rowcopy import RowCopier  # noqa: PLC0415
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


# --- reference ----------------------------------------------------------------------------------
def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts, dtype=torch.float32) -> torch.Tensor:
    """Dequantize-then-matmul reference in `dtype` (float32 or float64) on x's device.

    experts: callable e -> (w_gate [I, H], w_up [I, H], w_down [H, I]) float tensors (already
    dequantized), or a sequence of such triples. Lanes with id -1 contribute nothing.
    Returns [T, H] in `dtype`.
    """
    get = experts if callable(experts) else (lambda e: experts[e])
    xf = x.to(dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=dtype, device=x.device)
    ids = topk_ids.to(torch.int64)
    w = topk_weights.to(dtype)
    for e in sorted(set(ids.reshape(-1).tolist()) - {-1}):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        wg, wu, wd = (m.to(dtype=dtype, device=x.device) for m in get(e))
        h = xf[tok]
        a = F.silu(h @ wg.T) * (h @ wu.T)
        out.index_add_(0, tok, (a @ wd.T) * w[tok, kk][:, None])
    return out
