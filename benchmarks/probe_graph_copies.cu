// Can a CUDA graph aim the copy engine at rows that a kernel picks on the device?
//
// A decode step's misses are known only on the GPU (the plan step), so inside the captured step
// they are copied by a kernel (rawkernels/rowcopy.cu), which takes SMs and runs below the copy
// engine's rate. A conditional SWITCH node (CUDA 12.4+) runs the body whose index a kernel set with
// cudaGraphSetConditional, and a body may hold memcpy nodes: a switch a miss slot, with a body an
// expert that copies that expert's host row into the slot, would let the plan step choose the
// copies and the copy engine make them. This program measures what that costs and delivers on the
// GPU in hand, before cupool builds on it:
//
//   pinned       cudaMemcpyAsync of rows host → device: the link's rate, the bound
//   layer        pick kernel → K switch nodes (E bodies each) → join kernel: K = 1, 2, 4, 8 rows
//                copied; the same K switches copying nothing (value E); no switches at all
//   overlap      a kernel that keeps every SM busy for a set time, alone and beside K switches
//                that copy: the copy engine runs beside the SMs if the sum is near the longer one
//   chain        48 layers in one graph (pick → switches → join, then the next layer's pick),
//                1 or 2 slots a layer, against the same chain without switches: the switches'
//                cost a layer, and the time a copied row adds; the graph's instantiation time;
//                and the chain with 1 slot made by stream capture, as cupool captures its step,
//                alone and with a settle kernel that moves each slot into the bank row the
//                plan step chose (a memcpy node's destination is fixed when the graph is made)
//
// Every slot a run copied is compared byte for byte with the host row its pick named (fresh
// random picks, rows of random bytes); a mismatch fails the run (exit 1). Results are printed and
// written as JSON to argv[1] (benchmarks/run_gpu.sh graph-copies builds and runs it).
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -o probe_graph_copies benchmarks/probe_graph_copies.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#define CK(x) check((x), #x, __LINE__)
static void check(cudaError_t e, const char* what, int line) {
    if (e != cudaSuccess) {
        fprintf(stderr, "probe_graph_copies.cu:%d: %s: %s\n", line, what, cudaGetErrorString(e));
        exit(2);
    }
}

// One expert row of the Qwen3-30B-A3B shape (H 2048, I 768) as cupool/layout.py lays it out:
// a 256-byte header, 96 w13 strips of 18,432 bytes, 128 w2 strips of 6,912.
constexpr size_t ROW = 256 + 96 * 18432 + 128 * 6912;
constexpr int E = 128;          // experts a layer: bodies a switch
constexpr int LAYERS = 48;
constexpr int MAXK = 8;         // slots a layer, at most
constexpr int BANK = 64;        // bank rows the settled chain moves its slots into
constexpr int WARMUP = 5, REPEATS = 40;

// Sets slot k's switch to the expert ids[k] names (a negative id: E, no body runs). One thread
// sets them all: racing calls to cudaGraphSetConditional are undefined.
__global__ void pick(const int* ids, const cudaGraphConditionalHandle* handles, int k) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        for (int i = 0; i < k; ++i) {
            const int e = ids[i];
            cudaGraphSetConditional(handles[i], e < 0 ? (unsigned)E : (unsigned)e);
        }
}

// What the GEMM of a layer's rows would be to the copies: a kernel that reads each slot.
__global__ void join(const unsigned char* slots, int k, unsigned long long* sink) {
    if (threadIdx.x < k)
        atomicAdd(sink, *reinterpret_cast<const unsigned long long*>(slots + threadIdx.x * ROW));
}

// Moves each of the k slots into the bank row dest[i] names, 16 bytes a thread at a time: where
// a miss's row ends up once the copy engine has put it in a fixed slot (the plan step chooses the
// row on the device; a memcpy node's destination is fixed when the graph is made).
__global__ void settle(const unsigned char* slots, const int* dest, unsigned char* bank, int k) {
    for (int i = 0; i < k; ++i) {
        const int4* src = reinterpret_cast<const int4*>(slots + size_t(i) * ROW);
        int4* dst = reinterpret_cast<int4*>(bank + size_t(dest[i]) * ROW);
        for (size_t v = blockIdx.x * blockDim.x + threadIdx.x; v < ROW / 16;
             v += size_t(gridDim.x) * blockDim.x)
            dst[v] = src[v];
    }
}

// Every thread spins until `ns` nanoseconds have passed since it started (%globaltimer).
__global__ void busy(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}

struct Probe {
    int sms = 0;
    unsigned char* host = nullptr;    // [E][ROW] pinned, random bytes
    unsigned char* slots = nullptr;   // [LAYERS][MAXK][ROW] on the device
    int* ids = nullptr;               // [LAYERS][MAXK] the picks, on the device
    unsigned char* bank = nullptr;    // [BANK][ROW] rows the settle kernel moves slots into
    int* dest = nullptr;              // [LAYERS][MAXK] their bank rows, on the device
    std::vector<int> dests;           // what dest holds
    unsigned long long* sink = nullptr;
    cudaStream_t stream{};
    cudaEvent_t ev0{}, ev1{};
    std::mt19937 rng{20261204};
    std::vector<int> picks;           // [LAYERS][MAXK] what ids holds

    unsigned char* slot(int l, int k) const { return slots + (size_t(l) * MAXK + k) * ROW; }
};

// Host → device in the probe's stream (which does not wait for the legacy default stream), done
// before it returns.
static void put(Probe& P, void* dst, const void* src, size_t bytes) {
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, P.stream));
    CK(cudaStreamSynchronize(P.stream));
}

static cudaGraphNode_t add_kernel(cudaGraph_t g, const std::vector<cudaGraphNode_t>& deps,
                                  void* fn, dim3 grid, dim3 block, void** args) {
    cudaKernelNodeParams p = {};
    p.func = fn;
    p.gridDim = grid;
    p.blockDim = block;
    p.kernelParams = args;
    cudaGraphNode_t n;
    CK(cudaGraphAddKernelNode(&n, g, deps.data(), deps.size(), &p));
    return n;
}

// A switch of E bodies after `deps`: body e copies expert e's host row into `dst`.
static cudaGraphNode_t add_switch(const Probe& P, cudaGraph_t g,
                                  const std::vector<cudaGraphNode_t>& deps,
                                  cudaGraphConditionalHandle h, unsigned char* dst) {
    cudaGraphNodeParams p = {};
    p.type = cudaGraphNodeTypeConditional;
    p.conditional.handle = h;
    p.conditional.type = cudaGraphCondTypeSwitch;
    p.conditional.size = E;
    cudaGraphNode_t n;
    CK(cudaGraphAddNode(&n, g, deps.data(), nullptr, deps.size(), &p));
    for (int e = 0; e < E; ++e) {
        cudaGraphNode_t m;
        CK(cudaGraphAddMemcpyNode1D(&m, p.conditional.phGraph_out[e], nullptr, 0, dst,
                                    P.host + size_t(e) * ROW, ROW, cudaMemcpyHostToDevice));
    }
    return n;
}

struct Built {
    cudaGraphExec_t exec{};
    cudaGraphConditionalHandle* handles = nullptr;   // [LAYERS][MAXK] on the device: the graph's
    double instantiate_s = 0;
};

static Built with_handles() {
    Built b;
    CK(cudaMalloc(&b.handles, sizeof(cudaGraphConditionalHandle) * LAYERS * MAXK));
    return b;
}

static void destroy(Built& b) {
    CK(cudaGraphExecDestroy(b.exec));
    CK(cudaFree(b.handles));
}

// k handles a layer (slots i < k of hs[l·MAXK + i]; the others stay 0 and are never set), each
// back to E (no body) at every launch unless a pick kernel sets it.
static void make_handles(std::vector<cudaGraphConditionalHandle>& hs, cudaGraph_t g, int layers,
                         int k) {
    if (hs.empty()) return;
    for (int l = 0; l < layers; ++l)
        for (int i = 0; i < k; ++i)
            CK(cudaGraphConditionalHandleCreate(&hs[l * MAXK + i], g, E,
                                                cudaGraphCondAssignDefault));
}

// b.exec from g (timed), then g goes.
static void instantiate(Built& b, cudaGraph_t g) {
    const auto t0 = std::chrono::steady_clock::now();
    CK(cudaGraphInstantiate(&b.exec, g, 0));
    b.instantiate_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CK(cudaGraphDestroy(g));
}

// `layers` layers in a chain: pick → (k switches) (and a busy kernel of busy_ns) → join.
static Built build(Probe& P, int layers, int k, bool switches, unsigned long long busy_ns) {
    Built b = with_handles();
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    // the kernel nodes copy their arguments when added, so these may live on the stack
    std::vector<cudaGraphConditionalHandle> hs(switches ? size_t(layers) * MAXK : 0);
    make_handles(hs, g, layers, k);
    if (switches) put(P, b.handles, hs.data(), hs.size() * sizeof(hs[0]));
    cudaGraphNode_t prev{};
    bool first = true;
    for (int l = 0; l < layers; ++l) {
        const int* ids = P.ids + l * MAXK;
        const cudaGraphConditionalHandle* hl = b.handles + l * MAXK;
        int kk = k, set = switches ? k : 0;     // without switches the pick sets nothing
        void* pa[] = {&ids, &hl, &set};
        std::vector<cudaGraphNode_t> deps;
        if (!first) deps.push_back(prev);
        cudaGraphNode_t pk = add_kernel(g, deps, (void*)pick, 1, 32, pa);
        std::vector<cudaGraphNode_t> before_join{pk};
        if (switches) {
            before_join.clear();
            for (int i = 0; i < k; ++i)
                before_join.push_back(add_switch(P, g, {pk}, hs[l * MAXK + i], P.slot(l, i)));
        }
        if (busy_ns) {
            unsigned long long ns = busy_ns;
            void* ba[] = {&ns};
            before_join.push_back(add_kernel(g, {pk}, (void*)busy, P.sms * 8, 256, ba));
        }
        const unsigned char* s = P.slot(l, 0);
        void* ja[] = {&s, &kk, &P.sink};
        prev = add_kernel(g, before_join, (void*)join, 1, 32, ja);
        first = false;
    }
    instantiate(b, g);
    return b;
}

// The same chain (no busy kernel) made the way a captured decode step would make it: the
// kernels captured from a stream, each layer's switches added to the graph being captured
// (cudaStreamGetCaptureInfo) and made the stream's dependencies for the join kernel; with
// `settled`, a settle kernel (32 blocks) moves the slots into their bank rows before the join.
static Built build_captured(Probe& P, int layers, int k, bool settled) {
    Built b = with_handles();
    CK(cudaStreamBeginCapture(P.stream, cudaStreamCaptureModeThreadLocal));
    cudaStreamCaptureStatus status;
    cudaGraph_t g;
    const cudaGraphNode_t* deps;
    size_t ndeps;
    CK(cudaStreamGetCaptureInfo(P.stream, &status, nullptr, &g, &deps, nullptr, &ndeps));
    std::vector<cudaGraphConditionalHandle> hs(size_t(layers) * MAXK);
    make_handles(hs, g, layers, k);
    for (int l = 0; l < layers; ++l) {
        pick<<<1, 32, 0, P.stream>>>(P.ids + l * MAXK, b.handles + l * MAXK, k);
        CK(cudaGetLastError());
        CK(cudaStreamGetCaptureInfo(P.stream, &status, nullptr, &g, &deps, nullptr, &ndeps));
        const std::vector<cudaGraphNode_t> after_pick(deps, deps + ndeps);
        std::vector<cudaGraphNode_t> sw;
        for (int i = 0; i < k; ++i)
            sw.push_back(add_switch(P, g, after_pick, hs[l * MAXK + i], P.slot(l, i)));
        CK(cudaStreamUpdateCaptureDependencies(P.stream, sw.data(), nullptr, sw.size(),
                                               cudaStreamSetCaptureDependencies));
        if (settled) {
            settle<<<32, 256, 0, P.stream>>>(P.slot(l, 0), P.dest + l * MAXK, P.bank, k);
            CK(cudaGetLastError());
        }
        join<<<1, 32, 0, P.stream>>>(P.slot(l, 0), k, P.sink);
        CK(cudaGetLastError());
    }
    cudaGraph_t done;
    CK(cudaStreamEndCapture(P.stream, &done));
    // the pick kernels read the handles when they run: written once the capture is over
    put(P, b.handles, hs.data(), hs.size() * sizeof(hs[0]));
    instantiate(b, done);
    return b;
}

// Fresh picks: k distinct experts a layer (none where `none`), and k distinct bank rows for
// them, written to the device.
static void new_picks(Probe& P, int layers, int k, bool none) {
    P.picks.assign(size_t(LAYERS) * MAXK, -1);
    P.dests.assign(size_t(LAYERS) * MAXK, 0);
    std::vector<int> all(E), rows(BANK);
    std::iota(all.begin(), all.end(), 0);
    std::iota(rows.begin(), rows.end(), 0);
    for (int l = 0; l < layers; ++l) {
        std::shuffle(all.begin(), all.end(), P.rng);
        std::shuffle(rows.begin(), rows.end(), P.rng);
        for (int i = 0; i < k; ++i) {
            if (!none) P.picks[l * MAXK + i] = all[i];
            P.dests[l * MAXK + i] = rows[i];
        }
    }
    put(P, P.ids, P.picks.data(), P.picks.size() * sizeof(int));
    put(P, P.dest, P.dests.data(), P.dests.size() * sizeof(int));
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median ms of a launch (fresh picks before each, outside the timed span).
static double time_exec(Probe& P, const Built& b, int layers, int k, bool none) {
    std::vector<double> ms;
    for (int r = 0; r < WARMUP + REPEATS; ++r) {
        new_picks(P, layers, k, none);
        CK(cudaEventRecord(P.ev0, P.stream));
        CK(cudaGraphLaunch(b.exec, P.stream));
        CK(cudaEventRecord(P.ev1, P.stream));
        CK(cudaEventSynchronize(P.ev1));
        float t;
        CK(cudaEventElapsedTime(&t, P.ev0, P.ev1));
        if (r >= WARMUP) ms.push_back(t);
    }
    return median(ms);
}

// After a launch with fresh picks: every picked slot holds its expert's row (`settled`: and so
// does the bank row the last layer moved it to; earlier layers' rows may be written again).
static int verify(Probe& P, const Built& b, int layers, int k, bool settled = false) {
    new_picks(P, layers, k, false);
    CK(cudaMemsetAsync(P.slots, 0xA5, size_t(LAYERS) * MAXK * ROW, P.stream));   // poison
    CK(cudaMemsetAsync(P.bank, 0x5A, size_t(BANK) * ROW, P.stream));
    CK(cudaGraphLaunch(b.exec, P.stream));
    CK(cudaStreamSynchronize(P.stream));
    std::vector<unsigned char> got(ROW);
    int bad = 0;
    auto differs = [&](const unsigned char* dev, int e) {
        CK(cudaMemcpy(got.data(), dev, ROW, cudaMemcpyDeviceToHost));
        return memcmp(got.data(), P.host + size_t(e) * ROW, ROW) != 0;
    };
    for (int l = 0; l < layers; ++l)
        for (int i = 0; i < k; ++i) bad += differs(P.slot(l, i), P.picks[l * MAXK + i]);
    if (settled)
        for (int i = 0; i < k; ++i) {
            const int l = layers - 1;
            bad += differs(P.bank + size_t(P.dests[l * MAXK + i]) * ROW, P.picks[l * MAXK + i]);
        }
    return bad;
}

int main(int argc, char** argv) {
    const char* json = argc > 1 ? argv[1] : nullptr;
    Probe P;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    P.sms = prop.multiProcessorCount;
    CK(cudaStreamCreateWithFlags(&P.stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&P.ev0));
    CK(cudaEventCreate(&P.ev1));
    CK(cudaHostAlloc(reinterpret_cast<void**>(&P.host), size_t(E) * ROW, cudaHostAllocDefault));
    CK(cudaMalloc(&P.slots, size_t(LAYERS) * MAXK * ROW));
    CK(cudaMalloc(&P.ids, sizeof(int) * LAYERS * MAXK));
    CK(cudaMalloc(&P.dest, sizeof(int) * LAYERS * MAXK));
    CK(cudaMalloc(&P.bank, size_t(BANK) * ROW));
    CK(cudaMalloc(&P.sink, sizeof(unsigned long long)));
    {
        std::mt19937_64 fill(7);
        auto* w = reinterpret_cast<unsigned long long*>(P.host);
        for (size_t i = 0; i < size_t(E) * ROW / 8; ++i) w[i] = fill();
    }
    printf("%s, %d SMs; row %zu bytes, %d experts, %d repeats (median)\n", prop.name, P.sms, ROW,
           E, REPEATS);
    std::string out = "{\n  \"gpu\": \"" + std::string(prop.name) + "\",\n";
    char buf[512];
    int failures = 0;

    // pinned: K rows by cudaMemcpyAsync, the link's rate
    double pinned_gbs = 0;
    for (int k : {1, 8}) {
        std::vector<double> ms;
        for (int r = 0; r < WARMUP + REPEATS; ++r) {
            CK(cudaEventRecord(P.ev0, P.stream));
            for (int i = 0; i < k; ++i)
                CK(cudaMemcpyAsync(P.slot(0, i), P.host + size_t((r * 8 + i) % E) * ROW, ROW,
                                   cudaMemcpyHostToDevice, P.stream));
            CK(cudaEventRecord(P.ev1, P.stream));
            CK(cudaEventSynchronize(P.ev1));
            float t;
            CK(cudaEventElapsedTime(&t, P.ev0, P.ev1));
            if (r >= WARMUP) ms.push_back(t);
        }
        const double m = median(ms), gbs = k * ROW / (m * 1e6);
        if (k == 8) pinned_gbs = gbs;
        printf("pinned        %d rows: %8.3f ms  %6.1f GB/s\n", k, m, gbs);
        snprintf(buf, sizeof buf, "  \"pinned_%d_ms\": %.4f, \"pinned_%d_gbs\": %.2f,\n", k, m, k,
                 gbs);
        out += buf;
    }

    // one layer: pick → K switches → join
    {
        Built plain = build(P, 1, 1, false, 0);
        const double base = time_exec(P, plain, 1, 1, true);
        printf("layer, no switch:           %8.4f ms\n", base);
        snprintf(buf, sizeof buf, "  \"layer_plain_ms\": %.4f,\n", base);
        out += buf;
        for (int k : {1, 2, 4, 8}) {
            Built b = build(P, 1, k, true, 0);
            const double none = time_exec(P, b, 1, k, true);
            const double copy = time_exec(P, b, 1, k, false);
            const int bad = verify(P, b, 1, k);
            failures += bad;
            const double gbs = k * ROW / (copy * 1e6);
            printf("layer, %d switches: none %8.4f ms, copying %8.4f ms  %6.1f GB/s (%.2f of "
                   "pinned)%s\n", k, none, copy, gbs, gbs / pinned_gbs,
                   bad ? "  WRONG BYTES" : "");
            snprintf(buf, sizeof buf, "  \"layer_%d\": {\"none_ms\": %.4f, \"copy_ms\": %.4f, "
                     "\"gbs\": %.2f, \"of_pinned\": %.3f, \"wrong_slots\": %d},\n", k, none, copy,
                     gbs, gbs / pinned_gbs, bad);
            out += buf;
            destroy(b);
        }
        destroy(plain);
    }

    // overlap: a kernel on every SM for `ns`, alone and beside 4 switches that copy
    {
        const unsigned long long ns = 200000;
        Built alone = build(P, 1, 4, false, ns);
        Built both = build(P, 1, 4, true, ns);
        Built copies = build(P, 1, 4, true, 0);
        const double a = time_exec(P, alone, 1, 4, true);
        const double c = time_exec(P, copies, 1, 4, false);
        const double ab = time_exec(P, both, 1, 4, false);
        const int bad = verify(P, both, 1, 4);
        failures += bad;
        printf("overlap: busy kernel %.4f ms, 4 copies %.4f ms, both %.4f ms (sum %.4f, longer "
               "%.4f)%s\n", a, c, ab, a + c, std::max(a, c), bad ? "  WRONG BYTES" : "");
        snprintf(buf, sizeof buf, "  \"overlap\": {\"busy_ms\": %.4f, \"copies_ms\": %.4f, "
                 "\"both_ms\": %.4f, \"wrong_slots\": %d},\n", a, c, ab, bad);
        out += buf;
        for (Built* b : {&alone, &both, &copies}) destroy(*b);
    }

    // chain of 48 layers
    {
        Built plain = build(P, LAYERS, 1, false, 0);
        const double base = time_exec(P, plain, LAYERS, 1, true);
        printf("chain of %d layers, no switch: %8.4f ms\n", LAYERS, base);
        snprintf(buf, sizeof buf, "  \"chain_plain_ms\": %.4f,\n", base);
        out += buf;
        for (int k : {1, 2}) {
            Built b = build(P, LAYERS, k, true, 0);
            const double none = time_exec(P, b, LAYERS, k, true);
            const double copy = time_exec(P, b, LAYERS, k, false);
            const int bad = verify(P, b, LAYERS, k);
            failures += bad;
            const double switch_us = (none - base) * 1e3 / LAYERS;
            const double row_us = (copy - none) * 1e3 / (LAYERS * k);
            const double link_us = ROW / (pinned_gbs * 1e3);
            printf("chain, %d switches a layer: instantiate %.2f s; none %8.4f ms (%.2f us a "
                   "layer more), copying %8.4f ms (%.1f us a row; %.1f at the pinned rate)%s\n",
                   k, b.instantiate_s, none, switch_us, copy, row_us, link_us,
                   bad ? "  WRONG BYTES" : "");
            snprintf(buf, sizeof buf, "  \"chain_%d\": {\"instantiate_s\": %.3f, \"none_ms\": "
                     "%.4f, \"copy_ms\": %.4f, \"switch_us_a_layer\": %.3f, \"us_a_row\": %.2f, "
                     "\"pinned_us_a_row\": %.2f, \"wrong_slots\": %d},\n", k, b.instantiate_s,
                     none, copy, switch_us, row_us, link_us, bad);
            out += buf;
            destroy(b);
        }
        destroy(plain);
    }

    // the chain again, captured from a stream: as above, then with each slot moved into a
    // bank row (the settle kernel) before the join
    for (bool settled : {false, true}) {
        Built b = build_captured(P, LAYERS, 1, settled);
        const double copy = time_exec(P, b, LAYERS, 1, false);
        const int bad = verify(P, b, LAYERS, 1, settled);
        failures += bad;
        const char* name = settled ? "chain_captured_settled_1" : "chain_captured_1";
        printf("chain captured from a stream, 1 switch a layer%s: copying %8.4f ms%s\n",
               settled ? ", settled into bank rows" : "", copy, bad ? "  WRONG BYTES" : "");
        snprintf(buf, sizeof buf, "  \"%s\": {\"copy_ms\": %.4f, \"wrong_slots\": %d},\n",
                 name, copy, bad);
        out += buf;
        destroy(b);
    }

    time_t now = time(nullptr);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    snprintf(buf, sizeof buf, "  \"wrong_slots\": %d,\n  \"date\": \"%s\"\n}\n", failures, date);
    out += buf;
    if (json) {
        FILE* f = fopen(json, "w");
        if (!f) { perror(json); return 2; }
        fputs(out.c_str(), f);
        fclose(f);
    }
    printf("%s\n", failures ? "FAILED: slots with other bytes than their picked rows"
                            : "every copied slot matched its row");
    return failures ? 1 : 0;
}
