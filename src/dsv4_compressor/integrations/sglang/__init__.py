"""SGLang adapter: DeepSeek-V4's compressors in SGLang (0.5.23) through :mod:`dsv4_compressor.ops`.

What SGLang does today (``srt/layers/attention/dsv4/compressor_v2.py``, see docs/INTEGRATION.md, "SGLang 0.5.23"):
once per step and ratio, ``create_paged_compressor_data`` runs a C++ planner whose result is stored as
``DSV4Metadata.c4_compress_metadata`` / ``c128_compress_metadata`` (built inside the decode / target-verify
CUDA graphs, refreshed with ``DSV4Metadata.copy_`` on replay); per layer and compressor,
``CompressorBackendMixin.forward_unified`` (aliased ``forward_core_compressor`` / ``forward_indexer_compressor``)
computes ``kv_score`` and calls ``_forward_compress_all_in_one``: ``compress_forward`` (ring reads, the write
plan, a fresh float32 ``[N, H]`` per call), then ``compress_norm_rope_store``.

This package replaces both with the library's ops, on SGLang's own buffers, with no copy:

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
C128 ring ``CompressStatePool`` (``hca="online"``)   ``ops.compress_online_hca`` on the same pool's rows read as
                                                    ``[slots, B, 3, H]`` banks (``B``: E rounded up to even),
                                                    the pool sized for the banks where SGLang sizes the ring
                                                    (:mod:`.online`); no commit launch
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
    dsv4_sglang.install()                 # or install(hca="online"): online HCA banks in SGLang's C128 pool
    # dsv4_sglang.install(projection="engine")   # SGLang's compute_kv_score on every step

    if __name__ == "__main__":
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.server_args import prepare_server_args
        launch_server(prepare_server_args(sys.argv[1:]))

:func:`install` patches ``CompressorBackendMixin.forward_unified`` and its two aliases, every module-level
reference to ``create_paged_compressor_data``, and wraps the backend's target-verify metadata builders so their
plans are built as decode plans (every request brings at most ``E`` rows). The HCA scratch (float32
``[rows, 512]``, rows from :func:`scratch_rows_for`: 4096 rows are 8 MiB) is allocated in each backend's
constructor, which SGLang runs after it has sized the KV pool; so :func:`install` also wraps
``KVCacheConfigurator._profile_available_bytes`` (``srt/mem_cache/kv_cache_configurator.py``, the KV budget
SGLang turns into token counts) to subtract :func:`scratch_bytes_for`: one scratch for every backend with
compressor layers (:func:`compressor_backends_for`: the target's, with two-batch overlap or PD multiplexing
several; a draft model's MTP layers have no compressor, so its backends get nothing), counted where SGLang counts
its KV cache instead of out of its headroom; the constructor also allocates the projection workspaces, which the
same wrapper subtracts (:func:`projection_bytes_for`).

**Settings.** Every size and refusal reads the values SGLang runs with (:func:`settings_of`), never the raw
``ServerArgs`` fields, which SGLang's resolution leaves as given (``None`` for ``chunked_prefill_size``,
``max_running_requests`` and the speculative settings of a default record): the config bags the process published
(``get_schedule()`` / ``get_spec()``, what SGLang's own backend reads), else SGLang's ``resolution_result``,
resolving a copy with its own pipeline first where a record was never resolved. The chunk and the request count
are the attention-DP rank's. The backend's constructor also reads each compressor layer's page layout from the
pool on the host (:func:`layer_layout`): V4, V4.1 (``V41``) and V4.1 interleaved (``V41_NEW``, both selected by
``SGLANG_DSV4_KV_LAYOUT`` on SM100 / SM103) and the trtllm backend's uniform FP8 pool (``--dsv4-attn-backend
trtllm``: SGLang's bytes, its Triton norm and rope then e4m3; slot 0, where SGLang's store zeroes the rows that
close no group, is left alone) layers are written in their own layout; V4.1 FP4 records and HiSparse are refused
with the layer and the reason.
:func:`hca_online_savings` gives what ``hca="online"`` saves at a model's numbers.

The modules: :mod:`.settings` (the settings SGLang runs with, the refusals, step and backend counts),
:mod:`.metadata` (the per-step metadata and SGLang's constants), :mod:`.adapter` (:class:`SGLangCompressor`, the
per-layer layout check), :mod:`.projection` (where our projection runs, the joined C4 weights), :mod:`.memory`
(the bytes counted in SGLang's KV sizing), :mod:`.online` (``hca="online"``: the banks in SGLang's C128 pool, its
sizing, PD transfer and clears), :mod:`.capacity` (SGLang's pool configurator run ring against online: ``python
-m dsv4_compressor.integrations.sglang.capacity``) and :mod:`.patching` (:func:`install`, :func:`uninstall`,
:func:`register`). Every public name is importable from this package.
"""

from __future__ import annotations

from ... import ops  # noqa: F401  (the op module the adapter calls; tests patch it)
from .adapter import (  # noqa: F401
    REFUSED_LAYOUTS,
    V4_RECORD_BYTES,
    WRITTEN_LAYOUTS,
    SGLangCompressor,
    _detach,
    _index_page_size,
    _refuse_unsupported,
    layer_layout,
    layer_layout_refusal,
)
from .memory import _counting_profile, hca_online_savings, projection_bytes_for, scratch_bytes_for  # noqa: F401
from .metadata import (  # noqa: F401
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
    verify_step,
)
from .online import BANK_ATTR, NO_BANKS, bank_count, bank_rows, banks_view, pool_banks  # noqa: F401
from .patching import (  # noqa: F401
    _ADAPTER_ATTR,
    _CORE,
    MODULES,
    ONLINE_MODULES,
    PLUGIN_ENV,
    PROJECTION_ENV,
    _as_builder,
    _checked_init,
    _checked_layout,
    _compressor_ratios,
    _hisparse_pool,
    _import_sglang,
    _publishing_core,
    _refers_to,
    install,
    installed,
    register,
    uninstall,
)
from .projection import (  # noqa: F401
    _PAIRABLE_KEYS,
    _PARTNERS,
    PAIR_DONE,
    _sglang_compressor_module,
    _x_key,
    join_c4_weights,
    kv_score_differs,
    model_dims,
    projection_weight,
    projection_workspaces,
)
from .settings import (  # noqa: F401
    _RESOLVED_COPY,
    CHUNKED_PREFILL_OFF,
    HISPARSE_REFUSAL,
    KV_LAYOUT_DEFAULT,
    SGLangModeNotSupported,
    SGLangNotInstalled,
    SGLangSettings,
    SGLangUnsupported,
    _draft_backends,
    _env,
    _leaf_reader,
    _settings,
    backends_for,
    compressed_kv_layout_env,
    compressor_backends_for,
    kv_layout_env,
    refusals_from_environment,
    refusals_from_server_args,
    refusals_from_settings,
    scratch_backends_for,
    scratch_rows_for,
    settings_of,
)

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
    "refusals_from_settings",
    "SGLangSettings",
    "settings_of",
    "backends_for",
    "compressor_backends_for",
    "layer_layout",
    "layer_layout_refusal",
    "WRITTEN_LAYOUTS",
    "REFUSED_LAYOUTS",
    "kv_layout_env",
    "compressed_kv_layout_env",
    "CHUNKED_PREFILL_OFF",
    "HISPARSE_REFUSAL",
    "MAX_DRAFT_TOKENS",
    "register",
    "install",
    "uninstall",
    "installed",
    "hca_online_savings",
    "bank_count",
    "bank_rows",
    "banks_view",
    "pool_banks",
    "MODULES",
]


def __getattr__(name: str):
    # install()'s state lives in .patching, rebound on every install() / uninstall()
    if name == "_installed":
        from . import patching

        return patching._installed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
