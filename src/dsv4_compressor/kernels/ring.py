"""The ring state: where a window finds its rows, the APE bias, and saving a step's tail rows.

A window position ``q`` of a request lives in this step's ``kv_score`` when ``q >= start`` (row
``row0 + q - start``) and in the state otherwise. Which state row holds it depends on the engine:

* ``req_ring`` (the default; LightLLM's and SGLang's HCA, our own): row ``slot * ring + q % ring``, computed
  in the kernel; each request saves its last ``ring`` rows.
* any other addressing (``token_map_ring``, ``block_table``) comes precomputed per step by
  :func:`~dsv4_compressor.ops.build_state_rows`: ``read_rows[k, j]`` is the state row of position
  ``start - (window - 1) + j`` of the step's ``k``-th request (``-1``: none), ``save_rows[t]`` the row step row
  ``t`` is saved into (``-1``: not saved). The kernels read those tables (``TABLE``).

In ring mode a row's address is ``slot * slot_stride + (q % ring) * row_stride`` (constants and multiplies, as
hot as the original ring kernels); a table row index is turned into an address through the state's blocks
(``RPB`` rows per block, a constexpr, ``block_stride`` apart), so a 2-D ``[rows, 2W]`` and vLLM's padded
``[blocks, block_size, 2W]`` are addressed alike. Saved rows are ``[kv | score + ape]``, or the bare
``[kv | score]`` when the engine keeps them so (``HAS_APE`` off, SGLang); rows of ``kv_score`` carry the bare
gate logits, so the bias is added on load. Positions below zero are absent.

Saving must come after every window of the step has read the state (SPEC section 6): the single-stage kernel
saves per row in decode steps (where no saved row overwrites one another window of the step reads), and in
other ring-mode steps from one program per request, after that request's windows that read the ring; the
tiled HCA kernel saves per row in decode steps too, else from its second stage; a table-addressed state in a step that is not decode is
saved by :func:`launch_ring_save`, launched last.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .pdl import launch_options, wait_then_release
from .plan import row_record

#: ``kv_score`` rows: base pointer and row stride (elements; columns are contiguous). ``SPLIT`` (a constexpr) > 1:
#: the rows are ``SPLIT`` partial sums ``split_stride`` elements apart (a K-split projection's, left unsummed), a
#: value their sum in split order (:func:`load_kv`); kernels that read rows any other way take ``SPLIT = 1`` only.
KvRef = namedtuple("KvRef", "ptr row_stride split_stride SPLIT", defaults=(0, tl.constexpr(1)))
#: The state: base pointer, its rows (a row index at or beyond them is never read or written), elements between
#: request slots (ring mode), between blocks (table mode) and between rows (columns contiguous), and the per-step
#: ``read_rows`` / ``save_rows`` tables (any tensor when ``TABLE`` is off).
StateRef = namedtuple("StateRef", "ptr rows slot_stride block_stride row_stride read_rows save_rows")
#: Constexpr state switches: ring rows per request (ring mode), tables instead of the ring, rows with APE, rows
#: per block (table mode).
StateMeta = namedtuple("StateMeta", "RING TABLE HAS_APE RPB")
#: APE bias ``[r, coff, H]`` as strides: row (``p % r``), half (overlap: 0 = previous-group, 1 = own), channel.
ApeRef = namedtuple("ApeRef", "ptr row_stride half_stride chan_stride")


def kv_ref(kv) -> KvRef:
    """The kernels' view of ``kv_score`` (a ``[T, 2W]`` tensor) or of a projection's unsummed partials
    (``[split, T, 2W]``)."""
    if kv.dim() == 3:
        return KvRef(kv, kv.stride(1), kv.stride(0), tl.constexpr(kv.shape[0]))
    return KvRef(kv, kv.stride(0))


@triton.jit
def load_kv(kv, ptrs, mask):
    """``kv_score`` values at ``ptrs`` (addresses of the first partial) where ``mask``, else 0: the partials
    added in split order, the order a projection that sums them itself adds them in (``kernels/projection.py``),
    so the values are the same floats either way."""
    values = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, kv.SPLIT):
        values += tl.load(ptrs + s * kv.split_stride, mask=mask, other=0.0)
    return values


@triton.jit
def state_row_ptr(state, row, RPB: tl.constexpr):
    """Address of table row ``row`` (int tensor or scalar) in blocks of ``RPB`` rows."""
    row = row.to(tl.int64)
    return state.ptr + (row // RPB) * state.block_stride + (row % RPB) * state.row_stride


@triton.jit
def ring_row_ptr(state, slot, q, RING: tl.constexpr):
    """Address of position ``q``'s row in request slot ``slot``'s ring (``q >= -RING``)."""
    return state.ptr + slot.to(tl.int64) * state.slot_stride + ((q + RING) % RING).to(tl.int64) * state.row_stride


@triton.jit
def window_row_ptrs(q, kv, state, slot, k, start, row0, SM: tl.constexpr, WINDOW: tl.constexpr):
    """Row base pointers of window positions ``q`` (a tensor) of the ``k``-th request (slot ``slot``), and
    masks: ``new`` (a row of this step) and ``present`` (the row exists: ``q >= 0``, and in table mode the
    engine gave a state row)."""
    new = q >= start
    present = q >= 0
    kv_row = (row0 + (q - start)).to(tl.int64)
    if SM.TABLE:
        old = present & (new == 0)
        row = tl.load(state.read_rows + k.to(tl.int64) * (WINDOW - 1) + (q - start + WINDOW - 1), mask=old, other=-1)
        present = present & (new | ((row >= 0) & (row < state.rows)))
        state_ptrs = state_row_ptr(state, tl.where(present, row, 0), SM.RPB)
    else:
        state_ptrs = ring_row_ptr(state, slot, q, SM.RING)  # q >= -RING wherever it is read
    ptrs = tl.where(new, kv.ptr + kv_row * kv.row_stride, state_ptrs)
    return ptrs, new, present


@triton.jit
def slot_in_state(state, slot, SM: tl.constexpr):
    """Whether request slot ``slot`` has a ring in this state (table mode: the tables say where rows are)."""
    if SM.TABLE:
        return slot >= 0
    else:
        return (slot >= 0) & ((slot.to(tl.int64) + 1) * SM.RING <= state.rows)


@triton.jit
def ape_bias(ape, q, half, chan, mask, RATIO: tl.constexpr):
    """``ape[q % r, half, chan]`` where ``mask``, else 0 (``q`` and ``half`` broadcast against ``chan``)."""
    off = (q % RATIO) * ape.row_stride + half * ape.half_stride + chan * ape.chan_stride
    return tl.load(ape.ptr + off, mask=mask, other=0.0)


@triton.jit
def needs_bias(new, SM: tl.constexpr):
    """Rows whose gate logits lack the APE bias: this step's rows, and state rows kept without it."""
    if SM.HAS_APE:
        return new
    else:
        return new | (new == 0)


@triton.jit
def save_target(state, t, pos, slot, end, SM: tl.constexpr):
    """Whether step row ``t`` (position ``pos`` of request ``slot``) is saved, and its state row's address: ring
    mode saves a request's last ``RING`` rows, table mode wherever ``save_rows[t]`` says."""
    if SM.TABLE:
        row = tl.load(state.save_rows + t).to(tl.int64)
        save = (slot >= 0) & (row >= 0) & (row < state.rows)
        dst = state_row_ptr(state, tl.where(save, row, 0), SM.RPB)
    else:
        save = slot_in_state(state, slot, SM) & (pos >= end - SM.RING)
        dst = ring_row_ptr(state, tl.where(save, slot, 0), pos, SM.RING)
    return save, dst


@triton.jit
def saved_values(kv, ape, t, pos, cols, mask, RATIO: tl.constexpr, HEAD: tl.constexpr, WIDTH: tl.constexpr,
                 SM: tl.constexpr):  # fmt: skip
    """Columns ``cols`` of step row ``t`` as the state keeps them: ``[kv | score + ape]``, or bare."""
    values = tl.load(kv.ptr + t.to(tl.int64) * kv.row_stride + cols, mask=mask, other=0.0)
    if SM.HAS_APE:
        score_col = cols - WIDTH
        values += ape_bias(ape, pos, score_col // HEAD, score_col % HEAD, mask & (score_col >= 0), RATIO)
    return values


@triton.jit
def save_row(kv, state, ape, t, pos, slot, end, RATIO: tl.constexpr, HEAD: tl.constexpr, WIDTH: tl.constexpr,
             SM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Save row ``t`` (position ``pos`` of request ``slot``) where :func:`save_target` says, ``BLOCK`` columns
    at a time."""
    save, dst = save_target(state, t, pos, slot, end, SM)
    if save:
        for c0 in tl.static_range(0, 2 * WIDTH, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < 2 * WIDTH
            tl.store(dst + cols, saved_values(kv, ape, t, pos, cols, mask, RATIO, HEAD, WIDTH, SM), mask=mask)


@triton.jit
def load_saved_row(kv, state, ape, t, pos, slot, end, RATIO: tl.constexpr, HEAD: tl.constexpr, WIDTH: tl.constexpr,
                   SM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """:func:`save_row` split in two, for a row of at most ``BLOCK`` columns: ``(values, addresses, mask)``
    to store later (``tl.store(addresses, values, mask=mask)``), so a kernel can request the row together
    with its other loads instead of after its last store. In table mode the values are requested for every row
    of a request (``slot >= 0``), not only those ``save_rows`` saves: masked by the table, the loads would wait
    for its round trip and hold up every load issued after them."""
    tl.static_assert(2 * WIDTH <= BLOCK)
    save, dst = save_target(state, t, pos, slot, end, SM)
    cols = tl.arange(0, BLOCK)
    wanted = (slot >= 0) if SM.TABLE else save
    load_mask = (cols < 2 * WIDTH) & ((cols * 0 + wanted.to(tl.int32)) != 0)  # broadcast first (the interpreter)
    mask = load_mask & ((cols * 0 + save.to(tl.int32)) != 0)
    return saved_values(kv, ape, t, pos, cols, load_mask, RATIO, HEAD, WIDTH, SM), dst + cols, mask


@triton.jit
def _ring_save_kernel(kv, state, ape, plan, RATIO: tl.constexpr, HEAD: tl.constexpr, WIDTH: tl.constexpr,
                      SM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_release(PDL)
    t = tl.program_id(0)
    pos, slot, start, row0, end, out, k = row_record(plan, t)
    save_row(kv, state, ape, t, pos, slot, end, RATIO, HEAD, WIDTH, SM, BLOCK)


def save_block(width: int) -> int:
    """Columns one save loop iteration moves."""
    return min(2048, triton.next_power_of_2(2 * width))


def launch_ring_save(kv, state, ape, plan, sm, *, ratio: int, head: int, width: int, pdl: bool = False) -> None:
    """Save the step's rows into the state, one program per row, after every window of the step was read: the
    save of a table-addressed state in steps that are not decode (the single-stage kernel saves a ring itself,
    from its request programs)."""
    if plan.T == 0:
        return
    _ring_save_kernel[(plan.T,)](
        kv, state, ape, plan, RATIO=ratio, HEAD=head, WIDTH=width, SM=sm, BLOCK=save_block(width), num_warps=4,
        **launch_options(pdl, plan.T),
    )  # fmt: skip


__all__ = [
    "KvRef",
    "kv_ref",
    "load_kv",
    "StateRef",
    "StateMeta",
    "ApeRef",
    "state_row_ptr",
    "ring_row_ptr",
    "window_row_ptrs",
    "slot_in_state",
    "ape_bias",
    "needs_bias",
    "save_row",
    "load_saved_row",
    "launch_ring_save",
    "save_block",
]
