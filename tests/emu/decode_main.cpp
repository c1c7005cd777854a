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
//
// A ROUTE build routes the call itself: the input has, after `stride`, E (experts, one row each),
// norm_topk, has_active and eps (float32 bits) instead of launches, parts and has_fresh; then the
// rows, h [T·H], the router's weight [E·H], the norm's weight [H] (one bf16 a word), active [T]
// (has_active) and the row of each expert [E] (the table). Its output then goes on with x [T·H]
// (bf16), logits [T·E] (float32 bits), ids [W], weights [W] (W_DTYPE's bits), the row of each
// lane [W] (−1: padding) and the route counter, which must be back at zero.
#include "moe_decode.cu"  // the kernel, copied next to the emulated common.cuh and async_copy.cuh
#include "emu_io.h"

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "decode_main");
    if (!fo) return 2;
    const int T = (int)next(), H = (int)next(), W = (int)next(), topk = (int)next();
    const long long smem = next(), rows = next(), stride = next();
#if ROUTE
    const int experts = (int)next(), norm_topk = (int)next();
    const bool has_active = next();
    const float eps = __uint_as_float((u32)next());
    const int launches = 1;
    const std::vector<int> parts{2};
    const bool has_fresh = false;
#else
    const int launches = (int)next();
    std::vector<int> parts;
    for (int i = 0; i < launches; ++i) parts.push_back((int)next());
    const bool has_fresh = next();
#endif
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
    auto row_addr = [&](long long r) {
        return r < 0 ? (i64)0 : (i64)reinterpret_cast<uintptr_t>(row_base + r * stride);
    };
    std::vector<u16> x((size_t)T * H);
#if ROUTE
    std::vector<u16> h((size_t)T * H), rw((size_t)experts * H), nw(H);
    for (auto* a : {&h, &rw, &nw})
        for (auto& v : *a) v = (u16)next();
    std::vector<u8> active(T, 1);
    if (has_active)
        for (auto& v : active) v = (u8)next();
    std::vector<i64> table(experts);
    for (auto& a : table) a = row_addr(next());
    std::fill(x.begin(), x.end(), (u16)0x7fc0);                   // poisoned: the kernel writes it
    std::vector<i64> lane_addr(W, -1);
    std::vector<float> logits((size_t)T * experts, __uint_as_float(0x7fc00000u));
    std::vector<i32> ids(W, 7777), route_count(1, 0);
    std::vector<u32> wts(W, 0x7fc07fc0u);                          // f32 or bf16 bits, poisoned
#else
    for (auto& v : x) v = (u16)next();
    std::vector<i64> lane_addr(W);
    for (auto& a : lane_addr) a = row_addr(next());
    std::vector<i32> fresh(W, 0);
    if (has_fresh)
        for (auto& f : fresh) f = (i32)next();
    std::vector<float> wts(W);
    for (auto& w : wts) w = __uint_as_float((u32)next());
#endif
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
#if ROUTE
            moe_decode(x.data(), T, H, nullptr, nullptr, nullptr, W, topk, part, act.data(),
                       yw.data(), group_done.data(), sync.data(), out.data(), error.data(), nullptr,
                       h.data(), rw.data(), nw.data(), eps, experts, norm_topk,
                       has_active ? active.data() : nullptr, table.data(), x.data(), logits.data(),
                       ids.data(), wts.data(), lane_addr.data(), route_count.data());
#else
            moe_decode(x.data(), T, H, lane_addr.data(), has_fresh ? fresh.data() : nullptr,
                       wts.data(), W, topk, part, act.data(), yw.data(), group_done.data(),
                       sync.data(), out.data(), error.data(), nullptr);
#endif
        });
    }
#if ROUTE
    std::vector<u32> logit_bits(logits.size()), weight_bits(W);
    for (size_t i = 0; i < logits.size(); ++i) logit_bits[i] = __float_as_uint(logits[i]);
    const u8* wb = reinterpret_cast<const u8*>(wts.data());
    for (int i = 0; i < W; ++i)
        weight_bits[i] = W_DTYPE == 0 ? reinterpret_cast<const u32*>(wb)[i]
                                      : (u32)reinterpret_cast<const u16*>(wb)[i];
    std::vector<long long> lane_rows(W);
    for (int i = 0; i < W; ++i)
        lane_rows[i] = lane_addr[i] == 0 ? -1 : (lane_addr[i] - row_addr(0)) / stride;
    return emu_finish(fo, out, error, sync, group_done, x, logit_bits, ids, weight_bits,
                      lane_rows, route_count);
#else
    return emu_finish(fo, out, error, sync, group_done);
#endif
}
