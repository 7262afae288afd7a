"""Where kernels run in this process (the interpreter or a GPU), what the session summary says about
the GPU modules, and the interpreter's casts corrected for an engine's kernel used as a reference.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter in this process (read as ``@triton.jit`` reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gpu_plan(cuda: bool, interpret: bool) -> str:
    """Whether this process runs the GPU modules (``tests/test_gpu.py``, ``tests/test_online_gpu.py``):
    ``"here"`` (CUDA and compiled kernels), ``"interpreted"`` (CUDA, but Triton runs under the interpreter in
    this process, as in the first pass of ``make test``: they skip, the session summary says so loudly, and
    ``make test`` runs them in its next pass, without the interpreter) or ``"none"`` (no CUDA: they skip)."""
    if not cuda:
        return "none"
    return "interpreted" if interpret else "here"


def gpu_session_note(counts: dict, plan: str):
    """What the session summary says about the GPU tests, from their outcome counts (``passed``, ``failed``,
    ``skipped``, ``error``) and :func:`gpu_plan`: ``(level, title, line)`` with level ``"ok"``, ``"note"`` or
    ``"alarm"`` (a CUDA device is here and no GPU test ran), or ``None`` when no GPU test was collected."""
    if not any(counts.values()):
        return None
    if plan == "none":
        return (
            "note",
            "GPU tests NOT run: no CUDA device",
            (f"{counts['skipped']} GPU tests (marker 'gpu') were skipped; scripts/gpu_check.sh runs them on a GPU"),
        )
    ran = counts["passed"] + counts["failed"] + counts["error"]
    if plan == "interpreted" or ran == 0:
        why = "this process interprets Triton (TRITON_INTERPRET is set)" if plan == "interpreted" else "see -rs"
        return (
            "alarm",
            "CUDA IS AVAILABLE BUT THE GPU TESTS DID NOT RUN IN THIS SESSION",
            (
                f"{counts['skipped']} GPU tests were skipped: {why}; run them with compiled kernels: "
                f"python -m pytest -m gpu tests (make test does, in its second pass)"
            ),
        )
    failed = counts["failed"] + counts["error"]
    return (
        ("alarm" if failed else "ok"),
        f"GPU tests ran with compiled kernels: {counts}",
        (f"{counts['passed']} passed, {failed} failed, {counts['skipped']} skipped"),
    )


def kernel_device() -> torch.device:
    """Where Triton kernels can run in this process: the CPU under the interpreter, else the GPU."""
    if interpreting() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def engine_casts_round_to_nearest_even():
    """Make the interpreter's float32 -> bfloat16 / float8e4nv conversions round to nearest even (the GPU's
    ``cvt.rn``), for an engine kernel used as the reference. Other conversions keep the interpreter's code.

    The interpreter truncates float32 -> bfloat16 and mis-rounds float32 -> e4m3 (SPEC section 9). Only an
    engine's kernel runs inside this: ours encode with exact arithmetic under the interpreter."""
    from triton.runtime import interpreter

    original = interpreter._convert_float
    import triton.language as tl

    targets = {tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in targets:
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(targets[output_dtype])
            return t.view(torch.uint16 if output_dtype == tl.bfloat16 else torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original


def count_launches(monkeypatch) -> list[str]:
    """Names of the Triton kernels launched from now on (under the interpreter), in launch order."""
    from triton.runtime.interpreter import InterpretedFunction

    names, run = [], InterpretedFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    return names


def record_out(filename: str, name: str, value) -> None:
    """Merge ``{name: value}`` into ``$OUT/filename`` (JSON), where the device tool's output folder is set: the GPU
    tests' counts come back with the run's logs."""
    import json

    out = os.environ.get("OUT")
    if not out or not os.path.isdir(out):
        return
    path = os.path.join(out, filename)
    data = json.loads(open(path).read()) if os.path.exists(path) else {}
    data[name] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
