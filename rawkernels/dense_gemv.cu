// Decode-step GEMVs of a decoder layer's dense part: y[n, r] = Σ_k W[r, k] · x[n, k] for the
// NB ≤ 16 tokens of a decode step, W a bf16 [N, K] row-major matrix (a torch Linear's weight),
// with the elementwise work around it fused in, so that a layer's dense part is a few launches.
//
// How blocks split the work: a block owns RT tiles of 16 consecutive output rows for every
// token; its WARPS warps split K in chunks of 32 columns (chunk c to warp c mod WARPS). Per chunk
// a lane loads 16 bytes of row g and 16 bytes of row g + 8 of a tile (g = lane / 4, t = lane % 4
// picks the 16 bytes). Read through a fixed permutation of k, applied to W and x alike (a sum over
// k does not care in which order it runs), those 32 bytes are exactly the A fragments of two
// m16n8k16 MMAs, and the B fragments are one 16-byte shared-memory load of x at the same k. The
// MMA's n is the token (8 a tile: NB ≤ 8 one tile, ≤ 16 two). The warps' partial sums meet in
// shared memory and the epilogue writes 16·RT rows × NB tokens.
//
// Why MMAs for a GEMV: the bytes of W are the cost. The MMA takes each lane's 16 loaded bytes as
// they are, with no shuffles for the k reduction, and costs the same for 1 token as for 8 (a
// CUDA-core dot product spends 8 FMAs and a shared-memory read per weight per token).
//
// Why the first weight loads are issued before the prologue: x may depend on a norm over the
// whole row (a chain of dependent loads and a block reduction); W does not, so the first 2·U
// chunks of W (both register buffers) are already in flight while x is being built. Launched as
// a dependent (common.cuh), those loads are issued even before the kernel that writes the input
// has finished: only then does the block wait for it. After that, the two buffers alternate: one
// is multiplied while the other's loads are in flight.
//
// Prologues (x [NB, K] bf16 in shared memory, a tile of KT columns at a time):
//   MODE 0 (plain): x = in
//   MODE 1 (norm):  h = in (+ add) rounded to bf16 (the residual stream's sum), then
//                   x = bf16(nw · bf16(h · rsqrt(mean(h²) + eps))), transformers' RMSNorm with
//                   its two roundings; block 0 (KS > 1: the blocks of tile 0, each its slice)
//                   writes h to h_out and x to x_out where given. Where K is one x tile
//                   (K ≤ KT, KS = 1) the statistics pass keeps h in the tile and the norm's
//                   weights are in shared memory before the wait: h is read once.
//                   NORM1=1: the RMSNorm of Qwen3-Next and Gemma, whose weight is stored as
//                   w − 1: x = bf16((1 + nw) · (h · rsqrt(mean(h²) + eps))), the product in
//                   float32 and one rounding.
//   MODE 2 (GLU):   in is a gated MLP's gate and up GEMV output [NB, 2K + GATE] (its gate
//                   rows, its up rows, with GATE its sigmoid gate's logit), and
//                   x = bf16(bf16(silu(g)) · u), g = in[n, k], u = in[n, K + k]: the
//                   act_fn(gate_proj(x)) * up_proj(x) of transformers' MLPs with SiLU, each op
//                   rounded to bf16 as torch rounds it. The MLP's down projection then needs no
//                   launch of its own for the activation and the product.
// Epilogues:
//   EPI 0: out[n, r] = bf16(acc + bias[r])
//   EPI 1: out[n, r] = bf16(res2[n, r] + bf16(acc + bias[r]))           (o-projection + residual)
//          GATE=1 (MODE 2 only): out[n, r] = bf16(res2[n, r] + bf16(s[n] · bf16(acc + bias[r]))),
//          s[n] = bf16(sigmoid(in[n, 2K])): a shared expert scaled by its sigmoid gate (Qwen2-MoE's,
//          Qwen3-Next's) added to the routed experts' sum (res2), as transformers' block rounds it;
//          without GATE, MODE 2 with EPI 1 adds an ungated shared expert (GLM-4.5's, DeepSeek's).
//   EPI 2: logits[n, r] = bf16(acc) as float (RBIAS=1: bf16(acc + bias[r]), a router with a
//          bias, gpt-oss's); the last block to finish (a ticket counter, put
//          back to zero by that block) routes every token: softmax over the N logits (float32) →
//          top-k (NaN counts as largest, ties go to the lower expert, as a stable descending sort)
//          → divided by their sum when norm_topk → weights (bf16, or float32 with w_f32, as the
//          model's router returns them); ids int32 [NB, topk]; a token
//          whose active[n] is 0 gets ids −1 and weights 0 (padding lanes for the pool).
//          LANE_ADDR=1 (EPI 2 only) also writes lane_addr[n·topk + j] = table[id] (0 for id −1),
//          table int64 [N] the device address of each expert's bank row: the decode GEMM's lane
//          addresses, for a bank that holds every expert at a fixed row (the plan step and row
//          copies then have nothing to do and are not run).
//          SIG=1: a sigmoid router with a correction bias (DeepSeek-V3's, GLM-4.5's, one expert
//          group; route.cuh's route_token_sigmoid): the logits stay float32 (acc, unrounded, as
//          those routers compute them), N ≤ 512, and the bias (float32 [N]) and the scale (the
//          routed_scaling_factor) come as the last two arguments.
//
// NVFP4 weights (WFP4 = 1): each matrix is NVFP4 strips (cupool/layout.py, `dense_strips`: 16
// rows × Kp columns a strip, 64-column chunks of 512 bytes of E2M1 codes and 64 of E4M3 block
// scales, Kp = K rounded up to 64, padding zero), and its global scale a float argument. A chunk
// is then 64 columns: per chunk a lane loads its 16 bytes of codes (rows g and g + 8, columns
// 16t … 16t + 15, four k-tiles) and its two scale bytes, dequantises them to bf16 A fragments
// (mma_fp4.cuh: exact, times 2^-8) and takes its B fragments as two 16-byte shared-memory loads
// of x at those 16 columns. The epilogue multiplies each row's sum by 2^8 · its matrix's global
// scale. A row tile lies in one matrix: n0 and n1 are multiples of 16 (the launcher checks).
// PRE = n > 0 (NVFP4, where a block's K slice is one x tile and a warp has at most n chunks of
// it; the launcher decides, n ≤ 8): one buffer of n chunks holds them all, and they are
// dequantised to A fragments before the wait, as soon as they land, so that after it a chunk
// costs only its MMAs and x loads.
//
// Rows come from up to three matrices (a fused q/k/v projection): output row r is row r of w0 for
// r < n0, row r − n0 of w1 for r < n0 + n1, else row r − n0 − n1 of w2 — the weights are used
// where they lie, no concatenated copy is kept. Biases (bf16) likewise, null where absent.
//
// Split K (KS > 1; KS = 1 is the code without any of this): the grid is tiles × KS blocks, block
// (tile, ks) = (blockIdx.x, blockIdx.y) takes K columns [kb, ke), slice ks of KS of whole chunks
// of 32 (the last slice also takes a partial chunk where K is not whole chunks); its warps split
// the slice as above. A small grid (a router, an o-projection of fewer tiles than SMs) then has
// enough blocks to keep every SM's loads in flight. The norm's statistics are over the whole row,
// so with MODE 1 every block still sums all K columns' squares, then stages only its slice of x.
// Each block writes its sums to partial[ks, n, r] (float32 [KS, NB, N]); the last of a tile's KS
// blocks (a ticket a tile, put back to zero by that block) adds the KS partials in the order
// ks = 0 .. KS − 1 and runs the epilogue. The result does not depend on which block finishes
// last, but its float sums run in another order than KS = 1's, so it may differ from KS = 1's
// by rounding. With EPI 2 the tiles' last blocks are the ones that take the routing ticket.
//
// Who writes what: out / logits rows of a tile are written by one block only (with KS > 1 the
// tile's last block; partial[ks] rows by block (tile, ks)); h_out and x_out by the blocks of
// tile 0 only (every block computes the same h and x for itself; with KS > 1 each writes its
// slice); ids, weights (and lane_addr) by the last block only, after every tile's logits are
// visible (fence, then the ticket).
#include "common.cuh"
#include "route.cuh"

#ifndef NB
#define NB 1              // tokens of the step
#endif
#ifndef MODE
#define MODE 0
#endif
#ifndef EPI
#define EPI 0
#endif
#ifndef WFP4
#define WFP4 0            // weights: 0 bf16 [N, K] row-major, 1 NVFP4 strips (header)
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef RT
#define RT 1              // 16-row tiles a block owns
#endif
#ifndef U                 // chunks a register buffer holds (two buffers: 2·U chunks in flight)
#if PRE
#define U PRE             // one buffer, all of a warp's chunks
#elif WFP4
#define U (RT > 1 ? 4 : 8)   // an NVFP4 chunk is 18 bytes a lane, a bf16 one 32
#else
#define U (RT > 1 ? 2 : 4)
#endif
#endif
#ifndef KS
#define KS 1              // blocks a row tile's K is split over
#endif
#ifndef PRE
#define PRE 0             // NVFP4: chunks a warp dequantises before the wait (0: none; header)
#endif
#ifndef LANE_ADDR
#define LANE_ADDR 0       // the route epilogue also writes the lanes' expert row addresses
#endif
#ifndef RBIAS
#define RBIAS 0           // the route epilogue adds the router's bias to the logits
#endif
#ifndef NORM1
#define NORM1 0           // the norm prologue's weight is stored as w − 1 (header: MODE 1)
#endif
#ifndef GATE
#define GATE 0            // MODE 2, EPI 1: the product scaled by the sigmoid gate in `in` (header)
#endif
#if WFP4
#include "mma_fp4.cuh"
#define CCOLS 64          // columns a chunk: 16 code bytes a lane (four k-tiles)
#define FP4_CHUNK 576     // bytes of a chunk: 512 of codes, then 64 of scales
#else
#define CCOLS 32          // columns a chunk: 16 bytes of row g and of row g + 8 a lane
#endif

#define NT ((NB + 7) / 8)           // MMA n tiles of 8 tokens
#define NBP (NT * 8)                // tokens padded to the tiles (the padding multiplies zeros)
#define KT (2048 / NT)              // x columns staged in shared memory at a time
// A token's row in shared memory is KT + 32 elements: the extra 64 bytes put the 16-byte loads
// of a quarter warp (two token rows, 64 bytes each) on disjoint banks.
// With WFP4 a lane reads 32 bytes (16 columns) of its token's row: rows KT + 40 elements apart
// (80 bytes past a multiple of 128) put a quarter warp's loads (two rows) on disjoint banks.
#if WFP4
#define XSTRIDE (KT + 40)
#else
#define XSTRIDE (KT + 32)
#endif

static_assert(NB >= 1 && NB <= 16, "a decode GEMV takes 1 to 16 tokens");
static_assert(KT % CCOLS == 0, "x tiles are whole chunks");
static_assert(WARPS == 4 || WARPS == 8, "a block of 4 or 8 warps");
static_assert(KS >= 1 && KS <= 16, "K split over 1 to 16 blocks");
static_assert(LANE_ADDR == 0 || EPI == 2, "lane addresses are written by the route epilogue");
static_assert(RBIAS == 0 || EPI == 2, "RBIAS belongs to the route epilogue (the others add biases)");
static_assert(MODE >= 0 && MODE <= 2, "prologue MODE 0 (plain), 1 (norm) or 2 (GLU)");
static_assert(NORM1 == 0 || MODE == 1, "NORM1 belongs to the norm prologue");
static_assert(GATE == 0 || (MODE == 2 && EPI == 1), "GATE belongs to the GLU prologue + residual");
static_assert(PRE == 0 || (WFP4 && PRE <= 8), "PRE dequantises up to 8 NVFP4 chunks a warp");

#if WFP4
struct Rows {
    const u8* w[3];
    const u16* b[3];
    float gs[3];
    i32 n0, n1, K;
    // The strip of row r (its 16-row tile lies in one matrix).
    CUPOOL_DEVICE const u8* row(i32 r) const {
        const i64 strip = (i64)9 * ((K + 63) / 64 * 64);
        if (r < n0) return w[0] + (i64)(r >> 4) * strip;
        if (r < n0 + n1) return w[1] + (i64)((r - n0) >> 4) * strip;
        return w[2] + (i64)((r - n0 - n1) >> 4) * strip;
    }
    CUPOOL_DEVICE float bias(i32 r) const {
        const u16* p = r < n0 ? b[0] : r < n0 + n1 ? b[1] : b[2];
        const i32 i = r < n0 ? r : r < n0 + n1 ? r - n0 : r - n0 - n1;
        return p ? bf16_to_f32(p[i]) : 0.0f;
    }
    // What row r's sum is multiplied by: 2^8 (the fragments' scaling) · its matrix's global scale.
    CUPOOL_DEVICE float scale(i32 r) const {
        return dequant_unscale<true>() * (r < n0 ? gs[0] : r < n0 + n1 ? gs[1] : gs[2]);
    }
};
#else
struct Rows {
    const u16* w[3];
    const u16* b[3];
    i32 n0, n1, K;
    // Row r's weights and (null or) its bias.
    CUPOOL_DEVICE const u16* row(i32 r) const {
        if (r < n0) return w[0] + (i64)r * K;
        if (r < n0 + n1) return w[1] + (i64)(r - n0) * K;
        return w[2] + (i64)(r - n0 - n1) * K;
    }
    CUPOOL_DEVICE float bias(i32 r) const {
        const u16* p = r < n0 ? b[0] : r < n0 + n1 ? b[1] : b[2];
        const i32 i = r < n0 ? r : r < n0 + n1 ? r - n0 : r - n0 - n1;
        return p ? bf16_to_f32(p[i]) : 0.0f;
    }
};
#endif

CUPOOL_DEVICE u32x4 ld_plain16(const void* p) {
    return *reinterpret_cast<const u32x4*>(p);
}

// h = in (+ add), 8 columns at k of token n, rounded to bf16 as torch's bf16 add rounds.
CUPOOL_DEVICE void residual8(const u16* in, const u16* add, i32 K, int n, i32 k, float* h) {
    unpack8(ld_plain16(in + (i64)n * K + k), h);
    if (add) {
        float a[8];
        unpack8(ld_plain16(add + (i64)n * K + k), a);
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = bf16_to_f32(f32_to_bf16(h[i] + a[i]));
    }
}

#if MODE == 2
// x = bf16(bf16(silu(g)) · u), 8 columns at k of token n: g = in[n, k], u = in[n, K + k] of
// in [NB, 2K + GATE] (K a multiple of 8); silu(g) = g / (1 + e^-g) in float32, as torch's silu.
CUPOOL_DEVICE void glu8(const u16* in, i32 K, int n, i32 k, float* x) {
    const u16* row = in + (i64)n * (2 * K + GATE);
    float g[8], u[8];
#if GATE             // rows of an odd width: past the first, not 16-byte aligned
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        g[i] = bf16_to_f32(row[k + i]);
        u[i] = bf16_to_f32(row[K + k + i]);
    }
#else
    unpack8(ld_plain16(row + k), g);
    unpack8(ld_plain16(row + K + k), u);
#endif
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = bf16_to_f32(f32_to_bf16(g[i] / (1.0f + expf(-g[i])))) * u[i];
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
#if WFP4
dense_gemv(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,
           i32 n0, i32 n1, i32 N, i32 K, float gs0, float gs1, float gs2,
#else
dense_gemv(const u16* __restrict__ w0, const u16* __restrict__ w1, const u16* __restrict__ w2,
           i32 n0, i32 n1, i32 N, i32 K,
#endif
           const u16* __restrict__ b0, const u16* __restrict__ b1, const u16* __restrict__ b2,
           const u16* in, const u16* add, const u16* __restrict__ nw, float eps,
           u16* h_out, u16* x_out, const u16* res2, u16* out,
           float* logits, i32* ids, void* wts, i32 topk, i32 norm_topk, i32 w_f32,
           const u8* active, i32* ticket
#if KS > 1
           , float* partial, i32* tile_ticket
#endif
#if LANE_ADDR
           , const i64* __restrict__ table, i64* lane_addr
#endif
#if SIG
           , const float* __restrict__ sbias, float sscale
#endif
           ) {
    // x tiles; after the last tile the warps' partial sums (red), then the routing logits
    __shared__ __align__(16) u16 xs[NBP * XSTRIDE];
    static_assert(sizeof(float) * WARPS * RT * 16 * NBP <= sizeof(u16) * NBP * XSTRIDE,
                  "the partial sums fit where the x tile was");
    float (*red)[RT * 16][NBP] = reinterpret_cast<float (*)[RT * 16][NBP]>(xs);
#if MODE == 1
    __shared__ float rstd[NBP];
#endif
#if EPI == 2
    __shared__ int last;
#endif
#if KS > 1
    __shared__ int tile_last;
    // this block's K slice [kb, ke): whole chunks, split as evenly as chunks allow
#if WFP4
    const i32 k_chunks = (K + CCOLS - 1) / CCOLS;
    const i32 kb = (i32)blockIdx.y * k_chunks / KS * CCOLS;
    const i32 ke = min(K, ((i32)blockIdx.y + 1) * k_chunks / KS * CCOLS);
#else
    const i32 k_chunks = (K + 31) / 32;
    const i32 kb = (i32)blockIdx.y * k_chunks / KS * 32;
    const i32 ke = min(K, ((i32)blockIdx.y + 1) * k_chunks / KS * 32);
#endif
#else
    const i32 kb = 0, ke = K;
#endif

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#if WFP4
    Rows rows{{w0, w1, w2}, {b0, b1, b2}, {gs0, gs1, gs2}, n0, n1, K};
#else
    Rows rows{{w0, w1, w2}, {b0, b1, b2}, n0, n1, K};
#endif
    const i32 r0 = blockIdx.x * (RT * 16);

#if WFP4
    // this lane's part of each row tile's strip (clamped: tiles past N read the last one, never
    // stored): its 16 code bytes and its two scale bytes of each chunk
    const u8* pa[RT];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) pa[rt] = rows.row(min(r0 + rt * 16, N - 1));
#else
    // this lane's two rows of each tile (clamped: rows past N load row N − 1, never stored)
    const u16* pa[RT];
    const u16* pb[RT];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        pa[rt] = rows.row(min(r0 + rt * 16 + g, N - 1)) + t * 8;
        pb[rt] = rows.row(min(r0 + rt * 16 + g + 8, N - 1)) + t * 8;
    }
#endif
    float acc[RT][NT][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.0f;

#if WFP4
    // two register buffers of U chunks: the next U chunks' loads are in flight while the
    // current ones are multiplied (PRE: buffer a alone); lo: the codes, hi: the scale pair (low
    // 16 bits)
    u32x4 a_lo[U][RT];
    u32 a_hi[U][RT];
#if !PRE
    u32x4 b_lo[U][RT];
    u32 b_hi[U][RT];
#endif
    const u32x4 zero{0u, 0u, 0u, 0u};
    // the loads of U chunks starting at chunk c0 (chunks c0, c0 + WARPS, ...) of the tile at k0
    auto load = [&](u32x4 (&lo)[U][RT], u32 (&hi)[U][RT], i32 k0, i32 c0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i32 k = k0 + (c0 + u * WARPS) * CCOLS;
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const bool ok = k < ke && k < k0 + KT;
                const u8* chunk = pa[rt] + (i64)(k / CCOLS) * FP4_CHUNK;
                lo[u][rt] = ok ? ld_stream16(chunk + lane * 16) : zero;
                hi[u][rt] = ok ? ld_u16_nc(chunk + 512 + 2 * lane) : 0u;
            }
        }
    };
    // chunk u of a buffer -> A fragments of its four k-tiles, each row tile's
    auto dequant = [&](const u32x4 (&lo)[U][RT], const u32 (&hi)[U][RT], int u,
                       u32 (&a)[RT][4][4]) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const u32 sc = scale_pair<true>(hi[u][rt]);
            dequant_tile<true>(lo[u][rt].x, sc, a[rt][0]);
            dequant_tile<true>(lo[u][rt].y, sc, a[rt][1]);
            dequant_tile<true>(lo[u][rt].z, sc, a[rt][2]);
            dequant_tile<true>(lo[u][rt].w, sc, a[rt][3]);
        }
    };
    // the MMAs of one chunk whose x columns start at col
    auto mma_chunk = [&](const u32 (&a)[RT][4][4], int col) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u16* xr = &xs[(nt * 8 + g) * XSTRIDE + col];
            const u32x4 x0 = *reinterpret_cast<const u32x4*>(xr);
            const u32x4 x1 = *reinterpret_cast<const u32x4*>(xr + 8);
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                mma16816<true>(acc[rt][nt], a[rt][0], x0.x, x0.y);
                mma16816<true>(acc[rt][nt], a[rt][1], x0.z, x0.w);
                mma16816<true>(acc[rt][nt], a[rt][2], x1.x, x1.y);
                mma16816<true>(acc[rt][nt], a[rt][3], x1.z, x1.w);
            }
        }
    };
#if !PRE
    // the buffer's chunks c0, c0 + WARPS, ... below `chunks` (the tile's; the same for every
    // lane, so past the slice's end no zero chunk is multiplied)
    auto multiply = [&](u32x4 (&lo)[U][RT], u32 (&hi)[U][RT], i32 c0, i32 chunks) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c0 + u * WARPS >= chunks) break;
            u32 a[RT][4][4];
            dequant(lo, hi, u, a);
            mma_chunk(a, (c0 + u * WARPS) * CCOLS + t * 16);
        }
    };
#endif
#else
    // two register buffers of U chunks: the next U chunks' loads are in flight while the
    // current ones are multiplied
    u32x4 a_lo[U][RT], a_hi[U][RT], b_lo[U][RT], b_hi[U][RT];
    const u32x4 zero{0u, 0u, 0u, 0u};
    // the loads of U chunks starting at chunk c0 (chunks c0, c0 + WARPS, ...) of the tile at k0;
    // lo: rows g, hi: rows g + 8 of each row tile
    auto load = [&](u32x4 (&lo)[U][RT], u32x4 (&hi)[U][RT], i32 k0, i32 c0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i32 k = k0 + (c0 + u * WARPS) * 32;
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const bool ok = k + t * 8 < ke && k < k0 + KT;
                lo[u][rt] = ok ? ld_stream16(pa[rt] + k) : zero;
                hi[u][rt] = ok ? ld_stream16(pb[rt] + k) : zero;
            }
        }
    };
    // (the tile's `chunks` is the NVFP4 build's bound; here the loop stops at the x tile's end,
    // and past the slice's end the buffers hold zeros)
    auto multiply = [&](u32x4 (&lo)[U][RT], u32x4 (&hi)[U][RT], i32 c0, i32 /*chunks*/) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int col = (c0 + u * WARPS) * 32 + t * 8;
            if (col >= KT) break;                 // the same for every lane: KT is whole chunks
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const u32x4 x = *reinterpret_cast<const u32x4*>(&xs[(nt * 8 + g) * XSTRIDE + col]);
#pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    const u32 a0[4] = {lo[u][rt].x, hi[u][rt].x, lo[u][rt].y, hi[u][rt].y};
                    const u32 a1[4] = {lo[u][rt].z, hi[u][rt].z, lo[u][rt].w, hi[u][rt].w};
                    mma16816<true>(acc[rt][nt], a0, x.x, x.y);
                    mma16816<true>(acc[rt][nt], a1, x.z, x.w);
                }
            }
        }
    };

#endif

    // both buffers' first chunks of the first x tile: only weights, so before the wait
    const i32 chunks0 = min((i32)KT, ke - kb) / CCOLS + ((min((i32)KT, ke - kb) % CCOLS) != 0);
    load(a_lo, a_hi, kb, warp);
#if !PRE
    if (warp + WARPS * U < chunks0) load(b_lo, b_hi, kb, warp + WARPS * U);
#endif
#if MODE == 1
    // One x tile (K ≤ KT, no split): the norm's statistics pass keeps h in the x tile and the
    // staging reads it there, and the norm's weights are in shared memory before the wait, so
    // after the wait h is read from global memory once. Otherwise the norm's weights are read
    // while each tile is staged: bring this slice's to L2 now.
    const bool one_tile = KS == 1 && K <= KT;
    __shared__ __align__(16) u16 nws[KT];
    if (one_tile) {                      // plain loads (cp.async measured no faster)
        for (i32 k = threadIdx.x * 8; k < K; k += WARPS * 32 * 8)
            *reinterpret_cast<u32x4*>(&nws[k]) = ld_plain16(nw + k);
    } else {
        for (i32 k = kb + threadIdx.x * 64; k < ke; k += WARPS * 32 * 64) prefetch_l2(nw + k);
    }
#endif
#if PRE
    // every chunk of this warp's slice is in buffer a: its fragments, as the loads land
    u32 fa[U][RT][4][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (warp + u * WARPS >= chunks0) break;
        dequant(a_lo, a_hi, u, fa[u]);
    }
#endif
#if LANE_ADDR
    // the last block reads the lanes' row addresses from the table right after the top-k
    for (i32 i = threadIdx.x * 16; i < N; i += WARPS * 32 * 16) prefetch_l2(table + i);
#endif
    // in, add and res2 are the kernel before's output; every write below comes after this
    wait_for_producers();
    let_consumers_launch();

#if MODE == 1
    // rstd of every token: the whole block sums each token's squares (every thread's loads of
    // all NB tokens in flight at once), then one sum a token across the warps
    {
        __shared__ float part[WARPS][NB];
        float ss[NB];
#pragma unroll
        for (int n = 0; n < NB; ++n) ss[n] = 0.0f;
        for (i32 k = threadIdx.x * 8; k < K; k += WARPS * 32 * 8) {
#pragma unroll
            for (int n = 0; n < NB; ++n) {
                float h[8];
                residual8(in, add, K, n, k, h);
#pragma unroll
                for (int i = 0; i < 8; ++i) ss[n] += h[i] * h[i];
                if (one_tile) *reinterpret_cast<u32x4*>(&xs[n * XSTRIDE + k]) = pack8(h);
            }
        }
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            const float v = warp_sum(ss[n]);
            if (lane == 0) part[warp][n] = v;
        }
        __syncthreads();
        if (threadIdx.x < NB) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) v += part[w][threadIdx.x];
            rstd[threadIdx.x] = rsqrtf(v / (float)K + eps);
        }
        __syncthreads();
    }
#endif

    for (i32 k0 = kb; k0 < ke; k0 += KT) {
        // stage x[:, k0 : k0 + KT]
        if (k0 > kb) __syncthreads();            // every warp is done with the previous tile
        for (int i = threadIdx.x; i < NBP * (KT / 8); i += WARPS * 32) {
            const int n = i / (KT / 8);
            const i32 k = k0 + (i % (KT / 8)) * 8;
            u32x4 v = zero;
            if (n < NB && k < ke) {
#if MODE == 1
                float h[8], x[8], w[8];
                if (one_tile) {                  // h as the statistics pass left it (bf16)
                    unpack8(*reinterpret_cast<const u32x4*>(&xs[n * XSTRIDE + k]), h);
                    unpack8(*reinterpret_cast<const u32x4*>(&nws[k]), w);
                } else {
                    residual8(in, add, K, n, k, h);
                    unpack8(ld_plain16(nw + k), w);
                }
                const float r = rstd[n];
#if NORM1
                // (1 + w) times the normalised h in float32: pack8 is the one rounding
#pragma unroll
                for (int j = 0; j < 8; ++j) x[j] = (1.0f + w[j]) * (h[j] * r);
#else
#pragma unroll
                for (int j = 0; j < 8; ++j) x[j] = w[j] * bf16_to_f32(f32_to_bf16(h[j] * r));
#endif
                v = pack8(x);
                if (blockIdx.x == 0) {
                    if (h_out && add) st16(h_out + (i64)n * K + k, pack8(h));
                    if (x_out) st16(x_out + (i64)n * K + k, v);
                }
#elif MODE == 2
                float x[8];
                glu8(in, K, n, k, x);
                v = pack8(x);
#else
                v = ld_plain16(in + (i64)n * K + k);
#endif
            }
            *reinterpret_cast<u32x4*>(&xs[n * XSTRIDE + (k - k0)]) = v;
        }
        __syncthreads();
        const i32 chunks = min((i32)KT, ke - k0) / CCOLS + ((min((i32)KT, ke - k0) % CCOLS) != 0);
#if PRE
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (warp + u * WARPS >= chunks) break;
            mma_chunk(fa[u], (warp + u * WARPS) * CCOLS + t * 16);
        }
#else
        if (k0 > kb) load(a_lo, a_hi, k0, warp);
        for (i32 c0 = warp; c0 < chunks; c0 += 2 * WARPS * U) {
            const i32 c1 = c0 + WARPS * U;
            if (c1 < chunks && (k0 > kb || c0 != warp)) load(b_lo, b_hi, k0, c1);  // else loaded
            multiply(a_lo, a_hi, c0, chunks);
            if (c1 < chunks) {
                if (c1 + WARPS * U < chunks) load(a_lo, a_hi, k0, c1 + WARPS * U);
                multiply(b_lo, b_hi, c1, chunks);
            }
        }
#endif
    }

    // partial sums of the warps → shared memory (over the x tile) → one sum per (row, token)
    __syncthreads();
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            red[warp][rt * 16 + g][nt * 8 + 2 * t] = acc[rt][nt][0];
            red[warp][rt * 16 + g][nt * 8 + 2 * t + 1] = acc[rt][nt][1];
            red[warp][rt * 16 + g + 8][nt * 8 + 2 * t] = acc[rt][nt][2];
            red[warp][rt * 16 + g + 8][nt * 8 + 2 * t + 1] = acc[rt][nt][3];
        }
    __syncthreads();
#if KS > 1
    // this block's sums → partial[ks]; the tile's last block adds the KS of them in ks order
    for (int i = threadIdx.x; i < RT * 16 * NB; i += WARPS * 32) {
        const int row = i / NB, n = i % NB;
        const i32 r = r0 + row;
        if (r >= N) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += red[w][row][n];
        partial[((i64)blockIdx.y * NB + n) * N + r] = s;
    }
    __threadfence();                             // this block's partials, before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        tile_last = atomicAdd(tile_ticket + blockIdx.x, 1) == KS - 1;
        if (tile_last) tile_ticket[blockIdx.x] = 0;      // ready for the next launch
    }
    __syncthreads();
    if (!tile_last) return;
    __threadfence();
#endif
    for (int i = threadIdx.x; i < RT * 16 * NB; i += WARPS * 32) {
        const int row = i / NB, n = i % NB;
        const i32 r = r0 + row;
        if (r >= N) continue;
        float s = 0.0f;
#if KS > 1
#pragma unroll
        for (int j = 0; j < KS; ++j) s += ld_f32_cg(partial + ((i64)j * NB + n) * N + r);
#else
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += red[w][row][n];
#endif
#if WFP4
        s *= rows.scale(r);
#endif
#if EPI == 2 && RBIAS
        logits[(i64)n * N + r] = bf16_to_f32(f32_to_bf16(s + rows.bias(r)));
#elif EPI == 2 && SIG
        logits[(i64)n * N + r] = s;               // a sigmoid router's logits stay float32
#elif EPI == 2
        logits[(i64)n * N + r] = bf16_to_f32(f32_to_bf16(s));
#else
        float y = bf16_to_f32(f32_to_bf16(s + rows.bias(r)));
#if EPI == 1
#if GATE
        // the gate's logit: the last column of token n's row of in; sigmoid as torch's, rounded
        const float gl = bf16_to_f32(in[(i64)n * (2 * K + 1) + 2 * K]);
        y = bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(1.0f / (1.0f + expf(-gl)))) * y));
#endif
        y += bf16_to_f32(res2[(i64)n * N + r]);
#endif
        out[(i64)n * N + r] = f32_to_bf16(y);
#endif
    }

#if EPI == 2
    // with KS > 1 only the tiles' last blocks get here: gridDim.x of them take the ticket
    __threadfence();                             // this block's logits, before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
        if (last) *ticket = 0;                   // ready for the next launch (graph replay)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // one warp a token, up to WARPS tokens at a time (WARPS · N floats fit over the x tile:
    // checked by the launcher)
    float* lg = reinterpret_cast<float*>(xs);
    for (int n0 = 0; n0 < NB; n0 += WARPS) {
        __syncthreads();
        const int nn = min(WARPS, NB - n0);
        for (i32 i = threadIdx.x; i < nn * N; i += WARPS * 32)
            lg[i] = ld_f32_cg(logits + (i64)n0 * N + i);
        __syncthreads();
        const int n = n0 + warp;
        if (warp < nn) {
            const bool on = active == nullptr || active[n] != 0;
            u8* w = static_cast<u8*>(wts) + (i64)n * topk * (w_f32 ? 4 : 2);
#if LANE_ADDR
            const i64* tab = table;
            i64* la = lane_addr + n * topk;
#else
            const i64* tab = nullptr;
            i64* la = nullptr;
#endif
#if SIG
            route_token_sigmoid<LANE_ADDR>(lg + warp * N, N, topk, norm_topk, on, ids + n * topk,
                                           w, w_f32, tab, la, sbias, sscale);
#else
            route_token<LANE_ADDR>(lg + warp * N, N, topk, norm_topk, on, ids + n * topk, w,
                                   w_f32, tab, la);
#endif
        }
    }
#endif
}
