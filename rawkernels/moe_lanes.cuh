// What route_decode (moe_align.cu) and moe_decode share: router weights read in their own dtype
// and the grouping of decode lanes into units by the address of their expert's row.
//
// Include after the macros NT and W_DTYPE.
#pragma once
#include "common.cuh"
#include "mma_fp4.cuh"
#include "block_scan.cuh"

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

// Units of decode lanes: lanes arrive with the address the plan step gave them (bank row, staging
// row, or a host UVA address; 0 = padding) and, optionally, lane_fresh (1: the row is being
// copied in this step). Lanes with the same address are one expert; units of at most NT lanes.
// Units of rows already in place come first, then units of fresh rows, each part in
// first-occurrence order; lanes keep lane order within a unit. One lane per thread (W ≤
// blockDim.x). Up to 32 lanes, warp 0 groups them with warp instructions (match, shuffles) while
// the other warps wait at one barrier; past that, O(W) comparisons per lane in shared memory and
// two block scans. Every thread of the block calls it; its outputs are visible to the whole block
// when it returns.
//   s_addr: blockDim.x i64 and s_base: blockDim.x ints of shared scratch; scan: 33 ints.
//   Outputs (global or shared): lane_w[W] (0 for padding and rejected lanes), unit_addr,
//   unit_lanes[u * NT + slot], unit_count; *held / *total: units in place / all units (written
//   by thread 0 at least: a block that reads them in other threads passes shared memory).
//   A non-finite weight on a routed lane sets ERR_BAD_WEIGHT in *error (when flag_errors) and
//   the lane becomes padding.

// Lane i's address (0: padding, or a non-finite weight, rejected) and whether its row is fresh;
// writes lane_w[i].
CUPOOL_DEVICE i64 take_lane(int i, const i64* __restrict__ lane_addr,
                            const i32* __restrict__ lane_fresh, const void* __restrict__ topk_w,
                            float* lane_w, i32* error, bool flag_errors, bool* fresh) {
    i64 a = lane_addr[i];
    *fresh = lane_fresh != nullptr && lane_fresh[i] != 0;
    const float w = load_weight(topk_w, i);
    if (a != 0 && !finite(w)) {
        if (flag_errors) atomicOr(error, ERR_BAD_WEIGHT);
        a = 0;
    }
    lane_w[i] = a != 0 ? w : 0.0f;
    return a;
}

// group_lanes for W ≤ 32, by warp 0: the lanes of one address are one __match_any_sync; held and
// fresh unit counts are scanned together (fresh in the high half-word).
template <class LaneT, class CountT>
CUPOOL_DEVICE void group_lanes_warp(const i64* __restrict__ lane_addr,
                                    const i32* __restrict__ lane_fresh,
                                    const void* __restrict__ topk_w, int W, float* lane_w,
                                    i64* unit_addr, LaneT* unit_lanes, CountT* unit_count,
                                    int* held, int* total, i32* error, bool flag_errors) {
    const int i = threadIdx.x;
    i64 a = 0;
    bool fresh = false;
    if (i < W) a = take_lane(i, lane_addr, lane_fresh, topk_w, lane_w, error, flag_errors, &fresh);
    const u32 same = __match_any_sync(0xffffffffu, (unsigned long long)a);
    const int pos = __popc(same & ((1u << i) - 1u)), size = __popc(same);
    const int units = (a != 0 && pos == 0) ? (size + NT - 1) / NT : 0;
    const int v = fresh ? units << 16 : units;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (i >= o) incl += n;
    }
    const int all = __shfl_sync(0xffffffffu, incl, 31), n_held = all & 0xffff;
    const int before = incl - v;
    const int base = fresh ? n_held + (before >> 16) : (before & 0xffff);
    const int first_base = __shfl_sync(0xffffffffu, base, __ffs(same) - 1);
    if (a != 0) {
        const int u = first_base + pos / NT, slot = pos % NT;
        unit_lanes[u * NT + slot] = (LaneT)i;
        if (slot == 0) {
            unit_addr[u] = a;
            unit_count[u] = (CountT)min(NT, size - (pos / NT) * NT);
        }
    }
    *held = n_held;
    *total = n_held + (all >> 16);
}

template <class LaneT, class CountT>
CUPOOL_DEVICE void group_lanes(const i64* __restrict__ lane_addr, const i32* __restrict__ lane_fresh,
                               const void* __restrict__ topk_w, int W, i64* s_addr, int* s_base,
                               int* scan, float* lane_w, i64* unit_addr, LaneT* unit_lanes,
                               CountT* unit_count, int* held, int* total, i32* error,
                               bool flag_errors) {
    const int i = threadIdx.x;
    if (W <= 32) {
        if (i < 32)
            group_lanes_warp(lane_addr, lane_fresh, topk_w, W, lane_w, unit_addr, unit_lanes,
                             unit_count, held, total, error, flag_errors);
        __syncthreads();
        return;
    }
    i64 a = 0;
    bool fresh = false;
    if (i < W) a = take_lane(i, lane_addr, lane_fresh, topk_w, lane_w, error, flag_errors, &fresh);
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
    if (i == 0) {             // one writer (every thread holds the same sums)
        *held = n_held;
        *total = n_held + n_fresh;
    }
    __syncthreads();          // the outputs visible to the block, as on the warp path
}
