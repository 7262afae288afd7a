"""The Lightning Indexer's optional 132-byte FP8 pack: Walsh-Hadamard transform, then one float32 scale per key.

``hadamard_fp8_pack`` is the ``@triton.jit`` helper the indexer compress kernel calls on each finished key;
``indexer_fp8_pack`` launches it standalone over stored bf16 keys (e.g. to re-pack a pool).

The transform is Sylvester-ordered: ``out[i] = sum_j (-1)^popcount(i & j) v[j]``, scaled by ``H**-0.5``;
the sign matrix is generated from indices, so nothing but the key is read.
"""

import math

import torch
import triton
import triton.language as tl

from .numerics import e4m3_byte, exact_fp8_default


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
def hadamard_fp8_pack(
    v_nope,
    v_even,
    v_odd,
    idx_nope,
    idx_even,
    idx_odd,
    slot,
    pages_ptr,
    page_stride,
    HEAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    EXACT_FP8: tl.constexpr,
    INV_SQRT_HEAD: tl.constexpr,
):
    """Pack one key given in three parts (values at channel indices ``idx_*``; padded lanes hold zeros and
    indices >= HEAD, which multiply zero) into page slot ``slot``: ``[P x H e4m3fn][P x 4-byte scale]``, pages
    ``page_stride`` bytes apart."""
    i = tl.arange(0, HEAD)[:, None]
    h = tl.sum(_hadamard_sign(i, idx_nope[None, :]) * v_nope[None, :], axis=1)
    h += tl.sum(_hadamard_sign(i, idx_even[None, :]) * v_even[None, :], axis=1)
    h += tl.sum(_hadamard_sign(i, idx_odd[None, :]) * v_odd[None, :], axis=1)
    h = h * INV_SQRT_HEAD  # float32(HEAD**-0.5), rounded once on the host as in the reference
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=0), 1e-4), 448.0)
    q = tl.math.div_rn(h, scale)
    q = e4m3_byte(tl.minimum(tl.maximum(q, -448.0), 448.0), EXACT_FP8)
    slot = slot.to(tl.int64)
    page = slot // PAGE_SIZE
    t = slot % PAGE_SIZE
    base = pages_ptr + page * page_stride
    tl.store(base + t * HEAD + tl.arange(0, HEAD), q)
    tl.store((base + PAGE_SIZE * HEAD + t * 4).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def _indexer_fp8_pack_kernel(
    keys_ptr,
    slots_ptr,
    pages_ptr,
    HEAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    EXACT_FP8: tl.constexpr,
    INV_SQRT_HEAD: tl.constexpr,
):
    slot = tl.load(slots_ptr + tl.program_id(0))
    if slot < 0:
        return
    idx = tl.arange(0, HEAD)
    v = tl.load(keys_ptr + slot.to(tl.int64) * HEAD + idx).to(tl.float32)
    zero_idx = tl.full([1], HEAD, tl.int32)  # an index >= HEAD carrying a zero value
    zero = tl.zeros([1], tl.float32)
    hadamard_fp8_pack(
        v,
        zero,
        zero,
        idx,
        zero_idx,
        zero_idx,
        slot,
        pages_ptr,
        PAGE_SIZE * (HEAD + 4),
        HEAD,
        PAGE_SIZE,
        EXACT_FP8,
        INV_SQRT_HEAD,
    )


def indexer_fp8_pack(keys: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, page_size: int, exact_fp8=None):
    """Pack bf16 ``keys[slots]`` (``[num_slots, H]``) into FP8 ``pages`` (uint8 ``[num_pages, P * (H + 4)]``).

    ``slots``: int32 device tensor; ``-1`` entries are skipped.
    """
    head = keys.shape[1]
    if keys.dtype != torch.bfloat16 or head & (head - 1):
        raise ValueError(f"keys must be bf16 with a power-of-two width, got {keys.dtype} {list(keys.shape)}")
    if pages.dtype != torch.uint8 or pages.shape[1] != page_size * (head + 4):
        raise ValueError(f"pages must be uint8 [num_pages, {page_size * (head + 4)}], got {list(pages.shape)}")
    if slots.numel() == 0:
        return
    exact = exact_fp8_default(keys.device) if exact_fp8 is None else exact_fp8
    _indexer_fp8_pack_kernel[(slots.numel(),)](
        keys,
        slots,
        pages,
        HEAD=head,
        PAGE_SIZE=page_size,
        EXACT_FP8=exact,
        INV_SQRT_HEAD=1.0 / math.sqrt(head),
        num_warps=4,
    )
