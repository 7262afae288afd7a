"""Programmatic dependent launch (PDL): letting a step's next kernel start while this one finishes.

In a CUDA graph of a decode step the GPU runs our kernels back to back (``build_plan``, then per layer the
compress kernels); each is a few microseconds, of which launching and scheduling the programs is a fixed part.
With PDL (Hopper and newer) a kernel launched with ``launch_pdl=True`` may start once every program of the
kernel before it has called ``griddepcontrol.launch_dependents`` (or exited), instead of after that kernel
completed and flushed its writes; it must then execute ``griddepcontrol.wait`` before it touches memory the
earlier kernel writes or reads.

Every program of our kernels, when ``PDL`` is on, waits (:func:`wait_then_release`) for the kernel before it to
complete before it touches memory that kernels of the step write, and before it exits. Waiting in every
program keeps the order transitive: a kernel cannot complete before its predecessor did, so a wait on it also
covers everything earlier in the stream, including kernels of the engine's that were not launched with PDL.
What overlaps is the next kernel's launch and its programs getting resident, and one read: the compress
kernels' programs (``record_first``) read their plan record, which decides every address they use, before
their wait. That is not safe right after the plan's build (``build_plan`` releases its successor at its
start, before it writes the plan), so ``ops`` launches the first compress on a plan after its build with
``record_first=False`` and every later one with ``True`` (``ops.records_first``, one entry per stream): the first waits for the
kernel before it, hence for the build, before it releases anything, and every later compress is launched
after that release, whatever the engine launched in between. A program releases the next kernel when it exits
(:data:`RELEASE` ``"exit"``), or right after its wait (``"start"``: the next kernel's programs then sit
resident beside this one's while it runs, and read their records meanwhile).

PDL on every launch with the release at the exit makes the whole V4-Flash decode step faster at every batch
size; releasing at the start makes a layer's own graph faster but the whole step slower at B >= 64, because
the next kernel's programs then sit resident beside the running kernel's (H200, docs/runs/tune_13a47bc, column
``pdl all``). Launches small enough to leave multiprocessors idle (:data:`START_RELEASE_MAX_PROGRAMS`) do
release at their start.

``ENABLED`` (or the environment variable ``DSV4_PDL=0/1`` read at import) turns it off or forces it; by
default it is on for compiled kernels on CUDA devices of compute capability 9.0 and newer.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import interpreting, sm_count


def _from_env():
    value = os.environ.get("DSV4_PDL", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"DSV4_PDL must be 0, 1 or auto, got {value!r}")


#: ``None``: PDL where the device supports it; ``True`` / ``False``: always (where supported) / never.
ENABLED: bool | None = _from_env()
#: When a program releases the next kernel: ``"exit"`` or ``"start"`` (see above; ``DSV4_PDL_RELEASE`` at import,
#: for A/B runs).
RELEASE = os.environ.get("DSV4_PDL_RELEASE", "exit").strip().lower() or "exit"
if RELEASE not in ("exit", "start"):
    raise ValueError(f"DSV4_PDL_RELEASE must be exit or start, got {RELEASE!r}")
#: Launches of at most this many programs release at the start even when ``RELEASE`` is ``"exit"`` (0: none;
#: ``None``: the current device's multiprocessor count, :func:`~dsv4_compressor.kernels.sm_count`). A small
#: grid leaves most multiprocessors idle, so the next kernel's programs need not sit beside its own. One
#: program per multiprocessor (132 on the H200) made the whole V4-Flash step faster or equal everywhere, 288
#: slower (docs/runs/tune_59ec3f0). Order is unaffected: every program still waits before touching memory.
START_RELEASE_MAX_PROGRAMS: int | None = None


@functools.cache
def _supported(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL now (``ENABLED`` and the device's support)."""
    if ENABLED is False:
        return False
    return _supported(device.type, device.index)


def launch_options(pdl: bool, programs: int, *, start: bool = False) -> dict:
    """The kernel arguments of a launch of ``programs`` programs: the ``PDL`` constexpr (0: off, 1: wait,
    release at exit, 2: wait, release at start), and ``launch_pdl`` where it is on (the interpreter takes no
    launch options). ``start``: release at the start whatever the size (a launcher's own policy)."""
    if not pdl:
        return {"PDL": 0}
    limit = START_RELEASE_MAX_PROGRAMS
    start = start or RELEASE == "start" or programs <= (sm_count() if limit is None else limit)
    return {"PDL": 2 if start else 1, "launch_pdl": True}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one completed (and with ``PDL == 2`` let the kernel
    after it launch now, not when this program exits). Call first in every program, before any load or
    store."""
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def wait_before_record(PDL: tl.constexpr, RECORD_FIRST: tl.constexpr):
    """:func:`wait_then_release` at a program's start, unless it reads its plan record first (``RECORD_FIRST``:
    then :func:`wait_after_record` once the record is requested)."""
    if not RECORD_FIRST:
        wait_then_release(PDL)


@triton.jit
def wait_after_record(PDL: tl.constexpr, RECORD_FIRST: tl.constexpr):
    """:func:`wait_then_release` right after a ``RECORD_FIRST`` program requested its plan record."""
    if RECORD_FIRST:
        wait_then_release(PDL)


__all__ = [
    "ENABLED",
    "RELEASE",
    "START_RELEASE_MAX_PROGRAMS",
    "pdl_enabled",
    "launch_options",
    "wait_then_release",
    "wait_before_record",
    "wait_after_record",
]
