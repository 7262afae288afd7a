"""Per-step state-row tables for engines whose state is not a per-request ring (``ops.build_state_rows``).

Once per step and ratio, after ``build_plan``, this resolves the engine's addressing so that every layer's
compress kernels read plain row indices (:mod:`.ring`, ``TABLE`` mode):

* ``read_rows[k, j]``: the state row of position ``start - (window - 1) + j`` of the plan's ``k``-th request
  (``-1`` for positions below zero or not held), the only state rows a window of this step can read;
* ``save_rows[t]``: the state row step row ``t`` is saved into, or ``-1``.

Modes (``MODE``):

====================  ======================================================================  =================
mode                  state row of position ``q`` of request slot ``s``                       rows saved
====================  ======================================================================  =================
0 ``req_ring``        ``s * ring + q % ring``                                                  last ``ring``
1 ``token_map_ring``  ``(m // page) * ring + m % ring``, ``m = token_to_state[req_to_token[s,  last ``ring``, and
                      q]]`` (LightLLM's and SGLang's C4 state by SWA page)                     each page's last
                                                                                               ``page_tail``
2 ``block_table``     ``block_table[s, q // bs] * bs + q % bs`` (vLLM)                        every row
====================  ======================================================================  =================

Saving each state page's last rows keeps radix prefix reuse working: a request that starts on a shared page
boundary finds the rows its first window needs. Grid: ``R`` request programs, then one program per block of
``save_rows`` (its length is a capacity; rows past the plan's ``T`` are left alone). No atomics.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .pdl import launch_options, wait_then_release
from .plan import H_ROWS, REC, request_record

MODES = {"req_ring": 0, "token_map_ring": 1, "block_table": 2}
#: The addressing tables of every mode (unused ones are any tensor).
StateTables = namedtuple(
    "StateTables", "ring req_to_token req_stride token_to_state page page_tail block_table block_stride block_size"
)


@triton.jit
def _state_row(slot, q, valid, tables, MODE: tl.constexpr):
    """State row of positions ``q`` of request slot ``slot`` (``-1`` where not ``valid`` or not held), and for
    ``token_map_ring`` the position's offset in its state page (else 0)."""
    slot = slot.to(tl.int64)
    q64 = q.to(tl.int64)
    if MODE == 0:
        row = slot * tables.ring + q64 % tables.ring
        in_page = q64 * 0
    elif MODE == 1:
        token = tl.load(tables.req_to_token + slot * tables.req_stride + q64, mask=valid, other=-1).to(tl.int64)
        m = tl.load(tables.token_to_state + token, mask=valid & (token >= 0), other=-1).to(tl.int64)
        valid = valid & (m >= 0)
        row = (m // tables.page) * tables.ring + m % tables.ring
        in_page = m % tables.page
    else:
        block = tl.load(
            tables.block_table + slot * tables.block_stride + q64 // tables.block_size, mask=valid, other=-1
        )
        block = block.to(tl.int64)
        valid = valid & (block >= 0)
        row = block * tables.block_size + q64 % tables.block_size
        in_page = q64 * 0
    return tl.where(valid, row, -1), in_page


@triton.jit
def _state_rows_kernel(
    plan, read_rows_ptr, save_rows_ptr, save_capacity, tables,
    MODE: tl.constexpr, WINDOW: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_then_release(PDL)
    pid = tl.program_id(0)
    if pid < plan.R:
        _request_rows(plan, pid, read_rows_ptr, tables, MODE, WINDOW, BLOCK_W)
    else:
        _save_rows(plan, pid - plan.R, save_rows_ptr, save_capacity, tables, MODE, BLOCK)


@triton.jit
def _request_rows(plan, k, read_rows_ptr, tables, MODE: tl.constexpr, WINDOW: tl.constexpr, BLOCK_W: tl.constexpr):
    """``read_rows[k]``: the state rows of the ``window - 1`` positions before request ``k``'s start."""
    first, slot, start, row0, end, first_out = request_record(plan, k)
    j = tl.arange(0, BLOCK_W)
    q = start - (WINDOW - 1) + j
    valid = ((j * 0 + first) >= 0) & (j < WINDOW - 1) & (q >= 0)  # (the interpreter mistypes scalar & tensor)
    row, _ = _state_row(slot, q, valid, tables, MODE)
    tl.store(read_rows_ptr + k.to(tl.int64) * (WINDOW - 1) + j, row, mask=j < WINDOW - 1)


@triton.jit
def _save_rows(plan, block, save_rows_ptr, save_capacity, tables, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """``save_rows`` of rows ``[block * BLOCK, (block + 1) * BLOCK)`` that the step has."""
    rows = tl.load(plan.ptr + H_ROWS)
    t = block * BLOCK + tl.arange(0, BLOCK)
    in_step = t < rows
    rec = plan.ptr + REC + REC * plan.R + REC * t
    pos = tl.load(rec, mask=in_step, other=0)
    slot = tl.load(rec + 1, mask=in_step, other=-1)
    end = tl.load(rec + 4, mask=in_step, other=0)
    _store_save_rows(t, in_step, pos, slot, end, in_step & (slot >= 0), save_rows_ptr, save_capacity, tables, MODE)


@triton.jit
def _store_save_rows(t, in_step, pos, slot, end, valid, save_rows_ptr, save_capacity, tables, MODE: tl.constexpr):
    """``save_rows[t]`` of the step's rows ``t`` (``in_step``; ``valid``: a row of a request, at position ``pos``
    of slot ``slot``, whose rows end before ``end``): the state row where the mode's rule saves it, else ``-1``."""
    row, in_page = _state_row(slot, pos, valid, tables, MODE)
    if MODE == 2:
        keep = valid
    elif MODE == 1:
        keep = valid & ((pos >= end - tables.ring) | (in_page >= tables.page - tables.page_tail))
    else:
        keep = valid & (pos >= end - tables.ring)
    tl.store(save_rows_ptr + t, tl.where(keep, row, -1), mask=in_step & (t < save_capacity))


@triton.jit
def block_state_rows(t, T, R, pos, fits, slot, start, end, at_start, run, runs, read_rows_ptr, save_rows_ptr,
                     save_capacity, tables, MODE: tl.constexpr, WINDOW: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """Both tables of a step whose plan (``T`` rows, ``R`` requests) this program has just built in one block
    (``kernels.step_build``), from the build's own registers (``plan._build_plan_one_block``'s values of rows
    ``t``) rather than its records: what :func:`_request_rows` and :func:`_save_rows` read back from them.
    ``read_rows`` of request ``run`` from its first row (``at_start``) and ``-1`` for the plan's requests past the
    step's ``runs``; ``save_rows`` of every row in the step (``fits``: a row of one of the plan's requests)."""
    j = tl.arange(0, BLOCK_W)[None, :]
    in_window = j < WINDOW - 1
    q = start[:, None] - (WINDOW - 1) + j
    want = at_start[:, None] & in_window
    row, _ = _state_row(slot[:, None], q, want & (q >= 0), tables, MODE)
    request = tl.where(at_start, run, 0).to(tl.int64)
    tl.store(read_rows_ptr + request[:, None] * (WINDOW - 1) + j, row, mask=want)
    none = ((t >= runs) & (t < R))[:, None] & in_window
    tl.store(read_rows_ptr + t[:, None].to(tl.int64) * (WINDOW - 1) + j, tl.full(row.shape, -1, row.dtype), mask=none)
    _store_save_rows(t, t < T, pos, slot, end, fits, save_rows_ptr, save_capacity, tables, MODE)


def launch_state_rows(plan, read_rows, save_rows, tables, *, mode: int, window: int, pdl: bool = False) -> None:
    block = 256
    grid = (plan.R + triton.cdiv(save_rows.shape[0], block),)
    _state_rows_kernel[grid](
        plan, read_rows, save_rows, save_rows.shape[0], tables, MODE=mode, WINDOW=window,
        BLOCK_W=triton.next_power_of_2(max(window - 1, 1)), BLOCK=block, num_warps=4,
        **launch_options(pdl, grid[0]),
    )  # fmt: skip


__all__ = ["MODES", "StateTables", "block_state_rows", "launch_state_rows"]
