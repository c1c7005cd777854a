// Runs rawkernels/planner.cu's plan step on CPU threads (cuda_emu.h) over a trace, and writes
// every step's outputs and tables, for tests/_planner_emu.py to compare with the reference.
//
// Input (int64 words): R, E, L, S, max_lanes, rows_base, row_stride, steps, C (ring capacity, a
// power of two >= R), key_of[R], then per step: gate, layer, kind (0 plan step, 1 prefetch step:
// the PREFETCH build only), promote (the launch's promotion cap, 0: none), is64, W, ids[W].
// Output per step (int64 words): routes[W], lane_addr[W], lane_fresh[W], n_copies, copies[2*n_copies],
// slot_of[L*E], key_of[R], last_use[R], head, span, n_live, order[n_live] (the window's
// non-holes in window order, each checked against pos_of: -2 where pos_of disagrees), clock,
// error, counters[L*5]; the PREFETCH build then adds pf_n_copies, pf_copies[2*pf_n_copies],
// touched, pf_flag[R], pf_counters[L*3]. A prefetch step writes its list to the pf_ buffers: the
// plan step's outputs above must keep their poison.
// The HOST_SPLIT build reads split[W + 1] and then leave (1: the host's misses left out of the
// bank) after a plan step's ids, takes kind 2 as a landing (every
// behind copy landed: pending cleared, as the pool's memset; nothing launched, nothing written),
// and adds to a plan step's output n_behind, behind[2*n_behind], host_keys[W], pending[R],
// host_counters[L].
#include "planner.cu"  // the kernel, copied next to the emulated common.cuh
#include "emu_io.h"

int main(int argc, char** argv) {
    std::FILE* fo = emu_open(argc, argv, "planner_main");
    if (!fo) return 2;

    const int R = (int)next(), E = (int)next(), L = (int)next(), S = (int)next();
    const int max_lanes = (int)next();
    const long long rows_base = next(), row_stride = next(), steps = next();
    const int C = (int)next();
    std::vector<i32> key_of(R), slot_of((size_t)L * E, -1), ring(C, -1), pos_of(R);
    i32 ends[2] = {0, R};  // head, span: the window starts as rows 0..R-1 (all last_use 0)
    std::vector<i64> last_use(R, 0), counters((size_t)L * NUM_COUNTERS, 0);
    for (int r = 0; r < R; ++r) {
        key_of[r] = (i32)next();
        if (key_of[r] >= 0) slot_of[key_of[r]] = r;
        ring[r] = r;
        pos_of[r] = r;
    }
    i64 clock = 0;
    i32 gate = 0, error = 0, n_copies = 0;
    std::vector<i32> routes(max_lanes), copies(2 * (size_t)max_lanes);
    std::vector<i64> lane_addr(max_lanes);
    std::vector<i32> lane_fresh(max_lanes);
#if PREFETCH
    i32 touched = 0, pf_n_copies = 0;
    std::vector<i32> pf_flag(R, 0), pf_copies(2 * (size_t)max_lanes);
    std::vector<i64> pf_counters((size_t)L * NUM_PF_COUNTERS, 0);
#define EMU_PF , &touched, pf_flag.data(), pf_counters.data()
#elif HOST_SPLIT
    i32 n_behind = 0, leave = 0;
    std::vector<i32> split(max_lanes + 1), pending(R, 0), behind(2 * (size_t)max_lanes);
    std::vector<i64> host_keys(max_lanes), host_counters(L, 0);
#define EMU_PF , split.data(), &leave, pending.data(), host_keys.data(), behind.data(), &n_behind, \
        host_counters.data()
#else
#define EMU_PF
#endif
    const std::size_t smem = 4 * ((size_t)E + 2 * ((R + 31) / 32));  // as cupool.planner.PlanStep

    for (long long s = 0; s < steps; ++s) {
        gate = (i32)next();
        const int layer = (int)next();
        const int kind = (int)next();
        const bool prefetch = kind == 1;
        const int promote = (int)next();
#if !PREFETCH
        if (prefetch) {
            std::fprintf(stderr, "planner_main: a prefetch step needs the PREFETCH build\n");
            return 2;
        }
#endif
#if HOST_SPLIT
        if (kind == 2) {  // a landing: no launch, no output
            std::fill(pending.begin(), pending.end(), 0);
            continue;
        }
#else
        if (kind == 2) {
            std::fprintf(stderr, "planner_main: a landing needs the HOST_SPLIT build\n");
            return 2;
        }
#endif
        const bool is64 = next() != 0;
        const int W = (int)next();
        std::vector<i64> ids64(W + 1);
        std::vector<i32> ids32(W + 1);
        for (int i = 0; i < W; ++i) ids32[i] = (i32)(ids64[i] = next());
#if HOST_SPLIT
        for (int i = 0; i <= W; ++i) split[i] = (i32)next();
        leave = (i32)next();
        std::fill(host_keys.begin(), host_keys.end(), 0x5A5A5A5A5A5ALL);
        std::fill(behind.begin(), behind.end(), 0x5A5A5A5A);
        n_behind = 0x5A5A5A5A;
#endif
        // poison the outputs: whatever the kernel must write, it writes
        std::fill(routes.begin(), routes.end(), 0x5A5A5A5A);
        std::fill(lane_addr.begin(), lane_addr.end(), 0x5A5A5A5A5A5ALL);
        std::fill(lane_fresh.begin(), lane_fresh.end(), 0x5A5A5A5A);
        std::fill(copies.begin(), copies.end(), 0x5A5A5A5A);
        n_copies = 0x5A5A5A5A;
#if PREFETCH
        std::fill(pf_copies.begin(), pf_copies.end(), 0x5A5A5A5A);
        pf_n_copies = 0x5A5A5A5A;
        if (prefetch) {
            emu_launch(THREADS, smem, [&] {
                if (is64)
                    prefetch_step_i64(ids64.data(), W, layer, E, R, S, promote, slot_of.data(),
                                      key_of.data(), last_use.data(), ring.data(), pos_of.data(),
                                      ends, C - 1, &clock, &gate, &error, counters.data(),
                                      routes.data(), lane_addr.data(), lane_fresh.data(),
                                      pf_copies.data(), &pf_n_copies, rows_base, row_stride EMU_PF);
                else
                    prefetch_step_i32(ids32.data(), W, layer, E, R, S, promote, slot_of.data(),
                                      key_of.data(), last_use.data(), ring.data(), pos_of.data(),
                                      ends, C - 1, &clock, &gate, &error, counters.data(),
                                      routes.data(), lane_addr.data(), lane_fresh.data(),
                                      pf_copies.data(), &pf_n_copies, rows_base, row_stride EMU_PF);
            });
        } else
#endif
        emu_launch(THREADS, smem, [&] {
            if (is64)
                plan_step_i64(ids64.data(), W, layer, E, R, S, promote, slot_of.data(),
                              key_of.data(), last_use.data(), ring.data(), pos_of.data(), ends,
                              C - 1, &clock, &gate, &error, counters.data(), routes.data(),
                              lane_addr.data(), lane_fresh.data(), copies.data(), &n_copies,
                              rows_base, row_stride EMU_PF);
            else
                plan_step_i32(ids32.data(), W, layer, E, R, S, promote, slot_of.data(),
                              key_of.data(), last_use.data(), ring.data(), pos_of.data(), ends,
                              C - 1, &clock, &gate, &error, counters.data(), routes.data(),
                              lane_addr.data(), lane_fresh.data(), copies.data(), &n_copies,
                              rows_base, row_stride EMU_PF);
        });
        put(fo, routes.data(), W);
        put(fo, lane_addr.data(), W);
        put(fo, lane_fresh.data(), W);
        put(fo, &n_copies, 1);
        put(fo, copies.data(), 2 * (long long)std::max(0, std::min(n_copies, max_lanes)));
        put(fo, slot_of.data(), (long long)slot_of.size());
        put(fo, key_of.data(), R);
        put(fo, last_use.data(), R);
        put(fo, ends, 2);
        std::vector<i64> live;
        for (int i = 0; i < ends[1] && i < C; ++i) {
            const int p = (ends[0] + i) & (C - 1);
            const int r = ring[p];
            if (r >= 0) live.push_back(r < R && pos_of[r] == p ? r : -2);
        }
        const long long n_live = (long long)live.size();
        put(fo, &n_live, 1);
        put(fo, live.data(), n_live);
        put(fo, &clock, 1);
        put(fo, &error, 1);
        put(fo, counters.data(), (long long)counters.size());
#if PREFETCH
        put(fo, &pf_n_copies, 1);
        put(fo, pf_copies.data(), 2 * (long long)std::max(0, std::min(pf_n_copies, max_lanes)));
        put(fo, &touched, 1);
        put(fo, pf_flag.data(), R);
        put(fo, pf_counters.data(), (long long)pf_counters.size());
#elif HOST_SPLIT
        put(fo, &n_behind, 1);
        put(fo, behind.data(), 2 * (long long)std::max(0, std::min(n_behind, max_lanes)));
        put(fo, host_keys.data(), W);
        put(fo, pending.data(), R);
        put(fo, host_counters.data(), L);
#endif
    }
    std::fclose(fo);
    return 0;
}
