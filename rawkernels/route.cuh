// What the router's epilogue (dense_gemv.cu, EPI 2) and moe_decode's ROUTE build share: bf16
// words as floats, and softmax top-k routing of one token by one warp. The routing rule: softmax
// over the N logits (float32) → top-k (NaN counts as largest, ties go to the lower expert, as a
// stable descending sort) → divided by their sum when norm_topk → weights (bf16, or float32 with
// w_f32, as the model's router returns them); a token that is not active gets ids −1 and weights
// 0 (padding lanes for the pool). With LA the lanes' row addresses too: lane_addr[j] = table[id]
// (0 for an inactive token). route_token_sigmoid: the sigmoid routers of DeepSeek-V3, GLM-4.5
// and dots.llm1 (one expert group), below.
#pragma once
#include "common.cuh"

// Eight bf16 values of a 16-byte word as floats, and back (round to nearest even).
CUPOOL_DEVICE void unpack8(u32x4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

CUPOOL_DEVICE u32x4 pack8(const float* f) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = (u32)f32_to_bf16(f[2 * i]) | ((u32)f32_to_bf16(f[2 * i + 1]) << 16);
    return u32x4{w[0], w[1], w[2], w[3]};
}

// An entry's sort key for the top-k, as an unsigned int, of its softmax numerator
// v = exp(logit − max) ∈ [0, 1] (the one division by the sum comes in route_out, not one an
// entry): a NaN above every entry (NaN counts as largest), a taken entry (−1 in the
// shared-memory form) below all (0); otherwise v ≥ 0, whose float bits order as the floats do.
// Dividing by the sum keeps that order but for one case: two v a float step or two apart can
// round to one probability, where a sort of the probabilities takes the lower expert and the
// keys the larger v (bf16 logits give v that close only when both lie within about 2^−14 of 0).
// route_value gives v back (any NaN as one NaN).
constexpr u32 ROUTE_NAN_KEY = 0x40000001u;       // 2.0f's bits + 1: above any v ≤ 1
CUPOOL_DEVICE u32 route_key(float v) {
    return v != v ? ROUTE_NAN_KEY : v < 0.0f ? 0u : __float_as_uint(v) + 1u;
}

CUPOOL_DEVICE float route_value(u32 key) {
    return key == ROUTE_NAN_KEY ? __int_as_float(0x7fffffff) : __uint_as_float(key - 1u);
}

// v / d within an ulp of the rounded quotient, for d ∈ [1, 2^20] and v ∈ [0, 1] or NaN (a
// weight: den ≥ 1, as the largest logit's v is 1): the reciprocal's estimate, the quotient, and
// the quotient corrected once by its exact residual (an FMA). An IEEE division (div.rn.f32)
// checks its operands' range and calls a slow path outside it; the registers saved around that
// call spilled the 64-register ROUTE build (H=2048, I=512, 32 lanes).
CUPOOL_DEVICE float route_div(float v, float d) {
    const float r = __fdividef(1.0f, d);
    const float q = v * r;
    return fmaf(fmaf(-d, q, v), r, q);
}

// Lane j < topk writes its round's expert e, weight v / den (route_rounds' denominator) and,
// with LA, table[e]: ids [topk], wts [topk] (float32 with w_f32, else bf16) and lane_addr [topk]
// in any memory space, `table` in shared or global memory; an inactive token gets −1, 0 and 0.
// Each lane reads its table entry once, after the rounds: a read inside them (predicated on the
// lane that took the round) is one load a round into the same register, which the hardware
// completes one after another, a round trip each.
template <bool LA>
CUPOOL_DEVICE void route_out(i32 mine_e, float mine_v, float den, i32 topk, bool active,
                             i32* ids, void* wts, int w_f32, const i64* table,
                             i64* lane_addr) {
    const int lane = threadIdx.x & 31;
    if (lane < topk) {
        const float w = route_div(mine_v, den);
        ids[lane] = active ? mine_e : -1;
        if (LA) lane_addr[lane] = active ? table[mine_e] : 0;
        if (w_f32) static_cast<float*>(wts)[lane] = active ? w : 0.0f;
        else static_cast<u16*>(wts)[lane] = active ? f32_to_bf16(w) : (u16)0;
    }
}

// The top-k rounds both forms share: each lane holds its segment's best key (0: none left); a
// round is a warp max of them (redux) and the lowest lane holding it (segments are in e order, so
// that is the lowest e of the largest key, the rule of a stable descending sort). expert_of(src)
// gives the round's expert (every lane calls it: a shuffle from src), take(mine, e) lets the
// lane that holds it mark it and find its next best. The round's v comes from the key; lane j
// keeps round j's expert and v. den, the weights' denominator, comes in as the softmax's sum, or
// as 0 with norm_topk, when the rounds add their v to it.
template <class ExpertOf, class Take>
CUPOOL_DEVICE void route_rounds(u32& best, i32 topk, int norm_topk, ExpertOf expert_of,
                                Take take, i32& mine_e, float& mine_v, float& den) {
    const int lane = threadIdx.x & 31;
    for (i32 j = 0; j < topk; ++j) {
        const u32 top = warp_max_u32(best);
        const int src = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;
        const i32 e = expert_of(src);
        const float v = route_value(top);
        take(lane == src, e);
        if (norm_topk) den += v;
        if (lane == j) {
            mine_v = v;
            mine_e = e;
        }
    }
}

// route_token for segments of more than 16 entries (N > 512), its logits in shared memory
// (overwritten with the softmax's numerators v, then with −1 where taken).
//
// The softmax runs over e = lane + 32i; the top-k over contiguous segments, lane l holding
// [l·per, l·per + per), and each lane keeps its segment's best (largest key, the lowest e among
// equal keys) in registers; in each round (route_rounds) the lane holding the largest marks its
// entry and rescans its segment: no pass over all N entries a round.
template <bool LA>
CUPOOL_DEVICE void route_token_shared(float* lg, i32 N, i32 topk, int norm_topk, bool active,
                                      i32* ids, void* wts, int w_f32, const i64* table,
                                      i64* lane_addr) {
    const int lane = threadIdx.x & 31;
    float m = -__int_as_float(0x7f800000);
    for (i32 e = lane; e < N; e += 32) m = fmaxf(m, lg[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
    for (i32 e = lane; e < N; e += 32) {
        const float v = expf(lg[e] - m);
        lg[e] = v;
        s += v;
    }
    s = warp_sum(s);
    if (s != s)                          // a NaN anywhere makes every probability NaN
        for (i32 e = lane; e < N; e += 32) lg[e] = s;
    __syncwarp();
    const i32 per = (N + 31) / 32, e0 = lane * per, e1 = min(N, e0 + per);
    u32 best = 0;                        // this segment's best key (0: none left) ...
    i32 best_e = N;                      // ... and its entry
    auto rescan = [&]() {
        best = 0;
        for (i32 e = e0; e < e1; ++e) {
            const float v = lg[e];
            const u32 key = route_key(v);
            if (key > best) { best = key; best_e = e; }
        }
    };
    rescan();
    float mine_v = 0.0f, den = norm_topk ? 0.0f : s;
    i32 mine_e = -1;
    route_rounds(best, topk, norm_topk,
                 [&](int src) { return __shfl_sync(0xffffffffu, best_e, src); },
                 [&](bool mine, i32 e) {
                     if (mine) {          // only this lane's segment changes
                         lg[e] = -1.0f;
                         rescan();
                     }
                 },
                 mine_e, mine_v, den);
    route_out<LA>(mine_e, mine_v, den, topk, active, ids, wts, w_f32, table, lane_addr);
}

// A lane's segment's best of its PER keys: the largest key (bk) and its index (bi), as a tree of
// pairs, the lower index kept unless the higher one's key is larger.
template <int PER>
CUPOOL_DEVICE void segment_best(const u32 (&key)[PER], u32& bk, int& bi) {
    u32 k2[PER];
    int i2[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) { k2[i] = key[i]; i2[i] = i; }
#pragma unroll
    for (int w = 1; w < PER; w *= 2)
#pragma unroll
        for (int i = 0; i + w < PER; i += 2 * w)
            if (k2[i + w] > k2[i]) { k2[i] = k2[i + w]; i2[i] = i2[i + w]; }
    bk = k2[0];
    bi = i2[0];
}

// route_token for segments of up to PER entries (N ≤ 32·PER), in registers: lane l holds
// entries [l·PER, l·PER + PER) (−inf past N), their softmax's numerators (a local max and sum,
// then one warp max and one warp sum), their keys, and its best (largest key, the lowest e
// among equal keys, as a tree over the PER keys). In each round (route_rounds) the lane holding
// the largest zeroes that key and takes the tree again; the round's expert is one shuffle off
// the rounds' chain. lg is only read.
template <int PER, bool LA>
CUPOOL_DEVICE void route_token_regs(const float* lg, i32 N, i32 topk, int norm_topk,
                                    bool active, i32* ids, void* wts, int w_f32,
                                    const i64* table, i64* lane_addr) {
    const int lane = threadIdx.x & 31;
    const i32 e0 = lane * PER;
    float v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = e0 + i < N ? lg[e0 + i] : -__int_as_float(0x7f800000);
    float m = v[0];
#pragma unroll
    for (int i = 1; i < PER; ++i) m = fmaxf(m, v[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        v[i] = e0 + i < N ? expf(v[i] - m) : 0.0f;
        s += v[i];
    }
    s = warp_sum(s);
    u32 key[PER];                        // a NaN anywhere makes every probability NaN
#pragma unroll
    for (int i = 0; i < PER; ++i)
        key[i] = e0 + i >= N ? 0u : s != s ? ROUTE_NAN_KEY : __float_as_uint(v[i]) + 1u;
    auto best_of = [&](u32& bk, int& bi) { segment_best<PER>(key, bk, bi); };
    u32 best;
    int best_i;
    best_of(best, best_i);
    float mine_v = 0.0f, den = norm_topk ? 0.0f : s;
    i32 mine_e = -1;
    route_rounds(best, topk, norm_topk,
                 [&](int src) { return src * PER + __shfl_sync(0xffffffffu, best_i, src); },
                 [&](bool mine, i32) {
                     if (mine) {
#pragma unroll
                         for (int i = 0; i < PER; ++i) key[i] = i == best_i ? 0u : key[i];
                     }
                     best_of(best, best_i);
                 },
                 mine_e, mine_v, den);
    route_out<LA>(mine_e, mine_v, den, topk, active, ids, wts, w_f32, table, lane_addr);
}

// Top-k routing of one token by one warp, its N logits in `lg` (shared memory, overwritten where
// N > 512): ids, weights and, with LA, lane addresses as route_out writes them.
template <bool LA>
CUPOOL_DEVICE void route_token(float* lg, i32 N, i32 topk, int norm_topk, bool active,
                               i32* ids, void* wts, int w_f32, const i64* table,
                               i64* lane_addr) {
    if (N <= 128)
        route_token_regs<4, LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table, lane_addr);
    else if (N <= 256)
        route_token_regs<8, LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table, lane_addr);
    else if (N <= 512)
        route_token_regs<16, LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table,
                                 lane_addr);
    else
        route_token_shared<LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table,
                               lane_addr);
}

// An order-preserving key of any float c, for sigmoid routing's choice scores (which a
// correction bias can make negative): NaN above every float (NaN counts as largest), 0 ("none
// left") below all; −0 is taken as +0 first, so that the two tie as floats do.
CUPOOL_DEVICE u32 sigmoid_key(float c) {
    if (c != c) return 0xffffffffu;
    const u32 b = __float_as_uint(c + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sigmoid top-k routing of one token by one warp (N ≤ 32·PER, in registers, as
// route_token_regs): scores v = sigmoid(logit) in float32; the top-k of v + bias[e] (float32
// [N], the router's e_score_correction_bias; NaN counts as largest, ties go to the lower
// expert) are chosen; a chosen expert's weight is its v, divided by the chosen v's sum + 1e-20
// when norm_topk, times scale (float32 with w_f32, else bf16), as transformers' router computes
// them for one expert group. Lane l holds entries [l·PER, l·PER + PER); each round takes the
// largest key (a warp max, the lowest lane holding it), whose v comes with it by a shuffle.
template <int PER, bool LA>
CUPOOL_DEVICE void route_token_sigmoid_regs(const float* lg, i32 N, i32 topk, int norm_topk,
                                            bool active, i32* ids, void* wts, int w_f32,
                                            const i64* table, i64* lane_addr,
                                            const float* bias, float scale) {
    const int lane = threadIdx.x & 31;
    const i32 e0 = lane * PER;
    float v[PER];
    u32 key[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const bool in = e0 + i < N;
        v[i] = in ? 1.0f / (1.0f + expf(-lg[e0 + i])) : 0.0f;
        key[i] = in ? sigmoid_key(v[i] + bias[e0 + i]) : 0u;
    }
    auto best_of = [&](u32& bk, int& bi, float& bv) {
        segment_best<PER>(key, bk, bi);
        bv = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) bv = i == bi ? v[i] : bv;
    };
    u32 best;
    int best_i;
    float best_v;
    best_of(best, best_i, best_v);
    float mine_v = 0.0f, den = 0.0f;
    i32 mine_e = -1;
    for (i32 j = 0; j < topk; ++j) {
        const u32 top = warp_max_u32(best);
        const int src = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;
        const i32 e = src * PER + __shfl_sync(0xffffffffu, best_i, src);
        const float val = __shfl_sync(0xffffffffu, best_v, src);
        if (lane == src) {
#pragma unroll
            for (int i = 0; i < PER; ++i) key[i] = i == best_i ? 0u : key[i];
        }
        best_of(best, best_i, best_v);
        den += val;
        if (lane == j) {
            mine_v = val;
            mine_e = e;
        }
    }
    if (lane < topk) {
        const float w = (norm_topk ? mine_v / (den + 1e-20f) : mine_v) * scale;
        ids[lane] = active ? mine_e : -1;
        if (LA) lane_addr[lane] = active ? table[mine_e] : 0;
        if (w_f32) static_cast<float*>(wts)[lane] = active ? w : 0.0f;
        else static_cast<u16*>(wts)[lane] = active ? f32_to_bf16(w) : (u16)0;
    }
}

// Sigmoid top-k routing of one token by one warp, its N ≤ 512 logits in `lg` (the launcher
// refuses more): ids, weights and, with LA, lane addresses as route_token_sigmoid_regs writes
// them.
template <bool LA>
CUPOOL_DEVICE void route_token_sigmoid(const float* lg, i32 N, i32 topk, int norm_topk,
                                       bool active, i32* ids, void* wts, int w_f32,
                                       const i64* table, i64* lane_addr, const float* bias,
                                       float scale) {
    if (N <= 128)
        route_token_sigmoid_regs<4, LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table,
                                        lane_addr, bias, scale);
    else if (N <= 256)
        route_token_sigmoid_regs<8, LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table,
                                        lane_addr, bias, scale);
    else if (N <= 512)
        route_token_sigmoid_regs<16, LA>(lg, N, topk, norm_topk, active, ids, wts, w_f32, table,
                                         lane_addr, bias, scale);
}
