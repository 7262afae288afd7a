"""APE add: ``score += ape[position % r]`` on the gate-logit half of a step's rows, in place.

This is the engines' separate launch (LightLLM, SGLang). The ring backend fuses the bias into its loads
by default (``fuse_ape=True``) and never writes ``kv_score``; ``fuse_ape=False`` runs this kernel first.
"""

import torch
import triton
import triton.language as tl

from .rows import desc_args, load_row_desc


@triton.jit
def _ape_add_kernel(kv_ptr, ape_ptr, desc_ptr, T, RATIO: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    pos, slot, start, row0, end, out = load_row_desc(desc_ptr, T, t)
    if slot < 0:  # padding row
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    score_ptr = kv_ptr + t.to(tl.int64) * (2 * WIDTH) + WIDTH + cols
    bias = tl.load(ape_ptr + (pos % RATIO) * WIDTH + cols, mask=mask, other=0.0)
    tl.store(score_ptr, tl.load(score_ptr, mask=mask, other=0.0) + bias, mask=mask)


def ape_add(kv_score: torch.Tensor, ape: torch.Tensor, desc) -> None:
    """Add ``ape[p % r]`` to the gate logits ``kv_score[:, W:]`` of every non-padding row, in place."""
    rows, width = desc.num_rows, ape.shape[1]
    if rows == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    packed, T, R = desc_args(desc)
    _ape_add_kernel[(rows, triton.cdiv(width, block))](
        kv_score, ape, packed, T, RATIO=ape.shape[0], WIDTH=width, BLOCK=block, num_warps=4
    )
