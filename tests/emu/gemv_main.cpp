// Runs rawkernels/dense_gemv.cu on CPU fibers (cuda_emu.h), the blocks of its grid (tiles, KS)
// one after another, and writes what it wrote, for tests/test_gemv_emu.py to compare with the
// reference. NB, MODE, EPI, WFP4, PRE, WARPS, RT, KS, LANE_ADDR, SIG and GATE are the build's
// defines.
//
// Input (int64 words): n0, n1, n2 (rows of the three matrices), K, has_bias, has_add, has_res2,
// the bits of eps (float32), topk, norm_topk, w_f32, has_active; then one bf16 a word: w0, w1, w2
// ([n·K] each), b0, b1, b2 ([n] each, has_bias), in [NB·K] (MODE 2: [NB·(2K + GATE)], a gated
// MLP's gate and up output), add [NB·K] (has_add), nw [K] (MODE 1), res2 [NB·N] (has_res2);
// then active [NB] (has_active), table [N] (LANE_ADDR), a word each; a SIG build (sigmoid
// routing) then reads the correction bias [N] and the scale, float32 bits a word.
// Output (int64 words): out [NB·N] (bf16; EPI 0 and 1), h_out and x_out [NB·K] (bf16; MODE 1),
// logits [NB·N] (float32 bits), ids [NB·topk], weights [NB·topk] (bf16, or float32 bits with
// w_f32), lane_addr [NB·topk] (EPI 2), the routing ticket (EPI 2) and the tiles' tickets (KS > 1).
// A WFP4 build (NVFP4 weights) reads, after has_active, the three global scales (float32 bits),
// and in place of the bf16 w0, w1, w2 their strips (cupool.layout.dense_strips: ceil(n/16) ·
// 9 · Kp bytes each, Kp = K rounded up to 64), 8 bytes a word, little-endian.
// Every output starts poisoned (NaN, or -7 for ids and lane addresses), so what a block should
// have written and did not shows.
#include "dense_gemv.cu"  // the kernel, copied next to the emulated common.cuh
#include "emu_io.h"

static std::vector<u16> words(long long n) {
    std::vector<u16> v(n);
    for (auto& x : v) x = (u16)next();
    return v;
}

// The strips of a matrix of n rows, 16-byte aligned as the kernel's 16-byte loads need (a strip
// is 9 · Kp bytes, a multiple of 16, so every strip and chunk stays aligned).
static std::vector<u32x4> strips(int n, int K) {
    const long long bytes = (long long)(n + 15) / 16 * 9 * ((K + 63) / 64 * 64);
    std::vector<u32x4> v((size_t)(bytes / 16));
    u8* p = reinterpret_cast<u8*>(v.data());
    for (long long i = 0; i < bytes / 8; ++i) {
        const u64 w = (u64)next();
        std::memcpy(p + 8 * i, &w, 8);
    }
    return v;
}

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "gemv_main");
    if (!fo) return 2;
    const int n0 = (int)next(), n1 = (int)next(), n2 = (int)next(), K = (int)next();
    const bool has_bias = next(), has_add = next(), has_res2 = next();
    const float eps = __uint_as_float((u32)next());
    const int topk = (int)next(), norm_topk = (int)next(), w_f32 = (int)next();
    const bool has_active = next();
    const int N = n0 + n1 + n2;
#if WFP4
    float gs[3];
    for (float& g : gs) g = __uint_as_float((u32)next());
    std::vector<u32x4> w0 = strips(n0, K), w1 = strips(n1, K), w2 = strips(n2, K);
    auto wptr = [](std::vector<u32x4>& v) {
        return v.empty() ? nullptr : reinterpret_cast<const u8*>(v.data());
    };
#else
    std::vector<u16> w0 = words((long long)n0 * K), w1 = words((long long)n1 * K);
    std::vector<u16> w2 = words((long long)n2 * K);
    auto wptr = [](std::vector<u16>& v) { return v.empty() ? nullptr : v.data(); };
#endif
    std::vector<u16> b0, b1, b2;
    if (has_bias) {
        b0 = words(n0);
        b1 = words(n1);
        b2 = words(n2);
    }
    std::vector<u16> in = words((long long)NB * (MODE == 2 ? 2 * K + GATE : K));
    std::vector<u16> add = has_add ? words((long long)NB * K) : std::vector<u16>();
    std::vector<u16> nw = MODE == 1 ? words(K) : std::vector<u16>();
    std::vector<u16> res2 = has_res2 ? words((long long)NB * N) : std::vector<u16>();
    std::vector<u8> active;
    if (has_active)
        for (int n = 0; n < NB; ++n) active.push_back((u8)next());
    std::vector<i64> table;
    if (LANE_ADDR)
        for (int i = 0; i < N; ++i) table.push_back(next());
#if SIG
    std::vector<float> sbias;
    for (int i = 0; i < N; ++i) sbias.push_back(__uint_as_float((u32)next()));
    const float sscale = __uint_as_float((u32)next());
#endif
    if (emu_at != emu_in.size()) {
        std::fprintf(stderr, "gemv_main: %zu input words left over\n", emu_in.size() - emu_at);
        return 2;
    }
    const u16 nan16 = 0x7fc0;
    const float nan32 = __uint_as_float(0x7fc00000u);
    std::vector<u16> out((size_t)NB * N, nan16), h_out((size_t)NB * K, nan16);
    std::vector<u16> x_out((size_t)NB * K, nan16);
    std::vector<float> logits((size_t)NB * N, nan32);
    std::vector<i32> ids((size_t)NB * topk, -7);
    std::vector<u32> wts((size_t)NB * topk, w_f32 ? 0x7fc00000u : 0x7fc07fc0u);
    std::vector<i64> lane_addr((size_t)NB * topk, -7);
    const int tiles = (N + 16 * RT - 1) / (16 * RT);
    std::vector<i32> ticket(1, 0), tile_ticket(tiles, 0);
    std::vector<float> partial((size_t)KS * NB * N, nan32);
    auto ptr = [](std::vector<u16>& v) { return v.empty() ? nullptr : v.data(); };
    emu_launch_grid({(unsigned)tiles, (unsigned)KS, 1}, WARPS * 32, 0, [&] {
        dense_gemv(wptr(w0), wptr(w1), wptr(w2), n0, n1, N, K,
#if WFP4
                   gs[0], gs[1], gs[2],
#endif
                   ptr(b0), ptr(b1), ptr(b2), in.data(), ptr(add), ptr(nw), eps,
                   MODE == 1 && has_add ? h_out.data() : nullptr,
                   MODE == 1 ? x_out.data() : nullptr, ptr(res2), out.data(), logits.data(),
                   ids.data(), wts.data(), topk, norm_topk, w_f32,
                   has_active ? active.data() : nullptr, ticket.data()
#if KS > 1
                   , partial.data(), tile_ticket.data()
#endif
#if LANE_ADDR
                   , table.data(), lane_addr.data()
#endif
#if SIG
                   , sbias.data(), sscale
#endif
        );
    });
    std::vector<u32> logit_bits(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) logit_bits[i] = __float_as_uint(logits[i]);
    put(fo, out);
    put(fo, h_out);
    put(fo, x_out);
    put(fo, logit_bits);
    put(fo, ids);
    if (w_f32) {
        put(fo, wts);
    } else {
        const u16* half = reinterpret_cast<const u16*>(wts.data());
        put(fo, half, (long long)NB * topk);
    }
    return emu_finish(fo, lane_addr, ticket, tile_ticket);
}
