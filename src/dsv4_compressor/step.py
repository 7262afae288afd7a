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

Two compacted lists let kernels launch programs only where work can be:

=================  =========================================================================================
``first_rows``     ``[R]``: the row of each request's first position (``-1`` past the step's requests)
``closing_rows``   ``[T // r + R]``: the rows that close a group, in order (``-1`` padding); no step can close
                   more groups than that, so the list length, like every grid, depends only on the shapes
=================  =========================================================================================

Kernels read these lists as records that repeat the row's fields (``request_records`` ``[R, 6]`` =
``row, slot, start, row0, end, first_out``, where ``first_out`` is the ``out_slot`` of the request's first
group-closing row in the step, or ``-1``; ``closing_records`` ``[T // r + R, 7]`` = ``row, position, slot,
start, row0, end, out_slot``), so a program finds everything about its row, and a decode program where its
entry goes, in one memory round trip instead of two.

A window position ``q`` of row ``t`` lives in ``kv_score[req_row0 + q - req_start]`` when ``q >= req_start``
and in the request's saved state otherwise. The descriptor depends on the ratio and the page tables, so one
descriptor serves every layer of a kind. Launch grids depend only on ``T`` and ``R``; padding rows
(``req_slot == -1``, ``out_slot == -1``) and ``-1`` list entries do nothing, so a CUDA graph captured for ``T``
rows and ``R`` requests replays any step of at most that many once the buffers are refilled
(:meth:`StepDescriptor.copy_`).
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

    ``packed`` is one 1-D int32 tensor ``[6 * T | 6 * R | 7 * (T // r + R)]`` holding the six per-row fields,
    then the request records, then the closing-row records; the named fields are views of it, so a step
    needs one host-to-device copy. ``requests`` keeps the host-side ``(slot, start, n, row0)`` of each request for
    backends that work request by request (the reference backend) and for bookkeeping; kernels never read it.
    """

    packed: torch.Tensor
    requests: list[tuple[int, int, int, int]]
    valid_rows: int
    num_rows: int
    max_requests: int
    ratio: int

    @property
    def num_closing(self) -> int:
        """Length of ``closing_rows``: ``T // r + R``, the most groups one step can close."""
        return self.num_rows // self.ratio + self.max_requests

    def __getattr__(self, name: str) -> torch.Tensor:
        t = self.__dict__["num_rows"]
        if name in FIELDS:
            i = FIELDS.index(name)
            return self.packed[i * t : (i + 1) * t]
        r_cap = self.__dict__["max_requests"]
        if name == "request_records":
            return self.packed[6 * t : 6 * t + 6 * r_cap].view(r_cap, 6)
        if name == "closing_records":
            return self.packed[6 * t + 6 * r_cap :].view(-1, 7)
        if name == "first_rows":
            return self.request_records[:, 0]
        if name == "closing_rows":
            return self.closing_records[:, 0]
        raise AttributeError(name)

    def copy_(self, other: StepDescriptor) -> StepDescriptor:
        """Refill this descriptor's buffers in place (for CUDA-graph replay) from a step of at most as many rows
        and requests (and the same ratio); the rest becomes padding."""
        if other.num_rows > self.num_rows or other.max_requests > self.max_requests or other.ratio != self.ratio:
            raise ValueError(
                f"descriptor holds {self.num_rows} rows / {self.max_requests} requests at ratio {self.ratio}; "
                f"cannot hold {other.num_rows} rows / {other.max_requests} requests at ratio {other.ratio}"
            )
        host = _layout(
            other.host_fields(), self.num_rows, self.max_requests, self.ratio, other.requests, other.valid_rows
        )
        self.packed.copy_(torch.from_numpy(host).to(self.packed.device), non_blocking=False)
        self.requests = list(other.requests)
        self.valid_rows = other.valid_rows
        return self

    def host_fields(self) -> np.ndarray:
        """The six per-row fields of the valid rows, as a host array ``[6, valid_rows]``."""
        return self.packed[: 6 * self.num_rows].view(6, self.num_rows)[:, : self.valid_rows].cpu().numpy()


def _layout(fields: np.ndarray, rows: int, max_requests: int, ratio: int, requests, total: int) -> np.ndarray:
    """Pack ``fields [6, total]`` into the 1-D layout for ``rows`` rows and ``max_requests`` requests."""
    out = np.zeros((6, rows), dtype=np.int64)
    out[FIELDS.index("req_slot")] = -1
    out[FIELDS.index("out_slot")] = -1
    out[:, :total] = fields
    req = np.full((max_requests, 6), -1, dtype=np.int64)
    for k, (slot, start, n, row0) in enumerate(requests):
        first = row0 + (ratio - 1 - start % ratio)  # the row closing the request's first group, if it is here
        first_out = out[FIELDS.index("out_slot"), first] if first < row0 + n else -1
        req[k] = (row0 if n > 0 else -1, slot, start, row0, start + n, first_out)
    closing = np.full((rows // ratio + max_requests, 7), -1, dtype=np.int64)
    rows_closing = np.nonzero(out[0, :total] % ratio == ratio - 1)[0]
    closing[: len(rows_closing), 0] = rows_closing
    closing[: len(rows_closing), 1:] = out[[0, 1, 2, 3, 4, 5]][:, rows_closing].T
    return np.concatenate([out.reshape(-1), req.reshape(-1), closing.reshape(-1)]).astype(np.int32)


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
    pad_requests_to: int | None = None,
) -> StepDescriptor:
    """Build the descriptor of a step on the host and move it to ``device`` in one copy.

    Args:
        slots, starts, num_rows: per request in the step, in ``kv_score`` order.
        ratio: tokens per entry ``r``; a row at position ``p`` with ``p % r == r - 1`` closes group
            ``p // r``.
        page_table: int array ``[slots, pages_per_request]`` of page ids (``-1`` unallocated), or ``None`` to
            mark no output (every ``out_slot`` is ``-1``).
        pad_to: total rows ``T`` including padding (defaults to the step's rows).
        pad_requests_to: request capacity ``R`` (defaults to the step's requests).
    """
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    counts = np.asarray(num_rows, dtype=np.int64).reshape(-1)
    total = int(counts.sum())
    rows = total if pad_to is None else pad_to
    max_requests = len(counts) if pad_requests_to is None else pad_requests_to
    if rows < total or max_requests < len(counts):
        raise ValueError(
            f"pad_to={pad_to} / pad_requests_to={pad_requests_to} smaller than the step's {total} rows / "
            f"{len(counts)} requests"
        )
    row0 = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else np.zeros(0, np.int64)

    fields = np.zeros((len(FIELDS), total), dtype=np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    positions = starts[owner] + (np.arange(total) - row0[owner])
    fields[0] = positions
    fields[1] = slots[owner]
    fields[2] = starts[owner]
    fields[3] = row0[owner]
    fields[4] = (starts + counts)[owner]
    fields[5] = -1
    closes = positions % ratio == ratio - 1
    if page_table is not None and closes.any():
        group = positions[closes] // ratio
        page = page_table[slots[owner][closes], group // page_size]
        if (page < 0).any():
            raise ValueError("internal: an entry closed by this step has no page allocated")
        fields[5][closes] = page * page_size + group % page_size
    if fields.max(initial=0) >= 2**31:
        raise ValueError("step descriptor values exceed int32")
    requests = [(int(s), int(a), int(n), int(r0)) for s, a, n, r0 in zip(slots, starts, counts, row0)]
    packed = torch.from_numpy(_layout(fields, rows, max_requests, ratio, requests, total))
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    return StepDescriptor(packed, requests, total, rows, max_requests, ratio)
