"""A layer's fixed tensors bound once: :func:`bind_layer` checks them, then each step is one short call of the
flat op (:meth:`BoundLayer.compress`, :meth:`BoundLayer.compress_from_hidden`).

An engine holds, per compressor layer, tensors that never change between steps (the APE, the norm weight, the
rope tables, the state, the output pages and keys) and settings (kind, page size, eps, the indexer's pack, how
the state is addressed). Binding them checks every one of them once, with the flat op's own checks, so a layer
built wrong is refused where it is built rather than at its first forward; each step then passes only what
changes (the step's rows, its plan, its tables, a scratch). The bound calls are the flat ops
(:func:`~.compression.compress`, :func:`~.online.compress_online_hca` and their ``*_from_hidden`` forms) with the
bound arguments: the same checks, launches and bytes. The flat ops stay the ``torch.ops.dsv4c`` surface.
"""

from __future__ import annotations

import torch

from ..errors import OpError
from .checks import _CHECKING, _fail, _int, _tensor
from .compression import KINDS, compress
from .hidden import compress_from_hidden, compress_online_hca_from_hidden
from .online import compress_online_hca
from .planning import build_plan, empty_plan
from .state_rows import build_state_rows

_OP = "bind_layer"


class BoundLayer:
    """One compressor layer's fixed tensors and settings, checked by :func:`bind_layer` (attributes: its
    arguments). Calls write the bound state, pages and keys."""

    __slots__ = ("kind", "ape", "norm_weight", "cos", "sin", "state", "out_pages", "page_size", "eps", "out_keys",
                 "ring", "tables", "online", "state_has_ape", "indexer_pack", "exact_fp8", "layout")  # fmt: skip

    def __init__(self, **fields):
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("a BoundLayer's tensors are fixed: bind the layer again (ops.bind_layer)")

    def _compress_kwargs(self, decode, scratch, read_rows, save_rows) -> dict:
        kwargs = dict(page_size=self.page_size, eps=self.eps, decode=decode, out_keys=self.out_keys,
                      exact_fp8=self.exact_fp8, scratch=scratch, layout=self.layout)  # fmt: skip
        if self.online:
            if read_rows is not None or save_rows is not None:
                _fail("BoundLayer", "an online HCA layer has no state-row tables (its banks are per request slot)")
            return kwargs
        if self.tables and (read_rows is None or save_rows is None):
            _fail("BoundLayer", "the layer was bound with tables=True: pass the step's read_rows and save_rows "
                                "(ops.build_state_rows)")  # fmt: skip
        if not self.tables and (read_rows is not None or save_rows is not None):
            _fail("BoundLayer", "the layer was bound for a ring state (tables=False): read_rows / save_rows are for a "
                                "table-addressed state")  # fmt: skip
        return dict(kwargs, kind=self.kind, ring=self.ring, read_rows=read_rows, save_rows=save_rows,
                    state_has_ape=self.state_has_ape, indexer_pack=self.indexer_pack)  # fmt: skip

    def compress(
        self,
        kv_score: torch.Tensor,
        plan: torch.Tensor,
        *,
        decode: bool = False,
        scratch: torch.Tensor | None = None,
        read_rows: torch.Tensor | None = None,
        save_rows: torch.Tensor | None = None,
    ) -> None:
        """The step's :func:`~.compression.compress` (or, for an ``online`` layer,
        :func:`~.online.compress_online_hca`) on the bound tensors: ``kv_score`` float32 ``[>= T, 2W]``, ``plan``
        the step's plan of the layer's ratio; ``decode``, ``scratch`` (float32 ``[>= T, H]``), and for a layer bound
        with ``tables=True`` the step's ``read_rows`` / ``save_rows`` as the flat op takes them. Raises
        :class:`OpError` as the flat op does, before anything is written."""
        kwargs = self._compress_kwargs(decode, scratch, read_rows, save_rows)
        args = (kv_score, plan, self.ape, self.norm_weight, self.cos, self.sin, self.state, self.out_pages)
        (compress_online_hca if self.online else compress)(*args, **kwargs)

    def compress_from_hidden(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        workspace: torch.Tensor,
        plan: torch.Tensor,
        *,
        decode: bool = False,
        scratch: torch.Tensor | None = None,
        read_rows: torch.Tensor | None = None,
        save_rows: torch.Tensor | None = None,
        projection: str = "auto",
    ) -> None:
        """The step's :func:`~.hidden.compress_from_hidden` (or, for an ``online`` layer,
        :func:`~.hidden.compress_online_hca_from_hidden`) on the bound tensors: ``x`` bf16 ``[>= T, D]``,
        ``weight`` bf16 ``[2W, D]`` row-major, ``workspace`` from :func:`~.projection.projection_workspace`,
        ``projection`` as the flat op takes it; the rest as :meth:`compress`."""
        kwargs = self._compress_kwargs(decode, scratch, read_rows, save_rows)
        args = (x, weight, workspace, plan, self.ape, self.norm_weight, self.cos, self.sin, self.state, self.out_pages)
        fn = compress_online_hca_from_hidden if self.online else compress_from_hidden
        fn(*args, projection=projection, **kwargs)


def bind_layer(
    *,
    kind: str,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    state: torch.Tensor,
    out_pages: torch.Tensor | None,
    page_size: int,
    eps: float = 1e-6,
    out_keys: torch.Tensor | None = None,
    ring: int | None = None,
    tables: bool = False,
    online: bool = False,
    state_has_ape: bool = True,
    indexer_pack: str = "hadamard",
    exact_fp8: bool | None = None,
    layout: str = "v4",
    num_slots: int = 0,
    mtp_step: int = 0,
) -> BoundLayer:
    """Bind one compressor layer's fixed tensors, checked now; returns a :class:`BoundLayer`.

    Args:
        kind: ``"hca"``, ``"csa"`` or ``"indexer"``.
        ape: float32 ``[r, W]`` or a strided ``[r, coff, H]`` view (``r`` is the layer's ratio).
        norm_weight: float32 or bf16 ``[H]``.
        cos, sin: float32 ``[positions, R/2]`` rope tables, any strides.
        state: the ring state as :func:`~.compression.compress` takes it (3-D ``[slots, ring, 2W]``, or 2-D with
            ``ring``, or with ``tables`` the rows the step's state-row tables address); with ``online`` (HCA) the
            banks, float32 ``[slots, mtp_step + 1, 3, H]``.
        out_pages: uint8 ``[pages, >= P * record]`` or ``None`` (then ``out_keys``).
        page_size: slots per page ``P``.
        eps: RMSNorm epsilon.
        out_keys: bf16 or float32 ``[slots, H]``, or ``None``.
        ring: ring rows per slot of a 2-D ring state.
        tables: the state is addressed by per-step state-row tables (:func:`~.state_rows.build_state_rows`).
        online: an HCA layer on the online-softmax banks (:func:`~.online.compress_online_hca`).
        state_has_ape, indexer_pack, exact_fp8, layout: as :func:`~.compression.compress` (``layout``: the
            records' layout in ``out_pages``).
        num_slots, mtp_step: what the layer's plans are built with (:func:`~.planning.build_plan`), when known:
            the state (slots, ring rows, banks) is checked against them now, as every step checks it against its
            plan.

    Raises :class:`OpError` for any tensor or setting the flat op would refuse on every step (the checks are
    the flat op's, run on a step of no rows); writes nothing and launches nothing.
    """
    if kind not in KINDS:
        _fail(_OP, f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    if online and kind != "hca":
        _fail(_OP, f"online=True is for kind='hca' (the online-softmax banks), got {kind!r}")
    if online and tables:
        _fail(_OP, "an online HCA layer has no state-row tables (tables=True)")
    _tensor(_OP, "ape", ape, dtypes=(torch.float32,), ndim=(2, 3), inner_contiguous=False)
    _tensor(_OP, "norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), ndim=1, inner_contiguous=False)
    _int(_OP, "num_slots", num_slots)
    _int(_OP, "mtp_step", mtp_step)
    layer = BoundLayer(kind=kind, ape=ape, norm_weight=norm_weight, cos=cos, sin=sin, state=state, out_pages=out_pages,
                       page_size=page_size, eps=eps, out_keys=out_keys, ring=ring, tables=bool(tables),
                       online=bool(online), state_has_ape=state_has_ape, indexer_pack=indexer_pack,
                       exact_fp8=exact_fp8, layout=layout)  # fmt: skip
    _check_bound(layer, num_slots=num_slots, mtp_step=mtp_step)
    return layer


def _check_bound(layer: BoundLayer, *, num_slots: int, mtp_step: int) -> None:
    """The flat op's checks of ``layer`` on a step of no rows, run without a launch (a plan of the layer's ratio
    built in check-only mode: the host record alone); errors name ``bind_layer``."""
    overlap, _ = KINDS[layer.kind]
    head, ratio = layer.norm_weight.shape[0], layer.ape.shape[0]
    device = layer.ape.device
    width = 2 * head * (2 if overlap else 1)
    index = torch.empty(0, dtype=torch.int64, device=device)
    token = _CHECKING.set(True)
    try:
        plan = empty_plan(0, 1, ratio, device)
        build_plan(plan, index, index, index, ratio=ratio, num_slots=num_slots, mtp_step=mtp_step)
        read_rows = save_rows = None
        if layer.tables:
            window = ratio * (2 if overlap else 1)
            read_rows = torch.empty(1, window - 1, dtype=torch.int64, device=device)
            save_rows = index
            build_state_rows(plan, read_rows, save_rows, mode="req_ring", ring=window - 1 + mtp_step + 1)
        layer.compress(torch.empty(0, width, device=device), plan, read_rows=read_rows, save_rows=save_rows)
    except OpError as e:  # the flat op's message, named for the bind
        raise OpError(_OP + str(e)[str(e).find(":") :]) from None
    finally:
        _CHECKING.reset(token)
