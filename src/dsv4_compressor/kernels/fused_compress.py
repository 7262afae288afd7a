"""Single-stage compress: one program per row loads its whole window, pools, normalizes, rotates and packs.

Used for CSA and the indexer (windows of 8 rows), and for HCA as the baseline variant
(``c128_kernel="single"``): there one program holds a 128 x 512 float32 window twice (values and gate logits),
far more than a multiprocessor's registers, so the compiler spills to local memory; that is the cost the
two-stage kernel in :mod:`.c128_two_stage` removes.
"""

import torch
import triton
import triton.language as tl

from .entry_pack import entry_meta, entry_outputs, finish_entry, split_offsets
from .ring_save import save_block, save_row
from .rows import ape_bias, desc_args, load_row_desc, window_row_ptrs


@triton.jit
def _pool_part(ptrs, col_off, idx, cmask, row_ok, new, q, ape_ptr, RATIO: tl.constexpr, WIDTH: tl.constexpr,
               ADD_APE: tl.constexpr):  # fmt: skip
    """Per-channel softmax pooling over the window for the channels ``idx`` (one of nope / rope x / rope y)."""
    cols = col_off[:, None] + idx[None, :]
    mask = row_ok[:, None] & cmask[None, :]
    kv = tl.load(ptrs[:, None] + cols, mask=mask, other=0.0)
    score = tl.load(ptrs[:, None] + WIDTH + cols, mask=mask, other=0.0)
    if ADD_APE:
        score += ape_bias(ape_ptr, q, cols, mask & new[:, None], RATIO, WIDTH)
    score = tl.where(row_ok[:, None], score, float("-inf"))  # absent rows get weight 0
    e = tl.exp(score - tl.max(score, axis=0)[None, :])
    return tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)


@triton.jit
def _compress_single_kernel(
    kv_ptr, ring_ptr, ape_ptr, desc_ptr, T, norm_w_ptr, cos_ptr, sin_ptr, eps, out_ptr, fp8_pages_ptr,
    RATIO: tl.constexpr, WINDOW: tl.constexpr, BLOCK_WIN: tl.constexpr, OVERLAP: tl.constexpr,
    WIDTH: tl.constexpr, RING: tl.constexpr, ADD_APE: tl.constexpr, SAVE_ROWS: tl.constexpr,
    SAVE_BLOCK: tl.constexpr,
    HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    INDEXER_FP8: tl.constexpr, EXACT_FP8: tl.constexpr, INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pos, slot, start, row0, end, out = load_row_desc(desc_ptr, T, t)
    if out >= 0:  # this row closes group pos // r
        j = tl.arange(0, BLOCK_WIN)
        q = pos - WINDOW + 1 + j
        ptrs, new, present = window_row_ptrs(q, kv_ptr, ring_ptr, slot, start, row0, 2 * WIDTH, RING)
        row_ok = present & (j < WINDOW)
        # With overlap the first r window rows are the previous group: their [0, H) halves count.
        col_off = tl.where(OVERLAP & (j >= RATIO), HEAD, 0)
        nope, even, odd, m_nope, m_half = split_offsets(HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF)
        c_nope = _pool_part(ptrs, col_off, nope, m_nope, row_ok, new, q, ape_ptr, RATIO, WIDTH, ADD_APE)
        c_even = _pool_part(ptrs, col_off, even, m_half, row_ok, new, q, ape_ptr, RATIO, WIDTH, ADD_APE)
        c_odd = _pool_part(ptrs, col_off, odd, m_half, row_ok, new, q, ape_ptr, RATIO, WIDTH, ADD_APE)
        finish_entry(
            c_nope, c_even, c_odd, out, pos - RATIO + 1, norm_w_ptr, cos_ptr, sin_ptr, eps, out_ptr, fp8_pages_ptr,
            HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF, LATENT, PAGE_SIZE, PAGE_BYTES, SCALE_BYTES, INDEXER_FP8, EXACT_FP8,
            INV_SQRT_HEAD,
        )  # fmt: skip
    if SAVE_ROWS:
        save_row(kv_ptr, ring_ptr, ape_ptr, t, pos, slot, end, RATIO, WIDTH, RING, ADD_APE, SAVE_BLOCK)


def compress_single(
    kv_score: torch.Tensor,
    ring: torch.Tensor,
    desc,
    params,
    pool,
    *,
    add_ape: bool,
    save_rows: bool,
    exact_fp8: bool,
    num_warps: int | None = None,
) -> None:
    """Launch the single-stage kernel over the step's rows.

    ``save_rows=True`` also saves the ring rows in the same launch; only valid when every request in the step
    brings at most ``mtp_step + 1`` rows (decode / verify), so no saved row overwrites one a window still reads.
    """
    cfg = pool.config
    if desc.num_rows == 0:
        return
    packed, T, R = desc_args(desc)
    out, fp8 = entry_outputs(pool)
    block_win = triton.next_power_of_2(cfg.window)
    if num_warps is None:
        num_warps = 8 if block_win * cfg.head_dim >= 16384 else 4
    _compress_single_kernel[(desc.num_rows,)](
        kv_score, ring, params.ape, packed, T, params.norm_weight, params.cos, params.sin, float(params.eps),
        out, fp8,
        RATIO=cfg.ratio, WINDOW=cfg.window, BLOCK_WIN=block_win, OVERLAP=cfg.overlap, WIDTH=cfg.width,
        RING=ring.shape[1], ADD_APE=add_ape, SAVE_ROWS=save_rows, SAVE_BLOCK=save_block(cfg.width),
        num_warps=num_warps, **entry_meta(cfg, pool, exact_fp8),
    )  # fmt: skip
