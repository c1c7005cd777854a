// Plain C definitions of the AVX-512 (and AVX2) intrinsics host_experts.c's AVX-512 loop uses, with
// the names and operand orders of <immintrin.h> and the semantics of Intel's intrinsics guide. A
// build with -DHX_EMULATE_AVX512 (isa="avx512-emulated") includes this instead of <immintrin.h>,
// so a CPU without AVX-512 runs that loop's indexing, lookups and accumulation order one lane at a
// time; where the CPU has AVX-512, the tests compare the real build with the other builds as well.
// Only host_experts.c includes it; nothing here is fast.
#ifndef HX_AVX512_EMULATED_H
#define HX_AVX512_EMULATED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { float f[8]; } __m256;
typedef struct { uint8_t b[64]; } __m512i;
typedef struct { float f[16]; } __m512;

static inline __m256 _mm256_loadu_ps(const float* p) {
    __m256 r;
    memcpy(r.f, p, sizeof r.f);
    return r;
}

static inline __m256 _mm256_mul_ps(__m256 a, __m256 b) {
    __m256 r;
    for (int i = 0; i < 8; ++i) r.f[i] = a.f[i] * b.f[i];
    return r;
}

static inline __m512i _mm512_loadu_si512(const void* p) {
    __m512i r;
    memcpy(r.b, p, 64);
    return r;
}

static inline __m512i _mm512_set1_epi8(char v) {
    __m512i r;
    memset(r.b, (uint8_t)v, 64);
    return r;
}

static inline __m512 _mm512_setzero_ps(void) {
    __m512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = 0.0f;
    return r;
}

static inline void _mm512_storeu_ps(float* p, __m512 a) { memcpy(p, a.f, sizeof a.f); }

// the upper 8 lanes are undefined in the intrinsic; zero here
static inline __m512 _mm512_castps256_ps512(__m256 a) {
    __m512 r = _mm512_setzero_ps();
    memcpy(r.f, a.f, sizeof a.f);
    return r;
}

// dst.byte[j] = a.byte[idx.byte[j] & 63] (VBMI vpermb)
static inline __m512i _mm512_permutexvar_epi8(__m512i idx, __m512i a) {
    __m512i r;
    for (int j = 0; j < 64; ++j) r.b[j] = a.b[idx.b[j] & 63];
    return r;
}

// dst.f[j] = a.f[idx.i32[j] & 15]
static inline __m512 _mm512_permutexvar_ps(__m512i idx, __m512 a) {
    __m512 r;
    for (int j = 0; j < 16; ++j) {
        int32_t k;
        memcpy(&k, idx.b + 4 * j, 4);
        r.f[j] = a.f[k & 15];
    }
    return r;
}

// bit i of dst = imm bit ((a_i << 2) | (b_i << 1) | c_i); the lane width does not matter
static inline __m512i _mm512_ternarylogic_epi32(__m512i a, __m512i b, __m512i c, int imm) {
    __m512i r;
    for (int j = 0; j < 64; ++j) {
        uint8_t v = 0;
        for (int i = 0; i < 8; ++i) {
            const int k = (((a.b[j] >> i) & 1) << 2) | (((b.b[j] >> i) & 1) << 1) | ((c.b[j] >> i) & 1);
            v |= (uint8_t)(((imm >> k) & 1) << i);
        }
        r.b[j] = v;
    }
    return r;
}

// for each 64-bit word of b: byte j = its 8 bits from bit (ctl.byte[j] & 63), wrapping around the
// word (VBMI vpmultishiftqb; ctl is the first operand)
static inline __m512i _mm512_multishift_epi64_epi8(__m512i ctl, __m512i b) {
    __m512i r;
    for (int w = 0; w < 8; ++w) {
        uint64_t q;
        memcpy(&q, b.b + 8 * w, 8);
        for (int j = 0; j < 8; ++j) {
            const int s = ctl.b[8 * w + j] & 63;
            r.b[8 * w + j] = (uint8_t)((q >> s | (s ? q << (64 - s) : 0)) & 0xFF);
        }
    }
    return r;
}

// dst.i32[j] = src.i32[j] + Σ_{k<4} (uint8) a.byte[4j + k] · (int8) b.byte[4j + k] (VNNI vpdpbusd,
// wrapping, no saturation)
static inline __m512i _mm512_dpbusd_epi32(__m512i src, __m512i a, __m512i b) {
    __m512i r;
    for (int j = 0; j < 16; ++j) {
        int32_t acc;
        memcpy(&acc, src.b + 4 * j, 4);
        for (int k = 0; k < 4; ++k) acc += (int32_t)a.b[4 * j + k] * (int32_t)(int8_t)b.b[4 * j + k];
        memcpy(r.b + 4 * j, &acc, 4);
    }
    return r;
}

static inline __m512 _mm512_cvtepi32_ps(__m512i a) {
    __m512 r;
    for (int j = 0; j < 16; ++j) {
        int32_t k;
        memcpy(&k, a.b + 4 * j, 4);
        r.f[j] = (float)k;
    }
    return r;
}

static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    __m512 r;
    for (int j = 0; j < 16; ++j) r.f[j] = fmaf(a.f[j], b.f[j], c.f[j]);
    return r;
}

#endif
