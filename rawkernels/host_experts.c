// Host experts: NVFP4 expert rows computed on the host's CPU cores, read where the host store keeps
// them (cupool/layout.py's kernel layout, unchanged), so a miss can be computed beside the PCIe
// link instead of crossing it. Built at first use by cupool/hostexperts.py with the machine's C
// compiler (-O3 -march=native); not a CUDA file.
//
// A call: T tokens, K lanes a token (lane i is token i / K), each lane a row key (layer·E + expert,
// -1 padding) and a router weight. out[t, h] = Σ over token t's lanes, in lane order within a row,
// rows in order of first use, of weight · (w2 · act(w13 · x_t + b13) + b2)[h], for h < H.
//
// How threads split it: the caller groups lanes into units (one a distinct row) and expands x;
// then the caller and the pool's workers take items from two counters. Phase 1 item p: act strip
// p (16 columns of I) of every unit, its gate and up strips (or the up strip alone) times the
// unit's tokens; phase 2 item s: output strip s (16 rows of H) of every unit, written to out for
// every token. Phase 2 starts once every phase-1 item is counted done (all act strips are in
// place). An item's result does not depend on which thread runs it, so the output is the same
// bit for bit for any thread count. Only phase-2 item s writes out[., 16s ... 16s + 15].
//
// Inner loop: a strip (16 rows × Kp columns) is Kp/64 chunks of 32 lane blocks (16 bytes: 4
// words of 8 E2M1 codes, rows g and g + 8, columns 16t ... 16t + 15 of the chunk, L = 4g + t) and
// 64 scale bytes. A word's 8 codes are decoded with two variable shifts and one permute into 8
// floats in slot order, rows g, g + 8 alternating, columns k0, k0, k0 + 2, k0 + 2, k0 + 1, k0 + 1,
// k0 + 3, k0 + 3 (layout.py); x is expanded once into that order (`expand`), so each word is one
// multiply-add against 8 contiguous floats. A lane block's 4 words share one block scale per row:
// they are summed first, then scaled (pairs (s_g, s_g8) broadcast) into the strip's accumulator for
// g. With AVX-512 a vector holds two words (16 slots); without AVX2 and FMA (or with HX_PORTABLE)
// the same loops run one slot at a time.
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// HX_ISA: 2 AVX-512 (F), 1 AVX2 + FMA, 0 portable C; the best the compiler's target allows, less
// with -DHX_NO_AVX512 or -DHX_PORTABLE (the builds tests and benchmarks compare).
#if !defined(HX_PORTABLE) && defined(__AVX512F__) && !defined(HX_NO_AVX512)
#define HX_ISA 2
#elif !defined(HX_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define HX_ISA 1
#else
#define HX_ISA 0
#endif
#if HX_ISA
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define hx_pause() _mm_pause()
#elif defined(__aarch64__)
#define hx_pause() __asm__ __volatile__("yield")
#else
#define hx_pause() ((void)0)
#endif

#define HEADER_BYTES 256
#define CHUNK_BYTES 576      // 512 bytes of codes, then 64 scale bytes (layout.py)
#define TB 4                 // tokens of a unit multiplied against one decoded word at a time

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

static float E4M3[256];

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

// --- one strip times up to TB expanded vectors --------------------------------------------------
// y[b][r] = Σ_k code(r, k) · scale(r, k / 16) · x_b[k] for the strip's 16 rows r (no global scale).
// xe[b]: token b's expanded vector (`expand`), 2·Kp floats.
#if HX_ISA == 2
// Two words a vector: 16 slots, words q and q + 1 of the lane block.
static void strip_dot(const uint8_t* strip, int nch, const float* const* xe, int nb,
                      float y[TB][16]) {
    // a 16-entry permute reads 4 index bits; the 4th is a neighbour field's, so the table repeats
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                        0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m512i mag_shift = _mm512_setr_epi32(0, 3, 6, 9, 16, 19, 22, 25,
                                                0, 3, 6, 9, 16, 19, 22, 25);
    const __m512i sign_shift = _mm512_setr_epi32(18, 19, 16, 17, 2, 3, 0, 1,
                                                 18, 19, 16, 17, 2, 3, 0, 1);
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u);
    const __m512i lo = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i hi = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    for (int g = 0; g < 8; ++g) {
        __m512 acc[TB];
        for (int b = 0; b < TB; ++b) acc[b] = _mm512_setzero_ps();
        for (int c = 0; c < nch; ++c) {
            const uint8_t* ch = strip + (int64_t)c * CHUNK_BYTES;
            for (int t = 0; t < 4; ++t) {
                const int L = 4 * g + t;
                const __m512i blk = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(ch + 16 * L)));
                const float pair[2] = {E4M3[ch[512 + 2 * L]], E4M3[ch[513 + 2 * L]]};
                double pd;
                memcpy(&pd, pair, sizeof pd);
                const __m512 sv = _mm512_castpd_ps(_mm512_set1_pd(pd));   // s_g, s_g8, ...
                __m512 tmp[TB];
                for (int b = 0; b < TB; ++b) tmp[b] = _mm512_setzero_ps();
                const int m0 = 16 * c + 4 * t;
                for (int half = 0; half < 2; ++half) {
                    const __m512i v = _mm512_permutexvar_epi32(half ? hi : lo, blk);
                    const __m512 mag = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, mag_shift), table);
                    // mag ^ (sign moved to bit 31 & the sign bit): ternary-logic table 0x78
                    const __m512 dec = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
                        _mm512_castps_si512(mag), _mm512_sllv_epi32(v, sign_shift), sign_bit, 0x78));
                    for (int b = 0; b < TB; ++b)
                        if (b < nb)
                            tmp[b] = _mm512_fmadd_ps(dec, _mm512_loadu_ps(xe[b] + 8 * (m0 + 2 * half)), tmp[b]);
                }
                for (int b = 0; b < TB; ++b)
                    if (b < nb) acc[b] = _mm512_fmadd_ps(tmp[b], sv, acc[b]);
            }
        }
        for (int b = 0; b < nb; ++b) {
            float a[16];
            _mm512_storeu_ps(a, acc[b]);
            y[b][g] = ((a[0] + a[2]) + (a[4] + a[6])) + ((a[8] + a[10]) + (a[12] + a[14]));
            y[b][g + 8] = ((a[1] + a[3]) + (a[5] + a[7])) + ((a[9] + a[11]) + (a[13] + a[15]));
        }
    }
}
#elif HX_ISA == 1
static void strip_dot(const uint8_t* strip, int nch, const float* const* xe, int nb,
                      float y[TB][16]) {
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    // slot n = 4h + j: magnitude at bit 16h + 3j, sign at 16h + 12 + (j ^ 1) (moved to bit 31)
    const __m256i mag_shift = _mm256_setr_epi32(0, 3, 6, 9, 16, 19, 22, 25);
    const __m256i sign_shift = _mm256_setr_epi32(18, 19, 16, 17, 2, 3, 0, 1);
    const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u);
    for (int g = 0; g < 8; ++g) {
        __m256 acc[TB];
        for (int b = 0; b < TB; ++b) acc[b] = _mm256_setzero_ps();
        for (int c = 0; c < nch; ++c) {
            const uint8_t* ch = strip + (int64_t)c * CHUNK_BYTES;
            for (int t = 0; t < 4; ++t) {
                const int L = 4 * g + t;
                const uint32_t* w = (const uint32_t*)(ch + 16 * L);
                const float pair[2] = {E4M3[ch[512 + 2 * L]], E4M3[ch[513 + 2 * L]]};
                double pd;
                memcpy(&pd, pair, sizeof pd);
                const __m256 sv = _mm256_castpd_ps(_mm256_set1_pd(pd));   // s_g, s_g8, ...
                __m256 tmp[TB];
                for (int b = 0; b < TB; ++b) tmp[b] = _mm256_setzero_ps();
                const int m0 = 16 * c + 4 * t;
                for (int q = 0; q < 4; ++q) {
                    const __m256i v = _mm256_set1_epi32((int)w[q]);
                    const __m256 mag = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(v, mag_shift));
                    const __m256i sg = _mm256_and_si256(_mm256_sllv_epi32(v, sign_shift), sign_bit);
                    const __m256 dec = _mm256_xor_ps(mag, _mm256_castsi256_ps(sg));
                    for (int b = 0; b < TB; ++b)
                        if (b < nb)
                            tmp[b] = _mm256_fmadd_ps(dec, _mm256_loadu_ps(xe[b] + 8 * (m0 + q)), tmp[b]);
                }
                for (int b = 0; b < TB; ++b)
                    if (b < nb) acc[b] = _mm256_fmadd_ps(tmp[b], sv, acc[b]);
            }
        }
        for (int b = 0; b < nb; ++b) {
            float a[8];
            _mm256_storeu_ps(a, acc[b]);
            y[b][g] = (a[0] + a[2]) + (a[4] + a[6]);
            y[b][g + 8] = (a[1] + a[3]) + (a[5] + a[7]);
        }
    }
}
#else
static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static void strip_dot(const uint8_t* strip, int nch, const float* const* xe, int nb,
                      float y[TB][16]) {
    for (int g = 0; g < 8; ++g) {
        float acc[TB][8] = {{0}};
        for (int c = 0; c < nch; ++c) {
            const uint8_t* ch = strip + (int64_t)c * CHUNK_BYTES;
            for (int t = 0; t < 4; ++t) {
                const int L = 4 * g + t;
                const float s[2] = {E4M3[ch[512 + 2 * L]], E4M3[ch[513 + 2 * L]]};
                float tmp[TB][8] = {{0}};
                for (int q = 0; q < 4; ++q) {
                    uint32_t v;
                    memcpy(&v, ch + 16 * L + 4 * q, 4);
                    const float* xq[TB];
                    for (int b = 0; b < nb; ++b) xq[b] = xe[b] + 8 * (16 * c + 4 * t + q);
                    for (int n = 0; n < 8; ++n) {
                        const int h = n >> 2, j = n & 3;
                        const float mag = E2M1[(v >> (16 * h + 3 * j)) & 7];
                        const float d = ((v >> (16 * h + 12 + (j ^ 1))) & 1) ? -mag : mag;
                        for (int b = 0; b < nb; ++b) tmp[b][n] += d * xq[b][n];
                    }
                }
                for (int b = 0; b < nb; ++b)
                    for (int n = 0; n < 8; ++n) acc[b][n] += tmp[b][n] * s[n & 1];
            }
        }
        for (int b = 0; b < nb; ++b) {
            y[b][g] = (acc[b][0] + acc[b][2]) + (acc[b][4] + acc[b][6]);
            y[b][g + 8] = (acc[b][1] + acc[b][3]) + (acc[b][5] + acc[b][7]);
        }
    }
}
#endif

// Where column k of a vector sits in its expanded form: 8 floats a group of 4 columns, in a word's
// slot order (column 4m + r at 8m + POS[r] and the next float).
static const int POS[4] = {0, 4, 2, 6};

static void expand(const float* x, int64_t n, int64_t kp, float* xe) {
    for (int64_t k = 0; k < kp; ++k) {
        const float v = k < n ? x[k] : 0.0f;
        float* p = xe + 8 * (k / 4) + POS[k % 4];
        p[0] = v;
        p[1] = v;
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
typedef struct {
    int kind;                        // 0 an expert call, 1 a read of `bytes` (bandwidth probe)
    const hx_layout* L;
    int units;
    const int64_t* unit_row;         // [units] host address of the unit's row
    const int* unit_start;           // [units + 1] into unit_lane
    const int* unit_lane;            // lanes of the units, unit by unit, in lane order
    const int* lane_token;           // [W]
    const float* lane_w;             // [W] (0 for dropped lanes)
    const float* xe;                 // [T][2·Hp]
    float* ae;                       // [W][2·Ip] the lanes' expanded act rows
    float* out;                      // [T][H]
    int T;
    int n1, n2;                      // items of the two phases
    atomic_int next1, next2, done1;
    const uint8_t* read_base;        // kind 1
    int64_t read_bytes;
    atomic_ullong read_sum;
} hx_job;

// What hx_serve answers: requests posted to a mailbox (rawkernels/host_handoff.cu).
typedef struct {
    const hx_layout* L;
    const int64_t* table;
    int64_t n_keys;
    int T, K;
    const uint32_t* seq;             // the request's number (written last by the poster)
    uint32_t* done;                  // the answered number (written last here)
    const int64_t* keys;             // [T·K]
    const float* weights;            // [T·K]
    const float* x;                  // [T, H]
    float* out;                      // [T, H]
    uint32_t first;                  // seq when serving started: requests after it are answered
} hx_serve_args;

typedef struct hx_pool {
    int threads;                     // the caller and threads - 1 workers
    pthread_t* tid;
    atomic_uint gen;                 // bumped to hand the workers a job
    atomic_int finished;             // workers done with the current job
    atomic_int stop;
    atomic_int sleepers;
    int64_t spin_ns;                 // how long an idle worker spins before it sleeps
    pthread_mutex_t mu;
    pthread_cond_t cv;
    hx_job job;
    float *xe, *ae;                  // scratch, grown as calls need
    size_t xe_cap, ae_cap;
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
            const float* xe[TB];
            for (int b = 0; b < nb; ++b)
                xe[b] = j->xe + 2 * hp * j->lane_token[j->unit_lane[i0 + b]];
            float yu[TB][16], yg[TB][16];
            strip_dot(up_strip, nch, xe, nb, yu);
            if (L->gated) strip_dot(gate_strip, nch, xe, nb, yg);
            for (int b = 0; b < nb; ++b) {
                float* ae = j->ae + 2 * ip * j->unit_lane[i0 + b];
                for (int r = 0; r < 16; ++r) {
                    const int64_t col = 16 * (int64_t)p + r;
                    float up = yu[b][r] * hs[1], gate = 0.0f;
                    if (L->gated) gate = yg[b][r] * hs[0];
                    if (bias) {
                        gate += bias[col];
                        up += bias[ip + col];
                    }
                    // columns past I are zero weights (and zero biases) and stay zero
                    const float a = col < L->inter ? activate(L, gate, up) : 0.0f;
                    float* q = ae + 8 * (col / 4) + POS[col % 4];
                    q[0] = a;
                    q[1] = a;
                }
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
        const float gs = ((const float*)row)[2];
        const uint8_t* strip = row + L->w2_offset + s * 9 * ip;
        const float* bias = L->bias_offset >= 0
            ? (const float*)(row + L->bias_offset) + 2 * ip + h0 : NULL;
        for (int i0 = j->unit_start[u]; i0 < j->unit_start[u + 1]; i0 += TB) {
            const int nb = j->unit_start[u + 1] - i0 < TB ? j->unit_start[u + 1] - i0 : TB;
            const float* ae[TB];
            for (int b = 0; b < nb; ++b) ae[b] = j->ae + 2 * ip * j->unit_lane[i0 + b];
            float y[TB][16];
            strip_dot(strip, nch, ae, nb, y);
            for (int b = 0; b < nb; ++b) {
                const int lane = j->unit_lane[i0 + b];
                const float w = j->lane_w[lane];
                float* o = j->out + j->lane_token[lane] * H + h0;
                for (int r = 0; r < rows; ++r) o[r] += w * (y[b][r] * gs + (bias ? bias[r] : 0.0f));
            }
        }
    }
}

// One thread's part of the current job.
static void run_share(hx_job* j) {
    if (j->kind == 1) {
        // the read probe: claims 1 MiB pieces and sums their 64-bit words
        const int64_t piece = 1 << 20, n = (j->read_bytes + piece - 1) / piece;
        unsigned long long sum = 0;
        for (;;) {
            const int64_t i = atomic_fetch_add(&j->next1, 1);
            if (i >= n) break;
            const uint64_t* p = (const uint64_t*)(j->read_base + i * piece);
            const int64_t words = (i + 1 == n ? j->read_bytes - i * piece : piece) / 8;
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int64_t k = 0;
            for (; k + 4 <= words; k += 4) {
                s0 += p[k];
                s1 += p[k + 1];
                s2 += p[k + 2];
                s3 += p[k + 3];
            }
            for (; k < words; ++k) s0 += p[k];
            sum += s0 + s1 + s2 + s3;
        }
        atomic_fetch_add(&j->read_sum, sum);
        return;
    }
    for (;;) {
        const int p = atomic_fetch_add_explicit(&j->next1, 1, memory_order_relaxed);
        if (p >= j->n1) break;
        phase1_item(j, p);
        atomic_fetch_add_explicit(&j->done1, 1, memory_order_release);
    }
    while (atomic_load_explicit(&j->done1, memory_order_acquire) < j->n1) hx_pause();
    for (;;) {
        const int s = atomic_fetch_add_explicit(&j->next2, 1, memory_order_relaxed);
        if (s >= j->n2) break;
        phase2_item(j, s);
    }
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
        atomic_fetch_add(&p->finished, 1);
    }
}

// Hands the job to the workers, runs a share on the calling thread, and returns once every worker
// is done with it (so the job and the scratch may be reused).
static void run_job(hx_pool* p) {
    atomic_store(&p->finished, 0);
    atomic_fetch_add(&p->gen, 1);                // publishes the job (sequentially consistent)
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_share(&p->job);
    while (atomic_load(&p->finished) < p->threads - 1) hx_pause();
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

// *buf holds at least `need` elements of `elem` bytes (*cap of them now).
static int grow(void** buf, size_t* cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    if (renew(buf, need * elem)) return -1;
    *cap = need;
    return 0;
}

// --- the C interface (cupool/hostexperts.py) ----------------------------------------------------
void hx_destroy(hx_pool* p);

hx_pool* hx_create(int threads, int64_t spin_ns) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_tables);
    if (threads < 1) return NULL;
    hx_pool* p = (hx_pool*)calloc(1, sizeof(hx_pool));
    if (!p) return NULL;
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
    free(p->xe);
    free(p->ae);
    free(p->unit_row);
    free(p->unit_start);
    free(p->unit_lane);
    free(p->lane_token);
    free(p->lane_unit);
    free(p->lane_w);
    free(p);
}

// Which strip_dot this build has: 2 AVX-512, 1 AVX2 + FMA, 0 portable C.
int hx_isa(void) { return HX_ISA; }

// out [T, H] = the experts of T·K lanes (keys [T·K]: layer·E + expert into table [n_keys] of host
// row addresses, -1 padding; weights [T·K]) applied to x [T, H] (float32, rows of H). Returns
// error bits (HX_ERR_*); with HX_ERR_KEY, HX_ERR_ARGS or HX_ERR_MEMORY out is not written.
int hx_run(hx_pool* p, const hx_layout* L, const int64_t* table, int64_t n_keys, int T, int K,
           const int64_t* keys, const float* weights, const float* x, float* out) {
    if (T < 1 || K < 1 || L->hp % 64 || L->ip % 64 || L->hidden > L->hp || L->inter > L->ip)
        return HX_ERR_ARGS;
    const int W = T * K;
    int err = 0;
    for (int i = 0; i < W; ++i)
        if (keys[i] < -1 || keys[i] >= n_keys) return HX_ERR_KEY;
    if (grow((void**)&p->xe, &p->xe_cap, (size_t)T * 2 * L->hp, sizeof(float)) ||
        grow((void**)&p->ae, &p->ae_cap, (size_t)W * 2 * L->ip, sizeof(float)))
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
    for (int t = 0; t < T; ++t) expand(x + (int64_t)t * L->hidden, L->hidden, L->hp, p->xe + (int64_t)t * 2 * L->hp);
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
    j->xe = p->xe;
    j->ae = p->ae;
    j->out = out;
    j->T = T;
    j->n1 = (int)(L->ip / 16);
    j->n2 = (int)((L->hidden + 15) / 16);
    atomic_store(&j->next1, 0);
    atomic_store(&j->next2, 0);
    atomic_store(&j->done1, 0);
    run_job(p);
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
    atomic_store(&j->next1, 0);
    atomic_store(&j->read_sum, 0);
    const int64_t t0 = now_ns();
    run_job(p);
    const int64_t t = now_ns() - t0;
    *checksum = atomic_load(&j->read_sum);
    return t;
}

// --- serving a mailbox ----------------------------------------------------------------------------
static void* serve_main(void* arg) {
    hx_pool* p = (hx_pool*)arg;
    const hx_serve_args* a = &p->sa;
    uint32_t last = a->first;
    for (;;) {
        uint32_t s;
        int64_t t0 = now_ns();
        unsigned spins = 0;
        while ((s = __atomic_load_n(a->seq, __ATOMIC_ACQUIRE)) == last) {
            if (atomic_load(&p->serve_stop)) return NULL;
            hx_pause();
            // idle past spin_ns: poll every 20 µs instead of spinning (the poster is a GPU, so
            // there is nothing to sleep on); the first request after that waits up to 20 µs
            if ((++spins & 255) == 0 && now_ns() - t0 > p->spin_ns) {
                const struct timespec nap = {0, 20000};
                nanosleep(&nap, NULL);
            }
        }
        last = s;
        const int err = hx_run(p, a->L, a->table, a->n_keys, a->T, a->K, a->keys, a->weights, a->x,
                               a->out);
        if (err) atomic_fetch_or(&p->serve_err, err);
        __atomic_store_n(a->done, s, __ATOMIC_RELEASE);
        atomic_fetch_add(&p->served, 1);
    }
}

// Starts a thread that answers every request posted to the mailbox (seq bumped after keys,
// weights and x are written) with hx_run into out, then stores the request's number in done.
// While it runs, the pool is that thread's: hx_run and hx_read must not be called. Returns 0, or
// -1 if it is already serving or the thread could not start.
int hx_serve(hx_pool* p, const hx_layout* L, const int64_t* table, int64_t n_keys, int T, int K,
             const uint32_t* seq, uint32_t* done, const int64_t* keys, const float* weights,
             const float* x, float* out) {
    if (p->serving || T < 1 || K < 1) return -1;
    // read here, not by the new thread: a request posted before that thread first looks is
    // still answered
    hx_serve_args a = {L, table, n_keys, T, K, seq, done, keys, weights, x, out,
                       __atomic_load_n(seq, __ATOMIC_ACQUIRE)};
    p->sa = a;
    atomic_store(&p->serve_stop, 0);
    atomic_store(&p->serve_err, 0);
    atomic_store(&p->served, 0);
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
