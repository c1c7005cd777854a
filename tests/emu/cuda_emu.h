// A CPU stand-in for the CUDA features cupool's single-block kernels use, so their real source runs
// in CPU tests (and under ThreadSanitizer, which then reports any shared- or global-memory access
// that two threads make without a barrier between them: what compute-sanitizer's racecheck finds
// on the GPU, found here without one).
//
// One std::thread per CUDA thread of ONE block. __syncthreads is a std::barrier over the block;
// warp intrinsics exchange values through a per-warp buffer between two barriers over the warp's
// 32 threads, so a warp intrinsic reached by only part of a warp deadlocks (the harness times out)
// instead of silently working. `__shared__` becomes `static`: one block per launch, launches one
// after another. Not emulated: several blocks, memory fences beyond barriers, texture/async ops.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct EmuDim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

struct EmuWarp {
    std::barrier<> bar{32};
    long long vals[32];
};
inline std::barrier<>* emu_block_barrier = nullptr;
inline EmuWarp* emu_warps = nullptr;
inline unsigned* emu_dyn_smem = nullptr;  // what `extern __shared__` arrays point to

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline void emu_check_mask(unsigned mask) {
    if (mask != 0xffffffffu) {
        std::fprintf(stderr, "cuda_emu: only full-warp masks are emulated (got %08x)\n", mask);
        std::abort();
    }
}

// Every lane publishes v; `pick(lane, vals)` reads what the intrinsic returns to this lane.
template <class T, class Pick>
T emu_warp_exchange(T v, Pick pick) {
    const int lane = threadIdx.x & 31;
    EmuWarp& w = emu_warps[threadIdx.x >> 5];
    w.vals[lane] = static_cast<long long>(v);
    w.bar.arrive_and_wait();
    const T out = static_cast<T>(pick(lane, w.vals));
    w.bar.arrive_and_wait();  // nobody overwrites vals before every lane has read
    return out;
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

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

template <class T, class U>
T atomicOr(T* p, U v) { return std::atomic_ref<T>(*p).fetch_or(static_cast<T>(v)); }

template <class T, class U>
T atomicAdd(T* p, U v) { return std::atomic_ref<T>(*p).fetch_add(static_cast<T>(v)); }

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
void emu_launch(int threads, std::size_t smem_bytes, F body) {
    if (threads % 32 || threads <= 0) {
        std::fprintf(stderr, "cuda_emu: block of %d threads is not whole warps\n", threads);
        std::abort();
    }
    std::vector<unsigned> dyn((smem_bytes + 3) / 4 + 1, 0xABABABABu);
    emu_dyn_smem = dyn.data();
    std::barrier<> block(threads);
    emu_block_barrier = &block;
    std::unique_ptr<EmuWarp[]> warps(new EmuWarp[threads / 32]);
    emu_warps = warps.get();
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([t, threads, &body] {
            threadIdx = {static_cast<unsigned>(t), 0, 0};
            blockIdx = {0, 0, 0};
            blockDim = {static_cast<unsigned>(threads), 1, 1};
            gridDim = {1, 1, 1};
            body();
        });
    }
    for (auto& th : pool) th.join();
}
