"""``backend="online"``: HCA with a running softmax state per channel instead of a 128-row ring, through
:func:`dsv4_compressor.ops.compress_online_hca`.

What a rewind needs is kept as *states*, not raw rows: ``mtp_step + 1`` banks of ``(max, sum, weighted sum)``
per channel, the states after each of the last ``mtp_step + 1`` lengths. Banks cost ``3 * H * 4`` bytes each
(6 KiB at H = 512), a raw row ``2 * H * 4`` (4 KiB); keeping the committed state plus the raw rows since would
be slightly smaller, but a restart would then replay those rows before the step's own work, and the request
program would read the rows it is about to overwrite. With banks, a restart at any of the kept lengths is one
bank read, and each new row writes one bank. At mtp_step 3 that is 24 KiB per request per layer, against
528 KiB of ring (22x less).

Overlapping kinds (CSA, indexer) have windows that span two groups, so they keep the ring path: for them this
backend is the Triton ring backend (:class:`~.triton.TritonRingBackend`), unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import ops
from ..kernels.c128_tiled import CHANNEL_TILE
from .base import NO_STATE, KernelBackend

__all__ = ["OnlineBackend", "make_online_backend"]


class OnlineBackend(KernelBackend):
    """Online-softmax state for non-overlapping kinds (HCA).

    Args (besides the common ones):
        workspace: the scratch that prefill steps split their groups' channels through (the tiled kernel's
            :class:`~dsv4_compressor.workspace.Workspace`; default: planned here for ``batch_max_tokens``);
            ``False``: none, every step one launch. Decode steps never use it; a step with more rows than its
            region runs in one launch.
        scratch_region: which workspace region this backend's steps use.
        batch_max_tokens: used only to plan the default workspace.
        exact_fp8: integer FP8 rounding instead of the hardware conversion (default: only on CPU).
    """

    name = "online"

    def __init__(self, *args, workspace=None, scratch_region: int = 0, batch_max_tokens: int = 8192,
                 exact_fp8: bool | None = None, **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        if self.config.overlap:
            raise ValueError(f"the online state is for non-overlapping kinds; {self.config.name} overlaps")
        self.exact_fp8 = exact_fp8
        if workspace is not False and self.config.head_dim % CHANNEL_TILE == 0:
            self.use_workspace(workspace, scratch_region, batch_max_tokens)
        self.banks = self.mtp_step + 1
        h = self.config.head_dim
        self.state = torch.zeros(self.max_requests, self.banks, 3, h, dtype=torch.float32, device=self.device)

    def state_tensors(self):
        return {"banks": self.state}

    def state_bytes_per_request(self) -> int:
        return self.banks * 3 * self.config.head_dim * 4

    def needs_from(self, starts: np.ndarray) -> np.ndarray:
        # a start on a group boundary begins from the empty state
        return np.where(starts % self.config.ratio != 0, starts, NO_STATE)

    def retained_from(self, ends: np.ndarray, previous: np.ndarray) -> np.ndarray:
        return np.maximum(previous, ends - self.mtp_step)

    def compress(self, kv_score, plan, *, decode: bool, scratch_region: int | None = None) -> None:
        rows = kv_score.shape[0]
        scratch = None
        if not decode and self.workspace is not None and rows <= self.workspace.plan.rows_per_region:
            region = self.scratch_region if scratch_region is None else scratch_region
            scratch = self.workspace.c128_scratch(region, rows)
        p, pool = self.params, self.pool
        ops.compress_online_hca(
            kv_score, plan, p.ape, p.norm_weight, p.cos, p.sin, self.state, pool.out_pages, page_size=pool.page_size,
            eps=p.eps, decode=decode, exact_fp8=self.exact_fp8, scratch=scratch,
        )  # fmt: skip


def make_online_backend(*args, **kwargs):
    """``backend="online"``: the online state for HCA, the ring kernels for overlapping kinds."""
    from .triton import TritonRingBackend

    config = kwargs["config"]
    if config.overlap:
        return TritonRingBackend(*args, **kwargs)
    return OnlineBackend(*args, **kwargs)
