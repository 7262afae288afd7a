"""Resolve an engine's state addressing once per step: the state-row tables every compress of a ratio reads."""

from __future__ import annotations

import torch

from ..kernels import plan as _plan
from ..kernels.pdl import pdl_enabled
from ..kernels.state_rows import MODES as STATE_MODES
from ..kernels.state_rows import StateTables as _plan_tables
from ..kernels.state_rows import launch_state_rows
from .checks import (
    _TABLES_ATTR,
    PlanInfo,
    _built,
    _checks_only,
    _fail,
    _int,
    _ring_need,
    _runnable,
    _TablesInfo,
    _tensor,
)
from .order import _launched


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
    if _checks_only():
        _remember_tables(read_rows, save_rows, info, mode, ring)
        return
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
