"""The ops as ``torch.ops.dsv4c.<name>``: schema, CPU and CUDA implementations, and a fake for ``torch.compile``.

The implementations are the ops themselves, run with the dispatcher flag set (a plan without a build record,
the clone functionalization may hand an op, is then taken at its shape: :func:`~.checks._built`). The fake runs
the same op, with the same checks, and returns before it launches anything (:func:`~.checks._checks_only`): a
call the eager op refuses is refused while ``torch.compile`` traces it, with the same :class:`OpError`, before
the graph runs; a plan build traced so keeps its record on the traced tensor, so later calls in the graph are
checked against it. A trace with symbolic sizes is not checked by the fake (the checks pick kernels by
concrete shapes); the implementation checks every call when it runs. What no trace can check is a plan built
outside the graph that reaches the op as functionalization's clone (``aot_eager``: the clone carries no
build record, so the slot, ``mtp_step`` and row checks against the build are skipped); Inductor re-inplaces
and hands the op the plan itself.
"""

from __future__ import annotations

import functools

import torch

from .checks import _CHECKING, _DISPATCHED
from .compression import compress, compress_pair
from .hidden import compress_from_hidden, compress_online_hca_from_hidden
from .online import compress_online_hca
from .planning import build_plan, build_plans, check_plan, copy_plan, empty_plan, plan_numel
from .projection import project
from .state_rows import build_state_rows

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


def _symbolic(values) -> bool:
    """Whether a tensor among ``values`` (or in a list among them) has a symbolic size or stride."""
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and any(
                not isinstance(d, int) for d in (*t.shape, *t.stride(), t.storage_offset())
            ):
                return True
    return False


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

    def fake(*args, **kwargs):
        if _symbolic(args) or _symbolic(kwargs.values()):
            return  # a dynamic-shape trace: the implementation checks each call at run time, on its shapes
        dispatched_token, checking_token = _DISPATCHED.set(True), _CHECKING.set(True)
        try:
            fn(*args, **kwargs)
        finally:
            _CHECKING.reset(checking_token)
            _DISPATCHED.reset(dispatched_token)

    for key in ("CPU", "CUDA"):
        _lib.impl(name, dispatched, key)
    torch.library.register_fake(f"dsv4c::{name}", fake, lib=_lib)


def _empty_plan_fake(max_rows, max_requests, ratio, device):
    numel = plan_numel(max_rows, max_requests, ratio)
    return torch.empty((max_requests, -(-numel // max_requests)), dtype=torch.int32, device=device)


for _fn in (build_plan, build_plans, build_state_rows, compress, compress_pair, compress_online_hca, check_plan,
            copy_plan, compress_from_hidden, compress_online_hca_from_hidden, project):  # fmt: skip
    _register(_fn, _MUTATES[_fn.__name__])
_lib.define("empty_plan" + torch.library.infer_schema(empty_plan, mutates_args=()))
_lib.impl("empty_plan", empty_plan, "CompositeExplicitAutograd")
torch.library.register_fake("dsv4c::empty_plan", _empty_plan_fake, lib=_lib)
