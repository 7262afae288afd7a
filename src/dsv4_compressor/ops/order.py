"""Programmatic dependent launch: which compress may read its plan record before its PDL wait.

``build_plan`` lets its successor start before it writes the plan; every other kernel of ours waits for its
predecessor before it lets the next one start. So a compress reads its plan record early except in the launch
that directly follows the plan's own build on the same stream; the ops keep, per stream, which builds were the
last launch of theirs.
"""

from __future__ import annotations

import torch

from .checks import PlanInfo, plan_info

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
