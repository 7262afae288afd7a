"""The engine-facing ops: plan a step on the device, then compress into buffers the engine owns.

An engine calls, per step and per ratio (one plan serves every layer of that ratio and both r = 4
compressors)::

    plan = ops.empty_plan(max_rows, max_requests, ratio, device)        # once, reused every step
    ops.build_plan(plan, positions, row_req, out_slot, ratio=r, num_slots=n, mtp_step=k)

and per layer and compressor one of::

    ops.compress(kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, kind="hca" | "csa" | "indexer",
                 page_size=P, decode=..., scratch=..., out_keys=..., ring=...)
    ops.compress_online_hca(kv_score, plan, ape, norm_weight, cos, sin, state_banks, out_pages, page_size=P)

or, for a CSA layer's main compressor and its indexer together (one launch on a decode step),
``ops.compress_pair(...)``.

Every op validates shapes, dtypes and devices on the host (no device reads: nothing here synchronises),
returns ``None``, allocates nothing (``empty_plan`` aside) and launches grids that depend only on ``T`` (the
step's rows, padding included) and the plan's request capacity, so a whole step can be captured in one CUDA
graph and replayed for any step that fits. ``decode=True`` (every request brings at most ``mtp_step + 1``
rows) is the only static switch. Results are deterministic.

**The contract between a call and its plan.** ``build_plan`` keeps on the host, with the plan tensor, what it
was built for (:class:`PlanInfo`: rows ``T``, request capacity, ratio, request slots, ``mtp_step``;
:func:`plan_info`), and every compress checks its arguments against that before it launches anything: a
``kv_score`` with fewer rows than ``T`` (rows past ``T`` are padding: ignored, the result is the call on the
first ``T``), an ``ape`` of another ratio, a state or banks with fewer request slots than ``num_slots``, a
ring or banks too small for ``mtp_step``, state-row tables built for another plan, outputs of different
capacities are refused with an :class:`OpError` naming both numbers, and then nothing is written. A plan is
written by :func:`build_plan` (or copied with :func:`copy_plan`); a plan no build has filled is refused.
What only the device knows (the rows' own values) is :func:`check_plan`'s.

**Writes.** Besides the state and outputs named in each op, the tiled HCA kernel's one-launch decode step
counts its channel tiles' arrivals in the plan (integer atomic adds on a per-row counter, which the last
arrival sets back to 0): ``compress`` lists ``plan`` as mutated, the plan reads the same after the call, and
the result does not depend on the order of arrival. Two such calls on one plan must not run at the same time
(on two streams): give each stream its own ratio-128 plan. The ratio-4 kernels (CSA and the indexer) only
read the plan, so SGLang's main and indexer compressors may share one on two streams.

**Programmatic dependent launch.** A compress kernel's programs read their plan record before their PDL wait
(:mod:`.kernels.pdl`), except in the launch that directly follows the plan's own build on the same stream
(``build_plan`` lets its successor start before it writes the plan; every other kernel of ours waits for its
predecessor before it lets the next one start, so a launch after it finds the plan whole). The ops keep, per
stream, which build was the last launch of theirs (:func:`records_first`).

The ops are also registered as ``torch.ops.dsv4c.<name>`` (schema, CPU and CUDA implementations, and a fake
for ``torch.compile``); eager callers use the functions here directly and skip the dispatcher.
:func:`launches` tells how many kernels a call launches.

The math and byte layouts are the SPEC's (sections 3-4); the plan's layout is in :mod:`.kernels.plan`.
"""

from __future__ import annotations

import contextvars
import functools
import os
from typing import NamedTuple

import torch

from .config import FP8_BLOCK
from .errors import OpError
from .kernels import exact_fp8_default, interpreting
from .kernels import plan as _plan
from .kernels import projection as _projection
from .kernels import step_build as _step_build
from .kernels.c128_tiled import CHANNEL_TILE, launch_c128_tiled, runs_in_one_launch
from .kernels.entry_pack import EntryOut, EntryParams, entry_args
from .kernels.fused_compress import launch_compress_pair, launch_compress_single, pairs_in_one_launch
from .kernels.indexer_pack import PACK_VARIANTS
from .kernels.online_hca import launch_online_hca, splits
from .kernels.pdl import pdl_enabled
from .kernels.ring import ApeRef, KvRef, StateMeta, StateRef, kv_ref, launch_ring_save
from .kernels.state_rows import MODES as STATE_MODES
from .kernels.state_rows import StateTables as _plan_tables
from .kernels.state_rows import launch_state_rows

__all__ = [
    "KINDS",
    "OpError",
    "empty_plan",
    "plan_numel",
    "build_plan",
    "build_plans",
    "PlanInfo",
    "plan_info",
    "copy_plan",
    "records_first",
    "launches",
    "build_state_rows",
    "STATE_MODES",
    "INDEXER_PACKS",
    "compress",
    "compress_pair",
    "PAIR_LAUNCH",
    "compress_online_hca",
    "PROJECTIONS",
    "projection_triton_rows",
    "projection_choice",
    "ProjectionChoice",
    "projection_workspace",
    "projection_workspace_numel",
    "join_pair_weights",
    "joint_pair_weight",
    "pair_projection_rows",
    "project",
    "compress_from_hidden",
    "compress_online_hca_from_hidden",
    "check_plan",
    "plan_error",
]

#: ``kind`` -> (overlapping windows, latent output). HCA: r = 128 latent; CSA: r = 4 overlapping latent;
#: indexer: r = 4 overlapping keys. The sizes come from the tensors, so smaller test shapes work too.
KINDS = {"hca": (False, True), "csa": (True, True), "indexer": (True, False)}

#: Whether :func:`compress_pair` runs a decode step's two compressors in one launch (else two, as
#: :func:`compress`); the environment variable ``DSV4_PAIR_LAUNCH=0`` read at import turns it off, for A/B runs.
PAIR_LAUNCH = os.environ.get("DSV4_PAIR_LAUNCH", "1").strip() != "0"

#: The indexer's FP8 pack variants (the engines round differently; see ``kernels/indexer_pack.py``).
INDEXER_PACKS = tuple(PACK_VARIANTS)

#: The record of a latent entry: 576 data bytes (448 FP8 + 64 bf16) and 8 scale bytes, at DeepSeek-V4 shapes.
_LATENT_SCALE_BYTES = 8


# ---------------------------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------------------------
def _fail(op: str, msg: str):
    raise OpError(f"{op}: {msg}")


def _int(op: str, name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(op, f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _tensor(op: str, name: str, t, *, dtypes, ndim=None, device=None, inner_contiguous=True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(op, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    dim = t.dim()
    if ndim is not None and (dim != ndim if type(ndim) is int else dim not in ndim):
        _fail(op, f"{name} must have {ndim} dimensions, got shape {list(t.shape)}")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device}, expected {device} (where kv_score / plan live)")
    if inner_contiguous and dim and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dimension, got strides {list(t.stride())}")
    return t


def _runnable(op: str, device: torch.device) -> None:
    """Kernels run on CUDA, or on CPU tensors under the Triton interpreter."""
    if device.type == "cpu" and not interpreting():
        _fail(op, "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before triton is imported")
    if device.type not in ("cpu", "cuda"):
        _fail(op, f"tensors on {device} are not supported (CUDA, or CPU under TRITON_INTERPRET=1)")


def _plan_capacity(op: str, plan, rows: int, ratio: int, device) -> int:
    """The plan's request capacity (its first dimension), after checking it holds a step of ``rows`` rows."""
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2, device=device)
    if not plan.is_contiguous():
        _fail(op, "plan must be contiguous (a buffer from ops.empty_plan)")
    requests = plan.shape[0]
    need = plan_numel(rows, requests, ratio)
    if plan.numel() < need:
        _fail(
            op,
            f"plan holds {plan.numel()} ints; a step of {rows} rows and {requests} requests at ratio {ratio} needs "
            f"{need} (ops.empty_plan(max_rows >= {rows}, ...))",
        )
    return requests


# ---------------------------------------------------------------------------------------------------------------
# The plan, and what the host keeps of it
# ---------------------------------------------------------------------------------------------------------------
class PlanInfo(NamedTuple):
    """What a plan was built for, kept on the host with the plan tensor by :func:`build_plan` (read it with
    :func:`plan_info`); every compress on the plan is checked against it before anything is launched.

    Attributes:
        rows: ``T``, the step's rows (the length of ``positions``; padding rows included).
        requests: ``R``, the plan's request capacity (its first dimension).
        ratio: ``r``.
        num_slots: request state slots; every slot a row addresses is below it.
        mtp_step: the MTP depth the step may rewind over (rings and banks must be sized for it).
        build: a serial number of the build (state-row tables and copies carry it; 0: no build seen).
    """

    rows: int
    requests: int
    ratio: int
    num_slots: int
    mtp_step: int
    build: int


class _TablesInfo(NamedTuple):
    """What :func:`build_state_rows` resolved, kept with its ``read_rows`` / ``save_rows``."""

    build: int  # the PlanInfo.build they were resolved for
    mode: str
    ring: int | None


_PLAN_ATTR = "_dsv4c_plan_info"
_TABLES_ATTR = "_dsv4c_state_rows"
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


def plan_info(plan: torch.Tensor) -> PlanInfo | None:
    """What ``plan`` was last built for (:class:`PlanInfo`), or ``None`` if no :func:`build_plan` (or
    :func:`copy_plan`) has filled this tensor. A view or a clone of a plan carries none."""
    return getattr(plan, _PLAN_ATTR, None) if isinstance(plan, torch.Tensor) else None


#: Set while an op runs through the dispatcher (``torch.ops.dsv4c.*``); see :func:`_built`.
_DISPATCHED = contextvars.ContextVar("dsv4c_dispatched", default=False)


def _built(op: str, plan, *, rows: int = 0, ratio: int = 0) -> PlanInfo:
    """The plan's build record. Called directly, an op refuses a plan without one. Through the dispatcher
    (compiled graphs: functionalization hands an op a clone of a mutated plan when the backend does not
    re-inplace it, and clones carry no record) such a plan is taken at its shape: ``rows`` and ``ratio`` are
    the call's own, no slot or ``mtp_step`` check, and its kernels wait before reading the plan."""
    info = plan_info(plan)
    if info is None:
        if _DISPATCHED.get():
            return PlanInfo(rows, plan.shape[0], ratio, 0, 0, build=0)
        _fail(op, "plan carries no build: fill it with ops.build_plan (or ops.copy_plan from a built plan) first; "
                  "a view or clone of a plan is not one")  # fmt: skip
    return info


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
    storages = [p.untyped_storage().data_ptr() for p in plans]
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
    launched = _step_build.launch_build_plans(
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
    # the tables' own launch (larger steps) waited for the plans before releasing anything: as build_state_rows
    _launched(device, *(infos if state is None or launched == 1 else ()))


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
    dst.copy_(src)
    if info is not None:
        setattr(dst, _PLAN_ATTR, info)
        _launched(dst.device, info)  # conservative: the next compress on dst waits for its PDL predecessor
    else:
        setattr(dst, _TABLES_ATTR, tables)


# ---------------------------------------------------------------------------------------------------------------
# Programmatic dependent launch: which compress may read its plan record before its wait
# ---------------------------------------------------------------------------------------------------------------
#: Per stream, the builds (a tuple of :class:`PlanInfo`: one for ``build_plan``, one per plan for ``build_plans``)
#: of the last launch of these ops there, empty when the last was another op's. One entry per stream an engine
#: launched on.
_LAST_LAUNCH: dict = {}


def _stream(device: torch.device):
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def _launched(device: torch.device, *builds: PlanInfo) -> None:
    """Note a launch of ours on ``device``'s current stream: of the builds of ``builds`` (:func:`build_plan`,
    :func:`build_plans`, :func:`copy_plan`), or none."""
    _LAST_LAUNCH[_stream(device)] = builds


def _just_built(key, info: PlanInfo | None) -> bool:
    """Whether the last launch of ours on stream ``key`` built the plan whose record is ``info``."""
    return info is not None and any(build is info for build in _LAST_LAUNCH.get(key, ()))


def _compress_launch(plan: torch.Tensor) -> bool:
    """:func:`records_first` for the compress about to launch on ``plan``, noting its launch."""
    key = _stream(plan.device)
    info = plan_info(plan)
    first = info is not None and not _just_built(key, info)
    _LAST_LAUNCH[key] = ()
    return first


def records_first(plan: torch.Tensor) -> bool:
    """Whether a compress launched now on ``plan`` (on its device's current stream) reads its plan record before
    its PDL wait: always, except right after the plan's own build on this stream. ``build_plan`` lets the next
    kernel start before it writes the plan; every other kernel of ours waits for its predecessor before it lets
    the next one start, so after it the plan is whole whatever the engine launched in between, and a copy
    (:func:`copy_plan`) counts as a build. A plan without a build record (:func:`plan_info`) waits. The ops apply
    this rule to every compress they launch."""
    info = plan_info(plan)
    return info is not None and not _just_built(_stream(plan.device), info)


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


# ---------------------------------------------------------------------------------------------------------------
# Compress
# ---------------------------------------------------------------------------------------------------------------
def _common(op, kv_score, plan, ape, norm_weight, cos, sin, *, overlap: bool, latent: bool, page_size: int):
    """Validate what every compress op reads against the plan's build; returns ``(info, head, rope, device)``
    (``info.rows`` is the step's ``T``: rows of ``kv_score`` past it are padding)."""
    _tensor(op, "kv_score", kv_score, dtypes=(torch.float32,), ndim=2)
    device = kv_score.device
    _runnable(op, device)
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2, device=device)
    _tensor(op, "ape", ape, dtypes=(torch.float32,), ndim=(2, 3), device=device, inner_contiguous=False)
    info = _built(op, plan, rows=kv_score.shape[0], ratio=ape.shape[0])
    _tensor(op, "norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), ndim=1, device=device,
            inner_contiguous=False)  # fmt: skip
    head = norm_weight.shape[0]
    width = head * (2 if overlap else 1)
    if kv_score.shape[1] != 2 * width:
        _fail(op, f"kv_score must be [T, {2 * width}] (2W for H = {head}), got {list(kv_score.shape)}")
    if kv_score.shape[0] < info.rows:
        _fail(op, f"kv_score has {kv_score.shape[0]} rows; the plan was built for a step of {info.rows} rows (T)")
    coff = 2 if overlap else 1
    if ape.dim() == 2 and ape.shape[1] != width or ape.dim() == 3 and tuple(ape.shape[1:]) != (coff, head):
        _fail(op, f"ape must be [r, {width}] or [r, {coff}, {head}], got {list(ape.shape)}")
    if ape.shape[0] != info.ratio:
        _fail(op, f"ape has {ape.shape[0]} rows (ratio {ape.shape[0]}); the plan was built for ratio {info.ratio}")
    ratio = info.ratio
    _tensor(op, "cos", cos, dtypes=(torch.float32,), ndim=2, device=device, inner_contiguous=False)
    _tensor(op, "sin", sin, dtypes=(torch.float32,), ndim=2, device=device, inner_contiguous=False)
    if cos.shape != sin.shape:
        _fail(op, f"cos and sin differ in shape ({list(cos.shape)}, {list(sin.shape)})")
    rope = 2 * cos.shape[1]
    if rope > head or cos.shape[0] < ratio:
        _fail(op, f"cos/sin must be [positions >= {ratio}, R/2] with R <= {head}, got {list(cos.shape)}")
    if latent and (head - rope) % FP8_BLOCK:
        _fail(op, f"latent output packs H - R = {head - rope} nope dims in blocks of {FP8_BLOCK}")
    if not latent and head & (head - 1):
        _fail(op, f"the indexer's Hadamard pack needs a power-of-two head_dim, got {head}")
    _int(op, "page_size", page_size, 1)
    _plan_capacity(op, plan, info.rows, ratio, device)
    return info, head, rope, device


#: ``EntryMeta`` (sizes and switches, no tensors) by the scalars it depends on: building it costs more than all
#: the rest of a launch's finishing arguments, and a layer builds the same one every step.
_ENTRY_META: dict = {}


def _entry(head, rope, latent, page_size, norm_weight, cos, sin, eps, out_pages, out_keys, exact_fp8, device,
           indexer_pack="hadamard"):  # fmt: skip
    """The finishing arguments of a launch (``entry_args``), FP8 rounding defaulting to the device's.

    The first call for a combination of sizes and switches goes through ``entry_args`` and keeps its
    ``EntryMeta``; later ones build only ``EntryParams`` and ``EntryOut`` (the tensors and their strides), as
    ``entry_args`` does (tests/test_cache.py checks that both paths give the same arguments)."""
    if exact_fp8 is None:
        exact = device.type == "cpu" or exact_fp8_default(device)
    else:
        exact = bool(exact_fp8)
    keys = 0 if out_keys is None else (1 if out_keys.dtype == torch.bfloat16 else 2)
    key = (head, rope, latent, page_size, exact, indexer_pack, out_pages is None, keys)
    meta = _ENTRY_META.get(key)
    if meta is None:
        prm, out, meta = entry_args(
            head=head, rope=rope, latent=latent, page_size=page_size, scale_bytes=_LATENT_SCALE_BYTES,
            norm_weight=norm_weight, cos=cos, sin=sin, eps=eps, out_pages=out_pages, out_keys=out_keys,
            exact_fp8=exact, indexer_pack=indexer_pack,
        )  # fmt: skip
        _ENTRY_META[key] = meta
        return prm, out, meta
    cos_row, cos_col = cos.stride()
    sin_row, sin_col = sin.stride()
    prm = EntryParams(norm_weight, norm_weight.stride(0), cos, cos_row, cos_col, sin, sin_row, sin_col, float(eps))
    if out_pages is None:
        out = EntryOut(out_keys, out_keys.stride(0), out_keys, out_keys.stride(0), out_keys.shape[0])
    elif out_keys is None:
        stride = out_pages.stride(0)
        out = EntryOut(out_pages, stride, out_pages, stride, out_pages.shape[0] * page_size)
    else:
        slots = min(out_pages.shape[0] * page_size, out_keys.shape[0])
        out = EntryOut(out_pages, out_pages.stride(0), out_keys, out_keys.stride(0), slots)
    return prm, out, meta


def _ape_ref(ape: torch.Tensor, head: int) -> ApeRef:
    if ape.dim() == 2:
        return ApeRef(ape, ape.stride(0), head * ape.stride(1), ape.stride(1))
    return ApeRef(ape, ape.stride(0), ape.stride(1), ape.stride(2))


def _pages(op, name, pages, *, device, record_bytes: int, page_size: int):
    _tensor(op, name, pages, dtypes=(torch.uint8,), ndim=2, device=device)
    if pages.shape[1] < page_size * record_bytes:
        _fail(op, f"{name} pages hold {pages.shape[1]} bytes; {page_size} slots of {record_bytes} need "
                  f"{page_size * record_bytes}")  # fmt: skip


def compress(
    kv_score: torch.Tensor,
    plan: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    state: torch.Tensor,
    out_pages: torch.Tensor | None,
    *,
    kind: str,
    page_size: int,
    eps: float = 1e-6,
    decode: bool = False,
    scratch: torch.Tensor | None = None,
    out_keys: torch.Tensor | None = None,
    ring: int | None = None,
    read_rows: torch.Tensor | None = None,
    save_rows: torch.Tensor | None = None,
    state_has_ape: bool = True,
    indexer_pack: str = "hadamard",
    exact_fp8: bool | None = None,
) -> None:
    """Compress one layer's step with the ring state: write every entry a row of the step closes, then save
    the step's rows the state keeps.

    Entry ``g`` (positions ``s = g*r .. s+r-1``, with overlap also the previous group's first halves):
    ``c = sum_j softmax_j(score_j + ape[p_j % r]) * kv_j`` per channel, ``n = c * rsqrt(mean(c^2) + eps) *
    norm_weight``, rope on the trailing ``R`` dims (interleaved pairs) at ``s``, then the stored encoding
    (SPEC sections 3-4).

    Args:
        kv_score: float32 ``[>= T, 2W]`` ``[kv | score]`` rows of the step: the ``T`` rows ``build_plan`` saw,
            then any padding rows of the engine's buffer (ignored: the result is that of the call on the first
            ``T``; fewer than ``T`` rows are refused). Never written. ``W = H`` for HCA, ``2H`` for CSA and the
            indexer.
        plan: the step's plan (:func:`build_plan` at ``ratio = ape.shape[0]``; another ratio is refused).
            Written and restored: the tiled HCA kernel's one-launch decode step counts its tiles' arrivals in it
            (integer atomics) and sets them back to zero before it ends, so the plan reads the same after the
            call; two such calls on one plan must not overlap (one stream, or a plan per stream).
        ape: float32 ``[r, W]`` or a strided ``[r, coff, H]`` view; added to the gate logits on load.
        norm_weight: float32 or bf16 ``[H]``.
        cos, sin: float32 ``[positions, R/2]`` rope tables, any strides (e.g. ``.real`` / ``.imag`` views).
        state: float32 rows ``[kv | score + ape]`` (``[kv | score]`` with ``state_has_ape=False``). Without
            tables it is a ring per request slot, row ``slot * ring + p % ring``: 3-D ``[slots, ring, 2W]``, or
            2-D ``[rows, 2W]`` with ``ring`` given, holding the plan's ``num_slots``; ``ring`` must be at least
            ``window - 1 + mtp_step`` (one more in a ``decode`` step; ``config.ring_rows(mtp_step)`` is).
            With ``read_rows`` / ``save_rows`` (from :func:`build_state_rows`) it is whatever rows those name:
            2-D ``[rows, 2W]`` or 3-D ``[blocks, rows_per_block, 2W]`` (any block stride). Written.
        out_pages: uint8 ``[pages, >= P * record]`` (page stride from the tensor). Latent kinds: FlashMLA
            fp8-sparse records (584 B); the indexer: 132-byte FP8 packs. ``None``: only ``out_keys``. Written.
        kind: ``"hca"``, ``"csa"`` or ``"indexer"``.
        page_size: slots per page ``P`` (64 for CSA and the indexer, 2 for HCA in the engines).
        eps: RMSNorm epsilon.
        decode: every request brings at most ``mtp_step + 1`` rows; each row's program then saves it. Otherwise
            a ring is saved by one program per request after its windows that read the ring (the same launch),
            and a table-addressed state by a second launch after every window was read.
        scratch: float32 ``[>= T, H]`` (a :class:`~dsv4_compressor.workspace.Workspace` region): HCA runs the
            tiled kernel with it (a decode step of up to 256 requests in one launch, any other in two); without
            it HCA runs single-stage (slow: it spills). Written.
        out_keys: ``[slots, H]`` values of every entry: bf16 (the indexer's keys), or float32 (unquantized, for a
            model that reads entries so); any kind, optional; with ``out_pages``, as many slots as the pages.
            Written.
        ring: ring rows per slot for a 2-D ``state`` without tables.
        read_rows, save_rows: the step's state-row tables (:func:`build_state_rows` after this plan's build):
            int ``[>= R, window - 1]`` and ``[>= T]``; both or neither.
        state_has_ape: the state's rows hold ``score + ape`` (LightLLM, vLLM, ours) or the bare ``score``
            (SGLang); the bias is then added when the rows are read, and not when they are saved.
        indexer_pack: the indexer's FP8 pack variant: ``"hadamard"`` (SPEC), ``"hadamard_bf16"`` (LightLLM),
            ``"hadamard_f32"`` (SGLang), ``"pow2"`` (vLLM); see :data:`INDEXER_PACKS`.
        exact_fp8: integer FP8 rounding instead of the hardware cast (default: only on CPU / the interpreter).
    """
    launch = _compress_args("compress", kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, kind=kind,
                            page_size=page_size, eps=eps, decode=decode, scratch=scratch, out_keys=out_keys,
                            ring=ring, read_rows=read_rows, save_rows=save_rows, state_has_ape=state_has_ape,
                            indexer_pack=indexer_pack, exact_fp8=exact_fp8)  # fmt: skip
    if launch is not None:
        _launch_compress(launch)


def compress_pair(
    kv_score: torch.Tensor,
    plan: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    state: torch.Tensor,
    out_pages: torch.Tensor | None,
    indexer_kv_score: torch.Tensor,
    indexer_ape: torch.Tensor,
    indexer_norm_weight: torch.Tensor,
    indexer_cos: torch.Tensor,
    indexer_sin: torch.Tensor,
    indexer_state: torch.Tensor,
    indexer_out_pages: torch.Tensor | None,
    *,
    page_size: int,
    indexer_page_size: int,
    eps: float = 1e-6,
    indexer_eps: float = 1e-6,
    decode: bool = False,
    out_keys: torch.Tensor | None = None,
    indexer_out_keys: torch.Tensor | None = None,
    ring: int | None = None,
    indexer_ring: int | None = None,
    read_rows: torch.Tensor | None = None,
    save_rows: torch.Tensor | None = None,
    indexer_read_rows: torch.Tensor | None = None,
    indexer_save_rows: torch.Tensor | None = None,
    state_has_ape: bool = True,
    indexer_pack: str = "hadamard",
    exact_fp8: bool | None = None,
) -> None:
    """A CSA layer's two compressions on one plan: :func:`compress` with ``kind="csa"`` on the first eight
    arguments, then :func:`compress` with ``kind="indexer"`` on the ``indexer_*`` ones (the same plan, so the
    same closing rows and output slots).

    Both calls are checked before either runs, so a refused pair writes nothing. A ``decode`` step runs both in
    one launch, one program per row requesting both windows before it stores anything (the two compressors'
    memory round trips overlap); any other step, two launches as :func:`compress`, with their bytes. In the one
    launch the main compressor's entries and both states are those two calls write, bit for bit; the indexer's
    window and norm sums run on the launch's 4 warps (1 in its own launch), in another order, so on a GPU its
    entries can differ at rounding boundaries (deterministic, within the tolerance model; the H200 count is in
    ``tests/test_ops_gpu.py``'s pair test).

    Args: as :func:`compress`, per compressor; ``state_has_ape`` and ``exact_fp8`` apply to both,
        ``indexer_pack`` to the indexer. A ``kv_score`` pair is typically the two column ranges of one
        :func:`project` output (``kv[:, :2W]`` and ``kv[:, 2W:]``). Each compressor has its own state-row
        tables (``read_rows`` / ``save_rows``, ``indexer_read_rows`` / ``indexer_save_rows``; the same
        tensors where the engine addresses both states alike).
    """
    op = "compress_pair"
    common = dict(decode=decode, scratch=None, state_has_ape=state_has_ape, exact_fp8=exact_fp8)
    main = _compress_args(op, kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, kind="csa",
                          page_size=page_size, eps=eps, out_keys=out_keys, ring=ring, read_rows=read_rows,
                          save_rows=save_rows, indexer_pack="hadamard", **common)  # fmt: skip
    try:
        indexer = _compress_args(op, indexer_kv_score, plan, indexer_ape, indexer_norm_weight, indexer_cos,
                                 indexer_sin, indexer_state, indexer_out_pages, kind="indexer",
                                 page_size=indexer_page_size, eps=indexer_eps, out_keys=indexer_out_keys,
                                 ring=indexer_ring, read_rows=indexer_read_rows, save_rows=indexer_save_rows,
                                 indexer_pack=indexer_pack, **common)  # fmt: skip
    except OpError as e:  # name the compressor: the checks name the arguments of compress
        raise OpError(str(e).replace(f"{op}: ", f"{op}: indexer: ", 1)) from None
    if main is None:  # a step of no rows
        return
    if decode and PAIR_LAUNCH and pairs_in_one_launch(main.head, indexer.head):
        launch_compress_pair(main.kernel_args, indexer.kernel_args, main.plan_ref, ratio=main.ratio,
                             pdl=pdl_enabled(plan.device), record_first=_compress_launch(plan))  # fmt: skip
        return
    _launch_compress(main)
    _launch_compress(indexer)


class _CompressLaunch(NamedTuple):
    """A validated :func:`compress` call, ready to launch: the kernels' arguments."""

    kernel_args: tuple  # (kv, state, ape, prm, out, meta, sm), as the launchers take them
    plan: torch.Tensor
    plan_ref: object
    ratio: int
    overlap: bool
    head: int
    width: int
    decode: bool
    scratch: torch.Tensor | None
    closing: int


def _compress_args(op, kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, *, kind, page_size, eps,
                   decode, scratch, out_keys, ring, read_rows, save_rows, state_has_ape, indexer_pack,
                   exact_fp8) -> _CompressLaunch | None:  # fmt: skip
    """Every check of :func:`compress` (raising :class:`OpError` before anything runs), then its launch's
    arguments; ``None`` for a step of no rows."""
    if kind not in KINDS:
        _fail(op, f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    overlap, latent = KINDS[kind]
    info, head, rope, device = _common(
        op, kv_score, plan, ape, norm_weight, cos, sin, overlap=overlap, latent=latent, page_size=page_size
    )
    rows, requests, ratio = info.rows, info.requests, info.ratio
    width = head * (2 if overlap else 1)
    window = ratio * (2 if overlap else 1)
    state_ref, ring_rows, rows_per_block = _state(
        op, state, read_rows, save_rows, ring, info, width=width, window=window, decode=bool(decode), device=device
    )
    _outputs(op, kind, out_pages, out_keys, latent=latent, head=head, rope=rope, page_size=page_size, device=device)
    if indexer_pack not in PACK_VARIANTS:
        _fail(op, f"indexer_pack must be one of {list(PACK_VARIANTS)}, got {indexer_pack!r}")
    if scratch is not None:
        if kind != "hca":
            _fail(op, f"scratch is for kind='hca', got {kind!r}")
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    if rows == 0:
        return None
    prm, out, meta = _entry(head, rope, latent, page_size, norm_weight, cos, sin, eps, out_pages, out_keys,
                            exact_fp8, device, indexer_pack)  # fmt: skip
    sm = StateMeta(RING=ring_rows, TABLE=read_rows is not None, HAS_APE=bool(state_has_ape), RPB=rows_per_block)
    kv = KvRef(kv_score, kv_score.stride(0))
    return _CompressLaunch(
        kernel_args=(kv, state_ref, _ape_ref(ape, head), prm, out, meta, sm), plan=plan,
        plan_ref=_plan.PlanRef(plan, rows, requests), ratio=ratio, overlap=overlap, head=head, width=width,
        decode=bool(decode), scratch=scratch, closing=_plan.closing_capacity(rows, requests, ratio),
    )  # fmt: skip


def _launch_compress(c: _CompressLaunch) -> None:
    """The kernels of one validated :func:`compress` call."""
    kv, state_ref, ape_ref, prm, out, meta, sm = c.kernel_args
    pdl = pdl_enabled(c.plan.device)
    record_first = _compress_launch(c.plan)
    if c.scratch is not None:  # HCA on the tiled kernel
        launch_c128_tiled(kv, state_ref, ape_ref, c.plan_ref, prm, out, meta, sm, c.scratch, ratio=c.ratio,
                          closing=c.closing, decode=c.decode, pdl=pdl, record_first=record_first)  # fmt: skip
        return
    # A step that is not decode saves a ring's rows from one program per request, after that request's windows
    # that read the ring; table mode (any row may be saved anywhere) saves in a second launch.
    request_saves = not c.decode and not sm.TABLE
    launch_compress_single(
        kv, state_ref, ape_ref, c.plan_ref, prm, out, meta, sm, ratio=c.ratio, overlap=c.overlap,
        save_rows=c.decode, request_saves=request_saves, pdl=pdl, record_first=record_first,
    )  # fmt: skip
    if not c.decode and not request_saves:
        launch_ring_save(kv, state_ref, ape_ref, c.plan_ref, sm, ratio=c.ratio, head=c.head, width=c.width, pdl=pdl)


def _scratch(op: str, scratch: torch.Tensor, *, rows: int, head: int, device) -> None:
    """A float32 ``[>= rows, head]`` scratch, rows ``head`` apart, for kernels that split a group's channels."""
    if head % CHANNEL_TILE:
        _fail(op, f"scratch is for head_dim a multiple of {CHANNEL_TILE}, got {head}")
    _tensor(op, "scratch", scratch, dtypes=(torch.float32,), ndim=2, device=device)
    if scratch.shape[0] < rows or scratch.shape[1] != head or (rows > 1 and scratch.stride(0) != head):
        _fail(op, f"scratch must be contiguous [>= {rows}, {head}], got {list(scratch.shape)} "
                  f"strides {list(scratch.stride())}")  # fmt: skip


def _outputs(op, kind, out_pages, out_keys, *, latent, head, rope, page_size, device) -> None:
    """Latent kinds write records (``out_pages``), the indexer FP8 packs; either may also or instead write the
    values to ``out_keys`` (bf16, or float32 for a model that reads entries unquantized). An entry's slot
    addresses both, so given together they hold the same slots."""
    if out_pages is None and out_keys is None:
        _fail(op, f"kind={kind!r} needs out_pages or out_keys (or both)")
    if out_pages is not None:
        record = head + rope + _LATENT_SCALE_BYTES if latent else head + 4
        _pages(op, "out_pages", out_pages, device=device, record_bytes=record, page_size=page_size)
    if out_keys is not None:
        _tensor(op, "out_keys", out_keys, dtypes=(torch.bfloat16, torch.float32), ndim=2, device=device)
        if out_keys.shape[1] != head:
            _fail(op, f"out_keys must be [slots, {head}], got {list(out_keys.shape)}")
    if out_pages is not None and out_keys is not None and out_keys.shape[0] != out_pages.shape[0] * page_size:
        slots = out_pages.shape[0] * page_size
        _fail(op, f"out_keys holds {out_keys.shape[0]} slots and out_pages {out_pages.shape[0]} pages x {page_size} = "
                  f"{slots}: an entry's slot addresses both, so they must hold the same")  # fmt: skip


def _ring_need(window: int, mtp_step: int, decode: bool) -> int:
    """Ring rows a window of ``window`` positions needs per request (or state page) when a step may rewind
    ``mtp_step`` positions: its oldest row is ``start - (window - 1)`` with ``start >= L - mtp_step``, and the
    ring keeps the last ``ring`` positions, so ``window - 1 + mtp_step``. A decode step saves its rows in the
    launch whose windows read the ring (each row's program saves it), so its up to ``mtp_step + 1`` new rows must
    not land on a row a window of the same step reads: one more. Never less than the window."""
    return max(window, window - 1 + mtp_step + (1 if decode else 0))


def _state(op, state, read_rows, save_rows, ring, info: PlanInfo, *, width, window, decode, device):
    """Validate the state (and its tables) against the plan's build; returns its ``StateRef``, the ring rows
    (ring mode) and the rows per block (table mode)."""
    _tensor(op, "state", state, dtypes=(torch.float32,), ndim=(2, 3), device=device)
    if state.shape[-1] != 2 * width:
        _fail(op, f"state rows must be {2 * width} wide (2W), got {list(state.shape)}")
    if (read_rows is None) != (save_rows is None):
        _fail(op, "read_rows and save_rows come together (ops.build_state_rows)")
    if state.dim() == 3:
        blocks, per_block, block_stride, row_stride = state.shape[0], state.shape[1], state.stride(0), state.stride(1)
    else:
        blocks, per_block, block_stride, row_stride = state.shape[0], 1, state.stride(0), state.stride(0)
    state_rows = blocks * per_block
    if read_rows is not None:
        _tensor(op, "read_rows", read_rows, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
        _tensor(op, "save_rows", save_rows, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
        if read_rows.shape[0] < info.requests or read_rows.shape[1] != window - 1 or not read_rows.is_contiguous():
            _fail(op, f"read_rows must be contiguous [>= {info.requests}, {window - 1}] (requests, window - 1), got "
                      f"{list(read_rows.shape)}")  # fmt: skip
        if save_rows.shape[0] < info.rows:
            _fail(op, f"save_rows must hold >= {info.rows} rows (T), got {save_rows.shape[0]}")
        if ring is not None:
            _fail(op, "ring= is for the req_ring state; with read_rows / save_rows the tables address the state")
        tables = None
        for name, t in (("read_rows", read_rows), ("save_rows", save_rows)):
            tables = getattr(t, _TABLES_ATTR, None)
            if tables is None and _DISPATCHED.get():
                break  # as for a plan without a record (_built)
            if tables is None:
                _fail(op, f"{name} was not filled by ops.build_state_rows (or ops.copy_plan from tables that were)")
            if info.build and tables.build != info.build:
                _fail(op, f"{name} was resolved for build {tables.build} of a plan; this plan holds build "
                          f"{info.build}: call ops.build_state_rows after each build_plan")  # fmt: skip
        if decode and tables is not None and tables.ring is not None:
            need = _ring_need(window, info.mtp_step, decode)
            if tables.ring < need:
                _fail(op, f"a decode step on a ring of {tables.ring} rows (build_state_rows ring=): windows of "
                          f"{window} with mtp_step={info.mtp_step} need >= {need}; run it with decode=False (the "
                          "save then follows every window's reads) or widen the ring")  # fmt: skip
        return StateRef(state, state_rows, 0, block_stride, row_stride, read_rows, save_rows), 1, per_block
    if state.dim() == 3:
        if ring is not None and ring != per_block:
            _fail(op, f"ring={ring} but state is [slots, {per_block}, 2W]")
        ring_rows = per_block
        slots = blocks
    else:
        if ring is None:
            _fail(op, "a 2-D state [rows, 2W] needs ring= (rows per request slot), or read_rows / save_rows")
        _int(op, "ring", ring, 1)
        ring_rows = ring
        slots = blocks // ring
    need = _ring_need(window, info.mtp_step, decode)
    if ring_rows < need:
        _fail(op, f"ring={ring_rows} rows cannot hold a window of {window} with mtp_step={info.mtp_step} "
                  f"(needs >= {need}{' in a decode step' if decode else ''}; config.ring_rows(mtp_step))")  # fmt: skip
    if slots < info.num_slots:
        _fail(op, f"state holds {slots} request slots of {ring_rows} rows; the plan addresses {info.num_slots} "
                  "(build_plan num_slots=)")  # fmt: skip
    slot_stride = block_stride if state.dim() == 3 else ring_rows * row_stride
    return StateRef(state, state_rows, slot_stride, block_stride, row_stride, state, state), ring_rows, 1


def build_state_rows(
    plan: torch.Tensor,
    read_rows: torch.Tensor,
    save_rows: torch.Tensor,
    *,
    mode: str,
    ring: int | None = None,
    req_to_token: torch.Tensor | None = None,
    token_to_state: torch.Tensor | None = None,
    state_page: int | None = None,
    page_tail: int | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
) -> None:
    """Resolve an engine's state addressing once per step (after :func:`build_plan`), for every layer's
    :func:`compress` of that ratio: ``read_rows[k, j]`` = the state row of position ``start - (window - 1) + j``
    of the plan's ``k``-th request (``-1``: none), ``save_rows[t]`` = the state row row ``t`` is saved into
    (``-1``: not saved). One launch, no host synchronisation.

    Modes: ``"req_ring"`` (``slot * ring + q % ring``; ``ring``), ``"token_map_ring"`` (LightLLM / SGLang C4:
    ``(m // state_page) * ring + m % ring`` with ``m = token_to_state[req_to_token[slot, q]]``; saves each
    request's last ``ring`` rows and each state page's last ``page_tail`` rows, so prefix reuse at a page
    boundary finds its rows; ``ring``, ``req_to_token`` int32 ``[max_req, max_seq]``, ``token_to_state``
    int32/int64 ``[tokens]``, ``state_page``, ``page_tail``), ``"block_table"`` (vLLM: ``block_table[slot,
    q // block_size] * block_size + q % block_size``, every row saved; ``block_table`` int32 ``[B, blocks]``,
    ``block_size``).

    Args:
        plan: the step's plan, built (:func:`build_plan`).
        read_rows: int32/int64 ``[>= R, window - 1]`` (``window`` = 8 for CSA and the indexer, 128 for HCA).
        save_rows: int32/int64 ``[>= T]`` (a capacity: rows past the step's ``T`` are not written).

    A ring (``req_ring``, ``token_map_ring``) must hold ``window - 1 + mtp_step`` rows (the plan's
    ``mtp_step``; a decode step one more: :func:`compress` checks). The tables remember the build they were
    resolved for: :func:`compress` refuses them with another build of the plan.
    """
    op = "build_state_rows"
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2)
    info = _built(op, plan)
    tables, window = _state_rows_args(op, plan.shape[0], info, plan.device, read_rows, save_rows, mode=mode,
                                      ring=ring, req_to_token=req_to_token, token_to_state=token_to_state,
                                      state_page=state_page, page_tail=page_tail, block_table=block_table,
                                      block_size=block_size)  # fmt: skip
    _runnable(op, plan.device)
    launch_state_rows(
        _plan.PlanRef(plan, 0, plan.shape[0]), read_rows, save_rows, tables, mode=STATE_MODES[mode],
        window=window, pdl=pdl_enabled(plan.device),
    )  # fmt: skip
    _launched(plan.device)
    _remember_tables(read_rows, save_rows, info, mode, ring)


def _state_rows_args(op: str, requests: int, info: PlanInfo, device, read_rows, save_rows, *, mode, ring,
                     req_to_token, token_to_state, state_page, page_tail, block_table, block_size):  # fmt: skip
    """:func:`build_state_rows`' checks of its tables and addressing for a plan of ``requests`` requests built
    (or about to be) as ``info`` says; returns the kernels' ``(StateTables, window)``. Reads no device memory."""
    if mode not in STATE_MODES:
        _fail(op, f"mode must be one of {list(STATE_MODES)}, got {mode!r}")
    _tensor(op, "read_rows", read_rows, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
    _tensor(op, "save_rows", save_rows, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if read_rows.shape[0] < requests or not read_rows.is_contiguous() or read_rows.shape[1] < 1:
        _fail(op, f"read_rows must be contiguous [>= {requests} (the plan's requests), window - 1], got "
                  f"{list(read_rows.shape)}")  # fmt: skip
    if save_rows.shape[0] and save_rows.stride(0) != 1:
        _fail(op, "save_rows must be contiguous")
    if save_rows.shape[0] < info.rows:
        _fail(op, f"save_rows holds {save_rows.shape[0]} rows; the plan was built for a step of {info.rows} (T)")
    window = read_rows.shape[1] + 1
    dummy = save_rows
    need = {
        "req_ring": ("ring",),
        "token_map_ring": ("ring", "req_to_token", "token_to_state", "state_page", "page_tail"),
        "block_table": ("block_table", "block_size"),
    }
    given = dict(ring=ring, req_to_token=req_to_token, token_to_state=token_to_state, state_page=state_page,
                 page_tail=page_tail, block_table=block_table, block_size=block_size)  # fmt: skip
    for name in need[mode]:
        if given[name] is None:
            _fail(op, f"mode={mode!r} needs {name}=")
    for name in ("ring", "state_page", "block_size"):
        if given[name] is not None:
            _int(op, name, given[name], 1)
    if page_tail is not None:
        _int(op, "page_tail", page_tail, 0)
    if mode != "block_table":
        least = _ring_need(window, info.mtp_step, decode=False)
        if ring < least:
            _fail(op, f"ring={ring} rows cannot hold a window of {window} with mtp_step={info.mtp_step} (needs "
                      f">= {least}; a decode step {_ring_need(window, info.mtp_step, decode=True)})")  # fmt: skip
    if req_to_token is not None:
        _tensor(op, "req_to_token", req_to_token, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
        if mode == "token_map_ring" and req_to_token.shape[0] < info.num_slots:
            _fail(op, f"req_to_token has {req_to_token.shape[0]} rows; the plan addresses {info.num_slots} slots")
    if token_to_state is not None:
        _tensor(op, "token_to_state", token_to_state, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if block_table is not None:
        _tensor(op, "block_table", block_table, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
        if mode == "block_table" and block_table.shape[0] < info.num_slots:
            _fail(op, f"block_table has {block_table.shape[0]} rows; the plan addresses {info.num_slots} slots")
    tables = _plan_tables(
        ring or 1, req_to_token if req_to_token is not None else dummy,
        req_to_token.stride(0) if req_to_token is not None else 0,
        token_to_state if token_to_state is not None else dummy, state_page or 1, page_tail or 0,
        block_table if block_table is not None else dummy, block_table.stride(0) if block_table is not None else 0,
        block_size or 1,
    )  # fmt: skip
    return tables, window


def _remember_tables(read_rows, save_rows, info: PlanInfo, mode: str, ring) -> None:
    """Keep with the tables the build they were resolved for (:func:`compress` checks it)."""
    record = _TablesInfo(info.build, mode, ring if mode != "block_table" else None)
    setattr(read_rows, _TABLES_ATTR, record)
    setattr(save_rows, _TABLES_ATTR, record)


def _float(op: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        _fail(op, f"{name} must be a float in (0, 1), got {value!r}")
    return float(value)


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
) -> None:
    """Compress one HCA layer's step with the online-softmax state: one launch, no ring (two launches and a
    scratch for a prefill step given one).

    Same entries as :func:`compress` with ``kind="hca"`` (records in ``out_pages``, values in ``out_keys``).
    The state is, per request slot, ``B = mtp_step + 1`` banks of ``(running max, running sum, running weighted
    sum)`` per channel: ``state_banks`` float32
    ``[slots, B, 3, H]`` (contiguous; 24 KiB per request at H = 512, B = 4, against 528 KiB of ring). Bank
    ``L % B`` holds the state after the first ``L`` positions, so a step may restart at any of the last ``B``
    lengths (an MTP rewind) with no commit step; a start on a group boundary needs no state at all.

    ``decode=True`` (every request brings at most ``mtp_step + 1`` rows) launches request programs only.
    ``scratch``: float32 ``[>= T, H]`` (a :class:`~dsv4_compressor.workspace.Workspace` region, the one
    :func:`compress` takes), used by steps that are not ``decode`` and have at most 3 groups per SM
    (:func:`~dsv4_compressor.kernels.online_hca.splits`; on the H200 chunks up to about 50K tokens): each
    group's channels are then pooled by ``H / 32`` programs into the scratch row of its closing row, and a
    second launch finishes the entries (an 8K chunk's 64 groups otherwise run on 64 SMs). Decode steps never
    touch it. Written.
    Other arguments as for :func:`compress`.
    """
    op = "compress_online_hca"
    info, head, rope, device = _common(
        op, kv_score, plan, ape, norm_weight, cos, sin, overlap=False, latent=True, page_size=page_size
    )
    rows = info.rows
    _banks(op, state_banks, info, head=head, device=device)
    _outputs(op, "hca", out_pages, out_keys, latent=True, head=head, rope=rope, page_size=page_size, device=device)
    if scratch is not None:
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    _launch_online(kv_score, plan, info, ape, norm_weight, cos, sin, state_banks, out_pages, out_keys, page_size,
                   eps, decode, exact_fp8, scratch, head=head, rope=rope, device=device)  # fmt: skip


def _launch_online(kv, plan, info: PlanInfo, ape, norm_weight, cos, sin, state_banks, out_pages, out_keys, page_size,
                   eps, decode, exact_fp8, scratch, *, head: int, rope: int, device) -> None:  # fmt: skip
    """Launch a validated online HCA step on ``kv``: ``kv_score`` ``[T, 2W]``, or a projection's unsummed K-split
    partials ``[split, T, 2W]`` (the kernel adds them)."""
    rows, requests, ratio = info.rows, info.requests, info.ratio
    if rows == 0:
        return
    prm, out, meta = _entry(head, rope, True, page_size, norm_weight, cos, sin, eps, out_pages, out_keys,
                            exact_fp8, device)  # fmt: skip
    record_first = _compress_launch(plan)
    launch_online_hca(
        kv_ref(kv), _ape_ref(ape, head), _plan.PlanRef(plan, rows, requests), state_banks, prm, out, meta,
        ratio=ratio, closing=_plan.closing_capacity(rows, requests, ratio), decode=bool(decode), scratch=scratch,
        pdl=pdl_enabled(device), record_first=record_first,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# From hidden states: the projection, then the compression
# ---------------------------------------------------------------------------------------------------------------
#: How the ``*_from_hidden`` ops project: ``"triton"`` (:mod:`.kernels.projection`, sized for decode steps),
#: ``"torch"`` (``torch.mm(x, weight.T, out_dtype=float32)``: cuBLAS on the GPU, what the engines run) or
#: ``"auto"`` (the path measured faster for the weight's shape and the step's rows: :func:`projection_triton_rows`).
PROJECTIONS = ("auto", "triton", "torch")
#: :func:`projection_workspace_numel` sizes the Triton path's partials for steps up to this many rows; above it
#: every configuration the kernel picks has no K split (its need is ``kv_score``'s, the torch path's).
_SPLIT_ROWS_SIZED = 1024


def projection_triton_rows(width: int, dim: int, *, online: bool = False) -> int:
    """The most rows ``projection="auto"`` projects with the Triton kernel for a ``[width, dim]`` weight (``2W``
    outputs, ``D`` inputs): the largest step at which the H200 bench measured it faster than cuBLAS
    (``kernels.projection.FASTER_THAN_CUBLAS``: decode steps of 64 rows for the V4 weights but the V4-Pro
    indexer's, 256 for the V4-Flash indexer), else 0 (cuBLAS always). ``online``: for
    :func:`compress_online_hca_from_hidden`, which also takes the projection's unsummed partials up to the
    largest step ``kernels.projection.PARTIALS`` has blocks for (the V4-Flash HCA layer measured faster that way
    than on cuBLAS at 64 and 256 rows: docs/runs/check_57c5a92)."""
    rows = _projection.FASTER_THAN_CUBLAS.get((int(width), int(dim)), 0)
    if online:
        rows = max([rows, *_projection.PARTIALS.get((int(width), int(dim)), {})])
    return rows


class ProjectionChoice(NamedTuple):
    """How a ``*_from_hidden`` op projects a step: ``path`` (``"triton"`` or ``"torch"``); ``cfg``, the Triton
    path's blocks (``kernels.projection.ProjectionConfig``, else ``None``); ``reduce``: whether the workspace
    then holds the step's ``kv_score`` (``[rows, 2W]`` at its start), or, false, the K split's unsummed partials
    (``[split_k, rows, 2W]`` after the ``kv_score`` region), which only the online op's kernel adds."""

    path: str
    cfg: object
    reduce: bool


def projection_choice(rows: int, width: int, dim: int, *, projection: str = "auto", online: bool = False):
    """The one decision of how a step of ``rows`` rows is projected through a ``[width, dim]`` weight, as
    :func:`compress_from_hidden` (``online`` false) and :func:`compress_online_hca_from_hidden` (``online``
    true) make it: ``"auto"`` takes the Triton kernel up to :func:`projection_triton_rows` rows, else cuBLAS.
    Returns a :class:`ProjectionChoice`; callers that read the workspace after the op (tests, adapters that
    size it) ask here rather than restating the rule."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {list(PROJECTIONS)}, got {projection!r}")
    path = projection
    if projection == "auto":
        path = "triton" if rows <= projection_triton_rows(width, dim, online=online) else "torch"
    if path == "torch":
        return ProjectionChoice("torch", None, True)
    cfg = _projection.partials_config(rows, width, dim) if online else None
    reduce = cfg is None or cfg.split_k == 1
    return ProjectionChoice("triton", cfg or _projection.projection_config(rows, width, dim), reduce)


def projection_workspace_numel(max_rows: int, width: int, dim: int) -> int:
    """float32 elements of a projection workspace that serves every step of at most ``max_rows`` rows, on
    either path, for a weight of ``width`` (``2W``) outputs and ``dim`` (``D``) inputs."""
    _int("projection_workspace_numel", "max_rows", max_rows)
    need = _projection.workspace_numel(max_rows, width, None)
    for rows in range(1, min(max_rows, _SPLIT_ROWS_SIZED) + 1):
        for cfg in (_projection.projection_config(rows, width, dim), _projection.partials_config(rows, width, dim)):
            if cfg is not None:
                need = max(need, _projection.workspace_numel(rows, width, cfg))
    return need


def projection_workspace(max_rows: int, width: int, dim: int, device: torch.device) -> torch.Tensor:
    """Allocate the workspace of :func:`compress_from_hidden` / :func:`compress_online_hca_from_hidden`:
    float32 ``[projection_workspace_numel(...)]``, zeros (the tile counters at its end must start at zero; the
    ops leave them zero). It holds the step's ``kv_score`` (``T x 2W``), the Triton path's split-K partials and
    the counters; layers of one kind may share one (they run one after another on a stream), two streams need
    two. Allocated once, like :func:`empty_plan`: a captured graph keeps reading it."""
    return torch.zeros(projection_workspace_numel(max_rows, width, dim), dtype=torch.float32, device=device)


def _x_and_weight(op: str, x, weight, name: str, *, rows: int, width: int, device) -> None:
    """``x`` bf16 ``[>= rows, D]`` (``D`` a multiple of 16) and the weight ``name`` bf16 row-major ``[width, D]``."""
    _tensor(op, "x", x, dtypes=(torch.bfloat16,), ndim=2, device=device)
    _tensor(op, name, weight, dtypes=(torch.bfloat16,), ndim=2, device=device, inner_contiguous=False)
    dim = x.shape[1]
    if tuple(weight.shape) != (width, dim):
        hint = " (a transposed [D, 2W] weight: pass weight.t())" if tuple(weight.shape) == (dim, width) else ""
        _fail(op, f"{name} must be [2W, D] = [{width}, {dim}] (the engines' wkv_gate weight: 2W outputs of D "
                  f"inputs), got {list(weight.shape)}{hint}")  # fmt: skip
    if dim > 1 and weight.stride(1) != 1 or width > 1 and weight.stride(0) < dim:
        _fail(op, f"{name} must be row-major [2W, D] (unit stride along D), got strides {list(weight.stride())}; "
                  "copy a transposed or column-major weight once at load time (weight.contiguous())")  # fmt: skip
    if dim % 16:
        _fail(op, f"x's hidden size D = {dim} must be a multiple of 16 (the projection's K blocks)")
    if x.shape[0] < rows:
        _fail(op, f"x has {x.shape[0]} rows; the plan was built for a step of {rows} rows (T)")


def _hidden(op: str, x, weight, workspace, projection: str, *, rows: int, width: int, device, partials=False):
    """Validate the projection's inputs for a step of ``rows`` rows (the plan's ``T``) and ``width`` (``2W``)
    outputs; returns ``(path, cfg, reduce)`` (``cfg``: the Triton path's blocks, else ``None``; ``reduce``
    false where, with ``partials`` (a consumer that adds them), the Triton path leaves its K split's partials:
    ``kernels.projection.partials_config``)."""
    if projection not in PROJECTIONS:
        _fail(op, f"projection must be one of {list(PROJECTIONS)}, got {projection!r}")
    _x_and_weight(op, x, weight, "weight", rows=rows, width=width, device=device)
    dim = x.shape[1]
    _tensor(op, "workspace", workspace, dtypes=(torch.float32,), ndim=1, device=device)
    path, cfg, reduce = projection_choice(rows, width, dim, projection=projection, online=partials)
    if cfg is not None and dim % (cfg.block_k * cfg.split_k):
        _fail(op, f"the projection's blocks {cfg} do not divide D = {dim} (kernels.projection.OVERRIDES)")
    if cfg is not None and cfg.split_k > 1 and cfg.tiles(rows, width) > _projection.COUNTERS:
        _fail(op, f"a Triton projection of {rows} rows splits {cfg.tiles(rows, width)} tiles along K, more than "
                  f"the workspace's {_projection.COUNTERS} counters (kernels.projection.OVERRIDES)")  # fmt: skip
    need = _projection.workspace_numel(rows, width, cfg)
    if workspace.numel() < need:
        _fail(op, f"workspace holds {workspace.numel()} floats; a {path} projection of {rows} rows x {width} needs "
                  f"{need} (ops.projection_workspace(max_rows >= {rows}, {width}, {dim}, device))")  # fmt: skip
    if path == "torch" and device.type == "cuda" and not _MM_OUT_DTYPE:
        _fail(op, f"projection='torch' needs torch.mm(..., out_dtype=) (torch >= 2.8; this is {torch.__version__})")
    return path, cfg, reduce


#: ``torch.mm(..., out_dtype=torch.float32)`` of bf16 inputs exists on CUDA from torch 2.8.
_MM_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)


def _project(x, weight, workspace, *, rows: int, path: str, cfg, device, reduce: bool = True) -> torch.Tensor:
    """Launch the projection; returns ``kv_score``, the ``[rows, 2W]`` view of the workspace it wrote, or with
    ``reduce`` false its K split's partials, ``[split_k, rows, 2W]``, whose sum in split order it is."""
    width = weight.shape[0]
    kv = workspace[: rows * width].view(rows, width)
    if not reduce:
        kv = workspace[rows * width : rows * width * (1 + cfg.split_k)].view(cfg.split_k, rows, width)
    if rows == 0:
        return kv
    if path == "torch" and device.type == "cpu":
        torch.mm(x[:rows].float(), weight.float().t(), out=kv)  # CPU has no bf16 -> float32 mm (tests only)
    elif path == "torch":
        torch.mm(x[:rows], weight.t(), out_dtype=torch.float32, out=kv)
    else:
        _projection.launch_projection(x, weight, workspace, rows=rows, cfg=cfg, pdl=pdl_enabled(device),
                                      reduce=reduce)  # fmt: skip
        _launched(device)
    return kv


def compress_from_hidden(
    x: torch.Tensor,
    weight: torch.Tensor,
    workspace: torch.Tensor,
    plan: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    state: torch.Tensor,
    out_pages: torch.Tensor | None,
    *,
    kind: str,
    page_size: int,
    eps: float = 1e-6,
    decode: bool = False,
    scratch: torch.Tensor | None = None,
    out_keys: torch.Tensor | None = None,
    ring: int | None = None,
    read_rows: torch.Tensor | None = None,
    save_rows: torch.Tensor | None = None,
    state_has_ape: bool = True,
    indexer_pack: str = "hadamard",
    exact_fp8: bool | None = None,
    projection: str = "auto",
) -> None:
    """:func:`compress` from the layer's hidden states: ``kv_score = x @ weight.T`` (bf16 in, float32
    accumulation and output), then the compression; writes the same state and outputs as the engine's
    projection followed by :func:`compress` (up to the projection's float32 rounding).

    Args:
        x: bf16 ``[>= T, D]`` hidden states of the step's rows (unit column stride; rows past ``T`` ignored).
        weight: the compressor's ``wkv_gate`` weight as the engines hold it: bf16 ``[2W, D]``, row-major (unit
            stride along ``D``, any row stride: a slice of a fused weight is fine). A transposed ``[D, 2W]``,
            float32 or FP8 weight is refused.
        workspace: float32 from :func:`projection_workspace` (written: the step's ``kv_score``, the Triton
            path's split-K partials; its tile counters are left zero).
        projection: ``"auto"``, ``"triton"`` or ``"torch"`` (:data:`PROJECTIONS`).
        The rest as for :func:`compress` (``kv_score`` is the workspace's).

    Every argument of both stages is checked before anything is launched. Two launches or more: the
    projection, then what :func:`compress` launches (:func:`launches`). Deterministic: the Triton path's K
    split adds its partials in a fixed order (no float atomics).
    """
    op = "compress_from_hidden"
    if kind not in KINDS:
        _fail(op, f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    overlap, latent = KINDS[kind]
    _tensor(op, "workspace", workspace, dtypes=(torch.float32,), ndim=1)
    device = workspace.device
    _runnable(op, device)
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2, device=device)
    _tensor(op, "norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), ndim=1, device=device,
            inner_contiguous=False)  # fmt: skip
    width = 2 * norm_weight.shape[0] * (2 if overlap else 1)
    info = _built(op, plan, rows=x.shape[0] if isinstance(x, torch.Tensor) else 0,
                  ratio=ape.shape[0] if isinstance(ape, torch.Tensor) else 0)  # fmt: skip
    rows = info.rows
    path, cfg, _ = _hidden(op, x, weight, workspace, projection, rows=rows, width=width, device=device)
    kv_shape = workspace[: rows * width].view(rows, width)
    # the compress stage's checks, on the kv_score the projection will write (nothing is launched)
    info, head, rope, _ = _common(op, kv_shape, plan, ape, norm_weight, cos, sin, overlap=overlap, latent=latent,
                                  page_size=page_size)  # fmt: skip
    window = info.ratio * (2 if overlap else 1)
    _state(op, state, read_rows, save_rows, ring, info, width=width // 2, window=window, decode=bool(decode),
           device=device)  # fmt: skip
    _outputs(op, kind, out_pages, out_keys, latent=latent, head=head, rope=rope, page_size=page_size, device=device)
    if indexer_pack not in PACK_VARIANTS:
        _fail(op, f"indexer_pack must be one of {list(PACK_VARIANTS)}, got {indexer_pack!r}")
    if scratch is not None:
        if kind != "hca":
            _fail(op, f"scratch is for kind='hca', got {kind!r}")
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    kv = _project(x, weight, workspace, rows=rows, path=path, cfg=cfg, device=device)
    compress(kv, plan, ape, norm_weight, cos, sin, state, out_pages, kind=kind, page_size=page_size, eps=eps,
             decode=decode, scratch=scratch, out_keys=out_keys, ring=ring, read_rows=read_rows, save_rows=save_rows,
             state_has_ape=state_has_ape, indexer_pack=indexer_pack, exact_fp8=exact_fp8)  # fmt: skip


def pair_projection_rows(first: int, second: int, dim: int) -> int:
    """The most rows at which one :func:`project` launch of two weights of one ``x`` (``first`` and ``second``
    outputs, ``D = dim``: a CSA layer's main compressor, 2W = 2048, and its indexer, 512) was measured faster
    than the two projections apart on the H200 (``kernels.projection.PAIR_FASTER``), else 0."""
    return _projection.PAIR_FASTER.get((int(first), int(second), int(dim)), 0)


def joint_pair_weight(weight: torch.Tensor, weight2: torch.Tensor) -> torch.Tensor | None:
    """The two weights of a pair as one bf16 ``[N1 + N2, D]`` row-major view, where ``weight2`` starts where
    ``weight`` ends in one storage (both row-major with a row stride of ``D``, as :func:`join_pair_weights` lays
    them out); else ``None``. A host check of addresses and strides: no device work."""
    if not (isinstance(weight, torch.Tensor) and isinstance(weight2, torch.Tensor)):
        return None
    if weight.ndim != 2 or weight2.ndim != 2 or weight.dtype != weight2.dtype or weight.device != weight2.device:
        return None
    (first, dim), (second, dim2) = weight.shape, weight2.shape
    if dim != dim2 or weight.stride() != (dim, 1) or weight2.stride() != (dim, 1):
        return None
    try:
        same = weight.untyped_storage().data_ptr() == weight2.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (fake, functional)
        return None
    if not same or weight2.storage_offset() != weight.storage_offset() + first * dim:
        return None
    return weight.as_strided((first + second, dim), (dim, 1))


def join_pair_weights(weight: torch.Tensor, weight2: torch.Tensor) -> torch.Tensor:
    """A new bf16 ``[N1 + N2, D]`` row-major tensor holding ``weight`` (``[N1, D]``) then ``weight2``
    (``[N2, D]``). An engine that holds a CSA layer's two ``wkv_gate`` weights as its views, ``joint[:N1]`` and
    ``joint[N1:]`` (done once at load time, then the originals freed), lets :func:`project` run the pair as one
    cuBLAS GEMM (:func:`joint_pair_weight`)."""
    op = "join_pair_weights"
    _tensor(op, "weight", weight, dtypes=(torch.bfloat16,), ndim=2, inner_contiguous=False)
    _tensor(op, "weight2", weight2, dtypes=(torch.bfloat16,), ndim=2, device=weight.device, inner_contiguous=False)
    if weight.shape[1] != weight2.shape[1]:
        _fail(op, f"the weights must share D, got {list(weight.shape)} and {list(weight2.shape)}")
    joint = torch.empty(weight.shape[0] + weight2.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
    joint[: weight.shape[0]].copy_(weight)
    joint[weight.shape[0] :].copy_(weight2)
    return joint


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    workspace: torch.Tensor,
    *,
    rows: int,
    weight2: torch.Tensor | None = None,
    projection: str = "auto",
) -> None:
    """The projection of :func:`compress_from_hidden` alone, of one weight or of two in one launch:
    ``kv_score = x[:rows] @ cat(weight, weight2).T`` (bf16 in, float32 accumulation and output), written as
    float32 ``[rows, N1 + N2]`` (row-major) at the start of ``workspace``.

    A CSA layer's main compressor and its indexer project the same hidden states, and each compressor's
    :func:`compress` then reads its columns, ``kv[:, :N1]`` and ``kv[:, N1:]`` (a ``kv_score`` with a row stride
    of ``N1 + N2``). Where the two weights are one tensor's halves (:func:`joint_pair_weight`,
    :func:`join_pair_weights`), ``"auto"`` runs one cuBLAS GEMM of the joint weight (the fastest path the H200
    bench measured at every step: V4-Flash 10.1 us at 64 rows, 12.8 at 256, against 11.1 and 22.9 for our one
    launch, docs/PERF.md, cold); else ``"auto"`` and ``"triton"`` stream both weights in one Triton launch (at 64
    rows 11.1 us against 8.88 + 5.61 for two of ours and 10.4 + 7.70 for cuBLAS's two).

    Args:
        x: bf16 ``[>= rows, D]`` (unit column stride).
        weight: bf16 ``[N1, D]``, row-major (unit stride along ``D``, any row stride), e.g. CSA main's ``wkv_gate``.
        workspace: float32 from ``projection_workspace(max_rows >= rows, N1 + N2, D)`` (written: ``kv_score``,
            the Triton path's split-K partials; its tile counters are left zero).
        rows: the step's ``T``.
        weight2: bf16 ``[N2, D]``, row-major, or ``None``.
        projection: ``"auto"``, ``"triton"`` or ``"torch"`` (:data:`PROJECTIONS`). One weight: as
            :func:`compress_from_hidden` picks. A pair: ``"auto"`` is cuBLAS on a joint weight, else ours;
            ``"torch"`` needs a joint weight (``torch.mm`` takes one), ``"triton"`` is ours.

    Every argument is checked before the launch; deterministic (no float atomics)."""
    op = "project"
    _tensor(op, "workspace", workspace, dtypes=(torch.float32,), ndim=1)
    device = workspace.device
    _runnable(op, device)
    rows = _int(op, "rows", rows)
    _tensor(op, "weight", weight, dtypes=(torch.bfloat16,), ndim=2, device=device, inner_contiguous=False)
    first = weight.shape[0]
    if weight2 is None:
        path, cfg, _ = _hidden(op, x, weight, workspace, projection, rows=rows, width=first, device=device)
        _project(x, weight, workspace, rows=rows, path=path, cfg=cfg, device=device)
        return
    if projection not in PROJECTIONS:
        _fail(op, f"projection must be one of {list(PROJECTIONS)}, got {projection!r}")
    _tensor(op, "weight2", weight2, dtypes=(torch.bfloat16,), ndim=2, device=device, inner_contiguous=False)
    second = weight2.shape[0]
    _x_and_weight(op, x, weight, "weight", rows=rows, width=first, device=device)
    _x_and_weight(op, x, weight2, "weight2", rows=rows, width=second, device=device)
    joint = joint_pair_weight(weight, weight2)
    if projection == "torch" and joint is None:
        _fail(op, "projection='torch' of a pair needs weight2 to follow weight in one tensor (torch.mm takes one "
                  "weight: ops.join_pair_weights); pass 'triton' / 'auto', or project them apart")  # fmt: skip
    if joint is not None and projection != "triton":
        path, cfg, _ = _hidden(op, x, joint, workspace, "torch", rows=rows, width=first + second, device=device)
        _project(x, joint, workspace, rows=rows, path=path, cfg=cfg, device=device)
        return
    dim = x.shape[1]
    cfg = _projection.pair_config(rows, first, second, dim)
    if cfg is None:
        _fail(op, f"a pair's first weight must have a multiple of 16 rows (a column block reads one weight), got "
                  f"N1 = {first}")  # fmt: skip
    if dim % (cfg.block_k * cfg.split_k):
        _fail(op, f"the projection's blocks {cfg} do not divide D = {dim} (kernels.projection.OVERRIDES)")
    width = first + second
    if cfg.split_k > 1 and cfg.tiles(rows, width) > _projection.COUNTERS:
        _fail(op, f"a Triton projection of {rows} rows splits {cfg.tiles(rows, width)} tiles along K, more than "
                  f"the workspace's {_projection.COUNTERS} counters")  # fmt: skip
    need = _projection.workspace_numel(rows, width, cfg)
    if workspace.numel() < need:
        _fail(op, f"workspace holds {workspace.numel()} floats; a pair projection of {rows} rows x {width} needs "
                  f"{need} (ops.projection_workspace(max_rows >= {rows}, {width}, {dim}, device))")  # fmt: skip
    if rows == 0:
        return
    _projection.launch_projection(x, weight, workspace, rows=rows, cfg=cfg, pdl=pdl_enabled(device), weight2=weight2)
    _launched(device)


def compress_online_hca_from_hidden(
    x: torch.Tensor,
    weight: torch.Tensor,
    workspace: torch.Tensor,
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
    projection: str = "auto",
) -> None:
    """:func:`compress_online_hca` from the layer's hidden states: the projection of
    :func:`compress_from_hidden` (``x`` bf16 ``[>= T, D]``, ``weight`` bf16 ``[2W, D]`` row-major,
    ``workspace`` from :func:`projection_workspace`, ``projection``), then the online compression. Every
    argument of both stages is checked before anything is launched."""
    op = "compress_online_hca_from_hidden"
    _tensor(op, "workspace", workspace, dtypes=(torch.float32,), ndim=1)
    device = workspace.device
    _runnable(op, device)
    _tensor(op, "plan", plan, dtypes=(torch.int32,), ndim=2, device=device)
    _tensor(op, "norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), ndim=1, device=device,
            inner_contiguous=False)  # fmt: skip
    width = 2 * norm_weight.shape[0]
    info = _built(op, plan, rows=x.shape[0] if isinstance(x, torch.Tensor) else 0,
                  ratio=ape.shape[0] if isinstance(ape, torch.Tensor) else 0)  # fmt: skip
    rows = info.rows
    path, cfg, reduce = _hidden(op, x, weight, workspace, projection, rows=rows, width=width, device=device,
                                partials=True)  # fmt: skip
    kv_shape = workspace[: rows * width].view(rows, width)
    info, head, rope, _ = _common(op, kv_shape, plan, ape, norm_weight, cos, sin, overlap=False, latent=True,
                                  page_size=page_size)  # fmt: skip
    _banks(op, state_banks, info, head=head, device=device)
    _outputs(op, "hca", out_pages, out_keys, latent=True, head=head, rope=rope, page_size=page_size, device=device)
    if scratch is not None:
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    # where measured faster (kernels.projection.PARTIALS), the projection leaves its K split's partials and the
    # online kernel adds them as it reads its rows: the same floats, one reduction pass fewer
    kv = _project(x, weight, workspace, rows=rows, path=path, cfg=cfg, device=device, reduce=reduce)
    _launch_online(kv, plan, info, ape, norm_weight, cos, sin, state_banks, out_pages, out_keys, page_size, eps,
                   decode, exact_fp8, scratch, head=head, rope=rope, device=device)  # fmt: skip


def _banks(op: str, state_banks, info: PlanInfo, *, head: int, device) -> None:
    """:func:`compress_online_hca`'s checks of its banks."""
    _tensor(op, "state_banks", state_banks, dtypes=(torch.float32,), ndim=4, device=device)
    if state_banks.shape[2:] != (3, head) or not state_banks.is_contiguous():
        _fail(op, f"state_banks must be contiguous [slots, mtp_step + 1, 3, {head}], got {list(state_banks.shape)}")
    if state_banks.shape[0] < info.num_slots:
        _fail(op, f"state_banks holds {state_banks.shape[0]} request slots; the plan addresses {info.num_slots} "
                  "(build_plan num_slots=)")  # fmt: skip
    if state_banks.shape[1] < info.mtp_step + 1:
        _fail(op, f"state_banks holds {state_banks.shape[1]} banks per slot; mtp_step={info.mtp_step} (the plan's) "
                  f"needs {info.mtp_step + 1}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# How many kernels a call launches
# ---------------------------------------------------------------------------------------------------------------
def launches(
    op: str,
    *,
    rows: int,
    requests: int,
    ratio: int = 4,
    kind: str = "csa",
    decode: bool = False,
    scratch: bool = False,
    tables: bool = False,
    device: torch.device | str = "cpu",
    plans: int = 1,
) -> int:
    """Kernel launches of one call of ``ops.<op>`` on a step of ``rows`` rows with a plan of ``requests``
    requests (the same rules the op follows; ``tests/test_op_contract.py`` counts real launches against it).

    ``build_plan``, ``build_state_rows``, ``check_plan``: 1. ``build_plans`` of ``plans`` plans (``requests``:
    the largest capacity): 1 where every plan's step fits one program
    (``kernels.step_build.plans_in_one_launch``), else ``plans``; with plan 0's state-row ``tables`` one more
    where it is not 1. ``compress``: for ``kind="hca"`` with a ``scratch``
    (the tiled kernel) 1 on a ``decode`` step of up to 256 requests, else 2; otherwise 1 on a ``decode`` step or
    with a ring state, 2 with state-row ``tables`` on other steps (the save follows every window's reads).
    ``compress_online_hca``: 1, or 2 for a step that is not ``decode`` given a ``scratch`` where
    :func:`~.kernels.online_hca.splits` splits it (it depends on ``device``'s multiprocessors).
    ``compress_pair``: 1 on a ``decode`` step (:data:`PAIR_LAUNCH`), else those of its two compresses. A
    compress of 0 rows launches nothing. ``compress_from_hidden`` / ``compress_online_hca_from_hidden``: one more (the
    projection, Triton or ``torch.mm``) than the op they end with. Engine-side work around the ops (a gather,
    a mask) is not counted.
    """
    if op in ("build_plan", "build_state_rows", "check_plan"):
        return 1
    if op == "build_plans":
        if _step_build.plans_in_one_launch(rows, [requests] * plans):
            return 1 + (bool(tables) and not _step_build.TABLES_IN_PLAN_LAUNCH)
        return plans + bool(tables)
    if op in ("compress_from_hidden", "compress_online_hca_from_hidden"):
        if rows == 0:
            return 0
        inner = op.replace("_from_hidden", "")
        return 1 + launches(inner, rows=rows, requests=requests, ratio=ratio, kind=kind, decode=decode,
                            scratch=scratch, tables=tables, device=device)  # fmt: skip
    if op == "compress_pair":
        if rows and decode and PAIR_LAUNCH:
            return 1
        return 2 * launches("compress", rows=rows, requests=requests, ratio=ratio, kind="csa", decode=decode,
                            tables=tables, device=device)  # fmt: skip
    if op not in ("compress", "compress_online_hca"):
        raise ValueError(f"op must be an op of this module that launches kernels, got {op!r}")
    if rows == 0:
        return 0
    if op == "compress_online_hca":
        return 2 if not decode and scratch and splits(rows, ratio, torch.device(device)) else 1
    if kind == "hca" and scratch:
        return 1 if runs_in_one_launch(requests, bool(decode)) else 2
    return 1 if decode or not tables else 2


# ---------------------------------------------------------------------------------------------------------------
# torch.library registration: schema, CPU / CUDA implementations and a fake, per op
# ---------------------------------------------------------------------------------------------------------------
_lib = torch.library.Library("dsv4c", "DEF")

_MUTATES = {
    "build_plan": ("plan",),
    "build_plans": ("plans", "read_rows", "save_rows"),
    "build_state_rows": ("read_rows", "save_rows"),
    "compress": ("state", "out_pages", "scratch", "out_keys", "plan"),
    "compress_pair": ("state", "out_pages", "out_keys", "indexer_state", "indexer_out_pages", "indexer_out_keys"),
    "compress_online_hca": ("state_banks", "out_pages", "out_keys", "scratch"),
    "check_plan": ("err",),
    "copy_plan": ("dst",),
    "compress_from_hidden": ("workspace", "state", "out_pages", "scratch", "out_keys", "plan"),
    "project": ("workspace",),
    "compress_online_hca_from_hidden": ("workspace", "state_banks", "out_pages", "out_keys", "scratch"),
}


def _register(fn, mutates_args) -> None:
    name = fn.__name__
    schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
    # infer_schema has no optional list of optional tensors (its Tensor?[] with a None default does not parse):
    # build_plans' out_slot_maps is one
    schema = schema.replace("Tensor?[] out_slot_maps=None", "Tensor?[]? out_slot_maps=None")
    _lib.define(name + schema)

    @functools.wraps(fn)
    def dispatched(*args, **kwargs):
        token = _DISPATCHED.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _DISPATCHED.reset(token)

    for key in ("CPU", "CUDA"):
        _lib.impl(name, dispatched, key)
    torch.library.register_fake(f"dsv4c::{name}", lambda *args, **kwargs: None, lib=_lib)


def _empty_plan_fake(max_rows, max_requests, ratio, device):
    numel = plan_numel(max_rows, max_requests, ratio)
    return torch.empty((max_requests, -(-numel // max_requests)), dtype=torch.int32, device=device)


for _fn in (build_plan, build_plans, build_state_rows, compress, compress_pair, compress_online_hca, check_plan,
            copy_plan, compress_from_hidden, compress_online_hca_from_hidden, project):  # fmt: skip
    _register(_fn, _MUTATES[_fn.__name__])
_lib.define("empty_plan" + torch.library.infer_schema(empty_plan, mutates_args=()))
_lib.impl("empty_plan", empty_plan, "CompositeExplicitAutograd")
torch.library.register_fake("dsv4c::empty_plan", _empty_plan_fake, lib=_lib)
