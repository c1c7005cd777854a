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

CUPOOL_DEVICE u32 ld_u16_nc(const void* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

CUPOOL_DEVICE u32x4 ld_u32x4_cg(const void* p) {
    u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// A counter's value, every write made visible before it was released (at GPU scope) visible too.
CUPOOL_DEVICE int ld_acquire(const i32* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// About 32 ns of sleep in a polling loop (sm_70+).
CUPOOL_DEVICE void nap_32ns() { asm volatile("nanosleep.u32 32;"); }

CUPOOL_DEVICE u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

CUPOOL_DEVICE float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Two products of 16-bit floats, each rounded once. sm_80-89 have no bf16x2 multiply (PTX's
// mul.bf16x2 is sm_90+); there a · b + (-0) by fma.bf16x2 is the same result bit for bit: the
// exact product rounded once, a zero product keeps its sign (x + -0 = x), subnormal inputs kept.
template <bool BF>
CUPOOL_DEVICE u32 hmul2(u32 a, u32 b) {
    u32 d;
    if (BF)
#if __CUDA_ARCH__ >= 900
        asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
    else
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// (v.lo, v.lo) or (v.hi, v.hi): register halves, which the multiply can read as an operand
// selector instead of an instruction.
template <int HI>
CUPOOL_DEVICE u32 splat(u32 v) {
    u32 d;
    if (HI)
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\nmov.b32 %0, {h, h};\n}" : "=r"(d) : "r"(v));
    else
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\nmov.b32 %0, {l, l};\n}" : "=r"(d) : "r"(v));
    return d;
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
