// A step's work handed to the host's CPU and its result taken back, inside a captured CUDA graph,
// with no host call between: the GPU and a host thread meet in a mailbox of pinned, mapped host
// memory (cupool/hostexperts.py's Mailbox; host_experts.c's hx_serve is the host side).
//
// Mailbox (host memory; the GPU reads and writes it across PCIe):
//   seq  (u32, byte 0)   the request's sequence number: written by host_post, last
//   done (u32, byte 64)  the answered sequence number: written by the host, after out
//   size (u32, byte 128) the request's lanes W = T·K (host_post): T may be fewer tokens than the
//                        mailbox holds (a prefill call's), and the host reads only those
//   keys [W] i64, weights [W] f32, x [T, H] f32: the request (host_post)
//   out [T, H] f32: the answer (the host)
// Order: host_post writes the request, fences at system scope, then seq; the host polls seq,
// computes, writes out, then done (a release store); host_wait polls done until it holds the
// step's number, then reads out. The number comes from a device counter (counter[0]) that
// host_post bumps, so every replay of a captured graph posts a new one and waits for its own
// answer. A call none of whose lanes is routed (every key -1: the planner handed nothing over)
// posts nothing and costs no round trip: host_post writes counter[1] = 0 (1 when it posted) and
// host_wait, finding 0, adds nothing (the answer would be zeros).
//
// Both kernels run as a grid of any number of blocks (cupool/ops/host_handoff.py: one per 1,024
// values of x, at most 32), each moving 4 values a thread a pass, 16 bytes at a time across PCIe:
// a block's thread waits out a read of host memory (about a microsecond) before its next, so
// the reads of the answer must be spread over many threads at once, not queued behind one block.
// host_post's blocks count themselves done in counter[2] (after their system-scope fences); the
// last one posts the number and puts the count back to 0. A wait that runs past ~1 s sets
// ERR_HOST_STALL in *error and goes on (the output is then wrong, never a hang); the caller
// reads the error word after the step.
#include "common.cuh"

#define ERR_HOST_STALL 1

// dtypes of the tensors on the GPU side: 0 float32, 1 bf16, 2 fp16 (the mailbox is float32)
#ifndef X_DTYPE
#define X_DTYPE 1         // x, the layer's input
#endif
#ifndef W_DTYPE
#define W_DTYPE 0         // the router weights
#endif
#ifndef Y_DTYPE
#define Y_DTYPE 0         // y, the output the answer is added to (rounded once, as torch's add)
#endif
static_assert(X_DTYPE >= 0 && X_DTYPE <= 2 && W_DTYPE >= 0 && W_DTYPE <= 2 && Y_DTYPE >= 0 &&
              Y_DTYPE <= 2, "X_DTYPE, W_DTYPE, Y_DTYPE: 0 float32, 1 bf16, 2 fp16");

template <int D>
CUPOOL_DEVICE float load_f32(const void* p, int i) {
    if (D == 1) return bf16_to_f32(reinterpret_cast<const u16*>(p)[i]);
    if (D == 2) return f16_to_f32(reinterpret_cast<const u16*>(p)[i]);
    return reinterpret_cast<const float*>(p)[i];
}

template <int D>
CUPOOL_DEVICE void store_f32(void* p, int i, float v) {
    if (D == 1) reinterpret_cast<u16*>(p)[i] = f32_to_bf16(v);
    else if (D == 2) reinterpret_cast<u16*>(p)[i] = f32_to_f16(v);
    else reinterpret_cast<float*>(p)[i] = v;
}

CUPOOL_DEVICE u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

CUPOOL_DEVICE void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The request: x [n] (T·H values) and the weights [lanes] as float32, keys [lanes], its size
// (lanes), then the next sequence number in counter[0] and in the mailbox's seq, and counter[1] =
// 1; with no routed lane only counter[1] = 0. mx is 16-byte aligned (the mailbox's 64-byte
// layout); x need not be.
extern "C" __global__ void host_post(const void* __restrict__ x, i32 n,
                                     const i64* __restrict__ keys, const void* __restrict__ weights,
                                     i32 lanes, i32* __restrict__ counter, u32* seq, u32* msize,
                                     float* mx, i64* mkeys, float* mweights) {
    int routed = 0;
    for (int i = threadIdx.x; i < lanes; i += blockDim.x) routed |= keys[i] >= 0;
    if (!__syncthreads_or(routed)) {          // the same in every block: each reads every key
        if (blockIdx.x == 0 && threadIdx.x == 0) counter[1] = 0;
        return;
    }
    const int stride = 4 * gridDim.x * blockDim.x, n4 = n & ~3;
    for (int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x); i < n4; i += stride) {
        const float4 v = make_float4(load_f32<X_DTYPE>(x, i), load_f32<X_DTYPE>(x, i + 1),
                                     load_f32<X_DTYPE>(x, i + 2), load_f32<X_DTYPE>(x, i + 3));
        *reinterpret_cast<float4*>(mx + i) = v;
    }
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) *msize = (u32)lanes;
        for (int i = n4 + threadIdx.x; i < n; i += blockDim.x) mx[i] = load_f32<X_DTYPE>(x, i);
        for (int i = threadIdx.x; i < lanes; i += blockDim.x) {
            mkeys[i] = keys[i];
            mweights[i] = load_f32<W_DTYPE>(weights, i);
        }
    }
    __threadfence_system();          // this thread's request writes before the block's barrier
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(&counter[2], 1) == (int)gridDim.x - 1) {
        __threadfence();             // every block's count seen: their fenced writes come first
        counter[2] = 0;
        const u32 s = (u32)counter[0] + 1u;
        counter[0] = (i32)s;
        counter[1] = 1;
        st_release_sys(seq, s);
    }
}

// Waits for the answer to the request host_post last posted (counter[0]), then y[i] += out[i]
// for i < n (in float32, rounded once to Y_DTYPE); nothing when the last host_post posted nothing
// (counter[1] == 0). Each block waits on its own; out is 16-byte aligned, y need not be.
extern "C" __global__ void host_wait(const i32* __restrict__ counter, const u32* done,
                                     const float* out, i32 n, void* __restrict__ y,
                                     i32* __restrict__ error) {
    __shared__ int skip;             // nothing posted, or the wait gave up
    if (threadIdx.x == 0) {
        const u32 s = (u32)counter[0];
        int spins = 0;
        skip = counter[1] == 0;      // nothing posted: nothing to wait for, nothing to add
        while (!skip && ld_acquire_sys(done) != s) {
            nap_32ns();
            if (++spins == (1 << 20)) {      // each spin is a read across PCIe (~1 µs)
                atomicOr(error, ERR_HOST_STALL);
                skip = 1;
            }
        }
    }
    __syncthreads();
    if (skip) return;
    // __ldcv: read from host memory now, never from a line cached by an earlier replay
    const int stride = 4 * gridDim.x * blockDim.x, n4 = n & ~3;
    for (int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x); i < n4; i += stride) {
        const float4 o = __ldcv(reinterpret_cast<const float4*>(out + i));
        store_f32<Y_DTYPE>(y, i, load_f32<Y_DTYPE>(y, i) + o.x);
        store_f32<Y_DTYPE>(y, i + 1, load_f32<Y_DTYPE>(y, i + 1) + o.y);
        store_f32<Y_DTYPE>(y, i + 2, load_f32<Y_DTYPE>(y, i + 2) + o.z);
        store_f32<Y_DTYPE>(y, i + 3, load_f32<Y_DTYPE>(y, i + 3) + o.w);
    }
    if (blockIdx.x == 0)
        for (int i = n4 + threadIdx.x; i < n; i += blockDim.x)
            store_f32<Y_DTYPE>(y, i, load_f32<Y_DTYPE>(y, i) + __ldcv(out + i));
}
