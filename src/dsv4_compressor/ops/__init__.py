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
``ops.compress_pair(...)``. A caller that holds a layer's fixed tensors may bind them once, checked then, and
pass only what changes per step (the same flat op runs)::

    layer = ops.bind_layer(kind="csa", ape=ape, norm_weight=norm_weight, cos=cos, sin=sin, state=state,
                           out_pages=pages, page_size=P)
    layer.compress(kv_score, plan, decode=...)      # or layer.compress_from_hidden(x, weight, workspace, plan)

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
(:mod:`dsv4_compressor.kernels.pdl`), except in the launch that directly follows the plan's own build on the same stream
(``build_plan`` lets its successor start before it writes the plan; every other kernel of ours waits for its
predecessor before it lets the next one start, so a launch after it finds the plan whole). The ops keep, per
stream, which build was the last launch of theirs (:func:`records_first`).

The ops are also registered as ``torch.ops.dsv4c.<name>`` (schema, CPU and CUDA implementations, and a fake
for ``torch.compile``); eager callers use the functions here directly and skip the dispatcher.
:func:`launches` tells how many kernels a call launches.

The math and byte layouts are docs/SPEC.md's (sections 3-4); the plan's layout is in
:mod:`dsv4_compressor.kernels.plan`.

**Modules**, one per job: :mod:`.checks` (the host checks and the build records they check against),
:mod:`.planning` (plan ops), :mod:`.state_rows`, :mod:`.compression` (``compress``, ``compress_pair``),
:mod:`.online` (``compress_online_hca``), :mod:`.projection` (``project`` and :func:`projection_choice`, the
one decision of a projection's path), :mod:`.hidden` (the ``*_from_hidden`` ops), :mod:`.binding`
(:func:`bind_layer`), :mod:`.counting` (:func:`launches`), :mod:`.order` (the PDL record order) and
:mod:`.library` (the ``torch.ops.dsv4c`` registration). Every name is re-exported here; import from
``dsv4_compressor.ops``, not from the modules.

**Patching.** Setting an attribute of this package (a test or a probe replacing ``ops.pdl_enabled``, a launcher,
``ops.projection_triton_rows``) sets it as well in every module of the package that holds the same object,
so the ops see the patch as they did when they were one module.
"""

from __future__ import annotations

import sys
import types

from ..errors import OpError
from . import (
    binding,
    checks,
    compression,
    counting,
    hidden,
    library,
    online,
    order,
    planning,
    projection,
    state_rows,
)
from .binding import BoundLayer, bind_layer
from .checks import PlanInfo, plan_info
from .compression import INDEXER_PACKS, KINDS, PAIR_LAUNCH, compress, compress_pair
from .counting import launches
from .hidden import compress_from_hidden, compress_online_hca_from_hidden
from .online import compress_online_hca
from .order import records_first
from .planning import (
    STATE_MODES,
    build_plan,
    build_plans,
    check_plan,
    copy_plan,
    empty_plan,
    plan_error,
    plan_numel,
    rows_from_requests,
)
from .projection import (
    PROJECTIONS,
    ProjectionChoice,
    join_pair_weights,
    joint_pair_triton_rows,
    joint_pair_weight,
    pair_projection_rows,
    project,
    projection_choice,
    projection_triton_rows,
    projection_workspace,
    projection_workspace_numel,
)
from .state_rows import build_state_rows

# isort: split
# Names that tests, probes and scripts reach (or replace) as ``ops.<name>``: the kernel modules and launchers the
# ops call, the PDL switch, and a few internals the tests read.
from ..kernels import plan as _plan  # noqa: F401
from ..kernels import step_build as _step_build  # noqa: F401
from ..kernels.c128_tiled import launch_c128_tiled  # noqa: F401
from ..kernels.fused_compress import launch_compress_single  # noqa: F401
from ..kernels.online_hca import launch_online_hca  # noqa: F401
from ..kernels.pdl import pdl_enabled  # noqa: F401
from ..kernels.ring import launch_ring_save  # noqa: F401
from ..kernels.state_rows import launch_state_rows  # noqa: F401
from .checks import _TABLES_ATTR, _built, _ring_need, _runnable, _state  # noqa: F401
from .compression import _ENTRY_META, _entry  # noqa: F401
from .order import _LAST_LAUNCH, _stream  # noqa: F401

__all__ = [
    "KINDS",
    "OpError",
    "empty_plan",
    "plan_numel",
    "build_plan",
    "build_plans",
    "rows_from_requests",
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
    "joint_pair_triton_rows",
    "joint_pair_weight",
    "pair_projection_rows",
    "project",
    "compress_from_hidden",
    "compress_online_hca_from_hidden",
    "check_plan",
    "plan_error",
    "bind_layer",
    "BoundLayer",
]

_MODULES = (checks, planning, order, state_rows, compression, online, projection, hidden, counting, library, binding)
_UNSET = object()


class _Package(types.ModuleType):
    """The package module: an attribute set here is set in every module of the package bound to the same object
    (see the module docstring, "Patching"), so a replaced function or table reaches the ops that call it."""

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get(name, _UNSET)
        super().__setattr__(name, value)
        if old is _UNSET or name.startswith("__"):
            return
        for module in _MODULES:
            if module.__dict__.get(name, _UNSET) is old:
                setattr(module, name, value)


sys.modules[__name__].__class__ = _Package
