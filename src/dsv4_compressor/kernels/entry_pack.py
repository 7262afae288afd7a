"""Finishing one entry from its pooled vector: RMSNorm, rope at the group start, and the stored encoding.

Shared ``@triton.jit`` helpers (no launches of their own). Every compress kernel ends in
:func:`finish_entry`; the two-stage HCA kernel's second stage is nothing else.

The pooled vector arrives split in three parts, so that rope needs no register shuffles:
``c_nope`` (dims ``[0, H-R)``, padded to ``BLOCK_NOPE`` with zeros), ``c_even`` and ``c_odd`` (the rope pairs'
``x = dim H-R+2k`` and ``y = dim H-R+2k+1``, padded to ``BLOCK_HALF``).
"""

import torch
import triton
import triton.language as tl

from .indexer_pack import hadamard_fp8_pack, inv_sqrt
from .numerics import bf16_bits, bf16_rne, e4m3_byte, pow2, ue8m0_exponent


@triton.jit
def split_offsets(HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Channel indices and masks of the three parts (nope, rope x, rope y)."""
    NOPE: tl.constexpr = HEAD - ROPE
    nope = tl.arange(0, BLOCK_NOPE)
    half = tl.arange(0, BLOCK_HALF)
    even = NOPE + 2 * half
    odd = even + 1
    return nope, even, odd, nope < NOPE, half < ROPE // 2


@triton.jit
def finish_inputs(
    norm_w_ptr, cos_ptr, sin_ptr, start_pos,
    HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """The norm weight (three parts) and the cos/sin row of ``start_pos``: what finishing an entry reads.
    Kernels may load these early so that the finish does not wait for memory."""
    nope, even, odd, m_nope, m_half = split_offsets(HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF)
    w_nope = tl.load(norm_w_ptr + nope, mask=m_nope, other=0.0).to(tl.float32)
    w_even = tl.load(norm_w_ptr + even, mask=m_half, other=0.0).to(tl.float32)
    w_odd = tl.load(norm_w_ptr + odd, mask=m_half, other=0.0).to(tl.float32)
    cos, sin = rope_row(cos_ptr, sin_ptr, start_pos, ROPE, BLOCK_HALF)
    return w_nope, w_even, w_odd, cos, sin


@triton.jit
def rope_row(cos_ptr, sin_ptr, start_pos, ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr):
    k = tl.arange(0, BLOCK_HALF)
    m_half = k < ROPE // 2
    row = start_pos.to(tl.int64) * (ROPE // 2)
    return tl.load(cos_ptr + row + k, mask=m_half, other=0.0), tl.load(sin_ptr + row + k, mask=m_half, other=0.0)


@triton.jit
def norm_rope(c_nope, c_even, c_odd, w_nope, w_even, w_odd, cos, sin, eps, HEAD: tl.constexpr):
    """``n = c * rsqrt(mean(c^2) + eps) * w``, then rotate the rope pairs ``(x, y)`` by ``(cos, sin)``."""
    sumsq = tl.sum(c_nope * c_nope, axis=0) + tl.sum(c_even * c_even, axis=0) + tl.sum(c_odd * c_odd, axis=0)
    # IEEE division and square root keep this within an ulp of the PyTorch reference.
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sumsq, HEAD * 1.0) + eps))
    x = c_even * inv_rms * w_even
    y = c_odd * inv_rms * w_odd
    return c_nope * inv_rms * w_nope, x * cos - y * sin, y * cos + x * sin


@triton.jit
def pack_latent(
    n_nope,
    n_even,
    n_odd,
    slot,
    pages_ptr,
    HEAD: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    EXACT_FP8: tl.constexpr,
):
    """Write the FlashMLA fp8-sparse record of one entry into global slot ``slot``:
    ``[nope e4m3fn | rope bf16]`` in the page's data area, ``[UE8M0 x blocks | zero pad]`` in its scale area."""
    NOPE: tl.constexpr = HEAD - ROPE
    DATA: tl.constexpr = NOPE + 2 * ROPE
    NB: tl.constexpr = BLOCK_NOPE // 64
    slot = slot.to(tl.int64)
    page = slot // PAGE_SIZE
    t = slot % PAGE_SIZE
    data_ptr = pages_ptr + page * PAGE_BYTES + t * DATA
    scale_ptr = pages_ptr + page * PAGE_BYTES + PAGE_SIZE * DATA + t * SCALE_BYTES

    # nope: bf16 rounding, then one power-of-two scale per 64 values.
    blocks = tl.reshape(bf16_rne(n_nope), (NB, 64))
    e = ue8m0_exponent(tl.max(tl.abs(blocks), axis=1))
    scaled = blocks * pow2(-e)[:, None]  # exact
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    q = e4m3_byte(scaled, EXACT_FP8)
    col = tl.arange(0, NB)[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(data_ptr + col, q, mask=col < NOPE)

    # rope dims as bf16, little-endian, interleaved as (x, y) pairs.
    k = tl.arange(0, BLOCK_HALF)
    m_half = k < ROPE // 2
    rope_ptr = (data_ptr + NOPE).to(tl.pointer_type(tl.int16))
    tl.store(rope_ptr + 2 * k, bf16_bits(n_even), mask=m_half)
    tl.store(rope_ptr + 2 * k + 1, bf16_bits(n_odd), mask=m_half)

    # scales: e + 127 per block, zero bytes after the last block.
    b = tl.arange(0, NB)
    tl.store(scale_ptr + b, (e + 127).to(tl.uint8), mask=b < NOPE // 64)
    pad = tl.arange(0, SCALE_BYTES)
    tl.store(scale_ptr + pad, tl.zeros([SCALE_BYTES], dtype=tl.uint8), mask=pad >= NOPE // 64)


@triton.jit
def store_indexer_key(
    n_nope,
    n_even,
    n_odd,
    slot,
    keys_ptr,
    fp8_pages_ptr,
    HEAD: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INDEXER_FP8: tl.constexpr,
    EXACT_FP8: tl.constexpr,
    INV_SQRT_HEAD: tl.constexpr,
):
    """Write the bf16 key of one entry to ``keys[slot]`` and, with ``INDEXER_FP8``, its 132-byte pack."""
    nope, even, odd, m_nope, m_half = split_offsets(HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF)
    key_ptr = keys_ptr.to(tl.pointer_type(tl.int16)) + slot.to(tl.int64) * HEAD
    tl.store(key_ptr + nope, bf16_bits(n_nope), mask=m_nope)
    tl.store(key_ptr + even, bf16_bits(n_even), mask=m_half)
    tl.store(key_ptr + odd, bf16_bits(n_odd), mask=m_half)
    if INDEXER_FP8:
        hadamard_fp8_pack(
            bf16_rne(n_nope),
            bf16_rne(n_even),
            bf16_rne(n_odd),
            nope,
            even,
            odd,
            slot,
            fp8_pages_ptr,
            HEAD,
            PAGE_SIZE,
            EXACT_FP8,
            INV_SQRT_HEAD,
        )


@triton.jit
def store_entry(
    n_nope, n_even, n_odd, slot, out_ptr, fp8_pages_ptr,
    HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    INDEXER_FP8: tl.constexpr, EXACT_FP8: tl.constexpr, INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    """Store a finished entry (normalized, rotated; three parts) at global slot ``slot``: the latent record,
    or the indexer key plus its optional FP8 pack."""
    if LATENT:
        pack_latent(
            n_nope, n_even, n_odd, slot, out_ptr, HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF, PAGE_SIZE, PAGE_BYTES,
            SCALE_BYTES, EXACT_FP8,
        )  # fmt: skip
    else:
        store_indexer_key(
            n_nope, n_even, n_odd, slot, out_ptr, fp8_pages_ptr, HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF, PAGE_SIZE,
            INDEXER_FP8, EXACT_FP8, INV_SQRT_HEAD,
        )  # fmt: skip


@triton.jit
def finish_entry_with(
    c_nope, c_even, c_odd, slot, w_nope, w_even, w_odd, cos, sin, eps, out_ptr, fp8_pages_ptr,
    HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    INDEXER_FP8: tl.constexpr, EXACT_FP8: tl.constexpr, INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    """Pooled vector -> RMSNorm -> rope -> stored entry, with the inputs of :func:`finish_inputs` given."""
    n_nope, n_even, n_odd = norm_rope(c_nope, c_even, c_odd, w_nope, w_even, w_odd, cos, sin, eps, HEAD)
    store_entry(
        n_nope, n_even, n_odd, slot, out_ptr, fp8_pages_ptr, HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF, LATENT,
        PAGE_SIZE, PAGE_BYTES, SCALE_BYTES, INDEXER_FP8, EXACT_FP8, INV_SQRT_HEAD,
    )  # fmt: skip


@triton.jit
def finish_entry(
    c_nope, c_even, c_odd, slot, start_pos, norm_w_ptr, cos_ptr, sin_ptr, eps, out_ptr, fp8_pages_ptr,
    HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    INDEXER_FP8: tl.constexpr, EXACT_FP8: tl.constexpr, INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    """Pooled vector -> RMSNorm -> rope (at ``start_pos``) -> stored entry (latent record, or indexer key +
    optional pack)."""
    w_nope, w_even, w_odd, cos, sin = finish_inputs(
        norm_w_ptr, cos_ptr, sin_ptr, start_pos, HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF
    )
    finish_entry_with(
        c_nope, c_even, c_odd, slot, w_nope, w_even, w_odd, cos, sin, eps, out_ptr, fp8_pages_ptr, HEAD, ROPE,
        BLOCK_NOPE, BLOCK_HALF, LATENT, PAGE_SIZE, PAGE_BYTES, SCALE_BYTES, INDEXER_FP8, EXACT_FP8, INV_SQRT_HEAD,
    )  # fmt: skip


def entry_meta(config, pool, exact_fp8: bool) -> dict:
    """Constexpr arguments of :func:`finish_entry` for a config and its output pool."""
    half = config.rope_dim // 2
    latent = config.output == "latent"
    return dict(
        HEAD=config.head_dim,
        ROPE=config.rope_dim,
        BLOCK_NOPE=max(64, triton.next_power_of_2(config.nope_dim)),
        BLOCK_HALF=max(1, triton.next_power_of_2(half)),
        LATENT=latent,
        PAGE_SIZE=pool.page_size,
        PAGE_BYTES=pool.layout.bytes_per_page if latent else 0,
        SCALE_BYTES=config.record_scale_bytes if latent else 8,
        INDEXER_FP8=bool(config.indexer_fp8),
        EXACT_FP8=exact_fp8,
        INV_SQRT_HEAD=inv_sqrt(config.head_dim),
    )


def entry_outputs(pool):
    """``(out, fp8_pages)`` tensors a finish_entry kernel writes to (the second may be a dummy)."""
    if pool.config.output == "latent":
        return pool.pages, pool.pages
    return pool.keys, pool.fp8_pages if pool.fp8_pages is not None else pool.keys


@triton.jit
def _pack_values_kernel(
    values_ptr,
    slots_ptr,
    out_ptr,
    fp8_pages_ptr,
    HEAD: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    LATENT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    INDEXER_FP8: tl.constexpr,
    EXACT_FP8: tl.constexpr,
    INV_SQRT_HEAD: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    nope, even, odd, m_nope, m_half = split_offsets(HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF)
    base = values_ptr + row.to(tl.int64) * HEAD
    n_nope = tl.load(base + nope, mask=m_nope, other=0.0)
    n_even = tl.load(base + even, mask=m_half, other=0.0)
    n_odd = tl.load(base + odd, mask=m_half, other=0.0)
    store_entry(
        n_nope, n_even, n_odd, slot, out_ptr, fp8_pages_ptr, HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF, LATENT,
        PAGE_SIZE, PAGE_BYTES, SCALE_BYTES, INDEXER_FP8, EXACT_FP8, INV_SQRT_HEAD,
    )  # fmt: skip


def pack_values(values, slots, pool, exact_fp8=None) -> None:
    """Encode precomputed entry values (float32 ``[N, H]``, already normalized and rotated) into ``pool`` at
    global ``slots`` with the kernels' encoder: checks the kernels' bytes against :mod:`..layout` alone."""
    from .numerics import exact_fp8_default

    if values.dim() != 2 or values.shape[1] != pool.config.head_dim or slots.shape != (values.shape[0],):
        raise ValueError(
            f"pack_values: values must be [N, {pool.config.head_dim}] with N slots, got {list(values.shape)} "
            f"and slots {list(slots.shape)}"
        )
    if values.shape[0] == 0:
        return
    exact = exact_fp8_default(values.device) if exact_fp8 is None else exact_fp8
    out, fp8 = entry_outputs(pool)
    _pack_values_kernel[(values.shape[0],)](
        values.float().contiguous(), slots.to(torch.int32), out, fp8, **entry_meta(pool.config, pool, exact)
    )
