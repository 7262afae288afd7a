"""Float32 operations as the engines' GPU kernels execute them (``@triton.jit`` helpers, no launches).

An engine-named indexer pack must hold the bytes that engine writes, so it repeats the engine's operations:

* ``rsqrt_approx``: CUDA's ``rsqrtf`` (SGLang's ``math::rsqrt``) and Triton's ``tl.rsqrt`` are the hardware
  approximation ``rsqrt.approx.f32``, not ``1 / sqrt``;
* ``div_full``: Triton's ``/`` on float32 is ``div.full.f32`` (an approximation within 2 ulp), not the IEEE
  quotient (LightLLM's Triton kernels divide with ``/``);
* ``fma``: where nvcc contracts ``a * b + c`` into one rounding (SGLang's sum of squares and rope).

On the GPU the first two are the PTX instructions themselves (inline assembly, so the compiler cannot pick
another form). The Triton interpreter runs no PTX: there they fall back to the correctly rounded operations,
which is also what the engines' Triton kernels compute under the interpreter (numpy), so CPU tests compare
operation order and the GPU check (``scripts/engine_pack_check.py``, ``benchmarks/engine_checks/``) compares the
hardware results.
"""

import triton
import triton.language as tl

from . import interpreting

#: True when kernels are compiled (inline PTX); False under the interpreter (correctly rounded fallbacks).
PTX = tl.constexpr(not interpreting())


@triton.jit
def rsqrt_approx(x):
    """``rsqrt.approx.f32`` (CUDA ``rsqrtf``, Triton ``tl.rsqrt``); interpreter: ``1 / sqrt(x)`` rounded."""
    if PTX:
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=f,f", [tl.cast(x, tl.float32)], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.div_rn(1.0, tl.math.sqrt_rn(x))


@triton.jit
def div_full(a, b):
    """``div.full.f32`` (Triton's ``/`` on float32 on NVIDIA GPUs); interpreter: the IEEE quotient."""
    if PTX:
        return tl.inline_asm_elementwise(
            "div.full.f32 $0, $1, $2;", "=f,f,f", [tl.cast(a, tl.float32), tl.cast(b, tl.float32)], dtype=tl.float32,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def fma(a, b, c):
    """``a * b + c`` rounded once (``fma.rn.f32``). The interpreter of triton <= 3.8 rounds ``tl.fma`` twice, so
    there it is the float64 product (exact) plus ``c``, rounded to float32 (as the CPU tests' reference does)."""
    if PTX:
        return tl.fma(a, b, c)
    else:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)


__all__ = ["PTX", "rsqrt_approx", "div_full", "fma"]
