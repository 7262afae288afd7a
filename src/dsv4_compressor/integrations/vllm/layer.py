"""The vLLM adapter's layer call: ``DeepseekCompressor.forward``'s body on the ops (:func:`compressor_forward`,
:func:`compress_layer`), the HCA scratch, and the online option's banks and memory."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ... import ops
from ...config import CompressorConfig
from ...errors import OpError
from . import planner as _planner
from .planner import STEP_ATTR, VllmStepPlan


# ---------------------------------------------------------------------------------------------------------------
# Per-layer call
# ---------------------------------------------------------------------------------------------------------------
def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's ``[blocks, P, record]`` uint8 cache as the op's ``[pages, P * record]``, without a copy (the page
    stride stays the tensor's padded block stride)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3:
        raise OpError(f"vllm: k cache must be uint8 [blocks, P, record], got {kv_cache.dtype} {list(kv_cache.shape)}")
    try:
        return kv_cache.view(kv_cache.shape[0], -1)
    except RuntimeError as err:
        raise OpError(
            f"vllm: k cache records of a block are not contiguous (strides {list(kv_cache.stride())})"
        ) from err


def online_bank_view(state_cache: torch.Tensor, banks: int, head_dim: int) -> torch.Tensor:
    """A request-scoped state block as the online op's banks ``[blocks, banks, 3, H]`` (a view, no copy).

    ``state_cache`` is vLLM's float32 view of a ``CircularBufferSpec`` group, ``[blocks, banks, 3H]``: each
    block's floats contiguous and exactly the banks, the blocks ``stride(0)`` apart (the whole packed block in
    block-outermost layouts, so more than the banks); the op checks that stride."""
    per_block = banks * 3 * head_dim
    if state_cache.dtype != torch.float32:
        raise OpError(f"vllm: online HCA banks must be float32, got {state_cache.dtype}")
    blocks = state_cache.shape[0] if state_cache.dim() else 0
    if (
        state_cache.dim() < 2
        or state_cache[:1].numel() != min(blocks, 1) * per_block
        or not (blocks == 0 or state_cache[0].is_contiguous())
    ):
        raise OpError(
            f"vllm: online HCA needs blocks of exactly {banks} x 3 x {head_dim} contiguous floats (mtp_step + 1 "
            f"banks), got {list(state_cache.shape)} strides {list(state_cache.stride())}"
        )
    stride = state_cache.stride(0)
    return state_cache.as_strided(
        (blocks, banks, 3, head_dim), (stride, 3 * head_dim, head_dim, 1), state_cache.storage_offset()
    )


def compress_layer(
    step: VllmStepPlan,
    kv_score: torch.Tensor,
    *,
    kind: str,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    state_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> None:
    """One compressor layer's step on vLLM's tensors (what ``DeepseekCompressor.forward`` computes).

    Args:
        step: the group's built :class:`VllmStepPlan`.
        kv_score: fp32 ``[>= T, 2W]`` from vLLM's GEMM (the first ``T`` rows are the step's; never written).
        kind: ``"hca"``, ``"csa"`` or ``"indexer"``.
        ape: vLLM's ``self.ape``, ``[r, coff * H]`` (viewed as ``[r, coff, H]``).
        norm_weight, eps: ``self.norm.weight``, ``self.rms_norm_eps``.
        cos_sin_cache: ``rotary_emb.cos_sin_cache``, fp32 ``[max_pos, R]`` (cos then sin).
        state_cache: ``self.state_cache.kv_cache``: ``[blocks, block_size, 2W]`` (ring state), or for an online
            step the request-scoped bank blocks (:func:`online_bank_view`).
        kv_cache: ``k_cache_layer.kv_cache``, uint8 ``[blocks, P, record]``.
        scratch: ``self._compress_scratch`` (HCA, ``[>= T, H]`` fp32: the tiled kernel's workspace; online,
            what a prefill step splits its groups through).
    """
    if not step.built:
        raise OpError("vllm: the step's plan was not built (VllmStepPlan.build)")
    rows = step.rows
    if kv_score.shape[0] < rows:
        raise OpError(f"vllm: kv_score has {kv_score.shape[0]} rows, the plan {rows}")
    kv_score = kv_score[:rows]  # the plan's sections are laid out for exactly T rows
    ratio = ape.shape[0]
    if ratio != step.ratio:
        raise OpError(f"vllm: a layer of ratio {ratio} on a plan built for ratio {step.ratio}")
    head = norm_weight.shape[0]
    coff = 2 if kind != "hca" else 1
    ape3 = ape.view(ratio, coff, head)
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
    out_pages, page_size = _pages(kv_cache), kv_cache.shape[1]
    if step.online:
        if kind != "hca":
            raise OpError(f"vllm: the online state is for HCA layers, not {kind!r}")
        # the banks one block holds (mtp_step + 1; at least 2 under KV transfer: .online.bank_count); the op
        # refuses fewer than the plan's mtp_step + 1
        per_block = math.prod(state_cache.shape[1:]) if state_cache.dim() > 1 else 0
        banks = online_bank_view(state_cache, max(1, per_block // (3 * head)), head)
        ops.compress_online_hca(
            kv_score, step.plan, ape3, norm_weight, cos, sin, banks, out_pages, page_size=page_size, eps=eps,
            decode=step.decode_path, scratch=None if step.decode_path else scratch,
        )  # fmt: skip
        return
    ops.compress(
        kv_score, step.plan, ape3, norm_weight, cos, sin, state_cache, out_pages, kind=kind, page_size=page_size,
        eps=eps, decode=step.decode_path, scratch=scratch if kind == "hca" else None, read_rows=step.read_rows,
        save_rows=step.save_rows, indexer_pack=indexer_pack(),
    )  # fmt: skip


@functools.cache
def indexer_pack() -> str:
    """vLLM's indexer FP8 pack: ``pow2``, or ``pow2_ue8m0`` (the scale as 4 packed UE8M0 bytes) where vLLM's MQA
    logits take MX scales (compute capability 10.x; vLLM's own ``mqa_logits_use_mx_scales``)."""
    try:
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
    except ImportError:
        return "pow2_ue8m0" if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10 else "pow2"
    return "pow2_ue8m0" if mqa_logits_use_mx_scales() else "pow2"


# ---------------------------------------------------------------------------------------------------------------
# DeepseekCompressor.forward
# ---------------------------------------------------------------------------------------------------------------
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    import warnings

    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _layer_kind(module, kv_cache: torch.Tensor) -> str:
    if not module.overlap:
        return "hca"
    # vLLM tells the indexer from CSA by head_dim (128 / 512); the record size says it for any shape:
    # the indexer's FP8 pack is H + 4 bytes, a latent record H + R + 8.
    return "indexer" if kv_cache.shape[-1] == module.head_dim + 4 else "csa"


def _unsupported(module, kv_score, kv_cache, cos_sin_cache) -> str | None:
    """Why this layer keeps vLLM's own kernels (``None``: the ops run it)."""
    if getattr(module, "use_fp4_cache", False):
        return "MXFP4 indexer cache"
    if kv_cache.dtype != torch.uint8:
        return f"k cache dtype {kv_cache.dtype} (only the fp8_ds_mla uint8 layout)"
    if kv_score.dtype != torch.float32 or kv_score.shape[-1] != 2 * module.coff * module.head_dim:
        return "forward is not given fp32 kv_score [T, 2W] (an older vLLM passes hidden states)"
    if cos_sin_cache.dtype != torch.float32:
        return f"cos_sin_cache dtype {cos_sin_cache.dtype}"
    return None


#: The HCA layers' tiled-kernel workspace, one per (device, rows, head): the layers run one after another on
#: one stream, so they share it. Allocated when the first HCA compressor is built (model init, before vLLM's
#: profile_run measures the memory the KV cache may not take), never later.
_SHARED_SCRATCH: dict[tuple, torch.Tensor] = {}
SCRATCH_ATTR = "_dsv4c_scratch"


def _allocate_scratch(module) -> None:
    """At ``DeepseekCompressor.__init__``: give an HCA layer the shared ``[max_num_batched_tokens, H]`` fp32
    scratch (vLLM's own ``_compress_scratch`` where it allocates one, ROCm)."""
    if getattr(module, "overlap", True) or getattr(module, "_compress_scratch", None) is not None:
        return
    rows, head = getattr(module, "max_num_batched_tokens", None), getattr(module, "head_dim", None)
    if rows is None or head is None:
        return
    device = torch.device(getattr(module, "device", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), int(rows), int(head))
    scratch = _SHARED_SCRATCH.get(key)
    if scratch is None:
        scratch = _SHARED_SCRATCH[key] = torch.empty(int(rows), int(head), dtype=torch.float32, device=device)
    setattr(module, SCRATCH_ATTR, scratch)


def _scratch(module) -> torch.Tensor | None:
    scratch = getattr(module, "_compress_scratch", None)
    return scratch if scratch is not None else getattr(module, SCRATCH_ATTR, None)


def compressor_forward(
    module, kv_score, positions, rotary_emb, *, attn_metadata, hca: str = "tiled", fallback=None,
    graph_mode: str | None = None,
):  # fmt: skip
    """The body of the patched ``DeepseekCompressor.forward`` (``attn_metadata``: the forward context's dict;
    ``graph_mode``: the name of its ``cudagraph_runtime_mode``, which with a capturing stream decides the path
    the step records: :func:`recorded_decode`).

    Returns ``fallback(...)``'s result when the layer is one the ops do not cover (MXFP4 indexer cache, plain
    full-cache layouts, a builder that was not patched)."""
    state_meta = attn_metadata[module.state_cache.prefix]
    step = getattr(state_meta, STEP_ATTR, None)
    k_cache_layer = module._static_forward_context[module.k_cache_prefix]
    kv_cache = k_cache_layer.kv_cache
    cos_sin_cache = rotary_emb.cos_sin_cache
    reason = "the metadata builder was not patched" if step is None else None  # (or vLLM's profiling metadata)
    reason = reason or _unsupported(module, kv_score, kv_cache, cos_sin_cache)
    if reason is not None:
        if fallback is None:
            raise OpError(f"vllm: {getattr(module, 'prefix', '') or 'compressor'}: {reason}")
        return fallback(module, kv_score, positions, rotary_emb)
    online = hca == "online" and not module.overlap
    scratch = None
    if not module.overlap:
        scratch = _scratch(module)
        if scratch is None:  # built before install(): its scratch would come after vLLM sized the KV cache
            _warn_once(
                f"dsv4_compressor: {getattr(module, 'prefix', '') or 'an HCA compressor'} was built before "
                "install() (no scratch allocated at model init): it keeps vLLM's own kernels"
            )
            if fallback is None:
                raise OpError("vllm: an HCA layer built before install() has no scratch")
            return fallback(module, kv_score, positions, rotary_emb)
    out_slot = attn_metadata[module.k_cache_prefix].slot_mapping
    # The first layer of the group builds the step's plan, in every forward pass: vLLM warms up and then
    # captures a CUDA graph on the same metadata, and the capture must contain the build. The group's other
    # layers reuse it. A layer that brings other tensors (a metadata object vLLM copied for another group with
    # update_block_table, another compressed-KV slot mapping) rebuilds: the buffers are the group's, and the
    # layers run in order on one stream.
    source = (state_meta, out_slot)
    same = step.source is not None and all(a is b for a, b in zip(step.source, source))
    if step.owner is None or step.owner is module or not same:
        capturing = _planner._capturing(step.planner.device)
        step.build(
            positions, state_meta.token_to_req_indices, state_meta.block_table, state_meta.slot_mapping, out_slot,
            ratio=module.compress_ratio, online=online,
            num_bank_slots=module.state_cache.kv_cache.shape[0] if online else None,
            replays_any_batch=not _planner.recorded_decode(True, graph_mode=graph_mode, capturing=capturing),
        )  # fmt: skip
        step.source = source
        if step.owner is None:
            step.owner = module
    compress_layer(
        step, kv_score, kind=_layer_kind(module, kv_cache), ape=module.ape, norm_weight=module.norm.weight,
        eps=module.rms_norm_eps, cos_sin_cache=cos_sin_cache, state_cache=module.state_cache.kv_cache,
        kv_cache=kv_cache, scratch=scratch,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Memory: online HCA banks against vLLM's C128 state
# ---------------------------------------------------------------------------------------------------------------
def online_hca_state_bytes(
    *, head_dim: int = 512, ratio: int = 128, block_size: int = 8, mtp_step: int = 3, page_align: int = 576
) -> dict[str, int]:
    """State bytes per request and HCA layer: vLLM's C128 state against the online banks.

    vLLM keeps the C128 state as a sliding-window group (window ``r``) in blocks of ``block_size`` rows of
    ``[kv | score + ape]`` fp32 (``2W = 2H`` floats: 1,024 at H = 512), each block padded to ``page_align``
    bytes. A step of ``S = mtp_step + 1`` rows needs the ``r - 1`` positions before it and its own ``S``, so a
    request holds the blocks of ``r - 1 + S`` consecutive positions: ``ceil(n / bs)`` or one more, by alignment.
    The online state is ``S`` banks of ``(max, sum, weighted sum)`` per channel: ``S * 3 * H`` fp32.

    At V4 shapes and mtp_step 3: 131 positions, 17-18 blocks of 32,832 bytes = 558,144-590,976 bytes
    (545-577 KiB) against 24,576 bytes (24 KiB): 22.7-24x less, 521-553 KiB saved per request and layer
    (V4-Flash's 20 HCA layers: 10.2-10.8 MiB per request).
    """
    cfg = dataclasses.replace(CompressorConfig.hca(), head_dim=head_dim, ratio=ratio)
    steps = mtp_step + 1
    row_bytes = cfg.state_row_bytes
    page_bytes = -(-block_size * row_bytes // page_align) * page_align
    positions = ratio - 1 + steps
    blocks_min = math.ceil(positions / block_size)
    blocks_max = (positions + block_size - 2) // block_size + 1
    online = cfg.online_bank_bytes(mtp_step)
    return dict(
        positions=positions,
        page_bytes=page_bytes,
        blocks_min=blocks_min,
        blocks_max=blocks_max,
        vllm_min=blocks_min * page_bytes,
        vllm_max=blocks_max * page_bytes,
        online=online,
        saved_min=blocks_min * page_bytes - online,
        saved_max=blocks_max * page_bytes - online,
    )
