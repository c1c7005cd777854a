// Host build of rawkernels/nvfp4_quant.cu's arithmetic, so CPU tests can hold it against the torch
// reference bit for bit without a GPU (tests/test_nvfp4_kernel_host.py builds and drives this).
// Only the indexing and atomics of the two kernels stay untested here; the GPU test covers them.
//
// Usage (raw little-endian files):
//   harness quant <dt 0|1|2> M N K in.bin out.bin   pass 1 + pass 2 on contiguous [M, N, K] input;
//                                                   out = packed [M,N,K/2] | scales [M,N,K/16] | g [M]
//   harness e4m3 in.bin out.bin                     float32 values -> e4m3_rne bytes
//   harness e2m1 in.bin out.bin                     float32 values -> e2m1_magnitude bytes
//   harness f16 out.bin                             all 65536 half bit patterns -> float32
#include "nvfp4_quant.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static std::vector<unsigned char> slurp(const char* path) {
    std::vector<unsigned char> buf;
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::perror(path); std::exit(2); }
    unsigned char tmp[1 << 16];
    size_t n;
    while ((n = std::fread(tmp, 1, sizeof tmp, f)) > 0) buf.insert(buf.end(), tmp, tmp + n);
    std::fclose(f);
    return buf;
}

static void spit(const char* path, const std::vector<unsigned char>& buf) {
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(buf.data(), 1, buf.size(), f) != buf.size()) { std::perror(path); std::exit(2); }
    std::fclose(f);
}

template <int DT>
static void quant(long long M, long long N, long long K, const std::vector<unsigned char>& in,
                  std::vector<unsigned char>& out) {
    constexpr int PV = Elem<DT>::per_vec;
    const long long per_mat_vecs = N * K / PV;
    const u32x4* vec = reinterpret_cast<const u32x4*>(in.data());
    out.assign(M * N * K / 2 + M * N * K / 16 + 4 * M, 0);
    unsigned char* packed = out.data();
    unsigned char* scales = packed + M * N * K / 2;
    unsigned char* gs = scales + M * N * K / 16;
    for (long long m = 0; m < M; ++m) {
        u32 best = 0;                              // pass 1, in the kernel's own terms
        for (long long v = 0; v < per_mat_vecs; ++v)
            best = max_u32(best, absmax_to_f32_bits<DT>(vec_absmax<DT>(vec[m * per_mat_vecs + v])));
        const float g = global_scale(best);
        std::memcpy(gs + 4 * m, &g, 4);
        for (long long b = 0; b < N * K / 16; ++b) {   // pass 2
            float w[16];
            for (int j = 0; j < 16 / PV; ++j)
                for (int i = 0; i < PV; ++i)
                    w[j * PV + i] = Elem<DT>::to_f32(
                        Elem<DT>::at(vec[m * per_mat_vecs + b * (16 / PV) + j], i));
            u32 sc, lo, hi;
            quant_block16(w, g, sc, lo, hi);
            const long long o = m * N * K / 16 + b;
            std::memcpy(packed + 8 * o, &lo, 4);
            std::memcpy(packed + 8 * o + 4, &hi, 4);
            scales[o] = (unsigned char)sc;
        }
    }
}

int main(int argc, char** argv) {
    if (argc < 3) { std::fprintf(stderr, "usage: see the file header\n"); return 2; }
    std::vector<unsigned char> out;
    if (!std::strcmp(argv[1], "quant") && argc == 8) {
        const int dt = std::atoi(argv[2]);
        const long long M = std::atoll(argv[3]), N = std::atoll(argv[4]), K = std::atoll(argv[5]);
        const std::vector<unsigned char> in = slurp(argv[6]);
        const long long esize = dt == DT_F32 ? 4 : 2;
        if ((long long)in.size() != M * N * K * esize) { std::fprintf(stderr, "size mismatch\n"); return 2; }
        if (dt == DT_F32) quant<DT_F32>(M, N, K, in, out);
        else if (dt == DT_F16) quant<DT_F16>(M, N, K, in, out);
        else quant<DT_BF16>(M, N, K, in, out);
        spit(argv[7], out);
    } else if ((!std::strcmp(argv[1], "e4m3") || !std::strcmp(argv[1], "e2m1")) && argc == 4) {
        const std::vector<unsigned char> in = slurp(argv[2]);
        const bool e4m3 = argv[1][1] == '4';
        out.resize(in.size() / 4);
        for (size_t i = 0; i < out.size(); ++i) {
            float v;
            std::memcpy(&v, in.data() + 4 * i, 4);
            out[i] = (unsigned char)(e4m3 ? e4m3_rne(v) : e2m1_magnitude(v));
        }
        spit(argv[3], out);
    } else if (!std::strcmp(argv[1], "f16") && argc == 3) {
        out.resize(4 * 65536);
        for (u32 h = 0; h < 65536; ++h) {
            const float f = f16_to_f32(h);
            std::memcpy(out.data() + 4 * h, &f, 4);
        }
        spit(argv[2], out);
    } else {
        std::fprintf(stderr, "bad arguments\n");
        return 2;
    }
    return 0;
}
