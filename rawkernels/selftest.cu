// The smallest kernel that exercises the whole path (loader, header inlining, launch on torch's
// stream, graph capture): y[i] = a * x[i] + b[0], with b read from device memory so a captured
// graph sees new values of b without recapture. Used by `python -m cupool info` and the tests.
#include "common.cuh"

extern "C" __global__ void axpb(const float* __restrict__ x, const float* __restrict__ b,
                                float* __restrict__ y, float a, i32 n) {
    const float bias = *b;
    for (i32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = a * x[i] + bias;
}

// out[0] = __CUDA_ARCH__ of the code that runs: 10 x the architecture the loader built for (the
// GPU's own, or CUPOOL_ARCH's, whose PTX the driver compiled). `cupool info` and the tests read
// it to show which code a GPU runs.
extern "C" __global__ void cuda_arch(i32* __restrict__ out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = __CUDA_ARCH__;
}
