// NVFP4 MoE decode in one launch, warp-specialised: one producer warp streams weights for
// eight consumer warps, which work through the block's items without block-wide barriers.
//
// The work and its numbers are moe_decode.cu's: items are numbered w13 first (unit, strip pair),
// then w2 (unit, group of output strips); each item has one task per consumer warp (w13: gate or
// up strip × K slice; w2: output strip × K slice), and every sum runs in the same order, so the
// output is the same bit for bit. What differs is who waits for what:
// - The producer claims the block's items (block b starts on item b, later ones come from the
//   ticket counter in ticket order, AHEAD beyond the items the consumers have taken), announces
//   each in a queue of QD slots and issues every
//   task's stages into its consumer's ring of NBUF stages (packed words by one bulk copy, scale
//   words by cp.async tracked on the same mbarrier). It runs ahead of the consumers by as much as
//   the rings and the queue hold, across items: a w2 item's weights stream in while the block is
//   still on w13, and the next item's loads are in flight during an epilogue.
// - A consumer takes the items in queue order, waits for each stage on its ring slot's mbarrier
//   and frees the slot when done. w13 partials go to a ring of RD slots in shared memory; the
//   consumer that arrives last (a shared-memory counter) sums them in the fixed order and runs the
//   epilogue, while the others go on. w2 items keep two barriers among the consumers (named
//   barrier 1): their unit's act rows are staged once, as fp16, for the whole block.
// - The top-k sum of an output strip is done by the last unit to finish that strip (a counter
//   per strip, over all units of the call), by one warp.
//
// No deadlock: as in moe_decode.cu, items are claimed in ticket order (w13 before w2) and every
// block of the grid is resident. In a block the producer issues stages in item order, so the
// oldest unfinished item of the call always has its stages issued (everything before it in its
// block is done and has freed its ring slots) and, if it is a w2 item, the w13 items it waits for
// are done. A unit wait that runs past ~1 s sets error bit 8 and goes on.
//
// Counters (`sync`, zero at rest): [0] ticket, [1] blocks finished, [2 + u] w13 items of unit u
// done; `group_done[strip]` counts units that finished the strip. The last block of a launch puts
// [0], [1], the range's unit counters and its lanes' amax back to zero.
#include "common.cuh"
#include "mma_fp4.cuh"

#ifndef HP
#define HP 2048
#endif
#ifndef IP
#define IP 768
#endif
#ifndef NT
#define NT 8              // lane slots per unit
#endif
#ifndef OUT_BF16
#define OUT_BF16 1
#endif
#ifndef MINB
#define MINB 2            // blocks per SM the register allocation must allow
#endif
#ifndef MAXW
#define MAXW 64           // most lanes (T·K) of a call; at most the block's threads
#endif
#ifndef IN_BF16
#define IN_BF16 1         // x: 1 bf16 (w13 dequantises to bf16), 0 fp16 (to fp16)
#endif
#ifndef XALIGN
#define XALIGN 1          // 1: x 4-byte aligned (pairs read as one word; the launcher checks)
#endif
#ifndef HFULL
#define HFULL 1           // 1: H == HP (no column of x past the row's end is read)
#endif
#ifndef STAGE
#define STAGE 4           // chunks (512 B of packed words + 64 B of scales each) a stage
#endif
#ifndef NBUF
#define NBUF 4            // stages in each consumer's ring
#endif
#ifndef QD
#define QD 4              // item queue slots (how many items the producer may run ahead)
#endif
#ifndef AHEAD
#define AHEAD 1           // items the producer may claim beyond those the consumers have taken
#endif
#ifndef PFENCE
#define PFENCE 1          // producer: fence.proxy.async before each bulk copy into a freed slot
#endif
#ifndef DECODE_TRACE
#define DECODE_TRACE 0    // 1: globaltimer stamps into `trace` (profile_gemm --trace), as moe_decode.cu
#endif
#define TRACE_ITEMS 8192  // trace: [TRACE_ITEMS][4] item stamps, then [grid][2] block stamps
#ifndef WAITMODE
#define WAITMODE 0        // mbarrier waits: 0 try_wait; 1 the producer polls test_wait with nanosleep;
#endif                    // 2 producer and consumers poll
#ifndef PORDER
#define PORDER 0          // producer's stage order in an item: 0 stage-major, 1 consumer-major
#endif
#ifndef XT
#define XT 0              // >0: x (up to XT tokens) staged once per block in shared memory for w13
#endif
#ifndef PLANES
#define PLANES 0          // 1: producer lane c issues consumer c's bulk copies (8 in one instruction)
#endif
#ifndef WS_ABLATE
#define WS_ABLATE 0       // profiling only (wrong output), bits: 1 no scale-word loads
#endif
#ifndef RD
#define RD 2              // w13 partial-sum slots (how many w13 items consumers may drift apart)
#endif

#include "async_copy.cuh"
#include "moe_common.cuh"
#include "moe_lanes.cuh"

#define CONS 8                        // consumer warps; the producer is warp CONS
#define THREADS (32 * (CONS + 1))
#define ERR_STALL 8
#define ERR_SMEM 16                   // launched with less shared memory than the layout needs

constexpr int NC13 = HP / 64;              // chunks of a w13 strip
constexpr int NC2 = IP / 64;               // chunks of a w2 strip
constexpr int NP = IP / 16;                // w13 strip pairs (gate, up) of an expert
constexpr int NS = HP / 16;                // w2 output strips of an expert
constexpr int KS13 = CONS / 2;             // w13: 2 strips × 4 K slices
// w2: K slices of at most 8 chunks where IP allows, the rest of the consumers on more strips
// (moe_decode.cu's default split, so that the sums match it)
constexpr int KS2 = NC2 <= 8 ? 1 : NC2 <= 16 ? 2 : NC2 <= 32 ? 4 : 8;
constexpr int WM2 = CONS / KS2;
constexpr int G2 = (NS + WM2 - 1) / WM2;   // w2 items of a unit
constexpr int XS2 = IP + 8;                // fp16 per staged act row: (IP+8)/2 words ≡ 4 mod 32
constexpr int PART = NTILES * 4 * 32;      // floats of one warp's partial sums
static_assert(NBUF >= 1 && NBUF <= 16 && STAGE >= 1 && 16 * STAGE <= 256, "stage ring shape");
static_assert(AHEAD >= 1 && QD >= AHEAD + 1 && RD >= 1, "queue and partial rings need slots");
static_assert(MAXW <= THREADS && MAXW % 8 == 0, "group_lanes takes one lane per thread");

// One consumer's stage ring: full[b] completes when stage b's packed words and scale words have
// landed, empty[b] when the consumer is done with it.
struct Ring {
    u64 full[NBUF];
    u64 empty[NBUF];
    u8 w[NBUF][STAGE * 512];
    u32 s[NBUF][16 * STAGE];
};
static_assert(sizeof(Ring) == 16 * NBUF + NBUF * STAGE * 576, "gemm._fused_ws_smem mirrors this");

struct Queue {
    u64 full[QD];         // the producer wrote item[q]
    u64 empty[QD];        // every consumer has read it
    i32 item[QD];
};

// Shared-memory layout: byte offsets of each part, in this order. gemm._fused_ws_smem mirrors
// SMEM_BYTES (a CPU test compiles this with EXPECT_SMEM from it; the kernel also checks its launch).
constexpr u32 up16(u32 n) { return (n + 15) / 16 * 16; }
constexpr u32 OFF_Q = CONS * sizeof(Ring);
constexpr u32 OFF_RED13 = OFF_Q + up16(sizeof(Queue));
constexpr u32 OFF_CNT13 = OFF_RED13 + RD * CONS * PART * 4;
constexpr u32 OFF_GEN13 = OFF_CNT13 + RD * 4;
constexpr u32 OFF_RED2 = OFF_GEN13 + RD * 4;
constexpr u32 OFF_CNT2 = OFF_RED2 + CONS * PART * 4;
constexpr u32 OFF_SI = up16(OFF_CNT2 + CONS * 4);
constexpr u32 OFF_XS = OFF_SI + CONS * sizeof(SlotInfo);
constexpr u32 OFF_UNIT = up16(OFF_XS + NT * XS2 * 2);
constexpr u32 XSTR = HP + 8;               // u16 per staged x row; row XT is zeros (empty slots)
constexpr u32 OFF_X = up16(OFF_UNIT + MAXW * (8 + 4 + NT + 1));
constexpr u32 SMEM_BYTES = OFF_X + (XT ? (XT + 1) * XSTR * 2 : 0);
#ifdef EXPECT_SMEM
static_assert(SMEM_BYTES == EXPECT_SMEM, "gemm._fused_ws_smem disagrees with this layout");
#endif

struct Smem {
    Ring* rings;          // [CONS]
    Queue* q;
    float* red13;         // [RD][CONS][PART] w13 partial sums
    i32* cnt13;           // [RD] consumers done with the slot's item
    i32* gen13;           // [RD] w13 item (in this block's order) the slot is free for
    float* red2;          // [CONS][PART] w2 partial sums (KS2 > 1)
    i32* cnt2;            // [CONS] consumers done with each strip of the w2 item
    SlotInfo* si;         // [CONS] each consumer's view of its item's slots
    u16* xs;              // [NT][XS2] w2: the unit's act rows, fp16, scaled
    i64* unit_addr;       // [MAXW]
    float* lane_w;        // [MAXW]
    u8* unit_lanes;       // [MAXW][NT]
    u8* unit_count;       // [MAXW]
};

CUPOOL_DEVICE Smem carve(u8* smem) {
    Smem m;
    m.rings = reinterpret_cast<Ring*>(smem);
    m.q = reinterpret_cast<Queue*>(smem + OFF_Q);
    m.red13 = reinterpret_cast<float*>(smem + OFF_RED13);
    m.cnt13 = reinterpret_cast<i32*>(smem + OFF_CNT13);
    m.gen13 = reinterpret_cast<i32*>(smem + OFF_GEN13);
    m.red2 = reinterpret_cast<float*>(smem + OFF_RED2);
    m.cnt2 = reinterpret_cast<i32*>(smem + OFF_CNT2);
    m.si = reinterpret_cast<SlotInfo*>(smem + OFF_SI);
    m.xs = reinterpret_cast<u16*>(smem + OFF_XS);
    m.unit_addr = reinterpret_cast<i64*>(smem + OFF_UNIT);
    m.lane_w = reinterpret_cast<float*>(m.unit_addr + MAXW);
    m.unit_lanes = reinterpret_cast<u8*>(m.lane_w + MAXW);
    m.unit_count = m.unit_lanes + MAXW * NT;
    return m;
}

CUPOOL_DEVICE u32 dynamic_smem_bytes() {
    u32 v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

CUPOOL_DEVICE int ld_acquire(const i32* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

CUPOOL_DEVICE u32 ld_u32_cg(const u32* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

CUPOOL_DEVICE u32x4 ld_u32x4_cg(const void* p) {
    u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

CUPOOL_DEVICE int ld_volatile_shared(const i32* p) { return *reinterpret_cast<const volatile i32*>(p); }

CUPOOL_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// The phase of `bar` also waits for every cp.async this thread has issued so far (the arrival
// counts as pending until they land).
CUPOOL_DEVICE void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

CUPOOL_DEVICE bool mbar_test(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

template <bool PRODUCER>
CUPOOL_DEVICE void ws_wait(u32 bar, u32 parity) {
    if (WAITMODE == 0 || (WAITMODE == 1 && !PRODUCER)) {
        mbar_wait(bar, parity);
    } else {
        while (!mbar_test(bar, parity)) __nanosleep(20);
    }
}

CUPOOL_DEVICE void consumers_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(32 * CONS) : "memory");
}

// Chunks [c0, c1) of a strip of nc chunks for K slice ks of ksplit.
CUPOOL_DEVICE void k_slice(int ks, int ksplit, int nc, int& c0, int& c1) {
    const int per = (nc + ksplit - 1) / ksplit;
    c0 = min(ks * per, nc);
    c1 = min(c0 + per, nc);
}

// Stamp `idx` of the trace (lane 0 of the calling warp; DECODE_TRACE only). Items: 0 announced by
// the producer, 1 consumer 0 has it (w2: act staged), 2 consumer 0's K loop done, 3 done.
CUPOOL_DEVICE void stamp_at(u64* trace, int idx) {
#if DECODE_TRACE
    if ((threadIdx.x & 31) == 0) {
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        trace[idx] = t;
    }
#endif
}

CUPOOL_DEVICE void stamp(u64* trace, int item, int k) {
    if (item < TRACE_ITEMS) stamp_at(trace, item * 4 + k);
}

struct Args {
    u64* trace;
    u32 xs_smem;          // XT: shared address of the staged x rows
    const u16* x;
    int topk, tokens, hidden, all_units, first, n13, total;
    float* act;
    u32* amax;
    float* yw;
    i32* group_done;
    i32* ticket;
    i32* unit_done;
    u16* out;
    i32* error;
};

// Consumer c's task of an item: its strip and chunks [c0, c1).
struct Task {
    const u8* strip;
    int c0, c1;
};

CUPOOL_DEVICE Task task_of(const Args& a, const Smem& m, int item, int c) {
    Task t;
    if (item < a.n13) {
        const int u = a.first + item / NP, p = item % NP;
        t.strip = reinterpret_cast<const u8*>(m.unit_addr[u]) + 256 + (i64)(2 * p + c / KS13) * W13_STRIP;
        k_slice(c % KS13, KS13, NC13, t.c0, t.c1);
    } else {
        const int i = item - a.n13, u = a.first + i / G2, st = (i % G2) * WM2 + c / KS2;
        t.strip = reinterpret_cast<const u8*>(m.unit_addr[u]) + W2_OFFSET + (i64)st * W2_STRIP;
        t.c0 = t.c1 = 0;
        if (st < NS) k_slice(c % KS2, KS2, NC2, t.c0, t.c1);
    }
    return t;
}

// Producer: chunks [c, min(c + STAGE, c1)) of a strip (KP columns) into ring slot `slot`.
template <int KP>
CUPOOL_DEVICE void produce_stage(Ring& r, int slot, const u8* strip, int c, int c1, int lane) {
    const int n = min(STAGE, c1 - c);
    const u32 bar = smem_addr(&r.full[slot]);
#pragma unroll
    for (int idx = lane; idx < 16 * STAGE; idx += 32) {
        const int row = idx / STAGE, ci = idx % STAGE;
        if (ci < n && !(WS_ABLATE & 1))
            cp_async4(&r.s[slot][idx], strip + 8 * KP + row * (KP / 16) + 4 * (c + ci));
    }
    if (!(WS_ABLATE & 1)) cp_async_mbar_arrive(bar);   // before the one counted arrival below
    __syncwarp();
    if (lane == 0) {
        if (PFENCE) fence_proxy_async_smem();          // the slot's last reads were generic loads
        mbar_arrive_expect(bar, n * 512);
        bulk_load(smem_addr(&r.w[slot][0]), strip + (i64)c * 512, n * 512, bar);
    }
}

// Producer: every consumer's stages of one item, stage by stage across the consumers, each into
// the next slot of that consumer's ring once the consumer has freed it.
template <int KP>
CUPOOL_DEVICE void produce_item(const Args& a, const Smem& m, int item, u32 (&issued)[CONS], int lane) {
    Task t[CONS];
    int stages = 0;
#pragma unroll
    for (int c = 0; c < CONS; ++c) {
        t[c] = task_of(a, m, item, c);
        stages = max(stages, (t[c].c1 - t[c].c0 + STAGE - 1) / STAGE);
    }
    auto one = [&](int c, int s) {
        const int cc = t[c].c0 + s * STAGE;
        if (cc >= t[c].c1) return;
        Ring& r = m.rings[c];
        const u32 slot = issued[c] % NBUF, use = issued[c] / NBUF;
        if (use > 0) ws_wait<true>(smem_addr(&r.empty[slot]), (use - 1) & 1u);
        produce_stage<KP>(r, slot, t[c].strip, cc, t[c].c1, lane);
        ++issued[c];
    };
    if (PORDER == 0) {
        for (int s = 0; s < stages; ++s)
#pragma unroll
            for (int c = 0; c < CONS; ++c) one(c, s);
    } else {
#pragma unroll
        for (int c = 0; c < CONS; ++c)
            for (int s = 0; s < stages; ++s) one(c, s);
    }
}

// PLANES: lane c < CONS keeps consumer c's task and ring count; per stage, the lanes wait for their
// consumers' slots, the warp issues every consumer's scale words, then lanes 0..7 issue the eight
// bulk copies in one instruction.
template <int KP>
CUPOOL_DEVICE void produce_item_lanes(const Args& a, const Smem& m, int item, u32& mine_issued,
                                      int lane) {
    const bool mine = lane < CONS;
    const Task t = task_of(a, m, item, mine ? lane : 0);
    int stages = mine ? (t.c1 - t.c0 + STAGE - 1) / STAGE : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) stages = max(stages, __shfl_xor_sync(0xffffffffu, stages, o));
    const u64 strip = reinterpret_cast<u64>(t.strip);
    for (int s = 0; s < stages; ++s) {
        const int cc = t.c0 + s * STAGE;
        const bool has = mine && cc < t.c1;
        const u32 slot = mine_issued % NBUF, use = mine_issued / NBUF;
        if (has && use > 0) ws_wait<true>(smem_addr(&m.rings[lane].empty[slot]), (use - 1) & 1u);
        __syncwarp();
#pragma unroll
        for (int c = 0; c < CONS; ++c) {
            const int ccc = __shfl_sync(0xffffffffu, cc, c), c1 = __shfl_sync(0xffffffffu, t.c1, c);
            const u32 sl = __shfl_sync(0xffffffffu, slot, c);
            const u8* st = reinterpret_cast<const u8*>(__shfl_sync(0xffffffffu, strip, c));
            if (ccc >= c1) continue;
            Ring& r = m.rings[c];
            const int n = min(STAGE, c1 - ccc);
#pragma unroll
            for (int idx = lane; idx < 16 * STAGE; idx += 32) {
                const int row = idx / STAGE, ci = idx % STAGE;
                if (ci < n && !(WS_ABLATE & 1))
                    cp_async4(&r.s[sl][idx], st + 8 * KP + row * (KP / 16) + 4 * (ccc + ci));
            }
            if (!(WS_ABLATE & 1)) cp_async_mbar_arrive(smem_addr(&r.full[sl]));
        }
        __syncwarp();
        if (has) {
            Ring& r = m.rings[lane];
            const int n = min(STAGE, t.c1 - cc);
            const u32 bar = smem_addr(&r.full[slot]);
            if (PFENCE) fence_proxy_async_smem();
            mbar_arrive_expect(bar, n * 512);
            bulk_load(smem_addr(&r.w[slot][0]), t.strip + (i64)cc * 512, n * 512, bar);
            ++mine_issued;
        }
    }
}

// Items are claimed lazily: the next ticket only once the consumers have taken the item AHEAD - 1
// before the one just issued (AHEAD 1: the next item's loads stream while the consumers work on
// this one). Claiming as far ahead as the queue allows piles items onto the first blocks.
CUPOOL_DEVICE void producer(const Args& a, const Smem& m, int base) {
    const int lane = threadIdx.x & 31;
    u32 issued[CONS];
#pragma unroll
    for (int c = 0; c < CONS; ++c) issued[c] = 0;
    u32 mine_issued = 0;                     // PLANES: stages issued to consumer `lane`
    int item = (int)blockIdx.x < base ? (int)blockIdx.x : a.total;
    for (int j = 0;; ++j) {
        const int q = j % QD;
        if (j >= QD) ws_wait<true>(smem_addr(&m.q->empty[q]), (u32)(j / QD - 1) & 1u);
        if (lane == 0) {
            m.q->item[q] = item;
            mbar_arrive(smem_addr(&m.q->full[q]));
        }
        if (item >= a.total) break;
        stamp(a.trace, item, 0);
        if (PLANES) {
            if (item < a.n13) produce_item_lanes<HP>(a, m, item, mine_issued, lane);
            else produce_item_lanes<IP>(a, m, item, mine_issued, lane);
        } else {
            if (item < a.n13) produce_item<HP>(a, m, item, issued, lane);
            else produce_item<IP>(a, m, item, issued, lane);
        }
        const int taken = j + 1 - AHEAD;
        if (taken >= 0) ws_wait<true>(smem_addr(&m.q->empty[taken % QD]), (u32)(taken / QD) & 1u);
        int next = a.total;
        if (lane == 0 && base < a.total) next = base + atomicAdd(a.ticket, 1);
        item = __shfl_sync(0xffffffffu, next, 0);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// Consumer: acc[nt] += chunks [c0, c1) × B, stage by stage from the ring (n: stages taken so far).
template <bool BF, class BFrag>
CUPOOL_DEVICE void consume(Ring& r, u32& n, int c0, int c1, int ntiles, float (&acc)[NTILES][4],
                           int lane, BFrag bfrag) {
    const int g = lane >> 2;
    for (int c = c0; c < c1; c += STAGE, ++n) {
        const u32 slot = n % NBUF;
        ws_wait<false>(smem_addr(&r.full[slot]), (n / NBUF) & 1u);
#pragma unroll
        for (int ci = 0; ci < STAGE; ++ci) {
            if (c + ci >= c1) break;
            const u32x4 w = *reinterpret_cast<const u32x4*>(&r.w[slot][ci * 512 + lane * 16]);
            u32 af[4][4];
            dequant_chunk<BF>(w, r.s[slot][g * STAGE + ci], r.s[slot][(g + 8) * STAGE + ci], af);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) {
                    if (nt >= ntiles) continue;
                    u32 b0, b1;
                    bfrag(c + ci, nt, q, b0, b1);
                    mma16816<BF>(acc[nt], af[q], b0, b1);
                }
            }
        }
        __syncwarp();                        // every lane done with the slot
        if (lane == 0) mbar_arrive(smem_addr(&r.empty[slot]));
    }
}

CUPOOL_DEVICE void put_partial(float* red, int lane, const float (&acc)[NTILES][4]) {
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[(nt * 4 + r) * 32 + lane] = acc[nt][r];
}

// Σ over warps w0 .. w0 + n - 1 of their partials in `red` ([warp][PART]), in that order.
CUPOOL_DEVICE void sum_partials(const float* red, int w0, int n, int lane, float (&acc)[NTILES][4]) {
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float v = 0.0f;
            for (int w = w0; w < w0 + n; ++w) v += red[w * PART + (nt * 4 + r) * 32 + lane];
            acc[nt][r] = v;
        }
}

// After this warp's shared-memory stores: true in every lane of the warp that arrives
// `expected`-th on *count (which it resets).
CUPOOL_DEVICE bool warp_last_arrival(i32* count, int expected, int lane) {
    __threadfence_block();
    __syncwarp();
    int last = 0;
    if (lane == 0) {
        last = atomicAdd(count, 1) == expected - 1;
        if (last) *count = 0;
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    if (last) __threadfence_block();
    return last != 0;
}

// Two activations (k, k+1) of a token row as the B fragment word; 0 past the row's end.
CUPOOL_DEVICE u32 x_pair(const u16* row, int k, int hidden) {
    if (row == nullptr || (!HFULL && k >= hidden)) return 0u;
#if XALIGN
    return *reinterpret_cast<const u32*>(row + k);
#else
    return (u32)row[k] | (!HFULL && k + 1 >= hidden ? 0u : (u32)row[k + 1] << 16);
#endif
}

// Lane of slot s of unit u, -1 if empty.
CUPOOL_DEVICE int unit_lane(const Smem& m, int u, int s) {
    return s < m.unit_count[u] ? (int)m.unit_lanes[u * NT + s] : -1;
}

// w13 task of consumer c: strip (gate for c < KS13, else up) of pair p of unit u, K slice c % KS13.
// The consumer that finishes the item last runs its epilogue. i13: this block's w13 item count.
CUPOOL_DEVICE void w13_task(const Args& a, const Smem& m, Ring& r, u32& n, int u, int p, int i13,
                             int item) {
    const int c = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c0, c1;
    k_slice(c % KS13, KS13, NC13, c0, c1);
    const float* hdr = reinterpret_cast<const float*>(m.unit_addr[u]);
    const float gs_gate = hdr[0], gs_up = hdr[1];               // in flight during the K loop
    const int ntiles = (m.unit_count[u] + 7) >> 3;
    const int g = lane >> 2, t = lane & 3, hidden = a.hidden;
    const u16* xrow[NTILES];
    u32 xsrow[NTILES];                                          // XT: shared address of the row
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
        const int l = unit_lane(m, u, nt * 8 + g);
        xrow[nt] = l >= 0 ? a.x + (i64)(l / a.topk) * hidden : nullptr;
        xsrow[nt] = a.xs_smem + (u32)(l >= 0 ? l / a.topk : XT) * XSTR * 2;
    }
    float acc[NTILES][4] = {};
    if (c == 0) stamp(a.trace, item, 1);
    consume<IN_BF16>(r, n, c0, c1, ntiles, acc, lane, [&](int ch, int nt, int q, u32& b0, u32& b1) {
        const int k = ch * 64 + q * 16 + 2 * t;
        if (XT) {
            asm("ld.shared.b32 %0, [%1];" : "=r"(b0) : "r"(xsrow[nt] + 2 * k));
            asm("ld.shared.b32 %0, [%1];" : "=r"(b1) : "r"(xsrow[nt] + 2 * k + 16));
        } else {
            b0 = x_pair(xrow[nt], k, hidden);
            b1 = x_pair(xrow[nt], k + 8, hidden);
        }
    });
    if (c == 0) stamp(a.trace, item, 2);
    const int rs = i13 % RD;
    if (lane == 0)
        while (ld_volatile_shared(m.gen13 + rs) != i13) __nanosleep(32);   // slot's last item read
    __syncwarp();
    float* red = m.red13 + rs * CONS * PART;
    put_partial(red + c * PART, lane, acc);
    if (!warp_last_arrival(m.cnt13 + rs, CONS, lane)) return;
    float gu[2][NTILES][4];
    sum_partials(red, 0, KS13, lane, gu[0]);
    sum_partials(red, KS13, KS13, lane, gu[1]);
    __syncwarp();
    if (lane == 0) {                                            // partials read: slot free
        __threadfence_block();
        *reinterpret_cast<volatile i32*>(m.gen13 + rs) = i13 + RD;
    }
    SlotInfo* si = m.si + c;
    if (lane < NT) {
        si->lane[lane] = unit_lane(m, u, lane);
        si->scale[lane] = 1.0f;                                 // x goes in unscaled
    }
    __syncwarp();
    w13_epilogue(gu, ntiles, si, gs_gate * dequant_unscale<IN_BF16>(),
                 gs_up * dequant_unscale<IN_BF16>(), p, lane, a.act, a.amax);
    __threadfence();                                            // act and amax before the count
    __syncwarp();
    if (lane == 0) atomicAdd(a.unit_done + u, 1);
    stamp(a.trace, item, 3);
}

// Top-k sum of rows [h0, h0 + rows) of every token by one warp (as moe_common's topk_sum).
CUPOOL_DEVICE void warp_topk_sum(int h0, int rows, int lane, const Args& a, const float* lane_w) {
    for (int i = lane; i < a.tokens * rows; i += 32) {
        const int tk = i / rows, h = h0 + i % rows;
        if (h >= a.hidden) continue;
        float sum = 0.0f;
        for (int k = 0; k < a.topk; ++k) {
            const int l = tk * a.topk + k;
            if (lane_w[l] != 0.0f) sum += ld_f32_cg(a.yw + (i64)l * HP + h);
        }
#if OUT_BF16
        a.out[(i64)tk * a.hidden + h] = f32_to_bf16(sum);
#else
        a.out[(i64)tk * a.hidden + h] = f32_to_f16(sum);
#endif
    }
}

// w2 task of consumer c: output strip grp·WM2 + c / KS2 of unit u, K slice c % KS2. All consumers
// meet twice: once the unit's act is complete (and the block's last w2 item is done with xs), and
// once its act rows are staged.
CUPOOL_DEVICE void w2_task(const Args& a, const Smem& m, Ring& r, u32& n, int u, int grp, int item) {
    const int c = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = c / KS2, st = grp * WM2 + wm;
    int c0 = 0, c1 = 0;
    if (st < NS) k_slice(c % KS2, KS2, NC2, c0, c1);
    const float gs_down = reinterpret_cast<const float*>(m.unit_addr[u])[2];
    const int ntiles = (m.unit_count[u] + 7) >> 3;
    if (threadIdx.x == 0) {                                     // the unit's act is complete
        int spins = 0;
        while (ld_acquire(a.unit_done + u) < NP) {
            __nanosleep(32);
            if (++spins == (1 << 25)) { atomicOr(a.error, ERR_STALL); break; }
        }
    }
    consumers_sync();
    // act rows (fp32, L2: written by other blocks) as fp16 / the slot's power-of-two scale
    SlotInfo* si = m.si + c;
    if (lane < NT) {
        const int l = unit_lane(m, u, lane);
        si->lane[lane] = l;
        si->scale[lane] = l >= 0 ? pow2_scale(__uint_as_float(ld_u32_cg(a.amax + l))) : 1.0f;
    }
    constexpr int VPR = IP / 4;
    for (int v = threadIdx.x; v < ntiles * 8 * VPR; v += 32 * CONS) {
        const int s = v / VPR, col = (v % VPR) * 4;
        const int l = unit_lane(m, u, s);
        u32 lo = 0u, hi = 0u;
        if (l >= 0) {
            const u32x4 f = ld_u32x4_cg(a.act + (i64)l * IP + col);
            const float inv = 1.0f / pow2_scale(__uint_as_float(ld_u32_cg(a.amax + l)));
            lo = (u32)f32_to_f16(__uint_as_float(f.x) * inv) | ((u32)f32_to_f16(__uint_as_float(f.y) * inv) << 16);
            hi = (u32)f32_to_f16(__uint_as_float(f.z) * inv) | ((u32)f32_to_f16(__uint_as_float(f.w) * inv) << 16);
        }
        u32* dst = reinterpret_cast<u32*>(m.xs + s * XS2 + col);
        dst[0] = lo;
        dst[1] = hi;
    }
    consumers_sync();
    if (c == 0) stamp(a.trace, item, 1);
    const int g = lane >> 2, t = lane & 3;
    float acc[NTILES][4] = {};
    consume<false>(r, n, c0, c1, ntiles, acc, lane, [&](int ch, int nt, int q, u32& b0, u32& b1) {
        const u16* xp = m.xs + (nt * 8 + g) * XS2 + ch * 64 + q * 16 + 2 * t;
        b0 = *reinterpret_cast<const u32*>(xp);
        b1 = *reinterpret_cast<const u32*>(xp + 8);
    });
    if (c == 0) stamp(a.trace, item, 2);
    if (KS2 > 1) {
        put_partial(m.red2 + c * PART, lane, acc);
        if (!warp_last_arrival(m.cnt2 + wm, KS2, lane)) return;
        sum_partials(m.red2, wm * KS2, KS2, lane, acc);
    }
    if (st >= NS) return;
    w2_epilogue(acc, ntiles, si, gs_down * dequant_unscale<false>(), st, lane, m.lane_w,
                a.topk, a.hidden, false, a.yw, nullptr);
    // the last unit to finish this strip sums over top-k in fixed order
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(a.group_done + st, 1) == a.all_units - 1;
    if (__shfl_sync(0xffffffffu, last, 0)) {
        __threadfence();
        if (lane == 0) a.group_done[st] = 0;                    // ready for the next call
        warp_topk_sum(st * 16, 16, lane, a, m.lane_w);
    }
}

CUPOOL_DEVICE void consumer(const Args& a, const Smem& m) {
    const int c = threadIdx.x >> 5, lane = threadIdx.x & 31;
    Ring& r = m.rings[c];
    u32 n = 0;                               // stages taken from the ring
    int i13 = 0;                             // w13 items seen
    for (int j = 0;; ++j) {
        const int q = j % QD;
        ws_wait<false>(smem_addr(&m.q->full[q]), (u32)(j / QD) & 1u);
        const int item = m.q->item[q];
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&m.q->empty[q]));
        if (item >= a.total) break;
        if (item < a.n13) {
            w13_task(a, m, r, n, a.first + item / NP, item % NP, i13++, item);
        } else {
            const int i = item - a.n13;
            w2_task(a, m, r, n, a.first + i / G2, i % G2, item);
            if (c == 0) stamp(a.trace, item, 3);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_decode(const u16* __restrict__ x,            // [T, H] bf16/fp16 hidden states
           i32 tokens, i32 hidden,
           const i64* __restrict__ lane_addr,    // [W] row address per lane (0: padding)
           const i32* __restrict__ lane_fresh,   // [W] 1: row being copied in (null: none)
           const void* __restrict__ topk_w,      // [W] router weights, W_DTYPE
           i32 W, i32 topk,
           i32 part,                             // 0: rows in place, 1: fresh rows, 2: all
           float* __restrict__ act,              // [W, IP]
           u32* __restrict__ amax,               // [W] zero at rest
           float* __restrict__ yw,               // [W, HP]
           i32* __restrict__ group_done,         // [NS] zero at rest
           i32* __restrict__ sync,               // [2 + W] zero at rest
           u16* __restrict__ out,                // [T, H]
           i32* __restrict__ error,
           u64* __restrict__ trace) {            // DECODE_TRACE only (else unused, may be null)
    extern __shared__ __align__(16) u8 smem[];
    __shared__ int s_held, s_total;
    __shared__ Args a;                    // in shared memory: registers stay with the K loop
    const Smem m = carve(smem);
    if (threadIdx.x == 0) stamp_at(trace, TRACE_ITEMS * 4 + blockIdx.x * 2);
    if (SMEM_BYTES > dynamic_smem_bytes() || (XT && tokens > XT)) {   // launcher and layout disagree
        if (threadIdx.x == 0) atomicOr(error, ERR_SMEM);
        return;
    }
    {   // unit table of the call; scratch in the (not yet used) rings
        i64* s_addr = reinterpret_cast<i64*>(m.rings);
        int* s_base = reinterpret_cast<int*>(s_addr + THREADS);
        group_lanes(lane_addr, lane_fresh, topk_w, W, s_addr, s_base, s_base + THREADS, m.lane_w,
                    m.unit_addr, m.unit_lanes, m.unit_count, &s_held, &s_total, error,
                    blockIdx.x == 0);
    }
    __syncthreads();                      // the scratch is dead
    if (threadIdx.x == 0) stamp_at(trace, TRACE_ITEMS * 4 + blockIdx.x * 2 + 1);
    if (XT) {                             // x rows (and a zero row) for w13's B fragments
        u16* xs = reinterpret_cast<u16*>(smem + OFF_X);
        for (int i = threadIdx.x; i < (XT + 1) * (HP / 2); i += THREADS) {
            const int tok = i / (HP / 2), k = (i % (HP / 2)) * 2;
            u32 v = 0u;
            if (tok < tokens && k < hidden)
                v = (u32)x[(i64)tok * hidden + k] | (k + 1 < hidden ? (u32)x[(i64)tok * hidden + k + 1] << 16 : 0u);
            *reinterpret_cast<u32*>(xs + tok * XSTR + k) = v;
        }
    }
    const int first = part == 1 ? s_held : 0;
    const int count = (part == 0 ? s_held : s_total) - first;
    const int n13 = count * NP, total = n13 + count * G2;
    if (threadIdx.x == 0) {
        a.trace = trace; a.xs_smem = smem_addr(smem) + OFF_X; a.x = x; a.topk = topk; a.tokens = tokens; a.hidden = hidden; a.all_units = s_total;
        a.first = first; a.n13 = n13; a.total = total;
        a.act = act; a.amax = amax; a.yw = yw; a.group_done = group_done;
        a.ticket = sync; a.unit_done = sync + 2; a.out = out; a.error = error;
        for (int c = 0; c < CONS; ++c)
            for (int b = 0; b < NBUF; ++b) {
                mbar_init(smem_addr(&m.rings[c].full[b]), 1);
                mbar_init(smem_addr(&m.rings[c].empty[b]), 1);
            }
        for (int q = 0; q < QD; ++q) {
            mbar_init(smem_addr(&m.q->full[q]), 1);
            mbar_init(smem_addr(&m.q->empty[q]), CONS);
        }
        for (int s = 0; s < RD; ++s) { m.cnt13[s] = 0; m.gen13[s] = s; }
        for (int w = 0; w < CONS; ++w) m.cnt2[w] = 0;
        fence_proxy_async_smem();
    }
    __syncthreads();
    if (s_total <= 0) {                                        // every lane was padding
        for (int i = blockIdx.x * THREADS + threadIdx.x; i < tokens * hidden; i += gridDim.x * THREADS)
            out[i] = 0;
    }
    if ((threadIdx.x >> 5) == CONS) producer(a, m, min(total, (int)gridDim.x));
    else consumer(a, m);
    __syncthreads();
    // the last block out puts the counters and its lanes' amax back to zero for the next launch
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1) == (int)gridDim.x - 1) {
            for (int u = first; u < first + count; ++u) {
                a.unit_done[u] = 0;
                for (int s = 0; s < m.unit_count[u]; ++s) amax[m.unit_lanes[u * NT + s]] = 0u;
            }
            sync[0] = 0;
            sync[1] = 0;
            __threadfence();
        }
    }
}
