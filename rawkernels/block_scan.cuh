// A block-wide prefix sum (moe_lanes.cuh's lane grouping, moe_align.cu): plain CUDA, no PTX, so
// the CPU emulation (tests/emu) runs this very code.
#pragma once
#include "common.cuh"

// Exclusive prefix sum of one value per thread (int, or u64: sample.cu's fixed-point masses) over
// the whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 33 values of shared
// memory; `total` receives the block's sum. Every thread of the block must call it (it
// synchronises).
template <class T>
CUPOOL_DEVICE T block_exclusive_scan(T v, T* scratch, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();                         // scratch may still be read by a previous call
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nw ? scratch[lane] : T(0);
        T wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T n = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += n;
        }
        scratch[lane] = wi - w;              // exclusive prefix of warp sums
        if (lane == 31) scratch[32] = wi;
    }
    __syncthreads();
    const T out = scratch[warp] + incl - v;
    *total = scratch[32];
    return out;
}
