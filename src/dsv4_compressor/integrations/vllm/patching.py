"""``install()`` / ``register()``: patching vLLM's ``DeepseekCompressor`` and ``CompressorMetadataBuilder``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import EngineModeNotSupported, EngineNotInstalled
from .. import entry_points as _entry_points
from .layer import _allocate_scratch, compressor_forward
from .planner import PLANNER_ATTR, STEP_ATTR, VLLM_STATE_BLOCK_SIZE, VllmCompressorPlanner

#: Where vLLM keeps the classes ``install()`` patches (docs/INTEGRATION.md, vLLM: paths relative to ``vllm``);
#: the first one importable wins.
COMPRESSOR_MODULES = ("vllm.models.deepseek_v4.compressor", "vllm.model_executor.models.deepseek_v4.compressor")
FORWARD_CONTEXT_MODULE = "vllm.forward_context"


class VllmNotAvailableError(EngineNotInstalled):
    """``install()`` found no vLLM with DeepSeek-V4's compressor to patch."""


class VllmModeNotSupported(EngineModeNotSupported):
    """A vLLM mode the adapter refuses at install or where vLLM builds the layer's state (``hca="online"``)."""


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

    def uninstall(self) -> None:
        self.compressor_cls.forward = self.original_forward
        if self.original_compressor_init is not None:
            self.compressor_cls.__init__ = self.original_compressor_init
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
            return module.DeepseekCompressor, module.CompressorMetadataBuilder, context.get_forward_context
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
) -> Installation:
    """Patch vLLM so that DeepSeek-V4's compressors run on the ops.

    * ``CompressorMetadataBuilder.__init__``: also allocates the group's :class:`VllmCompressorPlanner`
      (sizes from ``vllm_config``: ``max_num_batched_tokens``, ``max_num_seqs``, ``num_speculative_tokens``;
      the state spec's ``block_size`` and ``sliding_window``). ``_cudagraph_support`` stays ``ALWAYS``.
    * ``CompressorMetadataBuilder.build``: returns vLLM's metadata with the step's handle attached
      (``decode`` from ``max_query_len``); no device work.
    * ``DeepseekCompressor.forward(kv_score, positions, rotary_emb)``: :func:`compressor_forward`; layers the
      ops do not cover (MXFP4 indexer cache, a non-uint8 k cache) keep vLLM's original forward.

    Args:
        hca: ``"tiled"`` (the tiled ring kernel on vLLM's state and ``_compress_scratch``) or ``"online"``
            (banks in a request-scoped C128 state block, slot ``block_table[req, 0]``).
        debug: validate every plan on the device and raise on a bad one (synchronises).
        compressor_cls, builder_cls, get_forward_context: what to patch; by default imported from vLLM
            (``vllm.models.deepseek_v4.compressor``, ``vllm.forward_context``).

    Raises:
        VllmNotAvailableError: vLLM (with DeepSeek-V4) is not importable and the classes were not given.
    """
    if hca not in ("tiled", "online"):
        raise ValueError(f"install: hca must be 'tiled' or 'online', got {hca!r}")
    if compressor_cls is None or builder_cls is None or get_forward_context is None:
        found = _import_vllm()
        compressor_cls = compressor_cls or found[0]
        builder_cls = builder_cls or found[1]
        get_forward_context = get_forward_context or found[2]
    if hca == "online" and compressor_cls.__module__ in COMPRESSOR_MODULES:
        raise VllmModeNotSupported(ONLINE_REFUSED)
    previous = vars(compressor_cls).get("_dsv4c_installation")
    if previous is not None:
        previous.uninstall()  # a second install() replaces the first (new options), never stacks on it

    original_forward, original_init, original_build = compressor_cls.forward, builder_cls.__init__, builder_cls.build
    original_compressor_init = compressor_cls.__init__

    def compressor_init(self, *args, **kwargs):
        original_compressor_init(self, *args, **kwargs)
        _allocate_scratch(self)

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if hca == "online" and self.block_size == VLLM_STATE_BLOCK_SIZE[128]:
            window = getattr(self.kv_cache_spec, "sliding_window", None)
            if window is not None:
                reason = f"this C128 state group's spec has sliding_window={window}"
                raise VllmModeNotSupported(f"{ONLINE_REFUSED} ({reason})")
        config = self.vllm_config
        spec = getattr(config, "speculative_config", None)
        planner = VllmCompressorPlanner(
            block_size=self.block_size,
            window=getattr(self.kv_cache_spec, "sliding_window", None),
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
            setattr(metadata, STEP_ATTR, planner.begin_step(decode=decode))
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
    installation = Installation(
        compressor_cls, builder_cls, original_forward, original_init, original_build, hca, original_compressor_init
    )
    compressor_cls._dsv4c_installation = installation
    builder_cls._dsv4c_installation = installation
    return installation


#: Why ``hca="online"`` is refused on vLLM's own DeepSeek-V4 classes.
ONLINE_REFUSED = (
    "vllm: hca='online' is not supported on vLLM 0.33's DeepSeek-V4: its C128 compressor state is a 128-token "
    "sliding-window KV cache spec (SlidingWindowMLASpec, blocks of 8 rows padded to 32,832 bytes), so a request "
    "has no block of its own for the online banks (block_table[:, 0] becomes the shared null block once the "
    "window moves on) and the KV sizing would still reserve the ring; vLLM 0.33 has a request-scoped state spec "
    "only for DeepSeek-V4.1. Use hca='tiled' (the default)"
)

#: The environment variable :func:`register` reads (``VLLM_``-prefixed: vLLM forwards those to its Ray workers):
#: unset (or ``off``) leaves vLLM alone; ``tiled`` installs the adapter. :data:`ENV_VAR_ALIAS`: the earlier name,
#: read when :data:`ENV_VAR` is unset (it does not reach Ray workers). Both live in :mod:`.entry_points`.
ENV_VAR, ENV_VAR_ALIAS = _entry_points.VLLM_ENV, _entry_points.VLLM_ENV_ALIAS


def register() -> Installation | None:
    """What vLLM's ``vllm.general_plugins`` entry point runs when its switch is on (this package declares
    :func:`.entry_points.vllm`, which imports this module only then); callable directly too.

    Inert unless the user opts in: with ``$VLLM_DSV4C`` (or ``$DSV4C_VLLM``) unset, empty or ``off`` it
    imports nothing and patches nothing. Opted in (``tiled``), it runs :func:`install`; a setup it cannot serve
    (a bad value, ``online``, a vLLM without DeepSeek-V4's compressor) raises a clear error then, since the
    user asked for it and would otherwise run vLLM's kernels unknowingly."""
    name, raw = _entry_points.vllm_switch()
    choice = (raw or "").strip().lower()
    if choice in _entry_points.VLLM_OFF:
        return None
    if choice == "online":
        raise VllmModeNotSupported(f"{name}=online: {ONLINE_REFUSED}")
    if choice not in ("tiled", "1", "on"):
        raise ValueError(f"{name} must be 'tiled' or 'off' (unset: off), got {raw!r}")
    return install(hca="tiled")
