// A CPU stand-in for the CUDA features cupool's plan step, decode attention, dense GEMVs, MoE
// decode GEMM, sampler and host hand-off use (async_copy.cuh: the copies and mbarriers), so their
// real source runs in CPU tests (and under ThreadSanitizer, which then reports any shared- or
// global-memory access that two threads make without a barrier between them: what
// compute-sanitizer's racecheck finds on the GPU, found here without one).
//
// Each CUDA thread of ONE block is a fiber (ucontext) on one OS thread by default, or, built with
// -DEMU_THREADS=1 (the ThreadSanitizer builds), a std::thread. __syncthreads is a barrier over the
// block; warp intrinsics exchange values through a per-warp buffer and a barrier over the warp's
// 32 threads, so a warp intrinsic or __syncthreads reached by only part of a warp or block
// deadlocks instead of silently working: fibers report it and abort, threads hang (the harness
// times out). Fibers switch only at barriers, so a run is deterministic and about ten times
// faster than one thread per CUDA thread on a few cores; races are what the threads build is for.
// `__shared__` becomes `static`: one block at a time. A grid (`emu_launch_grid`) runs its blocks
// one after another, x fastest, so a kernel whose last block (by a ticket) finishes the work sees
// every other block's writes; it cannot show what concurrent blocks would race on. Not emulated:
// memory fences beyond barriers (blocks never overlap), textures. Asynchronous copies and
// mbarriers are tests/emu/async_copy.cuh's (the copies land at once).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#ifndef EMU_THREADS
#define EMU_THREADS 0
#endif
#if EMU_THREADS
#include <barrier>
#include <thread>
#else
#include <ucontext.h>
#endif

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <class T>
T __ldcg(const T* p) {  // a load through L2: blocks run one after another, so a plain load
    return *p;
}
template <class T>
T __ldcv(const T* p) {  // a load that fetches again (host memory): here a plain load
    return *p;
}

struct EmuDim3 {
    unsigned x = 0, y = 0, z = 0;
};

#if EMU_THREADS
inline thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;
inline thread_local unsigned emu_exchange_count = 0;  // warp exchanges this thread has made
inline unsigned& emu_exchanges() { return emu_exchange_count; }

using EmuBarrier = std::barrier<>;
#else
// One OS thread runs every fiber: these are set by the scheduler before it resumes a fiber.
inline EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

struct EmuFiber {
    ucontext_t ctx;
    unsigned exchanges = 0;  // warp exchanges this fiber has made
    bool done = false;
};
inline EmuFiber* emu_fibers = nullptr;
inline int emu_cur = -1;              // the fiber running now
inline ucontext_t emu_scheduler;
inline unsigned long emu_progress = 0;  // barrier arrivals and finished fibers, for deadlocks
inline void (*emu_call)(void*) = nullptr;
inline void* emu_body = nullptr;

inline unsigned& emu_exchanges() { return emu_fibers[emu_cur].exchanges; }

inline void emu_yield() { swapcontext(&emu_fibers[emu_cur].ctx, &emu_scheduler); }

// The last fiber to arrive opens the barrier (a new generation) and runs on; the others wait,
// yielding, until they see the generation change.
class EmuBarrier {
public:
    explicit EmuBarrier(int n) : n_(n) {}
    void arrive_and_wait() {
        ++emu_progress;
        const unsigned long gen = gen_;
        if (++arrived_ == n_) {
            arrived_ = 0;
            ++gen_;
            return;
        }
        while (gen_ == gen) emu_yield();
    }

private:
    const int n_;
    int arrived_ = 0;
    unsigned long gen_ = 0;
};

inline void emu_fiber_main() {
    emu_call(emu_body);
    emu_fibers[emu_cur].done = true;
    ++emu_progress;
}  // returns to uc_link: the scheduler
#endif

struct EmuWarp {
    EmuBarrier bar{32};
    long long vals[2][32];  // exchanges alternate between two buffers (see emu_warp_exchange)
};
inline EmuBarrier* emu_block_barrier = nullptr;
inline EmuWarp* emu_warps = nullptr;
inline unsigned* emu_dyn_smem = nullptr;  // what `extern __shared__` arrays point to

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline void emu_check_mask(unsigned mask) {
    if (mask != 0xffffffffu) {
        std::fprintf(stderr, "cuda_emu: only full-warp masks are emulated (got %08x)\n", mask);
        std::abort();
    }
}

// Every lane publishes v; `pick(lane, vals)` reads what the intrinsic returns to this lane. One
// warp barrier an exchange: exchange n writes buffer n % 2, and a lane can only write that buffer
// again at exchange n + 2, after passing exchange n + 1's barrier, which every lane reaches only
// once it has read exchange n's values.
// Values travel as their bits (a float keeps its bits; an int its low bytes, as on the GPU).
template <class T, class Pick>
T emu_warp_exchange(T v, Pick pick) {
    static_assert(sizeof(T) <= sizeof(long long), "a warp exchange of at most 8 bytes");
    const int lane = threadIdx.x & 31;
    EmuWarp& w = emu_warps[threadIdx.x >> 5];
    long long* vals = w.vals[emu_exchanges()++ & 1];
    long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    vals[lane] = bits;
    w.bar.arrive_and_wait();
    const long long got = pick(lane, vals);
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu_check_mask(mask);
    emu_warp_exchange<int>(0, [](int, const long long*) { return 0LL; });
}

// blocks run one after another: a fence orders nothing that is not already ordered
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// __syncthreads that also returns whether any thread's predicate was nonzero: each thread adds
// its vote, a barrier, every thread reads the sum, a barrier before the next call's votes.
inline int emu_votes = 0;
inline int __syncthreads_or(int pred) {
    if (pred) std::atomic_ref<int>(emu_votes).fetch_add(1);
    __syncthreads();
    const int any = std::atomic_ref<int>(emu_votes).load() != 0;
    __syncthreads();
    if (threadIdx.x == 0) std::atomic_ref<int>(emu_votes).store(0);
    __syncthreads();
    return any;
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
    emu_check_mask(mask);
    return emu_warp_exchange<unsigned>(pred ? 1u : 0u, [](int, const long long* v) {
        unsigned m = 0;
        for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(v[i] != 0) << i;
        return m;
    });
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src) {
    emu_check_mask(mask);
    return emu_warp_exchange<T>(var, [src](int, const long long* v) { return v[src & 31]; });
}

template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta) {
    emu_check_mask(mask);
    return emu_warp_exchange<T>(var, [delta](int lane, const long long* v) {
        return lane >= static_cast<int>(delta) ? v[lane - delta] : v[lane];
    });
}

template <class T>
T __shfl_xor_sync(unsigned mask, T var, int m) {
    emu_check_mask(mask);
    return emu_warp_exchange<T>(var, [m](int lane, const long long* v) { return v[(lane ^ m) & 31]; });
}

// the lanes whose value equals this lane's
inline unsigned __match_any_sync(unsigned mask, unsigned long long value) {
    emu_check_mask(mask);
    return emu_warp_exchange<unsigned long long>(value, [](int lane, const long long* v) {
        unsigned m = 0;
        for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(v[i] == v[lane]) << i;
        return static_cast<long long>(m);
    });
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
// bytes of {y, x} (x bytes 0-3, y bytes 4-7) picked by the low 3 bits of each selector nibble
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long xy = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n)
        r |= (unsigned)((xy >> (8 * ((s >> (4 * n)) & 7))) & 0xffu) << (8 * n);
    return r;
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float expf(float x) { return std::exp(x); }
inline float __expf(float x) { return std::exp(x); }   // the GPU's is ex2.approx-based
inline float __fdividef(float a, float b) { return a / b; }   // the GPU's: a · rcp.approx(b)
inline float fmaxf(float a, float b) { return std::fmax(a, b); }

template <class T, class U>
T atomicOr(T* p, U v) { return std::atomic_ref<T>(*p).fetch_or(static_cast<T>(v)); }

template <class T, class U>
T atomicAdd(T* p, U v) { return std::atomic_ref<T>(*p).fetch_add(static_cast<T>(v)); }

template <class T, class U>
T atomicMax(T* p, U v) {
    std::atomic_ref<T> a(*p);
    T cur = a.load();
    while (static_cast<T>(v) > cur && !a.compare_exchange_weak(cur, static_cast<T>(v))) {
    }
    return cur;
}

template <class T, class U>
T atomicMin(T* p, U v) {
    std::atomic_ref<T> a(*p);
    T cur = a.load();
    while (static_cast<T>(v) < cur && !a.compare_exchange_weak(cur, static_cast<T>(v))) {
    }
    return cur;
}

// Runs body() once per thread of a block of `threads` threads with `smem_bytes` of dynamic shared
// memory, filled with 0xAB so a kernel that reads shared memory it never wrote sees garbage.
template <class F>
void emu_launch(int threads, std::size_t smem_bytes, F body, EmuDim3 at = {0, 0, 0},
                EmuDim3 grid = {1, 1, 1}) {
    if (threads % 32 || threads <= 0) {
        std::fprintf(stderr, "cuda_emu: block of %d threads is not whole warps\n", threads);
        std::abort();
    }
    std::vector<unsigned> dyn((smem_bytes + 3) / 4 + 1, 0xABABABABu);
    emu_dyn_smem = dyn.data();
    EmuBarrier block(threads);
    emu_block_barrier = &block;
    std::unique_ptr<EmuWarp[]> warps(new EmuWarp[threads / 32]);
    emu_warps = warps.get();
    blockIdx = at;
    blockDim = {static_cast<unsigned>(threads), 1, 1};
    gridDim = grid;
#if EMU_THREADS
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([t, threads, &body, at, grid] {
            threadIdx = {static_cast<unsigned>(t), 0, 0};
            emu_exchanges() = 0;
            blockIdx = at;
            blockDim = {static_cast<unsigned>(threads), 1, 1};
            gridDim = grid;
            body();
        });
    }
    for (auto& th : pool) th.join();
#else
    constexpr std::size_t STACK = 64 << 10;  // the kernels keep a few small arrays on the stack
    std::unique_ptr<char[]> stacks(new char[STACK * threads]);
    std::unique_ptr<EmuFiber[]> fibers(new EmuFiber[threads]);
    emu_fibers = fibers.get();
    emu_body = &body;
    emu_call = [](void* p) { (*static_cast<F*>(p))(); };
    for (int t = 0; t < threads; ++t) {
        ucontext_t& c = fibers[t].ctx;
        getcontext(&c);
        c.uc_stack.ss_sp = stacks.get() + STACK * t;
        c.uc_stack.ss_size = STACK;
        c.uc_link = &emu_scheduler;
        makecontext(&c, emu_fiber_main, 0);
    }
    // Round robin: each fiber runs until it waits at a barrier or ends. A round in which every
    // fiber only found its barrier still closed can never end: some threads wait at a barrier
    // that the others will not reach.
    for (int live = threads; live > 0;) {
        const unsigned long before = emu_progress;
        for (int t = 0; t < threads; ++t) {
            if (fibers[t].done) continue;
            emu_cur = t;
            threadIdx = {static_cast<unsigned>(t), 0, 0};
            swapcontext(&emu_scheduler, &fibers[t].ctx);
            live -= fibers[t].done;
        }
        if (live > 0 && emu_progress == before) {
            std::fprintf(stderr, "cuda_emu: deadlock: %d of %d threads wait at a barrier (a "
                         "__syncthreads or warp intrinsic) that the others do not reach\n",
                         live, threads);
            std::abort();
        }
    }
    emu_fibers = nullptr;
    emu_cur = -1;
#endif
}

// Every block of `grid`, one after another (x fastest, then y, then z).
template <class F>
void emu_launch_grid(EmuDim3 grid, int threads, std::size_t smem_bytes, F body) {
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) emu_launch(threads, smem_bytes, body, {x, y, z}, grid);
}
