"""The float references of the fused decode step's kernels (`rawkernels/dense_gemv.cu`,
`rawkernels/dense_attention.cu`, `rawkernels/delta_decode.cu`), written as transformers computes a
decoder layer, with the roundings to the model's dtype where transformers rounds.

Shape legend (ARCHITECTURE.md): B tokens of a decode step (one a slot) · H hidden · N output rows
· E experts · K top-k · nh query heads · hk KV heads · G = nh / hk · D head dim · L_max positions
a slot holds; a gated delta net's: hk / hv key / value heads · dk / dv their dims · r = hv / hk ·
C = 2·hk·dk + hv·dv convolution channels · KC the convolution's kernel · S slots.
"""

from __future__ import annotations

import torch

from cupool.dense_nvfp4 import DenseNVFP4


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float,
             one_plus: bool = False) -> torch.Tensor:
    """transformers' RMSNorm: float32 statistics, the normalised value rounded to h's dtype, then
    times the weight in that dtype. one_plus: the norm of Qwen3-Next and Gemma, whose weight is
    stored as w − 1: the normalised value times (1 + w) in float32, rounded once."""
    x = h.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    if one_plus:
        return (x * torch.rsqrt(var + eps) * (1.0 + weight.to(torch.float32))).to(h.dtype)
    return weight * (x * torch.rsqrt(var + eps)).to(h.dtype)


def gemv(weights, biases, x: torch.Tensor) -> torch.Tensor:
    """x [B, K] times each of `weights` ([n_i, K]) with its bias (or None), outputs side by side:
    [B, Σ n_i] in x's dtype (one rounding after the bias, as a Linear with a bias)."""
    outs = []
    for i, w in enumerate(weights):
        b = None if biases is None else biases[i]
        y = x.to(torch.float32) @ w.to(torch.float32).T
        if b is not None:
            y = y + b.to(torch.float32)
        outs.append(y.to(x.dtype))
    return torch.cat(outs, dim=-1)


def residual_norm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                  eps: float, one_plus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + add rounded to h's dtype, its RMSNorm (`rms_norm`'s one_plus)): the prologue of a
    normed GEMV."""
    if add is not None:
        h = h + add
    return h, rms_norm(h, weight, eps, one_plus)


def glu(gu: torch.Tensor, size: int) -> torch.Tensor:
    """act_fn(gate) · up of a gated MLP with SiLU, from its gate and up GEMV's output gu [B,
    2·size] or [B, 2·size + 1] (the gate rows, the up rows, then a sigmoid gate's logit where it
    has one), each op rounded to gu's dtype as transformers' MLP rounds: the GLU prologue of its
    down projection."""
    return torch.nn.functional.silu(gu[:, :size]) * gu[:, size:2 * size]


def glu_gate(gu: torch.Tensor, size: int) -> torch.Tensor:
    """sigmoid of a shared expert gate's logit, the last column of gu [B, 2·size + 1], in gu's
    dtype: [B, 1], the factor of the down projection's output (Qwen2-MoE's, Qwen3-Next's)."""
    return torch.sigmoid(gu[:, 2 * size:])


def route_topk(logits: torch.Tensor, top_k: int, norm_topk: bool, weight_dtype: torch.dtype,
          active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax top-k router on logits [B, E] (already in the model's dtype): softmax in float32,
    the top_k largest (ties to the lower expert), divided by their sum when norm_topk, weights in
    weight_dtype. Tokens with active False get ids −1 and weights 0. Returns (ids int32 [B, K],
    weights [B, K])."""
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    key = torch.where(probs.isnan(), torch.full_like(probs, 2.0), probs)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = probs.gather(1, order)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    ids, w = order.to(torch.int32), top.to(weight_dtype)
    if active is not None:
        off = ~active.to(torch.bool)
        ids = ids.masked_fill(off[:, None], -1)
        w = w.masked_fill(off[:, None], 0)
    return ids, w


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk: bool,
                  scale: float, weight_dtype: torch.dtype = torch.float32,
                  active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid top-k router with a correction bias on logits [B, E] (DeepSeek-V3's, GLM-4.5's
    and dots.llm1's routers with one expert group): scores = sigmoid(logits) in float32; the
    top_k largest of scores + bias (float32 [E]; NaN counts as largest, ties to the lower
    expert) are chosen; their weights are their scores, divided by their sum (+ 1e-20) when
    norm_topk, times scale, in weight_dtype. Tokens with active False get ids −1 and weights 0.
    Returns (ids int32 [B, K], weights [B, K])."""
    scores = torch.sigmoid(logits.to(torch.float32))
    choice = scores + bias.to(torch.float32)
    key = torch.where(choice.isnan(), torch.full_like(choice, float("inf")), choice)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = scores.gather(1, order)
    if norm_topk:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    ids, w = order.to(torch.int32), (top * scale).to(weight_dtype)
    if active is not None:
        off = ~active.to(torch.bool)
        ids = ids.masked_fill(off[:, None], -1)
        w = w.masked_fill(off[:, None], 0)
    return ids, w


def lane_addresses(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The decode GEMM's lane addresses of a bank holding every expert: ids int32 [B, K] (−1:
    padding), table int64 [E] (each expert's bank row address) → int64 [B·K], table[id] a lane,
    0 for padding."""
    flat = ids.reshape(-1).to(torch.int64)
    return torch.where(flat >= 0, table[flat.clamp(min=0)], torch.zeros_like(flat))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rotary_dims: int | None = None) -> torch.Tensor:
    """transformers' rotary embedding in x's dtype: x·cos + rotate_half(x)·sin, each product and
    the sum rounded. x [..., D], cos / sin broadcastable to it. rotary_dims R < D (partial
    rotary, GLM-4.5's): only x[..., :R] turns, by cos / sin[..., :R], and the rest passes."""
    R = x.shape[-1] if rotary_dims is None else rotary_dims
    if R < x.shape[-1]:
        return torch.cat((rope(x[..., :R], cos[..., :R], sin[..., :R]), x[..., R:]), dim=-1)
    half = R // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def attention_decode(qkv: torch.Tensor, nh: int, hk: int, q_norm, k_norm, eps: float,
                     cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                     window: int = 0, sinks: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None,
                     rotary_dims: int | None = None, q_gate: bool = False,
                     one_plus: bool = False) -> torch.Tensor:
    """One decode step of attention for B tokens. qkv [B, (nh + 2 hk)·D] (queries, keys, values
    of the new tokens, in the model's dtype); q_norm / k_norm: RMSNorm weights [D] or None;
    cos_t / sin_t [L_max, D]; pos int [B] (where each token goes; a negative pos marks an
    inactive token, whose output row is zeros and whose slot's cache rows are left as they are);
    k_cache / v_cache [S, hk, L_max, D], updated in place at pos; slots int [B]: token b's slot
    of the cache (None: slot b, S = B). Token b attends to positions
    lo … pos[b] (lo = pos − window + 1 with a window > 0). Scores, softmax and the weighted sum
    in float32; sinks [nh] (or None) add exp(sink) to each head's softmax denominator;
    rotary_dims (None: D) the dims the rotary embedding turns (`rope`). q_gate (Qwen3-Next's gated
    attention): qkv is [B, (2 nh + 2 hk)·D], q_proj's rows as that model lays them out, head j's
    query at columns 2jD … 2jD + D − 1 and its output gate right after it, then the keys and
    values; the gates are not read here (the caller multiplies the output by their sigmoid).
    one_plus: the q/k norms are `rms_norm`'s one_plus kind. Returns [B, nh·D] in the model's
    dtype."""
    B = qkv.shape[0]
    D = k_cache.shape[-1]
    L = k_cache.shape[2]
    G = nh // hk
    dt = qkv.dtype
    nq = 2 * nh if q_gate else nh                 # query columns / D: with their gates
    q = qkv[:, :nq * D].reshape(B, nh, nq // nh, D)[:, :, 0]
    k = qkv[:, nq * D:(nq + hk) * D].reshape(B, hk, D)
    v = qkv[:, (nq + hk) * D:(nq + 2 * hk) * D].reshape(B, hk, D)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps, one_plus)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps, one_plus)
    p = pos.to(torch.int64).clamp(0, L - 1)
    cos, sin = cos_t[p][:, None, :], sin_t[p][:, None, :]
    q, k = rope(q, cos, sin, rotary_dims), rope(k, cos, sin, rotary_dims)
    out = torch.zeros(B, nh, D, dtype=dt, device=qkv.device)
    for b in range(B):
        if int(pos[b]) < 0:
            continue
        P, c = int(p[b]), int(slots[b]) if slots is not None else b
        k_cache[c, :, P] = k[b]
        v_cache[c, :, P] = v[b]
        lo = max(0, P - window + 1) if window > 0 else 0
        keys = k_cache[c, :, lo:P + 1].to(torch.float32)            # [hk, n, D]
        vals = v_cache[c, :, lo:P + 1].to(torch.float32)
        qf = q[b].to(torch.float32).reshape(hk, G, D)
        s = torch.einsum("hgd,hnd->hgn", qf, keys) * scale           # [hk, G, n]
        if sinks is not None:
            sk = sinks.to(torch.float32).reshape(hk, G, 1)
            m = torch.maximum(s.amax(-1, keepdim=True), sk)
            e = torch.exp(s - m)
            w = e / (e.sum(-1, keepdim=True) + torch.exp(sk - m))
        else:
            w = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hgn,hnd->hgd", w, vals).reshape(nh, D).to(dt)
    return out.reshape(B, nh * D)


class GemvReference:
    """`cupool.ops.dense_gemv.DenseGemv`'s interface computed by the functions above (any
    device): the fused step's reference backend. The launch shape (warps, split_k) is taken and
    ignored: it changes only the order of the kernel's float sums."""

    def __init__(self, weights, biases=None, *, tokens: int, norm: bool = False,
                 epilogue: int = 0, warps: int = 8, split_k: int = 1, lane_addr: bool = False,
                 sigmoid=None, one_plus: bool = False, glu: bool = False,
                 glu_gate: bool = False):
        self.weights, self.biases = list(weights), biases
        self.one_plus = one_plus
        self.glu, self.glu_gate = glu, glu_gate
        self.sigmoid = sigmoid
        self.tokens, self.norm, self.epilogue = tokens, norm, epilogue
        self.lane_addr = lane_addr
        # NVFP4 weights (cupool.dense_nvfp4.DenseNVFP4) as the float32 values they hold
        self._mats = [w.dequantize(torch.float32) if isinstance(w, DenseNVFP4) else w
                      for w in self.weights]
        self.N, self.K = sum(w.shape[0] for w in self._mats), self._mats[0].shape[1]
        self.nvfp4 = isinstance(self.weights[0], DenseNVFP4)

    def __call__(self, x, *, add=None, norm_weight=None, eps=1e-6, h_out=None, x_out=None,
                 residual=None, out=None, route=None, top_k=0, norm_topk=False, active=None,
                 table=None, lane_addr=None):
        lanes = table is not None or lane_addr is not None
        if lanes and not (self.epilogue == 2 and self.lane_addr):
            raise ValueError("table and lane_addr belong to a ROUTE GEMV built with lane_addr=True")
        if self.norm:
            h, xin = residual_norm(x, add, norm_weight, eps, self.one_plus)
            if h_out is not None:
                h_out.copy_(h)
            if x_out is not None:
                x_out.copy_(xin)
        elif self.glu:
            xin = glu(x, self.K)
        else:
            xin = x
        if self.epilogue == 2 and self.sigmoid is not None:
            # float32 logits, as those routers compute them
            y = xin.to(torch.float32) @ self._mats[0].to(torch.float32).T
        else:
            y = gemv(self._mats, self.biases, xin)
        if self.epilogue == 2:
            if self.sigmoid is not None:
                ids, w = route_sigmoid(y, self.sigmoid[0], top_k, norm_topk, self.sigmoid[1],
                                       route.weights.dtype, active)
            else:
                ids, w = route_topk(y, top_k, norm_topk, route.weights.dtype, active)
            route.logits.copy_(y.to(torch.float32))
            route.ids.copy_(ids)
            route.weights.copy_(w)
            if lanes:
                if table is None or lane_addr is None or lane_addr.shape != (ids.numel(),):
                    raise ValueError(f"table [E] and lane_addr [{ids.numel()}] go together")
                lane_addr.copy_(lane_addresses(ids, table))
        elif self.epilogue == 1:
            if self.glu_gate:
                y = glu_gate(x, self.K) * y
            out.copy_(residual + y)
        else:
            out.copy_(y)


class AttentionReference:
    """`cupool.ops.dense_attention.DecodeAttention`'s interface computed by `attention_decode`
    (`ahead` and `min_chunk`, choices of kernel build and split, change nothing here)."""

    def __init__(self, heads, kv_heads, head_dim, *, q_norm=None, k_norm=None, eps=1e-6,
                 scale, window=0, sinks=None, workspace=None, ahead=False, min_chunk=64,
                 rotary_dims=None, q_gate=False, one_plus=False):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_gate, self.one_plus = q_gate, one_plus
        self.rotary_dims = rotary_dims
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, eps
        self.scale, self.window, self.sinks = scale, window, sinks

    def __call__(self, qkv, pos, k_cache, v_cache, cos, sin, out, slots=None):
        out.copy_(attention_decode(qkv, self.heads, self.kv_heads, self.q_norm, self.k_norm,
                                   self.eps, cos, sin, pos, k_cache, v_cache, self.scale,
                                   self.window, self.sinks, slots, self.rotary_dims,
                                   self.q_gate, self.one_plus))


def delta_projection(proj: torch.Tensor, hk: int, hv: int, dk: int, dv: int, grouped: bool):
    """A gated delta net's in-projection output proj [B, 2·hk·dk + 2·hv·dv + 2·hv] split into
    (mixed [B, C]: the queries, keys and values in the convolution's channel order; z [B, hv,
    dv]; b, a [B, hv]). grouped: Qwen3-Next's layout, in_proj_qkvz's rows then in_proj_ba's, each
    by key head (head j: its query, its key, then its r value heads, then their r gates z; then
    key head j's r b then r a); else Qwen3.5's, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a one
    after another (q of every head, k, v, then z, b, a)."""
    B, r = proj.shape[0], hv // hk
    if grouped:
        g = 2 * dk + 2 * r * dv
        qkvz = proj[:, :hk * g].reshape(B, hk, g)
        ba = proj[:, hk * g:].reshape(B, hk, 2 * r)
        q, k = qkvz[..., :dk].reshape(B, -1), qkvz[..., dk:2 * dk].reshape(B, -1)
        v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(B, -1)
        z = qkvz[..., 2 * dk + r * dv:].reshape(B, hv, dv)
        b, a = ba[..., :r].reshape(B, hv), ba[..., r:].reshape(B, hv)
        return torch.cat([q, k, v], dim=-1), z, b, a
    C, V = 2 * hk * dk + hv * dv, hv * dv
    return (proj[:, :C], proj[:, C:C + V].reshape(B, hv, dv), proj[:, C + V:C + V + hv],
            proj[:, C + V + hv:C + V + 2 * hv])


def delta_decode(proj: torch.Tensor, hk: int, hv: int, dk: int, dv: int, grouped: bool,
                 conv_state: torch.Tensor, conv_w: torch.Tensor, state: torch.Tensor,
                 neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float,
                 pos: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of a gated delta net (Qwen3-Next's, Qwen3.5's) from its in-projection's
    output to the input of its out-projection, as transformers' module computes it with its torch
    functions (`causal_conv1d_update`, `torch_recurrent_gated_delta_rule`, the gated RMSNorm).

    proj [B, 2·hk·dk + 2·hv·dv + 2·hv] (model dtype; `delta_projection`'s layouts); conv_state
    [S, C, KC] (model dtype) and state [S, hv, dk, dv] (float32), token b's rows those of slot
    slots[b] (None: slot b), both updated in place; conv_w [C, KC]; neg_a = −exp(A_log) and
    dt_bias, float32 [hv]; norm_w [dv] (model dtype) and eps the gated norm's; pos [B]: a
    negative one marks an inactive token, whose output row is zeros and whose slot's states are
    left as they are. Returns [B, hv·dv] in the model's dtype.

    Per token: the convolution over the slot's last KC inputs (the new one last; the state keeps
    them), rounded, then SiLU, rounded; q and k L2-normalised in float32 (eps 1e-6), q / √dk;
    value head j reads key head j // r; beta = sigmoid(b) rounded; g = neg_a · softplus(a +
    dt_bias) in float32; the state S [dk, dv] of a value head decays by exp(g), then S += k ⊗
    beta·(v − kᵀS), and o = qᵀS, rounded; then weight · rmsnorm(o) (rounded twice, as
    transformers' gated RMSNorm) times silu(z) in float32, rounded."""
    dt, f32 = proj.dtype, torch.float32
    B, r = proj.shape[0], hv // hk
    mixed, z, b, a = delta_projection(proj, hk, hv, dk, dv, grouped)
    out = torch.zeros(B, hv, dv, dtype=dt, device=proj.device)
    silu = torch.nn.functional.silu
    for t in range(B):
        if int(pos[t]) < 0:
            continue
        c = int(slots[t]) if slots is not None else t
        window = torch.cat([conv_state[c, :, 1:], mixed[t, :, None].to(conv_state.dtype)], -1)
        conv_state[c] = window
        y = (window.to(f32) * conv_w.to(f32)).sum(-1).to(dt)
        y = silu(y.to(f32)).to(dt).to(f32)
        q = y[:hk * dk].reshape(hk, dk)
        k = y[hk * dk:2 * hk * dk].reshape(hk, dk)
        v = y[2 * hk * dk:].reshape(hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = (q * (1.0 / dk ** 0.5)).repeat_interleave(r, 0)
        k = k.repeat_interleave(r, 0)
        beta = torch.sigmoid(b[t].to(f32)).to(dt).to(f32)
        g = neg_a.to(f32) * torch.nn.functional.softplus(a[t].to(f32) + dt_bias.to(f32))
        S = state[c].to(f32) * g.exp()[:, None, None]
        kv = (S * k[:, :, None]).sum(1)
        delta = (v - kv) * beta[:, None]
        S = S + k[:, :, None] * delta[:, None, :]
        state[c] = S
        out[t] = gated_rms_norm((S * q[:, :, None]).sum(1).to(dt), z[t], norm_w, eps)
    return out.reshape(B, hv * dv)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """A gated delta net's output norm (transformers' RMSNormGated) over o's last dim: weight ·
    rmsnorm(o) rounded to o's dtype, then times silu(z) in float32, rounded."""
    f32 = torch.float32
    x = o.to(f32)
    n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * n).to(f32) * torch.nn.functional.silu(z.to(f32))).to(o.dtype)


class DeltaReference:
    """`cupool.ops.delta_decode.DeltaDecode`'s interface computed by `delta_decode`."""

    def __init__(self, key_heads, value_heads, key_dim, value_dim, *, grouped, conv_w, neg_a,
                 dt_bias, norm_w, eps, tokens=None):
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.grouped, self.conv_w, self.neg_a, self.dt_bias = grouped, conv_w, neg_a, dt_bias
        self.norm_w, self.eps = norm_w, eps

    def __call__(self, proj, pos, conv_state, state, out, slots=None):
        out.copy_(delta_decode(proj, self.hk, self.hv, self.dk, self.dv, self.grouped,
                               conv_state, self.conv_w, state, self.neg_a, self.dt_bias,
                               self.norm_w, self.eps, pos, slots))
