#!/usr/bin/env bash
# What one device session runs, stage by stage: `benchmarks/run_device.sh tests sanitize bench
# decode`. Logs and JSON go to $OUT (the device tool's output folder) or .out/; a summary of each
# stage is printed last. SWEEP="default XPREFETCH=0 ..." picks the moe_decode variants of `sweep`
# and SWEEP_CASES="2048:1 2048:2 ..." its decode cases (H:T). BUNDLE=1 packs logs and
# benchmarks/results/ into $OUT/bundle.tgz.
set -u
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
summary=()
# copy-kernel grids timed beside the Bank's own: "ld" (SM loads) and "bulk" (cp.async.bulk)
PLANNER_SWEEP="--copy-sweep 2,512,4 0.25,256,8 --bulk-sweep 1,16,4 0.5,16,4 0.25,16,4 0.25,32,4 0.125,32,4"
run() {  # name, timeout seconds, command...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|ERROR SUMMARY|error|Error' "$OUT/$name.log" | tail -1)")
}
for stage in "$@"; do
  case $stage in
    wrap)     run pytest_wrap 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -ra -s tests/test_gpu_wrap.py tests/test_examples.py ;;
    gemm-tests) run pytest_gemm 200 python3 -m pytest -m gpu -q -p no:cacheprovider -ra tests/test_gpu_gemm.py ;;
    tests)    run pytest_gpu ${TESTS_TIMEOUT:-480} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 300 -ra tests ;;
    sanitize) run memcheck 150 compute-sanitizer --tool memcheck python3 tests/gpu_planner_sanitize.py
              run racecheck 150 compute-sanitizer --tool racecheck python3 tests/gpu_planner_sanitize.py --steps 100 --big-steps 4 ;;
    sanitize-decode) for tool in memcheck racecheck synccheck; do
              run "decode_$tool" 200 compute-sanitizer --tool $tool python3 tests/gpu_decode_sanitize.py; done ;;
    sanitize-gemm) for tool in memcheck racecheck synccheck; do
              run "gemm_$tool" ${SANITIZE_TIMEOUT:-200} compute-sanitizer --tool $tool python3 tests/gpu_gemm_sanitize.py; done ;;
    profile)  run profile 120 python3 benchmarks/profile_gemm.py ;;
    sweep)    run sweep 300 python3 benchmarks/profile_gemm.py --sweep ${SWEEP:-} --repeats ${SWEEP_REPEATS:-1} ${SWEEP_CASES:+--cases $SWEEP_CASES} ;;
    prefill-kernels) run prefill_kernels 120 python3 benchmarks/profile_gemm.py --prefill-kernels 512 2048 ;;
    prefill-sweep) run prefill_sweep 400 python3 benchmarks/profile_gemm.py --prefill-sweep ${PREFILL_SWEEP:-default} --repeats ${SWEEP_REPEATS:-1} ;;
    trace)    run trace 120 python3 benchmarks/profile_gemm.py --trace 1 4
              run trace_4096 120 python3 benchmarks/profile_gemm.py --trace 1 4 --hidden 4096 ;;
    read)     run profile_read 240 python3 benchmarks/profile_read.py ;;
    ncu)      NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
              run ncu_gemm 200 $NCU -k regex:"moe_decode|route_decode|moe_w13|moe_w2" --launch-skip 3 -c 3 python3 benchmarks/profile_gemm.py
              run ncu_plan 200 $NCU -k regex:"plan_step" --launch-skip 200 -c 2 python3 benchmarks/bench_planner.py --skip-copy --experts 128 --lanes 8 --replays 20 ;;
    ncu-source) run ncu_source 200 ncu --clock-control none --section WarpStateStats --section SourceCounters --page source --print-source sass --csv -k regex:moe_decode --launch-skip 3 -c 1 python3 benchmarks/profile_gemm.py
              gzip -f "$OUT/ncu_source.log" ;;   # summarise with benchmarks/ncu_source.py
    ncu-prefill) NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
              run prefill_kernels 120 python3 benchmarks/profile_gemm.py --prefill-kernels 2048
              run ncu_prefill 300 $NCU -k regex:"moe_w13|moe_w2" --launch-skip 2 -c 2 python3 benchmarks/profile_gemm.py --prefill-kernels 2048
              for k in moe_w13 moe_w2; do
                run ncu_source_$k 300 ncu --clock-control none --section WarpStateStats --section SourceCounters --page source --print-source sass --csv -k regex:$k --launch-skip 1 -c 1 python3 benchmarks/profile_gemm.py --prefill-kernels 2048
                gzip -f "$OUT/ncu_source_$k.log"; done ;;
    profile-decode) run profile_decode 200 python3 benchmarks/profile_decode.py
              run profile_decode_compiled 300 python3 benchmarks/profile_decode.py --compile --layers 8 ;;
    bench)    run bench_store 120 python3 benchmarks/bench_store.py --rows 16
              run bench_nvfp4 120 python3 benchmarks/bench_nvfp4.py
              run bench_planner 180 python3 benchmarks/bench_planner.py $PLANNER_SWEEP
              run bench_gemm 240 python3 benchmarks/bench_gemm.py --layers 16 ;;
    planner)  run bench_planner 150 python3 benchmarks/bench_planner.py $PLANNER_SWEEP ;;
    gemm-bench) run bench_gemm 150 python3 benchmarks/bench_gemm.py --layers 16 ${GEMM_ARGS:-} ;;
    example)  run decode_loop 300 python3 examples/decode_loop.py --json "$OUT/decode_loop.json" ;;
    decode)   run bench_decode 560 python3 benchmarks/bench_decode.py ;;
    decode-small) run bench_decode_small 200 python3 benchmarks/bench_decode.py --small --tokens 16 --repeats 1 ;;
    decode-compile-small) run bench_decode_small_compiled 300 python3 benchmarks/bench_decode.py --small --tokens 16 --repeats 2 --compile ;;
    decode-compile) run bench_decode_compiled 590 python3 benchmarks/bench_decode.py --compile --modes pool resident uva-graph ;;
    decode-compile-rest) run bench_decode_compiled_rest 590 python3 benchmarks/bench_decode.py --compile --merge --modes uva-eager hf-bf16 ;;
  esac
done
for f in ${COPY:-}; do cp "benchmarks/results/$f" "$OUT/" 2>/dev/null; done   # the tool returns 8 files
if [ -n "${BUNDLE:-}" ]; then   # everything in one file: logs and every results file
  cp -r benchmarks/results "$OUT/results"
  tar czf bundle.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv bundle.tgz "$OUT/"
fi
printf '%s\n' "${summary[@]}"
