"""Launcher of `rawkernels/dense_gemv.cu`: the decode step's GEMVs (bf16 weights, or NVFP4 ones
kept packed: `cupool.dense_nvfp4.DenseNVFP4`) with their prologue (plain; residual sum +
RMSNorm, transformers' or the (1 + w) one: `DenseGemv`'s one_plus; or a SiLU gated MLP's
act(gate) · up: `DenseGemv`'s glu) and epilogue (plain; + residual, with a shared expert's
sigmoid gate or without; or softmax top-k routing).

Shape legend (ARCHITECTURE.md): B tokens of the step · K inner dim · N output rows (Σ n_i of up
to three matrices) · E experts (N of a router) · k top-k.

A `DenseGemv` is built once per weight set (validated then) and called with the step's
activations (validated at every call, which happens at graph capture; replays skip Python).
The reference is `cupool.reference.dense` (`gemv`, `residual_norm`, `route`).

The launch is a dependent one (`cupool.kernels.launch`): the kernel loads its weights before it
waits for the kernel before it, so the weights may not be that kernel's output.

Launch shape (`warps`, `split_k`; the defaults, 8 warps and no split, are the plain build; the
fused step's come from `cupool.fused.DEFAULT_DENSE_SHAPE`):
warps=4 gives blocks of 4 warps, of which twice as many fit an SM at the same registers a thread
(a grid of a few hundred blocks then runs in one wave). split_k=S splits each row tile's K over S
blocks (slices of whole chunks: 32 columns of bf16 weights, 64 of NVFP4 ones), which adds blocks
where there are fewer row tiles than SMs; the partial sums go to a float32 workspace [S, B, N]
and a ticket a row tile (both held by the DenseGemv, so two launches of one DenseGemv must not run
at once), and the tile's last block adds them in a fixed order: the result is deterministic, but
its float sums run in another order than split_k=1's, so it may differ from that by rounding.

NVFP4 weights are dequantised before the kernel's wait where every chunk of a warp's K slice
fits one register buffer and the grid stays resident at once with the registers that takes
(`predequant_chunks`, `DenseGemv.pre`): after the wait a chunk then costs only its MMAs.

Lane addresses (`lane_addr=True`, ROUTE only): the router also builds the kernel's LANE_ADDR
build, which, called with `table=` (int64 [E], the device address of each expert's bank row) and
`lane_addr=` (int64 [B·k]), writes lane_addr[b·k + j] = table[ids[b, j]] (0 for an inactive
token's padding lanes) beside ids and weights: the decode GEMM's lane addresses, for a bank that
holds every expert at a fixed row (`cupool.fused`, CUPOOL_SKIP_PLAN). Called without them it
launches the build without lane addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cupool import kernels
from cupool.dense_nvfp4 import DenseNVFP4
from cupool.layout import CHUNK_COLS, dense_strips_shape

WARPS = 8                      # the kernel's block: 8 warps (4 with warps=4)
WARPS_CHOICES = (4, 8)
MAX_SPLIT_K = 16
SIGMOID_EXPERTS = 512          # most experts the SIG route epilogue takes (16 a lane, registers)
NO_NORM, NORM, GLU = 0, 1, 2     # MODE
PLAIN, RESIDUAL, ROUTE = 0, 1, 2   # EPI
# x tile columns in shared memory (KT of the kernel) by n tiles of 8 tokens; the route epilogue
# reuses that memory for up to `warps` tokens' logits
_TILE_ELEMS = 2048


def _tiles(tokens: int) -> int:
    return (tokens + 7) // 8


def route_capacity(tokens: int, warps: int = WARPS) -> int:
    """Largest E the route epilogue takes for `tokens` tokens in blocks of `warps` warps (one warp
    routes one token: the x tile's shared memory holds min(tokens, warps) tokens' float logits)."""
    nt = _tiles(tokens)
    smem = 2 * nt * 8 * (_TILE_ELEMS // nt + 32)
    return smem // (4 * min(tokens, warps))


def chunk_cols(nvfp4: bool) -> int:
    """Columns of K a warp's chunk covers (a K slice is whole chunks): 32 of bf16 weights, 64
    of NVFP4 ones (`cupool.layout`'s chunk)."""
    return CHUNK_COLS if nvfp4 else 32


def check_launch_shape(warps, split_k, K: int | None, chunk: int = 32) -> None:
    """ValueError naming the argument unless warps is 4 or 8 and split_k an int in [1, 16] with
    at least one chunk of K a slice where split_k > 1 (K >= chunk · split_k, chunk 32 columns for
    bf16 weights and 64 for NVFP4 ones; K None: not checked)."""
    if isinstance(warps, bool) or not isinstance(warps, int) or warps not in WARPS_CHOICES:
        raise ValueError(f"warps must be 4 or 8, got {warps!r}")
    if isinstance(split_k, bool) or not isinstance(split_k, int) \
            or not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k must be an int in [1, {MAX_SPLIT_K}], got {split_k!r}")
    if K is not None and split_k > 1 and K < chunk * split_k:
        raise ValueError(f"split_k={split_k} leaves less than {chunk} columns of K={K} a block "
                         f"(at most {max(K // chunk, 1)} here)")


def predequant_chunks(K: int, warps: int, split_k: int, tokens: int, row_tiles: int) -> int:
    """The NVFP4 build's PRE: how many chunks a warp dequantises before the kernel's wait (the
    kernel's header), 0 for none. Where a block's K slice is one x tile and each warp has at most
    8 chunks of it (64 columns a chunk), that count rounded up to a power of two, so one
    register buffer holds all of them; 0 where the slice spans x tiles, or where the fragments
    (16 registers a chunk, a row tile and an n tile of 8 tokens) would pass 8 chunks' worth, 128
    registers, and spill. DenseGemv takes it only where the grid then stays resident at once."""
    chunks = -(-K // CHUNK_COLS)
    per_slice = -(-chunks // split_k)               # the widest slice, in chunks
    if per_slice * CHUNK_COLS > _TILE_ELEMS // _tiles(tokens):
        return 0
    per_warp = -(-per_slice // warps)
    pre = 1 << (per_warp - 1).bit_length()
    return pre if pre * row_tiles * _tiles(tokens) <= 8 else 0


@dataclass
class RouteOut:
    """Buffers of the route epilogue: logits float32 [B, E], ids int32 [B, k], weights [B, k]
    (bf16 or float32), ticket int32 [1] (zero at rest; the kernel puts it back)."""
    logits: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    ticket: torch.Tensor

    @classmethod
    def allocate(cls, tokens: int, experts: int, top_k: int, weight_dtype: torch.dtype,
                 device) -> RouteOut:
        return cls(torch.empty(tokens, experts, dtype=torch.float32, device=device),
                   torch.empty(tokens, top_k, dtype=torch.int32, device=device),
                   torch.empty(tokens, top_k, dtype=weight_dtype, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))


def _check_matrix(name: str, t, K: int | None, device, rows: int | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.dim() != 2 or (K is not None and t.shape[1] != K) or (rows is not None and t.shape[0] != rows):
        want = f"[{'n' if rows is None else rows}, {K if K is not None else 'K'}]"
        raise ValueError(f"{name} must be {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (stride {t.stride()})")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (address {t.data_ptr():#x})")


def _check_nvfp4(name: str, w, K: int, device, last: bool) -> None:
    """A DenseNVFP4 a GEMV can take: strips uint8 [ceil(n/16), 9·Kp] contiguous, 16-byte aligned
    on `device`, inner dim K, n a multiple of 16 unless it is the last matrix (a row tile lies
    in one matrix), a positive finite global scale."""
    if not isinstance(w, DenseNVFP4):
        raise TypeError(f"{name} must be a DenseNVFP4 like the other weights, got "
                        f"{type(w).__name__}")
    if w.cols != K:
        raise ValueError(f"{name} has inner dim {w.cols}, weights[0] {K}")
    want = dense_strips_shape(w.rows, K)
    st = w.strips
    if not isinstance(st, torch.Tensor) or st.dtype != torch.uint8 or tuple(st.shape) != want \
            or st.device != device or not st.is_contiguous() or st.data_ptr() % 16:
        got = (f"{st.dtype} {list(st.shape)} on {st.device}" if isinstance(st, torch.Tensor)
               else type(st).__name__)
        raise ValueError(f"{name}.strips must be contiguous, 16-byte aligned uint8 {list(want)} "
                         f"on {device}, got {got}")
    if not last and w.rows % 16:
        raise ValueError(f"{name} has {w.rows} rows; every NVFP4 matrix but the last must have a "
                         f"multiple of 16 (a 16-row tile lies in one matrix)")
    g = w.global_scale
    if not isinstance(g, float) or not (0 < g < float("inf")):
        raise ValueError(f"{name}.global_scale must be a positive finite float, got {g!r}")


def _check_vector(name: str, t, n: int, device, dtype=torch.bfloat16):
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device \
            or t.shape != (n,) or not t.is_contiguous():
        got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name} must be a contiguous {dtype} [{n}] tensor on {device}, got {got}")


class DenseGemv:
    """y = W·x for `tokens` tokens, W the rows of `weights` (1 to 3 bf16 [n_i, K] matrices, used
    where they lie, or 1 to 3 `DenseNVFP4`, the NVFP4 build) with `biases` (bf16 [n_i] or None
    each).

    Args:
        weights, biases: the matrices and their biases (biases None: none at all). NVFP4 ones:
            every n_i but the last a multiple of 16.
        tokens: B, the step's tokens (1 to 16).
        norm: the prologue sums the residual and applies an RMSNorm (call with norm_weight, eps).
        epilogue: PLAIN, RESIDUAL (+ a residual) or ROUTE (softmax top-k routing of the logits,
            a router's bias added to them before their rounding, the kernel's RBIAS build).
        warps: warps a block, 4 or 8 (the module docstring: launch shape).
        split_k: blocks each row tile's K is split over, 1 to 16 with K >= 32 · split_k.
        lane_addr: ROUTE only: also build the launch that writes lane addresses (the module
            docstring), taken by calls with table= and lane_addr=.
        sigmoid: ROUTE only, a sigmoid router with a correction bias (DeepSeek-V3's, GLM-4.5's,
            one expert group): (bias, scale), bias a float32 [N] tensor (its
            e_score_correction_bias), scale its routed_scaling_factor: the kernel's SIG build
            (`cupool.reference.dense.route_sigmoid`'s rule), at most 512 experts. None: softmax.
        one_plus: norm only, the RMSNorm of Qwen3-Next and Gemma, whose weight is stored as
            w − 1: the normalised x times (1 + norm_weight) in float32, rounded once
            (`cupool.reference.dense.rms_norm`'s one_plus), the kernel's NORM1 build. False:
            transformers' RMSNorm (the normalised x rounded, then times the weight in bf16).
        glu: the down projection of a gated MLP with SiLU: called with x its gate and up GEMV's
            output [B, 2K] (gate rows, then up rows), it multiplies silu(gate) · up, each op
            rounded to bf16 (`cupool.reference.dense.glu`): the kernel's GLU prologue (MODE 2).
            K a multiple of 8; not with norm or ROUTE.
        glu_gate: glu with RESIDUAL only, a shared expert with a sigmoid gate (Qwen2-MoE's,
            Qwen3-Next's): x is [B, 2K + 1], its last column the gate's logit, and the product
            is scaled by its sigmoid before the residual (the routed experts' sum) is added
            (`cupool.reference.dense.glu_gate`), the kernel's GATE build.
    """

    def __init__(self, weights: Sequence[torch.Tensor], biases=None, *, tokens: int,
                 norm: bool = False, epilogue: int = PLAIN, warps: int = WARPS,
                 split_k: int = 1, lane_addr: bool = False,
                 sigmoid: tuple[torch.Tensor, float] | None = None, one_plus: bool = False,
                 glu: bool = False, glu_gate: bool = False):
        weights = list(weights)
        if not 1 <= len(weights) <= 3:
            raise ValueError(f"weights must hold 1 to 3 matrices, got {len(weights)}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 16:
            raise ValueError(f"tokens must be an int in [1, 16], got {tokens!r}")
        if epilogue not in (PLAIN, RESIDUAL, ROUTE):
            raise ValueError(f"epilogue must be PLAIN, RESIDUAL or ROUTE, got {epilogue!r}")
        w0 = weights[0]
        self.nvfp4 = isinstance(w0, DenseNVFP4)
        if not self.nvfp4 and not isinstance(w0, torch.Tensor):
            raise TypeError(f"weights[0] must be a bf16 torch tensor or a DenseNVFP4, got "
                            f"{type(w0).__name__}")
        K = w0.cols if self.nvfp4 else int(w0.shape[1]) if w0.dim() == 2 else None
        check_launch_shape(warps, split_k, K, chunk_cols(self.nvfp4))
        self.device = w0.device
        if self.device.type != "cuda":
            raise ValueError(f"weights must be on a CUDA device, got {self.device}")
        for i, w in enumerate(weights):
            if self.nvfp4:
                _check_nvfp4(f"weights[{i}]", w, K, self.device, i == len(weights) - 1)
            else:
                _check_matrix(f"weights[{i}]", w, K, self.device)
        if not self.nvfp4 and K % 8:
            raise ValueError(f"the inner dim K={K} must be a multiple of 8 (16-byte rows)")
        rows = [w.rows if self.nvfp4 else w.shape[0] for w in weights]
        biases = [None] * len(weights) if biases is None else list(biases)
        if len(biases) != len(weights):
            raise ValueError(f"biases has {len(biases)} entries for {len(weights)} matrices")
        for i, (b, n) in enumerate(zip(biases, rows)):
            if b is not None:
                _check_vector(f"biases[{i}]", b, n, self.device)
        if lane_addr and epilogue != ROUTE:
            raise ValueError("lane_addr=True belongs to a GEMV built with epilogue=ROUTE")
        if one_plus and not norm:
            raise ValueError("one_plus=True belongs to a GEMV built with norm=True")
        if glu and (norm or epilogue == ROUTE):
            raise ValueError("glu=True takes neither norm=True nor epilogue=ROUTE (it is the "
                             "prologue of a gated MLP's down projection)")
        if glu_gate and not (glu and epilogue == RESIDUAL):
            raise ValueError("glu_gate=True belongs to a GEMV built with glu=True and "
                             "epilogue=RESIDUAL")
        if glu and K % 8:
            raise ValueError(f"glu=True needs the inner dim K={K} to be a multiple of 8 (the "
                             f"gate and up halves of x are read 8 columns at a time)")
        self.weights, self.biases = weights, biases
        self.K, self.N, self.rows = int(K), sum(rows), rows
        self.tokens, self.norm, self.epilogue = tokens, bool(norm), epilogue
        self.one_plus = bool(one_plus)
        self.glu, self.glu_gate = bool(glu), bool(glu_gate)
        # columns of x: K, or with glu a gated MLP's gate and up rows (and its gate's logit)
        self.x_cols = 2 * int(K) + int(self.glu_gate) if self.glu else int(K)
        self.warps, self.split_k = warps, split_k
        cap = route_capacity(tokens, warps)
        if epilogue == ROUTE and self.N > cap:
            raise ValueError(f"a router of {self.N} experts is more than the route epilogue "
                             f"takes for {tokens} tokens in blocks of {warps} warps ({cap})")
        # 2 row tiles a block for very tall matrices (the output head), so that fewer blocks
        # each build x: the x tile is made once per block
        self.row_tiles = 2 if self.N >= 16384 else 1
        tiles = -(-self.N // (16 * self.row_tiles))
        self.grid = tiles if split_k == 1 else (tiles, split_k)
        defines = {"NB": tokens, "MODE": NORM if norm else GLU if glu else NO_NORM,
                   "EPI": epilogue, "WARPS": warps, "RT": self.row_tiles}
        if self.glu_gate:          # the shared expert's sigmoid gate
            defines["GATE"] = 1
        if self.one_plus:          # the (1 + w) norm (Qwen3-Next's, Gemma's)
            defines["NORM1"] = 1
        if epilogue == ROUTE and any(b is not None for b in biases):    # gpt-oss's router
            defines["RBIAS"] = 1
        self.sigmoid = sigmoid
        self._sig_args = ()
        if sigmoid is not None:
            if epilogue != ROUTE:
                raise ValueError("sigmoid= belongs to a GEMV built with epilogue=ROUTE")
            sbias, scale = sigmoid
            _check_vector("sigmoid bias", sbias, self.N, self.device, torch.float32)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                    or not 0 < scale < float("inf"):
                raise ValueError(f"the sigmoid router's scale must be a positive finite number, "
                                 f"got {scale!r}")
            if self.N > SIGMOID_EXPERTS:
                raise ValueError(f"a sigmoid router of {self.N} experts is more than the "
                                 f"{SIGMOID_EXPERTS} the route epilogue takes")
            defines["SIG"] = 1
            self._sig_args = (sbias, kernels.f32(float(scale)))
        if self.nvfp4:             # bf16 builds take neither the defines nor the scales
            defines["WFP4"] = 1
            pre = predequant_chunks(self.K, warps, split_k, tokens, self.row_tiles)
            # the fragments held across the wait take registers: only where the grid still
            # runs in one wave (a second wave would cost more than the wait saves)
            if pre and tiles * split_k <= kernels.resident_grid(
                    kernels.function("dense_gemv", "dense_gemv", {**defines, "PRE": pre},
                                     self.device.index), warps * 32, 0, self.device):
                defines["PRE"] = pre
        self.pre = defines.get("PRE", 0)
        self._split_args = ()
        if split_k > 1:            # KS = 1 builds take neither the define nor the two arguments
            defines["KS"] = split_k
            self.partials = torch.empty(split_k, tokens, self.N, dtype=torch.float32,
                                        device=self.device)        # [S, B, N]
            self.tile_tickets = torch.zeros(tiles, dtype=torch.int32, device=self.device)
            self._split_args = (self.partials, self.tile_tickets)
        self.kernel = kernels.function("dense_gemv", "dense_gemv", defines, self.device.index)
        self.lane_kernel = (kernels.function("dense_gemv", "dense_gemv",
                                             {**defines, "LANE_ADDR": 1}, self.device.index)
                            if lane_addr else None)
        w = weights + [weights[0]] * (3 - len(weights))
        b = biases + [None] * (3 - len(biases))
        n0 = rows[0]
        n1 = rows[1] if len(rows) > 1 else 0
        scales = ()
        if self.nvfp4:
            scales = tuple(kernels.f32(m.global_scale) for m in w)
            w = [m.strips for m in w]
        self._wargs = (*w, kernels.i32(n0), kernels.i32(n1), kernels.i32(self.N),
                       kernels.i32(self.K), *scales,
                       *(kernels.NULL if t is None else t for t in b))

    def _check_act(self, name: str, t, cols: int):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.device != self.device \
                or t.shape != (self.tokens, cols) or not t.is_contiguous() or t.data_ptr() % 16:
            got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{name} must be a contiguous, 16-byte aligned bfloat16 "
                             f"[{self.tokens}, {cols}] tensor on {self.device}, got {got}")

    def __call__(self, x: torch.Tensor, *, add: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 h_out: torch.Tensor | None = None, x_out: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 route: RouteOut | None = None, top_k: int = 0, norm_topk: bool = False,
                 active: torch.Tensor | None = None, table: torch.Tensor | None = None,
                 lane_addr: torch.Tensor | None = None) -> None:
        """One launch on torch's current stream.

        x: [B, K] (the GEMV's input; with norm, the residual stream before `add`; with glu, the
        gate and up GEMV's output [B, 2K], or [B, 2K + 1] with glu_gate). add: [B, K] or
        None, summed into x first (norm only). norm_weight [K], eps: the RMSNorm (norm only).
        h_out / x_out: [B, K] or None, receive x + add and the normed x (norm only).
        residual: [B, N] added to the product (RESIDUAL). out: [B, N] (PLAIN, RESIDUAL).
        route, top_k, norm_topk, active (bool or uint8 [B], or None: every token): ROUTE.
        table int64 [E], lane_addr int64 [B·k]: both or neither, ROUTE built with lane_addr=True:
        lane_addr[b·k + j] = table[route.ids[b, j]], 0 for padding lanes.
        """
        B, K, N = self.tokens, self.K, self.N
        self._check_act("x", x, self.x_cols)
        null = kernels.NULL
        if self.norm:
            if add is not None:
                self._check_act("add", add, K)
            _check_vector("norm_weight", norm_weight, K, self.device)
            if norm_weight.data_ptr() % 16:
                raise ValueError(f"norm_weight must be 16-byte aligned (address "
                                 f"{norm_weight.data_ptr():#x})")
            for name, t in (("h_out", h_out), ("x_out", x_out)):
                if t is not None:
                    self._check_act(name, t, K)
            if h_out is not None and add is None:
                raise ValueError("h_out is x + add: it needs add")
        elif any(t is not None for t in (add, norm_weight, h_out, x_out)):
            raise ValueError("add, norm_weight, h_out and x_out belong to a GEMV built with norm=True")
        if self.epilogue == RESIDUAL:
            self._check_act("residual", residual, N)
        elif residual is not None:
            raise ValueError("residual belongs to a GEMV built with epilogue=RESIDUAL")
        if self.epilogue == ROUTE:
            if route is None:
                raise ValueError("a ROUTE GEMV needs route= (RouteOut buffers)")
            if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(32, N):
                raise ValueError(f"top_k must be an int in [1, {min(32, N)}], got {top_k!r}")
            want = {"logits": ((B, N), (torch.float32,)), "ids": ((B, top_k), (torch.int32,)),
                    "weights": ((B, top_k), (torch.bfloat16, torch.float32)),
                    "ticket": ((1,), (torch.int32,))}
            for name, (shape, dtypes) in want.items():
                t = getattr(route, name)
                if t.shape != shape or t.dtype not in dtypes or t.device != self.device \
                        or not t.is_contiguous():
                    raise ValueError(f"route.{name} must be a contiguous {dtypes[0]} {list(shape)} "
                                     f"tensor on {self.device}, got {t.dtype} {list(t.shape)} "
                                     f"on {t.device}")
            if active is not None:
                if active.dtype == torch.bool:
                    active = active.view(torch.uint8)
                if active.dtype != torch.uint8 or active.shape != (B,) \
                        or active.device != self.device or not active.is_contiguous():
                    raise ValueError(f"active must be a contiguous bool or uint8 [{B}] tensor on "
                                     f"{self.device}, got {active.dtype} {list(active.shape)}")
            if out is not None:
                raise ValueError("a ROUTE GEMV writes route.logits, not out")
            rargs = (route.logits, route.ids, route.weights, kernels.i32(top_k),
                     kernels.i32(int(bool(norm_topk))),
                     kernels.i32(int(route.weights.dtype == torch.float32)),
                     null if active is None else active, route.ticket)
        else:
            self._check_act("out", out, N)
            rargs = (null, null, null, kernels.i32(0), kernels.i32(0), kernels.i32(0), null, null)
        kernel, lane_args = self.kernel, ()
        if table is not None or lane_addr is not None:
            self._check_lane_addr(table, lane_addr, top_k)
            kernel, lane_args = self.lane_kernel, (table, lane_addr)
        kernels.launch(kernel, self.grid, self.warps * 32, (
            *self._wargs, x, null if add is None else add,
            null if norm_weight is None else norm_weight, kernels.f32(eps),
            null if h_out is None else h_out, null if x_out is None else x_out,
            null if residual is None else residual, null if out is None else out,
            *rargs, *self._split_args, *lane_args, *self._sig_args), device=self.device,
            dependent=True)

    def _check_lane_addr(self, table, lane_addr, top_k: int) -> None:
        """ValueError naming the argument unless this is a ROUTE GEMV built with lane_addr=True,
        table is a contiguous int64 [E] and lane_addr a contiguous int64 [B·k], both on its
        device."""
        if self.lane_kernel is None:
            raise ValueError("table and lane_addr belong to a ROUTE GEMV built with lane_addr=True")
        _check_vector("table", table, self.N, self.device, torch.int64)
        _check_vector("lane_addr", lane_addr, self.tokens * top_k, self.device, torch.int64)
