"""The compressor's projection ``kv_score = x @ weight.T`` (bf16 in, float32 out) on our Triton kernel or cuBLAS,
and :func:`projection_choice`, the one place that decides which path a step takes."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels import projection as _projection
from ..kernels.pdl import pdl_enabled
from .checks import _checks_only, _fail, _int, _runnable, _tensor
from .order import _launched

#: How the ``*_from_hidden`` ops project: ``"triton"`` (:mod:`.kernels.projection`, sized for decode steps),
#: ``"torch"`` (``torch.mm(x, weight.T, out_dtype=float32)``: cuBLAS on the GPU, what the engines run) or
#: ``"auto"`` (the path measured faster for the weight's shape and the step's rows: :func:`projection_triton_rows`).
PROJECTIONS = ("auto", "triton", "torch")
#: :func:`projection_workspace_numel` sizes the Triton path's partials for steps up to this many rows; above it
#: every configuration the kernel picks has no K split (its need is ``kv_score``'s, the torch path's).
_SPLIT_ROWS_SIZED = 1024


def projection_triton_rows(width: int, dim: int, *, online: bool = False) -> int:
    """The most rows ``projection="auto"`` projects with the Triton kernel for a ``[width, dim]`` weight (``2W``
    outputs, ``D`` inputs): the largest step at which it was measured faster than cuBLAS
    (``kernels.projection.FASTER_THAN_CUBLAS``, by weight shape; docs/PERF.md), else 0 (cuBLAS always).
    ``online``: for :func:`compress_online_hca_from_hidden`, which also takes the projection's unsummed partials,
    up to the largest step ``kernels.projection.PARTIALS`` has blocks for (where that path was measured faster).
    Every ``projection="auto"`` decision reads this function (through :func:`projection_choice`), so replacing
    ``ops.projection_triton_rows`` changes what the ops do."""
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


def pair_projection_rows(first: int, second: int, dim: int) -> int:
    """The most rows at which one :func:`project` launch of two weights of one ``x`` (``first`` and ``second``
    outputs, ``D = dim``: a CSA layer's main compressor and its indexer) was measured faster than the two
    projections apart (``kernels.projection.PAIR_FASTER``, by shape), else 0."""
    return _projection.PAIR_FASTER.get((int(first), int(second), int(dim)), 0)


def joint_pair_triton_rows(first: int, second: int, dim: int) -> int:
    """The most rows at which :func:`project` with ``"auto"`` runs a pair whose two weights are one tensor's
    halves (:func:`joint_pair_weight`) as our one launch on the halves rather than one cuBLAS GEMM of the joint
    weight: where that measured faster beside the engine's attention GEMM (``kernels.projection.JOINT_PAIR_TRITON``,
    by shape; never above :func:`pair_projection_rows`), else 0 (cuBLAS always)."""
    key = (int(first), int(second), int(dim))
    return min(_projection.JOINT_PAIR_TRITON.get(key, 0), pair_projection_rows(*key))


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
    :func:`join_pair_weights`), ``"auto"`` runs one cuBLAS GEMM of the joint weight, except on steps of at most
    :func:`joint_pair_triton_rows` rows (where our launch on the halves measured faster beside the engine's own
    attention GEMM: docs/DESIGN.md); else ``"auto"`` and ``"triton"`` stream both weights in one Triton launch
    (one pass over ``x``, faster than two projections apart).

    Args:
        x: bf16 ``[>= rows, D]`` (unit column stride).
        weight: bf16 ``[N1, D]``, row-major (unit stride along ``D``, any row stride), e.g. CSA main's ``wkv_gate``.
        workspace: float32 from ``projection_workspace(max_rows >= rows, N1 + N2, D)`` (written: ``kv_score``,
            the Triton path's split-K partials; its tile counters are left zero).
        rows: the step's ``T``.
        weight2: bf16 ``[N2, D]``, row-major, or ``None``.
        projection: ``"auto"``, ``"triton"`` or ``"torch"`` (:data:`PROJECTIONS`). One weight: as
            :func:`compress_from_hidden` picks. A pair: ``"auto"`` is cuBLAS on a joint weight above
            :func:`joint_pair_triton_rows`, else ours;
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
        if _checks_only():
            return
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
    dim = x.shape[1]
    cublas = projection == "torch" or (projection == "auto" and rows > joint_pair_triton_rows(first, second, dim))
    if joint is not None and cublas:
        path, cfg, _ = _hidden(op, x, joint, workspace, "torch", rows=rows, width=first + second, device=device)
        if _checks_only():
            return
        _project(x, joint, workspace, rows=rows, path=path, cfg=cfg, device=device)
        return
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
    if rows == 0 or _checks_only():
        return
    _projection.launch_projection(x, weight, workspace, rows=rows, cfg=cfg, pdl=pdl_enabled(device), weight2=weight2)
    _launched(device)
