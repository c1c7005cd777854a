// Align + remap for the MoE GEMM (moe_gemm.cu): lanes grouped by expert into units of at most NT
// lanes, each unit with the address of its expert's weights; activations brought to fp16.
//
// - route_decode (decode, W ≤ 1024, align_block + prep of every token): lanes arrive with the
//   address the plan step gave them (bank row, staging row, or a host UVA address; 0 = padding)
//   and, optionally, the plan step's lane_fresh (1: the row is being copied in this step). Lanes
//   with the same address are one expert. Units of rows already in place come first, then units
//   of fresh rows, each part in first-occurrence order; lanes keep lane order within a unit.
//   range[5] = {0, Uh, U, 0, U}: &range[0] is the in-place units' range, &range[1] the fresh
//   ones', &range[3] all of them (the GEMM runs the first part while the copies land).
//   One block, O(W²/threads) comparisons in shared memory (W is small in decode).
// - align_experts (prefill, any W, E ≤ 1024): lanes arrive with expert ids. Experts whose weights
//   are on the GPU (expert_addr[e] ≠ 0) form phase 0; the others are routed through scratch rows
//   in chunks of C experts (phase 1 + chunk), each with a copy list for the row-copy kernel, so
//   every non-resident expert crosses PCIe once per call. Chunk c uses scratch buffer c % nbuf
//   (rows [b·C, b·C + C)), so the launcher can copy the next chunks while the GEMM reads one. Units are ordered by (phase, expert);
//   lane order within an expert is not fixed (atomics), which only reorders a sum.
//   The ALL_HOST build ranks and copies every non-resident expert, with lanes or not, so the
//   copy lists (copies, n_copies) depend on expert_addr alone, not on the routing: run with
//   W = 0 it writes a layer's lists before that layer's router has run (the launcher's prefill
//   ahead), and the layer's own call with its lanes writes the same lists. An expert without
//   lanes still has no units: its copy is the price of a routing-free list, which pays only
//   where a call routes to nearly every expert anyway.
// - prep_x: per token (one warp each), a power-of-two scale s and fp16 x/s (exact for bf16 inputs),
//   padded to HP; route_decode runs the same prep_row.
//
// Both align kernels write lane_w[W] (router weight, 0 for padding and for rejected lanes) and
// set sticky bits in `error`: 1 = expert id outside [0, E) (align_experts), 2 = non-finite router
// weight. A rejected lane is treated as padding and reads nothing.

#ifndef NT
#define NT 16
#endif
#ifndef HP
#define HP 2048
#endif
#ifndef IN_BF16
#define IN_BF16 1
#endif
#ifndef IDS64
#define IDS64 1
#endif
#include "moe_lanes.cuh"

#ifndef ALL_HOST
#define ALL_HOST 0        // 1: every non-resident expert gets a host rank and a copy (see above)
#endif

#ifndef XVEC
#define XVEC 0            // 1: H % 8 == 0 and x 16-byte aligned (the launcher checks)
#endif
#define XLOADS 8          // 16-byte loads in flight per lane: a 2048-wide row in one round trip

CUPOOL_DEVICE float in_to_f32(u16 h) {
#if IN_BF16
    return bf16_to_f32(h);
#else
    return f16_to_f32(h);
#endif
}

// One warp brings token row t to fp16: xh[t] = x[t] / s, s = pow2_scale(max |x[t]|), zero-padded
// to HP. With XVEC the row is read in 16-byte words, XLOADS per lane in flight, twice (the second
// pass hits L1).
CUPOOL_DEVICE void prep_row(const u16* __restrict__ row, i32 H, u16* __restrict__ out,
                            float* __restrict__ scale, int lane) {
    float m = 0.0f;
#if XVEC
    for (int k0 = lane * 8; k0 < H; k0 += 32 * 8 * XLOADS) {
        u32x4 v[XLOADS];
#pragma unroll
        for (int j = 0; j < XLOADS; ++j) {
            const int k = k0 + j * 256;
            v[j] = k < H ? *reinterpret_cast<const u32x4*>(row + k) : u32x4{0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int j = 0; j < XLOADS; ++j) {
            const u32 words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                m = nan_max(m, fabsf(in_to_f32((u16)(words[q] & 0xffffu))));
                m = nan_max(m, fabsf(in_to_f32((u16)(words[q] >> 16))));
            }
        }
    }
#else
    for (int k = lane; k < H; k += 32) m = nan_max(m, fabsf(in_to_f32(row[k])));
#endif
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = pow2_scale(m), inv = 1.0f / s;
#if XVEC
    for (int k = lane * 8; k < HP; k += 256) {
        u32x4 v = {0u, 0u, 0u, 0u};
        if (k < H) v = *reinterpret_cast<const u32x4*>(row + k);
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 lo = f32_to_f16(in_to_f32((u16)(words[q] & 0xffffu)) * inv);
            const u32 hi = f32_to_f16(in_to_f32((u16)(words[q] >> 16)) * inv);
            words[q] = lo | (hi << 16);
        }
        *reinterpret_cast<u32x4*>(out + k) = u32x4{words[0], words[1], words[2], words[3]};
    }
#else
    for (int k = lane; k < HP; k += 32) out[k] = f32_to_f16(k < H ? in_to_f32(row[k]) * inv : 0.0f);
#endif
    if (lane == 0) *scale = s;
}

// Decode grouping into global unit tables (route_decode): group_lanes and range[5] =
// {0, Uh, U, 0, U}: &range[0] the in-place units, &range[1] the fresh ones, &range[3] all of them
// (the GEMM runs the first part while the copies land).
CUPOOL_DEVICE void align_block(const i64* __restrict__ lane_addr, const i32* __restrict__ lane_fresh,
                               const void* __restrict__ topk_w, i32 W, i32* __restrict__ range,
                               i64* __restrict__ unit_addr, i32* __restrict__ unit_lanes,
                               i32* __restrict__ unit_count, float* __restrict__ lane_w,
                               i32* __restrict__ error) {
    __shared__ i64 s_addr[1024];
    __shared__ int s_base[1024];
    __shared__ int scan[33];
    int held, total;
    group_lanes(lane_addr, lane_fresh, topk_w, W, s_addr, s_base, scan, lane_w, unit_addr,
                unit_lanes, unit_count, &held, &total, error, true);
    if (threadIdx.x == 0) {
        range[0] = 0;
        range[1] = held;
        range[2] = total;
        range[3] = 0;
        range[4] = total;
    }
}

// Decode: align_block and the activation prep of every token in one launch (one block): each warp
// converts tokens w, w+32, ... while the block groups lanes. Saves a launch and its latency.
extern "C" __global__ void __launch_bounds__(1024)
route_decode(const u16* __restrict__ x, i32 T, i32 H,
             u16* __restrict__ xh, float* __restrict__ xscale,
             const i64* __restrict__ lane_addr, const i32* __restrict__ lane_fresh,
             const void* __restrict__ topk_w, i32 W,
             i32* __restrict__ range, i64* __restrict__ unit_addr, i32* __restrict__ unit_lanes,
             i32* __restrict__ unit_count, float* __restrict__ lane_w, i32* __restrict__ error) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int t = warp; t < T; t += blockDim.x >> 5)
        prep_row(x + (i64)t * H, H, xh + (i64)t * HP, xscale + t, lane);
    align_block(lane_addr, lane_fresh, topk_w, W, range, unit_addr, unit_lanes, unit_count, lane_w,
                error);
}

extern "C" __global__ void __launch_bounds__(1024)
align_experts(const void* __restrict__ ids_raw,    // [W] int64 (IDS64) or int32 expert ids, -1 pad
              const void* __restrict__ topk_w,     // [W] W_DTYPE
              i32 W, i32 E, i32 layer,
              const i64* __restrict__ expert_addr, // [E] device address of resident experts, else 0
              i64 scratch_base, i64 scratch_stride, i32 C, i32 nbuf, i32 nchunks,
              i32* __restrict__ phase_off,         // [2 + nchunks] out: unit offsets per phase
              i64* __restrict__ unit_addr,         // [units max] out
              i32* __restrict__ unit_lanes,        // [units max, NT] out
              i32* __restrict__ unit_count,        // [units max] out
              float* __restrict__ lane_w,          // [W] out
              i32* __restrict__ lane_e,            // [W] workspace: expert of each lane or -1
              i32* __restrict__ copies,            // [nchunks * C, 2] out: (key, scratch row)
              i32* __restrict__ n_copies,          // [nchunks] out
              i32* __restrict__ error) {
    __shared__ int hist[1024], cursor[1024], ubase[1024];
    __shared__ i64 addr[1024];
    __shared__ int scan[33];
    const int tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x) { hist[e] = 0; cursor[e] = 0; }
    __syncthreads();
    for (int l = tid; l < W; l += blockDim.x) {
#if IDS64
        const i64 id = reinterpret_cast<const i64*>(ids_raw)[l];
#else
        const i64 id = reinterpret_cast<const i32*>(ids_raw)[l];
#endif
        const float w = load_weight(topk_w, l);
        bool ok = id >= 0 && id < E;
        if (id != -1 && !ok) atomicOr(error, ERR_BAD_ID);
        if (ok && !finite(w)) { atomicOr(error, ERR_BAD_WEIGHT); ok = false; }
        lane_w[l] = ok ? w : 0.0f;
        lane_e[l] = ok ? (int)id : -1;
        if (ok) atomicAdd(&hist[id], 1);
    }
    __syncthreads();
    // one expert per thread (E ≤ blockDim.x): units, residency, host rank
    const int e = tid;
    const int h = e < E ? hist[e] : 0;
    const bool resident = e < E && expert_addr[e] != 0;
    const int nu = (h + NT - 1) / NT;
    int total_res, n_host, total_host_units;
    const int res_base = block_exclusive_scan(resident ? nu : 0, scan, &total_res);
#if ALL_HOST
    const bool host = e < E && !resident;                        // copied with lanes or not
#else
    const bool host = !resident && h > 0;
#endif
    const int hrank = block_exclusive_scan(host ? 1 : 0, scan, &n_host);
    const int host_base = block_exclusive_scan(resident ? 0 : nu, scan, &total_host_units);
    const int total = total_res + total_host_units;
    for (int c = tid; c < nchunks + 2; c += blockDim.x)
        phase_off[c] = c == 0 ? 0 : total;                       // empty chunks start at the end
    for (int c = tid; c < nchunks; c += blockDim.x)
        n_copies[c] = max(0, min(C, n_host - c * C));
    __syncthreads();
    if (tid == 0) phase_off[1] = total_res;
    if (e < E && (h > 0 || host)) {
        if (resident) {
            ubase[e] = res_base;
            addr[e] = expert_addr[e];
        } else {
            ubase[e] = total_res + host_base;
            const int chunk = hrank / C, row = hrank % C + (chunk % nbuf) * C;
            addr[e] = scratch_base + scratch_stride * row;
            if (hrank % C == 0 && chunk > 0) phase_off[1 + chunk] = total_res + host_base;
            if (chunk < nchunks) {
                copies[2 * hrank] = layer * E + e;
                copies[2 * hrank + 1] = row;
            }
        }
    }
    if (n_host > nchunks * C && tid == 0) atomicOr(error, 4);    // launcher sized chunks wrong
    __syncthreads();
    for (int l = tid; l < W; l += blockDim.x) {
        const int ex = lane_e[l];
        if (ex < 0) continue;
        const int pos = atomicAdd(&cursor[ex], 1);
        const int u = ubase[ex] + pos / NT, slot = pos % NT;
        unit_lanes[u * NT + slot] = l;
        if (slot == 0) {
            unit_addr[u] = addr[ex];
            unit_count[u] = min(NT, hist[ex] - (pos / NT) * NT);
        }
    }
}

// Prefill: one warp per token, grid = ceil(T / 8) blocks of 256 threads (prep_row).
extern "C" __global__ void __launch_bounds__(256)
prep_x(const u16* __restrict__ x, i32 T, i32 H, u16* __restrict__ xh, float* __restrict__ xscale) {
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (t < T) prep_row(x + (i64)t * H, H, xh + (i64)t * HP, xscale + t, threadIdx.x & 31);
}
