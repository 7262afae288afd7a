"""The settings SGLang 0.5.23 runs with (its resolution, not the raw ``ServerArgs`` fields), the modes they
refuse, and the step and backend counts the adapter sizes its buffers from."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import torch

from ...errors import EngineModeNotSupported, EngineNotInstalled


class SGLangNotInstalled(EngineNotInstalled):
    """``install()`` was called but SGLang (with DeepSeek-V4 support) cannot be imported."""


class SGLangUnsupported(EngineModeNotSupported):
    """An SGLang configuration this adapter does not cover (refused rather than written wrongly)."""


class SGLangModeNotSupported(EngineModeNotSupported):
    """An SGLang mode the adapter refuses, at install() or at the backend's / pool's construction (before
    any forward and any graph capture), with the mode and what to do."""


def _env(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


#: SGLang 0.5.23's default of ``SGLANG_DSV4_KV_LAYOUT`` (``srt/environ.py``): the V4 pages, on every GPU.
KV_LAYOUT_DEFAULT = "v4"


def kv_layout_env() -> tuple[str, bool]:
    """``(SGLANG_DSV4_KV_LAYOUT lower-cased, whether it is set)``, read through SGLang's own ``envs`` when it is
    importable (its default, ``v4``, when unset), else from the environment with the same default."""
    try:
        envs = importlib.import_module("sglang.srt.environ").envs
        var = envs.SGLANG_DSV4_KV_LAYOUT
        return str(var.get()).strip().lower(), bool(var.is_set())
    except (ImportError, AttributeError):
        raw = os.environ.get("SGLANG_DSV4_KV_LAYOUT")
        return (raw.strip().lower() if raw else KV_LAYOUT_DEFAULT), raw is not None


def compressed_kv_layout_env() -> str:
    """``SGLANG_DSV4_COMPRESSED_KV_LAYOUT`` lower-cased (``auto``, ``fp8`` or ``fp4``; SGLang's default ``auto``),
    read through SGLang's own ``envs`` when it is importable."""
    try:
        envs = importlib.import_module("sglang.srt.environ").envs
        return str(envs.SGLANG_DSV4_COMPRESSED_KV_LAYOUT.get()).strip().lower()
    except (ImportError, AttributeError):
        raw = os.environ.get("SGLANG_DSV4_COMPRESSED_KV_LAYOUT")
        return raw.strip().lower() if raw else "auto"


def refusals_from_environment(*, hip: bool | None = None, sm100: bool | None = None) -> list[str]:
    """The SGLang modes :func:`install` refuses that the process environment already tells (SGLang reads the
    same variables): ``hip`` / ``sm100`` default to what torch sees.

    ``SGLANG_DSV4_KV_LAYOUT`` as SGLang's ``select_dsv4_kv_layout`` reads it: unset is ``v4`` (the V4 pages, on
    every GPU, Blackwell included); ``v41`` / ``v41_new`` (and an explicit ``auto`` on an SM100 / SM103 GPU)
    select the V4.1 layouts, written too, unless ``SGLANG_DSV4_COMPRESSED_KV_LAYOUT=fp4`` makes the compressed
    layers' records V4.1 FP4 (refused: not written)."""
    if hip is None:
        hip = getattr(torch.version, "hip", None) is not None
    if sm100 is None:
        sm100 = bool(torch.cuda.is_available() and torch.version.cuda and torch.cuda.get_device_capability()[0] == 10)
    out = []
    if hip:  # SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton takes effect on HIP only (unified_kv_gate.py)
        out.append(
            "ROCm / HIP: SGLang's HIP paths (unified KV 'unified_kv_triton', DeepseekV4HipRadixBackend, aiter's "
            "preshuffled indexer cache, the V4.1 gfx950 layouts) store in layouts the adapter does not write; "
            "run SGLang's own kernels there (do not install the adapter)"
        )
    layout, _ = kv_layout_env()
    v41 = layout in ("v41", "v41_new") or (layout == "auto" and sm100)
    if v41 and compressed_kv_layout_env() == "fp4":
        out.append(
            f"SGLANG_DSV4_KV_LAYOUT={layout} with SGLANG_DSV4_COMPRESSED_KV_LAYOUT=fp4: the compressed layers' "
            "V4.1 FP4 records (e2m1 with e4m3 scales) are not written; unset SGLANG_DSV4_COMPRESSED_KV_LAYOUT "
            "(auto: FP8 V4.1 records for the compressors' ratios 4 and 128) or do not install the adapter"
        )
    return out


# ---------------------------------------------------------------------------------------------------------------
# The settings SGLang runs with
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SGLangSettings:
    """The values SGLang 0.5.23 runs with, after its resolution (``ServerArgs.resolve_once``: the arg-group
    hooks declare their decisions beside the raw fields, which stay as the operator gave them, often ``None``).

    ``chunked_prefill_size`` and ``max_running_requests`` are per attention-DP rank (SGLang divides the chunk in
    ``_handle_data_parallelism``, the request count in ``KVCacheConfigurator.resolve_max_num_reqs``);
    ``chunked_prefill_size`` ``None`` or ``<= 0`` means chunked prefill is off; ``decode_graph_bs`` /
    ``prefill_graph_tokens`` are the CUDA-graph capture limits (0 where that phase captures none);
    ``draft_tokens`` is ``speculative_num_draft_tokens`` (1 without speculation). ``source`` says where they were
    read: ``"runtime context"`` (the process's published config bags, what SGLang's own backend reads),
    ``"resolved ServerArgs"`` or ``"a resolved copy"`` (SGLang's resolution run on a copy of a record that had
    not been resolved), or ``"fields"`` (a stand-in object's attributes)."""

    chunked_prefill_size: int | None
    max_prefill_tokens: int | None
    max_running_requests: int | None
    decode_graph_bs: int
    prefill_graph_tokens: int
    enable_mixed_chunk: bool
    speculative_algorithm: str
    speculative_num_steps: int
    speculative_eagle_topk: int
    draft_tokens: int
    enable_two_batch_overlap: bool
    enable_pdmux: bool
    sm_group_num: int
    attn_dp_size: int
    enable_hisparse: bool
    dsv4_attn_backend: str
    source: str

    @property
    def chunked_prefill(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    @property
    def speculative(self) -> bool:
        """A draft model runs (EAGLE / MTP and the others SGLang builds a draft runner for; not NGRAM)."""
        return self.speculative_algorithm not in ("NONE", "NGRAM")


_RESOLVED_COPY = "_dsv4c_resolved_copy"  # bookkeeping on a record resolved in a copy (SGLang allows "_" names)


def _leaf_reader(server_args):
    """A function ``field -> value`` reading what SGLang resolved for ``server_args`` (``None``: the process's
    published record), and where it reads from."""
    runtime = sys.modules.get("sglang.srt.runtime_context")
    ctx = runtime.get_context() if runtime is not None else None
    published = getattr(ctx, "_server_args", None)
    if published is not None and (server_args is None or server_args is published):
        return ctx.config_leaf, "runtime context"
    if server_args is None:
        raise SGLangModeNotSupported(
            "dsv4_compressor.sglang: no server arguments given and none published in this process"
        )
    try:
        overrides = importlib.import_module("sglang.srt.arg_groups.overrides")
        is_record = importlib.import_module("sglang.srt.arg_groups.arg_utils").is_record(server_args)
    except ImportError:
        is_record = False
    if not is_record:
        return (lambda name: getattr(server_args, name, None)), "fields"
    record, source = server_args, "resolved ServerArgs"
    if not getattr(server_args, "_resolution_finished", False):
        record, source = server_args.__dict__.get(_RESOLVED_COPY), "a resolved copy"
        if record is None:
            import copy

            record = copy.deepcopy(server_args)
            try:
                record.resolve_once()  # SGLang's own resolution pipeline, on a copy: the caller's record is kept
            except Exception as err:
                raise SGLangModeNotSupported(
                    "dsv4_compressor.sglang: SGLang's resolution of these server arguments failed, so the values "
                    f"SGLang would run with are unknown ({type(err).__name__}: {err}); pass a resolved ServerArgs "
                    "(resolve_once()) or call this where SGLang has published its settings"
                ) from err
            server_args.__dict__[_RESOLVED_COPY] = record
    return (lambda name: overrides.resolution_result(record, name)), source


def settings_of(server_args=None) -> SGLangSettings:
    """The :class:`SGLangSettings` SGLang runs with for ``server_args`` (a ``ServerArgs``; ``None``: this
    process's published one): the published config bags where ``server_args`` is the record this process
    published (what SGLang's backends and schedulers read, ``get_schedule()`` / ``get_spec()``), else SGLang's
    ``resolution_result`` of the record, resolving a copy first with SGLang's own ``resolve_once`` when the
    record was never resolved (the raw fields of a default ``ServerArgs`` are ``None`` where SGLang decides
    later). Raises :class:`SGLangModeNotSupported` when SGLang's resolution fails."""
    read, source = _leaf_reader(server_args)

    def value(name, default=None):
        v = read(name)
        return default if v is None else v

    def as_int(name, default=0) -> int:
        v = value(name, default)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    def phase(config, name: str) -> int:
        ph = getattr(config, name, None)
        backend = str(getattr(ph, "backend", "disabled") or "disabled").lower()
        bs = getattr(ph, "max_bs", None)
        return int(bs) if backend != "disabled" and isinstance(bs, int) and bs > 0 else 0

    graphs = value("cuda_graph_config")
    dp = max(1, as_int("attn_dp_size", 1))
    requests = value("max_running_requests")
    algo = str(value("speculative_algorithm", "NONE")).upper()
    draft = as_int("speculative_num_draft_tokens", 1) if algo not in ("NONE", "NGRAM") else 1
    chunk = value("chunked_prefill_size")
    return SGLangSettings(
        chunked_prefill_size=int(chunk) if chunk is not None else None,
        max_prefill_tokens=value("max_prefill_tokens"),
        # the request count is global; each attention-DP rank runs its share (resolve_max_num_reqs)
        max_running_requests=max(1, int(requests) // dp) if requests is not None else None,
        decode_graph_bs=phase(graphs, "decode"),
        prefill_graph_tokens=phase(graphs, "prefill"),
        enable_mixed_chunk=bool(value("enable_mixed_chunk", False)),
        speculative_algorithm=algo,
        speculative_num_steps=as_int("speculative_num_steps", 0),
        speculative_eagle_topk=as_int("speculative_eagle_topk", 0),
        draft_tokens=max(1, draft),
        enable_two_batch_overlap=bool(value("enable_two_batch_overlap", False)),
        enable_pdmux=bool(value("enable_pdmux", False)),
        sm_group_num=as_int("sm_group_num", 0),
        attn_dp_size=dp,
        enable_hisparse=bool(value("enable_hisparse", False)),
        dsv4_attn_backend=str(value("dsv4_attn_backend", "auto")),
        source=source,
    )


def _settings(server_args_or_settings) -> SGLangSettings:
    if isinstance(server_args_or_settings, SGLangSettings):
        return server_args_or_settings
    return settings_of(server_args_or_settings)


#: Why chunked prefill switched off is refused.
CHUNKED_PREFILL_OFF = (
    "chunked prefill is off (chunked_prefill_size {value} as SGLang resolved it): a prefill step is then bounded "
    "by the prompt, not by a server limit, so the HCA scratch and the projection workspaces cannot be sized before "
    "graph capture; keep chunked prefill on (--chunked-prefill-size > 0)"
)


def refusals_from_settings(settings: SGLangSettings) -> list[str]:
    """The SGLang modes refused from the settings SGLang runs with (checked at :func:`install` where SGLang has
    published them, and when each backend is built, before the KV cache's first use and any graph capture)."""
    out = []
    attn = settings.dsv4_attn_backend or "auto"
    if attn == "flashmla_mega":
        out.append(
            "--dsv4-attn-backend flashmla_mega runs DeepSeek-V4.1's fused Q-RoPE + sparse attention + MXFP8 "
            "FlashMLA kernel (a V4.1 model on SM100 / SM103), which the adapter is not checked against; use "
            "--dsv4-attn-backend flashmla (SGLANG_DSV4_KV_LAYOUT=v41 / v41_new keeps the V4.1 pages) or do not "
            "install the adapter"
        )
    if not settings.chunked_prefill:
        out.append(CHUNKED_PREFILL_OFF.format(value=settings.chunked_prefill_size))
    if settings.enable_hisparse:
        out.append(HISPARSE_REFUSAL)
    return out


def refusals_from_server_args(server_args) -> list[str]:
    """:func:`refusals_from_settings` of :func:`settings_of` ``(server_args)``: the values SGLang resolves, not
    the raw fields."""
    return refusals_from_settings(settings_of(server_args))


#: Why HiSparse is refused (its C4 pool keeps compressed entries on the host and translates slots per step).
HISPARSE_REFUSAL = (
    "HiSparse (--enable-hisparse) keeps the C4 compressed cache in a HiSparseC4DevicePool whose slots SGLang "
    "translates to host-backed pages each step; the adapter writes the pool's pages directly; turn HiSparse off "
    "or do not install the adapter"
)


def scratch_rows_for(server_args, draft_tokens: int | None = None, *, max_running_requests: int | None = None) -> int:
    """HCA scratch rows for the largest step SGLang runs on one attention-DP rank under ``server_args`` (a
    ``ServerArgs`` or :class:`SGLangSettings`; its resolved values, :func:`settings_of`): a prefill chunk
    (``chunked_prefill_size``: SGLang's ``PrefillAdder`` charges every admitted extend, mixed-in decode rows
    included, to the chunk and truncates a longer request to it), a padded prefill graph (its ``max_bs`` tokens),
    or a decode / verify step (``max(max_running_requests, the decode graph's max_bs)`` x draft tokens).
    ``draft_tokens`` defaults to the settings'; ``max_running_requests`` overrides the settings' per-rank count
    (the model runner's, which SGLang may lower to the KV capacity). Chunked prefill off is refused
    (:data:`CHUNKED_PREFILL_OFF`): no server limit bounds a prefill step then."""
    settings = _settings(server_args)
    if not settings.chunked_prefill:
        raise SGLangModeNotSupported("dsv4_compressor.sglang: refused: " +
                                     CHUNKED_PREFILL_OFF.format(value=settings.chunked_prefill_size))  # fmt: skip
    draft = settings.draft_tokens if draft_tokens is None else max(1, int(draft_tokens))
    requests = settings.max_running_requests if max_running_requests is None else int(max_running_requests)
    decode = max(int(requests or 0), settings.decode_graph_bs) * draft
    return max(int(settings.chunked_prefill_size), settings.prefill_graph_tokens, decode, 1)


def backends_for(server_args) -> int:
    """How many ``DeepseekV4AttnBackend`` objects one SGLang 0.5.23 scheduler process builds under
    ``server_args`` (a ``ServerArgs`` or :class:`SGLangSettings`; resolved values), every one after the KV
    cache is sized:

    * the target model runner (``build_attention_backends``, model_runner_components/attention_backend_setup.py):
      1; with two-batch overlap ``TboAttnBackend.init_new``'s primary and 2 children, 3; with PD multiplexing
      1 + ``sm_group_num``;
    * with a draft model (EAGLE / MTP: ``speculative_algorithm`` other than ``NGRAM``): the draft runner's own
      backend (1), the draft-extend backend (1) and, when ``speculative_num_steps`` > 1, the multi-step draft
      backend (``DeepseekV4MultiStepBackend``: itself a ``DeepseekV4AttnBackend``, plus one per step, 1 + steps).

    SGLang's automatic EAGLE settings (3 steps, top-k 1, 4 draft tokens) build 7. Not counted: the extra
    backends ``speculative_adaptive`` builds per step configuration and the multi-layer EAGLE worker's."""
    return compressor_backends_for(server_args) + _draft_backends(_settings(server_args))


def compressor_backends_for(server_args) -> int:
    """The backends of :func:`backends_for` whose model has compressor layers: the target runner's. A DeepSeek-V4
    draft runner's pool has every layer at ratio 0 (``KVCacheConfigurator``: ``COMPRESS_RATIO_NEXTN_LAYER`` for
    a draft worker), so its backends get no HCA scratch and no projection workspace."""
    settings = _settings(server_args)
    if settings.enable_pdmux:
        return 1 + settings.sm_group_num
    return 3 if settings.enable_two_batch_overlap else 1


def _draft_backends(settings: SGLangSettings) -> int:
    if not settings.speculative:
        return 0
    steps = max(1, settings.speculative_num_steps)
    return 2 + (1 + steps if steps > 1 else 0)


def scratch_backends_for(server_args) -> int:
    """The backends that allocate an HCA scratch: :func:`compressor_backends_for`."""
    return compressor_backends_for(server_args)
