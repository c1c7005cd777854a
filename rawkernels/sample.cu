// The next token of each row of 16-bit logits: temperature, top-k, top-p and the Gumbel-max draw
// of `cupool.sampling.sample` (the reference), without sorting the vocabulary.
//
// What is drawn (sampling.py): order the ids by logit, larger first, equal logits by id; the
// kept set is the longest prefix of that order whose every member has, ahead of it, less than
// top_p of the probability softmax(logit / T) gives the first top_k ids; the token is the kept id
// with the largest logit / T + Gumbel noise, the noise a hash of (seed, step, id). T <= 0 is
// greedy: the first id of the order.
//
// Why no sort: a 16-bit logit takes at most 65,536 values, and every id of one value has the same
// probability. So a histogram of the values (ordered as keys, below) is all the sort would give:
// the cut of top-k and of top-p falls between two keys or inside one key's group of equal logits,
// and where it falls inside a group, the group's ids kept are its first ones (the order puts
// equal logits by id).
//
// Three launches a step, grid (blocks, B): block x of row b takes ids [x·THREADS·ITEMS, +THREADS·
// ITEMS), thread t the ITEMS consecutive ids from x·THREADS·ITEMS + t·ITEMS (so a block's ids in
// thread order are in id order, which the ranks below need).
//   1. sample_histogram counts each id's key into hist[b] (global atomics: a warp's lanes that
//      hold the same key add once) and each coarse bin's ids (a block's sums, added once). The
//      row's last block (a ticket) scans the histogram from the largest key down, skipping empty
//      coarse bins, and writes the row's cut: key κ, keep c, group G (the kept set is every id
//      whose key is above κ and the first c of the G ids whose key is κ), then zeroes what it
//      read and its ticket.
//   2. sample_rank: where the cut falls inside a group (c < G), each block counts the group's ids
//      among its own; else it returns at once.
//   3. sample_draw: each block's best kept id by (score, smaller id) goes into best[b] by a 64-bit
//      atomicMax; the row's last block (a ticket) writes out[b] and zeroes best[b] and its ticket.
// Invariants between calls (the launcher allocates them zeroed; every call leaves them so): hist,
// best and the tickets are zero. Every sum is of integers (the atomic ones included), so a row's
// token does not depend on which block ran first.
//
// The scan sums probabilities as integers (2^-40 of the largest id's a unit) over the histogram,
// where the reference adds float32 probabilities in the sorted order: the two can disagree on a
// token only where top_p times the kept mass lies within their rounding of the mass ahead of a
// group.
#include "block_scan.cuh"
#include "common.cuh"

#ifndef THREADS
#define THREADS 256        // threads a block (all three kernels); also the coarse bins a row
#endif
#ifndef ITEMS
#define ITEMS 8            // consecutive ids a thread
#endif
#ifndef IN_F16
#define IN_F16 0           // logits: 0 bf16, 1 fp16
#endif

#define KEYS 65536
#define KEYS_PER_THREAD (KEYS / THREADS)
#define IDS_PER_BLOCK (THREADS * ITEMS)
#define WARPS (THREADS / 32)
// a row's histogram: the counts of the KEYS keys, then of THREADS coarse bins of KEYS_PER_THREAD
// keys each (u32 [B, HIST_WORDS])
#define HIST_WORDS (KEYS + THREADS)
// the row's cut (sample_histogram's scan writes it, the other two read it): i32 [B, CUT_WORDS]
#define CUT_KEY 0
#define CUT_KEEP 1
#define CUT_GROUP 2
#define CUT_WORDS 4
// An id's probability relative to the row's largest, in the scan's fixed point: 2^40 (a row's
// sum, at most V·2^40, stays below 2^63 for any V under 2^23)
#define FIXED_ONE 1099511627776.0

static_assert(KEYS_PER_THREAD % 256 == 0, "a warp reads a coarse bin 8 rounds of 32 keys at once");
static_assert(ITEMS >= 1, "ITEMS: ids a thread");
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS: whole warps, at most 1024");

// A logit's 16 bits -> a key whose unsigned order is the values' order (sign set: all bits
// flipped; else the sign bit set). +NaN lands above +inf, as torch's sort puts NaN first.
CUPOOL_DEVICE u32 order_key(u32 bits) {
    return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

CUPOOL_DEVICE float key_value(u32 key) {
    const u32 bits = (key & 0x8000u) ? (key & 0x7FFFu) : (~key & 0xFFFFu);
    return IN_F16 ? f16_to_f32((u16)bits) : bf16_to_f32((u16)bits);
}

// The temperature as the reference divides by it (temperature.clamp_min(1e-6)).
CUPOOL_DEVICE float divisor(float t) { return fmaxf(t, 1e-6f); }

// sampling.py's _mix: a 32-bit hash (its int64 products masked to 32 bits are these u32 products).
CUPOOL_DEVICE u32 mix(u32 x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
    x ^= x >> 16;
    return x;
}

// The hash of (seed, step) that every id's noise of a row starts from (sampling.uniform_noise).
CUPOOL_DEVICE u32 row_hash(i64 seed, i64 step) {
    const u64 s = (u64)seed, k = (u64)step;
    return mix(mix(mix((u32)s) ^ (u32)(s >> 32)) ^ (u32)k);
}

// Gumbel noise of id v: 23 bits of its hash, u = (bits + 0.5) / 2^23, strictly inside (0, 1) and
// exact in float32, then -log(-log(u)), each step rounded as the reference's float32 tensor ops.
CUPOOL_DEVICE float gumbel(u32 row, u32 v) {
    const float u = ((float)(mix(row ^ v) >> 9) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

// A float's bits as a key whose unsigned order is the values' order.
CUPOOL_DEVICE u32 float_key(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

CUPOOL_DEVICE u32 logit_key(const u16* row, int v) { return order_key(ld_u16_nc(row + v)); }

// The block's largest u64 (0 where no thread had one); every thread must call it. `slots`:
// WARPS words of shared memory.
CUPOOL_DEVICE u64 block_max_u64(u64 v, u64* slots) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 m = 0;
    for (int w = 0; w < WARPS; ++w) m = slots[w] > m ? slots[w] : m;
    return m;
}

// Whether this block took the row's last ticket (after every thread's writes are made visible).
CUPOOL_DEVICE bool last_of_row(i32* ticket, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!*flag) return false;
    __threadfence();
    return true;
}

// One warp's walk over coarse bin `seg` from its largest key down, 32 keys a round (lane 0 the
// largest), the counts of 8 rounds loaded at once through L2 (where the other blocks' atomics
// landed). f(key, count) runs on every lane and returns a warp-uniform bool: true stops the walk.
template <class F>
CUPOOL_DEVICE void warp_walk(const u32* hist, int seg, F f) {
    const int lane = threadIdx.x & 31, top = (seg + 1) * KEYS_PER_THREAD - 1 - lane;
    for (int r0 = 0; r0 < KEYS_PER_THREAD / 32; r0 += 8) {
        u32 c[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) c[r] = __ldcg(hist + top - 32 * (r0 + r));
#pragma unroll
        for (int r = 0; r < 8; ++r)
            if (f(top - 32 * (r0 + r), c[r])) return;
    }
}

// Inclusive sum over lanes 0..lane (lane 0 holds the largest key of a round).
template <class T>
CUPOOL_DEVICE T warp_inclusive(T v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// The histogram's scan (one block: the row's last), from the largest key down. Coarse bin s
// holds keys [s·KEYS_PER_THREAD, +KEYS_PER_THREAD); thread t stands for bin THREADS - 1 - t in
// the block scans, so thread order is the keys' descending order and a block scan over threads
// is a prefix of the sorted order. The keys of a bin are read by one warp at a time, and only in
// bins that hold ids (logits span a few octaves: most bins are empty).
CUPOOL_DEVICE void scan_row(u32* hist, int V, float temperature, i64 top_k, float top_p,
                            i32* cut) {
    __shared__ u64 u64scratch[33];
    __shared__ int iscratch[33];
    __shared__ u64 slots[WARPS];
    __shared__ u64 seg_mass[THREADS];
    __shared__ u32 seg_count[THREADS];
    __shared__ int found_seg, k_key, k_ties, p_key, p_keep, top_key;
    __shared__ u64 found_run;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int my_seg = THREADS - 1 - threadIdx.x;
    const u32 mine = __ldcg(hist + KEYS + my_seg);           // ids whose key is in my_seg
    seg_count[my_seg] = mine;
    seg_mass[my_seg] = 0;
    auto count_at = [&](int key) -> u32 { return __ldcg(hist + key); };

    // (a) the row's largest key that some id holds: in the highest bin that holds ids
    const int top_seg = (int)block_max_u64(mine ? (u64)my_seg + 1 : 0ull, slots) - 1;  // V >= 1
    if (warp == 0)
        warp_walk(hist, top_seg, [&](int key, u32 c) {
            const u32 held = __ballot_sync(0xffffffffu, c != 0);
            if (held && lane == __ffs((int)held) - 1) top_key = key;
            return held != 0;
        });
    __syncthreads();
    const int kmax = top_key;
    const float t = divisor(temperature);
    const float m = key_value(kmax) / t;
    const bool greedy = !(temperature > 0.0f);

    // (b) top-k: the key whose group holds the k-th id of the order, and how many of its ids
    const int K = (top_k > 0 && top_k < (i64)V) ? (int)top_k : V;
    if (threadIdx.x == 0) { k_key = -1; k_ties = 0; found_seg = -1; }
    int total;
    const int above = block_exclusive_scan((int)mine, iscratch, &total);   // synchronises
    if (K < V && above < K && K <= above + (int)mine) { found_seg = my_seg; found_run = above; }
    __syncthreads();
    if (K < V && warp == 0) {
        int run = (int)found_run;
        warp_walk(hist, found_seg, [&](int key, u32 c) {
            const int incl = warp_inclusive((int)c);
            const u32 reach = __ballot_sync(0xffffffffu, run + incl >= K);
            if (reach && lane == __ffs((int)reach) - 1) {
                k_key = key;
                k_ties = K - (run + incl - (int)c);
            }
            run += __shfl_sync(0xffffffffu, incl, 31);
            return reach != 0;
        });
    }
    __syncthreads();
    const int kk = k_key, kties = k_ties;    // kk = -1: every id is in the top-k set

    // (c) the top-k set's mass: exp(logit / T - m) an id in fixed point (FIXED_ONE is the
    // largest id's), summed by each bin's warp. Integer sums make the scan's prefixes exact, so
    // each thread's range of the mass ends where the next one's starts.
    auto in_set = [&](int key, u32 c) -> u64 {
        return key > kk ? (u64)c : key == kk ? (u64)kties : 0ull;
    };
    auto prob = [&](int key) -> u64 {
        return (u64)((double)expf(key_value(key) / t - m) * FIXED_ONE + 0.5);
    };
    if (!greedy) {
        for (int seg = warp; seg < THREADS; seg += WARPS) {
            if (!seg_count[seg] || (seg + 1) * KEYS_PER_THREAD - 1 < kk) continue;
            u64 sum = 0;
            warp_walk(hist, seg, [&](int key, u32 c) {
                const u64 n = in_set(key, c);
                if (n) sum += n * prob(key);
                return __shfl_sync(0xffffffffu, key, 31) <= kk;     // the round reached kk
            });
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) seg_mass[seg] = sum;
        }
    }
    __syncthreads();
    const u64 mass = seg_mass[my_seg];
    u64 z;
    const u64 mass_above = block_exclusive_scan(mass, u64scratch, &z);

    // (d) top-p: the group where the mass ahead of an id reaches top_p · z, and how many of its
    // ids have less than that ahead of them
    if (threadIdx.x == 0) { p_key = -1; p_keep = 0; found_seg = -1; }
    __syncthreads();
    const double target = (double)top_p * (double)z;
    const bool cut_p = !greedy && top_p < 1.0f;
    if (cut_p && (double)mass_above < target && target <= (double)(mass_above + mass)) {
        found_seg = my_seg;
        found_run = mass_above;
    }
    __syncthreads();
    if (cut_p && warp == 0 && found_seg >= 0) {
        u64 run = found_run;
        warp_walk(hist, found_seg, [&](int key, u32 c) {
            const u64 n = in_set(key, c), q = n ? prob(key) : 0ull, incl = warp_inclusive(n * q);
            const u32 reach = __ballot_sync(0xffffffffu, (double)(run + incl) >= target);
            if (reach && lane == __ffs((int)reach) - 1) {
                // q > 0 here: the mass ahead was below target. Ids j = 0.. of the group have
                // before + j·q ahead of them; those below target stay.
                const u64 before = run + incl - n * q;
                const double need = (target - (double)before) / (double)q;
                const u64 up = (u64)need + ((double)(u64)need < need ? 1 : 0);
                p_key = key;
                p_keep = (int)(up < 1 ? 1 : up > n ? n : up);
            }
            run += __shfl_sync(0xffffffffu, incl, 31);
            return reach != 0;
        });
    }
    __syncthreads();

    if (threadIdx.x == 0) {
        i32* out = cut;
        if (greedy) {                    // the first id of the order: the largest key's first id
            out[CUT_KEY] = kmax;
            out[CUT_KEEP] = 1;
            out[CUT_GROUP] = (int)count_at(kmax);
        } else if (p_key >= 0) {
            out[CUT_KEY] = p_key;
            out[CUT_KEEP] = p_keep;
            out[CUT_GROUP] = (int)count_at(p_key);
        } else if (kk >= 0) {
            out[CUT_KEY] = kk;
            out[CUT_KEEP] = kties;
            out[CUT_GROUP] = (int)count_at(kk);
        } else {                         // every id: above key 0, and all of key 0's
            const int c0 = (int)count_at(0);
            out[CUT_KEY] = 0;
            out[CUT_KEEP] = c0;
            out[CUT_GROUP] = c0;
        }
    }
    __syncthreads();                     // every read of the histogram is done
    const u32x4 zero = {0u, 0u, 0u, 0u};
    u32* mine_keys = hist + my_seg * KEYS_PER_THREAD;
    if (mine)
        for (int j = 0; j < KEYS_PER_THREAD; j += 4) st16(mine_keys + j, zero);
    hist[KEYS + my_seg] = 0u;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_histogram(const u16* __restrict__ logits, i64 row_stride, int V, u32* hist, i32* tickets,
                 const float* __restrict__ temperature, const i64* __restrict__ top_k,
                 const float* __restrict__ top_p, i32* cut) {
    __shared__ int last;
    __shared__ u32 coarse[THREADS];      // the block's counts of coarse bins (KEYS_PER_THREAD keys)
    const int b = blockIdx.y;
    const u16* row = logits + (i64)b * row_stride;
    u32* h = hist + (i64)b * HIST_WORDS;
    const int first = blockIdx.x * IDS_PER_BLOCK + threadIdx.x * ITEMS;
    const int lane = threadIdx.x & 31;
    coarse[threadIdx.x] = 0u;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i;
        const u32 key = v < V ? logit_key(row, v) : KEYS;       // KEYS: no id
        const u32 same = __match_any_sync(0xffffffffu, key);     // lanes holding this key
        if (key < KEYS && __ffs((int)same) - 1 == lane) {
            atomicAdd(h + key, (u32)__popc(same));
            atomicAdd(coarse + key / KEYS_PER_THREAD, (u32)__popc(same));
        }
    }
    __syncthreads();
    if (coarse[threadIdx.x]) atomicAdd(h + KEYS + threadIdx.x, coarse[threadIdx.x]);
    if (!last_of_row(tickets + 2 * b, &last)) return;
    scan_row(h, V, temperature[b], top_k[b], top_p[b], cut + CUT_WORDS * b);
    if (threadIdx.x == 0) tickets[2 * b] = 0;
}

// The ids of the cut's group ahead of this thread's first in id order: those of the blocks before
// (sample_rank's counts) and of this block's threads before (`mine`: this thread's). Every thread
// must call it.
CUPOOL_DEVICE int group_rank_base(const i32* counts, int mine) {
    __shared__ int scratch[33];
    __shared__ int before;
    if (threadIdx.x < 32) {
        int s = 0;
        for (int j = threadIdx.x; j < (int)blockIdx.x; j += 32) s += counts[j];
        s = warp_sum_int(s);
        if (threadIdx.x == 0) before = s;
    }
    int total;
    const int base = block_exclusive_scan(mine, scratch, &total);   // synchronises
    return before + base;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_rank(const u16* __restrict__ logits, i64 row_stride, int V, const i32* __restrict__ cut,
            i32* counts) {
    __shared__ int scratch[33];
    const int b = blockIdx.y;
    const i32* c = cut + CUT_WORDS * b;
    if (c[CUT_KEEP] >= c[CUT_GROUP]) return;      // the cut keeps its whole group: no ranks
    const u32 key = (u32)c[CUT_KEY];
    const u16* row = logits + (i64)b * row_stride;
    const int first = blockIdx.x * IDS_PER_BLOCK + threadIdx.x * ITEMS;
    int n = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) n += first + i < V && logit_key(row, first + i) == key;
    int total;
    block_exclusive_scan(n, scratch, &total);
    if (threadIdx.x == 0) counts[(i64)b * gridDim.x + blockIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_draw(const u16* __restrict__ logits, i64 row_stride, int V, const i32* __restrict__ cut,
            const i32* __restrict__ counts, const float* __restrict__ temperature,
            const i64* __restrict__ seeds, const i64* __restrict__ steps, u64* best,
            i32* tickets, i64* out) {
    __shared__ u64 slots[WARPS];
    __shared__ int last;
    const int b = blockIdx.y;
    const i32* c = cut + CUT_WORDS * b;
    const u32 ck = (u32)c[CUT_KEY];
    const int keep = c[CUT_KEEP];
    const bool partial = keep < c[CUT_GROUP];
    const u16* row = logits + (i64)b * row_stride;
    const int first = blockIdx.x * IDS_PER_BLOCK + threadIdx.x * ITEMS;
    u32 keys[ITEMS];
    int members = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        keys[i] = first + i < V ? logit_key(row, first + i) : 0xFFFFFFFFu;   // none: never kept
        members += keys[i] == ck && first + i < V;
    }
    int rank = 0;
    if (partial) rank = group_rank_base(counts + (i64)b * gridDim.x, members);
    const float t = divisor(temperature[b]);
    const u32 rh = row_hash(seeds[b], steps[b]);
    u64 mine = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int v = first + i;
        if (v >= V) continue;
        bool kept = keys[i] > ck;
        if (keys[i] == ck) kept = !partial || rank++ < keep;
        if (!kept) continue;
        const float score = key_value(keys[i]) / t + gumbel(rh, (u32)v);
        const u64 packed = (u64)float_key(score) << 32 | (u64)(0xFFFFFFFFu - (u32)v);
        mine = packed > mine ? packed : mine;
    }
    const u64 blk = block_max_u64(mine, slots);
    if (threadIdx.x == 0 && blk) atomicMax(best + b, blk);
    if (!last_of_row(tickets + 2 * b + 1, &last)) return;
    if (threadIdx.x == 0) {
        const u64 win = atomicAdd(best + b, 0ull);
        out[b] = (i64)(0xFFFFFFFFu - (u32)win);
        best[b] = 0;
        tickets[2 * b + 1] = 0;
    }
}
