// The host expert pool's threading (rawkernels/host_experts.c) under a race detector: built with
// -fsanitize=thread by tests/test_host_experts.py and run there.
//
//     host_pool_harness THREADS CALLS SPIN_NS
//
// A pool of THREADS (more than the machine's CPUs, so workers come late to jobs and sleep between
// them with SPIN_NS 0) and a one-thread pool answer the same CALLS random expert calls over rows of
// random bytes, with read-probe jobs between them, then a served mailbox's requests posted from
// this thread; every answer must equal the one-thread pool's, bit for bit. Prints the count of
// mismatches; exits 1 if there is any.
#include "host_experts.c"

#include <stdio.h>

#define H 120                  // hidden, padded to 128
#define I 64
#define E 6                    // rows
#define T 2
#define K 3
#define ROW_BYTES 16384        // past the header, w13 and w2 of this layout

static uint32_t next_random(uint32_t* s) {
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static void random_call(uint32_t* s, int64_t* keys, float* w, float* x) {
    for (int i = 0; i < T * K; ++i) {
        keys[i] = (int64_t)(next_random(s) % (E + 1)) - 1;     // -1 is padding
        w[i] = 0.25f;
    }
    for (int i = 0; i < T * H; ++i) x[i] = (float)(next_random(s) % 2001) / 1000.0f - 1.0f;
}

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s THREADS CALLS SPIN_NS\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[1]), calls = atoi(argv[2]);
    const int64_t spin_ns = atoll(argv[3]);
    const hx_layout L = {H, I, 128, I, HEADER_BYTES + 2 * (I / 16) * 9 * 128, -1, 1, 0, 0.0f, 0.0f};
    uint8_t* rows = aligned_alloc(64, (size_t)E * ROW_BYTES);
    uint32_t s = 12345;
    for (int i = 0; i < E * ROW_BYTES; ++i) rows[i] = next_random(&s) & 0x77;  // finite scales
    int64_t table[E];
    for (int e = 0; e < E; ++e) {
        float* global = (float*)(rows + (size_t)e * ROW_BYTES);
        global[0] = global[1] = global[2] = 1e-3f;
        table[e] = (int64_t)(intptr_t)(rows + (size_t)e * ROW_BYTES);
    }
    hx_pool* many = hx_create(threads, spin_ns);
    hx_pool* one = hx_create(1, spin_ns);
    if (!many || !one) {
        fprintf(stderr, "hx_create failed\n");
        return 2;
    }
    int64_t keys[T * K];
    float w[T * K], x[T * H], a[T * H], b[T * H];
    long bad = 0;
    for (int c = 0; c < calls; ++c) {
        random_call(&s, keys, w, x);
        const int ea = hx_run(many, &L, table, E, T, K, keys, w, x, a);
        const int eb = hx_run(one, &L, table, E, T, K, keys, w, x, b);
        bad += ea != eb || memcmp(a, b, sizeof a) != 0;
        if (c % 25 == 0) {
            uint64_t sa, sb;
            hx_read(many, rows, (int64_t)E * ROW_BYTES, &sa);
            hx_read(one, rows, (int64_t)E * ROW_BYTES, &sb);
            bad += sa != sb;
        }
    }
    // a served mailbox: this thread posts (writes the request and its size, then bumps seq) and
    // waits for done; requests of 1 to T tokens, each compared over its own rows
    static uint32_t seq = 0, done = 0, size = 0;
    int64_t mkeys[T * K];
    float mw[T * K], mx[T * H], mout[T * H];
    if (hx_serve(many, &L, table, E, T, K, &seq, &done, &size, mkeys, mw, mx, mout)) {
        fprintf(stderr, "hx_serve failed\n");
        return 2;
    }
    for (uint32_t r = 1; r <= (uint32_t)calls / 4; ++r) {
        const int t = 1 + (int)(r % T);
        random_call(&s, mkeys, mw, mx);
        size = (uint32_t)(t * K);
        __atomic_store_n(&seq, r, __ATOMIC_RELEASE);
        while (__atomic_load_n(&done, __ATOMIC_ACQUIRE) != r) hx_pause();
        hx_run(one, &L, table, E, t, K, mkeys, mw, mx, b);
        bad += memcmp(mout, b, sizeof(float) * (size_t)t * H) != 0;
    }
    hx_serve_stop(many, NULL);
    hx_destroy(many);
    hx_destroy(one);
    free(rows);
    printf("%d threads, %d calls: %ld mismatches\n", threads, calls, bad);
    return bad != 0;
}
