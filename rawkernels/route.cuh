// What the router's epilogue (dense_gemv.cu, EPI 2) and moe_decode's ROUTE build share: bf16
// words as floats, and softmax top-k routing of one token by one warp. The routing rule: softmax
// over the N logits (float32) → top-k (NaN counts as largest, ties go to the lower expert, as a
// stable descending sort) → divided by their sum when norm_topk → weights (bf16, or float32 with
// w_f32, as the model's router returns them); a token that is not active gets ids −1 and weights
// 0 (padding lanes for the pool). With LA the lanes' row addresses too: lane_addr[j] = table[id]
// (0 for an inactive token).
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

// A probability's sort key for the top-k, as an unsigned int: a NaN above every probability (NaN
// counts as largest), an entry already taken (−1) below all (0); otherwise p ≥ 0, whose float
// bits order as the floats do.
CUPOOL_DEVICE u32 route_key(float v) {
    return v != v ? __float_as_uint(2.0f) + 1u : v < 0.0f ? 0u : __float_as_uint(v) + 1u;
}

// Top-k routing of one token by one warp, its N logits in `lg` (shared memory; overwritten with
// the probabilities, then with −1 where taken). ids [topk], wts [topk] (float32 with w_f32, else
// bf16) and, with LA, lane_addr [topk] are written by lanes 0 .. topk − 1 (any memory space);
// `table` may be in shared or global memory. Each lane reads its table entry once, after the
// rounds: a read inside them (predicated on the lane that took the round) is one load a round
// into the same register, which the hardware completes one after another, a round trip each.
//
// The softmax runs over e = lane + 32i; the top-k over contiguous segments, lane l holding
// [l·per, l·per + per), and each lane keeps its segment's best (largest key, the lowest e among
// equal keys) in registers. A round is then one warp max of the lanes' keys (redux), the lowest
// lane holding it (a ballot: segments are in e order, so that is the lowest e of the largest key,
// the rule of a stable descending sort), and that lane alone marks its entry and rescans its
// segment: no pass over all N entries a round.
template <bool LA>
CUPOOL_DEVICE void route_token(float* lg, i32 N, i32 topk, int norm_topk, bool active,
                               i32* ids, void* wts, int w_f32, const i64* table,
                               i64* lane_addr) {
    const int lane = threadIdx.x & 31;
    float m = -__int_as_float(0x7f800000);
    for (i32 e = lane; e < N; e += 32) m = fmaxf(m, lg[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
    for (i32 e = lane; e < N; e += 32) s += expf(lg[e] - m);
    s = warp_sum(s);
    for (i32 e = lane; e < N; e += 32) lg[e] = expf(lg[e] - m) / s;
    __syncwarp();
    const i32 per = (N + 31) / 32, e0 = lane * per, e1 = min(N, e0 + per);
    u32 best = 0;                        // this segment's best key (0: none left) ...
    i32 best_e = N;                      // ... its entry
    float best_p = 0.0f;                 // ... and its probability
    auto rescan = [&]() {
        best = 0;
        for (i32 e = e0; e < e1; ++e) {
            const float v = lg[e];
            const u32 key = route_key(v);
            if (key > best) { best = key; best_e = e; best_p = v; }
        }
    };
    rescan();
    float mine_p = 0.0f, total = 0.0f;
    i32 mine_e = -1;
    for (i32 j = 0; j < topk; ++j) {
        const u32 top = warp_max_u32(best);
        const int src = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;
        const i32 e = __shfl_sync(0xffffffffu, best_e, src);
        const float p = __shfl_sync(0xffffffffu, best_p, src);
        if (lane == src) {               // only this lane's segment changes
            lg[e] = -1.0f;
            rescan();
        }
        total += p;
        if (lane == j) {
            mine_p = p;
            mine_e = e;
        }
    }
    if (lane < topk) {
        const float w = norm_topk ? mine_p / total : mine_p;
        ids[lane] = active ? mine_e : -1;
        if (LA) lane_addr[lane] = active ? table[mine_e] : 0;
        if (w_f32) static_cast<float*>(wts)[lane] = active ? w : 0.0f;
        else static_cast<u16*>(wts)[lane] = active ? f32_to_bf16(w) : (u16)0;
    }
}
