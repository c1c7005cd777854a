"""Launcher of `rawkernels/dense_attention.cu`: a decode step's attention over the slot cache,
with q/k norm, rotary embedding, the cache write, sliding window, sinks and the split-KV merge.

Shape legend (ARCHITECTURE.md): B tokens of the step (one a slot) · nh query heads · hk KV heads ·
G = nh / hk · D head dim · L_max positions a slot holds · NS parts a (slot, KV head)'s positions
are split into.

The reference is `cupool.reference.dense.attention_decode`.

The launch is a dependent one (`cupool.kernels.launch`): the kernel reads pos, the slot map, the
cache's older rows, the norms and the rotary tables before it waits for the kernel before it, so
none of those may be that kernel's output (in the fused step it is the QKV projection; a torch op
before it always finishes first).
"""

from __future__ import annotations

import torch

from cupool import kernels

THREADS = 128                   # the kernel's block
MINCHUNK = 64                   # fewest positions a part (the kernel's MINCHUNK)
HEAD_DIMS = (64, 128, 192, 256)
# the merge keeps G · NS part weights where the block's G · D scratch is: NS ≤ 64 for D ≥ 64
MAX_PARTS = 64
TRACE_STAMPS = 8                # the ATTN_TRACE build's stamps a block
MGROUP = 8                      # parts a first-level merge takes (the kernel's MGROUP)
COUNTERS = 1 + MAX_PARTS // MGROUP   # merge tickets a (slot, KV head): the final's, a group's


def shape_fits(group: int, head_dim: int) -> bool:
    """Whether G = `group` query heads a KV head of head_dim dims is a shape the kernel is built
    for: head_dim in HEAD_DIMS, and the heads' P·V sums (MMA tiles of 8 heads: ceil(G / 8)·D / 4
    floats a lane) within 64 registers."""
    return head_dim in HEAD_DIMS and -(-group // 8) * head_dim <= 256


def parts(tokens: int, kv_heads: int, max_len: int, sm_count: int,
          min_chunk: int = MINCHUNK) -> int:
    """NS: enough blocks for two a streaming multiprocessor at the longest context, but no more
    parts than max_len has min_chunk-position pieces (the kernel cuts them from each slot's own
    position at run time, and only the parts that hold positions run: a short context uses
    few)."""
    want = -(-2 * sm_count // (tokens * kv_heads))
    return max(1, min(want, -(-max_len // min_chunk), MAX_PARTS))


def check_min_chunk(min_chunk) -> int:
    """min_chunk as an int, or ValueError: a multiple of the kernel's 64-position tile, 64 to
    4096."""
    if isinstance(min_chunk, bool) or not isinstance(min_chunk, int) or min_chunk % 64 \
            or not 64 <= min_chunk <= 4096:
        raise ValueError(f"min_chunk must be a multiple of 64 in [64, 4096], got {min_chunk!r}")
    return min_chunk


class AttentionWorkspace:
    """The split-KV partial results and merge counters, shared by every layer of a step (layers
    run one after another): part_o float32 [B, nh, NS, D], part_ml float32 [B, nh, NS, 2], count
    int32 [B, hk, COUNTERS] (zero at rest; the kernel puts them back)."""

    def __init__(self, tokens: int, heads: int, kv_heads: int, head_dim: int, num_parts: int,
                 device):
        self.tokens, self.heads, self.kv_heads = tokens, heads, kv_heads
        self.head_dim, self.num_parts = head_dim, num_parts
        self.part_o = torch.empty(tokens, heads, num_parts, head_dim, dtype=torch.float32,
                                  device=device)
        self.part_ml = torch.empty(tokens, heads, num_parts, 2, dtype=torch.float32, device=device)
        self.count = torch.zeros(tokens, kv_heads, COUNTERS, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.part_o, self.part_ml, self.count))


def _vec(name: str, t, n: int, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.shape != (n,) \
            or t.device != device or not t.is_contiguous():
        got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
            else type(t).__name__
        raise ValueError(f"{name} must be a contiguous bfloat16 [{n}] tensor on {device}, got {got}")


def trace_buffer(workspace: AttentionWorkspace) -> torch.Tensor:
    """Zeroed int64 stamps of a traced launch: [NS · hk · B · TRACE_STAMPS], block s + NS·(h +
    hk·b)'s TRACE_STAMPS from its index times TRACE_STAMPS (rawkernels/dense_attention.cu)."""
    ws = workspace
    return torch.zeros(ws.num_parts * ws.kv_heads * ws.tokens * TRACE_STAMPS, dtype=torch.int64,
                       device=ws.part_o.device)


class DecodeAttention:
    """One layer's decode attention (see the module docstring).

    Args:
        heads, kv_heads, head_dim: nh, hk, D (nh a multiple of hk; D in HEAD_DIMS).
        q_norm, k_norm: RMSNorm weights [D] (bf16) or None; eps their epsilon.
        scale: the scores' factor (transformers' `scaling`).
        window: sliding window (positions a token sees, itself included) or 0 for none.
        sinks: bf16 [nh] or None.
        workspace: an AttentionWorkspace of matching shape (shared by a step's layers).
        ahead: the build that issues a tile's key and value loads ahead of their use (the
            kernel's AHEAD; the same output bits, more registers).
        min_chunk: fewest positions a part (the kernel's MINCHUNK): a context of n positions
            runs ceil(n / max(min_chunk, n / NS)) parts; one part writes the output itself,
            more are merged by the last to finish (above 2 · MGROUP parts in two levels, groups
            of MGROUP first). Fewer, longer parts cost less to merge; more keep more SMs busy.
        trace: the profiling build (the kernel's ATTN_TRACE: the same outputs, and each block's
            phase times written to the `trace` buffer a call passes; `trace_buffer`).
        rotary_dims: the dims the rotary embedding turns, a multiple of 64 below D (partial
            rotary, GLM-4.5's: the kernel's ROT), or None for all of them.
        q_gate: qkv rows as Qwen3-Next's gated attention lays them out, [B, (2 nh + 2 hk)·D]:
            query head j at columns 2jD … 2jD + D − 1, its output gate right after it, then the
            keys and values (the kernel's QGATE). The gates are not read: out stays [B, nh·D],
            and the caller multiplies it by their sigmoid.
        one_plus: q_norm / k_norm stored as w − 1 (Qwen3-Next's RMSNorm): the normalised value
            times (1 + w) in float32, rounded once (the kernel's NORM1).
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, *, q_norm=None, k_norm=None,
                 eps: float = 1e-6, scale: float, window: int = 0, sinks=None,
                 workspace: AttentionWorkspace, ahead: bool = False,
                 min_chunk: int = MINCHUNK, trace: bool = False,
                 rotary_dims: int | None = None, q_gate: bool = False, one_plus: bool = False):
        for name, v in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim} is not one the kernel is built for {HEAD_DIMS}")
        G = heads // kv_heads
        if not shape_fits(G, head_dim):
            raise ValueError(f"{G} query heads a KV head of {head_dim} dims exceed a lane's "
                             f"accumulators (ceil(G / 8)·D <= 256)")
        ws = workspace
        if not 1 <= ws.num_parts <= MAX_PARTS:
            raise ValueError(f"workspace has {ws.num_parts} parts; the kernel merges 1 to "
                             f"{MAX_PARTS}")
        if (ws.heads, ws.kv_heads, ws.head_dim) != (heads, kv_heads, head_dim):
            raise ValueError(f"workspace is for heads={ws.heads}, kv_heads={ws.kv_heads}, "
                             f"head_dim={ws.head_dim}; this layer has {heads}, {kv_heads}, "
                             f"{head_dim}")
        dev = ws.part_o.device
        _vec("q_norm", q_norm, head_dim, dev)
        _vec("k_norm", k_norm, head_dim, dev)
        _vec("sinks", sinks, heads, dev)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_norm, self.k_norm, self.sinks = q_norm, k_norm, sinks
        self.eps, self.scale, self.window = float(eps), float(scale), int(window)
        self.workspace, self.device = ws, dev
        if not isinstance(ahead, bool):
            raise ValueError(f"ahead must be True or False, got {ahead!r}")
        self.ahead = ahead
        self.min_chunk = check_min_chunk(min_chunk)
        defines = {"D": head_dim, "G": G, "MINCHUNK": self.min_chunk}
        if ahead:
            defines["AHEAD"] = 1
        if rotary_dims is not None and rotary_dims != head_dim:
            if isinstance(rotary_dims, bool) or not isinstance(rotary_dims, int) \
                    or not 0 < rotary_dims < head_dim or rotary_dims % 64:
                raise ValueError(f"rotary_dims must be a multiple of 64 below the head dim "
                                 f"{head_dim} (or None), got {rotary_dims!r}")
            defines["ROT"] = rotary_dims
        self.rotary_dims = rotary_dims
        for name, v in (("q_gate", q_gate), ("one_plus", one_plus)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        self.q_gate, self.one_plus = q_gate, one_plus
        if q_gate:
            defines["QGATE"] = 1
        if one_plus:
            defines["NORM1"] = 1
        if not isinstance(trace, bool):
            raise ValueError(f"trace must be True or False, got {trace!r}")
        self.trace = trace
        if trace:
            defines["ATTN_TRACE"] = 1
        self.kernel = kernels.function("dense_attention", "dense_attention", defines, dev.index)

    def __call__(self, qkv: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor, trace: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None) -> None:
        """qkv bf16 [B, (nh + 2 hk)·D] ([B, (2 nh + 2 hk)·D] with q_gate); pos int64 [B] (-1:
        token b is inactive, its out row zeros and its slot's cache neither read nor written);
        k_cache / v_cache bf16 [S, hk, L_max, D] (updated at pos); slots: int64 [B], token b's
        slot of the cache, distinct values in [0, S) (not checked on the device: the caller's),
        or None for slot b (S = B); cos / sin bf16 [L_max, D]; out bf16 [B, nh·D]; trace: the
        stamps' buffer (`trace_buffer`), for a launcher built with trace=True only. One launch."""
        ws, D = self.workspace, self.head_dim
        B, nh, hk = ws.tokens, self.heads, self.kv_heads
        dev = self.device

        def check(name, t, shape, dtype):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape \
                    or t.device != dev or not t.is_contiguous():
                got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
                    else type(t).__name__
                raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} tensor on "
                                 f"{dev}, got {got}")

        bf = torch.bfloat16
        width = ((2 if self.q_gate else 1) * nh + 2 * hk) * D    # with q_gate, each query's gate
        if self.q_gate and isinstance(qkv, torch.Tensor) and tuple(qkv.shape) != (B, width):
            raise ValueError(f"qkv must be [B, (2·heads + 2·kv_heads)·head_dim] = [{B}, {width}] "
                             f"with q_gate (each query head's gate after it), got "
                             f"{list(qkv.shape)}")
        check("qkv", qkv, (B, width), bf)
        check("pos", pos, (B,), torch.int64)
        if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
            raise ValueError(f"k_cache must be [S, hk, L_max, D], got "
                             f"{getattr(k_cache, 'shape', type(k_cache).__name__)}")
        S, L = k_cache.shape[0], k_cache.shape[2]
        if slots is None and S != B:
            raise ValueError(f"k_cache has {S} slots for a step of {B} tokens: pass slots, each "
                             f"token's slot")
        check("k_cache", k_cache, (S, hk, L, D), bf)
        check("v_cache", v_cache, (S, hk, L, D), bf)
        if slots is not None:
            check("slots", slots, (B,), torch.int64)
        check("cos", cos, (L, D), bf)
        check("sin", sin, (L, D), bf)
        check("out", out, (B, nh * D), bf)
        if self.trace:
            check("trace", trace, (ws.num_parts * hk * B * TRACE_STAMPS,), torch.int64)
        elif trace is not None:
            raise ValueError("trace belongs to a DecodeAttention built with trace=True")
        null = kernels.NULL
        kernels.launch(self.kernel, (ws.num_parts, hk, B), THREADS, (
            qkv, kernels.i32(nh), kernels.i32(hk),
            null if self.q_norm is None else self.q_norm,
            null if self.k_norm is None else self.k_norm, kernels.f32(self.eps),
            cos, sin, pos, null if slots is None else slots, k_cache, v_cache, kernels.i32(L),
            kernels.f32(self.scale),
            kernels.i32(self.window), null if self.sinks is None else self.sinks,
            ws.part_o, ws.part_ml, ws.count, out) + ((trace,) if self.trace else ()),
            device=dev, dependent=True)
