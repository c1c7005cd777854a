// Runs rawkernels/host_handoff.cu's host_post and then host_wait on CPU threads (cuda_emu.h), each
// as a grid of the given blocks run one after another, over a mailbox in ordinary memory, and
// writes what they left, for tests/test_handoff_emu.py.
//
// Input (int64 words): n, lanes, blocks, x[n] (X_DTYPE's bits), keys[lanes], weights[lanes]
// (W_DTYPE's bits), counter[3], seq, answer (1: the host answers the post, its done word set to
// the post's number; 0: done stays at the next word), done, y[n] (Y_DTYPE's bits), out[n]
// (float32 bits). The mailbox's x, keys and weights start poisoned.
// Output (int64 words): mx[n] (float32 bits), mkeys[lanes], mweights[lanes] (float32 bits),
// counter[3], seq, size (the mailbox's word; it starts poisoned), y[n] (Y_DTYPE's bits), error.
#include <cstring>
#include <type_traits>

#include "host_handoff.cu"  // the kernel, copied next to the emulated common.cuh
#include "emu_io.h"

template <int D>
using Word = std::conditional_t<D == 0, u32, u16>;   // one element's bits

constexpr u32 POISON = 0x7FBADBADu;                    // a NaN no conversion makes

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "handoff_main");
    if (!fo) return 2;
    const int n = (int)next(), lanes = (int)next(), blocks = (int)next();
    std::vector<Word<X_DTYPE>> x(n);
    for (auto& v : x) v = (Word<X_DTYPE>)next();
    std::vector<i64> keys(lanes);
    for (auto& v : keys) v = next();
    std::vector<Word<W_DTYPE>> w(lanes);
    for (auto& v : w) v = (Word<W_DTYPE>)next();
    i32 counter[3];
    for (auto& v : counter) v = (i32)next();
    u32 seq = (u32)next(), size = POISON;
    const bool answer = next() != 0;
    u32 done = (u32)next();
    std::vector<Word<Y_DTYPE>> y(n);
    for (auto& v : y) v = (Word<Y_DTYPE>)next();
    std::vector<float4> out_buf((n + 3) / 4 + 1), mx_buf((n + 3) / 4 + 1);   // 16-byte aligned
    float* out = reinterpret_cast<float*>(out_buf.data());
    float* mx = reinterpret_cast<float*>(mx_buf.data());
    for (int i = 0; i < n; ++i) {
        const u32 bits = (u32)next();
        std::memcpy(out + i, &bits, 4);
        std::memcpy(mx + i, &POISON, 4);
    }
    std::vector<i64> mkeys(lanes, -7);
    std::vector<float> mweights(lanes);
    for (auto& v : mweights) std::memcpy(&v, &POISON, 4);
    i32 error = 0;

    emu_launch_grid({(unsigned)blocks, 1, 1}, 256, 0, [&] {
        host_post(x.data(), n, keys.data(), w.data(), lanes, counter, &seq, &size, mx,
                  mkeys.data(), mweights.data());
    });
    if (answer) done = seq;
    emu_launch_grid({(unsigned)blocks, 1, 1}, 256, 0, [&] {
        host_wait(counter, &done, out, n, y.data(), &error);
    });

    std::vector<u32> mx_bits(n), mw_bits(lanes);
    std::memcpy(mx_bits.data(), mx, 4 * (size_t)n);
    std::memcpy(mw_bits.data(), mweights.data(), 4 * (size_t)lanes);
    const std::vector<i32> counters(counter, counter + 3);
    const std::vector<u32> seqs{seq, size};
    const std::vector<i32> errors{error};
    return emu_finish(fo, mx_bits, mkeys, mw_bits, counters, seqs, y, errors);
}
