#!/usr/bin/env bash
# GPU tests and benchmarks in stages, run from the checkout's root on a machine with a GPU:
#
#     benchmarks/run_gpu.sh tests sanitize bench decode
#
# Each stage's output goes to a log in $OUT (default .out/); a summary line a stage (exit code,
# seconds, the log's last pytest/sanitizer/error line) is printed last. Benchmarks write their
# canonical files to benchmarks/results/ (a reduced run writes to $OUT through --json instead).
#
# Stages: wrap, gemm-tests, tests, tests-kernels, tests-models, tests-host, host-serve, host-late, host-bench, sanitize, sanitize-decode, sanitize-gemm, profile, sweep,
# prefill-kernels, prefill-sweep, trace, read, ncu, ncu-dense, ncu-source, ncu-prefill, attention, chain, profile-decode, profile-slots, profile-narrow, ab-dense, ab-trees, ab-serve,
# bench, planner, gemm-bench, example, decode, decode-small, decode-compile-small,
# decode-compile, decode-compile-serial, decode-compile-rest, hybrid-tests, decode-qwen4, ngram,
# prefix, prefix-host, prefix-scratch, serve, serve-glm, serve-next, serve-slots, first-request, overlap, graph-copies,
# decode-gptoss, decode-gptoss-small.
#
# Settings (environment):
#   SWEEP="default minb=4 w13_split=2 minb=3,w13_split=4"  moe_decode builds of `sweep`
#   SWEEP_CASES="2048:1 4096:4"   its decode cases, H:T;  SWEEP_REPEATS=2  rounds over them
#   DENSE_SHAPES="default qkv=w4 ..."  CUPOOL_DENSE_SHAPE values of `ab-dense`
#   AB_TREES="ab_base ."  AB_ROUNDS=3  AB_CONTEXT=16  AB_ARGS=  the trees, rounds, positions and
#                                 other profile_decode.py arguments of `ab-trees` (AB_ROUNDS,
#                                 default 1 there, and AB_ARGS also of `ab-dense`); `ab-serve`
#                                 times bench_serve.py (SERVE_ARGS, default "--streams 1 --banks
#                                 1.0") in AB_TREES, AB_ROUNDS rounds (default 2), each round's
#                                 trees in the other order than the round before
#   PREFILL_SWEEP="default NB=2,MINB=1"  prefill launch configs of `prefill-sweep`
#   SCRATCHES="32x2 64x2 64x4"    prefill scratch rows x buffers of `prefix-scratch`
#   HOST_STREAMS="1 8 16"  HOST_ARGS="--host-promote"  stream counts and other bench_serve
#                                 arguments of `host-serve` (default none: serve's own)
#   GEMM_ARGS="..."               extra bench_gemm.py arguments of `gemm-bench`
#   TESTS_TIMEOUT, SANITIZE_TIMEOUT  seconds of the `tests` and `sanitize-gemm` stages
#   COPY="bench_gemm.json ..."    results files copied into $OUT at the end
#   BUNDLE=1                      packs the logs and benchmarks/results/ into $OUT/bundle.tgz
set -u
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
summary=()
# pytest's per-test timeout where the plugin is installed (unquoted below: empty or two words,
# as $PLANNER_SWEEP, $NCU_SECTIONS, $SWEEP and the other lists of words are split on purpose)
PYTEST_TIMEOUT=
if python3 -c "import pytest_timeout" 2>/dev/null; then PYTEST_TIMEOUT="--timeout 300"; fi
PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider -ra)
# copy-kernel grids timed beside the Bank's own: "ld" (SM loads) and "bulk" (cp.async.bulk)
PLANNER_SWEEP="--copy-sweep 2,512,4 0.25,256,8 --bulk-sweep 1,16,4 0.5,16,4 0.25,16,4 0.25,32,4 0.125,32,4"
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
NCU_SOURCE="ncu --clock-control none --section WarpStateStats --section SourceCounters --page source --print-source sass --csv"
run() {  # name, timeout seconds, command...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|ERROR SUMMARY|error|Error' "$OUT/$name.log" | tail -1)")
}
for stage in "$@"; do
  case $stage in
    wrap)     run pytest_wrap 300 "${PYTEST[@]}" $PYTEST_TIMEOUT -s tests/test_gpu_wrap.py tests/test_examples.py ;;
    gemm-tests) run pytest_gemm 200 "${PYTEST[@]}" tests/test_gpu_gemm.py ;;
    tests)    run pytest_gpu "${TESTS_TIMEOUT:-480}" "${PYTEST[@]}" $PYTEST_TIMEOUT tests ;;
    # the same suite in three parts (the kernels; the pool, engine and models; the host's CPU path
    # in tests-host below), for runs that must fit a time limit; with CUPOOL_ARCH set they test
    # that architecture's code
    tests-kernels) run pytest_gpu_kernels "${TESTS_TIMEOUT:-480}" "${PYTEST[@]}" $PYTEST_TIMEOUT \
              tests/test_gpu_planner.py tests/test_gpu_gemm.py tests/test_gpu_nvfp4.py \
              tests/test_gpu_foundation.py tests/test_gpu_arch.py tests/test_gpu_read_probe.py \
              tests/test_gpu_dense.py tests/test_gpu_nongated.py tests/test_checkpoints_fill.py \
              tests/test_gpu_sampling.py ;;
    tests-models) run pytest_gpu_models "${TESTS_TIMEOUT:-480}" "${PYTEST[@]}" $PYTEST_TIMEOUT \
              tests --deselect tests/test_gpu_planner.py --deselect tests/test_gpu_gemm.py \
              --deselect tests/test_gpu_nvfp4.py --deselect tests/test_gpu_foundation.py \
              --deselect tests/test_gpu_arch.py --deselect tests/test_gpu_read_probe.py \
              --deselect tests/test_gpu_dense.py --deselect tests/test_gpu_nongated.py \
              --deselect tests/test_checkpoints_fill.py --deselect tests/test_gpu_sampling.py \
              --deselect tests/test_gpu_host_planner.py \
              --deselect tests/test_gpu_host_handoff.py --deselect tests/test_gpu_host_decode.py ;;
    # the host's CPU path: its CPU tests on this machine's CPU (the native build is AVX-512 where
    # the CPU has it), the hand-off and the planner's HOST_SPLIT build on the GPU
    tests-host) run pytest_host "${TESTS_TIMEOUT:-300}" python3 -m pytest -m "gpu or not gpu" -q \
              -p no:cacheprovider -ra $PYTEST_TIMEOUT tests/test_host_experts.py \
              tests/test_host_decode_order.py tests/test_gpu_host_handoff.py \
              tests/test_gpu_host_planner.py tests/test_gpu_host_decode.py ;;
    # host experts in serve's step at a 50% bank, each stream count beside its baseline in one
    # process (HOST_STREAMS; HOST_ARGS: other bench_serve arguments)
    host-serve) for n in ${HOST_STREAMS:-1 8 16}; do
                run "serve_host_$n" 200 python3 benchmarks/bench_serve.py --banks 0.5 --streams "$n" \
                    --host-experts --host-baseline ${HOST_ARGS:-} --json "$OUT/serve_host_$n.json"
                summary[-1]="${summary[-1]} $(grep -o '[0-9.]*x the decode rate without them' "$OUT/serve_host_$n.log")"
              done ;;
    # serve's 8 slots a step at 1, 4 and 7 streams, each with and without host experts, and the
    # first token of a 512-token prompt arriving while they decode (a reduced run, into $OUT)
    host-late) run serve_host_late 300 python3 benchmarks/bench_serve.py --banks 0.5 --streams 1 4 7 \
              --slots 8 --host-experts --host-baseline --late-prompt 512 \
              --json "$OUT/serve_host_late.json" ;;
    host-bench) run bench_host_experts 400 python3 benchmarks/bench_host_experts.py
              run probe_host_handoff 200 python3 benchmarks/probe_host_handoff.py \
                  --json "$OUT/probe_host_handoff.json" ;;
    sanitize) run memcheck 150 compute-sanitizer --tool memcheck python3 tests/gpu_planner_sanitize.py
              run racecheck 150 compute-sanitizer --tool racecheck python3 tests/gpu_planner_sanitize.py --steps 100 --big-steps 4 ;;
    sanitize-decode) for tool in memcheck racecheck synccheck; do
              run "decode_$tool" 200 compute-sanitizer --tool $tool python3 tests/gpu_decode_sanitize.py; done ;;
    sanitize-gemm) for tool in memcheck racecheck synccheck; do
              run "gemm_$tool" "${SANITIZE_TIMEOUT:-200}" compute-sanitizer --tool $tool python3 tests/gpu_gemm_sanitize.py; done ;;
    profile)  run profile 120 python3 benchmarks/profile_gemm.py ;;
    sweep)    run sweep 300 python3 benchmarks/profile_gemm.py --sweep ${SWEEP:-} --repeats "${SWEEP_REPEATS:-1}" ${SWEEP_CASES:+--cases $SWEEP_CASES} ;;
    prefill-kernels) run prefill_kernels 120 python3 benchmarks/profile_gemm.py --prefill-kernels 512 2048 ;;
    prefill-sweep) run prefill_sweep 400 python3 benchmarks/profile_gemm.py --prefill-sweep ${PREFILL_SWEEP:-default} --repeats "${SWEEP_REPEATS:-1}" ;;
    trace)    run trace 120 python3 benchmarks/profile_gemm.py --trace 1 4
              run trace_4096 120 python3 benchmarks/profile_gemm.py --trace 1 4 --hidden 4096 ;;
    read)     run profile_read 240 python3 benchmarks/profile_read.py ;;
    ncu)      run ncu_gemm 200 ncu --clock-control none $NCU_SECTIONS -k regex:"moe_decode|route_decode|moe_w13|moe_w2" --launch-skip 3 -c 3 python3 benchmarks/profile_gemm.py
              run ncu_plan 200 ncu --clock-control none $NCU_SECTIONS -k regex:"plan_step" --launch-skip 200 -c 2 python3 benchmarks/bench_planner.py --skip-copy --experts 128 --lanes 8 --replays 20 ;;
    ncu-dense) run ncu_dense 300 ncu --clock-control none $NCU_SECTIONS -k regex:"dense_gemv|dense_attention" --launch-skip 16 -c 10 python3 benchmarks/profile_decode.py --layers 4 --steps 2
              run ncu_source_dense 300 $NCU_SOURCE -k regex:"dense_gemv|dense_attention" --launch-skip 16 -c 4 python3 benchmarks/profile_decode.py --layers 4 --steps 2
              gzip -f "$OUT/ncu_source_dense.log" ;;
    ncu-source) run ncu_source 200 $NCU_SOURCE -k regex:moe_decode --launch-skip 3 -c 1 python3 benchmarks/profile_gemm.py
              gzip -f "$OUT/ncu_source.log" ;;   # summarise with benchmarks/ncu_source.py
    ncu-prefill) run prefill_kernels 120 python3 benchmarks/profile_gemm.py --prefill-kernels 2048
              run ncu_prefill 300 ncu --clock-control none $NCU_SECTIONS --section ComputeWorkloadAnalysis -k regex:"moe_w13|moe_w2" --launch-skip 2 -c 2 python3 benchmarks/profile_gemm.py --prefill-kernels 2048
              for k in moe_w13 moe_w2; do
                run "ncu_source_$k" 300 $NCU_SOURCE -k regex:$k --launch-skip 1 -c 1 python3 benchmarks/profile_gemm.py --prefill-kernels 2048
                gzip -f "$OUT/ncu_source_$k.log"; done ;;
    # the fused step's launch shapes side by side (CUPOOL_DENSE_SHAPE; "default": unset), in
    # AB_ROUNDS rounds (default 1) of one profile_decode run a shape (with --ablate and AB_ARGS,
    # e.g. "--model gpt-oss-120b --layers 8"), the graph's ms a step in each summary line
    ab-dense) i=0
              for r in $(seq "${AB_ROUNDS:-1}"); do
                for shape in ${DENSE_SHAPES:-default qkv=w4 o=k2,router=k8 attn=ahead qkv=w4,o=k2,router=k8,attn=ahead}; do
                  i=$((i + 1))
                  [ "$shape" = default ] && v= || v=$shape
                  CUPOOL_DENSE_SHAPE=$v run "profile_decode_ab$i" 200 python3 benchmarks/profile_decode.py --ablate ${AB_ARGS:-} --json "$OUT/profile_decode_ab$i.json"
                  summary[-1]="${summary[-1]} [$shape] $(grep -o 'graph replay [0-9.]* ms ([0-9.]* tok/s)' "$OUT/profile_decode_ab$i.log")"
                done
              done ;;
    # trees side by side: AB_TREES, directories holding a checkout's cupool/, rawkernels/ and
    # benchmarks/ ("." this one; e.g. ab_base/ from `git archive HEAD cupool rawkernels benchmarks`),
    # in AB_ROUNDS rounds (default 3) of one profile_decode --context AB_CONTEXT (default 16) a
    # tree, each run's ms a step in its summary line
    ab-trees) for r in $(seq "${AB_ROUNDS:-3}"); do
                for t in ${AB_TREES:-.}; do
                  tree=$(cd "$t" && pwd)
                  name="ab_$(basename "$tree")_$r"
                  PYTHONPATH=$tree run "$name" 200 python3 "$tree/benchmarks/profile_decode.py" --context "${AB_CONTEXT:-16}" ${AB_ARGS:-}
                  summary[-1]="${summary[-1]} [$t] $(grep -o 'graph replay [0-9.]* ms ([0-9.]* tok/s)' "$OUT/$name.log")"
                done
              done ;;
    ab-serve) order=(${AB_TREES:-.})
              for r in $(seq "${AB_ROUNDS:-2}"); do
                for t in "${order[@]}"; do
                  tree=$(cd "$t" && pwd)
                  name="serve_$(basename "$tree")_$r"
                  PYTHONPATH=$tree run "$name" 200 python3 "$tree/benchmarks/bench_serve.py" \
                    ${SERVE_ARGS:---streams 1 --banks 1.0} --json "$OUT/$name.json"
                  summary[-1]="${summary[-1]} [$t] $(grep -oE 'decode +[0-9.]+' "$OUT/$name.log" | tr '\n' ' ')"
                done
                rev=(); for ((i=${#order[@]}-1; i>=0; i--)); do rev+=("${order[i]}"); done; order=("${rev[@]}")
              done ;;
    chain)    run profile_chain 120 python3 benchmarks/profile_chain.py --json "$OUT/profile_chain.json" ;;
    attention) run profile_attention 300 python3 benchmarks/profile_attention.py --min-chunk 64 256 --json "$OUT/profile_attention.json" ;;
    # one request's step in an engine of 1 slot and of serve's default 8, and 8 requests', each
    # with its parts' cost inside the graph (--ablate; reduced runs, into $OUT)
    profile-slots) for ba in 1:1 8:1 8:8; do
                b=${ba%:*} a=${ba#*:}
                run "profile_decode_b${b}a${a}" 200 python3 benchmarks/profile_decode.py --batch "$b" \
                    --active "$a" --ablate --json "$OUT/profile_decode_b${b}a${a}.json"
                summary[-1]="${summary[-1]} [$a of $b] $(grep -o 'graph replay [0-9.]* ms ([0-9.]* tok/s)' "$OUT/profile_decode_b${b}a${a}.log" | head -1)"
              done ;;
    # N of serve's 8 slots active (NARROW_ACTIVE, default 1 2 3 4): the step of every slot and
    # the engine's narrow step for them, side by side (reduced runs, into $OUT)
    profile-narrow) for a in ${NARROW_ACTIVE:-1 2 3 4}; do
                for n in "" --narrow; do
                  name="profile_decode_b8a${a}${n:+_narrow}"
                  run "$name" 200 python3 benchmarks/profile_decode.py --batch 8 --active "$a" $n \
                      --json "$OUT/$name.json"
                  summary[-1]="${summary[-1]} [$a of 8${n:+, narrow}] $(grep -o 'graph replay [0-9.]* ms ([0-9.]* tok/s)' "$OUT/$name.log" | head -1)"
                done
              done ;;
    profile-decode) run profile_decode 200 python3 benchmarks/profile_decode.py --json "$OUT/profile_decode.json"
              run profile_decode_compiled 300 python3 benchmarks/profile_decode.py --step compiled --layers 8 --json "$OUT/profile_decode_compiled.json" ;;
    bench)    run bench_store 120 python3 benchmarks/bench_store.py --rows 16
              run bench_nvfp4 120 python3 benchmarks/bench_nvfp4.py
              run bench_planner 180 python3 benchmarks/bench_planner.py $PLANNER_SWEEP
              run bench_gemm 240 python3 benchmarks/bench_gemm.py --layers 16 ;;
    planner)  run bench_planner 150 python3 benchmarks/bench_planner.py $PLANNER_SWEEP ;;
    gemm-bench) run bench_gemm 150 python3 benchmarks/bench_gemm.py --layers 16 ${GEMM_ARGS:-} ;;
    example)  run decode_loop 300 python3 examples/decode_loop.py --json "$OUT/decode_loop.json" ;;
    decode)   run bench_decode 560 python3 benchmarks/bench_decode.py ;;
    hybrid-tests) run hybrid_tests 590 "${PYTEST[@]}" $PYTEST_TIMEOUT tests/test_gpu_engine_hybrid.py tests/test_checkpoints_fp8.py ;;
    decode-qwen4) run bench_decode_qwen4_exp 590 python3 benchmarks/bench_decode.py --model qwen4_exp ;;
    ngram)    run bench_ngram 300 python3 benchmarks/bench_ngram.py ;;
    prefix)   run bench_prefix 590 python3 benchmarks/bench_prefix.py --profile ;;
    # turn 2 with the host's CPU taking part in the reused turn's prefill (a reduced run, into $OUT)
    prefix-host) run bench_prefix_host 590 python3 benchmarks/bench_prefix.py --host-experts \
              --json "$OUT/bench_prefix_host.json" ;;
    # turn 2 at a 75% bank with the default scratch and with room for the next layer's copies
    # (SCRATCHES: rows x buffers)
    prefix-scratch) for rb in ${SCRATCHES:-32x2 64x2 64x4}; do
                run "bench_prefix_75_$rb" 590 python3 benchmarks/bench_prefix.py --bank 75 --repeats 3 \
                    --scratch-rows "${rb%x*}" --scratch-buffers "${rb#*x}" --json "$OUT/bench_prefix_75_$rb.json"; done ;;
    # the canonical bench_serve (serve's defaults), the plain pool beside host experts where
    # serve turns them on
    serve)    run bench_serve 590 python3 benchmarks/bench_serve.py --host-baseline ;;
    # GLM-4.5-Air's shape (46 layers, 56.1 GB of NVFP4 expert rows) at 1 and 8 streams (a reduced
    # run, into $OUT; GLM_BANKS, default "1.0 0.5")
    serve-glm) run bench_serve_glm 590 python3 benchmarks/bench_serve.py --model glm-4.5-air \
              --streams 1 8 --banks ${GLM_BANKS:-1.0 0.5} --json "$OUT/bench_serve_glm_4_5_air.json" ;;
    # Qwen3-Next-80B-A3B's shape (48 layers, 43.5 GB of NVFP4 expert rows) at 1 and 8 streams (a
    # reduced run, into $OUT; NEXT_BANKS, default "1.0 0.5")
    serve-next) run bench_serve_next 590 python3 benchmarks/bench_serve.py --model qwen3-next-80b-a3b \
              --streams 1 8 --banks ${NEXT_BANKS:-1.0 0.5} --json "$OUT/bench_serve_qwen3_next_80b_a3b.json" ;;
    # the first requests after Engine.warmup(), in a fresh process (run it with the kernel cache warm)
    first-request) run bench_first_request 300 python3 benchmarks/bench_first_request.py ;;
    # serve's default 8 slots a step with 1, 4 and 8 of them active: what one user of a default
    # `serve` gets (a reduced run, into $OUT)
    serve-slots) run bench_serve_slots 590 python3 benchmarks/bench_serve.py --streams 1 4 8 --slots 8 \
              --json "$OUT/bench_serve_slots.json" ;;
    # a 50% bank with and without the copies beside the GEMM of the rows in place
    overlap)  for o in "" --overlap-copies; do
                run "profile_decode_50${o:+_overlap}" 200 python3 benchmarks/profile_decode.py --bank 50 --timeline $o \
                    --json "$OUT/profile_decode_50${o:+_overlap}.json"
                run "bench_serve_50${o:+_overlap}" 200 python3 benchmarks/bench_serve.py --banks 0.5 --streams 1 8 $o \
                    --json "$OUT/bench_serve_50${o:+_overlap}.json"; done ;;
    # can a graph aim the copy engine at rows a kernel picks? (conditional SWITCH nodes whose
    # bodies are row copies; benchmarks/probe_graph_copies.cu says what it times). Then: does a
    # kernel built the way cupool builds its kernels (NVRTC through CuPy) link the device call
    # that sets a switch's value?
    graph-copies) mkdir -p /tmp/cupool_probe
              run probe_graph_copies_build 120 nvcc -std=c++17 -O2 -arch=native \
                  -o /tmp/cupool_probe/probe_graph_copies benchmarks/probe_graph_copies.cu
              run probe_graph_copies 300 /tmp/cupool_probe/probe_graph_copies "$OUT/probe_graph_copies.json"
              run set_conditional_nvrtc 120 python3 -c 'import cupy as cp
src = "extern \"C\" __device__ void cudaGraphSetConditional(unsigned long long, unsigned);\n" \
      "extern \"C\" __global__ void set_it(const unsigned long long* h) { cudaGraphSetConditional(h[0], 1u); }"
cp.RawModule(code=src, options=("-std=c++17",)).get_function("set_it")
print("NVRTC (CuPy) cubin calling cudaGraphSetConditional: loaded")' ;;
    # gpt-oss-120b's shape through the engine: the canonical file (36 layers, 64.6 GB of rows
    # resident: an H200), and a reduced run of 8 layers (resident, pool-25, pool-50; into $OUT)
    decode-gptoss) run bench_decode_gptoss 590 python3 benchmarks/bench_decode.py --model gpt-oss-120b ;;
    decode-gptoss-small) run bench_decode_gptoss_small 200 python3 benchmarks/bench_decode.py \
              --model gpt-oss-120b --layers 8 --modes resident pool --routings locality --repeats 2 \
              --tokens 64 --json "$OUT/bench_decode_gptoss_small.json" ;;
    decode-small) run bench_decode_small 200 python3 benchmarks/bench_decode.py --small --tokens 16 --repeats 1 --json "$OUT/bench_decode_small.json" ;;
    decode-compile-small) run bench_decode_small_compiled 300 python3 benchmarks/bench_decode.py --small --tokens 16 --repeats 2 --compile --json "$OUT/bench_decode_small_compiled.json" ;;
    # the canonical bench_decode.json in three parts, each merged into the one before
    decode-compile) run bench_decode_compiled 590 python3 benchmarks/bench_decode.py --compile --modes pool resident uva-graph ;;
    decode-compile-serial) run bench_decode_compiled_serial 590 python3 benchmarks/bench_decode.py --compile --merge --modes pool-serial ;;
    decode-compile-rest) run bench_decode_compiled_rest 590 python3 benchmarks/bench_decode.py --compile --merge --modes uva-eager hf-bf16 ;;
    *)        summary+=("$stage: no such stage (see the list at the top of $0)") ;;
  esac
done
for f in ${COPY:-}; do cp "benchmarks/results/$f" "$OUT/" 2>/dev/null || summary+=("COPY: no benchmarks/results/$f"); done
if [ -n "${BUNDLE:-}" ]; then   # everything in one file: logs and every results file
  cp -r benchmarks/results "$OUT/results"
  tar czf bundle.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv bundle.tgz "$OUT/"
fi
printf '%s\n' "${summary[@]}"
