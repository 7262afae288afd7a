"""Single-stage compress: one program per row loads its whole window, pools, normalizes, rotates and packs.

Used for CSA and the indexer (windows of 8 rows), and for HCA when no scratch is given: there one program
holds a 128 x 512 float32 window twice (values and gate logits), far more than a multiprocessor's registers,
so the compiler spills to local memory; that is the cost the two-stage kernel in :mod:`.c128_two_stage`
removes.
"""

import triton
import triton.language as tl

from .entry_pack import finish_entry, finish_entry_with, finish_inputs
from .pdl import launch_options, wait_then_release
from .plan import closing_capacity, closing_record, row_record
from .ring import ape_bias, load_saved_row, needs_bias, save_block, save_row, slot_in_state, window_row_ptrs

#: Largest window (rows x channels, padded) around which loads are issued early (see the kernel): CSA's 8 x 512
#: and the indexer's 8 x 128 are; HCA's 128 x 512 is not (H200, HCA single-stage decode, B = 256, no group
#: closing: 3.87 -> 5.09 us cold with the saved row loaded early; docs/runs/bench_3367c94).
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
def _compress_single_kernel(
    kv, state, ape, plan, prm, out,
    E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_WIN: tl.constexpr,
    SAVE_ROWS: tl.constexpr, SAVE_BLOCK: tl.constexpr, CLOSING_GRID: tl.constexpr, FINISH_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_then_release(PDL)
    WINDOW: tl.constexpr = RATIO * (2 if OVERLAP else 1)
    WIDTH: tl.constexpr = E.HEAD * (2 if OVERLAP else 1)
    if CLOSING_GRID:
        # one program per record of the closing list (padding records: row and out_slot -1)
        t, pos, slot, start, row0, end, out_slot, k = closing_record(plan, tl.program_id(0))
    else:
        t = tl.program_id(0)
        pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
    # Everything that depends only on the record is requested before anything waits for memory: the row to save
    # and the finish's norm weight and rope row travel with the window (after the pooling, each would add a
    # memory round trip to the program's chain). Not around a window that spills (HCA's 128 rows): there the
    # early values are spilled, so the program waits for them before its window.
    EARLY: tl.constexpr = BLOCK_WIN * E.BLOCK_HEAD <= EARLY_LOADS_MAX_CELLS
    EARLY_SAVE: tl.constexpr = EARLY and SAVE_ROWS and 2 * WIDTH <= SAVE_BLOCK
    if EARLY_SAVE:
        saved, saved_at, save_mask = load_saved_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, WIDTH, SM,
                                                    SAVE_BLOCK)  # fmt: skip
    if (out_slot >= 0) & slot_in_state(state, slot, SM):  # this row closes group pos // r
        if EARLY:
            w, cos, sin = finish_inputs(prm, pos - RATIO + 1, E)
            if FINISH_FIRST:  # a barrier: ptxas otherwise sinks these loads to their use, after the window arrived
                tl.debug_barrier()
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
        if EARLY:
            finish_entry_with(tl.where(ch < E.HEAD, c, 0.0), out_slot, w, cos, sin, prm, out, E)
        else:
            finish_entry(tl.where(ch < E.HEAD, c, 0.0), out_slot, pos - RATIO + 1, prm, out, E)
    if EARLY_SAVE:
        tl.store(saved_at, saved, mask=save_mask)
    elif SAVE_ROWS:
        save_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, WIDTH, SM, SAVE_BLOCK)


#: Whether steps that do not save rows in-kernel (prefill, mixed) launch over the closing list by default.
#: H200, 8K prefill chunk (docs/runs/tune_e6c3275): indexer 26.6 -> 21.4 us, CSA unchanged.
PREFILL_CLOSING_GRID = True


def launch_compress_single(kv, state, ape, plan, prm, out, meta, sm, *, ratio: int, overlap: bool, save_rows: bool,
                           num_warps: int | None = None, closing_grid: bool | None = None,
                           maxnreg: int | None = None, finish_first: bool | None = None, pdl: bool = False) -> None:  # fmt: skip
    """One program per row of the step. ``save_rows=True`` also saves the ring rows in the same launch; valid
    only when every request brings at most ``mtp_step + 1`` rows (decode / verify), so no saved row overwrites
    one a window still reads. ``closing_grid`` (only without ``save_rows``) launches one program per record of the
    plan's closing list (``T // r + R``) instead of one per row, so a prefill chunk's rows that close nothing
    cost no program (``None``: :data:`PREFILL_CLOSING_GRID` for steps without ``save_rows``). ``maxnreg`` caps
    the registers per thread (more programs per multiprocessor; the compiler's choice when ``None``).
    ``finish_first`` requests the finish's inputs before the window, behind a barrier (else ptxas issues them
    once the window has arrived); ``None``: for steps that do not save rows, with windows of at most
    :data:`EARLY_LOADS_MAX_CELLS`. H200, cold (docs/runs/tune_dea6acf): CSA 8K prefill 26.0 -> 24.8 us; decode
    steps 0.03-0.15 us slower with it."""
    if plan.T == 0:
        return
    block_win = triton.next_power_of_2(ratio * (2 if overlap else 1))
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
    grid = (closing_capacity(plan.T, plan.R, ratio),) if closing_grid else (plan.T,)
    _compress_single_kernel[grid](
        kv, state, ape, plan, prm, out, meta, sm, RATIO=ratio, OVERLAP=overlap, BLOCK_WIN=block_win,
        SAVE_ROWS=save_rows, SAVE_BLOCK=save_block(meta.HEAD * (2 if overlap else 1)), CLOSING_GRID=closing_grid,
        FINISH_FIRST=finish_first, num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}), **launch_options(pdl, grid[0]),
    )  # fmt: skip


__all__ = ["launch_compress_single"]
