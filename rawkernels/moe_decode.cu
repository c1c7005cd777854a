// NVFP4 MoE decode, w13 → activation (SiLU·up, or clamped SwiGLU; biases where the rows have them;
// ReLU(up)² for rows without a gate, ROW_GATED 0) → w2 → weighted sum over top-k, in one launch
// per unit range.
//
// Why one launch: at T ≤ 16 a layer reads ~20 MB of rows, a few µs of HBM time, while separate
// w13 and w2 launches each pay a start, a chain of dependent loads and a tail. Here blocks take
// items in one order: first the w13 items (unit, act strips: strip pairs, or up strips in rows
// without a gate) of every unit of the range, then the w2 items (unit, group of output strips).
// A w2 item issues its weight loads first (they do not depend on w13) and only then waits until
// its unit's w13 items have all arrived (a per-unit counter), so w2's bytes stream in while w13
// finishes.
//
// No deadlock: items are numbered w13 first, then w2; block b starts on item b, and every later
// item is claimed from a ticket counter in that order, at most one ahead of the item the block
// works on (so a block waiting in a w2 item holds no unstarted w13 item). w13 items wait for
// nothing, and the grid is sized so that every block is resident at once, so every w13 item a w2
// item waits for is running or will run (if another kernel holds some SMs, as soon as it ends).
// A wait that still runs past ~1 s sets error bit 8 and goes on (wrong output, never a hang).
//
// Weights go global → shared memory per warp in a ring of NBUF buffers of STAGE chunks (4.6 KB a
// stage), each stage one bulk copy on sm_90+ (a chunk's scale bytes follow its packed codes,
// layout.py) or the warp's 16-byte cp.async copies before sm_90 (issue_stage), so the bytes in
// flight are bounded by shared memory, not registers; a warp issues its second stage only once
// the first has landed (run_stages). w13 multiplies x as it is: its weights are
// dequantised to the model's dtype (bf16 or fp16, mma_fp4.cuh), so no pass over x has to finish
// before the first multiply. (The XSMEM variant, which profilers select, first copies a w13
// item's unit's token rows of x into shared memory, so the K loop's B fragments are shared-memory
// loads; it is faster alone and slower in the decode step, docs/PERFORMANCE.md.) w13 writes the
// activation as bf16 act rows; after the wait, w2 reads its B fragments straight from them (L2)
// and multiplies them with bf16-dequantised weights.
//
// Front: every block groups the call's lanes into units itself (group_lanes, in shared memory:
// the lane table is a few hundred bytes, and a block's first weight loads then wait for one read
// of it instead of a separate launch). `part` picks the units of this launch: 0 rows already in
// place, 1 rows being copied (lane_fresh), 2 all. The top-k sum of an output strip group is done
// by the last unit to finish it, counted over all units of the call, so a call may run as two
// launches in stream order (part 0, then part 1 once the copies have landed) with the same result
// bit for bit.
//
// ROUTE build (a bank that holds every expert at a fixed row, so the plan step has nothing to do):
// the launch routes the step itself instead of taking lane addresses and weights, the router's
// launch (dense_gemv.cu's RMSNorm prologue and route epilogue) folded into this one. It is launched
// as a dependent of the kernel that writes the residual stream h: before its wait a block loads
// its router row, the norm's weights and the table of row addresses. Then every block sums the
// squares of h (dense_gemv's order, so the same rstd) and normalises it, block 0 writes the normed
// rows to x, and block b computes the logits of experts b, b + grid, ... (one dot product a token and expert, the block
// reduces it) and counts them done (`route_count`, release). Once all E are out, every block reads
// them and routes each token itself (route.cuh, one warp a token), so its unit table needs no
// second exchange; block 0 writes ids, weights and lane addresses for the caller. The logits' sums
// run in another order than dense_gemv's MMAs, so they may differ from its by rounding.
//
// Tables and counters, in the order they are written:
// - act[l, 16p ... 16p + 15] (bf16): written only by the w13 item that holds act strip p of lane
//   l's unit (strip pair p, by the pair's first gate warp; or, without a gate, up strip p, by its
//   first warp), then a fence, then unit_done[u] += its act strips.
// - a w2 item of unit u reads the act rows of u's lanes only after unit_done[u] has reached NP
//   (acquire load), and through L2, since other blocks wrote them. It writes yw[l, h] for the h
//   of its output strips (nothing else writes yw), then arrives on group_done[its strip group].
// - out[t, h] for the rows h of a strip group: written by the block that arrives last on that
//   group's group_done (one arrival per unit of the call, over all of its launches), which sums
//   yw over top-k in k order; or zeros, by the whole grid, when every lane is padding.
// Counters (`sync`, zero at rest): [0] ticket, [1] blocks finished, [2 + u] w13 act strips of
// unit u done. The last block of a launch puts them back to zero; group_done is reset by its last
// unit.
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
#define MINB 3            // blocks per SM the register allocation must allow
#endif
#ifndef MAXW
#define MAXW 64           // most lanes (T·K) of a call; at most the block's 256 threads
#endif
#ifndef IN_BF16
#define IN_BF16 1         // x: 1 bf16 (w13 dequantises to bf16), 0 fp16 (to fp16)
#endif
#ifndef XALIGN
#define XALIGN 1          // 1: x 16-byte aligned (a lane's 16 columns read as two 16-byte words;
                          // the launcher checks)
#endif
#ifndef HFULL
#define HFULL 1           // 1: H == HP (no column of x past the row's end is read)
#endif
#ifndef XSMEM
#define XSMEM 0           // 1: a w13 item stages its unit's x rows in shared memory first
#endif
#ifndef ROUTE
#define ROUTE 0           // 1: the launch routes the step itself (above); bf16 x, weights f32/bf16
#endif
// DECODE_TRACE 1 is the profiling build (same output as 0): thread 0 of a block writes
// %globaltimer stamps into `trace`: [TRACE_ITEMS][4] by item number (start, waits done, K loop
// done, end), then [grid][2] by block (start, unit table built), and in a ROUTE build, from
// [TRACE_BLOCKS][2] on, [grid][5] by block (waited for the kernel before, logits out, every
// expert's logits seen, the first tokens' logits read, routed). benchmarks/profile_gemm.py
// --trace and --route-trace read them to print when blocks start and each phase ends.
#ifndef DECODE_TRACE
#define DECODE_TRACE 0
#endif
#define TRACE_ITEMS 8192
#define TRACE_BLOCKS 4096

#include "async_copy.cuh"
#include "moe_common.cuh"
#include "moe_lanes.cuh"

#define WARPS 8
#define THREADS (32 * WARPS)
#define STAGE 4           // chunks (CHUNK_BYTES: 512 B of packed codes + 64 B of scales) a stage
#define NBUF 2            // stage buffers a warp: NBUF stages in flight, NBUF - 1 while it computes
#define ERR_STALL 8
#include "moe_stages.cuh"
#if ROUTE
#include "route.cuh"
#endif

constexpr int NC13 = HP / 64;              // chunks of a w13 strip
constexpr int NC2 = IP / 64;               // chunks of a w2 strip
constexpr int NP = IP / 16;                // w13 act strips of an expert (moe_common.cuh)
constexpr int NS = HP / 16;                // w2 output strips of an expert
// w13: the warps split the K of each of the SPI strips of an item: SPI × KS13 warps. An item
// makes PPI act strips: SPI / 2 strip pairs (gate, up), or SPI up strips in rows without a gate.
// The launcher picks KS13 a call (cupool/ops/moe_decode.py, w13_split): 2 (twice the strips an
// item, twice the chunks a warp) where the call has items enough for that, else 4.
#ifndef W13_KSPLIT
#define W13_KSPLIT 4      // warps splitting K of a w13 strip (1, 2, 4)
#endif
constexpr int KS13 = W13_KSPLIT;
constexpr int SPI = WARPS / KS13;          // w13 strips of an item
constexpr int PPI = SPI / W13_SPS;         // act strips of a w13 item
static_assert(SPI * KS13 == WARPS && PPI * W13_SPS == SPI && NP % PPI == 0,
              "W13_KSPLIT must be 1, 2 or 4, and an item's act strips divide the expert's");
constexpr int NI13 = NP / PPI;             // w13 items of a unit
// w2: KS2 warps split the K of a strip: one where its chunks fit the stage ring at once
// (IP ≤ 512), else 2 up to 32 chunks (IP ≤ 2048), then 4, then 8. More warps put more of a
// strip's bytes in flight at once and add a sum of partials; on an H200 at 4 blocks per SM, 2
// warps measured faster than 4 at IP = 1536 and than 1 at IP = 768 (see docs/PERFORMANCE.md).
// W2_KSPLIT (1, 2, 4, 8) sets another split: 4 for a launch of one token's lanes where the rule
// gives 2 (moe_decode.w2_split_for: the decode step measured faster so), or any of them forced
// by a profiler.
#ifdef W2_KSPLIT
constexpr int KS2 = W2_KSPLIT;
#else
constexpr int KS2 = NC2 <= NBUF * STAGE ? 1 : NC2 <= 32 ? 2 : NC2 <= 64 ? 4 : 8;
#endif
static_assert(WARPS % KS2 == 0 && KS2 <= NC2,
              "KS2 must divide the block's 8 warps and be at most a w2 strip's chunks");
static_assert(MAXW <= THREADS && MAXW % 8 == 0, "group_lanes takes one lane per thread");
constexpr int WM2 = WARPS / KS2;
constexpr int G2 = (NS + WM2 - 1) / WM2;   // w2 items of a unit

// Copy chunks [c, min(c + STAGE, c1)) of a strip into stage `buf`, completed on bar[buf]; nothing
// is issued if there are no chunks. Every lane of the warp calls it (n is the same for all).
// sm_90+: one bulk copy (lane 0, one instruction a stage). Before sm_90 there is no bulk-copy
// engine: the lanes copy the stage 16 bytes at a time (cp.async, 4.5 copies a lane) and each
// arrives on the barrier when its copies have landed, so the ring, its parities and the waits
// are the same on every architecture.
CUPOOL_DEVICE void issue_stage(WarpStages& ws, int buf, const u8* strip, int c, int c1, int lane) {
    const int n = min(STAGE, c1 - c);
#if CUPOOL_BULK_COPY
    if (n > 0 && lane == 0) {
        const u32 bar = smem_addr(&ws.bar[buf]);
        fence_proxy_async_smem();            // the buffer's last reads were generic loads
        mbar_arrive_expect(bar, n * CHUNK_BYTES);
        bulk_load(smem_addr(&ws.w[buf][0]), strip + (i64)c * CHUNK_BYTES, n * CHUNK_BYTES, bar);
    }
#else
    if (n > 0) {
        const u8* src = strip + (i64)c * CHUNK_BYTES;
        for (int v = lane; v < n * (CHUNK_BYTES / 16); v += 32)
            cp_async16(&ws.w[buf][16 * v], src + 16 * v);
        cp_async_arrive_noinc(smem_addr(&ws.bar[buf]));
    }
#endif
}

// Stages 0 .. n - 1 (n ≤ NBUF) of chunks [c0, c1), into buffers 0 .. n - 1. The items issue
// stage 0 only (n = 1) and leave the rest to run_stages.
CUPOOL_DEVICE void issue_first(WarpStages& ws, const u8* strip, int c0, int c1, int lane, int n) {
#pragma unroll
    for (int b = 0; b < NBUF; ++b)
        if (b < n) issue_stage(ws, b, strip, c0 + b * STAGE, c1, lane);
}

// acc[nt] += chunks [c0, c1) of the strip × B, stage by stage. Stage 0 was issued as soon as the
// strip's address was known; stage i + 1 < NBUF goes out once stage i has landed, and stage
// i + NBUF into the buffer stage i leaves. Why one stage first: stages issued together share HBM
// with every other warp's and land together near the end, while a lone first stage lands early
// and its chunks are computed as the next one arrives (measured faster on an H200 for w13 and
// w2; see docs/PERFORMANCE.md). bfrag(c, nt, b): this lane's 16 activations of chunk c for
// n-tile nt (columns 16t … 16t+15 of the chunk, layout.py) as 8 words; k-tile q takes words 2q,
// 2q+1.
template <bool BF, class BFrag>
CUPOOL_DEVICE void run_stages(WarpStages& ws, const u8* strip, int c0, int c1, int ntiles,
                              float (&acc)[NTILES][4], int lane, BFrag bfrag) {
    u32 parity = ws.parity;
    for (int c = c0, i = 0; c < c1; c += STAGE, ++i) {
        const int buf = i % NBUF;
        mbar_wait(smem_addr(&ws.bar[buf]), (parity >> buf) & 1u);      // the stage's bytes
        parity ^= 1u << buf;
        if (i + 1 < NBUF) issue_stage(ws, i + 1, strip, c + STAGE, c1, lane);
#pragma unroll
        for (int ci = 0; ci < STAGE; ++ci) {
            if (c + ci >= c1) break;
            const u8* chunk = &ws.w[buf][ci * CHUNK_BYTES];
            const u32x4 w = *reinterpret_cast<const u32x4*>(chunk + lane * 16);
            const u32 sc = *reinterpret_cast<const u16*>(chunk + CHUNK_SCALES + 2 * lane);
            u32 a[4][4];
            dequant_chunk<BF>(w, sc, a);
            u32 b[NTILES][8];
#pragma unroll
            for (int nt = 0; nt < NTILES; ++nt)
                if (nt < ntiles) bfrag(c + ci, nt, b[nt]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) {
                    if (nt >= ntiles) continue;
                    mma16816<BF>(acc[nt], a[q], b[nt][2 * q], b[nt][2 * q + 1]);
                }
            }
        }
        __syncwarp();                           // every lane done with the buffer
        issue_stage(ws, buf, strip, c + NBUF * STAGE, c1, lane);
    }
    __syncwarp();
    if (lane == 0) ws.parity = parity;
}

// Shared memory of a block. The unit table is built once per launch; before that, the stages
// hold group_lanes' scratch.
struct Smem {
    WarpStages* stages;     // [WARPS]
    float* red;             // [WARPS][NTILES·4][32] partial sums of K slices
    SlotInfo* si;
    i64* unit_addr;         // [MAXW] row of each unit
    float* lane_w;          // [MAXW] router weight of each lane (0: padding or rejected)
    u8* unit_lanes;         // [MAXW][NT]
    u8* unit_count;         // [MAXW]
    float* bias;            // ROW_BIAS: [BIAS_FLOATS] the item's biases (w13: per pair, 16 gate
                            // then 16 up; w2: 16 per output strip)
    u16* xs;                // XSMEM: [NT][XS_STRIDE] the unit's token rows of x
};
constexpr int BIAS_FLOATS = ROW_BIAS ? 128 : 0;           // ≥ 32·PPI and ≥ 16·WM2

CUPOOL_DEVICE Smem carve(u8* smem) {
    Smem m;
    m.stages = reinterpret_cast<WarpStages*>(smem);
    m.red = reinterpret_cast<float*>(smem + WARPS * sizeof(WarpStages));
    m.si = reinterpret_cast<SlotInfo*>(m.red + WARPS * NTILES * 4 * 32);
    m.unit_addr = reinterpret_cast<i64*>(m.si + 1);
    m.lane_w = reinterpret_cast<float*>(m.unit_addr + MAXW);
    m.unit_lanes = reinterpret_cast<u8*>(m.lane_w + MAXW);
    m.unit_count = m.unit_lanes + MAXW * NT;
    m.bias = reinterpret_cast<float*>(m.unit_count + MAXW);   // 8-byte aligned (MAXW % 8 == 0)
#if XSMEM
    m.xs = reinterpret_cast<u16*>(smem + (reinterpret_cast<u8*>(m.bias + BIAS_FLOATS) - smem
                                          + 15) / 16 * 16);
#endif
    return m;
}
static_assert(sizeof(SlotInfo) % 8 == 0, "the unit table after SlotInfo is 8-byte aligned");
static_assert(!ROW_BIAS || (BIAS_FLOATS >= 32 * PPI && BIAS_FLOATS >= 16 * WM2),
              "the bias buffer holds an item's biases");

CUPOOL_DEVICE void put_partial(const Smem& m, int warp, int lane, const float (&acc)[NTILES][4]) {
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) m.red[((warp * NTILES + nt) * 4 + r) * 32 + lane] = acc[nt][r];
}

// Σ over warps w0, w0 + 1, ..., w0 + n - 1 of their partials, in that order.
CUPOOL_DEVICE void sum_partials(const Smem& m, int w0, int n, int lane, float (&acc)[NTILES][4]) {
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float v = 0.0f;
            for (int w = w0; w < w0 + n; ++w) v += m.red[((w * NTILES + nt) * 4 + r) * 32 + lane];
            acc[nt][r] = v;
        }
}

struct Args {
    u64* trace;
    const u16* x;
    int topk, tokens, hidden, all_units;
    u16* act;
    float* yw;
    i32* group_done;
    i32* unit_done;
    u16* out;
    i32* error;
};

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

#if ROUTE
static_assert(IN_BF16 && W_DTYPE <= 1 && XALIGN, "ROUTE: bf16 x (16-byte aligned), router weights "
              "float32 or bf16");
// The routing's inputs and outputs (see the header).
struct RouteArgs {
    const u16* h;          // [T, H] the residual stream: the kernel before's output
    const u16* rw;         // [E, H] the router's weight (bf16)
    const u16* nw;         // [H] the norm's weight (bf16)
    float eps;
    i32 E, norm_topk;
    const u8* active;      // [T] 0: the token's lanes are padding (null: every token routes)
    const i64* table;      // [E] each expert's bank row address
    u16* x;                // [T, H] out (block 0): the normed rows, which w13 reads as x
    float* logits;         // [T, E] out
    i32* ids;              // [T, topk] out (block 0)
    void* wts;             // [T, topk] out (block 0): W_DTYPE's float32 or bf16
    i64* lane_addr;        // [W] out (block 0)
    i32* count;            // [1] experts whose logits are out (zero at rest)
};

// Where the routing keeps its state, in the stage rings (dead until the unit table is built):
// [0, 1 KB) the warps' partial sums, then rstd; group_lanes' scratch (below 4 KB) reuses that
// once the routing is done; [4 KB, 8 KB) the lanes' row addresses, weights and ids, which
// group_lanes reads; from 8 KB the table of row addresses [E], copied in before the wait, then
// the logits of up to WARPS tokens (the launcher checks they fit: `route_fits`).
constexpr int ROUTE_LANES_AT = 4096, ROUTE_LOGITS_AT = 8192;
constexpr int RV = (HP + 8 * THREADS - 1) / (8 * THREADS);    // 16-byte words of a row a thread
static_assert(HP <= 4096, "ROUTE: rows up to 4096 wide (the router rows held in registers spill "
              "past that; cupool/ops/moe_decode.py ROUTE_MAX_HP)");
constexpr int RG = 4;                      // tokens whose loads are in flight together
static_assert(ROUTE_LANES_AT + 16 * MAXW <= ROUTE_LOGITS_AT,
              "the lane arrays fit below the table and the logits");
static_assert(8 * THREADS + 4 * THREADS + 4 * 33 <= ROUTE_LANES_AT,
              "group_lanes' scratch (s_addr, s_base, scan) stays below the lane arrays");

// Every block routes the call's tokens (see the header); on return the lanes' row addresses and
// weights are at scratch + ROUTE_LANES_AT for group_lanes. Every thread calls it.
CUPOOL_DEVICE void route_step(const RouteArgs& r, int tokens, int hidden, int topk, u8* scratch,
                              i32* error, u64* trace) {
    const int stamps = TRACE_ITEMS * 4 + TRACE_BLOCKS * 2 + blockIdx.x * 5;   // DECODE_TRACE
    float (*part)[16] = reinterpret_cast<float (*)[16]>(scratch);           // [WARPS][16]
    float* rstd = reinterpret_cast<float*>(scratch + WARPS * 16 * 4);         // [16]
    i64* s_la = reinterpret_cast<i64*>(scratch + ROUTE_LANES_AT);
    u8* s_wts = scratch + ROUTE_LANES_AT + 8 * MAXW;
    i32* s_ids = reinterpret_cast<i32*>(scratch + ROUTE_LANES_AT + 12 * MAXW);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int E = r.E, H = hidden;
    i64* s_table = reinterpret_cast<i64*>(scratch + ROUTE_LOGITS_AT);
    float* lg = reinterpret_cast<float*>(s_table + E);
    const u32x4 zero{0u, 0u, 0u, 0u};
    // before the wait: this block's first router row, the norm's weights and the table of row
    // addresses (into shared memory), none of which the kernel before writes
    u32x4 wrow[RV], nwv[RV];
#pragma unroll
    for (int j = 0; j < RV; ++j) {
        const int k = (tid + j * THREADS) * 8;
        wrow[j] = k < H && (int)blockIdx.x < E ? ld_stream16(r.rw + (i64)blockIdx.x * H + k) : zero;
        nwv[j] = k < H ? *reinterpret_cast<const u32x4*>(r.nw + k) : zero;
    }
    for (int i = tid; i < E; i += THREADS) s_table[i] = r.table[i];
    wait_for_producers();
    let_consumers_launch();
    stamp_at(trace, stamps);

    // rstd of every token: each thread's squares in k order, a warp sum, the warps in order
    // (dense_gemv's MODE 1 order); RG tokens' loads in flight at a time
    for (int n0 = 0; n0 < tokens; n0 += RG) {
        float ss[RG];
#pragma unroll
        for (int q = 0; q < RG; ++q) {
            ss[q] = 0.0f;
            if (n0 + q >= tokens) continue;
#pragma unroll
            for (int j = 0; j < RV; ++j) {
                const int k = (tid + j * THREADS) * 8;
                if (k >= H) continue;
                float h[8];
                unpack8(*reinterpret_cast<const u32x4*>(r.h + (i64)(n0 + q) * H + k), h);
#pragma unroll
                for (int i = 0; i < 8; ++i) ss[q] += h[i] * h[i];
            }
        }
#pragma unroll
        for (int q = 0; q < RG; ++q) {
            if (n0 + q >= tokens) continue;
            const float v = warp_sum(ss[q]);
            if (lane == 0) part[warp][n0 + q] = v;
        }
    }
    __syncthreads();
    if (tid < tokens) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += part[w][tid];
        rstd[tid] = rsqrtf(v / (float)H + r.eps);
    }
    __syncthreads();

    // the logits of experts blockIdx.x, + gridDim.x, ...: x = bf16(nw · bf16(h · rstd)) (block 0
    // writes it out once), one dot product a token, reduced over the block
    int mine = 0;
    for (int e = blockIdx.x; e < E; e += gridDim.x, ++mine) {
        if (mine > 0) {
#pragma unroll
            for (int j = 0; j < RV; ++j) {
                const int k = (tid + j * THREADS) * 8;
                wrow[j] = k < H ? ld_stream16(r.rw + (i64)e * H + k) : zero;
            }
        }
        for (int n0 = 0; n0 < tokens; n0 += RG) {
            float d[RG];
#pragma unroll
            for (int q = 0; q < RG; ++q) {
                d[q] = 0.0f;
                const int n = n0 + q;
                if (n >= tokens) continue;
                const float rs = rstd[n];
#pragma unroll
                for (int j = 0; j < RV; ++j) {
                    const int k = (tid + j * THREADS) * 8;
                    if (k >= H) continue;
                    float h[8], w[8], x[8], g[8];
                    unpack8(*reinterpret_cast<const u32x4*>(r.h + (i64)n * H + k), h);
                    unpack8(nwv[j], w);
                    unpack8(wrow[j], g);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        x[i] = bf16_to_f32(f32_to_bf16(w[i] * bf16_to_f32(f32_to_bf16(h[i] * rs))));
                        d[q] += x[i] * g[i];
                    }
                    if (blockIdx.x == 0 && mine == 0) st16(r.x + (i64)n * H + k, pack8(x));
                }
            }
#pragma unroll
            for (int q = 0; q < RG; ++q) {
                if (n0 + q >= tokens) continue;
                const float v = warp_sum(d[q]);
                if (lane == 0) part[warp][n0 + q] = v;
            }
        }
        __syncthreads();
        if (tid < tokens) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) v += part[w][tid];
            r.logits[(i64)tid * E + e] = bf16_to_f32(f32_to_bf16(v));
        }
        __syncthreads();
    }
    if (mine > 0) {                          // (block-uniform)
        __threadfence();                     // the logits (and block 0's x) before the count
        __syncthreads();
        if (tid == 0) atomicAdd(r.count, mine);
    }
    stamp_at(trace, stamps + 1);
    wait_count(r.count, E, error);           // every expert's logits are out
    stamp_at(trace, stamps + 2);

    // route every token from the logits, WARPS at a time, one warp a token
    for (int n0 = 0; n0 < tokens; n0 += WARPS) {
        const int nn = min(WARPS, tokens - n0);
        for (int i = tid; i < nn * E; i += THREADS) lg[i] = ld_f32_cg(r.logits + (i64)n0 * E + i);
        __syncthreads();
        if (n0 == 0) stamp_at(trace, stamps + 3);
        const int n = n0 + warp;
        if (warp < nn)
            route_token<true>(lg + warp * E, E, topk, r.norm_topk,
                              r.active == nullptr || r.active[n] != 0, s_ids + n * topk,
                              s_wts + n * topk * (W_DTYPE == 0 ? 4 : 2), W_DTYPE == 0, s_table,
                              s_la + n * topk);
        __syncthreads();
    }
    if (blockIdx.x == 0) {
        for (int i = tid; i < tokens * topk; i += THREADS) {
            r.ids[i] = s_ids[i];
            r.lane_addr[i] = s_la[i];
            if (W_DTYPE == 0)
                static_cast<float*>(r.wts)[i] = reinterpret_cast<const float*>(s_wts)[i];
            else
                static_cast<u16*>(r.wts)[i] = reinterpret_cast<const u16*>(s_wts)[i];
        }
    }
    stamp_at(trace, stamps + 4);
}
#endif

// w13 item: strips SPI·i ... SPI·i + SPI - 1 of unit u's w13, i.e. act strips PPI·i ...
// PPI·i + PPI - 1; strip s is K-sliced by warps s·KS13 ... s·KS13 + KS13 - 1. Gated rows: pair j's
// gate strip is strip 2j, its up strip 2j + 1 (PPI 1: warps 0..3 gate, 4..7 up). Rows without a
// gate: strip j is up strip j (KS13 4: warps 0..3 act strip 2i, 4..7 act strip 2i + 1).
CUPOOL_DEVICE void w13_item(const Args& a, const Smem& m, int u, int i, int item) {
    stamp(a.trace, item, 0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int s = warp / KS13, ks = warp % KS13;              // strip s of the item
    const u8* row = reinterpret_cast<const u8*>(m.unit_addr[u]);
    const u8* strip = row + 256 + (i64)(SPI * i + s) * W13_STRIP;
    int c0, c1;
    k_slice(ks, KS13, NC13, c0, c1);
    WarpStages& ws = m.stages[warp];
    issue_first(ws, strip, c0, c1, lane, 1);                  // stage 0 only
    const float* hdr = reinterpret_cast<const float*>(row);
#if ROW_GATED
    const float gs_gate = hdr[0], gs_up = hdr[1];              // in flight during the K loop
#else
    const float gs_up = hdr[1];                                // (no gate: hdr[0] unused)
#endif
#if ROW_BIAS
    if (threadIdx.x < 32 * PPI) {                              // pair j: 16 gate, then 16 up
        const int j = threadIdx.x >> 5, r = threadIdx.x & 31;
        const float* b = reinterpret_cast<const float*>(row + ROW_BIAS_OFFSET);
        m.bias[threadIdx.x] = b[(r < 16 ? 0 : IP) + 16 * (PPI * i + j) + (r & 15)];
    }
#endif
    if (threadIdx.x < NT) {
        m.si->lane[threadIdx.x] = slot_lane(m.unit_count, m.unit_lanes, u);
        m.si->scale[threadIdx.x] = 1.0f;                       // x goes in unscaled
    }
    __syncthreads();
    stamp(a.trace, item, 1);
    const int ntiles = (m.unit_count[u] + 7) >> 3;
    const int g = lane >> 2, t = lane & 3, hidden = a.hidden;
    const u16* xrow[NTILES];
#if XSMEM
    stage_x(m.xs, m.si, m.unit_count[u], a.x, a.topk, hidden);
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
        xrow[nt] = m.si->lane[nt * 8 + g] >= 0 ? m.xs + (nt * 8 + g) * XS_STRIDE : nullptr;
#else
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
        const int l = m.si->lane[nt * 8 + g];
        xrow[nt] = l >= 0 ? a.x + (i64)(l / a.topk) * hidden : nullptr;
    }
#endif
    float acc[NTILES][4] = {};
    // B from x in the model's dtype: in shared memory (XSMEM), or straight from global memory
    // (plain loads: the compiler may hoist them)
    run_stages<IN_BF16>(ws, strip, c0, c1, ntiles, acc, lane, [&](int c, int nt, u32 (&b)[8]) {
#if XSMEM
        smem_cols16(xrow[nt], c * 64 + 16 * t, b);
#else
        x_cols16(xrow[nt], c * 64 + 16 * t, hidden, b);
#endif
    });
    stamp(a.trace, item, 2);
    put_partial(m, warp, lane, acc);
    __syncthreads();
#if ROW_GATED
    if (ks == 0 && s % 2 == 0) {                               // the pair's first gate warp
        float gu[2][NTILES][4];
        sum_partials(m, warp, KS13, lane, gu[0]);
        sum_partials(m, warp + KS13, KS13, lane, gu[1]);
        const float* bias = m.bias + 32 * (s / 2);
        w13_epilogue(gu, ntiles, m.si, gs_gate * dequant_unscale<IN_BF16>(),
                     gs_up * dequant_unscale<IN_BF16>(), PPI * i + s / 2, lane, a.act, bias,
                     bias + 16);
        __threadfence();                                       // act before the count
    }
#else
    if (ks == 0) {                                             // the up strip's first warp
        float up[NTILES][4];
        sum_partials(m, warp, KS13, lane, up);
        w13_epilogue_up(up, ntiles, m.si, gs_up * dequant_unscale<IN_BF16>(), PPI * i + s, lane,
                        a.act);
        __threadfence();                                       // act before the count
    }
#endif
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(a.unit_done + u, PPI);    // act strips done
    stamp(a.trace, item, 3);
}

// w2 item: output strips grp·WM2 ... of unit u, each split over KS2 warps along K.
CUPOOL_DEVICE void w2_item(const Args& a, const Smem& m, int u, int grp, int* s_last, int item) {
    stamp(a.trace, item, 0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp / KS2, ks = warp % KS2;
    const int st = grp * WM2 + wm;
    const u8* row = reinterpret_cast<const u8*>(m.unit_addr[u]);
    const u8* strip = row + W2_OFFSET + (i64)st * W2_STRIP;
    int c0 = 0, c1 = 0;
    if (st < NS) k_slice(ks, KS2, NC2, c0, c1);
    WarpStages& ws = m.stages[warp];
    issue_first(ws, strip, c0, c1, lane, 1);                  // stage 0 only
    const float gs_down = reinterpret_cast<const float*>(row)[2];
#if ROW_BIAS
    if (threadIdx.x < 16 * WM2 && grp * WM2 * 16 + (int)threadIdx.x < HP)
        m.bias[threadIdx.x] = reinterpret_cast<const float*>(row + ROW_BIAS_OFFSET)[
            2 * IP + grp * WM2 * 16 + threadIdx.x];
#endif
    if (threadIdx.x < NT) {
        m.si->lane[threadIdx.x] = slot_lane(m.unit_count, m.unit_lanes, u);
        m.si->scale[threadIdx.x] = 1.0f;                       // act goes in as w13 wrote it
    }
    wait_count(a.unit_done + u, NP, a.error);                  // the unit's act is complete
    stamp(a.trace, item, 1);
    const int ntiles = (m.unit_count[u] + 7) >> 3;
    const int g = lane >> 2, t = lane & 3;
    // B straight from the unit's act rows (bf16, written by other blocks: L2 loads)
    const u16* arow[NTILES];
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
        const int l = m.si->lane[nt * 8 + g];
        arow[nt] = l >= 0 ? a.act + (i64)l * IP : nullptr;
    }
    float acc[NTILES][4] = {};
    run_stages<true>(ws, strip, c0, c1, ntiles, acc, lane, [&](int c, int nt, u32 (&b)[8]) {
        if (arow[nt] != nullptr) {
            load_cols16<true>(arow[nt] + c * 64 + 16 * t, b);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) b[i] = 0u;
        }
    });
    stamp(a.trace, item, 2);
    if (KS2 > 1) {
        put_partial(m, warp, lane, acc);
        __syncthreads();
        if (ks == 0) sum_partials(m, warp, KS2, lane, acc);
    }
    if (ks == 0 && st < NS)
        w2_epilogue(acc, ntiles, m.si, gs_down * dequant_unscale<true>(), st, lane, m.lane_w,
                    a.topk, a.hidden, false, a.yw, nullptr, m.bias + 16 * wm);
    // the last unit to finish this strip group sums over top-k in fixed order
    if (last_arrival(a.group_done + grp, a.all_units, s_last))
        topk_sum(grp * WM2 * 16, WM2 * 16, a.tokens, a.topk, a.hidden, m.lane_w, a.yw, a.out);
    stamp(a.trace, item, 3);
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_decode(const u16* __restrict__ x,            // [T, H] bf16/fp16 hidden states
           i32 tokens, i32 hidden,
           const i64* __restrict__ lane_addr,    // [W] row address per lane (0: padding)
           const i32* __restrict__ lane_fresh,   // [W] 1: row being copied in (null: none)
           const void* __restrict__ topk_w,      // [W] router weights, W_DTYPE
           i32 W, i32 topk,
           i32 part,                             // 0: rows in place, 1: fresh rows, 2: all
           u16* __restrict__ act,                // [W, IP] bf16
           float* __restrict__ yw,               // [W, HP]
           i32* __restrict__ group_done,         // [G2] zero at rest
           i32* __restrict__ sync,               // [2 + W] zero at rest
           u16* __restrict__ out,                // [T, H]
           i32* __restrict__ error,
           u64* __restrict__ trace              // DECODE_TRACE only (else unused, may be null)
#if ROUTE
           // the routing (RouteArgs; lane_addr, lane_fresh and topk_w are then null)
           , const u16* __restrict__ route_h, const u16* __restrict__ route_w,
           const u16* __restrict__ route_nw, float route_eps, i32 experts, i32 norm_topk,
           const u8* __restrict__ active, const i64* __restrict__ table, u16* xn, float* logits,
           i32* ids, void* wts, i64* lane_addr_out, i32* route_count
#endif
           ) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ int s_ticket;
    __shared__ int s_last, s_held, s_total;
    __shared__ Args a;                    // in shared memory: registers stay with the K loop
    const Smem m = carve(smem);
#if !ROUTE
    // launched as an ordinary launch (everything before it has finished): the next kernel, if
    // launched as a dependent, may start its early part (weight loads) now (common.cuh)
    let_consumers_launch();
#endif
    stamp_at(trace, TRACE_ITEMS * 4 + blockIdx.x * 2);         // block stamps after the items'
    if (threadIdx.x == 0) {
        a.trace = trace;
        a.x = x; a.topk = topk; a.tokens = tokens; a.hidden = hidden;
        a.act = act; a.yw = yw; a.group_done = group_done;
        a.unit_done = sync + 2; a.out = out; a.error = error;
    }
    {   // unit table of the call; scratch in the (not yet used) stages
        i64* s_addr = reinterpret_cast<i64*>(m.stages);
        int* s_base = reinterpret_cast<int*>(s_addr + THREADS);
#if ROUTE
        // launched as a dependent: route_step waits for the kernel before, then lets the next
        // launch start
        const RouteArgs ra{route_h, route_w, route_nw, route_eps, experts, norm_topk, active,
                           table, xn, logits, ids, wts, lane_addr_out, route_count};
        route_step(ra, tokens, hidden, topk, reinterpret_cast<u8*>(m.stages), error, trace);
        const u8* routed = reinterpret_cast<const u8*>(m.stages) + ROUTE_LANES_AT;
        const i64* lanes = reinterpret_cast<const i64*>(routed);
        const void* weights = routed + 8 * MAXW;
#else
        const i64* lanes = lane_addr;
        const void* weights = topk_w;
#endif
        group_lanes(lanes, lane_fresh, weights, W, s_addr, s_base, s_base + THREADS, m.lane_w,
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
    const int n13 = rg.count * NI13, total = n13 + rg.count * G2;
    // Block b < base starts on item b without a ticket; later items are claimed from the counter
    // (numbered from base), one ahead: the claim is issued when an item starts and its answer is
    // only needed when the item ends, so the atomic's round trip is hidden.
    const int bid = blockIdx.x, base = min(total, (int)gridDim.x);
    int item = bid < base ? bid : total;
    while (item < total) {
        int next = total;
        if (threadIdx.x == 0 && base < total) next = base + atomicAdd(sync, 1);
        if (item < n13) {
            w13_item(a, m, rg.first + item / NI13, item % NI13, item);
        } else {
            const int i = item - n13;
            w2_item(a, m, rg.first + i / G2, i % G2, &s_last, item);
        }
        if (threadIdx.x == 0) s_ticket = next;
        __syncthreads();                                       // next item known, smem free
        item = s_ticket;
    }
    // the last block out puts the counters back to zero for the next launch
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1) == (int)gridDim.x - 1) {
            for (int u = rg.first; u < rg.first + rg.count; ++u) a.unit_done[u] = 0;
            sync[0] = 0;
            sync[1] = 0;
#if ROUTE
            *route_count = 0;
#endif
            __threadfence();
        }
    }
}
