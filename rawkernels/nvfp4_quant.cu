// NVFP4 quantization of M weight matrices [N, K] (ModelOpt's definition), bit-identical to the torch
// reference `cupool.nvfp4.quantize` (its module docstring is the spec; this file follows it step by
// step). Input dtypes: float32, float16, bfloat16, read as raw bits.
//
// Work sketch (two launches on torch's stream, launcher: cupool/ops/nvfp4_quant.py):
//   1. nvfp4_amax_<dt>   grid (x: slices of a matrix, y: matrices). Each thread keeps UNROLL 16-byte
//      loads in flight, folds them into max|w| as float32 bits, and each block gives its maximum to
//      amax_bits[m] with one atomicMax. Non-finite values add to bad[0] and atomicMin their flat
//      index into bad[1]; the launcher reads both back and raises before pass 2 runs.
//   2. nvfp4_quant_<dt>  one thread per 16-element block: loads its 16 values, computes the block
//      scale and 16 codes, writes 8 packed bytes and 1 scale byte; thread (0, 0) of each matrix
//      writes the global scale.
// Invariants: the launcher zeroes amax_bits and sets bad = {0, UINT64_MAX} before pass 1; pass 2
// only reads amax_bits. Input rows are K contiguous elements at any matrix / row stride that is a
// multiple of 16 bytes (a gate or up half of a fused gate_up weight is quantized where it lies);
// outputs are contiguous [M, N, K/2] and [M, N, K/16], written once each.
//
// Exactness: a max over non-negative floats is a max over their bit patterns, so amax is exact and
// independent of the reduction order. Every arithmetic step is one IEEE operation written as PTX
// (div.rn / mul.rn without .ftz): no compiler flag (fast math, ftz, FMA contraction) can change
// it. The helpers marked NVFP4_HD also compile for the host, where tests/nvfp4_host_harness.cu
// checks them bit for bit against the torch reference without a GPU.
#include "common.cuh"

#ifndef THREADS
#define THREADS 256
#endif
#ifndef UNROLL
#define UNROLL 4
#endif

#define NVFP4_HD __host__ __device__ __forceinline__

// Input element types (the launcher picks the kernel by name).
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

NVFP4_HD u32 f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    u32 u;
    __builtin_memcpy(&u, &f, 4);
    return u;
#endif
}

NVFP4_HD float u2f(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
#endif
}

// Correctly rounded float32 a / b and a * b with subnormals kept: the reference's `/` and `*`.
NVFP4_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a / b;
#endif
}

NVFP4_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a * b;
#endif
}

NVFP4_HD u32 max_u32(u32 a, u32 b) { return a > b ? a : b; }

// float16 bits -> float32, exact for every finite half (subnormals included): the 15 magnitude
// bits shifted into a float32 keep their meaning up to a factor 2^(127-15), which one exact
// multiplication by 2^112 removes (a subnormal half lands on a float32 subnormal first, hence
// mul_rn, which keeps subnormals). Infinities/NaN are never converted: pass 1 rejects them.
NVFP4_HD float f16_to_f32(u32 h) {
    const float mag = mul_rn(u2f((h & 0x7FFFu) << 13), 0x1p112f);
    return u2f(f2u(mag) | ((h & 0x8000u) << 16));
}

NVFP4_HD float bf16_to_f32(u32 b) { return u2f((b & 0xFFFFu) << 16); }

// float32 v >= 0 (or +inf) -> float8_e4m3fn bits, clamped to 448 then rounded to nearest even:
// the reference's torch.clamp(v, max=448).to(torch.float8_e4m3fn).
NVFP4_HD u32 e4m3_rne(float v) {
    u32 u = f2u(v);
    if (u >= 0x43E00000u) return 0x7Eu;            // >= 448 (+inf included): 448, the largest finite
    if (u >= 0x3C800000u) {                        // >= 2^-6: normal in E4M3
        // Round the 23-bit mantissa to 3 bits, ties to even; a carry moves into the exponent, which
        // is the correctly rounded result. Then rebias the exponent from 127 to 7.
        u += 0x7FFFFu + ((u >> 20) & 1u);
        return (u >> 20) - (120u << 3);
    }
    // Subnormal E4M3: multiples of 2^-9, i.e. round v·2^9 to an integer, ties to even (a result of 8
    // is 0x08 = 2^-6, the smallest normal, as it should be). v·2^9 = mant · 2^(e - 141).
    const u32 e = u >> 23;
    if (e < 117u) return 0u;                       // v < 2^-10 (or exactly half of 2^-9: tie to 0)
    const u32 mant = (u & 0x7FFFFFu) | 0x800000u;
    const u32 s = 141u - e;                        // 21..24
    const u32 q = mant >> s;
    const u32 rem = mant & ((1u << s) - 1u);
    const u32 half = 1u << (s - 1u);
    return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// float8_e4m3fn bits (0..0x7E, non-negative) -> float32, exact.
NVFP4_HD float e4m3_to_f32(u32 c) {
    const u32 e = c >> 3, m = c & 7u;
    if (e == 0u) return mul_rn((float)m, 0x1p-9f);
    return u2f(((e + 120u) << 23) | (m << 20));
}

// float32 x >= 0 (or +inf) -> code of the nearest E2M1 magnitude, ties to the even code, 7 above 6.
// The boundaries are the midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5; at a midpoint the even code of the
// two neighbours wins, i.e. `>=` where the upper neighbour is even.
NVFP4_HD u32 e2m1_magnitude(float x) {
    return (u32)(x > 0.25f) + (u32)(x >= 0.75f) + (u32)(x > 1.25f) + (u32)(x >= 1.75f) +
           (u32)(x > 2.5f) + (u32)(x >= 3.5f) + (u32)(x > 5.0f);
}

// Global scale of a matrix from max|w| (as float32 bits): amax / (6·448).
NVFP4_HD float global_scale(u32 amax_bits) { return div_rn(u2f(amax_bits), 2688.0f); }

// One 16-element block -> its scale byte and 16 codes (element i in bits 4(i%8).. of word i/8).
NVFP4_HD void quant_block16(const float* w, float g, u32& scale, u32& lo, u32& hi) {
    scale = 0u;
    lo = 0u;
    hi = 0u;
    if (f2u(g) == 0u) return;                      // all-zero matrix: scale 0, codes 0
    u32 bmax = 0u;
#pragma unroll
    for (int i = 0; i < 16; ++i) bmax = max_u32(bmax, f2u(w[i]) & 0x7FFFFFFFu);
    scale = e4m3_rne(div_rn(div_rn(u2f(bmax), 6.0f), g));
    const float d = mul_rn(e4m3_to_f32(scale), g);
    if (f2u(d) == 0u) return;                      // zero block or scale underflow: codes 0
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const u32 wb = f2u(w[i]);
        const u32 code = e2m1_magnitude(div_rn(u2f(wb & 0x7FFFFFFFu), d)) | ((wb >> 31) << 3);
        if (i < 8) lo |= code << (4 * i);
        else hi |= code << (4 * (i - 8));
    }
}

// --- per dtype: elements per 16-byte vector, magnitude bits, conversion ---------------------------
template <int DT> struct Elem;
template <> struct Elem<DT_F32> {
    static constexpr int per_vec = 4;
    static constexpr u32 inf_bits = 0x7F800000u;   // |bits| >= this: Inf or NaN
    NVFP4_HD static u32 at(const u32x4& v, int i) {
        return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
    }
    NVFP4_HD static u32 abs_bits(u32 b) { return b & 0x7FFFFFFFu; }
    NVFP4_HD static float to_f32(u32 b) { return u2f(b); }
};
struct Elem16 {   // fp16 and bf16: two elements a word, the sign in bit 15
    static constexpr int per_vec = 8;
    NVFP4_HD static u32 at(const u32x4& v, int i) {
        const u32 w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
        return (i & 1) ? (w >> 16) : (w & 0xFFFFu);
    }
    NVFP4_HD static u32 abs_bits(u32 b) { return b & 0x7FFFu; }
};
template <> struct Elem<DT_F16> : Elem16 {
    static constexpr u32 inf_bits = 0x7C00u;
    NVFP4_HD static float to_f32(u32 b) { return f16_to_f32(b); }
};
template <> struct Elem<DT_BF16> : Elem16 {
    static constexpr u32 inf_bits = 0x7F80u;
    NVFP4_HD static float to_f32(u32 b) { return bf16_to_f32(b); }
};

// max|element| of a vector in the dtype's own magnitude bits (ordered like the values).
template <int DT> NVFP4_HD u32 vec_absmax(const u32x4& v) {
    u32 m = 0u;
#pragma unroll
    for (int i = 0; i < Elem<DT>::per_vec; ++i) m = max_u32(m, Elem<DT>::abs_bits(Elem<DT>::at(v, i)));
    return m;
}

// Magnitude bits of the dtype -> float32 bits; monotonic on finite values, so max commutes with it.
template <int DT> NVFP4_HD u32 absmax_to_f32_bits(u32 a) { return f2u(Elem<DT>::to_f32(a)); }

// 16-byte load through the read-only path. L1 is allowed here (unlike ld_stream16): in pass 2 a
// thread reads its block as 2 or 4 adjacent vectors, and the later ones hit the lines the first
// one brought in.
CUPOOL_DEVICE u32x4 ld_nc16(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// --- pass 1: amax per matrix, non-finite census -----------------------------------------------------
template <int DT>
__device__ void amax_pass(const u8* __restrict__ x, i64 stride_m, i64 stride_n, i32 n_mat, i32 rows,
                          i32 k, u32* __restrict__ amax_bits, u64* __restrict__ bad) {
    constexpr int PV = Elem<DT>::per_vec;
    const u32 vecs_per_row = (u32)k / PV;
    const u32 per_mat = (u32)rows * vecs_per_row;  // < 2^31 (checked by the launcher)
    __shared__ u32 warp_max[THREADS / 32];
    for (i32 m = blockIdx.y; m < n_mat; m += gridDim.y) {
        const u8* xm = x + (i64)m * stride_m;
        u32 best = 0u;                             // max|w| of this thread, float32 bits
        for (u32 v0 = blockIdx.x * (THREADS * UNROLL) + threadIdx.x; v0 < per_mat;
             v0 += gridDim.x * (THREADS * UNROLL)) {
            u32x4 buf[UNROLL];
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const u32 v = v0 + j * THREADS;
                if (v < per_mat) {
                    const u32 r = v / vecs_per_row, c = v - r * vecs_per_row;
                    buf[j] = ld_nc16(xm + (i64)r * stride_n + (i64)c * 16);
                } else {
                    buf[j] = u32x4{0u, 0u, 0u, 0u};
                }
            }
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const u32 a = vec_absmax<DT>(buf[j]);
                if (a >= Elem<DT>::inf_bits) {     // rare: count and locate, the launcher raises
                    const u32 v = v0 + j * THREADS;
                    const u32 r = v / vecs_per_row, c = v - r * vecs_per_row;
                    const u64 base = ((u64)m * rows + r) * (u64)k + (u64)c * PV;
                    u64 n_bad = 0, first = ~0ull;
                    for (int i = 0; i < PV; ++i) {
                        if (Elem<DT>::abs_bits(Elem<DT>::at(buf[j], i)) >= Elem<DT>::inf_bits) {
                            ++n_bad;
                            if (first == ~0ull) first = base + i;
                        }
                    }
                    atomicAdd(&bad[0], (unsigned long long)n_bad);
                    atomicMin(&bad[1], (unsigned long long)first);
                } else {
                    best = max_u32(best, absmax_to_f32_bits<DT>(a));
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best = max_u32(best, __shfl_xor_sync(0xffffffffu, best, o));
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 b = 0u;
#pragma unroll
            for (int w = 0; w < THREADS / 32; ++w) b = max_u32(b, warp_max[w]);
            if (b) atomicMax(&amax_bits[m], b);
        }
        __syncthreads();                           // warp_max is reused for the next matrix
    }
}

// --- pass 2: block scales and codes -----------------------------------------------------------------
template <int DT>
__device__ void quant_pass(const u8* __restrict__ x, i64 stride_m, i64 stride_n, i32 n_mat,
                           i32 rows, i32 k, const u32* __restrict__ amax_bits,
                           u8* __restrict__ packed, u8* __restrict__ scales,
                           float* __restrict__ gscale) {
    constexpr int PV = Elem<DT>::per_vec;
    constexpr int VECS = 16 / PV;                  // 16-byte loads per block: 4 (f32) or 2
    const u32 kblocks = (u32)k / 16;
    const u32 per_mat = (u32)rows * kblocks;       // < 2^31 (checked by the launcher)
    for (i32 m = blockIdx.y; m < n_mat; m += gridDim.y) {
        const float g = global_scale(amax_bits[m]);
        if (blockIdx.x == 0 && threadIdx.x == 0) gscale[m] = g;
        const u8* xm = x + (i64)m * stride_m;
        for (u32 b = blockIdx.x * THREADS + threadIdx.x; b < per_mat; b += gridDim.x * THREADS) {
            const u32 r = b / kblocks, kb = b - r * kblocks;
            const u8* src = xm + (i64)r * stride_n + (i64)kb * (16 * 16 / PV);
            u32x4 v[VECS];
#pragma unroll
            for (int j = 0; j < VECS; ++j) v[j] = ld_nc16(src + 16 * j);
            float w[16];
#pragma unroll
            for (int j = 0; j < VECS; ++j)
#pragma unroll
                for (int i = 0; i < PV; ++i) w[j * PV + i] = Elem<DT>::to_f32(Elem<DT>::at(v[j], i));
            u32 sc, lo, hi;
            quant_block16(w, g, sc, lo, hi);
            const u64 o = (u64)m * per_mat + b;
            *reinterpret_cast<u64*>(packed + 8 * o) = (u64)lo | ((u64)hi << 32);
            scales[o] = (u8)sc;
        }
    }
}

// --- entry points ----------------------------------------------------------------------------------
// x: first element of matrix 0; strides in bytes; rows = N; k = K (a multiple of 16).
#define NVFP4_AMAX_ARGS                                                                          \
    const u8 *__restrict__ x, i64 stride_m, i64 stride_n, i32 n_mat, i32 rows, i32 k,            \
        u32 *__restrict__ amax_bits, u64 *__restrict__ bad
#define NVFP4_QUANT_ARGS                                                                         \
    const u8 *__restrict__ x, i64 stride_m, i64 stride_n, i32 n_mat, i32 rows, i32 k,            \
        const u32 *__restrict__ amax_bits, u8 *__restrict__ packed, u8 *__restrict__ scales,     \
        float *__restrict__ gscale

extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_amax_f32(NVFP4_AMAX_ARGS) {
    amax_pass<DT_F32>(x, stride_m, stride_n, n_mat, rows, k, amax_bits, bad);
}
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_amax_f16(NVFP4_AMAX_ARGS) {
    amax_pass<DT_F16>(x, stride_m, stride_n, n_mat, rows, k, amax_bits, bad);
}
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_amax_bf16(NVFP4_AMAX_ARGS) {
    amax_pass<DT_BF16>(x, stride_m, stride_n, n_mat, rows, k, amax_bits, bad);
}
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_quant_f32(NVFP4_QUANT_ARGS) {
    quant_pass<DT_F32>(x, stride_m, stride_n, n_mat, rows, k, amax_bits, packed, scales, gscale);
}
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_quant_f16(NVFP4_QUANT_ARGS) {
    quant_pass<DT_F16>(x, stride_m, stride_n, n_mat, rows, k, amax_bits, packed, scales, gscale);
}
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_quant_bf16(NVFP4_QUANT_ARGS) {
    quant_pass<DT_BF16>(x, stride_m, stride_n, n_mat, rows, k, amax_bits, packed, scales, gscale);
}
