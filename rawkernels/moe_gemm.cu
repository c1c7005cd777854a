// NVFP4 MoE GEMM: w13 (gate/up) + SiLU(gate)·up, then w2 scaled by the router weight and summed
// over top-k. Weights are read from expert rows in the kernel layout of cupool/layout.py, wherever
// they are (bank row, staging row, or pinned host memory through a UVA address).
//
// Work sketch
// - A *unit* is one expert's weights plus up to NT lanes (a lane = one (token, k) pair) routed to
//   it; the align kernel (moe_align.cu) builds the unit table. An *item* is (unit, group of WARPS_M
//   strips): for w13 a strip is a (gate strip, up strip) pair of 16 rows each, so SiLU·up fuses in
//   registers; for w2 a strip is 16 output rows of H.
// - A block is WARPS_M × KSPLIT warps: WARPS_M warps on different strips of the same unit (they
//   share the activations staged in shared memory), KSPLIT warps splitting K of each strip (decode:
//   one token per unit, so K-splitting is what puts enough loads in flight to fill HBM).
// - Each warp streams its strips in 64-column chunks: one 16-byte load per lane per chunk is four
//   m16n8k16 A fragments (mma_fp4.cuh), dequantized in registers; B fragments (activations, fp16,
//   per-lane power-of-two scaled) come from shared memory. fp32 accumulation.
// - The grid is fixed (persistent blocks); the number of units is read from device memory, so one
//   captured launch serves every routing.
//
// Outputs and invariants
// - moe_w13 writes act[lane, 0:IP] (fp32, SiLU(gate)·up, true scale) for every lane of every unit
//   in its range, and raises amax[lane] (float bits, atomicMax) to max |act| of that lane. The
//   align kernel zeroed amax before; nothing else writes act or amax.
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
#define KC 1024           // activation columns staged in shared memory at a time
#endif
#ifndef NB
#define NB 4              // 64-column chunks in flight per warp before the first is used
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

#define NWARPS (KSPLIT * WARPS_M)
#define THREADS (32 * NWARPS)
#define XS_STRIDE (KC + 8)                 // fp16 per staged row: (KC+8)/2 words ≡ 4 mod 32, so
                                           // the 8 rows × 4 columns of a B fragment hit 32 banks

static_assert(KC % 64 == 0, "KC must be a multiple of 64");

// acc[s][nt] += strip s (16 rows) × staged activations, over 64-column chunks [c_lo, c_hi) of K.
// xs holds staged columns starting at chunk xs_c0. KP is the strip's K (HP or IP).
template <int NS>
struct Strips { const u8* p[NS]; };     // passed by value so the pointers stay in registers

// One batch of NB 64-column chunks of NS strips, held in registers between load and use.
template <int NS>
struct Batch {
    u32x4 w[NS][NB];
    u32 sg[NS][NB], sg8[NS][NB];
};

// Issue every load of chunks [c, min(c+NB, c_hi)) before any is used: HBM (or PCIe) latency is
// paid once per batch, not once per chunk.
template <int NS, int KP>
CUPOOL_DEVICE void load_batch(Batch<NS>& b, const Strips<NS> strip, int c, int c_hi, int lane) {
    const int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        if (c + i < c_hi) {
#pragma unroll
            for (int s = 0; s < NS; ++s) {
                b.w[s][i] = ld_stream16(strip.p[s] + (i64)(c + i) * 512 + lane * 16);
                const u8* sc = strip.p[s] + 8 * KP + (c + i) * 4;
                b.sg[s][i] = ld_u32_nc(sc + g * (KP / 16));
                b.sg8[s][i] = ld_u32_nc(sc + (g + 8) * (KP / 16));
            }
        }
    }
}

// acc[s][nt] += the batch's chunks × staged activations (xs holds columns from chunk xs_c0 on).
template <int NS>
CUPOOL_DEVICE void compute_batch(const Batch<NS>& b, int c, int c_hi, const u16* xs, int xs_c0,
                                 int ntiles, float (&acc)[NS][NTILES][4], int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        if (c + i < c_hi) {
            const u16* xc = xs + (c + i - xs_c0) * 64 + 2 * t;
            u32 a[NS][4][4];
#pragma unroll
            for (int s = 0; s < NS; ++s) dequant_chunk<false>(b.w[s][i], b.sg[s][i], b.sg8[s][i], a[s]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) {
                    if (nt < ntiles) {
                        const u16* p = xc + (nt * 8 + g) * XS_STRIDE + q * 16;
                        const u32 b0 = *reinterpret_cast<const u32*>(p);
                        const u32 b1 = *reinterpret_cast<const u32*>(p + 8);
#pragma unroll
                        for (int s = 0; s < NS; ++s) mma16816<false>(acc[s][nt], a[s][q], b0, b1);
                    }
                }
            }
        }
    }
}

// This warp's 64-column chunks [lo, hi) of the activation chunk [kc0, kc1) of K.
CUPOOL_DEVICE void warp_chunks(int kc0, int kc1, int ks, int& lo, int& hi) {
    const int nch = (kc1 - kc0) >> 6;
    const int per = (nch + KSPLIT - 1) / KSPLIT;
    lo = (kc0 >> 6) + ks * per;
    hi = min(lo + per, kc1 >> 6);
}

// The K loop of one item: stage activations chunk by chunk (stage(kc0, kc1) writes xs and is
// called by every thread between barriers) and multiply. The first weight batch was loaded by
// the caller before the first staging, so its latency overlaps the staging.
template <int NS, int KP, class Stage>
CUPOOL_DEVICE void item_k_loop(Batch<NS>& b, const Strips<NS> strips, bool active, int ks,
                               const u16* xs, int ntiles, float (&acc)[NS][NTILES][4], int lane,
                               Stage stage) {
    for (int kc0 = 0; kc0 < KP; kc0 += KC) {
        const int kc1 = kc0 + KC < KP ? kc0 + KC : KP;
        __syncthreads();                                        // xs free, slot info visible
        stage(kc0, kc1);
        __syncthreads();
        if (active) {
            int lo, hi;
            warp_chunks(kc0, kc1, ks, lo, hi);
            for (int c = lo; c < hi; c += NB) {
                if (kc0 != 0 || c != lo) load_batch<NS, KP>(b, strips, c, hi, lane);
                compute_batch<NS>(b, c, hi, xs, kc0 >> 6, ntiles, acc, lane);
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

// Shared memory: staged activations [NT][XS_STRIDE] fp16, the K-split buffer, and per-slot data.
CUPOOL_DEVICE float* red_buffer(u16* xs) {
    return reinterpret_cast<float*>(xs + NT * XS_STRIDE);
}

CUPOOL_DEVICE SlotInfo* slot_info(u16* xs, int ns) {
    return reinterpret_cast<SlotInfo*>(red_buffer(xs) + (KSPLIT - 1) * WARPS_M * ns * NTILES * 4 * 32);
}

// ------------------------------------------------------------------------------------------
// w13: act[lane, j] = SiLU(gate_j · x) · (up_j · x) for the unit's lanes.
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_w13(const i32* __restrict__ range,        // [2] first unit, end unit of this launch
        const i64* __restrict__ unit_addr,    // [units] row address (device or UVA host)
        const i32* __restrict__ unit_lanes,   // [units, NT] lane ids, -1 empty
        const i32* __restrict__ unit_count,   // [units] lanes in the unit
        const u16* __restrict__ xh,           // [T, HP] fp16 activations, row-scaled
        const float* __restrict__ xscale,     // [T] power-of-two scale of each token row
        i32 topk,                             // K: token of lane = lane / K
        float* __restrict__ act,              // [W, IP]
        u32* __restrict__ amax) {             // [W] max |act| per lane (float bits)
    extern __shared__ __align__(16) u8 smem[];
    u16* xs = reinterpret_cast<u16*>(smem);
    float* red = red_buffer(xs);
    SlotInfo* si = slot_info(xs, 2);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp / KSPLIT, ks = warp % KSPLIT;
    const Range rg = unit_range(range);
    constexpr int NP = IP / 16;                                 // strip pairs per expert
    constexpr int GROUPS = (NP + WARPS_M - 1) / WARPS_M;
    const int items = rg.count * GROUPS;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int u = rg.first + item / GROUPS;
        const int p = (item % GROUPS) * WARPS_M + wm;
        const bool active = p < NP;
        const int count = unit_count[u];
        const int ntiles = (count + 7) >> 3;
        const u8* row = reinterpret_cast<const u8*>(unit_addr[u]);
        Strips<2> strips;
        strips.p[0] = row + 256 + (i64)(2 * p) * W13_STRIP;         // gate rows 16p..16p+15
        strips.p[1] = strips.p[0] + W13_STRIP;                       // up rows, same j

        // First weight batch in flight before anything else: it depends only on unit_addr.
        Batch<2> b;
        {
            int lo, hi;
            warp_chunks(0, KC < HP ? KC : HP, ks, lo, hi);
            if (active) load_batch<2, HP>(b, strips, lo, hi, lane);
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
        float acc[2][NTILES][4] = {};
        // stage xh rows of the unit's tokens, columns [kc0, kc1), 8 fp16 per thread-step
        auto stage = [&](int kc0, int kc1) {
            const int vec_per_row = (kc1 - kc0) >> 3;
            for (int v = threadIdx.x; v < ntiles * 8 * vec_per_row; v += THREADS) {
                const int n = v / vec_per_row, col = kc0 + (v % vec_per_row) * 8;
                const int l = si->lane[n];
                u32x4 val = {0u, 0u, 0u, 0u};
                if (l >= 0) val = *reinterpret_cast<const u32x4*>(xh + (i64)(l / topk) * HP + col);
                *reinterpret_cast<u32x4*>(xs + n * XS_STRIDE + (col - kc0)) = val;
            }
        };
        item_k_loop<2, HP>(b, strips, active, ks, xs, ntiles, acc, lane, stage);
        ksplit_reduce<2>(acc, red, wm, ks, lane);
        if (ks == 0 && active) {
            const float* hdr = reinterpret_cast<const float*>(row);
            w13_epilogue(acc, ntiles, si, hdr[0] * dequant_unscale<false>(),
                         hdr[1] * dequant_unscale<false>(), p, lane, act, amax);
        }
    }
}

// ------------------------------------------------------------------------------------------
// w2: out[t, h] = Σ_k weight(t,k) · (w2_{e(t,k)} · act[t,k])[h]
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_w2(const i32* __restrict__ range,       // this launch's units
       const i32* __restrict__ all_range,   // REDUCE 0: every unit of the call (arrival target)
       const i64* __restrict__ unit_addr,
       const i32* __restrict__ unit_lanes,
       const i32* __restrict__ unit_count,
       const float* __restrict__ act,        // [W, IP]
       const u32* __restrict__ amax,         // [W]
       const float* __restrict__ lane_w,     // [W] router weight per lane (0 for padding)
       i32 topk, i32 tokens, i32 hidden,     // K, T, H
       float* __restrict__ yw,               // REDUCE 0: [W, HP] per-lane outputs
       i32* __restrict__ group_done,         // REDUCE 0: [groups] arrival counters (zero at rest)
       u16* __restrict__ out,                // REDUCE 0: [T, H] bf16/fp16
       float* __restrict__ out32) {          // REDUCE 1: [T, HP] fp32 accumulator
    extern __shared__ __align__(16) u8 smem[];
    u16* xs = reinterpret_cast<u16*>(smem);
    float* red = red_buffer(xs);
    SlotInfo* si = slot_info(xs, 1);
#if REDUCE == 0
    __shared__ int s_last;
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp / KSPLIT, ks = warp % KSPLIT;
    const Range rg = unit_range(range);
    constexpr int NS = HP / 16;                                  // output strips
    constexpr int GROUPS = (NS + WARPS_M - 1) / WARPS_M;
    const int items = rg.count * GROUPS;
#if REDUCE == 0
    const int all_units = unit_range(all_range).count;
    if (all_units <= 0) {                                        // every lane was padding
        for (int i = blockIdx.x * THREADS + threadIdx.x; i < tokens * hidden; i += gridDim.x * THREADS)
            out[i] = 0;
        return;
    }
#endif
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int u = rg.first + item / GROUPS;
        const int grp = item % GROUPS;
        const int p = grp * WARPS_M + wm;
        const bool active = p < NS;
        const int count = unit_count[u];
        const int ntiles = (count + 7) >> 3;
        const u8* row = reinterpret_cast<const u8*>(unit_addr[u]);
        Strips<1> strips;
        strips.p[0] = row + W2_OFFSET + (i64)p * W2_STRIP;
        Batch<1> b;
        {
            int lo, hi;
            warp_chunks(0, KC < IP ? KC : IP, ks, lo, hi);
            if (active) load_batch<1, IP>(b, strips, lo, hi, lane);
        }
        __syncthreads();
        if (threadIdx.x < NT) {
            const int l = threadIdx.x < count ? unit_lanes[u * NT + threadIdx.x] : -1;
            si->lane[threadIdx.x] = l;
            si->scale[threadIdx.x] = l >= 0 ? pow2_scale(__uint_as_float(amax[l])) : 1.0f;
        }
        float acc[1][NTILES][4] = {};
        // stage act rows (fp32) as fp16 divided by the slot's power-of-two scale (exact)
        auto stage = [&](int kc0, int kc1) {
            const int vec_per_row = (kc1 - kc0) >> 2;
            for (int v = threadIdx.x; v < ntiles * 8 * vec_per_row; v += THREADS) {
                const int n = v / vec_per_row, col = kc0 + (v % vec_per_row) * 4;
                const int l = si->lane[n];
                u32 lo = 0u, hi = 0u;
                if (l >= 0) {
                    const u32x4 f = *reinterpret_cast<const u32x4*>(act + (i64)l * IP + col);
                    const float inv = 1.0f / si->scale[n];
                    lo = (u32)f32_to_f16(__uint_as_float(f.x) * inv) |
                         ((u32)f32_to_f16(__uint_as_float(f.y) * inv) << 16);
                    hi = (u32)f32_to_f16(__uint_as_float(f.z) * inv) |
                         ((u32)f32_to_f16(__uint_as_float(f.w) * inv) << 16);
                }
                u32* dst = reinterpret_cast<u32*>(xs + n * XS_STRIDE + (col - kc0));
                dst[0] = lo;
                dst[1] = hi;
            }
        };
        item_k_loop<1, IP>(b, strips, active, ks, xs, ntiles, acc, lane, stage);
        ksplit_reduce<1>(acc, red, wm, ks, lane);
        if (ks == 0 && active)
            w2_epilogue(acc[0], ntiles, si,
                        reinterpret_cast<const float*>(row)[2] * dequant_unscale<false>(), p, lane,
                        lane_w, topk, hidden, REDUCE == 1, yw, out32);
#if REDUCE == 0
        // The last unit to finish this strip group sums over top-k in fixed order.
        if (last_arrival(group_done + grp, all_units, &s_last))
            topk_sum(grp * WARPS_M * 16, WARPS_M * 16, tokens, topk, hidden, lane_w, yw, out);
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
