// One decode step of a gated delta net (Qwen3-Next's and Qwen3.5's linear-attention layers) for the
// B tokens of a decode step (one a slot), from its in-projection's output to its out-projection's
// input: the short causal convolution with its state, SiLU, the L2 norms of q and k, the gates
// beta and g, the delta rule's update of the recurrent state, its read-out, and the gated RMSNorm.
//
// Names: nk / nv key / value heads (r = nv / nk value heads a key head), DK / DV their dims, C =
// 2·nk·DK + nv·DV convolution channels (every query dim, every key dim, every value dim, in that
// order: transformers' mixed_qkv), KC the convolution's kernel.
//
// Inputs: proj [B, width] bf16, the in-projection GEMV's output, in one of two layouts (GROUPED):
// 1 is Qwen3-Next's, in_proj_qkvz's rows then in_proj_ba's, each by key head — key head j's
// columns j·(2·DK + 2·r·DV) ... hold its query (DK), its key (DK), its r value heads' values (r·DV)
// and their gates z (r·DV); then at column nk·(2·DK + 2·r·DV) + 2·r·j its r heads' b, then their r
// a; 0 is Qwen3.5's, in_proj_qkv, in_proj_z, in_proj_b and in_proj_a one after another (the C
// channels, z [nv·DV], b [nv], a [nv]). conv_state bf16 [S, C, KC] (a slot's last KC inputs of each
// channel, oldest first) and state float32 [S, nv, DK, DV], transformers' cache layouts, updated in
// place; conv_w bf16 [C, KC]; neg_a = −exp(A_log) and dt_bias float32 [nv]; norm_w bf16 [DV] and
// eps, the gated RMSNorm's. Output out bf16 [B, nv·DV].
//
// How blocks split the work: grid (nv, B), block (h, b) takes value head h of token b (the whole
// head: the gated norm reads all DV outputs). Its THREADS threads hold the head's state [DK, DV] in
// registers, thread t the four columns 4·(t % TPR) ... + 3 of rows t / TPR + RG·i (TPR = DV / 4
// threads a row, RG = THREADS / TPR row groups, RPT = DK / RG rows a thread), read before the wait
// for the in-projection (the state is this kernel's own output of the step before), as are the
// convolution windows and weights of the 2·DK + DV channels the block reads: key head h / r's
// query and key, value head h's value. Sums over the DK rows go through shared memory, a row group
// at a time, in the same order in every block.
//
// Rounding follows transformers' torch functions (causal_conv1d_update,
// torch_recurrent_gated_delta_rule, the gated RMSNorm): the convolution's sum in float32, rounded
// to bf16, SiLU in float32, rounded; q and k L2-normalised in float32 (x · rsqrt(Σx² + 1e-6)), q
// then times 1 / √DK; beta = sigmoid(b) rounded to bf16; g = neg_a · softplus(a + dt_bias) in
// float32 (softplus(x) = x above 20, as torch's); the state decays by exp(g); kv = kᵀS; S += k ⊗
// beta·(v − kv); o = qᵀS, rounded to bf16; then n = bf16(o · rsqrt(mean(o²) + eps)), y = bf16(w ·
// n), out = bf16(y · silu(z)) with silu(z) in float32. The sums run in another order than torch's
// and products may fuse with their sums: the state and outputs agree with the reference
// (cupool.reference.dense.delta_decode) to float32 rounding, the outputs' bf16 to a last bit.
//
// Who writes what:
// - pos[b] < 0 marks token b inactive: its blocks wait for the kernel before, write zeros to their
//   head's row of out and return; nothing of its slot is read or written.
// - State rows of (slot, h): block (h, b) alone, after its wait.
// - Convolution states: a value channel's by its head's block. A query or key channel is read by
//   the r blocks of its key head; each takes a ticket on count[b, h / r] (int32 [B, nk], zero at
//   rest) after its window is in registers, and the last to take it writes the key head's new
//   windows and puts the counter back to zero (with r = 1 the block writes them at once).
// - out [b, h·DV ...]: block (h, b).
#include "common.cuh"

#ifndef DK
#define DK 128            // key head dim
#endif
#ifndef DV
#define DV 128            // value head dim
#endif
#ifndef KC
#define KC 4              // the convolution's kernel (positions a window holds)
#endif
#ifndef GROUPED
#define GROUPED 1         // 1: Qwen3-Next's in-projection layout, 0: Qwen3.5's (above)
#endif

#define THREADS 256
#define TPR (DV / 4)                              // threads a state row
#define RG (THREADS / TPR)                        // row groups
#define RPT (DK / RG)                             // state rows a thread
#define NCH (2 * DK + DV)                         // convolution channels a block reads
#define CPT ((NCH + THREADS - 1) / THREADS)       // of them a thread

static_assert(DK == 32 || DK == 64 || DK == 128, "DK: 32, 64 or 128");
static_assert(DV == 32 || DV == 64 || DV == 128, "DV: 32, 64 or 128");
static_assert(RPT >= 1 && RG * RPT == DK, "the row groups must split DK evenly");
static_assert(KC >= 2 && KC <= 8, "KC: 2 to 8");

// Channel i of the block's NCH (query dims, key dims, value dims) of key head kh / value head h:
// its convolution channel ...
CUPOOL_DEVICE int conv_channel(int i, int kh, int h, int nk) {
    return i < DK ? kh * DK + i
         : i < 2 * DK ? nk * DK + kh * DK + (i - DK)
                      : 2 * nk * DK + h * DV + (i - 2 * DK);
}

// ... and its column of proj (j = h % r, value head h's place among its key head's)
CUPOOL_DEVICE int proj_column(int i, int kh, int j, int h, int nk, int r) {
#if GROUPED
    const int base = kh * (2 * DK + 2 * r * DV);
    return i < 2 * DK ? base + i : base + 2 * DK + j * DV + (i - 2 * DK);
#else
    (void)j, (void)r;
    return conv_channel(i, kh, h, nk);
#endif
}

CUPOOL_DEVICE float silu_f32(float x) { return x / (1.0f + expf(-x)); }

CUPOOL_DEVICE float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

extern "C" __global__ void __launch_bounds__(THREADS)
delta_decode(const u16* __restrict__ proj, int width, int nk, const i64* __restrict__ pos,
             const i64* __restrict__ slot_of, u16* conv_state, const u16* __restrict__ conv_w,
             float* state, const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
             const u16* __restrict__ norm_w, float eps, i32* count, u16* __restrict__ out) {
    const int h = blockIdx.x, nv = gridDim.x, b = blockIdx.y, tid = threadIdx.x;
    const int r = nv / nk, kh = h / r, j = h % r;
    const i64 C = 2 * (i64)nk * DK + (i64)nv * DV;
    u16* const orow = out + ((i64)b * nv + h) * DV;
    if (pos[b] < 0) {
        wait_for_producers();
        let_consumers_launch();
        for (int v = tid; v < DV; v += THREADS) orow[v] = 0;
        return;
    }
    const i64 slot = slot_of ? slot_of[b] : (i64)b;

    // --- before the wait: this head's state, the channels' windows and weights ---------------
    float* const S = state + (slot * nv + h) * (i64)DK * DV;
    const int c4 = tid % TPR, rg = tid / TPR;
    float4 s[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
        s[i] = *reinterpret_cast<const float4*>(S + (i64)(rg + RG * i) * DV + 4 * c4);
    u16 win[CPT][KC], wt[CPT][KC];
#pragma unroll
    for (int e = 0; e < CPT; ++e) {
        const int i = tid + e * THREADS;
        if (i < NCH) {
            const i64 ch = conv_channel(i, kh, h, nk);
#pragma unroll
            for (int k = 0; k < KC; ++k) {
                win[e][k] = conv_state[(slot * C + ch) * KC + k];
                wt[e][k] = conv_w[ch * KC + k];
            }
        }
    }
    const float na = neg_a[h], dtb = dt_bias[h];
    wait_for_producers();
    let_consumers_launch();

    __shared__ float sq[DK], sk[DK], sv[DV], sdelta[DV];
    __shared__ float red[RG][DV];
    __shared__ float s_beta, s_decay, s_norm[THREADS / 32];
    __shared__ int s_last;
    const u16* const x = proj + (i64)b * width;

    // --- the convolution over [window[1 ...], x], SiLU ----------------------------------------
    u16 xin[CPT];
#pragma unroll
    for (int e = 0; e < CPT; ++e) {
        const int i = tid + e * THREADS;
        if (i < NCH) {
            xin[e] = x[proj_column(i, kh, j, h, nk, r)];
            float acc = 0.0f;
#pragma unroll
            for (int k = 0; k + 1 < KC; ++k) acc += bf16_to_f32(wt[e][k]) * bf16_to_f32(win[e][k + 1]);
            acc += bf16_to_f32(wt[e][KC - 1]) * bf16_to_f32(xin[e]);
            const float y = round_bf16(silu_f32(round_bf16(acc)));
            if (i < DK) sq[i] = y;
            else if (i < 2 * DK) sk[i - DK] = y;
            else sv[i - 2 * DK] = y;
        }
    }
    if (tid == 64) {              // the gates (a warp that the norms below leave free)
#if GROUPED
        const int col = nk * (2 * DK + 2 * r * DV) + 2 * r * kh + j;
        const float bb = bf16_to_f32(x[col]), aa = bf16_to_f32(x[col + r]);
#else
        const float bb = bf16_to_f32(x[C + (i64)nv * DV + h]);
        const float aa = bf16_to_f32(x[C + (i64)nv * DV + nv + h]);
#endif
        s_beta = round_bf16(1.0f / (1.0f + expf(-bb)));
        const float u = aa + dtb;
        s_decay = expf(na * (u > 20.0f ? u : log1pf(expf(u))));
    }
    __syncthreads();              // q, k, v, the gates; every window read

    // --- the new windows: a value channel's here, a query or key channel's by the last block of
    // its key head to take the ticket ---------------------------------------------------------
    if (r > 1) {
        if (tid == 0) {
            i32* const c = count + (i64)b * nk + kh;
            const int t = atomicAdd(c, 1);
            s_last = t == r - 1;
            if (t == r - 1) *c = 0;
        }
        __syncthreads();
    }
    const bool write_qk = r == 1 || s_last;
#pragma unroll
    for (int e = 0; e < CPT; ++e) {
        const int i = tid + e * THREADS;
        if (i < NCH && (i >= 2 * DK || write_qk)) {
            u16* const w = conv_state + (slot * C + conv_channel(i, kh, h, nk)) * KC;
#pragma unroll
            for (int k = 0; k + 1 < KC; ++k) w[k] = win[e][k + 1];
            w[KC - 1] = xin[e];
        }
    }

    // --- q and k L2-normalised (warps 0 and 1), q / √DK ---------------------------------------
    if (tid < 64) {
        float* const vec = tid < 32 ? sq : sk;
        const int lane = tid & 31;
        float ss = 0.0f;
        for (int d = lane; d < DK; d += 32) ss += vec[d] * vec[d];
        const float inv = rsqrtf(warp_sum(ss) + 1e-6f);
        const float qscale = 1.0f / sqrtf((float)DK);
        for (int d = lane; d < DK; d += 32) {
            const float n = vec[d] * inv;
            vec[d] = tid < 32 ? n * qscale : n;
        }
    }
    __syncthreads();

    // --- decay, kv = kᵀS, delta = beta·(v − kv) ------------------------------------------------
    const float decay = s_decay;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const float kk = sk[rg + RG * i];
        s[i].x *= decay, s[i].y *= decay, s[i].z *= decay, s[i].w *= decay;
        acc[0] += s[i].x * kk, acc[1] += s[i].y * kk, acc[2] += s[i].z * kk, acc[3] += s[i].w * kk;
    }
    *reinterpret_cast<float4*>(&red[rg][4 * c4]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (tid < DV) {
        float kv = 0.0f;
        for (int g = 0; g < RG; ++g) kv += red[g][tid];
        sdelta[tid] = (sv[tid] - kv) * s_beta;
    }
    __syncthreads();

    // --- S += k ⊗ delta, written back; o = qᵀS --------------------------------------------------
    const float4 dl = *reinterpret_cast<const float4*>(&sdelta[4 * c4]);
    acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int row = rg + RG * i;
        const float kk = sk[row], qq = sq[row];
        s[i].x += kk * dl.x, s[i].y += kk * dl.y, s[i].z += kk * dl.z, s[i].w += kk * dl.w;
        acc[0] += s[i].x * qq, acc[1] += s[i].y * qq, acc[2] += s[i].z * qq, acc[3] += s[i].w * qq;
        *reinterpret_cast<float4*>(S + (i64)row * DV + 4 * c4) = s[i];
    }
    *reinterpret_cast<float4*>(&red[rg][4 * c4]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();

    // --- o rounded, the gated RMSNorm (threads v < DV, one a column) ---------------------------
    float o = 0.0f;
    if (tid < DV) {
        for (int g = 0; g < RG; ++g) o += red[g][tid];
        o = round_bf16(o);
    }
    const float sq_sum = warp_sum(tid < DV ? o * o : 0.0f);
    if ((tid & 31) == 0) s_norm[tid / 32] = sq_sum;
    __syncthreads();
    if (tid < DV) {
        float ss = 0.0f;
        for (int w = 0; w < (DV + 31) / 32; ++w) ss += s_norm[w];
        const float n = round_bf16(o * rsqrtf(ss / DV + eps));
        const float y = round_bf16(bf16_to_f32(norm_w[tid]) * n);
#if GROUPED
        const int zcol = kh * (2 * DK + 2 * r * DV) + 2 * DK + r * DV + j * DV + tid;
#else
        const i64 zcol = C + (i64)h * DV + tid;
#endif
        orow[tid] = f32_to_bf16(y * silu_f32(bf16_to_f32(x[zcol])));
    }
}
