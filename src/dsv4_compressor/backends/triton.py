"""``backend="triton"``: the ring-state Triton kernels the engines run (SPEC sections 6-7), built right.

Per step and layer:

===================  ========================================================================================
HCA, ``tiled``       ``window_compress`` (row x 64-channel tile -> float32 scratch), then ``norm_rope_pack``
                     (RMSNorm, rope, FP8 pack, page write, ring save): 2 launches for every kind of step.
HCA ``single``,      ``compress_single`` (whole window per program) and, for prefill / mixed steps,
CSA, indexer         ``ring_save``; decode steps (every request brings at most ``mtp_step + 1`` rows) save in
                     the same launch: 1 launch.
``fuse_ape=False``   one more launch first: ``ape_add`` adds the APE bias to ``kv_score`` in place, as the
                     engines do; by default the bias is added on load and ``kv_score`` is left untouched.
===================  ========================================================================================

The scratch comes from a :class:`~dsv4_compressor.workspace.Workspace`; its capacity is checked against the
step's row count before anything is launched (also when no row closes a group, since a CUDA graph captured
on such a step replays on steps where rows do).
"""

from __future__ import annotations

import torch

from ..kernels.ape import ape_add
from ..kernels.c128_two_stage import norm_rope_pack, window_compress
from ..kernels.fused_compress import compress_single
from ..kernels.numerics import exact_fp8_default
from ..kernels.ring_save import ring_save
from ..step import StepDescriptor
from ..workspace import Workspace, plan_c128_scratch
from .base import RingBackend

__all__ = ["TritonRingBackend"]


class TritonRingBackend(RingBackend):
    """Ring state + Triton kernels.

    Args (besides the common ones, passed through ``CompressedKVCache(..., **backend_options)``):
        c128_kernel: ``"tiled"`` (two-stage, default) or ``"single"`` for non-overlapping kinds (HCA);
            overlapping kinds (CSA, indexer) and head sizes that are not a multiple of 64 run single-stage.
        fuse_ape: add the APE bias on load (default) instead of a separate in-place ``ape_add`` launch.
        workspace: the C128 scratch to use (default: planned here for ``batch_max_tokens`` and this cache's
            ``max_requests`` and ``mtp_step``).
        scratch_region: which workspace region this backend's steps use (one per micro-batch in flight).
        batch_max_tokens: used only to plan the default workspace.
        exact_fp8: integer FP8 rounding instead of the hardware conversion (default: only under the
            Triton interpreter / on CPU).
        c128_block_t, c128_warps: stage-1 tile rows and warps (64 and 4 measured best at B = 64, 256).
    """

    name = "triton"

    def __init__(
        self,
        *args,
        c128_kernel: str = "tiled",
        fuse_ape: bool = True,
        workspace: Workspace | None = None,
        scratch_region: int = 0,
        batch_max_tokens: int = 8192,
        exact_fp8: bool | None = None,
        c128_block_t: int = 64,
        c128_warps: int = 4,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.c128_block_t = c128_block_t
        self.c128_warps = c128_warps
        if c128_kernel not in ("tiled", "single"):
            raise ValueError(f"c128_kernel must be 'tiled' or 'single', got {c128_kernel!r}")
        # The tiled kernel pools 64-channel tiles of a non-overlapping window; anything else runs single-stage.
        self.tiled = c128_kernel == "tiled" and not self.config.overlap and self.config.head_dim % 64 == 0
        self.c128_kernel = "tiled" if self.tiled else "single"
        self.fuse_ape = bool(fuse_ape)
        self.exact_fp8 = exact_fp8_default(self.device) if exact_fp8 is None else bool(exact_fp8)
        self.scratch_region = scratch_region
        self.workspace = workspace
        if self.tiled and workspace is None:
            plan = plan_c128_scratch(
                batch_max_tokens=batch_max_tokens,
                max_req_num=self.max_requests,
                mtp_step=self.mtp_step,
                head_dim=self.config.head_dim,
            )
            self.workspace = Workspace(plan, device=self.device)
        if self.workspace is not None and self.workspace.plan.head_dim != self.config.head_dim:
            raise ValueError(
                f"workspace head_dim {self.workspace.plan.head_dim} != config head_dim {self.config.head_dim}"
            )

    def check_capacity(self, rows: int, requests: int) -> None:
        if self.tiled:
            self.workspace.c128_scratch(self.scratch_region, rows)

    def launches_per_step(self, decode: bool) -> int:
        base = 2 if self.tiled else (1 if decode else 2)
        return base + (0 if self.fuse_ape else 1)

    def is_decode(self, desc: StepDescriptor) -> bool:
        """Every request brings at most ``mtp_step + 1`` rows (the single-stage kernel may then save in-kernel)."""
        return all(n <= self.mtp_step + 1 for _, _, n, _ in desc.requests)

    def step(self, desc: StepDescriptor, kv_score: torch.Tensor) -> None:
        self.launch(desc, kv_score, decode=self.is_decode(desc))

    def launch(
        self, desc: StepDescriptor, kv_score: torch.Tensor, *, decode: bool, scratch_region: int | None = None
    ) -> None:
        """Launch the step's kernels; no host synchronisation, grids depend only on ``desc.num_rows``, so this
        can be captured in a CUDA graph (``decode=True`` graphs replay only decode / verify steps)."""
        rows = desc.num_rows
        scratch = None
        if self.tiled:  # capacity check before any launch
            region = self.scratch_region if scratch_region is None else scratch_region
            scratch = self.workspace.c128_scratch(region, rows)
        if rows == 0:
            return
        params, add_ape = self.params, self.fuse_ape
        if not self.fuse_ape:
            ape_add(kv_score, params.ape, desc)
        if self.tiled:
            window_compress(
                kv_score, self.ring, desc, params, scratch, add_ape=add_ape, block_t=self.c128_block_t,
                num_warps=self.c128_warps,
            )  # fmt: skip
            norm_rope_pack(
                scratch, kv_score, self.ring, desc, params, self.pool, add_ape=add_ape, save_rows=True,
                exact_fp8=self.exact_fp8,
            )  # fmt: skip
        else:
            compress_single(
                kv_score, self.ring, desc, params, self.pool, add_ape=add_ape, save_rows=decode,
                exact_fp8=self.exact_fp8,
            )  # fmt: skip
            if not decode:
                ring_save(kv_score, self.ring, params.ape, desc, add_ape=add_ape)
