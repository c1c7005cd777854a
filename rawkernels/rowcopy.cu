// Row copies from the host store (pinned, read through UVA pointers) into GPU rows.
// Two kernels with one contract: copy_rows (SM loads, any GPU) and copy_rows_bulk (Hopper bulk
// copies, sm_90+, further down; built for every architecture, but before sm_90 its body only
// traps: cupool/ops/rowcopy.py picks copy_rows there).
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
#include "async_copy.cuh"

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

// ---------------------------------------------------------------------------------------------
// copy_rows_bulk: the same copies through Hopper's bulk-copy (TMA) engine, sm_90 and later.
//
// Why: copy_rows' threads wait for their loads of one row before they start on the next row, so
// every row costs a PCIe round trip on top of its bytes (on an H200, about 3 us: 7% of a 2 MiB
// row). Here one thread keeps NSTAGES chunks in flight across row boundaries, and each chunk
// goes to the SM's bulk-copy engine as one instruction that issues the host reads itself.
//
// Work sketch: the copy list is cut into chunks, CHUNK bytes each except the last chunk of a row
// (row_bytes need not be a multiple of CHUNK; it is a multiple of 16, so every chunk is too).
// Chunk c covers bytes [(c % per_row) * CHUNK, ...) of copy c / per_row. Block b takes chunks
// b, b + G, b + 2G, ... (G = gridDim.x): at any moment the whole grid works on one window of
// about G x NSTAGES consecutive chunks, so the reads in flight stay in one stretch of host memory
// (the locality copy_rows has by sharing every row among all blocks; on an H200 rows read in
// store order or at random made no difference), and every block gets the same number of chunks,
// give or take one, so none is left with a long tail.
//
// Per block, one thread does everything (a bulk copy is issued by one thread; the block's other
// threads have no work and return). It runs a ring of NSTAGES shared-memory buffers:
//   load  chunk k:   host row -> buf[k % NSTAGES]   (cp.async.bulk, completes on full[k % NSTAGES])
//   store chunk k:   buf[k % NSTAGES] -> GPU row    (cp.async.bulk, one bulk async-group each)
// Chunk k's load is waited for, its store issued, and then the buffer of chunk k - 1 (whose
// store went out one step earlier, so it has most likely been read by now) is refilled with
// chunk k - 1 + NSTAGES. While the thread waits for a load, NSTAGES - 1 loads are in flight per
// block: G x (NSTAGES - 1) x CHUNK bytes over the grid, far beyond PCIe's bandwidth x latency.
//
// Invariants (besides copy_rows'):
//   - full[s] completes one phase per chunk loaded into buf[s]; the j-th use of buf[s] waits for
//     phase parity j & 1. Only the elected thread arrives on (count 1) and waits on full[s].
//   - buf[s] is reloaded only after the store that read it has finished reading
//     (cp.async.bulk.wait_group.read), and the block exits only after every store completed.
//   - The kernel never writes the host store and never reads or writes past row_bytes of a row:
//     the last chunk of a row is cut to row_bytes (a multiple of 16, as bulk copies need).
//   - Addresses: host rows are 256-byte aligned, GPU rows 16-byte aligned (row_stride % 16 ==
//     0, dst_base 256-byte aligned), chunk offsets are multiples of CHUNK (a multiple of 16) and
//     the buffers 128-byte aligned: every bulk copy meets the 16-byte alignment it needs.
//
// Launch: 32 threads a block, NSTAGES * CHUNK bytes of dynamic shared memory.

#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef NSTAGES
#define NSTAGES 4
#endif
static_assert(CHUNK >= 16 && CHUNK % 16 == 0, "CHUNK must be a positive multiple of 16 bytes");
// The mbarrier's transaction count holds at most 2^20 - 1 bytes a phase.
static_assert(CHUNK < (1 << 20), "CHUNK must be below 1 MiB");
// With one stage the refill of chunk k - 1's buffer would come after the wait for chunk k.
static_assert(NSTAGES >= 2, "NSTAGES must be at least 2");

// Where chunk c of the copy list starts in the host store and in the GPU rows, and its size.
struct BulkChunk {
    const u8* src;
    u8* dst;
    u32 bytes;
};

CUPOOL_DEVICE BulkChunk locate_chunk(i64 c, i64 per_row, const i64* __restrict__ src_of_key,
                                     const i32* __restrict__ copies, u8* dst_base,
                                     i64 row_stride, i64 row_bytes) {
    const i64 i = c / per_row;                              // which copy
    const i64 off = (c - i * per_row) * CHUNK;              // byte offset in the row
    const i32 key = copies[2 * i];
    const i32 row = copies[2 * i + 1];
    const i64 left = row_bytes - off;
    BulkChunk ch;
    ch.src = reinterpret_cast<const u8*>(src_of_key[key]) + off;
    ch.dst = dst_base + row_stride * row + off;
    ch.bytes = static_cast<u32>(left < CHUNK ? left : CHUNK);
    return ch;
}

extern "C" __global__ void copy_rows_bulk(const i64* __restrict__ src_of_key,  // [L*E] UVA addresses
                                          const i32* __restrict__ copies,      // [max_copies, 2]
                                          const i32* __restrict__ n_copies,    // [1]
                                          u8* __restrict__ dst_base,           // rows of row_stride
                                          i64 row_stride, i64 row_bytes, i32 max_copies) {
#if CUPOOL_BULK_COPY
    extern __shared__ __align__(128) u8 buf[];              // [NSTAGES][CHUNK]
    __shared__ __align__(8) u64 full[NSTAGES];              // one mbarrier per buffer
    if (threadIdx.x != 0) return;                            // one thread issues every copy

    int n = *n_copies;
    n = n < max_copies ? n : max_copies;
    const i64 per_row = (row_bytes + CHUNK - 1) / CHUNK;    // chunks per row, tail included
    const i64 total = per_row * (n > 0 ? n : 0);
    const i64 G = gridDim.x;
    if (blockIdx.x >= total) return;                         // empty list: only the launch
    const i64 mine = (total - blockIdx.x + G - 1) / G;      // chunks of this block

    for (int s = 0; s < NSTAGES; ++s) mbar_init(smem_addr(&full[s]), 1);
    // The ISA says a bulk copy reaches its mbarrier through the generic proxy, so the init needs
    // no proxy fence in principle; the CUDA programming guide's bulk-copy example fences here all
    // the same, and once per block costs nothing.
    fence_proxy_async_smem();

    // Load chunk k (the k-th of this block) into its buffer.
    auto load = [&](i64 k) {
        const int s = static_cast<int>(k % NSTAGES);
        const BulkChunk ch = locate_chunk(blockIdx.x + k * G, per_row, src_of_key, copies,
                                          dst_base, row_stride, row_bytes);
        const u32 bar = smem_addr(&full[s]);
        mbar_arrive_expect(bar, ch.bytes);
        bulk_load(smem_addr(buf + s * CHUNK), ch.src, ch.bytes, bar);
    };

    const i64 first = mine < NSTAGES ? mine : NSTAGES;
    for (i64 k = 0; k < first; ++k) load(k);

    for (i64 k = 0; k < mine; ++k) {
        const int s = static_cast<int>(k % NSTAGES);
        mbar_wait(smem_addr(&full[s]), static_cast<u32>((k / NSTAGES) & 1));
        // The wait makes the loaded bytes visible to this thread; the store reads them through
        // the async proxy again. The ISA does not spell this async -> async hand-over out, so
        // order it explicitly: one fence per chunk is noise against a chunk's PCIe time.
        fence_proxy_async_smem();
        const BulkChunk ch = locate_chunk(blockIdx.x + k * G, per_row, src_of_key, copies,
                                          dst_base, row_stride, row_bytes);
        bulk_store(ch.dst, smem_addr(buf + s * CHUNK), ch.bytes);
        bulk_commit();
        // Refill the buffer of chunk k - 1: every store but the one just issued has read its
        // buffer once at most one group is still reading.
        if (k >= 1 && k - 1 + NSTAGES < mine) {
            bulk_wait_read<1>();
            load(k - 1 + NSTAGES);
        }
    }
    // Shared memory must outlive the stores that read it; waiting for full completion (not only
    // the reads) also leaves no write of this kernel in flight when the block retires.
    bulk_wait_all();
#else
    // No bulk-copy engine before sm_90. The launcher never picks this kernel there (RowCopier's
    // mode "auto" is "ld", and "bulk" is refused); launched all the same, it fails loudly rather
    // than copying nothing.
    __trap();
#endif
}
