#!/usr/bin/env bash
# Everything the GPU machine checks, in one call: the GPU test modules, the long random fuzz
# (scripts/gpu_fuzz.py), then `bench --quick` (-> PERF.md and perf.png through scripts/write_perf.py).
# Logs and results go to $OUT (the device tool's output folder) or ./out; all but PERF.md, perf.json, perf.png,
# bench.json and environment.txt are packed into logs.tgz (the tool returns 8 files).
#
#   DSV4_COMMIT=<sha> bash scripts/gpu_check.sh [--tests-only | --bench-only | --ab-only] [bench args...]
#
# DSV4_COMMIT records the commit where no .git travels with the tree: pass the sha as a literal, resolved on
# the machine you submit from (git does not run on the device copy).
#
# GPU_CHECK_AB="VAR=value ...[;VAR=value ...]" adds an A/B of those library switches on the same GPU: the GPU
# test modules of GPU_CHECK_AB_TESTS (default the projection's) again with each set of them, then
# `bench --preset projection` without and with each (ab_base.json, ab_other<i>.json; the pages ab<i>.md by
# scripts/write_perf.py --compare, together in ab.md), e.g.
# GPU_CHECK_AB="DSV4_PDL=0;DSV4_STEP_TABLES_IN_PLAN_LAUNCH=1".
. "$(dirname "$0")/device_env.sh"
mode=all
case "${1:-}" in
  --tests-only) mode=tests; shift ;;
  --bench-only) mode=bench; shift ;;
  --ab-only) mode=ab; shift ;;  # only the GPU_CHECK_AB bench (no test modules, fuzz or bench --quick)
esac
status=0
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "commit: ${DSV4_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
} | tee "$OUT/environment.txt"
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  echo "== GPU tests: $PY -m pytest -q -rsP -m gpu tests"
  # the engine modules that import SGLang / vLLM from engine_kit/ (scripts/build_engine_kit.sh, carried) run in a
  # process each, so the kit's sys.path and one engine's import-time settings stay out of the other modules
  engine_mods=(tests/test_engine_sglang_gpu.py tests/test_engine_sglang_v41_gpu.py tests/test_engine_vllm_gpu.py)
  ignore=()
  [ -f engine_kit/manifest.json ] && for m in "${engine_mods[@]}"; do ignore+=(--ignore="$m"); done
  # -rP: the passed tests' printed figures (the adapters' per-layer costs) stay in the log
  $PY -m pytest -q -rsP -p no:cacheprovider -m gpu "${ignore[@]}" tests > "$OUT/gpu_tests.log" 2>&1
  [ "$?" = 0 ] || status=1
  grep -E '^(vLLM defaults|SGLang defaults)' "$OUT/gpu_tests.log" || true
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/gpu_tests.log" | tail -n 25
  if [ -f engine_kit/manifest.json ]; then
    for m in "${engine_mods[@]}"; do
      log="$OUT/engine_gpu_$(basename "$m" .py).log"
      echo "== engine GPU tests (engine_kit/): $PY -m pytest -q -rs -s -m gpu $m"
      OUT="$OUT" $PY -m pytest -q -rs -s -p no:cacheprovider -m gpu "$m" > "$log" 2>&1 || status=1
      grep -E '^(E=|E |vLLM GPU|FAILED|ERROR)|passed|failed' "$log" | tail -n 25
    done
  fi
  echo "== fuzz: $PY scripts/gpu_fuzz.py --json $OUT/fuzz.json"
  $PY scripts/gpu_fuzz.py --json "$OUT/fuzz.json" > "$OUT/fuzz.log" 2>&1 || status=1
  tail -n 8 "$OUT/fuzz.log"
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  echo "== bench: $PY -m dsv4_compressor bench --quick $*"
  $PY -m dsv4_compressor bench --quick --json "$OUT/bench.json" "$@" > "$OUT/bench.log" 2>&1 || status=1
  tail -n 5 "$OUT/bench.log"
  $PY scripts/write_perf.py "$OUT/bench.json" --out "$OUT/PERF.md" > "$OUT/write_perf.log" 2>&1 || status=1
fi
if [ -n "${GPU_CHECK_AB:-}" ]; then
  IFS=';' read -r -a ab_variants <<< "$GPU_CHECK_AB"
  if [ "$mode" = all ] || [ "$mode" = tests ]; then
    ab_tests=${GPU_CHECK_AB_TESTS:-tests/test_projection_gpu.py}
    for i in "${!ab_variants[@]}"; do
      echo "== GPU tests with ${ab_variants[$i]}: $ab_tests"
      env ${ab_variants[$i]} $PY -m pytest -q -rs -p no:cacheprovider -m gpu $ab_tests > "$OUT/gpu_tests_ab$i.log" 2>&1 \
        || status=1
      tail -n 3 "$OUT/gpu_tests_ab$i.log"
    done
  fi
  echo "== A/B: bench --preset projection, then with each of: $GPU_CHECK_AB"
  $PY -m dsv4_compressor bench --preset projection --json "$OUT/ab_base.json" > "$OUT/ab_base.log" 2>&1 || status=1
  : > "$OUT/ab.md"
  for i in "${!ab_variants[@]}"; do
    env ${ab_variants[$i]} $PY -m dsv4_compressor bench --preset projection --json "$OUT/ab_other$i.json" \
      > "$OUT/ab_other$i.log" 2>&1 || status=1
    $PY scripts/write_perf.py "$OUT/ab_base.json" --compare "$OUT/ab_other$i.json" --out "$OUT/ab$i.md" || status=1
    cat "$OUT/ab$i.md" >> "$OUT/ab.md"
  done
  cat "$OUT/ab.md"
fi
bundle_out PERF.md perf.json perf.png bench.json environment.txt ab.md
exit $status
