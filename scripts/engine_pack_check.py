"""GPU check: the engine-named indexer packs against each engine's own kernel, byte for byte, on one GPU.

    bash scripts/engine_pack_sources.sh           # on the machine with the wheels: fills engine_src/
    PYTHONPATH=src python3 scripts/engine_pack_check.py --src engine_src   # on the GPU machine (carry engine_src)

``--ring-decode`` runs SGLang's C128 ring decode against our tiled C128 kernel instead (``--device cpu``: host-side,
SGLang emulated in PyTorch, ours under ``TRITON_INTERPRET=1``; ``--ring-compile-only``: only the CUDA wrappers'
build). The entry point only: the checks are ``benchmarks/engine_checks/`` (its docstring says what each compares,
and what it writes under ``--out``).
"""

from __future__ import annotations

import os
import sys


def _cpu_run() -> bool:
    """``--device cpu`` (the ring harness's host-side check under the Triton interpreter) or an import (tests)."""
    argv = sys.argv[1:]
    cpu = "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))
    return cpu or __name__ != "__main__"


if not _cpu_run():
    os.environ.pop("TRITON_INTERPRET", None)

# the checks live in the checkout's benchmarks/ (and reuse its cases, layers, timing): not installed with the package
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.engine_checks.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
