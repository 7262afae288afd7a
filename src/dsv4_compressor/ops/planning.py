"""Plan ops: allocate a step's plan, fill it from the engine's per-row metadata, copy it, check it on the device.

A plan is an int32 ``[R, k]`` tensor (layout: :mod:`dsv4_compressor.kernels.plan`) that one step's compress ops of
one ratio share; the host keeps what it was built for with it (:class:`~.checks.PlanInfo`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels import plan as _plan
from ..kernels import request_rows as _request_rows
from ..kernels import step_build as _step_build
from ..kernels.pdl import pdl_enabled
from ..kernels.state_rows import MODES as STATE_MODES
from .checks import (
    _PLAN_ATTR,
    _TABLES_ATTR,
    PlanInfo,
    _built,
    _checks_only,
    _fail,
    _int,
    _plan_capacity,
    _runnable,
    _storage_key,
    _tensor,
    plan_info,
)
from .order import _launched
from .state_rows import _remember_tables, _state_rows_args

_builds = iter(range(1, 2**62))


def plan_numel(max_rows: int, max_requests: int, ratio: int) -> int:
    """int32 elements a plan for ``max_rows`` rows and ``max_requests`` requests at ``ratio`` needs."""
    return _plan.plan_numel(max_rows, max_requests, ratio)


def empty_plan(max_rows: int, max_requests: int, ratio: int, device: torch.device) -> torch.Tensor:
    """Allocate a plan buffer: int32 ``[max_requests, k]``, reused every step.

    The first dimension is the request capacity ``R`` (grids need it on the host, so it lives in the shape);
    the buffer holds any step of at most ``max_rows`` rows at ``ratio`` or above. One plan per ratio serves
    every layer of a step.
    """
    op = "empty_plan"
    _int(op, "max_rows", max_rows)
    _int(op, "max_requests", max_requests, 1)
    _int(op, "ratio", ratio, 1)
    numel = plan_numel(max_rows, max_requests, ratio)
    return torch.full((max_requests, -(-numel // max_requests)), -1, dtype=torch.int32, device=device)


def _plan_args(op: str, plan, positions, row_req, out_slot, *, ratio, num_slots, req_state_slot, out_slot_map,
               mtp_step, out_name: str = "out_slot", map_name: str = "out_slot_map") -> int:  # fmt: skip
    """:func:`build_plan`'s checks of one plan's arguments (``out_name`` / ``map_name``: how the message names
    ``out_slot`` and ``out_slot_map``); returns the plan's request capacity. Reads no device memory."""
    _int(op, "ratio", ratio, 1)
    _int(op, "num_slots", num_slots, 0)
    _int(op, "mtp_step", mtp_step, 0)
    device = plan.device if isinstance(plan, torch.Tensor) else None
    for name, t in (("positions", positions), ("row_req", row_req), (out_name, out_slot)):
        _tensor(op, name, t, dtypes=(torch.int32, torch.int64), ndim=1, device=device, inner_contiguous=False)
    rows = positions.shape[0]
    if row_req.shape[0] != rows or out_slot.shape[0] != rows:
        _fail(op, f"positions, row_req, {out_name} differ in length ({rows}, {row_req.shape[0]}, {out_slot.shape[0]})")
    for name, t in (("positions", positions), ("row_req", row_req), (out_name, out_slot)):
        if rows > 1 and t.stride(0) != 1:
            _fail(op, f"{name} must be contiguous, got stride {t.stride(0)}")
    if req_state_slot is not None:
        _tensor(op, "req_state_slot", req_state_slot, dtypes=(torch.int32, torch.int64), ndim=1, device=device,
                inner_contiguous=False)  # fmt: skip
        if req_state_slot.shape[0] > 1 and req_state_slot.stride(0) < 1:
            _fail(op, f"req_state_slot must have a positive stride, got {req_state_slot.stride(0)}")
    if out_slot_map is not None:
        _tensor(op, map_name, out_slot_map, dtypes=(torch.int32, torch.int64), ndim=1, device=device,
                inner_contiguous=False)  # fmt: skip
        if out_slot_map.shape[0] > 1 and out_slot_map.stride(0) < 1:
            _fail(op, f"{map_name} must have a positive stride, got {out_slot_map.stride(0)}")
    return _plan_capacity(op, plan, rows, ratio, device)


#: The most requests :func:`rows_from_requests` scans in one program's registers; larger batches take torch's
#: ops (about a dozen launches).
ROWS_FROM_REQUESTS_MAX_BATCH = 1024
_INDEX_DTYPES = (torch.int32, torch.int64)


def rows_from_requests(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor | None,
    rows: int,
    *,
    pad_request: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's per-row ``(positions, row_req)`` (int64 ``[rows]`` each, new tensors) from per-request tensors,
    for :func:`build_plan`, in one launch (no host synchronisation; the grid depends on ``rows`` only).

    Args:
        req_pool_indices: int32/int64 ``[B]``: each request's state slot.
        seq_lens: int32/int64 ``[B]``: each request's length after the step.
        extend_lens: int32/int64 ``[B]``: the rows each request brings, packed request after request (a prefill
            chunk or a verify step); ``None``: a decode step, one row per request (``rows == B``).
        rows: the step's row count ``T`` (a host value: the padded token count of a graph, or the sum of the
            host's extend lengths); rows past the last request's are padding.
        pad_request: a state slot that marks padding (SGLang's request 0), or ``None``.

    Row ``t`` of request ``b`` (its ``k``-th row) is at position ``seq_lens[b] - extend_lens[b] + k`` (decode:
    ``seq_lens[b] - 1``) with ``row_req = req_pool_indices[b]``; a padding row, or one whose slot is
    ``pad_request``, gets ``row_req = -1`` (and a padding row position 0).
    """
    op = "rows_from_requests"
    device = req_pool_indices.device
    _tensor(op, "req_pool_indices", req_pool_indices, dtypes=_INDEX_DTYPES, ndim=1)
    batch = req_pool_indices.shape[0]
    _tensor(op, "seq_lens", seq_lens, dtypes=_INDEX_DTYPES, ndim=1, device=device)
    if extend_lens is not None:
        _tensor(op, "extend_lens", extend_lens, dtypes=_INDEX_DTYPES, ndim=1, device=device)
    for name, t in (("seq_lens", seq_lens), ("extend_lens", extend_lens)):
        if t is not None and t.shape[0] != batch:
            _fail(op, f"{name} has {t.shape[0]} entries for {batch} requests")
    _int(op, "rows", rows)
    if extend_lens is None and rows != batch:
        _fail(op, f"a decode step has one row per request: rows={rows} for {batch} requests")
    if pad_request is not None:
        _int(op, "pad_request", pad_request)
    _runnable(op, device)
    positions = torch.empty(rows, dtype=torch.int64, device=device)
    row_req = torch.empty(rows, dtype=torch.int64, device=device)
    if _checks_only() or rows == 0:
        return positions, row_req
    if batch > ROWS_FROM_REQUESTS_MAX_BATCH:
        return _rows_from_requests_torch(req_pool_indices, seq_lens, extend_lens, rows, pad_request)
    ext = extend_lens if extend_lens is not None else seq_lens
    _request_rows.launch_rows_from_requests(
        req_pool_indices, seq_lens, ext, positions, row_req, batch=batch, rows=rows,
        pad_req=-1 if pad_request is None else pad_request, decode=extend_lens is None,
    )  # fmt: skip
    return positions, row_req


def _rows_from_requests_torch(req_pool_indices, seq_lens, extend_lens, rows: int, pad_request):
    """:func:`rows_from_requests` in torch's ops (large batches; the tests' reference)."""
    req, seq = req_pool_indices.to(torch.int64), seq_lens.to(torch.int64)
    batch, device = req.shape[0], req.device
    if extend_lens is None:
        positions, row_req = seq - 1, req
    elif batch == 0:
        return (torch.zeros(rows, dtype=torch.int64, device=device),
                torch.full((rows,), -1, dtype=torch.int64, device=device))  # fmt: skip
    else:
        ext = extend_lens.to(torch.int64)
        ends = torch.cumsum(ext, 0)
        t = torch.arange(rows, dtype=torch.int64, device=device)
        b = torch.searchsorted(ends, t, right=True)
        valid = b < batch
        b = b.clamp(max=batch - 1)
        positions = torch.where(valid, seq[b] - ends[b] + t, 0)
        row_req = torch.where(valid, req[b], -1)
    if pad_request is not None:
        row_req = torch.where(row_req == pad_request, -1, row_req)
    return positions, row_req


def build_plan(
    plan: torch.Tensor,
    positions: torch.Tensor,
    row_req: torch.Tensor,
    out_slot: torch.Tensor,
    *,
    ratio: int,
    num_slots: int,
    req_state_slot: torch.Tensor | None = None,
    out_slot_map: torch.Tensor | None = None,
    mtp_step: int = 0,
) -> None:
    """Fill ``plan`` for one step from the engine's per-row metadata (one launch, no host synchronisation).

    Args:
        plan: int32 ``[R, k]`` from :func:`empty_plan` (written).
        positions: int32/int64 ``[T]``: each row's position ``p``.
        row_req: int32/int64 ``[T]``: each row's request state slot; ``-1`` or ``>= num_slots`` marks a padding
            row (it does nothing). Rows of a request are contiguous, positions consecutive and ascending.
        out_slot: int32/int64 ``[T]``: the global output slot (``page * P + i``) of the entry a row closes, read
            only on rows with ``p % ratio == ratio - 1`` (an engine's ``0`` or ``-1`` elsewhere is fine); ``-1``
            there writes nothing.
        ratio: ``r`` (4 for CSA and the indexer, 128 for HCA).
        num_slots: request state slots; a slot ``>= num_slots`` is padding. Every state the plan is used with
            must hold this many slots.
        req_state_slot: optional int32/int64 ``[B]`` (any stride, e.g. a column of a block table): each
            request's state slot. With it ``row_req`` holds request indices (``-1`` or ``>= B``: padding) and a
            row's slot is ``req_state_slot[row_req]`` (``-1`` or ``>= num_slots``: padding), so an engine that
            keeps a request index per row and a slot per request needs no gather of its own. A request is then a
            run of rows with one request index.
        out_slot_map: optional int32/int64 ``[N]`` (any positive stride, e.g. LightLLM's ``full_to_c4_indexs``
            indexed by token): the output slot per index. With it ``out_slot`` holds indices into the map (e.g.
            each row's token index) and a group-closing row's output slot is ``out_slot_map[out_slot[t]]``,
            read on those rows only (elsewhere ``out_slot`` may hold anything); the plan is the one
            ``out_slot=out_slot_map[out_slot]`` builds, without the engine's gather. An index outside the map
            (``< 0`` or ``>= N``) on a closing row writes nothing (as an ``out_slot`` of ``-1``) and flags the
            step: :func:`check_plan` reports it (code 9).
        mtp_step: the engine's MTP depth (draft tokens per request minus one): a step may start up to
            ``mtp_step`` positions before a request's length. Rings and online banks used with the plan must be
            sized for it, and :func:`compress` refuses smaller ones.

    A request's ``start`` is the position of its first row: a start below the previous length is an MTP rewind
    (the state already holds what the rewound step needs; nothing else is required). What the plan was built
    for is kept on the host (:func:`plan_info`); a refused call leaves the plan and that record unchanged.
    """
    op = "build_plan"
    requests = _plan_args(op, plan, positions, row_req, out_slot, ratio=ratio, num_slots=num_slots,
                          req_state_slot=req_state_slot, out_slot_map=out_slot_map, mtp_step=mtp_step)  # fmt: skip
    _runnable(op, plan.device)
    rows = positions.shape[0]
    if _checks_only():
        setattr(plan, _PLAN_ATTR, PlanInfo(rows, requests, ratio, num_slots, mtp_step, next(_builds)))
        return
    _plan.launch_build_plan(
        plan, positions, row_req, out_slot, rows=rows, requests=requests, ratio=ratio, num_slots=num_slots,
        req_state_slot=req_state_slot, out_slot_map=out_slot_map, pdl=pdl_enabled(plan.device),
    )  # fmt: skip
    info = PlanInfo(rows, requests, ratio, num_slots, mtp_step, next(_builds))
    setattr(plan, _PLAN_ATTR, info)
    _launched(plan.device, info)


def build_plans(
    plans: list[torch.Tensor],
    positions: torch.Tensor,
    row_req: torch.Tensor,
    out_slots: list[torch.Tensor],
    *,
    ratios: list[int],
    num_slots: int,
    req_state_slot: torch.Tensor | None = None,
    out_slot_maps: list[torch.Tensor | None] = None,  # None: no plan has a map (the schema's Tensor?[]=None)
    mtp_step: int = 0,
    read_rows: torch.Tensor | None = None,
    save_rows: torch.Tensor | None = None,
    state_mode: str | None = None,
    ring: int | None = None,
    req_to_token: torch.Tensor | None = None,
    token_to_state: torch.Tensor | None = None,
    state_page: int | None = None,
    page_tail: int | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
) -> None:
    """Fill several plans of one step from the same rows, e.g. a step's ratio-4 and ratio-128 plans: plan ``i``
    is byte for byte what ``build_plan(plans[i], positions, row_req, out_slots[i], ratio=ratios[i],
    out_slot_map=out_slot_maps[i], num_slots=num_slots, req_state_slot=req_state_slot, mtp_step=mtp_step)``
    writes, and its host record (:func:`plan_info`) holds the same fields. One launch of one program per plan
    for up to 2 plans whose steps :func:`build_plan` would build by one program (up to
    ``kernels.plan.PLAN_ONE_BLOCK_MAX_ROWS`` rows and requests; ``kernels.step_build.plans_in_one_launch``), else one
    :func:`build_plan` launch per plan; no host synchronisation either way.

    Args:
        plans: ``n >= 1`` distinct int32 ``[R_i, k_i]`` plans from :func:`empty_plan` (written), each holding a
            step of ``T`` rows at ``ratios[i]``; the capacities ``R_i`` may differ.
        positions: int32/int64 ``[T]``: each row's position ``p`` (shared by every plan).
        row_req: int32/int64 ``[T]``: each row's request state slot (or request index with ``req_state_slot``);
            ``-1`` or ``>= num_slots`` marks a padding row, as in :func:`build_plan` (shared).
        out_slots: ``n`` int32/int64 ``[T]`` tensors: plan ``i``'s ``out_slot`` (its global output slot of the
            entry a row closes at ``ratios[i]``, or with ``out_slot_maps[i]`` an index into that map, e.g.
            LightLLM's ``mem_index`` for every plan).
        ratios: ``n`` ints: plan ``i``'s ``r`` (e.g. ``[4, 128]``).
        num_slots: request state slots (shared), as in :func:`build_plan`.
        req_state_slot: optional int32/int64 ``[B]`` request-to-slot table (shared), as in :func:`build_plan`.
        out_slot_maps: optional list of ``n`` entries, each ``None`` or an int32/int64 ``[N_i]`` output-slot
            table (any positive stride) for plan ``i``, as ``build_plan``'s ``out_slot_map`` (e.g. LightLLM's
            ``full_to_c4_indexs`` and ``full_to_c128_indexs``); ``None``: no plan has one.
        mtp_step: the engine's MTP depth (shared), as in :func:`build_plan`.
        read_rows, save_rows, state_mode, ring, req_to_token, token_to_state, state_page, page_tail,
            block_table, block_size: optional: with ``read_rows`` and ``save_rows`` the call also writes what
            ``build_state_rows(plans[0], read_rows, save_rows, mode=state_mode, ring=ring, ...)`` writes after it
            (plan 0's state-row tables, e.g. LightLLM's C4 state rows), by plan 0's program in the same launch
            where the plans fit one, else by one more launch.

    Every plan's arguments (and the tables') are checked before anything is launched: a refused call leaves
    every plan, the tables and their records unchanged. For programmatic dependent launch the call counts as
    a build of each plan: the first compress after it on any of them waits before reading its plan record
    (:func:`records_first`), unless the tables took a launch of their own after the plans (which waited for
    them, as a separate :func:`build_state_rows` does).
    """
    op = "build_plans"
    for name, value in (("plans", plans), ("out_slots", out_slots), ("ratios", ratios)):
        if not isinstance(value, (list, tuple)):
            _fail(op, f"{name} must be a list, got {type(value).__name__}")
    n = len(plans)
    maps = [None] * n if out_slot_maps is None else out_slot_maps
    if not isinstance(maps, (list, tuple)):
        _fail(op, f"out_slot_maps must be a list or None, got {type(maps).__name__}")
    if n < 1 or len(out_slots) != n or len(ratios) != n or len(maps) != n:
        _fail(op, f"plans, out_slots, ratios, out_slot_maps must have one entry per plan (at least one), got "
                  f"{n}, {len(out_slots)}, {len(ratios)}, {len(maps)}")  # fmt: skip
    requests = []
    for i in range(n):
        requests.append(_plan_args(op, plans[i], positions, row_req, out_slots[i], ratio=ratios[i],
                                   num_slots=num_slots, req_state_slot=req_state_slot, out_slot_map=maps[i],
                                   mtp_step=mtp_step, out_name=f"out_slots[{i}]",
                                   map_name=f"out_slot_maps[{i}]"))  # fmt: skip
    device = plans[0].device  # every plan's device is positions' (checked above)
    storages = [_storage_key(p) for p in plans]
    if len(set(storages)) != n:
        _fail(op, "plans must be distinct buffers (each written by its own program)")
    rows = positions.shape[0]
    state = None
    if read_rows is not None or save_rows is not None:
        if read_rows is None or save_rows is None:
            _fail(op, "read_rows and save_rows come together (plan 0's state-row tables)")
        planned = PlanInfo(rows, requests[0], ratios[0], num_slots, mtp_step, 0)
        tables, window = _state_rows_args(op, requests[0], planned, device, read_rows, save_rows, mode=state_mode,
                                          ring=ring, req_to_token=req_to_token, token_to_state=token_to_state,
                                          state_page=state_page, page_tail=page_tail, block_table=block_table,
                                          block_size=block_size)  # fmt: skip
        state = (read_rows, save_rows, tables, STATE_MODES[state_mode], window)
    _runnable(op, device)
    route = plans_route(rows=rows, requests=requests, tables=state is not None)
    if not _checks_only():
        _step_build.launch_build_plans(
            plans, positions, row_req, out_slots, rows=rows, requests=requests, ratios=ratios, num_slots=num_slots,
            req_state_slot=req_state_slot, out_slot_maps=maps, state_rows=state, pdl=pdl_enabled(device),
        )  # fmt: skip
    infos = []
    for plan, capacity, ratio in zip(plans, requests, ratios):
        info = PlanInfo(rows, capacity, ratio, num_slots, mtp_step, next(_builds))
        setattr(plan, _PLAN_ATTR, info)
        infos.append(info)
    if state is not None:
        _remember_tables(read_rows, save_rows, infos[0], state_mode, ring)
    # the tables' own launch waited for the plans before releasing anything: as build_state_rows
    if not _checks_only():
        _launched(device, *(() if route.tables_apart else infos))


class PlansRoute(NamedTuple):
    """The launches of one :func:`build_plans` call (:func:`plans_route`)."""

    one_launch: bool  # every plan by one program of one launch (else a build_plan launch per plan)
    plans: int
    tables_apart: bool  # plan 0's state-row tables in a launch of their own, after the plans

    @property
    def launches(self) -> int:
        return (1 if self.one_launch else self.plans) + self.tables_apart


def plans_route(*, rows: int, requests, tables: bool) -> PlansRoute:
    """How :func:`build_plans` builds plans of capacities ``requests`` (a list) for a step of ``rows`` rows, as
    ``kernels.step_build.launch_build_plans`` decides it: in one launch where ``plans_in_one_launch``, else one
    launch per plan; with state-row ``tables``, those in the plans' launch where it is one and
    ``TABLES_IN_PLAN_LAUNCH``, else in one more."""
    requests = list(requests)
    one = _step_build.plans_in_one_launch(rows, requests)
    return PlansRoute(one, len(requests), bool(tables) and not (one and _step_build.TABLES_IN_PLAN_LAUNCH))


def copy_plan(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a built plan, or state-row tables from :func:`build_state_rows`, into ``dst`` (same shape, dtype
    and device), together with what the host keeps of it: what an engine does to refresh a CUDA graph's
    buffers from a step built outside the graph. Copying a plan or its tables with the engine's own code
    (``dst.copy_(src)``) would leave ``dst``'s record stale: compress checks its calls against the record."""
    op = "copy_plan"
    _tensor(op, "src", src, dtypes=(torch.int32, torch.int64), ndim=(1, 2), inner_contiguous=False)
    _tensor(op, "dst", dst, dtypes=(src.dtype,), ndim=src.dim(), device=src.device, inner_contiguous=False)
    if dst.shape != src.shape:
        _fail(op, f"dst is {list(dst.shape)}, src {list(src.shape)}: a plan or table is copied into one of its shape")
    info, tables = plan_info(src), getattr(src, _TABLES_ATTR, None)
    if info is None and tables is None:
        _fail(op, "src is neither a built plan nor tables from ops.build_state_rows")
    if not _checks_only():
        dst.copy_(src)
    if info is not None:
        setattr(dst, _PLAN_ATTR, info)
        if not _checks_only():
            _launched(dst.device, info)  # conservative: the next compress on dst waits for its PDL predecessor
    else:
        setattr(dst, _TABLES_ATTR, tables)


def check_plan(
    plan: torch.Tensor,
    state_info: torch.Tensor | None,
    err: torch.Tensor,
    *,
    mtp_step: int | None = None,
    max_positions: int = 2**31 - 1,
    decode: bool = False,
    out_slots: int | None = None,
) -> None:
    """Validate a built plan on the device; writes ``err`` (int32 ``[4]``) without a host synchronisation.

    ``err = [code, request index, slot, value]`` of the first problem (``code == 0``: none); read it when a
    debug build can afford a sync and turn it into a message with :func:`plan_error`. Codes, in the order they
    are checked: 1 more requests than the plan holds (value: requests), 2 an ``out_slot`` beyond int32, 9 an
    ``out_slot`` index outside :func:`build_plan`'s ``out_slot_map`` on a group-closing row (1, 2 and 9 are
    the build's flags: no request named), 3 a slot with two runs of rows (rows not contiguous or positions not
    consecutive), 4 a position beyond the rope table (value: last position), 5 a start outside
    ``[L - mtp_step, L]`` of the state's length ``L`` from ``state_info`` (int32/int64 ``[num_slots]``, the
    length each slot's state holds before the step; a start of 0 begins a request; skipped when ``None``), 6 a
    request with more than ``mtp_step + 1`` rows in a ``decode`` step (value: rows), 7 a negative position, 8
    an entry's ``out_slot`` at or beyond ``out_slots`` (the outputs' slots: pages x page size; value: the slot;
    skipped when ``None``), which would be written nowhere. ``mtp_step`` defaults to the plan's (:func:`build_plan`).
    """
    op = "check_plan"
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2)
    info = _built(op, plan)
    _tensor(op, "err", err, dtypes=(torch.int32,), ndim=1, device=plan.device)
    if err.numel() < 4:
        _fail(op, f"err must hold 4 ints, got {err.numel()}")
    if state_info is not None:
        _tensor(op, "state_info", state_info, dtypes=(torch.int32, torch.int64), ndim=1, device=plan.device)
        if state_info.shape[0] < info.num_slots:
            _fail(op, f"state_info holds {state_info.shape[0]} slots; the plan addresses {info.num_slots}")
    mtp_step = info.mtp_step if mtp_step is None else mtp_step
    _int(op, "mtp_step", mtp_step)
    _int(op, "max_positions", max_positions, 1)
    if out_slots is not None:
        _int(op, "out_slots", out_slots)
        if not info.build:
            _fail(op, "out_slots= needs a plan with a build record (ops.plan_info): the closing list follows T")
    _runnable(op, plan.device)
    if _checks_only():
        return
    _plan.launch_check_plan(
        plan, state_info, err, rows=info.rows, requests=plan.shape[0], mtp_step=mtp_step,
        max_positions=max_positions, decode=decode, out_slots=out_slots, pdl=pdl_enabled(plan.device),
    )  # fmt: skip
    _launched(plan.device)


_PLAN_ERRORS = {
    int(_plan.ERR_REQUEST_OVERFLOW): "the step has {value} requests, more than the plan's capacity",
    int(_plan.ERR_SLOT_OVERFLOW): "an out_slot of a group-closing row does not fit in int32",
    int(_plan.ERR_OUT_INDEX): "an out_slot of a group-closing row is an index outside build_plan's out_slot_map "
    "(the row writes nothing)",
    int(_plan.ERR_REQUEST_TWICE): "request {k} (slot {slot}) has a second run of rows: a request's rows must be "
    "contiguous with consecutive positions",
    int(_plan.ERR_BEYOND_ROPE): "request {k} (slot {slot}) reaches position {value}, beyond the rope table",
    int(_plan.ERR_START): "request {k} (slot {slot}) starts at {value}, outside [L - mtp_step, L] of its state",
    int(_plan.ERR_DECODE_ROWS): "request {k} (slot {slot}) brings {value} rows, more than mtp_step + 1 in a decode "
    "step",
    int(_plan.ERR_NEGATIVE_POSITION): "request {k} (slot {slot}) starts at negative position {value}",
    int(_plan.ERR_OUT_SLOT): "request {k} (slot {slot}) closes an entry at out_slot {value}, beyond the outputs' "
    "slots (it would be written nowhere)",
}


def plan_error(err: torch.Tensor) -> str | None:
    """The message of a :func:`check_plan` result (``None`` when it found nothing). Reads ``err`` (a sync)."""
    code, k, slot, value = (int(v) for v in err[:4].tolist())
    if code == 0:
        return None
    return "check_plan: " + _PLAN_ERRORS.get(code, "unknown error code {code}").format(
        k=k, slot=slot, value=value, code=code
    )
