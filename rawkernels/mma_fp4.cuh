// NVFP4 weights -> fp16 or bf16 tensor-core fragments, and the m16n8k16 mma that consumes them.
//
// Every dequantised weight is exact: E2M1 (≤ 2 significant bits) times an E4M3 block scale (≤ 4
// bits) fits both fp16's 11-bit and bf16's 8-bit significand, and the scaling below keeps every
// product a normal number (fp16 also keeps subnormals exactly).
//
// fp16 (BF = false): an E2M1 code (s e1 e0 m) placed as fp16 bits s.00e1e0.m000000000 is the
// E2M1 value times 2^-14 (e = 0 lands on fp16 subnormals, which is exactly E2M1's own subnormal
// 0.5·m). Multiplying by (block scale · 2^7) is exact; the fp32 epilogue multiplies by 2^7 · the
// global scale. Activations must then be fp16: bf16 ones are brought there with a power-of-two
// scale per row.
// bf16 (BF = true): the code placed as bf16 bits s.0000000e1.e0m000000 is E2M1 · 2^-126 (e = 0
// again on subnormals); times (block scale · 2^118) that is E2M1 · scale · 2^-8, a normal bf16;
// the epilogue multiplies by 2^8 · the global scale. bf16 activations then go in as they are.
#pragma once
#include "common.cuh"

template <int S>
CUPOOL_DEVICE u32 shift_left(u32 w) { return S >= 0 ? w << (S & 31) : w >> ((-S) & 31); }

// Slot pair J (lo = slot J, hi = slot J+4) of a layout word -> fp16x2 of E2M1 · 2^-14 or bf16x2
// of E2M1 · 2^-126. Slot 4h + J keeps its magnitude e1·e0·m at bits 16h + 3J … (m lowest) and its
// sign at bit 16h + 12 + (J xor 1) (layout.py); they go to bits MAG … and 15 of each half. Where
// both need the same shift (J = 1 and 2 for bf16) one shift and one mask do it; the other
// shifts are shared between registers (bf16: 5 shifts and 6 masks for the word's 4 registers,
// fp16: 5 and 8). J is a compile-time constant so the shifts are immediates.
template <bool BF, int J>
CUPOOL_DEVICE u32 fp4x2_raw(u32 w) {
    constexpr u32 MAG = BF ? 0x01C001C0u : 0x0E000E00u;       // e1 e0 m of each half
    constexpr int MAG_SHIFT = (BF ? 6 : 9) - 3 * J;
    constexpr int SIGN_SHIFT = 3 - (J ^ 1);                   // bit 12 + (J xor 1) -> 15
    if constexpr (MAG_SHIFT == SIGN_SHIFT)
        return shift_left<MAG_SHIFT>(w) & (MAG | 0x80008000u);
    else
        return (shift_left<MAG_SHIFT>(w) & MAG) | (shift_left<SIGN_SHIFT>(w) & 0x80008000u);
}

// E4M3 block scales without a conversion instruction: the 7 magnitude bits e3e2e1e0.m2m1m0
// shifted left by 7 are fp16 bits of (E4M3 value · 2^-8), and one multiply by 2^15 gives value ·
// 2^7 exactly (448 · 2^7 = 57344 < 65504); shifted left by 4 they are bf16 bits of (value ·
// 2^-120), and multiplies by 2^120 and 2^118 give value · 2^118 (< 2^127). Subnormal E4M3 lands on
// subnormals with the same ratio. Scales are non-negative, so the sign bit is dropped; a NaN
// scale (0x7F) would read as 480: the loaders refuse non-finite and negative scales first.
#define FP16X2_2P15 0x78007800u
#define BF16X2_2P120 0x7B807B80u
#define BF16X2_2P118 0x7A807A80u

// A lane's two scale bytes of a chunk (byte 0: row g, byte 1: row g+8; layout.py) -> one word
// in the fragment type, row g's scale in the low half and row g+8's in the high half, scaled as
// above: one byte permute spreads the bytes to the halves, one shift puts their bits in place.
template <bool BF>
CUPOOL_DEVICE u32 scale_pair(u32 pair) {
    const u32 spread = __byte_perm(pair, 0u, 0x4140);   // bytes (b0, 0, b1, 0)
    if (BF) return hmul2<true>(hmul2<true>((spread << 4) & 0x07F007F0u, BF16X2_2P120), BF16X2_2P118);
    return hmul2<false>((spread << 7) & 0x3F803F80u, FP16X2_2P15);
}

// What the fp32 epilogue multiplies the sums by, besides the global scale.
template <bool BF>
CUPOOL_DEVICE float dequant_unscale() { return BF ? 256.0f : 128.0f; }

// A fragments of one 16x16 k-tile: word w (this lane's 8 codes) with the scale pair of rows g
// (low half) and g+8 (high half), which is the same for all four k-tiles of a chunk.
template <bool BF>
CUPOOL_DEVICE void dequant_tile(u32 w, u32 s, u32 (&a)[4]) {
    const u32 s_lo = splat<0>(s);                       // row g
    const u32 s_hi = splat<1>(s);                       // row g+8
    a[0] = hmul2<BF>(fp4x2_raw<BF, 0>(w), s_lo);        // row g,   k-slots 2t, 2t+1
    a[1] = hmul2<BF>(fp4x2_raw<BF, 1>(w), s_hi);        // row g+8, k-slots 2t, 2t+1
    a[2] = hmul2<BF>(fp4x2_raw<BF, 2>(w), s_lo);        // row g,   k-slots 2t+8, 2t+9
    a[3] = hmul2<BF>(fp4x2_raw<BF, 3>(w), s_hi);        // row g+8, k-slots 2t+8, 2t+9
}

// max that keeps NaN (fmaxf drops it): a NaN activation must reach the output, not vanish.
CUPOOL_DEVICE float nan_max(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
}

// Power-of-two scale that brings a row whose largest magnitude is `amax` to [2^13, 2^14) in
// fp16 (exact for bf16 values within 2^27 of the row's largest). 1 for zero, Inf or NaN rows,
// so non-finite values pass through and show up in the output.
CUPOOL_DEVICE float pow2_scale(float amax) {
    const u32 bits = __float_as_uint(amax);
    const int e = (int)((bits >> 23) & 0xff);
    if (amax == 0.0f || e == 0xff) return 1.0f;
    int p = (e - 127) - 13;                      // amax in [2^(p+13), 2^(p+14))
    p = p < -126 ? -126 : p;
    return __uint_as_float((u32)(p + 127) << 23);
}
