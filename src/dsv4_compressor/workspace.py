"""The float32 scratch workspace of the tiled C128 (HCA) kernel, and its capacity rule (SPEC section 7).

Stage ``window_compress`` writes each pooled vector into the scratch row of its ``kv_score`` row, stage
``norm_rope_pack`` reads it back. Rows are indexed by ``kv_score`` row, so a region must hold as many rows as
the largest step a forward can have, whether or not any row closes a group; and there is one region per
micro-batch that can be in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import CapacityError

__all__ = ["CapacityError", "C128ScratchPlan", "plan_c128_scratch", "Workspace"]


@dataclass(frozen=True)
class C128ScratchPlan:
    """How much C128 scratch a serving configuration needs.

    ``regions``: one per micro-batch in flight (2 with decode or prefill overlap);
    ``rows_per_region``: the most ``kv_score`` rows one forward can hand the compressor;
    ``bytes = regions * rows_per_region * head_dim * 4``.
    """

    regions: int
    rows_per_region: int
    head_dim: int

    @property
    def bytes(self) -> int:
        return self.regions * self.rows_per_region * self.head_dim * 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_c128_scratch(
    *,
    batch_max_tokens: int,
    max_req_num: int,
    mtp_step: int = 0,
    tp: int = 1,
    dp: int = 1,
    decode_overlap: bool = False,
    prefill_overlap: bool = False,
    graph_max_batch_size: int = 0,
    head_dim: int = 512,
) -> C128ScratchPlan:
    """Plan the scratch for a serving configuration (the capacity rule of SPEC section 7).

    Args:
        batch_max_tokens: ``B``, the most tokens one prefill forward takes.
        max_req_num: ``R``, the most requests admitted per data-parallel rank.
        mtp_step: drafts per decode step; a decode request brings ``S = mtp_step + 1`` rows.
        tp: tensor-parallel ranks per data-parallel group (token padding unit when overlap mixes TP/SP).
        dp: data-parallel ranks.
        decode_overlap, prefill_overlap: two micro-batches in flight (two regions).
        graph_max_batch_size: ``Gq``, the largest decode CUDA-graph batch in requests (0 without graphs);
            graphs may be captured for more requests than are admitted.

    The decode batch splits in two micro-batches only when ``decode_overlap`` is on *and* ``dp > 1``; with
    ``dp == 1`` the whole decode batch runs in one forward, so halving the rows on the flag alone would
    overflow (R=256, B=128, decode_overlap, dp=1 needs 256 rows, not 128).
    """
    for name, value, low in (
        ("batch_max_tokens", batch_max_tokens, 1),
        ("max_req_num", max_req_num, 1),
        ("mtp_step", mtp_step, 0),
        ("tp", tp, 1),
        ("dp", dp, 1),
        ("graph_max_batch_size", graph_max_batch_size, 0),
        ("head_dim", head_dim, 1),
    ):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"plan_c128_scratch: {name} must be an integer >= {low}, got {value!r}")
    batch_max_tokens, max_req_num, mtp_step, tp, dp, graph_max_batch_size, head_dim = (
        int(v) for v in (batch_max_tokens, max_req_num, mtp_step, tp, dp, graph_max_batch_size, head_dim)
    )
    overlap = bool(decode_overlap or prefill_overlap)
    regions = 2 if overlap else 1

    def padded(x: int) -> int:  # token padding so TP/SP-mixed layers split evenly
        return _ceil_div(x, tp) * tp if overlap else x

    split = 2 if (decode_overlap and dp > 1) else 1
    rows_per_decode_request = mtp_step + 1
    rows = max(
        padded(batch_max_tokens),
        padded(_ceil_div(max_req_num, split) * rows_per_decode_request),
        padded(_ceil_div(graph_max_batch_size, split) * rows_per_decode_request),
    )
    return C128ScratchPlan(regions=regions, rows_per_region=rows, head_dim=head_dim)


class Workspace:
    """Scratch memory allocated from a :class:`C128ScratchPlan`.

    ``c128_scratch(region, rows)`` returns a float32 ``[rows, head_dim]`` view of that region; asking for more
    rows than planned raises :class:`CapacityError` (before anything is launched). The views of one region
    alias each other; two regions never overlap, so two micro-batches on two streams can run at once.
    """

    def __init__(self, plan: C128ScratchPlan, device="cuda"):
        self.plan = plan
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = torch.empty(
            plan.regions, plan.rows_per_region, plan.head_dim, dtype=torch.float32, device=self.device
        )

    def c128_scratch(self, region: int, rows: int) -> torch.Tensor:
        plan = self.plan
        if (
            isinstance(region, (bool, np.bool_))
            or not isinstance(region, (int, np.integer))
            or not 0 <= region < plan.regions
        ):
            raise CapacityError(f"c128_scratch: region {region!r} does not exist (the plan has {plan.regions})")
        if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)) or rows < 0:
            raise CapacityError(f"c128_scratch: rows must be an integer >= 0, got {rows!r}")
        if rows > plan.rows_per_region:
            raise CapacityError(
                f"c128_scratch: region {region} asked for {rows} rows but holds {plan.rows_per_region} "
                f"(planned for batch and request limits; re-plan with the serving configuration in use)"
            )
        return self.buffer[region, :rows]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * 4
