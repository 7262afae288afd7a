# Sourced by the device scripts (gpu_check.sh, tune_check.sh, multi_gpu_check.sh): results go to $OUT (the
# device tool's output folder) or ./out, the source tree is imported from src/, kernels run compiled (not under
# the interpreter), and $PY is the Python to use (PYTHON, else python3).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}

# The device tool brings back at most 8 files from $OUT: keep the named ones as they are and pack everything
# else (logs, JSON) into $OUT/logs.tgz.
bundle_out() {
  local keep=("$@") f k skip rest=()
  for f in "$OUT"/*; do
    [ -e "$f" ] || continue
    f=$(basename "$f")
    skip=0
    for k in "${keep[@]}" logs.tgz; do [ "$f" = "$k" ] && skip=1; done
    [ "$skip" = 0 ] && rest+=("$f")
  done
  [ "${#rest[@]}" -gt 0 ] || return 0
  tar czf "$OUT/logs.tgz" -C "$OUT" "${rest[@]}" && (cd "$OUT" && rm -rf -- "${rest[@]}")
  echo "bundle_out: kept ${keep[*]}; packed ${#rest[@]} more into $OUT/logs.tgz"
}
