"""The streaming cache API (SPEC section 5), built on the ops.

``CompressedKVCache`` is one compressor layer's compressed KV history for many requests: it validates each
step on the host, keeps the request table and the paged output pool, and hands the computing to a backend
(``"reference"``, ``"triton"`` or ``"online"``). The kernel backends run exactly what an engine runs
(:func:`~dsv4_compressor.ops.build_plan`, then the compress op), on tensors the cache owns; :meth:`graph`
captures that in a CUDA graph and replays it.

Invariant: after any sequence of valid steps, the entries of groups ``g < L // r`` equal the one-shot
computation over the current rows of positions ``0..L-1`` (the row most recently supplied per position).

Host work per step is O(requests + rows / r + new pages): validation is vectorised over the requests, pages are
handed out only where an entry crosses into a new page, and the per-row metadata goes to the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .backends.base import StepInput
from .config import INDEXER, CompressorConfig, CompressorParams
from .errors import CapacityError, StepError
from .kernels import interpreting
from .pool import EntryPool

__all__ = ["CompressedKVCache", "CacheGraph", "StepError", "CapacityError"]

_BACKENDS = ("reference", "triton", "online")


def _make_backend(name: str, **kwargs):
    if name == "reference":
        from .backends.reference import ReferenceBackend

        return ReferenceBackend(**kwargs)
    if name == "triton":
        from .backends.triton import TritonRingBackend

        return TritonRingBackend(**kwargs)
    from .backends.online import make_online_backend

    return make_online_backend(**kwargs)


#: Options each backend takes through ``CompressedKVCache(..., **backend_options)``.
_BACKEND_OPTIONS = {
    "reference": {"compute_dtype"},
    "triton": {"c128_kernel", "workspace", "scratch_region", "batch_max_tokens", "exact_fp8"},
    "online": {"exact_fp8", "c128_kernel", "workspace", "scratch_region", "batch_max_tokens"},
}


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")
    return int(value)


def _resolve_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but CUDA is not available here (torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    return dev


@dataclass
class _Layout:
    """What a step's request ids and row counts alone decide, validated. Decode steps repeat them step after
    step, so the cache keeps the last one and checks only the starts against the request table."""

    ids_key: bytes
    counts_key: bytes
    total: int
    row0: np.ndarray  # each request's first row
    owner: np.ndarray  # each row's request index
    base: np.ndarray  # row - row0[owner]: a row's position is starts[owner] + base
    tail: np.ndarray  # int64 [2, T]: row_req (the request ids of the rows) and out_slot -1
    decode: bool


@dataclass
class _Prepared:
    """A validated step, its reserved pages (undone if the step fails) and the request table after it."""

    step: StepInput
    given: list
    ends: np.ndarray
    retained: np.ndarray


class CompressedKVCache:
    """Compressed KV history of one compressor layer for up to ``max_requests`` concurrent requests.

    Args:
        config: the layer kind (``CompressorConfig.hca()``, ``.csa()``, ``.indexer()`` or a general one).
        params: its learned parameters and rope tables (validated against ``config``; moved to ``device``).
        max_requests: request ids are integers in ``[0, max_requests)``.
        max_seq_len: positions must stay below this (at most the rope tables' length).
        mtp_step: speculative draft rows per decode step; a step may rewind at most this many positions.
        backend: ``"reference"`` (PyTorch), ``"triton"`` (ring-state kernels) or ``"online"`` (HCA online
            softmax state; other kinds run the ring kernels).
        device: where the pool, the state and the step's rows live (``"cpu"`` runs kernels under the Triton
            interpreter, which must be enabled with ``TRITON_INTERPRET=1`` before triton is imported).
        page_size: slots per output page (default: 64 for ratio 4, 2 for ratio 128).
        max_pages: output pages in the pool (default: enough for every request at ``max_seq_len``); a step that
            needs more than are free is refused with a :class:`CapacityError`.
        check_finite: refuse steps whose rows hold NaN/inf. This reads a flag back from the device (a host
            synchronisation); engines that trust their inputs turn it off.
        backend_options: passed to the backend: ``c128_kernel`` (``"tiled"`` / ``"single"``), ``workspace``,
            ``scratch_region``, ``batch_max_tokens``, ``exact_fp8`` for the kernel backends; ``compute_dtype``
            for ``"reference"``.

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
        max_pages: int | None = None,
        check_finite: bool = True,
        **backend_options: Any,
    ):
        if not isinstance(config, CompressorConfig):
            raise TypeError(f"config must be a CompressorConfig, got {type(config).__name__}")
        if not isinstance(params, CompressorParams):
            raise TypeError(f"params must be a CompressorParams, got {type(params).__name__}")
        self.max_requests = _check_int("max_requests", max_requests, 1)
        self.max_seq_len = _check_int("max_seq_len", max_seq_len, 1)
        self.mtp_step = _check_int("mtp_step", mtp_step, 0, 16)
        self.page_size = config.default_page_size if page_size is None else _check_int("page_size", page_size, 1)
        if max_pages is not None:
            max_pages = _check_int("max_pages", max_pages, 1)
        if not isinstance(check_finite, (bool, np.bool_)):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose 'reference', 'triton' or 'online'")
        unknown = sorted(set(backend_options) - _BACKEND_OPTIONS[backend])
        if unknown:
            raise ValueError(
                f"backend {backend!r} takes no option(s) {unknown}; it takes {sorted(_BACKEND_OPTIONS[backend])}"
            )
        self.device = _resolve_device(device)
        if backend != "reference" and self.device.type == "cpu" and not interpreting():
            raise ValueError(
                f"backend={backend!r} on a CPU device runs its Triton kernels under the interpreter: set "
                f"TRITON_INTERPRET=1 in the environment before triton is imported (or use device='cuda')"
            )
        self.params = params.validate(config).to(self.device).validate(config)
        if self.max_seq_len > self.params.max_positions:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds the rope tables' {self.params.max_positions} positions"
            )
        self.config = config
        self.check_finite = bool(check_finite)
        self.pool = EntryPool(
            config,
            max_requests=self.max_requests,
            max_entries=self.max_seq_len // config.ratio,
            page_size=self.page_size,
            device=self.device,
            max_pages=max_pages,
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
        # The request table: length (-1: not live) and the oldest position the state still holds.
        self._length = np.full(self.max_requests, -1, dtype=np.int64)
        self._retained = np.zeros(self.max_requests, dtype=np.int64)
        self._last_layout: _Layout | None = None

    # ------------------------------------------------------------------------------------------
    # The API
    # ------------------------------------------------------------------------------------------
    def step(self, request_ids, starts, num_rows, kv_score: torch.Tensor) -> None:
        """Supply rows for positions ``[start, start + n)`` of each request.

        Args:
            request_ids, starts, num_rows: one value per request in the step (ordered sequences of ints, numpy
                arrays or 1-D integer tensors). ``start == L`` continues a request (prefill chunk, decode);
                ``L - mtp_step <= start < L`` first discards the rows at positions ``>= start`` (rejected
                drafts); ``start == 0`` begins a request.
            kv_score: float32 ``[sum(num_rows), 2W]`` on the cache's device, the requests' rows concatenated in
                the order of ``request_ids``, each request's rows in position order. Columns ``[0, W)`` are
                values, ``[W, 2W)`` gate logits (without the APE bias). Never written.

        Raises:
            StepError: (a ``ValueError``) on any invalid input, :class:`CapacityError` (a ``StepError``) when the
                step does not fit the pool or the scratch. Nothing has changed then; if the backend itself
                fails, the request table and the pages are rolled back too.
        """
        prepared = self._prepare(request_ids, starts, num_rows, kv_score, what="step")
        try:
            self.backend.run(prepared.step)
        except BaseException:
            self.pool.undo(prepared.given)
            raise
        self._commit(prepared)

    def graph(self, *, max_requests: int, rows_per_request: int) -> CacheGraph:
        """A CUDA graph of this layer's step for up to ``max_requests`` requests of up to ``rows_per_request``
        rows each (``rows_per_request <= mtp_step + 1``: a decode / verify graph). See :class:`CacheGraph`."""
        return CacheGraph(self, max_requests=max_requests, rows_per_request=rows_per_request)

    def entries(self, request_id) -> torch.Tensor:
        """float32 ``[L // r, head_dim]``: the dequantized latents (HCA, CSA) or the bf16 indexer keys."""
        rid = self._live(request_id, "entries")
        n = int(self._length[rid]) // self.config.ratio
        return self.pool.values(self.pool.slots_of(rid, n))

    def packed_entries(self, request_id) -> torch.Tensor:
        """uint8 ``[L // r, 584]`` latent records (FlashMLA fp8-sparse bytes: 576 data + 8 scale), or for an
        indexer with ``indexer_fp8`` its ``[L // r, 132]`` FP8 packs (128 e4m3fn + float32 scale)."""
        rid = self._live(request_id, "packed_entries")
        if self.config.output == INDEXER and not self.config.indexer_fp8:
            raise StepError(f"{self.config.name}: packed_entries needs latent output or indexer_fp8=True")
        n = int(self._length[rid]) // self.config.ratio
        return self.pool.records(self.pool.slots_of(rid, n))

    def length(self, request_id) -> int:
        """``L``: positions supplied so far (after rewinds)."""
        return int(self._length[self._live(request_id, "length")])

    def release(self, request_id) -> None:
        """End a request: its pages return to the pool and its id can begin again (``start == 0``)."""
        rid = self._live(request_id, "release")
        self.pool.free(rid)
        self._length[rid] = -1
        self._retained[rid] = 0

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------
    def is_live(self, request_id) -> bool:
        """Whether ``request_id`` has begun and not been released (ids outside ``[0, max_requests)``: False)."""
        rid = self._request_id(request_id, "is_live", check_range=False)
        return 0 <= rid < self.max_requests and bool(self._length[rid] >= 0)

    def live_requests(self) -> list[int]:
        return np.nonzero(self._length >= 0)[0].tolist()

    def page_table(self, request_id) -> np.ndarray:
        """Page ids of a live request's entries (``entry g`` is slot ``g % P`` of page ``table[g // P]``)."""
        rid = self._live(request_id, "page_table")
        n = -(-(int(self._length[rid]) // self.config.ratio) // self.page_size)
        return self.pool.page_table[rid, :n].copy()

    def state_bytes_per_request(self) -> int:
        """Bytes of backend state one request holds in this layer (ring rows or online state)."""
        return self.backend.state_bytes_per_request()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor the cache owns (backend state and output pool), by name."""
        return {**self.backend.state_tensors(), **self.pool.tensors()}

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes by part: ``pool`` (output pages), ``state`` (ring or online banks, plus scratch)."""
        return {"pool": self.pool.nbytes(), "state": self.backend.nbytes()}

    def __repr__(self) -> str:
        return (
            f"CompressedKVCache({self.config.describe()}, backend={self.backend_name!r}, "
            f"requests={int((self._length >= 0).sum())}/{self.max_requests}, device={self.device})"
        )

    # ------------------------------------------------------------------------------------------
    # Validation: everything is checked before anything changes.
    # ------------------------------------------------------------------------------------------
    def _request_id(self, value, what: str, check_range: bool = True) -> int:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
                raise StepError(f"{what}: request id must be an integer, got {value!r}")
            value = int(value.item())
        if not _is_int(value):
            raise StepError(f"{what}: request id must be an integer, got {value!r}")
        if check_range and not 0 <= value < self.max_requests:
            raise StepError(f"{what}: request id {value} is outside [0, {self.max_requests})")
        return int(value)

    def _live(self, request_id, what: str) -> int:
        rid = self._request_id(request_id, what)
        if self._length[rid] < 0:
            raise StepError(f"{what}: request {rid} is not live (begin it with a step at start 0)")
        return rid

    @staticmethod
    def _int_array(values, what: str) -> np.ndarray:
        if isinstance(values, torch.Tensor):
            if values.dim() > 1 or values.dtype.is_floating_point or values.dtype in (torch.bool, torch.complex64):
                raise StepError(f"step: {what} must be a 1-D integer sequence, got {values!r}")
            return values.reshape(-1).cpu().numpy().astype(np.int64)
        if isinstance(values, np.ndarray):
            if values.ndim > 1 or values.dtype.kind not in "iu":
                raise StepError(f"step: {what} must be a 1-D integer sequence, got {values!r}")
            return values.astype(np.int64, copy=False).reshape(-1)
        if isinstance(values, (set, frozenset, dict, str, bytes)) or not hasattr(values, "__iter__"):
            raise StepError(
                f"step: {what} must be an ordered sequence of integers (rows follow its order), got {values!r}"
            )
        out = list(values)
        # numpy types the whole list in C; a bool among ints would silently become 0 / 1, so look for one
        array = np.array(out) if out else np.zeros(0, dtype=np.int64)
        types = set(map(type, out))
        if array.ndim != 1 or array.dtype.kind not in "iu" or bool in types or np.bool_ in types:
            bad = next((v for v in out if not _is_int(v)), out)
            raise StepError(f"step: {what} must hold integers, got {bad!r}")
        return array.astype(np.int64, copy=False)

    def _layout(self, ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, what: str) -> _Layout:
        """The validated layout of ``ids`` and ``counts`` (reused while a step repeats the previous one's)."""
        if not (len(ids) == len(starts) == len(counts)):
            raise StepError(
                f"{what}: request_ids, starts and num_rows differ in length ({len(ids)}, {len(starts)}, {len(counts)})"
            )
        ids_key, counts_key = ids.tobytes(), counts.tobytes()
        layout = self._last_layout
        if layout is not None and layout.ids_key == ids_key and layout.counts_key == counts_key:
            return layout
        if len(ids):
            bad = np.nonzero((ids < 0) | (ids >= self.max_requests))[0]
            if len(bad):
                raise StepError(f"{what}: request id {ids[bad[0]]} is outside [0, {self.max_requests})")
            seen = np.bincount(ids, minlength=self.max_requests)
            if seen.max() > 1:
                raise StepError(f"{what}: request {int(np.argmax(seen))} appears twice in one step")
            bad = np.nonzero(counts < 0)[0]
            if len(bad):
                raise StepError(f"{what}: request {ids[bad[0]]} has num_rows={counts[bad[0]]} < 0")
        total = int(counts.sum())
        row0 = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=row0[1:])
        owner = np.repeat(np.arange(len(ids)), counts)
        tail = np.empty((2, total), dtype=np.int64)
        tail[0] = ids[owner]
        tail[1] = -1
        decode = bool((counts <= self.mtp_step + 1).all())
        layout = _Layout(ids_key, counts_key, total, row0, owner, np.arange(total) - row0[owner], tail, decode)
        self._last_layout = layout
        return layout

    def _check_starts(self, ids, starts, length, retained, needed, ends, what: str) -> None:
        """Raise the error of the first request whose start the request table refuses (the slow path of
        :meth:`_prepare`, taken only when its vectorised check found something)."""
        live = length >= 0
        bad = np.nonzero(~live & (starts != 0))[0]
        if len(bad):
            k = bad[0]
            raise StepError(f"{what}: request {ids[k]} is not live; it must begin with start 0, got start={starts[k]}")
        low = np.maximum(0, length - self.mtp_step)
        bad = np.nonzero(live & ((starts < low) | (starts > length)))[0]
        if len(bad):
            k = bad[0]
            raise StepError(
                f"{what}: request {ids[k]} has L={length[k]}; start={starts[k]} is outside [L - mtp_step, L] = "
                f"[{low[k]}, {length[k]}] (mtp_step={self.mtp_step})"
            )
        bad = np.nonzero(live & (needed < retained))[0]
        if len(bad):
            k = bad[0]
            raise StepError(
                f"{what}: request {ids[k]} cannot restart at {starts[k]}: it needs saved state from position "
                f"{needed[k]}, but the {self.backend_name} state only holds positions >= {retained[k]} (earlier "
                f"steps rewound further back than the state keeps)"
            )
        bad = np.nonzero(ends > self.max_seq_len)[0]
        if len(bad):
            k = bad[0]
            raise StepError(
                f"{what}: request {ids[k]} supplies positions up to {ends[k] - 1}, at or beyond "
                f"max_seq_len={self.max_seq_len}"
            )

    def _prepare(self, request_ids, starts, num_rows, kv_score, *, what: str, graph: CacheGraph | None = None):
        """Validate a step completely, then reserve its pages; returns what ``run`` and ``_commit`` need.

        The checks are vectorised: one pass over the requests tells whether anything is wrong, and only then
        do the per-check passes run that name the first offending request (same messages, same order)."""
        cfg = self.config
        ids = self._int_array(request_ids, "request_ids")
        starts = self._int_array(starts, "starts")
        counts = self._int_array(num_rows, "num_rows")
        layout = self._layout(ids, starts, counts, what)
        # The request table: a request not live has length -1 and retained 0 (release and __init__ keep it so).
        length = self._length[ids]
        retained = self._retained[ids]
        needed = self.backend.needs_from(starts)
        ends = starts + counts
        # A live request starts in [max(0, L - mtp_step), L], one not live (L = -1) at 0; then the state must
        # hold what the start needs and the rows must stay below max_seq_len. Decode steps (every request live)
        # pass the first test: 0 <= L - start <= mtp_step (as unsigned) and start >= 0.
        first = int(starts.min()) if len(ids) else 0
        if len(ids):
            window = (length - starts).view(np.uint64) <= self.mtp_step
            if not (window.all() and first >= 0):
                window = (starts >= np.maximum(length - self.mtp_step, 0)) & (starts <= np.maximum(length, 0))
            if not (window.all() and (needed >= retained).all() and ends.max() <= self.max_seq_len):
                self._check_starts(ids, starts, length, retained, needed, ends, what)
        total = layout.total
        self._check_rows(kv_score, total, what)
        decode = layout.decode
        if graph is not None:
            graph.check_fits(ids, counts, decode, what)
        else:
            self.backend.check_capacity(total, len(ids))
        if self.check_finite and total and not bool(torch.isfinite(kv_score).all()):
            bad_row = int((~torch.isfinite(kv_score)).any(dim=1).nonzero()[0, 0])
            owner = int(ids[np.searchsorted(np.cumsum(counts), bad_row, side="right")])
            raise StepError(f"{what}: kv_score row {bad_row} (request {owner}) holds non-finite values")
        # Host metadata of the rows [positions, row_req, out_slot], written once where the kernels' copy comes
        # from (pinned memory for a CUDA device), then the pages (the last thing that can refuse the step).
        upload = graph is None and self.backend_name != "reference"
        pinned = None
        if upload and self.device.type == "cuda":
            pinned = torch.empty((3, total), dtype=torch.int64, pin_memory=True)
            meta = pinned.numpy()
        else:
            meta = np.empty((3, total), dtype=np.int64)
        meta[1:] = layout.tail  # row_req, and out_slot -1
        positions = meta[0]
        np.take(starts, layout.owner, out=positions)
        positions += layout.base
        r = cfg.ratio
        closing = np.flatnonzero((positions & (r - 1) if r & (r - 1) == 0 else positions % r) == r - 1)
        given = self.pool.reserve(ids, ends // r, what)
        if len(closing):
            meta[2, closing] = self.pool.out_slots(meta[1, closing], positions[closing] // r)
        step = StepInput(ids, starts, counts, layout.row0, kv_score, meta, decode)
        if upload:
            dev_meta = torch.from_numpy(meta) if pinned is None else pinned.to(self.device, non_blocking=True)
            step.positions, step.row_req, step.out_slot = dev_meta.unbind(0)
        new_retained = retained if first > 0 else np.where(starts == 0, 0, retained)  # start 0 forgets
        return _Prepared(step, given, ends, self.backend.retained_from(ends, new_retained))

    def _check_rows(self, kv_score, total: int, what: str) -> None:
        cfg = self.config
        if not isinstance(kv_score, torch.Tensor):
            raise StepError(f"{what}: kv_score must be a torch.Tensor, got {type(kv_score).__name__}")
        if kv_score.dtype != torch.float32:
            raise StepError(f"{what}: kv_score must be float32, got {kv_score.dtype}")
        if kv_score.device != self.device:
            raise StepError(f"{what}: kv_score is on {kv_score.device}, the cache on {self.device}")
        if kv_score.dim() != 2 or kv_score.shape[1] != cfg.row_width:
            raise StepError(
                f"{what}: kv_score must be [rows, {cfg.row_width}] (2W for {cfg.name}), got {list(kv_score.shape)}"
            )
        if kv_score.shape[0] != total:
            raise StepError(f"{what}: sum(num_rows) = {total} but kv_score has {kv_score.shape[0]} rows")
        if not kv_score.is_contiguous():
            raise StepError(f"{what}: kv_score must be contiguous")
        if kv_score.requires_grad:
            raise StepError(
                f"{what}: kv_score requires grad; the cache keeps rows across steps and is not differentiable "
                f"(pass kv_score.detach())"
            )

    def _commit(self, prepared: _Prepared) -> None:
        ids = prepared.step.slots
        self._length[ids] = prepared.ends
        self._retained[ids] = prepared.retained


class CacheGraph:
    """A captured step of one cache: ``build_plan`` and the layer's compress op in a CUDA graph over static
    buffers for ``max_requests`` requests of up to ``rows_per_request`` rows.

    :meth:`step` takes the same arguments as :meth:`CompressedKVCache.step`, validates them on the host exactly
    as the cache does, refuses a step the graph cannot replay (more requests or rows than captured, or a prefill
    chunk in a decode graph) with a :class:`StepError`, fills the static buffers (one copy of the metadata, one
    of the rows; the rest is padding, which does nothing), replays, and keeps ``length`` / ``entries`` true.
    On a CPU device (the interpreter) it runs the same launch eagerly, so the logic is testable there.
    """

    def __init__(self, cache: CompressedKVCache, *, max_requests: int, rows_per_request: int):
        if cache.backend_name == "reference":
            raise ValueError("cache.graph needs a kernel backend ('triton' or 'online'); 'reference' is eager PyTorch")
        self.cache = cache
        self.max_requests = _check_int("max_requests", max_requests, 1, cache.max_requests)
        self.rows_per_request = _check_int("rows_per_request", rows_per_request, 1)
        self.rows = self.max_requests * self.rows_per_request
        self.decode = self.rows_per_request <= cache.mtp_step + 1
        backend, dev = cache.backend, cache.device
        backend.check_capacity(self.rows, self.max_requests)
        self.kv_score = torch.zeros(self.rows, cache.config.row_width, dtype=torch.float32, device=dev)
        self.meta = torch.zeros(3, self.rows, dtype=torch.int64, device=dev)
        self.meta[1] = -1  # padding rows
        self.plan = backend.plan_buffer(self.rows, self.max_requests)
        self._graph = None
        if dev.type == "cuda":
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self._launch()  # compiles the kernels outside the capture; all rows are padding: no writes
            torch.cuda.current_stream(dev).wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._launch()

    def _launch(self) -> None:
        positions, row_req, out_slot = self.meta
        self.cache.backend.launch(self.kv_score, positions, row_req, out_slot, self.plan, decode=self.decode)

    def check_fits(self, ids: np.ndarray, counts: np.ndarray, decode: bool, what: str) -> None:
        if len(ids) > self.max_requests:
            raise StepError(f"{what}: {len(ids)} requests, but the graph was captured for {self.max_requests}")
        if len(counts) and counts.max() > self.rows_per_request:
            k = int(np.argmax(counts))
            raise StepError(
                f"{what}: request {ids[k]} brings {counts[k]} rows, but the graph was captured for "
                f"{self.rows_per_request} per request"
                + (" (a decode graph replays only decode / verify steps)" if self.decode else "")
            )
        if self.decode and not decode:  # unreachable with the check above; kept as the rule it enforces
            raise StepError(f"{what}: a decode graph cannot replay a step with more than mtp_step + 1 rows")

    def step(self, request_ids, starts, num_rows, kv_score: torch.Tensor) -> None:
        cache = self.cache
        prepared = cache._prepare(request_ids, starts, num_rows, kv_score, what="graph step", graph=self)
        try:
            total = prepared.step.rows
            host = np.zeros((3, self.rows), dtype=np.int64)
            host[1] = -1
            host[:, :total] = prepared.step.host_meta
            self.meta.copy_(torch.from_numpy(host), non_blocking=False)
            self.kv_score[:total].copy_(kv_score)
            if self._graph is not None:
                self._graph.replay()
            else:
                self._launch()
        except BaseException:
            cache.pool.undo(prepared.given)
            raise
        cache._commit(prepared)
