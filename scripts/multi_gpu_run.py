"""An engine-shaped multi-GPU run of the LightLLM adapter: DeepSeek-V4 compressors on LightLLM's buffers, one
process per rank, between NCCL collectives and inside CUDA graphs (docs/INTEGRATION.md, "Distributed
engines")::

    torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode dp --hca ring      # or --hca online
    torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode tp --dispatch torch-ops
    # CPU smoke test (Triton interpreter, gloo, scaled-down shapes):
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode dp --backend gloo --device cpu \\
        --small --requests 3 --max-prompt 48 --decode-steps 3 --chunk 48 --csa-layers 1 --hca-layers 1 --hidden 64

``scripts/multi_gpu_check.sh`` runs the GPU runs; ``tests/test_multi_gpu_cpu.py`` the CPU smoke test. The entry
point only: the harness, its checks and its report are ``benchmarks/multi_gpu/`` (its docstring says what a run
does and reports).
"""

from __future__ import annotations

import os
import sys


def _interpret_on_cpu() -> None:
    """``--device cpu`` runs the kernels under the Triton interpreter, which must be on before triton is imported."""
    argv = sys.argv[1:]
    cpu = "--device=cpu" in argv or any(a == "--device" and argv[i + 1 : i + 2] == ["cpu"] for i, a in enumerate(argv))
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_on_cpu()

# the checkout's benchmarks/ (the harness; it puts tests/ on the path for LightLLM's stand-ins, tests/helpers/):
# neither is installed with the package
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.multi_gpu.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
