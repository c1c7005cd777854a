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

// rawkernels/common.cuh's warp MMA (m16n8k16, row · col, bf16 in, float32 sums), emulated: each
// lane publishes its fragments, then works out its four outputs from all of them (the PTX ISA's
// fragment layout; a product's terms added in k order, where the tensor core's order is its own).
// `a` holds A[row][k] for row = lane / 4 (+ 8 in a[1], a[3]), k = 2·(lane % 4) (+ 8 in a[2],
// a[3]) and k + 1 in the high half; b0 / b1 B[k][n = lane / 4] for the same k (b1 the + 8);
// d[0], d[1] are C[lane / 4][2·(lane % 4), + 1], d[2], d[3] the same of row lane / 4 + 8.
inline void emu_warp_gather(unsigned lo, unsigned hi, unsigned (&all_lo)[32],
                            unsigned (&all_hi)[32]) {
    const long long v = (long long)((unsigned long long)hi << 32 | lo);
    emu_warp_exchange<long long>(v, [&](int, const long long* vals) {
        for (int i = 0; i < 32; ++i) {
            all_lo[i] = (unsigned)(unsigned long long)vals[i];
            all_hi[i] = (unsigned)((unsigned long long)vals[i] >> 32);
        }
        return 0LL;
    });
}

template <bool BF>
CUPOOL_DEVICE void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    static_assert(BF, "the emulation multiplies bf16 fragments");
    unsigned A[4][32], B[2][32];
    emu_warp_gather(a[0], a[1], A[0], A[1]);
    emu_warp_gather(a[2], a[3], A[2], A[3]);
    emu_warp_gather(b0, b1, B[0], B[1]);
    auto half = [](unsigned w, int k) {
        return __uint_as_float((k & 1 ? w >> 16 : w & 0xffffu) << 16);
    };
    auto a_at = [&](int row, int k) {
        return half(A[(row >= 8) + 2 * (k >= 8)][(row % 8) * 4 + (k % 8) / 2], k);
    };
    auto b_at = [&](int k, int n) { return half(B[k >= 8][n * 4 + (k % 8) / 2], k); };
    const int lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = d[e];
        for (int k = 0; k < 16; ++k) s += a_at(row, k) * b_at(k, col);
        d[e] = s;
    }
}

// bf16 <-> float32 as rawkernels/common.cuh: the high half of a float32; rounding to nearest
// even (a NaN stays a NaN).
CUPOOL_DEVICE float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

CUPOOL_DEVICE u16 f32_to_bf16(float f) {
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// a load through L2: blocks run one after another, so a plain load sees every earlier block's
// writes
CUPOOL_DEVICE float ld_f32_cg(const float* p) { return *p; }

CUPOOL_DEVICE void prefetch_l2(const void*) {}

CUPOOL_DEVICE void wait_for_producers() {}

CUPOOL_DEVICE void let_consumers_launch() {}

CUPOOL_DEVICE float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

CUPOOL_DEVICE int warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// rawkernels/common.cuh's redux.sync max over the warp's 32 lanes
CUPOOL_DEVICE u32 warp_max_u32(u32 v) {
    emu_check_mask(0xffffffffu);
    return emu_warp_exchange<u32>(v, [](int, const long long* vals) {
        u32 m = 0;
        for (int i = 0; i < 32; ++i) m = std::max(m, static_cast<u32>(vals[i]));
        return m;
    });
}

// A polling loop's pause: the other threads run (fibers switch here), so a wait that nothing will
// end shows as the emulation's deadlock instead of a hang.
inline void emu_pause() {
#if EMU_THREADS
    std::this_thread::yield();
#else
    emu_yield();
#endif
}

CUPOOL_DEVICE void nap_32ns() { emu_pause(); }

// rawkernels/common.cuh's loads that name a cache level or ordering: blocks run one after
// another, so plain loads see what they would
CUPOOL_DEVICE u32 ld_u16_nc(const void* p) { return *static_cast<const u16*>(p); }

CUPOOL_DEVICE u32x4 ld_u32x4_cg(const void* p) { return *static_cast<const u32x4*>(p); }

CUPOOL_DEVICE int ld_acquire(const i32* p) {
    return std::atomic_ref<i32>(*const_cast<i32*>(p)).load(std::memory_order_acquire);
}

// fp16 <-> float32 (round to nearest even, subnormals kept), as cvt.rn.f16.f32 and cvt.f32.f16
CUPOOL_DEVICE u16 f32_to_f16(float f) {
    const _Float16 h = static_cast<_Float16>(f);
    u16 u;
    std::memcpy(&u, &h, 2);
    return u;
}

CUPOOL_DEVICE float f16_to_f32(u16 u) {
    _Float16 h;
    std::memcpy(&h, &u, 2);
    return static_cast<float>(h);
}

// rawkernels/common.cuh's hmul2: each half's exact product (it fits float32: 8- or 11-bit
// significands) rounded once to the half type
template <bool BF>
CUPOOL_DEVICE u32 hmul2(u32 a, u32 b) {
    u32 d = 0;
    for (int i = 0; i < 2; ++i) {
        const u16 x = static_cast<u16>(a >> (16 * i)), y = static_cast<u16>(b >> (16 * i));
        const u16 r = BF ? f32_to_bf16(bf16_to_f32(x) * bf16_to_f32(y))
                         : f32_to_f16(f16_to_f32(x) * f16_to_f32(y));
        d |= static_cast<u32>(r) << (16 * i);
    }
    return d;
}

template <int HI>
CUPOOL_DEVICE u32 splat(u32 v) {
    const u32 h = HI ? v >> 16 : v & 0xffffu;
    return h | h << 16;
}
