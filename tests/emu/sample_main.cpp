// Runs rawkernels/sample.cu's three launches on CPU fibers (cuda_emu.h), each grid's blocks one
// after another, and writes the tokens and what the calls leave in the workspace, for
// tests/test_sample_emu.py to compare with cupool.sampling.sample. THREADS, ITEMS and IN_F16 are
// the build's defines.
//
// Input (int64 words): B, V, calls; then per row the bits of temperature (float32), top_k, the
// bits of top_p (float32), seed, step; then the logits, one 16-bit value a word, B·V.
// Output (int64 words): out[B] of each call (the step advanced by one between calls), then
// the workspace after the last: the histogram's sum, best[B], tickets[2B], cut[B·CUT_WORDS].
#include "sample.cu"  // the kernel, copied next to the emulated common.cuh
#include "emu_io.h"

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "sample_main");
    if (!fo) return 2;
    const int B = (int)next(), V = (int)next(), calls = (int)next();
    std::vector<float> temperature(B), top_p(B);
    std::vector<i64> top_k(B), seeds(B), steps(B);
    for (int b = 0; b < B; ++b) {
        temperature[b] = __uint_as_float((u32)next());
        top_k[b] = next();
        top_p[b] = __uint_as_float((u32)next());
        seeds[b] = next();
        steps[b] = next();
    }
    std::vector<u16> logits((size_t)B * V);
    for (auto& x : logits) x = (u16)next();
    if (emu_at != emu_in.size()) {
        std::fprintf(stderr, "sample_main: %zu input words left over\n", emu_in.size() - emu_at);
        return 2;
    }
    const int blocks = (V + IDS_PER_BLOCK - 1) / IDS_PER_BLOCK;
    // the workspace as the launcher allocates it (zeroed); the block counts poisoned, since a
    // block reads only those sample_rank wrote in the same call
    std::vector<u32> hist((size_t)B * HIST_WORDS, 0u);
    std::vector<i32> cut((size_t)B * CUT_WORDS, 0), tickets((size_t)2 * B, 0);
    std::vector<i32> counts((size_t)B * blocks, 0x7eadbeef);
    std::vector<u64> best(B, 0ull);
    std::vector<i64> out(B), all;
    for (int c = 0; c < calls; ++c) {
        std::fill(out.begin(), out.end(), (i64)-7);        // poisoned
        const EmuDim3 grid{(unsigned)blocks, (unsigned)B, 1};
        emu_launch_grid(grid, THREADS, 0, [&] {
            sample_histogram(logits.data(), V, V, hist.data(), tickets.data(), temperature.data(),
                             top_k.data(), top_p.data(), cut.data());
        });
        emu_launch_grid(grid, THREADS, 0, [&] {
            sample_rank(logits.data(), V, V, cut.data(), counts.data());
        });
        emu_launch_grid(grid, THREADS, 0, [&] {
            sample_draw(logits.data(), V, V, cut.data(), counts.data(), temperature.data(),
                        seeds.data(), steps.data(), best.data(), tickets.data(), out.data());
        });
        all.insert(all.end(), out.begin(), out.end());
        for (auto& s : steps) ++s;
    }
    long long hist_sum = 0;
    for (u32 h : hist) hist_sum += h;
    std::vector<long long> tail{hist_sum};
    return emu_finish(fo, all, tail, best, tickets, cut);
}
