// NVFP4 MoE decode by slices of the intermediate dimension, in one launch per unit range: an item
// is one unit's 64 columns of act (slice s) — the w13 rows that make them (4 act strips), their
// activation, and the one w2 chunk of every output strip that multiplies them — so no item
// waits for another. moe_decode.cu computes the same thing in two kinds of items (all of w13,
// then w2 once a unit's act is complete); at a few lanes its w2 items wait on the slowest w13
// item of their unit and read act back through L2. Here act stays in the block's shared memory
// and each item writes a partial sum over its slice for every output row; reduction items sum
// them.
//
// Items, in the order blocks take them (the first gridDim.x without a ticket, the rest from a
// ticket counter one ahead, as in moe_decode.cu):
// - slice items (unit u, slice s), unit-major over the launch's units (`part`, as moe_decode);
// - in the launch that completes the call (part 2; part 0 when no unit's row is being copied,
//   else part 1), reduction items, one a group of RROWS output rows: each waits until every slice
//   item of the call has finished (a counter over all launches of the call), then writes
//   out[t, h] = Σ_k Σ_s P[s, t·K + k, h] in k order, then s order, for its rows (lanes of weight 0
//   skipped). A reduction item is claimed only after every slice item of its launch was, and the
//   slice items of earlier launches have finished, so the items it waits for are running or done.
//   (The sums are spread over the warps of the item by top-k lane, in a fixed order.)
//   A wait that still runs past ~1 s sets error bit 8 and goes on (wrong output, never a hang).
//
// A warp streams one list of chunks through its ring of NBUF stage buffers (STAGE chunks each):
// first its K slice of one w13 strip of the slice, then chunk s of its w2 output strips
// (strips warp, warp + WARPS, ...; STAGE of them a stage, one bulk copy each). All NBUF stages go
// out at the start, and each buffer is refilled as soon as it has been computed, so the first w2
// chunks are in flight while w13 finishes. Between the two: the block's w13 sums meet in shared
// memory, warps 0-3 write the slice's act (bf16, [NT slots][64]) there, and every warp loads its
// B fragments for w2 once (chunk s of a w2 strip covers exactly the slice's 64 columns).
//
// Tables and counters, in the order they are written:
// - P[s, l, h] (float32, the `yw` workspace as [IP/64][W][HP]): written only by slice item (u, s)
//   for the lanes l of unit u, for every h < H: w2 chunk s times act, times the global scale and
//   the router weight of l; slice 0 adds the w2 bias (ROW_BIAS). Then a fence and sync[2] += 1.
// - out[t, h]: written by the reduction item of h's group after sync[2] has reached the call's
//   slice items (acquire), reading P through L2; or zeros, by the whole grid, when every lane is
//   padding.
// Counters (`sync`, zero at rest): [0] ticket, [1] blocks finished, [2] slice items of the call
// finished. The last block of each launch puts [0] and [1] back to zero; [2] goes back to zero in
// the launch that runs the reduction items, after all of them.
#include "common.cuh"
#include "mma_fp4.cuh"

#ifndef HP
#define HP 2048
#endif
#ifndef IP
#define IP 768
#endif
#ifndef NT
#define NT 8              // lane slots per unit
#endif
#ifndef OUT_BF16
#define OUT_BF16 1
#endif
#ifndef MINB
#define MINB 2            // blocks per SM the register allocation must allow
#endif
#ifndef MAXW
#define MAXW 64           // most lanes (T·K) of a call; at most the block's 256 threads
#endif
#ifndef IN_BF16
#define IN_BF16 1         // x: 1 bf16 (w13 dequantises to bf16), 0 fp16 (to fp16)
#endif
#ifndef XALIGN
#define XALIGN 1          // 1: x 16-byte aligned (the launcher checks)
#endif
#ifndef HFULL
#define HFULL 1           // 1: H == HP
#endif
#ifndef NBUF
#define NBUF 3            // stage buffers a warp, all in flight at the start
#endif
// DECODE_TRACE 1 is the profiling build (same output as 0): thread 0 of a block writes
// %globaltimer stamps into `trace`: [TRACE_ITEMS][4] by item number (slice items: start, w13 K
// loop done (warp 0), w2 done, end; reduction items: start, wait done, end, end), then [grid][2]
// by block (start, unit table built).
#ifndef DECODE_TRACE
#define DECODE_TRACE 0
#endif
#define TRACE_ITEMS 8192

#include "async_copy.cuh"
#include "moe_common.cuh"
#include "moe_lanes.cuh"

#define WARPS 8
#define THREADS (32 * WARPS)
#define STAGE 4           // chunks a stage
#define ERR_STALL 8
#include "moe_stages.cuh"

constexpr int NSL = IP / 64;                  // slices of an expert
constexpr int SL13 = 4 * W13_SPS;             // w13 strips of a slice: its 4 act strips
constexpr int KS = WARPS / SL13;              // warps splitting the K of a w13 strip: 1 or 2
constexpr int NC13 = HP / 64;                 // chunks of a w13 strip
constexpr int NS = HP / 16;                   // w2 output strips
constexpr int NSW = (NS + WARPS - 1) / WARPS; // w2 strips of a warp (the last ones may be past NS)
constexpr int S2 = (NSW + STAGE - 1) / STAGE; // w2 stages of a warp
#ifndef RROWS
#define RROWS 32          // output rows of a reduction item: a warp's lanes
#endif
constexpr int NRED = (HP + RROWS - 1) / RROWS;   // reduction items (groups past H do nothing)
static_assert(SL13 * KS == WARPS, "a slice's w13 strips split the block's warps evenly");
static_assert(MAXW <= THREADS && MAXW % 8 == 0, "group_lanes takes one lane per thread");
static_assert(NT <= 16, "act of a slice: NT slots of 64 columns");

struct Smem {
    WarpStages* stages;     // [WARPS]
    float* red;             // [WARPS][NTILES·4][32] w13 sums of each warp
    SlotInfo* si;
    u16* act;               // [NT][64] the slice's act, slot-major (bf16)
    u16* xs;                // [NT][XS_STRIDE] the unit's token rows of x (zeros past H)
    i64* unit_addr;         // [MAXW]
    float* lane_w;          // [MAXW] router weight of each lane (0: padding or rejected)
    u8* unit_lanes;         // [MAXW][NT]
    u8* unit_count;         // [MAXW]
    float* bias;            // ROW_BIAS: [128] the slice's w13 biases, per act strip 16 gate, 16 up
};
CUPOOL_DEVICE Smem carve(u8* smem) {
    Smem m;
    m.stages = reinterpret_cast<WarpStages*>(smem);
    m.red = reinterpret_cast<float*>(smem + WARPS * sizeof(WarpStages));
    m.si = reinterpret_cast<SlotInfo*>(m.red + WARPS * NTILES * 4 * 32);
    m.act = reinterpret_cast<u16*>(m.si + 1);
    m.xs = m.act + NT * 64;
    m.unit_addr = reinterpret_cast<i64*>(m.xs + NT * XS_STRIDE);
    m.lane_w = reinterpret_cast<float*>(m.unit_addr + MAXW);
    m.unit_lanes = reinterpret_cast<u8*>(m.lane_w + MAXW);
    m.unit_count = m.unit_lanes + MAXW * NT;
    m.bias = reinterpret_cast<float*>(m.unit_count + MAXW);   // 8-byte aligned (MAXW % 8 == 0)
    return m;
}
static_assert(sizeof(SlotInfo) % 16 == 0, "act after SlotInfo is 16-byte aligned");

struct Args {
    u64* trace;
    const u16* x;
    int topk, tokens, hidden, lanes, all_units;
    float* part;            // P [NSL][W][HP]
    i32* items_done;
    u16* out;
    i32* error;
};

// What a warp streams through its ring for one slice item: stages 0 .. n13 - 1 hold chunks
// [c0, c1) of its w13 strip, stages n13 .. n13 + S2 - 1 chunk s of its w2 strips.
struct Stream {
    const u8* w13;          // the warp's w13 strip
    const u8* w2;           // chunk s of w2 strip 0 (strip st at + st · W2_STRIP)
    int c0, c1, n13, warp;
};

// Stage i of the stream into buffer buf, completed on bar[buf]; nothing past the last stage.
// sm_90+: lane 0 announces the stage's bytes and issues one bulk copy (w13: its chunks are
// contiguous) or one a chunk (w2); a stage of w2 strips all past NS completes at once. Before
// sm_90 the lanes copy 16 bytes at a time and each arrives once its copies have landed.
CUPOOL_DEVICE void issue(WarpStages& ws, int buf, int i, const Stream& f, int lane) {
    if (i >= f.n13 + S2) return;
    u8* dst = &ws.w[buf][0];
    const u32 bar = smem_addr(&ws.bar[buf]);
    if (i < f.n13) {
        const int c = f.c0 + i * STAGE, n = min(STAGE, f.c1 - c);
        const u8* src = f.w13 + (i64)c * CHUNK_BYTES;
#if CUPOOL_BULK_COPY
        if (lane == 0) {
            fence_proxy_async_smem();        // the buffer's last reads were generic loads
            mbar_arrive_expect(bar, n * CHUNK_BYTES);
            bulk_load(smem_addr(dst), src, n * CHUNK_BYTES, bar);
        }
#else
        for (int v = lane; v < n * (CHUNK_BYTES / 16); v += 32) cp_async16(dst + 16 * v, src + 16 * v);
        cp_async_arrive_noinc(bar);
#endif
        return;
    }
    const int q0 = (i - f.n13) * STAGE;      // the warp's w2 strips q0 ... q0 + STAGE - 1
    int n = 0;                               // of them inside NS (they come first)
#pragma unroll
    for (int k = 0; k < STAGE; ++k) n += q0 + k < NSW && (q0 + k) * WARPS + f.warp < NS;
#if CUPOOL_BULK_COPY
    if (lane == 0) {
        fence_proxy_async_smem();
        mbar_arrive_expect(bar, n * CHUNK_BYTES);
        for (int k = 0; k < n; ++k)
            bulk_load(smem_addr(dst + k * CHUNK_BYTES),
                      f.w2 + (i64)((q0 + k) * WARPS + f.warp) * W2_STRIP, CHUNK_BYTES, bar);
    }
#else
    for (int v = lane; v < n * (CHUNK_BYTES / 16); v += 32) {
        const int k = v / (CHUNK_BYTES / 16), o = 16 * (v % (CHUNK_BYTES / 16));
        cp_async16(dst + k * CHUNK_BYTES + o,
                   f.w2 + (i64)((q0 + k) * WARPS + f.warp) * W2_STRIP + o);
    }
    cp_async_arrive_noinc(bar);
#endif
}

// One chunk in shared memory times B: acc[nt] += A(chunk) · b[nt] for nt < ntiles.
template <bool BF>
CUPOOL_DEVICE void chunk_mma(const u8* chunk, int lane, int ntiles, const u32 (&b)[NTILES][8],
                             float (&acc)[NTILES][4]) {
    const u32x4 w = *reinterpret_cast<const u32x4*>(chunk + lane * 16);
    const u32 sc = *reinterpret_cast<const u16*>(chunk + CHUNK_SCALES + 2 * lane);
    u32 a[4][4];
    dequant_chunk<BF>(w, sc, a);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
            if (nt < ntiles) mma16816<BF>(acc[nt], a[q], b[nt][2 * q], b[nt][2 * q + 1]);
}

// Thread 0 waits until *counter reaches `target` (acquire), then the block goes on together.
CUPOOL_DEVICE void wait_count(const i32* counter, int target, i32* error) {
    if (threadIdx.x == 0) {
        int spins = 0;
        while (ld_acquire(counter) < target) {
            nap_32ns();
            if (++spins == (1 << 25)) { atomicOr(error, ERR_STALL); break; }
        }
    }
    __syncthreads();
}

// Slice item: slice s of unit u.
CUPOOL_DEVICE void slice_item(const Args& a, const Smem& m, int u, int s, int item) {
    stamp(a.trace, item, 0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = warp / KS, ks = warp % KS;                  // w13 strip j of the slice
    const u8* row = reinterpret_cast<const u8*>(m.unit_addr[u]);
    Stream f;
    f.w13 = row + 256 + (i64)(SL13 * s + j) * W13_STRIP;
    f.w2 = row + W2_OFFSET + (i64)s * CHUNK_BYTES;
    f.warp = warp;
    k_slice(ks, KS, NC13, f.c0, f.c1);
    f.n13 = (f.c1 - f.c0 + STAGE - 1) / STAGE;
    WarpStages& ws = m.stages[warp];
#pragma unroll
    for (int b = 0; b < NBUF; ++b) issue(ws, b, b, f, lane);
    const float* hdr = reinterpret_cast<const float*>(row);
#if ROW_GATED
    const float gs_gate = hdr[0];                              // in flight during the K loop
#endif
    const float gs_up = hdr[1], gs_down = hdr[2];
#if ROW_BIAS
    if (threadIdx.x < 128) {                                  // act strip jj: 16 gate, then 16 up
        const int jj = threadIdx.x >> 5, r = threadIdx.x & 31;
        const float* b = reinterpret_cast<const float*>(row + ROW_BIAS_OFFSET);
        m.bias[threadIdx.x] = b[(r < 16 ? 0 : IP) + 16 * (4 * s + jj) + (r & 15)];
    }
#endif
    if (threadIdx.x < NT) {
        m.si->lane[threadIdx.x] = slot_lane(m.unit_count, m.unit_lanes, u);
        m.si->scale[threadIdx.x] = 1.0f;                       // x goes in unscaled
    }
    __syncthreads();
    const int ntiles = (m.unit_count[u] + 7) >> 3;
    const int g = lane >> 2, t = lane & 3;
    stage_x(m.xs, m.si, m.unit_count[u], a.x, a.topk, a.hidden);
    u32 b[NTILES][8];
    const u16* xrow[NTILES];                                   // in shared memory
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
        xrow[nt] = m.si->lane[nt * 8 + g] >= 0 ? m.xs + (nt * 8 + g) * XS_STRIDE : nullptr;
    // w13: the warp's K slice of strip j, B from the unit's x rows in shared memory
    float acc[NTILES][4] = {};
    u32 parity = ws.parity;
    int i = 0;
    for (; i < f.n13; ++i) {
        const int buf = i % NBUF;
        mbar_wait(smem_addr(&ws.bar[buf]), (parity >> buf) & 1u);
        parity ^= 1u << buf;
#pragma unroll
        for (int ci = 0; ci < STAGE; ++ci) {
            const int c = f.c0 + i * STAGE + ci;
            if (c >= f.c1) break;
#pragma unroll
            for (int nt = 0; nt < NTILES; ++nt)
                if (nt < ntiles) smem_cols16(xrow[nt], c * 64 + 16 * t, b[nt]);
            chunk_mma<IN_BF16>(&ws.w[buf][ci * CHUNK_BYTES], lane, ntiles, b, acc);
        }
        __syncwarp();                                          // every lane done with the buffer
        issue(ws, buf, i + NBUF, f, lane);
    }
    stamp(a.trace, item, 1);
    // the slice's act: the w13 sums meet in shared memory; warp jj < 4 makes act strip jj
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) m.red[((warp * NTILES + nt) * 4 + r) * 32 + lane] = acc[nt][r];
    __syncthreads();
    if (warp < 4) {
        const int jj = warp;
        float up[NTILES][4] = {};
#if ROW_GATED
        float gate[NTILES][4] = {};
        const int wg = 2 * jj * KS, wu = (2 * jj + 1) * KS;
#else
        const int wu = jj * KS;
#endif
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                for (int k = 0; k < KS; ++k) {
                    const int o = (nt * 4 + r) * 32 + lane;
                    up[nt][r] += m.red[(wu + k) * NTILES * 4 * 32 + o];
#if ROW_GATED
                    gate[nt][r] += m.red[(wg + k) * NTILES * 4 * 32 + o];
#endif
                }
#if ROW_BIAS
        const float* bg = m.bias + 32 * jj;
        const float* bu = bg + 16;
#endif
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int n = nt * 8 + 2 * t + e;
                const bool live = nt < ntiles && m.si->lane[n] >= 0;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int rr = g + 8 * half;
                    float v = 0.0f;
                    if (live) {
                        const float uu = up[nt][2 * half + e] * gs_up * dequant_unscale<IN_BF16>();
#if ROW_GATED
                        const float gg = gate[nt][2 * half + e] * gs_gate * dequant_unscale<IN_BF16>();
#if ROW_BIAS
                        v = expert_act(gg + bg[rr], uu + bu[rr]);
#else
                        v = expert_act(gg, uu);
#endif
#else
                        v = expert_act_up(uu);
#endif
                    }
                    m.act[n * 64 + 16 * jj + rr] = f32_to_bf16(v);
                }
            }
    }
    __syncthreads();
    // w2: chunk s of the warp's strips; B (the slice's act) is the same for all of them
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) load_cols16(m.act + (nt * 8 + g) * 64 + 16 * t, b[nt]);
    const float f_down = gs_down * dequant_unscale<true>();
    float* part = a.part + (i64)s * a.lanes * HP;
    for (int jst = 0; jst < S2; ++jst, ++i) {
        const int buf = i % NBUF;
        mbar_wait(smem_addr(&ws.bar[buf]), (parity >> buf) & 1u);
        parity ^= 1u << buf;
#pragma unroll
        for (int ci = 0; ci < STAGE; ++ci) {
            const int st = (jst * STAGE + ci) * WARPS + warp;
            if (jst * STAGE + ci >= NSW || st >= NS) break;
            float acc2[NTILES][4] = {};
            chunk_mma<true>(&ws.w[buf][ci * CHUNK_BYTES], lane, ntiles, b, acc2);
#if ROW_BIAS
            const float* bd = reinterpret_cast<const float*>(row + ROW_BIAS_OFFSET) + 2 * IP
                              + 16 * st;
#endif
            for_each_slot(ntiles, lane, m.si, [&](int nt, int e, int n, int l) {
                if (l < 0) return;
                const float lw = m.lane_w[l];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int h = st * 16 + g + 8 * half;
                    if (h >= a.hidden) continue;
                    float y = acc2[nt][2 * half + e] * f_down;
#if ROW_BIAS
                    if (s == 0) y += bd[g + 8 * half];
#endif
                    part[(i64)l * HP + h] = y * lw;
                }
            });
        }
        __syncwarp();
        issue(ws, buf, i + NBUF, f, lane);
    }
    if (lane == 0) ws.parity = parity;
    stamp(a.trace, item, 2);
    __threadfence();                                           // P before the count
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(a.items_done, 1);
    stamp(a.trace, item, 3);
}

// Reduction item r: out rows [r·RROWS, (r + 1)·RROWS) ∩ [0, H) of every token, once every slice
// item of the call has finished. Warp p sums lanes t·K + k for k ≡ p (mod WARPS) over the slices
// (its loads all in flight at once); the WARPS partial sums meet in shared memory and are added
// in warp order.
CUPOOL_DEVICE void reduction_item(const Args& a, const Smem& m, int r, int item) {
    static_assert(RROWS == 32, "a reduction item is a warp's 32 lanes of rows");
    stamp(a.trace, item, 0);
    wait_count(a.items_done, a.all_units * NSL, a.error);
    stamp(a.trace, item, 1);
    const int p = threadIdx.x >> 5, h = r * RROWS + (threadIdx.x & 31);
    for (int tk = 0; tk < a.tokens; ++tk) {
        float sum = 0.0f;
        if (h < a.hidden)
            for (int k = p; k < a.topk; k += WARPS) {
                const int l = tk * a.topk + k;
                if (m.lane_w[l] == 0.0f) continue;
                const float* q = a.part + (i64)l * HP + h;
                constexpr int SB = NSL < 16 ? NSL : 16;     // loads in flight
                for (int s0 = 0; s0 < NSL; s0 += SB) {
                    float v[SB];
#pragma unroll
                    for (int s = 0; s < SB; ++s)
                        v[s] = s0 + s < NSL ? ld_f32_cg(q + (i64)(s0 + s) * a.lanes * HP) : 0.0f;
#pragma unroll
                    for (int s = 0; s < SB; ++s) sum += v[s];
                }
            }
        m.red[threadIdx.x] = sum;
        __syncthreads();
        if (p == 0 && h < a.hidden) {
            float y = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) y += m.red[w * 32 + (threadIdx.x & 31)];
#if OUT_BF16
            a.out[(i64)tk * a.hidden + h] = f32_to_bf16(y);
#else
            a.out[(i64)tk * a.hidden + h] = f32_to_f16(y);
#endif
        }
        __syncthreads();
    }
    stamp(a.trace, item, 2);
    stamp(a.trace, item, 3);
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_slices(const u16* __restrict__ x,            // [T, H] bf16/fp16 hidden states
           i32 tokens, i32 hidden,
           const i64* __restrict__ lane_addr,    // [W] row address per lane (0: padding)
           const i32* __restrict__ lane_fresh,   // [W] 1: row being copied in (null: none)
           const void* __restrict__ topk_w,      // [W] router weights, W_DTYPE
           i32 W, i32 topk,
           i32 part,                             // 0: rows in place, 1: fresh rows, 2: all
           float* __restrict__ partials,         // [IP/64, W, HP] P
           i32* __restrict__ sync,               // [3] zero at rest
           u16* __restrict__ out,                // [T, H]
           i32* __restrict__ error,
           u64* __restrict__ trace) {            // DECODE_TRACE only (else unused, may be null)
    extern __shared__ __align__(16) u8 smem[];
    __shared__ int s_ticket;
    __shared__ int s_held, s_total;
    __shared__ Args a;                    // in shared memory: registers stay with the K loops
    const Smem m = carve(smem);
    let_consumers_launch();
    stamp_at(trace, TRACE_ITEMS * 4 + blockIdx.x * 2);
    if (threadIdx.x == 0) {
        a.trace = trace;
        a.x = x; a.topk = topk; a.tokens = tokens; a.hidden = hidden; a.lanes = W;
        a.part = partials; a.items_done = sync + 2; a.out = out; a.error = error;
    }
    {   // unit table of the call; scratch in the (not yet used) stages
        i64* s_addr = reinterpret_cast<i64*>(m.stages);
        int* s_base = reinterpret_cast<int*>(s_addr + THREADS);
        group_lanes(lane_addr, lane_fresh, topk_w, W, s_addr, s_base, s_base + THREADS, m.lane_w,
                    m.unit_addr, m.unit_lanes, m.unit_count, &s_held, &s_total, error,
                    blockIdx.x == 0);
        if (threadIdx.x == 0) a.all_units = s_total;
        __syncthreads();
    }
    if ((threadIdx.x & 31) == 0) {        // the scratch is dead: each warp's stage barriers
        WarpStages& ws = m.stages[threadIdx.x >> 5];
        for (int b = 0; b < NBUF; ++b) mbar_init(smem_addr(&ws.bar[b]), STAGE_ARRIVALS);
        ws.parity = 0;
#if CUPOOL_BULK_COPY
        fence_proxy_async_smem();
#endif
    }
    __syncwarp();
    stamp_at(trace, TRACE_ITEMS * 4 + blockIdx.x * 2 + 1);
    if (a.all_units <= 0) {                                    // every lane was padding
        for (int i = blockIdx.x * THREADS + threadIdx.x; i < tokens * hidden; i += gridDim.x * THREADS)
            out[i] = 0;
    }
    Range rg;
    rg.first = part == 1 ? s_held : 0;
    rg.count = (part == 0 ? s_held : s_total) - rg.first;
    // the launch that completes the call sums: part 2; part 0 where no unit's row is being
    // copied, else part 1
    const bool reduce = a.all_units > 0 && (part == 2 || (part == 0) == (s_held == s_total));
    const int nslice = rg.count * NSL, total = nslice + (reduce ? NRED : 0);
    const int bid = blockIdx.x, base = min(total, (int)gridDim.x);
    int item = bid < base ? bid : total;
    while (item < total) {
        int next = total;
        if (threadIdx.x == 0 && base < total) next = base + atomicAdd(sync, 1);
        if (item < nslice) slice_item(a, m, rg.first + item / NSL, item % NSL, item);
        else reduction_item(a, m, item - nslice, item);
        if (threadIdx.x == 0) s_ticket = next;
        __syncthreads();                                       // next item known, smem free
        item = s_ticket;
    }
    // the last block out puts the counters back to zero for the next launch (the call's count of
    // finished slice items only once its reduction items have all run)
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1) == (int)gridDim.x - 1) {
            if (reduce) sync[2] = 0;
            sync[0] = 0;
            sync[1] = 0;
            __threadfence();
        }
    }
}
