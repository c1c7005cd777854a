// The two kernels around a captured decode step's copy-engine row copies (cupool/ops/enginecopy.py).
//
// Inside a CUDA graph the copy engine can only copy what a memcpy node names when the graph is
// made, while a step's misses are known only once its plan step has run on the device. So each
// layer call of the captured step holds K conditional SWITCH nodes (slots), each with one body
// an expert of the layer: a memcpy node of that expert's host row into the slot's fixed GPU row.
// - set_switches runs after the plan step: it points switch k at the expert of the copy list's
//   entry k (k < min(n, K)), the others at E (no body runs).
// - settle_rows runs after the switches: it moves slot k into the row the plan step chose for
//   entry k (a bank row, or a staging row), HBM to HBM, and copies the list's entries from K on
//   from the host itself (SM loads through UVA, as rowcopy.cu's copy_rows).
//
// Invariants: the copy list is the plan step's ((key, row) pairs, n of them, keys of this call's
// layer: key0 ≤ key < key0 + E); a key outside that range among the first K sets `error` bit 1,
// its switch copies nothing and its row is left as it was. Slots are K rows of slot_stride bytes; rows are the bank
// and staging rows, row_stride apart; row_bytes is a multiple of 16 and every base is 16-byte
// aligned. Neither kernel reads a row past row_bytes nor writes anything but rows[copies[2k+1]]
// (k < min(n, max_copies)) and error.
#include "common.cuh"

#define MAX_SLOTS 8
#define ERR_KEY 1

// The device call that sets a conditional node's value (CUDA 12.3+). It is a builtin of the
// device runtime that ptxas resolves without separate compilation; declared here because NVRTC
// builds this file without the runtime's headers.
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

// One thread sets all K switches (racing calls to cudaGraphSetConditional are undefined).
// h0..h7: the switches' handles, h0..h(K-1) used.
extern "C" __global__ void set_switches(const i32* __restrict__ copies,   // [>= K, 2] (key, row)
                                        const i32* __restrict__ n_copies, // [1]
                                        i32 key0, i32 E, i32 K, i32* __restrict__ error,
                                        u64 h0, u64 h1, u64 h2, u64 h3,
                                        u64 h4, u64 h5, u64 h6, u64 h7) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 h[MAX_SLOTS] = {h0, h1, h2, h3, h4, h5, h6, h7};
    const int n = min(*n_copies, K);
    for (int k = 0; k < K && k < MAX_SLOTS; ++k) {
        unsigned value = (unsigned)E;                       // no body: nothing copied
        if (k < n) {
            const int e = copies[2 * k] - key0;
            if (e >= 0 && e < E) value = (unsigned)e;
            else atomicOr(error, ERR_KEY);
        }
        cudaGraphSetConditional(h[k], value);
    }
}

// Entry k of the copy list (k < min(n, max_copies)) into rows[copies[2k + 1]]: from slot k for
// k < K (where its switch put the row; not at all where set_switches found its key outside the
// layer), from the host row src_of_key[copies[2k]] (UVA) for the others; every block a
// grid-strided share of each row.
extern "C" __global__ void settle_rows(const u8* __restrict__ slots, i64 slot_stride,
                                       const i64* __restrict__ src_of_key,   // [L*E]
                                       const i32* __restrict__ copies,
                                       const i32* __restrict__ n_copies,
                                       u8* __restrict__ rows, i64 row_stride, i64 row_bytes,
                                       i32 key0, i32 E, i32 K, i32 max_copies) {
    const int n = min(*n_copies, max_copies);
    const i64 units = row_bytes >> 4;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (int k = 0; k < n; ++k) {
        const int e = copies[2 * k] - key0;
        if (k < K && (e < 0 || e >= E)) continue;        // its switch copied nothing
        const u8* src = k < K ? slots + slot_stride * k
                              : reinterpret_cast<const u8*>(src_of_key[copies[2 * k]]);
        u8* dst = rows + row_stride * copies[2 * k + 1];
        for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += step)
            st16(dst + (u << 4), ld_stream16(src + (u << 4)));
    }
}
