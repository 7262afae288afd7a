"""Single-stage compress: one program per row loads its whole window, pools, normalizes, rotates and packs.

Used for CSA and the indexer (windows of 8 rows), and for HCA when no scratch is given: there one program
holds a 128 x 512 float32 window twice (values and gate logits), far more than a multiprocessor's registers,
so the compiler spills to local memory; that is the cost the tiled kernel in :mod:`.c128_tiled`
removes.
"""

import triton
import triton.language as tl

from .entry_pack import finish_entry, finish_entry_with, finish_inputs
from .pdl import launch_options, wait_after_record, wait_before_record
from .plan import REC, closing_capacity, closing_record, request_record, row_out_slot_ptr, row_record
from .ring import (
    ape_bias,
    load_saved_row,
    needs_bias,
    ring_row_ptr,
    save_block,
    save_row,
    saved_values,
    slot_in_state,
    window_row_ptrs,
)  # fmt: skip

#: Largest window (rows x channels, padded) around which loads are issued early (see the kernel): CSA's 8 x 512
#: and the indexer's 8 x 128 are; HCA's 128 x 512 is not: around that spilling window the early values are
#: spilled too, and the step got slower (H200, bench 3367c94, VALIDATION.md stop 14).
EARLY_LOADS_MAX_CELLS = tl.constexpr(4096)


@triton.jit
def _pool_window(ptrs, half, chan, cmask, row_ok, biased, q, ape, RATIO: tl.constexpr, HEAD: tl.constexpr,
                 WIDTH: tl.constexpr):  # fmt: skip
    """Per-channel softmax pooling over the window for the channels ``chan``; window row ``j`` reads its half
    ``half[j]`` (overlap: 0 = the previous group's, 1 = its own) and adds the APE bias where ``biased``."""
    cols = (half * HEAD)[:, None] + chan[None, :]
    mask = row_ok[:, None] & cmask[None, :]
    kv = tl.load(ptrs[:, None] + cols, mask=mask, other=0.0)
    score = tl.load(ptrs[:, None] + WIDTH + cols, mask=mask, other=0.0)
    score += ape_bias(ape, q[:, None], half[:, None], chan[None, :], mask & biased[:, None], RATIO)
    score = tl.where(row_ok[:, None], score, float("-inf"))  # absent rows get weight 0
    e = tl.exp(score - tl.max(score, axis=0)[None, :])
    return tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)


@triton.jit
def _pooled(kv, state, ape, pos, slot, start, row0, k, E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr,
            OVERLAP: tl.constexpr, BLOCK_WIN: tl.constexpr):  # fmt: skip
    """The pooled vector (``BLOCK_HEAD`` values in channel order, zeros past ``H``) of the group closing at
    position ``pos`` (``k``-th request): its window loaded whole and reduced; no store."""
    WINDOW: tl.constexpr = RATIO * (2 if OVERLAP else 1)
    WIDTH: tl.constexpr = E.HEAD * (2 if OVERLAP else 1)
    j = tl.arange(0, BLOCK_WIN)
    q = pos - WINDOW + 1 + j
    ptrs, new, present = window_row_ptrs(q, kv, state, slot, k, start, row0, SM, WINDOW)
    row_ok = present & (j < WINDOW)
    biased = needs_bias(new, SM)
    # With overlap the first r window rows are the previous group: their [0, H) halves count.
    half = tl.where(OVERLAP & (j >= RATIO), 1, 0)
    # every channel in one tile, in channel order: contiguous loads, one reduction per window
    ch = tl.arange(0, E.BLOCK_HEAD)
    c = _pool_window(ptrs, half, ch, ch < E.HEAD, row_ok, biased, q, ape, RATIO, E.HEAD, WIDTH)
    return tl.where(ch < E.HEAD, c, 0.0)


@triton.jit
def _entry(kv, state, ape, prm, out, pos, slot, start, row0, k, out_slot, E: tl.constexpr, SM: tl.constexpr,
           RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_WIN: tl.constexpr, EARLY: tl.constexpr,
           FINISH_FIRST: tl.constexpr):  # fmt: skip
    """Pool the window of the group-closing row at position ``pos`` (``k``-th request) and write its entry to
    ``out_slot``."""
    if EARLY:
        w, cos, sin = finish_inputs(prm, pos - RATIO + 1, E)
        if FINISH_FIRST:  # a barrier: ptxas otherwise sinks these loads to their use, after the window arrived
            tl.debug_barrier()
    c = _pooled(kv, state, ape, pos, slot, start, row0, k, E, SM, RATIO, OVERLAP, BLOCK_WIN)
    if EARLY:
        finish_entry_with(c, out_slot, w, cos, sin, prm, out, E)
    else:
        finish_entry(c, out_slot, pos - RATIO + 1, prm, out, E)


@triton.jit
def _reads_state(pos, start, WINDOW: tl.constexpr):
    """Whether the window of the closing row at ``pos`` reads a row from the state: a position in
    ``[0, start)``."""
    return (start > 0) & (pos - WINDOW + 1 < start)


@triton.jit
def _request_program(kv, state, ape, plan, prm, out, k, E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr,
                     OVERLAP: tl.constexpr, BLOCK_WIN: tl.constexpr, EARLY: tl.constexpr,
                     FINISH_FIRST: tl.constexpr, SAVE_BLOCK: tl.constexpr, SAVE_ROWS_AT_ONCE: tl.constexpr):  # fmt: skip
    """Ring mode, a step that is not decode: request ``k``'s entries whose windows read its ring, then its
    saved rows (its last ``RING`` rows of the step). The windows' rows are in registers and reduced across the
    program before the barrier, so no save overwrites a ring row they still read; no other program reads
    this request's ring."""
    WINDOW: tl.constexpr = RATIO * (2 if OVERLAP else 1)
    WIDTH: tl.constexpr = E.HEAD * (2 if OVERLAP else 1)
    first, slot, start, row0, end, first_out = request_record(plan, k)
    if (first >= 0) & slot_in_state(state, slot, SM):
        first_close = start + (RATIO - 1 - start % RATIO)
        outs_ptr = row_out_slot_ptr(plan, row0)  # out_slot of this request's rows, REC ints apart
        # a window reaches back at most WINDOW - 1 rows, so only the first ceil((WINDOW - 1) / r) closing rows
        for i in tl.static_range(0, (WINDOW - 1 + RATIO - 1) // RATIO):
            pos = first_close + i * RATIO
            if (pos < end) & _reads_state(pos, start, WINDOW):
                out_slot = tl.load(outs_ptr + REC * (pos - start))
                if out_slot >= 0:
                    _entry(kv, state, ape, prm, out, pos, slot, start, row0, k, out_slot, E, SM, RATIO, OVERLAP,
                           BLOCK_WIN, EARLY, FINISH_FIRST)  # fmt: skip
        tl.debug_barrier()
        # the last RING rows the request brought, SAVE_ROWS_AT_ONCE rows per round trip
        rows = tl.arange(0, SAVE_ROWS_AT_ONCE)[:, None]
        for p0 in range(tl.maximum(start, end - SM.RING), end, SAVE_ROWS_AT_ONCE):
            p = p0 + rows
            dst = ring_row_ptr(state, slot, p, SM.RING)
            for c0 in tl.static_range(0, 2 * WIDTH, SAVE_BLOCK):
                cols = c0 + tl.arange(0, SAVE_BLOCK)[None, :]
                mask = (p < end) & (cols < 2 * WIDTH)
                values = saved_values(kv, ape, row0 + (p - start), p, cols, mask, RATIO, E.HEAD, WIDTH, SM)
                tl.store(dst + cols, values, mask=mask)


@triton.jit
def _compress_single_kernel(
    kv, state, ape, plan, prm, out,
    E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_WIN: tl.constexpr,
    SAVE_ROWS: tl.constexpr, SAVE_BLOCK: tl.constexpr, CLOSING_GRID: tl.constexpr, REQUEST_SAVES: tl.constexpr,
    SAVE_ROWS_AT_ONCE: tl.constexpr, FINISH_FIRST: tl.constexpr, PDL: tl.constexpr, RECORD_FIRST: tl.constexpr,
):  # fmt: skip
    # RECORD_FIRST: the plan record is read before the PDL wait (kernels/pdl.py). Only in launches that release
    # the next kernel at their start (PDL == 2: small grids), whose successors' programs then read theirs while
    # this one runs; in launches released at their exit it was slower (H200, docs/runs/tune_db16a26).
    wait_before_record(PDL, RECORD_FIRST)
    WINDOW: tl.constexpr = RATIO * (2 if OVERLAP else 1)
    WIDTH: tl.constexpr = E.HEAD * (2 if OVERLAP else 1)
    # Everything that depends only on the record is requested before anything waits for memory: the row to save
    # and the finish's norm weight and rope row travel with the window (after the pooling, each would add a
    # memory round trip to the program's chain). Not around a window that spills (HCA's 128 rows): there the
    # early values are spilled, so the program waits for them before its window.
    EARLY: tl.constexpr = BLOCK_WIN * E.BLOCK_HEAD <= EARLY_LOADS_MAX_CELLS
    record = tl.program_id(0)
    if REQUEST_SAVES:  # programs [0, R) are the request programs, the closing list's follow
        record -= plan.R
        if record < 0:
            wait_after_record(PDL, RECORD_FIRST)
            _request_program(kv, state, ape, plan, prm, out, tl.program_id(0), E, SM, RATIO, OVERLAP, BLOCK_WIN, EARLY,
                             FINISH_FIRST, SAVE_BLOCK, SAVE_ROWS_AT_ONCE)  # fmt: skip
            return
    if CLOSING_GRID:
        # one program per record of the closing list (padding records: row and out_slot -1)
        t, pos, slot, start, row0, end, out_slot, k = closing_record(plan, record)
    else:
        t = record
        pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
    wait_after_record(PDL, RECORD_FIRST)
    EARLY_SAVE: tl.constexpr = EARLY and SAVE_ROWS and 2 * WIDTH <= SAVE_BLOCK
    if EARLY_SAVE:
        saved, saved_at, save_mask = load_saved_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, WIDTH, SM,
                                                    SAVE_BLOCK)  # fmt: skip
    closes = (out_slot >= 0) & slot_in_state(state, slot, SM)  # this row closes group pos // r
    if REQUEST_SAVES:
        closes = closes & (_reads_state(pos, start, WINDOW) == 0)  # else its request program's, before the save
    if closes:
        _entry(kv, state, ape, prm, out, pos, slot, start, row0, k, out_slot, E, SM, RATIO, OVERLAP, BLOCK_WIN, EARLY,
               FINISH_FIRST)  # fmt: skip
    if EARLY_SAVE:
        tl.store(saved_at, saved, mask=save_mask)
    elif SAVE_ROWS:
        save_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, WIDTH, SM, SAVE_BLOCK)


#: Whether steps that do not save rows in-kernel (prefill, mixed) launch over the closing list by default: rows
#: that close nothing then cost no program (H200, 8K indexer prefill 20% faster, docs/runs/tune_e6c3275).
PREFILL_CLOSING_GRID = True


def save_rows_at_once(ring: int, width: int, num_warps: int) -> int:
    """Rows a request program saves per round trip: the ring's rows, at most 64 float32 values per thread."""
    return max(1, min(triton.next_power_of_2(ring), 64 * 32 * num_warps // save_block(width)))


def launch_compress_single(kv, state, ape, plan, prm, out, meta, sm, *, ratio: int, overlap: bool, save_rows: bool,
                           request_saves: bool = False, num_warps: int | None = None, closing_grid: bool | None = None,
                           maxnreg: int | None = None, finish_first: bool | None = None, pdl: bool = False,
                           record_first: bool = False) -> None:  # fmt: skip
    """One program per row of the step. ``save_rows=True`` also saves the ring rows in the same launch; valid
    only when every request brings at most ``mtp_step + 1`` rows (decode / verify), so no saved row overwrites
    one a window still reads. ``request_saves=True`` (ring mode, any step) puts one program per request in front
    of the grid: it computes the request's entries whose windows read its ring, then saves its last ``RING``
    rows, so no separate :func:`~.ring.launch_ring_save` is needed; without either the ring is not written.
    ``closing_grid`` (only without ``save_rows``) launches one program per record of the plan's closing list
    (``T // r + R``) instead of one per row, so a prefill chunk's rows that close nothing cost no program
    (``None``: :data:`PREFILL_CLOSING_GRID` for steps without ``save_rows``). ``maxnreg`` caps the registers
    per thread (more programs per multiprocessor; the compiler's choice when ``None``). ``finish_first``
    requests the finish's inputs before the window, behind a barrier (else ptxas issues them once the window
    has arrived); ``None``: for steps that do not save rows, with windows of at most
    :data:`EARLY_LOADS_MAX_CELLS`: faster for prefill, slower for decode steps (H200, docs/runs/tune_dea6acf).
    ``record_first``: the programs may read their plan records before their
    PDL wait (:mod:`.pdl`; only launches releasing the next kernel at their start do)."""
    if plan.T == 0:
        return
    if request_saves and (save_rows or sm.TABLE):
        raise ValueError("request_saves saves a ring's last rows in a step that does not save them per row "
                         "(save_rows=False, ring mode)")  # fmt: skip
    block_win = triton.next_power_of_2(ratio * (2 if overlap else 1))
    width = meta.HEAD * (2 if overlap else 1)
    if num_warps is None:
        # One warp for the indexer's 8 x 128 window: with more, the window's rows are split across warps and
        # every reduction over them crosses shared memory (4 warps measured 2.2x slower at B = 256).
        cells = block_win * meta.HEAD
        num_warps = 8 if cells >= 16384 else (4 if cells > 1024 else 1)
    if closing_grid is None:
        closing_grid = PREFILL_CLOSING_GRID and not save_rows
    if finish_first is None:
        finish_first = not save_rows and block_win * meta.BLOCK_HEAD <= int(EARLY_LOADS_MAX_CELLS)
    if closing_grid and save_rows:
        raise ValueError("closing_grid launches no program for rows that close nothing, so it cannot save rows")
    programs = closing_capacity(plan.T, plan.R, ratio) if closing_grid else plan.T
    grid = (programs + (plan.R if request_saves else 0),)
    launch = launch_options(pdl, grid[0])
    _compress_single_kernel[grid](
        kv, state, ape, plan, prm, out, meta, sm, RATIO=ratio, OVERLAP=overlap, BLOCK_WIN=block_win,
        SAVE_ROWS=save_rows, SAVE_BLOCK=save_block(width), CLOSING_GRID=closing_grid, REQUEST_SAVES=request_saves,
        SAVE_ROWS_AT_ONCE=save_rows_at_once(sm.RING, width, num_warps), FINISH_FIRST=finish_first,
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}),
        RECORD_FIRST=record_first and launch["PDL"] == 2, **launch,
    )  # fmt: skip


@triton.jit
def _compress_pair_kernel(
    kv, state, ape, prm, out, kv2, state2, ape2, prm2, out2, plan,
    E: tl.constexpr, SM: tl.constexpr, E2: tl.constexpr, SM2: tl.constexpr, RATIO: tl.constexpr,
    BLOCK_WIN: tl.constexpr, SAVE_BLOCK: tl.constexpr, SAVE_BLOCK2: tl.constexpr, PDL: tl.constexpr,
    RECORD_FIRST: tl.constexpr,
):  # fmt: skip
    """A decode step of two compressors on one plan (a CSA layer's main compressor and its indexer), one
    program per row: both windows and both saved rows are requested before anything is stored, so the two
    compressors' memory round trips overlap instead of following each other."""
    wait_before_record(PDL, RECORD_FIRST)
    t = tl.program_id(0)
    pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
    wait_after_record(PDL, RECORD_FIRST)
    saved, saved_at, save_mask = load_saved_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, 2 * E.HEAD, SM,
                                                SAVE_BLOCK)  # fmt: skip
    saved2, saved_at2, save_mask2 = load_saved_row(kv2, state2, ape2, t, pos, slot, end, RATIO, E2.HEAD,
                                                   2 * E2.HEAD, SM2, SAVE_BLOCK2)  # fmt: skip
    closes = (out_slot >= 0) & slot_in_state(state, slot, SM)
    closes2 = (out_slot >= 0) & slot_in_state(state2, slot, SM2)
    if closes | closes2:
        w, cos, sin = finish_inputs(prm, pos - RATIO + 1, E)
        w2, cos2, sin2 = finish_inputs(prm2, pos - RATIO + 1, E2)
        c = _pooled(kv, state, ape, pos, slot, start, row0, k, E, SM, RATIO, True, BLOCK_WIN)
        c2 = _pooled(kv2, state2, ape2, pos, slot, start, row0, k, E2, SM2, RATIO, True, BLOCK_WIN)
        if closes:
            finish_entry_with(c, out_slot, w, cos, sin, prm, out, E)
        if closes2:
            finish_entry_with(c2, out_slot, w2, cos2, sin2, prm2, out2, E2)
    tl.store(saved_at, saved, mask=save_mask)
    tl.store(saved_at2, saved2, mask=save_mask2)


def pairs_in_one_launch(head: int, head2: int) -> bool:
    """Whether :func:`launch_compress_pair` takes two overlapping compressors of these head dims (each saved row
    fits one block of the save, requested with the windows)."""
    return all(4 * h <= save_block(2 * h) for h in (head, head2))


def launch_compress_pair(first, second, plan, *, ratio: int, pdl: bool = False, record_first: bool = False) -> None:
    """A decode step of two overlapping compressors on one plan in one launch, one program per row (4 warps);
    ``first`` and ``second`` are each ``(kv, state, ape, prm, out, meta, sm)`` as :func:`launch_compress_single`
    takes them. Writes what :func:`launch_compress_single` with ``save_rows=True`` writes for each."""
    if plan.T == 0:
        return
    kv, state, ape, prm, out, meta, sm = first
    kv2, state2, ape2, prm2, out2, meta2, sm2 = second
    if not pairs_in_one_launch(meta.HEAD, meta2.HEAD):
        raise ValueError(f"head dims {meta.HEAD} and {meta2.HEAD}: a saved row does not fit one save block")
    launch = launch_options(pdl, plan.T)
    _compress_pair_kernel[(plan.T,)](
        kv, state, ape, prm, out, kv2, state2, ape2, prm2, out2, plan, meta, sm, meta2, sm2, RATIO=ratio,
        BLOCK_WIN=triton.next_power_of_2(2 * ratio), SAVE_BLOCK=save_block(2 * meta.HEAD),
        SAVE_BLOCK2=save_block(2 * meta2.HEAD), num_warps=4, RECORD_FIRST=record_first and launch["PDL"] == 2,
        **launch,
    )  # fmt: skip


__all__ = ["launch_compress_single", "launch_compress_pair", "pairs_in_one_launch"]
