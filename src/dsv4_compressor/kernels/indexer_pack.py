"""The Lightning Indexer's 132-byte FP8 pack: ``H`` e4m3fn values and one float32 scale per key.

The engines pack the same key four slightly different ways, and a pool must hold what its engine's reader
expects byte for byte, so the pack is a constexpr ``VARIANT`` (numbers in :data:`PACK_VARIANTS`):

=================  ==============================================================================  ============
variant            values packed                                                                   who
=================  ==============================================================================  ============
``hadamard``       ``H(bf16(key)) * H**-0.5``; scale ``max(amax, 1e-4) / 448``                     SPEC, ours
``hadamard_bf16``  the same transform rounded to bf16 before packing                               LightLLM
``hadamard_f32``   ``H(key) * H**-0.5`` of the unrounded float32 key                               SGLang
``pow2``           ``bf16(key)``, no transform; scale ``2^ceil(log2(max(amax, 1e-4) * (1/448)))``  vLLM
``pow2_ue8m0``     ``pow2`` with the scale stored as 4 equal UE8M0 bytes (``e + 127``, one int32)  vLLM cc 10.x
=================  ==============================================================================  ============

The engine-named variants repeat their engine's GPU operations (:mod:`.engine_float`): ``hadamard_f32`` is
SGLang's ``fused_norm_rope_indexer`` (``fused_norm_rope_v2.cuh``) from the pooled vector on, see
:func:`sglang_norm_rope` (its own RMSNorm and rope, then ``q = h * (1 / scale)``); ``hadamard_bf16`` is
LightLLM's Triton ``hadamard_transform`` then ``destindex_copy_indexer_k_dsv4``, whose ``/`` are
``div.full.f32``: ``scale = max(amax, 1e-4) / 448`` and ``q = h / scale`` both approximate divisions.

``H`` is the Sylvester-ordered Walsh-Hadamard transform, ``out[i] = sum_j (-1)^popcount(i & j) v[j]``; the sign
matrix is generated from indices, so nothing but the key is read. A page of ``P`` packs is
``[P x H fp8][P x 4-byte scale]``. :func:`indexer_fp8_pack` launches the ``hadamard`` pack standalone over stored
bf16 keys (e.g. to re-pack a pool).
"""

import math

import torch
import triton
import triton.language as tl

from . import exact_fp8_default
from .engine_float import div_full, fma, rsqrt_approx
from .numerics import bf16_rne, e4m3_byte, pow2

#: Pack variants: name -> the constexpr the kernels take (0: no pack).
PACK_VARIANTS = {"hadamard": 1, "hadamard_bf16": 2, "hadamard_f32": 3, "pow2": 4, "pow2_ue8m0": 5}


@triton.jit
def _hadamard_sign(i, j):
    p = i & j
    p = p ^ (p >> 16)
    p = p ^ (p >> 8)
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return 1.0 - 2.0 * (p & 1).to(tl.float32)


@triton.jit
def _butterfly_stage(x, N: tl.constexpr, SPAN: tl.constexpr):
    """One radix-2 stage of the fast transform: lanes ``i`` and ``i + SPAN`` (bit ``SPAN`` of ``i`` clear) become
    ``(x[i] + x[i + SPAN], x[i] - x[i + SPAN])``."""
    pairs = tl.permute(tl.reshape(x, (N // (2 * SPAN), 2, SPAN)), (0, 2, 1))  # [high bits, low bits, bit SPAN]
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (N,))


@triton.jit
def _hadamard(v, idx, HEAD: tl.constexpr, INV_SQRT_HEAD: tl.constexpr):
    """``H(v) * H**-0.5`` in natural order, ``[HEAD]``, of a key in channel order (values at channel indices
    ``idx``; padding lanes hold zeros).

    When the key fills its block (``HEAD`` lanes, a power of two) it is transformed in registers by
    ``log2(HEAD)`` butterfly stages (``HEAD * log2(HEAD)`` additions; for 128 channels in a one-warp kernel
    doing only the transform triton 3.6 compiles them to 104 SASS instructions with 6 shuffles, against 440 with
    128 shuffles for the 16 x 8 matrix form ``H_16 X H_8``). Narrower keys, padded to 64 lanes, take the dense
    product."""
    if v.shape[0] == HEAD:
        x = v
        for s in tl.static_range(HEAD.bit_length() - 1):
            x = _butterfly_stage(x, HEAD, 1 << s)
        return x * INV_SQRT_HEAD
    else:
        i = tl.arange(0, HEAD)[:, None]
        h = tl.sum(_hadamard_sign(i, idx[None, :]) * v[None, :], axis=1)
        return h * INV_SQRT_HEAD  # float32(HEAD**-0.5), rounded once on the host as in the reference


@triton.jit
def _ceil_log2(x):
    """``ceil(log2(x))`` of a positive normal float32, exactly (from its bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _page_slot(slot, pages_ptr, page_stride, HEAD: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``(data, scale)`` pointers of pack slot ``slot``."""
    slot = slot.to(tl.int64)
    base = pages_ptr + (slot // PAGE_SIZE) * page_stride
    t = slot % PAGE_SIZE
    return base + t * HEAD, (base + PAGE_SIZE * HEAD + t * 4).to(tl.pointer_type(tl.float32))


@triton.jit
def _store_scaled(x, scale, data_ptr, idx, mask, EXACT_FP8: tl.constexpr):
    q = tl.math.div_rn(x, scale)
    tl.store(data_ptr + idx, e4m3_byte(tl.minimum(tl.maximum(q, -448.0), 448.0), EXACT_FP8), mask=mask)


@triton.jit
def _store_quantized(q, data_ptr, idx, mask, EXACT_FP8: tl.constexpr):
    tl.store(data_ptr + idx, e4m3_byte(tl.minimum(tl.maximum(q, -448.0), 448.0), EXACT_FP8), mask=mask)


@triton.jit
def _store_pow2(x, inv_scale, data_ptr, idx, mask, EXACT_FP8: tl.constexpr):
    q = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)  # exact: inv_scale is a power of two
    tl.store(data_ptr + idx, e4m3_byte(q, EXACT_FP8), mask=mask)


@triton.jit
def _halves_sum(v, N: tl.constexpr):
    """``v[:N/2] + v[N/2:]`` of a ``[N]`` vector: one step of a warp's ``shfl_xor`` sum (lane ``l`` adds lane
    ``l ^ N/2``)."""
    a, b = tl.split(tl.permute(tl.reshape(v, (2, N // 2)), (1, 0)))
    return a + b


@triton.jit
def sglang_norm_rope(c, w, cos, sin, eps, HEAD: tl.constexpr, ROPE: tl.constexpr):
    """RMSNorm and rope of a 128-channel indexer key as SGLang's ``fused_norm_rope_indexer`` computes them
    (``fused_norm_rope_v2.cuh``, one warp per key, lane ``l`` holding channels ``4l .. 4l+3``): each lane sums
    its four squares in order with contracted multiply-adds, the warp adds the 32 partial sums by ``shfl_xor``
    (lane distance 16, 8, 4, 2, 1), ``n = c * rsqrtf(sum / 128 + eps) * w``, and each rope pair
    ``(x, y)`` becomes ``(fma(x, cos, -(y * sin)), fma(x, sin, y * cos))``. ``cos`` / ``sin``: per channel
    pair, 1 / 0 off the rope dims (:func:`.entry_pack.finish_inputs`)."""
    tl.static_assert(HEAD == 128, "SGLang's indexer kernel is written for 128 channels")
    lanes = tl.reshape(c, (HEAD // 4, 2, 2))  # [lane, element bit 1, element bit 0]
    even, odd = tl.split(lanes)  # elements 4l + {0, 2}, 4l + {1, 3}
    e0, e2 = tl.split(even)
    e1, e3 = tl.split(odd)
    s = e0 * e0
    s = fma(e1, e1, s)
    s = fma(e2, e2, s)
    s = fma(e3, e3, s)
    s = _halves_sum(s, 32)
    s = _halves_sum(s, 16)
    s = _halves_sum(s, 8)
    s = _halves_sum(s, 4)
    total_a, total_b = tl.split(s)
    total = total_a + total_b
    inv_rms = rsqrt_approx(total * (1.0 / HEAD) + eps)  # / 128 is exact, so the sum may be contracted or not
    n = c * inv_rms * w
    x, y = tl.split(tl.reshape(n, (HEAD // 2, 2)))
    k = tl.arange(0, HEAD // 2) - (HEAD - ROPE) // 2
    is_rope = (k >= 0) & (k < ROPE // 2)
    x_rot = fma(x, cos, -(y * sin))
    y_rot = fma(x, sin, y * cos)
    return tl.reshape(tl.join(tl.where(is_rope, x_rot, x), tl.where(is_rope, y_rot, y)), (HEAD,))


@triton.jit
def pack_indexer_key(
    n, idx, mask, slot, pages_ptr, page_stride,
    VARIANT: tl.constexpr, HEAD: tl.constexpr, PAGE_SIZE: tl.constexpr, EXACT_FP8: tl.constexpr,
    INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    """Pack one finished key (float32 in channel order: values at channel indices ``idx`` where ``mask``,
    padding lanes zero) into pack slot ``slot`` the way ``VARIANT`` says (see the module docstring)."""
    data_ptr, scale_ptr = _page_slot(slot, pages_ptr, page_stride, HEAD, PAGE_SIZE)
    if VARIANT >= 4:
        # pow2: the bf16 key itself, with a power-of-two scale (scaling by it is exact)
        b = bf16_rne(n)
        e = _ceil_log2(tl.maximum(tl.max(tl.abs(b), axis=0), 1e-4) * (1.0 / 448.0))
        _store_pow2(b, pow2(-e), data_ptr, idx, mask, EXACT_FP8)
        if VARIANT == 5:
            # vLLM on compute capability 10.x: the exponent byte four times, read as one int32
            tl.store(scale_ptr.to(tl.pointer_type(tl.int32)), (e + 127) * 0x01010101)
        else:
            tl.store(scale_ptr, pow2(e))
    elif VARIANT == 3:
        # SGLang: (its norm and rope, sglang_norm_rope), the transform, scale = max(amax, 1e-4) / 448 and
        # q = h * (1 / scale), both IEEE (the JIT module is built without fast math)
        h = _hadamard(n, idx, HEAD, INV_SQRT_HEAD)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=0), 1e-4), 448.0)
        inv_scale = tl.math.div_rn(1.0, scale)
        _store_quantized(h * inv_scale, data_ptr, tl.arange(0, HEAD), tl.arange(0, HEAD) < HEAD, EXACT_FP8)
        tl.store(scale_ptr, scale)
    elif VARIANT == 2:
        # LightLLM: hadamard_transform rounds to bf16; the pack divides with Triton's "/" (div.full.f32)
        h = bf16_rne(_hadamard(bf16_rne(n), idx, HEAD, INV_SQRT_HEAD))
        scale = div_full(tl.maximum(tl.max(tl.abs(h), axis=0), 1e-4), 448.0)
        _store_quantized(div_full(h, scale), data_ptr, tl.arange(0, HEAD), tl.arange(0, HEAD) < HEAD, EXACT_FP8)
        tl.store(scale_ptr, scale)
    else:
        h = _hadamard(bf16_rne(n), idx, HEAD, INV_SQRT_HEAD)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=0), 1e-4), 448.0)
        _store_scaled(h, scale, data_ptr, tl.arange(0, HEAD), tl.arange(0, HEAD) < HEAD, EXACT_FP8)
        tl.store(scale_ptr, scale)


@triton.jit
def _indexer_fp8_pack_kernel(
    keys_ptr, slots_ptr, pages_ptr, HEAD: tl.constexpr, PAGE_SIZE: tl.constexpr, EXACT_FP8: tl.constexpr,
    INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    slot = tl.load(slots_ptr + tl.program_id(0))
    if slot < 0:
        return
    idx = tl.arange(0, HEAD)
    v = tl.load(keys_ptr + slot.to(tl.int64) * HEAD + idx).to(tl.float32)
    pack_indexer_key(
        v, idx, idx < HEAD, slot, pages_ptr, PAGE_SIZE * (HEAD + 4), 1, HEAD, PAGE_SIZE, EXACT_FP8, INV_SQRT_HEAD
    )  # fmt: skip


def indexer_fp8_pack(keys: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, page_size: int, exact_fp8=None):
    """Pack bf16 ``keys[slots]`` (``[num_slots, H]``) into FP8 ``pages`` (uint8 ``[num_pages, P * (H + 4)]``)
    with the ``hadamard`` variant. ``slots``: int32 device tensor; ``-1`` entries are skipped."""
    head = keys.shape[1]
    if keys.dtype != torch.bfloat16 or head & (head - 1):
        raise ValueError(f"keys must be bf16 with a power-of-two width, got {keys.dtype} {list(keys.shape)}")
    if pages.dtype != torch.uint8 or pages.shape[1] != page_size * (head + 4):
        raise ValueError(f"pages must be uint8 [num_pages, {page_size * (head + 4)}], got {list(pages.shape)}")
    if slots.numel() == 0:
        return
    exact = exact_fp8_default(keys.device) if exact_fp8 is None else exact_fp8
    _indexer_fp8_pack_kernel[(slots.numel(),)](
        keys, slots, pages, HEAD=head, PAGE_SIZE=page_size, EXACT_FP8=exact, INV_SQRT_HEAD=1.0 / math.sqrt(head),
        num_warps=4,
    )  # fmt: skip


__all__ = ["PACK_VARIANTS", "pack_indexer_key", "sglang_norm_rope", "indexer_fp8_pack"]
