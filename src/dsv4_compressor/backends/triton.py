"""``backend="triton"``: the ring-state Triton kernels the engines run, through :func:`dsv4_compressor.ops.compress`.

Per step and layer: ``build_plan`` (one launch), then

===================  ========================================================================================
HCA, ``tiled``       32-channel tile programs pool each closing window into the float32 scratch; decode steps
                     of up to 256 requests finish each entry from its last tile program and save the rows in
                     the same launch (1 launch), other steps in ``norm_rope_pack`` (2 launches).
HCA ``single``,      the single-stage kernel (whole window per program) and, for prefill / mixed steps, a
CSA, indexer         ring save; decode steps (every request at most ``mtp_step + 1`` rows) save in the same
                     launch: 1 launch.
===================  ========================================================================================

The APE bias is added on load; ``kv_score`` is never written. The scratch comes from a
:class:`~dsv4_compressor.workspace.Workspace`; its capacity is checked against the step's row count before
anything changes (also when no row closes a group, since a CUDA graph captured on such a step replays on steps
where rows do).
"""

from __future__ import annotations

from .. import ops
from ..workspace import Workspace
from .base import KernelBackend, RingBackend

__all__ = ["TritonRingBackend"]


class TritonRingBackend(KernelBackend, RingBackend):
    """Ring state + the ops' Triton kernels.

    Args (besides the common ones, passed through ``CompressedKVCache(..., **backend_options)``):
        c128_kernel: ``"tiled"`` (the tiled C128 kernel, default) or ``"single"`` for non-overlapping kinds (HCA);
            overlapping kinds (CSA, indexer) and head sizes that are not a multiple of 64 run single-stage.
        workspace: the C128 scratch to use (default: planned here for ``batch_max_tokens`` and this cache's
            ``max_requests`` and ``mtp_step``).
        scratch_region: which workspace region this backend's steps use (one per micro-batch in flight).
        batch_max_tokens: used only to plan the default workspace.
        exact_fp8: integer FP8 rounding instead of the hardware conversion (default: only on CPU).
    """

    name = "triton"

    def __init__(
        self,
        *args,
        c128_kernel: str = "tiled",
        workspace: Workspace | None = None,
        scratch_region: int = 0,
        batch_max_tokens: int = 8192,
        exact_fp8: bool | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if c128_kernel not in ("tiled", "single"):
            raise ValueError(f"c128_kernel must be 'tiled' or 'single', got {c128_kernel!r}")
        # The tiled kernel pools 64-channel tiles of a non-overlapping window; anything else runs single-stage.
        self.tiled = c128_kernel == "tiled" and not self.config.overlap and self.config.head_dim % 64 == 0
        self.c128_kernel = "tiled" if self.tiled else "single"
        self.exact_fp8 = exact_fp8
        self.workspace = None
        self.scratch_region = 0
        if self.tiled:
            self.use_workspace(workspace, scratch_region, batch_max_tokens)

    def check_capacity(self, rows: int, requests: int) -> None:
        if self.tiled:
            self.workspace.c128_scratch(self.scratch_region, rows)

    def launches_per_step(self, decode: bool, requests: int = 1) -> int:
        """Kernel launches per step of ``requests`` requests, ``build_plan`` included."""
        from ..kernels.c128_tiled import runs_in_one_launch  # imported here: it decorates kernels

        if self.tiled:
            return 1 + (1 if runs_in_one_launch(requests, decode) else 2)
        return 1 + (1 if decode else 2)

    def compress(self, kv_score, plan, *, decode: bool, scratch_region: int | None = None) -> None:
        scratch = None
        if self.tiled:
            region = self.scratch_region if scratch_region is None else scratch_region
            scratch = self.workspace.c128_scratch(region, kv_score.shape[0])
        p, pool = self.params, self.pool
        ops.compress(
            kv_score, plan, p.ape, p.norm_weight, p.cos, p.sin, self.ring, pool.out_pages, kind=self.config_kind,
            page_size=pool.page_size, eps=p.eps, decode=decode, scratch=scratch, out_keys=pool.out_keys,
            exact_fp8=self.exact_fp8,
        )  # fmt: skip

    @property
    def config_kind(self) -> str:
        """The op's ``kind`` for this config."""
        if self.config.output == "indexer":
            return "indexer"
        return "csa" if self.config.overlap else "hca"
