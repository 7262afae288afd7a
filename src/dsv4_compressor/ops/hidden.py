"""The compress ops from the layer's hidden states: the projection, then the compression, every argument of both
stages checked before anything is launched."""

from __future__ import annotations

import torch

from ..kernels.indexer_pack import PACK_VARIANTS
from .checks import _banks, _built, _checks_only, _common, _fail, _float, _outputs, _runnable, _scratch, _state, _tensor
from .compression import KINDS, compress
from .online import _launch_online
from .projection import _hidden, _project


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
    layout: str = "v4",
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
        The rest (``layout`` included) as for :func:`compress` (``kv_score`` is the workspace's).

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
                                  page_size=page_size, layout=layout)  # fmt: skip
    window = info.ratio * (2 if overlap else 1)
    _state(op, state, read_rows, save_rows, ring, info, width=width // 2, window=window, decode=bool(decode),
           device=device)  # fmt: skip
    _outputs(op, kind, out_pages, out_keys, latent=latent, head=head, rope=rope, page_size=page_size, device=device,
             layout=layout)  # fmt: skip
    if indexer_pack not in PACK_VARIANTS:
        _fail(op, f"indexer_pack must be one of {list(PACK_VARIANTS)}, got {indexer_pack!r}")
    if scratch is not None:
        if kind != "hca":
            _fail(op, f"scratch is for kind='hca', got {kind!r}")
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    if _checks_only():
        return
    kv = _project(x, weight, workspace, rows=rows, path=path, cfg=cfg, device=device)
    compress(kv, plan, ape, norm_weight, cos, sin, state, out_pages, kind=kind, page_size=page_size, eps=eps,
             decode=decode, scratch=scratch, out_keys=out_keys, ring=ring, read_rows=read_rows, save_rows=save_rows,
             state_has_ape=state_has_ape, indexer_pack=indexer_pack, exact_fp8=exact_fp8, layout=layout)  # fmt: skip


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
    layout: str = "v4",
) -> None:
    """:func:`compress_online_hca` from the layer's hidden states: the projection of
    :func:`compress_from_hidden` (``x`` bf16 ``[>= T, D]``, ``weight`` bf16 ``[2W, D]`` row-major,
    ``workspace`` from :func:`projection_workspace`, ``projection``), then the online compression (records in
    ``layout``). Every
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
                                  page_size=page_size, layout=layout)  # fmt: skip
    _banks(op, state_banks, info, head=head, device=device)
    _outputs(op, "hca", out_pages, out_keys, latent=True, head=head, rope=rope, page_size=page_size, device=device,
             layout=layout)  # fmt: skip
    if scratch is not None:
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    if _checks_only():
        return
    # where that path is faster (kernels.projection.PARTIALS), the projection leaves its K split's partials and the
    # online kernel adds them as it reads its rows: the same floats, one reduction pass fewer
    kv = _project(x, weight, workspace, rows=rows, path=path, cfg=cfg, device=device, reduce=reduce)
    _launch_online(kv, plan, info, ape, norm_weight, cos, sin, state_banks, out_pages, out_keys, page_size, eps,
                   decode, exact_fp8, scratch, head=head, rope=rope, device=device, layout=layout)  # fmt: skip
