"""Triton kernels, one family per module: ``plan`` (the step plan), ``state_rows`` (engines' state addressing),
``step_build`` (a step's plans and state rows in one launch), ``entry_pack`` (finishing an entry), ``ring`` (the
ring state), ``fused_compress`` (single-stage), ``c128_tiled`` (tiled HCA), ``online_hca``, ``indexer_pack``,
``projection`` (``x @ wkv_gate.T``), ``pdl`` (programmatic dependent launch), and the exact rounding helpers in
``numerics`` and ``engine_float``.

Importing this package decorates no kernel (the modules above do); it also mends one incompatibility of the Triton interpreter (CPU runs): triton < 3.7
converts a scalar to a loop bound with ``int(array_of_shape_1)``, which numpy >= 2.4 refuses
("only 0-dimensional arrays can be converted to Python scalars"); the interpreter of triton 3.9 squeezes first.
"""

import os

import triton


def interpreting() -> bool:
    """True when kernels run under the Triton interpreter (``TRITON_INTERPRET=1``). The variable must be set
    before the kernel modules are imported: ``@triton.jit`` reads it when it decorates."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
