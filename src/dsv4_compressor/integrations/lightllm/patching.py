"""Patching LightLLM: its modes and start arguments, the install / uninstall, the import hook, the launcher."""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.abc
import json
import os
import sys
import types
import weakref

from ...errors import CapacityError, EngineModeNotSupported
from . import layer
from .banks import allot_online_hca_banks, move_pd_banks
from .layer import join_c4_weights
from .layout import (
    _BANKS,
    PROJECTION_ENV,
    PROJECTIONS,
    LightLLMLayout,
    LightLLMNotInstalled,
    _engine_constants,
    _hidden_size,
)
from .step import StepBuilder

#: The launcher's switch, inherited by every process LightLLM spawns: tiled (default) | single | online | off.
ENV_VAR = "DSV4C_LIGHTLLM"
#: ``DSV4C_LIGHTLLM`` values and the :func:`install` options they stand for.
MODES = {"tiled": {}, "single": {"c128_kernel": "single"}, "online": {"online_hca": True}}
OFF = "off"
#: Where LightLLM keeps its final start arguments (JSON) for the processes it spawns (``envs_utils.py`` L35-38).
START_ARGS_ENV = "LIGHTLLM_START_ARGS"


class LightLLMModeNotSupported(EngineModeNotSupported):
    """A LightLLM mode the adapter cannot serve, refused at install; the message names it and what to do."""


def engine_start_args() -> dict | None:
    """LightLLM's start arguments as it hands them to its processes (``$LIGHTLLM_START_ARGS``), or ``None``
    before LightLLM has set them (the launch process, before ``launch_server``)."""
    raw = os.environ.get(START_ARGS_ENV)
    return json.loads(raw) if raw else None


def check_engine_modes(args, *, online_hca: bool = False) -> None:
    """Refuse the LightLLM modes the adapter cannot serve (``args``: LightLLM's start arguments, a mapping).

    Refused: ``--diverse_mode``. Its slave requests take the master's full slots up to the prompt's length
    and nothing else (``DiversehBackend._copy_master_req_to_slave_req``, ``diverse_backend/impl.py`` L200-215):
    the request-scoped C128 state of the slave's slot (ring rows or online banks) is never copied, and master
    and slave continue in the master's last SWA page, whose next slot both derive from the shared previous token
    (``alloc_swa_decode``, mem manager L887-894), so their C4 state rows collide too.

    Served, with nothing to carry: radix prefix reuse and the resume of a paused request (LightLLM matches at
    multiples of 256 tokens, ``infer_batch.py`` L740-760), ``--enable_cpu_cache`` (restores at checkpoint
    boundaries, multiples of 256 tokens, mem manager L647-682), ``--enable_dp_prompt_cache_fetch`` (copies
    whole 256-token pages between DP ranks, ``dp_shared_kv_trans.py`` L80-152): a length that is a multiple of
    128 leaves no HCA group open, so neither the ring nor the banks are read there. PD disaggregation
    (``--run_mode prefill`` / ``decode``) moves LightLLM's own ring rows, and :func:`move_pd_banks` the online
    banks. ``online_hca`` is accepted for the signature's sake: today both HCA paths refuse the same modes.
    """
    del online_hca
    if args.get("diverse_mode"):
        raise LightLLMModeNotSupported(
            "dsv4_compressor (LightLLM adapter): --diverse_mode is not supported with DeepSeek-V4: LightLLM gives a "
            "slave request the master's token slots but not the master's request-scoped C128 compressor state, and "
            "both continue in the master's last SWA page (their C4 state rows collide), so the compressed entries of "
            "slave requests would be pooled from another request's rows. Start LightLLM without --diverse_mode."
        )


# ---------------------------------------------------------------------------------------------------------------
# Patching LightLLM
# ---------------------------------------------------------------------------------------------------------------
_LAYER_MODULE = "lightllm.models.deepseek_v4.layer_infer.transformer_layer_infer"
_STATE_MODULE = "lightllm.models.deepseek_v4.infer_struct"
_MEM_MODULE = "lightllm.common.kv_cache_mem_manager.deepseek4_mem_manager"
_MODEL_MODULE = "lightllm.models.deepseek_v4.model"
#: The LightLLM modules the adapter patches.
_MODULES = (_LAYER_MODULE, _STATE_MODULE, _MEM_MODULE, _MODEL_MODULE)
#: (class, attribute) -> the original, for uninstall() and so that install() twice does not wrap twice.
_ORIGINALS: dict[tuple[type, str], object] = {}
#: The memory manager's methods the adapter replaces in every mode, and those only online HCA replaces.
_MEMORY_METHODS = ("get_fixed_memory_size", "_init_buffers")
_PD_METHODS = ("write_mem_to_page_kv_move_buffer", "read_page_kv_move_buffer_to_mem")
#: Marks an attribute the patched class inherited (uninstall() deletes the patch instead of restoring it).
_INHERITED = object()
#: The builder each memory manager's ``_init_buffers`` allotted (kept off the manager: LightLLM pickles its
#: managers for the PD and DP transfer processes, which need the banks but not the per-step buffers).
_BUILDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: ``model._dsv4c_builder`` before the model's first step.
_UNSET = object()


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise LightLLMNotInstalled(
            f"dsv4_compressor.integrations.lightllm.install(): cannot import {name} ({err}); install LightLLM from "
            f"ModelTC/LightLLM, branch support_ds4, in this environment"
        ) from err


def _patch(cls: type, name: str, make) -> None:
    """Replace ``cls.name`` by ``make(original)``; the original is kept once (install() twice wraps once)."""
    key = (cls, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = cls.__dict__.get(name, _INHERITED)
    original = _ORIGINALS[key]
    setattr(cls, name, make(getattr(cls.__mro__[1], name) if original is _INHERITED else original))


def _restore(which) -> None:
    for cls, name in [key for key in _ORIGINALS if which(*key)]:
        original = _ORIGINALS.pop((cls, name))
        if original is _INHERITED:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def _has_compressor_layers(model) -> bool:
    """Whether any of the model's layers compresses (LightLLM's MTP draft model has one SWA-only layer,
    ``deepseek_v4_mtp/model.py`` L94-95, and shares the main model's memory manager). A model that does not
    list its layers is taken to compress."""
    layers = getattr(model, "layers_infer", None)
    return layers is None or any(getattr(layer, "compress_ratio", 0) for layer in layers)


def _builder_for_model(model, options: dict) -> StepBuilder | None:
    """The step builder of a LightLLM model at its first step: none for a model without compressor layers, the
    one its memory manager allotted in ``_init_buffers`` (checked against the model's own limits), else a new
    one sized from the model."""
    if not _has_compressor_layers(model):
        return None
    builder = _BUILDERS.get(model.mem_manager)
    if builder is None:
        return StepBuilder.for_model(model, **options)
    rows = StepBuilder.rows_for_model(model, builder.layout.mtp_step)
    microbatches = StepBuilder.microbatches_for_model(model) or 1
    if builder.max_rows < rows or len(builder._sets) < microbatches:
        raise CapacityError(
            f"lightllm adapter: the memory manager's step buffers hold {builder.max_rows} rows and "
            f"{len(builder._sets)} micro-batches, the model needs {rows} and {microbatches} (LightLLM's start "
            f"arguments and the model disagree; pass install(max_rows=..., microbatches=...))"
        )
    return builder


def _planned_builder(mem_manager, options: dict, device) -> StepBuilder | None:
    """The step builder a memory manager allots with its fixed buffers, sized from LightLLM's start arguments
    as its model will size itself (:meth:`StepBuilder.rows_for_model`; ``graph_max_batch_size`` halved under
    decode micro-batch overlap and counted in rows, ``basemodel.py`` L83-87; two micro-batches with decode or
    prefill overlap); ``None`` without start arguments (the model's first step sizes one then) or without
    compressor layers."""
    args = engine_start_args()
    if args is None or (mem_manager.n_c4 == 0 and mem_manager.n_c128 == 0):
        return None
    layout = LightLLMLayout.from_mem_manager(mem_manager)
    mtp = int(args.get("mtp_step") or 0)
    graph = 0 if args.get("disable_cudagraph") else int(args.get("graph_max_batch_size") or 0)
    if args.get("enable_decode_microbatch_overlap"):
        graph //= 2
    stand_in = types.SimpleNamespace(
        batch_max_tokens=args.get("batch_max_tokens"), max_req_num=layout.max_request_num,
        graph_max_batch_size=graph * (mtp + 1),
    )  # fmt: skip
    overlap = args.get("enable_decode_microbatch_overlap") or args.get("enable_prefill_microbatch_overlap")
    opts = dict(options)
    if opts.get("max_rows") is None:
        opts["max_rows"] = StepBuilder.rows_for_model(stand_in, max(mtp, layout.mtp_step))
    if opts.get("microbatches") is None:
        opts["microbatches"] = 2 if overlap else 1
    if opts.get("hidden_size") is None:
        opts["hidden_size"] = _hidden_size(_model_config(args.get("model_dir")))
    return StepBuilder(layout, device=device, **opts)


def _model_config(model_dir) -> dict | None:
    """The model's ``config.json`` (what LightLLM reads into ``model.config``), or ``None``."""
    if not model_dir:
        return None
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _online_bank_bytes(mem_manager) -> int:
    mtp_step = mem_manager.c4_state_ring - _engine_constants(mem_manager)["DSV4_C4_STATE_RING"]
    return mem_manager.n_c128 * (mem_manager.max_request_num + 1) * (mtp_step + 1) * 3 * mem_manager.head_dim * 4


def _patch_memory_manager(cls: type, options: dict) -> None:
    """``get_fixed_memory_size`` (LightLLM sizes its KV cache with it, ``MemoryManager.profile_size``) also counts
    the step builder's buffers, which ``_init_buffers`` then allots; with online HCA both count and allot the
    banks in place of the C128 ring, and the PD page transfer carries them (:func:`move_pd_banks`)."""
    online = bool(options.get("online_hca"))

    def make_fixed(original):
        @functools.wraps(original)
        def get_fixed_memory_size(self):
            # runs before _init_buffers: from the numbers LightLLM's __init__ has set by then
            fixed = _online_bank_bytes(self) if online else original(self)
            builder = _planned_builder(self, options, "meta")
            return fixed + (0 if builder is None else builder.nbytes)

        return get_fixed_memory_size

    def make_init(original):
        @functools.wraps(original)
        def _init_buffers(self, *args, **kwargs):
            if online:
                ring = self.c128_state_ring
                # LightLLM sizes its C128 ring (max_req + 1) * ring + 1 rows: ring 0 leaves the sentinel row only
                self.c128_state_ring = 0
                try:
                    original(self, *args, **kwargs)
                finally:
                    self.c128_state_ring = ring
                if self.n_c128 > 0:
                    # no ring: a LightLLM path that would read it fails at once instead of reading out of bounds
                    # (the PD page copy then skips the C128 state, pd_cache_io.py L214-242)
                    self.c128_state_buffer = None
                    allot_online_hca_banks(self)
            else:
                original(self, *args, **kwargs)
            table = self.full_to_c4_indexs if self.n_c4 > 0 else self.full_to_c128_indexs
            if table is not None:
                builder = _planned_builder(self, options, table.device)
                if builder is not None:
                    _BUILDERS[self] = builder

        return _init_buffers

    def make_pd(direction):
        def make(original):
            @functools.wraps(original)
            def move(self, mem_indexes, page_index, dp_index, mem_managers, dp_world_size, start_kv_index,
                     request_kv_len, page_kind="kv", req_idx=None):  # fmt: skip
                result = original(self, mem_indexes, page_index, dp_index, mem_managers, dp_world_size,
                                  start_kv_index, request_kv_len, page_kind=page_kind, req_idx=req_idx)  # fmt: skip
                owner = mem_managers[dp_index]
                if getattr(owner, _BANKS, None) is not None:
                    move_pd_banks(
                        direction, self, owner, page_index=page_index, start_kv_index=start_kv_index,
                        token_num=len(mem_indexes), request_kv_len=request_kv_len, req_idx=req_idx,
                    )  # fmt: skip
                return result

            return move

        return make

    _patch(cls, "get_fixed_memory_size", make_fixed)
    _patch(cls, "_init_buffers", make_init)
    if online:
        _patch(cls, _PD_METHODS[0], make_pd("pack"))
        _patch(cls, _PD_METHODS[1], make_pd("unpack"))
    else:  # a ring install after an online one: LightLLM's own PD transfer again
        _restore(lambda klass, name: klass is cls and name in _PD_METHODS)


def _patch_module(name: str, module, options: dict) -> None:
    """Patch the LightLLM classes defined in module ``name`` (one of the four the adapter patches)."""
    if name == _STATE_MODULE:

        def make_init(original):
            @functools.wraps(original)
            def init_some_extra_state(self, model, *args, **kwargs):
                original(self, model, *args, **kwargs)
                builder = getattr(model, "_dsv4c_builder", _UNSET)
                if builder is _UNSET:
                    builder = _builder_for_model(model, dict(options))
                    model._dsv4c_builder = builder
                if builder is not None:  # a model without compressor layers (the MTP draft) builds nothing
                    builder.build(self)

            return init_some_extra_state

        _patch(module.DeepseekV4InferStateInfo, "init_some_extra_state", make_init)
    elif name == _LAYER_MODULE:
        _patch(
            module.CompressorInfer, "compress", lambda original: functools.wraps(original)(layer.compressor_compress)
        )
        _patch(
            module.DeepseekV4IndexInfer, "write_indexer_k",
            lambda original: functools.wraps(original)(layer.write_indexer_k),
        )  # fmt: skip
    elif name == _MEM_MODULE:
        _patch_memory_manager(module.DeepseekV4MemoryManager, options)
    elif name == _MODEL_MODULE:

        def make_mem(original):
            @functools.wraps(original)
            def _init_mem_manager(self, *args, **kwargs):
                # after _init_weights allotted the weights, before LightLLM sizes its KV cache and loads them; not
                # with LightLLM's torch memory saver: this runs in its KV-cache region, and weights belong to its
                # weight region (released and restored apart)
                saver = bool(getattr(getattr(self, "args", None), "enable_torch_memory_saver", False))
                if options.get("projection") == "auto" and not saver:
                    self._dsv4c_joined_layers = join_c4_weights(getattr(self, "trans_layers_weight", None) or ())
                return original(self, *args, **kwargs)

            return _init_mem_manager

        _patch(module.DeepseekV4TpPartModel, "_init_mem_manager", make_mem)


def _options(online_hca: bool, c128_kernel: str, max_rows, microbatches, check: bool, projection=None) -> dict:
    if c128_kernel not in ("tiled", "single"):
        raise ValueError(f"lightllm install: c128_kernel must be 'tiled' or 'single', got {c128_kernel!r}")
    for name, value in (("max_rows", max_rows), ("microbatches", microbatches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"lightllm install: {name} must be None or an integer >= 1, got {value!r}")
    if projection is None:
        projection = os.environ.get(PROJECTION_ENV, "").strip().lower() or "auto"
        where = f"${PROJECTION_ENV}={projection!r}"
    else:
        where = f"projection={projection!r}"
    if projection not in PROJECTIONS:
        raise ValueError(f"lightllm install: {where}: expected one of {', '.join(PROJECTIONS)}")
    return dict(online_hca=bool(online_hca), c128_kernel=c128_kernel, max_rows=max_rows, microbatches=microbatches,
                check=bool(check), projection=projection)  # fmt: skip


class _PatchingLoader(importlib.abc.Loader):
    """A module's own loader, then the adapter's patch of the classes it defines."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the module's own loader
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each of LightLLM's four modules as it is imported, in a process that has not imported them yet
    (:func:`install_on_import`): the module is found by the finders after this one and loaded by its own
    loader, then patched."""

    def __init__(self, options: dict):
        self.options = options

    def find_spec(self, name, path=None, target=None):
        if name not in _MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, functools.partial(_patch_module, name, options=self.options))
        return spec


def _remove_import_hooks() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _PatchOnImport)]


def install(
    *,
    online_hca: bool = False,
    c128_kernel: str = "tiled",
    max_rows: int | None = None,
    microbatches: int | None = None,
    check: bool = False,
    projection: str | None = None,
) -> None:
    """Patch LightLLM (imported from its documented module paths) to run the compressors as our ops.

    **Call it at the top level of the launch script**, not under ``if __name__ == "__main__":``: LightLLM starts
    its router and model workers with ``spawn`` (``api_server.py`` L14, ``api_start.py`` L34-35) and builds the
    model in the worker (``model_rpc.py`` L217); a spawned process re-runs the launch script's top level, and
    that is the only code of the launch process it runs. Under ``python -m lightllm.server.api_server`` there is
    no such place: use ``python -m dsv4_compressor.integrations.lightllm <LightLLM's arguments>``
    (:func:`main`), which installs the adapter in every process LightLLM spawns.

    ``online_hca=True``: HCA on online banks in place of LightLLM's C128 ring (allotted and counted by its memory
    manager, carried by its PD transfer). ``c128_kernel``: ``"tiled"`` or ``"single"`` (ring HCA). ``projection``
    (default ``$DSV4C_LIGHTLLM_PROJECTION``, else ``"auto"``): ``"auto"`` replaces LightLLM's GEMM with our
    projection (``ops.compress_from_hidden``) where it is faster than cuBLAS (steps of at most
    ``ops.projection_triton_rows(2W, D)`` rows: decode steps up to 64; with ``online_hca``, the C128 layers up
    to 256 at V4-Flash's shapes, on the projection's unsummed partials) and keeps LightLLM's GEMM
    elsewhere, and ``DeepseekV4TpPartModel._init_mem_manager`` first joins each C4 layer's two compressor weights
    into one tensor (:func:`join_c4_weights`: one GEMM projects both on decode steps); ``"engine"`` keeps LightLLM's
    GEMM and weights always (the switch back). The projection workspaces are counted
    with the step buffers when LightLLM's model config gives ``hidden_size``. Each model's
    :class:`StepBuilder` is allotted by its memory manager's ``_init_buffers`` and counted by its
    ``get_fixed_memory_size`` (sized from LightLLM's start arguments; ``max_rows`` / ``microbatches`` override), or,
    where the start arguments are not set, created at the model's first step; a model without compressor layers (the
    MTP draft model) gets none. Refuses the modes :func:`check_engine_modes` lists when LightLLM's start arguments
    are set (they are in every process LightLLM spawns) with :class:`LightLLMModeNotSupported`; raises
    :class:`LightLLMNotInstalled` when LightLLM cannot be imported. Calling it again re-patches with the new
    options; :func:`uninstall` restores LightLLM.
    """
    options = _options(online_hca, c128_kernel, max_rows, microbatches, check, projection)
    args = engine_start_args()
    if args is not None:
        check_engine_modes(args, online_hca=options["online_hca"])
    modules = {name: _import(name) for name in _MODULES}
    _remove_import_hooks()
    for name, module in modules.items():
        _patch_module(name, module, options)


def install_on_import(
    *,
    online_hca: bool = False,
    c128_kernel: str = "tiled",
    max_rows: int | None = None,
    microbatches: int | None = None,
    check: bool = False,
    projection: str | None = None,
) -> None:
    """:func:`install` without importing LightLLM: the modules already imported are patched now, the others
    when something imports them (a ``sys.meta_path`` hook). What the launcher runs in every process LightLLM
    spawns: most of them (detokenizer, HTTP and metric processes) never import the model code."""
    options = _options(online_hca, c128_kernel, max_rows, microbatches, check, projection)
    args = engine_start_args()
    if args is not None:
        check_engine_modes(args, online_hca=options["online_hca"])
    _remove_import_hooks()
    sys.meta_path.insert(0, _PatchOnImport(options))
    for name in _MODULES:
        if sys.modules.get(name) is not None:
            _patch_module(name, sys.modules[name], options)


def install_from_environment() -> str:
    """:func:`install_on_import` with the options ``$DSV4C_LIGHTLLM`` names (``tiled`` when unset; ``off``:
    nothing). Every process LightLLM spawns from the launcher runs it. Returns the mode."""
    mode = os.environ.get(ENV_VAR, "tiled").strip().lower() or "tiled"
    if mode == OFF:
        return mode
    if mode not in MODES:
        raise ValueError(f"${ENV_VAR}={mode!r}: expected one of {', '.join([*MODES, OFF])}")
    install_on_import(**MODES[mode])
    return mode


def uninstall() -> None:
    """Restore every LightLLM method :func:`install` replaced and remove the import hook."""
    _remove_import_hooks()
    _restore(lambda cls, name: True)


# ---------------------------------------------------------------------------------------------------------------
# The launcher: python -m dsv4_compressor.integrations.lightllm <LightLLM's arguments>
# ---------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """LightLLM's API server with the adapter in every process it spawns.

    ``python -m dsv4_compressor.integrations.lightllm [--dsv4c tiled|single|online|off] <LightLLM's arguments>``
    parses LightLLM's arguments with LightLLM's own parser (``lightllm.server.api_cli.add_cli_args``), refuses
    the modes :func:`check_engine_modes` names before anything starts, sets ``$DSV4C_LIGHTLLM`` (spawned
    processes inherit the environment), installs the import hook here and starts
    ``lightllm.server.api_server.launch_server`` as ``python -m lightllm.server.api_server`` does
    (``api_server.py`` L31-38). Every process LightLLM spawns re-runs this module first (``spawn`` re-imports the
    launch process's main module, as ``__mp_main__``, by name) and so runs :func:`install_from_environment`
    before it imports any LightLLM module; so do the processes those processes spawn (the model workers the
    router starts). ``--dsv4c`` defaults to ``$DSV4C_LIGHTLLM``, else ``tiled``.
    """
    launcher = argparse.ArgumentParser(prog="python -m dsv4_compressor.integrations.lightllm", add_help=False,
                                       allow_abbrev=False)  # fmt: skip
    launcher.add_argument("--dsv4c", choices=[*MODES, OFF], default=os.environ.get(ENV_VAR, "tiled"))
    launcher.add_argument("--dsv4c-projection", choices=PROJECTIONS, default=os.environ.get(PROJECTION_ENV, "auto"))
    ours, rest = launcher.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.dsv4c not in (*MODES, OFF):  # from $DSV4C_LIGHTLLM (argparse checks only what the command line gives)
        launcher.error(f"${ENV_VAR}={ours.dsv4c!r}: expected one of {', '.join([*MODES, OFF])}")
    if ours.dsv4c_projection not in PROJECTIONS:
        launcher.error(f"${PROJECTION_ENV}={ours.dsv4c_projection!r}: expected one of {', '.join(PROJECTIONS)}")
    api_cli = _import("lightllm.server.api_cli")
    parser = argparse.ArgumentParser()
    api_cli.add_cli_args(parser)
    args = parser.parse_args(rest)
    os.environ[ENV_VAR] = ours.dsv4c
    os.environ[PROJECTION_ENV] = ours.dsv4c_projection
    if ours.dsv4c != OFF:
        try:
            check_engine_modes(vars(args), **MODES[ours.dsv4c])
        except LightLLMModeNotSupported as err:
            parser.exit(2, f"{err}\n")
        install_on_import(**MODES[ours.dsv4c])
    api_server = _import("lightllm.server.api_server")
    start_args = _import("lightllm.server.core.objs.start_args_type")
    api_server.launch_server(start_args.StartArgs(**vars(args)))
