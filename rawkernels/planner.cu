// Plan step: one launch per MoE layer call decides hits, misses and evictions on the GPU, so a
// whole decode step (plan -> row copies -> GEMM) stays in one CUDA graph without host readback.
//
// Semantics: exactly `cupool.reference.planner.ReferencePlanner.step` (ARCHITECTURE.md, "Planner
// semantics"), and in the PREFETCH build also `ReferencePlanner.prefetch` (below); the
// reference's docstring is the specification and the GPU tests compare the two after every step.
// Shape legend: L layers, E experts per layer, R = L*N bank rows, S staging rows, W lanes.
//
// Work sketch: one block of THREADS threads (fixed grid: the launch never depends on data).
// Lane i of the call is thread i (W <= THREADS, checked by the launcher).
//
// The LRU order lives in a ring of C = 2^k >= R entries (`ring`, positions taken mod C) holding
// row indices or -1 (a hole): the live window is [head, head + span); its non-hole entries, read
// in window order, are every row exactly once sorted by (last_use, row). `pos_of[r]` is row r's
// position. A step removes its touched rows (hits and victims) from the window and appends them
// at the tail in row order, so an all-hit step writes O(W) entries, not the whole order.
//   A. Issue every read that depends on nothing (gate, clock, the lane's id, head and span, the
//      first window tile, thread 0's counters and error word) so their latencies overlap; clear
//      shared memory: the per-expert "first lane" table [E] and two row bitmaps [R] (hit, taken).
//   B. Lanes: validate the id; atomicMin on the table gives each expert its first lane (dedupe in
//      first-occurrence order). First lanes read slot_of: a hit stamps last_use, sets its hit bit
//      and reads its window position (pos_of) (gate open); a block scan numbers the misses
//      j = 0..M-1 in lane order.
//   C. Gate open and (V = min(M, P, R - H) > 0 or the appends would overflow the ring): walk the
//      window from head in tiles of THREADS*ITEMS entries held in registers, ranked with warp
//      ballots and one block scan of the warp totals. "Eligible" = not a hole and not a hit row.
//      The first V eligible entries are the victims (exactly the V smallest (last_use, row) among
//      rows not used this step: what taking the LRU row miss by miss, in order, yields); a
//      victim's old key is read here and its taken bit set. P is the promotion cap (`promote`,
//      a launch argument; 0: none, P = M): a step of many sequences can miss more experts than
//      the bank can give up without evicting what the next steps use, so only its first P
//      misses take rows and the rest are staged (ReferencePlanner's Policy.promote).
//      - usual case: stop at the tile holding eligible entry number V; the new head is that
//        entry's position (everything before it is a hole, a hit or a victim: dead after this
//        step), so nothing in the ring is written here.
//      - compaction (span + T > C, rare: holes left by hits pile up until the tail would run into
//        the head): walk the whole window and write the eligible non-victims back-to-back from
//        head, updating their pos_of; the window then holds R - T entries and no holes.
//   D. Miss j: j < V takes victim j (its old key loses its row); otherwise staging row R + (j-V)
//      if j - V < S, else no row (error flag): a miss past the cap is staged like one that found
//      no victim. Each miss writes copy-list entry j.
//   E. Gate open (same phase as D; they share no data): the touched rows (hit or taken bit), in
//      row order, are appended at the tail (ring and pos_of); outside compaction each hit's old
//      position becomes a hole; thread 0 writes the new head and span.
//   F. Each lane writes its route, row address and whether the copy list fills its row; thread 0
//      writes n_copies, error, clock, counters.
//
// Invariants between launches (the Bank builds the tables; afterwards only this kernel writes them):
//   - slot_of[k] == r >= 0  <=>  key_of[r] == k >= 0   (owned rows and keys are a bijection);
//   - last_use[r] <= clock for every row;
//   - 0 <= head < C, R <= span <= C; the window's non-holes are a permutation of 0..R-1 sorted by
//     (last_use[r], r), and pos_of[r] is r's position. Appending the touched rows by row index
//     keeps the sort: untouched rows keep last_use < clock, touched rows get last_use == clock.
//   - Gate closed: slot_of, key_of, last_use, ring, pos_of, ends, clock and counters are not
//     written.
// Who touches what inside one launch (barriers separate the phases):
//   - slot_of: B reads the first lanes' keys. D writes victims' old keys (-1) and the misses' keys.
//     An old key owned a row at the start and a missed key did not, so no address is written
//     twice, and B's reads are done before D (barriers).
//   - key_of: C reads a victim's entry (the one thread that found it), D writes it (the thread of
//     the miss that takes it), after C's last barrier.
//   - last_use: written only, B on hit rows and D on victim rows (disjoint sets).
//   - ring: A and C read tiles before the tile's barrier (HOST_SPLIT: a victim's hole is written
//     after it, at the victim's own position in the tile). Compaction writes offset rank - V <= the
//     entry's own offset, so a tile only writes entries already read (by itself or an earlier
//     tile). E writes the appended positions [head + span, head + span + T), outside the old
//     window because span + T <= C (else C compacted), and holes at hit positions inside it.
//   - pos_of: B reads hits' entries; C (compaction) writes eligible non-victims' entries; E
//     writes the touched rows' entries (disjoint from C's rows, after C's last barrier).
//   - ends: read in A, written by thread 0 in E after barriers. s_cut: set in A, written in C by
//     the one thread holding eligible entry V, read in E.
//   - hit bitmap: B sets, C reads (after B's scan barrier), E reads. taken bitmap: C sets (no one
//     reads it in C), E reads after C's last barrier. D touches neither, so D and E overlap.
//   - s_route, s_fresh: B (hits) and D (misses) write, F reads after E's barrier (or the one
//     standing in for it when E has nothing to do).
//   - routes, lane_addr, lane_fresh: lane t writes entry t in F (lane_fresh = 1 where the lane's
//     row is one the copy list fills, so the GEMM can run the other lanes while it is copied). copies[j]: the thread of miss j in D.
//   - clock/gate/counters/error: read in A (counters and error by thread 0, kept in shared
//     memory), written by thread 0 in F, after barriers.
//
// PREFETCH build (-DPREFETCH=1; the default build has none of what follows, so its binaries are
// those of a planner without prefetch). Three more tables: `touched` [1] (rows stamped by the
// last open tick), `pf_flag` [R] (1: a prefetch filled the row and no step has used it since),
// `pf_counters` [L, 3] (prefetched, prefetch_used, prefetch_wasted by the prefetched key's layer).
//   - plan_step_*: as above, plus: a hit on a flagged row clears the flag and counts
//     prefetch_used; a flagged victim counts prefetch_wasted (for its old key's layer) and is
//     unflagged; an open step writes touched = T.
//   - prefetch_step_*: the same launch with the ids a prediction: hits are stamped (the flag
//     kept), misses take victims among *eligible* rows only and are skipped when none is left
//     (never staged, no error; `promote` caps them: the first `promote` misses take rows, the
//     others are skipped), victims are flagged, no routes /
//     lane_addr / lane_fresh are written, and `copies` / `n_copies` are the prefetch's own list;
//     the plan counters stay.
//     Eligible = not used in this tick nor the one before (last_use < max(clock - 1, 1)): the
//     previous tick's step may still have a GEMM reading its rows while these copies land.
//     Why no last_use is read for that: the rows of the last open tick are exactly the window's
//     last `touched` entries (appended together, and nothing has punched holes into them since),
//     and every other non-hit row comes before them. So with Y = those tail entries that are not
//     hits now (a hit's ring position says whether it lies in the tail), the eligible rows are
//     the first R - H - Y non-hole non-hit entries, V = min(M, R - H - Y), and phase C's walk is
//     the plan step's unchanged: its first V eligible entries are eligible, the cut is the first
//     entry it keeps, compaction keeps the young entries behind the others.
//   Who touches what (beyond the list above): touched: read in A, written by thread 0 in F.
//   pf_flag: B (hits of a plan step) and D (victims) on disjoint rows. pf_counters: atomics only
//   (D for other layers' wasted rows, thread 0 in F for its own layer's columns).
//
// HOST_SPLIT build (-DHOST_SPLIT=1; not with PREFETCH; the default build has none of it): some
// misses are computed on the host's CPU (rawkernels/host_experts.c) instead of waited for
// (ReferencePlanner.step_host). Tables: `pending` [R] (1: a host step promoted the row and its
// copy, made behind the call, may not have landed; cleared all at once, by a memset, once the
// behind copies have landed), `host_counters` [L]. Launch arguments: `split` [W + 1] (of M
// misses the host takes split[M]), `host_leave` [1] (1: the host's misses are left out of the
// bank, below), outputs `host_keys` [W], `behind` [2·W], `n_behind`.
//   - B: a hit on a pending row is the host's (route -1); it is stamped as any hit.
//   - C: a pending row is not eligible (not a victim) but stays in the window: the walk ranks
//     eligible entries (victims: the first V) and survivors (non-hole, non-hit: the entries
//     that stay unless taken) apart. Compaction writes each surviving non-victim at head +
//     (survivors before it) - (victims before it); the cut is the first surviving non-victim
//     (atomicMin over the walked tiles: a pending entry can come before eligible entry V, so a
//     victim can lie past the cut: each victim leaves a hole where it was). With fewer eligible
//     rows than min(P, R - H), V is what the walk found.
//   - After C: h = min(split[M], V); misses V - h ... V - 1 are the host's: their rows are taken
//     as any victim's (stamped, appended) and marked pending, their (key, row) go to `behind`,
//     their lanes route -1 and write their key to host_keys. The copy list is the other victims,
//     then the staged misses.
//   - host_leave set (ReferencePlanner.step_host with leave): after B's scan, hl = split[M] (gate
//     open) of the misses, the last hl in miss order, are the host's and take no row: the walk
//     and D see the first M - hl misses alone (the cap P counts them alone), the host's route -1
//     and write their keys to host_keys, nothing goes behind (h = 0, n_behind 0) and no row
//     becomes pending.
//   Who touches what (beyond the list above): pending: B reads hits' entries, C reads window
//   entries' (both before any write), the marking after C writes host victims' entries (a
//   barrier before D and E). s_host: B (hits) and D (misses), read in F.
#include "common.cuh"

#ifndef THREADS
#define THREADS 128   // the block; also the largest W a launch accepts
#endif
#ifndef ITEMS
#define ITEMS 4       // window entries a thread holds per tile (tile = THREADS * ITEMS)
#endif
#ifndef PREFETCH
#define PREFETCH 0    // 1: the prefetch build (prefetch_step_*, the tables touched, pf_flag,
#endif                //    pf_counters)
#ifndef HOST_SPLIT
#define HOST_SPLIT 0  // 1: the host build (split, pending, host_keys, behind, host_counters)
#endif
static_assert(!(PREFETCH && HOST_SPLIT), "the PREFETCH and HOST_SPLIT builds are separate");

#define NWARPS (THREADS / 32)
#define TILE (THREADS * ITEMS)
#define FULL_MASK 0xffffffffu
#define NUM_COUNTERS 5  // hits, misses, promotions, steals, staged (reference.planner.COUNTERS)
#define ERR_BAD_ID 1
#define ERR_STAGING_OVERFLOW 2
// prefetched, prefetch_used, prefetch_wasted (reference.planner.PREFETCH_COUNTERS)
#define NUM_PF_COUNTERS 3
#define PF_PREFETCHED 0
#define PF_USED 1
#define PF_WASTED 2

static_assert(THREADS % 32 == 0 && THREADS >= 32 && THREADS <= 1024,
              "THREADS must be a multiple of 32 in [32, 1024]");
static_assert(ITEMS >= 1 && ITEMS <= 32, "ITEMS must be in [1, 32]");

// Lanes below this one (the %lanemask_lt register, written in C so the source also runs on the
// CPU emulation in tests/emu).
CUPOOL_DEVICE u32 lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }

// Exclusive offset of this warp's total among all warps, and the block total (every thread gets
// both). Contains one barrier; `scratch` may be reused only after the caller passes another one,
// which is why callers alternate between two scratch buffers.
CUPOOL_DEVICE int warp_offset(int warp_total, int* scratch, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = warp_total;
    __syncthreads();
    const int v = lane < NWARPS ? scratch[lane] : 0;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += n;
    }
    total = __shfl_sync(FULL_MASK, inc, 31);
    return __shfl_sync(FULL_MASK, inc - v, warp);
}

// Exclusive block-wide prefix sum of v (one barrier, see warp_offset).
CUPOOL_DEVICE int block_scan(int v, int* scratch, int& total) {
    const int lane = threadIdx.x & 31;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += n;
    }
    const int off = warp_offset(__shfl_sync(FULL_MASK, inc, 31), scratch, total);
    return off + inc - v;
}

CUPOOL_DEVICE bool test_bit(const u32* bits, int i) { return (bits[i >> 5] >> (i & 31)) & 1u; }

CUPOOL_DEVICE void set_bit(u32* bits, int i) { atomicOr(&bits[i >> 5], 1u << (i & 31)); }

// Window offset of this thread's item j in the tile starting at offset `base`. Warp w owns
// 32*ITEMS consecutive offsets and its lanes read them 32 at a time: every load is one coalesced
// 128-byte line (two at the ring's wrap), and a ballot over j ranks them in window order.
CUPOOL_DEVICE int tile_offset(int base, int j) {
    return base + (threadIdx.x >> 5) * 32 * ITEMS + (threadIdx.x & 31) + j * 32;
}

// This thread's ITEMS entries of the window tile at offset `base` (-1 past the window: a hole).
CUPOOL_DEVICE void load_tile(const i32* ring, int mask, int head, int span, int base,
                             int (&row)[ITEMS]) {
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int off = tile_offset(base, j);
        row[j] = off < span ? ring[(head + off) & mask] : -1;
    }
}

// PF: the prefetch mode (only instantiated in the PREFETCH build).
template <typename Id, bool PF>
CUPOOL_DEVICE void plan_step(const Id* __restrict__ ids, i32 W, i32 layer, i32 E, i32 R, i32 S,
                             i32 promote,
                             i32* __restrict__ slot_of, i32* __restrict__ key_of,
                             i64* __restrict__ last_use, i32* __restrict__ ring,
                             i32* __restrict__ pos_of, i32* __restrict__ ends, i32 ring_mask,
                             i64* __restrict__ clock, const i32* __restrict__ gate,
                             i32* __restrict__ error, i64* __restrict__ counters,
                             i32* __restrict__ routes, i64* __restrict__ lane_addr,
                             i32* __restrict__ lane_fresh, i32* __restrict__ copies,
                             i32* __restrict__ n_copies, i64 rows_base, i64 row_stride
#if PREFETCH
                             , i32* __restrict__ touched, i32* __restrict__ pf_flag,
                             i64* __restrict__ pf_counters
#endif
#if HOST_SPLIT
                             , const i32* __restrict__ split, const i32* __restrict__ host_leave,
                             i32* __restrict__ pending,
                             i64* __restrict__ host_keys, i32* __restrict__ behind,
                             i32* __restrict__ n_behind, i64* __restrict__ host_counters
#endif
                             ) {
    // Dynamic shared memory: first_lane [E] (the lowest lane asking for each expert of this
    // layer), then two row bitmaps of ceil(R/32) words: hit rows, and rows taken as victims.
    extern __shared__ u32 dyn_smem[];
    const int nwords = (R + 31) >> 5;
    i32* first_lane = reinterpret_cast<i32*>(dyn_smem);
    u32* hit_bits = dyn_smem + E;
    u32* taken_bits = hit_bits + nwords;
    __shared__ i32 s_route[THREADS];       // indexed by a first lane: its expert's row (or -1)
    __shared__ i32 s_fresh[THREADS];       // indexed by a first lane: 1 if the copy list fills it
    __shared__ i32 s_miss_key[THREADS];    // indexed by miss number j (lane order)
    __shared__ i32 s_miss_lane[THREADS];   // first lane of miss j
    __shared__ i32 s_victim[THREADS];      // row taken by miss j < V
    __shared__ i32 s_victim_old[THREADS];  // the key that row held (or -1)
    __shared__ i32 s_scratch[2][32];       // block-scan scratch, used alternately
    __shared__ i64 s_old[NUM_COUNTERS + 1];  // this layer's counters and the error word, as read
    __shared__ i32 s_error, s_steals, s_cut;
#if PREFETCH
    __shared__ i32 s_young_hits, s_pf_used;  // prefetch mode: hits in the last tick's tail;
                                             // plan mode: hits on flagged rows
#endif
#if HOST_SPLIT
    __shared__ i32 s_host[THREADS];        // indexed by a first lane: 1 if the host computes it
    __shared__ i32 s_host_hits;            // hits on pending rows
#endif

    const int t = threadIdx.x, lane = t & 31;

    // ---- A. independent reads first, then clear shared state ----------------------------------
    const bool open = *gate != 0;
    const i64 now = *clock + (open ? 1 : 0);
    const Id id = t < W ? ids[t] : (Id)-1;
    const int head = ends[0], span = ends[1];
    int row[ITEMS];  // the window tile C works on; the first one is read now
    load_tile(ring, ring_mask, head, span, 0, row);
    if (t == 0) {
#pragma unroll
        for (int k = 0; k < NUM_COUNTERS; ++k) s_old[k] = counters[(i64)layer * NUM_COUNTERS + k];
        s_old[NUM_COUNTERS] = *error;
        s_error = 0;
        s_steals = 0;
        s_cut = span;  // no eligible entry V in the window: every entry dies this step
#if PREFETCH
        s_young_hits = 0;
        s_pf_used = 0;
#endif
#if HOST_SPLIT
        s_host_hits = 0;
#endif
    }
#if HOST_SPLIT
    const bool leave = *host_leave != 0;
#endif
#if PREFETCH
    const int prev_touched = *touched;  // the window's last prev_touched entries: the last tick's
#endif
    for (int i = t; i < E; i += THREADS) first_lane[i] = THREADS;
    for (int i = t; i < 2 * nwords; i += THREADS) hit_bits[i] = 0u;  // both bitmaps
    __syncthreads();

    // ---- B. lanes: validate, dedupe, hit or miss --------------------------------------------
    int e = -1;  // this lane's expert, or -1 for padding / invalid
    if (t < W) {
        if (id >= 0 && id < (Id)E) e = (int)id;
        else if (id != (Id)-1) atomicOr(&s_error, ERR_BAD_ID);
    }
    if (e >= 0) atomicMin(&first_lane[e], t);
    __syncthreads();
    const bool first = e >= 0 && first_lane[e] == t;
    const int key = first ? layer * E + e : -1;
    const int slot = first ? slot_of[key] : -1;
    const bool hit = slot >= 0;
    const bool miss = first && slot < 0;
    int hit_pos = -1;  // the hit row's window position, which becomes a hole
    if (hit) {
        s_route[t] = slot;
        s_fresh[t] = 0;
#if HOST_SPLIT
        // its copy may still be in flight: the host computes it
        s_host[t] = pending[slot] != 0;
        if (s_host[t]) {
            s_route[t] = -1;
            atomicAdd(&s_host_hits, 1);
        }
#endif
        if (open) {
            last_use[slot] = now;
            hit_pos = pos_of[slot];
            set_bit(hit_bits, slot);
#if PREFETCH
            if constexpr (PF) {
                if (((hit_pos - head) & ring_mask) >= span - prev_touched) atomicAdd(&s_young_hits, 1);
            } else if (pf_flag[slot]) {
                pf_flag[slot] = 0;
                atomicAdd(&s_pf_used, 1);
            }
#endif
        }
    }
    // Misses in the low half, hits in the high half: W <= 1024 keeps both below 2^16.
    int counts;
    const int before = block_scan((miss ? 1 : 0) | (hit ? 1 << 16 : 0), s_scratch[0], counts);
    const int M = counts & 0xffff, H = counts >> 16;
    if (miss) {
        s_miss_key[before & 0xffff] = key;
        s_miss_lane[before & 0xffff] = t;
    }
#if HOST_SPLIT
    // leave mode: the last hl misses are the host's and take no row; Mo are the step's own
    const int hl = open && leave ? split[M] : 0;
    const int Mo = M - hl;
#else
    const int Mo = M;
#endif
    // Misses allowed to take a bank row: the first `promote` (a cap the launcher picks per step;
    // 0: no cap); in a prefetch the others are skipped. A cap of 0 costs a compare and a select.
    const int P = promote > 0 ? min(Mo, promote) : Mo;
#if PREFETCH
    // prefetch mode: the last tick's rows that are not hits now are not eligible (s_young_hits is
    // complete: the scan's barrier)
    const int V = open ? min(P, R - H - (PF ? prev_touched - s_young_hits : 0)) : 0;
#elif HOST_SPLIT
    int V = open ? min(P, R - H) : 0;  // at most; pending rows can leave fewer (C counts them)
#else
    const int V = open ? min(P, R - H) : 0;  // misses that get a bank row
#endif
#if HOST_SPLIT
    const bool compact = open && H + V > 0 && span + H + V > ring_mask + 1;  // H + V: at most T
    const bool walk = open && (V > 0 || compact);
    int survivors = 0;  // HOST_SPLIT: non-hole non-hit entries of the walked tiles
#else
    const int T = H + V;                      // rows stamped with `now` this step
    const bool compact = open && T > 0 && span + T > ring_mask + 1;
#endif

    // ---- C. victims (and, rarely, compaction of the window) ---------------------------------
    if (open && (V > 0 || compact)) {  // block-uniform: the barriers inside are reached by all
        int eligible_before = 0;  // eligible entries in earlier tiles
        int buf = 1;
        for (int base = 0; base < span; base += TILE) {
            if (base > 0) load_tile(ring, ring_mask, head, span, base, row);
            u32 keep[ITEMS];
            int run = 0;
#if HOST_SPLIT
            u32 stay[ITEMS];  // survivors: not a hole, not a hit (pending rows too)
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                const bool s = row[j] >= 0 && !test_bit(hit_bits, row[j]);
                stay[j] = __ballot_sync(FULL_MASK, s);
                keep[j] = __ballot_sync(FULL_MASK, s && !pending[row[j]]);
                run += __popc(keep[j]) | __popc(stay[j]) << 16;  // both < 2^16 (TILE <= 32768)
            }
            int tile_both;
            const int both = warp_offset(run, s_scratch[buf], tile_both);
            int rank = eligible_before + (both & 0xffff);
            int srank = survivors + (both >> 16);
            const int tile_total = tile_both & 0xffff;
            buf ^= 1;
            const u32 lt = lanemask_lt();
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                if ((stay[j] >> lane) & 1u) {
                    const int r = rank + __popc(keep[j] & lt);  // eligible entries before it
                    const int sr = srank + __popc(stay[j] & lt);
                    if ((keep[j] >> lane) & 1u && r < V) {
                        s_victim[r] = row[j];
                        s_victim_old[r] = key_of[row[j]];
                        // a pending entry before it can hold the cut back: leave a hole
                        if (!compact) ring[(head + tile_offset(base, j)) & ring_mask] = -1;
                    } else if (compact) {
                        const int p = (head + sr - min(r, V)) & ring_mask;
                        ring[p] = row[j];
                        pos_of[row[j]] = p;
                    } else {
                        atomicMin(&s_cut, tile_offset(base, j));
                    }
                }
                rank += __popc(keep[j]);
                srank += __popc(stay[j]);
            }
            survivors += tile_both >> 16;
#else
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                keep[j] = __ballot_sync(FULL_MASK, row[j] >= 0 && !test_bit(hit_bits, row[j]));
                run += __popc(keep[j]);
            }
            int tile_total;
            // The barrier in warp_offset also ends every read of this tile before any write.
            int rank = eligible_before + warp_offset(run, s_scratch[buf], tile_total);
            buf ^= 1;
            const u32 lt = lanemask_lt();
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                if ((keep[j] >> lane) & 1u) {
                    const int r = rank + __popc(keep[j] & lt);
                    if (r < V) {
                        s_victim[r] = row[j];
                        s_victim_old[r] = key_of[row[j]];
                        set_bit(taken_bits, row[j]);
                    } else if (compact) {
                        const int p = (head + r - V) & ring_mask;
                        ring[p] = row[j];
                        pos_of[row[j]] = p;
                    } else if (r == V) {
                        s_cut = tile_offset(base, j);
                    }
                }
                rank += __popc(keep[j]);
            }
#endif
            eligible_before += tile_total;
            if (!compact && eligible_before > V) break;  // block-uniform (a block total)
        }
#if HOST_SPLIT
        V = min(V, eligible_before);  // a walk to the window's end found every eligible row
#endif
    }
    __syncthreads();  // s_victim*, s_miss_*, s_cut and both bitmaps complete; ring reads done
#if HOST_SPLIT
    // Every victim is taken (appended at the tail as in the default build); the last h are the
    // host's, whose rows are pending until the behind copies land (none in leave mode).
    const int h = open && !leave ? min(split[M], V) : 0;
    const int T = H + V;  // rows stamped with `now` this step
    if (t < V) {
        set_bit(taken_bits, s_victim[t]);
        if (t >= V - h) pending[s_victim[t]] = 1;
    }
    __syncthreads();  // taken bits complete before E counts them
#endif

    // ---- D. misses: take a victim or a staging row ------------------------------------------
    if (t < M) {
        const int k = s_miss_key[t];
        int r;
        if (t < V) {
            r = s_victim[t];
            const int old = s_victim_old[t];
            if (old >= 0) {
                slot_of[old] = -1;
                if (old / E != layer) atomicAdd(&s_steals, 1);
#if PREFETCH
                if (pf_flag[r])
                    atomicAdd(reinterpret_cast<unsigned long long*>(
                                  &pf_counters[(i64)(old / E) * NUM_PF_COUNTERS + PF_WASTED]),
                              1ull);
#endif
            }
#if PREFETCH
            pf_flag[r] = PF ? 1 : 0;
#endif
            slot_of[k] = r;
            key_of[r] = k;
            last_use[r] = now;
        } else {
#if PREFETCH
            r = !PF && t - V < S ? R + (t - V) : -1;  // a prefetch never stages
#else
            r = t - V < S ? R + (t - V) : -1;
#endif
        }
#if HOST_SPLIT
        const bool left = t >= Mo;  // the host's, left out of the bank (its r is not used)
        const bool host = left || (t < V && t >= V - h);
        s_route[s_miss_lane[t]] = host ? -1 : r;
        s_fresh[s_miss_lane[t]] = !host && r >= 0;
        s_host[s_miss_lane[t]] = host;
        if (host && !left) {
            behind[2 * (t - (V - h))] = k;
            behind[2 * (t - (V - h)) + 1] = r;
        } else if (r >= 0) {
            const int j = t < V ? t : t - h;  // the copy list skips the host's victims
            copies[2 * j] = k;
            copies[2 * j + 1] = r;
        }
#else
        s_route[s_miss_lane[t]] = r;
        s_fresh[s_miss_lane[t]] = r >= 0;
        if (r >= 0) {
            copies[2 * t] = k;
            copies[2 * t + 1] = r;
        }
#endif
    }

    // ---- E. touched rows, in row order, appended at the window's tail ------------------------
#if HOST_SPLIT
    if (open && (T > 0 || compact)) {  // a walk that found no victim may still have compacted
#else
    if (open && T > 0) {
#endif
        // Window after C: compaction left R - T entries at head; otherwise it starts at the cut.
        // (With V = 0 and no compaction C did not run: nothing is cut.)
#if HOST_SPLIT
        const int cut = walk ? s_cut : 0;
        const int new_head = compact ? head : (head + cut) & ring_mask;
        const int kept = compact ? survivors - V : span - cut;
#else
        const int cut = V > 0 ? s_cut : 0;
        const int new_head = compact ? head : (head + cut) & ring_mask;
        const int kept = compact ? R - T : span - cut;
#endif
        const int per = (nwords + THREADS - 1) / THREADS;
        const int w0 = t * per, w1 = min(w0 + per, nwords);
        int n = 0;
        for (int w = w0; w < w1; ++w) n += __popc(hit_bits[w] | taken_bits[w]);
        int total;
        int pos = new_head + kept + block_scan(n, s_scratch[0], total);  // barrier also ends D
        for (int w = w0; w < w1; ++w) {
            u32 bits = hit_bits[w] | taken_bits[w];
            while (bits) {
                const int r = w * 32 + (__ffs(bits) - 1);
                const int p = (pos++) & ring_mask;
                ring[p] = r;
                pos_of[r] = p;
                bits &= bits - 1;
            }
        }
        if (hit_pos >= 0 && !compact) ring[hit_pos] = -1;
        if (t == 0) {
            ends[0] = new_head;
            ends[1] = kept + T;
        }
    } else {
        __syncthreads();  // ends D: s_route and s_steals complete
    }

    // ---- F. per-lane outputs and the scalars --------------------------------------------------
#if PREFETCH
    if (!PF && t < W) {  // a prefetch routes nothing (the GEMM running beside it reads these)
#else
    if (t < W) {
#endif
        const int route = e >= 0 ? s_route[first_lane[e]] : -1;
        routes[t] = route;
        lane_addr[t] = route >= 0 ? rows_base + (i64)route * row_stride : 0;
        lane_fresh[t] = e >= 0 ? s_fresh[first_lane[e]] : 0;
#if HOST_SPLIT
        host_keys[t] = e >= 0 && s_host[first_lane[e]] ? (i64)layer * E + e : -1;
#endif
    }
#if PREFETCH
    if (t == 0 && PF) {
        *n_copies = V;
        if (s_error) *error = (i32)s_old[NUM_COUNTERS] | s_error;
        if (open) {
            *clock = now;
            *touched = T;
            atomicAdd(reinterpret_cast<unsigned long long*>(
                          &pf_counters[(i64)layer * NUM_PF_COUNTERS + PF_PREFETCHED]),
                      (unsigned long long)V);
        }
    }
    if (t == 0 && !PF && open) {
        *touched = T;
        if (s_pf_used)
            atomicAdd(reinterpret_cast<unsigned long long*>(
                          &pf_counters[(i64)layer * NUM_PF_COUNTERS + PF_USED]),
                      (unsigned long long)s_pf_used);
    }
    if (t == 0 && !PF) {
#else
    if (t == 0) {
#endif
        const int staged = Mo - V;
        const int staged_ok = min(staged, S);
#if HOST_SPLIT
        *n_copies = V - h + staged_ok;
        *n_behind = h;
        if (open) host_counters[layer] += h + hl + s_host_hits;
#else
        *n_copies = V + staged_ok;
#endif
        const int err = s_error | (staged > S ? ERR_STAGING_OVERFLOW : 0);
        if (err) *error = (i32)s_old[NUM_COUNTERS] | err;
        if (open) {
            *clock = now;
            i64* c = counters + (i64)layer * NUM_COUNTERS;
            c[0] = s_old[0] + H;
            c[1] = s_old[1] + M;
            c[2] = s_old[2] + V;
            c[3] = s_old[3] + s_steals;
            c[4] = s_old[4] + staged_ok;
        }
    }
}

#define PLAN_STEP_ARGS                                                                         \
    i32 W, i32 layer, i32 E, i32 R, i32 S, i32 promote, i32 *slot_of, i32 *key_of,             \
        i64 *last_use, i32 *ring, i32 *pos_of, i32 *ends, i32 ring_mask, i64 *clock,           \
        const i32 *gate, i32 *error, i64 *counters, i32 *routes, i64 *lane_addr,               \
        i32 *lane_fresh, i32 *copies, i32 *n_copies, i64 rows_base, i64 row_stride
#define PLAN_STEP_PASS                                                                        \
    W, layer, E, R, S, promote, slot_of, key_of, last_use, ring, pos_of, ends, ring_mask,      \
        clock, gate, error, counters, routes, lane_addr, lane_fresh, copies, n_copies,         \
        rows_base, row_stride
#if PREFETCH
#define PF_ARGS , i32 *touched, i32 *pf_flag, i64 *pf_counters
#define PF_PASS , touched, pf_flag, pf_counters
#elif HOST_SPLIT
#define PF_ARGS , const i32 *split, const i32 *host_leave, i32 *pending, i64 *host_keys,         \
        i32 *behind, i32 *n_behind, i64 *host_counters
#define PF_PASS , split, host_leave, pending, host_keys, behind, n_behind, host_counters
#else
#define PF_ARGS
#define PF_PASS
#endif

// Two entry points because routers hand out int64 (torch.topk) or int32 ids; reading either
// directly avoids a cast kernel in the graph.
extern "C" __global__ void __launch_bounds__(THREADS)
plan_step_i32(const i32* __restrict__ ids, PLAN_STEP_ARGS PF_ARGS) {
    plan_step<i32, false>(ids, PLAN_STEP_PASS PF_PASS);
}

extern "C" __global__ void __launch_bounds__(THREADS)
plan_step_i64(const i64* __restrict__ ids, PLAN_STEP_ARGS PF_ARGS) {
    plan_step<i64, false>(ids, PLAN_STEP_PASS PF_PASS);
}

#if PREFETCH
// The prefetch mode: `copies` / `n_copies` are the prefetch's own list; routes, lane_addr and
// lane_fresh are not written (pass any buffers of the right type).
extern "C" __global__ void __launch_bounds__(THREADS)
prefetch_step_i32(const i32* __restrict__ ids, PLAN_STEP_ARGS PF_ARGS) {
    plan_step<i32, true>(ids, PLAN_STEP_PASS PF_PASS);
}

extern "C" __global__ void __launch_bounds__(THREADS)
prefetch_step_i64(const i64* __restrict__ ids, PLAN_STEP_ARGS PF_ARGS) {
    plan_step<i64, true>(ids, PLAN_STEP_PASS PF_PASS);
}
#endif

// Verification (not the hot path): compares bank rows with their host-store rows, both read on
// the GPU (the host row through its UVA address), for the (key, row) pairs listed.
// first_diff[p] must hold row_bytes on entry; it ends as the first differing byte of pair p, or
// stays row_bytes when the rows are equal.
extern "C" __global__ void compare_rows(const i64* __restrict__ src_of_key,
                                        const i32* __restrict__ pairs, i32 n,
                                        const u8* __restrict__ rows_base, i64 row_stride,
                                        i64 row_bytes, i64* __restrict__ first_diff) {
    const i64 units = row_bytes >> 4;
    for (int p = blockIdx.x; p < n; p += gridDim.x) {
        const u8* host = reinterpret_cast<const u8*>(src_of_key[pairs[2 * p]]);
        const u8* bank = rows_base + row_stride * pairs[2 * p + 1];
        for (i64 u = threadIdx.x; u < units; u += blockDim.x) {
            const u32x4 a = ld_stream16(host + (u << 4));
            const u32x4 b = *reinterpret_cast<const u32x4*>(bank + (u << 4));
            const u32 d[4] = {a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                if (d[w]) {  // little-endian: the lowest set byte is the lowest address
                    const i64 off = (u << 4) + 4 * w + ((__ffs(d[w]) - 1) >> 3);
                    atomicMin(&first_diff[p], off);
                    break;
                }
            }
        }
    }
}
