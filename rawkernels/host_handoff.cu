// A step's work handed to the host's CPU and its result taken back, inside a captured CUDA graph,
// with no host call between: the GPU and a host thread meet in a mailbox of pinned, mapped host
// memory (cupool/hostexperts.py's Mailbox; host_experts.c's hx_serve is the host side).
//
// Mailbox (host memory; the GPU reads and writes it across PCIe):
//   seq  (u32, byte 0)   the request's sequence number: written by host_post, last
//   done (u32, byte 64)  the answered sequence number: written by the host, after out
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
// Both kernels run as one block. A wait that runs past ~1 s sets ERR_HOST_STALL in *error and
// goes on (the output is then wrong, never a hang); the caller reads the error word after the
// step.
#include "common.cuh"

#define ERR_HOST_STALL 1

#ifndef X_BF16
#define X_BF16 1          // x: 1 bf16, 0 float32
#endif

CUPOOL_DEVICE float load_x(const void* x, int i) {
#if X_BF16
    return __uint_as_float((u32)reinterpret_cast<const u16*>(x)[i] << 16);
#else
    return reinterpret_cast<const float*>(x)[i];
#endif
}

CUPOOL_DEVICE u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

CUPOOL_DEVICE void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The request: x [n] (T·H values) as float32, keys and weights [lanes], then the next sequence
// number in counter[0] and in the mailbox's seq, and counter[1] = 1; with no routed lane only
// counter[1] = 0.
extern "C" __global__ void host_post(const void* __restrict__ x, i32 n,
                                     const i64* __restrict__ keys, const float* __restrict__ weights,
                                     i32 lanes, i32* __restrict__ counter, u32* seq,
                                     float* mx, i64* mkeys, float* mweights) {
    int routed = 0;
    for (int i = threadIdx.x; i < lanes; i += blockDim.x) routed |= keys[i] >= 0;
    if (!__syncthreads_or(routed)) {
        if (threadIdx.x == 0) counter[1] = 0;
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) mx[i] = load_x(x, i);
    for (int i = threadIdx.x; i < lanes; i += blockDim.x) {
        mkeys[i] = keys[i];
        mweights[i] = weights[i];
    }
    __threadfence_system();          // this thread's request writes before the block's barrier
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 s = (u32)counter[0] + 1u;
        counter[0] = (i32)s;
        counter[1] = 1;
        st_release_sys(seq, s);
    }
}

// Waits for the answer to the request host_post last posted (counter[0]), then y[i] += out[i]
// for i < n (float32); nothing when the last host_post posted nothing (counter[1] == 0).
extern "C" __global__ void host_wait(const i32* __restrict__ counter, const u32* done,
                                     const float* out, i32 n, float* __restrict__ y,
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
    // volatile: read from host memory now, never from a line cached by an earlier replay
    const volatile float* o = out;
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] += o[i];
}
