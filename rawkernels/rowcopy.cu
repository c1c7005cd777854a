// Row copies from the host store (pinned, read through UVA pointers) into GPU rows.
//
// Work sketch: a fixed grid (chosen at build time, never from data) walks the copy list that the
// plan step wrote. The list's length is read from device memory, so an empty list costs only the
// launch, and the same launch can be captured once in a CUDA graph and replayed with any list.
// Every block takes a contiguous slice of every listed row; each thread keeps UNROLL 16-byte
// host loads in flight before it stores, because a PCIe read is ~1-2 us of latency and the link
// only fills when about (bandwidth x latency) bytes are outstanding.
//
// Invariants: the copy list holds (key, row) pairs; `src_of_key[key]` is the UVA address of the
// key's row in the host store (written once at build time); `row` indexes the bank + staging rows
// of `row_stride` bytes at `dst_base`. Rows are 256-byte aligned and `row_bytes` is a multiple of
// 16. The kernel never writes the host store and never reads past `row_bytes` of any row.
#include "common.cuh"

#ifndef UNROLL
#define UNROLL 4
#endif

extern "C" __global__ void copy_rows(const i64* __restrict__ src_of_key,  // [L*E] UVA addresses
                                     const i32* __restrict__ copies,      // [max_copies, 2]
                                     const i32* __restrict__ n_copies,    // [1]
                                     u8* __restrict__ dst_base,           // rows of row_stride
                                     i64 row_stride, i64 row_bytes, i32 max_copies) {
    int n = *n_copies;
    n = n < max_copies ? n : max_copies;
    const i64 units = row_bytes >> 4;                       // 16-byte units per row
    // Block b owns units [lo, hi) of every row: contiguous per block keeps each warp's loads
    // on consecutive addresses (whole 128-byte lines over PCIe).
    const i64 per_block = (units + gridDim.x - 1) / gridDim.x;
    const i64 lo = per_block * blockIdx.x;
    const i64 hi = lo + per_block < units ? lo + per_block : units;
    for (int c = 0; c < n; ++c) {
        const i32 key = copies[2 * c];
        const i32 row = copies[2 * c + 1];
        const u8* src = reinterpret_cast<const u8*>(src_of_key[key]);
        u8* dst = dst_base + row_stride * row;
        for (i64 u = lo + threadIdx.x; u < hi; u += (i64)blockDim.x * UNROLL) {
            u32x4 v[UNROLL];
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const i64 uu = u + (i64)j * blockDim.x;
                if (uu < hi) v[j] = ld_stream16(src + (uu << 4));
            }
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const i64 uu = u + (i64)j * blockDim.x;
                if (uu < hi) st16(dst + (uu << 4), v[j]);
            }
        }
    }
}
