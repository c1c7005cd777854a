// Probes: how fast one launch can read the bytes a decode layer reads (n expert rows at
// scattered addresses), as the ceiling moe_decode's layer time is judged against; and what a
// launch costs in a chain of launches that do nothing else (chain_step).
// Benchmarks only (benchmarks/profile_read.py, profile_chain.py); not on any hot path.
//
// read_rows:      plain 16-byte loads; block b reads the b-th contiguous span of the rows' bytes
//                 (UNROLL loads in flight a thread), so the whole grid streams at once.
// read_rows_bulk: copies into shared memory, as moe_decode reads its weights: each warp
//                 takes 4 KiB pieces (piece p = its global warp id + k · all warps), two 2 KiB
//                 bulk copies on one barrier (sm_90+; before sm_90, as moe_decode there, the
//                 lanes' 16-byte cp.async copies, each lane arriving on the barrier), one wait,
//                 then the lanes read the piece back, so only 4 KiB a warp is in flight
//                 (moe_decode: two stages of 2.3 KB).
// Both fold what they read (XOR of every 32-bit word) into one word a block, sink[blockIdx.x], so
// the loads cannot be dropped and a test can check that every byte was read exactly once.
//
// chain_step:     one link of a chain of launches that do nothing else, for the cost of a kernel
//                 boundary in a decode step's graph (benchmarks/profile_chain.py): it waits for
//                 the launch before (when launched as a dependent, common.cuh), lets the next
//                 one start, and block 0's thread 0 reads count[0] and writes it back plus one. A
//                 launch that read before the one before it had written would lose a count.
#include "common.cuh"
#include "async_copy.cuh"

#define UNROLL 8          // read_rows: 16-byte loads in flight a thread
#define PIECE 4096
#define HALF (PIECE / 2)

// sink[blockIdx.x] = XOR of every thread's acc (all threads of the 256-thread block call it).
CUPOOL_DEVICE void block_xor_store(u32 acc, u32* sink) {
    __shared__ u32 part[8];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 v = 0;
        for (int w = 0; w < 8; ++w) v ^= part[w];
        sink[blockIdx.x] = v;
    }
}

// Row and offset of 16-byte vector v of the rows (each row `vpr` vectors long).
CUPOOL_DEVICE const u32x4* vec_at(const i64* addr, u32 v, u32 vpr) {
    const u32 r = v / vpr;
    return reinterpret_cast<const u32x4*>(addr[r]) + (v - r * vpr);
}

extern "C" __global__ void __launch_bounds__(256)
read_rows(const i64* __restrict__ addr,      // [n] row addresses (16-byte aligned)
          i32 n, i32 vpr,                    // rows, 16-byte vectors a row
          u32* __restrict__ sink) {           // [gridDim.x]
    const u32 total = (u32)n * (u32)vpr;
    const u32 per = (total + gridDim.x - 1) / gridDim.x;
    const u32 v0 = blockIdx.x * per, v1 = min(v0 + per, total);
    u32 acc = 0;
    for (u32 v = v0 + threadIdx.x; v < v1; v += UNROLL * blockDim.x) {
        u32x4 w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 vv = v + u * blockDim.x;
            w[u] = vv < v1 ? ld_stream16(vec_at(addr, vv, vpr)) : u32x4{0, 0, 0, 0};
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
    }
    block_xor_store(acc, sink);
}

extern "C" __global__ void __launch_bounds__(256)
read_rows_bulk(const i64* __restrict__ addr, i32 n, i32 row_pieces,   // row bytes / PIECE
               u32* __restrict__ sink) {                              // [gridDim.x]
    __shared__ __align__(128) u8 buf[8][PIECE];
    __shared__ u64 bar[8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 b = smem_addr(&bar[warp]);
    if (lane == 0) {
#if CUPOOL_BULK_COPY
        mbar_init(b, 1);
        fence_proxy_async_smem();
#else
        mbar_init(b, 32);                                    // every lane's copies arrive
#endif
    }
    __syncwarp();
    const int pieces = n * row_pieces, warps = gridDim.x * 8;
    u32 acc = 0, parity = 0;
    for (int p = blockIdx.x * 8 + warp; p < pieces; p += warps) {
        const u8* src = reinterpret_cast<const u8*>(addr[p / row_pieces]) + (i64)(p % row_pieces) * PIECE;
#if CUPOOL_BULK_COPY
        if (lane == 0) {
            fence_proxy_async_smem();
            mbar_arrive_expect(b, PIECE);
            bulk_load(smem_addr(&buf[warp][0]), src, HALF, b);
            bulk_load(smem_addr(&buf[warp][HALF]), src + HALF, HALF, b);
        }
#else
#pragma unroll
        for (int i = 0; i < PIECE / 512; ++i)
            cp_async16(&buf[warp][i * 512 + lane * 16], src + i * 512 + lane * 16);
        cp_async_arrive_noinc(b);
#endif
        mbar_wait(b, parity);
        parity ^= 1u;
#pragma unroll
        for (int i = 0; i < PIECE / 512; ++i) {
            const u32x4 w = *reinterpret_cast<const u32x4*>(&buf[warp][i * 512 + lane * 16]);
            acc ^= w.x ^ w.y ^ w.z ^ w.w;
        }
        __syncwarp();
    }
    block_xor_store(acc, sink);
}

extern "C" __global__ void __launch_bounds__(256) chain_step(i32* count) {
    wait_for_producers();
    let_consumers_launch();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        i32 v;
        asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(count));
        count[0] = v + 1;
    }
}
