#!/usr/bin/env bash
# The tuning call: optionally the GPU tests and the fuzz first (TUNE_TESTS=1: new launch paths are checked
# before they are timed; TUNE_FUZZ=0 leaves the fuzz out), bench --quick (the figures of record; TUNE_BENCH=0
# skips it), the launch-setting sweep (scripts/tune_kernels.py, with any arguments given here) and, where
# Nsight Compute reads the counters, one profile of the CSA and indexer kernels at B = 256, of CSA's 8K
# prefill and of the online HCA kernel's 8K prefill (TUNE_NCU=0 skips them, =decode or =prefill keeps one
# set). Logs under $OUT (the device tool's output folder) or ./out.
#
#   DSV4_COMMIT=<sha> [TUNE_TESTS=1] [TUNE_FUZZ=0] [TUNE_BENCH=0] [TUNE_NCU=0] bash scripts/tune_check.sh [tune_kernels args]
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
echo "== tune_kernels $*"
timeout "${TUNE_TIMEOUT:-420}" $PY scripts/tune_kernels.py "$OUT" "$@" > "$OUT/tune.log" 2>&1 || status=1
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
# TUNE_NCU: 1 (every profile), decode, prefill, or 0
if [ -n "$NCU" ] && [ "${TUNE_NCU:-1}" != 0 ]; then
  if [ "${TUNE_NCU:-1}" != prefill ]; then
    for kind in indexer csa; do
      ncu_case "${kind}_b256" compress_single --kinds "$kind" --phases decode --batch 256 --rows-per-request 4 \
        --boundary every --backends triton-single --warm-replays 1
    done
  fi
  if [ "${TUNE_NCU:-1}" != decode ]; then
    # CSA's 8K prefill: 2,048 closing programs of 4 warps (its target is 24 us; it takes 26)
    ncu_case csa_prefill compress_single --kinds csa --phases prefill --prefill 8192 --carry no \
      --backends triton-single
    # the online HCA kernel's 8K prefill: 64 groups, about one program per multiprocessor
    ncu_case online_prefill online_hca --kinds hca --phases prefill --prefill 8192 --carry no --backends online
  fi
fi
bundle_out tune.md PERF.md bench.json gpu_tests.log fuzz.log
exit $status
