"""What a backend is: the part of the cache that computes entries and keeps per-request state.

``CompressedKVCache`` owns validation, the request table and the output pool, and hands a backend a validated
:class:`StepInput`. A backend writes the entry of every row that closes a group into the pool and updates its
per-request state. Two rules tell the cache which rewinds the state can serve: :meth:`Backend.needs_from`
(the oldest position a step starting at ``start`` reads from the state; ``NO_STATE`` when it reads none) and
:meth:`Backend.retained_from` (the oldest position the state still holds after a step).

Kernel backends (``triton``, ``online``) run exactly what an engine runs: :func:`~dsv4_compressor.ops.build_plan`
then :func:`~dsv4_compressor.ops.compress` / :func:`~dsv4_compressor.ops.compress_online_hca` on the cache's
tensors (:meth:`KernelBackend.launch`, which the cache's CUDA graphs capture).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ..config import CompressorConfig, CompressorParams
from ..pool import EntryPool

__all__ = ["Backend", "RingBackend", "KernelBackend", "StepInput", "NO_STATE"]

#: ``needs_from`` of a step that reads no saved state.
NO_STATE = np.iinfo(np.int64).max


@dataclass
class StepInput:
    """A validated step, as the backends see it.

    ``slots``, ``starts``, ``counts``, ``row0``: per request, host int64 arrays (``row0`` = first row in
    ``kv_score``). ``host_meta``: int64 ``[3, T]``, the per-row ``positions``, ``row_req`` and ``out_slot``
    an engine would pass to ``build_plan`` (``out_slot`` is ``-1`` off group-closing rows); ``positions``,
    ``row_req``, ``out_slot``: the same on the device (``None`` for the reference backend, which needs none).
    ``decode``: every request brings at most ``mtp_step + 1`` rows.
    """

    slots: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    row0: np.ndarray
    kv_score: torch.Tensor
    host_meta: np.ndarray
    decode: bool
    positions: torch.Tensor | None = None
    row_req: torch.Tensor | None = None
    out_slot: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.kv_score.shape[0])

    @property
    def out_slot_host(self) -> np.ndarray:
        return self.host_meta[2]


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
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of per-request state this backend owns, by name."""

    @abstractmethod
    def state_bytes_per_request(self) -> int:
        """Bytes of per-request state this backend keeps for one layer."""

    @abstractmethod
    def run(self, step: StepInput) -> None:
        """Compute and store the entries closed by the step's rows, then update the state."""

    @abstractmethod
    def needs_from(self, starts: np.ndarray) -> np.ndarray:
        """Per request, the oldest position whose saved state a step starting at ``start`` reads (``NO_STATE``:
        none)."""

    @abstractmethod
    def retained_from(self, ends: np.ndarray, previous: np.ndarray) -> np.ndarray:
        """Per request, the oldest position the state still serves after a step ending at ``end``;
        ``previous`` is the value before the step (positions below it were already lost)."""

    def check_capacity(self, rows: int, requests: int) -> None:  # noqa: B027 - optional hook
        """Raise a ``CapacityError`` if a step of ``rows`` rows does not fit this backend's buffers."""

    def nbytes(self) -> int:
        """Bytes of every tensor this backend owns (state and scratch)."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())


class RingBackend(Backend):
    """Ring state (SPEC section 6): float32 rows ``[kv (W) | score + ape (W)]`` of past positions,
    ``ring_rows(mtp_step)`` rows per request, row ``position % ring`` (the layout ``ops.compress`` reads).

    A step reads old rows before it saves its new ones, and saves only each request's last ``min(n, ring)``
    rows, so a rewind of up to ``mtp_step`` positions always finds the rows it needs.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ring_rows = self.config.ring_rows(self.mtp_step)
        self.ring = torch.zeros(
            self.max_requests, self.ring_rows, self.config.row_width, dtype=torch.float32, device=self.device
        )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"ring": self.ring}

    def state_bytes_per_request(self) -> int:
        return self.config.ring_bytes(self.mtp_step)

    def needs_from(self, starts: np.ndarray) -> np.ndarray:
        r = self.config.ratio
        back = r if self.config.overlap else 0
        if r & (r - 1) == 0:  # (starts // r) * r: the start of the first group a row of this step can close
            return np.maximum((starts & -r) - back, 0)
        return np.maximum(starts // r * r - back, 0)

    def retained_from(self, ends: np.ndarray, previous: np.ndarray) -> np.ndarray:
        return np.maximum(previous, ends - self.ring_rows)


class KernelBackend(Backend):
    """A backend that runs the ops: plan the step on the device, then compress. :meth:`launch` is everything one
    layer launches for one step (no host work that depends on the step's values), so CUDA graphs capture it."""

    #: The plan of the last steps and the step shape it holds: ``(requests, rows)``.
    _plan: torch.Tensor | None = None
    _plan_holds: tuple[int, int] = (0, -1)

    #: The scratch of kernels that split a group's channels over programs (a region of it per step).
    workspace = None
    scratch_region = 0

    def use_workspace(self, workspace, scratch_region: int, batch_max_tokens: int) -> None:
        """Take ``workspace`` (a :class:`~dsv4_compressor.workspace.Workspace`; ``None``: plan one here for
        ``batch_max_tokens`` and this cache's ``max_requests`` and ``mtp_step``) and the region its steps use."""
        from ..workspace import Workspace, plan_c128_scratch

        if workspace is None:
            plan = plan_c128_scratch(
                batch_max_tokens=batch_max_tokens,
                max_req_num=self.max_requests,
                mtp_step=self.mtp_step,
                head_dim=self.config.head_dim,
            )
            workspace = Workspace(plan, device=self.device)
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a Workspace, got {type(workspace).__name__}")
        if workspace.plan.head_dim != self.config.head_dim or workspace.device != self.device:
            raise ValueError(
                f"workspace is for head_dim {workspace.plan.head_dim} on {workspace.device}; this cache has "
                f"head_dim {self.config.head_dim} on {self.device}"
            )
        workspace.c128_scratch(scratch_region, 0)  # refuses a region the workspace does not have
        self.workspace = workspace
        self.scratch_region = scratch_region

    def nbytes(self) -> int:
        return super().nbytes() + (self.workspace.nbytes if self.workspace is not None else 0)

    def run(self, step: StepInput) -> None:
        # One plan buffer, reused while steps have as many requests and no more rows (decode steps); like the
        # state, only this layer's launches touch it, in stream order.
        rows, requests = step.rows, max(1, len(step.slots))
        held_requests, held_rows = self._plan_holds
        if requests != held_requests or rows > held_rows:
            self._plan = self.plan_buffer(rows, requests)
            self._plan_holds = (requests, rows)
        self.launch(step.kv_score, step.positions, step.row_req, step.out_slot, self._plan, decode=step.decode)

    def plan_buffer(self, rows: int, requests: int) -> torch.Tensor:
        """A plan for ``rows`` rows and ``requests`` requests (``build_plan`` writes every int a step reads)."""
        from .. import ops  # the kernels are decorated on first use (TRITON_INTERPRET is read then)

        requests = max(1, requests)
        numel = ops.plan_numel(rows, requests, self.config.ratio)
        return torch.empty((requests, -(-numel // requests)), dtype=torch.int32, device=self.device)

    def launch(
        self, kv_score, positions, row_req, out_slot, plan, *, decode: bool, scratch_region: int | None = None
    ) -> None:
        from .. import ops

        ops.build_plan(
            plan, positions, row_req, out_slot, ratio=self.config.ratio, num_slots=self.max_requests,
            mtp_step=self.mtp_step,
        )  # fmt: skip
        self.compress(kv_score, plan, decode=decode, scratch_region=scratch_region)

    @abstractmethod
    def compress(self, kv_score, plan, *, decode: bool, scratch_region: int | None = None) -> None:
        """The layer's compress op(s) on this backend's state and the pool (``scratch_region``: the workspace
        region to use instead of the backend's own, for a second micro-batch)."""
