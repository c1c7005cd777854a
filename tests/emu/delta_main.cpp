// Runs rawkernels/delta_decode.cu's gated delta net step on CPU fibers (cuda_emu.h), the blocks of
// its grid (nv, B) one after another, and writes what it wrote, for tests/test_delta_emu.py to
// compare with the reference. DK, DV, KC and GROUPED are the build's defines.
//
// Input (int64 words): B, S (the slots), nk, nv, width, has_slots, the bits of eps (float32),
// pos[B], slots[B] (only with has_slots, else S = B and token b's slot is b); then one bf16 a
// word: proj[B·width], conv_state[S·C·KC], conv_w[C·KC], norm_w[DV]; then one float32's bits a
// word: state[S·nv·DK·DV], neg_a[nv], dt_bias[nv].
// Output (int64 words): out[B·nv·DV] (bf16), conv_state (bf16), state (float32 bits),
// count[B·nk].
#include "delta_decode.cu"  // the kernel, copied next to the emulated common.cuh
#include "emu_io.h"

static std::vector<u16> words(long long n) {
    std::vector<u16> v(n);
    for (auto& x : v) x = (u16)next();
    return v;
}

static std::vector<float> floats(long long n) {
    std::vector<float> v(n);
    for (auto& x : v) x = __uint_as_float((u32)next());
    return v;
}

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "delta_main");
    if (!fo) return 2;
    const int B = (int)next(), S = (int)next(), nk = (int)next(), nv = (int)next();
    const int width = (int)next();
    const bool has_slots = next();
    const float eps = __uint_as_float((u32)next());
    std::vector<i64> pos(B);
    for (auto& p : pos) p = next();
    std::vector<i64> slots(has_slots ? B : 0);
    for (auto& c : slots) c = next();
    const long long C = 2LL * nk * DK + (long long)nv * DV;
    std::vector<u16> proj = words((long long)B * width), conv = words((long long)S * C * KC);
    std::vector<u16> conv_w = words(C * KC), norm_w = words(DV);
    std::vector<float> state = floats((long long)S * nv * DK * DV);
    std::vector<float> neg_a = floats(nv), dt_bias = floats(nv);
    if (emu_at != emu_in.size()) {
        std::fprintf(stderr, "delta_main: %zu input words left over\n", emu_in.size() - emu_at);
        return 2;
    }
    std::vector<i32> count((size_t)B * nk, 0);
    std::vector<u16> out((size_t)B * nv * DV, 0x7fc0);   // poisoned: NaN
    emu_launch_grid({(unsigned)nv, (unsigned)B, 1u}, THREADS, 0, [&] {
        delta_decode(proj.data(), width, nk, pos.data(), has_slots ? slots.data() : nullptr,
                     conv.data(), conv_w.data(), state.data(), neg_a.data(), dt_bias.data(),
                     norm_w.data(), eps, count.data(), out.data());
    });
    std::vector<u32> state_bits(state.size());
    for (size_t i = 0; i < state.size(); ++i) state_bits[i] = __float_as_uint(state[i]);
    return emu_finish(fo, out, conv, state_bits, count);
}
