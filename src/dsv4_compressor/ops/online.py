"""Compress one HCA layer's step with the online-softmax state (banks per request slot, no ring)."""

from __future__ import annotations

import torch

from ..kernels import plan as _plan
from ..kernels.online_hca import launch_online_hca, splits
from ..kernels.pdl import pdl_enabled
from ..kernels.ring import kv_ref
from .checks import PlanInfo, _banks, _checks_only, _common, _float, _outputs, _scratch
from .compression import _ape_ref, _entry
from .order import _compress_launch


def compress_online_hca(
    kv_score: torch.Tensor,
    plan: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    state_banks: torch.Tensor,
    out_pages: torch.Tensor | None,
    *,
    page_size: int,
    eps: float = 1e-6,
    decode: bool = False,
    out_keys: torch.Tensor | None = None,
    exact_fp8: bool | None = None,
    scratch: torch.Tensor | None = None,
    layout: str = "v4",
) -> None:
    """Compress one HCA layer's step with the online-softmax state: one launch, no ring (two launches and a
    scratch for a prefill step given one).

    Same entries as :func:`compress` with ``kind="hca"`` (records in ``out_pages``, values in ``out_keys``).
    The state is, per request slot, ``B = mtp_step + 1`` banks of ``(running max, running sum, running weighted
    sum)`` per channel: ``state_banks`` float32
    ``[slots, B, 3, H]`` (24 KiB per request at H = 512, B = 4, against 528 KiB of ring), each slot's banks
    contiguous and slots ``stride(0) >= B * 3 * H`` apart (a view into an engine's padded blocks: vLLM's
    request-scoped block; other strides are an ``OpError`` before any launch). Bank
    ``L % B`` holds the state after the first ``L`` positions, so a step may restart at any of the last ``B``
    lengths (an MTP rewind) with no commit step; a start on a group boundary needs no state at all.

    ``decode=True`` (every request brings at most ``mtp_step + 1`` rows) launches request programs only.
    ``scratch``: float32 ``[>= T, H]`` (a :class:`~dsv4_compressor.workspace.Workspace` region, the one
    :func:`compress` takes), used by steps that are not ``decode`` and have at most 3 groups per SM
    (:func:`~dsv4_compressor.kernels.online_hca.splits`: chunks up to a few groups per multiprocessor): each
    group's channels are then pooled by ``H / 32`` programs into the scratch row of its closing row, and a
    second launch finishes the entries (an 8K chunk's 64 groups otherwise run on 64 SMs). Decode steps never
    touch it. Written.
    Other arguments (``layout`` included) as for :func:`compress`.
    """
    op = "compress_online_hca"
    info, head, rope, device = _common(
        op, kv_score, plan, ape, norm_weight, cos, sin, overlap=False, latent=True, page_size=page_size, layout=layout
    )
    rows = info.rows
    _banks(op, state_banks, info, head=head, device=device)
    _outputs(op, "hca", out_pages, out_keys, latent=True, head=head, rope=rope, page_size=page_size, device=device,
             layout=layout)  # fmt: skip
    if scratch is not None:
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    if _checks_only():
        return
    _launch_online(kv_score, plan, info, ape, norm_weight, cos, sin, state_banks, out_pages, out_keys, page_size,
                   eps, decode, exact_fp8, scratch, head=head, rope=rope, device=device, layout=layout)  # fmt: skip


def _launch_online(kv, plan, info: PlanInfo, ape, norm_weight, cos, sin, state_banks, out_pages, out_keys, page_size,
                   eps, decode, exact_fp8, scratch, *, head: int, rope: int, device, layout="v4") -> None:  # fmt: skip
    """Launch a validated online HCA step on ``kv``: ``kv_score`` ``[T, 2W]``, or a projection's unsummed K-split
    partials ``[split, T, 2W]`` (the kernel adds them)."""
    rows, requests, ratio = info.rows, info.requests, info.ratio
    if rows == 0:
        return
    prm, out, meta = _entry(head, rope, True, page_size, norm_weight, cos, sin, eps, out_pages, out_keys,
                            exact_fp8, device, layout=layout)  # fmt: skip
    record_first = _compress_launch(plan)
    split = online_splits(rows=rows, ratio=ratio, decode=decode, scratch=scratch is not None, device=device)
    launch_online_hca(
        kv_ref(kv), _ape_ref(ape, head), _plan.PlanRef(plan, rows, requests), state_banks, prm, out, meta,
        ratio=ratio, closing=_plan.closing_capacity(rows, requests, ratio), decode=bool(decode),
        scratch=scratch if split else None, pdl=pdl_enabled(device), record_first=record_first,
    )  # fmt: skip


def online_splits(*, rows: int, ratio: int, decode: bool, scratch: bool, device) -> bool:
    """Whether :func:`compress_online_hca` splits a step's groups over channel tiles (two launches, through the
    scratch): a step that is not ``decode``, given a scratch, where ``kernels.online_hca.splits`` says (it depends
    on ``device``'s multiprocessors; always under the interpreter). Else one launch."""
    return not decode and scratch and splits(rows, ratio, torch.device(device))
