# Sourced by the device scripts (gpu_check.sh, tune_check.sh, multi_gpu_check.sh): results go to $OUT (the
# device tool's output folder) or ./out, the source tree is imported from src/, kernels run compiled (not under
# the interpreter), and $PY is the Python to use (PYTHON, else python3).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
