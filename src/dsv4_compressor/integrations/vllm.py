"""vLLM adapter: DeepSeek-V4's compressors (``DeepseekCompressor.forward``) on the library's ops.

What a vLLM user adds: the patch must run in every process that builds the model, and vLLM's workers are
separate processes, so the way in is vLLM's plugin entry point (``vllm.general_plugins``), which calls
:func:`register` in each of them::

    # this package's pyproject.toml declares it
    [project.entry-points."vllm.general_plugins"]
    dsv4_compressor = "dsv4_compressor.integrations.vllm:register"

    # inert unless opted in: VLLM_DSV4C=tiled (VLLM_-prefixed, so vLLM forwards it to Ray workers)

or, where the model is built in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tests)::

    from dsv4_compressor.integrations import vllm as dsv4_vllm
    dsv4_vllm.install()               # before the model is built (HCA layers get their scratch at init)
    # hca="online" is refused on vLLM 0.33's classes: its C128 state has no request-scoped block (ONLINE_REFUSED)

Mapping, vLLM 0.33 names (``vllm/models/deepseek_v4/compressor.py``, ../shared/ENGINES.md sections 1.3, 2.3)
-> op arguments. Per step and per compressor-state KV-cache group (C4 main, C4 indexer, C128; each has its own
``CompressorMetadataBuilder`` and ``CompressorMetadata``):

====================================================  ============================================================
vLLM                                                  op argument
====================================================  ============================================================
``positions`` (int64, the model's persistent buffer)   ``build_plan(positions=)``
``CompressorMetadata.token_to_req_indices`` (int32)    ``build_plan(row_req=)``, with ``-1`` where the state
                                                       ``slot_mapping`` is ``-1`` (padding: vLLM leaves the
                                                       padded tail of ``token_to_req_indices`` stale)
``attn_metadata[k_cache_prefix].slot_mapping`` (int64,  ``build_plan(out_slot=)``; shorter than the step
-1 except on group-ends; ``num_actual_tokens`` rows:   (the unpadded count outside FULL CUDA graphs): copied
unpadded outside FULL CUDA graphs)                     into the planner's persistent buffer, ``-1`` after it
``CompressorMetadata.block_table`` (int32, clamped      the plan's state rows (``build_plans(state_mode=
>= 0), ``.block_size``                                 "block_table", block_size=4 (C4) or 8 (C128))``, in
                                                       the plan's launch): every row is saved, as
                                                       ``_SAVE_PARTIAL_STATES_KERNEL`` does; online HCA:
                                                       ``build_plan(req_state_slot=block_table[:, 0])``
``kv_score`` (fp32 ``[T, 2W]``, vLLM's GEMM)          ``compress(kv_score=)`` (never written)
``self.ape.view(r, coff, H)``                          ``ape``
``self.norm.weight``, ``self.rms_norm_eps``            ``norm_weight``, ``eps``
``rotary_emb.cos_sin_cache[:, :R/2]`` / ``[:, R/2:]``  ``cos`` / ``sin`` (strided views, no copy)
``self.state_cache.kv_cache`` (3-D, padded block       ``state`` (the op reads ``stride(0)``)
stride)
``k_cache_layer.kv_cache`` (uint8 ``[blocks, P,        ``out_pages = kv_cache.view(blocks, P * record)`` (a view:
record]``, padded block stride), ``.shape[1]``         the page stride stays ``kv_cache.stride(0)``),
                                                       ``page_size = P``
one fp32 ``[max_num_batched_tokens, 512]`` shared by    ``scratch`` (HCA's tiled kernel); vLLM's own
all HCA layers, allocated at model init                ``_compress_scratch`` where it has one (ROCm)
uniform-decode batch (``max_query_len <= 1 +           ``decode=True``
num_speculative_tokens``)
indexer (``head_dim`` 128, ``[blocks, 64, 132]``)      ``kind="indexer", indexer_pack="pow2"`` (no Hadamard,
                                                       power-of-two scale stored as float32; FP8 pack only;
                                                       ``"pow2_ue8m0"`` on cc 10.x: :func:`indexer_pack`)
====================================================  ============================================================

**Where the plan is built.** ``CompressorMetadataBuilder.__init__`` (patched) allocates the persistent buffers
(plan, ``row_req``, ``out_slot``, ``read_rows``, ``save_rows``) once; ``build`` (patched) attaches a per-step handle
(:class:`VllmStepPlan`) carrying the static ``decode`` flag, with no device work. The device work runs in
the first compressor layer of the group in each forward pass: four launches per state group on decode-sized
steps, twelve per V4-Flash step (three groups): three torch ops that copy ``token_to_req_indices`` and mask its
padding rows (``copy_``, ``slot_mapping < 0``, ``masked_fill_``), then one ``build_plans`` of the plan and its
block-table state rows (``ops.launches``: on steps of more than ``kernels.plan.PLAN_ONE_BLOCK_MAX_ROWS`` rows
or requests a ``build_plan`` and a ``build_state_rows`` launch; the online group's is a ``build_plan``). A
padded step whose
``token_to_req_indices`` or compressed slot mapping is shorter than the slot mapping adds a ``fill_`` for the
first and a ``copy_`` and a ``fill_`` for the second. It runs there because ``out_slot`` is
the *compressed-KV* group's slot mapping, which another group's builder produces and which only
``attn_metadata`` holds at forward time. Every other layer of the group
reuses the plan. All of it reads vLLM's persistent buffers (positions, slot mappings, block tables) and writes
ours, with no host synchronisation, so it is captured into vLLM's CUDA graphs with the layers and replays with
whatever the runner copied into those buffers.

Launches per layer and step: one (decode) or two (prefill; the ring save runs after every window was read),
against vLLM's two (C4: save + fused) or three (C128: save + compress + store).

**Online HCA** (``hca="online"``, PR #58074 style; refused on vLLM 0.33's own classes, :data:`ONLINE_REFUSED`,
for a vLLM or a model whose C128 state spec is request-scoped): each request owns one block of the C128 state
group, its bank slot is ``block_table[req, 0]``, and the block holds ``mtp_step + 1`` banks of
``(max, sum, weighted sum)`` per channel instead of a window of rows. Per request and HCA layer that is
:func:`online_hca_state_bytes` (24 KiB against vLLM's 545-577 KiB at V4 shapes and ``mtp_step`` 3). The engine
side (a request-scoped ``KVCacheSpec`` whose block is that size) is vLLM's to provide; the op needs the banks
contiguous, so the block must not be padded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import ops
from ..errors import OpError

__all__ = [
    "VLLM_STATE_BLOCK_SIZE",
    "VllmNotAvailableError",
    "VllmCompressorPlanner",
    "VllmStepPlan",
    "compress_layer",
    "compressor_forward",
    "online_bank_view",
    "online_hca_state_bytes",
    "install",
    "register",
    "Installation",
]

#: vLLM's compressor-state block sizes (``CompressorStateCache.__init__``): C4 blocks of 4 rows, C128 of 8.
VLLM_STATE_BLOCK_SIZE = {4: 4, 128: 8}

#: Attribute of vLLM's ``CompressorMetadata`` that carries our per-step handle.
STEP_ATTR = "dsv4c_step"
#: Attribute of the patched builder that holds its persistent buffers.
PLANNER_ATTR = "_dsv4c_planner"

#: Where vLLM keeps the classes ``install()`` patches (ENGINES.md 1.3: paths relative to the ``vllm`` package);
#: the first one importable wins.
COMPRESSOR_MODULES = ("vllm.models.deepseek_v4.compressor", "vllm.model_executor.models.deepseek_v4.compressor")
FORWARD_CONTEXT_MODULE = "vllm.forward_context"


class VllmNotAvailableError(ImportError):
    """``install()`` found no vLLM with DeepSeek-V4's compressor to patch."""


# ---------------------------------------------------------------------------------------------------------------
# Per-step metadata
# ---------------------------------------------------------------------------------------------------------------
class VllmCompressorPlanner:
    """The persistent buffers of one compressor-state KV-cache group, allocated once (vLLM: in
    ``CompressorMetadataBuilder.__init__``), and the per-step build into them.

    Args:
        block_size: the state group's block size (rows per block: 4 for C4, 8 for C128).
        window: positions one entry pools (vLLM's ``sliding_window`` of the state spec: 8 for C4, 128 for
            C128); ``None`` for a group that only runs the online HCA op (no state-row tables).
        max_num_tokens: rows of the largest step (``max_num_batched_tokens``, padding included).
        max_num_reqs: requests of the largest step (``max_num_seqs``): the plan's request capacity.
        mtp_step: ``num_speculative_tokens`` (0 without MTP): a step with at most ``mtp_step + 1`` rows per
            request is a decode step.
        debug: run ``ops.check_plan`` after every build and raise on a bad plan (synchronises: debug only).
    """

    def __init__(
        self,
        *,
        block_size: int,
        window: int | None,
        max_num_tokens: int,
        max_num_reqs: int,
        device,
        mtp_step: int = 0,
        debug: bool = False,
    ):
        self.block_size, self.window = int(block_size), window
        self.max_num_tokens, self.max_num_reqs = int(max_num_tokens), int(max_num_reqs)
        self.mtp_step, self.debug = int(mtp_step), bool(debug)
        self.device = torch.device(device)
        # Sized for the smallest ratio this window can have (overlapping windows are 2r wide), so the one buffer
        # fits whichever ratio the group's layers turn out to have: a smaller ratio needs a larger plan.
        min_ratio = max(1, (window or 2) // 2)
        self.plan = ops.empty_plan(self.max_num_tokens, self.max_num_reqs, min_ratio, self.device)
        self.row_req = torch.full((self.max_num_tokens,), -1, dtype=torch.int32, device=self.device)
        # A compressed-KV slot mapping shorter than the step is copied here and padded with -1; one buffer, so a
        # CUDA graph captured on a padded step reads the same address on every replay.
        self.out_slot = torch.full((self.max_num_tokens,), -1, dtype=torch.int64, device=self.device)
        self.save_rows = torch.full((self.max_num_tokens,), -1, dtype=torch.int64, device=self.device)
        self.read_rows = None
        if window is not None:
            self.read_rows = torch.full((self.max_num_reqs, window - 1), -1, dtype=torch.int64, device=self.device)
        self.err = torch.zeros(4, dtype=torch.int32, device=self.device) if debug else None
        # the first error a check inside a captured graph found (replays cannot sync): read at the next eager build
        self.captured_err = torch.zeros(4, dtype=torch.int32, device=self.device) if debug else None

    def begin_step(self, *, decode: bool) -> VllmStepPlan:
        """The handle of a new step (host only: vLLM's ``build`` attaches it to ``CompressorMetadata``)."""
        return VllmStepPlan(self, bool(decode))

    def is_decode(self, max_query_len: int) -> bool:
        """vLLM's uniform-decode batch: no request brings more than ``1 + num_speculative_tokens`` rows."""
        return int(max_query_len) <= self.mtp_step + 1


@dataclass(eq=False)
class VllmStepPlan:
    """One step's plan of one state group: built once (:meth:`build`), read by every layer of the group."""

    planner: VllmCompressorPlanner
    decode: bool
    rows: int = -1  # T, the step's rows (padding included); -1 until built
    ratio: int = 0
    online: bool = False
    owner: Any = None  # the layer that built it first: it rebuilds in every forward pass, the others reuse
    source: Any = field(default=None, repr=False)  # (state metadata, out_slot) it was last built from

    @property
    def plan(self) -> torch.Tensor:
        return self.planner.plan

    @property
    def read_rows(self) -> torch.Tensor | None:
        return None if self.online else self.planner.read_rows

    @property
    def save_rows(self) -> torch.Tensor | None:
        return None if self.online else self.planner.save_rows

    @property
    def built(self) -> bool:
        return self.rows >= 0

    def build(
        self,
        positions: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        out_slot: torch.Tensor,
        *,
        ratio: int,
        online: bool = False,
        num_bank_slots: int | None = None,
    ) -> VllmStepPlan:
        """Build the plan (and, for the ring state, the ``block_table`` state-row tables) from vLLM's tensors.

        ``T = slot_mapping.shape[0]`` (vLLM's ``num_actual``, padding included); ``positions`` is read on its
        first ``T`` rows. ``token_to_req_indices`` and ``out_slot`` may be shorter: vLLM sizes both by
        ``num_actual_tokens``, the unpadded count outside FULL CUDA graphs, while the slot mappings keep the
        padded one; the rows past them are padding (a shorter ``out_slot`` goes through the planner's
        persistent buffer, ``-1`` on the missing rows). A longer ``out_slot`` is refused. Rows whose state
        ``slot_mapping`` is ``-1`` are padding. With ``online=True`` a request's bank slot is its block in the
        request-scoped group, ``block_table[req, 0]``, which ``build_plan`` looks up itself (``req_state_slot``),
        and ``num_bank_slots`` is the banks tensor's first dimension. (A row vLLM schedules always has its
        request's state block; the null block 0 only stands in a padded row's stale entry, which
        ``slot_mapping`` already marks.)
        """
        pl = self.planner
        rows = int(slot_mapping.shape[0])
        if rows > pl.max_num_tokens:
            raise OpError(f"vllm: a step of {rows} rows; the planner holds {pl.max_num_tokens} (max_num_tokens)")
        if positions.shape[0] < rows:
            raise OpError(f"vllm: positions has {positions.shape[0]} rows, slot_mapping {rows}")
        device = pl.plan.device  # a tensor's device carries its index; the planner's may not
        if out_slot.dim() != 1 or out_slot.dtype not in (torch.int32, torch.int64) or out_slot.device != device:
            raise OpError(
                f"vllm: out_slot must be a 1-D int32/int64 tensor on {device}, got {out_slot.dtype} "
                f"{list(out_slot.shape)} on {out_slot.device}"
            )
        # The compressed-KV slot mapping covers vLLM's num_actual_tokens, which outside FULL CUDA graphs is the
        # unpadded count while the state slot mapping has the padded one: shorter is padding, longer is not a
        # step's (vLLM's num_actual_tokens never exceeds the rows of its slot mappings).
        if out_slot.shape[0] > rows:
            raise OpError(f"vllm: out_slot has {out_slot.shape[0]} rows, slot_mapping {rows}")
        if online and num_bank_slots is None:
            raise OpError("vllm: online=True needs num_bank_slots (the banks tensor's first dimension)")
        if not online and pl.read_rows is None:
            raise OpError("vllm: this planner has no window (window=None): it only plans online HCA steps")
        # vLLM pads the slot mappings, not token_to_req_indices, to the padded token count (the V2 runner
        # always; the V1 runner when a backend updates the KV cache outside forward): the rows past
        # token_to_req_indices are padding (their slots are -1), as vLLM's own kernels treat them.
        mapped = min(rows, int(token_to_req_indices.shape[0]))
        row_req = pl.row_req[:rows]
        row_req[:mapped].copy_(token_to_req_indices[:mapped])
        if mapped < rows:
            row_req[mapped:].fill_(-1)
        row_req.masked_fill_(slot_mapping < 0, -1)  # a padded row's request index is stale
        if out_slot.shape[0] < rows:
            padded = pl.out_slot[:rows]
            padded[: out_slot.shape[0]].copy_(out_slot)
            padded[out_slot.shape[0] :].fill_(-1)
            out_slot = padded
        if online:  # the request's bank slot: its block in the request-scoped group, looked up by build_plan
            ops.build_plan(
                pl.plan, positions[:rows], row_req, out_slot, ratio=ratio, num_slots=int(num_bank_slots),
                req_state_slot=block_table[:, 0], mtp_step=pl.mtp_step,
            )  # fmt: skip
        else:  # the plan and its block-table state rows in one build (one launch on decode-sized steps)
            ops.build_plans(
                [pl.plan], positions[:rows], row_req, [out_slot], ratios=[ratio],
                num_slots=int(block_table.shape[0]), mtp_step=pl.mtp_step, read_rows=pl.read_rows,
                save_rows=pl.save_rows, state_mode="block_table", block_table=block_table, block_size=pl.block_size,
            )  # fmt: skip
        self.rows, self.ratio, self.online = rows, int(ratio), bool(online)
        if pl.debug:
            ops.check_plan(pl.plan, None, pl.err, mtp_step=pl.mtp_step, decode=self.decode)
            if _capturing(pl.device):
                # no host read inside a capture: the graph keeps the first error it finds on replay
                pl.captured_err.copy_(torch.where(pl.captured_err[0] != 0, pl.captured_err, pl.err))
            else:
                for err, where in ((pl.captured_err, " (in a CUDA graph replay)"), (pl.err, "")):
                    message = ops.plan_error(err)  # reads err: a sync, which is why this is debug only
                    if message is not None:
                        err.zero_()
                        raise OpError(f"vllm: {message}{where}")
        return self


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (no host synchronisation allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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

    The op needs the banks contiguous, so each block must be exactly ``banks * 3 * H`` floats, unpadded."""
    per_block = banks * 3 * head_dim
    if state_cache.dtype != torch.float32:
        raise OpError(f"vllm: online HCA banks must be float32, got {state_cache.dtype}")
    blocks = state_cache.shape[0]
    if state_cache.numel() != blocks * per_block or not state_cache.is_contiguous():
        raise OpError(
            f"vllm: online HCA needs contiguous blocks of exactly {banks} x 3 x {head_dim} floats (mtp_step + 1 "
            f"banks), got {list(state_cache.shape)} strides {list(state_cache.stride())}"
        )
    return state_cache.view(blocks, banks, 3, head_dim)


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
        banks = online_bank_view(state_cache, step.planner.mtp_step + 1, head)
        ops.compress_online_hca(
            kv_score, step.plan, ape3, norm_weight, cos, sin, banks, out_pages, page_size=page_size, eps=eps,
            decode=step.decode, scratch=None if step.decode else scratch,
        )  # fmt: skip
        return
    ops.compress(
        kv_score, step.plan, ape3, norm_weight, cos, sin, state_cache, out_pages, kind=kind, page_size=page_size,
        eps=eps, decode=step.decode, scratch=scratch if kind == "hca" else None, read_rows=step.read_rows,
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


def compressor_forward(module, kv_score, positions, rotary_emb, *, attn_metadata, hca: str = "tiled", fallback=None):
    """The body of the patched ``DeepseekCompressor.forward`` (``attn_metadata``: the forward context's dict).

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
        step.build(
            positions, state_meta.token_to_req_indices, state_meta.block_table, state_meta.slot_mapping, out_slot,
            ratio=module.compress_ratio, online=online,
            num_bank_slots=module.state_cache.kv_cache.shape[0] if online else None,
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
        raise OpError(ONLINE_REFUSED)
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
                raise OpError(f"{ONLINE_REFUSED} (this C128 state group's spec has sliding_window={window})")
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
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None  # vLLM's profiling run: its own forward returns here too
        return compressor_forward(
            self, kv_score, positions, rotary_emb, attn_metadata=attn_metadata, hca=hca, fallback=original_forward
        )

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
#: unset (or ``off``) leaves vLLM alone; ``tiled`` installs the adapter.
ENV_VAR = "VLLM_DSV4C"
#: The earlier name, read when :data:`ENV_VAR` is unset (it does not reach Ray workers).
ENV_VAR_ALIAS = "DSV4C_VLLM"


def register() -> Installation | None:
    """vLLM's ``vllm.general_plugins`` entry point (this package declares it), which vLLM calls in its engine
    core and every worker, for every model, without a guard.

    Inert unless the user opts in: with ``$VLLM_DSV4C`` (or ``$DSV4C_VLLM``) unset, empty or ``off`` it
    imports nothing and patches nothing. Opted in (``tiled``), it runs :func:`install`; a setup it cannot serve
    (a bad value, ``online``, a vLLM without DeepSeek-V4's compressor) raises a clear error then, since the
    user asked for it and would otherwise run vLLM's kernels unknowingly."""
    import os

    raw = os.environ.get(ENV_VAR)
    name = ENV_VAR
    if raw is None:
        raw, name = os.environ.get(ENV_VAR_ALIAS), ENV_VAR_ALIAS
    choice = (raw or "").strip().lower()
    if choice in ("", "off", "0"):
        return None
    if choice == "online":
        raise OpError(f"{name}=online: {ONLINE_REFUSED}")
    if choice not in ("tiled", "1", "on"):
        raise ValueError(f"{name} must be 'tiled' or 'off' (unset: off), got {raw!r}")
    return install(hca="tiled")


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
    steps = mtp_step + 1
    row_bytes = 2 * head_dim * 4
    page_bytes = -(-block_size * row_bytes // page_align) * page_align
    positions = ratio - 1 + steps
    blocks_min = math.ceil(positions / block_size)
    blocks_max = (positions + block_size - 2) // block_size + 1
    online = steps * 3 * head_dim * 4
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
