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

KV transfer (``kv_transfer_config``, disaggregated prefill / decode). vLLM's NIXL pull connector sends a
``CircularBufferSpec`` group's block as it sends any attention group's (``NixlBaseConnectorScheduler.
get_exchange_clipped_blocks`` keeps it, the worker's descriptors cover the whole packed block), so the banks move
byte for byte into the decode node's block (tests/test_engine_vllm_transfer.py). The decode node then recomputes
the prompt's last token (``Scheduler._update_waiting_for_remote_kv``: ``num_computed_tokens = num_tokens - 1``), a
restart one position back, so under KV transfer the group holds at least 2 banks (:func:`bank_count`), also
without speculation. Refused there: any other connector (vLLM's offloading connectors store prefix-cacheable groups
only, so a loaded hit resumes without its banks; the others are not checked), and NIXL's host staging
(``kv_buffer_device='cpu'`` on a GPU), which copies a block to the host only in the step that allocates it.
Prefill and decode nodes must run the same ``num_speculative_tokens`` (the banks' count and layout), which NIXL's
handshake does not compare.
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


#: The connectors whose transfer of a ``CircularBufferSpec`` block is checked (NIXL's pull mode; ``NixlConnector``
#: is vLLM's name for it).
TRANSFER_CONNECTORS = ("NixlConnector", "NixlPullConnector")


def kv_transfer_of(vllm_config):
    """The ``kv_transfer_config`` of a ``VllmConfig`` that names a connector, else ``None``."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return transfer if getattr(transfer, "kv_connector", None) else None


def bank_count(vllm_config) -> int:
    """Banks per request: ``mtp_step + 1``, at least 2 under KV transfer, where the decode node restarts a loaded
    request one position back (it recomputes the prompt's last token) and needs the state before it."""
    banks = mtp_step_of(vllm_config) + 1
    return max(banks, 2) if kv_transfer_of(vllm_config) is not None else banks


def _transfer_refusal(transfer) -> str | None:
    name = transfer.kv_connector
    if name not in TRANSFER_CONNECTORS:
        return (
            f"kv_transfer_config names {name}: only NIXL's pull connector ({' / '.join(TRANSFER_CONNECTORS)}) is "
            "checked to carry the request-scoped C128 bank block (vLLM's offloading connectors store "
            "prefix-cacheable groups only, so a request loaded from them would resume without its banks)"
        )
    if getattr(transfer, "kv_buffer_device", None) == "cpu" and _platform_device() != "cpu":
        return (
            "kv_transfer_config stages NIXL transfers through host memory (kv_buffer_device='cpu'), which copies a "
            "block to the host only in the step that allocates it: the banks of a prompt prefilled in several "
            "chunks would travel stale"
        )
    return None


def _platform_device() -> str | None:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return getattr(current_platform, "device_type", None)


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
    transfer = kv_transfer_of(vllm_config)
    return None if transfer is None else _transfer_refusal(transfer)


def is_c128_state(state_cache) -> bool:
    """A vLLM 0.33 ``CompressorStateCache`` of an HCA layer (ratio 128: blocks of 8 rows, window 128)."""
    return getattr(state_cache, "sliding_window", None) == HCA_RATIO


def bank_spec(state_cache, vllm_config):
    """The ``CircularBufferSpec`` of an HCA layer's state: one block of :func:`bank_count` banks per request (its
    ``block_size``; the layer counts the banks of a block from the block's floats)."""
    cls = circular_buffer_spec_cls()
    head = int(state_cache.state_dim) // 2  # [kv | score] rows of a non-overlapping kind: 2H floats
    banks = bank_count(vllm_config)
    spec = cls(block_size=banks, num_kv_heads=1, head_size=3 * head, head_size_v=0, dtype=torch.float32)
    want = dataclasses.replace(CompressorConfig.hca(), head_dim=head).online_bank_bytes(banks - 1)
    if spec.page_size_bytes != want:  # vLLM sizes its pages another way than this vLLM's did
        raise RuntimeError(f"vllm: CircularBufferSpec pages are {spec.page_size_bytes} bytes, the banks {want}")
    return spec


__all__ = [
    "HCA_RATIO",
    "TRANSFER_CONNECTORS",
    "bank_count",
    "bank_spec",
    "circular_buffer_spec_cls",
    "is_c128_state",
    "kv_transfer_of",
    "mtp_step_of",
    "online_refusal",
]
