"""``backend="online"``: HCA with a running softmax state per channel instead of a 128-row ring.

What a rewind needs is kept as *states*, not raw rows: ``mtp_step + 1`` banks of ``(max, sum, weighted sum)``
per channel, the states after each of the last ``mtp_step + 1`` lengths. Banks cost ``3 * H * 4`` bytes each
(6 KiB at H = 512), a raw row ``2 * H * 4`` (4 KiB); keeping the committed state plus the raw rows since would
be slightly smaller, but a restart would then replay those rows before the step's own work, and the request
program would read the rows it is about to overwrite. With banks, a restart at any of the kept lengths is one
bank read, and each new row writes one bank. At mtp_step 3 that is 24 KiB per request per layer, against
528 KiB of ring (22x less).

Overlapping kinds (CSA, indexer) have windows that span two groups, so they keep the ring path: for them this
backend runs the Triton ring kernels (:class:`~.triton.TritonRingBackend`) unchanged.
"""

from __future__ import annotations

import torch

from ..kernels.numerics import exact_fp8_default
from ..kernels.online_hca import online_hca_step
from ..step import StepDescriptor
from .base import Backend
from .triton import TritonRingBackend

__all__ = ["OnlineBackend"]


class OnlineBackend(Backend):
    """Online-softmax state for non-overlapping kinds (HCA); the ring kernels for the others.

    Args (besides the common ones): ``exact_fp8`` as for the triton backend; ``block_t`` rows per tile and
    ``num_warps`` for prefill / mixed steps (default: from the step's shape,
    :func:`~..kernels.online_hca.prefill_launch_shape`); ``decode_warps`` and ``channel_major`` (register tile
    layout) for decode steps. Other options are passed to the ring backend for overlapping kinds.
    """

    name = "online"

    def __init__(
        self,
        *args,
        exact_fp8: bool | None = None,
        block_t: int | None = None,
        num_warps: int | None = None,
        decode_warps: int = 4,
        channel_major: bool = False,
        **kwargs,
    ):
        self.ring_backend = None
        ring_options = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("config", "params", "max_requests",
                                                                           "mtp_step", "pool", "device")}  # fmt: skip
        super().__init__(*args, **kwargs)
        if self.config.overlap:
            self.ring_backend = TritonRingBackend(*args, exact_fp8=exact_fp8, **kwargs, **ring_options)
            return
        if ring_options:
            raise ValueError(f"online backend: unknown options {sorted(ring_options)} for {self.config.name}")
        self.exact_fp8 = exact_fp8_default(self.device) if exact_fp8 is None else bool(exact_fp8)
        self.block_t = block_t
        self.num_warps = num_warps
        self.decode_warps = decode_warps
        self.channel_major = channel_major
        self.banks = self.mtp_step + 1
        h = self.config.head_dim
        self.state = torch.zeros(self.max_requests, self.banks, 3, h, dtype=torch.float32, device=self.device)

    @property
    def uses_ring(self) -> bool:
        return self.ring_backend is not None

    def state_bytes_per_request(self) -> int:
        if self.uses_ring:
            return self.ring_backend.state_bytes_per_request()
        return self.banks * 3 * self.config.head_dim * 4

    def needs_from(self, start: int) -> int | None:
        if self.uses_ring:
            return self.ring_backend.needs_from(start)
        return start if start % self.config.ratio else None  # a group boundary starts from an empty state

    def retained_from(self, start: int, end: int, previous: int) -> int:
        if self.uses_ring:
            return self.ring_backend.retained_from(start, end, previous)
        return max(previous, end - self.mtp_step)

    def is_decode(self, desc: StepDescriptor) -> bool:
        """Every request brings at most ``mtp_step + 1`` rows (the decode-specialised launch applies)."""
        return all(n <= self.mtp_step + 1 for _, _, n, _ in desc.requests)

    def check_capacity(self, rows: int, requests: int) -> None:
        if self.uses_ring:
            self.ring_backend.check_capacity(rows, requests)

    def step(self, desc: StepDescriptor, kv_score: torch.Tensor) -> None:
        self.launch(desc, kv_score, decode=self.is_decode(desc))

    def launch(self, desc: StepDescriptor, kv_score: torch.Tensor, *, decode: bool, **_) -> None:
        """One launch for any step (decode, prefill or mixed); CUDA-graph capturable. ``decode=True`` graphs
        replay only steps where every request brings at most ``mtp_step + 1`` rows."""
        if self.uses_ring:
            self.ring_backend.launch(desc, kv_score, decode=decode)
            return
        online_hca_step(
            kv_score, self.state, desc, self.params, self.pool, decode=decode, exact_fp8=self.exact_fp8,
            block_t=self.block_t, num_warps=self.num_warps, decode_warps=self.decode_warps,
            channel_major=self.channel_major,
        )  # fmt: skip
