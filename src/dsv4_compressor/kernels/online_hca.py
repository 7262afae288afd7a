"""Online-softmax HCA compressor: one launch per step, no ring, no scratch.

The softmax is per channel, so the partial group of a request is a running state per channel: the running
max ``m`` of the gate logits, the running sum ``s`` of ``exp(x - m)`` and the running weighted sum
``a`` of ``exp(x - m) * kv``; the pooled value of a finished group is ``a / s``.

State (per request): ``B = mtp_step + 1`` banks of ``(m, s, a)``, float32 ``[B, 3, H]``. Bank ``l % B`` holds
the state after the first ``l`` positions (the positions ``l - l % r .. l - 1`` of the partial group), for
the last ``B`` lengths ``l``, so a step may restart at any of them (an MTP rewind of up to ``mtp_step``). A
length that is a multiple of ``r`` needs no bank (empty state).

Grid ``R + T // r + R`` (shapes only), two roles read from the step plan (:mod:`.plan`):

* programs ``[0, R)``, one per request: the "request program". It loads the state at ``start``, absorbs the
  head segment if it carries state, then the *tail*: the groups holding the last ``mtp_step + 1`` rows,
  one row at a time, banking the state after each. All bank reads and writes of a request happen in this one
  program, in order, so no bank is overwritten before it is read. Groups that close on the way are finished
  in-program (RMSNorm, rope, FP8 pack, page write).
* the other programs walk the step's group-closing rows; a group that starts fresh inside the step, closes in
  it and banks nothing (every full group of a long prefill chunk, save a tail group that must bank) is an
  "interior" group: its program pools the ``r`` rows from a fresh state and finishes the entry, in parallel
  with the rest. The others exit at once. Spans of rows are absorbed as channel-major register tiles.

A decode / verify step (``DECODE``: every request brings at most ``mtp_step + 1`` rows) launches the request
programs only, specialised: the state and all rows are requested in one round, then absorbed row by row
from registers. Channels are held in three parts (nope, rope x, rope y) exactly as
:func:`~.entry_pack.finish_entry` wants them.
"""

import functools

import torch
import triton
import triton.language as tl

from .entry_pack import (
    finish_entry,
    finish_entry_natural_with,
    finish_entry_with,
    finish_inputs,
    finish_inputs_natural,
    rope_row,
    split_offsets,
)
from .pdl import launch_options, wait_then_release
from .plan import REC, closing_record, request_record, row_out_slot_ptr
from .ring import ape_bias


@triton.jit
def _absorb_row(m, s, a, kv, x):
    """Add one row (values ``kv``, gate logits ``x``) to the running state of each channel."""
    m_new = tl.maximum(m, x)
    alpha = tl.exp(m - m_new)
    e = tl.exp(x - m_new)
    return m_new, s * alpha + e, a * alpha + e * kv


@triton.jit
def _absorb_tile_cm(m, s, a, kv, x):
    """Add a channel-major tile of rows ``[C, BLOCK_T]`` (absent rows carry ``x = -inf``; at least one row
    present). Each thread holds every row of its channels, so the reductions over rows stay inside threads:
    no shared memory, no barrier (a row-major tile measured 1.3x slower on an 8K prefill, H200)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    alpha = tl.exp(m - m_new)
    e = tl.exp(x - m_new[:, None])
    return m_new, s * alpha + tl.sum(e, axis=1), a * alpha + tl.sum(e * kv, axis=1)


@triton.jit
def _row_part(kv, ape, p, start, row0, idx, mask, RATIO: tl.constexpr, HEAD: tl.constexpr):
    """Values and gated logits of position ``p`` (a row of this step) for channels ``idx``."""
    row = kv.ptr + (row0 + p - start).to(tl.int64) * kv.row_stride
    v = tl.load(row + idx, mask=mask, other=0.0)
    x = tl.load(row + HEAD + idx, mask=mask, other=0.0)
    x += ape_bias(ape, p, 0, idx, mask, RATIO)
    return v, x


@triton.jit
def _tile_part(kv, ape, p, ok, start, row0, idx, mask, RATIO: tl.constexpr, HEAD: tl.constexpr):
    """Values and gated logits of positions ``p`` (``[BLOCK_T]``, rows where ``ok``) for channels ``idx``."""
    rows = kv.ptr + (row0 + p - start).to(tl.int64) * kv.row_stride
    m2 = ok[:, None] & mask[None, :]
    v = tl.load(rows[:, None] + idx[None, :], mask=m2, other=0.0)
    x = tl.load(rows[:, None] + HEAD + idx[None, :], mask=m2, other=0.0)
    x += ape_bias(ape, p[:, None], 0, idx[None, :], m2, RATIO)
    return v, tl.where(ok[:, None], x, float("-inf"))


@triton.jit
def _bank_ptr(state_ptr, slot, length, BANKS: tl.constexpr, HEAD: tl.constexpr):
    return state_ptr + (slot.to(tl.int64) * BANKS + length % BANKS) * (3 * HEAD)


@triton.jit
def _load_bank(ptr, idx, mask, HEAD: tl.constexpr):
    m = tl.load(ptr + idx, mask=mask, other=0.0)
    s = tl.load(ptr + HEAD + idx, mask=mask, other=0.0)
    a = tl.load(ptr + 2 * HEAD + idx, mask=mask, other=0.0)
    return m, s, a


@triton.jit
def _store_bank(ptr, idx, mask, m, s, a, HEAD: tl.constexpr):
    tl.store(ptr + idx, m, mask=mask)
    tl.store(ptr + HEAD + idx, s, mask=mask)
    tl.store(ptr + 2 * HEAD + idx, a, mask=mask)


@triton.jit
def _span_tile(kv, ape, p0, hi, start, row0, nope, even, odd, m_nope, m_half, RATIO: tl.constexpr,
               HEAD: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """The channel-major tiles (values, gated logits; three parts) of positions ``[p0, p0 + BLOCK_T)`` below
    ``hi``; rows at or past ``hi`` are not read and carry ``x = -inf``."""
    p = p0 + tl.arange(0, BLOCK_T)
    ok = p < hi
    vn, xn = _tile_part_cm(kv, ape, p, ok, start, row0, nope, m_nope, RATIO, HEAD)
    ve, xe = _tile_part_cm(kv, ape, p, ok, start, row0, even, m_half, RATIO, HEAD)
    vo, xo = _tile_part_cm(kv, ape, p, ok, start, row0, odd, m_half, RATIO, HEAD)
    absent = ok[None, :] == 0
    return (vn, tl.where(absent, float("-inf"), xn), ve, tl.where(absent, float("-inf"), xe), vo,
            tl.where(absent, float("-inf"), xo))  # fmt: skip


@triton.jit
def _absorb_span(
    lo, hi, mn, sn, an, me, se, ae, mo, so, ao, kv, ape, start, row0, nope, even, odd, m_nope, m_half,
    RATIO: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """Absorb positions ``[lo, hi)`` tile by tile (channel-major) into the state (m, s, a) of the three parts.
    ``PREFETCH``: the next tile's loads are issued before the current tile is absorbed (its registers carried
    through the loop), so a program always has a tile in flight; a lone program per SM (a short chunk's few
    groups) is otherwise bound by one memory round trip per tile."""
    if PREFETCH:
        vn, xn, ve, xe, vo, xo = _span_tile(
            kv, ape, lo, hi, start, row0, nope, even, odd, m_nope, m_half, RATIO, HEAD, BLOCK_T
        )  # fmt: skip
        for p0 in range(lo, hi, BLOCK_T):
            # the next tile (rows at or past hi are masked: the last prefetch reads nothing)
            wn, yn, we, ye, wo, yo = _span_tile(
                kv, ape, p0 + BLOCK_T, hi, start, row0, nope, even, odd, m_nope, m_half, RATIO, HEAD, BLOCK_T
            )  # fmt: skip
            mn, sn, an = _absorb_tile_cm(mn, sn, an, vn, xn)
            me, se, ae = _absorb_tile_cm(me, se, ae, ve, xe)
            mo, so, ao = _absorb_tile_cm(mo, so, ao, vo, xo)
            vn, xn, ve, xe, vo, xo = wn, yn, we, ye, wo, yo
    else:
        for p0 in range(lo, hi, BLOCK_T):
            vn, xn, ve, xe, vo, xo = _span_tile(
                kv, ape, p0, hi, start, row0, nope, even, odd, m_nope, m_half, RATIO, HEAD, BLOCK_T
            )  # fmt: skip
            mn, sn, an = _absorb_tile_cm(mn, sn, an, vn, xn)
            me, se, ae = _absorb_tile_cm(me, se, ae, ve, xe)
            mo, so, ao = _absorb_tile_cm(mo, so, ao, vo, xo)
    return mn, sn, an, me, se, ae, mo, so, ao


@triton.jit
def _fresh(BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr):
    neg_n = tl.full([BLOCK_NOPE], float("-inf"), tl.float32)
    zero_n = tl.zeros([BLOCK_NOPE], tl.float32)
    neg_h = tl.full([BLOCK_HALF], float("-inf"), tl.float32)
    zero_h = tl.zeros([BLOCK_HALF], tl.float32)
    return neg_n, zero_n, zero_n, neg_h, zero_h, zero_h, neg_h, zero_h, zero_h


@triton.jit
def _is_interior(g, start, end, banked_from, RATIO: tl.constexpr):
    """Group ``g`` starts fresh inside the step, closes in it and banks no state: any program can pool it."""
    return (g * RATIO >= start) & (g * RATIO + RATIO <= end) & (banked_from >= g * RATIO + RATIO - 1)


@triton.jit
def _tile_part_cm(kv, ape, p, ok, start, row0, idx, mask, RATIO: tl.constexpr, HEAD: tl.constexpr):
    """Like :func:`_tile_part` but channel-major ``[C, BLOCK_S]``: a thread holds every row of its channels,
    so picking a row is an in-thread reduction."""
    rows = kv.ptr + (row0 + p - start).to(tl.int64) * kv.row_stride
    m2 = ok[None, :] & mask[:, None]
    v = tl.load(rows[None, :] + idx[:, None], mask=m2, other=0.0)
    x = tl.load(rows[None, :] + HEAD + idx[:, None], mask=m2, other=0.0)
    x += ape_bias(ape, p[None, :], 0, idx[:, None], m2, RATIO)
    return v, x


@triton.jit
def _pick_cm(tile, j, rows):
    return tl.sum(tl.where(rows[None, :] == j, tile, 0.0), axis=1)


@triton.jit
def _pick(tile, j, rows):
    """Row ``j`` of a register tile ``[BLOCK_S, C]`` (a masked sum: registers cannot be indexed)."""
    return tl.sum(tl.where(rows[:, None] == j, tile, 0.0), axis=0)


@triton.jit
def _live(mask, idx, p, end):
    """``mask`` where position ``p`` exists in the step (the scalar test is broadcast first: the interpreter
    mistypes ``bool tensor & scalar``)."""
    return mask & ((idx * 0 + p) < end)


@triton.jit
def _decode_row(
    J: tl.constexpr, p, end, slot, first_out, outs_ptr, kv_n, x_n, kv_e, x_e, kv_o, x_o,
    mn, sn, an, me, se, ae, mo, so, ao,
    first_close, w_nope, w_even, w_odd, cos0, sin0, state_ptr, prm, out, nope, even, odd, m_nope, m_half,
    E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr,
):  # fmt: skip
    """Row ``J`` of a decode step (position ``p``): absorb it, then bank the state or finish the group (the first
    group the request closes goes to ``first_out``, from the request record; a later one, possible only when
    ``r < mtp_step + 1``, reads its slot from the plan's row records at ``outs_ptr``)."""
    if p < end:
        if (J > 0) & (p % RATIO == 0):  # a new group begins inside the step
            mn, sn, an, me, se, ae, mo, so, ao = _fresh(E.BLOCK_NOPE, E.BLOCK_HALF)
        mn, sn, an = _absorb_row(mn, sn, an, kv_n, x_n)
        me, se, ae = _absorb_row(me, se, ae, kv_e, x_e)
        mo, so, ao = _absorb_row(mo, so, ao, kv_o, x_o)
        if (p + 1) % RATIO != 0:
            bank = _bank_ptr(state_ptr, slot, p + 1, BANKS, E.HEAD)
            _store_bank(bank, nope, m_nope, mn, sn, an, E.HEAD)
            _store_bank(bank, even, m_half, me, se, ae, E.HEAD)
            _store_bank(bank, odd, m_half, mo, so, ao, E.HEAD)
        else:
            cos = cos0
            sin = sin0
            slot_out = first_out
            if p != first_close:  # a second group closed in one step (ratio < mtp_step + 1)
                slot_out = tl.load(outs_ptr + REC * J)
                cos, sin = rope_row(prm, p + 1 - RATIO, E)
            if slot_out >= 0:
                finish_entry_with(an / sn, ae / se, ao / so, slot_out, w_nope, w_even, w_odd, cos, sin, prm, out, E)
    return mn, sn, an, me, se, ae, mo, so, ao


@triton.jit
def _fresh_natural(BLOCK: tl.constexpr):
    return tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)


@triton.jit
def _decode_row_natural(
    J: tl.constexpr, p, end, slot, first_out, outs_ptr, v, x, m, s, a, first_close, w, cos0, sin0, state_ptr, prm,
    out, ch, m_ch, E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr,
):  # fmt: skip
    """:func:`_decode_row` with the channels whole, in channel order (``BLOCK_HEAD`` values)."""
    if p < end:
        if (J > 0) & (p % RATIO == 0):  # a new group begins inside the step
            m, s, a = _fresh_natural(E.BLOCK_HEAD)
        m, s, a = _absorb_row(m, s, a, v, x)
        if (p + 1) % RATIO != 0:
            _store_bank(_bank_ptr(state_ptr, slot, p + 1, BANKS, E.HEAD), ch, m_ch, m, s, a, E.HEAD)
        else:
            cos = cos0
            sin = sin0
            slot_out = first_out
            if p != first_close:  # a second group closed in one step (ratio < mtp_step + 1)
                slot_out = tl.load(outs_ptr + REC * J)
                w, cos, sin = finish_inputs_natural(prm, p + 1 - RATIO, E)
            if slot_out >= 0:
                finish_entry_natural_with(tl.where(m_ch, a / s, 0.0), slot_out, w, cos, sin, prm, out, E)
    return m, s, a


@triton.jit
def _request_decode_natural(
    kv, ape, plan, state_ptr, prm, out, slot, start, row0, end, first_out,
    E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """:func:`_request_decode` for ``mtp_step <= 3`` with the channels whole, in channel order: one contiguous
    load per row and per bank field, one state per channel, the entry finished in channel order."""
    HEAD: tl.constexpr = E.HEAD
    ch = tl.arange(0, E.BLOCK_HEAD)
    m_ch = ch < HEAD
    m, s, a = _fresh_natural(E.BLOCK_HEAD)
    if start % RATIO != 0:
        m, s, a = _load_bank(_bank_ptr(state_ptr, slot, start, BANKS, HEAD), ch, m_ch, HEAD)
    # what finishing the first group this step closes reads, requested now so the finish does not wait
    first_close = start + (RATIO - 1 - start % RATIO)
    w, cos0, sin0 = finish_inputs_natural(prm, first_close + 1 - RATIO, E)
    outs_ptr = row_out_slot_ptr(plan, row0)  # out_slot of this request's rows, REC ints apart
    # every row in its own registers, all loads issued before any arithmetic
    v0, x0 = _row_part(kv, ape, start, start, row0, ch, _live(m_ch, ch, start, end), RATIO, HEAD)
    if BLOCK_S > 1:
        v1, x1 = _row_part(kv, ape, start + 1, start, row0, ch, _live(m_ch, ch, start + 1, end), RATIO, HEAD)
    if BLOCK_S > 2:
        v2, x2 = _row_part(kv, ape, start + 2, start, row0, ch, _live(m_ch, ch, start + 2, end), RATIO, HEAD)
        v3, x3 = _row_part(kv, ape, start + 3, start, row0, ch, _live(m_ch, ch, start + 3, end), RATIO, HEAD)
    m, s, a = _decode_row_natural(
        0, start, end, slot, first_out, outs_ptr, v0, x0, m, s, a, first_close, w, cos0, sin0, state_ptr, prm, out,
        ch, m_ch, E, RATIO, BANKS,
    )  # fmt: skip
    if BLOCK_S > 1:
        m, s, a = _decode_row_natural(
            1, start + 1, end, slot, first_out, outs_ptr, v1, x1, m, s, a, first_close, w, cos0, sin0, state_ptr,
            prm, out, ch, m_ch, E, RATIO, BANKS,
        )  # fmt: skip
    if BLOCK_S > 2:
        m, s, a = _decode_row_natural(
            2, start + 2, end, slot, first_out, outs_ptr, v2, x2, m, s, a, first_close, w, cos0, sin0, state_ptr,
            prm, out, ch, m_ch, E, RATIO, BANKS,
        )  # fmt: skip
        m, s, a = _decode_row_natural(
            3, start + 3, end, slot, first_out, outs_ptr, v3, x3, m, s, a, first_close, w, cos0, sin0, state_ptr,
            prm, out, ch, m_ch, E, RATIO, BANKS,
        )  # fmt: skip


@triton.jit
def _request_decode(
    kv, ape, plan, state_ptr, prm, out, slot, start, row0, end, first_out, nope, even, odd, m_nope, m_half,
    E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr, BLOCK_S: tl.constexpr, CHANNEL_MAJOR: tl.constexpr,
):  # fmt: skip
    """A request bringing at most ``mtp_step + 1`` rows (decode / verify): every row is banked. One load
    round (state + rows), then one unrolled pass over the rows: absorb, bank, finish a closed group."""
    HEAD: tl.constexpr = E.HEAD
    mn, sn, an, me, se, ae, mo, so, ao = _fresh(E.BLOCK_NOPE, E.BLOCK_HALF)
    if start % RATIO != 0:
        bank = _bank_ptr(state_ptr, slot, start, BANKS, HEAD)
        mn, sn, an = _load_bank(bank, nope, m_nope, HEAD)
        me, se, ae = _load_bank(bank, even, m_half, HEAD)
        mo, so, ao = _load_bank(bank, odd, m_half, HEAD)
    # what finishing the first group this step closes reads, requested now so the finish does not wait
    first_close = start + (RATIO - 1 - start % RATIO)
    w_nope, w_even, w_odd, cos0, sin0 = finish_inputs(prm, first_close + 1 - RATIO, E)
    outs_ptr = row_out_slot_ptr(plan, row0)  # out_slot of this request's rows, REC ints apart
    if BLOCK_S <= 4:
        # mtp_step <= 3 (DeepSeek-V4 runs 3): every row in its own registers, all loads issued before any
        # arithmetic, then the rows unrolled by hand; no cross-thread reductions to pick a row out of a tile.
        kv0n, x0n = _row_part(kv, ape, start, start, row0, nope, _live(m_nope, nope, start, end), RATIO, HEAD)
        kv0e, x0e = _row_part(kv, ape, start, start, row0, even, _live(m_half, even, start, end), RATIO, HEAD)
        kv0o, x0o = _row_part(kv, ape, start, start, row0, odd, _live(m_half, odd, start, end), RATIO, HEAD)
        if BLOCK_S > 1:
            p1 = start + 1
            kv1n, x1n = _row_part(kv, ape, p1, start, row0, nope, _live(m_nope, nope, p1, end), RATIO, HEAD)
            kv1e, x1e = _row_part(kv, ape, p1, start, row0, even, _live(m_half, even, p1, end), RATIO, HEAD)
            kv1o, x1o = _row_part(kv, ape, p1, start, row0, odd, _live(m_half, odd, p1, end), RATIO, HEAD)
        if BLOCK_S > 2:
            p2 = start + 2
            p3 = start + 3
            kv2n, x2n = _row_part(kv, ape, p2, start, row0, nope, _live(m_nope, nope, p2, end), RATIO, HEAD)
            kv2e, x2e = _row_part(kv, ape, p2, start, row0, even, _live(m_half, even, p2, end), RATIO, HEAD)
            kv2o, x2o = _row_part(kv, ape, p2, start, row0, odd, _live(m_half, odd, p2, end), RATIO, HEAD)
            kv3n, x3n = _row_part(kv, ape, p3, start, row0, nope, _live(m_nope, nope, p3, end), RATIO, HEAD)
            kv3e, x3e = _row_part(kv, ape, p3, start, row0, even, _live(m_half, even, p3, end), RATIO, HEAD)
            kv3o, x3o = _row_part(kv, ape, p3, start, row0, odd, _live(m_half, odd, p3, end), RATIO, HEAD)
        mn, sn, an, me, se, ae, mo, so, ao = _decode_row(
            0, start, end, slot, first_out, outs_ptr, kv0n, x0n, kv0e, x0e, kv0o, x0o, mn, sn, an, me, se, ae, mo, so,
            ao, first_close, w_nope, w_even, w_odd, cos0, sin0, state_ptr, prm, out, nope, even, odd, m_nope, m_half,
            E, RATIO, BANKS,
        )  # fmt: skip
        if BLOCK_S > 1:
            mn, sn, an, me, se, ae, mo, so, ao = _decode_row(
                1, start + 1, end, slot, first_out, outs_ptr, kv1n, x1n, kv1e, x1e, kv1o, x1o, mn, sn, an, me, se, ae,
                mo, so, ao, first_close, w_nope, w_even, w_odd, cos0, sin0, state_ptr, prm, out, nope, even, odd,
                m_nope, m_half, E, RATIO, BANKS,
            )  # fmt: skip
        if BLOCK_S > 2:
            mn, sn, an, me, se, ae, mo, so, ao = _decode_row(
                2, start + 2, end, slot, first_out, outs_ptr, kv2n, x2n, kv2e, x2e, kv2o, x2o, mn, sn, an, me, se, ae,
                mo, so, ao, first_close, w_nope, w_even, w_odd, cos0, sin0, state_ptr, prm, out, nope, even, odd,
                m_nope, m_half, E, RATIO, BANKS,
            )  # fmt: skip
            mn, sn, an, me, se, ae, mo, so, ao = _decode_row(
                3, start + 3, end, slot, first_out, outs_ptr, kv3n, x3n, kv3e, x3e, kv3o, x3o, mn, sn, an, me, se, ae,
                mo, so, ao, first_close, w_nope, w_even, w_odd, cos0, sin0, state_ptr, prm, out, nope, even, odd,
                m_nope, m_half, E, RATIO, BANKS,
            )  # fmt: skip
    else:
        # longer drafts: the rows as one register tile, each picked out by a masked reduction
        rows = tl.arange(0, BLOCK_S)
        p_rows = start + rows
        valid = p_rows < end
        if CHANNEL_MAJOR:
            kvt_n, xt_n = _tile_part_cm(kv, ape, p_rows, valid, start, row0, nope, m_nope, RATIO, HEAD)
            kvt_e, xt_e = _tile_part_cm(kv, ape, p_rows, valid, start, row0, even, m_half, RATIO, HEAD)
            kvt_o, xt_o = _tile_part_cm(kv, ape, p_rows, valid, start, row0, odd, m_half, RATIO, HEAD)
        else:
            kvt_n, xt_n = _tile_part(kv, ape, p_rows, valid, start, row0, nope, m_nope, RATIO, HEAD)
            kvt_e, xt_e = _tile_part(kv, ape, p_rows, valid, start, row0, even, m_half, RATIO, HEAD)
            kvt_o, xt_o = _tile_part(kv, ape, p_rows, valid, start, row0, odd, m_half, RATIO, HEAD)
        for j in tl.static_range(BLOCK_S):
            if CHANNEL_MAJOR:
                kv_n, x_n = _pick_cm(kvt_n, j, rows), _pick_cm(xt_n, j, rows)
                kv_e, x_e = _pick_cm(kvt_e, j, rows), _pick_cm(xt_e, j, rows)
                kv_o, x_o = _pick_cm(kvt_o, j, rows), _pick_cm(xt_o, j, rows)
            else:
                kv_n, x_n = _pick(kvt_n, j, rows), _pick(xt_n, j, rows)
                kv_e, x_e = _pick(kvt_e, j, rows), _pick(xt_e, j, rows)
                kv_o, x_o = _pick(kvt_o, j, rows), _pick(xt_o, j, rows)
            mn, sn, an, me, se, ae, mo, so, ao = _decode_row(
                j, start + j, end, slot, first_out, outs_ptr, kv_n, x_n, kv_e, x_e, kv_o, x_o, mn, sn, an, me, se, ae,
                mo, so, ao, first_close, w_nope, w_even, w_odd, cos0, sin0, state_ptr, prm, out, nope, even, odd,
                m_nope, m_half, E, RATIO, BANKS,
            )  # fmt: skip


@triton.jit
def _online_hca_kernel(
    kv, ape, plan, state_ptr, slots, prm, out,
    E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr, BLOCK_S: tl.constexpr, TAIL_GROUPS: tl.constexpr,
    BLOCK_T: tl.constexpr, DECODE: tl.constexpr, CHANNEL_MAJOR: tl.constexpr, PREFETCH: tl.constexpr,
    NATURAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_then_release(PDL)
    # Programs [0, R) are the request programs (plan request records); programs [R, R + T // r + R) walk the
    # group-closing rows and act only on interior groups of long chunks.
    HEAD: tl.constexpr = E.HEAD
    k_prog = tl.program_id(0)
    if k_prog < plan.R:
        t, slot, start, row0, end, first_out = request_record(plan, k_prog)
        pos = start
        out_slot = -1
    else:
        t, pos, slot, start, row0, end, out_slot, _ = closing_record(plan, k_prog - plan.R)
        first_out = -1
    if (t < 0) | (slot < 0) | (slot >= slots):
        return
    nope, even, odd, m_nope, m_half = split_offsets(E)
    head_group = start // RATIO
    banked_from = tl.maximum(start, end - BANKS)  # rows whose resulting state is banked
    tail_group = banked_from // RATIO
    group = pos // RATIO

    if DECODE & NATURAL & (BLOCK_S <= 4):
        # every request brings at most mtp_step + 1 <= 4 rows: request programs only (grid R), channel order
        _request_decode_natural(
            kv, ape, plan, state_ptr, prm, out, slot, start, row0, end, first_out, E, RATIO, BANKS, BLOCK_S
        )  # fmt: skip
    elif DECODE:
        # every request brings at most mtp_step + 1 rows: request programs only (grid R)
        _request_decode(
            kv, ape, plan, state_ptr, prm, out, slot, start, row0, end, first_out, nope, even, odd, m_nope, m_half,
            E, RATIO, BANKS, BLOCK_S, CHANNEL_MAJOR,
        )  # fmt: skip
    elif k_prog < plan.R:
        # ---- request program: the carried head group and the banked tail, in order --------------------
        # Groups that start fresh inside the step, close in it and bank nothing are left to the interior
        # programs, so this program walks at most the two partial groups at the ends of a long chunk.
        mn, sn, an, me, se, ae, mo, so, ao = _fresh(E.BLOCK_NOPE, E.BLOCK_HALF)
        if start % RATIO != 0:
            bank = _bank_ptr(state_ptr, slot, start, BANKS, HEAD)
            mn, sn, an = _load_bank(bank, nope, m_nope, HEAD)
            me, se, ae = _load_bank(bank, even, m_half, HEAD)
            mo, so, ao = _load_bank(bank, odd, m_half, HEAD)
        first_tail = tl.maximum(tail_group, head_group + 1)
        last_group = (end - 1) // RATIO
        outs_ptr = row_out_slot_ptr(plan, row0)
        for k in range(0, 1 + TAIL_GROUPS):
            g = tl.where(k == 0, head_group, first_tail + k - 1)
            if (g <= last_group) & (_is_interior(g, start, end, banked_from, RATIO) == 0):
                lo = tl.maximum(start, g * RATIO)
                hi = tl.minimum(end, g * RATIO + RATIO)
                if k > 0:
                    mn, sn, an, me, se, ae, mo, so, ao = _fresh(E.BLOCK_NOPE, E.BLOCK_HALF)
                # rows before the banked tail: tile by tile
                mn, sn, an, me, se, ae, mo, so, ao = _absorb_span(
                    lo, tl.minimum(hi, banked_from), mn, sn, an, me, se, ae, mo, so, ao, kv, ape, start, row0, nope,
                    even, odd, m_nope, m_half, RATIO, HEAD, BLOCK_T, PREFETCH,
                )  # fmt: skip
                # banked rows: one at a time, saving the state after each
                for p in range(tl.maximum(lo, banked_from), hi):
                    v, x = _row_part(kv, ape, p, start, row0, nope, m_nope, RATIO, HEAD)
                    mn, sn, an = _absorb_row(mn, sn, an, v, x)
                    v, x = _row_part(kv, ape, p, start, row0, even, m_half, RATIO, HEAD)
                    me, se, ae = _absorb_row(me, se, ae, v, x)
                    v, x = _row_part(kv, ape, p, start, row0, odd, m_half, RATIO, HEAD)
                    mo, so, ao = _absorb_row(mo, so, ao, v, x)
                    if (p + 1) % RATIO != 0:
                        bank = _bank_ptr(state_ptr, slot, p + 1, BANKS, HEAD)
                        _store_bank(bank, nope, m_nope, mn, sn, an, HEAD)
                        _store_bank(bank, even, m_half, me, se, ae, HEAD)
                        _store_bank(bank, odd, m_half, mo, so, ao, HEAD)
                if hi == g * RATIO + RATIO:  # the segment closes group g
                    slot_out = tl.load(outs_ptr + REC * (hi - 1 - start))
                    if slot_out >= 0:
                        finish_entry(an / sn, ae / se, ao / so, slot_out, g * RATIO, prm, out, E)
    elif _is_interior(group, start, end, banked_from, RATIO) & (out_slot >= 0):
        # ---- interior program: a full group of the chunk, from a fresh state, in parallel -----------
        mn, sn, an, me, se, ae, mo, so, ao = _fresh(E.BLOCK_NOPE, E.BLOCK_HALF)
        mn, sn, an, me, se, ae, mo, so, ao = _absorb_span(
            group * RATIO, group * RATIO + RATIO, mn, sn, an, me, se, ae, mo, so, ao, kv, ape, start, row0,
            nope, even, odd, m_nope, m_half, RATIO, HEAD, BLOCK_T, PREFETCH,
        )  # fmt: skip
        finish_entry(an / sn, ae / se, ao / so, out_slot, group * RATIO, prm, out, E)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


#: Whether decode steps (``mtp_step <= 3``) hold the channels whole, in channel order
#: (:func:`_request_decode_natural`), rather than in the three parts (nope, rope x, rope y).
DECODE_NATURAL_ORDER = True
#: Whether non-decode steps with more groups than SMs absorb their spans with the next tile's loads in flight
#: (:func:`_absorb_span`). H200 (docs/runs/tune_aa8f218): a 64K chunk 79.5 -> 76.0 us; an 8K chunk (one
#: program per SM) was slower with it at every measured shape (34.9 us without, 40.2 at 8 warps x 16 rows).
PREFILL_PREFETCH = True


def prefill_launch_shape(num_rows: int, ratio: int, device) -> tuple[int, int, bool]:
    """``(num_warps, block_t, prefetch)`` of a non-decode step: with at most one group per SM each group's
    program is alone on its SM and wider (8 warps, 32-row tiles) keeps more loads in flight; with more groups
    than SMs the narrower shape packs several programs per SM and, with :data:`PREFILL_PREFETCH`, keeps the
    next tile in flight (two tiles live: 8 rows each). Depends only on the shapes (CUDA-graph safe).
    H200, HCA, one request, without prefetch (us per chunk): 8K tokens 44 -> 33, 512 tokens 37 -> 29, 64K 82
    (narrow) vs 107."""
    if num_rows // ratio <= _sm_count(torch.device(device)):
        return 8, 32, False
    return (4, 8, True) if PREFILL_PREFETCH else (4, 16, False)


def launch_online_hca(
    kv, ape, plan, state_banks: torch.Tensor, prm, out, meta, *, ratio: int, closing: int, decode: bool,
    block_t: int | None = None, num_warps: int | None = None, decode_warps: int = 4, channel_major: bool = False,
    prefetch: bool | None = None, natural: bool | None = None, pdl: bool = False,
) -> None:  # fmt: skip
    """Launch the online step: update ``state_banks`` (float32 ``[slots, banks, 3, H]``, contiguous) and write
    closed entries. ``decode=True`` (every request brings at most ``mtp_step + 1`` rows) launches only the
    request programs, specialised for that case. ``block_t`` and ``num_warps`` (non-decode steps) default to
    :func:`prefill_launch_shape`, ``prefetch`` to :data:`PREFILL_PREFETCH`."""
    if plan.T == 0:
        return
    banks = state_banks.shape[1]
    grid = (plan.R,) if decode else (plan.R + closing,)
    auto_warps, auto_block_t, auto_prefetch = prefill_launch_shape(plan.T, ratio, state_banks.device)
    block_t = auto_block_t if block_t is None else block_t
    num_warps = auto_warps if num_warps is None else num_warps
    prefetch = auto_prefetch if prefetch is None else prefetch
    _online_hca_kernel[grid](
        kv, ape, plan, state_banks, state_banks.shape[0], prm, out, meta,
        RATIO=ratio, BANKS=banks, BLOCK_S=triton.next_power_of_2(banks), TAIL_GROUPS=-(-banks // ratio) + 1,
        BLOCK_T=min(block_t, triton.next_power_of_2(ratio)), DECODE=decode, CHANNEL_MAJOR=channel_major,
        PREFETCH=prefetch and not decode, NATURAL=DECODE_NATURAL_ORDER if natural is None else natural,
        num_warps=decode_warps if decode else num_warps, **launch_options(pdl, grid[0]),
    )  # fmt: skip


__all__ = ["launch_online_hca", "prefill_launch_shape"]
