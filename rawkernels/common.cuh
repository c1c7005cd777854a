// Shared helpers of every cupool kernel: fixed-width types, cache-hinted loads, warp sums.
//
// No CUDA or C++ library headers: NVRTC (through CuPy) and nvcc both compile this as is, so the
// kernels do not depend on where a CUDA toolkit's headers live on the user's machine.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define CUPOOL_DEVICE __device__ __forceinline__

struct alignas(16) u32x4 { u32 x, y, z, w; };

// 16-byte load that bypasses L1: weights and host rows are read once per step, so keeping them
// in L1 would only evict the activations that are reused.
CUPOOL_DEVICE u32x4 ld_stream16(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Plain 16-byte store (the rows written here are read by the next kernel, so they may stay in L2).
CUPOOL_DEVICE void st16(void* p, u32x4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// D += A(16x16, row) · B(16x8, col), fp16 or bf16 inputs, fp32 accumulate. Not volatile: it
// touches no memory, so the compiler may schedule the fragment loads of later tiles around it.
template <bool BF>
CUPOOL_DEVICE void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (BF)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16 <-> float32: a bf16 is the high half of a float32 (exact); rounding to bf16 is to nearest
// even, as torch rounds.
CUPOOL_DEVICE float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

CUPOOL_DEVICE u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

CUPOOL_DEVICE float ld_f32_cg(const float* p) {     // L2 only: data written by other blocks
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// A hint that the 128-byte line at p will be read soon: fetched into L2, no register held.
CUPOOL_DEVICE void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// Programmatic dependent launch (sm_90 and newer). A decode step is a chain of short kernels,
// each reading the one before's output; launched as a dependent (`cupool.kernels.launch(...,
// dependent=True)`), a kernel starts while the one before it still runs and does the work that
// needs none of that output (weight loads, L2 prefetches) before `wait_for_producers`, which
// returns once every earlier kernel of the stream has finished and its writes are visible.
// `let_consumers_launch` lets the next dependent start its own early part. The rule that keeps
// this safe: a kernel launched as a dependent calls `let_consumers_launch` only after
// `wait_for_producers`, so a dependent's early part runs beside at most one unfinished kernel and
// may read anything older than that one; before its wait it writes nothing. Both are no-ops in a
// launch that did not ask for it, and before sm_90 (where the launcher never asks).
CUPOOL_DEVICE void wait_for_producers() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

CUPOOL_DEVICE void let_consumers_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

CUPOOL_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The largest v of the warp's lanes, in one instruction (sm_80 and newer).
CUPOOL_DEVICE u32 warp_max_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

CUPOOL_DEVICE int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Exclusive prefix sum of one int per thread over the whole block (blockDim.x a multiple of 32,
// at most 1024). `scratch` holds 33 ints of shared memory; `total` receives the block's sum.
// Every thread of the block must call it (it synchronises).
CUPOOL_DEVICE int block_exclusive_scan(int v, int* scratch, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();                         // scratch may still be read by a previous call
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nw ? scratch[lane] : 0;
        int wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += n;
        }
        scratch[lane] = wi - w;              // exclusive prefix of warp sums
        if (lane == 31) scratch[32] = wi;
    }
    __syncthreads();
    const int out = scratch[warp] + incl - v;
    *total = scratch[32];
    return out;
}
