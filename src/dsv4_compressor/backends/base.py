"""What a backend is: the part of the cache that computes entries and keeps per-request state.

``CompressedKVCache`` owns validation, the request table and the output pool; a backend gets a validated
step (a :class:`~dsv4_compressor.step.StepDescriptor` plus ``kv_score``) and must, for every row that closes
a group, write that group's entry into the pool, then update its per-request state. Two rules tell the
cache which rewinds the state can serve: :meth:`Backend.needs_from` (the oldest position a step starting at
``start`` reads from state) and :meth:`Backend.retained_from` (the oldest position the state still holds
after a step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..config import CompressorConfig, CompressorParams
from ..pool import EntryPool
from ..step import StepDescriptor

__all__ = ["Backend", "RingBackend"]


class Backend(ABC):
    name = "abstract"

    def __init__(
        self,
        config: CompressorConfig,
        params: CompressorParams,
        *,
        max_requests: int,
        mtp_step: int,
        pool: EntryPool,
        device,
    ):
        self.config = config
        self.params = params
        self.max_requests = max_requests
        self.mtp_step = mtp_step
        self.pool = pool
        self.device = torch.device(device)

    @abstractmethod
    def state_bytes_per_request(self) -> int:
        """Bytes of per-request state this backend keeps for one layer."""

    @abstractmethod
    def step(self, desc: StepDescriptor, kv_score: torch.Tensor) -> None:
        """Compute and store the entries closed by the step's rows, then update the state."""

    @abstractmethod
    def needs_from(self, start: int) -> int | None:
        """Oldest position whose saved state a step of one request starting at ``start`` reads (``None``:
        it reads no saved state)."""

    @abstractmethod
    def retained_from(self, start: int, end: int, previous: int) -> int:
        """Oldest position the state still serves after a step ``[start, end)``; ``previous`` is the value
        before the step (positions below it were already lost)."""

    def check_capacity(self, rows: int, requests: int) -> None:  # noqa: B027 - optional hook
        """Raise (a ``ValueError``) if a step of ``rows`` rows and ``requests`` requests does not fit this
        backend's buffers; called by the cache before anything changes."""

    def begin(self, slot: int) -> None:  # noqa: B027 - optional hook
        """A request begins in ``slot`` (a step at ``start == 0``)."""


class RingBackend(Backend):
    """Ring state (SPEC section 6): float32 rows ``[kv (W) | score + ape (W)]`` of past positions,
    ``ring_rows(mtp_step)`` rows per request, row ``position % ring``.

    A step reads old rows before it saves its new ones, and saves only each request's last
    ``min(n, ring)`` rows, so a rewind of up to ``mtp_step`` positions always finds the rows it needs.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ring_rows = self.config.ring_rows(self.mtp_step)
        self.ring = torch.zeros(
            self.max_requests, self.ring_rows, self.config.row_width, dtype=torch.float32, device=self.device
        )

    def state_bytes_per_request(self) -> int:
        return self.config.ring_bytes(self.mtp_step)

    def needs_from(self, start: int) -> int:
        r = self.config.ratio
        first_group = start // r  # the first group a row of this step can close
        return max(0, (first_group - (1 if self.config.overlap else 0)) * r)

    def retained_from(self, start: int, end: int, previous: int) -> int:
        return max(previous, end - self.ring_rows)
