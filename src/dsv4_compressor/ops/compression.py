"""Compress one layer's step with the ring state (:func:`compress`), or a CSA layer's two compressors on one
plan (:func:`compress_pair`)."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..errors import OpError
from ..kernels import exact_fp8_default
from ..kernels import plan as _plan
from ..kernels.c128_tiled import launch_c128_tiled, runs_in_one_launch
from ..kernels.entry_pack import EntryOut, EntryParams, entry_args
from ..kernels.fused_compress import launch_compress_pair, launch_compress_single, pairs_in_one_launch
from ..kernels.indexer_pack import PACK_VARIANTS
from ..kernels.pdl import pdl_enabled
from ..kernels.ring import ApeRef, KvRef, StateMeta, launch_ring_save
from .checks import _LATENT_SCALE_BYTES, _checks_only, _common, _fail, _float, _outputs, _scratch, _state
from .order import _compress_launch

#: ``kind`` -> (overlapping windows, latent output). HCA: r = 128 latent; CSA: r = 4 overlapping latent;
#: indexer: r = 4 overlapping keys. The sizes come from the tensors, so smaller test shapes work too.
KINDS = {"hca": (False, True), "csa": (True, True), "indexer": (True, False)}

#: Whether :func:`compress_pair` runs a decode step's two compressors in one launch (else two, as
#: :func:`compress`); the environment variable ``DSV4_PAIR_LAUNCH=0`` read at import turns it off, for A/B runs.
PAIR_LAUNCH = os.environ.get("DSV4_PAIR_LAUNCH", "1").strip() != "0"

#: The indexer's FP8 pack variants (the engines round differently; see ``kernels/indexer_pack.py``).
INDEXER_PACKS = tuple(PACK_VARIANTS)


#: ``EntryMeta`` (sizes and switches, no tensors) by the scalars it depends on: building it costs more than all
#: the rest of a launch's finishing arguments, and a layer builds the same one every step.
_ENTRY_META: dict = {}


def _entry(head, rope, latent, page_size, norm_weight, cos, sin, eps, out_pages, out_keys, exact_fp8, device,
           indexer_pack="hadamard", layout="v4"):  # fmt: skip
    """The finishing arguments of a launch (``entry_args``), FP8 rounding defaulting to the device's.

    The first call for a combination of sizes and switches goes through ``entry_args`` and keeps its
    ``EntryMeta``; later ones build only ``EntryParams`` and ``EntryOut`` (the tensors and their strides), as
    ``entry_args`` does (tests/test_cache.py checks that both paths give the same arguments)."""
    if exact_fp8 is None:
        exact = device.type == "cpu" or exact_fp8_default(device)
    else:
        exact = bool(exact_fp8)
    keys = 0 if out_keys is None else (1 if out_keys.dtype == torch.bfloat16 else 2)
    key = (head, rope, latent, page_size, exact, indexer_pack, out_pages is None, keys, layout)
    meta = _ENTRY_META.get(key)
    if meta is None:
        prm, out, meta = entry_args(
            head=head, rope=rope, latent=latent, page_size=page_size, scale_bytes=_LATENT_SCALE_BYTES,
            norm_weight=norm_weight, cos=cos, sin=sin, eps=eps, out_pages=out_pages, out_keys=out_keys,
            exact_fp8=exact, indexer_pack=indexer_pack, layout=layout,
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
    layout: str = "v4",
) -> None:
    """Compress one layer's step with the ring state: write every entry a row of the step closes, then save
    the step's rows the state keeps.

    Entry ``g`` (positions ``s = g*r .. s+r-1``, with overlap also the previous group's first halves):
    ``c = sum_j softmax_j(score_j + ape[p_j % r]) * kv_j`` per channel, ``n = c * rsqrt(mean(c^2) + eps) *
    norm_weight``, rope on the trailing ``R`` dims (interleaved pairs) at ``s``, then the stored encoding
    (docs/SPEC.md sections 3-4).

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
        indexer_pack: the indexer's FP8 pack variant: ``"hadamard"`` (docs/SPEC.md), ``"hadamard_bf16"`` (LightLLM),
            ``"hadamard_f32"`` (SGLang), ``"pow2"`` (vLLM); see :data:`INDEXER_PACKS`.
        exact_fp8: integer FP8 rounding instead of the hardware cast (default: only on CPU / the interpreter).
        layout: the latent records' layout (HCA, CSA): ``"v4"`` (FlashMLA's fp8-sparse record), ``"v41"``,
            ``"v41_new"`` (SGLang's V4.1 records, block-split or interleaved pages), ``"uniform_fp8"``
            (SGLang's trtllm pool: its Triton norm and rope, then e4m3; :mod:`dsv4_compressor.layout`); the
            indexer takes ``"v4"``. ``out_pages`` must hold ``page_size``
            records of it.
    """
    launch = _compress_args("compress", kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, kind=kind,
                            page_size=page_size, eps=eps, decode=decode, scratch=scratch, out_keys=out_keys,
                            ring=ring, read_rows=read_rows, save_rows=save_rows, state_has_ape=state_has_ape,
                            indexer_pack=indexer_pack, exact_fp8=exact_fp8, layout=layout)  # fmt: skip
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
    layout: str = "v4",
) -> None:
    """A CSA layer's two compressions on one plan: :func:`compress` with ``kind="csa"`` on the first eight
    arguments, then :func:`compress` with ``kind="indexer"`` on the ``indexer_*`` ones (the same plan, so the
    same closing rows and output slots).

    Both calls are checked before either runs, so a refused pair writes nothing. A ``decode`` step runs both in
    one launch, one program per row requesting both windows before it stores anything (the two compressors'
    memory round trips overlap); any other step, two launches as :func:`compress`, with their bytes. In the one
    launch the main compressor's entries and both states are those two calls write, bit for bit; the indexer's
    window and norm sums run on the launch's 4 warps (1 in its own launch), in another order, so on a GPU its
    entries can differ at rounding boundaries (deterministic, within the tolerance model; ``tests/test_ops_gpu.py``'s
    pair test counts them).

    Args: as :func:`compress`, per compressor; ``state_has_ape`` and ``exact_fp8`` apply to both,
        ``indexer_pack`` to the indexer, ``layout`` to the main compressor's records. A ``kv_score`` pair is
        typically the two column ranges of one :func:`project` output (``kv[:, :2W]`` and ``kv[:, 2W:]``). Each
        compressor has its own state-row tables (``read_rows`` / ``save_rows``, ``indexer_read_rows`` /
        ``indexer_save_rows``; the same tensors where the engine addresses both states alike).
    """
    op = "compress_pair"
    common = dict(decode=decode, scratch=None, state_has_ape=state_has_ape, exact_fp8=exact_fp8)
    main = _compress_args(op, kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, kind="csa",
                          page_size=page_size, eps=eps, out_keys=out_keys, ring=ring, read_rows=read_rows,
                          save_rows=save_rows, indexer_pack="hadamard", layout=layout, **common)  # fmt: skip
    try:
        indexer = _compress_args(op, indexer_kv_score, plan, indexer_ape, indexer_norm_weight, indexer_cos,
                                 indexer_sin, indexer_state, indexer_out_pages, kind="indexer",
                                 page_size=indexer_page_size, eps=indexer_eps, out_keys=indexer_out_keys,
                                 ring=indexer_ring, read_rows=indexer_read_rows, save_rows=indexer_save_rows,
                                 indexer_pack=indexer_pack, **common)  # fmt: skip
    except OpError as e:  # name the compressor: the checks name the arguments of compress
        raise OpError(str(e).replace(f"{op}: ", f"{op}: indexer: ", 1)) from None
    if main is None:  # a step of no rows, or a fake
        return
    if pair_in_one_launch(decode=decode, head=main.head, indexer_head=indexer.head):
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
                   exact_fp8, layout="v4") -> _CompressLaunch | None:  # fmt: skip
    """Every check of :func:`compress` (raising :class:`OpError` before anything runs), then its launch's
    arguments; ``None`` for a step of no rows, or in a fake (nothing to launch)."""
    if kind not in KINDS:
        _fail(op, f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    overlap, latent = KINDS[kind]
    info, head, rope, device = _common(op, kv_score, plan, ape, norm_weight, cos, sin, overlap=overlap, latent=latent,
                                       page_size=page_size, layout=layout)  # fmt: skip
    rows, requests, ratio = info.rows, info.requests, info.ratio
    width = head * (2 if overlap else 1)
    window = ratio * (2 if overlap else 1)
    state_ref, ring_rows, rows_per_block = _state(
        op, state, read_rows, save_rows, ring, info, width=width, window=window, decode=bool(decode), device=device
    )
    _outputs(op, kind, out_pages, out_keys, latent=latent, head=head, rope=rope, page_size=page_size, device=device,
             layout=layout)  # fmt: skip
    if indexer_pack not in PACK_VARIANTS:
        _fail(op, f"indexer_pack must be one of {list(PACK_VARIANTS)}, got {indexer_pack!r}")
    if scratch is not None:
        if kind != "hca":
            _fail(op, f"scratch is for kind='hca', got {kind!r}")
        _scratch(op, scratch, rows=rows, head=head, device=device)
    _float(op, "eps", eps)
    if rows == 0 or _checks_only():
        return None
    prm, out, meta = _entry(head, rope, latent, page_size, norm_weight, cos, sin, eps, out_pages, out_keys,
                            exact_fp8, device, indexer_pack, layout)  # fmt: skip
    sm = StateMeta(RING=ring_rows, TABLE=read_rows is not None, HAS_APE=bool(state_has_ape), RPB=rows_per_block)
    kv = KvRef(kv_score, kv_score.stride(0))
    return _CompressLaunch(
        kernel_args=(kv, state_ref, _ape_ref(ape, head), prm, out, meta, sm), plan=plan,
        plan_ref=_plan.PlanRef(plan, rows, requests), ratio=ratio, overlap=overlap, head=head, width=width,
        decode=bool(decode), scratch=scratch, closing=_plan.closing_capacity(rows, requests, ratio),
    )  # fmt: skip


class CompressRoute(NamedTuple):
    """The kernels one :func:`compress` call launches (:func:`compress_route`)."""

    tiled: bool  # HCA on the tiled kernel (given a scratch)
    one_launch: bool  # tiled: the step in one launch (else its windows, then the entries)
    request_saves: bool  # single-stage: a ring saved by one program per request, in the windows' launch
    ring_save: bool  # single-stage: the save in a launch of its own, after every window was read

    @property
    def launches(self) -> int:
        if self.tiled:
            return 1 if self.one_launch else 2
        return 1 + self.ring_save


def compress_route(*, tiled: bool, decode: bool, tables: bool, requests: int) -> CompressRoute:
    """How :func:`compress` runs a step (the op follows it, and :func:`~.counting.launches` counts it): the tiled
    HCA kernel takes one launch on a decode step of a plan it runs at once (``runs_in_one_launch``), else two;
    the single-stage kernels save a decode step's rows from each row's program, a ring's rows on other steps
    from one program per request after that request's windows, and a table-addressed state (any row may be
    saved anywhere) in a second launch after every window was read."""
    if tiled:
        return CompressRoute(True, runs_in_one_launch(requests, bool(decode)), False, False)
    request_saves = not decode and not tables
    return CompressRoute(False, False, request_saves, not decode and not request_saves)


def pair_in_one_launch(*, decode: bool, head: int, indexer_head: int) -> bool:
    """Whether :func:`compress_pair` runs its two compressors in one launch: on a ``decode`` step, with
    :data:`PAIR_LAUNCH` on, for head dims the fused kernel takes (``pairs_in_one_launch``)."""
    return bool(decode) and PAIR_LAUNCH and pairs_in_one_launch(head, indexer_head)


def _launch_compress(c: _CompressLaunch) -> None:
    """The kernels of one validated :func:`compress` call."""
    kv, state_ref, ape_ref, prm, out, meta, sm = c.kernel_args
    pdl = pdl_enabled(c.plan.device)
    record_first = _compress_launch(c.plan)
    route = compress_route(tiled=c.scratch is not None, decode=c.decode, tables=sm.TABLE, requests=c.plan_ref.R)
    if route.tiled:
        launch_c128_tiled(kv, state_ref, ape_ref, c.plan_ref, prm, out, meta, sm, c.scratch, ratio=c.ratio,
                          closing=c.closing, decode=c.decode, one_launch=route.one_launch, pdl=pdl,
                          record_first=record_first)  # fmt: skip
        return
    launch_compress_single(
        kv, state_ref, ape_ref, c.plan_ref, prm, out, meta, sm, ratio=c.ratio, overlap=c.overlap,
        save_rows=c.decode, request_saves=route.request_saves, pdl=pdl, record_first=record_first,
    )  # fmt: skip
    if route.ring_save:
        launch_ring_save(kv, state_ref, ape_ref, c.plan_ref, sm, ratio=c.ratio, head=c.head, width=c.width, pdl=pdl)
