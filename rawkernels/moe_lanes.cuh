// What route_decode (moe_align.cu) and moe_decode share: router weights read in their own dtype,
// the activation prep (a per-token power-of-two scale and fp16 x/s), and the grouping of decode
// lanes into units by the address of their expert's row.
//
// Include after the macros NT, HP, IN_BF16, W_DTYPE and XVEC.
#pragma once
#include "common.cuh"
#include "mma_fp4.cuh"

#define ERR_BAD_ID 1
#define ERR_BAD_WEIGHT 2

CUPOOL_DEVICE bool finite(float w) { return (__float_as_uint(w) & 0x7f800000u) != 0x7f800000u; }

// Router weight of lane i as float, from the router's own dtype (decode: no cast launch).
#ifndef W_DTYPE
#define W_DTYPE 0         // topk weights: 0 float32, 1 bfloat16, 2 float16
#endif
CUPOOL_DEVICE float load_weight(const void* w, int i) {
#if W_DTYPE == 0
    return reinterpret_cast<const float*>(w)[i];
#elif W_DTYPE == 1
    return bf16_to_f32(reinterpret_cast<const u16*>(w)[i]);
#else
    return f16_to_f32(reinterpret_cast<const u16*>(w)[i]);
#endif
}

#ifndef XVEC
#define XVEC 0            // 1: H % 8 == 0 and x 16-byte aligned (the launcher checks)
#endif
#define XLOADS 8          // 16-byte loads in flight per lane: a 2048-wide row in one round trip

CUPOOL_DEVICE float in_to_f32(u16 h) {
#if IN_BF16
    return bf16_to_f32(h);
#else
    return f16_to_f32(h);
#endif
}

// One warp brings token row t to fp16: xh[t] = x[t] / s, s = pow2_scale(max |x[t]|), zero-padded
// to HP. With XVEC the row is read in 16-byte words, XLOADS per lane in flight, twice (the second
// pass hits L1).
CUPOOL_DEVICE void prep_row(const u16* __restrict__ row, i32 H, u16* __restrict__ out,
                            float* __restrict__ scale, int lane) {
    float m = 0.0f;
#if XVEC
    for (int k0 = lane * 8; k0 < H; k0 += 32 * 8 * XLOADS) {
        u32x4 v[XLOADS];
#pragma unroll
        for (int j = 0; j < XLOADS; ++j) {
            const int k = k0 + j * 256;
            v[j] = k < H ? *reinterpret_cast<const u32x4*>(row + k) : u32x4{0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int j = 0; j < XLOADS; ++j) {
            const u32 words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                m = nan_max(m, fabsf(in_to_f32((u16)(words[q] & 0xffffu))));
                m = nan_max(m, fabsf(in_to_f32((u16)(words[q] >> 16))));
            }
        }
    }
#else
    for (int k = lane; k < H; k += 32) m = nan_max(m, fabsf(in_to_f32(row[k])));
#endif
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = pow2_scale(m), inv = 1.0f / s;
#if XVEC
    for (int k = lane * 8; k < HP; k += 256) {
        u32x4 v = {0u, 0u, 0u, 0u};
        if (k < H) v = *reinterpret_cast<const u32x4*>(row + k);
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 lo = f32_to_f16(in_to_f32((u16)(words[q] & 0xffffu)) * inv);
            const u32 hi = f32_to_f16(in_to_f32((u16)(words[q] >> 16)) * inv);
            words[q] = lo | (hi << 16);
        }
        *reinterpret_cast<u32x4*>(out + k) = u32x4{words[0], words[1], words[2], words[3]};
    }
#else
    for (int k = lane; k < HP; k += 32) out[k] = f32_to_f16(k < H ? in_to_f32(row[k]) * inv : 0.0f);
#endif
    if (lane == 0) *scale = s;
}

// Units of decode lanes: lanes arrive with the address the plan step gave them (bank row, staging
// row, or a host UVA address; 0 = padding) and, optionally, lane_fresh (1: the row is being
// copied in this step). Lanes with the same address are one expert; units of at most NT lanes.
// Units of rows already in place come first, then units of fresh rows, each part in
// first-occurrence order; lanes keep lane order within a unit. One lane per thread (W ≤
// blockDim.x); O(W) comparisons per lane in shared memory. Every thread of the block calls it.
//   s_addr: blockDim.x i64 and s_base: blockDim.x ints of shared scratch; scan: 33 ints.
//   Outputs (global or shared): lane_w[W] (0 for padding and rejected lanes), unit_addr,
//   unit_lanes[u * NT + slot], unit_count; *held / *total: units in place / all units.
//   A non-finite weight on a routed lane sets ERR_BAD_WEIGHT in *error (when flag_errors) and
//   the lane becomes padding.
template <class LaneT, class CountT>
CUPOOL_DEVICE void group_lanes(const i64* __restrict__ lane_addr, const i32* __restrict__ lane_fresh,
                               const void* __restrict__ topk_w, int W, i64* s_addr, int* s_base,
                               int* scan, float* lane_w, i64* unit_addr, LaneT* unit_lanes,
                               CountT* unit_count, int* held, int* total, i32* error,
                               bool flag_errors) {
    const int i = threadIdx.x;
    i64 a = 0;
    bool fresh = false;
    if (i < W) {
        a = lane_addr[i];
        fresh = lane_fresh != nullptr && lane_fresh[i] != 0;
        const float w = load_weight(topk_w, i);
        if (a != 0 && !finite(w)) {
            if (flag_errors) atomicOr(error, ERR_BAD_WEIGHT);
            a = 0;
        }
        lane_w[i] = a != 0 ? w : 0.0f;
    }
    s_addr[i] = a;
    __syncthreads();
    int pos = 0, size = 0, first = i;
    if (a != 0) {
        for (int j = 0; j < W; ++j) {
            if (s_addr[j] == a) {
                ++size;
                if (j < i) { ++pos; first = min(first, j); }
            }
        }
    }
    const int units = (a != 0 && pos == 0) ? (size + NT - 1) / NT : 0;
    int n_held, n_fresh;
    const int base_held = block_exclusive_scan(fresh ? 0 : units, scan, &n_held);
    const int base_fresh = block_exclusive_scan(fresh ? units : 0, scan, &n_fresh);
    if (units) s_base[i] = fresh ? n_held + base_fresh : base_held;
    __syncthreads();
    if (a != 0) {
        const int u = s_base[first] + pos / NT, slot = pos % NT;
        unit_lanes[u * NT + slot] = (LaneT)i;
        if (slot == 0) {
            unit_addr[u] = a;
            unit_count[u] = (CountT)min(NT, size - (pos / NT) * NT);
        }
    }
    *held = n_held;
    *total = n_held + n_fresh;
}
