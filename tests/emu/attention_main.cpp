// Runs rawkernels/dense_attention.cu's decode attention on CPU fibers (cuda_emu.h), the blocks of
// its grid (NS, hk, B) one after another, and writes what it wrote, for
// tests/test_attention_emu.py to compare with the reference. D, G, MINCHUNK, AHEAD, ROT, QGATE
// and NORM1 are the build's defines.
//
// Input (int64 words): B, S (the cache's slots), nh, hk, L, NS, window, has_q_norm, has_k_norm,
// has_sinks, has_slots, the bits of eps and scale (float32), pos[B], slots[B] (each token's slot;
// only with has_slots, else S = B and token b's slot is b); then one bf16 a word:
// qkv[B·(nh + 2hk)·D] (with QGATE [B·(2nh + 2hk)·D], each query head's gate after it), k_cache
// and v_cache [S·hk·L·D] each, cos and sin [L·D] each, q_norm[D], k_norm[D], sinks[nh] (the
// absent ones left out).
// Output (int64 words): out[B·nh·D] (bf16), k_cache, v_cache (bf16), count[B·hk·COUNTERS].
#include "dense_attention.cu"  // the kernel, copied next to the emulated common.cuh
#include "emu_io.h"

static std::vector<u16> words(long long n) {
    std::vector<u16> v(n);
    for (auto& x : v) x = (u16)next();
    return v;
}

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "attention_main");
    if (!fo) return 2;
    const int B = (int)next(), S = (int)next(), nh = (int)next(), hk = (int)next();
    const int L = (int)next(), NS = (int)next(), window = (int)next();
    const bool has_qn = next(), has_kn = next(), has_sinks = next(), has_slots = next();
    const u32 eps_bits = (u32)next(), scale_bits = (u32)next();
    const float eps = __uint_as_float(eps_bits), scale = __uint_as_float(scale_bits);
    std::vector<i64> pos(B);
    for (auto& p : pos) p = next();
    std::vector<i64> slots(has_slots ? B : 0);
    for (auto& c : slots) c = next();
    std::vector<u16> qkv = words((long long)B * (QCOL * nh + 2 * hk) * D);
    std::vector<u16> kc = words((long long)S * hk * L * D), vc = words((long long)S * hk * L * D);
    std::vector<u16> cs = words((long long)L * D), sn = words((long long)L * D);
    std::vector<u16> qn = has_qn ? words(D) : std::vector<u16>();
    std::vector<u16> kn = has_kn ? words(D) : std::vector<u16>();
    std::vector<u16> sk = has_sinks ? words(nh) : std::vector<u16>();
    if (emu_at != emu_in.size()) {
        std::fprintf(stderr, "attention_main: %zu input words left over\n", emu_in.size() - emu_at);
        return 2;
    }
    // the workspace as the launcher allocates it; part_o poisoned (NaN), so a part the merge
    // reads without its block having written it shows
    std::vector<float> part_o((size_t)B * nh * NS * D, __uint_as_float(0x7fc00000u));
    std::vector<float> part_ml((size_t)B * nh * NS * 2, __uint_as_float(0x7fc00000u));
    std::vector<i32> count((size_t)B * hk * COUNTERS, 0);
    std::vector<u16> out((size_t)B * nh * D, 0x7fc0);
    emu_launch_grid({(unsigned)NS, (unsigned)hk, (unsigned)B}, THREADS, 0, [&] {
        dense_attention(qkv.data(), nh, hk, has_qn ? qn.data() : nullptr,
                        has_kn ? kn.data() : nullptr, eps, cs.data(), sn.data(), pos.data(),
                        has_slots ? slots.data() : nullptr, kc.data(), vc.data(), L, scale, window,
                        has_sinks ? sk.data() : nullptr, part_o.data(), part_ml.data(),
                        count.data(), out.data());
    });
    return emu_finish(fo, out, kc, vc, count);
}
