// Host experts: NVFP4 expert rows computed on the host's CPU cores, read where the host store keeps
// them (cupool/layout.py's kernel layout, unchanged), so a miss can be computed beside the PCIe
// link instead of crossing it. Built at first use by cupool/hostexperts.py with the machine's C
// compiler (-O3 -march=native); not a CUDA file.
//
// A call: T tokens, K lanes a token (lane i is token i / K), each lane a row key (layer·E + expert,
// -1 padding) and a router weight. out[t, h] = Σ over token t's lanes, in lane order within a row,
// rows in order of first use, of weight · (w2 · act(w13 · x_t + b13) + b2)[h], for h < H.
//
// Numbers: the weights are the exact NVFP4 values; the vectors they multiply (x, and the act
// between w13 and w2) are quantized to int8 per block of 16 columns, the weights' own blocks
// (`quantize_block`: scale = amax / 127, q = rint(v · 127 / amax)), as llama.cpp's CPU path does
// with its q8 blocks. A 16-column block's dot product is then an exact integer (the E2M1 codes
// taken as 2·value, -12 … 12) times the two blocks' scales, accumulated in float32.
// cupool/hostexperts.py's `reference_host` is the same computation in NumPy.
//
// How threads split a call: the caller groups lanes into units (one a distinct row) and quantizes
// the x of tokens with a routed lane; then the caller and the pool's workers claim items one at a
// time from the job's claim word (`claim_item`). Items 0 ... n1 - 1 are phase 1: item p is act
// block p (16 columns of I) of every unit, its gate and up strips (or the up strip alone) times
// the unit's tokens, quantized; the next n2 are phase 2: item n1 + s is output strip s (16 rows of
// H) of every unit, written to out for every token. A phase-2 item waits until every phase-1 item
// is counted done. A thread counts the items it did when it has no further item (its phase-1 items
// also when it takes a phase-2 one), and the caller returns once every item is counted done, not
// once every worker has looked: a worker the OS has not run for a while (more busy threads than
// CPUs) holds up only items it claimed. An item's result does not depend on which thread runs it,
// and every build below does the same float operations in the same order, so the output is the
// same bit for bit for any thread count and any build. Only phase-2 item s writes out[., 16s ...
// 16s + 15].
//
// Inner loop: a strip (16 rows × Kp columns) is Kp/64 chunks of 32 lane blocks (16 bytes: 4
// words of 8 E2M1 codes, rows g and g + 8, columns 16t ... 16t + 15 of the chunk, L = 4g + t) and
// 64 scale bytes. A word's 16-bit half u holds (layout.py) row g's columns k, k + 2 (magnitudes at
// bits 0 and 6, signs at 13 and 15) and row g + 8's (bits 3 and 9; signs 12 and 14). Each half is
// turned into two bytes for row g and two for row g + 8, each a 4-bit index (sign · 8 + magnitude)
// into a table of the code's value + 12 (unsigned, what the unsigned × signed byte products take);
// so a word gives 4 weights of each row at columns k0, k0 + 2, k0 + 1, k0 + 3, and the int8
// vectors are stored in that order (BPOS). A word's integer dot product is Σ (w + 12)·q − 12·Σ q,
// the second term kept with the vector (`c`). Row r's 16 float32 accumulators are its chunk's
// 4 blocks × 4 words: acc[4t + q] += float(D) · (block scale(r, t) · vector scale(t)), fused
// multiply-adds in chunk order, summed by `reduce16` at the end. A strip's lines are prefetched
// before its first row pair (without it a thread waits on memory for about a fifth of its time:
// its first reads stride a chunk apart), and its block scales converted once (`strip_scales`).
//  - AVX-512 (F, BW, VBMI, VNNI): a vector is a chunk's 4 lane blocks of row pair g; the index
//    bytes come from vpmultishiftqb (magnitudes, signs) and one ternary logic, the weights from
//    vpermb, the products from vpdpbusd. Row pairs go 8, 4 or 2 at a time (1, 2, more tokens),
//    chunk by chunk, so a chunk's codes are read in order with the accumulators in registers.
//  - AVX2 + FMA: a vector is 2 lane blocks; the index bytes come from shifts and masks of 16-bit
//    halves, the weights from vpshufb, the products from vpmaddubsw and vpmaddwd.
//  - portable C (no AVX2 and FMA, or HX_PORTABLE): the same integers and float operations one at a
//    time.
// HX_EMULATE_AVX512 builds the AVX-512 loop over hx_avx512_emulated.h's plain C definitions of its
// intrinsics, so a CPU without AVX-512 checks that loop's indexing (isa="avx512-emulated").
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// HX_ISA: 2 AVX-512 (F, BW, VBMI, VNNI), 1 AVX2 + FMA + F16C, 0 portable C; the best the compiler's
// target allows, less with -DHX_NO_AVX512 or -DHX_PORTABLE (the builds tests and benchmarks
// compare). hx_isa() reports 3 for the emulated AVX-512 build.
#if defined(HX_EMULATE_AVX512)
#define HX_ISA 2
#include "hx_avx512_emulated.h"
#elif !defined(HX_PORTABLE) && !defined(HX_NO_AVX512) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define HX_ISA 2
#elif !defined(HX_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HX_ISA 1
#else
#define HX_ISA 0
#endif
#if (defined(__x86_64__) || defined(__i386__)) && !defined(HX_EMULATE_AVX512)
#include <immintrin.h>
#define hx_pause() _mm_pause()
#elif defined(__aarch64__)
#define hx_pause() __asm__ __volatile__("yield")
#else
#define hx_pause() ((void)0)
#endif

#define HEADER_BYTES 256
#define CHUNK_BYTES 576      // 512 bytes of codes, then 64 scale bytes (layout.py)
#define TB 4                 // tokens of a unit multiplied against one decoded chunk at a time
#define CODE_BIAS 12         // the weight table's offset: 2·|E2M1| <= 12

#define HX_INLINE static inline __attribute__((always_inline))

#define HX_ERR_KEY 1         // a key outside [-1, n_keys): nothing computed
#define HX_ERR_WEIGHT 2      // a non-finite weight on a routed lane: the lane is dropped
#define HX_ERR_ARGS 4        // sizes the pool cannot take (T, W or the layout): nothing computed
#define HX_ERR_MEMORY 8      // scratch could not be allocated: nothing computed

typedef struct {
    int64_t hidden, inter, hp, ip;   // H, I, Hp, Ip
    int64_t w2_offset;               // bytes from a row's start to w2
    int64_t bias_offset;             // bytes from a row's start to the biases, -1: none
    int32_t gated;                   // 1: (gate, up) strip pairs; 0: up strips alone
    int32_t act;                     // 0 SiLU(gate)·up, 1 clamped SwiGLU, 2 ReLU(up)²
    float alpha, limit;              // clamped SwiGLU only
} hx_layout;

// A quantized vector of kp columns (kp a multiple of 64): what a strip is multiplied with.
typedef struct {
    const int8_t* q;                 // [kp] codes, each word's 4 columns in BPOS order
    const float* s;                  // [kp / 8] each 16-column block's scale, twice
    const int32_t* c;                // [kp / 4] -12 · the sum of each word's 4 codes
} hx_vec;

static float E4M3[256];

// index (sign · 8 + magnitude) -> 2·E2M1 value + CODE_BIAS
static const int8_t WEIGHT_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// Where column 4m + r of a vector sits among its quantized codes: byte 4m + BPOS[r] (the AVX-512
// quantize_block has it as a byte shuffle).
static const int BPOS[4] __attribute__((unused)) = {0, 2, 1, 3};

static void init_tables(void) {
    for (int b = 0; b < 256; ++b) {
        const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
        float v;
        if (e == 15 && m == 7) v = NAN;                      // E4M3 (fn): no infinities
        else if (e == 0) v = ldexpf((float)m, -9);           // subnormal: m/8 · 2^-6
        else v = ldexpf(1.0f + m / 8.0f, e - 7);
        E4M3[b] = s ? -v : v;
    }
}

// The sum of a row's 16 accumulators (lane 4t + q), in one order for every build.
static float reduce16(const float a[16]) {
    float v8[8], v4[4];
    for (int i = 0; i < 8; ++i) v8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; ++i) v4[i] = v8[i] + v8[i + 4];
    return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

#if HX_ISA
// A strip's E4M3 block scales as floats, all of them before its row pairs: out[64c + 8g + i] is
// the scale of row g (i even) or g + 8 (i odd) of lane block 4g + i / 2 of chunk c (the chunk's
// scale bytes in order). Exactly E4M3[]'s values: an E4M3 byte's bits moved into a half float
// (sign at 15, exponent and mantissa at 7 ... 13) are the same number times 2^-8, normal or not;
// the NaN codes (0x7F, 0xFF) become a half-float NaN. 16 at a time; the emulated build, which
// checks the AVX-512 loop's indexing, reads E4M3[].
#if defined(HX_EMULATE_AVX512)
static inline void strip_scales(const uint8_t* strip, int nch, float* out) {
    for (int c = 0; c < nch; ++c)
        for (int i = 0; i < 64; ++i) out[64 * c + i] = E4M3[strip[(int64_t)c * CHUNK_BYTES + 512 + i]];
}
#else
static inline void strip_scales(const uint8_t* strip, int nch, float* out) {
    const __m256i m7f = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16((short)0x8000);
    const __m256i nan = _mm256_set1_epi16(0x7E00);
    const __m256 k = _mm256_set1_ps(256.0f);
    for (int c = 0; c < nch; ++c)
        for (int i = 0; i < 4; ++i) {
            const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                (const __m128i*)(strip + (int64_t)c * CHUNK_BYTES + 512 + 16 * i)));
            const __m256i mag = _mm256_and_si256(b, m7f);
            __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                        _mm256_and_si256(_mm256_slli_epi16(b, 8), sign));
            h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, m7f), nan));
            float* o = out + 64 * c + 16 * i;
            _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k));
            _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k));
        }
}
#endif
#endif

// --- one strip times up to TB quantized vectors -------------------------------------------------
// y[b][r] = Σ_k 2·code(r, k) · scale(r, k / 16) · x_b[k] for the strip's 16 rows r (no global
// scale, no 1/2).
#if HX_ISA == 2
HX_INLINE void strip_dot_n(const uint8_t* strip, int nch, const hx_vec* xv, const int nb, float y[TB][16]) {
    // vpmultishiftqb controls: for each 16-bit half i of a 64-bit word, the bit offsets that put
    // row g's magnitudes (bits 0, 6) and signs (13, 15; at bit 3 of the byte) and row g + 8's
    // (3, 9; 12, 14) into the low bits of two bytes
    static const uint8_t CTL[4][8] = {{0, 6, 16, 22, 32, 38, 48, 54},     // row g, magnitudes
                                      {10, 12, 26, 28, 42, 44, 58, 60},   // row g, signs
                                      {3, 9, 19, 25, 35, 41, 51, 57},     // row g + 8, magnitudes
                                      {9, 11, 25, 27, 41, 43, 57, 59}};   // row g + 8, signs
    static const int32_t SPREAD[2][16] = {{0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6},
                                          {1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7}};
    uint8_t ctl[4][64], lut[64];
    for (int i = 0; i < 64; ++i) {
        for (int k = 0; k < 4; ++k) ctl[k][i] = CTL[k][i % 8];
        lut[i] = (uint8_t)WEIGHT_U[i % 16];   // vpermb reads 6 index bits; bits 4, 5 are noise
    }
    const __m512i ctl_ag = _mm512_loadu_si512(ctl[0]), ctl_sg = _mm512_loadu_si512(ctl[1]);
    const __m512i ctl_ag8 = _mm512_loadu_si512(ctl[2]), ctl_sg8 = _mm512_loadu_si512(ctl[3]);
    const __m512i table = _mm512_loadu_si512(lut), low3 = _mm512_set1_epi8(7);
    const __m512i spread_g = _mm512_loadu_si512(SPREAD[0]), spread_g8 = _mm512_loadu_si512(SPREAD[1]);
    // GB row pairs at a time, chunk by chunk: each chunk's GB·64 code bytes read in order, and
    // 2·GB·nb accumulators kept in registers
    const int GB = nb == 1 ? 8 : nb == 2 ? 4 : 2;
    for (int64_t o = 0; o < (int64_t)nch * CHUNK_BYTES; o += 64) __builtin_prefetch(strip + o, 0, 3);
    float sc[nch * 64];              // the strip's block scales (strip_scales)
    strip_scales(strip, nch, sc);
    for (int g0 = 0; g0 < 8; g0 += GB) {
        __m512 acc[TB][8][2];
        for (int b = 0; b < TB; ++b)
            for (int j = 0; j < GB; ++j) acc[b][j][0] = acc[b][j][1] = _mm512_setzero_ps();
        for (int c = 0; c < nch; ++c) {
            const uint8_t* ch = strip + (int64_t)c * CHUNK_BYTES;
#pragma GCC unroll 8
            for (int j = 0; j < GB; ++j) {
                const int g = g0 + j;
                const __m512i v = _mm512_loadu_si512(ch + 64 * g);      // lane blocks 4g ... 4g + 3
                // (magnitude & 7) | (sign byte & ~7): ternary-logic table 0xE4 (c ? a : b)
                const __m512i wg = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(
                    _mm512_multishift_epi64_epi8(ctl_ag, v), _mm512_multishift_epi64_epi8(ctl_sg, v),
                    low3, 0xE4), table);
                const __m512i wg8 = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(
                    _mm512_multishift_epi64_epi8(ctl_ag8, v), _mm512_multishift_epi64_epi8(ctl_sg8, v),
                    low3, 0xE4), table);
                const __m256 sw = _mm256_loadu_ps(sc + 64 * c + 8 * g);  // (g, t), (g + 8, t), t = 0 ... 3
                for (int b = 0; b < TB; ++b) {
                    if (b >= nb) break;
                    const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(sw, _mm256_loadu_ps(xv[b].s + 8 * c)));
                    const __m512i x = _mm512_loadu_si512(xv[b].q + 64 * c);
                    const __m512i nc = _mm512_loadu_si512(xv[b].c + 16 * c);
                    acc[b][j][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(nc, wg, x)),
                                                   _mm512_permutexvar_ps(spread_g, p), acc[b][j][0]);
                    acc[b][j][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(nc, wg8, x)),
                                                   _mm512_permutexvar_ps(spread_g8, p), acc[b][j][1]);
                }
            }
        }
        for (int b = 0; b < nb; ++b)
            for (int j = 0; j < GB; ++j) {
                float a[16];
                _mm512_storeu_ps(a, acc[b][j][0]);
                y[b][g0 + j] = reduce16(a);
                _mm512_storeu_ps(a, acc[b][j][1]);
                y[b][g0 + j + 8] = reduce16(a);
            }
    }
}
#elif HX_ISA == 1
// Index bytes of 16 halves: rows g (*wg) and g + 8 (*wg8), each half's two columns in order.
static inline void decode16(__m256i u, __m256i table, __m256i* wg, __m256i* wg8) {
    const __m256i m0007 = _mm256_set1_epi16(0x0007), m0008 = _mm256_set1_epi16(0x0008);
    const __m256i m0700 = _mm256_set1_epi16(0x0700), m0800 = _mm256_set1_epi16(0x0800);
    const __m256i m0807 = _mm256_set1_epi16(0x0807);
    // row g: magnitude bits 0-2 -> 0-2, sign 13 -> 3; magnitude 6-8 -> 8-10, sign 15 -> 11
    const __m256i ig = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(u, m0007), _mm256_and_si256(_mm256_srli_epi16(u, 10), m0008)),
        _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(u, 2), m0700),
                        _mm256_and_si256(_mm256_srli_epi16(u, 4), m0800)));
    // row g + 8: magnitude 3-5 -> 0-2 and sign 14 -> 11 (one shift), sign 12 -> 3, magnitude 9-11 -> 8-10
    const __m256i ig8 = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(u, 3), m0807),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u, 9), m0008),
                        _mm256_and_si256(_mm256_srli_epi16(u, 1), m0700)));
    *wg = _mm256_shuffle_epi8(table, ig);
    *wg8 = _mm256_shuffle_epi8(table, ig8);
}

static inline __m256 word_dots(__m256i w, __m256i x, __m256i nc) {
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones), nc));
}

HX_INLINE void strip_dot_n(const uint8_t* strip, int nch, const hx_vec* xv, const int nb, float y[TB][16]) {
    // WEIGHT_U in each 128-bit half (vpshufb looks up within halves)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)WEIGHT_U));
    const __m256i sp_g01 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i sp_g801 = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
    const __m256i sp_g23 = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
    const __m256i sp_g823 = _mm256_setr_epi32(5, 5, 5, 5, 7, 7, 7, 7);
    for (int64_t o = 0; o < (int64_t)nch * CHUNK_BYTES; o += 64) __builtin_prefetch(strip + o, 0, 3);
    float sc[nch * 64];              // the strip's block scales (strip_scales)
    strip_scales(strip, nch, sc);
    for (int g = 0; g < 8; ++g) {
        __m256 acc[TB][4];   // row g lanes 0-7, 8-15; row g + 8 lanes 0-7, 8-15
        for (int b = 0; b < TB; ++b)
            for (int i = 0; i < 4; ++i) acc[b][i] = _mm256_setzero_ps();
        for (int c = 0; c < nch; ++c) {
            const uint8_t* ch = strip + (int64_t)c * CHUNK_BYTES;
            __m256i wg01, wg801, wg23, wg823;
            decode16(_mm256_loadu_si256((const __m256i*)(ch + 64 * g)), table, &wg01, &wg801);
            decode16(_mm256_loadu_si256((const __m256i*)(ch + 64 * g + 32)), table, &wg23, &wg823);
            const __m256 sw = _mm256_loadu_ps(sc + 64 * c + 8 * g);  // (g, t), (g + 8, t), t = 0 ... 3
            for (int b = 0; b < TB; ++b) {
                if (b >= nb) break;
                const __m256 p = _mm256_mul_ps(sw, _mm256_loadu_ps(xv[b].s + 8 * c));
                const __m256i x01 = _mm256_loadu_si256((const __m256i*)(xv[b].q + 64 * c));
                const __m256i x23 = _mm256_loadu_si256((const __m256i*)(xv[b].q + 64 * c + 32));
                const __m256i c01 = _mm256_loadu_si256((const __m256i*)(xv[b].c + 16 * c));
                const __m256i c23 = _mm256_loadu_si256((const __m256i*)(xv[b].c + 16 * c + 8));
                acc[b][0] = _mm256_fmadd_ps(word_dots(wg01, x01, c01), _mm256_permutevar8x32_ps(p, sp_g01), acc[b][0]);
                acc[b][1] = _mm256_fmadd_ps(word_dots(wg23, x23, c23), _mm256_permutevar8x32_ps(p, sp_g23), acc[b][1]);
                acc[b][2] = _mm256_fmadd_ps(word_dots(wg801, x01, c01), _mm256_permutevar8x32_ps(p, sp_g801), acc[b][2]);
                acc[b][3] = _mm256_fmadd_ps(word_dots(wg823, x23, c23), _mm256_permutevar8x32_ps(p, sp_g823), acc[b][3]);
            }
        }
        for (int b = 0; b < nb; ++b) {
            float a[16];
            _mm256_storeu_ps(a, acc[b][0]);
            _mm256_storeu_ps(a + 8, acc[b][1]);
            y[b][g] = reduce16(a);
            _mm256_storeu_ps(a, acc[b][2]);
            _mm256_storeu_ps(a + 8, acc[b][3]);
            y[b][g + 8] = reduce16(a);
        }
    }
}
#else
HX_INLINE void strip_dot_n(const uint8_t* strip, int nch, const hx_vec* xv, const int nb, float y[TB][16]) {
    for (int g = 0; g < 8; ++g) {
        float acc[TB][2][16] = {{{0}}};
        for (int c = 0; c < nch; ++c) {
            const uint8_t* ch = strip + (int64_t)c * CHUNK_BYTES;
            for (int t = 0; t < 4; ++t) {
                const int L = 4 * g + t;
                const float sw[2] = {E4M3[ch[512 + 2 * L]], E4M3[ch[513 + 2 * L]]};
                for (int q = 0; q < 4; ++q) {
                    uint8_t idx[2][4];           // rows g, g + 8: columns k0, k0 + 2, k0 + 1, k0 + 3
                    for (int h = 0; h < 2; ++h) {
                        const unsigned u = ch[16 * L + 4 * q + 2 * h] | (unsigned)ch[16 * L + 4 * q + 2 * h + 1] << 8;
                        idx[0][2 * h] = (uint8_t)((u & 7) | ((u >> 10) & 8));
                        idx[0][2 * h + 1] = (uint8_t)(((u >> 6) & 7) | ((u >> 12) & 8));
                        idx[1][2 * h] = (uint8_t)(((u >> 3) & 7) | ((u >> 9) & 8));
                        idx[1][2 * h + 1] = (uint8_t)(((u >> 9) & 7) | ((u >> 11) & 8));
                    }
                    const int m = 16 * c + 4 * t + q;   // the word's index in the vector
                    for (int b = 0; b < nb; ++b) {
                        const float p = sw[0] * xv[b].s[2 * (4 * c + t)];
                        const float p8 = sw[1] * xv[b].s[2 * (4 * c + t) + 1];
                        for (int r = 0; r < 2; ++r) {
                            int32_t d = xv[b].c[m];
                            for (int i = 0; i < 4; ++i) d += WEIGHT_U[idx[r][i]] * xv[b].q[4 * m + i];
                            acc[b][r][4 * t + q] = fmaf((float)d, r ? p8 : p, acc[b][r][4 * t + q]);
                        }
                    }
                }
            }
        }
        for (int b = 0; b < nb; ++b) {
            y[b][g] = reduce16(acc[b][0]);
            y[b][g + 8] = reduce16(acc[b][1]);
        }
    }
}
#endif

// Quantized vectors, n of them of kp columns each, one after another (scratch of a call).
typedef struct {
    int8_t* q;                       // [n][kp]
    float* s;                        // [n][kp / 8]
    int32_t* c;                      // [n][kp / 4]
    size_t cap;                      // columns the buffers hold, all vectors together
} hx_vecs;

// strip_dot_n with nb a constant in each case, so the token loops unroll and the accumulators
// stay in registers.
static void strip_dot(const uint8_t* strip, int nch, const hx_vec* xv, int nb, float y[TB][16]) {
    switch (nb) {
    case 1: strip_dot_n(strip, nch, xv, 1, y); break;
    case 2: strip_dot_n(strip, nch, xv, 2, y); break;
    case 3: strip_dot_n(strip, nch, xv, 3, y); break;
    default: strip_dot_n(strip, nch, xv, TB, y); break;
    }
}

// Quantizes block `blk` (columns 16·blk ...) of vector n (kp columns) of x from its 16 values v:
// codes rint(v · 127 / amax) (ties to even), the scale amax / 127 (twice), the words' code sums ·
// -CODE_BIAS; a block with a NaN or an infinity gets codes 0 and a NaN scale (so what it touches
// is NaN, as the float computation's would be). The AVX-512 build converts with the default
// rounding mode (to nearest, ties to even, as nearbyintf): the same bits as the plain C.
static void quantize_block(const float v[16], hx_vecs* x, int64_t n, int64_t kp, int64_t blk) {
    int8_t* q = x->q + n * kp;
    float* s = x->s + n * kp / 8;
    int32_t* c = x->c + n * kp / 4;
    int32_t code[16];
#if HX_ISA == 2 && !defined(HX_EMULATE_AVX512)
    const __m512 vv = _mm512_loadu_ps(v);
    // |v|'s bits: for non-negative floats they order as the values, and a NaN or an infinity is
    // at least 0x7f800000, so one integer maximum gives both amax and finiteness
    const uint32_t top = _mm512_reduce_max_epu32(
        _mm512_and_si512(_mm512_castps_si512(vv), _mm512_set1_epi32(0x7fffffff)));
    const int finite = top < 0x7f800000u;
    float amax;
    memcpy(&amax, &top, 4);
    const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i ci = finite ? _mm512_cvtps_epi32(_mm512_mul_ps(vv, _mm512_set1_ps(inv)))
                              : _mm512_setzero_si512();
    // each word's 4 codes in BPOS order: bytes 0, 2, 1, 3 of the word take codes 0, 1, 2, 3
    const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    _mm_storeu_si128((__m128i*)(q + 16 * blk), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(ci), order));
    _mm512_storeu_si512(code, ci);
    for (int w = 0; w < 4; ++w)
        c[4 * blk + w] = -CODE_BIAS * (code[4 * w] + code[4 * w + 1] + code[4 * w + 2] +
                                       code[4 * w + 3]);
#else
    float amax = 0.0f;
    int finite = 1;
    for (int r = 0; r < 16; ++r) {
        const float a = fabsf(v[r]);
        finite &= isfinite(a) != 0;
        amax = a > amax ? a : amax;
    }
    const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int r = 0; r < 16; ++r) code[r] = finite ? (int)nearbyintf(v[r] * inv) : 0;
    for (int w = 0; w < 4; ++w) {
        int32_t sum = 0;
        for (int r = 0; r < 4; ++r) {
            q[16 * blk + 4 * w + BPOS[r]] = (int8_t)code[4 * w + r];
            sum += code[4 * w + r];
        }
        c[4 * blk + w] = -CODE_BIAS * sum;
    }
#endif
    s[2 * blk] = s[2 * blk + 1] = finite ? amax / 127.0f : NAN;
}

// Vector n of x (n from 0) of length kp: x + n·kp with (q, s, c) as hx_vec has them.
static hx_vec vec_at(const hx_vecs* x, int64_t n, int64_t kp) {
    const hx_vec r = {x->q + n * kp, x->s + n * kp / 8, x->c + n * kp / 4};
    return r;
}

// Quantizes vector n (kp columns) of x from v [cols] (columns past cols are zero).
static void quantize(const float* v, int64_t cols, hx_vecs* x, int64_t n, int64_t kp) {
    for (int64_t blk = 0; blk < kp / 16; ++blk) {
        if (16 * blk + 16 <= cols) {          // a whole block in place
            quantize_block(v + 16 * blk, x, n, kp, blk);
            continue;
        }
        float b[16];
        for (int r = 0; r < 16; ++r) b[r] = 16 * blk + r < cols ? v[16 * blk + r] : 0.0f;
        quantize_block(b, x, n, kp, blk);
    }
}

static float activate(const hx_layout* L, float g, float u) {
    switch (L->act) {
    case 1: {
        const float gc = fminf(g, L->limit), uc = fminf(fmaxf(u, -L->limit), L->limit);
        return (uc + 1.0f) * (gc / (1.0f + expf(-L->alpha * gc)));
    }
    case 2: {
        const float r = fmaxf(u, 0.0f);
        return r * r;
    }
    default:
        return g / (1.0f + expf(-g)) * u;
    }
}

// --- the pool -----------------------------------------------------------------------------------
#define HX_LINE 64                   // a cache line's bytes

typedef struct {
    int kind;                        // 0 an expert call, 1 a read of `bytes` (bandwidth probe)
    const hx_layout* L;
    int units;
    const int64_t* unit_row;         // [units] host address of the unit's row
    const int* unit_start;           // [units + 1] into unit_lane
    const int* unit_lane;            // lanes of the units, unit by unit, in lane order
    const int* lane_token;           // [W]
    const float* lane_w;             // [W] (0 for dropped lanes)
    const hx_vecs* xq;               // T vectors of Hp columns: the tokens' x, quantized
    hx_vecs* aq;                     // W vectors of Ip columns: the lanes' act rows, quantized
    float* out;                      // [T][H]
    int T;
    int n1;                          // phase-1 items (the rest of the job's items are phase 2)
    const uint8_t* read_base;        // kind 1
    int64_t read_bytes, read_piece;
    // Written by every thread while a job runs, each on a cache line of its own: sharing a line
    // with each other or with the fields above, which every item reads, each write would take
    // that line from every other thread.
    // The claim word: the job's number (32 bits), its items (16) and the next unclaimed one (16);
    // a thread that read another job's word cannot claim through it (its compare-exchange fails).
    _Alignas(HX_LINE) _Atomic uint64_t claim;
    _Alignas(HX_LINE) atomic_int done1;  // phase-1 items done
    _Alignas(HX_LINE) atomic_int done;   // all items done
    _Alignas(HX_LINE) atomic_ullong read_sum;
} hx_job;

#define HX_MAX_ITEMS 0xffff          // a job's items at most (the claim word's 16 bits)

// An expert call's items: Ip / 16 act blocks (phase 1), then ceil(H / 16) output strips.
static int64_t expert_items(const hx_layout* L) { return L->ip / 16 + (L->hidden + 15) / 16; }

// What hx_serve answers: requests posted to a mailbox (rawkernels/host_handoff.cu).
typedef struct {
    const hx_layout* L;
    const int64_t* table;
    int64_t n_keys;
    int T, K;                        // the mailbox's tokens (the most a request carries), lanes
    const uint32_t* seq;             // the request's number (written last by the poster)
    uint32_t* done;                  // the answered number (written last here)
    const uint32_t* size;            // the request's lanes, t·K for its t <= T tokens
    const int64_t* keys;             // [t·K]
    const float* weights;            // [t·K]
    const float* x;                  // [t, H]
    float* out;                      // [t, H]
    uint32_t first;                  // seq when serving started: requests after it are answered
} hx_serve_args;

typedef struct hx_pool {
    int threads;                     // the caller and threads - 1 workers
    pthread_t* tid;
    uint32_t jobs;                   // jobs run: the claim word's number
    atomic_int sleepers;
    int64_t spin_ns;                 // how long an idle worker spins before it sleeps
    pthread_mutex_t mu;
    pthread_cond_t cv;
    // what idle workers poll, on a line of its own
    _Alignas(HX_LINE) atomic_uint gen;   // bumped to hand the workers a job
    atomic_int stop;
    hx_job job;
    hx_vecs xq, aq;                  // scratch, grown as calls need
    int64_t *unit_row;
    int *unit_start, *unit_lane, *lane_token, *lane_unit;
    float* lane_w;
    size_t lane_cap;
    // hx_serve: a thread that answers a mailbox's requests, the pool's caller while it runs
    hx_serve_args sa;
    pthread_t server;
    int serving;
    atomic_int serve_stop;
    atomic_int serve_err;            // error bits of the calls served
    atomic_uint served;              // requests answered
    // what the serving thread's calls took (hx_serve_stats): wall ns summed and the longest,
    // distinct rows summed
    _Atomic uint64_t served_ns, served_max_ns, served_rows;
    int last_units;                  // distinct rows of the last hx_run
} hx_pool;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void phase1_item(hx_job* j, int p) {
    const hx_layout* L = j->L;
    const int64_t hp = L->hp, ip = L->ip, sb = 9 * hp;     // a w13 strip's bytes
    const int nch = (int)(hp / 64);
    for (int u = 0; u < j->units; ++u) {
        const uint8_t* row = (const uint8_t*)(intptr_t)j->unit_row[u];
        const float* hs = (const float*)row;               // global scales: gate, up, down
        const uint8_t* up_strip = row + HEADER_BYTES + (L->gated ? (2 * p + 1) : p) * sb;
        const uint8_t* gate_strip = row + HEADER_BYTES + 2 * p * sb;
        const float* bias = L->bias_offset >= 0 ? (const float*)(row + L->bias_offset) : NULL;
        for (int i0 = j->unit_start[u]; i0 < j->unit_start[u + 1]; i0 += TB) {
            const int nb = j->unit_start[u + 1] - i0 < TB ? j->unit_start[u + 1] - i0 : TB;
            hx_vec xv[TB];
            for (int b = 0; b < nb; ++b) xv[b] = vec_at(j->xq, j->lane_token[j->unit_lane[i0 + b]], hp);
            float yu[TB][16], yg[TB][16];
            strip_dot(up_strip, nch, xv, nb, yu);
            if (L->gated) strip_dot(gate_strip, nch, xv, nb, yg);
            // the codes count 2·E2M1: half of each global scale
            const float su = 0.5f * hs[1], sg = 0.5f * hs[0];
            for (int b = 0; b < nb; ++b) {
                const int64_t lane = j->unit_lane[i0 + b];
                float a[16];
                for (int r = 0; r < 16; ++r) {
                    const int64_t col = 16 * (int64_t)p + r;
                    float up = yu[b][r] * su, gate = 0.0f;
                    if (L->gated) gate = yg[b][r] * sg;
                    if (bias) {
                        gate += bias[col];
                        up += bias[ip + col];
                    }
                    // columns past I are zero weights (and zero biases) and stay zero
                    a[r] = col < L->inter ? activate(L, gate, up) : 0.0f;
                }
                quantize_block(a, j->aq, lane, ip, p);
            }
        }
    }
}

static void phase2_item(hx_job* j, int s) {
    const hx_layout* L = j->L;
    const int64_t ip = L->ip, h0 = 16 * (int64_t)s, H = L->hidden;
    const int nch = (int)(ip / 64), rows = H - h0 < 16 ? (int)(H - h0) : 16;
    for (int t = 0; t < j->T; ++t) memset(j->out + t * H + h0, 0, rows * sizeof(float));
    for (int u = 0; u < j->units; ++u) {
        const uint8_t* row = (const uint8_t*)(intptr_t)j->unit_row[u];
        const float gs = 0.5f * ((const float*)row)[2];   // the codes count 2·E2M1
        const uint8_t* strip = row + L->w2_offset + s * 9 * ip;
        const float* bias = L->bias_offset >= 0
            ? (const float*)(row + L->bias_offset) + 2 * ip + h0 : NULL;
        for (int i0 = j->unit_start[u]; i0 < j->unit_start[u + 1]; i0 += TB) {
            const int nb = j->unit_start[u + 1] - i0 < TB ? j->unit_start[u + 1] - i0 : TB;
            hx_vec av[TB];
            for (int b = 0; b < nb; ++b) av[b] = vec_at(j->aq, j->unit_lane[i0 + b], ip);
            float y[TB][16];
            strip_dot(strip, nch, av, nb, y);
            for (int b = 0; b < nb; ++b) {
                const int lane = j->unit_lane[i0 + b];
                const float w = j->lane_w[lane];
                float* o = j->out + j->lane_token[lane] * H + h0;
                for (int r = 0; r < rows; ++r) o[r] += w * (y[b][r] * gs + (bias ? bias[r] : 0.0f));
            }
        }
    }
}

// The current job's next item, or -1 when none is left (or the word read was an earlier job's
// and the current one has none left either). A claim succeeds only on the current job's word, and
// the caller writes a job's fields before that word (release): after a claim they are the job's.
static int claim_item(hx_job* j) {
    uint64_t c = atomic_load_explicit(&j->claim, memory_order_acquire);
    for (;;) {
        const int total = (int)((c >> 16) & 0xffff), i = (int)(c & 0xffff);
        if (i >= total) return -1;
        if (atomic_compare_exchange_weak_explicit(&j->claim, &c, c + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return i;
    }
}

static void read_piece(hx_job* j, int i) {
    // the read probe's piece i: its 64-bit words summed
    const int64_t piece = j->read_piece, start = i * piece;
    const uint64_t* p = (const uint64_t*)(j->read_base + start);
    const int64_t words = (j->read_bytes - start < piece ? j->read_bytes - start : piece) / 8;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t k = 0;
    for (; k + 4 <= words; k += 4) {
        s0 += p[k];
        s1 += p[k + 1];
        s2 += p[k + 2];
        s3 += p[k + 3];
    }
    for (; k < words; ++k) s0 += p[k];
    atomic_fetch_add_explicit(&j->read_sum, s0 + s1 + s2 + s3, memory_order_relaxed);
}

// One thread's part of the current job: items claimed until none is left. The thread counts its
// items done into the job's counters once, not an item at a time: its phase-1 items when it
// claims a phase-2 item (every phase-1 item is claimed by then, and it runs its own in order) or
// when none is left; all of its items when none is left, the last touch of the job's data by a
// thread that holds no further item.
static void run_share(hx_job* j) {
    int done1 = 0, done = 0;
    for (;;) {
        const int i = claim_item(j);
        if (i < 0) break;
        if (j->kind == 1) {
            read_piece(j, i);
        } else if (i < j->n1) {
            phase1_item(j, i);
            ++done1;
        } else {
            if (done1) atomic_fetch_add_explicit(&j->done1, done1, memory_order_release);
            done1 = 0;
            while (atomic_load_explicit(&j->done1, memory_order_acquire) < j->n1) hx_pause();
            phase2_item(j, i - j->n1);
        }
        ++done;
    }
    if (done1) atomic_fetch_add_explicit(&j->done1, done1, memory_order_release);
    if (done) atomic_fetch_add_explicit(&j->done, done, memory_order_release);
}

static void* worker_main(void* arg) {
    hx_pool* p = (hx_pool*)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int64_t t0 = now_ns();
        unsigned spins = 0;
        while ((g = atomic_load(&p->gen)) == seen) {
            if (atomic_load(&p->stop)) return NULL;
            hx_pause();
            if ((++spins & 255) == 0 && now_ns() - t0 > p->spin_ns) {
                // idle: sleep until the next job (the caller wakes sleepers after bumping gen)
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->sleepers, 1);
                while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop))
                    pthread_cond_wait(&p->cv, &p->mu);
                atomic_fetch_sub(&p->sleepers, 1);
                pthread_mutex_unlock(&p->mu);
                t0 = now_ns();
            }
        }
        seen = g;
        if (atomic_load(&p->stop)) return NULL;
        run_share(&p->job);
    }
}

// Publishes the job whose fields are written (`items` of them, at most HX_MAX_ITEMS), runs a share
// on the calling thread, and returns once every item is done: no thread reads the job's data
// after that (a worker that comes late finds no item to claim), so it and the scratch may be
// reused.
static void run_job(hx_pool* p, int items) {
    hx_job* j = &p->job;
    atomic_store_explicit(&j->done1, 0, memory_order_relaxed);
    atomic_store_explicit(&j->done, 0, memory_order_relaxed);
    p->jobs += 1;
    atomic_store_explicit(&j->claim, (uint64_t)p->jobs << 32 | (uint64_t)items << 16,
                          memory_order_release);
    atomic_fetch_add(&p->gen, 1);                // wakes the workers (sequentially consistent)
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_share(j);
    while (atomic_load_explicit(&j->done, memory_order_acquire) < items) hx_pause();
}

// Replaces *buf with an uninitialised 64-byte aligned block of `bytes`; -1 (and *buf kept) if
// there is no memory.
static int renew(void** buf, size_t bytes) {
    void* q = NULL;
    if (posix_memalign(&q, 64, bytes)) return -1;
    free(*buf);
    *buf = q;
    return 0;
}

// v holds at least `cols` columns of quantized vectors.
static int grow_vecs(hx_vecs* v, size_t cols) {
    if (cols <= v->cap) return 0;
    if (renew((void**)&v->q, cols) || renew((void**)&v->s, cols / 8 * sizeof(float)) ||
        renew((void**)&v->c, cols / 4 * sizeof(int32_t))) {
        v->cap = 0;                              // some were replaced: none is known to fit
        return -1;
    }
    v->cap = cols;
    return 0;
}

// --- the C interface (cupool/hostexperts.py) ----------------------------------------------------
void hx_destroy(hx_pool* p);

hx_pool* hx_create(int threads, int64_t spin_ns) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_tables);
    if (threads < 1) return NULL;
    hx_pool* p = NULL;                           // aligned as its cache-line fields ask
    if (posix_memalign((void**)&p, HX_LINE, sizeof(hx_pool))) return NULL;
    memset(p, 0, sizeof(hx_pool));
    p->threads = threads;
    p->spin_ns = spin_ns;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->tid = (pthread_t*)calloc(threads, sizeof(pthread_t));
    if (!p->tid) {
        free(p);
        return NULL;
    }
    for (int i = 1; i < threads; ++i) {
        if (pthread_create(&p->tid[i], NULL, worker_main, p)) {
            p->threads = i;                      // the ones started are stopped by hx_destroy
            hx_destroy(p);
            return NULL;
        }
    }
    return p;
}

int hx_serve_stop(hx_pool* p, unsigned* served);

void hx_destroy(hx_pool* p) {
    if (!p) return;
    hx_serve_stop(p, NULL);
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->threads; ++i) pthread_join(p->tid[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->tid);
    for (int k = 0; k < 2; ++k) {
        hx_vecs* v = k ? &p->aq : &p->xq;
        free(v->q);
        free(v->s);
        free(v->c);
    }
    free(p->unit_row);
    free(p->unit_start);
    free(p->unit_lane);
    free(p->lane_token);
    free(p->lane_unit);
    free(p->lane_w);
    free(p);
}

// Which strip_dot this build has: 2 AVX-512, 1 AVX2 + FMA, 0 portable C, 3 AVX-512 over emulated
// intrinsics.
#if defined(HX_EMULATE_AVX512)
int hx_isa(void) { return 3; }
#else
int hx_isa(void) { return HX_ISA; }
#endif

// out [T, H] = the experts of T·K lanes (keys [T·K]: layer·E + expert into table [n_keys] of host
// row addresses, -1 padding; weights [T·K]) applied to x [T, H] (float32, rows of H). Returns
// error bits (HX_ERR_*); with HX_ERR_KEY, HX_ERR_ARGS or HX_ERR_MEMORY out is not written.
int hx_run(hx_pool* p, const hx_layout* L, const int64_t* table, int64_t n_keys, int T, int K,
           const int64_t* keys, const float* weights, const float* x, float* out) {
    p->last_units = 0;
    if (T < 1 || K < 1 || L->hp % 64 || L->ip % 64 || L->hidden > L->hp || L->inter > L->ip ||
        expert_items(L) > HX_MAX_ITEMS)
        return HX_ERR_ARGS;
    const int W = T * K;
    int err = 0;
    for (int i = 0; i < W; ++i)
        if (keys[i] < -1 || keys[i] >= n_keys) return HX_ERR_KEY;
    if (grow_vecs(&p->xq, (size_t)T * L->hp) || grow_vecs(&p->aq, (size_t)W * L->ip))
        return HX_ERR_MEMORY;
    if ((size_t)W > p->lane_cap) {
        const int bad = renew((void**)&p->unit_row, W * sizeof(int64_t))
            | renew((void**)&p->unit_start, (W + 1) * sizeof(int))
            | renew((void**)&p->unit_lane, W * sizeof(int))
            | renew((void**)&p->lane_token, W * sizeof(int))
            | renew((void**)&p->lane_unit, W * sizeof(int))
            | renew((void**)&p->lane_w, W * sizeof(float));
        if (bad) {
            p->lane_cap = 0;
            return HX_ERR_MEMORY;
        }
        p->lane_cap = W;
    }
    // units: distinct keys in order of first use; their lanes in lane order
    int units = 0;
    for (int i = 0; i < W; ++i) {
        p->lane_token[i] = i / K;
        p->lane_unit[i] = -1;
        p->lane_w[i] = 0.0f;
        if (keys[i] < 0) continue;
        if (!isfinite(weights[i])) {
            err |= HX_ERR_WEIGHT;
            continue;
        }
        p->lane_w[i] = weights[i];
        int u = 0;
        while (u < units && p->unit_row[u] != table[keys[i]]) ++u;
        if (u == units) p->unit_row[units++] = table[keys[i]];
        p->lane_unit[i] = u;
    }
    int n = 0;
    for (int u = 0; u < units; ++u) {
        p->unit_start[u] = n;
        for (int i = 0; i < W; ++i)
            if (p->lane_unit[i] == u) p->unit_lane[n++] = i;
    }
    p->unit_start[units] = n;
    p->last_units = units;
    // the x of tokens with a routed lane (no unit reads the others': a prefill call's request
    // carries every token of the call, and only some have a lane on the host)
    for (int t = 0; t < T; ++t) {
        int used = 0;
        for (int k = t * K; k < (t + 1) * K; ++k) used |= p->lane_unit[k] >= 0;
        if (used) quantize(x + (int64_t)t * L->hidden, L->hidden, &p->xq, t, L->hp);
    }
    if (units == 0) {
        memset(out, 0, (size_t)T * L->hidden * sizeof(float));
        return err;
    }
    hx_job* j = &p->job;
    j->kind = 0;
    j->L = L;
    j->units = units;
    j->unit_row = p->unit_row;
    j->unit_start = p->unit_start;
    j->unit_lane = p->unit_lane;
    j->lane_token = p->lane_token;
    j->lane_w = p->lane_w;
    j->xq = &p->xq;
    j->aq = &p->aq;
    j->out = out;
    j->T = T;
    j->n1 = (int)(L->ip / 16);
    run_job(p, (int)expert_items(L));
    return err;
}

// hx_run `reps` times, each call's wall time in ns[rep] (the benchmark's timer: no Python between
// the calls).
int hx_run_timed(hx_pool* p, const hx_layout* L, const int64_t* table, int64_t n_keys, int T,
                 int K, const int64_t* keys, const float* weights, const float* x, float* out,
                 int reps, int64_t* ns) {
    int err = 0;
    for (int r = 0; r < reps; ++r) {
        const int64_t t0 = now_ns();
        err |= hx_run(p, L, table, n_keys, T, K, keys, weights, x, out);
        ns[r] = now_ns() - t0;
    }
    return err;
}

// Reads `bytes` from base with every thread of the pool (1 MiB pieces); returns the wall time in
// ns. The host-memory read rate the expert calls are held against.
int64_t hx_read(hx_pool* p, const uint8_t* base, int64_t bytes, uint64_t* checksum) {
    hx_job* j = &p->job;
    j->kind = 1;
    j->read_base = base;
    j->read_bytes = bytes;
    // 1 MiB pieces, or as many bytes as keep the pieces to a job's items (multiples of 64)
    const int64_t least = (bytes + HX_MAX_ITEMS - 1) / HX_MAX_ITEMS;
    j->read_piece = least > (1 << 20) ? (least + 63) / 64 * 64 : 1 << 20;
    atomic_store(&j->read_sum, 0);
    const int64_t t0 = now_ns();
    run_job(p, (int)((bytes + j->read_piece - 1) / j->read_piece));
    const int64_t t = now_ns() - t0;
    *checksum = atomic_load(&j->read_sum);
    return t;
}

// --- serving a mailbox ----------------------------------------------------------------------------
#define HX_NAP_MIN_NS 20000          // the serving thread's first nap once idle past spin_ns
#define HX_NAP_MAX_NS 1000000        // and its longest
static void* serve_main(void* arg) {
    hx_pool* p = (hx_pool*)arg;
    const hx_serve_args* a = &p->sa;
    uint32_t last = a->first;
    for (;;) {
        uint32_t s;
        int64_t t0 = now_ns(), nap_ns = 0;          // 0: spinning
        unsigned spins = 0;
        while ((s = __atomic_load_n(a->seq, __ATOMIC_ACQUIRE)) == last) {
            if (atomic_load(&p->serve_stop)) return NULL;
            // idle past spin_ns: poll between naps instead of spinning (the poster is a GPU, so
            // there is nothing to sleep on), the nap doubling from 20 µs to 1 ms while nothing
            // comes: an idle server wakes about a thousand times a second, and the first request
            // after a long idle waits up to 1 ms
            if (nap_ns) {
                const struct timespec nap = {0, nap_ns};
                nanosleep(&nap, NULL);
                nap_ns = nap_ns * 2 < HX_NAP_MAX_NS ? nap_ns * 2 : HX_NAP_MAX_NS;
                continue;
            }
            hx_pause();
            if ((++spins & 255) == 0 && now_ns() - t0 > p->spin_ns) nap_ns = HX_NAP_MIN_NS;
        }
        last = s;
        const int64_t t1 = now_ns();
        // the request's own tokens (a prefill call carries fewer than the mailbox holds): its
        // size is written before seq, so the acquire above orders the read
        const uint32_t lanes = __atomic_load_n(a->size, __ATOMIC_RELAXED);
        const int T = (int)(lanes / (uint32_t)a->K);
        int err = HX_ERR_ARGS;
        p->last_units = 0;
        if (lanes % (uint32_t)a->K == 0 && T >= 1 && T <= a->T)
            err = hx_run(p, a->L, a->table, a->n_keys, T, a->K, a->keys, a->weights, a->x, a->out);
        const uint64_t ns = (uint64_t)(now_ns() - t1);
        if (err) atomic_fetch_or(&p->serve_err, err);
        __atomic_store_n(a->done, s, __ATOMIC_RELEASE);
        atomic_fetch_add(&p->served_ns, ns);
        atomic_fetch_add(&p->served_rows, (uint64_t)p->last_units);
        if (ns > atomic_load(&p->served_max_ns)) atomic_store(&p->served_max_ns, ns);
        atomic_fetch_add(&p->served, 1);
    }
}

// Starts a thread that answers every request posted to the mailbox (seq bumped after size, keys,
// weights and x are written) with hx_run into out, then stores the request's number in done. A
// request carries size / K tokens, at most T (the mailbox's); a size outside that is answered
// with nothing computed and HX_ERR_ARGS in the served calls' error bits.
// While it runs, the pool is that thread's: hx_run and hx_read must not be called. Returns 0, or
// -1 if it is already serving or the thread could not start.
int hx_serve(hx_pool* p, const hx_layout* L, const int64_t* table, int64_t n_keys, int T, int K,
             const uint32_t* seq, uint32_t* done, const uint32_t* size, const int64_t* keys,
             const float* weights, const float* x, float* out) {
    if (p->serving || T < 1 || K < 1) return -1;
    // read here, not by the new thread: a request posted before that thread first looks is
    // still answered
    hx_serve_args a = {L, table, n_keys, T, K, seq, done, size, keys, weights, x, out,
                       __atomic_load_n(seq, __ATOMIC_ACQUIRE)};
    p->sa = a;
    atomic_store(&p->serve_stop, 0);
    atomic_store(&p->serve_err, 0);
    atomic_store(&p->served, 0);
    atomic_store(&p->served_ns, 0);
    atomic_store(&p->served_max_ns, 0);
    atomic_store(&p->served_rows, 0);
    if (pthread_create(&p->server, NULL, serve_main, p)) return -1;
    p->serving = 1;
    return 0;
}

// Stops the serving thread (after the request it may be answering); returns the error bits of
// the calls it served.
int hx_serve_stop(hx_pool* p, unsigned* served) {
    if (p->serving) {
        atomic_store(&p->serve_stop, 1);
        pthread_join(p->server, NULL);
        p->serving = 0;
    }
    if (served) *served = atomic_load(&p->served);
    return atomic_load(&p->serve_err);
}

int hx_serving(const hx_pool* p) { return p->serving; }

// What the serving thread's calls took since hx_serve: the requests answered, their hx_run wall
// time summed and their distinct rows summed; the longest call (ns) since hx_serve or the last
// read with reset_max, which starts it again at 0. May be read while serving (each figure on its
// own: a call may land between the reads).
void hx_serve_stats(hx_pool* p, int reset_max, unsigned* served, uint64_t* ns, uint64_t* max_ns,
                    uint64_t* rows) {
    *served = atomic_load(&p->served);
    *ns = atomic_load(&p->served_ns);
    *max_ns = reset_max ? atomic_exchange(&p->served_max_ns, 0) : atomic_load(&p->served_max_ns);
    *rows = atomic_load(&p->served_rows);
}
