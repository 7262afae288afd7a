"""Online HCA in vLLM: the C128 state group as vLLM's own ``CircularBufferSpec`` (one block per request for its
lifetime, never prefix cached, no slot mapping), sized for one request's banks, and what vLLM must provide for it.

A C128 ``CompressorStateCache`` then declares ``CircularBufferSpec(block_size=mtp_step + 1, num_kv_heads=1,
head_size=3 * H, head_size_v=0, dtype=float32)``: a page of ``mtp_step + 1`` banks of ``(max, sum, weighted
sum) x H`` float32 (:meth:`~dsv4_compressor.config.CompressorConfig.online_bank_bytes`), vLLM's class itself (its
NIXL connector checks the exact type). The state cache's tensor is vLLM's view ``[blocks, banks, 3H]`` of the
shared cache allocation, whose block stride is the whole block (block-outermost layouts pack every group's page
of a block together), so the banks reach the op as a strided view (:func:`~.layer.online_bank_view`). A request's
banks are its one block, ``block_table[req, 0]``; the worker gives such a group an all-padding slot mapping, so the
plan takes the request's rows from ``token_to_req_indices`` and treats a row whose request holds the null block 0
(a padded request, a dummy batch) as padding, as vLLM's V4.1 compressor builder does.

Refused (:class:`~.patching.VllmModeNotSupported`, with the reason): a vLLM without ``CircularBufferSpec``; the
hybrid KV-cache manager disabled (vLLM would unify the groups into full-attention specs, which a request-scoped
block is not); a KV block size that is not a multiple of 128 (prefix-cache hits land on block multiples, and the
banks carry no checkpoint: a hit must land where no HCA group is open).
"""

from __future__ import annotations

import dataclasses

import torch

from ...config import CompressorConfig

#: The ratio whose state group becomes request-scoped, and the one whose groups a prefix hit must not split.
HCA_RATIO = 128


def circular_buffer_spec_cls():
    """vLLM's ``CircularBufferSpec`` class, or ``None`` where this vLLM has none."""
    try:
        from vllm.v1.kv_cache_interface import CircularBufferSpec
    except ImportError:
        return None
    return CircularBufferSpec


def mtp_step_of(vllm_config) -> int:
    """``num_speculative_tokens`` of a ``VllmConfig`` (0 without speculation)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0


def online_refusal(vllm_config=None) -> str | None:
    """Why this vLLM (and, given one, this ``VllmConfig``) cannot run online HCA; ``None`` when it can."""
    if circular_buffer_spec_cls() is None:
        return "this vLLM has no CircularBufferSpec (vllm.v1.kv_cache_interface), the request-scoped spec of the banks"
    if vllm_config is None:
        return None
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler, "disable_hybrid_kv_cache_manager", False):
        return (
            "the hybrid KV-cache manager is disabled (--disable-hybrid-kv-cache-manager, or a setting that turns it "
            "off): vLLM would turn the request-scoped C128 state group into full-attention blocks"
        )
    cache = getattr(vllm_config, "cache_config", None)
    block = getattr(cache, "block_size", None)
    if block is not None and int(block) % HCA_RATIO != 0:
        return (
            f"the KV block size {block} is not a multiple of {HCA_RATIO}: a prefix-cache hit could land inside an "
            "HCA group, and the banks keep no checkpoint of an open group"
        )
    return None


def is_c128_state(state_cache) -> bool:
    """A vLLM 0.33 ``CompressorStateCache`` of an HCA layer (ratio 128: blocks of 8 rows, window 128)."""
    return getattr(state_cache, "sliding_window", None) == HCA_RATIO


def bank_spec(state_cache, vllm_config):
    """The ``CircularBufferSpec`` of an HCA layer's state: one block of ``mtp_step + 1`` banks per request."""
    cls = circular_buffer_spec_cls()
    head = int(state_cache.state_dim) // 2  # [kv | score] rows of a non-overlapping kind: 2H floats
    banks = mtp_step_of(vllm_config) + 1
    spec = cls(block_size=banks, num_kv_heads=1, head_size=3 * head, head_size_v=0, dtype=torch.float32)
    want = dataclasses.replace(CompressorConfig.hca(), head_dim=head).online_bank_bytes(banks - 1)
    if spec.page_size_bytes != want:  # vLLM sizes its pages another way than this vLLM's did
        raise RuntimeError(f"vllm: CircularBufferSpec pages are {spec.page_size_bytes} bytes, the banks {want}")
    return spec


__all__ = ["HCA_RATIO", "bank_spec", "circular_buffer_spec_cls", "is_c128_state", "mtp_step_of", "online_refusal"]
