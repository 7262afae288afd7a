"""Online-softmax HCA compressor: no ring; one launch per step (two and a scratch for a split prefill step).

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

A step that is not decode may instead be split (``SPLIT``, with a float32 scratch ``[>= T, H]``): the same
programs, each for ``SPLIT`` channels of its groups (the state is per channel, so banks split with them), store
a closed group's pooled values in the scratch row of its closing row, and a second launch
(:func:`_online_finish_kernel`, one program per closing row) finishes the entries, since RMSNorm needs every
channel. One program per group leaves an 8K chunk's 64 groups on 64 SMs; split 16 ways they fill the GPU.

A decode / verify step (``DECODE``: every request brings at most ``mtp_step + 1`` rows) launches the request
programs only, specialised: the state and all rows are requested in one round, then absorbed row by row
from registers. Channels are held whole, in channel order (``BLOCK_HEAD`` lanes, padding lanes zero), and
entries finished by :func:`~.entry_pack.finish_entry`: one contiguous load per row and bank field (three
parts, nope / rope x / rope y, took more registers and were slower: H200, docs/runs/tune_4b07542).

Rows are read through :func:`~.ring.load_kv`: ``kv`` may be a K-split projection's partials, left unsummed and
added here (``ops.compress_online_hca_from_hidden`` on decode steps: the projection then skips its own
reduction, which a decode step's projection measured paying about 2.5 us for; docs/runs/probe_03536d9).
"""

import functools
import math
import os
from collections import namedtuple

import torch
import triton
import triton.language as tl

from .entry_pack import finish_entry, finish_entry_with, finish_inputs
from .pdl import launch_options, wait_after_record, wait_before_record, wait_then_release
from .plan import REC, closing_record, request_record, row_out_slot_ptr
from .ring import ape_bias, load_kv

#: The banks: base pointer and the elements between request slots (``state_banks.stride(0)``: at least
#: ``BANKS * 3 * H``, more where the banks are a view into an engine's padded blocks, vLLM's).
BanksRef = namedtuple("BanksRef", "ptr slot_stride")


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
    v = load_kv(kv, row + idx, mask)
    x = load_kv(kv, row + HEAD + idx, mask)
    x += ape_bias(ape, p, 0, idx, mask, RATIO)
    return v, x


@triton.jit
def _tile_part(kv, ape, p, ok, start, row0, idx, mask, RATIO: tl.constexpr, HEAD: tl.constexpr):
    """Values and gated logits of positions ``p`` (``[BLOCK_T]``, rows where ``ok``) for channels ``idx``."""
    rows = kv.ptr + (row0 + p - start).to(tl.int64) * kv.row_stride
    m2 = ok[:, None] & mask[None, :]
    v = load_kv(kv, rows[:, None] + idx[None, :], m2)
    x = load_kv(kv, rows[:, None] + HEAD + idx[None, :], m2)
    x += ape_bias(ape, p[:, None], 0, idx[None, :], m2, RATIO)
    return v, tl.where(ok[:, None], x, float("-inf"))


@triton.jit
def _tile_part_cm(kv, ape, p, ok, start, row0, idx, mask, RATIO: tl.constexpr, HEAD: tl.constexpr):
    """Like :func:`_tile_part` but channel-major ``[C, BLOCK_S]``: a thread holds every row of its channels,
    so picking a row is an in-thread reduction."""
    rows = kv.ptr + (row0 + p - start).to(tl.int64) * kv.row_stride
    m2 = ok[None, :] & mask[:, None]
    v = load_kv(kv, rows[None, :] + idx[:, None], m2)
    x = load_kv(kv, rows[None, :] + HEAD + idx[:, None], m2)
    x += ape_bias(ape, p[None, :], 0, idx[:, None], m2, RATIO)
    return v, x


@triton.jit
def _bank_ptr(state_ptr, slot, length, BANKS: tl.constexpr, HEAD: tl.constexpr):
    """Bank ``length % BANKS`` of request slot ``slot``: slots ``state_ptr.slot_stride`` floats apart (a view
    into an engine's blocks may pad them), the banks of a slot contiguous."""
    return state_ptr.ptr + slot.to(tl.int64) * state_ptr.slot_stride + (length % BANKS) * (3 * HEAD)


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
def _fresh(BLOCK: tl.constexpr):
    """The empty state of ``BLOCK`` channels: ``m = -inf``, ``s = a = 0``."""
    return tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)


@triton.jit
def _absorb_span(
    lo, hi, m, s, a, kv, ape, start, row0, ch, m_ch, RATIO: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr
):  # fmt: skip
    """Absorb positions ``[lo, hi)`` tile by tile (channel-major) into the state (m, s, a). (The next
    tile is not prefetched while one is absorbed: in channel order that was slower, docs/runs/tune_e8fcfb1.)"""
    for p0 in range(lo, hi, BLOCK_T):
        p = p0 + tl.arange(0, BLOCK_T)
        ok = p < hi
        v, x = _tile_part_cm(kv, ape, p, ok, start, row0, ch, m_ch, RATIO, HEAD)
        m, s, a = _absorb_tile_cm(m, s, a, v, tl.where(ok[None, :], x, float("-inf")))
    return m, s, a


@triton.jit
def _is_interior(g, start, end, banked_from, RATIO: tl.constexpr):
    """Group ``g`` starts fresh inside the step, closes in it and banks no state: any program can pool it."""
    return (g * RATIO >= start) & (g * RATIO + RATIO <= end) & (banked_from >= g * RATIO + RATIO - 1)


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
def _pooled(m_ch, s, a):
    """The pooled values ``a / s`` of a closed group (padding lanes zero)."""
    return tl.where(m_ch, a / s, 0.0)


@triton.jit
def _close_group(pooled, out_slot, t, group_start, scratch_ptr, ch, m_ch, prm, out, E: tl.constexpr,
                 SPLIT: tl.constexpr):  # fmt: skip
    """A group closed at row ``t`` of the step: finish its entry (whole channels), or store this program's
    channels of the pooled values in scratch row ``t`` for :func:`_online_finish_kernel` (``SPLIT``)."""
    if SPLIT:
        tl.store(scratch_ptr + t.to(tl.int64) * E.HEAD + ch, pooled, mask=m_ch)
    else:
        finish_entry(pooled, out_slot, group_start, prm, out, E)


@triton.jit
def _decode_row(
    J: tl.constexpr, p, end, slot, first_out, outs_ptr, v, x, m, s, a, first_close, w, cos0, sin0, state_ptr, prm,
    out, ch, m_ch, E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr,
):  # fmt: skip
    """Row ``J`` of a decode step (position ``p``): absorb it, then bank the state or finish the group (the first
    group the request closes goes to ``first_out``, from the request record; a later one, possible only when
    ``r < mtp_step + 1``, reads its slot from the plan's row records at ``outs_ptr``)."""
    if p < end:
        if (J > 0) & (p % RATIO == 0):  # a new group begins inside the step
            m, s, a = _fresh(E.BLOCK_HEAD)
        m, s, a = _absorb_row(m, s, a, v, x)
        if (p + 1) % RATIO != 0:
            _store_bank(_bank_ptr(state_ptr, slot, p + 1, BANKS, E.HEAD), ch, m_ch, m, s, a, E.HEAD)
        else:
            cos = cos0
            sin = sin0
            slot_out = first_out
            if p != first_close:  # a second group closed in one step (ratio < mtp_step + 1)
                slot_out = tl.load(outs_ptr + REC * J)
                w, cos, sin = finish_inputs(prm, p + 1 - RATIO, E)
            if slot_out >= 0:
                finish_entry_with(_pooled(m_ch, s, a), slot_out, w, cos, sin, prm, out, E)
    return m, s, a


@triton.jit
def _request_decode(
    kv, ape, plan, state_ptr, prm, out, slot, start, row0, end, first_out, ch, m_ch,
    E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr, BLOCK_S: tl.constexpr, CHANNEL_MAJOR: tl.constexpr,
):  # fmt: skip
    """A request bringing at most ``mtp_step + 1`` rows (decode / verify): every row is banked. One load
    round (state + rows), then one unrolled pass over the rows: absorb, bank, finish a closed group."""
    HEAD: tl.constexpr = E.HEAD
    m, s, a = _fresh(E.BLOCK_HEAD)
    if start % RATIO != 0:
        m, s, a = _load_bank(_bank_ptr(state_ptr, slot, start, BANKS, HEAD), ch, m_ch, HEAD)
    # what finishing the first group this step closes reads, requested now so the finish does not wait
    first_close = start + (RATIO - 1 - start % RATIO)
    w, cos0, sin0 = finish_inputs(prm, first_close + 1 - RATIO, E)
    outs_ptr = row_out_slot_ptr(plan, row0)  # out_slot of this request's rows, REC ints apart
    if BLOCK_S <= 4:
        # mtp_step <= 3 (DeepSeek-V4 runs 3): every row in its own registers, all loads issued before any
        # arithmetic, then the rows unrolled by hand; no cross-thread reductions to pick a row out of a tile.
        v0, x0 = _row_part(kv, ape, start, start, row0, ch, _live(m_ch, ch, start, end), RATIO, HEAD)
        if BLOCK_S > 1:
            v1, x1 = _row_part(kv, ape, start + 1, start, row0, ch, _live(m_ch, ch, start + 1, end), RATIO, HEAD)
        if BLOCK_S > 2:
            v2, x2 = _row_part(kv, ape, start + 2, start, row0, ch, _live(m_ch, ch, start + 2, end), RATIO, HEAD)
            v3, x3 = _row_part(kv, ape, start + 3, start, row0, ch, _live(m_ch, ch, start + 3, end), RATIO, HEAD)
        m, s, a = _decode_row(
            0, start, end, slot, first_out, outs_ptr, v0, x0, m, s, a, first_close, w, cos0, sin0, state_ptr, prm,
            out, ch, m_ch, E, RATIO, BANKS,
        )  # fmt: skip
        if BLOCK_S > 1:
            m, s, a = _decode_row(
                1, start + 1, end, slot, first_out, outs_ptr, v1, x1, m, s, a, first_close, w, cos0, sin0, state_ptr,
                prm, out, ch, m_ch, E, RATIO, BANKS,
            )  # fmt: skip
        if BLOCK_S > 2:
            m, s, a = _decode_row(
                2, start + 2, end, slot, first_out, outs_ptr, v2, x2, m, s, a, first_close, w, cos0, sin0, state_ptr,
                prm, out, ch, m_ch, E, RATIO, BANKS,
            )  # fmt: skip
            m, s, a = _decode_row(
                3, start + 3, end, slot, first_out, outs_ptr, v3, x3, m, s, a, first_close, w, cos0, sin0, state_ptr,
                prm, out, ch, m_ch, E, RATIO, BANKS,
            )  # fmt: skip
    else:
        # longer drafts: the rows as one register tile, each picked out by a masked reduction
        rows = tl.arange(0, BLOCK_S)
        p_rows = start + rows
        valid = p_rows < end
        if CHANNEL_MAJOR:
            vt, xt = _tile_part_cm(kv, ape, p_rows, valid, start, row0, ch, m_ch, RATIO, HEAD)
        else:
            vt, xt = _tile_part(kv, ape, p_rows, valid, start, row0, ch, m_ch, RATIO, HEAD)
        for j in tl.static_range(BLOCK_S):
            if CHANNEL_MAJOR:
                v, x = _pick_cm(vt, j, rows), _pick_cm(xt, j, rows)
            else:
                v, x = _pick(vt, j, rows), _pick(xt, j, rows)
            m, s, a = _decode_row(
                j, start + j, end, slot, first_out, outs_ptr, v, x, m, s, a, first_close, w, cos0, sin0, state_ptr,
                prm, out, ch, m_ch, E, RATIO, BANKS,
            )  # fmt: skip


@triton.jit
def _online_hca_kernel(
    kv, ape, plan, state_ptr, slots, prm, out, scratch_ptr,
    E: tl.constexpr, RATIO: tl.constexpr, BANKS: tl.constexpr, BLOCK_S: tl.constexpr, TAIL_GROUPS: tl.constexpr,
    BLOCK_T: tl.constexpr, DECODE: tl.constexpr, CHANNEL_MAJOR: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr, RECORD_FIRST: tl.constexpr,
):  # fmt: skip
    # Programs [0, R) are the request programs (plan request records); programs [R, R + T // r + R) walk the
    # group-closing rows and act only on interior groups of long chunks. SPLIT: grid (H / SPLIT, records), a
    # record's channel tiles adjacent in launch order. RECORD_FIRST: the record is read before the PDL wait
    # (kernels/pdl.py).
    wait_before_record(PDL, RECORD_FIRST)
    HEAD: tl.constexpr = E.HEAD
    BLOCK_C: tl.constexpr = SPLIT if SPLIT else E.BLOCK_HEAD
    k_prog = tl.program_id(1) if SPLIT else tl.program_id(0)
    if k_prog < plan.R:
        t, slot, start, row0, end, first_out = request_record(plan, k_prog)
        pos = start
        out_slot = -1
    else:
        t, pos, slot, start, row0, end, out_slot, _ = closing_record(plan, k_prog - plan.R)
        first_out = -1
    wait_after_record(PDL, RECORD_FIRST)
    if (t < 0) | (slot < 0) | (slot >= slots):
        return
    ch = (tl.program_id(0) * SPLIT if SPLIT else 0) + tl.arange(0, BLOCK_C)
    m_ch = ch < HEAD
    head_group = start // RATIO
    banked_from = tl.maximum(start, end - BANKS)  # rows whose resulting state is banked
    tail_group = banked_from // RATIO
    group = pos // RATIO

    if DECODE:
        # every request brings at most mtp_step + 1 rows: request programs only (grid R)
        _request_decode(
            kv, ape, plan, state_ptr, prm, out, slot, start, row0, end, first_out, ch, m_ch, E, RATIO, BANKS, BLOCK_S,
            CHANNEL_MAJOR,
        )  # fmt: skip
    elif k_prog < plan.R:
        # ---- request program: the carried head group and the banked tail, in order --------------------
        # Groups that start fresh inside the step, close in it and bank nothing are left to the interior
        # programs, so this program walks at most the two partial groups at the ends of a long chunk.
        m, s, a = _fresh(BLOCK_C)
        if start % RATIO != 0:
            m, s, a = _load_bank(_bank_ptr(state_ptr, slot, start, BANKS, HEAD), ch, m_ch, HEAD)
        first_tail = tl.maximum(tail_group, head_group + 1)
        last_group = (end - 1) // RATIO
        outs_ptr = row_out_slot_ptr(plan, row0)
        for k in range(0, 1 + TAIL_GROUPS):
            g = tl.where(k == 0, head_group, first_tail + k - 1)
            if (g <= last_group) & (_is_interior(g, start, end, banked_from, RATIO) == 0):
                lo = tl.maximum(start, g * RATIO)
                hi = tl.minimum(end, g * RATIO + RATIO)
                if k > 0:
                    m, s, a = _fresh(BLOCK_C)
                # rows before the banked tail: tile by tile
                m, s, a = _absorb_span(
                    lo, tl.minimum(hi, banked_from), m, s, a, kv, ape, start, row0, ch, m_ch, RATIO, HEAD, BLOCK_T
                )  # fmt: skip
                # banked rows: one at a time, saving the state after each
                for p in range(tl.maximum(lo, banked_from), hi):
                    v, x = _row_part(kv, ape, p, start, row0, ch, m_ch, RATIO, HEAD)
                    m, s, a = _absorb_row(m, s, a, v, x)
                    if (p + 1) % RATIO != 0:
                        _store_bank(_bank_ptr(state_ptr, slot, p + 1, BANKS, HEAD), ch, m_ch, m, s, a, HEAD)
                if hi == g * RATIO + RATIO:  # the segment closes group g
                    slot_out = tl.load(outs_ptr + REC * (hi - 1 - start))
                    if slot_out >= 0:
                        _close_group(_pooled(m_ch, s, a), slot_out, row0 + (hi - 1 - start), g * RATIO, scratch_ptr,
                                     ch, m_ch, prm, out, E, SPLIT)  # fmt: skip
    elif _is_interior(group, start, end, banked_from, RATIO) & (out_slot >= 0):
        # ---- interior program: a full group of the chunk, from a fresh state, in parallel -----------
        m, s, a = _fresh(BLOCK_C)
        m, s, a = _absorb_span(
            group * RATIO, group * RATIO + RATIO, m, s, a, kv, ape, start, row0, ch, m_ch, RATIO, HEAD, BLOCK_T
        )  # fmt: skip
        _close_group(_pooled(m_ch, s, a), out_slot, t, group * RATIO, scratch_ptr, ch, m_ch, prm, out, E, SPLIT)


@triton.jit
def _online_finish_kernel(scratch_ptr, plan, slots, prm, out, E: tl.constexpr, RATIO: tl.constexpr,
                          PDL: tl.constexpr):  # fmt: skip
    """The split step's second launch: one program per group-closing row finishes its entry from the pooled
    values the first launch left in the row's scratch row (every closing row whose entry is written has them:
    its request's program or its group's interior programs stored them, under the same conditions)."""
    wait_then_release(PDL)
    t, pos, slot, _start, _row0, _end, out_slot, _ = closing_record(plan, tl.program_id(0))
    if (t < 0) | (out_slot < 0) | (slot < 0) | (slot >= slots):
        return
    ch = tl.arange(0, E.BLOCK_HEAD)
    c = tl.load(scratch_ptr + t.to(tl.int64) * E.HEAD + ch, mask=ch < E.HEAD, other=0.0)
    finish_entry(c, out_slot, pos + 1 - RATIO, prm, out, E)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefill_launch_shape(num_rows: int, ratio: int, device) -> tuple[int, int]:
    """``(num_warps, block_t)`` of a non-decode step: with at most one group per SM each group's program is
    alone on its SM and wider (8 warps, 32-row tiles) keeps more loads in flight; with more groups than SMs
    the narrower shape packs several programs per SM. Depends only on the shapes (CUDA-graph safe). Both
    shapes were the fastest of those swept for their side of the rule (H200, docs/runs/tune_e8fcfb1)."""
    if num_rows // ratio <= _sm_count(torch.device(device)):
        return 8, 32
    return 4, 16


#: Channels per program of a split step (a divisor of the head dims this path takes), and the rows each
#: loads at once (a whole 128-row group: one memory round trip per interior program).
SPLIT_TILE = 32
SPLIT_BLOCK_T = 128
#: A step given a scratch is split when it has at most this many groups per SM: splitting wins from 8K to 32K
#: tokens and loses at 64K (3.9 groups per SM); 64-channel programs lose at 8K (H200, docs/runs/tune_6092045).
SPLIT_MAX_GROUPS_PER_SM = 3


def splits(num_rows: int, ratio: int, device) -> bool:
    """Whether a step that is not decode, given a scratch, is split: when whole-channel programs, one per
    group, would not fill the GPU; always on the CPU (the interpreter), which has no SMs to fill. Depends only
    on the shapes (CUDA-graph safe)."""
    sms = _sm_count(torch.device(device))
    return sms == 0 or num_rows // ratio <= SPLIT_MAX_GROUPS_PER_SM * sms


#: Warps of a decode step's request programs (``DSV4_ONLINE_DECODE_WARPS`` read at import, for A/B runs), and
#: of those that read a projection's unsummed partials (``kv.SPLIT > 1``): eight partials per value want more
#: loads in flight than four warps' registers hold. V4-Flash HCA layer from hidden states, H200, cold: 7.60 us
#: at B = 16 with 8 warps, 9.01 with 4, 7.92 with 16 (docs/runs/check_57c5a92); steps on a summed ``kv_score``
#: keep the 4 that ``tune_kernels`` picked for them.
DECODE_WARPS = int(os.environ.get("DSV4_ONLINE_DECODE_WARPS", "4"))
PARTIALS_DECODE_WARPS = 8


def _decode_warps(kv) -> int:
    return PARTIALS_DECODE_WARPS if getattr(kv.SPLIT, "value", kv.SPLIT) > 1 else DECODE_WARPS


def launch_online_hca(
    kv, ape, plan, state_banks: torch.Tensor, prm, out, meta, *, ratio: int, closing: int, decode: bool,
    scratch: torch.Tensor | None = None, split_tile: int = SPLIT_TILE, block_t: int | None = None,
    num_warps: int | None = None, decode_warps: int | None = None, channel_major: bool = False, pdl: bool = False,
    record_first: bool = False,
) -> None:  # fmt: skip
    """Launch the online step: update ``state_banks`` (float32 ``[slots, banks, 3, H]``, each slot's banks
    contiguous, slots ``stride(0)`` apart) and write
    closed entries. ``decode=True`` (every request brings at most ``mtp_step + 1`` rows) launches only the
    request programs, specialised for that case. Otherwise, with ``scratch`` (float32 ``[>= T, H]``) and
    where :func:`splits` says, the step is split: ``split_tile`` channels per program, then the entries
    finished by a second launch; else one launch of whole-channel programs. ``block_t`` and ``num_warps`` (non-decode steps) default to
    :data:`SPLIT_BLOCK_T` and 4 warps when split, else to :func:`prefill_launch_shape`. ``record_first``: the
    programs read their plan records before their PDL wait (:mod:`.pdl`)."""
    if plan.T == 0:
        return
    banks = state_banks.shape[1]
    split = split_tile if not decode and scratch is not None and splits(plan.T, ratio, state_banks.device) else 0
    if split:
        grid = (meta.HEAD // split, plan.R + closing)
        auto_warps, auto_block_t = 4, SPLIT_BLOCK_T
    else:
        grid = (plan.R,) if decode else (plan.R + closing,)
        auto_warps, auto_block_t = prefill_launch_shape(plan.T, ratio, state_banks.device)
    block_t = auto_block_t if block_t is None else block_t
    num_warps = auto_warps if num_warps is None else num_warps
    banks_ref = BanksRef(state_banks, state_banks.stride(0))
    _online_hca_kernel[grid](
        kv, ape, plan, banks_ref, state_banks.shape[0], prm, out, scratch if split else state_banks, meta,
        RATIO=ratio, BANKS=banks, BLOCK_S=triton.next_power_of_2(banks), TAIL_GROUPS=-(-banks // ratio) + 1,
        BLOCK_T=min(block_t, triton.next_power_of_2(ratio)), DECODE=decode, CHANNEL_MAJOR=channel_major,
        SPLIT=split, num_warps=(decode_warps or _decode_warps(kv)) if decode else num_warps,
        RECORD_FIRST=record_first and pdl,
        **launch_options(pdl, math.prod(grid)),
    )  # fmt: skip
    if split:
        _online_finish_kernel[(closing,)](
            scratch, plan, state_banks.shape[0], prm, out, meta, RATIO=ratio, num_warps=4,
            **launch_options(pdl, closing),
        )  # fmt: skip


__all__ = ["BanksRef", "SPLIT_TILE", "launch_online_hca", "prefill_launch_shape", "splits"]
