// Runs rawkernels/moe_decode.cu on CPU fibers (cuda_emu.h) as ONE block of 256 threads, which
// then takes every item of the call in order (w13 items first, so each w2 item's wait is already
// met), and writes what it wrote, for tests/test_decode_emu.py to compare with the reference.
// HP, IP, NT, MAXW, W13_KSPLIT, the activation and row macros and EMU_BULK are the build's
// defines; moe_decode.cu's `extern __shared__` array is the emulation's dynamic shared memory.
//
// Input (int64 words): T, H, W, topk, smem (dynamic shared bytes), rows, stride (bytes a row,
// a multiple of 16), launches; the part of each launch (0 rows in place, 1 fresh rows, 2 all);
// has_fresh; then the rows' bytes (rows · stride / 8 words, little-endian), x [T·H] (one bf16 a
// word), the row of each lane [W] (−1: padding), lane_fresh [W] (has_fresh), the router weight
// of each lane [W] (float32 bits).
// Output (int64 words): out [T·H] (bf16), the error word, then the counters that must be back at
// zero: sync [2 + W] and group_done [HP / 16].
#include "moe_decode.cu"  // the kernel, copied next to the emulated common.cuh and async_copy.cuh
#include "emu_io.h"

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "decode_main");
    if (!fo) return 2;
    const int T = (int)next(), H = (int)next(), W = (int)next(), topk = (int)next();
    const long long smem = next(), rows = next(), stride = next();
    const int launches = (int)next();
    std::vector<int> parts;
    for (int i = 0; i < launches; ++i) parts.push_back((int)next());
    const bool has_fresh = next();
    if (stride % 16 != 0) {
        std::fprintf(stderr, "decode_main: a row stride of %lld bytes is not 16-byte aligned\n", stride);
        return 2;
    }
    // the rows, 128-byte aligned as the bank's and the host store's are
    std::vector<u64> row_words((size_t)(rows * stride / 8) + 16);
    u8* row_base = reinterpret_cast<u8*>(row_words.data());
    row_base += (128 - reinterpret_cast<uintptr_t>(row_base) % 128) % 128;
    for (long long i = 0; i < rows * stride / 8; ++i) {
        const u64 v = (u64)next();
        std::memcpy(row_base + 8 * i, &v, 8);
    }
    std::vector<u16> x((size_t)T * H);
    for (auto& v : x) v = (u16)next();
    std::vector<i64> lane_addr(W);
    for (auto& a : lane_addr) {
        const long long r = next();
        a = r < 0 ? 0 : (i64)reinterpret_cast<uintptr_t>(row_base + r * stride);
    }
    std::vector<i32> fresh(W, 0);
    if (has_fresh)
        for (auto& f : fresh) f = (i32)next();
    std::vector<float> wts(W);
    for (auto& w : wts) w = __uint_as_float((u32)next());
    if (emu_at != emu_in.size()) {
        std::fprintf(stderr, "decode_main: %zu input words left over\n", emu_in.size() - emu_at);
        return 2;
    }
    // the workspaces as the launcher allocates them; act, yw and out poisoned (NaN)
    std::vector<u16> act((size_t)W * IP, 0x7fc0), out((size_t)T * H, 0x7fc0);
    std::vector<float> yw((size_t)W * HP, __uint_as_float(0x7fc00000u));
    std::vector<i32> group_done(HP / 16, 0), sync(2 + W, 0), error(1, 0);
    for (int part : parts) {
        emu_launch(THREADS, (std::size_t)smem, [&] {
            moe_decode(x.data(), T, H, lane_addr.data(), has_fresh ? fresh.data() : nullptr,
                       wts.data(), W, topk, part, act.data(), yw.data(), group_done.data(),
                       sync.data(), out.data(), error.data(), nullptr);
        });
    }
    return emu_finish(fo, out, error, sync, group_done);
}
