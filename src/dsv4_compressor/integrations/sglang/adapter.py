"""The compressor path of one SGLang attention backend: :class:`SGLangCompressor`, and the per-layer layout
check of SGLang's pool."""

from __future__ import annotations

from typing import Any

import torch

from ... import ops
from ...errors import OpError
from .._pairing import HeldScore, compress_pair_of, pair_kv_score
from .metadata import (
    _VERIFY,
    C4_PAGE_TAIL,
    INDEX_PAGE_SIZE,
    MAX_DRAFT_TOKENS,
    PAD_REQ_INDEX,
    PROJECTIONS,
    SGLangCompressMetadata,
    _capturing,
    _is_overlap,
    _resolved,
    _ring_rows,
)
from .online import banks_view, pool_banks
from .projection import (
    _PAIRABLE_KEYS,
    _PARTNERS,
    PAIR_DONE,
    _x_key,
    kv_score_differs,
    projection_weight,
    projection_workspaces,
)
from .settings import (
    SGLangUnsupported,
)


# ---------------------------------------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------------------------------------
class SGLangCompressor:
    """The compressor path of one SGLang attention backend (``DeepseekV4AttnBackend``).

    Args:
        draft_tokens: ``E``, tokens per request in a target-verify step (``speculative_num_draft_tokens``);
            1 without speculation. Rejected drafts are overwritten by the next step, never rolled back, so rings
            must hold ``E - 1`` extra rows (checked) and the online banks are ``E`` deep.
        hca: ``"ring"`` (SGLang's C128 ring state, the library's ring kernels) or ``"online"`` (online-softmax
            banks: one launch per HCA layer and step, ``E * 3 * H`` floats per request instead of a ring).
        hca_kernel: ``"tiled"`` (the tiled kernel, with the persistent scratch) or ``"single"`` (one launch; slower
            when groups close: it spills the 128 x 512 window).
        unified_kv: C4 state by request ring (``req_pool_idx * ring + pos % ring``) instead of by SWA page, as
            SGLang does under unified KV; ``None`` reads ``token_to_kv_pool._unified_kv`` when it can.
        c4_ape: ``"hotfix"`` (SGLang's load-time reordering: the C4 APE's memory is ``[coff, r, H]``) or
            ``"checkpoint"`` (``[r, coff, H]``).
        indexer_pack: the indexer's FP8 pack (``"hadamard_f32"``: SGLang's).
        scratch_rows: rows of the HCA scratch, allocated once (at the first step that needs it, or by
            :meth:`allocate_scratch`) with ``max(scratch_rows, that step's rows)`` and never replaced: a step that
            needs more raises :class:`OpError` (a captured CUDA graph keeps the buffer's address). Size it to the
            largest step; :func:`install` does, from SGLang's server arguments (:func:`scratch_rows_for`).
        pad_req_index: the request slot of padding rows (SGLang: 0); ``None`` keeps every row.
        index_page_size: the indexer's page when the pool has no ``get_index_k_page_size`` (SGLang 0.5.23: 64).
        projection: ``"auto"`` (:meth:`forward_unified` runs ``ops.compress_from_hidden`` /
            ``ops.compress_online_hca_from_hidden``, our Triton projection then the compression, on steps of at
            most ``ops.projection_triton_rows(2W, D)`` rows, where it measured faster than cuBLAS, and SGLang's
            ``compressor.compute_kv_score`` then ``ops.compress`` on the others) or ``"engine"`` (SGLang's
            ``compute_kv_score`` always). Ours needs a workspace from :meth:`allocate_projection` (install()
            allocates it in the backend's constructor); without one that holds the step, SGLang's GEMM runs
            and :attr:`projection_fallbacks` counts why.
    """

    def __init__(
        self,
        *,
        draft_tokens: int = 1,
        hca: str = "ring",
        hca_kernel: str = "tiled",
        unified_kv: bool | None = None,
        c4_ape: str = "hotfix",
        indexer_pack: str = "hadamard_f32",
        scratch_rows: int = 0,
        pad_req_index: int | None = PAD_REQ_INDEX,
        index_page_size: int = INDEX_PAGE_SIZE,
        projection: str = "auto",
    ):
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise ValueError(f"draft_tokens must be an integer >= 1, got {draft_tokens!r}")
        if draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens={draft_tokens}: SGLang's rings hold at most {MAX_DRAFT_TOKENS} drafts")
        for name, value, allowed in (
            ("hca", hca, ("ring", "online")),
            ("hca_kernel", hca_kernel, ("tiled", "single")),
            ("c4_ape", c4_ape, ("hotfix", "checkpoint")),
            ("indexer_pack", indexer_pack, ops.INDEXER_PACKS),
            ("projection", projection, PROJECTIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        self.draft_tokens = draft_tokens
        self.mtp_step = draft_tokens - 1
        self.hca, self.hca_kernel, self.unified_kv = hca, hca_kernel, unified_kv
        self.c4_ape, self.indexer_pack, self.pad_req_index = c4_ape, indexer_pack, pad_req_index
        self.scratch_rows, self.index_page_size = scratch_rows, index_page_size
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._banks: dict[Any, torch.Tensor] = {}
        self.projection = projection
        #: stream group ("main": C4 main and C128 layers; "indexer") -> its projection workspace (float32)
        self._projection: dict[str, torch.Tensor] = {}
        #: (group, 2W, D) -> the most rows that group's workspace was sized for at that weight shape
        self._projection_rows: dict[tuple[str, int, int], int] = {}
        #: why a step that our projection would have served ran SGLang's GEMM (reason -> layer calls)
        self.projection_fallbacks: dict[str, int] = {}
        #: a C4 layer's pair (:meth:`paired_kv_score`): the columns its first compressor projected for the second
        #: (main compressor's id -> HeldScore), the last unpaired call per layer ((x key, kind)), and whether
        #: both compressors of a layer saw the same x on the same stream at a step size ((layer, rows) -> bool)
        self._pair_held: dict[int, HeldScore] = {}
        self._pair_seen: dict[int, tuple] = {}
        self._pairable: dict[tuple[int, int], bool] = {}
        #: C4 layers whose two weights the backend's constructor joined (join_c4_weights), or why it joined none
        self.joined_layers = 0
        self.join_refused: str | None = None
        #: (pool id, layer) -> why its compressed pages are not written (None: V4, written); read on the host
        self._layouts: dict[tuple[int, int], tuple[str | None, str | None]] = {}  # -> (layout, refusal)
        #: the compressor ratios of the backend's pool (the backend's constructor sets it; () for a draft model)
        self.compressor_ratios: tuple[int, ...] | None = None
        #: hca="online" under install(): the banks must be SGLang's C128 pool rows (never the adapter's own)
        self.require_pool_banks = False

    # -- metadata ---------------------------------------------------------------------------------------------
    def metadata(
        self,
        ratio: int,
        *,
        positions: torch.Tensor,
        req_pool_indices: torch.Tensor,
        out_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        full_to_swa_index_mapping: torch.Tensor | None,
        swa_page_size: int | None,
        ring: int,
        decode: bool,
        num_requests: int | None = None,
        unified_kv: bool = False,
        padding_marked: bool = False,
    ) -> SGLangCompressMetadata:
        """Build one step's metadata of ``ratio`` from SGLang's per-token tensors (device-only, capturable).

        Args:
            positions: int64 ``[T]``, ``forward_batch.positions`` (padding rows included).
            req_pool_indices: int64 ``[T]``, the request slot of each token (``req_pool_indices`` repeated per
                token); ``pad_req_index`` (0) marks padding.
            out_loc: int64 ``[T]``, ``core_metadata.c4_out_loc`` / ``c128_out_loc``.
            req_to_token: int32 ``[slots, max_context]``; ``full_to_swa_index_mapping``, ``swa_page_size``: the
                C4 state's SWA pages (unused for C128 and under ``unified_kv``).
            ring: the state ring (``token_to_kv_pool.get_ring_size(ratio)``).
            decode: a decode or target-verify step (every request brings at most ``draft_tokens`` rows).
            num_requests: the step's (padded) batch size, the plan's request capacity (default: ``T``).
            padding_marked: ``req_pool_indices`` already holds ``-1`` where it held ``pad_req_index``
            (``ops.rows_from_requests`` made it).
        """
        tokens = positions.shape[0]
        requests = max(1, tokens if num_requests is None else num_requests)
        token_map = _is_overlap(ratio) and not unified_kv
        need = _ring_rows(ratio, self.mtp_step)
        banked = self.hca == "online" and not _is_overlap(ratio)  # online HCA: banks, no ring (``ring`` unused)
        if ring < need and not banked:
            raise OpError(
                f"sglang: ring {ring} of ratio {ratio} cannot hold a window plus {self.mtp_step} rejected drafts "
                f"(needs >= {need}; draft_tokens={self.draft_tokens})"
            )
        if decode and not banked and ring < _ring_rows(ratio, self.mtp_step, decode=True):
            decode = False  # compress, then save after every window's reads (SGLang's E = 10 on its 16-row ring)
        row_req = req_pool_indices
        if self.pad_req_index is not None and not padding_marked:
            # one elementwise op rather than a host-side filter: padding is data, not shape, under graphs
            row_req = torch.where(req_pool_indices == self.pad_req_index, -1, req_pool_indices)
        plan = ops.empty_plan(tokens, requests, ratio, positions.device)
        num_slots = req_to_token.shape[0]
        meta = SGLangCompressMetadata(
            ratio=ratio, decode=bool(decode), addressing="token_map_ring" if token_map else "req_ring", ring=ring,
            num_tokens=tokens, num_slots=num_slots, plan=plan,
        )  # fmt: skip
        if not token_map:
            ops.build_plan(plan, positions, row_req, out_loc, ratio=ratio, num_slots=num_slots, mtp_step=self.mtp_step)
            return meta
        if full_to_swa_index_mapping is None or swa_page_size is None:
            raise OpError("sglang: C4 state by SWA page needs full_to_swa_index_mapping and swa_page_size")
        window = 2 * ratio
        meta.read_rows = torch.empty(requests, window - 1, dtype=torch.int32, device=positions.device)
        meta.save_rows = torch.empty(tokens, dtype=torch.int32, device=positions.device)
        # the plan and its state-row tables in one build (one launch on decode-sized steps)
        ops.build_plans(
            [plan], positions, row_req, [out_loc], ratios=[ratio], num_slots=num_slots, mtp_step=self.mtp_step,
            read_rows=meta.read_rows, save_rows=meta.save_rows, state_mode="token_map_ring", ring=ring,
            req_to_token=req_to_token, token_to_state=full_to_swa_index_mapping, state_page=swa_page_size,
            page_tail=C4_PAGE_TAIL,
        )  # fmt: skip
        return meta

    def create_paged_compressor_data(
        self,
        compress_ratio: int,
        *,
        is_prefill: bool,
        token_to_kv_pool,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_lens: torch.Tensor | None = None,
        seq_lens_cpu=None,
        extend_lens_cpu=None,
        use_prefill_cuda_graph: bool = False,
        num_q_tokens: int | None = None,
        out_loc: torch.Tensor | None = None,
        **_ignored,
    ) -> SGLangCompressMetadata:
        """SGLang's ``create_paged_compressor_data`` (same signature), building :class:`SGLangCompressMetadata`.

        SGLang hands over per-request tensors; the per-token ones are derived on the device: decode rows are
        ``seq_lens - 1``; prefill / verify rows are packed request after request, request ``b`` supplying
        positions ``seq_lens[b] - extend_lens[b] ..`` (rows past ``sum(extend_lens)`` are padding), and the
        output slot is ``out_loc`` when given (SGLang's ``core_attn_metadata.c{r}_out_loc`` of the step, which
        :func:`install` hands over: it routes encoder-SWA bounded replay's folded rows to slot 0 on purpose),
        else ``req_to_token[req, pos] // r`` (= ``raw_out_loc // r``, what ``c{r}_out_loc`` holds on group
        ends). The token count comes from ``num_q_tokens`` (graphs) or ``extend_lens_cpu``: never from a device
        read.
        """
        ratio = int(compress_ratio)
        batch = req_pool_indices.shape[0]
        decode = not is_prefill or _VERIFY.get()
        if not is_prefill:
            tokens, extend = batch, None
        else:
            if extend_lens is None:
                raise OpError("sglang: a prefill plan needs extend_lens")
            if num_q_tokens is not None:
                tokens = int(num_q_tokens)
            elif extend_lens_cpu is not None:
                tokens = int(sum(int(n) for n in extend_lens_cpu))
            else:
                raise OpError("sglang: a prefill plan needs num_q_tokens or extend_lens_cpu (the token count)")
            extend = extend_lens
        # one launch for the per-row tensors (torch's ops took about a dozen per plan in a verify step's graph)
        positions, row_req = ops.rows_from_requests(req_pool_indices, seq_lens, extend, tokens,
                                                    pad_request=self.pad_req_index)  # fmt: skip
        if out_loc is not None and out_loc.shape[0] >= tokens:
            out_loc = out_loc[:tokens].to(torch.int64)  # SGLang's own, read (its padding rows past T ignored)
        else:
            max_context = req_to_token.shape[1]
            full_loc = req_to_token[row_req.clamp(min=0), positions.clamp(0, max_context - 1)]
            out_loc = torch.where(row_req >= 0, full_loc.to(torch.int64) // ratio, 0)
        unified = self._unified(token_to_kv_pool)
        requests = batch
        if is_prefill and use_prefill_cuda_graph and not _VERIFY.get():
            # a breakable prefill graph replays one token bucket for any batch size, and copy_ needs one shape:
            # size the plan by T (no more requests than tokens or request slots) instead of by the batch
            requests = max(batch, min(tokens, req_to_token.shape[0]))
        return self.metadata(
            ratio, positions=positions, req_pool_indices=row_req, out_loc=out_loc, padding_marked=True,
            req_to_token=req_to_token, full_to_swa_index_mapping=_detach(token_to_kv_pool.full_to_swa_index_mapping),
            swa_page_size=token_to_kv_pool.swa_page_size,
            ring=int(token_to_kv_pool.get_ring_size(compress_ratio=ratio)), decode=decode, num_requests=requests,
            unified_kv=unified,
        )  # fmt: skip

    def _unified(self, pool) -> bool:
        if self.unified_kv is not None:
            return self.unified_kv
        return bool(getattr(pool, "_unified_kv", False))

    # -- the per-layer call -------------------------------------------------------------------------------------
    def forward_compress(
        self,
        kv_score: torch.Tensor,
        metadata: SGLangCompressMetadata,
        compressor,
        *,
        state: torch.Tensor,
        out_pages: torch.Tensor,
        page_size: int,
        layer_id: Any = None,
        banks: int | None = None,
        layout: str = "v4",
    ) -> None:
        """``_forward_compress_all_in_one``: compress one layer's step into SGLang's buffers.

        Args:
            kv_score: float32 ``[>= T, 2W]`` from ``compressor.compute_kv_score`` (rows past the plan's ``T`` are
                padding and ignored).
            metadata: the step's :class:`SGLangCompressMetadata` of ``compressor.ratio``.
            compressor: SGLang's ``Compressor`` (``ratio``, ``head_dim``, ``is_in_indexer``, ``ape``, ``norm``,
                ``freqs_cis``).
            state: ``kv_score_buffer.kv_score``, float32 ``[size, 2 * coff * H]`` (raw score rows). With
                ``hca="online"`` an HCA layer keeps its state in the adapter's banks instead (key ``layer_id``).
            out_pages: ``get_extra_key_buffer(l)`` or ``get_index_k_with_scale_buffer(l)`` (any dtype; read as
                uint8).
            page_size: ``get_extra_key_page_size(l)`` (C4 64, C128 2) or the indexer's page (64).
            banks: with ``hca="online"``, the bank count ``B`` of an HCA layer's pool that holds online banks
                (:func:`.online.pool_banks`): ``state`` is then read as the banks ``[slots, B, 3, H]``
                (:func:`.online.banks_view`); ``None`` (direct use on a pool without banks) keeps them in the
                adapter (key ``layer_id``), which :func:`install`'s backends refuse.
            layout: the latent pages' record layout (:func:`layer_layout` of the layer: ``"v4"``, ``"v41"``,
                ``"v41_new"``, ``"uniform_fp8"``); the indexer's pages are V4's.
        """
        name, args, kwargs = self._layer_call(
            metadata, compressor, "kv_score", kv_score.shape[0], kv_score.device, state=state, out_pages=out_pages,
            page_size=page_size, layer_id=layer_id, banks=banks, layout=layout,
        )  # fmt: skip
        # the plan addresses rows by index: padding rows past T would shift nothing
        getattr(ops, name)(kv_score[: metadata.num_tokens], *args, **kwargs)

    def forward_compress_from_hidden(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        workspace: torch.Tensor,
        metadata: SGLangCompressMetadata,
        compressor,
        *,
        state: torch.Tensor,
        out_pages: torch.Tensor,
        page_size: int,
        layer_id: Any = None,
        banks: int | None = None,
        layout: str = "v4",
    ) -> None:
        """:meth:`forward_compress` from the layer's hidden states: ``ops.compress_from_hidden`` (or
        ``ops.compress_online_hca_from_hidden``) projects ``x`` (bf16 ``[>= T, D]``) with ``weight``
        (``compressor.wkv_gate.weight``, bf16 ``[2W, D]`` row-major) into ``workspace`` (from
        :meth:`allocate_projection`) with our Triton kernel, then compresses exactly as :meth:`forward_compress`
        does (the same arguments and buffers)."""
        name, args, kwargs = self._layer_call(
            metadata, compressor, "x", x.shape[0], workspace.device, state=state, out_pages=out_pages,
            page_size=page_size, layer_id=layer_id, banks=banks, layout=layout,
        )  # fmt: skip
        # "triton", not "auto": the caller chose our kernel for this step (forward_unified: from the same
        # ops.projection_triton_rows the op's "auto" reads) and sized the workspace for it
        getattr(ops, name + "_from_hidden")(x, weight, workspace, *args, projection="triton", **kwargs)

    def _layer_call(self, metadata, compressor, what: str, rows: int, device, *, state, out_pages, page_size,
                    layer_id, banks=None, layout="v4") -> tuple[str, tuple, dict]:  # fmt: skip
        """The op (``"compress"`` or ``"compress_online_hca"``) and its arguments after ``kv_score``, for one
        layer's step: what :meth:`forward_compress` and :meth:`forward_compress_from_hidden` share."""
        ratio, head = int(compressor.ratio), int(compressor.head_dim)
        if metadata.ratio != ratio:
            raise OpError(f"sglang: metadata of ratio {metadata.ratio} given to a ratio-{ratio} compressor")
        tokens = metadata.num_tokens
        if rows < tokens:
            raise OpError(f"sglang: {what} has {rows} rows, the step's plan {tokens}")
        indexer = bool(compressor.is_in_indexer)
        kind = "indexer" if indexer else ("csa" if _is_overlap(ratio) else "hca")
        ape = self._ape(compressor, ratio, head)
        rope = torch.view_as_real(compressor.freqs_cis)  # [positions, R/2, 2]: cos and sin interleaved
        cos, sin = rope[..., 0], rope[..., 1]
        norm = compressor.norm
        pages = out_pages if out_pages.dtype == torch.uint8 else out_pages.view(torch.uint8)
        eps = float(norm.variance_epsilon)
        if kind == "hca" and self.hca == "online":
            if banks is not None:  # SGLang's C128 pool rows, read as the banks (install(hca="online"))
                state_banks = banks_view(state, banks, head)
            elif self.require_pool_banks:
                raise SGLangUnsupported(f"dsv4_compressor.sglang: layer {layer_id}'s C128 state pool holds no "
                                        "online banks (built before install(hca='online')?)")  # fmt: skip
            else:
                state_banks = self._online_banks(layer_id, metadata.num_slots, head, device)
            # prefill steps split through the tiled scratch (allocated and counted with hca_kernel="tiled")
            tiled = self.hca_kernel == "tiled" and not metadata.decode
            scratch = self._scratch_for(tokens, head, device) if tiled else None
            args = (metadata.plan, ape, norm.weight, cos, sin, state_banks, pages)
            return "compress_online_hca", args, dict(page_size=page_size, eps=eps, decode=metadata.decode,
                                                     scratch=scratch, layout=layout)  # fmt: skip
        need = _ring_rows(ratio, self.mtp_step, decode=metadata.decode)
        if metadata.ring < need:  # the metadata may come from a builder that did not know this backend's E
            raise OpError(f"sglang: ring {metadata.ring} of ratio {ratio} is too small for draft_tokens="
                          f"{self.draft_tokens} (needs >= {need})")  # fmt: skip
        if metadata.addressing == "token_map_ring":
            tables = dict(read_rows=metadata.read_rows, save_rows=metadata.save_rows)
        else:
            if state.dim() == 2 and state.shape[0] < metadata.num_slots * metadata.ring:
                raise OpError(
                    f"sglang: the state pool has {state.shape[0]} rows; {metadata.num_slots} request slots x ring "
                    f"{metadata.ring} need {metadata.num_slots * metadata.ring}"
                )
            tables = dict(ring=metadata.ring)
        scratch = None
        if kind == "hca" and self.hca_kernel == "tiled":
            scratch = self._scratch_for(tokens, head, device)
        args = (metadata.plan, ape, norm.weight, cos, sin, state, pages)
        kwargs = dict(kind=kind, page_size=page_size, eps=eps, decode=metadata.decode, scratch=scratch,
                      state_has_ape=False, indexer_pack=self.indexer_pack, **tables)  # fmt: skip
        if not indexer:
            kwargs["layout"] = layout
        return "compress", args, kwargs

    def forward_unified(self, backend, x: torch.Tensor, forward_batch, layer_id: int, compressor) -> None:
        """``CompressorBackendMixin.forward_unified``: SGLang's buffers looked up as SGLang does, then our
        projection and compression (:meth:`forward_compress_from_hidden`) where :meth:`projection_for` admits the
        step, else SGLang's ``compressor.compute_kv_score`` and :meth:`forward_compress`."""
        if forward_batch.forward_mode.is_idle():
            return
        pool = backend.token_to_kv_pool
        _refuse_unsupported(backend, pool, compressor, layer_id)
        metadata = getattr(backend.forward_metadata, f"c{int(compressor.ratio)}_compress_metadata", None)
        if not isinstance(metadata, SGLangCompressMetadata):
            raise RuntimeError(
                f"dsv4_compressor.sglang: c{compressor.ratio}_compress_metadata is {type(metadata).__name__}, not "
                "the adapter's metadata: install() replaces create_paged_compressor_data too (was it bypassed?)"
            )
        buffers = self._buffers(backend, pool, compressor, layer_id)

        def compress_both(mine, other, partner) -> bool:  # a decode step: the layer's two compressors in one launch
            if not metadata.decode:
                return False
            _refuse_unsupported(backend, pool, partner, layer_id)
            ours = {compressor: (mine, buffers), partner: (other, self._buffers(backend, pool, partner, layer_id))}
            self.forward_compress_pair(metadata, ours)
            return True

        kv_score = self.paired_kv_score(x, forward_batch, compressor, metadata.num_tokens, compress_both)
        if kv_score is PAIR_DONE:
            return
        if kv_score is not None:
            self.forward_compress(kv_score, metadata, compressor, **buffers)
            return
        ours = self.projection_for(x, forward_batch, compressor, metadata.num_tokens)
        if ours is not None:
            self.forward_compress_from_hidden(x, *ours, metadata, compressor, **buffers)
            return
        kv_score = compressor.compute_kv_score(x, forward_batch)
        self.forward_compress(kv_score, metadata, compressor, **buffers)

    def check_layouts(self, pool) -> list[str]:
        """Read every compressor layer's page layout from SGLang's ``pool`` on the host (:func:`layer_layout`:
        each layer is then written in its own layout) and keep them; returns the refused layers' reasons. The backend's
        constructor calls it (under :func:`install`); a layer not checked then is checked at its first call."""
        out = []
        for layer_id, item in enumerate(getattr(pool, "layer_mapping", None) or ()):
            if item is None or int(item[0]) < 4:  # ratio 0 (MTP), 1 / 2 (V4.1's latents): no compressor
                continue
            reason = self._read_layout(pool, layer_id)
            if reason is not None:
                out.append(reason)
        return out

    def _buffers(self, backend, pool, compressor, layer_id) -> dict:
        """A compressor's state and output buffers, looked up as SGLang looks them up."""
        state_pool = compressor.get_state_pool(backend)
        state = state_pool.kv_score_buffer.kv_score
        banks = pool_banks(state_pool) if self.hca == "online" and not _is_overlap(int(compressor.ratio)) else None
        if compressor.is_in_indexer:
            out = pool.get_index_k_with_scale_buffer(layer_id)
            page_size = _index_page_size(pool, compressor, self.index_page_size)
        else:
            key = (id(pool), layer_id)
            if key not in self._layouts:  # a backend built before install(): read the layout now, once
                self._read_layout(pool, layer_id)
            layout, reason = self._layouts[key]
            if reason is not None:
                raise SGLangUnsupported("dsv4_compressor.sglang: refused: " + reason)
            out = pool.get_extra_key_buffer(layer_id)
            page_size = int(pool.get_extra_key_page_size(layer_id))
            return dict(state=state, out_pages=out, page_size=page_size, layer_id=layer_id, banks=banks,
                        layout=layout)  # fmt: skip
        return dict(state=state, out_pages=out, page_size=page_size, layer_id=layer_id, banks=banks)

    def _read_layout(self, pool, layer_id) -> str | None:
        """Read layer ``layer_id``'s page layout (:func:`layer_layout`) and keep ``(layout, refusal)``; returns
        the refusal."""
        try:
            self._layouts[(id(pool), layer_id)] = (layer_layout(pool, layer_id), None)
        except SGLangUnsupported as e:
            self._layouts[(id(pool), layer_id)] = (None, str(e))
        return self._layouts[(id(pool), layer_id)][1]

    def forward_compress_pair(self, metadata: SGLangCompressMetadata, pair: dict) -> None:
        """A C4 layer's two compressors (``pair``: compressor -> (its ``kv_score`` columns, its buffers from
        :meth:`_buffers`)) compressed as :meth:`forward_compress` compresses each, in one ``ops.compress_pair``
        (one launch on a decode step)."""
        calls = {}
        for compressor, (kv, buffers) in pair.items():
            name, args, kwargs = self._layer_call(metadata, compressor, "kv_score", kv.shape[0], kv.device,
                                                  **buffers)  # fmt: skip
            if name != "compress":
                raise OpError(f"sglang: a C4 pair takes ring compressors, not {name}")
            calls[kwargs["kind"]] = ((kv[: metadata.num_tokens], *args), kwargs)
        compress_pair_of(calls["csa"], calls["indexer"])

    # -- parameters as SGLang holds them --------------------------------------------------------------------------
    def _ape(self, compressor, ratio: int, head: int) -> torch.Tensor:
        ape = compressor.ape
        if not _is_overlap(ratio):
            return ape.view(ratio, 1, head)
        if self.c4_ape == "hotfix":
            # the hotfix stores the previous-group half's r rows first, then the current half's: [coff, r, H]
            return ape.view(2, ratio, head).permute(1, 0, 2)
        return ape.view(ratio, 2, head)

    # -- the projection -----------------------------------------------------------------------------------------
    def paired_kv_score(self, x: torch.Tensor, forward_batch, compressor, rows: int, compress_both=None):
        """A C4 layer's ``kv_score`` for ``compressor`` from one GEMM of both its compressors' weights, or ``None``
        (each projects on its own: :meth:`projection_for` or SGLang's GEMM), or :data:`PAIR_DONE` (this
        compressor's entries and state are written).

        ``compress_both(mine, other, partner)``: called by the layer's first compressor with both column ranges;
        where it compresses both (a decode step: one ``ops.compress_pair``) and returns ``True``, the first call
        and then the second (same ``x``, stream and forward) are :data:`PAIR_DONE`. A second call that finds
        another ``x`` or stream waits for the stream the pair ran on, then projects and compresses on its own
        (a decode step's windows read no row the step saves, so it rewrites the same state and its own entries).

        Where :func:`join_c4_weights` made the layer's two ``wkv_gate`` weights one tensor's halves, the layer's
        first compressor to run (SGLang calls the indexer's first) projects both with ``ops.project``: on steps
        of up to ``ops.joint_pair_triton_rows`` rows our one launch on the halves into the ``"pair"`` workspace
        (:meth:`allocate_projection`; V4-Flash at 64 rows: faster than cuBLAS beside the attention's own GEMM,
        docs/DESIGN.md), above that one cuBLAS GEMM of the joint weight, on the H200 faster than the two apart at
        every step size measured (V4-Flash: 12.8 us at 256 rows against 11.7 + 7.63 for ours apart;
        docs/PERF.md), its output, float32 ``[T, 2W_main + 2W_indexer]``, allocated as SGLang's own GEMM
        allocates its ``kv_score``. The first compressor holds the other's columns, and the second takes them if
        its ``x`` is the same tensor, unchanged, on the same stream, in the same forward. SGLang's multi-stream
        prepare runs the two on different streams (captured decode steps of up to 64 rows on Hopper): a layer
        pairs at a step size only once both compressors were seen with the same ``x`` on one stream at that size
        (learned from the calls themselves, host values only; SGLang's warm-up runs before each capture teach
        it), so a step whose second compressor would not take the columns does not pay for them."""
        try:
            partner = _PARTNERS.get(compressor)
        except TypeError:  # not weak-referenceable: never joined
            partner = None
        if self.projection != "auto" or partner is None or rows <= 0 or x.dim() != 2:
            return None
        indexer = bool(compressor.is_in_indexer)
        main_c, index_c = (partner, compressor) if indexer else (compressor, partner)
        layer, kind = id(main_c), ("indexer" if indexer else "main")
        key = _x_key(x, forward_batch, layer)
        held = self._pair_held.pop(layer, None)
        if held is not None and held.kind == kind:  # the layer's first compressor projected for this one
            self._pair_seen.pop(layer, None)
            if held.key == key:
                return PAIR_DONE if held.compressed is not None else held.kv_score
            self._pairable[(layer, rows)] = False
            if held.compressed is not None and held.compressed[0] is not None:
                # the pair wrote this compressor's entries on that stream: this call's own come after them
                torch.cuda.current_stream(x.device).wait_stream(held.compressed[0])
            return None
        seen = self._pair_seen.pop(layer, None)
        if seen is not None and seen[1] != kind:  # the second compressor of an unpaired layer: learn
            if len(self._pairable) >= _PAIRABLE_KEYS:  # prefill sizes vary: bounded, relearned when full
                self._pairable.clear()
            self._pairable[(layer, rows)] = seen[0] == key
            return None
        self._pair_seen[layer] = (key, kind)
        if not self._pairable.get((layer, rows)):
            return None
        dim = int(x.shape[1])
        weights = []
        for c in (main_c, index_c):
            width = 2 * int(c.head_dim) * 2
            weight, reason = projection_weight(c, width, dim)
            reason = reason or kv_score_differs(c, x, forward_batch)
            if reason is not None:
                self.projection_fallbacks[reason] = self.projection_fallbacks.get(reason, 0) + 1
                return None
            weights.append(weight)
        if ops.joint_pair_weight(*weights) is None:
            reason = "the C4 layer's two wkv_gate weights are no longer one tensor's halves"
            self.projection_fallbacks[reason] = self.projection_fallbacks.get(reason, 0) + 1
            return None
        first, width = weights[0].shape[0], weights[0].shape[0] + weights[1].shape[0]
        ws = self._projection.get("pair")
        if ws is not None and (ws.device != x.device or rows > self._projection_rows.get(("pair", width, dim), 0)):
            ws = None
        kv = pair_kv_score(x, weights[0], weights[1], rows, ws)  # joined weights: never None
        mine, other = (kv[:, first:], kv[:, :first]) if indexer else (kv[:, :first], kv[:, first:])
        if compress_both is not None and compress_both(mine, other, partner):
            stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
            self._pair_held[layer] = HeldScore(key, "main" if indexer else "indexer", other, compressed=(stream,))
            return PAIR_DONE
        self._pair_held[layer] = HeldScore(key, "main" if indexer else "indexer", other)
        return mine

    def projection_for(self, x: torch.Tensor, forward_batch, compressor, rows: int):
        """``(weight, workspace)`` when this layer's step of ``rows`` rows (the plan's ``T``) takes our projection
        (:meth:`forward_compress_from_hidden`), else ``None`` (SGLang's ``compute_kv_score``).

        Decided from host values only (shapes, dtypes, strides, SGLang's flags), never from device data, so a
        captured graph replays the path it recorded for its shape: ours when ``projection="auto"``, ``0 < rows <=
        ops.projection_triton_rows(2W, D)`` (where our kernel measured faster than cuBLAS; above it cuBLAS is,
        and SGLang's GEMM runs by choice), SGLang's ``compute_kv_score`` would compute the plain bf16 GEMM
        (:func:`projection_weight`, :func:`kv_score_differs`) and a workspace allocated beforehand holds the
        step. When one of the last two fails, SGLang's GEMM runs and :attr:`projection_fallbacks` counts why:
        nothing is allocated here (this may run under CUDA-graph capture)."""
        if self.projection != "auto" or rows <= 0 or x.dim() != 2:
            return None
        width = 2 * int(compressor.head_dim) * (2 if _is_overlap(int(compressor.ratio)) else 1)
        dim = int(x.shape[1])
        if rows > ops.projection_triton_rows(width, dim):
            return None
        weight, reason = projection_weight(compressor, width, dim)
        if reason is None:
            reason = kv_score_differs(compressor, x, forward_batch)
        ws = None
        if reason is None:
            group = "indexer" if compressor.is_in_indexer else "main"
            ws = self._projection.get(group)
            if ws is None or ws.device != x.device or rows > self._projection_rows.get((group, width, dim), 0):
                reason = "no projection workspace holds the step (allocate_projection() before the first step)"
        if reason is not None:
            self.projection_fallbacks[reason] = self.projection_fallbacks.get(reason, 0) + 1
            return None
        return weight, ws

    def allocate_projection(
        self,
        device,
        *,
        hidden_size: int,
        max_rows: int,
        head_dim: int = 512,
        index_head_dim: int = 128,
        ratios=(4, 128),
    ) -> dict[str, torch.Tensor]:
        """Allocate the projection workspaces now (``projection="auto"``; none with ``"engine"``): one per stream
        group, ``"main"`` (the C4 main and C128 compressors, which run one after another: on the current stream,
        or all on SGLang's ``alt_streams[1]`` in its multi-stream prepare) and ``"indexer"`` (the indexer's
        compressor, which SGLang's multi-stream prepare runs on ``alt_streams[2]`` concurrently with the main
        one), and ``"pair"`` (a C4 layer's two projections in one launch, on the one stream both then share),
        each for steps of up to ``min(ops.projection_triton_rows(2W, D), max_rows)`` rows at every width
        its compressors have (:func:`projection_workspaces`). ``max_rows``: the largest step SGLang can run
        (:func:`install`: :func:`scratch_rows_for`). SGLang's backend constructor calls this under
        :func:`install`, before any graph is captured. Allocated once and never replaced (captured graphs read
        it by address): a later call that needs more than is there raises :class:`OpError`."""
        if self.projection != "auto":
            return {}
        device = _resolved(device)
        sizes = projection_workspaces(hidden_size, max_rows, head_dim=head_dim, index_head_dim=index_head_dim,
                                      ratios=ratios)  # fmt: skip
        for group, (numel, rows) in sizes.items():
            ws = self._projection.get(group)
            if ws is None:
                if _capturing(device):
                    raise OpError("sglang: the projection workspaces must exist before CUDA-graph capture "
                                  "(allocate_projection())")  # fmt: skip
                # zeros: the split-K tile counters at its end must start at zero (every launch leaves them so)
                ws = self._projection[group] = torch.zeros(numel, dtype=torch.float32, device=device)
            elif ws.numel() < numel or ws.device != device:
                raise OpError(
                    f"sglang: the {group} projection workspace holds {ws.numel()} floats on {ws.device}; {numel} on "
                    f"{device} are asked for: it is never replaced, since captured graphs read it by address"
                )
            for width, n in rows.items():
                key = (group, width, int(hidden_size))
                self._projection_rows[key] = max(self._projection_rows.get(key, 0), n)
        return dict(self._projection)

    @property
    def projection_bytes(self) -> int:
        """Device bytes of the projection workspaces allocated so far."""
        return sum(t.numel() * t.element_size() for t in self._projection.values())

    # -- persistent buffers -------------------------------------------------------------------------------------
    def allocate_scratch(self, device, head: int = 512) -> torch.Tensor:
        """Allocate the HCA scratch now (``scratch_rows`` rows; SGLang's backend constructor calls this under
        :func:`install`, before any graph is captured)."""
        return self._scratch_for(max(1, self.scratch_rows), head, _resolved(device))

    def _scratch_for(self, rows: int, head: int, device: torch.device) -> torch.Tensor:
        """The HCA float32 scratch (the tiled kernel's; with ``hca="online"``, what prefill steps split
        through), shared by every HCA layer (they run one after another on one stream); replaces
        ``compress_forward``'s per-call ``[N, H]`` allocation. Allocated once, never replaced (graphs captured
        with it read it by address)."""
        key = (device, head)
        buf = self._scratch.get(key)
        if buf is None:
            if _capturing(device):
                raise OpError("sglang: the HCA scratch must exist before CUDA-graph capture (allocate_scratch())")
            buf = torch.empty(max(rows, self.scratch_rows, 1), head, dtype=torch.float32, device=device)
            self._scratch[key] = buf
        elif buf.shape[0] < rows:
            raise OpError(
                f"sglang: a step of {rows} tokens needs {rows} HCA scratch rows, the scratch holds {buf.shape[0]} "
                "(sized once from scratch_rows / the settings SGLang runs with: the rank's chunked_prefill_size, "
                "max_running_requests x draft tokens, the graphs' max_bs); it is never replaced, since captured "
                "graphs read it"
            )
        return buf

    def _online_banks(self, layer_id, slots: int, head: int, device: torch.device) -> torch.Tensor:
        """``[slots, E, 3, H]`` float32 online state of one HCA layer. Never read before written (a request
        starts at position 0 or, after a radix hit, on a 256-token page: both group boundaries); filled with NaN
        so that a read of a bank no step wrote shows up in the entries."""
        banks = self._banks.get(layer_id)
        shape = (slots, self.draft_tokens, 3, head)
        if banks is None or tuple(banks.shape) != shape or banks.device != device:
            if _capturing(device):
                raise OpError(f"sglang: online HCA banks of layer {layer_id} must exist before CUDA-graph capture")
            banks = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
            self._banks[layer_id] = banks
        return banks


def _detach(t):
    # SGLang's full_to_swa_index_mapping can be a proxy object (its own planner calls .detach() for tvm-ffi)
    return t.detach() if isinstance(t, torch.Tensor) else t


def _index_page_size(pool, compressor, default: int) -> int:
    # newer SGLang asks the pool; 0.5.23's indexer pages are 64 slots (a padded buffer width cannot tell)
    getter = getattr(pool, "get_index_k_page_size", None)
    return int(getter(compressor.ratio)) if getter is not None else default


def _refuse_unsupported(backend, pool, compressor, layer_id) -> None:
    """SGLang paths the adapter does not cover, refused loudly rather than written wrongly."""
    indexer = bool(compressor.is_in_indexer)
    if indexer and getattr(backend, "enable_deepseek_v4_fp4_indexer", False):
        raise SGLangUnsupported("dsv4_compressor.sglang: the FP4 indexer cache is not supported")
    mapping = getattr(pool, "layer_mapping", None)
    if mapping is not None and not indexer:
        compress_pool = mapping[layer_id][2]
        if hasattr(compress_pool, "translate_loc_to_hisparse_device"):
            raise SGLangUnsupported("dsv4_compressor.sglang: HiSparse compressed pools are not supported")


#: Bytes of one V4 compressed record (576 data: 448 FP8 + 64 bf16 rope; 8 scale bytes).
V4_RECORD_BYTES = 584
#: SGLang's ``KVLayout`` values of compressed pages the adapter writes -> the ops' ``layout=`` and the record's
#: bytes (``kv_layout.py``: V4 584, V41 / V41_NEW 528, UNIFORM_FP8 512: the trtllm backend's pool).
WRITTEN_LAYOUTS = {
    "v4": ("v4", V4_RECORD_BYTES),
    "v41": ("v41", 528),
    "v41_new": ("v41_new", 528),
    "uniform_fp8": ("uniform_fp8", 512),
}
#: Compressed-page layouts SGLang can select that the adapter does not write, with the reason.
REFUSED_LAYOUTS = {
    "v41_fp4": "V4.1 FP4 records (e2m1 with e4m3 scales, SGLANG_DSV4_COMPRESSED_KV_LAYOUT=fp4) are not written",
    "v41_fp4_new": "V4.1 FP4 records (e2m1 with e4m3 scales, SGLANG_DSV4_COMPRESSED_KV_LAYOUT=fp4) are not written",
}


def layer_layout(pool, layer_id: int) -> str:
    """The ops' ``layout=`` of layer ``layer_id``'s compressed pages in SGLang's ``pool``, read on the host
    (``get_extra_key_layout``, ``get_extra_key_page_size``, the page buffer's width): ``"v4"``, ``"v41"``,
    ``"v41_new"`` or, for the trtllm backend's pool (``pool.uniform_fp8``: ``DeepSeekV4UniformFP8KVPool``, whose
    ``get_extra_key_layout`` still says V4), ``"uniform_fp8"``. Raises :class:`SGLangUnsupported` with the layer
    and the reason for a layout the adapter does not write (V4.1 FP4 records) or pages too small for the
    layout's records. A pool without ``get_extra_key_layout`` (not SGLang's) is taken as V4.

    The uniform FP8 records are SGLang's bytes (``layout.py``); SGLang's trtllm store also writes the zeroed
    rows of decode requests that close no group (and of invalid prefill plan rows) into slot 0, its dummy slot,
    which no request reads: the adapter leaves slot 0 as it is (the pool's zeros)."""
    uniform = bool(getattr(pool, "uniform_fp8", False))
    getter = getattr(pool, "get_extra_key_layout", None)
    if getter is None and not uniform:
        return "v4"
    found = "uniform_fp8" if uniform else getter(layer_id)
    name = str(getattr(found, "value", found)).lower()
    page = int(pool.get_extra_key_page_size(layer_id))
    buf = pool.get_extra_key_buffer(layer_id)
    width = int(buf.shape[-1]) * buf.element_size() if buf.dim() >= 2 else 0
    if name not in WRITTEN_LAYOUTS:
        why = REFUSED_LAYOUTS.get(name, "a layout the adapter does not write")
        raise SGLangUnsupported(
            f"layer {layer_id}: the pool's compressed pages are {name} ({width}-byte pages of {page} records of "
            f"{getattr(found, 'bytes_per_token', '?')} bytes): {why}"
        )
    layout, record = WRITTEN_LAYOUTS[name]
    if width < page * record:
        raise SGLangUnsupported(
            f"layer {layer_id}: the pool's {width}-byte pages cannot hold {page} {name} records of {record} bytes"
        )
    return layout


def layer_layout_refusal(pool, layer_id: int) -> str | None:
    """Why the adapter must not write layer ``layer_id``'s compressed pages of SGLang's ``pool``
    (:func:`layer_layout`'s reason), or ``None`` where it writes them."""
    try:
        layer_layout(pool, layer_id)
    except SGLangUnsupported as e:
        return str(e)
    return None
