#!/usr/bin/env bash
# The tuning call: bench --quick (the figures of record), the single-stage kernel's sweep
# (scripts/tune_kernels.py) and, where Nsight Compute reads the counters, one profile of the CSA and indexer
# kernels at B = 256. Logs under $OUT (the device tool's output folder) or ./out.
#
#   DSV4_COMMIT=<sha> bash scripts/tune_check.sh
. "$(dirname "$0")/device_env.sh"
status=0
echo "== bench --quick"
timeout 300 $PY -m dsv4_compressor bench --quick --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
tail -n 3 "$OUT/bench.log"
$PY scripts/write_perf.py "$OUT/bench.json" --out "$OUT/PERF.md" > "$OUT/write_perf.log" 2>&1 || status=1
echo "== tune_kernels"
timeout 420 $PY scripts/tune_kernels.py "$OUT" > "$OUT/tune.log" 2>&1 || status=1
grep -v "^bench" "$OUT/tune.log" | tail -n 80
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -n "$NCU" ]; then
  for kind in indexer csa; do
    echo "== ncu $kind B=256"
    timeout 120 "$NCU" --clock-control none --kernel-name regex:compress_single --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      $PY -m dsv4_compressor bench --kinds "$kind" --phases decode --batch 256 --rows-per-request 4 \
      --boundary every --backends triton-single --instances 1 --replays 1 --warmup 1 --warm-replays 1 \
      --json "$OUT/ncu_bench_$kind.json" > "$OUT/ncu_$kind.txt" 2>&1
    grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Issued Warp|Memory Throughput|Compute \(SM\)" \
      "$OUT/ncu_$kind.txt" | head -n 20
  done
fi
bundle_out tune.md PERF.md bench.json
exit $status
