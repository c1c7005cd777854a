// Asynchronous copies into shared memory: cp.async (16 bytes a thread, sm_80+, tracked by commit
// groups or by an mbarrier; moe_gemm.cu's activation staging, moe_decode.cu's stages before
// sm_90) and the bulk-copy (TMA) engine with mbarrier transaction counts (sm_90 and later;
// moe_decode.cu, rowcopy.cu, read_probe.cu), plus the proxy fence between them and ordinary
// accesses.
#pragma once
#include "common.cuh"

// 1 where the bulk-copy engine and mbarrier transaction counts exist (sm_90 and later: Hopper,
// Blackwell), 0 before (sm_80-89: A100, RTX 30xx/40xx) and in nvcc's host pass. Kernels choose
// their copy path with it at compile time; the launchers choose their kernels from the same
// fact (cupool._cuda.Arch.bulk_copy).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUPOOL_BULK_COPY 1
#else
#define CUPOOL_BULK_COPY 0
#endif

// Shared-window address of a shared-memory object, as the bulk-copy and mbarrier operands take it.
CUPOOL_DEVICE u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Start a bulk load of `bytes` from global memory (device memory, or host memory through its UVA
// address) into this CTA's shared memory; its completion adds `bytes` to the transactions of `bar`.
// The .shared::cluster destination (PTX 8.0) rather than .shared::cta (PTX 8.6) keeps older
// NVRTCs able to compile this; a CTA's own shared address is valid in the cluster window.
CUPOOL_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Start a bulk store of `bytes` from shared memory to global memory; tracked by bulk async-groups.
CUPOOL_DEVICE void bulk_store(void* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}

CUPOOL_DEVICE void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until at most N bulk async-groups still read their shared-memory source.
template <int N>
CUPOOL_DEVICE void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// Wait until every bulk async-group has completed (its writes are done).
CUPOOL_DEVICE void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

CUPOOL_DEVICE void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Arrive (the one expected arrival) and announce `bytes` of bulk-copy transactions this phase.
CUPOOL_DEVICE void mbar_arrive_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

// Block until the phase with parity `parity` of `bar` has completed. try_wait suspends the
// thread for a while inside the instruction, so this loop does not spin hot; before sm_90 there
// is only test_wait, which returns at once, so the loop polls.
CUPOOL_DEVICE void mbar_wait(u32 bar, u32 parity) {
#if CUPOOL_BULK_COPY
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "wait_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra wait_%=;\n}"
        :: "r"(bar), "r"(parity) : "memory");
#else
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "wait_%=:\n\t"
        "mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n\t"
        "@!done bra wait_%=;\n}"
        :: "r"(bar), "r"(parity) : "memory");
#endif
}

// Order this thread's shared-memory accesses through the generic proxy against those through
// the async proxy (the bulk-copy engine).
CUPOOL_DEVICE void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// cp.async of 16 bytes (L2 only) from global into shared memory, or 16 zero bytes (nothing
// read) where `valid` is false; completion is tracked per thread by commit groups.
CUPOOL_DEVICE void cp_async16_zfill(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// cp.async of 16 bytes (L2 only) from global memory (device memory, or host memory through its
// UVA address) into shared memory.
CUPOOL_DEVICE void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"(smem_addr(dst)), "l"(src) : "memory");
}

// Arrive on `bar` once every cp.async this thread has issued so far has landed. With .noinc the
// arrival is one of the phase's expected arrivals (mbar_init's count), so a barrier that N
// threads arrive on this way is initialised with count N.
CUPOOL_DEVICE void cp_async_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" :: "r"(bar) : "memory");
}

CUPOOL_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most N of this thread's cp.async groups are still in flight.
template <int N>
CUPOOL_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
