"""Triton kernels, one family per module: ``plan`` (the step plan), ``state_rows`` (engines' state addressing),
``step_build`` (a step's plans and state rows in one launch), ``entry_pack`` (finishing an entry), ``ring`` (the
ring state), ``fused_compress`` (single-stage), ``c128_tiled`` (tiled HCA), ``online_hca``, ``indexer_pack``,
``projection`` (``x @ wkv_gate.T``), ``pdl`` (programmatic dependent launch), and the exact rounding helpers in
``numerics`` and ``engine_float``; :func:`sm_count` gives the multiprocessor count the launch sizes aim at.

Importing this package decorates no kernel (the modules above do); it also mends one incompatibility of the Triton interpreter (CPU runs): triton < 3.7
converts a scalar to a loop bound with ``int(array_of_shape_1)``, which numpy >= 2.4 refuses
("only 0-dimensional arrays can be converted to Python scalars"); the interpreter of triton 3.9 squeezes first.
"""

import functools
import os

import torch
import triton

#: The multiprocessor count :func:`sm_count` answers where no CUDA device can be asked (CPU runs, the
#: interpreter, ``scripts/compile_check.py``): the H100 SXM's and H200's 132.
DEFAULT_SM_COUNT = 132


def interpreting() -> bool:
    """True when kernels run under the Triton interpreter (``TRITON_INTERPRET=1``). The variable must be set
    before the kernel modules are imported: ``@triton.jit`` reads it when it decorates."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _device_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device=None) -> int:
    """Multiprocessors of ``device`` (a ``torch.device``, an index, or ``None``: the current CUDA device), read
    from the device once and cached per device (132 on an H100 SXM / H200, 148 on a B200). Without CUDA, for a
    non-CUDA device, or under the interpreter: :data:`DEFAULT_SM_COUNT`."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return DEFAULT_SM_COUNT
        device = device.index
    elif isinstance(device, str):
        return sm_count(torch.device(device))
    if interpreting() or not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    return _device_sm_count(torch.cuda.current_device() if device is None else int(device))


def exact_fp8_default(device) -> bool:
    """Integer FP8 encoding under the interpreter or on CPU tensors; hardware conversion on the GPU."""
    return interpreting() or str(device).startswith("cpu")


def _mend_interpreter_scalar_index() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no interpreter in this build
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if original is None or (major, minor) >= (3, 7) or getattr(original, "mended", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.mended = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_mend_interpreter_scalar_index()
