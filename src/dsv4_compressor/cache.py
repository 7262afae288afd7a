"""The streaming cache API (SPEC section 5).

``CompressedKVCache`` is one compressor layer's compressed KV history for many requests: it validates each
step, keeps the request table and the paged output pool, and hands the computing to a backend
(``"reference"``, ``"triton"`` or ``"online"``), so every backend shares this API, the pool and the tests.

Invariant: after any sequence of valid steps, the entries of groups ``g < L // r`` equal the one-shot
computation over the current rows of positions ``0..L-1`` (the row most recently supplied per position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import INDEXER, CompressorConfig, CompressorParams
from .pool import EntryPool
from .step import StepDescriptor, build_step_descriptor

__all__ = ["CompressedKVCache", "StepError"]


class StepError(ValueError):
    """A refused step or read. The cache is unchanged when this is raised."""


@dataclass
class _Request:
    length: int = 0
    # Oldest position whose saved state the backend can still serve (moves up as the state forgets).
    retained_from: int = 0


def _make_backend(name: str, **kwargs):
    if name == "reference":
        from .backends.reference import ReferenceBackend

        return ReferenceBackend(**kwargs)
    if name == "triton":
        from .backends.triton import TritonRingBackend

        return TritonRingBackend(**kwargs)
    if name == "online":
        from .backends.online import OnlineBackend

        return OnlineBackend(**kwargs)
    raise ValueError(f"unknown backend {name!r}; choose 'reference', 'triton' or 'online'")


class CompressedKVCache:
    """Compressed KV history of one compressor layer for up to ``max_requests`` concurrent requests.

    Args:
        config: the layer kind (``CompressorConfig.hca()``, ``.csa()``, ``.indexer()`` or a general one).
        params: its learned parameters and rope tables (validated against ``config``; moved to ``device``).
        max_requests: request ids are integers in ``[0, max_requests)``.
        max_seq_len: positions must stay below this (at most the rope tables' length).
        mtp_step: speculative draft rows per decode step; a step may rewind at most this many positions.
        backend: ``"reference"`` (PyTorch), ``"triton"`` (ring-state kernels) or ``"online"`` (HCA online
            softmax state; other kinds fall back to the ring kernels).
        device: where the pool, the state and the step's rows live.
        page_size: slots per output page (default: 64 for ratio 4, 2 for ratio 128).
        check_finite: refuse steps whose rows hold NaN/inf. This reads a flag back from the device (a host
            synchronisation); engines that trust their inputs turn it off.
        backend_options: passed to the backend (e.g. ``c128_kernel="single"`` for ``"triton"``).

    Example::

        cache = CompressedKVCache(CompressorConfig.hca(), params, max_requests=8, max_seq_len=4096)
        cache.step([0, 1], [0, 0], [300, 7], kv_score)      # two prompts: 300 and 7 rows
        cache.entries(0)                                    # float32 [2, 512]
    """

    def __init__(
        self,
        config: CompressorConfig,
        params: CompressorParams,
        *,
        max_requests: int,
        max_seq_len: int,
        mtp_step: int = 0,
        backend: str = "reference",
        device="cpu",
        page_size: int | None = None,
        check_finite: bool = True,
        **backend_options: Any,
    ):
        if not isinstance(config, CompressorConfig):
            raise TypeError(f"config must be a CompressorConfig, got {type(config).__name__}")
        for name, value, low in (("max_requests", max_requests, 1), ("max_seq_len", max_seq_len, 1)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(mtp_step, (int, np.integer)) or not 0 <= mtp_step <= 16:
            raise ValueError(f"mtp_step must be an integer in [0, 16], got {mtp_step!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(params, CompressorParams):
            raise TypeError(f"params must be a CompressorParams, got {type(params).__name__}")
        self.params = params.validate(config).to(self.device).validate(config)
        if max_seq_len > self.params.max_positions:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the rope tables' {self.params.max_positions} positions"
            )
        self.config = config
        self.max_requests = int(max_requests)
        self.max_seq_len = int(max_seq_len)
        self.mtp_step = int(mtp_step)
        self.check_finite = check_finite
        self.page_size = int(page_size) if page_size is not None else config.default_page_size
        self.pool = EntryPool(
            config,
            max_requests=self.max_requests,
            max_entries=self.max_seq_len // config.ratio,
            page_size=self.page_size,
            device=self.device,
        )
        self.backend_name = backend
        self.backend = _make_backend(
            backend,
            config=config,
            params=self.params,
            max_requests=self.max_requests,
            mtp_step=self.mtp_step,
            pool=self.pool,
            device=self.device,
            **backend_options,
        )
        self._requests: dict[int, _Request] = {}

    # ------------------------------------------------------------------------------------------
    # The API
    # ------------------------------------------------------------------------------------------
    def step(self, request_ids, starts, num_rows, kv_score: torch.Tensor) -> StepDescriptor:
        """Supply rows for positions ``[start, start + n)`` of each request.

        Args:
            request_ids, starts, num_rows: one value per request in the step (sequences of ints or 1-D
                integer tensors). ``start == L`` continues a request (prefill chunk, decode);
                ``L - mtp_step <= start < L`` first discards the rows at positions ``>= start`` (rejected
                drafts); ``start == 0`` begins a request.
            kv_score: float32 ``[sum(num_rows), 2W]`` on the cache's device, the requests' rows
                concatenated in the order of ``request_ids``, each request's rows in position order.
                Columns ``[0, W)`` are values, ``[W, 2W)`` gate logits (without the APE bias).
                Backends may use its gate-logit half as scratch (the ``"triton"`` ring backend with
                ``fuse_ape=False`` adds the APE bias in place, as the engines do; by default no backend writes
                it); pass a clone if you need it afterwards.

        Returns:
            The step's :class:`StepDescriptor` (for inspection; it is not needed afterwards).

        Raises:
            StepError: (a ``ValueError``) on any invalid input; nothing is changed then.
        """
        ids, starts, counts = self._validate(request_ids, starts, num_rows, kv_score)
        cfg = self.config
        for rid, start, n in zip(ids, starts, counts):
            self.pool.ensure(rid, (start + n) // cfg.ratio)
        desc = build_step_descriptor(
            ids,
            starts,
            counts,
            ratio=cfg.ratio,
            page_table=self.pool.page_table,
            page_size=self.page_size,
            device=self.device,
        )
        for rid, start in zip(ids, starts):
            if start == 0:
                self.backend.begin(rid)
        self.backend.step(desc, kv_score)
        for rid, start, n in zip(ids, starts, counts):
            req = self._requests.setdefault(rid, _Request())
            if start == 0:
                req.retained_from = 0
            req.retained_from = self.backend.retained_from(start, start + n, req.retained_from)
            req.length = start + n
        return desc

    def entries(self, request_id) -> torch.Tensor:
        """float32 ``[L // r, head_dim]``: the dequantized latents (HCA, CSA) or the bf16 indexer keys."""
        rid = self._live(request_id, "entries")
        n = self._requests[rid].length // self.config.ratio
        return self.pool.values(self.pool.slots_of(rid, n))

    def packed_entries(self, request_id) -> torch.Tensor:
        """uint8 ``[L // r, 584]`` latent records (FlashMLA fp8-sparse bytes: 576 data + 8 scale), or for an
        indexer with ``indexer_fp8`` its ``[L // r, 132]`` FP8 packs (128 e4m3fn + float32 scale)."""
        rid = self._live(request_id, "packed_entries")
        if self.config.output == INDEXER and not self.config.indexer_fp8:
            raise StepError(f"{self.config.name}: packed_entries needs latent output or indexer_fp8=True")
        n = self._requests[rid].length // self.config.ratio
        return self.pool.records(self.pool.slots_of(rid, n))

    def length(self, request_id) -> int:
        """``L``: positions supplied so far (after rewinds)."""
        return self._requests[self._live(request_id, "length")].length

    def release(self, request_id) -> None:
        """End a request: its pages return to the pool and its id can begin again (``start == 0``)."""
        rid = self._live(request_id, "release")
        self.pool.free(rid)
        del self._requests[rid]

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------
    def is_live(self, request_id) -> bool:
        return request_id in self._requests

    def page_table(self, request_id) -> np.ndarray:
        """Page ids of a live request's entries (``entry g`` is slot ``g % P`` of page ``table[g // P]``)."""
        rid = self._live(request_id, "page_table")
        n = -(-(self._requests[rid].length // self.config.ratio) // self.page_size)
        return self.pool.page_table[rid, :n].copy()

    def state_bytes_per_request(self) -> int:
        """Bytes of backend state one request holds in this layer (ring rows or online state)."""
        return self.backend.state_bytes_per_request()

    def __repr__(self) -> str:
        return (
            f"CompressedKVCache({self.config.describe()}, backend={self.backend_name!r}, "
            f"requests={len(self._requests)}/{self.max_requests}, device={self.device})"
        )

    # ------------------------------------------------------------------------------------------
    # Validation: everything is checked before anything changes.
    # ------------------------------------------------------------------------------------------
    def _request_id(self, value, what: str) -> int:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
                raise StepError(f"{what}: request id must be an integer, got {value!r}")
            value = int(value.item())
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise StepError(f"{what}: request id must be an integer, got {value!r}")
        if not 0 <= value < self.max_requests:
            raise StepError(f"{what}: request id {value} is outside [0, {self.max_requests})")
        return int(value)

    def _live(self, request_id, what: str) -> int:
        rid = self._request_id(request_id, what)
        if rid not in self._requests:
            raise StepError(f"{what}: request {rid} is not live (begin it with a step at start 0)")
        return rid

    @staticmethod
    def _int_list(values, what: str) -> list[int]:
        if isinstance(values, torch.Tensor):
            if values.dim() > 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
                raise StepError(f"step: {what} must be a 1-D integer sequence, got {values!r}")
            values = values.tolist()
        if isinstance(values, np.ndarray):
            values = values.tolist()
        try:
            out = list(values)
        except TypeError:
            raise StepError(f"step: {what} must be a sequence of integers, got {values!r}") from None
        for v in out:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise StepError(f"step: {what} must hold integers, got {v!r}")
        return [int(v) for v in out]

    def _validate(self, request_ids, starts, num_rows, kv_score):
        cfg = self.config
        ids = [self._request_id(v, "step") for v in self._int_list(request_ids, "request_ids")]
        starts = self._int_list(starts, "starts")
        counts = self._int_list(num_rows, "num_rows")
        if not (len(ids) == len(starts) == len(counts)):
            raise StepError(
                f"step: request_ids, starts and num_rows differ in length ({len(ids)}, {len(starts)}, {len(counts)})"
            )
        seen = set()
        for rid, start, n in zip(ids, starts, counts):
            if rid in seen:
                raise StepError(f"step: request {rid} appears twice in one step")
            seen.add(rid)
            if n < 0:
                raise StepError(f"step: request {rid} has num_rows={n} < 0")
            req = self._requests.get(rid)
            if req is None:
                if start != 0:
                    raise StepError(f"step: request {rid} is not live; it must begin with start 0, got start={start}")
            else:
                low = max(0, req.length - self.mtp_step)
                if not low <= start <= req.length:
                    raise StepError(
                        f"step: request {rid} has L={req.length}; start={start} is outside "
                        f"[L - mtp_step, L] = [{low}, {req.length}] (mtp_step={self.mtp_step})"
                    )
                needed = self.backend.needs_from(start)
                if needed is not None and needed < req.retained_from:
                    raise StepError(
                        f"step: request {rid} cannot restart at {start}: it needs saved state from position "
                        f"{needed}, but the {self.backend_name} state only holds positions >= {req.retained_from} "
                        f"(earlier steps rewound further back than the state keeps)"
                    )
            if start + n > self.max_seq_len:
                raise StepError(
                    f"step: request {rid} supplies positions up to {start + n - 1}, at or beyond "
                    f"max_seq_len={self.max_seq_len}"
                )
        total = sum(counts)
        if not isinstance(kv_score, torch.Tensor):
            raise StepError(f"step: kv_score must be a torch.Tensor, got {type(kv_score).__name__}")
        if kv_score.dtype != torch.float32:
            raise StepError(f"step: kv_score must be float32, got {kv_score.dtype}")
        if kv_score.device != self.device:
            raise StepError(f"step: kv_score is on {kv_score.device}, the cache on {self.device}")
        if kv_score.dim() != 2 or kv_score.shape[1] != cfg.row_width:
            raise StepError(
                f"step: kv_score must be [rows, {cfg.row_width}] (2W for {cfg.name}), got {list(kv_score.shape)}"
            )
        if kv_score.shape[0] != total:
            raise StepError(f"step: sum(num_rows) = {total} but kv_score has {kv_score.shape[0]} rows")
        if not kv_score.is_contiguous():
            raise StepError("step: kv_score must be contiguous")
        # Backend capacity (the C128 scratch) is part of validation: refused before pages or state change.
        self.backend.check_capacity(total, len(ids))
        if self.check_finite and total and not bool(torch.isfinite(kv_score).all()):
            bad = (~torch.isfinite(kv_score)).any(dim=1).nonzero()[:1, 0].item()
            owner = next(rid for rid, r0, n in _row_ranges(ids, counts) if r0 <= bad < r0 + n)
            raise StepError(f"step: kv_score row {bad} (request {owner}) holds non-finite values")
        return ids, starts, counts


def _row_ranges(ids, counts):
    row = 0
    for rid, n in zip(ids, counts):
        yield rid, row, n
        row += n
