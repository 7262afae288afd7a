#!/usr/bin/env bash
# Create $VENV (default .venv) with everything `make demo` and `make test` need.
# Reuses a Python that can already import torch (e.g. a GPU image); otherwise installs the CPU build
# torch==2.13.0 (a local file on the project's machines, fast). TRITON_VERSION=x.y.z pins triton (the minimum
# supported one is tested in a second environment this way); ENGINE_REQUIREMENTS=file adds a serving engine's
# pinned release and the modules its imports need (tests/engines/*.txt), installed with --no-deps.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for cand in python3 python3.12 python3.11 python3.10 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' >/dev/null 2>&1; then
      PYTHON=$cand; HAVE_TORCH=1; break
    fi
  done
fi
if [ -z "$PYTHON" ]; then PYTHON=python3; HAVE_TORCH=0; fi
HAVE_TORCH=${HAVE_TORCH:-0}
echo "bootstrap: using $($PYTHON --version 2>&1) at $(command -v $PYTHON) (torch importable: $HAVE_TORCH)"
if [ "$HAVE_TORCH" = 1 ]; then
  "$PYTHON" -m venv --system-site-packages "$VENV"
else
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# --no-compile: pip byte-compiles every file of torch otherwise (about 40 s per environment); Python compiles
# what it imports on first use.
PIP_FLAGS=(-q --no-compile)
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "bootstrap: installing torch==2.13.0 (CPU build)"
  $PIP install "${PIP_FLAGS[@]}" torch==2.13.0
fi
if [ -n "${TRITON_VERSION:-}" ]; then
  echo "bootstrap: pinning triton==$TRITON_VERSION"
  $PIP install "${PIP_FLAGS[@]}" "triton==$TRITON_VERSION"
fi
$PIP install "${PIP_FLAGS[@]}" -e '.[test]'
if [ -n "${ENGINE_REQUIREMENTS:-}" ]; then
  # an engine's pinned release and the pure-Python modules its imports need, each without its dependencies: the
  # engines pin CUDA builds of torch, which must not replace the CPU build here
  echo "bootstrap: installing $ENGINE_REQUIREMENTS (--no-deps)"
  $PIP install "${PIP_FLAGS[@]}" --no-deps -r "$ENGINE_REQUIREMENTS"
fi
"$VENV/bin/python" -c 'import torch, triton, dsv4_compressor; print("bootstrap: torch", torch.__version__, "triton", triton.__version__, "ok")'
