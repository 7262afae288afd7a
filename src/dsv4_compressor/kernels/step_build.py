"""A step's metadata in as few launches as its size allows: several plans of the same rows and, optionally, the
state-row tables of the first (``ops.build_plans``).

An engine's step builds one plan per ratio from the same rows (LightLLM's C4 and C128 plans) and, where its
state is not a per-request ring, resolves the C4 state rows from the C4 plan (:mod:`.state_rows`). Each launch in
a decode step's graph costs more than the little work it does, so where every plan's step fits one program
(:func:`plans_in_one_launch`) this is one launch of one program per plan, each running
``plan._build_plan_one_block``, and, with state rows, ``build_state_rows``' own launch after it (with
:data:`TABLES_IN_PLAN_LAUNCH`, plan 0's program resolves them instead from the values its build left in
registers, ``state_rows.block_state_rows``: one launch, but slower on the H200). Larger steps take one
``build_plan`` launch per plan and, with state rows, ``build_state_rows``' own launch after them. Every way
writes the same bytes.
"""

import os

import triton
import triton.language as tl

from .pdl import launch_options, wait_then_release
from .plan import PlanRef, _build_plan_one_block, _kernel, _one_block_size, _out_map, _slot_map, launch_build_plan
from .state_rows import StateTables, block_state_rows, launch_state_rows

#: The most plans :func:`launch_build_plans` builds in one launch.
PLANS_ONE_LAUNCH_MAX = 2


def _tables_in_plan_launch_from_env() -> bool:
    value = os.environ.get("DSV4_STEP_TABLES_IN_PLAN_LAUNCH", "0").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no", ""):
        return False
    raise ValueError(f"DSV4_STEP_TABLES_IN_PLAN_LAUNCH must be 0 or 1, got {value!r}")


#: Whether plan 0's state-row tables are resolved inside the one-launch build by plan 0's program
#: (``DSV4_STEP_TABLES_IN_PLAN_LAUNCH=1`` at import), or by ``build_state_rows``' own launch after it (the
#: default: its many programs beat one program's serial work; the one-rank V4-Flash step on the H200 measured
#: the build at 5.4 / 5.6 us against 9.1 / 8.9 with the tables in the plan launch, docs/VALIDATION.md).
TABLES_IN_PLAN_LAUNCH: bool = _tables_in_plan_launch_from_env()


@triton.jit
def _build_plans_one_block_kernel(
    plan_0, out_ptr_0, omap_0, plan_1, out_ptr_1, omap_1, pos_ptr, req_ptr, num_slots, smap,
    read_rows_ptr, save_rows_ptr, save_capacity, tables,
    RATIO_0: tl.constexpr, OUT_MAP_0: tl.constexpr, RATIO_1: tl.constexpr, OUT_MAP_1: tl.constexpr,
    BLOCK: tl.constexpr, MAP: tl.constexpr, STATE_MODE: tl.constexpr, WINDOW: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Up to two plans of one step's rows, one program each (grid ``(plans,)``): program ``i`` builds plan ``i``
    at ``RATIO_i`` with its own out slots (``OUT_MAP_i``: through its map), exactly as ``build_plan``'s
    one-block kernel does; with ``STATE_MODE >= 0`` program 0 then writes plan 0's state-row tables (mode
    ``STATE_MODE`` of :data:`.state_rows.MODES`, a window of ``WINDOW`` rows). ``BLOCK`` covers every plan's rows
    and requests."""
    wait_then_release(PDL)
    if tl.program_id(0) == 0:
        pos, fits, slot, start, end, at_start, run, runs = _build_plan_one_block(
            plan_0, pos_ptr, req_ptr, out_ptr_0, num_slots, smap, omap_0, RATIO_0, BLOCK, MAP, OUT_MAP_0
        )  # fmt: skip
        if STATE_MODE >= 0:
            block_state_rows(
                tl.arange(0, BLOCK), plan_0.T, plan_0.R, pos, fits, slot, start, end, at_start, run, runs,
                read_rows_ptr, save_rows_ptr, save_capacity, tables, STATE_MODE, WINDOW, BLOCK_W,
            )  # fmt: skip
    else:
        _build_plan_one_block(
            plan_1, pos_ptr, req_ptr, out_ptr_1, num_slots, smap, omap_1, RATIO_1, BLOCK, MAP, OUT_MAP_1
        )  # fmt: skip


def plans_in_one_launch(rows: int, requests, kernel: str | None = None) -> bool:
    """Whether :func:`launch_build_plans` builds plans of ``requests`` (a list: each plan's capacity) request
    capacities for a step of ``rows`` rows in one launch: at most :data:`PLANS_ONE_LAUNCH_MAX` plans, each of
    which ``launch_build_plan`` would build with ``kernel`` (default ``plan.PLAN_KERNEL``) by one program."""
    requests = list(requests)
    return 1 <= len(requests) <= PLANS_ONE_LAUNCH_MAX and all(
        _kernel(kernel, rows, r) == "one_block" for r in requests
    )  # fmt: skip


def launch_build_plans(plans, positions, row_req, out_slots, *, rows: int, requests, ratios, num_slots: int,
                       req_state_slot=None, out_slot_maps=None, state_rows=None, kernel: str | None = None,
                       pdl: bool = False) -> int:  # fmt: skip
    """Build several plans of one step's rows (``plans[i]`` from ``out_slots[i]``, ``out_slot_maps[i]``, at
    ``ratios[i]``, ``requests[i]`` its capacity) and, with ``state_rows = (read_rows, save_rows, tables, mode,
    window)`` (:class:`.state_rows.StateTables`, a mode number), plan 0's state-row tables: one launch where
    :func:`plans_in_one_launch`, else one ``launch_build_plan`` per plan and one ``launch_state_rows``; the bytes
    are the same either way. Returns the launches. Arguments are validated by
    :func:`dsv4_compressor.ops.build_plans`."""
    n = len(plans)
    maps = [None] * n if out_slot_maps is None else list(out_slot_maps)
    if not plans_in_one_launch(rows, requests, kernel):
        for i in range(n):
            launch_build_plan(
                plans[i], positions, row_req, out_slots[i], rows=rows, requests=requests[i], ratio=ratios[i],
                num_slots=num_slots, req_state_slot=req_state_slot, out_slot_map=maps[i], kernel=kernel, pdl=pdl,
            )  # fmt: skip
        if state_rows is None:
            return n
        read_rows, save_rows, tables, mode, window = state_rows
        launch_state_rows(
            PlanRef(plans[0], 0, plans[0].shape[0]), read_rows, save_rows, tables, mode=mode, window=window, pdl=pdl
        )  # fmt: skip
        return n + 1
    block = _one_block_size(rows, max(requests))
    slot_map, smap = _slot_map(req_state_slot, row_req)
    slots = []
    for i in (0, min(1, n - 1)):  # a single plan fills the second slot too (its program is not launched)
        out_map, omap = _out_map(maps[i], out_slots[i])
        slots.append((PlanRef(plans[i], rows, requests[i]), out_slots[i], omap, ratios[i], out_map))
    (p0, o0, m0, r0, om0), (p1, o1, m1, r1, om1) = slots
    separate = state_rows is not None and not TABLES_IN_PLAN_LAUNCH
    if state_rows is None or separate:  # unused stand-ins (STATE_MODE -1 reads none of them)
        tables = StateTables(1, positions, 0, positions, 1, 0, positions, 0, 1)
        read_rows, save_rows, mode, window = positions, positions, -1, 2
    else:
        read_rows, save_rows, tables, mode, window = state_rows
    _build_plans_one_block_kernel[(n,)](
        p0, o0, m0, p1, o1, m1, positions, row_req, num_slots, smap, read_rows, save_rows, save_rows.shape[0],
        tables, RATIO_0=r0, OUT_MAP_0=om0, RATIO_1=r1, OUT_MAP_1=om1, BLOCK=block, MAP=slot_map, STATE_MODE=mode,
        WINDOW=window, BLOCK_W=triton.next_power_of_2(max(window - 1, 1)), num_warps=4 if block <= 256 else 8,
        **launch_options(pdl, n),
    )  # fmt: skip
    if separate:
        read_rows, save_rows, tables, mode, window = state_rows
        launch_state_rows(
            PlanRef(plans[0], 0, plans[0].shape[0]), read_rows, save_rows, tables, mode=mode, window=window, pdl=pdl
        )  # fmt: skip
        return 2
    return 1


__all__ = ["PLANS_ONE_LAUNCH_MAX", "TABLES_IN_PLAN_LAUNCH", "plans_in_one_launch", "launch_build_plans"]
