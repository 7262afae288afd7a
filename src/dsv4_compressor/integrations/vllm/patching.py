"""``install()`` / ``register()``: patching vLLM's ``DeepseekCompressor`` and ``CompressorMetadataBuilder``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import EngineModeNotSupported, EngineNotInstalled
from .. import entry_points as _entry_points
from . import online as _online
from .layer import _allocate_scratch, compressor_forward
from .planner import PLANNER_ATTR, STEP_ATTR, VllmCompressorPlanner

#: Where vLLM keeps the classes ``install()`` patches (docs/INTEGRATION.md, vLLM: paths relative to ``vllm``);
#: the first one importable wins.
COMPRESSOR_MODULES = ("vllm.models.deepseek_v4.compressor", "vllm.model_executor.models.deepseek_v4.compressor")
FORWARD_CONTEXT_MODULE = "vllm.forward_context"


class VllmNotAvailableError(EngineNotInstalled):
    """``install()`` found no vLLM with DeepSeek-V4's compressor to patch."""


class VllmModeNotSupported(EngineModeNotSupported):
    """A vLLM setup the adapter refuses for ``hca="online"``, at install or where vLLM builds the layer's state
    spec or metadata builder (:func:`.online.online_refusal` says why)."""


# ---------------------------------------------------------------------------------------------------------------
# install()
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Installation:
    """What :func:`install` patched; :meth:`uninstall` puts the originals back (also as a context manager)."""

    compressor_cls: type
    builder_cls: type
    original_forward: Any
    original_init: Any
    original_build: Any
    hca: str
    original_compressor_init: Any = None
    state_cache_cls: type | None = None
    original_spec: Any = None

    def uninstall(self) -> None:
        self.compressor_cls.forward = self.original_forward
        if self.original_compressor_init is not None:
            self.compressor_cls.__init__ = self.original_compressor_init
        if self.state_cache_cls is not None and self.original_spec is not None:
            self.state_cache_cls.get_kv_cache_spec = self.original_spec
        self.builder_cls.__init__ = self.original_init
        self.builder_cls.build = self.original_build
        for cls in (self.compressor_cls, self.builder_cls):
            if "_dsv4c_installation" in vars(cls):
                delattr(cls, "_dsv4c_installation")

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _import_vllm():
    import importlib

    errors = []
    for name in COMPRESSOR_MODULES:
        try:
            module = importlib.import_module(name)
            context = importlib.import_module(FORWARD_CONTEXT_MODULE)
            return (module.DeepseekCompressor, module.CompressorMetadataBuilder, context.get_forward_context,
                    getattr(module, "CompressorStateCache", None))  # fmt: skip
        except (ImportError, AttributeError) as err:
            errors.append(f"{name}: {err}")
    raise VllmNotAvailableError(
        "dsv4_compressor.integrations.vllm.install(): no vLLM with DeepSeek-V4's compressor is importable (tried "
        + "; ".join(errors)
        + "). Install vLLM (0.33 is what this adapter follows), or pass compressor_cls=, builder_cls= and "
        "get_forward_context= explicitly."
    )


def install(
    *,
    hca: str = "tiled",
    debug: bool = False,
    compressor_cls: type | None = None,
    builder_cls: type | None = None,
    get_forward_context=None,
    state_cache_cls: type | None = None,
    vllm_config=None,
) -> Installation:
    """Patch vLLM so that DeepSeek-V4's compressors run on the ops.

    * ``CompressorMetadataBuilder.__init__``: also allocates the group's :class:`VllmCompressorPlanner`
      (sizes from ``vllm_config``: ``max_num_batched_tokens``, ``max_num_seqs``, ``num_speculative_tokens``;
      the state spec's ``block_size`` and ``sliding_window``). ``_cudagraph_support`` stays ``ALWAYS``.
    * ``CompressorMetadataBuilder.build``: returns vLLM's metadata with the step's handle attached
      (``decode`` from ``max_query_len``); no device work.
    * ``DeepseekCompressor.forward(kv_score, positions, rotary_emb)``: :func:`compressor_forward`; layers the
      ops do not cover (MXFP4 indexer cache, a non-uint8 k cache) keep vLLM's original forward.
    * ``hca="online"`` only: ``CompressorStateCache.get_kv_cache_spec`` of a C128 state returns vLLM's own
      ``CircularBufferSpec`` sized for the request's banks (:mod:`.online`); the C128 group's builder accepts it.

    Args:
        hca: ``"tiled"`` (the tiled ring kernel on vLLM's state and ``_compress_scratch``) or ``"online"``
            (banks in a request-scoped C128 state block, slot ``block_table[req, 0]``).
        debug: validate every plan on the device and raise on a bad one (synchronises).
        compressor_cls, builder_cls, get_forward_context, state_cache_cls: what to patch; by default imported
            from vLLM (``vllm.models.deepseek_v4.compressor``, ``vllm.forward_context``).
        vllm_config: the ``VllmConfig`` to check ``hca="online"`` against now (else where vLLM asks for the
            state spec or builds the metadata builder, which carry it).

    Raises:
        VllmNotAvailableError: vLLM (with DeepSeek-V4) is not importable and the classes were not given.
        VllmModeNotSupported: ``hca="online"`` on a vLLM (or config) that cannot hold the banks (the reason
            says which: no ``CircularBufferSpec``, hybrid KV-cache manager disabled, block size not a multiple
            of 128, a ``kv_transfer_config`` other than NIXL's pull connector on device buffers); nothing is
            patched.
    """
    if hca not in ("tiled", "online"):
        raise ValueError(f"install: hca must be 'tiled' or 'online', got {hca!r}")
    if compressor_cls is None or builder_cls is None or get_forward_context is None:
        found = _import_vllm()
        compressor_cls = compressor_cls or found[0]
        builder_cls = builder_cls or found[1]
        get_forward_context = get_forward_context or found[2]
        state_cache_cls = state_cache_cls or (found[3] if len(found) > 3 else None)
    if hca == "online" and (compressor_cls.__module__ in COMPRESSOR_MODULES or vllm_config is not None):
        _refuse_online(vllm_config)  # (stand-in classes bring their own request-scoped spec)
    previous = vars(compressor_cls).get("_dsv4c_installation")
    if previous is not None:
        previous.uninstall()  # a second install() replaces the first (new options), never stacks on it

    original_forward, original_init, original_build = compressor_cls.forward, builder_cls.__init__, builder_cls.build
    original_compressor_init = compressor_cls.__init__
    original_spec = getattr(state_cache_cls, "get_kv_cache_spec", None) if hca == "online" else None

    def get_kv_cache_spec(self, vllm_config):
        if not _online.is_c128_state(self):
            return original_spec(self, vllm_config)
        _refuse_online(vllm_config)
        return _online.bank_spec(self, vllm_config)

    def compressor_init(self, *args, **kwargs):
        original_compressor_init(self, *args, **kwargs)
        _allocate_scratch(self)

    def __init__(self, *args, **kwargs):
        online = hca == "online" and _is_bank_spec(_spec_arg(args, kwargs))
        if online:  # vLLM's __init__ asserts a sliding-window spec: its base's, then what its forward reads
            _refuse_online(_config_arg(args, kwargs))
            super(builder_cls, self).__init__(*args, **kwargs)
            self.block_size = self.kv_cache_spec.block_size
            self.token_to_req_indices = torch.zeros(
                self.vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int32, device=self.device
            )
        else:
            original_init(self, *args, **kwargs)
        window = getattr(self.kv_cache_spec, "sliding_window", None)
        if hca == "online" and window == _online.HCA_RATIO:
            raise VllmModeNotSupported(
                f"{ONLINE_REFUSED}: this C128 state group's spec is {type(self.kv_cache_spec).__name__} "
                f"(sliding_window={window}), not CircularBufferSpec: vLLM asked for the state's spec before "
                "install(hca='online'), or another class declared it"
            )
        config = self.vllm_config
        spec = getattr(config, "speculative_config", None)
        planner = VllmCompressorPlanner(
            block_size=self.block_size,
            window=None if online else window,
            max_num_tokens=config.scheduler_config.max_num_batched_tokens,
            max_num_reqs=config.scheduler_config.max_num_seqs,
            device=self.device,
            mtp_step=(getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0,
            debug=debug,
        )
        setattr(self, PLANNER_ATTR, planner)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = original_build(self, common_prefix_len, common_attn_metadata, fast_build)
        planner = getattr(self, PLANNER_ATTR, None)
        if planner is not None and metadata.token_to_req_indices is not None:
            decode = planner.is_decode(common_attn_metadata.max_query_len)
            qsl = getattr(common_attn_metadata, "query_start_loc", None)
            setattr(metadata, STEP_ATTR, planner.begin_step(decode=decode, query_start_loc=qsl))
        return metadata

    def forward(self, kv_score, positions, rotary_emb):
        context = get_forward_context()
        attn_metadata = context.attn_metadata
        if not isinstance(attn_metadata, dict):
            return None  # vLLM's profiling run: its own forward returns here too
        mode = getattr(context, "cudagraph_runtime_mode", None)
        return compressor_forward(
            self, kv_score, positions, rotary_emb, attn_metadata=attn_metadata, hca=hca, fallback=original_forward,
            graph_mode=getattr(mode, "name", mode),
        )  # fmt: skip

    for fn, original in ((__init__, original_init), (build, original_build), (forward, original_forward),
                         (compressor_init, original_compressor_init)):  # fmt: skip
        fn.__wrapped__ = original
        fn.__doc__ = (
            f"dsv4_compressor's replacement (see dsv4_compressor.integrations.vllm)\n\n{original.__doc__ or ''}"
        )
    builder_cls.__init__, builder_cls.build, compressor_cls.forward = __init__, build, forward
    compressor_cls.__init__ = compressor_init
    if original_spec is not None:
        get_kv_cache_spec.__wrapped__ = original_spec
        get_kv_cache_spec.__doc__ = "dsv4_compressor's replacement: a C128 state's CircularBufferSpec of banks"
        state_cache_cls.get_kv_cache_spec = get_kv_cache_spec
    installation = Installation(
        compressor_cls, builder_cls, original_forward, original_init, original_build, hca, original_compressor_init,
        state_cache_cls if original_spec is not None else None, original_spec,
    )  # fmt: skip
    compressor_cls._dsv4c_installation = installation
    builder_cls._dsv4c_installation = installation
    return installation


#: The start of every ``hca="online"`` refusal (the reason follows it).
ONLINE_REFUSED = "vllm: hca='online' is not supported here"


def _refuse_online(vllm_config) -> None:
    reason = _online.online_refusal(vllm_config)
    if reason is not None:
        raise VllmModeNotSupported(f"{ONLINE_REFUSED}: {reason}. Use hca='tiled' (the default)")


def _spec_arg(args, kwargs):
    """``kv_cache_spec`` of ``AttentionMetadataBuilder.__init__(kv_cache_spec, layer_names, vllm_config, device)``."""
    return kwargs.get("kv_cache_spec", args[0] if args else None)


def _config_arg(args, kwargs):
    return kwargs.get("vllm_config", args[2] if len(args) > 2 else None)


def _is_bank_spec(spec) -> bool:
    cls = _online.circular_buffer_spec_cls()
    return cls is not None and type(spec) is cls


#: The environment variable :func:`register` reads (``VLLM_``-prefixed: vLLM forwards those to its Ray workers):
#: unset (or ``off``) leaves vLLM alone; ``tiled`` installs the adapter, ``online`` with online HCA.
#: :data:`ENV_VAR_ALIAS`: the earlier name, read when :data:`ENV_VAR` is unset (it does not reach Ray workers).
#: Both live in :mod:`.entry_points`.
ENV_VAR, ENV_VAR_ALIAS = _entry_points.VLLM_ENV, _entry_points.VLLM_ENV_ALIAS


def register() -> Installation | None:
    """What vLLM's ``vllm.general_plugins`` entry point runs when its switch is on (this package declares
    :func:`.entry_points.vllm`, which imports this module only then); callable directly too.

    Inert unless the user opts in: with ``$VLLM_DSV4C`` (or ``$DSV4C_VLLM``) unset, empty or ``off`` it
    imports nothing and patches nothing. Opted in (``tiled`` or ``online``), it runs :func:`install`; a setup it
    cannot serve (a bad value, a vLLM without DeepSeek-V4's compressor, ``online`` where :mod:`.online` refuses
    it) raises a clear error then, since the user asked for it and would otherwise run vLLM's kernels
    unknowingly."""
    name, raw = _entry_points.vllm_switch()
    choice = (raw or "").strip().lower()
    if choice in _entry_points.VLLM_OFF:
        return None
    if choice == "online":
        return install(hca="online")
    if choice not in ("tiled", "1", "on"):
        raise ValueError(f"{name} must be 'tiled', 'online' or 'off' (unset: off), got {raw!r}")
    return install(hca="tiled")
