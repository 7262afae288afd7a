"""The step plan: what every compress kernel of a step reads, built on the device from the engine's metadata.

An engine has, per step, one row per token: ``positions [T]``, ``row_req [T]`` (the row's request state slot;
``-1`` or ``>= num_slots`` for padding) and ``out_slot [T]`` (the output slot of the entry a row closes, read
only on rows with ``p % r == r - 1``). Rows of one request are contiguous, positions consecutive and ascending.
With a request-to-slot table (``req_state_slot [B]``, e.g. vLLM's first state block per request) ``row_req``
holds request indices and a row's slot is the table's entry (an index outside it: padding). With an output-slot
table (``out_slot_map [N]``, e.g. LightLLM's ``full_to_c4_indexs``) ``out_slot`` holds indices into it (LightLLM's
``mem_index``) and a group-closing row's output slot is the table's entry there, looked up on those rows only; an
index outside the table writes nothing and flags the step (:data:`FLAG_OUT_INDEX`).
:func:`build_plan` turns these into one int32 buffer of 8-int records, so a kernel program finds everything
about its row, request or group-closing row in one 32-byte read:

==================  ==================  =================================================================
section             records             fields (8 int32 each)
==================  ==================  =================================================================
header              1                   ``T, R, ratio, num_slots, requests, closing, valid rows, flags``
requests            ``R``               ``first row, slot, start, row0, end, first_out, index, -``
rows                ``T``               ``position, slot, start, row0, end, out_slot, request index, arrivals``
closing rows        ``T // r + R``      ``row, position, slot, start, row0, end, out_slot, request index``
==================  ==================  =================================================================

A *request* is a run of consecutive rows with the same valid ``row_req`` and consecutive positions; its
``start`` is the position of its first row (a start below the previous length is an MTP rewind: nothing else
is needed), ``row0`` that row's index, ``end = start + n``. ``first_out`` is the ``out_slot`` of the first row
of the request that closes a group (``-1``: none in this step). Padding rows have ``slot = -1``; request and
closing lists are padded with records whose first field is ``-1``. A row's ``arrivals`` is written 0 here and
is the tiled C128 kernel's count of the channel-tile programs done with the row's group in a one-launch decode
step (:func:`row_arrivals_ptr`); the last to arrive sets it back to 0, so between kernels it is always 0 and
the plan reads the same to every layer of the step. Past the ``R``-th request the rows are
treated as padding and the header's ``flags`` gets :data:`FLAG_REQUEST_OVERFLOW` (``check_plan`` reports it).

No step of ``T`` rows and ``R`` requests closes more than ``T // r + R`` groups, so every grid depends only on
``T`` and ``R``: a CUDA graph captured once replays any step that fits. Steps of more than 64 rows or
requests are built by one program per block of rows (each counts the runs and groups before its block from the
inputs themselves and scans its own rows) and one more that counts every row for the header and pads the lists,
smaller ones by a single program in one pass. Neither uses atomics or reads what another program writes, so the
plan is deterministic.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .pdl import launch_options, wait_then_release

# Module constants are ``tl.constexpr`` so kernels may read them; host code uses ``int(...)``.
#: Ints per record (the header is one record).
REC = tl.constexpr(8)
#: Header fields.
H_ROWS = tl.constexpr(0)
H_REQUESTS_CAP = tl.constexpr(1)
H_RATIO = tl.constexpr(2)
H_NUM_SLOTS = tl.constexpr(3)
H_REQUESTS = tl.constexpr(4)
H_CLOSING = tl.constexpr(5)
H_VALID_ROWS = tl.constexpr(6)
H_FLAGS = tl.constexpr(7)
#: ``flags`` bit: the step has more requests than the plan holds (the extra rows were treated as padding).
FLAG_REQUEST_OVERFLOW = tl.constexpr(1)
#: ``flags`` bit: an ``out_slot`` of a group-closing row does not fit in int32 (the row writes nothing).
FLAG_SLOT_OVERFLOW = tl.constexpr(2)
#: ``flags`` bit: with an ``out_slot_map``, a group-closing row's ``out_slot`` index lies outside the map (the row
#: writes nothing).
FLAG_OUT_INDEX = tl.constexpr(4)

#: What a kernel needs to read the plan: the buffer, its rows ``T`` and its request capacity ``R``.
PlanRef = namedtuple("PlanRef", "ptr T R")
#: An engine's request-to-slot table for ``build_plan``: ``ptr[i * stride]`` is request ``i``'s state slot,
#: ``i < n``. The same shape serves ``out_slot_map`` (``ptr[i * stride]``: the output slot of index ``i``).
SlotMap = namedtuple("SlotMap", "ptr n stride")


def plan_numel(rows: int, requests: int, ratio: int) -> int:
    """int32 elements of a plan for ``rows`` rows and ``requests`` requests at ``ratio``."""
    return int(REC) * (1 + requests + rows + rows // ratio + requests)


def closing_capacity(rows: int, requests: int, ratio: int) -> int:
    """Length of the closing-row list: the most groups a step of ``rows`` rows and ``requests`` requests closes."""
    return rows // ratio + requests


# ---------------------------------------------------------------------------------------------------------------
# Readers (device side)
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _request_base(plan):
    return plan.ptr + REC


@triton.jit
def _row_base(plan):
    return plan.ptr + REC + REC * plan.R


@triton.jit
def _closing_base(plan):
    return plan.ptr + REC + REC * plan.R + REC * plan.T


@triton.jit
def row_record(plan, t):
    """``(position, slot, start, row0, end, out_slot, request index)`` of row ``t`` (``slot == -1``: padding)."""
    rec = _row_base(plan) + REC * t
    return (
        tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4), tl.load(rec + 5),
        tl.load(rec + 6),
    )  # fmt: skip


@triton.jit
def row_out_slot_ptr(plan, row0):
    """Pointer to ``out_slot`` of row ``row0``; row ``row0 + j`` is ``REC * j`` further."""
    return _row_base(plan) + REC * row0 + 5


@triton.jit
def row_arrivals_ptr(plan, t):
    """Pointer to ``arrivals`` of row ``t`` (0 between kernels)."""
    return _row_base(plan) + REC * t + 7


@triton.jit
def request_record(plan, k):
    """``(first row, slot, start, row0, end, first_out)`` of the ``k``-th request (first row ``-1``: none)."""
    rec = _request_base(plan) + REC * k
    return tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4), tl.load(rec + 5)


@triton.jit
def closing_record(plan, k):
    """``(row, position, slot, start, row0, end, out_slot, request index)`` of the ``k``-th group-closing row
    (row ``-1``: past the last one)."""
    rec = _closing_base(plan) + REC * k
    return (
        tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4), tl.load(rec + 5),
        tl.load(rec + 6), tl.load(rec + 7),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# build_plan
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _runs(pos_ptr, req_ptr, t, T, num_slots, smap, NEXT: tl.constexpr, MAP: tl.constexpr):
    """Per row of block ``t``: position, slot (int32), valid, starts a run, ends a run (``NEXT``; else all
    false, and the next rows are not read). With ``MAP`` (:func:`slot_map_mode`) a row's ``row_req`` is a
    request index and its slot ``smap``'s entry there (:data:`SlotMap`; an index outside it: padding): looked
    up (``MAP == 1``, a load that waits on the index's), or gathered from the whole table (``MAP`` entries,
    requested with the rows); for a scalar ``t`` (one row) only whether the index is inside the table (see
    below). A run is a stretch of rows of one ``row_req`` value with consecutive positions;
    neighbours are compared in the input dtype, so an int64 padding value never aliases a slot."""
    inb = t < T
    rq = tl.load(req_ptr + t, mask=inb, other=-1)
    pos = tl.load(pos_ptr + t, mask=inb, other=0)
    if MAP:
        mapped = inb & (rq >= 0) & (rq < smap.n)
        index = tl.where(mapped, rq, 0)
        if len(t.shape) == 0:
            # one row (the blocks build's last row of a block, asked only whether its run goes on past the
            # block): its slot is not read, since rows of one run share a request index and so a slot, and an
            # index inside the table stands for a valid row. An invalid entry there only sends the caller
            # looking for a run end past the block that no stored field uses; no load waits on the row's index.
            slot = tl.where(mapped, 0, -1)
        elif MAP >= 2:
            k = tl.arange(0, MAP)
            table = tl.load(smap.ptr + k * smap.stride, mask=k < smap.n, other=-1)
            slot = tl.where(mapped, tl.gather(table, index.to(tl.int32), 0), -1)
        else:
            slot = tl.load(smap.ptr + index * smap.stride, mask=mapped, other=-1)
    else:
        slot = rq
    valid = inb & (slot >= 0) & (slot < num_slots)
    has_prev = inb & (t > 0)
    rq_prev = tl.load(req_ptr + t - 1, mask=has_prev, other=-1)
    pos_prev = tl.load(pos_ptr + t - 1, mask=has_prev, other=0)
    same_prev = has_prev & (rq_prev == rq) & (pos_prev + 1 == pos)
    is_start = valid & (same_prev == 0)
    if NEXT:
        has_next = (t + 1) < T
        rq_next = tl.load(req_ptr + t + 1, mask=has_next, other=-1)
        pos_next = tl.load(pos_ptr + t + 1, mask=has_next, other=0)
        same_next = has_next & (rq_next == rq) & (pos + 1 == pos_next)
        is_last = valid & (same_next == 0)
    else:
        is_last = valid & (valid == 0)
    return pos.to(tl.int32), slot.to(tl.int32), valid, is_start, is_last


@triton.jit
def _store_record(ptr, f0, f1, f2, f3, f4, f5, f6, f7, rows, keep5):
    """Write 8-int records at ``ptr`` (a ``[BLOCK]`` tensor of record addresses; the fields ``[BLOCK]`` tensors)
    where ``rows``, field 5 only where ``keep5`` too: one 4-byte store per field, from the fields' own registers.
    (Packing a record into 16-byte stores moves the fields through shared memory to the store's layout, 8-12
    barriers per record list, and was slower: H200, docs/runs/tune_09f5859, tune_e850a21.)"""
    tl.store(ptr, f0, mask=rows)
    tl.store(ptr + 1, f1, mask=rows)
    tl.store(ptr + 2, f2, mask=rows)
    tl.store(ptr + 3, f3, mask=rows)
    tl.store(ptr + 4, f4, mask=rows)
    tl.store(ptr + 5, f5, mask=rows & keep5)
    tl.store(ptr + 6, f6, mask=rows)
    tl.store(ptr + 7, f7, mask=rows)


@triton.jit
def _slot_fits(out64):
    """Whether an engine's ``out_slot`` fits in the plan's int32 (``-1``: none)."""
    return (out64 >= -1) & (out64 < 2147483647)


@triton.jit
def _out_slots(out_ptr, omap, t, inb, closes, OUT_MAP: tl.constexpr):
    """``(out_slot as read, index outside the map)`` of rows ``t``: without ``OUT_MAP`` the rows' own
    ``out_slot`` (every row's, requested with the other inputs; only closing rows' are used); with it the
    output-slot table ``omap``'s (:data:`SlotMap`) entry at the row's ``out_slot``, looked up only where
    ``closes`` (``-1`` elsewhere and where the index lies outside the table, which the second value flags)."""
    raw = tl.load(out_ptr + t, mask=inb, other=-1)
    if OUT_MAP:
        index = raw.to(tl.int64)
        inside = (index >= 0) & (index < omap.n)
        out64 = tl.load(omap.ptr + tl.where(inside, index, 0) * omap.stride, mask=closes & inside, other=-1)
        return out64.to(tl.int64), closes & (inside == 0)
    else:
        return raw, inb & (inb == 0)


@triton.jit
def _pad_records(base, k, pad):
    """Mark records ``k`` (a tensor) of the list at ``base`` as padding (every field ``-1``) where ``pad``."""
    f = tl.arange(0, REC)[None, :]
    tl.store(base + REC * k[:, None] + f, tl.full([1, REC], -1, tl.int32), mask=pad[:, None])


@triton.jit
def _store_header(plan, num_slots, runs, closes, valid_rows, flags, RATIO: tl.constexpr):
    header = tl.arange(0, REC)
    values = tl.where(header == H_ROWS, plan.T, 0)
    values = tl.where(header == H_REQUESTS_CAP, plan.R, values)
    values = tl.where(header == H_RATIO, RATIO, values)
    values = tl.where(header == H_NUM_SLOTS, num_slots, values)
    values = tl.where(header == H_REQUESTS, runs, values)
    values = tl.where(header == H_CLOSING, closes, values)
    values = tl.where(header == H_VALID_ROWS, valid_rows, values)
    values = tl.where(header == H_FLAGS, flags, values)
    tl.store(plan.ptr + header, values)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _totals(runs0, closes0, valid0, flags0, runs1, closes1, valid1, flags1):
    return runs0 + runs1, closes0 + closes1, valid0 + valid1, flags0 | flags1


@triton.jit
def _scan3(run0, close0, start0, run1, close1, start1):
    return run0 + run1, close0 + close1, tl.maximum(start0, start1)


@triton.jit
def _store_rows(plan, t, inb, pos, slot, start, row0, end, out, run, cid, fits, is_start, closes_here,
                RATIO: tl.constexpr):  # fmt: skip
    """The records of rows ``t`` (a block, ``inb``: in the step): every row's, the request record at each
    request's first row, and the closing record of each group-closing row (``cid``: its index in the list)."""
    _store_record(
        _row_base(plan) + REC * t, pos, tl.where(fits, slot, -1), tl.where(fits, start, 0), tl.where(fits, row0, 0),
        tl.where(fits, end, 0), out, tl.where(fits, run, -1), run * 0, inb, inb,
    )  # fmt: skip
    # first_out is written by the request's first group-closing row (offset below r in its run) from the
    # out_slot it holds, so no load waits on the scans; the first row writes the other fields, and -1 there when
    # the request closes nothing in this step (the two stores never touch the same field: threads of a program
    # do not order their stores). The request may start in another program's block.
    first_close = closes_here & (pos - start < RATIO)
    tl.store(_request_base(plan) + REC * tl.where(first_close, run, 0) + 5, out, mask=first_close)
    at_start = is_start & fits
    closes_in_step = (start + RATIO - 1 - start % RATIO) < end
    _store_record(
        _request_base(plan) + REC * tl.where(at_start, run, 0), t, slot, pos, t, end, tl.full(t.shape, -1, tl.int32),
        run, run * 0, at_start, closes_in_step == 0,
    )  # fmt: skip
    _store_record(
        _closing_base(plan) + REC * tl.where(closes_here, cid, 0), t, pos, slot, start, row0, end, out, run,
        closes_here, closes_here,
    )  # fmt: skip


@triton.jit
def _build_plan_one_block_kernel(
    plan, pos_ptr, req_ptr, out_ptr, num_slots, smap, omap,
    RATIO: tl.constexpr, BLOCK: tl.constexpr, MAP: tl.constexpr, OUT_MAP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The whole plan of a step whose rows and requests fit one block, by one program
    (:func:`_build_plan_one_block`)."""
    wait_then_release(PDL)
    _build_plan_one_block(plan, pos_ptr, req_ptr, out_ptr, num_slots, smap, omap, RATIO, BLOCK, MAP, OUT_MAP)


@triton.jit
def _build_plan_one_block(plan, pos_ptr, req_ptr, out_ptr, num_slots, smap, omap, RATIO: tl.constexpr,
                          BLOCK: tl.constexpr, MAP: tl.constexpr, OUT_MAP: tl.constexpr):  # fmt: skip
    """The whole plan of a step whose rows and requests fit one block, in one pass from registers: a run's
    first row is a forward max-scan of run starts, its last row a backward min-scan of run ends, so nothing
    written is read back (one round trip to memory). Every count comes from those two scans and one
    multi-operand reduction: each scan or reduction across warps is a shared-memory round trip. The caller
    has waited (:func:`wait_then_release`). Returns, per row ``t`` of the block, what its records hold (a step's
    state rows are resolved from them, :mod:`.state_rows`): ``(pos, fits, slot, start, end, at_start, run,
    runs)``; ``fits`` marks the rows of the plan's requests (padding and overflow rows are not), ``at_start``
    a request's first row, ``run`` its request index, ``runs`` the step's requests."""
    T = plan.T
    R = plan.R
    t = tl.arange(0, BLOCK)
    inb = t < T
    pos, slot, valid, is_start, is_last = _runs(pos_ptr, req_ptr, t, T, num_slots, smap, True, MAP)
    # the closing index counts the valid rows' closings: the count of those that fit wherever it is used (see
    # _build_plan_blocks_kernel)
    closes_valid = valid & (pos % RATIO == RATIO - 1)
    # out_slot is [T]: read every row's with the other inputs, not after the scans (only closing rows' count);
    # an out_slot_map is looked up on the valid closing rows
    out64, outside = _out_slots(out_ptr, omap, t, inb, closes_valid, OUT_MAP)
    n_run, n_close, row0 = tl.associative_scan(
        (is_start.to(tl.int32), closes_valid.to(tl.int32), tl.where(is_start, t, -1)), 0, _scan3
    )
    last = tl.associative_scan(tl.where(is_last, t, BLOCK), 0, _min, reverse=True)
    run = n_run - 1
    fits = valid & (run < R)
    closes_here = fits & (pos % RATIO == RATIO - 1)
    cid = n_close - 1
    start = pos - (t - row0)
    end = pos + (last - t) + 1
    out_fits = _slot_fits(out64)
    runs, closes, valid_rows, flags = tl.reduce(
        (is_start.to(tl.int32), closes_here.to(tl.int32), fits.to(tl.int32),
         _bad_slot(closes_here, out64, outside)), 0, _totals,
    )  # fmt: skip
    flags |= tl.where(runs > R, FLAG_REQUEST_OVERFLOW, 0)
    out = tl.where(closes_here & out_fits, out64, -1).to(tl.int32)
    _store_rows(plan, t, inb, pos, slot, start, row0, end, out, run, cid, fits, is_start, closes_here, RATIO)
    _pad_records(_request_base(plan), t, (t < R) & (t >= runs))
    n_closing = T // RATIO + R
    for k0 in tl.static_range(0, 2 * BLOCK, BLOCK):  # n_closing <= T + R <= 2 * BLOCK
        k = k0 + t
        _pad_records(_closing_base(plan), k, (k < n_closing) & (k >= closes))
    _store_header(plan, num_slots, runs, closes, valid_rows, flags, RATIO)
    return pos, fits, slot, start, end, is_start & fits, run, runs


@triton.jit
def _counts(starts0, closes0, valid0, last0, flags0, starts1, closes1, valid1, last1, flags1):
    return starts0 + starts1, closes0 + closes1, valid0 + valid1, tl.maximum(last0, last1), flags0 | flags1


@triton.jit
def _bad_slot(closes, out64, outside):
    """Per row: :data:`FLAG_SLOT_OVERFLOW` where a closing row's ``out_slot`` does not fit in int32, or
    :data:`FLAG_OUT_INDEX` where its index lies outside the ``out_slot_map`` (``outside``), else 0."""
    overflow = tl.where(closes & (_slot_fits(out64) == 0), FLAG_SLOT_OVERFLOW, 0)
    return overflow | tl.where(closes & outside, FLAG_OUT_INDEX, 0)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _prefix_counts(pos_ptr, req_ptr, out_ptr, T, R, num_slots, smap, omap, end, RATIO: tl.constexpr,
                   CHUNK: tl.constexpr, MAP: tl.constexpr, OUT_MAP: tl.constexpr):  # fmt: skip
    """Over rows ``[0, end)``: ``(runs, closing rows that fit, valid rows that fit, the last run start (-1:
    none), flags)``, in chunks of ``CHUNK`` rows. Every valid row fits (its run is below R) until the R-th run:
    a chunk is counted in one multi-operand reduction, and scanned for its runs only when that run ends in it."""
    lane = tl.arange(0, CHUNK)
    runs = tl.zeros([], tl.int32)
    closes = tl.zeros([], tl.int32)
    valid_rows = tl.zeros([], tl.int32)
    last_start = tl.full([], -1, tl.int32)
    flags = tl.zeros([], tl.int32)
    for c in range(0, end, CHUNK):
        t = c + lane
        inb = t < end
        pos, slot, valid, is_start, _ = _runs(pos_ptr, req_ptr, t, T, num_slots, smap, False, MAP)
        valid = valid & inb
        is_start = is_start & inb
        closes_here = valid & (pos % RATIO == RATIO - 1)
        # with the other inputs: no second round trip (a map is looked up on the closing rows)
        out64, outside = _out_slots(out_ptr, omap, t, inb, closes_here, OUT_MAP)
        n_start, n_close, n_valid, last, bad = tl.reduce(
            (is_start.to(tl.int32), closes_here.to(tl.int32), valid.to(tl.int32), tl.where(is_start, t, -1),
             _bad_slot(closes_here, out64, outside)), 0, _counts,
        )  # fmt: skip
        if runs + n_start > R:  # rows of this chunk past the R-th run are padding
            fits = valid & (runs + tl.cumsum(is_start.to(tl.int32), 0) - 1 < R)
            closes_here = fits & (pos % RATIO == RATIO - 1)
            n_close = tl.sum(closes_here.to(tl.int32), 0)
            n_valid = tl.sum(fits.to(tl.int32), 0)
            bad = tl.reduce(_bad_slot(closes_here, out64, outside), 0, _or)
        runs += n_start
        closes += n_close
        valid_rows += n_valid
        last_start = tl.maximum(last_start, last)
        flags |= bad
    return runs, closes, valid_rows, last_start, flags


@triton.jit
def _runs_before(a_start0, a_close0, a_last0, a_start1, a_close1, a_last1):
    return a_start0 + a_start1, a_close0 + a_close1, tl.maximum(a_last0, a_last1)


@triton.jit
def _prefix_runs(pos_ptr, req_ptr, T, num_slots, smap, end, RATIO: tl.constexpr, CHUNK: tl.constexpr,
                 MAP: tl.constexpr):  # fmt: skip
    """Over rows ``[0, end)``: ``(runs, closing rows of valid rows, the last run start (-1: none))``, in chunks
    of ``CHUNK`` rows, each one three-operand reduction: what a block's program needs of the rows before it.
    (Closing rows past the R-th run are counted too: where a block's row fits, every row before it does, so the
    count equals the fitting rows' wherever it is used.)"""
    lane = tl.arange(0, CHUNK)
    runs = tl.zeros([], tl.int32)
    closes = tl.zeros([], tl.int32)
    last_start = tl.full([], -1, tl.int32)
    for c in range(0, end, CHUNK):
        t = c + lane
        inb = t < end
        pos, _slot, valid, is_start, _ = _runs(pos_ptr, req_ptr, t, T, num_slots, smap, False, MAP)
        n_start, n_close, last = tl.reduce(
            ((is_start & inb).to(tl.int32), (valid & inb & (pos % RATIO == RATIO - 1)).to(tl.int32),
             tl.where(is_start & inb, t, -1)), 0, _runs_before,
        )  # fmt: skip
        runs += n_start
        closes += n_close
        last_start = tl.maximum(last_start, last)
    return runs, closes, last_start


@triton.jit
def _build_plan_blocks_kernel(
    plan, pos_ptr, req_ptr, out_ptr, num_slots, smap, omap,
    RATIO: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, MAP: tl.constexpr, OUT_MAP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program per block of ``BLOCK`` rows, and one more, the last, for the header and the padding of the
    request and closing lists. A block's program counts the runs and closing rows before its block
    (:func:`_prefix_runs`, read from the inputs, not from other programs), scans its own rows, and looks past
    its block only for the end of a run that crosses it. The last program counts every row
    (:func:`_prefix_counts`: the header's counts and flags), so the header waits on no block's scans. Nothing is
    read that another program writes: deterministic, no atomics."""
    wait_then_release(PDL)
    T = plan.T
    R = plan.R
    if tl.program_id(0) == tl.num_programs(0) - 1:  # the header and the list padding
        runs, closes, valid_rows, _last, flags = _prefix_counts(
            pos_ptr, req_ptr, out_ptr, T, R, num_slots, smap, omap, T, RATIO, CHUNK, MAP, OUT_MAP
        )  # fmt: skip
        flags |= tl.where(runs > R, FLAG_REQUEST_OVERFLOW, 0)
        for k0 in range(0, R, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            _pad_records(_request_base(plan), k, (k < R) & (k >= runs))
        n_closing = T // RATIO + R
        for k0 in range(0, n_closing, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            _pad_records(_closing_base(plan), k, (k < n_closing) & (k >= closes))
        _store_header(plan, num_slots, runs, closes, valid_rows, flags, RATIO)
    else:
        b0 = tl.program_id(0) * BLOCK
        # the block's own rows are requested first, so their loads overlap the prefix's
        t = b0 + tl.arange(0, BLOCK)
        inb = t < T
        pos, slot, valid, is_start, is_last = _runs(pos_ptr, req_ptr, t, T, num_slots, smap, True, MAP)
        out64, _outside = _out_slots(out_ptr, omap, t, inb, valid & (pos % RATIO == RATIO - 1), OUT_MAP)
        runs0, closes0, start0 = _prefix_runs(pos_ptr, req_ptr, T, num_slots, smap, b0, RATIO, CHUNK, MAP)
        # run index, closing index and the run's first row in one scan; the closing index counts the valid
        # rows' closings, which is the count of those that fit wherever it is used: a row fits when its run is
        # below R, and runs only grow, so every row before a fitting row fits too
        closes_valid = valid & (pos % RATIO == RATIO - 1)
        n_run, n_close, row0 = tl.associative_scan(
            (is_start.to(tl.int32), closes_valid.to(tl.int32), tl.where(is_start, t, -1)), 0, _scan3
        )
        run = runs0 + n_run - 1
        fits = valid & (run < R)
        row0 = tl.maximum(row0, start0)
        closes_here = fits & (pos % RATIO == RATIO - 1)
        cid = closes0 + n_close - 1
        # the end of a run still open at the block's last row lies beyond it: the first run end after the block
        BIG: tl.constexpr = 2147483647
        last = tl.associative_scan(tl.where(is_last, t, BIG), 0, _min, reverse=True)
        # whether it does: the block's last row alone, as a scalar (no reduction over the block)
        _pos_b, _slot_b, valid_b, _start_b, last_b = _runs(
            pos_ptr, req_ptr, b0 + BLOCK - 1, T, num_slots, smap, True, MAP
        )
        crosses = valid_b & (last_b == 0)
        after = tl.full([], BIG, tl.int32)
        c = b0 + BLOCK
        while crosses & (after == BIG) & (c < T):
            tc = c + tl.arange(0, CHUNK)
            _p, _s, _v, _f, ends = _runs(pos_ptr, req_ptr, tc, T, num_slots, smap, True, MAP)
            after = tl.min(tl.where(ends, tc, BIG), 0)
            c += CHUNK
        last = tl.minimum(last, after)
        start = pos - (t - row0)
        end = pos + (last - t) + 1
        out = tl.where(closes_here & _slot_fits(out64), out64, -1).to(tl.int32)
        _store_rows(plan, t, inb, pos, slot, start, row0, end, out, run, cid, fits, is_start, closes_here, RATIO)


#: How ``launch_build_plan`` builds a plan by default: ``"blocks"`` (one program per block of rows,
#: :func:`blocks_config`), ``"one_block"`` (one program, one pass; up to 1,024 rows and requests), or
#: ``"auto"``: ``one_block`` for steps of up to :data:`PLAN_ONE_BLOCK_MAX_ROWS` rows and requests, else ``blocks``.
PLAN_KERNEL = "auto"
#: One program is faster than blocks at 64 rows, slower at 128 (H200, docs/runs/tune_791ebef).
PLAN_ONE_BLOCK_MAX_ROWS = 64


def blocks_config(rows: int) -> tuple[int, int, int]:
    """``(rows per program, warps, rows read at once before the block)`` of the ``blocks`` build for a step of
    ``rows`` rows:

    ===========  =====================
    rows         rows per block, warps
    ===========  =====================
    up to 256    32, 4
    up to 1,024  32, 8
    up to 4,096  64, 16
    more         128, 16
    ===========  =====================

    Smaller blocks mean more programs, each with fewer rows to scan and records to write, and the same prefix
    to count; past 4,096 rows the prefix reads of many programs cost more than that saves (H200,
    docs/runs/tune_791ebef). The chunk never exceeds the step (next power of two, at least 128): a smaller step
    reads no masked-off rows, which the header's program would otherwise pay for in every chunk it reads;
    chunks of 512 or 256 rows lose (docs/runs/tune_1bf5800)."""
    chunk = min(1024 if rows <= 2048 else 2048, max(128, triton.next_power_of_2(max(rows, 1))))
    if rows <= 256:
        return (32, 4, chunk)
    if rows <= 1024:
        return (32, 8, chunk)
    if rows <= 4096:
        return (64, 16, chunk)
    return (128, 16, chunk)


#: Request-to-slot tables of up to this many entries are read whole with the rows and gathered from (no load
#: waits on a row's index); longer ones are looked up row by row.
SLOT_GATHER_MAX = 4096


def slot_map_mode(req_state_slot) -> int:
    """The kernels' ``MAP``: 0 without a table, the table's entries rounded up to a power of two where it is
    gathered from (at most :data:`SLOT_GATHER_MAX`), else 1 (looked up)."""
    if req_state_slot is None:
        return 0
    n = req_state_slot.shape[0]
    return triton.next_power_of_2(n) if 2 <= n <= SLOT_GATHER_MAX else 1


def _slot_map(req_state_slot, row_req):
    """``(MAP, SlotMap)`` of a request-to-slot table (``None``: off)."""
    slot_map = slot_map_mode(req_state_slot)
    if slot_map:
        return slot_map, SlotMap(req_state_slot, req_state_slot.shape[0], req_state_slot.stride(0))
    return slot_map, SlotMap(row_req, 0, 0)  # not read (MAP is off): any pointer of the step stands in


def _out_map(out_slot_map, out_slot):
    """``(OUT_MAP, SlotMap)`` of an output-slot table (``None``: off)."""
    if out_slot_map is not None:
        return True, SlotMap(out_slot_map, out_slot_map.shape[0], out_slot_map.stride(0))
    return False, SlotMap(out_slot, 0, 0)  # not read (OUT_MAP is off)


def _kernel(kernel, rows: int, requests: int) -> str:
    """The build of a plan of ``requests`` requests for ``rows`` rows: ``kernel``, else :data:`PLAN_KERNEL`,
    with ``"auto"`` resolved by size."""
    kernel = PLAN_KERNEL if kernel is None else kernel
    if kernel == "auto":
        kernel = "one_block" if max(rows, requests) <= PLAN_ONE_BLOCK_MAX_ROWS else "blocks"
    return kernel


def _one_block_size(rows: int, requests: int) -> int:
    block = max(16, triton.next_power_of_2(max(rows, requests, 1)))
    if block > 1024:
        raise ValueError(f"kernel='one_block' holds up to 1,024 rows and requests, got {rows} rows, {requests}")
    return block


def launch_build_plan(plan, positions, row_req, out_slot, *, rows: int, requests: int, ratio: int, num_slots: int,
                      req_state_slot=None, out_slot_map=None, num_warps: int | None = None,
                      kernel: str | None = None,
                      block: int | None = None, chunk: int | None = None, pdl: bool = False):  # fmt: skip
    """Launch the plan build (:data:`PLAN_KERNEL` unless ``kernel`` says; ``block``, ``chunk`` and ``num_warps``
    override the defaults above). Arguments are validated by :func:`dsv4_compressor.ops.build_plan`."""
    ref = PlanRef(plan, rows, requests)
    slot_map, smap = _slot_map(req_state_slot, row_req)
    out_map, omap = _out_map(out_slot_map, out_slot)
    kernel = _kernel(kernel, rows, requests)
    if kernel == "blocks":
        auto_block, auto_warps, auto_chunk = blocks_config(rows)
        block = block or auto_block
        grid = (triton.cdiv(max(rows, 1), block) + 1,)  # the blocks, and the header's program
        _build_plan_blocks_kernel[grid](
            ref, positions, row_req, out_slot, num_slots, smap, omap, RATIO=ratio, BLOCK=block,
            CHUNK=chunk or auto_chunk, MAP=slot_map, OUT_MAP=out_map, num_warps=num_warps or auto_warps,
            **launch_options(pdl, grid[0]),
        )  # fmt: skip
        return
    if kernel != "one_block":
        raise ValueError(f"kernel must be 'auto', 'blocks' or 'one_block', got {kernel!r}")
    block = _one_block_size(rows, requests)
    _build_plan_one_block_kernel[(1,)](
        ref, positions, row_req, out_slot, num_slots, smap, omap, RATIO=ratio, BLOCK=block, MAP=slot_map,
        OUT_MAP=out_map, num_warps=num_warps or (4 if block <= 256 else 8), **launch_options(pdl, 1),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# check_plan: the device-side validator
# ---------------------------------------------------------------------------------------------------------------
#: Error codes ``check_plan`` writes to ``err[0]`` (``err = [code, request index, slot, value]``).
PLAN_OK = tl.constexpr(0)
ERR_REQUEST_OVERFLOW = tl.constexpr(1)  # value: requests in the step
ERR_SLOT_OVERFLOW = tl.constexpr(2)  # an out_slot does not fit in int32
ERR_REQUEST_TWICE = tl.constexpr(3)  # a slot has two runs of rows: rows not contiguous, or positions not consecutive
ERR_BEYOND_ROPE = tl.constexpr(4)  # value: the request's last position
ERR_START = tl.constexpr(5)  # value: the request's start; outside [L - mtp_step, L] for the state's length L
ERR_DECODE_ROWS = tl.constexpr(6)  # value: rows of the request; more than mtp_step + 1 in a decode step
ERR_NEGATIVE_POSITION = tl.constexpr(7)  # value: the request's start
ERR_OUT_SLOT = tl.constexpr(8)  # value: an entry's out_slot, at or beyond the outputs' slots
ERR_OUT_INDEX = tl.constexpr(9)  # an out_slot index outside the out_slot_map (checked with the flags, after 2)


@triton.jit
def _first_error(err_code, err_k, bad, k, code):
    """Keep the first error in (code order, request order): ``bad`` flags requests ``k`` failing ``code``."""
    first_k = tl.min(tl.where(bad, k, 2147483647), 0)
    take = (err_code == 0) & (first_k < 2147483647)
    return tl.where(take, code, err_code), tl.where(take, first_k, err_k)


@triton.jit
def _check_plan_kernel(
    plan, lengths_ptr, err_ptr, mtp_step, max_positions, out_slots,
    HAS_LENGTHS: tl.constexpr, DECODE: tl.constexpr, OUT_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_then_release(PDL)
    R = plan.R
    plan_ptr = plan.ptr
    reqs = _request_base(plan)
    lane = tl.arange(0, BLOCK)
    flags = tl.load(plan_ptr + H_FLAGS)
    n_req = tl.load(plan_ptr + H_REQUESTS)
    code = tl.where((flags & FLAG_REQUEST_OVERFLOW) != 0, ERR_REQUEST_OVERFLOW, 0)
    code = tl.where((code == 0) & ((flags & FLAG_SLOT_OVERFLOW) != 0), ERR_SLOT_OVERFLOW, code)
    code = tl.where((code == 0) & ((flags & FLAG_OUT_INDEX) != 0), ERR_OUT_INDEX, code)
    kbad = tl.where(code == ERR_REQUEST_OVERFLOW, R, -1)
    for pass_code in tl.static_range(3, 8):
        for k0 in range(0, R, BLOCK):
            k = k0 + lane
            live = (k < R) & (k < n_req)
            rec = reqs + REC * k
            slot = tl.load(rec + 1, mask=live, other=-1)
            start = tl.load(rec + 2, mask=live, other=0)
            end = tl.load(rec + 4, mask=live, other=0)
            if pass_code == ERR_REQUEST_TWICE:
                bad = live & (live == 0)
                for j0 in range(0, R, BLOCK):
                    j = j0 + lane
                    other = tl.load(reqs + REC * j + 1, mask=(j < R) & (j < n_req), other=-2)
                    dup = (slot[:, None] == other[None, :]) & (k[:, None] != j[None, :])
                    bad = bad | (tl.max(dup.to(tl.int32), 1) > 0)
            elif pass_code == ERR_BEYOND_ROPE:
                bad = live & (end > max_positions)
            elif pass_code == ERR_START:
                bad = live & (live == 0)
                if HAS_LENGTHS:
                    length = tl.load(lengths_ptr + slot, mask=live, other=0).to(tl.int32)
                    bad = live & (start != 0) & ((start > length) | (start < length - mtp_step))
            elif pass_code == ERR_DECODE_ROWS:
                bad = live & (live == 0)
                if DECODE:
                    bad = live & (end - start > mtp_step + 1)
            else:
                bad = live & (start < 0)
            code, kbad = _first_error(code, kbad, bad, k, pass_code)
    bad_out = tl.full([], -1, tl.int32)
    if OUT_SLOTS:
        # the closing list, in order: the first entry whose slot the outputs do not have
        n_close = tl.load(plan_ptr + H_CLOSING)
        first_c = tl.full([], 2147483647, tl.int32)
        for c0 in range(0, n_close, BLOCK):
            c = c0 + lane
            live = c < n_close
            out = tl.load(_closing_base(plan) + REC * c + 6, mask=live, other=-1)
            first_c = tl.minimum(first_c, tl.min(tl.where(live & (out >= out_slots), c, 2147483647), 0))
        found = (code == 0) & (first_c < 2147483647)
        rec_c = _closing_base(plan) + REC * tl.where(found, first_c, 0)
        code = tl.where(found, ERR_OUT_SLOT, code)
        kbad = tl.where(found, tl.load(rec_c + 7), kbad)
        bad_out = tl.where(found, tl.load(rec_c + 6), -1)
    has_k = (kbad >= 0) & (kbad < R)
    rec = reqs + REC * tl.where(has_k, kbad, 0)
    slot = tl.where(has_k, tl.load(rec + 1, mask=has_k, other=-1), -1)
    start = tl.load(rec + 2, mask=has_k, other=0)
    end = tl.load(rec + 4, mask=has_k, other=0)
    value = tl.where(code == ERR_REQUEST_OVERFLOW, n_req, 0)
    value = tl.where(code == ERR_BEYOND_ROPE, end - 1, value)
    value = tl.where((code == ERR_START) | (code == ERR_NEGATIVE_POSITION), start, value)
    value = tl.where(code == ERR_DECODE_ROWS, end - start, value)
    value = tl.where(code == ERR_OUT_SLOT, bad_out, value)
    out = tl.arange(0, 4)
    vals = tl.where(out == 0, code, tl.where(out == 1, tl.where(has_k, kbad, -1), tl.where(out == 2, slot, value)))
    tl.store(err_ptr + out, vals)


def launch_check_plan(plan, lengths, err, *, rows: int, requests: int, mtp_step: int, max_positions: int, decode,
                      out_slots: int | None = None, pdl: bool = False):  # fmt: skip
    """``out_slots``: check every entry's ``out_slot`` against it (``None``: not checked); the closing list
    is found from ``rows``, the plan's ``T``."""
    block = min(128, max(16, triton.next_power_of_2(max(requests, 1))))
    _check_plan_kernel[(1,)](
        PlanRef(plan, rows, requests), lengths if lengths is not None else err, err, mtp_step, max_positions,
        0 if out_slots is None else out_slots, HAS_LENGTHS=lengths is not None, DECODE=bool(decode),
        OUT_SLOTS=out_slots is not None, BLOCK=block, num_warps=4, **launch_options(pdl, 1),
    )  # fmt: skip


__all__ = [
    "REC",
    "PlanRef",
    "SlotMap",
    "plan_numel",
    "closing_capacity",
    "row_record",
    "row_out_slot_ptr",
    "row_arrivals_ptr",
    "request_record",
    "closing_record",
    "launch_build_plan",
    "launch_check_plan",
]
