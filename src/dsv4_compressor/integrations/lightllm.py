"""LightLLM (``ModelTC/LightLLM``, branch ``support_ds4``): the compressors of DeepSeek-V4 as our ops.

How a LightLLM user turns it on: start LightLLM through the launcher, with LightLLM's own arguments::

    python -m dsv4_compressor.integrations.lightllm [--dsv4c tiled|single|online|off] <LightLLM's arguments>

(:func:`main`; ``--dsv4c`` defaults to ``$DSV4C_LIGHTLLM``, else ``tiled``). LightLLM spawns its router and model
workers and builds the model in the worker, so the adapter must be in place in processes the launch script
never runs code in: a spawned process re-imports the launch process's main module, and the launcher is that
module. A launch script of one's own calls, **at its top level** (not under ``if __name__ == "__main__":``)::

    from dsv4_compressor.integrations import lightllm as dsv4c_lightllm
    dsv4c_lightllm.install()                      # ring C128 state (LightLLM's own), tiled HCA kernel
    dsv4c_lightllm.install(online_hca=True)       # or: online HCA banks in place of the C128 ring

``install()`` patches four LightLLM methods (module paths as in ENGINES.md section 1.1):

* ``DeepseekV4InferStateInfo.init_some_extra_state`` (``lightllm/models/deepseek_v4/infer_struct.py``): the
  original, then :meth:`StepBuilder.build` (once per step, for every layer; a model without compressor layers,
  the MTP draft model, builds nothing);
* ``CompressorInfer.compress`` (``lightllm/models/deepseek_v4/layer_infer/transformer_layer_infer.py``; C4 main
  and C128): :func:`compressor_compress`, one op from the hidden states (``ops.compress_from_hidden``: our
  projection and compression) where our projection is faster than cuBLAS (``ops.projection_triton_rows``:
  decode steps up to 64 rows), LightLLM's GEMM then one op elsewhere (no ``apply_ape``, no per-layer
  gather); on a decode step a C4 layer's first compressor projects both its weights in one call and
  compresses both in one ``ops.compress_pair`` (:func:`_paired_step`), and the second finds its work done;
  ``install(projection="engine")`` keeps LightLLM's GEMM everywhere;
* ``DeepseekV4IndexInfer.write_indexer_k`` (same file; indexer compress, ``hadamard_transform``,
  ``pack_indexer_k_to_cache``): :func:`write_indexer_k`, the same, writing the 132-byte packs;
* ``DeepseekV4TpPartModel._init_mem_manager`` (``lightllm/models/deepseek_v4/model.py``): first, with
  ``projection="auto"``, :func:`join_c4_weights` (each C4 layer's two compressor weights made one tensor's
  halves before LightLLM loads them, so one cuBLAS GEMM projects both), then LightLLM's own;

and ``DeepseekV4MemoryManager`` (``lightllm/common/kv_cache_mem_manager/deepseek4_mem_manager.py``):
``get_fixed_memory_size`` (what LightLLM subtracts before it sizes the KV cache) also counts the step builder's
buffers, which ``_init_buffers`` allots, sized from LightLLM's start arguments; with ``online_hca=True`` both count
and allot the banks instead of the C128 ring, and ``write_mem_to_page_kv_move_buffer`` /
``read_page_kv_move_buffer_to_mem`` carry them through the PD transfer (:func:`move_pd_banks`). Modes it cannot
serve are refused at install (:func:`check_engine_modes`). :func:`uninstall` restores all of them.

**Once per step** (:class:`StepBuilder`, run at the end of ``init_some_extra_state``; all on the device, no host
synchronisation, into buffers allocated once, one set per micro-batch ``infer_state.microbatch_index``):

* rows: ``positions = infer_state.position_ids``; ``row_req = infer_state.dsv4_sparse_req_idx`` (prefill:
  ``b_req_idx`` repeated by ``b_q_seq_len``; decode: ``b_req_idx``, one entry per row, ``b_mtp_index``
  0..mtp_step). Padding rows carry ``HOLD = max_request_num``, which is ``>= num_slots``, so they do nothing.
* ``out_slot``: ``full_to_c4_indexs[mem_index]`` and ``full_to_c128_indexs[mem_index]`` (LightLLM keys a compressed
  slot by the full slot of its group-end token), looked up once per step instead of in every layer call, by
  the plans' build itself on the group-end rows (``out_slot=mem_index, out_slot_map=full_to_c4_indexs``).
* ``ops.build_plans`` of both ratios' plans (4, and 128 for HCA) and, in the same call, the C4 plan's state-row
  tables (``state_mode="token_map_ring", req_to_token=req_manager.req_to_token_indexs,
  token_to_state=mem_manager.full_to_swa_indexs, state_page=128, ring=page_tail=mem_manager.c4_state_ring``):
  one launch on decode-sized steps. LightLLM's C4 state row is ``(swa // 128) * ring + swa % ring``, its save
  rule a request's last ``ring`` rows and each 128-slot SWA page's last ``ring`` rows (which radix prefix reuse
  at a page boundary reads).
* the results are ``infer_state`` tensor attributes (``dsv4c_c4_plan``, ``dsv4c_c4_read_rows``,
  ``dsv4c_c4_save_rows``, ``dsv4c_c128_plan``, ``dsv4c_c128_scratch``): ``copy_for_cuda_graph`` skips tensors
  at the captured address, and the builder writes every step into those same buffers, so a replayed decode
  graph reads the step's metadata.

**Per layer** (:func:`compress_layer`), one op on LightLLM's own buffers; ``kv_score`` is LightLLM's fp32
``[T, 2W]`` GEMM output (never written: the APE ``compressor_ape_.weight.view(r, coff, H)`` is added on load),
``norm_weight`` the bf16 ``compressor_norm_.weight``, cos / sin the layer's strided ``cos_compress_table`` /
``sin_compress_table`` (``.real`` / ``.imag`` of a complex64 table), ``decode = not infer_state.is_prefill``:

=========  ===========================================================================================
C4 main    ``ops.compress(kind="csa", state=get_c4_state_buffer(l), read_rows / save_rows from the step,
           out_pages=get_compressed_kv_buffer(l), page_size=c4_pool.page_size)`` (64)
indexer    ``ops.compress(kind="indexer", state=get_c4_indexer_state_buffer(l), same tables,
           out_pages=c4_indexer_pool.get_layer_buffer(layer_to_c4_idx[l]), page_size=64,
           indexer_pack="hadamard_bf16")``: LightLLM stores only the pack, no bf16 key
C128 ring  ``ops.compress(kind="hca", state=get_c128_state_buffer(l), ring=c128_state_ring,
           out_pages=get_compressed_kv_buffer(l), page_size=c128_pool.page_size, scratch=...)`` (2)
C128       ``ops.compress_online_hca(state_banks=c128_state_banks(mem_manager, l), same pages)``
online
=========  ===========================================================================================

Launches per layer and step: C4 about 10 (2 GEMMs, 2 APE adds, 2 fused, 2 saves, 2 gathers, plus hadamard and
pack) become the 2 GEMMs and 2-4 ops; C128 4 become 1 (online; tiled on decode steps of up to 256 requests) or
2 (tiled, other steps).

**Online HCA memory.** LightLLM keeps ``c128_state_ring = ceil((128 + mtp_step) / 4) * 4`` float32 rows of
``[kv | score + ape]`` (``2 * 512`` values) per request and HCA layer: 540,672 bytes (528 KiB) at mtp_step 3.
The online banks are ``mtp_step + 1`` banks of ``3 * 512`` float32: 24,576 bytes (24 KiB). Freed per request
(:func:`online_hca_savings`, from ``CompressorConfig.hca()`` and the layer counts of SPEC section 1):

* DeepSeek-V4-Flash, 20 HCA layers: 10,321,920 bytes (9.84 MiB) per request (2.46 GiB at 256 requests);
* DeepSeek-V4-Pro, 31 HCA layers: 15,998,976 bytes (15.26 MiB) per request (3.81 GiB at 256 requests).

LightLLM reserves that state for every request slot (``running_max_req_size + 1``); what online HCA gives its KV
cache back at its defaults is in docs/INTEGRATION.md (``python -m dsv4_compressor.testing.lightllm_sim capacity``).

Checked against stand-ins of LightLLM's classes and buffers (``dsv4_compressor.testing.lightllm_sim``, which
``tests/test_integration_lightllm.py`` and ``scripts/multi_gpu_run.py`` run on), not against LightLLM itself.
"""

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
from dataclasses import dataclass

import torch

from .. import ops
from ..config import CompressorConfig
from ..errors import CapacityError
from ..workspace import C128ScratchPlan, Workspace
from ._pairing import HeldScore, compress_pair_of, joint_kv_score, tensor_key

__all__ = [
    "LightLLMLayout",
    "StepBuilder",
    "compress_layer",
    "compress_layer_from_hidden",
    "compressor_compress",
    "projection_weight",
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
]

#: LightLLM's constants (``deepseek4_mem_manager.py``): SWA page, pool pages, the C4 ring before MTP padding.
SWA_PAGE_SIZE = 128
C4_PAGE_SIZE = 64
C128_PAGE_SIZE = 2
INDEXER_PAGE_SIZE = 64
C4_STATE_RING_BASE = 8
#: LightLLM packs the indexer key as ``fp8(bf16(hadamard(bf16 key)))`` with a float32 ``amax / 448`` scale.
INDEXER_PACK = "hadamard_bf16"
#: The C4 ratio (CSA and its indexer); the HCA ratio is a layout field (128; smaller in tests).
C4_RATIO = 4
#: DeepSeek-V4's indexer key size (``index_head_dim``).
INDEXER_HEAD_DIM = 128
#: How :func:`compressor_compress` projects ``x``: ``"auto"`` (``ops.compress_from_hidden`` /
#: ``ops.compress_online_hca_from_hidden``, our Triton projection, where it is the faster path: steps of at most
#: ``ops.projection_triton_rows(2W, D)`` rows; LightLLM's GEMM then our compress elsewhere, where cuBLAS is
#: level or faster) or ``"engine"`` (LightLLM's GEMM then our compress, always).
PROJECTIONS = ("auto", "engine")
#: The projection switch for processes LightLLM spawns (``install(projection=None)`` reads it; default auto).
PROJECTION_ENV = "DSV4C_LIGHTLLM_PROJECTION"

#: ``infer_state`` attributes the builder sets (tensors, so ``copy_for_cuda_graph`` sees them) and reads back.
_C4_PLAN, _C4_READ, _C4_SAVE = "dsv4c_c4_plan", "dsv4c_c4_read_rows", "dsv4c_c4_save_rows"
_C128_PLAN, _C128_SCRATCH = "dsv4c_c128_plan", "dsv4c_c128_scratch"
#: The builder itself (not a tensor: copy_for_cuda_graph leaves it alone; layers read its layout and options).
_BUILDER = "dsv4c_builder"
#: Where :func:`allot_online_hca_banks` puts the banks on LightLLM's memory manager.
_BANKS = "dsv4c_c128_state_banks"


class LightLLMNotInstalled(ImportError):
    """``install()`` was called where LightLLM (branch ``support_ds4``) cannot be imported."""


# ---------------------------------------------------------------------------------------------------------------
# The engine's geometry
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LightLLMLayout:
    """What the ops need to know about LightLLM's buffers (read once from its memory manager).

    ``max_request_num`` is also LightLLM's ``HOLD_REQUEST_ID``: request slots are ``0..max_request_num - 1`` and
    padding rows carry ``max_request_num``. ``c4_state_ring = 8 + mtp_step``; ``c128_state_ring =
    ceil((c128_ratio + mtp_step) / 4) * 4`` (our ``CompressorConfig.ring_rows``). ``index_dtype`` is the dtype of
    ``full_to_c4_indexs`` / ``full_to_c128_indexs`` (``build_plan`` reads either).
    """

    max_request_num: int
    mtp_step: int
    c4_state_ring: int
    c128_state_ring: int
    has_c4: bool = True
    has_c128: bool = True
    head_dim: int = 512
    c128_ratio: int = 128
    swa_page_size: int = SWA_PAGE_SIZE
    c4_page_size: int = C4_PAGE_SIZE
    c128_page_size: int = C128_PAGE_SIZE
    indexer_page_size: int = INDEXER_PAGE_SIZE
    index_dtype: torch.dtype = torch.int32

    def __post_init__(self) -> None:
        if self.max_request_num < 1 or self.mtp_step < 0:
            raise ValueError(f"LightLLMLayout: max_request_num >= 1 and mtp_step >= 0, got {self}")
        if self.has_c4 and self.c4_state_ring != C4_STATE_RING_BASE + self.mtp_step:
            raise ValueError(f"LightLLMLayout: c4_state_ring must be 8 + mtp_step = {8 + self.mtp_step}, "
                             f"got {self.c4_state_ring}")  # fmt: skip
        if self.has_c4 and self.c4_state_ring > self.swa_page_size:
            raise ValueError(f"LightLLMLayout: c4_state_ring {self.c4_state_ring} exceeds the SWA page "
                             f"{self.swa_page_size}")  # fmt: skip
        want = self.hca_config.ring_rows(self.mtp_step)
        if self.has_c128 and self.c128_state_ring != want:
            raise ValueError(f"LightLLMLayout: c128_state_ring must be ceil((r + mtp_step) / 4) * 4 = {want}, got "
                             f"{self.c128_state_ring}")  # fmt: skip

    @property
    def hca_config(self) -> CompressorConfig:
        """The HCA layers' configuration at this layout's ratio and head size."""
        return CompressorConfig(ratio=self.c128_ratio, head_dim=self.head_dim, rope_dim=64, overlap=False)

    @classmethod
    def from_mem_manager(
        cls, mem_manager, *, swa_page_size: int | None = None, c128_ratio: int | None = None
    ) -> LightLLMLayout:
        """Read the layout of a ``DeepseekV4MemoryManager``: ``max_request_num``, ``c4_state_ring``,
        ``c128_state_ring``, ``head_dim``, ``n_c4`` / ``n_c128``, the pools' ``page_size`` and the index tables'
        dtype; the SWA page and the C128 ratio are its module's ``DSV4_SWA_PAGE_SIZE`` and
        ``DSV4_C128_STATE_RING`` (128 and 128; a scaled-down stand-in may set others) unless given. Also before
        ``_init_buffers`` has run (LightLLM sizes its fixed buffers then, ``get_fixed_memory_size``): the pools'
        page sizes and the tables' dtype are then LightLLM's (64 / 2 / 64, int32)."""
        mm = mem_manager
        consts = _engine_constants(mm)
        has_c4, has_c128 = mm.n_c4 > 0, mm.n_c128 > 0

        def page_size(pool: str, default: int) -> int:
            found = getattr(mm, pool, None)
            return default if found is None else found.page_size

        table = getattr(mm, "full_to_c4_indexs" if has_c4 else "full_to_c128_indexs", None)
        return cls(
            max_request_num=mm.max_request_num,
            mtp_step=mm.c4_state_ring - consts["DSV4_C4_STATE_RING"],
            c4_state_ring=mm.c4_state_ring,
            c128_state_ring=mm.c128_state_ring,
            has_c4=has_c4,
            has_c128=has_c128,
            head_dim=mm.head_dim,
            c128_ratio=consts["DSV4_C128_STATE_RING"] if c128_ratio is None else c128_ratio,
            swa_page_size=consts["DSV4_SWA_PAGE_SIZE"] if swa_page_size is None else swa_page_size,
            c4_page_size=page_size("c4_pool", C4_PAGE_SIZE) if has_c4 else C4_PAGE_SIZE,
            c128_page_size=page_size("c128_pool", C128_PAGE_SIZE) if has_c128 else C128_PAGE_SIZE,
            indexer_page_size=page_size("c4_indexer_pool", INDEXER_PAGE_SIZE) if has_c4 else INDEXER_PAGE_SIZE,
            index_dtype=torch.int32 if table is None else table.dtype,
        )


def _engine_constants(mem_manager) -> dict[str, int]:
    """LightLLM's layout constants, from the module that defines the memory manager's class (its own values:
    a stand-in may scale them down), else LightLLM's."""
    module = sys.modules.get(type(mem_manager).__module__)
    defaults = {"DSV4_SWA_PAGE_SIZE": SWA_PAGE_SIZE, "DSV4_C4_STATE_RING": C4_STATE_RING_BASE,
                "DSV4_C128_STATE_RING": 128}  # fmt: skip
    return {name: int(getattr(module, name, value)) for name, value in defaults.items()}


# ---------------------------------------------------------------------------------------------------------------
# Once per step
# ---------------------------------------------------------------------------------------------------------------
class _StepBuffers:
    """One micro-batch's persistent per-step buffers (the addresses a captured graph reads)."""

    def __init__(self, layout: LightLLMLayout, max_rows: int, max_requests: int, device, check: bool):
        window = 2 * C4_RATIO  # CSA and indexer windows: 8 rows, 7 of them before the first new row
        self.c4_plan = self.c4_read = self.c4_save = None
        self.c128_plan = None
        if layout.has_c4:
            self.c4_plan = ops.empty_plan(max_rows, max_requests, C4_RATIO, device)
            self.c4_read = torch.full((max_requests, window - 1), -1, dtype=torch.int32, device=device)
            self.c4_save = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        if layout.has_c128:
            self.c128_plan = ops.empty_plan(max_rows, max_requests, layout.c128_ratio, device)
        self.err = torch.zeros(2, 4, dtype=torch.int32, device=device) if check else None


class StepBuilder:
    """LightLLM's per-step compressor metadata, built once per step for every compressor layer.

    Holds persistent buffers for steps of up to ``max_rows`` rows and ``max_requests`` requests (default: the
    layout's ``max_request_num``, the most a step can hold), one set per micro-batch (LightLLM's decode / prefill
    overlap runs two ``infer_state`` at once), and the per-layer options: ``online_hca`` (HCA on the online
    banks of :func:`allot_online_hca_banks`, not the C128 ring; its prefill steps split through the scratch
    below) and ``c128_kernel`` (``"tiled"``: the tiled kernel with a float32 scratch of ``max_rows x
    head_dim`` per micro-batch; ``"single"``: no scratch, the single-stage kernel). ``check=True`` also runs
    ``ops.check_plan`` on every plan (no synchronisation; read the result with :meth:`plan_errors`).
    """

    def __init__(
        self,
        layout: LightLLMLayout,
        *,
        max_rows: int,
        device,
        max_requests: int | None = None,
        microbatches: int = 2,
        online_hca: bool = False,
        c128_kernel: str = "tiled",
        check: bool = False,
        projection: str = "auto",
        hidden_size: int | None = None,
        indexer_head_dim: int = INDEXER_HEAD_DIM,
    ):
        if c128_kernel not in ("tiled", "single"):
            raise ValueError(f"StepBuilder: c128_kernel must be 'tiled' or 'single', got {c128_kernel!r}")
        if max_rows < 1 or microbatches < 1:
            raise ValueError(f"StepBuilder: max_rows and microbatches must be >= 1, got {max_rows}, {microbatches}")
        if projection not in PROJECTIONS:
            raise ValueError(f"StepBuilder: projection must be one of {PROJECTIONS}, got {projection!r}")
        if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, int)
                                        or hidden_size < 16 or hidden_size % 16):  # fmt: skip
            raise ValueError(f"StepBuilder: hidden_size must be None or a multiple of 16, got {hidden_size!r}")
        self.layout = layout
        self.max_rows = max_rows
        self.max_requests = layout.max_request_num if max_requests is None else max_requests
        self.online_hca = bool(online_hca)
        self.c128_kernel = c128_kernel
        self.device = torch.device(device)
        self._sets = [
            _StepBuffers(layout, max_rows, self.max_requests, self.device, check) for _ in range(microbatches)
        ]
        self.workspace = None
        if layout.has_c128 and (self.online_hca or c128_kernel == "tiled"):  # online: prefill steps split
            self.workspace = Workspace(C128ScratchPlan(microbatches, max_rows, layout.head_dim), self.device)
        # The projection from hidden states (ops.*_from_hidden) runs on steps of at most triton_rows(2W, D) rows
        # (projection_rows caps it); one workspace per micro-batch and stream group ("main": C4 main and C128
        # layers, one after another on LightLLM's main stream; "indexer": the indexer, on its aux stream in
        # prefill), for the groups whose widths take that path at all.
        self.projection = projection
        self.hidden_size = hidden_size
        self.projection_rows = max_rows if projection == "auto" else 0
        self._projection_ws: list[dict[str, torch.Tensor]] = [{} for _ in range(microbatches)]
        self._projection_need: dict[tuple[int, int], int] = {}
        #: why a compressor fell back to LightLLM's GEMM (reason -> calls): a weight the op cannot read
        self.projection_fallbacks: dict[str, int] = {}
        #: a C4 layer's two projections (main, indexer) of one x in one launch on decode steps of at most
        #: pair_rows(D) rows: the kv_score the layer's second compressor reads, per micro-batch (HeldScore)
        self.c4_widths = (4 * layout.head_dim, 4 * indexer_head_dim)
        self.c128_width = 2 * layout.head_dim if layout.has_c128 else 0
        self._paired: list[HeldScore | None] = [None] * microbatches
        if self.projection_rows and hidden_size is not None:
            widths = {"main": [4 * layout.head_dim] * layout.has_c4 + [2 * layout.head_dim] * layout.has_c128,
                      "indexer": [4 * indexer_head_dim] * layout.has_c4}  # fmt: skip
            for group, sizes in widths.items():
                sizes = [w for w in sizes if self.triton_rows(w, hidden_size)]
                if sizes:
                    need = max(self._workspace_need(w, hidden_size) for w in sizes)
                    for sets in self._projection_ws:
                        sets[group] = torch.zeros(need, dtype=torch.float32, device=self.device)
            if layout.has_c4 and self.pair_rows(hidden_size):
                need = self._workspace_need(sum(self.c4_widths), hidden_size, self.pair_rows(hidden_size))
                for sets in self._projection_ws:
                    sets["pair"] = torch.zeros(need, dtype=torch.float32, device=self.device)
        self.steps = 0  # steps built (tests count them: once per step, whatever the layer count)

    @property
    def nbytes(self) -> int:
        """Device bytes the builder holds: its plans, tables, scratch and projection workspaces (what LightLLM's
        fixed-memory sizing counts for it, :func:`install`)."""
        tensors = [t for bufs in self._sets for t in vars(bufs).values() if isinstance(t, torch.Tensor)]
        tensors += [t for sets in self._projection_ws for t in sets.values()]
        if self.workspace is not None:
            tensors.append(self.workspace.buffer)
        return sum(t.numel() * t.element_size() for t in tensors)

    def triton_rows(self, width: int, dim: int) -> int:
        """The most rows of a step whose ``width`` (``2W``) x ``dim`` (``D``) projection runs as ours
        (:func:`compress_layer_from_hidden`): ``ops.projection_triton_rows`` (where our kernel is faster than
        cuBLAS; for the C128 layers on online banks, where ``ops.compress_online_hca_from_hidden``'s partials path
        is) within :attr:`projection_rows` (the builder's rows with ``projection="auto"``, else 0)."""
        online = self.online_hca and width == self.c128_width
        return min(self.projection_rows, ops.projection_triton_rows(width, dim, online=online))

    def pair_rows(self, dim: int) -> int:
        """The most rows of a decode step whose C4 layers project main and indexer in one launch
        (``ops.pair_projection_rows`` of the C4 widths, where that measured faster than two projections, within
        :attr:`projection_rows`)."""
        return min(self.projection_rows, ops.pair_projection_rows(*self.c4_widths, dim))

    def _workspace_need(self, width: int, dim: int, rows: int | None = None) -> int:
        rows = self.triton_rows(width, dim) if rows is None else rows
        key = (width, dim, rows)
        if key not in self._projection_need:
            self._projection_need[key] = ops.projection_workspace_numel(max(1, rows), width, dim)
        return self._projection_need[key]

    def projection_workspace(self, microbatch: int, group: str, width: int, dim: int) -> torch.Tensor:
        """The projection workspace of ``group`` (``"main"`` / ``"indexer"``, or ``"pair"``: a C4 layer's two
        projections) for micro-batch ``microbatch``, holding a ``width`` (``2W``) x ``dim`` (``D``) projection of
        up to :meth:`triton_rows` rows (``"pair"``: :meth:`pair_rows`). Allotted with the builder when it knows
        ``hidden_size``; else at the first call, which must not be under CUDA graph capture (LightLLM's warm-up
        forward runs eagerly before it captures)."""
        sets = self._projection_ws[microbatch]
        ws = sets.get(group)
        need = self._workspace_need(width, dim, self.pair_rows(dim) if group == "pair" else None)
        if ws is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise CapacityError(
                    "lightllm StepBuilder: the projection workspace would be allotted during CUDA graph capture; "
                    "give the builder hidden_size= (install() reads it from LightLLM's model config)"
                )
            ws = sets[group] = torch.zeros(need, dtype=torch.float32, device=self.device)
        elif ws.numel() < need:
            raise CapacityError(
                f"lightllm StepBuilder: the {group} projection workspace holds {ws.numel()} floats; a {width} x "
                f"{dim} projection of {self.pair_rows(dim) if group == 'pair' else self.triton_rows(width, dim)} "
                f"rows needs {need} (hidden_size or the "
                f"indexer's head size differ from the model's)"
            )
        return ws

    @staticmethod
    def rows_for_model(model, mtp_step: int) -> int:
        """The most rows one forward of a LightLLM model hands the compressors: the largest of
        ``batch_max_tokens`` (a prefill forward), ``max_req_num * (mtp_step + 1)`` (a decode forward) and
        ``graph_max_batch_size`` (a captured decode graph, padding included: LightLLM keeps it in rows,
        ``basemodel.py`` L83-87), rounded up to 64 (token padding for TP / SP mixing)."""
        need = max(
            int(getattr(model, "batch_max_tokens", None) or 0),
            int(model.max_req_num) * (mtp_step + 1),
            int(getattr(model, "graph_max_batch_size", 0) or 0),
        )
        return -(-need // 64) * 64

    @staticmethod
    def microbatches_for_model(model) -> int | None:
        """Micro-batches a LightLLM model runs at once: its ``dsv4_workspace.microbatch_count`` (2 with decode or
        prefill micro-batch overlap, ``models/deepseek_v4/workspace.py`` L110-111), ``None`` if it has none."""
        workspace = getattr(model, "dsv4_workspace", None)
        count = getattr(workspace, "microbatch_count", None)
        return None if count is None else int(count)

    @classmethod
    def for_model(cls, model, **options) -> StepBuilder:
        """A builder sized from a LightLLM model: its memory manager's layout, :meth:`rows_for_model` rows and
        :meth:`microbatches_for_model` micro-batches (2 when the model does not say). ``options`` go to the
        constructor (``max_rows`` and ``microbatches`` override)."""
        layout = LightLLMLayout.from_mem_manager(model.mem_manager)
        if options.get("max_rows") is None:
            options["max_rows"] = cls.rows_for_model(model, layout.mtp_step)
        if options.get("microbatches") is None:
            options["microbatches"] = cls.microbatches_for_model(model) or 2
        if options.get("hidden_size") is None:
            options["hidden_size"] = _hidden_size(getattr(model, "config", None))
        device = options.pop("device", None)
        if device is None:
            device = (
                model.mem_manager.full_to_c4_indexs if layout.has_c4 else model.mem_manager.full_to_c128_indexs
            ).device
        return cls(layout, device=device, **options)

    #: The launches of a build, in order (``build(parts=...)`` runs a subset: timing probes).
    PARTS = ("plans", "state_rows")

    def build(self, infer_state, *, parts=PARTS) -> None:
        """Build the step's plans and C4 state-row tables from LightLLM's ``infer_state`` (after its own
        ``init_some_extra_state`` set ``position_ids`` and ``dsv4_sparse_req_idx``) and set them as
        ``infer_state`` attributes. Device work only; host reads are of shapes and Python attributes: one
        ``build_plans`` of every ratio's plan, each reading its out slots through LightLLM's table itself
        (``out_slot=mem_index``, ``out_slot_map=full_to_c4_indexs`` / ``full_to_c128_indexs``) and, in the same
        call, the C4 plan's state-row tables (``mode="token_map_ring"``): one launch on steps of up to
        ``kernels.plan.PLAN_ONE_BLOCK_MAX_ROWS`` rows and requests, else one per plan and one for the tables
        (``check=True`` adds a ``check_plan`` per plan, which also reports a group end whose ``mem_index`` lies
        outside the table). ``parts`` (a subset of :data:`PARTS`) is for timing probes only: ``("plans",)`` the
        plans alone (a plan rebuilt without its tables is refused by the next compress), ``("state_rows",)`` the
        tables alone by ``build_state_rows``."""
        lay = self.layout
        positions = infer_state.position_ids
        rows = positions.shape[0]
        if rows > self.max_rows:
            raise CapacityError(
                f"lightllm StepBuilder: a step of {rows} rows, but the buffers hold {self.max_rows} (build the "
                f"builder with a larger max_rows: batch_max_tokens, or the decode rows of max_req_num requests)"
            )
        mb = int(getattr(infer_state, "microbatch_index", 0) or 0)
        if mb >= len(self._sets):
            raise CapacityError(f"lightllm StepBuilder: micro-batch {mb}, but the builder has {len(self._sets)}")
        buf = self._sets[mb]
        row_req = _row_requests(infer_state, rows)
        mem_index = infer_state.mem_index.reshape(-1)
        mm = infer_state.mem_manager
        # LightLLM's C4 state rows: (swa // 128) * ring + swa % ring of the SWA slot of each (request, position)
        c4_tables = dict(
            read_rows=buf.c4_read, save_rows=buf.c4_save, ring=lay.c4_state_ring,
            req_to_token=infer_state.req_manager.req_to_token_indexs, token_to_state=mm.full_to_swa_indexs,
            state_page=lay.swa_page_size, page_tail=lay.c4_state_ring,
        ) if lay.has_c4 else {}  # fmt: skip
        if "plans" in parts:  # every ratio's plan and the C4 tables in one build_plans (one launch when it fits)
            built = [(buf.c4_plan, C4_RATIO, mm.full_to_c4_indexs)] if lay.has_c4 else []
            if lay.has_c128:
                built.append((buf.c128_plan, lay.c128_ratio, mm.full_to_c128_indexs))
            with_tables = dict(state_mode="token_map_ring", **c4_tables) if c4_tables and "state_rows" in parts else {}
            if built:
                plans, ratios, maps = (list(column) for column in zip(*built))
                ops.build_plans(
                    plans, positions, row_req, [mem_index] * len(plans), ratios=ratios,
                    num_slots=lay.max_request_num, out_slot_maps=maps, mtp_step=lay.mtp_step, **with_tables,
                )  # fmt: skip
        elif c4_tables and "state_rows" in parts:  # the tables alone (a timing probe's part)
            read, save = c4_tables.pop("read_rows"), c4_tables.pop("save_rows")
            ops.build_state_rows(buf.c4_plan, read, save, mode="token_map_ring", **c4_tables)
        if lay.has_c4:
            setattr(infer_state, _C4_PLAN, buf.c4_plan)
            setattr(infer_state, _C4_READ, buf.c4_read)
            setattr(infer_state, _C4_SAVE, buf.c4_save)
        if lay.has_c128:
            setattr(infer_state, _C128_PLAN, buf.c128_plan)
            if self.workspace is not None:
                setattr(infer_state, _C128_SCRATCH, self.workspace.buffer[mb])
        if buf.err is not None:
            decode = not infer_state.is_prefill
            for k, plan in enumerate((buf.c4_plan, buf.c128_plan)):
                if plan is not None:
                    ops.check_plan(plan, None, buf.err[k], mtp_step=lay.mtp_step, decode=decode)
        setattr(infer_state, _BUILDER, self)
        self.steps += 1

    def plan_errors(self, microbatch: int = 0) -> list[str]:
        """Messages of ``check_plan`` findings of the micro-batch's last step (reads the device: a sync)."""
        err = self._sets[microbatch].err
        if err is None:
            raise ValueError("StepBuilder: plan_errors needs check=True")
        return [m for m in (ops.plan_error(err[0]), ops.plan_error(err[1])) if m is not None]


def _row_requests(infer_state, rows: int) -> torch.Tensor:
    """Each row's request slot: LightLLM's ``dsv4_sparse_req_idx`` (``b_req_idx`` repeated in prefill, ``b_req_idx``
    itself in decode), else derived the same way (``output_size`` keeps ``repeat_interleave`` sync-free)."""
    row_req = getattr(infer_state, "dsv4_sparse_req_idx", None)
    if row_req is None:
        if infer_state.is_prefill:
            row_req = torch.repeat_interleave(infer_state.b_req_idx, infer_state.b_q_seq_len, output_size=rows)
        else:
            row_req = infer_state.b_req_idx
    return row_req


# ---------------------------------------------------------------------------------------------------------------
# Per layer
# ---------------------------------------------------------------------------------------------------------------
def _step_tensor(infer_state, name: str) -> torch.Tensor:
    t = getattr(infer_state, name, None)
    if t is None:
        raise RuntimeError(
            f"lightllm adapter: infer_state has no {name}: the step builder did not run (dsv4c_lightllm.install() "
            f"patches DeepseekV4InferStateInfo.init_some_extra_state; or call StepBuilder.build(infer_state))"
        )
    return t


def _layer_op(kind: str, infer_state, layer_idx: int, *, ape, norm_weight, cos, sin, eps):
    """The op of one compressor of one layer on LightLLM's buffers: ``(builder, op name, positional arguments
    after kv_score, keyword arguments)`` (views and attribute reads only, no device work)."""
    builder: StepBuilder = _step_tensor(infer_state, _BUILDER)
    lay = builder.layout
    mm = infer_state.mem_manager
    decode = not infer_state.is_prefill
    head = norm_weight.shape[0]
    args = dict(norm_weight=norm_weight, cos=cos, sin=sin, eps=eps, decode=decode)
    if kind in ("c4", "indexer"):
        plan = _step_tensor(infer_state, _C4_PLAN)
        args.update(read_rows=_step_tensor(infer_state, _C4_READ), save_rows=_step_tensor(infer_state, _C4_SAVE))
        ape = ape.view(C4_RATIO, 2, head)
        if kind == "c4":
            args.update(state=mm.get_c4_state_buffer(layer_idx), out_pages=mm.get_compressed_kv_buffer(layer_idx),
                        kind="csa", page_size=lay.c4_page_size)  # fmt: skip
        else:
            pages = mm.c4_indexer_pool.get_layer_buffer(mm.layer_to_c4_idx[layer_idx])
            args.update(state=mm.get_c4_indexer_state_buffer(layer_idx), out_pages=pages, kind="indexer",
                        page_size=lay.indexer_page_size, indexer_pack=INDEXER_PACK)  # fmt: skip
        return builder, "compress", (plan, ape), args
    if kind != "c128":
        raise ValueError(f"compress_layer: kind must be 'c4', 'indexer' or 'c128', got {kind!r}")
    plan = _step_tensor(infer_state, _C128_PLAN)
    ape = ape.view(lay.c128_ratio, 1, head)
    args.update(out_pages=mm.get_compressed_kv_buffer(layer_idx), page_size=lay.c128_page_size)
    if builder.online_hca:
        scratch = None if decode else _step_tensor(infer_state, _C128_SCRATCH)  # prefill steps split
        args.update(state_banks=c128_state_banks(mm, layer_idx), scratch=scratch)
        return builder, "compress_online_hca", (plan, ape), args
    scratch = _step_tensor(infer_state, _C128_SCRATCH) if builder.c128_kernel == "tiled" else None
    args.update(state=mm.get_c128_state_buffer(layer_idx), kind="hca", ring=lay.c128_state_ring, scratch=scratch)
    return builder, "compress", (plan, ape), args


def compress_layer(
    kind: str,
    kv_score: torch.Tensor,
    infer_state,
    layer_idx: int,
    *,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> None:
    """One compressor of one layer for the step: a single op on LightLLM's buffers.

    ``kind``: ``"c4"`` (the CSA latent), ``"indexer"`` (the C4 layer's indexer keys, FP8 packs only) or
    ``"c128"`` (the HCA latent; ring or online banks as the step's builder says). ``kv_score``: fp32 ``[T, 2W]``
    from LightLLM's GEMM (not written). ``ape``: the checkpoint's ``[r, coff * H]`` weight (viewed here as
    ``[r, coff, H]``); ``norm_weight``: bf16 ``[H]``; ``cos`` / ``sin``: the layer's compress rope tables.
    """
    _, name, args, kwargs = _layer_op(kind, infer_state, layer_idx, ape=ape, norm_weight=norm_weight, cos=cos,
                                      sin=sin, eps=eps)  # fmt: skip
    getattr(ops, name)(kv_score, *args, **kwargs)


def compress_layer_from_hidden(
    kind: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    infer_state,
    layer_idx: int,
    *,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> None:
    """:func:`compress_layer` from the layer's hidden states: ``ops.compress_from_hidden`` (or
    ``ops.compress_online_hca_from_hidden``) projects ``x`` (bf16 ``[>= T, D]``) with ``weight`` (bf16 ``[2W, D]``,
    unit stride along ``D``: ``.t()`` of LightLLM's ``[D, 2W]`` weight view) through the step builder's
    projection workspace, then compresses as :func:`compress_layer` does. For steps of at most
    ``builder.triton_rows(2W, D)`` rows (where the Triton projection is the faster path)."""
    builder, name, args, kwargs = _layer_op(kind, infer_state, layer_idx, ape=ape, norm_weight=norm_weight, cos=cos,
                                            sin=sin, eps=eps)  # fmt: skip
    mb = int(getattr(infer_state, "microbatch_index", 0) or 0)
    ws = builder.projection_workspace(mb, "indexer" if kind == "indexer" else "main", weight.shape[0], x.shape[1])
    getattr(ops, name + "_from_hidden")(x, weight, ws, *args, projection="auto", **kwargs)


def _gemm(linear, x: torch.Tensor, use_custom_tensor_manager: bool) -> torch.Tensor:
    """LightLLM's replicated bf16 GEMM to fp32 ``kv_score``. The allocator flag (spelled as LightLLM spells it)
    is passed only when off: the prefill aux stream must not use the main stream's tensor manager."""
    if use_custom_tensor_manager:
        return linear.mm(x, out_dtype=torch.float32)
    return linear.mm(x, use_custom_tensor_mananger=False, out_dtype=torch.float32)


#: LightLLM weight object -> (the tensor it was read from, the ``[2W, D]`` weight or the reason there is none).
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def projection_weight(linear, width: int, dim: int) -> tuple[torch.Tensor | None, str | None]:
    """The ``[2W, D]`` weight ``ops.compress_from_hidden`` takes, from LightLLM's weight object, as
    ``(weight, None)``; or ``(None, reason)`` where the op cannot read it, and LightLLM's GEMM runs. LightLLM's
    ``ROWMMWeight`` (``support_ds4``: ``mm_weight.py`` ``MMWeightTpl``) keeps the checkpoint's row-major ``[2W, D]``
    in ``mm_param.weight`` and, unquantized, a ``NoQuantization`` (``method_name`` ``"none"``) as its
    ``quant_method``; its ``mm`` is ``torch.mm(x, weight.t(), out_dtype=float32)``. An older layout kept a
    ``weight`` attribute, the ``[D, 2W]`` transposed view (``_process_weight``): read as ``weight.t()``. Refused:
    a quantization method, a bias, another dtype or shape, a weight without unit stride along ``D``. Cached per
    weight object and tensor."""
    pack = getattr(linear, "mm_param", None)
    tensor = getattr(pack, "weight", None) if pack is not None else getattr(linear, "weight", None)
    try:
        cached = _WEIGHTS.get(linear)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None and cached[0] is tensor:
        return cached[1]
    quant = getattr(linear, "quant_method", None)
    method = getattr(quant, "method_name", None)
    if quant is not None and method != "none":
        found = None, f"the weight is quantized (quant_method {method or type(quant).__name__})"
    elif getattr(linear, "bias", None) is not None:
        found = None, "the GEMM has a bias"
    elif not isinstance(tensor, torch.Tensor):
        found = None, f"{type(linear).__name__} has no weight tensor (mm_param.weight)"
    elif tensor.dtype != torch.bfloat16:
        found = None, f"the weight is {tensor.dtype}, not bf16"
    elif pack is not None:  # [2W, D] row-major
        if tuple(tensor.shape) != (width, dim):
            found = None, f"mm_param.weight is {list(tensor.shape)}, not [2W, D] = [{width}, {dim}]"
        elif dim > 1 and tensor.stride(1) != 1:
            found = None, "mm_param.weight [2W, D] has no unit stride along D"
        else:
            found = tensor, None
    elif tuple(tensor.shape) != (dim, width):
        found = None, f"the weight is {list(tensor.shape)}, not the [D, 2W] = [{dim}, {width}] view"
    elif dim > 1 and tensor.stride(0) != 1:
        found = None, "the weight [D, 2W] is not the transposed view of a row-major [2W, D] tensor"
    else:
        found = tensor.t(), None
    try:
        _WEIGHTS[linear] = (tensor, found)
    except TypeError:
        pass
    return found


def _x_key(x: torch.Tensor, builder: StepBuilder, layer_idx: int) -> tuple:
    return (layer_idx, builder.steps, *tensor_key(x))


#: The layer weights of each C4 compressor's parameters (LightLLM's ``DeepseekV4TransformerLayerWeight``):
#: ``wkv_gate`` linear, APE, norm.
_C4_WEIGHTS = {
    "c4": ("compressor_wkv_gate_", "compressor_ape_", "compressor_norm_"),
    "indexer": ("idx_cmp_wkv_gate_", "idx_cmp_ape_", "idx_cmp_norm_"),
}


def _compressed_with(kind: str, layer_weight, cos, sin, eps) -> tuple:
    """What a C4 compressor's compression reads besides its ``kv_score`` and LightLLM's buffers (compared by
    identity; ``eps`` by value)."""
    _, ape, norm = _C4_WEIGHTS[kind]
    return (id(getattr(layer_weight, ape).weight), id(getattr(layer_weight, norm).weight), id(cos), id(sin), eps)


def _compress_c4_pair(kv: dict, infer_state, layer_weight, layer_idx: int, cos, sin, eps) -> None:
    """Both compressors of a C4 layer (``kv``: each kind's ``kv_score`` columns) in one ``ops.compress_pair`` on
    LightLLM's buffers, each with its own APE and norm weight and this call's rope tables and ``eps``."""
    calls = {}
    for kind, (_, ape, norm) in _C4_WEIGHTS.items():
        weights = dict(ape=getattr(layer_weight, ape).weight, norm_weight=getattr(layer_weight, norm).weight)
        _, _, args, kwargs = _layer_op(kind, infer_state, layer_idx, cos=cos, sin=sin, eps=eps, **weights)
        calls[kind] = ((kv[kind], *args), kwargs)
    compress_pair_of(calls["c4"], calls["indexer"])


def _paired_step(builder: StepBuilder, kind: str, x, infer_state, layer_weight, layer_idx: int, cos, sin,
                 eps) -> bool:  # fmt: skip
    """On a decode step, a C4 layer's compressor ``kind`` (``"c4"`` / ``"indexer"``) through its pair; ``True``
    where it is done (its entries and state written), ``False`` where the pair does not apply (a prefill step,
    a larger step, a weight the op cannot read) and the caller's own path runs.

    LightLLM's decode calls ``compressor.compress(x)`` then ``write_indexer_k(x)`` (``transformer_layer_infer.py``).
    The first of the two projects both weights in one call and compresses both in one ``ops.compress_pair``
    (each compressor's APE and norm weight from the layer's weights; the rope tables and ``eps`` of this call),
    and holds what it did; the second is then done if its ``x`` is the same tensor, unchanged, on the same
    stream, in the same step, and it reads the same APE, norm weight, rope tables and ``eps``; if only the ``x``
    matches, it compresses the held columns with its own arguments (a decode step's windows read no row the
    step saves, so compressing again rewrites the same state and the right entries); else it projects afresh.
    Where :func:`join_c4_weights` made the two weights one tensor's halves: one cuBLAS GEMM of the joint weight
    (``ops.project``, the fastest path measured at every step size) into a float32 ``[T, 2W_main + 2W_indexer]``
    allocated as LightLLM's GEMM allocates its output, on every decode step the builder serves; else our one
    Triton launch over both into the builder's ``"pair"`` workspace, on steps of at most ``builder.pair_rows(D)``
    rows."""
    rows, dim = infer_state.position_ids.shape[0], x.shape[1]
    if infer_state.is_prefill or not 0 < rows <= builder.projection_rows:
        return False
    mb = int(getattr(infer_state, "microbatch_index", 0) or 0)
    key = _x_key(x, builder, layer_idx)
    held, builder._paired[mb] = builder._paired[mb], None
    mine = _compressed_with(kind, layer_weight, cos, sin, eps)
    if held is not None and held.key == key and held.kind == kind:
        if held.compressed != mine:
            ape, norm = (getattr(layer_weight, name).weight for name in _C4_WEIGHTS[kind][1:])
            compress_layer(kind, held.kv_score, infer_state, layer_idx, ape=ape, norm_weight=norm, cos=cos, sin=sin,
                           eps=eps)  # fmt: skip
        return True
    first, second = builder.c4_widths
    w_main, why_main = projection_weight(layer_weight.compressor_wkv_gate_, first, dim)
    w_idx, why_idx = projection_weight(layer_weight.idx_cmp_wkv_gate_, second, dim)
    if w_main is None or w_idx is None:
        return False  # the compressor's own path counts the fallback
    if ops.joint_pair_weight(w_main, w_idx) is not None:
        kv = joint_kv_score(x, w_main, w_idx, rows)
    elif rows <= builder.pair_rows(dim):
        ws = builder.projection_workspace(mb, "pair", first + second, dim)
        ops.project(x, w_main, ws, rows=rows, weight2=w_idx)
        kv = ws[: rows * (first + second)].view(rows, first + second)
    else:
        return False
    columns = {"c4": kv[:, :first], "indexer": kv[:, first:]}
    _compress_c4_pair(columns, infer_state, layer_weight, layer_idx, cos, sin, eps)
    other = "indexer" if kind == "c4" else "c4"
    done = _compressed_with(other, layer_weight, cos, sin, eps)
    builder._paired[mb] = HeldScore(key, other, columns[other], compressed=done)
    return True


def join_c4_weights(layer_weights) -> int:
    """Make each C4 layer's two compressor weights (``compressor_wkv_gate_`` and ``idx_cmp_wkv_gate_``: LightLLM's
    ``ROWMMWeight``, unquantized bf16 ``[2W, D]`` in ``mm_param.weight``) the halves of one tensor
    (``ops.join_pair_weights``), so a decode step projects both in one GEMM (:func:`_paired_step`); returns
    the number of layers whose weights are joined. Every ``WeightPack`` of the weight object
    (``mm_param`` and the ``mm_param_list`` views LightLLM's loader writes into, ``weight_pack.weight[:].copy_``)
    is re-pointed at the same offsets of the joint tensor, so a load after the join (LightLLM loads after it
    sizes its KV cache: ``basemodel.py`` ``_init_weights``, ``_init_mem_manager``, ``load_weights``) fills it.
    Called by the patched ``DeepseekV4TpPartModel._init_mem_manager`` before LightLLM's own, so the two old
    tensors are freed (and on CUDA the cache emptied) before the KV cache is sized. A layer whose weight objects
    the op cannot read, or whose packs do not all view the one weight, is left as it is."""
    joined = 0
    for layer_weight in layer_weights:
        linears = [getattr(layer_weight, name, None) for name in ("compressor_wkv_gate_", "idx_cmp_wkv_gate_")]
        if any(getattr(linear, "mm_param", None) is None for linear in linears):
            continue
        weights = [linear.mm_param.weight for linear in linears]
        if not all(isinstance(w, torch.Tensor) and w.ndim == 2 for w in weights):
            continue
        dim = int(weights[0].shape[1])
        if any(projection_weight(linear, int(w.shape[0]), dim)[1] is not None for linear, w in zip(linears, weights)):
            continue
        if ops.joint_pair_weight(*weights) is not None:
            joined += 1
            continue
        packs = [_packs_viewing(linear, w) for linear, w in zip(linears, weights)]
        if any(p is None for p in packs) or any(w.stride() != (dim, 1) for w in weights):
            continue
        with torch.no_grad():
            joint = ops.join_pair_weights(*weights)
        lo = 0
        for linear_packs, w in zip(packs, weights):
            base = w.storage_offset()
            for pack in linear_packs:
                t = pack.weight
                pack.weight = joint.as_strided(t.shape, t.stride(), lo * dim + t.storage_offset() - base)
            lo += int(w.shape[0])
        del joint, weights, packs
        if linears[0].mm_param.weight.is_cuda:
            torch.cuda.empty_cache()  # the two old tensors' blocks back before the next layer's copy
        joined += 1
    return joined


def _packs_viewing(linear, weight: torch.Tensor):
    """``linear``'s weight packs (``mm_param`` and ``mm_param_list``), if each holds a view of ``weight``'s rows
    (its storage, within its span); else ``None``."""
    packs = [linear.mm_param, *(getattr(linear, "mm_param_list", None) or [])]
    storage = weight.untyped_storage().data_ptr()
    lo, hi = weight.storage_offset(), weight.storage_offset() + weight.numel()
    for pack in packs:
        t = getattr(pack, "weight", None)
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != storage:
            return None
        if t.stride() != weight.stride() or not lo <= t.storage_offset() <= t.storage_offset() + t.numel() <= hi:
            return None
    return packs


def compressor_compress(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
    """Replacement of ``CompressorInfer.compress`` (C4 main, C128, or the indexer when ``is_in_indexer``): with
    the builder's ``projection="auto"``: on a decode step of at most ``builder.pair_rows(D)`` rows (every decode
    step the builder serves where the weights are joined), a C4 layer's two compressors share one projection and
    one compression (:func:`_paired_step`); on a
    step of at most ``builder.triton_rows(2W, D)`` rows, :func:`compress_layer_from_hidden` (our projection and
    compression, ``kv_score`` in the builder's workspace); otherwise, or where :func:`projection_weight` finds no
    weight the op reads, LightLLM's GEMM then :func:`compress_layer`. Returns ``None``: the entries are in
    LightLLM's pools."""
    ratio = self.compress_ratio
    if ratio == 0:
        return None
    if self.is_in_indexer:
        kind, linear, norm, ape = "indexer", "idx_cmp_wkv_gate_", "idx_cmp_norm_", "idx_cmp_ape_"
    else:
        kind = "c4" if ratio == C4_RATIO else "c128"
        linear, norm, ape = "compressor_wkv_gate_", "compressor_norm_", "compressor_ape_"
    linear = getattr(layer_weight, linear)
    norm_weight = getattr(layer_weight, norm).weight
    layer = dict(ape=getattr(layer_weight, ape).weight, norm_weight=norm_weight, cos=cos_table, sin=sin_table,
                 eps=self.eps)  # fmt: skip
    builder = getattr(infer_state, _BUILDER, None)
    width = 2 * norm_weight.shape[0] * (1 if kind == "c128" else 2)
    if builder is not None and kind != "c128":
        if _paired_step(builder, kind, x, infer_state, layer_weight, self.layer_idx_, cos_table, sin_table, self.eps):
            return None
    if builder is not None and 0 < infer_state.position_ids.shape[0] <= builder.triton_rows(width, x.shape[1]):
        weight, reason = projection_weight(linear, width, x.shape[1])
        if weight is not None:
            compress_layer_from_hidden(kind, x, weight, infer_state, self.layer_idx_, **layer)
            return None
        builder.projection_fallbacks[reason] = builder.projection_fallbacks.get(reason, 0) + 1
    kv_score = _gemm(linear, x, use_custom_tensor_manager)
    compress_layer(kind, kv_score, infer_state, self.layer_idx_, **layer)
    return None


def write_indexer_k(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
    """Replacement of ``DeepseekV4IndexInfer.write_indexer_k`` (indexer compress, ``hadamard_transform`` and
    ``pack_indexer_k_to_cache``): the GEMM, then one op writing the 132-byte packs into ``c4_indexer_pool``."""
    if self.compress_ratio != C4_RATIO:
        return
    compressor_compress(self.indexer_compressor, x, infer_state, layer_weight, cos_table, sin_table,
                        use_custom_tensor_manager)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Online HCA state
# ---------------------------------------------------------------------------------------------------------------
def _bank_shape(mem_manager, layout: LightLLMLayout) -> tuple[int, ...]:
    # one bank set per request slot and the HOLD slot, as LightLLM's C128 ring has (max_req + 1) slots
    return (mem_manager.n_c128, layout.max_request_num + 1, layout.mtp_step + 1, 3, layout.head_dim)


def allot_online_hca_banks(mem_manager, layout: LightLLMLayout | None = None) -> torch.Tensor:
    """Allot the online HCA state on LightLLM's memory manager, in place of the C128 ring: float32
    ``[n_c128, max_req + 1, mtp_step + 1, 3, head_dim]`` (zeros: no bank is read before it was written)."""
    layout = LightLLMLayout.from_mem_manager(mem_manager) if layout is None else layout
    device = mem_manager.full_to_c128_indexs.device
    banks = torch.zeros(_bank_shape(mem_manager, layout), dtype=torch.float32, device=device)
    setattr(mem_manager, _BANKS, banks)
    return banks


def c128_state_banks(mem_manager, layer_idx: int) -> torch.Tensor:
    """The online banks ``[max_req + 1, mtp_step + 1, 3, head_dim]`` of HCA layer ``layer_idx``."""
    banks = getattr(mem_manager, _BANKS, None)
    if banks is None:
        raise RuntimeError("lightllm adapter: online HCA needs allot_online_hca_banks(mem_manager) (install(online_hca"
                           "=True) does it in DeepseekV4MemoryManager._init_buffers)")  # fmt: skip
    return banks[mem_manager.layer_to_c128_idx[layer_idx]]


def _pd_bank_section(mover, page_index: int, banks: torch.Tensor) -> torch.Tensor:
    """Where a PD page carries one request's bank: the first ``3 * H`` float32 of each HCA layer's slice of the
    page's C128 state section (``DeepseekV4PDCacheLayout``, mem manager L262-266: 127 ring rows of ``2H``
    float32 per layer, which online HCA leaves unused). float32 ``[n_c128, 3 * H]``, a view of the page."""
    layout = mover.pd_cache_layout
    layers, words = banks.shape[0], banks.shape[3] * banks.shape[4]
    if layout.c128_state_layer_nbytes < words * 4:
        raise RuntimeError(f"lightllm adapter: the PD page's C128 state section holds {layout.c128_state_layer_nbytes}"
                           f" bytes per layer, a bank needs {words * 4}")  # fmt: skip
    start, end = layout.c128_state_offset, layout.c128_state_offset + layout.c128_state_nbytes
    section = mover.kv_move_buffer[page_index].reshape(-1)[start:end].view(torch.float32)
    return section.view(layers, -1)[:, :words]


def move_pd_banks(direction: str, mover, owner, *, page_index: int, start_kv_index: int, token_num: int,
                  request_kv_len: int, req_idx: int) -> bool:  # fmt: skip
    """Carry one request's online HCA state through LightLLM's PD transfer (prefill node to decode node).

    ``direction="pack"`` (prefill node, after ``write_mem_to_page_kv_move_buffer`` staged the page) copies the
    bank holding the state after ``request_kv_len`` positions, of request slot ``req_idx`` in ``owner`` (the
    memory manager whose cache the page reads, ``mem_managers[dp_index]``), into PD page ``page_index`` of
    ``mover.kv_move_buffer``; ``"unpack"`` (decode node, after ``read_page_kv_move_buffer_to_mem``) copies it
    from the page into the decode node's bank of that length for ``req_idx`` (its own slot). The state is
    carried by the page holding the request's last position, and only when that position leaves a group open
    (``request_kv_len % 128 != 0``: a closed group needs no state); LightLLM sends that page whole
    (``layout.page_nbytes``, ``pd_cache_io.py`` L351-367). The two nodes may keep different bank counts
    (a prefill node runs with ``mtp_step`` 0, ``model.py`` L96): each uses bank ``request_kv_len % B`` of its
    own. Device copies on the current stream (LightLLM's copy stream). Returns whether it copied."""
    banks = getattr(owner, _BANKS, None)
    if banks is None or direction not in ("pack", "unpack"):
        raise ValueError(f"move_pd_banks: direction 'pack' or 'unpack' on a memory manager with online banks, got "
                         f"{direction!r}, banks {'absent' if banks is None else 'present'}")  # fmt: skip
    ratio = LightLLMLayout.from_mem_manager(owner).c128_ratio
    last = request_kv_len - 1
    if request_kv_len % ratio == 0 or not start_kv_index <= last < start_kv_index + token_num:
        return False
    section = _pd_bank_section(mover, page_index, banks)
    bank = banks[:, req_idx, request_kv_len % banks.shape[2]].view(banks.shape[0], -1)
    if direction == "pack":
        section.copy_(bank)
    else:
        bank.copy_(section)
    return True


def online_hca_savings(hca_layers: int, mtp_step: int = 3, config: CompressorConfig | None = None) -> int:
    """Bytes per request freed by online HCA banks in place of LightLLM's C128 ring, over ``hca_layers``
    layers: ``ring_rows(mtp_step) * 2H * 4`` (the ring) minus ``(mtp_step + 1) * 3 * H * 4`` (the banks)."""
    cfg = CompressorConfig.hca() if config is None else config
    ring = cfg.ring_bytes(mtp_step)
    banks = (mtp_step + 1) * 3 * cfg.head_dim * 4
    return hca_layers * (ring - banks)


def online_hca_memory_report(mtp_step: int = 3) -> dict[str, int]:
    """Bytes per request freed by online HCA, for each model of SPEC section 1 (V4-Flash, V4-Pro)."""
    from ..bench.floors import MODELS  # the layer counts of SPEC section 1 (pure Python)

    return {name: online_hca_savings(layers["hca"], mtp_step) for name, layers in MODELS.items()}


# ---------------------------------------------------------------------------------------------------------------
# LightLLM's start arguments and modes
# ---------------------------------------------------------------------------------------------------------------
#: The launcher's switch, inherited by every process LightLLM spawns: tiled (default) | single | online | off.
ENV_VAR = "DSV4C_LIGHTLLM"
#: ``DSV4C_LIGHTLLM`` values and the :func:`install` options they stand for.
MODES = {"tiled": {}, "single": {"c128_kernel": "single"}, "online": {"online_hca": True}}
OFF = "off"
#: Where LightLLM keeps its final start arguments (JSON) for the processes it spawns (``envs_utils.py`` L35-38).
START_ARGS_ENV = "LIGHTLLM_START_ARGS"


class LightLLMModeNotSupported(ValueError):
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


def _hidden_size(config) -> int | None:
    """``hidden_size`` of a model config (LightLLM's ``model.config``, a dict), if it has a usable one."""
    value = config.get("hidden_size") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 16 and not value % 16 else None


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
        _patch(module.CompressorInfer, "compress", lambda original: functools.wraps(original)(compressor_compress))
        _patch(
            module.DeepseekV4IndexInfer, "write_indexer_k",
            lambda original: functools.wraps(original)(write_indexer_k),
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


if __name__ == "__main__":  # the launcher; run with -m, so its spawned processes re-run this module by name
    from dsv4_compressor.integrations.lightllm import main as _main

    _main()
elif __name__ == "__mp_main__":  # a process LightLLM spawned from the launcher
    from dsv4_compressor.integrations.lightllm import install_from_environment as _install_from_environment

    _install_from_environment()
