"""Finishing one entry from its pooled vector: RMSNorm, rope at the group start, and the stored encoding.

Shared ``@triton.jit`` helpers; every compress kernel ends in :func:`finish_entry`. What travels together is
grouped in three named tuples, built once per launch by :func:`entry_args`:

* ``EntryMeta`` (constexpr): sizes and switches (head and rope dims, the register block ``BLOCK_HEAD``, latent
  or indexer output, page size, FP8 rounding mode, the latent record layout ``LAYOUT``: :data:`LAYOUTS`);
* ``EntryParams``: the norm weight, the cos / sin tables with their strides (engines pass strided views of a
  complex table), ``eps``;
* ``EntryOut``: the output pages and their page stride (taken from the tensor), the indexer's bf16 keys, and
  how many output slots there are (an entry for a slot beyond them is not written).

The pooled vector arrives whole, in channel order (``BLOCK_HEAD`` lanes, zeros past ``H``): kernels pool one
tile of contiguous channels, and the rope pairs ``(x, y) = (dim 2m, dim 2m + 1)`` are taken apart after the
norm by a reshape. Holding three parts instead (nope / rope x / rope y, which spares the reshape) was slower
everywhere: three reductions per window, strided loads, padding lanes (H200, docs/runs/tune_858b68c).
"""

import math
from collections import namedtuple

import torch
import triton
import triton.language as tl

from .indexer_pack import PACK_VARIANTS, pack_indexer_key, sglang_norm_rope
from .numerics import bf16_bits, bf16_rne, e4m3_byte, pow2, ue8m0_exponent, v41_exponent

EntryMeta = namedtuple(
    "EntryMeta",
    "HEAD ROPE BLOCK_HEAD LATENT PAGE_SIZE SCALE_BYTES INDEXER_PACK KEYS EXACT_FP8 INV_SQRT_HEAD LAYOUT",
)
#: ``layout=`` name -> ``EntryMeta.LAYOUT``, SGLang's ``KVLayout`` numbers (``kv_layout.cuh``); the records are
#: those of :func:`dsv4_compressor.layout.encode_latent`.
LAYOUTS = {"v4": 0, "v41": 1, "uniform_fp8": 3, "v41_new": 4}
EntryParams = namedtuple("EntryParams", "norm_w norm_stride cos cos_row cos_col sin sin_row sin_col eps")
EntryOut = namedtuple("EntryOut", "pages page_stride keys key_stride slots")


@triton.jit
def finish_inputs(prm, start_pos, E: tl.constexpr):
    """What finishing an entry reads: the norm weight (``BLOCK_HEAD`` values) and, per channel pair ``m``
    (dims ``2m, 2m + 1``), ``cos / sin[start_pos, m - (H - R) / 2]`` for the rope pairs, 1 / 0 for the others.
    Kernels may load these early so that the finish does not wait for memory."""
    NOPE: tl.constexpr = E.HEAD - E.ROPE
    ch = tl.arange(0, E.BLOCK_HEAD)
    w = tl.load(prm.norm_w + ch * prm.norm_stride, mask=ch < E.HEAD, other=0.0).to(tl.float32)
    k = tl.arange(0, E.BLOCK_HEAD // 2) - NOPE // 2
    is_rope = (k >= 0) & (k < E.ROPE // 2)
    p = start_pos.to(tl.int64)
    cos = tl.load(prm.cos + p * prm.cos_row + k * prm.cos_col, mask=is_rope, other=1.0)
    sin = tl.load(prm.sin + p * prm.sin_row + k * prm.sin_col, mask=is_rope, other=0.0)
    return w, cos, sin


@triton.jit
def norm_rope(c, w, cos, sin, eps, E: tl.constexpr):
    """``n = c * rsqrt(mean(c^2) + eps) * w``, then the rope pairs ``(x, y) = (dim 2m, dim 2m + 1)``,
    ``2m >= H - R``, rotated by ``(cos[m], sin[m])`` (:func:`finish_inputs`); the other pairs left as they are."""
    NOPE: tl.constexpr = E.HEAD - E.ROPE
    sumsq = tl.sum(c * c, axis=0)
    # IEEE division and square root keep this within an ulp of the PyTorch reference. The mean of a power-of-two
    # head is a product by its exact reciprocal: the same correctly rounded quotient, without a division.
    if (E.HEAD & (E.HEAD - 1)) == 0:
        mean = sumsq * (1.0 / E.HEAD)
    else:
        mean = tl.math.div_rn(sumsq, E.HEAD * 1.0)
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))
    n = c * inv_rms * w
    x, y = tl.split(tl.reshape(n, (E.BLOCK_HEAD // 2, 2)))
    k = tl.arange(0, E.BLOCK_HEAD // 2) - NOPE // 2
    is_rope = (k >= 0) & (k < E.ROPE // 2)
    x_rot = tl.where(is_rope, x * cos - y * sin, x)
    y_rot = tl.where(is_rope, y * cos + x * sin, y)
    return tl.reshape(tl.join(x_rot, y_rot), (E.BLOCK_HEAD,))


@triton.jit
def norm_rope_sglang_triton(c, w, cos, sin, eps, E: tl.constexpr):
    """RMSNorm and rope as SGLang's Triton ``_fused_norm_rope_kernel`` (``kernels/ops/attention/dsv4/rope.py``,
    ``fused_norm_rope_inplace_triton``: the trtllm backend's compressor store) computes them, written with the same
    Triton operations in the same order, so that the compiler makes the same instructions of both:
    ``inv = tl.rsqrt(sum(c * c) / H + eps)`` (the hardware ``rsqrt.approx.f32`` on the GPU, ``1 / sqrt`` under
    the interpreter), ``n = c * inv * w``, and each rope pair ``(x, y)`` becomes ``(x * cos - y * sin,
    x * sin + y * cos)``. Only the order of the sum of squares' additions may differ on the GPU: Triton reduces
    in the register layout it picks for each kernel."""
    NOPE: tl.constexpr = E.HEAD - E.ROPE
    inv = tl.rsqrt(tl.sum(c * c, axis=0) / E.HEAD + eps)
    n = c * inv * w
    x, y = tl.split(tl.reshape(n, (E.BLOCK_HEAD // 2, 2)))
    k = tl.arange(0, E.BLOCK_HEAD // 2) - NOPE // 2
    is_rope = (k >= 0) & (k < E.ROPE // 2)
    x_rot = tl.where(is_rope, x * cos - y * sin, x)
    y_rot = tl.where(is_rope, x * sin + y * cos, y)
    return tl.reshape(tl.join(x_rot, y_rot), (E.BLOCK_HEAD,))


@triton.jit
def pack_latent(n, slot, out, E: tl.constexpr):
    """Write the FlashMLA fp8-sparse record of one entry (channel order) into global slot ``slot``:
    ``[nope e4m3fn | rope bf16]`` in the page's data area, ``[UE8M0 x blocks | zero pad]`` in its scale area."""
    NOPE: tl.constexpr = E.HEAD - E.ROPE
    DATA: tl.constexpr = NOPE + 2 * E.ROPE
    NB: tl.constexpr = E.BLOCK_HEAD // 64
    slot = slot.to(tl.int64)
    page_base = out.pages + (slot // E.PAGE_SIZE) * out.page_stride
    t = slot % E.PAGE_SIZE
    data_ptr = page_base + t * DATA
    scale_ptr = page_base + E.PAGE_SIZE * DATA + t * E.SCALE_BYTES
    ch = tl.arange(0, E.BLOCK_HEAD)

    # nope: bf16 rounding, then one power-of-two scale per 64 values (the rope dims zeroed out of the blocks)
    blocks = tl.reshape(tl.where(ch < NOPE, bf16_rne(n), 0.0), (NB, 64))
    e = ue8m0_exponent(tl.max(tl.abs(blocks), axis=1))
    scaled = blocks * pow2(-e)[:, None]  # exact
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    q = e4m3_byte(scaled, E.EXACT_FP8)
    col = tl.arange(0, NB)[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(data_ptr + col, q, mask=col < NOPE)

    # rope dims as bf16, little-endian, in channel order: the (x, y) pairs interleaved
    rope_ptr = (data_ptr + NOPE).to(tl.pointer_type(tl.int16))
    tl.store(rope_ptr + (ch - NOPE), bf16_bits(n), mask=(ch >= NOPE) & (ch < E.HEAD))

    # scales: e + 127 per block, zero bytes after the last block.
    b = tl.arange(0, NB)
    tl.store(scale_ptr + b, (e + 127).to(tl.uint8), mask=b < NOPE // 64)
    pad = tl.arange(0, E.SCALE_BYTES)
    tl.store(scale_ptr + pad, (pad * 0).to(tl.uint8), mask=pad >= NOPE // 64)


@triton.jit
def pack_latent_v41(n, slot, out, E: tl.constexpr):
    """Write the V4.1 record of one entry (``LAYOUT`` 1, block-split pages ``[P x H][P x H / 32]``; 4,
    interleaved, each record's ``H`` data bytes then its ``H / 32`` scales) or its uniform FP8 values (3,
    ``[P x H]``: ``e4m3(clamp(x, +-448))``, the saturating cast of SGLang's pool) into global slot ``slot``. V4.1: every dim of the float32 values, one UE8M0 exponent ``e =
    max(ceil(log2(amax / 448)), -13)`` per 32 (the floor after the quotient), ``x / 2^e`` as e4m3fn."""
    slot = slot.to(tl.int64)
    page_base = out.pages + (slot // E.PAGE_SIZE) * out.page_stride
    t = slot % E.PAGE_SIZE
    ch = tl.arange(0, E.BLOCK_HEAD)
    if E.LAYOUT == 3:
        q = e4m3_byte(tl.minimum(tl.maximum(n, -448.0), 448.0), E.EXACT_FP8)
        tl.store(page_base + t * E.HEAD + ch, q, mask=ch < E.HEAD)
    else:
        NB: tl.constexpr = E.BLOCK_HEAD // 32
        NS: tl.constexpr = E.HEAD // 32
        if E.LAYOUT == 4:
            data_ptr = page_base + t * (E.HEAD + NS)
            scale_ptr = data_ptr + E.HEAD
        else:
            data_ptr = page_base + t * E.HEAD
            scale_ptr = page_base + E.PAGE_SIZE * E.HEAD + t * NS
        blocks = tl.reshape(tl.where(ch < E.HEAD, n, 0.0), (NB, 32))
        e = v41_exponent(tl.max(tl.abs(blocks), axis=1))
        scaled = blocks * pow2(-e)[:, None]  # exact; |x / 2^e| <= 448
        q = e4m3_byte(tl.minimum(tl.maximum(scaled, -448.0), 448.0), E.EXACT_FP8)
        col = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(data_ptr + col, q, mask=col < E.HEAD)
        b = tl.arange(0, NB)
        tl.store(scale_ptr + b, (e + 127).to(tl.uint8), mask=b < NS)


@triton.jit
def store_entry(n, slot, out, E: tl.constexpr):
    """Store a finished entry (normalized, rotated, channel order) at global slot ``slot``: the latent record
    (``LATENT``), the values (``KEYS``: 1 bf16, the indexer's keys; 2 float32, unquantized entries), the
    indexer's FP8 pack (``INDEXER_PACK``, a variant of :mod:`.indexer_pack`; 0: none)."""
    if slot < out.slots:
        ch = tl.arange(0, E.BLOCK_HEAD)
        m = ch < E.HEAD
        row = slot.to(tl.int64) * out.key_stride
        if E.LATENT:
            if E.LAYOUT == 0:
                pack_latent(n, slot, out, E)
            else:
                pack_latent_v41(n, slot, out, E)
        if E.KEYS == 1:
            tl.store(out.keys.to(tl.pointer_type(tl.int16)) + row + ch, bf16_bits(n), mask=m)
        elif E.KEYS == 2:
            tl.store(out.keys.to(tl.pointer_type(tl.float32)) + row + ch, n, mask=m)
        if E.INDEXER_PACK != 0:
            pack_indexer_key(
                n, ch, m, slot, out.pages, out.page_stride, E.INDEXER_PACK, E.HEAD, E.PAGE_SIZE, E.EXACT_FP8,
                E.INV_SQRT_HEAD,
            )  # fmt: skip


@triton.jit
def finish_entry_with(c, slot, w, cos, sin, prm, out, E: tl.constexpr):
    """Pooled vector -> RMSNorm -> rope -> stored entry, with the inputs of :func:`finish_inputs` given. SGLang's
    128-channel indexer pack (``hadamard_f32``) takes SGLang's own norm and rope (its operation order); so do the
    uniform FP8 records (``LAYOUT`` 3: SGLang's Triton norm and rope, :func:`norm_rope_sglang_triton`)."""
    if E.LATENT and E.LAYOUT == 3:
        n = norm_rope_sglang_triton(c, w, cos, sin, prm.eps, E)
    elif E.INDEXER_PACK == 3 and E.HEAD == 128 and E.BLOCK_HEAD == 128 and not E.LATENT:
        n = sglang_norm_rope(c, w, cos, sin, prm.eps, E.HEAD, E.ROPE)
    else:
        n = norm_rope(c, w, cos, sin, prm.eps, E)
    store_entry(n, slot, out, E)


@triton.jit
def finish_entry(c, slot, start_pos, prm, out, E: tl.constexpr):
    """Pooled vector (``BLOCK_HEAD`` values in channel order, zeros past ``H``) -> RMSNorm -> rope (at
    ``start_pos``) -> stored entry at global slot ``slot``."""
    w, cos, sin = finish_inputs(prm, start_pos, E)
    finish_entry_with(c, slot, w, cos, sin, prm, out, E)


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------
def inv_sqrt(head: int) -> float:
    """``head ** -0.5`` as the Python float the reference multiplies by (rounded to float32 in the kernel)."""
    return 1.0 / math.sqrt(head)


def entry_args(
    *,
    head: int,
    rope: int,
    latent: bool,
    page_size: int,
    scale_bytes: int,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    out_pages: torch.Tensor | None,
    out_keys: torch.Tensor | None,
    exact_fp8: bool,
    indexer_pack: str = "hadamard",
    layout: str = "v4",
):
    """``(EntryParams, EntryOut, EntryMeta)`` of a launch. ``latent``: the kind's records are latent (written
    when ``out_pages`` is given, in ``layout``, a key of :data:`LAYOUTS`); ``out_keys`` (bf16 or float32
    ``[slots, H]``) receives the values. Missing outputs are replaced by a tensor that is never written (its
    switch is off)."""
    dummy = out_pages if out_pages is not None else out_keys
    meta = EntryMeta(
        HEAD=head,
        ROPE=rope,
        BLOCK_HEAD=max(64, triton.next_power_of_2(head)),
        LATENT=latent and out_pages is not None,
        PAGE_SIZE=page_size,
        SCALE_BYTES=scale_bytes,
        INDEXER_PACK=PACK_VARIANTS[indexer_pack] if (not latent and out_pages is not None) else 0,
        KEYS=0 if out_keys is None else (1 if out_keys.dtype == torch.bfloat16 else 2),
        EXACT_FP8=exact_fp8,
        INV_SQRT_HEAD=inv_sqrt(head),
        LAYOUT=LAYOUTS[layout],
    )
    prm = EntryParams(
        norm_weight, norm_weight.stride(0), cos, cos.stride(0), cos.stride(1), sin, sin.stride(0), sin.stride(1),
        float(eps),
    )  # fmt: skip
    pages = out_pages if out_pages is not None else dummy
    keys = out_keys if out_keys is not None else dummy
    slots = []
    if out_pages is not None:
        slots.append(out_pages.shape[0] * page_size)
    if out_keys is not None:
        slots.append(out_keys.shape[0])
    out = EntryOut(pages, pages.stride(0), keys, keys.stride(0), min(slots))
    return prm, out, meta


@triton.jit
def _pack_values_kernel(values_ptr, slots_ptr, out, E: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    ch = tl.arange(0, E.BLOCK_HEAD)
    n = tl.load(values_ptr + row.to(tl.int64) * E.HEAD + ch, mask=ch < E.HEAD, other=0.0)
    store_entry(n, slot, out, E)


def pack_values(values: torch.Tensor, slots: torch.Tensor, out: EntryOut, meta: EntryMeta) -> None:
    """Encode finished entry values (float32 ``[N, H]``, normalized and rotated) at global ``slots`` (int32,
    ``-1`` skipped) with the kernels' encoder: checks the kernels' bytes against :mod:`..layout` alone."""
    if values.shape[0]:
        _pack_values_kernel[(values.shape[0],)](values.float().contiguous(), slots.to(torch.int32), out, meta)


@triton.jit
def _finish_values_kernel(pooled_ptr, start_ptr, slots_ptr, prm, out, E: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    ch = tl.arange(0, E.BLOCK_HEAD)
    c = tl.load(pooled_ptr + row.to(tl.int64) * E.HEAD + ch, mask=ch < E.HEAD, other=0.0)
    finish_entry(c, slot, tl.load(start_ptr + row), prm, out, E)


def finish_values(pooled: torch.Tensor, start_pos: torch.Tensor, slots: torch.Tensor, prm: EntryParams,
                  out: EntryOut, meta: EntryMeta) -> None:  # fmt: skip
    """Finish pooled vectors (float32 ``[N, H]``, before RMSNorm) whose groups start at ``start_pos`` (int32
    ``[N]``) into global ``slots`` (int32, ``-1`` skipped) with the kernels' own :func:`finish_entry`: the norm,
    rope and pack of every compress kernel, from the point where an engine's finishing kernel starts."""
    if pooled.shape[0]:
        _finish_values_kernel[(pooled.shape[0],)](
            pooled.float().contiguous(), start_pos.to(torch.int32), slots.to(torch.int32), prm, out, meta
        )  # fmt: skip


__all__ = [
    "LAYOUTS",
    "finish_values",
    "EntryMeta",
    "EntryParams",
    "EntryOut",
    "entry_args",
    "finish_inputs",
    "finish_entry",
    "finish_entry_with",
    "store_entry",
    "pack_latent_v41",
    "norm_rope_sglang_triton",
    "pack_values",
    "inv_sqrt",
]
