// Decode attention of one layer for the B tokens of a decode step (one a slot), over the slot
// cache, with what comes between the QKV projection and the o-projection fused in: q/k RMSNorm
// over the head dim (Qwen3's q_norm / k_norm), rotary embedding, the write of the new key and
// value into the cache, grouped-query attention with an optional sliding window and optional
// attention sinks (gpt-oss), and the merge of the split-KV partial results.
//
// How blocks split the work: grid (NS, hk, B). Block (s, h, b) takes the G = nh / hk query heads
// of KV head h of slot b and the s-th of NS equal parts of the positions that slot b's token
// attends to, [lo, pos[b]] (lo = pos − window + 1 with a sliding window, else 0), at least
// MINCHUNK positions a part (so short contexts use few parts). The parts are cut on the device
// from pos[b], so a captured graph replays at any position. Within a block, tiles of TP = 64
// positions: scores (two threads a position, half the head dim each, one shuffle to join), an
// online softmax per head (m, l kept in shared memory), then P·V with the head dim across the
// lanes of each warp and the tile's positions across the warps.
//
// Rounding follows transformers: q and k leave the projection in bf16; the norm is
// bf16(w · bf16(x · rsqrt(mean(x²) + eps))); the rotary embedding is
// bf16(bf16(x · cos) + bf16(rotate_half(x) · sin)) with transformers' own bf16 cos / sin tables
// (passed in, [L_max, D]). Scores, softmax and P·V run in float32; the output is bf16.
//
// Who writes what, in order:
// - the new key and value of slot b, KV head h go to the cache at pos[b], written only by the
//   block whose part holds pos[b], before (__syncthreads) that block reads its positions; no
//   other block reads position pos[b] (the parts are disjoint).
// - part_o [B, nh, NS, D], part_ml [B, nh, NS, 2] (max, sum of exponentials): written by block
//   (s, h, b) for its G heads, then a fence, then a ticket on count[b, h]. Only the parts that
//   hold positions take part: the first ceil(n / chunk) of the NS (n the positions slot b's token
//   attends to), worked out alike by every block from pos[b]; a block of a part past them
//   returns at once, writing nothing.
// - out [B, nh · D]: written by the last block of (h, b) to take a ticket, which reads the used
//   parts through L2 and merges them (with the sink's exp(sink − m) in the denominator), and
//   puts count[b, h] back to zero for the next launch.
//   The merge's part weights live in the block's scratch: G · NS ≤ max(G, 2) · D, so NS ≤ 64.
//
// AHEAD = 1: a tile's loads are issued together, ahead of their use. A warp's value rows of the
// tile (TP / NWARP positions) go into registers at the start of the tile, before the scores and
// the softmax, which they do not depend on, and P·V multiplies registers; a thread's key loads
// for its scores are issued eight at a time (all of them up to D = 128). With AHEAD = 0 each P·V position's
// load is issued in its loop iteration, after the softmax, and the key loads two at a time: one
// L2 round trip after another, which one warp a scheduler does not hide. The last block's merge
// likewise issues the loads of all its elements' parts eight parts at a time (AHEAD = 0: one element
// after another). The sums run in the same order either way: the outputs are the same bits.
//
// ATTN_TRACE = 1 is the profiling build (the same outputs): thread 0 of each block writes
// %globaltimer stamps into trace [block][TRACE_STAMPS] (block = s + NS·(h + hk·b)): 0 start,
// 1 producers waited for, 2 queries normed and rotated, 3 the new key and value written (the
// block holding pos, else as 2), 4 the tile loop done, 5 the part written and its ticket taken,
// 6 the merge's part weights ready and 7 the merge done (the last block only). A part past the
// used ones stamps 0 alone. benchmarks/profile_attention.py reads them.
#include "common.cuh"

#ifndef D
#define D 128             // head dim
#endif
#ifndef G
#define G 8               // query heads per KV head
#endif
#ifndef MINCHUNK
#define MINCHUNK 64       // fewest positions a part
#endif
#ifndef AHEAD
#define AHEAD 0           // 1: a tile's key and value loads issued ahead of their use (below)
#endif
#ifndef ATTN_TRACE
#define ATTN_TRACE 0
#endif
#define TRACE_STAMPS 8
#define TP 64             // positions a tile
#define THREADS 128
#define NWARP (THREADS / 32)
#define DPL (D / 32)      // head dims a lane holds in P·V

static_assert(D % 64 == 0 && D <= 256, "head dims of 64, 128, 192 or 256");
static_assert(G >= 1 && G * DPL <= 64, "G query heads of D dims fit a lane's accumulators");
static_assert(2 * TP == THREADS, "two threads a position in the score phase");

// Loads through L2 only (other blocks wrote these; L1 is not coherent). Not volatile: a merge
// issues its loads together; the barrier before them keeps them after the ticket (memory clobber).
CUPOOL_DEVICE float ld_cg(const float* p) {
    float v;
    asm("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

// A lane's DPL consecutive bf16 values of a cache row, in one load where DPL allows.
CUPOOL_DEVICE void load_dims(const u16* p, float* f) {
#if DPL % 4 == 0
#pragma unroll
    for (int i = 0; i < DPL; i += 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(p + i);
        f[i] = __uint_as_float(v.x << 16);
        f[i + 1] = __uint_as_float(v.x & 0xffff0000u);
        f[i + 2] = __uint_as_float(v.y << 16);
        f[i + 3] = __uint_as_float(v.y & 0xffff0000u);
    }
#else
#pragma unroll
    for (int i = 0; i < DPL; i += 2) {
        const u32 v = *reinterpret_cast<const u32*>(p + i);
        f[i] = __uint_as_float(v << 16);
        f[i + 1] = __uint_as_float(v & 0xffff0000u);
    }
#endif
}

#if AHEAD
// A lane's DPL values of a cache row as raw bf16 pairs (loaded now, unpacked when used).
#define VWORDS (DPL / 2)
CUPOOL_DEVICE void load_raw(const u16* p, u32* w) {
#if DPL % 4 == 0
#pragma unroll
    for (int i = 0; i < DPL; i += 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(p + i);
        w[i / 2] = v.x;
        w[i / 2 + 1] = v.y;
    }
#else
#pragma unroll
    for (int i = 0; i < DPL; i += 2) w[i / 2] = *reinterpret_cast<const u32*>(p + i);
#endif
}
#endif

// P·V of one position: acc[g] += p_g · v for each of the G heads, p_g = sc[g][p] (the tile's
// probabilities), v the lane's DPL dims of the position's value row.
CUPOOL_DEVICE void add_pv(float (&acc)[G][DPL], const float (&sc)[G][TP], int p, const float* vf) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float pr = sc[g][p];
#pragma unroll
        for (int k = 0; k < DPL; ++k) acc[g][k] += pr * vf[k];
    }
}

CUPOOL_DEVICE float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#if ATTN_TRACE
// stamp k of this block (thread 0)
#define STAMP(k)                                                                              \
    do {                                                                                      \
        if (threadIdx.x == 0) {                                                               \
            u64 t_;                                                                           \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                            \
            trace[(blockIdx.x + (i64)gridDim.x * (blockIdx.y + (i64)gridDim.y * blockIdx.z)) \
                  * TRACE_STAMPS + (k)] = t_;                                                 \
        }                                                                                     \
    } while (0)
#else
#define STAMP(k) do {} while (0)
#endif

// x [n][D] (float holding bf16 values) → norm (if w) and rotary embedding, in place, rows in
// parallel over the block; tmp is a [n][D] scratch. Every thread of the block calls it.
CUPOOL_DEVICE void norm_rope(float* x, float* tmp, int n, const u16* w, float eps,
                             const u16* cs, const u16* sn) {
    __shared__ float rs[G];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (w) {
        for (int r = warp; r < n; r += NWARP) {
            float ss = 0.0f;
            for (int i = lane; i < D; i += 32) ss += x[r * D + i] * x[r * D + i];
            ss = warp_sum(ss);
            if (lane == 0) rs[r] = rsqrtf(ss / (float)D + eps);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n * D; i += THREADS)
            x[i] = round_bf16(bf16_to_f32(w[i % D]) * round_bf16(x[i] * rs[i / D]));
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n * D; i += THREADS) tmp[i] = x[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n * D; i += THREADS) {
        const int r = i / D, c = i % D;
        const float rot = c < D / 2 ? -tmp[r * D + c + D / 2] : tmp[r * D + c - D / 2];
        x[i] = round_bf16(round_bf16(tmp[i] * bf16_to_f32(cs[c])) +
                          round_bf16(rot * bf16_to_f32(sn[c])));
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS)
dense_attention(const u16* __restrict__ qkv, i32 nh, i32 hk,
                const u16* __restrict__ q_norm, const u16* __restrict__ k_norm, float eps,
                const u16* __restrict__ cos_t, const u16* __restrict__ sin_t,
                const i64* __restrict__ pos, u16* kc, u16* vc, i32 max_len,
                float scale, i32 window, const u16* __restrict__ sinks,
                float* part_o, float* part_ml, i32* count, u16* out
#if ATTN_TRACE
                , u64* trace
#endif
                ) {
    __shared__ float qs[G * D];        // queries, normed and rotated (bf16 values)
    __shared__ float tmp[(G > 1 ? G : 2) * D];   // scratch; then the merge of the warps' P·V
    __shared__ float sc[G][TP];        // a tile's scores, then its probabilities
    __shared__ float m_run[G], l_run[G], alpha[G];
    __shared__ int last;

    STAMP(0);
    const int NS = gridDim.x, s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 stride = (i64)(nh + 2 * hk) * D;               // one token's q, k, v
    const u16* row = qkv + b * stride;
    const i64 P = min(max(pos[b], (i64)0), (i64)max_len - 1);
    const i64 lo = window > 0 ? max((i64)0, P - window + 1) : 0;
    const i64 n = P - lo + 1;
    const i64 chunk = max((i64)MINCHUNK, (n + NS - 1) / NS);
    // the parts that hold positions: 1 .. NS (a short context leaves the rest empty); only they
    // take part, so the ticket counts them and the merge reads them alone
    const int used = (int)((n + chunk - 1) / chunk);
    if (s >= used) return;
    const i64 start = lo + s * chunk, end = min(start + chunk, P + 1);
    const u16* cs = cos_t + P * D;
    const u16* sn = sin_t + P * D;
    const i64 cache_base = ((i64)b * hk + h) * max_len * D;

    // Everything below reads data no earlier phase writes (the cache rows of this part, the
    // norms, the rotary row) only after a chain of dependent phases: ask for all of it now, so
    // those reads find it in L2. The first tile's keys and values are most of it.
    {
        const i64 first = min(end, start + TP);
        const int lines = D * 2 / 128;                    // 128-byte lines a cache row
        for (i64 i = threadIdx.x; i < (first - start) * lines; i += THREADS) {
            const i64 off = cache_base + (start + i / lines) * D + (i % lines) * 64;
            prefetch_l2(kc + off);
            prefetch_l2(vc + off);
        }
        if (threadIdx.x < lines) {
            prefetch_l2(cs + threadIdx.x * 64);
            prefetch_l2(sn + threadIdx.x * 64);
            if (q_norm) prefetch_l2(q_norm + threadIdx.x * 64);
            if (k_norm) prefetch_l2(k_norm + threadIdx.x * 64);
        }
    }
    // qkv is the kernel before's output (pos, the cache's older rows, the norms and the rotary
    // table are older: read above, before the wait, when launched as a dependent)
    wait_for_producers();
    let_consumers_launch();
    STAMP(1);
    for (int i = threadIdx.x; i < G * D; i += THREADS)
        qs[i] = bf16_to_f32(row[(i64)(h * G) * D + i]);
    if (threadIdx.x < G) { m_run[threadIdx.x] = -__int_as_float(0x7f800000); l_run[threadIdx.x] = 0.0f; }
    __syncthreads();
    norm_rope(qs, tmp, G, q_norm, eps, cs, sn);
    STAMP(2);
    STAMP(3);

    if (start <= P && P < end) {               // this part holds the new token: write k and v
        for (int i = threadIdx.x; i < D; i += THREADS)
            tmp[i] = bf16_to_f32(row[(i64)(nh + h) * D + i]);
        __syncthreads();
        norm_rope(tmp, tmp + D, 1, k_norm, eps, cs, sn);
        for (int i = threadIdx.x; i < D; i += THREADS) {
            kc[cache_base + P * D + i] = f32_to_bf16(tmp[i]);
            vc[cache_base + P * D + i] = row[(i64)(nh + hk + h) * D + i];
        }
        __syncthreads();
        STAMP(3);
    }

    float acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;

    for (i64 j0 = start; j0 < end; j0 += TP) {
#if AHEAD
        // this warp's P·V positions j0 + warp + i·NWARP: their value rows, asked for now
        u32 vraw[TP / NWARP][VWORDS];
#pragma unroll
        for (int i = 0; i < TP / NWARP; ++i) {
            const i64 j = j0 + warp + i * NWARP;
            if (j < end) {
                load_raw(vc + cache_base + j * D + lane * DPL, vraw[i]);
            } else {
#pragma unroll
                for (int k = 0; k < VWORDS; ++k) vraw[i][k] = 0u;
            }
        }
#endif
        // scores: thread pair (2p, 2p + 1) takes position j0 + p, half the head dim each
        {
            const int p = threadIdx.x >> 1, half = threadIdx.x & 1;
            const i64 j = j0 + p;
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; ++g) dot[g] = 0.0f;
            if (j < end) {
                const u16* k = kc + cache_base + j * D + half * (D / 2);
                const float* q = qs + half * (D / 2);
#if AHEAD
#pragma unroll 8                    // every key load of D ≤ 128 at once; half of them at 256
#else
#pragma unroll 2
#endif
                for (int c = 0; c < D / 2; c += 8) {
                    const u32x4 v = *reinterpret_cast<const u32x4*>(k + c);
                    const u32 wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float k0 = __uint_as_float(wv[e] << 16);
                        const float k1 = __uint_as_float(wv[e] & 0xffff0000u);
#pragma unroll
                        for (int g = 0; g < G; ++g)
                            dot[g] += q[g * D + c + 2 * e] * k0 + q[g * D + c + 2 * e + 1] * k1;
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], 1);
                if ((g & 1) == half)
                    sc[g][p] = j < end ? dot[g] * scale : -__int_as_float(0x7f800000);
            }
        }
        __syncthreads();
        // online softmax: warp w takes heads w, w + 4, ...
        for (int g = warp; g < G; g += NWARP) {
            const float a = sc[g][lane], c = sc[g][lane + 32];
            float mx = fmaxf(a, c);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m_run[g], mx);
            const float pa = expf(a - m_new), pc = expf(c - m_new);
            sc[g][lane] = pa;
            sc[g][lane + 32] = pc;
            const float sum = warp_sum(pa + pc);
            __syncwarp();
            if (lane == 0) {
                const float al = expf(m_run[g] - m_new);
                alpha[g] = al;
                l_run[g] = l_run[g] * al + sum;
                m_run[g] = m_new;
            }
        }
        __syncthreads();
        // P·V: warp w takes the tile's positions w, w + 4, ...; lane the dims lane·DPL ...
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] *= alpha[g];
#if AHEAD
#pragma unroll
        for (int i = 0; i < TP / NWARP; ++i) {
            const int p = warp + i * NWARP;
            if (j0 + p >= end) break;
            float vf[DPL];
#pragma unroll
            for (int k = 0; k < VWORDS; ++k) {
                vf[2 * k] = __uint_as_float(vraw[i][k] << 16);
                vf[2 * k + 1] = __uint_as_float(vraw[i][k] & 0xffff0000u);
            }
            add_pv(acc, sc, p, vf);
        }
#else
        for (int p = warp; p < TP && j0 + p < end; p += NWARP) {
            float vf[DPL];
            load_dims(vc + cache_base + (j0 + p) * D + lane * DPL, vf);
            add_pv(acc, sc, p, vf);
        }
#endif
        __syncthreads();
    }

    STAMP(4);
    // the warps' P·V sums, in warp order (deterministic), into tmp [G][D]
    for (int w = 0; w < NWARP; ++w) {
        if (warp == w) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int i = 0; i < DPL; ++i) {
                    float* o = &tmp[g * D + lane * DPL + i];
                    *o = (w == 0 ? 0.0f : *o) + acc[g][i];
                }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < G * D; i += THREADS) {
        const int g = i / D, c = i % D;
        const i64 head = (i64)b * nh + h * G + g;
        part_o[(head * NS + s) * D + c] = tmp[i];
        if (c == 0) {
            part_ml[(head * NS + s) * 2] = m_run[g];
            part_ml[(head * NS + s) * 2 + 1] = l_run[g];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&count[b * hk + h], 1) == used - 1;
        if (last) count[b * hk + h] = 0;
    }
    __syncthreads();
    STAMP(5);
    if (!last) return;
    __threadfence();
    // the merge: part weights per head first (G·NS ≤ the scratch, checked by the launcher),
    // then each output element sums its used parts with loads that depend on nothing
    float* wm = tmp;                           // [G][NS]: max, then the part's weight
    float* wl = qs;                            // [G][NS]: sum of exponentials
    for (int i = threadIdx.x; i < G * used; i += THREADS) {
        const int g = i / used, q = i % used;
        const i64 head = (i64)b * nh + h * G + g;
        wm[g * NS + q] = ld_cg(part_ml + (head * NS + q) * 2);
        wl[g * NS + q] = ld_cg(part_ml + (head * NS + q) * 2 + 1);
    }
    __syncthreads();
    for (int g = warp; g < G; g += NWARP) {
        const float sink = sinks ? bf16_to_f32(sinks[h * G + g]) : -__int_as_float(0x7f800000);
        float M = sink;
        for (int q = lane; q < used; q += 32) M = fmaxf(M, wm[g * NS + q]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float den = 0.0f;
        for (int q = lane; q < used; q += 32) den += expf(wm[g * NS + q] - M) * wl[g * NS + q];
        den = warp_sum(den) + (sinks ? expf(sink - M) : 0.0f);
        __syncwarp();
        for (int q = lane; q < used; q += 32) wm[g * NS + q] = expf(wm[g * NS + q] - M) / den;
    }
    __syncthreads();
    STAMP(6);
#if AHEAD
    // a thread's EPT elements i = threadIdx.x + e · THREADS together: the loads of MP parts of
    // every element are issued at once, then summed part by part (the order of the loop below)
    constexpr int EPT = (G * D + THREADS - 1) / THREADS;
    constexpr int MP = EPT > 8 ? 4 : 8;          // ≤ 64 loads in flight a thread
    float num[EPT];
#pragma unroll
    for (int e = 0; e < EPT; ++e) num[e] = 0.0f;
    // element i's part q sits at part_o + ((b·nh + h·G + i / D) · NS + q) · D + i % D
    const float* po = part_o + ((i64)b * nh + h * G) * NS * D;
    for (int q0 = 0; q0 < used; q0 += MP) {
        float v[EPT][MP];
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
            const int i = threadIdx.x + e * THREADS;
            const float* o = po + ((i / D) * NS + q0) * D + i % D;
#pragma unroll
            for (int k = 0; k < MP; ++k)
                v[e][k] = i < G * D && q0 + k < used ? ld_cg(o + k * D) : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
            const int g = (threadIdx.x + e * THREADS) / D;
#pragma unroll
            for (int k = 0; k < MP; ++k)
                if (q0 + k < used && g < G) num[e] += wm[g * NS + q0 + k] * v[e][k];
        }
    }
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
        const int i = threadIdx.x + e * THREADS;
        if (i < G * D) out[(i64)b * nh * D + (i64)(h * G) * D + i] = f32_to_bf16(num[e]);
    }
#else
    for (int i = threadIdx.x; i < G * D; i += THREADS) {
        const int g = i / D, c = i % D;
        const i64 head = (i64)b * nh + h * G + g;
        const float* o = part_o + head * NS * D + c;
        float num = 0.0f;
#pragma unroll 8
        for (int q = 0; q < used; ++q) num += wm[g * NS + q] * ld_cg(o + (i64)q * D);
        out[(i64)b * nh * D + (i64)(h * G + g) * D + c] = f32_to_bf16(num);
    }
#endif
    STAMP(7);
}
