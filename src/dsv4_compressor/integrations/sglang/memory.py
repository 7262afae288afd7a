"""Memory accounting: the device bytes the adapter allocates outside SGLang's KV pool, subtracted where SGLang
sizes it (``KVCacheConfigurator._profile_available_bytes``), and what ``hca="online"`` would save."""

from __future__ import annotations

import dataclasses
import functools

from ...config import CompressorConfig
from .projection import (
    model_dims,
    projection_workspaces,
)
from .settings import (
    SGLangModeNotSupported,
    _settings,
    compressor_backends_for,
    refusals_from_settings,
    scratch_rows_for,
    settings_of,
)


def projection_bytes_for(server_args, model_config, *, projection: str = "auto") -> int:
    """Bytes of projection workspaces the adapter allocates in one SGLang process under ``server_args`` (a
    ``ServerArgs`` or :class:`SGLangSettings`; resolved values) for SGLang's ``model_config``: every backend of
    :func:`compressor_backends_for` (the draft backends' MTP layers have no compressor and get none) gets
    :func:`projection_workspaces` for steps up to :func:`scratch_rows_for` rows (the largest step SGLang runs on
    one rank); 0 with ``projection="engine"`` or without a hidden size. :func:`install` subtracts it, with
    :func:`scratch_bytes_for`, from the KV budget SGLang profiles."""
    if projection != "auto":
        return 0
    dims = model_dims(model_config)
    if dims is None:
        return 0
    settings = _settings(server_args)
    rows = scratch_rows_for(settings)
    per_backend = sum(numel for numel, _ in projection_workspaces(max_rows=rows, **dims).values())
    return compressor_backends_for(settings) * per_backend * 4


def scratch_bytes_for(server_args, *, hca_kernel: str = "tiled", scratch_rows: int = 0, head: int = 512,
                      ratios=(4, 128)) -> int:  # fmt: skip
    """Bytes of HCA scratch the adapter allocates in one SGLang process under ``server_args`` (a ``ServerArgs``
    or :class:`SGLangSettings`): every backend of :func:`compressor_backends_for` gets float32 ``[rows, head]``
    with ``rows = max(scratch_rows,`` :func:`scratch_rows_for` ``)``; 0 with ``hca_kernel="single"`` or a model
    without C128 layers (``ratios``: its ``compress_ratios``). :func:`install` subtracts it from the KV budget
    SGLang profiles (``KVCacheConfigurator._profile_available_bytes``)."""
    if hca_kernel != "tiled" or not any(int(r) > 4 for r in ratios):
        return 0
    settings = _settings(server_args)
    rows = max(int(scratch_rows), scratch_rows_for(settings), 1)
    return compressor_backends_for(settings) * rows * head * 4


def _counting_profile(profile, options, is_dsv4):
    """``KVCacheConfigurator._profile_available_bytes`` (the KV budget SGLang turns into token counts, once per
    process, on the target runner: draft runners take the target's pool config) less the HCA scratch and the
    projection workspaces the adapter allocates later, in the backends' constructors, for a DeepSeek-V4 model,
    sized from the settings SGLang runs with (:func:`settings_of`). A mode the adapter refuses is refused here,
    the first point after SGLang's resolution where the server's sizes are decided."""

    @functools.wraps(profile)
    def _profile_available_bytes(self, *args, **kwargs):
        available = profile(self, *args, **kwargs)
        server_args = getattr(self, "server_args", None)
        model_config = getattr(self, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        if server_args is None or getattr(self, "is_draft_worker", False):
            return available
        if is_dsv4 is not None and not is_dsv4(hf_config):
            return available
        settings = settings_of(server_args)
        refused = refusals_from_settings(settings)
        if refused:
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
        dims = model_dims(model_config)
        ratios = dims["ratios"] if dims is not None else (4, 128)
        kernel, rows = options["hca_kernel"], options["scratch_rows"]
        scratch = scratch_bytes_for(settings, hca_kernel=kernel, scratch_rows=rows, ratios=ratios)
        projection = projection_bytes_for(settings, model_config, projection=options["projection"])
        return available - scratch - projection

    return _profile_available_bytes


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
    cfg = dataclasses.replace(CompressorConfig.hca(), head_dim=head_dim, ratio=ratio)
    ring = ratio if draft_tokens <= 1 else 2 * ratio
    ring_bytes = ring * cfg.state_row_bytes
    online_bytes = cfg.online_bank_bytes(draft_tokens - 1)
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
