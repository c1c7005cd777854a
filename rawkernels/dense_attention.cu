// Decode attention of one layer for the B tokens of a decode step (one a slot), over the slot
// cache, with what comes between the QKV projection and the o-projection fused in: q/k RMSNorm
// over the head dim (Qwen3's q_norm / k_norm), rotary embedding, the write of the new key and
// value into the cache, grouped-query attention with an optional sliding window and optional
// attention sinks (gpt-oss), and the merge of the split-KV partial results.
//
// How blocks split the work: grid (NS, hk, B). Block (s, h, b) takes the G = nh / hk query heads
// of KV head h of token b and the s-th of NS equal parts of the positions that token b attends
// to in its slot, [lo, pos[b]] (lo = pos − window + 1 with a sliding window, else 0), at least
// MINCHUNK positions a part (so short contexts use few parts). The parts are cut on the device
// from pos[b], so a captured graph replays at any position. Token b's slot of the cache is
// slot_of[b] where the launch passes that map (a step of fewer tokens than the cache has slots,
// each token's slot set on the device before each replay), else b. Within a block, tiles of TP = 64
// positions, 16 a warp: the warp's scores with tensor-core MMAs, an online softmax per head over
// the tile (m, l kept in shared memory), then the warp's P·V with MMAs; the warps' sums are
// added after the last tile.
//
// The MMAs (m16n8k16, bf16 in, float32 sums) take the G heads as their n (padded to NG tiles of
// 8; a padded head's column is computed and never stored). Scores: A = the warp's 16 key rows ×
// 16 dims, B = the queries (bf16 in shared memory). A sum over the dims does not care in which
// order it runs, so a lane reads 16 bytes of each of its two key rows at dims 32c + 8t (t = lane
// % 4) and those are the A fragments of two MMAs, with the matching 16 bytes of each query as B
// (dense_gemv.cu reads its weights the same way). P·V: O^T = V^T · P^T, A = 16 dims × the warp's
// 16 positions of V, B = the probabilities (hi and lo, above). Lane group g (= lane / 4) holds
// dims DG·g ... DG·g + DG − 1 (DG = D / 8) of the four positions 4t ... 4t + 3 (one 2·DG-byte
// read a row); m tile i takes dims DG·g + 2i (row g) and DG·g + 2i + 1 (row g + 8), so a lane's A
// fragments are its bf16 pairs of two positions, joined by byte permutes.
//
// Rounding follows transformers: q and k leave the projection in bf16; the norm is
// bf16(w · bf16(x · rsqrt(mean(x²) + eps))); the rotary embedding is
// bf16(bf16(x · cos) + bf16(rotate_half(x) · sin)) with transformers' own bf16 cos / sin tables
// (passed in, [L_max, D]); with ROT < D (partial rotary, GLM-4.5's: ROT a multiple of 64) only
// the first ROT dims turn, rotate_half pairing dims c and c + ROT / 2, and the others pass as
// they are (the tables' columns past ROT are not read). Scores, softmax and P·V run in float32:
// the MMAs' products of bf16 values are exact, and P·V takes each float32 probability as two
// bf16 terms, hi = bf16(p) and lo = bf16(p − hi) (two MMAs: 16 bits of its mantissa where one
// bf16 keeps 8); the output is bf16.
//
// Qwen3-Next's full-attention layers: QGATE = 1 reads a token's qkv row [(2·nh + 2·hk)·D] as its
// q_proj lays it out, query head j at columns 2jD ... 2jD + D − 1 with that head's output gate
// right after it, then the keys at column 2·nh·D and the values (QGATE = 0: [q (nh·D) | k (hk·D) |
// v (hk·D)]). The gates are not read: out stays [B, nh·D], and the caller multiplies it by their
// sigmoid. NORM1 = 1: the q/k norms' weights are stored as w − 1 (Qwen3-Next's RMSNorm), and the
// norm is bf16((1 + w) · (x · rsqrt(mean(x²) + eps))) in float32, rounded once.
//
// Who writes what, in order:
// - pos[b] < 0 marks token b inactive (its slot has no token this step): its blocks return at
//   once, but for part 0's, which waits for the kernel before (a dependent writes nothing before
//   its wait) and writes zeros to its G heads' rows of out. Nothing of its slot is read or
//   written: an idle slot holding a finished request's context costs nothing, however long.
// - the new key and value of token b, KV head h go to its slot's cache at pos[b], written only by the
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
// AHEAD = 1: a tile's value rows are read into registers at the start of the tile, before the
// scores and the softmax, which they do not depend on, and the next tile's key rows right after
// this tile's score MMAs, so they are in flight during its softmax and P·V. With AHEAD = 0 a
// tile reads its key rows at its start and its value rows after the softmax (fewer registers
// held across it). A merge issues the loads of MP parts of its elements at once either way
// (fewer parts with AHEAD = 0, which keeps to fewer registers). The sums run in the same order
// either way: the outputs are the same bits.
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
#ifndef ROT
#define ROT D             // dims the rotary embedding turns: the first ROT (partial rotary below D)
#endif
#ifndef AHEAD
#define AHEAD 0           // 1: a tile's key and value loads issued ahead of their use (below)
#endif
#ifndef QGATE
#define QGATE 0           // 1: each query head's D columns followed by its gate's (Qwen3-Next)
#endif
#ifndef NORM1
#define NORM1 0           // 1: the q/k norms' weights stored as w − 1 (Qwen3-Next, above)
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
#define DPL (D / 32)      // head dims a lane holds in the q/k norm: lane + 32·i
#define QCOL (QGATE ? 2 : 1)   // D-column blocks of a token's qkv row a query head takes
#define RPW ((G + NWARP) / NWARP)   // rows a warp normalises and rotates: G queries and the new key
#define NG ((G + 7) / 8)  // MMA n tiles of 8 heads
#define MT (D / 16)       // P·V's m tiles of 16 dims
#define DG (D / 8)        // dims a lane holds in P·V: DG·g ... (g = lane / 4)
#define KC (D / 32)       // 32-dim chunks of a key row: two score MMAs each
#define QSTRIDE (D + 32)  // bf16 a query row in shared memory: a quarter warp's two rows of 16-byte
                          // loads fall on disjoint banks
#define SCS (TP + 4)      // floats a head's row of the tile's scores

static_assert(D % 64 == 0 && D <= 256, "head dims of 64, 128, 192 or 256");
static_assert(DPL % 2 == 0, "rotate_half pairs a lane's dims i and i + DPL / 2");
#define RPL (ROT / 32)    // rotary dims a lane holds: its first RPL of the DPL
static_assert(ROT % 64 == 0 && ROT <= D, "rotate_half pairs a lane's dims i and i + RPL / 2");
static_assert(G >= 1 && NG * D <= 256, "the G heads' P·V sums fit a lane's registers (NG·D/4)");
static_assert(TP == 16 * NWARP, "16 positions of a tile a warp");

// The merge reads what other blocks wrote through L2 only (__ldcg: L1 is not coherent); the
// barrier of the ticket before those reads keeps them after it.

CUPOOL_DEVICE float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// A q/k norm weight as the norm multiplies by it: with NORM1 the stored w − 1 plus one (float32,
// as Qwen3-Next's norm adds it).
CUPOOL_DEVICE float norm_weight(u16 w) {
#if NORM1
    return 1.0f + bf16_to_f32(w);
#else
    return bf16_to_f32(w);
#endif
}

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

// P·V's accumulators of a lane: acc[nt][i] = O^T[dims DG·g + 2i, + 1][heads nt·8 + 2t, + 1]
// (c0: dim 2i, head 2t; c1: dim 2i, head 2t + 1; c2, c3: dim 2i + 1). One head's DG dims of them
// (e = 0: head nt·8 + 2t, 1: + 1), in dim order.
CUPOOL_DEVICE void head_dims(const float (&acc)[MT][4], int e, float (&v)[DG]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        v[2 * i] = acc[i][e];
        v[2 * i + 1] = acc[i][2 + e];
    }
}

// DG float32 values to p (16-byte aligned) and back, in 16-byte stores and loads.
CUPOOL_DEVICE void store_dg(float* p, const float (&v)[DG]) {
#pragma unroll
    for (int i = 0; i < DG; i += 4)
        *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

CUPOOL_DEVICE void load_dg(const float* p, float (&v)[DG]) {
#pragma unroll
    for (int i = 0; i < DG; i += 4) {
        const float4 f = *reinterpret_cast<const float4*>(p + i);
        v[i] = f.x; v[i + 1] = f.y; v[i + 2] = f.z; v[i + 3] = f.w;
    }
}

CUPOOL_DEVICE u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// One row of D values (bf16 values in float32), a lane's dims lane + 32·i: the RMSNorm (if norm:
// w the lane's DPL weights, `norm_weight`s) and the rotary embedding (cs, sn the lane's DPL
// entries of the row's cos and sin), in registers. A whole warp calls it. The lane's squares are
// summed in the order of its dims, then across the warp.
CUPOOL_DEVICE void norm_rope_row(float (&x)[DPL], bool norm, const float (&w)[DPL], float eps,
                                 const float (&cs)[DPL], const float (&sn)[DPL]) {
    if (norm) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) ss += x[i] * x[i];
        const float rs = rsqrtf(warp_sum(ss) / (float)D + eps);
#if NORM1
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = round_bf16(w[i] * (x[i] * rs));   // one rounding
#else
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = round_bf16(w[i] * round_bf16(x[i] * rs));
#endif
    }
    float y[RPL];
#pragma unroll
    for (int i = 0; i < RPL; ++i) {     // rotate_half: c < R/2 takes −x[c + R/2], else x[c − R/2]
        const float rot = i < RPL / 2 ? -x[i + RPL / 2] : x[i - RPL / 2];
        y[i] = round_bf16(round_bf16(x[i] * cs[i]) + round_bf16(rot * sn[i]));
    }
#pragma unroll
    for (int i = 0; i < RPL; ++i) x[i] = y[i];    // dims past ROT pass as they are
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
                const i64* __restrict__ pos, const i64* __restrict__ slot_of,
                u16* kc, u16* vc, i32 max_len,
                float scale, i32 window, const u16* __restrict__ sinks,
                float* part_o, float* part_ml, i32* count, u16* out
#if ATTN_TRACE
                , u64* trace
#endif
                ) {
    // qs: the queries, normed and rotated (bf16, NG·8 rows: the padding rows are never written,
    // and only feed the padding heads' scores); sc: a tile's scores, then its probabilities; both
    // dead after the tile loop, where red takes their place: warps 1 .. NWARP − 1's P·V sums;
    // then the merge's scratch
    constexpr int QS = NG * 8 * QSTRIDE / 2;   // floats
    constexpr int QS_SC = QS + G * SCS, RED = (NWARP - 1) * G * D;
    __shared__ __align__(16) float smem[QS_SC > RED ? QS_SC : RED];
    u16* qs = reinterpret_cast<u16*>(smem);
    float (&sc)[G][SCS] = *reinterpret_cast<float (*)[G][SCS]>(smem + QS);
    float (&red)[NWARP - 1][G * D] = *reinterpret_cast<float (*)[NWARP - 1][G * D]>(smem);
    __shared__ __align__(16) float tmp[(G > 1 ? G : 2) * D];   // the merge's part weights
    __shared__ float m_run[G], l_run[G], alpha[G];

    STAMP(0);
    const int NS = gridDim.x, s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 stride = (i64)(QCOL * nh + 2 * hk) * D;        // one token's q (and gates), k, v
    const u16* row = qkv + b * stride;
    if (pos[b] < 0) {                          // an inactive slot: zeros out, nothing else
        if (s == 0) {
            wait_for_producers();
            u16* o = out + ((i64)b * nh + h * G) * D;
            for (int i = threadIdx.x; i < G * D; i += THREADS) o[i] = 0;
        }
        return;
    }
    if (slot_of) {                             // token b's slot, where that is not slot b
        const i64 moved = (slot_of[b] - b) * hk * max_len * D;
        kc += moved;
        vc += moved;
    }
    const i64 P = min(pos[b], (i64)max_len - 1);
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
        qw[i] = q_norm ? norm_weight(q_norm[c]) : 0.0f;
        kw[i] = k_norm ? norm_weight(k_norm[c]) : 0.0f;
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
                const u16* src = row + (i64)(r < G ? QCOL * (h * G + r) : QCOL * nh + h) * D;
#pragma unroll
                for (int i = 0; i < DPL; ++i) x[j][i] = bf16_to_f32(src[lane + 32 * i]);
                if (r == G) {
#pragma unroll
                    for (int i = 0; i < DPL; ++i)
                        vnew[i] = row[(i64)(QCOL * nh + hk + h) * D + lane + 32 * i];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < RPW; ++j) {
            const int r = warp + j * NWARP;
            if (r < G) {
                norm_rope_row(x[j], q_norm != nullptr, qw, eps, cs_f, sn_f);
#pragma unroll
                for (int i = 0; i < DPL; ++i) qs[r * QSTRIDE + lane + 32 * i] = f32_to_bf16(x[j][i]);
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

    const int g = lane >> 2, t = lane & 3;      // the MMA fragments' group and thread
    float acc[NG][MT][4];                        // P·V (head_dims)
#pragma unroll
    for (int nt = 0; nt < NG; ++nt)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][i][e] = 0.0f;
    const u32x4 zero{0u, 0u, 0u, 0u};
    const u16* kbase = kc + cache_base;
    const u16* vbase = vc + cache_base;

    // the score MMAs' A fragments: key rows pw + g and pw + g + 8 of a warp's 16 positions from
    // pw, 16 bytes at dims 32c + 8t
    u32x4 klo[KC], khi[KC];
    auto load_keys = [&](i64 pw) {
#pragma unroll
        for (int c = 0; c < KC; ++c) {
            klo[c] = pw + g < end
                ? *reinterpret_cast<const u32x4*>(kbase + (pw + g) * D + 32 * c + 8 * t) : zero;
            khi[c] = pw + g + 8 < end
                ? *reinterpret_cast<const u32x4*>(kbase + (pw + g + 8) * D + 32 * c + 8 * t) : zero;
        }
    };
#if AHEAD
    load_keys(start + 16 * warp);                // then each tile's score MMAs load the next's
#endif

    for (i64 j0 = start; j0 < end; j0 += TP) {
        const i64 pw = j0 + 16 * warp;           // this warp's 16 positions
#if !AHEAD
        load_keys(pw);
#endif
        // P·V's A fragments come from value rows pw + 4t + q (q < 4), dims DG·g ...: word w of
        // vw[q] holds dims DG·g + 2w, + 1 (zeros past end: their probability is 0, and 0 · NaN
        // would not be)
        u32 vw[4][DG / 2];
        auto load_values = [&]() {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const i64 j = pw + 4 * t + q;
#pragma unroll
                for (int c = 0; c < DG / 8; ++c) {
                    const u32x4 v = j < end
                        ? *reinterpret_cast<const u32x4*>(vbase + j * D + DG * g + 8 * c) : zero;
                    vw[q][4 * c] = v.x; vw[q][4 * c + 1] = v.y;
                    vw[q][4 * c + 2] = v.z; vw[q][4 * c + 3] = v.w;
                }
            }
        };
#if AHEAD
        load_values();
#endif
        // scores: S[position pw + g (+ 8)][head nt·8 + 2t (+ 1)]
        {
            float sv[NG][4];
#pragma unroll
            for (int nt = 0; nt < NG; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sv[nt][e] = 0.0f;
#pragma unroll
            for (int c = 0; c < KC; ++c) {
                const u32 a0[4] = {klo[c].x, khi[c].x, klo[c].y, khi[c].y};
                const u32 a1[4] = {klo[c].z, khi[c].z, klo[c].w, khi[c].w};
#pragma unroll
                for (int nt = 0; nt < NG; ++nt) {
                    const u32x4 x = *reinterpret_cast<const u32x4*>(
                        &qs[(nt * 8 + g) * QSTRIDE + 32 * c + 8 * t]);
                    mma16816<true>(sv[nt], a0, x.x, x.y);
                    mma16816<true>(sv[nt], a1, x.z, x.w);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NG; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int hd = nt * 8 + 2 * t + (e & 1), p = 16 * warp + g + 8 * (e >> 1);
                    if (hd < G)
                        sc[hd][p] = j0 + p < end ? sv[nt][e] * scale : -__int_as_float(0x7f800000);
                }
        }
#if AHEAD
        // the next tile's keys, read while this tile's softmax and P·V run
        if (j0 + TP < end) load_keys(pw + TP);
#endif
        __syncthreads();
        // online softmax: warp w takes heads w, w + 4, ...
        for (int hd = warp; hd < G; hd += NWARP) {
            const float a = sc[hd][lane], c = sc[hd][lane + 32];
            float mx = fmaxf(a, c);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m_run[hd], mx);
            const float pa = expf(a - m_new), pc = expf(c - m_new);
            sc[hd][lane] = pa;
            sc[hd][lane + 32] = pc;
            const float sum = warp_sum(pa + pc);
            __syncwarp();
            if (lane == 0) {
                const float al = expf(m_run[hd] - m_new);
                alpha[hd] = al;
                l_run[hd] = l_run[hd] * al + sum;
                m_run[hd] = m_new;
            }
        }
        __syncthreads();
#if !AHEAD
        load_values();
#endif
        // P·V: O^T[dims][heads] += V^T[dims][the warp's positions] · P^T
#pragma unroll
        for (int nt = 0; nt < NG; ++nt) {
            const int h0 = nt * 8 + 2 * t;
            const float al0 = h0 < G ? alpha[h0] : 1.0f, al1 = h0 + 1 < G ? alpha[h0 + 1] : 1.0f;
            // P^T's fragments: head nt·8 + g at positions 4t ... 4t + 3, as hi and lo bf16 terms
            u32 hi0 = 0u, hi1 = 0u, lo0 = 0u, lo1 = 0u;
            if (nt * 8 + g < G) {
                const float4 pr =
                    *reinterpret_cast<const float4*>(&sc[nt * 8 + g][16 * warp + 4 * t]);
                hi0 = pack_bf16(pr.x, pr.y);
                hi1 = pack_bf16(pr.z, pr.w);
                lo0 = pack_bf16(pr.x - round_bf16(pr.x), pr.y - round_bf16(pr.y));
                lo1 = pack_bf16(pr.z - round_bf16(pr.z), pr.w - round_bf16(pr.w));
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                acc[nt][i][0] *= al0;
                acc[nt][i][1] *= al1;
                acc[nt][i][2] *= al0;
                acc[nt][i][3] *= al1;
                const u32 a[4] = {__byte_perm(vw[0][i], vw[1][i], 0x5410),
                                  __byte_perm(vw[0][i], vw[1][i], 0x7632),
                                  __byte_perm(vw[2][i], vw[3][i], 0x5410),
                                  __byte_perm(vw[2][i], vw[3][i], 0x7632)};
                mma16816<true>(acc[nt][i], a, hi0, hi1);
                mma16816<true>(acc[nt][i], a, lo0, lo1);
            }
        }
        __syncthreads();
    }

    STAMP(4);
    // the warps' P·V sums, in warp order (deterministic): warps 1 .. NWARP − 1 through shared
    // memory (over qs and sc: the tile loop's last barrier is behind every read of them), summed
    // in warp 0's registers
    if (warp > 0) {
#pragma unroll
        for (int nt = 0; nt < NG; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int hd = nt * 8 + 2 * t + e;
                if (hd < G) {
                    float v[DG];
                    head_dims(acc[nt], e, v);
                    store_dg(&red[warp - 1][hd * D + DG * g], v);
                }
            }
    }
    __syncthreads();
    // warp 0's sums of head nt·8 + 2t + e, dims DG·g ...
    float sum[NG][2][DG];
    if (warp == 0) {
#pragma unroll
        for (int nt = 0; nt < NG; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int hd = nt * 8 + 2 * t + e;
                head_dims(acc[nt], e, sum[nt][e]);
#pragma unroll
                for (int i = 0; i < DG; ++i) sum[nt][e][i] = 0.0f + sum[nt][e][i];
                if (hd >= G) continue;
#pragma unroll
                for (int w = 1; w < NWARP; ++w) {
                    float r[DG];
                    load_dg(&red[w - 1][hd * D + DG * g], r);
#pragma unroll
                    for (int i = 0; i < DG; ++i) sum[nt][e][i] += r[i];
                }
            }
    }
    if (used == 1) {
        // the one part is the whole context: out = w · sum, w = exp(m − M) / (exp(m − M)·l +
        // exp(sink − M)), M = max(m, sink): a merge of this one part's weight
        if (warp == 0) {
#pragma unroll
            for (int nt = 0; nt < NG; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int hd = nt * 8 + 2 * t + e;
                    if (hd >= G) continue;
                    const float m = m_run[hd], l = l_run[hd];
                    const float sink =
                        sinks ? bf16_to_f32(sinks[h * G + hd]) : -__int_as_float(0x7f800000);
                    const float M = fmaxf(sink, m);
                    const float w =
                        expf(m - M) / (expf(m - M) * l + (sinks ? expf(sink - M) : 0.0f));
                    u16* dst = out + (head0 + hd) * D + DG * g;
#pragma unroll
                    for (int i = 0; i < DG; i += 8)
                        st16(dst + i,
                             u32x4{pack_bf16(w * sum[nt][e][i], w * sum[nt][e][i + 1]),
                                   pack_bf16(w * sum[nt][e][i + 2], w * sum[nt][e][i + 3]),
                                   pack_bf16(w * sum[nt][e][i + 4], w * sum[nt][e][i + 5]),
                                   pack_bf16(w * sum[nt][e][i + 6], w * sum[nt][e][i + 7])});
                }
        }
        STAMP(5);
        STAMP(6);
        STAMP(7);
        return;
    }
    if (warp == 0) {
#pragma unroll
        for (int nt = 0; nt < NG; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int hd = nt * 8 + 2 * t + e;
                if (hd < G) store_dg(part_o + ((head0 + hd) * NS + s) * D + DG * g, sum[nt][e]);
            }
        for (int hd = lane; hd < G; hd += 32) {
            part_ml[((head0 + hd) * NS + s) * 2] = m_run[hd];
            part_ml[((head0 + hd) * NS + s) * 2 + 1] = l_run[hd];
        }
        __threadfence();
    }
    i32* counter = count + ((i64)b * hk + h) * COUNTERS;
    float* wm = tmp;                           // [G][NS]: the parts' weights
    float* wl = smem;                          // [G][NS]: scratch
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
