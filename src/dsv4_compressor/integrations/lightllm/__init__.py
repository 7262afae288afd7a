"""LightLLM (``ModelTC/LightLLM``, branch ``support_ds4``): DeepSeek-V4's compressors as our ops.

Turn it on by starting LightLLM through the launcher, with LightLLM's own arguments::

    python -m dsv4_compressor.integrations.lightllm [--dsv4c tiled|single|online|off] <LightLLM's arguments>

or, from a launch script of one's own, at its top level (spawned processes re-run only that)::

    from dsv4_compressor.integrations import lightllm as dsv4c_lightllm
    dsv4c_lightllm.install()                      # LightLLM's C128 ring state, tiled HCA kernel
    dsv4c_lightllm.install(online_hca=True)       # online HCA banks in place of the C128 ring

What it patches, what it builds per step and per layer, the memory it gives back and the modes it refuses:
docs/INTEGRATION.md (LightLLM). The modules, in the order a step runs them:

* :mod:`.layout`: LightLLM's pool constants and :class:`LightLLMLayout`, read off its memory manager;
* :mod:`.step`: :class:`StepBuilder`, once per step, the plans and state-row tables on the device;
* :mod:`.layer`: the replacements of ``CompressorInfer.compress`` and ``write_indexer_k``, one op per layer;
* :mod:`.banks`: the online HCA banks (allotment, views, PD transfer, what they save);
* :mod:`.patching`: the modes, :func:`install` / :func:`uninstall`, the import hook and the launcher.

Checked against stand-ins of LightLLM's classes and buffers (``tests/test_integration_lightllm.py``), not
against LightLLM itself (it is not on PyPI).
"""

from ... import ops  # noqa: F401  (adapter.ops: the ops the adapter calls; tests patch their policy through it)
from .banks import (
    allot_online_hca_banks,
    c128_state_banks,
    move_pd_banks,
    online_hca_memory_report,
    online_hca_savings,
)
from .layer import (
    compress_layer,
    compress_layer_from_hidden,
    compressor_compress,
    join_c4_weights,
    projection_weight,
    write_indexer_k,
)
from .layout import INDEXER_PACK, PROJECTION_ENV, PROJECTIONS, LightLLMLayout
from .patching import (
    ENV_VAR,
    MODES,
    OFF,
    START_ARGS_ENV,
    LightLLMModeNotSupported,
    LightLLMNotInstalled,
    check_engine_modes,
    engine_start_args,
    install,
    install_from_environment,
    install_on_import,
    main,
    uninstall,
)
from .step import StepBuilder

__all__ = [
    "LightLLMLayout",
    "StepBuilder",
    "compress_layer",
    "compress_layer_from_hidden",
    "compressor_compress",
    "projection_weight",
    "join_c4_weights",
    "write_indexer_k",
    "allot_online_hca_banks",
    "c128_state_banks",
    "online_hca_savings",
    "online_hca_memory_report",
    "move_pd_banks",
    "engine_start_args",
    "check_engine_modes",
    "install",
    "install_on_import",
    "install_from_environment",
    "uninstall",
    "main",
    "LightLLMNotInstalled",
    "LightLLMModeNotSupported",
    "INDEXER_PACK",
    "ENV_VAR",
    "PROJECTIONS",
    "PROJECTION_ENV",
    "MODES",
    "OFF",
    "START_ARGS_ENV",
]
