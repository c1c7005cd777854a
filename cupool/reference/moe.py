"""The MoE GEMM's references: the float one (dequantize, then matmul; of moe_decode.cu and
moe_gemm.cu), the one with int8 activation blocks (of the host's CPU path, host_experts.c) and
align_experts' grouping and copy lists (moe_align.cu).

Shape legend (ARCHITECTURE.md): T tokens · K top-k · H hidden · I intermediate · E experts.
"""

from __future__ import annotations

import math

import torch

from cupool.activation import SILU, Activation


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts, dtype=torch.float32, *, activation: Activation = SILU,
                  biases=None, quantize=None) -> torch.Tensor:
    """Dequantize-then-matmul reference in `dtype` (float32 or float64) on x's device.

    experts: callable e -> (w_gate [I, H], w_up [I, H], w_down [H, I]) float tensors (already
    dequantized; w_gate None for non-gated experts, whose activation is act(up)), or a sequence
    of such triples. activation: act(gate, up) (`cupool.activation`,
    SiLU by default). biases: None, or like experts e -> (b_gate [I], b_up [I], b_down [H]).
    Lane (t, k) adds w[t, k] · (w_down · act(w_gate x + b_gate, w_up x + b_up) + b_down); lanes
    with id -1 contribute nothing. Returns [T, H] in `dtype`. quantize (optional): v -> v, applied
    to each lane's x and act before they are multiplied (`reference_moe_q8`).
    """
    get = experts if callable(experts) else (lambda e: experts[e])
    get_b = (None if biases is None else biases if callable(biases)
             else (lambda e: biases[e]))
    xf = x.to(dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=dtype, device=x.device)
    ids = topk_ids.to(torch.int64)
    w = topk_weights.to(dtype)
    for e in sorted(set(ids.reshape(-1).tolist()) - {-1}):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        wg, wu, wd = (None if m is None else m.to(dtype=dtype, device=x.device) for m in get(e))
        h = xf[tok] if quantize is None else quantize(x[tok]).to(dtype)
        g, u = (None if wg is None else h @ wg.T), h @ wu.T
        if get_b is not None:
            bg, bu, bd = (b.to(dtype=dtype, device=x.device) for b in get_b(e))
            g, u = g + bg, u + bu
        a = activation(g, u)
        if quantize is not None:
            a = quantize(a).to(dtype)
        y = a @ wd.T
        if get_b is not None:
            y = y + bd
        out.index_add_(0, tok, y * w[tok, kk][:, None])
    return out


def quantize_q8(v: torch.Tensor) -> torch.Tensor:
    """v [..., n] quantized to int8 in blocks of 16 columns and back, as host_experts.c does it in
    float32: scale = amax / 127, code = rint(v · (127 / amax)) (ties to even); a block with a NaN
    or an infinity is NaN. Returns float64 code · scale (exact)."""
    n = v.shape[-1]
    pad = -n % 16
    b = torch.nn.functional.pad(v.float(), (0, pad)).reshape(*v.shape[:-1], -1, 16)
    finite = torch.isfinite(b).all(-1, keepdim=True)
    amax = b.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True)
    inv = torch.where(finite & (amax > 0), torch.tensor(127.0) / amax, torch.zeros(()))
    codes = torch.round(b.nan_to_num(0.0, 0.0, 0.0) * inv)
    scale = torch.where(finite, amax / torch.tensor(127.0), torch.full((), float("nan")))
    out = codes.double() * scale.double()
    return out.reshape(*v.shape[:-1], -1)[..., :n]


def reference_moe_q8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     experts, *, activation: Activation = SILU, biases=None) -> torch.Tensor:
    """The host CPU path's reference (host_experts.c): `reference_moe` in float64 with x and the
    act quantized by `quantize_q8` (the act rounded to float32 first, as the C computes it)."""
    return reference_moe(x, topk_ids, topk_weights, experts, torch.float64, activation=activation,
                         biases=biases, quantize=lambda v: quantize_q8(v.float()))


def align_experts(ids, weights, num_experts: int, layer: int, expert_addr, scratch_base: int,
                  scratch_stride: int, chunk: int, nbuf: int, nchunks: int, nt: int, *,
                  all_host: bool = False) -> dict:
    """What moe_align.cu's align_experts writes, in plain Python (lane order inside an expert's
    units is the kernel's choice: `expert_lanes` holds each expert's lanes as a set).

    ids [W] expert ids (−1 padding), weights [W], expert_addr [E] (0: not on the GPU). Resident
    experts with lanes form phase 0 (expert order); the others are ranked in expert order and
    chunk c = rank // chunk takes rows (c % nbuf)·chunk + rank % chunk of the scratch: all of
    them with `all_host` (the ALL_HOST build, copy lists from expert_addr alone), else only those
    with lanes. Returns phase_off [nchunks + 2], units (expert, address, lane count) in unit
    order, expert_lanes {e: set of lanes}, copies [(layer·E + e, scratch row)] in rank order
    (the first nchunks·chunk), n_copies [nchunks], lane_w [W], error (sticky bits)."""
    E, C = int(num_experts), int(chunk)
    ids = [int(i) for i in ids]
    weights = [float(v) for v in weights]
    addr = [int(a) for a in expert_addr]
    error = 0
    lanes: dict[int, list[int]] = {e: [] for e in range(E)}
    lane_w = []
    for lane, (i, w) in enumerate(zip(ids, weights)):
        ok = 0 <= i < E
        if i != -1 and not ok:
            error |= 1
        if ok and not math.isfinite(w):
            error, ok = error | 2, False
        lane_w.append(w if ok else 0.0)
        if ok:
            lanes[i].append(lane)
    nunits = {e: -(-len(lanes[e]) // nt) for e in range(E)}
    resident = [e for e in range(E) if addr[e] != 0]
    host = [e for e in range(E) if addr[e] == 0 and (all_host or lanes[e])]
    units = []
    for e in resident:
        units += [(e, addr[e], min(nt, len(lanes[e]) - u * nt)) for u in range(nunits[e])]
    total_res = len(units)
    phase_off = [0] + [None] * (nchunks + 1)
    phase_off[1] = total_res
    copies = []
    for rank, e in enumerate(host):
        c = rank // C
        row = rank % C + (c % nbuf) * C
        if rank % C == 0 and 0 < c <= nchunks:
            phase_off[1 + c] = len(units)
        units += [(e, scratch_base + scratch_stride * row, min(nt, len(lanes[e]) - u * nt))
                  for u in range(nunits[e])]
        if c < nchunks:
            copies.append((layer * E + e, row))
    if len(host) > nchunks * C:
        error |= 4
    phase_off = [len(units) if v is None else v for v in phase_off]
    n_copies = [max(0, min(C, len(host) - c * C)) for c in range(nchunks)]
    return {"phase_off": phase_off, "units": units,
            "expert_lanes": {e: set(v) for e, v in lanes.items() if v}, "copies": copies,
            "n_copies": n_copies, "lane_w": lane_w, "error": error}
