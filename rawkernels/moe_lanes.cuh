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
