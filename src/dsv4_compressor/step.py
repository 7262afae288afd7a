"""The step descriptor: per-row device tensors every kernel of a step reads.

A step's ``kv_score`` holds rows of several requests, concatenated request by request, each request's rows
contiguous and in position order. For row ``t`` the descriptor gives:

=============  ===========================================================================================
``positions``  the row's position ``p``
``req_slot``   the owning request's state slot (ring / online state index); ``-1`` marks a padding row
``req_start``  the first position the request supplies in this step (``start``)
``req_row0``   the row index of that first position in ``kv_score``
``req_end``    ``start + n``: one past the request's last position in this step
``out_slot``   global output slot (``page * P + slot``) of the entry whose group this row closes, else ``-1``
=============  ===========================================================================================

A window position ``q`` of row ``t`` lives in ``kv_score[req_row0 + q - req_start]`` when ``q >= req_start``
and in the request's saved state otherwise. The descriptor depends on the ratio and the page tables, so one
descriptor serves every layer of a kind. Launch grids depend only on its row count; padding rows
(``req_slot == -1``, ``out_slot == -1``) do nothing, so a CUDA graph captured for ``T`` rows replays any step
of at most ``T`` rows once the descriptor buffers are refilled (:meth:`StepDescriptor.copy_`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["StepDescriptor", "build_step_descriptor", "FIELDS"]

FIELDS = ("positions", "req_slot", "req_start", "req_row0", "req_end", "out_slot")


@dataclass
class StepDescriptor:
    """Per-row int32 device tensors of one step (see the module docstring).

    ``packed`` is one ``[6, T]`` int32 tensor; the named fields are views of its rows, so a step needs one
    host-to-device copy. ``requests`` keeps the host-side ``(slot, start, n, row0)`` of each request for
    backends that work request by request (the reference backend) and for bookkeeping; kernels never read it.
    """

    packed: torch.Tensor
    requests: list[tuple[int, int, int, int]]
    valid_rows: int

    @property
    def num_rows(self) -> int:
        return self.packed.shape[1]

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in FIELDS:
            return self.packed[FIELDS.index(name)]
        raise AttributeError(name)

    def copy_(self, other: StepDescriptor) -> StepDescriptor:
        """Refill this descriptor's buffers in place (for CUDA-graph replay); ``other`` may have fewer rows,
        the rest become padding."""
        t = other.num_rows
        if t > self.num_rows:
            raise ValueError(f"descriptor has {self.num_rows} rows, cannot hold a step of {t}")
        self.packed[:, :t].copy_(other.packed, non_blocking=True)
        if t < self.num_rows:
            self.packed[:, t:].copy_(_padding(self.num_rows - t, self.packed.device))
        self.requests = list(other.requests)
        self.valid_rows = other.valid_rows
        return self


def _padding(rows: int, device) -> torch.Tensor:
    pad = torch.zeros(len(FIELDS), rows, dtype=torch.int32)
    pad[FIELDS.index("req_slot")] = -1
    pad[FIELDS.index("out_slot")] = -1
    return pad.to(device)


def build_step_descriptor(
    slots,
    starts,
    num_rows,
    *,
    ratio: int,
    page_table: np.ndarray | None,
    page_size: int,
    device="cpu",
    pad_to: int | None = None,
) -> StepDescriptor:
    """Build the descriptor of a step on the host and move it to ``device`` in one copy.

    Args:
        slots, starts, num_rows: per request in the step, in ``kv_score`` order.
        ratio: tokens per entry ``r``; a row at position ``p`` with ``p % r == r - 1`` closes group
            ``p // r``.
        page_table: int array ``[slots, pages_per_request]`` of page ids (``-1`` unallocated), or ``None`` to
            mark no output (every ``out_slot`` is ``-1``).
        pad_to: total rows including padding (defaults to the step's rows).
    """
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    counts = np.asarray(num_rows, dtype=np.int64).reshape(-1)
    total = int(counts.sum())
    rows = total if pad_to is None else pad_to
    if rows < total:
        raise ValueError(f"pad_to={pad_to} is smaller than the step's {total} rows")
    row0 = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else np.zeros(0, np.int64)

    out = np.zeros((len(FIELDS), rows), dtype=np.int64)
    out[FIELDS.index("req_slot")] = -1
    out[FIELDS.index("out_slot")] = -1
    owner = np.repeat(np.arange(len(counts)), counts)
    positions = starts[owner] + (np.arange(total) - row0[owner])
    out[0, :total] = positions
    out[1, :total] = slots[owner]
    out[2, :total] = starts[owner]
    out[3, :total] = row0[owner]
    out[4, :total] = (starts + counts)[owner]
    closes = positions % ratio == ratio - 1
    if page_table is not None and closes.any():
        group = positions[closes] // ratio
        page = page_table[slots[owner][closes], group // page_size]
        if (page < 0).any():
            raise ValueError("internal: an entry closed by this step has no page allocated")
        out[5, :total][closes] = page * page_size + group % page_size
    if out.max(initial=0) >= 2**31:
        raise ValueError("step descriptor values exceed int32")
    packed = torch.from_numpy(out.astype(np.int32))
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    requests = [(int(s), int(a), int(n), int(r0)) for s, a, n, r0 in zip(slots, starts, counts, row0)]
    return StepDescriptor(packed, requests, total)
