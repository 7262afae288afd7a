"""Ring-state save: copy each request's last ``min(n, ring)`` rows into its ring (row ``position % ring``).

Saved rows are ``[kv | score + ape]``. It must run after every window of the step has read the ring
(SPEC section 6); the two-stage C128 kernel calls :func:`save_row` from its second stage, which starts only
after the first stage has read all windows, and the single-stage kernel calls it in-kernel only for decode
steps, where no saved row can overwrite a row another window of the step still reads.
"""

import torch
import triton
import triton.language as tl

from .rows import desc_args, load_row_desc


@triton.jit
def save_row(
    kv_ptr,
    ring_ptr,
    ape_ptr,
    t,
    pos,
    slot,
    end,
    RATIO: tl.constexpr,
    WIDTH: tl.constexpr,
    RING: tl.constexpr,
    ADD_APE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Save row ``t`` (position ``pos`` of ring ``slot``) if it is among its request's last ``RING`` rows."""
    if (slot >= 0) & (pos >= end - RING):
        src = kv_ptr + t.to(tl.int64) * (2 * WIDTH)
        dst = ring_ptr + (slot.to(tl.int64) * RING + pos % RING) * (2 * WIDTH)
        for c0 in range(0, 2 * WIDTH, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < 2 * WIDTH
            row = tl.load(src + cols, mask=mask, other=0.0)
            if ADD_APE:
                is_score = cols >= WIDTH
                row += tl.load(ape_ptr + (pos % RATIO) * WIDTH + (cols - WIDTH), mask=mask & is_score, other=0.0)
            tl.store(dst + cols, row, mask=mask)


@triton.jit
def _ring_save_kernel(
    kv_ptr,
    ring_ptr,
    ape_ptr,
    desc_ptr,
    T,
    RATIO: tl.constexpr,
    WIDTH: tl.constexpr,
    RING: tl.constexpr,
    ADD_APE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    pos, slot, start, row0, end, out = load_row_desc(desc_ptr, T, t)
    save_row(kv_ptr, ring_ptr, ape_ptr, t, pos, slot, end, RATIO, WIDTH, RING, ADD_APE, BLOCK)


def save_block(width: int) -> int:
    return min(2048, triton.next_power_of_2(2 * width))


def ring_save(kv_score: torch.Tensor, ring: torch.Tensor, ape: torch.Tensor, desc, *, add_ape: bool) -> None:
    """Save the step's tail rows into ``ring`` (float32 ``[slots, RING, 2W]``); ``add_ape`` adds the bias
    to the gate logits on the way (when the step's rows do not carry it yet)."""
    if desc.num_rows == 0:
        return
    packed, T, R = desc_args(desc)
    width = ape.shape[1]
    _ring_save_kernel[(desc.num_rows,)](
        kv_score,
        ring,
        ape,
        packed,
        T,
        RATIO=ape.shape[0],
        WIDTH=width,
        RING=ring.shape[1],
        ADD_APE=add_ape,
        BLOCK=save_block(width),
        num_warps=4,
    )
