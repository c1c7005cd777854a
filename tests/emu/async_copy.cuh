// CPU stand-in for rawkernels/async_copy.cuh (tests/emu): the copies happen at once, and an
// mbarrier is a word in the block's dynamic shared memory that counts its arrivals and pending
// transaction bytes and flips its phase bit when both reach zero, as the hardware's does. A wait
// on a phase that never completes yields to the other threads, so the emulation reports a
// deadlock instead of spinning. EMU_BULK=1 takes the sm_90+ path of the kernels (one bulk copy a
// stage, an arrival with its byte count), 0 the cp.async path of sm_80-89 (each lane's copies,
// then its arrival).
#pragma once
#include "common.cuh"

#ifndef EMU_BULK
#define EMU_BULK 0
#endif
#define CUPOOL_BULK_COPY EMU_BULK

// Offset of a dynamic shared-memory object: the barriers and stage buffers the kernels address
// by their shared-window address live there.
CUPOOL_DEVICE u32 smem_addr(const void* p) {
    const char* base = reinterpret_cast<const char*>(emu_dyn_smem);
    const char* q = static_cast<const char*>(p);
    if (q < base) {
        std::fprintf(stderr, "cuda_emu: smem_addr of an address outside dynamic shared memory\n");
        std::abort();
    }
    return static_cast<u32>(q - base);
}

CUPOOL_DEVICE void* emu_smem_at(u32 addr) { return reinterpret_cast<char*>(emu_dyn_smem) + addr; }

// An mbarrier's 8 bytes: bits 0-31 pending transaction bytes (signed), 32-39 the arrivals a phase
// expects, 40-47 the arrivals still missing, 63 the phase bit.
struct EmuMbar {
    i32 tx;
    u8 count, pending, zero_, flags;
    bool phase() const { return flags & 0x80; }
};
static_assert(sizeof(EmuMbar) == 8, "an mbarrier is 8 bytes");

CUPOOL_DEVICE EmuMbar& emu_mbar(u32 bar) { return *static_cast<EmuMbar*>(emu_smem_at(bar)); }

CUPOOL_DEVICE void emu_mbar_settle(EmuMbar& b) {
    if (b.pending == 0 && b.tx == 0) {
        b.flags ^= 0x80;
        b.pending = b.count;
    }
}

CUPOOL_DEVICE void mbar_init(u32 bar, u32 count) {
    EmuMbar& b = emu_mbar(bar);
    std::memset(&b, 0, sizeof(b));
    b.count = b.pending = static_cast<u8>(count);
}

CUPOOL_DEVICE void emu_mbar_arrive(u32 bar) {
    EmuMbar& b = emu_mbar(bar);
    if (b.pending == 0) {
        std::fprintf(stderr, "cuda_emu: more arrivals on an mbarrier than its phase expects\n");
        std::abort();
    }
    --b.pending;
    emu_mbar_settle(b);
}

CUPOOL_DEVICE void mbar_arrive_expect(u32 bar, u32 bytes) {
    emu_mbar(bar).tx += static_cast<i32>(bytes);
    emu_mbar_arrive(bar);
}

CUPOOL_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    std::memcpy(emu_smem_at(dst), src, bytes);
    EmuMbar& b = emu_mbar(bar);
    b.tx -= static_cast<i32>(bytes);
    emu_mbar_settle(b);
}

// Until the phase of parity `parity` has completed (the phase bit moved past it).
CUPOOL_DEVICE void mbar_wait(u32 bar, u32 parity) {
    while (emu_mbar(bar).phase() == (parity != 0)) emu_pause();
}

CUPOOL_DEVICE void fence_proxy_async_smem() {}

CUPOOL_DEVICE void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }

// this thread's copies have all landed (they happen at once): one arrival
CUPOOL_DEVICE void cp_async_arrive_noinc(u32 bar) { emu_mbar_arrive(bar); }
