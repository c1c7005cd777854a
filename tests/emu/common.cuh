// CPU stand-in for rawkernels/common.cuh (tests/emu): the same types and helpers without PTX.
// The emulation harness puts this file next to a copy of the kernel source, so the kernel's
// `#include "common.cuh"` finds it instead of the real one.
#pragma once
#include "cuda_emu.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define CUPOOL_DEVICE __device__ __forceinline__

struct alignas(16) u32x4 { u32 x, y, z, w; };

CUPOOL_DEVICE u32x4 ld_stream16(const void* p) { return *static_cast<const u32x4*>(p); }

CUPOOL_DEVICE void st16(void* p, u32x4 v) { *static_cast<u32x4*>(p) = v; }

// bf16 <-> float32 as rawkernels/common.cuh: the high half of a float32; rounding to nearest
// even (a NaN stays a NaN).
CUPOOL_DEVICE float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

CUPOOL_DEVICE u16 f32_to_bf16(float f) {
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

CUPOOL_DEVICE void prefetch_l2(const void*) {}

CUPOOL_DEVICE void wait_for_producers() {}

CUPOOL_DEVICE void let_consumers_launch() {}

CUPOOL_DEVICE float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
