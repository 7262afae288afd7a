"""What the LightLLM and SGLang adapters share to project and compress a C4 layer's two compressors (main and
indexer) from one ``x`` in one call: the identity of that ``x``, the columns the first compressor holds for the
second, the GEMM of the two weights where they are one tensor's halves (``ops.join_pair_weights``), and the two
compress calls made as one ``ops.compress_pair``."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .. import ops
from ..errors import OpError
from ..kernels.projection import workspace_numel


@dataclass
class HeldScore:
    """The ``kv_score`` columns a C4 layer's first compressor projected for its second (``kind``), and what
    identifies the ``x`` they came from (``key``: the layer, the step, :func:`tensor_key`). ``compressed``: where
    the first call also compressed them (``ops.compress_pair``), what it compressed them with, which the second
    call compares with its own arguments; ``None`` where they still need compressing."""

    key: tuple
    kind: str
    kv_score: torch.Tensor
    compressed: tuple | None = None


def tensor_key(x: torch.Tensor) -> tuple:
    """``x``'s address, shape, strides, dtype and version, and the current stream: equal for a second call only
    if it reads the same tensor, unchanged, on the same stream."""
    try:
        version = x._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        version = None
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, version, stream)


def joint_kv_score(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 ``[rows, N1 + N2]``: ``ops.project`` of two weights that are one tensor's halves, one cuBLAS GEMM
    (``projection="torch"``), into a tensor allocated as the engines' own GEMMs allocate their ``kv_score``."""
    width = weight.shape[0] + weight2.shape[0]
    workspace = torch.empty(workspace_numel(rows, width, None), dtype=torch.float32, device=x.device)
    ops.project(x, weight, workspace, rows=rows, weight2=weight2, projection="torch")
    return workspace[: rows * width].view(rows, width)


def pair_kv_score(
    x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, rows: int, workspace: torch.Tensor | None = None
) -> torch.Tensor | None:
    """float32 ``[rows, N1 + N2]``: a C4 layer's two projections of one ``x`` (``weight``: the main compressor's
    ``[N1, D]``, ``weight2``: its indexer's ``[N2, D]``), or ``None`` where neither path serves them.

    Our one launch (``ops.project``, ``"auto"``) into ``workspace`` (the caller's, holding the pair at ``rows``
    rows; ``None`` where it has none that does) on steps our launch serves: up to ``ops.joint_pair_triton_rows``
    rows where the two weights are one tensor's halves (``ops.joint_pair_weight``: measured beside the engine's
    attention GEMM), up to ``ops.pair_projection_rows`` apart. Otherwise, on joined weights, one cuBLAS GEMM
    (:func:`joint_kv_score`); apart, ``None`` (each compressor projects on its own)."""
    first, second, dim = int(weight.shape[0]), int(weight2.shape[0]), int(x.shape[1])
    joint = ops.joint_pair_weight(weight, weight2) is not None
    ours = ops.joint_pair_triton_rows(first, second, dim) if joint else ops.pair_projection_rows(first, second, dim)
    if workspace is not None and 0 < rows <= ours:
        ops.project(x, weight, workspace=workspace, rows=rows, weight2=weight2)  # "auto": ours, on the halves if joint
        return workspace[: rows * (first + second)].view(rows, first + second)
    return joint_kv_score(x, weight, weight2, rows) if joint else None


#: ``ops.compress_pair``'s arguments that both compressors share (both calls must agree on them)
_SHARED = ("decode", "state_has_ape", "exact_fp8")
#: the ops' own signatures (taken at import: a caller may wrap the module's functions)
_COMPRESS = inspect.signature(ops.compress)
_PAIR_PARAMETERS = tuple(inspect.signature(ops.compress_pair).parameters)


def compress_pair_of(main: tuple[tuple, dict], indexer: tuple[tuple, dict]) -> None:
    """A C4 layer's two ``ops.compress`` calls on one plan, each ``(args, kwargs)`` as ``ops.compress`` takes them
    (``kind="csa"`` for ``main``, ``"indexer"``), made as one ``ops.compress_pair``: the main's arguments by their
    own names, the indexer's as ``indexer_<name>`` (its ``indexer_pack`` as it is). Calls that are not such a pair
    (another kind, another plan, a scratch, different ``decode`` / ``state_has_ape`` / ``exact_fp8``) are
    refused with :class:`OpError` before anything runs."""
    m, i = (_COMPRESS.bind(*args, **kwargs) for args, kwargs in (main, indexer))
    for call in (m, i):
        call.apply_defaults()
    m, i = m.arguments, i.arguments
    if m["kind"] != "csa" or i["kind"] != "indexer" or m["plan"] is not i["plan"]:
        raise OpError("compress_pair_of: the calls must be a CSA main compressor's and its indexer's on one plan")
    if m["scratch"] is not None or i["scratch"] is not None or any(m[k] != i[k] for k in _SHARED):
        raise OpError(f"compress_pair_of: the calls take no scratch and agree on {', '.join(_SHARED)}")
    pair = {}
    for name in _PAIR_PARAMETERS:
        own = name.removeprefix("indexer_")
        pair[name] = i[name] if name == "indexer_pack" else i[own] if own != name else m[name]
    ops.compress_pair(**pair)
