"""LightLLM (``ModelTC/LightLLM``, branch ``support_ds4``): the compressors of DeepSeek-V4 as our ops.

What a LightLLM user adds (before the model is built)::

    from dsv4_compressor.integrations import lightllm as dsv4c_lightllm
    dsv4c_lightllm.install()                      # ring C128 state (LightLLM's own), tiled HCA kernel
    dsv4c_lightllm.install(online_hca=True)       # or: online HCA banks in place of the C128 ring

``install()`` patches three LightLLM methods (module paths as in ENGINES.md section 1.1):

* ``DeepseekV4InferStateInfo.init_some_extra_state`` (``lightllm/models/deepseek_v4/infer_struct.py``): the
  original, then :meth:`StepBuilder.build` (once per step, for every layer);
* ``CompressorInfer.compress`` (``lightllm/models/deepseek_v4/layer_infer/transformer_layer_infer.py``; C4 main
  and C128): :func:`compressor_compress`, LightLLM's GEMM then one op (no ``apply_ape``, no per-layer gather);
* ``DeepseekV4IndexInfer.write_indexer_k`` (same file; indexer compress, ``hadamard_transform``,
  ``pack_indexer_k_to_cache``): :func:`write_indexer_k`, the GEMM then one op writing the 132-byte packs;

and, with ``online_hca=True``, ``DeepseekV4MemoryManager`` (``lightllm/common/kv_cache_mem_manager/
deepseek4_mem_manager.py``): ``get_fixed_memory_size`` counts the banks instead of the C128 ring and
``_init_buffers`` allots the banks instead of the ring. :func:`uninstall` restores all of them.

**Once per step** (:class:`StepBuilder`, run at the end of ``init_some_extra_state``; all on the device, no host
synchronisation, into buffers allocated once, one set per micro-batch ``infer_state.microbatch_index``):

* rows: ``positions = infer_state.position_ids``; ``row_req = infer_state.dsv4_sparse_req_idx`` (prefill:
  ``b_req_idx`` repeated by ``b_q_seq_len``; decode: ``b_req_idx``, one entry per row, ``b_mtp_index``
  0..mtp_step). Padding rows carry ``HOLD = max_request_num``, which is ``>= num_slots``, so they do nothing.
* ``out_slot``: ``full_to_c4_indexs[mem_index]`` and ``full_to_c128_indexs[mem_index]`` (LightLLM keys a compressed
  slot by the full slot of its group-end token), gathered once per step instead of in every layer call.
* ``ops.build_plan`` per ratio (4, and 128 for HCA), then for C4 ``ops.build_state_rows(mode="token_map_ring",
  req_to_token=req_manager.req_to_token_indexs, token_to_state=mem_manager.full_to_swa_indexs, state_page=128,
  ring=page_tail=mem_manager.c4_state_ring)``: LightLLM's C4 state row ``(swa // 128) * ring + swa % ring`` and
  its save rule (a request's last ``ring`` rows and each 128-slot SWA page's last ``ring`` rows, which radix
  prefix reuse at a page boundary reads).
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

Checked against stand-ins of LightLLM's classes and buffers (``scripts/lightllm_sim.py``, which
``tests/test_integration_lightllm.py`` and ``scripts/multi_gpu_run.py`` run on), not against LightLLM itself.
Not handled: LightLLM's PD and CPU-cache transfers of C128 ring rows (newer versions export
them) do not know the online banks; a draft (MTP) model whose layers use these classes gets its own builder
(one per model), sized from its own memory manager.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass

import torch

from .. import ops
from ..config import CompressorConfig
from ..errors import CapacityError
from ..workspace import C128ScratchPlan, Workspace

__all__ = [
    "LightLLMLayout",
    "StepBuilder",
    "compress_layer",
    "compressor_compress",
    "write_indexer_k",
    "allot_online_hca_banks",
    "c128_state_banks",
    "online_hca_savings",
    "online_hca_memory_report",
    "install",
    "uninstall",
    "LightLLMNotInstalled",
    "INDEXER_PACK",
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
    ``full_to_c4_indexs`` / ``full_to_c128_indexs`` (the per-step gathers keep it).
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
        ``DSV4_C128_STATE_RING`` (128 and 128; a scaled-down stand-in may set others) unless given."""
        mm = mem_manager
        consts = _engine_constants(mm)
        has_c4, has_c128 = mm.n_c4 > 0, mm.n_c128 > 0
        table = mm.full_to_c4_indexs if has_c4 else mm.full_to_c128_indexs
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
            c4_page_size=mm.c4_pool.page_size if has_c4 else C4_PAGE_SIZE,
            c128_page_size=mm.c128_pool.page_size if has_c128 else C128_PAGE_SIZE,
            indexer_page_size=mm.c4_indexer_pool.page_size if has_c4 else INDEXER_PAGE_SIZE,
            index_dtype=table.dtype,
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
        self.c4_plan = self.c4_read = self.c4_save = self.c4_out = None
        self.c128_plan = self.c128_out = None
        if layout.has_c4:
            self.c4_plan = ops.empty_plan(max_rows, max_requests, C4_RATIO, device)
            self.c4_read = torch.full((max_requests, window - 1), -1, dtype=torch.int32, device=device)
            self.c4_save = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
            self.c4_out = torch.full((max_rows,), -1, dtype=layout.index_dtype, device=device)
        if layout.has_c128:
            self.c128_plan = ops.empty_plan(max_rows, max_requests, layout.c128_ratio, device)
            self.c128_out = torch.full((max_rows,), -1, dtype=layout.index_dtype, device=device)
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
    ):
        if c128_kernel not in ("tiled", "single"):
            raise ValueError(f"StepBuilder: c128_kernel must be 'tiled' or 'single', got {c128_kernel!r}")
        if max_rows < 1 or microbatches < 1:
            raise ValueError(f"StepBuilder: max_rows and microbatches must be >= 1, got {max_rows}, {microbatches}")
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
        self.steps = 0  # steps built (tests count them: once per step, whatever the layer count)

    @classmethod
    def for_model(cls, model, **options) -> StepBuilder:
        """A builder sized from a LightLLM model: its memory manager's layout and rows up to the largest of
        ``batch_max_tokens`` (a prefill forward), ``max_req_num * (mtp_step + 1)`` (a decode forward) and
        ``graph_max_batch_size * (mtp_step + 1)`` (a captured decode graph, padding included), rounded up to 64
        (token padding for TP / SP mixing). ``options`` go to the constructor (``max_rows`` overrides)."""
        layout = LightLLMLayout.from_mem_manager(model.mem_manager)
        s = layout.mtp_step + 1
        need = max(
            int(getattr(model, "batch_max_tokens", None) or 0),
            int(getattr(model, "max_req_num", layout.max_request_num)) * s,
            int(getattr(model, "graph_max_batch_size", 0) or 0) * s,
        )
        options.setdefault("max_rows", -(-need // 64) * 64)
        device = options.pop("device", None)
        if device is None:
            device = (
                model.mem_manager.full_to_c4_indexs if layout.has_c4 else model.mem_manager.full_to_c128_indexs
            ).device
        return cls(layout, device=device, **options)

    def build(self, infer_state) -> None:
        """Build the step's plans and C4 state-row tables from LightLLM's ``infer_state`` (after its own
        ``init_some_extra_state`` set ``position_ids`` and ``dsv4_sparse_req_idx``) and set them as
        ``infer_state`` attributes. Device work only; host reads are of shapes and Python attributes."""
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
        if lay.has_c4:
            out = buf.c4_out[:rows]
            torch.index_select(mm.full_to_c4_indexs, 0, mem_index, out=out)
            ops.build_plan(
                buf.c4_plan, positions, row_req, out, ratio=C4_RATIO, num_slots=lay.max_request_num,
                mtp_step=lay.mtp_step,
            )  # fmt: skip
            ops.build_state_rows(
                buf.c4_plan, buf.c4_read, buf.c4_save, mode="token_map_ring", ring=lay.c4_state_ring,
                req_to_token=infer_state.req_manager.req_to_token_indexs, token_to_state=mm.full_to_swa_indexs,
                state_page=lay.swa_page_size, page_tail=lay.c4_state_ring,
            )  # fmt: skip
            setattr(infer_state, _C4_PLAN, buf.c4_plan)
            setattr(infer_state, _C4_READ, buf.c4_read)
            setattr(infer_state, _C4_SAVE, buf.c4_save)
        if lay.has_c128:
            out = buf.c128_out[:rows]
            torch.index_select(mm.full_to_c128_indexs, 0, mem_index, out=out)
            ops.build_plan(
                buf.c128_plan, positions, row_req, out, ratio=lay.c128_ratio, num_slots=lay.max_request_num,
                mtp_step=lay.mtp_step,
            )  # fmt: skip
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
    builder: StepBuilder = _step_tensor(infer_state, _BUILDER)
    lay = builder.layout
    mm = infer_state.mem_manager
    decode = not infer_state.is_prefill
    head = norm_weight.shape[0]
    args = dict(norm_weight=norm_weight, cos=cos, sin=sin)
    if kind in ("c4", "indexer"):
        plan = _step_tensor(infer_state, _C4_PLAN)
        tables = dict(read_rows=_step_tensor(infer_state, _C4_READ), save_rows=_step_tensor(infer_state, _C4_SAVE))
        ape = ape.view(C4_RATIO, 2, head)
        if kind == "c4":
            ops.compress(
                kv_score, plan, ape, state=mm.get_c4_state_buffer(layer_idx),
                out_pages=mm.get_compressed_kv_buffer(layer_idx), kind="csa", page_size=lay.c4_page_size, eps=eps,
                decode=decode, **tables, **args,
            )  # fmt: skip
        else:
            pages = mm.c4_indexer_pool.get_layer_buffer(mm.layer_to_c4_idx[layer_idx])
            ops.compress(
                kv_score, plan, ape, state=mm.get_c4_indexer_state_buffer(layer_idx), out_pages=pages,
                kind="indexer", page_size=lay.indexer_page_size, eps=eps, decode=decode, indexer_pack=INDEXER_PACK,
                **tables, **args,
            )  # fmt: skip
        return
    if kind != "c128":
        raise ValueError(f"compress_layer: kind must be 'c4', 'indexer' or 'c128', got {kind!r}")
    plan = _step_tensor(infer_state, _C128_PLAN)
    ape = ape.view(lay.c128_ratio, 1, head)
    pages = mm.get_compressed_kv_buffer(layer_idx)
    if builder.online_hca:
        scratch = None if decode else _step_tensor(infer_state, _C128_SCRATCH)  # prefill steps split
        ops.compress_online_hca(
            kv_score, plan, ape, state_banks=c128_state_banks(mm, layer_idx), out_pages=pages,
            page_size=lay.c128_page_size, eps=eps, decode=decode, scratch=scratch, **args,
        )  # fmt: skip
        return
    scratch = None
    if builder.c128_kernel == "tiled":
        scratch = _step_tensor(infer_state, _C128_SCRATCH)
    ops.compress(
        kv_score, plan, ape, state=mm.get_c128_state_buffer(layer_idx), out_pages=pages, kind="hca",
        page_size=lay.c128_page_size, eps=eps, decode=decode, ring=lay.c128_state_ring, scratch=scratch, **args,
    )  # fmt: skip


def _gemm(linear, x: torch.Tensor, use_custom_tensor_manager: bool) -> torch.Tensor:
    """LightLLM's replicated bf16 GEMM to fp32 ``kv_score``. The allocator flag (spelled as LightLLM spells it)
    is passed only when off: the prefill aux stream must not use the main stream's tensor manager."""
    if use_custom_tensor_manager:
        return linear.mm(x, out_dtype=torch.float32)
    return linear.mm(x, use_custom_tensor_mananger=False, out_dtype=torch.float32)


def compressor_compress(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
    """Replacement of ``CompressorInfer.compress``: the GEMM, then :func:`compress_layer` (C4 main, C128, or the
    indexer when ``is_in_indexer``). Returns ``None``: the entries are in LightLLM's pools."""
    ratio = self.compress_ratio
    if ratio == 0:
        return None
    if self.is_in_indexer:
        kind, linear, norm, ape = "indexer", "idx_cmp_wkv_gate_", "idx_cmp_norm_", "idx_cmp_ape_"
    else:
        kind = "c4" if ratio == C4_RATIO else "c128"
        linear, norm, ape = "compressor_wkv_gate_", "compressor_norm_", "compressor_ape_"
    kv_score = _gemm(getattr(layer_weight, linear), x, use_custom_tensor_manager)
    compress_layer(
        kind, kv_score, infer_state, self.layer_idx_, ape=getattr(layer_weight, ape).weight,
        norm_weight=getattr(layer_weight, norm).weight, cos=cos_table, sin=sin_table, eps=self.eps,
    )  # fmt: skip
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
# install
# ---------------------------------------------------------------------------------------------------------------
_LAYER_MODULE = "lightllm.models.deepseek_v4.layer_infer.transformer_layer_infer"
_STATE_MODULE = "lightllm.models.deepseek_v4.infer_struct"
_MEM_MODULE = "lightllm.common.kv_cache_mem_manager.deepseek4_mem_manager"
#: (class, attribute) -> the original, for uninstall() and so that install() twice does not wrap twice.
_ORIGINALS: dict[tuple[type, str], object] = {}
#: The memory manager's methods online HCA replaces.
_MEMORY_METHODS = ("get_fixed_memory_size", "_init_buffers")
#: Marks an attribute the patched class inherited (uninstall() deletes the patch instead of restoring it).
_INHERITED = object()


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


def install(
    *,
    online_hca: bool = False,
    c128_kernel: str = "tiled",
    max_rows: int | None = None,
    microbatches: int = 2,
    check: bool = False,
) -> None:
    """Patch LightLLM (imported from its documented module paths) to run the compressors as our ops.

    Options go to each model's :class:`StepBuilder` (created at its first step, sized by
    :meth:`StepBuilder.for_model` unless ``max_rows`` is given). ``online_hca=True`` also patches
    ``DeepseekV4MemoryManager`` so that it allots the online banks instead of the C128 ring. Raises
    :class:`LightLLMNotInstalled` when LightLLM cannot be imported; calling it again re-patches with the new
    options; :func:`uninstall` restores LightLLM.
    """
    layer_mod, state_mod = _import(_LAYER_MODULE), _import(_STATE_MODULE)
    mem_mod = _import(_MEM_MODULE) if online_hca else None
    options = dict(online_hca=online_hca, c128_kernel=c128_kernel, microbatches=microbatches, check=check)
    if max_rows is not None:
        options["max_rows"] = max_rows

    def make_init(original):
        @functools.wraps(original)
        def init_some_extra_state(self, model, *args, **kwargs):
            original(self, model, *args, **kwargs)
            builder = getattr(model, "_dsv4c_builder", None)
            if builder is None:
                builder = StepBuilder.for_model(model, **options)
                model._dsv4c_builder = builder
            builder.build(self)

        return init_some_extra_state

    _patch(state_mod.DeepseekV4InferStateInfo, "init_some_extra_state", make_init)
    _patch(layer_mod.CompressorInfer, "compress", lambda original: functools.wraps(original)(compressor_compress))
    _patch(
        layer_mod.DeepseekV4IndexInfer, "write_indexer_k", lambda original: functools.wraps(original)(write_indexer_k)
    )
    if mem_mod is not None:
        _patch_memory_manager(mem_mod.DeepseekV4MemoryManager)
    else:  # a ring install after an online one: LightLLM allots its C128 ring again
        _restore(lambda cls, name: name in _MEMORY_METHODS)


def _patch_memory_manager(cls: type) -> None:
    """Online HCA: count and allot the banks in place of the C128 ring (``(max_req + 1) * ring + 1`` rows)."""

    def make_fixed(original):
        @functools.wraps(original)
        def get_fixed_memory_size(self):
            # runs before _init_buffers: from the numbers LightLLM's __init__ has set by then
            mtp_step = self.c4_state_ring - _engine_constants(self)["DSV4_C4_STATE_RING"]
            banks = self.n_c128 * (self.max_request_num + 1) * (mtp_step + 1) * 3 * self.head_dim
            return banks * 4

        return get_fixed_memory_size

    def make_init(original):
        @functools.wraps(original)
        def _init_buffers(self, *args, **kwargs):
            ring = self.c128_state_ring
            # LightLLM sizes its C128 ring (max_req + 1) * ring + 1 rows: ring 0 leaves only the sentinel row, so
            # the ring's memory is never taken (the fixed-memory budget no longer counts it)
            self.c128_state_ring = 0
            try:
                original(self, *args, **kwargs)
            finally:
                self.c128_state_ring = ring
            if self.n_c128 > 0:
                allot_online_hca_banks(self)

        return _init_buffers

    for name, make in zip(_MEMORY_METHODS, (make_fixed, make_init)):
        _patch(cls, name, make)


def _restore(which) -> None:
    for cls, name in [key for key in _ORIGINALS if which(*key)]:
        original = _ORIGINALS.pop((cls, name))
        if original is _INHERITED:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def uninstall() -> None:
    """Restore every LightLLM method :func:`install` replaced."""
    _restore(lambda cls, name: True)
