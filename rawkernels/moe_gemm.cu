// NVFP4 MoE GEMM: w13 (gate/up) + the activation (SiLU(gate)·up, or gpt-oss's clamped SwiGLU;
// biases where the rows have them; ReLU(up)² of up alone in rows without a gate, ROW_GATED 0;
// moe_common.cuh), then w2 (+ bias) scaled by the router weight and summed over top-k. Weights
// are read from expert rows in the kernel layout of cupool/layout.py, wherever they are (bank
// row, staging row, or pinned host memory through a UVA address).
//
// Work sketch
// - A *unit* is one expert's weights plus up to NT lanes (a lane = one (token, k) pair) routed to
//   it; the align kernel (moe_align.cu) builds the unit table. An *item* is (unit, group of WARPS_M
//   strips): for w13 a strip is a (gate strip, up strip) pair of 16 rows each, so SiLU·up fuses in
//   registers (rows without a gate: one up strip, W13_SPS = 1); for w2 a strip is 16 output rows
//   of H.
// - A block is WARPS_M × KSPLIT warps: WARPS_M warps on different strips of the same unit (they
//   share the activations staged in shared memory), KSPLIT warps splitting K of each strip (decode:
//   one token per unit, so K-splitting is what puts enough loads in flight to fill HBM).
// - Each warp streams its strips in 64-column chunks: one 16-byte load per lane per chunk is four
//   m16n8k16 A fragments (mma_fp4.cuh), dequantized in registers with one 16-bit load of the
//   lane's two block scales; B fragments are two 16-byte loads a n-tile from the activations
//   staged in shared memory (a lane's 16 columns of a chunk are contiguous, layout.py). fp32
//   accumulation.
// - Activations are staged by cp.async in stages of KC columns (w2: W2_KC), double-buffered where
//   K takes more than one stage: stage s + 1 is copied while stage s is multiplied. w13 multiplies
//   fp16 x (row-scaled by a power of two, moe_align.cu's prep) with fp16-dequantised weights; w2
//   multiplies the bf16 act rows w13 wrote with bf16-dequantised weights. Both are exact products.
// - The grid is fixed (persistent blocks); the number of units is read from device memory, so one
//   captured launch serves every routing. w13 blocks take items round-robin (the units of one
//   expert are then read at about the same time, from L2); w2 blocks take a contiguous range, so
//   consecutive items of one unit reuse its staged act rows where w2 stages all of K at once.
//
// Outputs and invariants
// - moe_w13 writes act[lane, 0:IP] (bf16, act(gate, up) or act(up) at true scale) for every lane
//   of every unit in its range; nothing else writes act.
// - moe_w2 (REDUCE 0, decode): writes yw[lane, h] = weight(lane) · (w2 · act)[h] for its units,
//   then the last unit to finish a strip group (per-group arrival counter against the units of
//   `all_range`, reset by that block) sums yw over k in fixed order for every token and writes
//   out[t, h]. Deterministic. A call may run as two launches in stream order, the units already
//   in place and then the fresh ones (moe_align.cu), both counting towards all_range: the
//   reducing block is then in the second launch, after every yw of the first is written.
//   (REDUCE 1, prefill): atomicAdd into out32[t, h] (zeroed by the launcher); several launches
//   (resident experts, then each chunk of host experts) accumulate into it, and moe_finish
//   converts it to the output dtype.

// Configuration (launchers pass -D; the defaults are the decode kernel of Qwen3-30B-A3B).
#ifndef HP
#define HP 2048           // padded hidden size (multiple of 64)
#endif
#ifndef IP
#define IP 768            // padded intermediate size (multiple of 64)
#endif
#ifndef NT
#define NT 16             // lane slots per unit (multiple of 8: one mma n-tile per 8)
#endif
#ifndef KSPLIT
#define KSPLIT 4          // warps splitting K of one strip
#endif
#ifndef WARPS_M
#define WARPS_M 1         // warps on different strips of one unit
#endif
#ifndef KC
#define KC 1024           // activation columns of w13 staged in shared memory at a time
#endif
#ifndef W2_KC
#define W2_KC KC          // the same for w2 (≥ IP: all of K once, reused by a unit's items)
#endif
#ifndef W2_NS
#define W2_NS 1           // output strips of w2 per warp (2: each B fragment feeds two mma)
#endif
#ifndef NB
#define NB 4              // 64-column chunks in flight per warp before the first is used
#endif
#ifndef NTG
#define NTG 4             // n-tiles whose B fragments a warp holds at once (compute_batch)
#endif
#ifndef OUT_BF16
#define OUT_BF16 1        // output dtype: 1 bf16, 0 fp16
#endif
#ifndef REDUCE
#define REDUCE 0          // 0: deterministic last-block sum over top-k; 1: fp32 atomics
#endif
#ifndef MINB
#define MINB 1            // blocks per SM the register allocation must allow (__launch_bounds__)
#endif
#ifndef PREFETCH_W2
#define PREFETCH_W2 1     // moe_w13 pulls each unit's w2 rows into L2 for moe_w2
#endif

#include "moe_common.cuh"
#include "async_copy.cuh"

#define NWARPS (KSPLIT * WARPS_M)
#define THREADS (32 * NWARPS)

static_assert(KC % 64 == 0 && W2_KC % 64 == 0, "KC and W2_KC must be multiples of 64");
static_assert((W2_NS == 1 || W2_NS == 2) && (HP / 16) % W2_NS == 0, "W2_NS: 1 or 2");
constexpr int NG = NTG < NTILES ? NTG : NTILES;   // n-tiles a step of compute_batch
static_assert(NTG >= 1 && NTILES % NG == 0, "NTG must divide the n-tiles (or exceed them)");

// Staged activations of one kernel: NBUF buffers of [NT][STRIDE] 16-bit values, STRIDE = the
// stage's columns + 8, so that a row is 16 bytes past a multiple of 128: in each quarter of a
// warp's 16-byte B loads (2 rows × 4 lanes, 32 bytes apart within a row) the 8 lanes hit 8
// different 16-byte bank groups.
template <int KP, int KCX>
struct Staging {
    static constexpr int COLS = KCX < KP ? KCX : KP;
    static constexpr int STAGES = (KP + COLS - 1) / COLS;
    static constexpr int NBUF = STAGES > 1 ? 2 : 1;
    static constexpr int STRIDE = COLS + 8;
    static constexpr int BYTES = NBUF * NT * STRIDE * 2;
};
typedef Staging<HP, KC> Stage13;
typedef Staging<IP, W2_KC> Stage2;

template <int NS>
struct Strips { const u8* p[NS]; };     // passed by value so the pointers stay in registers

// One batch of NB 64-column chunks of NS strips, held in registers between load and use.
template <int NS>
struct Batch {
    u32x4 w[NS][NB];
    u32 sc[NS][NB];              // the lane's two scale bytes of each chunk
};

// Issue every load of chunks [c, min(c+NB, c_hi)) before any is used: HBM (or PCIe) latency is
// paid once per batch, not once per chunk.
template <int NS>
CUPOOL_DEVICE void load_batch(Batch<NS>& b, const Strips<NS> strip, int c, int c_hi, int lane) {
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        if (c + i < c_hi) {
#pragma unroll
            for (int s = 0; s < NS; ++s) {
                const u8* chunk = strip.p[s] + (i64)(c + i) * CHUNK_BYTES;
                b.w[s][i] = ld_stream16(chunk + lane * 16);
                b.sc[s][i] = ld_u16_nc(chunk + CHUNK_SCALES + 2 * lane);
            }
        }
    }
}

// acc[s][nt] += the batch's chunks × staged activations (xs: a buffer of [NT][STRIDE] holding
// the columns from chunk xs_c0 on). BF: bf16 operands, else fp16. A lane's B fragments of a
// chunk and n-tile are its 16 activations 16t … 16t+15 (layout.py): two 16-byte shared loads,
// each two k-tiles.
template <int NS, bool BF, int STRIDE>
CUPOOL_DEVICE void compute_batch(const Batch<NS>& b, int c, int c_hi, const u16* xs, int xs_c0,
                                 int ntiles, float (&acc)[NS][NTILES][4], int lane) {
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        if (c + i < c_hi) {
            u32 sc[NS];
#pragma unroll
            for (int s = 0; s < NS; ++s) sc[s] = scale_pair<BF>(b.sc[s][i]);
            const int g = lane >> 2, t = lane & 3;
            const u16* xc = xs + (c + i - xs_c0) * 64 + 16 * t;
            // half a chunk at a time (k-tiles 2h, 2h+1: 8 A registers a strip, not 16), so that
            // w2's two strips × 8 n-tiles of accumulators fit without spilling
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 a[NS][2][4];
#pragma unroll
                for (int s = 0; s < NS; ++s) {
                    dequant_tile<BF>(h ? b.w[s][i].z : b.w[s][i].x, sc[s], a[s][0]);
                    dequant_tile<BF>(h ? b.w[s][i].w : b.w[s][i].y, sc[s], a[s][1]);
                }
                // NG n-tiles a step: NG·NS other mma between an accumulator's two updates
#pragma unroll
                for (int n0 = 0; n0 < NTILES; n0 += NG) {
                    u32x4 v[NG];
#pragma unroll
                    for (int j = 0; j < NG; ++j)
                        if (n0 + j < ntiles)
                            v[j] = *reinterpret_cast<const u32x4*>(xc + ((n0 + j) * 8 + g) * STRIDE + 8 * h);
#pragma unroll
                    for (int s = 0; s < NS; ++s)
#pragma unroll
                        for (int j = 0; j < NG; ++j)
                            if (n0 + j < ntiles) mma16816<BF>(acc[s][n0 + j], a[s][0], v[j].x, v[j].y);
#pragma unroll
                    for (int s = 0; s < NS; ++s)
#pragma unroll
                        for (int j = 0; j < NG; ++j)
                            if (n0 + j < ntiles) mma16816<BF>(acc[s][n0 + j], a[s][1], v[j].z, v[j].w);
                }
            }
        }
    }
}

// This warp's 64-column chunks [lo, hi) of the activation stage [kc0, kc1) of K.
CUPOOL_DEVICE void warp_chunks(int kc0, int kc1, int ks, int& lo, int& hi) {
    const int nch = (kc1 - kc0) >> 6;
    const int per = (nch + KSPLIT - 1) / KSPLIT;
    lo = (kc0 >> 6) + ks * per;
    hi = min(lo + per, kc1 >> 6);
}

// cp.async of columns [kc0, kc1) of the unit's ntiles·8 staged rows into buffer xb (row n from
// row(n), which points at column 0 of its source row, or is null: zeros). Every thread calls it;
// each warp takes whole rows, each lane 16 bytes of them.
template <int STRIDE, class Row>
CUPOOL_DEVICE void stage_rows(u16* xb, int ntiles, int kc0, int kc1, Row row) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int n = warp; n < ntiles * 8; n += NWARPS) {
        const u16* src = row(n);
        for (int col = kc0 + lane * 8; col < kc1; col += 256)
            cp_async16_zfill(xb + n * STRIDE + (col - kc0), src ? src + col : xb, src != nullptr);
    }
    cp_async_commit();
}

// The K loop of one item. Stage 0 was issued by the caller (or is still in place from the
// previous item when there is one stage); each stage waits for its copies, then starts the next
// stage's copies into the other buffer and multiplies. The first weight batch was loaded by the
// caller before staging, so its latency overlaps the staging. row(n): see stage_rows.
template <int NS, int KP, bool BF, class S, class Row>
CUPOOL_DEVICE void item_k_loop(Batch<NS>& b, const Strips<NS> strips, bool active, int ks,
                               u16* xs, int ntiles, float (&acc)[NS][NTILES][4], int lane, Row row) {
    for (int st = 0; st < S::STAGES; ++st) {
        const int kc0 = st * S::COLS, kc1 = kc0 + S::COLS < KP ? kc0 + S::COLS : KP;
        cp_async_wait<0>();
        __syncthreads();                   // stage st in place; every warp is past stage st - 1
        if (st + 1 < S::STAGES)
            stage_rows<S::STRIDE>(xs + ((st + 1) & 1) * NT * S::STRIDE, ntiles, kc1,
                                  kc1 + S::COLS < KP ? kc1 + S::COLS : KP, row);
        if (active) {
            const u16* xb = xs + (st & 1) * NT * S::STRIDE;
            int lo, hi;
            warp_chunks(kc0, kc1, ks, lo, hi);
            for (int c = lo; c < hi; c += NB) {
                if (kc0 != 0 || c != lo) load_batch<NS>(b, strips, c, hi, lane);
                compute_batch<NS, BF, S::STRIDE>(b, c, hi, xb, kc0 >> 6, ntiles, acc, lane);
            }
        }
    }
}

// Sum the KSPLIT partial accumulators into the ks == 0 warp of each strip. `red` has room for
// (KSPLIT-1) × WARPS_M × NS·NTILES·4 × 32 floats. Called by every thread of the block.
template <int NS>
CUPOOL_DEVICE void ksplit_reduce(float (&acc)[NS][NTILES][4], float* red, int wm, int ks, int lane) {
    if (KSPLIT == 1) return;
    constexpr int V = NS * NTILES * 4;
    if (ks > 0) {
        float* dst = red + (((ks - 1) * WARPS_M + wm) * V) * 32 + lane;
#pragma unroll
        for (int s = 0; s < NS; ++s)
#pragma unroll
            for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) dst[((s * NTILES + nt) * 4 + r) * 32] = acc[s][nt][r];
    }
    __syncthreads();
    if (ks == 0) {
        for (int k = 1; k < KSPLIT; ++k) {
            const float* src = red + (((k - 1) * WARPS_M + wm) * V) * 32 + lane;
#pragma unroll
            for (int s = 0; s < NS; ++s)
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[s][nt][r] += src[((s * NTILES + nt) * 4 + r) * 32];
        }
    }
}

// Shared memory of a kernel (cupool/ops/moe_gemm.py, shared_bytes, mirrors it): the staging
// buffers (BYTES), the K-split buffer, the per-slot data.
template <int BYTES>
CUPOOL_DEVICE float* red_buffer(u8* smem) { return reinterpret_cast<float*>(smem + BYTES); }

template <int BYTES, int NS>
CUPOOL_DEVICE SlotInfo* slot_info(u8* smem) {
    return reinterpret_cast<SlotInfo*>(red_buffer<BYTES>(smem) + (KSPLIT - 1) * WARPS_M * NS * NTILES * 4 * 32);
}

// ------------------------------------------------------------------------------------------
// w13: act[lane, j] = act(gate_j · x, up_j · x) (rows without a gate: act(up_j · x)) for the
// unit's lanes, in bf16.
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_w13(const i32* __restrict__ range,        // [2] first unit, end unit of this launch
        const i64* __restrict__ unit_addr,    // [units] row address (device or UVA host)
        const i32* __restrict__ unit_lanes,   // [units, NT] lane ids, -1 empty
        const i32* __restrict__ unit_count,   // [units] lanes in the unit
        const u16* __restrict__ xh,           // [T, HP] fp16 activations, row-scaled
        const float* __restrict__ xscale,     // [T] power-of-two scale of each token row
        i32 topk,                             // K: token of lane = lane / K
        u16* __restrict__ act) {              // [W, IP] bf16
    extern __shared__ __align__(16) u8 smem[];
    u16* xs = reinterpret_cast<u16*>(smem);
    float* red = red_buffer<Stage13::BYTES>(smem);
    SlotInfo* si = slot_info<Stage13::BYTES, W13_SPS>(smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp / KSPLIT, ks = warp % KSPLIT;
    const Range rg = unit_range(range);
    constexpr int NP = IP / 16;                                 // act strips per expert
    constexpr int GROUPS = (NP + WARPS_M - 1) / WARPS_M;
    const int items = rg.count * GROUPS;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int u = rg.first + item / GROUPS;
        const int p = (item % GROUPS) * WARPS_M + wm;
        const bool active = p < NP;
        const int count = unit_count[u];
        const int ntiles = (count + 7) >> 3;
        const u8* row = reinterpret_cast<const u8*>(unit_addr[u]);
        Strips<W13_SPS> strips;
#if ROW_GATED
        strips.p[0] = row + 256 + (i64)(2 * p) * W13_STRIP;         // gate rows 16p..16p+15
        strips.p[1] = strips.p[0] + W13_STRIP;                       // up rows, same j
#else
        strips.p[0] = row + 256 + (i64)p * W13_STRIP;               // up rows 16p..16p+15
#endif

        // First weight batch in flight before anything else: it depends only on unit_addr.
        Batch<W13_SPS> b;
        {
            int lo, hi;
            warp_chunks(0, Stage13::COLS, ks, lo, hi);
            if (active) load_batch<W13_SPS>(b, strips, lo, hi, lane);
        }
#if PREFETCH_W2
        // Pull this unit's w2 rows towards L2 now, so moe_w2 reads them from L2: each of the
        // NP items of a unit takes 1/NP of them.
        {
            constexpr i64 W2_BYTES = (i64)(HP / 16) * W2_STRIP;
            constexpr i64 PER = ((W2_BYTES / NP) + 127) / 128 * 128;
            const i64 lo = (i64)(item % GROUPS) * PER, hi = lo + PER < W2_BYTES ? lo + PER : W2_BYTES;
            for (i64 off = lo + threadIdx.x * 128; off < hi; off += THREADS * 128)
                prefetch_l2(row + W2_OFFSET + off);
        }
#endif
        __syncthreads();                                        // previous item done with smem
        if (threadIdx.x < NT) {
            const int l = threadIdx.x < count ? unit_lanes[u * NT + threadIdx.x] : -1;
            si->lane[threadIdx.x] = l;
            si->scale[threadIdx.x] = l >= 0 ? xscale[l / topk] : 0.0f;
        }
        __syncthreads();
        // x row of slot n's token (fp16, row-scaled), or null for an empty slot
        auto x_row = [&](int n) -> const u16* {
            const int l = si->lane[n];
            return l >= 0 ? xh + (i64)(l / topk) * HP : nullptr;
        };
        stage_rows<Stage13::STRIDE>(xs, ntiles, 0, Stage13::COLS, x_row);
        float acc[W13_SPS][NTILES][4] = {};
        item_k_loop<W13_SPS, HP, false, Stage13>(b, strips, active, ks, xs, ntiles, acc, lane, x_row);
        ksplit_reduce<W13_SPS>(acc, red, wm, ks, lane);
        if (ks == 0 && active) {
            const float* hdr = reinterpret_cast<const float*>(row);
#if ROW_GATED
            const float* bias = reinterpret_cast<const float*>(row + ROW_BIAS_OFFSET) + 16 * p;
            w13_epilogue(acc, ntiles, si, hdr[0] * dequant_unscale<false>(),
                         hdr[1] * dequant_unscale<false>(), p, lane, act, bias, bias + IP);
#else
            w13_epilogue_up(acc[0], ntiles, si, hdr[1] * dequant_unscale<false>(), p, lane, act);
#endif
        }
    }
}

// ------------------------------------------------------------------------------------------
// w2: out[t, h] = Σ_k weight(t,k) · (w2_{e(t,k)} · act[t,k])[h]
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_w2(const i32* __restrict__ range,       // this launch's units
       const i32* __restrict__ all_range,   // REDUCE 0: every unit of the call (arrival target)
       const i64* __restrict__ unit_addr,
       const i32* __restrict__ unit_lanes,
       const i32* __restrict__ unit_count,
       const u16* __restrict__ act,          // [W, IP] bf16
       const float* __restrict__ lane_w,     // [W] router weight per lane (0 for padding)
       i32 topk, i32 tokens, i32 hidden,     // K, T, H
       float* __restrict__ yw,               // REDUCE 0: [W, HP] per-lane outputs
       i32* __restrict__ group_done,         // REDUCE 0: [groups] arrival counters (zero at rest)
       u16* __restrict__ out,                // REDUCE 0: [T, H] bf16/fp16
       float* __restrict__ out32) {          // REDUCE 1: [T, HP] fp32 accumulator
    extern __shared__ __align__(16) u8 smem[];
    u16* xs = reinterpret_cast<u16*>(smem);
    float* red = red_buffer<Stage2::BYTES>(smem);
    SlotInfo* si = slot_info<Stage2::BYTES, W2_NS>(smem);
#if REDUCE == 0
    __shared__ int s_last;
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp / KSPLIT, ks = warp % KSPLIT;
    const Range rg = unit_range(range);
    constexpr int NS = HP / 16;                                  // output strips
    constexpr int GROUPS = (NS / W2_NS + WARPS_M - 1) / WARPS_M;
    [[maybe_unused]] constexpr int GROUP_ROWS = WARPS_M * W2_NS * 16;   // rows of a group
    const int items = rg.count * GROUPS;
#if REDUCE == 0
    const int all_units = unit_range(all_range).count;
    if (all_units <= 0) {                                        // every lane was padding
        for (int i = blockIdx.x * THREADS + threadIdx.x; i < tokens * hidden; i += gridDim.x * THREADS)
            out[i] = 0;
        return;
    }
#endif
    // a contiguous range of items: a unit's items follow each other
    const int first = (int)((i64)items * blockIdx.x / gridDim.x);
    const int last = (int)((i64)items * (blockIdx.x + 1) / gridDim.x);
    int staged = -1;                             // unit whose act rows are in xs (one stage)
    for (int item = first; item < last; ++item) {
        const int u = rg.first + item / GROUPS;
        const int grp = item % GROUPS;
        const int p = (grp * WARPS_M + wm) * W2_NS;                // this warp's first strip
        const bool active = p < NS;
        const int count = unit_count[u];
        const int ntiles = (count + 7) >> 3;
        const u8* row = reinterpret_cast<const u8*>(unit_addr[u]);
        Strips<W2_NS> strips;
#pragma unroll
        for (int s = 0; s < W2_NS; ++s) strips.p[s] = row + W2_OFFSET + (i64)(p + s) * W2_STRIP;
        Batch<W2_NS> b;
        {
            int lo, hi;
            warp_chunks(0, Stage2::COLS, ks, lo, hi);
            if (active) load_batch<W2_NS>(b, strips, lo, hi, lane);
        }
        __syncthreads();                                        // previous item done with smem
        auto act_row = [&](int n) -> const u16* {
            const int l = si->lane[n];
            return l >= 0 ? act + (i64)l * IP : nullptr;
        };
        if (Stage2::STAGES > 1 || u != staged) {
            if (threadIdx.x < NT) {
                const int l = threadIdx.x < count ? unit_lanes[u * NT + threadIdx.x] : -1;
                si->lane[threadIdx.x] = l;
                si->scale[threadIdx.x] = 1.0f;
            }
            __syncthreads();
            stage_rows<Stage2::STRIDE>(xs, ntiles, 0, Stage2::COLS, act_row);
            staged = u;
        }
        float acc[W2_NS][NTILES][4] = {};
        item_k_loop<W2_NS, IP, true, Stage2>(b, strips, active, ks, xs, ntiles, acc, lane, act_row);
        ksplit_reduce<W2_NS>(acc, red, wm, ks, lane);
        if (ks == 0 && active) {
            const float gs = reinterpret_cast<const float*>(row)[2] * dequant_unscale<true>();
#pragma unroll
            for (int s = 0; s < W2_NS; ++s)
                w2_epilogue(acc[s], ntiles, si, gs, p + s, lane, lane_w, topk, hidden, REDUCE == 1,
                            yw, out32, reinterpret_cast<const float*>(row + ROW_BIAS_OFFSET)
                                           + 2 * IP + 16 * (p + s));
        }
#if REDUCE == 0
        // The last unit to finish this strip group sums over top-k in fixed order.
        if (last_arrival(group_done + grp, all_units, &s_last))
            topk_sum(grp * GROUP_ROWS, GROUP_ROWS, tokens, topk, hidden, lane_w, yw, out);
#endif
    }
}

// REDUCE 1: out[t, h] = out32[t, h] in the output dtype.
extern "C" __global__ void moe_finish(const float* __restrict__ out32, i32 tokens, i32 hidden,
                                      u16* __restrict__ out) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (i64)tokens * hidden;
         i += (i64)gridDim.x * blockDim.x) {
        const float v = out32[(i / hidden) * HP + i % hidden];
#if OUT_BF16
        out[i] = f32_to_bf16(v);
#else
        out[i] = f32_to_f16(v);
#endif
    }
}
