// Row copies from the host store (pinned, read through UVA pointers) into GPU rows.
//
// Work sketch: a fixed grid (chosen at build time, never from data) walks the copy list that the
// plan step wrote. The list's length is read from device memory, so an empty list costs only the
// launch, and the same launch can be captured once in a CUDA graph and replayed with any list.
// Every block takes the same contiguous slice [lo, hi) of every listed row. The block's work is
// the flattened (copy, unit) range, so a thread keeps UNROLL 16-byte host loads in flight even
// when its slice of one row is a single load (small rows, big grids): a PCIe read is ~1-2 us of
// latency and the link only fills when about (bandwidth x latency) bytes are outstanding. The
// list is read in chunks of CHUNK entries into shared memory (source and destination addresses),
// so the loads of the copy itself do not wait on dependent list reads.
//
// Invariants: the copy list holds (key, row) pairs; `src_of_key[key]` is the UVA address of the
// key's row in the host store (written once at build time); `row` indexes the bank + staging rows
// of `row_stride` bytes at `dst_base`. Rows are 256-byte aligned and `row_bytes` is a multiple of
// 16. The kernel never writes the host store and never reads past `row_bytes` of any row.
#include "common.cuh"

#ifndef UNROLL
#define UNROLL 8
#endif
#define CHUNK 256

extern "C" __global__ void copy_rows(const i64* __restrict__ src_of_key,  // [L*E] UVA addresses
                                     const i32* __restrict__ copies,      // [max_copies, 2]
                                     const i32* __restrict__ n_copies,    // [1]
                                     u8* __restrict__ dst_base,           // rows of row_stride
                                     i64 row_stride, i64 row_bytes, i32 max_copies) {
    __shared__ const u8* s_src[CHUNK];
    __shared__ u8* s_dst[CHUNK];
    int n = *n_copies;
    n = n < max_copies ? n : max_copies;
    const i64 units = row_bytes >> 4;                       // 16-byte units per row
    // Block b owns units [lo, hi) of every row: contiguous per block keeps each warp's loads
    // on consecutive addresses (whole 128-byte lines over PCIe).
    const i64 per_block = (units + gridDim.x - 1) / gridDim.x;
    const i64 lo = per_block * blockIdx.x;
    const int span = (int)(lo + per_block < units ? per_block : (units > lo ? units - lo : 0));
    if (span == 0) return;
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
        const int m = n - c0 < CHUNK ? n - c0 : CHUNK;
        __syncthreads();                                    // previous chunk's readers are done
        for (int c = threadIdx.x; c < m; c += blockDim.x) {
            const i32 key = copies[2 * (c0 + c)];
            const i32 row = copies[2 * (c0 + c) + 1];
            s_src[c] = reinterpret_cast<const u8*>(src_of_key[key]) + (lo << 4);
            s_dst[c] = dst_base + row_stride * row + (lo << 4);
        }
        __syncthreads();
        const int total = m * span;                         // (copy, unit) pairs of this chunk
        for (int f = threadIdx.x; f < total; f += blockDim.x * UNROLL) {
            u32x4 v[UNROLL];
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const int ff = f + j * blockDim.x;
                if (ff < total) v[j] = ld_stream16(s_src[ff / span] + ((i64)(ff % span) << 4));
            }
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const int ff = f + j * blockDim.x;
                if (ff < total) st16(s_dst[ff / span] + ((i64)(ff % span) << 4), v[j]);
            }
        }
    }
}
