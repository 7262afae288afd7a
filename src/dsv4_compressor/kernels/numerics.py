"""Bit-exact rounding helpers shared by every kernel (``@triton.jit`` functions, no launches).

Why integer arithmetic: the Triton interpreter (CPU tests) truncates float32 -> bfloat16 casts and
mis-rounds some float32 -> float8e4nv casts (SPEC section 9). The helpers below round to nearest even with
integer operations, so CPU and GPU produce the same bytes; on the GPU ``EXACT_FP8=False`` keeps the
hardware ``cvt.rn.satfinite`` FP8 conversion, which the GPU tests check against the exact path byte for byte.
"""

import triton
import triton.language as tl

from . import exact_fp8_default, interpreting  # noqa: F401  (re-exported)


@triton.jit
def bf16_rne(x):
    """float32 -> float32 holding the nearest-even bfloat16 value (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x):
    """float32 -> the 16 bits of its nearest-even bfloat16, as int16 (store through an int16 pointer)."""
    bits = bf16_rne(x).to(tl.int32, bitcast=True)
    return (bits >> 16).to(tl.int16)


@triton.jit
def pow2(k):
    """Exact ``2.0**k`` as float32 for integer ``k`` in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_exponent(amax):
    """``ceil(log2(max(amax, 1e-4) / 448))`` exactly, from the bits of the clamped ``amax = m * 2^E`` (``m`` in
    [1, 2)), with no division: ``448 = 1.75 * 2^8``, so the quotient is ``(m / 1.75) * 2^(E - 8)`` with
    ``m / 1.75`` in (0.57, 1.15), whose ceiling log2 is 0, or 1 where ``m > 1.75``. The same as rounding the
    quotient to float32 first, as the reference does: a power of two is a float, and the float next to
    ``448 * 2^k`` makes a quotient more than half an ulp above ``2^k``, so the rounding never reaches one."""
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135  # E - 8
    return e + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 0x600000: the mantissa bits of 1.75


@triton.jit
def v41_exponent(amax):
    """``max(ceil(log2(amax / 448)), -13)`` exactly, from the bits of ``amax = m * 2^E`` (``m`` in [1, 2)) as
    :func:`ue8m0_exponent`, the floor (``1e-4`` lies between ``2^-14`` and ``2^-13``) applied after the
    quotient: SGLang's V4.1 record scale (``kv_layout.cuh``, ``store_row_fp8``). ``amax`` 0 gives -13."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(e, -13)


@triton.jit
def e4m3_byte_exact(x):
    """float32 within [-448, 448] -> float8 e4m3fn byte, round to nearest even, by integer arithmetic."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits < 0).to(tl.int32) << 7
    a = tl.abs(x)
    abits = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): keep 3 of 23 mantissa bits, round the 20 dropped bits to nearest even;
    # a carry out of the mantissa moves into the exponent field, as it should.
    exp = (abits >> 23) - 127
    man = abits & 0x7FFFFF
    keep = man >> 20
    rem = man & 0xFFFFF
    up = ((rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))).to(tl.int32)
    normal = ((exp + 7) << 3) + keep + up
    # Subnormals (|x| < 2^-6) count multiples of 2^-9; |x| * 512 is exact, round it to nearest even.
    t = a * 512.0
    whole = t.to(tl.int32)
    frac = t - whole.to(tl.float32)
    up_s = ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    mag = tl.where(a < 0.015625, whole + up_s, normal)
    mag = tl.minimum(mag, 0x7E)  # 448, the largest finite e4m3fn
    return (sign | mag).to(tl.uint8)


@triton.jit
def e4m3_byte(x, EXACT: tl.constexpr):
    """float32 within [-448, 448] -> e4m3fn byte; ``EXACT`` picks integer rounding over the hardware cast."""
    if EXACT:
        return e4m3_byte_exact(x)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
