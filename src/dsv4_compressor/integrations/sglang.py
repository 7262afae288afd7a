"""SGLang adapter: DeepSeek-V4's compressors in SGLang (0.5.23) through :mod:`dsv4_compressor.ops`.

What SGLang does today (``srt/layers/attention/dsv4/compressor_v2.py``, see ../shared/ENGINES.md section 1.2):
once per step and ratio, ``create_paged_compressor_data`` runs a C++ planner whose result is stored as
``DSV4Metadata.c4_compress_metadata`` / ``c128_compress_metadata`` (built inside the decode / target-verify
CUDA graphs, refreshed with ``DSV4Metadata.copy_`` on replay); per layer and compressor,
``CompressorBackendMixin.forward_unified`` (aliased ``forward_core_compressor`` / ``forward_indexer_compressor``)
computes ``kv_score`` and calls ``_forward_compress_all_in_one``: ``compress_forward`` (ring reads, the write
plan, a fresh float32 ``[N, H]`` per call), then ``compress_norm_rope_store``.

This module replaces both with the library's ops, on SGLang's own buffers, with no copy:

==================================================  ================================================================
SGLang                                              here
==================================================  ================================================================
``create_paged_compressor_data(r, ...)``            :meth:`SGLangCompressor.metadata` (from per-token tensors) or
                                                    :meth:`SGLangCompressor.create_paged_compressor_data` (SGLang's
                                                    own signature): ``ops.build_plan``, for C4
                                                    ``ops.build_plans`` with the state rows; the result,
                                                    :class:`SGLangCompressMetadata`, has ``copy_`` for replay
``forward_batch.positions`` (int64)                 ``positions``
``req_pool_indices`` repeated per token (int64)     ``row_req``; SGLang's padding index 0 (``ReqToTokenPool``
                                                    reserves row 0 for CUDA-graph padding) becomes ``-1``: a no-op
``core_metadata.c4_out_loc`` / ``c128_out_loc``     ``out_slot`` (``raw_out_loc // r`` on group ends, 0 elsewhere:
                                                    the plan reads it only on group ends)
C128 state: ``rid * ring + pos % ring``,            ``req_ring`` in the kernel: ``ring=`` on the flat 2-D state
``ring = get_ring_size(128)`` (128; 256 with MTP)
C4 state: ``(swa_loc // swa_page_size) * ring +     the plan's state rows (``state_mode="token_map_ring",
swa_loc % ring`` (ring 8; 16 with MTP)              req_to_token, token_to_state=full_to_swa_index_mapping,
                                                    state_page=swa_page_size, ring, page_tail=4``);
                                                    ``unified_kv``: ``req_ring``
``compressor.compute_kv_score(x, fb)``              ``kv_score`` (float32 ``[T, 2W]``; never written); on steps
                                                    where our projection is faster, ``ops.compress_from_hidden``
                                                    projects ``x`` itself (see *The projection* below)
``CompressStatePool.kv_score_buffer.kv_score``      ``state`` (flat float32 ``[size, 2 * coff * H]``) with
                                                    ``state_has_ape=False``: SGLang's rows hold the raw score
``compressor.ape`` (C4: hotfixed memory)            C4 ``ape.view(2, 4, H).permute(1, 0, 2)``; C128
                                                    ``ape.view(128, 1, H)``
``compressor.norm.weight`` / ``variance_epsilon``   ``norm_weight`` (float32) / ``eps``
``compressor.freqs_cis`` (complex64)                ``cos`` / ``sin`` = ``view_as_real(freqs_cis)[..., 0 / 1]``
``get_extra_key_buffer(l)``, ``_page_size(l)``      ``out_pages`` (uint8), ``page_size`` (C4 64, C128 2)
``get_index_k_with_scale_buffer(l)``                indexer ``out_pages`` (``[pages, 8448]``, page 64),
                                                    ``indexer_pack="hadamard_f32"`` (SGLang packs the unrounded
                                                    float32 key), pack only
``compress_forward``'s per-call ``[N, H]``          a persistent HCA ``scratch`` (the tiled kernel)
online C128 pool + ``OnlineC128MTPController``      ``hca="online"``: ``ops.compress_online_hca`` with
                                                    ``[slots, E, 3, H]`` banks; no commit launch (direct
                                                    use only: install() refuses it, ``ONLINE_REFUSAL``)
==================================================  ================================================================

The main and the indexer C4 compressors share one metadata (one plan, one state-row table). Building the
metadata is device-only (no host synchronisation; grids depend on the step's padded token count and request
count only), so it can be recorded in SGLang's decode / target-verify graphs; the per-layer call allocates
nothing (after the first step has sized the scratch and the online banks).

**The projection.** SGLang's ``compute_kv_score`` is ``x @ wkv_gate.weight.T`` (bf16 in, float32 out:
``_compute_wkv_gate`` -> ``linear_bf16_fp32``, cuBLAS). With ``projection="auto"`` (the default of
:func:`install` and :class:`SGLangCompressor`), ``forward_unified`` runs ``ops.compress_from_hidden`` /
``ops.compress_online_hca_from_hidden`` (our Triton projection into a persistent workspace, then the same
compression, on the same buffers) on steps of at most ``ops.projection_triton_rows(2W, D)`` rows, where the
H200 bench measured our kernel faster than cuBLAS (decode steps of up to 64 rows for every V4 weight but the
V4-Pro indexer's, 256 for the V4-Flash indexer; 0 for any other shape), and SGLang's ``compute_kv_score`` then
``ops.compress`` on larger steps; ``projection="engine"`` (``DSV4C_SGLANG_PROJECTION=engine`` for the plugin)
keeps SGLang's GEMM always. The choice (:meth:`SGLangCompressor.projection_for`) reads host values only (the
plan's row count, shapes, dtypes, SGLang's flags), so a captured graph replays the path it recorded. Ours runs
only where SGLang's path is the plain bf16 GEMM of this step's rows (:func:`projection_weight`,
:func:`kv_score_differs`); SGLang's path is kept, and ``projection_fallbacks`` counts why, for a compressor class
that overrides ``compute_kv_score`` / ``_compute_wkv_gate``, aiter (its ``tgemm`` rounds ``kv_score`` to bf16),
a GGUF ``qweight``, a weight that is not bf16 ``[2W, D]`` row-major, prefill context parallelism (SGLang's
``dsa_use_prefill_cp``: ``kv_score`` gathered across the ranks), an ``x`` that is not bf16, and a step no
workspace holds (nothing is allocated in the forward). The workspaces: one per stream group and backend,
``"main"`` (C4 main and C128 layers, one after another on one stream) and ``"indexer"`` (SGLang's multi-stream
prepare runs the indexer's compressor on ``alt_streams[2]`` while the main one runs on ``alt_streams[1]``), in
every backend SGLang builds (two-batch overlap's children, PD multiplexing's groups and the draft backends each
have their own adapter); allocated once, in the backend's constructor (:meth:`allocate_projection`, for steps of
``min(projection_triton_rows, scratch_rows_for(server_args))`` rows at the model config's shapes), never
replaced (captured graphs read it by address) and counted in the KV sizing (:func:`projection_bytes_for`:
DeepSeek-V4-Flash 4.78 MiB per backend, V4-Pro 2.52 MiB). Launches: our projection's one launch in place of
SGLang's GEMM. A C4 layer's two compressors share one GEMM where :func:`join_c4_weights` (the backend's
constructor, not under SGLang's memory saver) made their weights one tensor's halves and both run on one stream
(:meth:`SGLangCompressor.paired_kv_score`), and then, on decode and verify steps, one ``ops.compress_pair`` launch.

Launches per layer and step: each C4 compressor (main, indexer) 1 in decode / verify steps (compress and state
save in one kernel; paired, 1 for both) and 2 in prefill steps (the save waits for every window's reads), against
SGLang's 2; C128 2 with the tiled ring kernels and 1 online, against SGLang's 2 (3 with its online C128 + MTP
commit). Per step and ratio the metadata costs a padding mask and one build (C4: the plan and its state-row tables
in one ``build_plans`` launch on decode-sized steps, else ``build_plan`` and ``build_state_rows``' launches); the
SGLang-signature path adds 10-20 small torch ops deriving the per-token tensors from the per-request ones.

Using it (SGLang importable): set ``DSV4C_SGLANG=ring`` (the ``sglang.srt.plugins`` entry point,
:func:`register`, installs it in every SGLang process), or call :func:`install` at the top level of the
script that launches the server.
SGLang runs its schedulers and model runners in processes started with multiprocessing's ``spawn``, which
import the launching script again (as ``__mp_main__``) but do not run its ``__main__`` block, so a call made
only there would patch the launcher process alone::

    import sys
    from dsv4_compressor.integrations import sglang as dsv4_sglang
    dsv4_sglang.install()                 # hca="online" is refused under SGLang (ONLINE_REFUSAL)
    # dsv4_sglang.install(projection="engine")   # SGLang's compute_kv_score on every step

    if __name__ == "__main__":
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.server_args import prepare_server_args
        launch_server(prepare_server_args(sys.argv[1:]))

:func:`install` patches ``CompressorBackendMixin.forward_unified`` and its two aliases, every module-level
reference to ``create_paged_compressor_data``, and wraps the backend's target-verify metadata builders so their
plans are built as decode plans (every request brings at most ``E`` rows). The HCA scratch (float32
``[rows, 512]``, rows from :func:`scratch_rows_for`: 16384 rows are 32 MiB) is allocated in each backend's
constructor, which SGLang runs after it has sized the KV pool; so :func:`install` also wraps
``KVCacheConfigurator._profile_available_bytes`` (``srt/mem_cache/kv_cache_configurator.py`` L2990-3060, the KV
budget SGLang turns into token counts) to subtract :func:`scratch_bytes_for`: one scratch for every backend the
server arguments make SGLang build (:func:`scratch_backends_for`: two-batch overlap, PD multiplexing, the draft
backends), counted where SGLang counts its KV cache instead of out of its headroom; the constructor also
allocates the projection workspaces, which the same wrapper subtracts (:func:`projection_bytes_for`).
:func:`hca_online_savings` gives
what ``hca="online"`` saves at a model's numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .. import ops
from ..errors import OpError
from ._pairing import HeldScore, compress_pair_of, joint_kv_score, tensor_key

__all__ = [
    "SGLangCompressMetadata",
    "SGLangCompressor",
    "SGLangNotInstalled",
    "SGLangModeNotSupported",
    "scratch_rows_for",
    "scratch_backends_for",
    "scratch_bytes_for",
    "projection_workspaces",
    "projection_bytes_for",
    "projection_weight",
    "kv_score_differs",
    "model_dims",
    "PROJECTIONS",
    "refusals_from_environment",
    "refusals_from_server_args",
    "MAX_DRAFT_TOKENS",
    "register",
    "install",
    "uninstall",
    "installed",
    "hca_online_savings",
    "MODULES",
]

#: The SGLang modules :func:`install` patches (paths relative to the ``sglang`` package as in ENGINES.md).
MODULES = {
    "compressor_v2": "sglang.srt.layers.attention.dsv4.compressor_v2",
    "deepseek_v4_backend": "sglang.srt.layers.attention.deepseek_v4_backend",
    "kv_cache_configurator": "sglang.srt.mem_cache.kv_cache_configurator",
}

#: SGLang's ``ReqToTokenPool`` keeps row 0 for CUDA-graph padding: padded requests have ``req_pool_indices``
#: 0 (and ``req_to_token[0] == 0``). The adapter turns those rows into plan padding, so they write nothing.
PAD_REQ_INDEX = 0

#: C4 state rows SGLang keeps at the end of each SWA page (what a radix prefix hit on the page boundary reads:
#: the previous group's 4 rows of the overlapping window).
C4_PAGE_TAIL = 4

#: The C4 indexer page of SGLang 0.5.23 (64 slots: ``[64 x 128 fp8][64 x 4 B scale]`` = 8,448 bytes), used when
#: the pool has no ``get_index_k_page_size``.
INDEX_PAGE_SIZE = 64


class SGLangNotInstalled(ImportError):
    """``install()`` was called but SGLang (with DeepSeek-V4 support) cannot be imported."""


def _is_overlap(ratio: int) -> bool:
    # SGLang's is_overlap_compress: only the ratio-4 compressors (CSA main and indexer) have overlapping windows.
    return ratio == 4


def _ring_rows(ratio: int, mtp_step: int, *, decode: bool = False) -> int:
    """Smallest ring per request slot (or per SWA page) that holds a window and ``mtp_step`` rejected drafts:
    ``window - 1 + mtp_step`` rows when the state is saved after every window's reads (two launches), one more
    when a decode step compresses and saves in one launch (``ops._ring_need``)."""
    window = 2 * ratio if _is_overlap(ratio) else ratio
    need = max(window, window - 1 + mtp_step + (1 if decode else 0))
    return need if _is_overlap(ratio) else -(-need // 4) * 4


#: SGLang's largest draft depth: its C4 ring (16 with speculation) keeps ``mtp_pad`` rows resident for up to
#: 10 draft tokens (``c_plan.cuh``). At E = 10 a verify step needs 17 rows to compress and save in one launch,
#: so the adapter plans it as a prefill step (save after the reads: 16 rows suffice).
MAX_DRAFT_TOKENS = 10

#: How :meth:`SGLangCompressor.forward_unified` projects ``x``: ``"auto"`` (our Triton projection fused before the
#: compression, ``ops.compress_from_hidden``, on steps of at most ``ops.projection_triton_rows(2W, D)`` rows, where
#: it measured faster than cuBLAS; SGLang's ``compute_kv_score`` elsewhere) or ``"engine"`` (SGLang's, always).
PROJECTIONS = ("auto", "engine")


# ---------------------------------------------------------------------------------------------------------------
# Per-step metadata
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SGLangCompressMetadata:
    """One step's metadata of one ratio, shared by every layer of that ratio (and by both C4 compressors):
    what ``DSV4Metadata.c4_compress_metadata`` / ``c128_compress_metadata`` hold once the adapter is in.

    ``plan`` (int32, from ``ops.empty_plan``), and for ``addressing == "token_map_ring"`` the state-row tables
    ``read_rows`` / ``save_rows`` (int32); ``num_tokens`` is the step's (padded) token count the plan was built
    for and ``num_slots`` the request slots (``req_to_token.shape[0]``).
    """

    ratio: int
    decode: bool
    addressing: str  # "req_ring" (the kernel computes slot * ring + pos % ring) or "token_map_ring" (tables)
    ring: int
    num_tokens: int
    num_slots: int
    plan: torch.Tensor
    read_rows: torch.Tensor | None = None
    save_rows: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        # SGLang code reads ``plan.is_decode`` on its compress metadata.
        return self.decode

    def copy_(self, other: SGLangCompressMetadata) -> None:
        """Refresh in place from ``other`` (``DSV4Metadata.copy_`` → ``maybe_copy_inplace``): what CUDA-graph
        replay does when the metadata was built outside the graph. Shapes are static per graph, so they must
        agree; only the tensors' contents change (the captured kernels read them by address)."""
        if type(other) is not type(self):
            raise TypeError(f"copy_: expected {type(self).__name__}, got {type(other).__name__}")
        static = ("ratio", "decode", "addressing", "ring", "num_tokens", "num_slots")
        mine, theirs = (tuple(getattr(m, f) for f in static) for m in (self, other))
        if mine != theirs:
            raise ValueError(f"copy_: metadata differ in {static}: {mine} vs {theirs} (a graph replays one shape)")
        for name in ("plan", "read_rows", "save_rows"):
            dst, src = getattr(self, name), getattr(other, name)
            if (dst is None) != (src is None) or dst is not None and dst.shape != src.shape:
                raise ValueError(f"copy_: {name} differs in shape")
            if dst is not None:
                ops.copy_plan(dst, src)  # with the build record compress checks its calls against


# A target-verify step brings at most E rows per request (E = draft tokens): SGLang plans it with its prefill
# planner, but our kernels can then compress and save in one launch (``decode=True``). ``install`` wraps the
# backend's verify metadata builders to set this while they run.
_VERIFY = contextvars.ContextVar("dsv4c_sglang_verify", default=False)


@contextlib.contextmanager
def verify_step():
    """Metadata built inside this block is for a target-verify step (``decode=True``)."""
    token = _VERIFY.set(True)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def _resolved(device) -> torch.device:
    """``device`` as a tensor on it reports it: ``torch.device("cuda")`` (what SGLang's backend holds) is not
    equal to the ``cuda:0`` of the step's tensors, so a buffer keyed or checked by it would be looked up anew."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
        """
        tokens = positions.shape[0]
        requests = max(1, tokens if num_requests is None else num_requests)
        token_map = _is_overlap(ratio) and not unified_kv
        need = _ring_rows(ratio, self.mtp_step)
        if ring < need:
            raise OpError(
                f"sglang: ring {ring} of ratio {ratio} cannot hold a window plus {self.mtp_step} rejected drafts "
                f"(needs >= {need}; draft_tokens={self.draft_tokens})"
            )
        if decode and ring < _ring_rows(ratio, self.mtp_step, decode=True):
            decode = False  # compress, then save after every window's reads (SGLang's E = 10 on its 16-row ring)
        row_req = req_pool_indices
        if self.pad_req_index is not None:
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
        device = req_pool_indices.device
        batch = req_pool_indices.shape[0]
        req = req_pool_indices.to(torch.int64)
        seq = seq_lens.to(torch.int64)
        decode = not is_prefill or _VERIFY.get()
        if not is_prefill:
            positions = seq - 1
            row_req = req
            tokens = batch
        else:
            if extend_lens is None:
                raise OpError("sglang: a prefill plan needs extend_lens")
            if num_q_tokens is not None:
                tokens = int(num_q_tokens)
            elif extend_lens_cpu is not None:
                tokens = int(sum(int(n) for n in extend_lens_cpu))
            else:
                raise OpError("sglang: a prefill plan needs num_q_tokens or extend_lens_cpu (the token count)")
            ext = extend_lens.to(torch.int64)
            ends = torch.cumsum(ext, 0)
            t = torch.arange(tokens, dtype=torch.int64, device=device)
            b = torch.searchsorted(ends, t, right=True)  # the request row t belongs to (batch: padding)
            valid = b < batch
            b = b.clamp(max=max(batch - 1, 0))
            if batch:
                positions = seq[b] - ends[b] + t  # = seq_lens[b] - extend_lens[b] + (t - first row of b)
                pad = self.pad_req_index if self.pad_req_index is not None else -1
                row_req = torch.where(valid, req[b], pad)
                positions = torch.where(valid, positions, 0)
            else:
                positions = torch.zeros(tokens, dtype=torch.int64, device=device)
                row_req = torch.full((tokens,), -1, dtype=torch.int64, device=device)
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
            ratio, positions=positions.contiguous(), req_pool_indices=row_req.contiguous(), out_loc=out_loc,
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
        """
        name, args, kwargs = self._layer_call(
            metadata, compressor, "kv_score", kv_score.shape[0], kv_score.device, state=state, out_pages=out_pages,
            page_size=page_size, layer_id=layer_id,
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
    ) -> None:
        """:meth:`forward_compress` from the layer's hidden states: ``ops.compress_from_hidden`` (or
        ``ops.compress_online_hca_from_hidden``) projects ``x`` (bf16 ``[>= T, D]``) with ``weight``
        (``compressor.wkv_gate.weight``, bf16 ``[2W, D]`` row-major) into ``workspace`` (from
        :meth:`allocate_projection`) with our Triton kernel, then compresses exactly as :meth:`forward_compress`
        does (the same arguments and buffers)."""
        name, args, kwargs = self._layer_call(
            metadata, compressor, "x", x.shape[0], workspace.device, state=state, out_pages=out_pages,
            page_size=page_size, layer_id=layer_id,
        )  # fmt: skip
        # "triton", not "auto": the caller chose our kernel for this step (forward_unified: from the same
        # ops.projection_triton_rows the op's "auto" reads) and sized the workspace for it
        getattr(ops, name + "_from_hidden")(x, weight, workspace, *args, projection="triton", **kwargs)

    def _layer_call(self, metadata, compressor, what: str, rows: int, device, *, state, out_pages, page_size,
                    layer_id) -> tuple[str, tuple, dict]:  # fmt: skip
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
            banks = self._online_banks(layer_id, metadata.num_slots, head, device)
            scratch = None if metadata.decode else self._scratch_for(tokens, head, device)  # prefill splits
            args = (metadata.plan, ape, norm.weight, cos, sin, banks, pages)
            return "compress_online_hca", args, dict(page_size=page_size, eps=eps, decode=metadata.decode,
                                                     scratch=scratch)  # fmt: skip
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

    def _buffers(self, backend, pool, compressor, layer_id) -> dict:
        """A compressor's state and output buffers, looked up as SGLang looks them up."""
        state = compressor.get_state_pool(backend).kv_score_buffer.kv_score
        if compressor.is_in_indexer:
            out = pool.get_index_k_with_scale_buffer(layer_id)
            page_size = _index_page_size(pool, compressor, self.index_page_size)
        else:
            out = pool.get_extra_key_buffer(layer_id)
            page_size = int(pool.get_extra_key_page_size(layer_id))
        return dict(state=state, out_pages=out, page_size=page_size, layer_id=layer_id)

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
        first compressor to run (SGLang calls the indexer's first) projects both with ``ops.project``: one cuBLAS
        GEMM of the joint weight, on the H200 faster than the two apart at every step size measured (V4-Flash:
        10.1 us at 64 rows against 8.88 + 5.61 for ours apart, 12.8 at 256 against 11.7 + 7.63; docs/PERF.md).
        Its output, float32 ``[T, 2W_main + 2W_indexer]``, is allocated as SGLang's own GEMM allocates its
        ``kv_score``; the first compressor holds the other's columns, and the second takes them if its ``x`` is
        the same tensor, unchanged, on the same stream, in the same forward. SGLang's multi-stream prepare runs
        the two on different streams (captured decode steps of up to 64 rows on Hopper): a layer pairs at a step
        size only once both compressors were seen with the same ``x`` on one stream at that size (learned from
        the calls themselves, host values only; SGLang's warm-up runs before each capture teach it), so a step
        whose second compressor would not take the columns does not pay for them."""
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
        first = weights[0].shape[0]
        kv = joint_kv_score(x, weights[0], weights[1], rows)
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
        one), each for steps of up to ``min(ops.projection_triton_rows(2W, D), max_rows)`` rows at every width
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
                "(sized once from scratch_rows / SGLang's limits: chunked_prefill_size, max_prefill_tokens, "
                "cuda_graph_max_bs x draft tokens); it is never replaced, since captured graphs read it"
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


class SGLangUnsupported(ValueError):
    """An SGLang configuration this adapter does not cover (refused rather than written wrongly)."""


def _refuse_unsupported(backend, pool, compressor, layer_id) -> None:
    """SGLang paths the adapter does not cover, refused loudly rather than written wrongly."""
    indexer = bool(compressor.is_in_indexer)
    if getattr(pool, "uniform_fp8", False) and not indexer:
        raise SGLangUnsupported("dsv4_compressor.sglang: the uniform-FP8 (trtllm) store is not supported")
    if indexer and getattr(backend, "enable_deepseek_v4_fp4_indexer", False):
        raise SGLangUnsupported("dsv4_compressor.sglang: the FP4 indexer cache is not supported")
    mapping = getattr(pool, "layer_mapping", None)
    if mapping is not None and not indexer:
        compress_pool = mapping[layer_id][2]
        if hasattr(compress_pool, "translate_loc_to_hisparse_device"):
            raise SGLangUnsupported("dsv4_compressor.sglang: HiSparse compressed pools are not supported")


# ---------------------------------------------------------------------------------------------------------------
# The projection: where ours computes what SGLang's compute_kv_score does
# ---------------------------------------------------------------------------------------------------------------
def _sglang_compressor_module(compressor) -> ModuleType | None:
    """The module of SGLang's ``Compressor`` class when ``compressor`` runs that class's own
    ``compute_kv_score`` and ``_compute_wkv_gate`` (the code this adapter was read against); else ``None``: a
    subclass or stand-in that computes ``kv_score`` some other way keeps it."""
    cls = next((c for c in type(compressor).__mro__ if c.__name__ == "Compressor"
                and "compute_kv_score" in c.__dict__ and "_compute_wkv_gate" in c.__dict__), None)  # fmt: skip
    if cls is None:
        return None
    for name in ("compute_kv_score", "_compute_wkv_gate"):
        if getattr(type(compressor), name) is not cls.__dict__[name]:
            return None
    return sys.modules.get(cls.__module__)


def _x_key(x: torch.Tensor, forward_batch, layer: int) -> tuple:
    return (layer, id(forward_batch), *tensor_key(x))


#: The most (layer, step size) pairing verdicts an adapter keeps (SGLang's prefill chunks come in many sizes).
_PAIRABLE_KEYS = 1 << 16
#: What :meth:`SGLangCompressor.paired_kv_score` returns where the compressor's work is done (its entries
#: and state written by the layer's ``ops.compress_pair``).
PAIR_DONE = object()
#: A joined C4 layer's compressors, each to the other (:func:`join_c4_weights`); weak: a model freed is forgotten.
_PARTNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def join_c4_weights(model) -> int:
    """Make each C4 layer's two ``wkv_gate`` weights (the attention's ``compressor`` and ``indexer.compressor``:
    bf16 ``[2W, D]`` row-major, what :func:`projection_weight` reads) the halves of one tensor
    (``ops.join_pair_weights``; the parameters keep their objects and loaders, their ``.data`` become views), so
    :meth:`SGLangCompressor.paired_kv_score` projects both in one GEMM; returns the number of layers joined.
    Memory-neutral: a layer's two old tensors are freed once its joint copy is made (on CUDA the cache is
    emptied after each layer, so at most one layer's weights are held twice: 20 MiB for V4-Flash, 35 for V4-Pro).
    Done once per model, when the first backend is built (after SGLang has loaded the weights and before any
    graph is captured; an in-place weight update later writes into the views); a second call only counts.
    Layers whose weights the op does not read (quantized, GGUF, another layout) are left as they are."""
    joined = 0
    first = not getattr(model, "_dsv4c_joined", False)
    for module in model.modules():
        main_c = getattr(module, "compressor", None)
        index_c = getattr(getattr(module, "indexer", None), "compressor", None)
        if main_c is None or index_c is None or int(getattr(main_c, "ratio", 0)) != 4:
            continue
        weights = [getattr(getattr(c, "wkv_gate", None), "weight", None) for c in (main_c, index_c)]
        if not all(isinstance(w, torch.Tensor) for w in weights):
            continue
        dim = int(weights[0].shape[-1])
        if any(projection_weight(c, int(w.shape[0]), dim)[1] is not None for c, w in zip((main_c, index_c), weights)):
            continue
        if ops.joint_pair_weight(*weights) is None:
            if not first or any(w.stride() != (dim, 1) for w in weights):
                continue
            with torch.no_grad():
                joint = ops.join_pair_weights(weights[0].data, weights[1].data)
                n1 = weights[0].shape[0]
                weights[0].data, weights[1].data = joint[:n1], joint[n1:]
            del joint
            if weights[0].is_cuda:
                torch.cuda.empty_cache()  # the two old tensors' blocks back before the next layer's copy
        _PARTNERS[main_c], _PARTNERS[index_c] = index_c, main_c
        joined += 1
    if first:
        model._dsv4c_joined = True
    return joined


def projection_weight(compressor, width: int, dim: int) -> tuple[torch.Tensor | None, str | None]:
    """``(compressor.wkv_gate.weight, None)`` where SGLang 0.5.23's ``Compressor._compute_wkv_gate`` is the plain
    ``linear_bf16_fp32(x, weight)`` our projection computes: a bf16 ``[2W, D]`` row-major weight (SGLang's
    ``torch.mm(x, w.t(), out_dtype=float32)`` or ``deep_gemm``'s bf16 x bf16 -> float32, the same product; its
    split-K "hpc" kernel takes a float32 weight only), no aiter. Else ``(None, reason)``, and SGLang's GEMM runs:
    aiter's ``tgemm`` (ROCm) rounds ``kv_score`` to bf16; a GGUF ``qweight`` (no ``weight``) goes through
    ``fused_mul_mat_gguf``; a weight of another dtype (quantized, float32) or layout is read SGLang's way."""
    module = _sglang_compressor_module(compressor)
    if module is None:
        return None, "the compressor's compute_kv_score is not SGLang's Compressor's: kept"
    if getattr(module, "_use_aiter", False):
        return None, "aiter's tgemm (ROCm) rounds kv_score to bf16"
    weight = getattr(getattr(compressor, "wkv_gate", None), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None, "wkv_gate has no weight tensor (GGUF qweight)"
    if weight.dtype != torch.bfloat16:
        return None, f"wkv_gate.weight is {weight.dtype}, not bf16 (quantized or float32)"
    if tuple(weight.shape) != (width, dim):
        return None, f"wkv_gate.weight is {list(weight.shape)}, not [2W, D] = [{width}, {dim}]"
    if dim > 1 and weight.stride(1) != 1:
        return None, "wkv_gate.weight is not row-major [2W, D]"
    return weight, None


def kv_score_differs(compressor, x: torch.Tensor, forward_batch) -> str | None:
    """Why SGLang's ``compute_kv_score(x, forward_batch)`` would not be ``x @ W.T`` of this step's rows, or
    ``None``: under prefill context parallelism (SGLang's own ``dsa_use_prefill_cp(forward_batch)``, a host
    check) it gathers ``kv_score`` across the ranks (``cp_materialize_global_token_order``); an ``x`` that is not
    bf16 with unit column stride goes through SGLang's float32 fallback or is not what our kernel reads."""
    module = _sglang_compressor_module(compressor)
    use_cp = getattr(module, "dsa_use_prefill_cp", None)
    if use_cp is None:
        return "SGLang's compressor module has no dsa_use_prefill_cp: prefill context parallelism unknown"
    if use_cp(forward_batch):
        return "prefill context parallel: SGLang gathers kv_score across the ranks"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, not bf16"
    if x.shape[1] > 1 and x.stride(1) != 1:
        return "x has no unit column stride"
    return None


def projection_workspaces(
    hidden_size: int, max_rows: int, *, head_dim: int = 512, index_head_dim: int = 128, ratios=(4, 128)
) -> dict[str, tuple[int, dict[int, int]]]:
    """``group -> (float32 elements, {2W: rows})`` of the projection workspaces one adapter allocates
    (:meth:`SGLangCompressor.allocate_projection`) for a model of ``hidden_size`` (``D``), compressor heads
    ``head_dim`` / ``index_head_dim`` and the layers' ``ratios`` (``compress_ratios``): group ``"main"`` holds
    the C4 main (``2W = 4 * head_dim``) and HCA (``2 * head_dim``) projections, ``"indexer"`` the indexer's
    (``4 * index_head_dim``), each for steps of ``min(ops.projection_triton_rows(2W, D), max_rows)`` rows; a
    width our kernel never serves (0 rows) needs nothing, a group without any is left out. DeepSeek-V4-Flash
    (D = 4096) at ``max_rows >= 256``: main 2.27 MiB (64 rows), indexer 2.52 MiB (256 rows); V4-Pro (7168):
    main 2.52 MiB, no indexer workspace (cuBLAS is as fast there)."""
    widths = {"main": [], "indexer": []}
    ratios = {int(r) for r in ratios}
    if 4 in ratios:
        widths["main"].append(4 * int(head_dim))
        widths["indexer"].append(4 * int(index_head_dim))
    if any(r > 4 for r in ratios):
        widths["main"].append(2 * int(head_dim))
    out = {}
    for group, sizes in widths.items():
        rows = {w: min(ops.projection_triton_rows(w, hidden_size), int(max_rows)) for w in sizes}
        rows = {w: n for w, n in rows.items() if n > 0}
        if rows:
            out[group] = (max(ops.projection_workspace_numel(n, w, hidden_size) for w, n in rows.items()), rows)
    return out


def model_dims(model_config) -> dict[str, Any] | None:
    """The projection's shapes from SGLang's ``ModelConfig`` (``hf_text_config``, else ``hf_config``):
    ``hidden_size``, ``head_dim`` (``qk_nope_head_dim + qk_rope_head_dim`` without one), ``index_head_dim``,
    ``ratios`` (``compress_ratios``; both kinds when absent); ``None`` without a hidden size (no workspace)."""
    cfg = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
        return None
    head = getattr(cfg, "head_dim", None)
    if not isinstance(head, int) or head <= 0:
        head = int(getattr(cfg, "qk_nope_head_dim", 448)) + int(getattr(cfg, "qk_rope_head_dim", 64))
    index = getattr(cfg, "index_head_dim", None)
    ratios = tuple(int(r) for r in (getattr(cfg, "compress_ratios", None) or ())) or (4, 128)
    return dict(hidden_size=hidden, head_dim=head, index_head_dim=int(index) if index else 128, ratios=ratios)


def projection_bytes_for(server_args, model_config, *, projection: str = "auto") -> int:
    """Bytes of projection workspaces the adapter allocates in one SGLang process under ``server_args`` for
    SGLang's ``model_config``: every backend of :func:`scratch_backends_for` gets :func:`projection_workspaces`
    for steps up to :func:`scratch_rows_for` rows (the largest step SGLang runs); 0 with ``projection="engine"``
    or without a hidden size. :func:`install` subtracts it, with :func:`scratch_bytes_for`, from the KV budget
    SGLang profiles. Every backend is counted at the target's config: a draft runner's backends allocate from
    its own model config, which for DeepSeek-V4's MTP draft is the same checkpoint's (``configs/model_config.py``
    only renames the architecture), so the same shapes."""
    if projection != "auto":
        return 0
    dims = model_dims(model_config)
    if dims is None:
        return 0
    draft = int(getattr(server_args, "speculative_num_draft_tokens", None) or 1)
    rows = scratch_rows_for(server_args, draft)
    per_backend = sum(numel for numel, _ in projection_workspaces(max_rows=rows, **dims).values())
    return scratch_backends_for(server_args) * per_backend * 4


# ---------------------------------------------------------------------------------------------------------------
# install()
# ---------------------------------------------------------------------------------------------------------------
_ADAPTER_ATTR = "_dsv4c_sglang_adapter"
_installed: dict[str, Any] | None = None

#: ``c{r}_out_loc`` of the step being built: the backend's builders make ``core_attn_metadata`` (with the out
#: locations, encoder-SWA bounded replay's rows routed to slot 0 included) before they call the planner, which has
#: no argument for it; ``install`` wraps ``make_core_attn_metadata`` to publish it here, scoped to each builder.
_CORE = contextvars.ContextVar("dsv4c_sglang_core", default=None)

#: Why ``hca="online"`` is refused under SGLang (issue 30): the banks would live outside SGLang's memory planner.
ONLINE_REFUSAL = (
    "dsv4_compressor.sglang: hca='online' is refused in SGLang 0.5.23: SGLang always allocates its C128 ring "
    "(DeepSeekV4 pool, deepseek_v4_memory_pool.py L1048-1052) and sizes the KV cache around it, so banks "
    "would come on top of it, outside its memory planner and memory saver; PD disaggregation and HiCache move "
    "CompressStatePool rows (deepseek_v4_compress_state.py L105-126), never the banks (a decode node would read "
    "unwritten banks); two-batch overlap runs three backends, so a request's banks would split across them. "
    "Use hca='ring' (the default)"
)


class SGLangModeNotSupported(RuntimeError):
    """An SGLang mode the adapter refuses, at install() or at the backend's / pool's construction (before
    any forward and any graph capture), with the mode and what to do."""


def installed() -> bool:
    return _installed is not None


def _import_sglang() -> dict[str, ModuleType]:
    mods = {}
    for key, path in MODULES.items():
        try:
            mods[key] = importlib.import_module(path)
        except ImportError as err:
            raise SGLangNotInstalled(
                f"dsv4_compressor.integrations.sglang.install(): cannot import {path} ({err}); install SGLang with "
                "DeepSeek-V4 support (sglang==0.5.23 was read for this adapter) in this environment"
            ) from err
    return mods


def _env(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def refusals_from_environment(*, hip: bool | None = None, sm100: bool | None = None) -> list[str]:
    """The SGLang modes :func:`install` refuses that the process environment already tells (SGLang reads the
    same variables): ``hip`` / ``sm100`` default to what torch sees."""
    if hip is None:
        hip = getattr(torch.version, "hip", None) is not None
    if sm100 is None:
        sm100 = bool(torch.cuda.is_available() and torch.version.cuda and torch.cuda.get_device_capability()[0] == 10)
    out = []
    if hip:  # SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton takes effect on HIP only (unified_kv_gate.py)
        out.append(
            "ROCm / HIP: SGLang's HIP paths (unified KV 'unified_kv_triton', DeepseekV4HipRadixBackend, aiter's "
            "preshuffled indexer cache, the V4.1 gfx950 layouts) store in layouts the adapter does not write; "
            "run SGLang's own kernels there (do not install the adapter)"
        )
    layout = _env("SGLANG_DSV4_KV_LAYOUT") or "auto"
    if layout in ("v41", "v41_new"):
        out.append(
            f"SGLANG_DSV4_KV_LAYOUT={layout}: the V4.1 compressed records (1,536-byte C128 pages) are not the V4 "
            "584-byte records the adapter writes; set SGLANG_DSV4_KV_LAYOUT=v4 or do not install the adapter"
        )
    elif layout == "auto" and sm100:
        out.append(
            "SGLANG_DSV4_KV_LAYOUT=auto on an SM100 / SM103 GPU selects the V4.1 layouts, which the adapter does "
            "not write; set SGLANG_DSV4_KV_LAYOUT=v4"
        )
    return out


def refusals_from_server_args(server_args) -> list[str]:
    """The SGLang modes refused from the server arguments (checked when the backend is built, before the KV
    cache's first use and before any CUDA graph is captured)."""
    out = []
    attn = str(getattr(server_args, "dsv4_attn_backend", "auto") or "auto")
    if attn == "flashmla_mega":
        out.append(
            "--dsv4-attn-backend flashmla_mega selects the V4.1 KV layouts, which the adapter does not write; "
            "use the default attention backend or do not install the adapter"
        )
    if attn == "trtllm":
        out.append("--dsv4-attn-backend trtllm stores uniform FP8 records the adapter does not write")
    chunk = getattr(server_args, "chunked_prefill_size", None)
    if chunk is not None and int(chunk) <= 0:
        out.append(
            "chunked prefill off (--chunked-prefill-size <= 0): a prefill step is then bounded by the prompt, "
            "not by a server limit, so the HCA scratch cannot be sized before graph capture; keep chunked prefill on"
        )
    return out


def scratch_rows_for(server_args, draft_tokens: int = 1) -> int:
    """HCA scratch rows for the largest step SGLang can run under ``server_args``: a prefill chunk
    (``chunked_prefill_size``, ``max_prefill_tokens``), a padded prefill graph (``cuda_graph_max_bs_prefill``
    tokens) or a decode / verify graph (``cuda_graph_max_bs_decode`` x draft tokens)."""
    candidates = [
        getattr(server_args, "chunked_prefill_size", None),
        getattr(server_args, "max_prefill_tokens", None),
        getattr(server_args, "cuda_graph_max_bs_prefill", None),
    ]
    bs = getattr(server_args, "cuda_graph_max_bs_decode", None) or getattr(server_args, "max_running_requests", None)
    if bs:
        candidates.append(int(bs) * max(1, int(draft_tokens)))
    rows = [int(c) for c in candidates if isinstance(c, int) and not isinstance(c, bool) and c > 0]
    if not rows:
        raise SGLangModeNotSupported(
            "dsv4_compressor.sglang: the server arguments give no step limit (chunked_prefill_size, "
            "max_prefill_tokens) to size the HCA scratch from"
        )
    return max(rows)


def scratch_backends_for(server_args) -> int:
    """How many ``DeepseekV4AttnBackend`` objects (each with its own adapter, so its own HCA scratch) one SGLang
    0.5.23 scheduler process builds under ``server_args``, every one after the KV cache is sized:

    * the target model runner (``build_attention_backends``, model_runner_components/attention_backend_setup.py):
      1; with two-batch overlap (``enable_two_batch_overlap``) ``TboAttnBackend.init_new``'s primary and 2
      children, 3; with PD multiplexing (``enable_pdmux``) 1 + ``sm_group_num``;
    * with a draft model (EAGLE / MTP: ``speculative_algorithm`` other than ``NGRAM``): the draft runner's own
      backend (1), the draft-extend backend (1) and, when ``speculative_num_steps`` > 1, the multi-step draft
      backend (speculative/draft_utils.py ``_create_dsv4_decode_backend``: itself a ``DeepseekV4AttnBackend``,
      plus one per step, 1 + steps).

    PD disaggregation (``disaggregation_mode``) builds no other backend. Not counted: the extra target and draft
    backends ``speculative_adaptive`` builds per step configuration (speculative/eagle_worker_v2.py
    ``build_adaptive_runtime_state``, from its config file) and the multi-layer EAGLE worker's."""
    if getattr(server_args, "enable_pdmux", False):
        target = 1 + int(getattr(server_args, "sm_group_num", 0) or 0)
    elif getattr(server_args, "enable_two_batch_overlap", False):
        target = 3
    else:
        target = 1
    algo = str(getattr(server_args, "speculative_algorithm", None) or "NONE").upper()
    if algo in ("NONE", "NGRAM"):
        return target
    steps = int(getattr(server_args, "speculative_num_steps", None) or 1)
    return target + 2 + (1 + steps if steps > 1 else 0)


def scratch_bytes_for(server_args, *, hca_kernel: str = "tiled", scratch_rows: int = 0, head: int = 512) -> int:
    """Bytes of HCA scratch the adapter allocates in one SGLang process under ``server_args``: every backend of
    :func:`scratch_backends_for` gets float32 ``[rows, head]`` with ``rows = max(scratch_rows,``
    :func:`scratch_rows_for` ``)`` (SGLang's ``speculative_num_draft_tokens`` is one process-wide value, so every
    backend has the same rows); 0 with ``hca_kernel="single"`` (no scratch). :func:`install` subtracts it from
    the KV budget SGLang profiles (``KVCacheConfigurator._profile_available_bytes``)."""
    if hca_kernel != "tiled":
        return 0
    draft = int(getattr(server_args, "speculative_num_draft_tokens", None) or 1)
    rows = max(int(scratch_rows), scratch_rows_for(server_args, draft), 1)
    return scratch_backends_for(server_args) * rows * head * 4


def _counting_profile(profile, options, is_dsv4):
    """``KVCacheConfigurator._profile_available_bytes`` (the KV budget SGLang turns into token counts, once per
    process, on the target runner: draft runners take the target's pool config) less the HCA scratch and the
    projection workspaces the adapter allocates later, in the backends' constructors, for a DeepSeek-V4 model."""

    @functools.wraps(profile)
    def _profile_available_bytes(self, *args, **kwargs):
        available = profile(self, *args, **kwargs)
        server_args = getattr(self, "server_args", None)
        hf_config = getattr(getattr(self, "model_config", None), "hf_config", None)
        if server_args is None or getattr(self, "is_draft_worker", False):
            return available
        if is_dsv4 is not None and not is_dsv4(hf_config):
            return available
        kernel, rows = options["hca_kernel"], options["scratch_rows"]
        scratch = scratch_bytes_for(server_args, hca_kernel=kernel, scratch_rows=rows)
        model_config = getattr(self, "model_config", None)
        projection = projection_bytes_for(server_args, model_config, projection=options["projection"])
        return available - scratch - projection

    return _profile_available_bytes


def _refers_to(code, name: str) -> bool:
    if name in code.co_names:
        return True
    return any(_refers_to(c, name) for c in code.co_consts if hasattr(c, "co_names"))


def install(
    *,
    hca: str = "ring",
    hca_kernel: str = "tiled",
    unified_kv: bool | None = None,
    c4_ape: str = "hotfix",
    scratch_rows: int = 0,
    projection: str = "auto",
    modules: dict[str, ModuleType] | None = None,
    check_environment: bool = True,
) -> None:
    """Route SGLang's DeepSeek-V4 compressors through the ops (options as :class:`SGLangCompressor`).

    Patches ``CompressorBackendMixin.forward_unified`` with its aliases ``forward_core_compressor`` /
    ``forward_indexer_compressor``; replaces ``create_paged_compressor_data`` in ``compressor_v2`` and in every
    loaded module that imported it by name (``deepseek_v4_backend`` does); wraps the backend's metadata builders
    (those that call the planner: each publishes its ``core_attn_metadata``'s ``c{r}_out_loc`` to the planner;
    the target-verify ones plan decode plans), the backend's constructor (refuses the modes its server
    arguments select, and allocates the HCA scratch once from SGLang's limits, :func:`scratch_rows_for`, and
    with ``projection="auto"`` the projection workspaces, :meth:`SGLangCompressor.allocate_projection`),
    ``select_dsv4_kv_layout`` (refuses the V4.1 layouts when the pool is built) and
    ``KVCacheConfigurator._profile_available_bytes`` (the KV budget less :func:`scratch_bytes_for` and
    :func:`projection_bytes_for`, for a DeepSeek-V4 target runner: what the backends allocate later is counted
    where SGLang sizes its KV cache). ``projection``: ``"auto"`` (the default: our projection on the steps where
    it is faster than cuBLAS, :meth:`SGLangCompressor.projection_for`) or ``"engine"`` (SGLang's GEMM always);
    another value is refused here. Refuses at once what the environment tells (:func:`refusals_from_environment`;
    ``check_environment=False`` skips it, for tests) and ``hca="online"`` (:data:`ONLINE_REFUSAL`).
    :func:`uninstall` undoes it all, in modules imported later too.

    ``modules``: ``{"compressor_v2": ..., "deepseek_v4_backend": ..., "kv_cache_configurator": ...}`` to patch
    instead of importing SGLang (a vendored fork, or stand-ins in tests). Raises :class:`SGLangNotInstalled` when
    SGLang is absent.
    """
    global _installed
    options = dict(hca=hca, hca_kernel=hca_kernel, unified_kv=unified_kv, c4_ape=c4_ape, scratch_rows=scratch_rows,
                   projection=projection)  # fmt: skip
    if _installed is not None:
        if _installed["options"] == options and modules is None:
            return  # the launch script's top level runs again in each spawned scheduler process of the same one
        raise RuntimeError("dsv4_compressor.sglang is already installed with other options (uninstall() first)")
    SGLangCompressor(**options)  # validate the options now, not at the first forward
    if hca == "online":
        raise SGLangModeNotSupported(ONLINE_REFUSAL)
    if check_environment:
        refused = refusals_from_environment()
        if refused:
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
    mods = dict(modules) if modules is not None else _import_sglang()
    cv2 = mods["compressor_v2"]
    online = getattr(cv2, "_use_online_compress", None)
    if online is not None and online(128):
        raise SGLangModeNotSupported(
            "SGLang's own online C128 compress (SGLANG_OPT_USE_ONLINE_COMPRESS) is on: its state pool has the "
            "online layout and its MTP controller commits into it; turn it off to use the adapter"
        )
    patches: list[tuple[Any, str, Any]] = []
    wrappers: dict[str, tuple[Any, Any]] = {}  # name -> (wrapper, original): restored in every module holding it

    def patch(owner, name, value):
        patches.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def adapter_of(backend) -> SGLangCompressor:
        adapter = backend.__dict__.get(_ADAPTER_ATTR)
        if adapter is None:
            draft = getattr(backend, "speculative_num_draft_tokens", None)
            adapter = SGLangCompressor(draft_tokens=int(draft) if draft else 1, **options)
            setattr(backend, _ADAPTER_ATTR, adapter)
        return adapter

    def forward_unified(self, x, forward_batch, layer_id, compressor):
        return adapter_of(self).forward_unified(self, x, forward_batch, layer_id, compressor)

    mixin = cv2.CompressorBackendMixin
    for name in ("forward_unified", "forward_core_compressor", "forward_indexer_compressor"):
        if name in mixin.__dict__:
            patch(mixin, name, forward_unified)

    # The planner has no backend argument: one stateless builder serves every backend (the options are global;
    # draft_tokens only bounds ring checks there, so the widest, SGLang's own rings, are accepted).
    builder = SGLangCompressor(**options, draft_tokens=1)
    original = cv2.create_paged_compressor_data

    @functools.wraps(original)
    def create_paged_compressor_data(compress_ratio, **kwargs):
        scope = _CORE.get()  # [core] inside a wrapped builder, None outside: never a stale step's
        core = scope[0] if scope else None
        out_loc = getattr(core, f"c{int(compress_ratio)}_out_loc", None) if core is not None else None
        return builder.create_paged_compressor_data(compress_ratio, out_loc=out_loc, **kwargs)

    wrappers["create_paged_compressor_data"] = (create_paged_compressor_data, original)

    backend_mod = mods.get("deepseek_v4_backend")
    backend_cls = getattr(backend_mod, "DeepseekV4AttnBackend", None) if backend_mod is not None else None
    if backend_cls is not None:
        verify = ("make_forward_metadata_from_raw_verify", "init_forward_metadata_target_verify")
        # the backend and its subclasses in the module (the multi-step draft backend): every method that calls
        # the planner becomes a builder scope
        classes = [c for c in vars(backend_mod).values() if isinstance(c, type) and issubclass(c, backend_cls)]
        for cls in classes:
            for name, fn in list(cls.__dict__.items()):
                if not callable(fn) or not hasattr(fn, "__code__"):
                    continue
                calls_planner = _refers_to(fn.__code__, "create_paged_compressor_data")
                if calls_planner or name in verify:
                    patch(cls, name, _as_builder(fn, verify=name in verify))
        make_core = backend_cls.__dict__.get("make_core_attn_metadata")
        if make_core is not None:
            patch(backend_cls, "make_core_attn_metadata", _publishing_core(make_core))
        init = backend_cls.__dict__.get("__init__")
        if init is not None:
            patch(backend_cls, "__init__", _checked_init(init, adapter_of))

    # the scratch the backends' constructors allocate is counted where SGLang sizes its KV cache
    kvc_mod = mods.get("kv_cache_configurator")
    kvc_cls = getattr(kvc_mod, "KVCacheConfigurator", None) if kvc_mod is not None else None
    profile = kvc_cls.__dict__.get("_profile_available_bytes") if kvc_cls is not None else None
    if profile is not None:
        counting = _counting_profile(profile, options, getattr(kvc_mod, "is_deepseek_v4", None))
        patch(kvc_cls, "_profile_available_bytes", counting)

    pool_mod = mods.get("deepseek_v4_memory_pool")
    if pool_mod is None and modules is None:
        pool_mod = sys.modules.get("sglang.srt.mem_cache.deepseek_v4_memory_pool")
    select = getattr(pool_mod, "select_dsv4_kv_layout", None) if pool_mod is not None else None
    if select is not None:
        wrappers["select_dsv4_kv_layout"] = (_checked_layout(select), select)

    # every loaded module that imported a wrapped function by name holds its own reference
    candidates = list(mods.values()) + [m for key, m in list(sys.modules.items()) if key.startswith("sglang.")]
    for name, (wrapper, orig) in wrappers.items():
        holders = []
        for module in candidates:
            if module is not None and getattr(module, name, None) is orig and module not in holders:
                holders.append(module)
        for module in holders:
            patch(module, name, wrapper)
    _installed = dict(patches=patches, options=options, wrappers=wrappers)


#: The environment variable that turns the ``sglang.srt.plugins`` entry point on: ``ring`` (or ``tiled``: the
#: C128 ring, the tiled HCA kernel), ``single`` (the ring, the single-stage kernel), ``off`` / unset (inert).
#: SGLang starts its scheduler, detokenizer and model-runner processes on one node with multiprocessing (they
#: inherit the launching process's whole environment), and loads the plugins in each (srt/plugins L103-140), so
#: the variable reaches every worker; on several nodes, set it on each node's launch command as SGLang's own.
PLUGIN_ENV = "DSV4C_SGLANG"
#: The projection switch for the entry point: ``auto`` (unset: our projection where it is faster) or ``engine``
#: (SGLang's GEMM always); :data:`PROJECTIONS`.
PROJECTION_ENV = "DSV4C_SGLANG_PROJECTION"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: inert unless ``DSV4C_SGLANG`` says otherwise. SGLang catches and
    only logs an ``Exception`` from a plugin, so a refused mode exits the process (``SystemExit``) instead of
    leaving SGLang on its own kernels with a log line."""
    mode = _env(PLUGIN_ENV)
    if mode in ("", "0", "off", "false", "no"):
        return
    kernels = {"ring": "tiled", "tiled": "tiled", "single": "single", "1": "tiled", "on": "tiled"}
    if mode == "online":
        raise SystemExit(ONLINE_REFUSAL)
    if mode not in kernels:
        raise SystemExit(f"{PLUGIN_ENV}={mode!r}: expected one of off, ring (tiled), single")
    projection = _env(PROJECTION_ENV) or "auto"
    if projection not in PROJECTIONS:
        raise SystemExit(f"{PROJECTION_ENV}={projection!r}: expected one of {', '.join(PROJECTIONS)}")
    try:
        install(hca_kernel=kernels[mode], projection=projection)
    except (SGLangModeNotSupported, SGLangNotInstalled) as err:
        raise SystemExit(f"{PLUGIN_ENV}={mode}: {err}") from err


def _as_builder(fn, *, verify: bool):
    """A backend metadata builder: ``c{r}_out_loc`` published to the planner only within this call; target-verify
    builders plan decode plans."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _CORE.set([None])
        try:
            with verify_step() if verify else contextlib.nullcontext():
                return fn(*args, **kwargs)
        finally:
            _CORE.reset(token)

    return wrapper


def _publishing_core(fn):
    @functools.wraps(fn)
    def make_core_attn_metadata(*args, **kwargs):
        core = fn(*args, **kwargs)
        scope = _CORE.get()
        if scope is not None:
            scope[0] = core
        return core

    return make_core_attn_metadata


def _checked_init(init, adapter_of):
    """The backend's constructor: refuse what its server arguments select, then give it its adapter with the
    HCA scratch and the projection workspaces allocated from SGLang's limits and model config, before any CUDA
    graph is captured (SGLang builds its backends before it captures)."""

    @functools.wraps(init)
    def __init__(self, model_runner, *args, **kwargs):
        server_args = getattr(model_runner, "server_args", None)
        refused = refusals_from_server_args(server_args) if server_args is not None else []
        if refused:
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
        init(self, model_runner, *args, **kwargs)
        if getattr(self, "enable_deepseek_v4_fp4_indexer", False):
            raise SGLangModeNotSupported(
                "dsv4_compressor.sglang: the FP4 indexer cache (enable_deepseek_v4_fp4_indexer) is not supported"
            )
        pool = getattr(self, "token_to_kv_pool", None)
        if getattr(pool, "uniform_fp8", False):
            raise SGLangModeNotSupported("dsv4_compressor.sglang: the uniform-FP8 (trtllm) store is not supported")
        adapter = adapter_of(self)
        device = getattr(self, "device", None) or getattr(model_runner, "device", "cpu")
        if server_args is not None and adapter.hca_kernel == "tiled":
            rows = max(adapter.scratch_rows, scratch_rows_for(server_args, adapter.draft_tokens))
            adapter.scratch_rows = rows
            adapter.allocate_scratch(device)
        # the projection workspaces, from the same limits (projection_bytes_for counts them so)
        dims = model_dims(getattr(model_runner, "model_config", None))
        if server_args is not None and adapter.projection == "auto" and dims is not None:
            adapter.allocate_projection(device, max_rows=scratch_rows_for(server_args, adapter.draft_tokens), **dims)
        # each C4 layer's two projection weights as one tensor's halves: one GEMM for both (paired_kv_score); not
        # under SGLang's memory saver, whose weight region the joint tensors would be allocated outside of (a
        # release would keep them, a resume would not restore them)
        model = getattr(model_runner, "model", None)
        saver = getattr(model_runner, "memory_saver_adapter", None)
        if adapter.projection == "auto" and isinstance(model, torch.nn.Module):
            if getattr(saver, "enabled", False):
                adapter.join_refused = "SGLang's memory saver is on: the weights stay as SGLang allotted them"
            else:
                adapter.joined_layers = join_c4_weights(model)

    return __init__


def _checked_layout(select):
    @functools.wraps(select)
    def select_dsv4_kv_layout(*args, **kwargs):
        layout = select(*args, **kwargs)
        main = layout[0] if isinstance(layout, tuple) else layout
        name = str(getattr(main, "name", main))
        if name != "V4":
            raise SGLangModeNotSupported(
                f"dsv4_compressor.sglang: SGLang selected the {name} KV layout (SGLANG_DSV4_KV_LAYOUT, "
                "--dsv4-attn-backend flashmla_mega, or auto on SM100); the adapter writes the V4 records only: set "
                "SGLANG_DSV4_KV_LAYOUT=v4 or do not install the adapter"
            )
        return layout

    return select_dsv4_kv_layout


def uninstall() -> None:
    """Restore everything :func:`install` patched, also in SGLang modules imported after :func:`install` that
    took a patched function by name (adapters already attached to backends stay unused)."""
    global _installed
    if _installed is None:
        return
    for owner, name, value in reversed(_installed["patches"]):
        setattr(owner, name, value)
    for name, (wrapper, orig) in _installed["wrappers"].items():
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, name, None) is wrapper:
                setattr(module, name, orig)
    _installed = None


# ---------------------------------------------------------------------------------------------------------------
# What hca="online" saves
# ---------------------------------------------------------------------------------------------------------------
def hca_online_savings(
    *, hca_layers: int = 20, head_dim: int = 512, ratio: int = 128, draft_tokens: int = 1, requests: int = 1
) -> dict[str, float]:
    """State bytes and launches of SGLang's C128 path against ``hca="online"``, from config numbers.

    SGLang's C128 state is a ring of ``get_ring_size(128)`` rows (128, or 256 with speculation) of ``2H`` floats
    per request and layer; online banks are ``E`` x ``3H`` floats (running max, sum, weighted sum). Launches per
    HCA layer and step: SGLang 2 (``compress_forward``, ``compress_norm_rope_store``), 3 with its online C128 +
    MTP path (the commit), the library's tiled ring path 1 on decode steps of up to 256 requests (2 otherwise)
    and online 1.

    V4-Flash (20 HCA layers, H = 512): 512 KiB -> 6 KiB per request and layer without speculation (85x),
    1 MiB -> 24 KiB with E = 4 (43x); 256 requests at E = 4: 5 GiB -> 120 MiB, and 40 (60 with SGLang's online
    MTP) -> 20 launches per step. V4-Pro (31 HCA layers): 7.75 GiB -> 186 MiB, 62 (93) -> 31 launches.
    """
    ring = ratio if draft_tokens <= 1 else 2 * ratio
    ring_bytes = ring * 2 * head_dim * 4
    online_bytes = draft_tokens * 3 * head_dim * 4
    return {
        "ring_rows": ring,
        "ring_bytes_per_request_layer": ring_bytes,
        "online_bytes_per_request_layer": online_bytes,
        "memory_ratio": ring_bytes / online_bytes,
        "ring_bytes": ring_bytes * hca_layers * requests,
        "online_bytes": online_bytes * hca_layers * requests,
        "saved_bytes": (ring_bytes - online_bytes) * hca_layers * requests,
        "launches_sglang": 2 * hca_layers,
        "launches_sglang_online_mtp": 3 * hca_layers,
        "launches_online": hca_layers,
    }
