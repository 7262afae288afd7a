"""Where a kernel finds a row: the step descriptor and window addressing (``@triton.jit`` helpers).

The descriptor is one int32 tensor (see :mod:`dsv4_compressor.step`): field ``f`` of row ``t`` is at
``desc + f * T + t``, then ``R`` request records of 6, then ``T // r + R`` closing-row records of 7. A window
position ``q`` of a request lives in this step's ``kv_score`` when ``q >= req_start`` and in the request's ring
otherwise; positions below zero are absent.
"""

import triton
import triton.language as tl


@triton.jit
def load_row_desc(desc_ptr, T, t):
    """``(position, req_slot, req_start, req_row0, req_end, out_slot)`` of row ``t``."""
    pos = tl.load(desc_ptr + t)
    slot = tl.load(desc_ptr + T + t)
    start = tl.load(desc_ptr + 2 * T + t)
    row0 = tl.load(desc_ptr + 3 * T + t)
    end = tl.load(desc_ptr + 4 * T + t)
    out = tl.load(desc_ptr + 5 * T + t)
    return pos, slot, start, row0, end, out


@triton.jit
def window_row_ptrs(q, kv_ptr, ring_ptr, slot, start, row0, ROW: tl.constexpr, RING: tl.constexpr):
    """Row base pointers of positions ``q`` (a tensor), plus masks: ``new`` (row of this step, its gate
    logits still lack the APE bias) and ``present`` (``q >= 0``)."""
    new = q >= start
    present = q >= 0
    kv_row = (row0 + (q - start)).to(tl.int64)
    ring_row = slot.to(tl.int64) * RING + ((q + RING) % RING)  # q >= -RING here; absent rows are masked
    ptrs = tl.where(new, kv_ptr + kv_row * ROW, ring_ptr + ring_row * ROW)
    return ptrs, new, present


@triton.jit
def ape_bias(ape_ptr, q, cols, mask, RATIO: tl.constexpr, WIDTH: tl.constexpr):
    """``ape[q % r, cols]`` where ``mask``, else 0 (added to new rows' gate logits on load)."""
    return tl.load(ape_ptr + ((q % RATIO) * WIDTH)[:, None] + cols, mask=mask, other=0.0)


@triton.jit
def closing_record(desc_ptr, T, R, k):
    """``(row, position, req_slot, req_start, req_row0, req_end, out_slot)`` of the ``k``-th group-closing row
    (``row == -1`` past the last one)."""
    rec = desc_ptr + 6 * T + 6 * R + 7 * k
    return (
        tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4), tl.load(rec + 5),
        tl.load(rec + 6),
    )  # fmt: skip


@triton.jit
def request_record(desc_ptr, T, k):
    """``(first row, req_slot, req_start, req_row0, req_end, first_out)`` of the ``k``-th request (row ``-1``:
    none; ``first_out``: output slot of the first group the request closes in the step, else ``-1``)."""
    rec = desc_ptr + 6 * T + 6 * k
    return tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4), tl.load(rec + 5)


def desc_args(desc):
    """``(packed descriptor, T, R)``: the launch arguments every step kernel takes."""
    return desc.packed, desc.num_rows, desc.max_requests


__all__ = ["load_row_desc", "window_row_ptrs", "ape_bias", "closing_record", "request_record", "desc_args"]
