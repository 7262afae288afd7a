"""Layers driven the way an engine drives them: a step's metadata and plan, then each layer's op.

Per step an engine has the per-row metadata (``positions``, ``row_req``, ``out_slot``: int64 device tensors),
builds one plan per ratio with :func:`~dsv4_compressor.ops.build_plan` (shared by every layer of that ratio),
and calls each layer's :func:`~dsv4_compressor.ops.compress` / :func:`~dsv4_compressor.ops.compress_online_hca`
on that layer's own state and pages. Here a :class:`~dsv4_compressor.cache.CompressedKVCache` only owns a
layer's buffers (ring rows or online banks, the output pages and their page table); :class:`StepMeta` is the
step and its plan, :class:`LayerOp` one layer's op with its buffers bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv4_compressor import ops
from dsv4_compressor.backends.base import StepInput
from dsv4_compressor.cache import CompressedKVCache
from dsv4_compressor.config import CompressorConfig, CompressorParams
from dsv4_compressor.integrations._pairing import compress_pair_of
from dsv4_compressor.pool import EntryPool
from dsv4_compressor.workspace import Workspace

__all__ = [
    "BACKEND_ARGS",
    "StepMeta",
    "LayerOp",
    "make_cache",
    "fill_state",
    "reserve_pages",
    "step_meta",
    "owned_bytes",
    "HiddenLayerOp",
    "PairedHiddenLayerOp",
]

#: Bench backend name -> (cache backend, backend options).
BACKEND_ARGS = {
    "reference": ("reference", {}),
    "triton-single": ("triton", {"c128_kernel": "single"}),
    "triton-tiled": ("triton", {"c128_kernel": "tiled"}),
    "online": ("online", {}),
}


def make_cache(
    cfg: CompressorConfig,
    params: CompressorParams,
    backend: str,
    *,
    max_requests: int,
    max_seq_len: int,
    mtp_step: int,
    device,
    workspace: Workspace | None = None,
    max_pages: int | None = None,
) -> CompressedKVCache:
    """A cache that owns one layer's buffers (``check_finite`` off: the bench's rows are finite by
    construction, and the check would synchronise)."""
    name, opts = BACKEND_ARGS[backend]
    opts = dict(opts)
    if name == "online" and not cfg.overlap:
        opts["workspace"] = workspace if workspace is not None else False  # the bench's, shared, or none
    elif workspace is not None and name == "triton" and not cfg.overlap:
        opts["workspace"] = workspace
    return CompressedKVCache(
        cfg,
        params,
        max_requests=max_requests,
        max_seq_len=max_seq_len,
        mtp_step=mtp_step,
        backend=name,
        device=device,
        max_pages=max_pages,
        check_finite=False,
        **opts,
    )


def fill_state(cache: CompressedKVCache, gen: torch.Generator) -> None:
    """Random state, so windows read real values: ring rows ~ N(0, 1); online banks random but consistent
    (running max ~ N(0, 1), running sum in [1, 4), weighted sum ~ N(0, 1))."""
    backend = cache.backend
    ring = getattr(backend, "ring", None)
    if ring is not None:
        ring.normal_(generator=gen)
    if backend.name == "online":
        state = backend.state
        state[:, :, 0].normal_(generator=gen)
        state[:, :, 1].uniform_(1.0, 4.0, generator=gen)
        state[:, :, 2].normal_(generator=gen)


def reserve_pages(pools: list[EntryPool], slots: np.ndarray, ends: np.ndarray) -> None:
    """Give each request the pages of its entries up to ``ends`` in every pool. The pools must come out with
    one page table (fresh pools of one shape do), since one plan carries the output slots for all of them."""
    first = pools[0]
    for pool in pools:
        pool.reserve(slots, ends // pool.config.ratio)
        if pool.page_size != first.page_size or not np.array_equal(pool.page_table, first.page_table):
            raise RuntimeError("the layer instances' page tables differ; one plan cannot address all of them")


@dataclass
class StepMeta:
    """One step as an engine holds it: per-request host arrays, the per-row metadata on the device, and the
    plan built from it for ``ratio``.

    ``host``: int64 ``[3, T]``, the rows' ``positions``, ``row_req`` and ``out_slot`` (``-1`` off group-closing
    rows); ``positions``, ``row_req``, ``out_slot``: the same, int64 device tensors (what ``build_plan`` reads).
    """

    slots: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    row0: np.ndarray
    host: np.ndarray
    decode: bool
    ratio: int
    num_slots: int
    mtp_step: int
    positions: torch.Tensor
    row_req: torch.Tensor
    out_slot: torch.Tensor
    plan: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.host.shape[1])

    def build_plan(self) -> None:
        """The engine's per-step launch (one per ratio)."""
        ops.build_plan(
            self.plan, self.positions, self.row_req, self.out_slot, ratio=self.ratio, num_slots=self.num_slots,
            mtp_step=self.mtp_step,
        )  # fmt: skip

    def check(self) -> None:
        """Validate the built plan on the device (``ops.check_plan``; reads one flag back): a wrong step here
        would time something other than what the case says."""
        err = torch.zeros(4, dtype=torch.int32, device=self.plan.device)
        ops.check_plan(self.plan, None, err, mtp_step=self.mtp_step, decode=self.decode)
        message = ops.plan_error(err)
        if message:
            raise RuntimeError(f"the bench built an invalid step: {message}")


def step_meta(
    slots,
    starts,
    counts,
    *,
    ratio: int,
    num_slots: int,
    mtp_step: int,
    device,
    pool: EntryPool | None = None,
    out_slot: np.ndarray | None = None,
) -> StepMeta:
    """The metadata of a step of requests ``slots`` supplying ``counts`` rows from ``starts``, and its plan,
    built and checked. The output slot of a group-closing row comes from ``pool``'s page table (pages reserved
    beforehand), or from ``out_slot`` (per row) when the step writes into no pool (plan cases)."""
    slots, starts, counts = (np.asarray(a, dtype=np.int64) for a in (slots, starts, counts))
    rows = int(counts.sum())
    row0 = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(len(slots)), counts)
    positions = (starts - row0)[owner] + np.arange(rows)
    row_req = slots[owner]
    closes = positions % ratio == ratio - 1
    if out_slot is None:
        out_slot = np.full(rows, -1, dtype=np.int64)
        if pool is not None:
            out_slot[closes] = pool.out_slots(row_req[closes], positions[closes] // ratio)
    host = np.stack([positions, row_req, np.asarray(out_slot, dtype=np.int64)])
    positions_dev, row_req_dev, out_slot_dev = (torch.from_numpy(a.copy()).to(device) for a in host)
    meta = StepMeta(
        slots, starts, counts, row0, host, bool((counts <= mtp_step + 1).all()), ratio, num_slots, mtp_step,
        positions_dev, row_req_dev, out_slot_dev, ops.empty_plan(rows, max(1, len(slots)), ratio, device),
    )  # fmt: skip
    meta.build_plan()
    meta.check()
    return meta


class LayerOp:
    """One layer's compress op with its buffers bound: ``op(kv_score, meta)`` runs it on the step's plan.

    Ring backends call ``ops.compress`` (with ``scratch``, HCA runs the tiled kernel; without it
    single-stage), the online backend ``ops.compress_online_hca`` (with ``scratch``, prefill steps split);
    the reference backend (eager PyTorch, no op) runs its ``run`` on the step. :meth:`call` gives the op's
    name and arguments, so the same call can go through ``torch.ops.dsv4c`` instead.
    """

    def __init__(self, cache: CompressedKVCache, *, scratch: torch.Tensor | None = None):
        self.cache = cache
        self.scratch = scratch
        self.reference = cache.backend.name == "reference"
        self.name = "compress_online_hca" if cache.backend.name == "online" else "compress"
        if scratch is not None and cache.config.op_kind != "hca":
            raise ValueError(f"scratch is for HCA layers, not {cache.config.name}")

    def call(self, kv_score: torch.Tensor, plan: torch.Tensor, *, decode: bool) -> tuple[str, tuple, dict]:
        """``(op name, args, kwargs)`` of this layer's op for one step."""
        cache, p, pool = self.cache, self.cache.params, self.cache.pool
        args = (kv_score, plan, p.ape, p.norm_weight, p.cos, p.sin)
        if self.name == "compress_online_hca":
            kwargs = dict(page_size=pool.page_size, eps=p.eps, decode=decode, scratch=self.scratch)
            return self.name, (*args, cache.backend.state, pool.out_pages), kwargs
        kwargs = dict(
            kind=cache.config.op_kind, page_size=pool.page_size, eps=p.eps, decode=decode, scratch=self.scratch,
            out_keys=pool.out_keys,
        )  # fmt: skip
        return self.name, (*args, cache.backend.ring, pool.out_pages), kwargs

    def __call__(self, kv_score: torch.Tensor, meta: StepMeta) -> None:
        if self.reference:
            step = StepInput(meta.slots, meta.starts, meta.counts, meta.row0, kv_score, meta.host, meta.decode)
            self.cache.backend.run(step)
            return
        name, args, kwargs = self.call(kv_score, meta.plan, decode=meta.decode)
        getattr(ops, name)(*args, **kwargs)


class HiddenLayerOp:
    """One layer's op from hidden states: ``op(x, meta)`` runs ``ops.compress_from_hidden`` (ring backends) or
    ``ops.compress_online_hca_from_hidden`` (online) with this layer's ``weight`` (bf16 ``[2W, D]``) and the
    cache's buffers, through ``workspace`` (shared by layers that run one after another), projecting with
    ``projection`` (``"triton"``, ``"torch"`` or ``"auto"``)."""

    def __init__(self, layer: LayerOp, weight: torch.Tensor, workspace: torch.Tensor, projection: str):
        if layer.reference:
            raise ValueError("the reference backend has no op from hidden states")
        # "joint" (a case whose CSA layers hold their two weights as one tensor) runs a lone weight on auto
        projection = "auto" if projection == "joint" else projection
        self.layer, self.weight, self.workspace, self.projection = layer, weight, workspace, projection

    def __call__(self, x: torch.Tensor, meta: StepMeta) -> None:
        name, args, kwargs = self.layer.call(x, meta.plan, decode=meta.decode)
        op = getattr(ops, name + "_from_hidden")
        op(x, self.weight, self.workspace, *args[1:], projection=self.projection, **kwargs)


class PairedHiddenLayerOp:
    """A CSA layer's main compressor and its indexer from one ``x``: ``ops.project`` of both weights (our one launch,
    or one cuBLAS GEMM where they are one tensor's halves) into ``workspace``, then ``ops.compress_pair`` on the
    two column ranges of the result (one launch on a decode step; ``op(x, meta)``)."""

    def __init__(self, main: LayerOp, indexer: LayerOp, weights: tuple[torch.Tensor, torch.Tensor],
                 workspace: torch.Tensor):  # fmt: skip
        if main.reference or indexer.reference:
            raise ValueError("the reference backend has no op from hidden states")
        self.main, self.indexer, self.weights, self.workspace = main, indexer, weights, workspace
        self.first = weights[0].shape[0]
        self.width = self.first + weights[1].shape[0]

    def __call__(self, x: torch.Tensor, meta: StepMeta) -> None:
        rows = meta.rows
        ops.project(x, self.weights[0], self.workspace, rows=rows, weight2=self.weights[1])
        kv = self.workspace[: rows * self.width].view(rows, self.width)
        main = self.main.call(kv[:, : self.first], meta.plan, decode=meta.decode)[1:]
        indexer = self.indexer.call(kv[:, self.first :], meta.plan, decode=meta.decode)[1:]
        compress_pair_of(main, indexer)  # as the adapters make it


def owned_bytes(tensors) -> int:
    """Bytes of distinct tensors' storages (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
