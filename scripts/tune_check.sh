#!/usr/bin/env bash
# The tuning call: optionally the GPU tests and the fuzz first (TUNE_TESTS=1: new launch paths are checked
# before they are timed; TUNE_FUZZ=0 leaves the fuzz out), bench --quick (the figures of record; TUNE_BENCH=0
# skips it), the launch-setting sweep (python -m benchmarks.probes.tune_kernels, with any arguments given
# here) and, where
# Nsight Compute reads the counters, one profile of the CSA and indexer kernels at B = 256, of CSA's 8K
# prefill, of the online HCA kernel's 8K prefill and of build_plan at 1,024 rows (TUNE_NCU=0 skips them; a
# comma-separated choice of decode, prefill, plan keeps those). Logs under $OUT (the device tool's output folder) or ./out.
#
#   DSV4_COMMIT=<sha> [TUNE_TESTS=1] [TUNE_FUZZ=0] [TUNE_BENCH=0] [TUNE_NCU=0] [TUNE_BASE=dir] \
#     bash scripts/tune_check.sh [tune_kernels args]
. "$(dirname "$0")/device_env.sh"
status=0
if [ "${TUNE_TESTS:-0}" = 1 ]; then
  echo "== GPU tests: $PY -m pytest -q -rs -m gpu tests"
  timeout "${TESTS_TIMEOUT:-330}" $PY -m pytest -q -rs -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.log" 2>&1 \
    || status=1
  tail -n 25 "$OUT/gpu_tests.log"
fi
if [ "${TUNE_FUZZ:-${TUNE_TESTS:-0}}" = 1 ]; then
  echo "== fuzz: $PY scripts/gpu_fuzz.py"
  timeout "${FUZZ_TIMEOUT:-150}" $PY scripts/gpu_fuzz.py --json "$OUT/fuzz.json" > "$OUT/fuzz.log" 2>&1 || status=1
  tail -n 8 "$OUT/fuzz.log"
fi
if [ "${TUNE_BENCH:-1}" = 1 ]; then
  echo "== bench --quick"
  timeout 300 $PY -m dsv4_compressor bench --quick --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
  tail -n 3 "$OUT/bench.log"
  $PY scripts/write_perf.py "$OUT/bench.json" --out "$OUT/PERF.md" > "$OUT/write_perf.log" 2>&1 || status=1
fi
if [ -n "${TUNE_BASE:-}" ]; then
  # the same sweep on a baseline tree first (src/, benchmarks/ and scripts/ of an earlier commit, carried as an
  # ignored folder, e.g. made by `git archive <sha> src benchmarks scripts | tar -x -C .baseline`): an A/B on one
  # GPU in one call. Where the sweep lives depends on the tree's age: benchmarks/probes/ (run from the baseline's
  # root, so that its benchmarks/ is the one imported), src/dsv4_compressor/bench/probes/, or scripts/.
  echo "== baseline tune_kernels $* ($TUNE_BASE)"
  base_out=$(cd "$OUT" && pwd)/base
  base_dir=.
  if [ -f "$TUNE_BASE/benchmarks/probes/tune_kernels.py" ]; then
    base_dir=$TUNE_BASE
    base_sweep=(-m benchmarks.probes.tune_kernels)
  elif [ -f "$TUNE_BASE/scripts/tune_kernels.py" ]; then
    base_sweep=("$TUNE_BASE/scripts/tune_kernels.py")
  else
    base_sweep=(-m dsv4_compressor.bench.probes.tune_kernels)
  fi
  base_src=$(cd "$TUNE_BASE/src" && pwd)
  (cd "$base_dir" && PYTHONPATH="$base_src" timeout "${TUNE_TIMEOUT:-420}" $PY "${base_sweep[@]}" "$base_out" "$@") \
    > "$OUT/tune_base.log" 2>&1 || status=1
  grep -v "^bench" "$OUT/tune_base.log" | tail -n 40
  mv "$OUT/base/tune.md" "$OUT/tune_base.md" 2>/dev/null
  rm -rf "$OUT/base"
fi
echo "== tune_kernels $*"
timeout "${TUNE_TIMEOUT:-420}" $PY -m benchmarks.probes.tune_kernels "$OUT" "$@" > "$OUT/tune.log" 2>&1 \
  || status=1
grep -v "^bench" "$OUT/tune.log" | tail -n 80
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
  --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
KEY="Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Issued Warp|Memory Throughput|Compute \(SM\)|Block Limit"
# ncu_case NAME KERNEL_REGEX BENCH_ARGS...: one profiled launch of the named kernel in a one-instance bench run
ncu_case() {
  local name=$1 kernel=$2
  shift 2
  echo "== ncu $name"
  timeout 120 "$NCU" --clock-control none --kernel-name "regex:$kernel" --launch-count 1 $SECTIONS \
    $PY -m dsv4_compressor bench "$@" --instances 1 --replays 1 --warmup 1 --json "$OUT/ncu_bench_$name.json" \
    > "$OUT/ncu_$name.txt" 2>&1
  grep -E "$KEY" "$OUT/ncu_$name.txt" | head -n 24
}
# TUNE_NCU: 1 (every profile), 0 (none), or a comma-separated choice of decode, prefill, plan
ncu_wants() { case ",${TUNE_NCU:-1}," in *",1,"*|*",$1,"*) return 0 ;; *) return 1 ;; esac; }
if [ -n "$NCU" ] && [ "${TUNE_NCU:-1}" != 0 ]; then
  if ncu_wants decode; then
    for kind in indexer csa; do
      ncu_case "${kind}_b256" compress_single --kinds "$kind" --phases decode --batch 256 --rows-per-request 4 \
        --boundary every --backends triton-single --warm-replays 1
    done
  fi
  if ncu_wants prefill; then
    # CSA's 8K prefill: 2,048 closing programs of 4 warps (its target is 24 us; it takes 26)
    ncu_case csa_prefill compress_single --kinds csa --phases prefill --prefill 8192 --carry no \
      --backends triton-single
    # the online HCA kernel's 8K prefill: 64 groups, about one program per multiprocessor
    ncu_case online_prefill online_hca --kinds hca --phases prefill --prefill 8192 --carry no --backends online
  fi
  if ncu_wants plan; then
    # build_plan of a 1,024-row step: one program (its target is 3 us; it takes 6)
    ncu_case plan_1024 build_plan --phases plan --plan-rows 1024
  fi
fi
bundle_out tune.md tune_base.md PERF.md bench.json gpu_tests.log fuzz.log
exit $status
