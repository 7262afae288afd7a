"""The tiled C128 (HCA) kernel (SPEC section 7): a closing group's 128-row window is pooled by ``H / 32``
programs of 32 channels each, since one program holding the whole 128 x 512 window spills.

A tile program streams its 128 x 32 window slice (values and gate logits, 32 KiB) in row tiles with an online
softmax (running max, sum and weighted sum per channel) and writes the float32 pooled values into the scratch
row of its ``kv_score`` row. Tile programs run over the plan's list of closing rows (``T // r + R`` long, so
rows that close nothing cost no program); padding records exit at once. RMSNorm needs all channels, so an
entry is finished once all of its tiles are in the scratch:

* **Decode steps of up to** :data:`ONE_LAUNCH_MAX_REQUESTS` **requests, one launch** (``window_finish``): each
  tile program counts its arrival in the closing row's plan record (an atomic add on the record's
  ``arrivals``, zero between kernels), and the one that counts the last tile reads the scratch row back,
  finishes the entry and sets the count back to zero. Row programs in the same grid save the rows: in a
  decode step no saved row is one a window of the step reads (SPEC section 6: the ring is wider than the
  window by ``mtp_step``).
* **Every other step, two launches**: ``window_compress`` (the tile programs), then ``norm_rope_pack``, one
  program per row, which finishes each closing row's entry from its scratch row and saves the step's tail rows
  into the ring. Stage 1 read every window before stage 2 starts, so the save cannot clobber a row a window
  still needs.
"""

import triton
import triton.language as tl

from .entry_pack import finish_entry
from .pdl import launch_options, wait_after_record, wait_before_record, wait_then_release
from .plan import closing_record, row_arrivals_ptr, row_record
from .ring import ape_bias, load_saved_row, needs_bias, save_block, save_row, slot_in_state, window_row_ptrs

#: The head dims this kernel takes are multiples of this.
CHANNEL_TILE = 64
#: Plans of up to this many requests launch the two-launch path's stage 1 tile-major (a record's tiles
#: adjacent, records in list order): faster up to 256 requests, slower at 1,024 (H200, docs/runs/tune_b34a560).
TILE_MAJOR_MAX_REQUESTS = 256
#: Decode steps of plans of up to this many requests run in one launch: faster than two or level up to 256
#: requests, slower at 1,024 (H200, docs/runs/tune_612e02a).
ONE_LAUNCH_MAX_REQUESTS = 256
#: One-launch decode steps of plans of up to this many requests release the next kernel at their programs'
#: start (:mod:`.pdl`), whatever their program count (0: none; the size rule of :mod:`.pdl` applies): the next
#: kernel's programs then read their plan records while this one runs. Faster up to 64 requests, slower at 256,
#: where the next kernel's programs sit beside this one's (H200, docs/runs/tune_e7c297f).
RELEASE_AT_START_MAX_REQUESTS = 64
#: Whether a tile program adds its window's two softmax sums as one two-operand reduction (``fused_sums``):
#: off, as it bought nothing (cold graph of SGLang's ring decode case: 0.56 us slower per layer at 4B = 64, within
#: 0.25 us either way at 4B = 256 and 1024; H100, ``scripts/engine_pack_check.py --ring-decode``, docs/VALIDATION.md
#: at 7fd3ccd).
FUSED_SUMS = False
#: Channels of one tile program (a divisor of ``CHANNEL_TILE``): 32 beat 64 wherever groups close, which is
#: where the time goes (H200, docs/runs/tune_c4565ac).
PROGRAM_TILE = 32


@triton.jit
def _add_pairs(a, b, c, d):
    return a + c, b + d


@triton.jit
def absorb_rows(m, s, acc, x_kv, score, FUSED_SUMS: tl.constexpr):
    """Add a tile of window rows ``[rows, channels]`` (values ``x_kv``, gate logits ``score``; absent rows carry
    ``-inf``) to each channel's running max ``m``, sum ``s`` and weighted sum ``acc``. ``FUSED_SUMS``: the two
    sums as one two-operand reduction (one pass across the warps instead of two)."""
    m_new = tl.maximum(m, tl.max(score, axis=0))
    alpha = tl.exp(m - m_new)
    e = tl.exp(score - m_new[None, :])
    if FUSED_SUMS:
        e_sum, ex_sum = tl.reduce((e, e * x_kv), 0, _add_pairs)
    else:
        e_sum, ex_sum = tl.sum(e, axis=0), tl.sum(e * x_kv, axis=0)
    return m_new, s * alpha + e_sum, acc * alpha + ex_sum


@triton.jit
def pool_window_tile(kv, state, ape, pos, slot, k, start, row0, ch, SM: tl.constexpr, RATIO: tl.constexpr,
                     HEAD: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
                     FUSED_SUMS: tl.constexpr):  # fmt: skip
    """The float32 pooled values of channels ``ch`` (``TILE`` of them) of the group closing at ``pos``: its
    ``RATIO``-row window streamed ``BLOCK_T`` rows at a time with an online softmax (running max, sum and
    weighted sum per channel)."""
    m = tl.full([TILE], float("-inf"), tl.float32)
    s = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE], tl.float32)
    # BLOCK_T = r (up to 128): the whole window is requested at once, one memory round trip per program.
    for i in tl.static_range(0, RATIO, BLOCK_T):
        r = i + tl.arange(0, BLOCK_T)
        q = pos - RATIO + 1 + r
        ptrs, new, present = window_row_ptrs(q, kv, state, slot, k, start, row0, SM, RATIO)
        ok = ((r < RATIO) & present)[:, None]
        addr = ptrs[:, None] + ch[None, :]
        x_kv = tl.load(addr, mask=ok, other=0.0)
        score = tl.load(addr + HEAD, mask=ok, other=0.0)
        score += ape_bias(ape, q[:, None], 0, ch[None, :], ok & needs_bias(new, SM)[:, None], RATIO)
        m, s, acc = absorb_rows(m, s, acc, x_kv, tl.where(ok, score, float("-inf")), FUSED_SUMS)
    return acc / s


@triton.jit
def arrive(row, ch, pooled, plan, t):
    """A tile program's part of the one-launch merge: store its pooled channels ``ch`` into the scratch row
    ``row`` and count its arrival in row ``t``'s plan record; returns the count before it (``H / TILE - 1``:
    the last)."""
    tl.store(row + ch, pooled)
    # Every thread's stores precede the release below (the barrier orders them before the one thread that
    # performs the atomic), so the program that counts the last arrival sees all tiles.
    tl.debug_barrier()
    return tl.atomic_add(row_arrivals_ptr(plan, t), 1, sem="acq_rel", scope="gpu")


@triton.jit
def merged_row(row, plan, t, HEAD: tl.constexpr, BLOCK_HEAD: tl.constexpr):
    """The last arrival's read of the whole scratch row (``BLOCK_HEAD`` lanes, zeros past ``HEAD``), row
    ``t``'s count set back to zero for the next layer."""
    tl.store(row_arrivals_ptr(plan, t), 0)
    full = tl.arange(0, BLOCK_HEAD)
    # .cg: from L2, where the other programs' tiles are (this multiprocessor's L1 may hold stale lines)
    return tl.load(row + full, mask=full < HEAD, other=0.0, cache_modifier=".cg")


@triton.jit
def _window_compress_kernel(
    kv, state, ape, plan, scratch_ptr,
    SM: tl.constexpr, RATIO: tl.constexpr, HEAD: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
    TILE_MAJOR: tl.constexpr, PDL: tl.constexpr, FUSED_SUMS: tl.constexpr,
):  # fmt: skip
    wait_then_release(PDL)
    # TILE_MAJOR: grid (tiles, records), so a record's tiles are adjacent in launch order and the records that
    # close a group (the list's head) are scheduled before its padding
    record = tl.program_id(1) if TILE_MAJOR else tl.program_id(0)
    tile = tl.program_id(0) if TILE_MAJOR else tl.program_id(1)
    t, pos, slot, start, row0, end, out_slot, k = closing_record(plan, record)
    if (t < 0) | (out_slot < 0) | (slot_in_state(state, slot, SM) == 0):
        return
    ch = tile * TILE + tl.arange(0, TILE)
    pooled = pool_window_tile(kv, state, ape, pos, slot, k, start, row0, ch, SM, RATIO, HEAD, TILE, BLOCK_T,
                              FUSED_SUMS)  # fmt: skip
    tl.store(scratch_ptr + t.to(tl.int64) * HEAD + ch, pooled)


@triton.jit
def _norm_rope_pack_kernel(
    scratch_ptr, kv, state, ape, plan, prm, out,
    E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr, SAVE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_then_release(PDL)
    t = tl.program_id(0)
    pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
    # the row to save is requested with the pooled row, not after the entry's stores (one round trip less)
    EARLY_SAVE: tl.constexpr = 2 * E.HEAD <= SAVE_BLOCK
    if EARLY_SAVE:
        saved, saved_at, save_mask = load_saved_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, E.HEAD, SM,
                                                    SAVE_BLOCK)  # fmt: skip
    if (out_slot >= 0) & slot_in_state(state, slot, SM):
        ch = tl.arange(0, E.BLOCK_HEAD)  # the pooled row read whole, in channel order
        c = tl.load(scratch_ptr + t.to(tl.int64) * E.HEAD + ch, mask=ch < E.HEAD, other=0.0)
        finish_entry(c, out_slot, pos - RATIO + 1, prm, out, E)
    if EARLY_SAVE:
        tl.store(saved_at, saved, mask=save_mask)
    else:
        save_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, E.HEAD, SM, SAVE_BLOCK)


@triton.jit
def _window_finish_kernel(
    kv, state, ape, plan, scratch_ptr, prm, out, tile_programs,
    E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
    SAVE_BLOCK: tl.constexpr, PDL: tl.constexpr, RECORD_FIRST: tl.constexpr, FUSED_SUMS: tl.constexpr,
):  # fmt: skip
    # RECORD_FIRST: every program reads its plan record before its PDL wait (kernels/pdl.py)
    wait_before_record(PDL, RECORD_FIRST)
    pid = tl.program_id(0)
    TILES: tl.constexpr = E.HEAD // TILE
    if pid < tile_programs:
        # a tile program of closing record pid // TILES (a record's tiles adjacent in launch order)
        t, pos, slot, start, row0, end, out_slot, k = closing_record(plan, pid // TILES)
        wait_after_record(PDL, RECORD_FIRST)
        if (t >= 0) & (out_slot >= 0) & slot_in_state(state, slot, SM):
            ch = (pid % TILES) * TILE + tl.arange(0, TILE)
            pooled = pool_window_tile(kv, state, ape, pos, slot, k, start, row0, ch, SM, RATIO, E.HEAD, TILE,
                                      BLOCK_T, FUSED_SUMS)  # fmt: skip
            row = scratch_ptr + t.to(tl.int64) * E.HEAD
            if arrive(row, ch, pooled, plan, t) == TILES - 1:
                c = merged_row(row, plan, t, E.HEAD, E.BLOCK_HEAD)
                # (its norm weight and rope row requested here, with the scratch row: by every tile program
                # with its window was slower, docs/runs/tune_612e02a)
                finish_entry(c, out_slot, pos - RATIO + 1, prm, out, E)
    else:
        # a row program: a decode step saves each row from its own program (SPEC section 6: the ring is wider
        # than the window by mtp_step, so no row saved here is one a window of the step reads)
        t = pid - tile_programs
        pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
        wait_after_record(PDL, RECORD_FIRST)
        save_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, E.HEAD, SM, SAVE_BLOCK)


def runs_in_one_launch(requests: int, decode: bool) -> bool:
    """Whether :func:`launch_c128_tiled` takes one launch (else two) for a plan of ``requests`` requests."""
    return decode and requests <= ONE_LAUNCH_MAX_REQUESTS


def launch_c128_tiled(kv, state, ape, plan, prm, out, meta, sm, scratch, *, ratio: int, closing: int,
                      block_t: int | None = None, num_warps: int = 4, tile: int = PROGRAM_TILE,
                      tile_major: bool | None = None, decode: bool = False, one_launch: bool | None = None,
                      pdl: bool = False, record_first: bool = False, fused_sums: bool | None = None) -> None:  # fmt: skip
    """Pooled values of every group-closing row into ``scratch[row]`` (float32 ``[>= T, H]``), every entry
    finished and the ring saved: in one launch for a ``decode`` step when ``one_launch`` (``None``:
    :func:`runs_in_one_launch`), else in two. ``closing`` is the plan's closing-list length; ``tile`` (a divisor
    of ``CHANNEL_TILE``) the channels of one tile program, ``block_t`` the window rows it loads at once,
    ``tile_major`` the two-launch stage 1's grid order (``None``: tile-major up to
    :data:`TILE_MAJOR_MAX_REQUESTS` requests). ``record_first``: the one-launch programs read their plan records
    before their PDL wait (:mod:`.pdl`). ``fused_sums``: the window's two softmax sums as one reduction (``None``:
    :data:`FUSED_SUMS`)."""
    if plan.T == 0:
        return
    head = meta.HEAD
    if block_t is None:
        # The whole 128-row window in one load when few programs run (up to 64 requests: lower latency), two
        # halves beyond (fewer registers per program, more programs resident).
        block_t = 128 if plan.R <= 64 else 64
    if one_launch is None:
        one_launch = runs_in_one_launch(plan.R, decode)
    if decode and one_launch:
        tile_programs = closing * (head // tile)
        programs = tile_programs + plan.T
        _window_finish_kernel[(programs,)](
            kv, state, ape, plan, scratch, prm, out, tile_programs, meta, SM=sm, RATIO=ratio, TILE=tile,
            BLOCK_T=min(block_t, triton.next_power_of_2(ratio)), SAVE_BLOCK=save_block(head), num_warps=num_warps,
            RECORD_FIRST=record_first and pdl, FUSED_SUMS=FUSED_SUMS if fused_sums is None else fused_sums,
            **launch_options(pdl, programs, start=plan.R <= RELEASE_AT_START_MAX_REQUESTS),
        )  # fmt: skip
        return
    if tile_major is None:
        tile_major = plan.R <= TILE_MAJOR_MAX_REQUESTS
    grid = (head // tile, closing) if tile_major else (closing, head // tile)
    _window_compress_kernel[grid](
        kv, state, ape, plan, scratch, SM=sm, RATIO=ratio, HEAD=head, TILE=tile,
        BLOCK_T=min(block_t, triton.next_power_of_2(ratio)), TILE_MAJOR=tile_major, num_warps=num_warps,
        FUSED_SUMS=FUSED_SUMS if fused_sums is None else fused_sums,
        **launch_options(pdl, closing * (head // tile)),
    )  # fmt: skip
    _norm_rope_pack_kernel[(plan.T,)](
        scratch, kv, state, ape, plan, prm, out, meta, SM=sm, RATIO=ratio, SAVE_BLOCK=save_block(head),
        num_warps=4, **launch_options(pdl, plan.T),
    )  # fmt: skip


__all__ = ["CHANNEL_TILE", "ONE_LAUNCH_MAX_REQUESTS", "runs_in_one_launch", "launch_c128_tiled"]
