"""Test configuration.

Without a GPU, Triton kernels run under the interpreter on CPU tensors (SPEC section 9): ``TRITON_INTERPRET=1``
is set here, before anything imports triton (``make test`` sets it for its first pass on every machine).

The GPU modules (``tests/test_gpu.py``, ``tests/test_online_gpu.py``, marker ``gpu``) need compiled kernels, which
a process that interprets Triton cannot have: there they skip, and on a GPU machine ``make test`` runs them in a
second pass without the interpreter (``pytest -m gpu``). The summary at the end of a session that collected them
says which GPU tests ran and, loudly, when none did although a GPU is there.
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
from helpers.inputs import STREAMING_BACKENDS  # noqa: E402
from helpers.session import gpu_plan, gpu_session_note, interpreting  # noqa: E402


@pytest.fixture(scope="session", params=STREAMING_BACKENDS)
def backend(request) -> str:
    """Each streaming backend by name (a missing one fails its tests: nothing is skipped)."""
    return request.param


def _gpu_counts(stats) -> dict[str, int]:
    counts = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        counts[outcome] = sum(1 for rep in stats.get(outcome, []) if "gpu" in getattr(rep, "keywords", {}))
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say which GPU tests (marker ``gpu``) ran; loudly when a CUDA device is here and none did."""
    note = gpu_session_note(_gpu_counts(terminalreporter.stats), gpu_plan(CUDA, interpreting()))
    if note is not None:
        level, title, line = note
        colour = {"ok": dict(green=True), "note": dict(yellow=True), "alarm": dict(red=True)}[level]
        terminalreporter.write_sep("!" if level == "alarm" else "=", title, bold=True, **colour)
        terminalreporter.write_line(line)
