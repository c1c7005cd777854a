// The decode kernel's (moe_decode.cu) stage ring and B-fragment sources, apart from its item
// logic: a warp's ring of stage buffers with their mbarriers and K slices, the B fragments of a
// token row of x (from global memory, or staged in shared memory), the lane of a unit's slot,
// and the DECODE_TRACE stamps.
//
// Include after async_copy.cuh and moe_common.cuh, and the macros STAGE, NBUF, HFULL, XALIGN,
// ROUTE, DECODE_TRACE and TRACE_ITEMS.
#pragma once

// One warp's stage buffers: [buffer][chunk][576 B as in the row] (one bulk copy a stage,
// completed on bar[buffer]). `parity`: bit b is the phase of bar[b] the next wait on it waits for.
static_assert(NBUF >= 2 && NBUF <= 8 && STAGE >= 1, "stage ring shape");
struct WarpStages {
    u64 bar[NBUF];
    u32 parity;
    u32 pad_[(16 - (8 * NBUF + 4) % 16) / 4];   // w starts 16-byte aligned
    u8 w[NBUF][STAGE * CHUNK_BYTES];
};
static_assert(sizeof(WarpStages) == (8 * NBUF + 4 + 15) / 16 * 16 + NBUF * STAGE * CHUNK_BYTES,
              "cupool/ops/moe_decode.py stage_ring_bytes mirrors this layout");

// Chunks [c0, c1) of a strip of nc chunks for K slice ks of ksplit.
CUPOOL_DEVICE void k_slice(int ks, int ksplit, int nc, int& c0, int& c1) {
    const int per = (nc + ksplit - 1) / ksplit;
    c0 = min(ks * per, nc);
    c1 = min(c0 + per, nc);
}

// Arrivals that complete a phase of a stage barrier: the lane that issues the stage's bulk copy
// (sm_90+), or, before sm_90, each of the warp's 32 lanes once its cp.async copies have landed.
constexpr u32 STAGE_ARRIVALS = CUPOOL_BULK_COPY ? 1 : 32;

// Stamp k of item `item` (thread 0; DECODE_TRACE only): 0 start, 1 waits done, 2 K loop done
// (warp 0), 3 end.
CUPOOL_DEVICE void stamp_at(u64* trace, int idx) {
#if DECODE_TRACE
    if (threadIdx.x == 0) {
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        trace[idx] = t;
    }
#endif
}

CUPOOL_DEVICE void stamp(u64* trace, int item, int k) {
    if (item < TRACE_ITEMS) stamp_at(trace, item * 4 + k);
}

// Columns k … k+15 of a token row as 8 B-fragment words (k = 64c + 16t: the lane's columns of
// chunk c); zeros for an empty slot or past the row's end (H is a multiple of 16, so the 16
// columns are all inside or all outside).
CUPOOL_DEVICE void x_cols16(const u16* row, int k, int hidden, u32 (&b)[8]) {
    if (row == nullptr || (!HFULL && k >= hidden)) {
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = 0u;
        return;
    }
#if XALIGN
    load_cols16<ROUTE>(row + k, b);      // ROUTE: x was written in this launch (through L2)
#else
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = (u32)row[k + 2 * i] | ((u32)row[k + 2 * i + 1] << 16);
#endif
}

// Lane of slot threadIdx.x (< NT) of unit u of a unit table (group_lanes'), -1 if empty.
CUPOOL_DEVICE int slot_lane(const u8* unit_count, const u8* unit_lanes, int u) {
    return (int)threadIdx.x < unit_count[u] ? (int)unit_lanes[u * NT + threadIdx.x] : -1;
}

// A token row of x in shared memory ([NT][XS_STRIDE] 16-bit words a unit): 16 bytes of padding
// put the slots' rows on different banks.
constexpr int XS_STRIDE = HP + 8;

// The token rows of x of a unit's first `nslots` slots (si->lane) into xs, 16 bytes a thread at a
// time, zeros past H; then the block goes on together (every thread calls it). K loops that read
// their B fragments from here instead of global memory do not hold every HMMA of a chunk up on a
// load through L2.
CUPOOL_DEVICE void stage_x(u16* xs, const SlotInfo* si, int nslots, const u16* x, int topk,
                           int hidden) {
    constexpr int V = HP / 8;                                  // 16-byte words of a row
    for (int v = threadIdx.x; v < nslots * V; v += blockDim.x) {
        const int n = v / V, k = 8 * (v % V);
        const u16* src = x + (i64)(si->lane[n] / topk) * hidden + k;
        u32x4 w = {0u, 0u, 0u, 0u};
        if (HFULL || k < hidden) {
#if XALIGN
            w = *reinterpret_cast<const u32x4*>(src);
#else
            w.x = (u32)src[0] | ((u32)src[1] << 16);
            w.y = (u32)src[2] | ((u32)src[3] << 16);
            w.z = (u32)src[4] | ((u32)src[5] << 16);
            w.w = (u32)src[6] | ((u32)src[7] << 16);
#endif
        }
        *reinterpret_cast<u32x4*>(xs + n * XS_STRIDE + k) = w;
    }
    __syncthreads();
}

// Columns k … k+15 of a row in shared memory as 8 B-fragment words; zeros for an empty slot.
CUPOOL_DEVICE void smem_cols16(const u16* row, int k, u32 (&b)[8]) {
    if (row == nullptr) {
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = 0u;
        return;
    }
    load_cols16(row + k, b);
}
