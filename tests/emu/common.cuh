// CPU stand-in for rawkernels/common.cuh (tests/emu): the same types and helpers without PTX.
// The emulation harness puts this file next to a copy of the kernel source, so the kernel's
// `#include "common.cuh"` finds it instead of the real one.
#pragma once
#include "cuda_emu.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define CUPOOL_DEVICE __device__ __forceinline__

struct alignas(16) u32x4 { u32 x, y, z, w; };

CUPOOL_DEVICE u32x4 ld_stream16(const void* p) { return *static_cast<const u32x4*>(p); }

CUPOOL_DEVICE void st16(void* p, u32x4 v) { *static_cast<u32x4*>(p) = v; }
