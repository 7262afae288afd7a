"""vLLM adapter: DeepSeek-V4's compressors (``DeepseekCompressor.forward``) on the library's ops.

What a vLLM user adds: the patch must run in every process that builds the model, and vLLM's workers are
separate processes, so the way in is vLLM's plugin entry point (``vllm.general_plugins``), which runs
:func:`register` in each of them when the switch is on (and imports nothing heavy when it is off)::

    # this package's pyproject.toml declares it
    [project.entry-points."vllm.general_plugins"]
    dsv4_compressor = "dsv4_compressor.integrations.entry_points:vllm"

    # inert unless opted in: VLLM_DSV4C=tiled | online (VLLM_-prefixed, so vLLM forwards it to Ray workers)

or, where the model is built in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tests)::

    from dsv4_compressor.integrations import vllm as dsv4_vllm
    dsv4_vllm.install()               # before the model is built (HCA layers get their scratch at init)
    dsv4_vllm.install(hca="online")   # or: online HCA banks in a CircularBufferSpec C128 group (below)

Mapping, vLLM 0.33 names (``vllm/models/deepseek_v4/compressor.py``; docs/INTEGRATION.md, the vLLM section)
-> op arguments. Per step and per compressor-state KV-cache group (C4 main, C4 indexer, C128; each has its own
``CompressorMetadataBuilder`` and ``CompressorMetadata``):

====================================================  ============================================================
vLLM                                                  op argument
====================================================  ============================================================
``positions`` (int64, the model's persistent buffer)   ``build_plan(positions=)``
``CompressorMetadata.token_to_req_indices`` (int32)    ``build_plan(row_req=)``, with ``-1`` where the state
                                                       ``slot_mapping`` is ``-1`` (padding: vLLM leaves the
                                                       padded tail of ``token_to_req_indices`` stale)
``attn_metadata[k_cache_prefix].slot_mapping`` (int64,  ``build_plan(out_slot=)``; shorter than the step
-1 except on group-ends; ``num_actual_tokens`` rows:   (the unpadded count outside FULL CUDA graphs): copied
unpadded outside FULL CUDA graphs)                     into the planner's persistent buffer, ``-1`` after it
``CompressorMetadata.block_table`` (int32, clamped      the plan's state rows (``build_plans(state_mode=
>= 0), ``.block_size``                                 "block_table", block_size=4 (C4) or 8 (C128))``, in
                                                       the plan's launch): every row is saved, as
                                                       ``_SAVE_PARTIAL_STATES_KERNEL`` does; online HCA:
                                                       ``build_plan(req_state_slot=block_table[:, 0])``
``kv_score`` (fp32 ``[T, 2W]``, vLLM's GEMM)          ``compress(kv_score=)`` (never written)
``self.ape.view(r, coff, H)``                          ``ape``
``self.norm.weight``, ``self.rms_norm_eps``            ``norm_weight``, ``eps``
``rotary_emb.cos_sin_cache[:, :R/2]`` / ``[:, R/2:]``  ``cos`` / ``sin`` (strided views, no copy)
``self.state_cache.kv_cache`` (3-D, padded block       ``state`` (the op reads ``stride(0)``)
stride)
``k_cache_layer.kv_cache`` (uint8 ``[blocks, P,        ``out_pages = kv_cache.view(blocks, P * record)`` (a view:
record]``, padded block stride), ``.shape[1]``         the page stride stays ``kv_cache.stride(0)``),
                                                       ``page_size = P``
one fp32 ``[max_num_batched_tokens, 512]`` shared by    ``scratch`` (HCA's tiled kernel); vLLM's own
all HCA layers, allocated at model init                ``_compress_scratch`` where it has one (ROCm)
uniform-decode batch (``max_query_len <= 1 +           ``decode=True``, except in launches a PIECEWISE graph
num_speculative_tokens``)                              captures (it replays any batch: :func:`recorded_decode`)
``block_table.shape[0]`` (the step's requests, padded  the plan's request capacity ``min(max_num_seqs, T,
ones included)                                         block_table.shape[0])``, not ``max_num_seqs``
indexer (``head_dim`` 128, ``[blocks, 64, 132]``)      ``kind="indexer", indexer_pack="pow2"`` (no Hadamard,
                                                       power-of-two scale stored as float32; FP8 pack only;
                                                       ``"pow2_ue8m0"`` on cc 10.x: :func:`indexer_pack`)
====================================================  ============================================================

**Where the plan is built.** ``CompressorMetadataBuilder.__init__`` (patched) allocates the persistent buffers
(plan, ``row_req``, ``out_slot``, ``read_rows``, ``save_rows``) once; ``build`` (patched) attaches a per-step handle
(:class:`VllmStepPlan`) carrying the metadata's ``decode`` claim, with no device work. The device work runs in
the first compressor layer of the group in each forward pass: three torch ops that copy
``token_to_req_indices`` and mask its padding rows (``copy_``, ``slot_mapping < 0``, ``masked_fill_``), then one
``build_plans`` of the plan and its block-table state rows (its launches: ``ops.launches("build_plans",
tables=True)`` at the step's rows and the plan's capacity; one program builds the plan up to
``kernels.plan.PLAN_ONE_BLOCK_MAX_ROWS`` rows and requests; the online group's is a ``build_plan``). A
padded step whose
``token_to_req_indices`` or compressed slot mapping is shorter than the slot mapping adds a ``fill_`` for the
first and a ``copy_`` and a ``fill_`` for the second. It runs there because ``out_slot`` is
the *compressed-KV* group's slot mapping, which another group's builder produces and which only
``attn_metadata`` holds at forward time. Every other layer of the group
reuses the plan. All of it reads vLLM's persistent buffers (positions, slot mappings, block tables) and writes
ours, with no host synchronisation, so it is captured into vLLM's CUDA graphs with the layers and replays with
whatever the runner copied into those buffers. What a capture records must hold for every batch its graph
replays: the plan is a view of capacity ``min(max_num_seqs, T, block_table.shape[0])`` (shapes only, so a
decode batch of ``B`` requests gets the grids the bare ops have at ``B``: the tiled HCA kernel's one-launch
decode path up to 256 requests, the plan's one-program build up to 64), and a PIECEWISE capture records the
general path (:func:`recorded_decode`).

Launches per layer and step: one (decode) or two (prefill; the ring save runs after every window was read),
against vLLM's two (C4: save + fused) or three (C128: save + compress + store).

**Online HCA** (``hca="online"``, :mod:`.online`): a C128 ``CompressorStateCache`` declares vLLM's own
``CircularBufferSpec`` (the class itself), one block of ``mtp_step + 1`` banks of ``(max, sum, weighted sum)``
per channel per request for its lifetime (24 KiB at V4 shapes and ``mtp_step`` 3), never prefix cached. The
banks are the request's block ``block_table[req, 0]``, a strided view of vLLM's packed blocks
(:func:`online_bank_view`); the group has no slot mapping, so a row is padding where its request holds the null
block 0 or it lies past ``query_start_loc[-1]``. Refused at install, or where vLLM asks for the spec or builds
the builder (:class:`VllmModeNotSupported`, with the reason): a vLLM without ``CircularBufferSpec``, the hybrid
KV-cache manager disabled, a KV block size that is not a multiple of 128, a ``kv_transfer_config`` other than
NIXL's pull connector on device buffers. Under NIXL the banks move with the request's blocks (at least 2 banks
there: the decode node recomputes the prompt's last token). What it admits in vLLM's own planner:
``python -m dsv4_compressor.integrations.vllm.capacity`` (:mod:`.capacity`).
"""

from __future__ import annotations

from ... import ops  # noqa: F401  (the ops the adapter calls, reachable as before)
from . import layer, online, patching, planner  # noqa: F401  (by job: plan, layer call, banks' spec, patching)
from .layer import (
    SCRATCH_ATTR,
    compress_layer,
    compressor_forward,
    indexer_pack,
    online_bank_view,
    online_hca_state_bytes,
)
from .patching import (
    COMPRESSOR_MODULES,
    ENV_VAR,
    ENV_VAR_ALIAS,
    ONLINE_REFUSED,
    Installation,
    VllmModeNotSupported,
    VllmNotAvailableError,
    install,
    register,
)
from .planner import (
    PLANNER_ATTR,
    STEP_ATTR,
    VLLM_STATE_BLOCK_SIZE,
    VllmCompressorPlanner,
    VllmStepPlan,
    recorded_decode,
)

__all__ = [
    "VLLM_STATE_BLOCK_SIZE",
    "VllmNotAvailableError",
    "VllmModeNotSupported",
    "VllmCompressorPlanner",
    "VllmStepPlan",
    "compress_layer",
    "compressor_forward",
    "recorded_decode",
    "online_bank_view",
    "online_hca_state_bytes",
    "install",
    "register",
    "Installation",
    "ONLINE_REFUSED",
    "ENV_VAR",
    "ENV_VAR_ALIAS",
    "COMPRESSOR_MODULES",
    "STEP_ATTR",
    "PLANNER_ATTR",
    "SCRATCH_ATTR",
    "indexer_pack",
]
