"""The two-stage tiled C128 (HCA) kernel (SPEC section 7).

Stage 1, ``window_compress``: one program per (row, 64-channel tile), over the step's list of rows that
close a group (``closing_rows`` of the descriptor, ``T // r + R`` long, so rows that close nothing cost no
program); padding entries exit at once. Each program streams its 128 x 64 window slice (values and gate
logits, 64 KiB) in 64-row tiles with an online softmax (running max, sum and weighted sum per channel) and
writes the float32 pooled values into the scratch row of its ``kv_score`` row.

Stage 2, ``norm_rope_pack``: one program per row reads its scratch row back and finishes the entry
(RMSNorm needs all channels, hence the split). It also saves the step's tail rows into the ring: every
window was read by stage 1, which completed before stage 2 started, so the save cannot clobber a row a
window still needs.
"""

import torch
import triton
import triton.language as tl

from .entry_pack import entry_meta, entry_outputs, finish_entry, split_offsets
from .ring_save import save_block, save_row
from .rows import ape_bias, closing_record, desc_args, load_row_desc, window_row_ptrs

CHANNEL_TILE = 64


@triton.jit
def _window_compress_kernel(
    kv_ptr, ring_ptr, ape_ptr, desc_ptr, T, R, scratch_ptr,
    RATIO: tl.constexpr, HEAD: tl.constexpr, RING: tl.constexpr, ADD_APE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    # Programs walk the step's list of group-closing rows (at most T // r + R of them), so a step where no
    # row closes a group launches T // r + R exiting programs per tile, not T.
    t, pos, slot, start, row0, end, out = closing_record(desc_ptr, T, R, tl.program_id(0))
    if (t < 0) | (out < 0):
        return
    ch = tl.program_id(1) * TILE + tl.arange(0, TILE)
    m = tl.full([TILE], float("-inf"), tl.float32)
    s = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE], tl.float32)
    # BLOCK_T = r (up to 128): the whole window is requested at once, one memory round trip per program.
    for i in range(0, RATIO, BLOCK_T):
        r = i + tl.arange(0, BLOCK_T)
        q = pos - RATIO + 1 + r
        ptrs, new, present = window_row_ptrs(q, kv_ptr, ring_ptr, slot, start, row0, 2 * HEAD, RING)
        ok = (r < RATIO)[:, None]
        addr = ptrs[:, None] + ch[None, :]
        kv = tl.load(addr, mask=ok, other=0.0)
        score = tl.load(addr + HEAD, mask=ok, other=0.0)
        if ADD_APE:
            score += ape_bias(ape_ptr, q, ch[None, :], ok & new[:, None], RATIO, HEAD)
        score = tl.where(ok, score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(score - m_new[None, :])
        s = s * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e * kv, axis=0)
        m = m_new
    tl.store(scratch_ptr + t.to(tl.int64) * HEAD + ch, acc / s)


@triton.jit
def _norm_rope_pack_kernel(
    scratch_ptr, kv_ptr, ring_ptr, ape_ptr, desc_ptr, T, norm_w_ptr, cos_ptr, sin_ptr, eps, out_ptr, fp8_pages_ptr,
    RATIO: tl.constexpr, RING: tl.constexpr, ADD_APE: tl.constexpr, SAVE_ROWS: tl.constexpr,
    SAVE_BLOCK: tl.constexpr,
    HEAD: tl.constexpr, ROPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    INDEXER_FP8: tl.constexpr, EXACT_FP8: tl.constexpr, INV_SQRT_HEAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pos, slot, start, row0, end, out = load_row_desc(desc_ptr, T, t)
    if out >= 0:
        nope, even, odd, m_nope, m_half = split_offsets(HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF)
        row = scratch_ptr + t.to(tl.int64) * HEAD
        c_nope = tl.load(row + nope, mask=m_nope, other=0.0)
        c_even = tl.load(row + even, mask=m_half, other=0.0)
        c_odd = tl.load(row + odd, mask=m_half, other=0.0)
        finish_entry(
            c_nope, c_even, c_odd, out, pos - RATIO + 1, norm_w_ptr, cos_ptr, sin_ptr, eps, out_ptr, fp8_pages_ptr,
            HEAD, ROPE, BLOCK_NOPE, BLOCK_HALF, LATENT, PAGE_SIZE, PAGE_BYTES, SCALE_BYTES, INDEXER_FP8, EXACT_FP8,
            INV_SQRT_HEAD,
        )  # fmt: skip
    if SAVE_ROWS:
        save_row(kv_ptr, ring_ptr, ape_ptr, t, pos, slot, end, RATIO, HEAD, RING, ADD_APE, SAVE_BLOCK)


def window_compress(
    kv_score: torch.Tensor, ring: torch.Tensor, desc, params, scratch: torch.Tensor, *, add_ape: bool,
    block_t: int = 64, num_warps: int = 4,
) -> None:  # fmt: skip
    """Stage 1: pooled float32 values of every group-closing row into ``scratch[row]`` (``[T, H]``)."""
    head = scratch.shape[1]
    if desc.num_rows == 0:
        return
    if head % CHANNEL_TILE or params.ape.shape[1] != head:
        raise ValueError(f"window_compress needs a non-overlapping config with head_dim % 64 == 0, got {head}")
    packed, T, R = desc_args(desc)
    _window_compress_kernel[(desc.num_closing, head // CHANNEL_TILE)](
        kv_score, ring, params.ape, packed, T, R, scratch,
        RATIO=params.ape.shape[0], HEAD=head, RING=ring.shape[1], ADD_APE=add_ape,
        TILE=CHANNEL_TILE, BLOCK_T=min(block_t, triton.next_power_of_2(params.ape.shape[0])), num_warps=num_warps,
    )  # fmt: skip


def norm_rope_pack(
    scratch: torch.Tensor, kv_score: torch.Tensor, ring: torch.Tensor, desc, params, pool, *, add_ape: bool,
    save_rows: bool, exact_fp8: bool, num_warps: int = 4,
) -> None:  # fmt: skip
    """Stage 2: finish every group-closing row's entry from ``scratch``; then (``save_rows``) save the ring."""
    cfg = pool.config
    if desc.num_rows == 0:
        return
    packed, T, R = desc_args(desc)
    out, fp8 = entry_outputs(pool)
    _norm_rope_pack_kernel[(desc.num_rows,)](
        scratch, kv_score, ring, params.ape, packed, T, params.norm_weight, params.cos, params.sin,
        float(params.eps), out, fp8,
        RATIO=cfg.ratio, RING=ring.shape[1], ADD_APE=add_ape, SAVE_ROWS=save_rows, SAVE_BLOCK=save_block(cfg.width),
        num_warps=num_warps, **entry_meta(cfg, pool, exact_fp8),
    )  # fmt: skip
