// What the MoE GEMM kernels share (moe_gemm.cu: prefill; moe_decode.cu: decode): the row layout's
// offsets, cache-hinted loads, the A fragments of one 64-column chunk, the slots of a unit, and the
// epilogues of w13 (biases, activation) and w2 (bias, router weight, sum over top-k).
//
// Include after the configuration macros HP, IP, NT and OUT_BF16 (topk_sum's output dtype), and
// optionally ROW_BIAS (1: rows end with float32 biases, cupool/layout.py), ROW_GATED (0: w13 is
// the up strips alone, experts without a gate; default 1, [gate; up] strip pairs) and ACT /
// ACT_ALPHA / ACT_LIMIT (the activation, cupool/activation.py; ACT 0 is SiLU(gate)·up).
//
// A w13 *act strip* is what one strip of act (16 of its IP columns) is made from: a (gate, up)
// strip pair in gated rows, one up strip in rows without a gate. Both kernels count w13 work in
// act strips (IP / 16 of an expert either way) and multiply W13_SPS strips for each.
#pragma once
#include "common.cuh"
#include "mma_fp4.cuh"

#define NTILES (NT / 8)
#define W13_STRIP (9 * HP)                 // bytes of one 16-row strip of w13 (K = HP)
#define W2_STRIP (9 * IP)                  // bytes of one 16-row strip of w2 (K = IP)
#ifndef ROW_GATED
#define ROW_GATED 1
#endif
#define W13_SPS (ROW_GATED ? 2 : 1)        // w13 strips an act strip is made from
#define W2_OFFSET (256 + W13_SPS * (IP / 16) * W13_STRIP)
#define CHUNK_BYTES 576                    // a 64-column chunk: 512 B of packed codes, 64 B of scales
#define CHUNK_SCALES 512                   // offset of its scale bytes (lane L: bytes 2L, 2L+1)
#define ROW_BIAS_OFFSET (W2_OFFSET + (HP / 16) * W2_STRIP)  // float32 gate[IP], up[IP], down[HP]
#ifndef ROW_BIAS
#define ROW_BIAS 0
#endif
#ifndef ACT
#define ACT 0             // 0: SiLU(gate)·up; 1: clamped SwiGLU (ACT_ALPHA, ACT_LIMIT); 2: ReLU(up)²
#endif
static_assert(ACT == 0 || ACT == 1 || ACT == 2, "ACT: 0 SiLU, 1 clamped SwiGLU, 2 ReLU(up)^2");
static_assert(ROW_GATED == 0 || ROW_GATED == 1, "ROW_GATED: 1 [gate; up] strip pairs, 0 up alone");
static_assert((ACT == 2) == (ROW_GATED == 0),
              "ReLU(up)^2 (ACT 2) is the activation of rows without a gate (ROW_GATED 0), and only it");
static_assert(ROW_GATED || !ROW_BIAS, "rows without a gate carry no biases (cupool/layout.py)");
#ifdef ROW_W2_OFFSET
static_assert(ROW_W2_OFFSET == W2_OFFSET, "w2's offset differs from cupool/layout.py's");
#endif

static_assert(NT % 8 == 0 && NT >= 8, "NT must be a multiple of 8");
static_assert(HP % 64 == 0 && IP % 64 == 0, "HP and IP are padded to 64");

// Four k-tiles of A fragments (fp16, or bf16 with BF) from one lane's 16-byte chunk word and
// its two scale bytes (the 16-bit word at CHUNK_SCALES + 2·lane of the chunk).
template <bool BF>
CUPOOL_DEVICE void dequant_chunk(const u32x4& w, u32 scales, u32 (&a)[4][4]) {
    const u32 s = scale_pair<BF>(scales);
    dequant_tile<BF>(w.x, s, a[0]);
    dequant_tile<BF>(w.y, s, a[1]);
    dequant_tile<BF>(w.z, s, a[2]);
    dequant_tile<BF>(w.w, s, a[3]);
}

// Eight words (16 activations) from a 16-byte aligned address, global or shared (CG: global
// through L2 only, for data other blocks of the launch wrote): a lane's B fragments of one chunk
// and n-tile (layout.py: its 16 columns are contiguous).
template <bool CG = false>
CUPOOL_DEVICE void load_cols16(const u16* p, u32 (&b)[8]) {
    const u32x4 lo = CG ? ld_u32x4_cg(p) : *reinterpret_cast<const u32x4*>(p);
    const u32x4 hi = CG ? ld_u32x4_cg(p + 8) : *reinterpret_cast<const u32x4*>(p + 8);
    b[0] = lo.x; b[1] = lo.y; b[2] = lo.z; b[3] = lo.w;
    b[4] = hi.x; b[5] = hi.y; b[6] = hi.z; b[7] = hi.w;
}

// Lanes of the unit an item works on, with the power-of-two scale of each slot's staged row.
struct SlotInfo {
    i32 lane[NT];      // lane of each slot (-1: empty)
    float scale[NT];   // power-of-two scale of the slot's activation row
};

// f(nt, e, n, l) for each accumulator column this lane holds: m16n8 tile nt (< ntiles, a
// warp-uniform bound, so shuffles inside f are safe), column 2t + e (t = lane % 4), which is
// slot n = 8·nt + 2t + e of the unit, holding lane l (-1: empty slot). acc[..][nt][2·half + e]
// is that column's value in strip row g + 8·half (g = lane / 4).
template <class F>
CUPOOL_DEVICE void for_each_slot(int ntiles, int lane, const SlotInfo* si, F f) {
    const int t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
        if (nt >= ntiles) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int n = nt * 8 + 2 * t + e;
            f(nt, e, n, si->lane[n]);
        }
    }
}

#if ROW_GATED
// The expert's activation of one (gate, up) pair at true scale, biases added (cupool/activation.py).
CUPOOL_DEVICE float expert_act(float gate, float up) {
#if ACT == 0
    return gate / (1.0f + __expf(-gate)) * up;
#else
    const float g = fminf(gate, ACT_LIMIT);
    const float u = fminf(fmaxf(up, -ACT_LIMIT), ACT_LIMIT);
    return (u + 1.0f) * (g / (1.0f + __expf(-ACT_ALPHA * g)));
#endif
}
#else
// The activation of experts without a gate, of up at true scale: ReLU(up)² (ACT 2).
CUPOOL_DEVICE float expert_act_up(float up) {
    const float r = fmaxf(up, 0.0f);
    return r * r;
}
#endif

#if ROW_GATED
// w13 of strip pair p (acc[0] gate, acc[1] up, fp32 sums over all of K; gs_*: the global
// scales times dequant_unscale): act[l, 16p + row] = act(gate + b_gate, up + b_up) at true scale,
// in bf16 (what w2 then multiplies as it is), for every slot's lane l. bias_gate / bias_up: the
// biases of the pair's 16 rows (ROW_BIAS only; shared or global memory).
CUPOOL_DEVICE void w13_epilogue(const float (&acc)[2][NTILES][4], int ntiles, const SlotInfo* si,
                                float gs_gate, float gs_up, int p, int lane, u16* act,
                                const float* bias_gate, const float* bias_up) {
    const int g = lane >> 2;
#if ROW_BIAS
    const float bg[2] = {bias_gate[g], bias_gate[g + 8]}, bu[2] = {bias_up[g], bias_up[g + 8]};
#endif
    for_each_slot(ntiles, lane, si, [&](int nt, int e, int n, int l) {
        if (l < 0) return;
        const float ts = si->scale[n];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float gate = acc[0][nt][2 * half + e] * gs_gate * ts;
            float up = acc[1][nt][2 * half + e] * gs_up * ts;
#if ROW_BIAS
            gate += bg[half];
            up += bu[half];
#endif
            act[(i64)l * IP + p * 16 + g + 8 * half] = f32_to_bf16(expert_act(gate, up));
        }
    });
}
#else
// w13 of up strip p in rows without a gate (acc: fp32 sums over all of K; gs_up: the up global
// scale times dequant_unscale): act[l, 16p + row] = ReLU(up)² at true scale, in bf16, for every
// slot's lane l.
CUPOOL_DEVICE void w13_epilogue_up(const float (&acc)[NTILES][4], int ntiles, const SlotInfo* si,
                                   float gs_up, int p, int lane, u16* act) {
    const int g = lane >> 2;
    for_each_slot(ntiles, lane, si, [&](int nt, int e, int n, int l) {
        if (l < 0) return;
        const float f = gs_up * si->scale[n];
#pragma unroll
        for (int half = 0; half < 2; ++half)
            act[(i64)l * IP + p * 16 + g + 8 * half] =
                f32_to_bf16(expert_act_up(acc[nt][2 * half + e] * f));
    });
}
#endif

// w2 of output strip p (acc: fp32 sums over all of K; gs_down: the global scale times
// dequant_unscale), plus the bias of its 16 rows (bias_down, ROW_BIAS only), times the router
// weight of each lane: yw[l, h] (reduce 0, summed later in fixed order) or atomically into
// out32[token, h] (reduce 1).
CUPOOL_DEVICE void w2_epilogue(const float (&acc)[NTILES][4], int ntiles, const SlotInfo* si,
                               float gs_down, int p, int lane, const float* lane_w, int topk,
                               int hidden, bool reduce_atomic, float* yw, float* out32,
                               const float* bias_down) {
    const int g = lane >> 2;
#if ROW_BIAS
    const float bd[2] = {bias_down[g], bias_down[g + 8]};
#endif
    for_each_slot(ntiles, lane, si, [&](int nt, int e, int n, int l) {
        if (l < 0) return;
#if ROW_BIAS
        const float f = gs_down * si->scale[n];
#else
        const float f = gs_down * si->scale[n] * lane_w[l];
#endif
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int h = p * 16 + g + 8 * half;
            if (h >= hidden) continue;
#if ROW_BIAS
            const float y = (acc[nt][2 * half + e] * f + bd[half]) * lane_w[l];
#else
            const float y = acc[nt][2 * half + e] * f;
#endif
            if (reduce_atomic) atomicAdd(out32 + (i64)(l / topk) * HP + h, y);
            else yw[(i64)l * HP + h] = y;
        }
    });
}

// out[t, h] for rows [h0, h0 + rows) of every token: Σ_k yw[t·K + k, h] in k order (padding lanes,
// whose weight is 0, are skipped). Called by every thread of the block that arrived last.
CUPOOL_DEVICE void topk_sum(int h0, int rows, int tokens, int topk, int hidden,
                            const float* lane_w, const float* yw, u16* out) {
    for (int i = threadIdx.x; i < tokens * rows; i += blockDim.x) {
        const int tk = i / rows, h = h0 + i % rows;
        if (h >= hidden) continue;
        float sum = 0.0f;
        for (int k = 0; k < topk; ++k) {
            const int l = tk * topk + k;
            if (lane_w[l] != 0.0f) sum += ld_f32_cg(yw + (i64)l * HP + h);
        }
#if OUT_BF16
        out[(i64)tk * hidden + h] = f32_to_bf16(sum);
#else
        out[(i64)tk * hidden + h] = f32_to_f16(sum);
#endif
    }
}

// The last of `expected` arrivals on counter *done (one per block, after its stores) resets it
// and returns true in every thread of that block. Called by every thread of the block.
CUPOOL_DEVICE bool last_arrival(i32* done, int expected, int* s_flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *s_flag = atomicAdd(done, 1) == expected - 1;
    __syncthreads();
    const bool last = *s_flag != 0;
    if (last) {
        __threadfence();
        if (threadIdx.x == 0) *done = 0;          // ready for the next call
    }
    return last;
}

struct Range { int first, count; };

CUPOOL_DEVICE Range unit_range(const i32* range) {
    Range r;
    r.first = range[0];
    r.count = range[1] - range[0];
    return r;
}
