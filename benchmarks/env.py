"""The environment a run is recorded with: GPU, driver, versions, git commit, date."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["environment", "git_commit"]

_REPO = Path(__file__).resolve().parents[1]  # benchmarks/env.py -> repository root


#: ``DSV4_*`` variables that name the run rather than change it.
_NOT_SETTINGS = ("DSV4_COMMIT", "DSV4_DIRTY")


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=15, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text or None


def git_commit() -> dict:
    """``{"commit": sha or "unknown", "dirty": bool or None}`` of the checkout this package runs from
    (falls back to the working directory's repository; ``DSV4_COMMIT`` names it where no ``.git`` travels,
    as on the device machine)."""
    if os.environ.get("DSV4_COMMIT"):
        return {"commit": os.environ["DSV4_COMMIT"], "dirty": os.environ.get("DSV4_DIRTY", "0") == "1"}
    for where in (_REPO, Path.cwd()):
        sha = _run(["git", "rev-parse", "HEAD"], cwd=where)
        if sha:
            status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where)
            return {"commit": sha, "dirty": bool(status)}
    return {"commit": "unknown", "dirty": None}


def _driver() -> str:
    text = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if text:
        return text.splitlines()[0].strip()
    try:
        import torch

        version = torch._C._cuda_getDriverVersion()  # e.g. 12040: the CUDA driver API version
        return f"unknown (nvidia-smi unavailable; CUDA driver API {version // 1000}.{version % 1000 // 10})"
    except Exception:  # best effort: a private torch call
        return "unknown"


def environment(device=None) -> dict:
    """Everything the report needs to say where the numbers come from."""
    import numpy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = "not installed"
    from dsv4_compressor import __version__

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "dsv4_compressor": __version__,
        "cuda_runtime": torch.version.cuda,
        **git_commit(),
        # the library's switches set for this run (DSV4_PDL, DSV4_STEP_TABLES_IN_PLAN_LAUNCH, ...)
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSV4_") and k not in _NOT_SETTINGS},
    }
    if torch.cuda.is_available():
        dev = torch.device(device or "cuda")
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        env.update(
            gpu=torch.cuda.get_device_name(idx),
            driver=_driver(),
            sm_count=props.multi_processor_count,
            gpu_memory_bytes=props.total_memory,
            l2_bytes=getattr(props, "L2_cache_size", None),
            capability=f"{props.major}.{props.minor}",
        )
    else:
        env.update(gpu=None, driver=None)
    return env
