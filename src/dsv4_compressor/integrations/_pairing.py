"""What the LightLLM and SGLang adapters share to project a C4 layer's two compressors (main and indexer) from one
``x`` in one call: the identity of that ``x``, the columns the first compressor holds for the second, and the
GEMM of the two weights where they are one tensor's halves (``ops.join_pair_weights``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
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
