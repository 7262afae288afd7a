"""``install()`` / ``uninstall()`` / the ``sglang.srt.plugins`` entry point: what is patched in SGLang, and the
backend's constructor (refusals, per-layer layouts, the buffers)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
from types import ModuleType
from typing import Any

import torch

from .adapter import (
    SGLangCompressor,
)
from .memory import _counting_profile
from .metadata import (
    PROJECTIONS,
    verify_step,
)
from .online import NO_BANKS, online_patches, pool_banks
from .projection import (
    join_c4_weights,
    model_dims,
)
from .settings import (
    HISPARSE_REFUSAL,
    SGLangModeNotSupported,
    SGLangNotInstalled,
    _env,
    refusals_from_environment,
    refusals_from_settings,
    scratch_rows_for,
    settings_of,
)

#: The SGLang modules :func:`install` patches (paths relative to the ``sglang`` package as in docs/INTEGRATION.md).
MODULES = {
    "compressor_v2": "sglang.srt.layers.attention.dsv4.compressor_v2",
    "deepseek_v4_backend": "sglang.srt.layers.attention.deepseek_v4_backend",
    "kv_cache_configurator": "sglang.srt.mem_cache.kv_cache_configurator",
}


# ---------------------------------------------------------------------------------------------------------------
# install()
# ---------------------------------------------------------------------------------------------------------------
_ADAPTER_ATTR = "_dsv4c_sglang_adapter"
_installed: dict[str, Any] | None = None

#: ``c{r}_out_loc`` of the step being built: the backend's builders make ``core_attn_metadata`` (with the out
#: locations, encoder-SWA bounded replay's rows routed to slot 0 included) before they call the planner, which has
#: no argument for it; ``install`` wraps ``make_core_attn_metadata`` to publish it here, scoped to each builder.
_CORE = contextvars.ContextVar("dsv4c_sglang_core", default=None)

#: The SGLang modules ``install(hca="online")`` patches besides :data:`MODULES` (the C128 pool and its sizing).
ONLINE_MODULES = {
    "deepseek_v4_memory_pool": "sglang.srt.mem_cache.deepseek_v4_memory_pool",
    "pool_configurator": "sglang.srt.model_executor.pool_configurator",
}


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
    ``select_dsv4_kv_layout`` (refuses, when the pool is built, the layouts it does not write: V4.1 FP4
    compressed records) and
    ``KVCacheConfigurator._profile_available_bytes`` (the KV budget less :func:`scratch_bytes_for` and
    :func:`projection_bytes_for`, for a DeepSeek-V4 target runner: what the backends allocate later is counted
    where SGLang sizes its KV cache). ``projection``: ``"auto"`` (the default: our projection on the steps where
    it is faster than cuBLAS, :meth:`SGLangCompressor.projection_for`) or ``"engine"`` (SGLang's GEMM always);
    another value is refused here. Refuses at once what the environment tells (:func:`refusals_from_environment`;
    ``check_environment=False`` skips it, for tests). ``hca="online"``: the online HCA banks live in SGLang's own
    C128 ``CompressStatePool`` in place of the ring, sized for the banks where SGLang sizes the ring, so its KV
    sizing turns the freed bytes into tokens; its PD transfer, clears and EAGLE cleanup handle them as banks
    (:mod:`.online`); the backend's constructor refuses a pool whose C128 layers hold no banks.
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
    if check_environment:
        refused = refusals_from_environment()
        if refused:
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
    runtime = sys.modules.get("sglang.srt.runtime_context")
    if modules is None and getattr(runtime and runtime.get_context(), "_server_args", None) is not None:
        # SGLang has published the settings it runs with in this process: refuse what they select now
        refused = refusals_from_settings(settings_of(None))
        if refused:
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
    mods = dict(modules) if modules is not None else _import_sglang()
    if hca == "online":
        for key, path in ONLINE_MODULES.items():
            if key not in mods and modules is None:
                mods[key] = importlib.import_module(path)
        if getattr(mods.get("deepseek_v4_memory_pool"), "DeepSeekV4TokenToKVPool", None) is None:
            raise SGLangModeNotSupported(
                "dsv4_compressor.sglang: hca='online' keeps the banks in SGLang's C128 CompressStatePool: it needs "
                "sglang.srt.mem_cache.deepseek_v4_memory_pool (DeepSeekV4TokenToKVPool) among the modules"
            )
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
    if hca == "online":  # the banks in SGLang's C128 pool, sized, transferred and cleared as banks (.online)
        bank_patches, bank_wrappers = online_patches(pool_mod, mods.get("pool_configurator"))
        for owner, name, value in bank_patches:
            patch(owner, name, value)
        wrappers.update(bank_wrappers)

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
#: C128 ring, the tiled HCA kernel), ``single`` (the ring, the single-stage kernel), ``online`` (online HCA banks
#: in SGLang's C128 pool: ``install(hca="online")``), ``off`` / unset (inert).
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
    kernels = {"ring": "tiled", "tiled": "tiled", "single": "single", "1": "tiled", "on": "tiled", "online": "tiled"}
    if mode not in kernels:
        raise SystemExit(f"{PLUGIN_ENV}={mode!r}: expected one of off, ring (tiled), single, online")
    projection = _env(PROJECTION_ENV) or "auto"
    if projection not in PROJECTIONS:
        raise SystemExit(f"{PROJECTION_ENV}={projection!r}: expected one of {', '.join(PROJECTIONS)}")
    try:
        online = dict(hca="online") if mode == "online" else {}  # ring: install()'s default
        install(**online, hca_kernel=kernels[mode], projection=projection)
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
    """The backend's constructor: refuse what the settings SGLang runs with select (:func:`settings_of` of the
    runner's server arguments), then give it its adapter with the HCA scratch and the projection workspaces
    allocated from those settings and the model config, before any CUDA graph is captured (SGLang builds its
    backends before it captures). After SGLang's constructor: HiSparse and the FP4 indexer cache are refused, each
    compressor layer's page layout is read from the pool (:func:`layer_layout`: V4, V41, V41_NEW and uniform FP8
    layers are written in their layout, any other layer refuses the backend with the layer and the reason), and a
    backend whose pool has no compressor layer (a draft runner's: every MTP / NextN layer has ratio 0) gets nothing
    allocated."""

    @functools.wraps(init)
    def __init__(self, model_runner, *args, **kwargs):
        server_args = getattr(model_runner, "server_args", None)
        settings = None
        if server_args is not None:
            settings = settings_of(server_args)
            refused = refusals_from_settings(settings)
            if refused:
                raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
        init(self, model_runner, *args, **kwargs)
        if getattr(self, "enable_deepseek_v4_fp4_indexer", False):
            raise SGLangModeNotSupported(
                "dsv4_compressor.sglang: the FP4 indexer cache (enable_deepseek_v4_fp4_indexer) is not supported"
            )
        pool = getattr(self, "token_to_kv_pool", None)
        if getattr(self, "hisparse_coordinator", None) is not None or _hisparse_pool(pool):
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + HISPARSE_REFUSAL)
        adapter = adapter_of(self)
        refused = adapter.check_layouts(pool)
        if adapter.hca == "online":
            refused += _bank_refusals(pool, adapter)
        if refused:
            raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " + "; ".join(refused))
        dims = model_dims(getattr(model_runner, "model_config", None))
        ratios = _compressor_ratios(self, pool, dims)
        adapter.compressor_ratios = ratios
        if settings is None or not ratios:
            return  # no compressor layer (a draft model's MTP layers): no scratch, no workspace
        device = getattr(self, "device", None) or getattr(model_runner, "device", "cpu")
        requests = getattr(model_runner, "max_running_requests", None)  # this rank's, after the KV sizing
        requests = requests if isinstance(requests, int) and not isinstance(requests, bool) else None
        rows = scratch_rows_for(settings, adapter.draft_tokens, max_running_requests=requests)
        if adapter.hca_kernel == "tiled" and any(r > 4 for r in ratios):
            adapter.scratch_rows = max(adapter.scratch_rows, rows)
            adapter.allocate_scratch(device)
        # the projection workspaces, from the same limits (projection_bytes_for counts them so)
        if adapter.projection == "auto" and dims is not None:
            adapter.allocate_projection(device, max_rows=rows, **{**dims, "ratios": ratios})
        # each C4 layer's two projection weights as one tensor's halves: one GEMM for both (paired_kv_score); not
        # under SGLang's memory saver, whose weight region the joint tensors would be allocated outside of (a
        # release would keep them, a resume would not restore them)
        model = getattr(model_runner, "model", None)
        saver = getattr(model_runner, "memory_saver_adapter", None)
        if adapter.projection == "auto" and 4 in ratios and isinstance(model, torch.nn.Module):
            if getattr(saver, "enabled", False):
                adapter.join_refused = "SGLang's memory saver is on: the weights stay as SGLang allotted them"
            else:
                adapter.joined_layers = join_c4_weights(model)

    return __init__


def _bank_refusals(pool, adapter) -> list[str]:
    """Under ``hca="online"``: each C128 layer's state pool must hold online banks (:mod:`.online`), at least
    the backend's draft count of them. The adapter then reads them from the pool (``require_pool_banks``)."""
    out = []
    pools = getattr(pool, "compress_state_pools", None) or ()
    for layer_id, item in enumerate(getattr(pool, "layer_mapping", None) or ()):
        if item is None or int(item[0]) <= 4:
            continue
        state = pools[layer_id] if layer_id < len(pools) else None
        banks = pool_banks(state)
        if banks is None:
            out.append(NO_BANKS.format(layer=layer_id))
        elif banks < adapter.draft_tokens:
            out.append(f"layer {layer_id}: the C128 pool holds {banks} online banks per request, the backend runs "
                       f"{adapter.draft_tokens} draft tokens (SGLang's published draft count changed after the pool "
                       "was built?)")  # fmt: skip
    adapter.require_pool_banks = True
    return out


def _compressor_ratios(backend, pool, dims) -> tuple[int, ...]:
    """The compressor ratios (4, and the HCA ratio: 128) the backend's pool has layers of (SGLang's
    ``present_ratios``; the model config's ``compress_ratios`` where the pool does not say)."""
    present = getattr(backend, "present_ratios", None)
    if present is None:
        present = getattr(pool, "present_ratios", None)
    if present is None:
        present = dims["ratios"] if dims is not None else (4, 128)
    return tuple(sorted(int(r) for r in set(present) if int(r) >= 4))  # 4: CSA; above: HCA (SGLang: 128)


def _hisparse_pool(pool) -> bool:
    mapping = getattr(pool, "layer_mapping", None) or ()
    return any(item is not None and hasattr(item[2], "translate_loc_to_hisparse_device") for item in mapping)


def _checked_layout(select):
    @functools.wraps(select)
    def select_dsv4_kv_layout(*args, **kwargs):
        layout = select(*args, **kwargs)
        main, option = layout if isinstance(layout, tuple) else (layout, None)
        name = str(getattr(main, "name", main)).upper()
        if name not in ("V4", "V41", "V41_NEW"):
            raise SGLangModeNotSupported(
                f"dsv4_compressor.sglang: SGLang selected the {name} KV layout; the adapter writes the V4 and V4.1 "
                "(V41, V41_NEW) records only: set SGLANG_DSV4_KV_LAYOUT=v4, v41 or v41_new, or do not install it"
            )
        if name != "V4" and str(option or "").lower() == "fp4":
            raise SGLangModeNotSupported(
                f"dsv4_compressor.sglang: SGLang selected the {name} KV layout with V4.1 FP4 compressed records "
                "(SGLANG_DSV4_COMPRESSED_KV_LAYOUT=fp4), which the adapter does not write: unset it (auto keeps "
                "the compressors' ratios 4 and 128 in FP8 V4.1 records) or do not install the adapter"
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
