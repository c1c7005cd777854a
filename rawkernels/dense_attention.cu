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
// - Only the parts that hold positions take part: the first `used` = ceil(n / chunk) of the NS
//   (n the positions slot b's token attends to), worked out alike by every block from pos[b]; a
//   block of a part past them returns at once, writing nothing.
// - used = 1 (a context of at most MINCHUNK positions): the block writes out [B, nh · D] itself.
// - Otherwise part_o [B, nh, NS, D], part_ml [B, nh, NS, 2] (max, sum of exponentials): written
//   by block (s, h, b) for its G heads, then a fence, then a ticket. Up to 2 · MGROUP parts are
//   merged by the last block to take the ticket on count[b, h, 0], which reads them through L2
//   and writes out (with the sink's exp(sink − m) in the denominator). More parts are merged in
//   two levels, so that no one block reads all of them: the parts in groups of MGROUP, the last
//   block of each group (its ticket on count[b, h, 1 + group]) merging the group into the
//   group's first part (max and sum of exponentials over the group; unnormalised), then taking
//   the ticket on count[b, h, 0]; the last of those merges the groups' first parts into out.
//   Each block that takes a last ticket puts that counter back to zero for the next launch.
//   The merge's part weights live in the block's scratch: G · NS ≤ max(G, 2) · D, so NS ≤ 64.
//
// AHEAD = 1: a tile's loads are issued together, ahead of their use. A warp's value rows of the
// tile (TP / NWARP positions) go into registers at the start of the tile, before the scores and
// the softmax, which they do not depend on, and P·V multiplies registers; a thread's key loads
// for its scores are issued eight at a time (all of them up to D = 128). With AHEAD = 0 each P·V position's
// load is issued in its loop iteration, after the softmax, and the key loads two at a time: one
// L2 round trip after another, which one warp a scheduler does not hide. A merge issues the
// loads of MP parts of its elements at once either way (fewer parts with AHEAD = 0, which keeps
// to fewer registers). The sums run in the same order either way: the outputs are the same bits.
//
// ATTN_TRACE = 1 is the profiling build (the same outputs): thread 0 of each block writes
// %globaltimer stamps into trace [block][TRACE_STAMPS] (block = s + NS·(h + hk·b)): 0 start,
// 1 producers waited for, 2 queries normed and rotated and 3 the new key and value written (one
// phase: both stamped at its end), 4 the tile loop done, 5 the part written and its ticket taken
// (with one part: out written), 6 the final merge's part weights ready and 7 the final merge
// done (the block that writes out only; with one part, both as 5). A part past the used ones
// stamps 0 alone. benchmarks/profile_attention.py reads them.
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
#define MGROUP 8          // parts a first-level merge takes (more than 2 · MGROUP parts: two levels)
#define COUNTERS (1 + 64 / MGROUP)   // tickets a (slot, KV head): the final merge's, then a group's
#define TP 64             // positions a tile
#define THREADS 128
#define NWARP (THREADS / 32)
#define DPL (D / 32)      // head dims a lane holds: in P·V, lane·DPL ...; in the q/k norm, lane + 32·i
#define RPW ((G + NWARP) / NWARP)   // rows a warp normalises and rotates: G queries and the new key

static_assert(D % 64 == 0 && D <= 256, "head dims of 64, 128, 192 or 256");
static_assert(DPL % 2 == 0, "rotate_half pairs a lane's dims i and i + DPL / 2");
static_assert(G >= 1 && G * DPL <= 64, "G query heads of D dims fit a lane's accumulators");
static_assert(2 * TP == THREADS, "two threads a position in the score phase");

// The merge reads what other blocks wrote through L2 only (__ldcg: L1 is not coherent); the
// barrier of the ticket before those reads keeps them after it.

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
// the merge's stamp 6 (its weights ready) goes where STAMP6 points
#define STAMP6 , trace + (blockIdx.x + (i64)gridDim.x * (blockIdx.y + (i64)gridDim.y * blockIdx.z)) \
                         * TRACE_STAMPS + 6
#define NO_STAMP6 , nullptr
#else
#define STAMP(k) do {} while (0)
#define STAMP6
#define NO_STAMP6
#endif

// A lane's DPL float32 values to p (p + i for i < DPL), in 16-byte stores where DPL allows.
CUPOOL_DEVICE void store_dims(float* p, const float* v) {
#if DPL % 4 == 0
#pragma unroll
    for (int i = 0; i < DPL; i += 4)
        *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
#else
#pragma unroll
    for (int i = 0; i < DPL; i += 2) *reinterpret_cast<float2*>(p + i) = make_float2(v[i], v[i + 1]);
#endif
}

CUPOOL_DEVICE void load_dims_f(const float* p, float* v) {
#if DPL % 4 == 0
#pragma unroll
    for (int i = 0; i < DPL; i += 4) {
        const float4 f = *reinterpret_cast<const float4*>(p + i);
        v[i] = f.x; v[i + 1] = f.y; v[i + 2] = f.z; v[i + 3] = f.w;
    }
#else
#pragma unroll
    for (int i = 0; i < DPL; i += 2) {
        const float2 f = *reinterpret_cast<const float2*>(p + i);
        v[i] = f.x; v[i + 1] = f.y;
    }
#endif
}

// One row of D values (bf16 values in float32), a lane's dims lane + 32·i: the RMSNorm (if norm:
// w the lane's DPL weights) and the rotary embedding (cs, sn the lane's DPL entries of the
// row's cos and sin), in registers. A whole warp calls it. The lane's squares are summed in the
// order of its dims, then across the warp.
CUPOOL_DEVICE void norm_rope_row(float (&x)[DPL], bool norm, const float (&w)[DPL], float eps,
                                 const float (&cs)[DPL], const float (&sn)[DPL]) {
    if (norm) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) ss += x[i] * x[i];
        const float rs = rsqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = round_bf16(w[i] * round_bf16(x[i] * rs));
    }
    float y[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {     // rotate_half: dim c < D/2 takes −x[c + D/2], else x[c − D/2]
        const float rot = i < DPL / 2 ? -x[i + DPL / 2] : x[i - DPL / 2];
        y[i] = round_bf16(round_bf16(x[i] * cs[i]) + round_bf16(rot * sn[i]));
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = y[i];
}

// One merge: for each of the G heads of (b, h) (heads [head0, head0 + G), NS slots a head),
// `cnt` parts, the k-th at slot first + k·stride of part_o / part_ml. Each part's weight: with
// fin, exp(m − M) / (Σ exp(m − M)·l + exp(sink − M)) (M the max over the parts and the sink),
// and out [G·D] (bf16, this KV head's) gets Σ weight · o; else exp(m − M), and slot `first`
// gets the merged part: o = Σ weight · o (each element read and then written by the same
// thread), (M, Σ exp(m − M)·l). wm and wl are [G][NS] scratch. Every thread of the block calls it.
//
// A thread sums the float4 chunks c = threadIdx.x + j·THREADS of the G·D elements (chunk c is
// elements 4c .. 4c + 3, of head 4c / D), MP parts at a time in part order; the first MP parts'
// loads are issued before the weights are worked out (they do not depend on them), so the two
// reads of the merge overlap.
#define CHUNKS (G * D / 4)
#define CPT ((CHUNKS + THREADS - 1) / THREADS)   // chunks a thread
#if AHEAD && !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900)
#define MP (CPT > 2 ? 16 / CPT : 8)         // parts a round: ≤ 64 values in flight a thread
#else
#define MP (CPT > 1 ? 8 / CPT : 8)          // ≤ 32 (the plain build's registers; before sm_90
                                             // ptxas holds the AHEAD build at 128: more spill)
#endif
static_assert(MP >= 1, "a round takes at least one part");

CUPOOL_DEVICE void load_parts(const float* po, int NS, int first, int stride, int cnt, int k0,
                              float4 (&v)[CPT][MP]) {
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = threadIdx.x + j * THREADS;
        const float* o = po + ((i64)(4 * c / D) * NS + first + (i64)k0 * stride) * D + 4 * c % D;
#pragma unroll
        for (int k = 0; k < MP; ++k)
            v[j][k] = c < CHUNKS && k0 + k < cnt
                ? __ldcg(reinterpret_cast<const float4*>(o + (i64)k * stride * D))
                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

CUPOOL_DEVICE void merge(float* part_o, float* part_ml, i64 head0, int NS, int first, int stride,
                         int cnt, bool fin, const u16* sinks, int sink0, float* wm, float* wl,
                         u16* out
#if ATTN_TRACE
                         , u64* stamp6
#endif
                         ) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* po = part_o + head0 * NS * D;
    float4 v[CPT][MP];
    load_parts(po, NS, first, stride, cnt, 0, v);
    for (int i = threadIdx.x; i < G * cnt; i += THREADS) {
        const int g = i / cnt, k = i % cnt;
        const float* ml = part_ml + ((head0 + g) * NS + first + k * stride) * 2;
        wm[g * NS + k] = __ldcg(ml);
        wl[g * NS + k] = __ldcg(ml + 1);
    }
    __syncthreads();
    for (int g = warp; g < G; g += NWARP) {
        const bool sink_in = fin && sinks;
        const float sink = sink_in ? bf16_to_f32(sinks[sink0 + g]) : -__int_as_float(0x7f800000);
        float M = sink;
        for (int k = lane; k < cnt; k += 32) M = fmaxf(M, wm[g * NS + k]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float den = 0.0f;
        for (int k = lane; k < cnt; k += 32) den += expf(wm[g * NS + k] - M) * wl[g * NS + k];
        den = warp_sum(den) + (sink_in ? expf(sink - M) : 0.0f);
        __syncwarp();
        for (int k = lane; k < cnt; k += 32)
            wm[g * NS + k] = fin ? expf(wm[g * NS + k] - M) / den : expf(wm[g * NS + k] - M);
        if (!fin && lane == 0) {
            part_ml[((head0 + g) * NS + first) * 2] = M;
            part_ml[((head0 + g) * NS + first) * 2 + 1] = den;
        }
    }
    __syncthreads();
#if ATTN_TRACE
    if (stamp6 && threadIdx.x == 0) {
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        *stamp6 = t;
    }
#endif
    float num[CPT][4];
#pragma unroll
    for (int j = 0; j < CPT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) num[j][e] = 0.0f;
    for (int k0 = 0; k0 < cnt; k0 += MP) {
        if (k0 > 0) load_parts(po, NS, first, stride, cnt, k0, v);
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            const int g = 4 * (threadIdx.x + j * THREADS) / D;
#pragma unroll
            for (int k = 0; k < MP; ++k) {
                if (k0 + k < cnt && g < G) {
                    const float w = wm[g * NS + k0 + k];
                    num[j][0] += w * v[j][k].x;
                    num[j][1] += w * v[j][k].y;
                    num[j][2] += w * v[j][k].z;
                    num[j][3] += w * v[j][k].w;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = threadIdx.x + j * THREADS;
        if (c >= CHUNKS) continue;
        if (fin) {
#pragma unroll
            for (int e = 0; e < 4; ++e) out[4 * c + e] = f32_to_bf16(num[j][e]);
        } else {
            *reinterpret_cast<float4*>(po + ((i64)(4 * c / D) * NS + first) * D + 4 * c % D) =
                make_float4(num[j][0], num[j][1], num[j][2], num[j][3]);
        }
    }
}

// Takes a ticket on *counter, of `of` blocks: true in the last block to take one (which puts the
// counter back to zero). Every thread of the block calls it, after a fence on what it wrote.
CUPOOL_DEVICE bool last_ticket(i32* counter, int of) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == of - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    return last;
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
    // qs: the queries, normed and rotated (bf16 values); sc: a tile's scores, then its
    // probabilities; both dead after the tile loop, where red takes their place: warps 1 ..
    // NWARP − 1's P·V sums; then the merge's scratch
    constexpr int QS_SC = G * D + G * TP, RED = (NWARP - 1) * G * D;
    __shared__ __align__(16) float smem[QS_SC > RED ? QS_SC : RED];
    float* qs = smem;
    float (&sc)[G][TP] = *reinterpret_cast<float (*)[G][TP]>(smem + G * D);
    float (&red)[NWARP - 1][G * D] = *reinterpret_cast<float (*)[NWARP - 1][G * D]>(smem);
    __shared__ __align__(16) float tmp[(G > 1 ? G : 2) * D];   // the merge's part weights
    __shared__ float m_run[G], l_run[G], alpha[G];

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
    // take part, so the tickets count them and the merge reads them alone
    const int used = (int)((n + chunk - 1) / chunk);
    if (s >= used) return;
    const i64 start = lo + s * chunk, end = min(start + chunk, P + 1);
    const bool holds = start <= P && P < end;  // this part holds the new token: it writes k, v
    const u16* cs = cos_t + P * D;
    const u16* sn = sin_t + P * D;
    const i64 cache_base = ((i64)b * hk + h) * max_len * D;
    const i64 head0 = (i64)b * nh + h * G;     // this block's first query head over the batch

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
    }
    // the lane's dims of the rotary row and the norms (older than the kernel before: read before
    // the wait, when launched as a dependent)
    float cs_f[DPL], sn_f[DPL], qw[DPL], kw[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int c = lane + 32 * i;
        cs_f[i] = bf16_to_f32(cs[c]);
        sn_f[i] = bf16_to_f32(sn[c]);
        qw[i] = q_norm ? bf16_to_f32(q_norm[c]) : 0.0f;
        kw[i] = k_norm ? bf16_to_f32(k_norm[c]) : 0.0f;
    }
    // qkv is the kernel before's output
    wait_for_producers();
    let_consumers_launch();
    STAMP(1);
    if (threadIdx.x < G) { m_run[threadIdx.x] = -__int_as_float(0x7f800000); l_run[threadIdx.x] = 0.0f; }
    // rows warp, warp + NWARP, ...: r < G the query heads h·G + r, r = G the new key (and with it
    // the new value); each warp's loads first, then its rows one after another
    {
        float x[RPW][DPL];
        u16 vnew[DPL];
#pragma unroll
        for (int j = 0; j < RPW; ++j) {
            const int r = warp + j * NWARP;
            if (r < G || (r == G && holds)) {
                const u16* src = row + (i64)(r < G ? h * G + r : nh + h) * D;
#pragma unroll
                for (int i = 0; i < DPL; ++i) x[j][i] = bf16_to_f32(src[lane + 32 * i]);
                if (r == G) {
#pragma unroll
                    for (int i = 0; i < DPL; ++i) vnew[i] = row[(i64)(nh + hk + h) * D + lane + 32 * i];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < RPW; ++j) {
            const int r = warp + j * NWARP;
            if (r < G) {
                norm_rope_row(x[j], q_norm != nullptr, qw, eps, cs_f, sn_f);
#pragma unroll
                for (int i = 0; i < DPL; ++i) qs[r * D + lane + 32 * i] = x[j][i];
            } else if (r == G && holds) {
                norm_rope_row(x[j], k_norm != nullptr, kw, eps, cs_f, sn_f);
#pragma unroll
                for (int i = 0; i < DPL; ++i) {
                    kc[cache_base + P * D + lane + 32 * i] = f32_to_bf16(x[j][i]);
                    vc[cache_base + P * D + lane + 32 * i] = vnew[i];
                }
            }
        }
    }
    __syncthreads();
    STAMP(2);
    STAMP(3);

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
    // the warps' P·V sums, in warp order (deterministic): warps 1 .. NWARP − 1 through shared
    // memory (over qs and sc: the tile loop's last barrier is behind every read of them), summed
    // in warp 0's registers
    if (warp > 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) store_dims(&red[warp - 1][g * D + lane * DPL], acc[g]);
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float sum[DPL];
#pragma unroll
            for (int i = 0; i < DPL; ++i) sum[i] = 0.0f + acc[g][i];
#pragma unroll
            for (int w = 1; w < NWARP; ++w) {
                float o[DPL];
                load_dims_f(&red[w - 1][g * D + lane * DPL], o);
#pragma unroll
                for (int i = 0; i < DPL; ++i) sum[i] += o[i];
            }
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] = sum[i];
        }
    }
    if (used == 1) {
        // the one part is the whole context: out = w · acc, w = exp(m − M) / (exp(m − M)·l +
        // exp(sink − M)), M = max(m, sink): a merge of this one part's weight
        if (warp == 0) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float m = m_run[g], l = l_run[g];
                const float sink = sinks ? bf16_to_f32(sinks[h * G + g]) : -__int_as_float(0x7f800000);
                const float M = fmaxf(sink, m);
                const float w = expf(m - M) / (expf(m - M) * l + (sinks ? expf(sink - M) : 0.0f));
                u16* o = out + (head0 + g) * D + lane * DPL;
#pragma unroll
                for (int i = 0; i < DPL; ++i) o[i] = f32_to_bf16(w * acc[g][i]);
            }
        }
        STAMP(5);
        STAMP(6);
        STAMP(7);
        return;
    }
    if (warp == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g)
            store_dims(part_o + ((head0 + g) * NS + s) * D + lane * DPL, acc[g]);
        for (int g = lane; g < G; g += 32) {
            part_ml[((head0 + g) * NS + s) * 2] = m_run[g];
            part_ml[((head0 + g) * NS + s) * 2 + 1] = l_run[g];
        }
        __threadfence();
    }
    i32* counter = count + ((i64)b * hk + h) * COUNTERS;
    float* wm = tmp;                           // [G][NS]: the parts' weights
    float* wl = qs;                            // [G][NS]: scratch
    u16* o = out + head0 * D;
    if (used <= 2 * MGROUP) {
        const bool last = last_ticket(counter, used);
        STAMP(5);
        if (!last) return;
        __threadfence();
        merge(part_o, part_ml, head0, NS, 0, 1, used, true, sinks, h * G, wm, wl, o STAMP6);
        STAMP(7);
        return;
    }
    // two levels: this part's group of MGROUP, then the groups
    const int grp = s / MGROUP, groups = (used + MGROUP - 1) / MGROUP;
    const int in_grp = min(MGROUP, used - grp * MGROUP);
    const bool last = last_ticket(counter + 1 + grp, in_grp);
    STAMP(5);
    if (!last) return;
    __threadfence();
    merge(part_o, part_ml, head0, NS, grp * MGROUP, 1, in_grp, false, sinks, h * G, wm, wl, o
          NO_STAMP6);
    __threadfence();
    if (!last_ticket(counter, groups)) return;
    __threadfence();
    merge(part_o, part_ml, head0, NS, 0, MGROUP, groups, true, sinks, h * G, wm, wl, o STAMP6);
    STAMP(7);
}
