"""The ring state: where a window finds its rows, the APE bias, and saving a step's tail rows.

A window position ``q`` of a request lives in this step's ``kv_score`` when ``q >= start`` (row
``row0 + q - start``) and in the request's saved state otherwise, at row ``slot * ring + q % ring`` (the
``req_ring`` addressing LightLLM's and SGLang's HCA state use). Saved rows are ``[kv | score + ape]``; rows of
``kv_score`` carry the bare gate logits, so the bias is added on load. Positions below zero are absent.

Saving must come after every window of the step has read the state (SPEC section 6): the single-stage kernel
saves in-kernel only for decode steps (where no saved row overwrites one another window of the step reads),
the two-stage HCA kernel saves from its second stage, and otherwise :func:`launch_ring_save` runs last.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .plan import row_record

#: ``kv_score`` rows: base pointer and row stride (elements; columns are contiguous).
KvRef = namedtuple("KvRef", "ptr row_stride")
#: Ring state: base pointer, request slots it holds (a plan row of a larger slot does nothing), elements between
#: request slots and between rows (columns contiguous).
StateRef = namedtuple("StateRef", "ptr slots slot_stride row_stride")
#: APE bias ``[r, coff, H]`` as strides: row (``p % r``), half (overlap: 0 = previous-group, 1 = own), channel.
ApeRef = namedtuple("ApeRef", "ptr row_stride half_stride chan_stride")


@triton.jit
def window_row_ptrs(q, kv, state, slot, start, row0, RING: tl.constexpr):
    """Row base pointers of window positions ``q`` (a tensor), and masks: ``new`` (a row of this step, whose
    gate logits still lack the APE bias) and ``present`` (``q >= 0``)."""
    new = q >= start
    present = q >= 0
    kv_row = (row0 + (q - start)).to(tl.int64)
    ring_row = (q + RING) % RING  # q >= -RING wherever it is read; absent rows are masked
    state_off = slot.to(tl.int64) * state.slot_stride + ring_row.to(tl.int64) * state.row_stride
    ptrs = tl.where(new, kv.ptr + kv_row * kv.row_stride, state.ptr + state_off)
    return ptrs, new, present


@triton.jit
def ape_bias(ape, q, half, chan, mask, RATIO: tl.constexpr):
    """``ape[q % r, half, chan]`` where ``mask``, else 0 (``q`` and ``half`` broadcast against ``chan``)."""
    off = (q % RATIO) * ape.row_stride + half * ape.half_stride + chan * ape.chan_stride
    return tl.load(ape.ptr + off, mask=mask, other=0.0)


@triton.jit
def save_row(kv, state, ape, t, pos, slot, end, RATIO: tl.constexpr, HEAD: tl.constexpr, WIDTH: tl.constexpr,
             RING: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Save row ``t`` (position ``pos`` of request ``slot``) as ``[kv | score + ape]`` if it is among its
    request's last ``RING`` rows."""
    if (slot >= 0) & (slot < state.slots) & (pos >= end - RING):
        src = kv.ptr + t.to(tl.int64) * kv.row_stride
        dst = state.ptr + slot.to(tl.int64) * state.slot_stride + (pos % RING).to(tl.int64) * state.row_stride
        for c0 in tl.static_range(0, 2 * WIDTH, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < 2 * WIDTH
            row = tl.load(src + cols, mask=mask, other=0.0)
            score_col = cols - WIDTH
            row += ape_bias(ape, pos, score_col // HEAD, score_col % HEAD, mask & (score_col >= 0), RATIO)
            tl.store(dst + cols, row, mask=mask)


@triton.jit
def _ring_save_kernel(kv, state, ape, plan, RATIO: tl.constexpr, HEAD: tl.constexpr, WIDTH: tl.constexpr,
                      RING: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    pos, slot, start, row0, end, out = row_record(plan, t)
    save_row(kv, state, ape, t, pos, slot, end, RATIO, HEAD, WIDTH, RING, BLOCK)


def save_block(width: int) -> int:
    """Columns one save loop iteration moves."""
    return min(2048, triton.next_power_of_2(2 * width))


def launch_ring_save(kv, state, ape, plan, *, ratio: int, head: int, width: int, ring: int) -> None:
    """Save every request's last ``min(n, ring)`` rows of the step (one program per row)."""
    if plan.T == 0:
        return
    _ring_save_kernel[(plan.T,)](
        kv, state, ape, plan, RATIO=ratio, HEAD=head, WIDTH=width, RING=ring, BLOCK=save_block(width), num_warps=4
    )


__all__ = ["KvRef", "StateRef", "ApeRef", "window_row_ptrs", "ape_bias", "save_row", "launch_ring_save", "save_block"]
