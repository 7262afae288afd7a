"""Stand-ins of LightLLM's DeepSeek-V4 serving objects, at full or scaled-down size, for engine-shaped runs.

LightLLM is ``ModelTC/LightLLM``, branch ``support_ds4``; its layout is described in docs/INTEGRATION.md ("LightLLM").
The classes here have LightLLM's names, attributes, dtypes and layouts, as far as the compressors see them:

- ``DeepseekV4MemoryManager``: pools, state buffers and index tables;
- ``DeepseekV4ReqManager``: ``req_to_token_indexs``;
- ``DeepseekV4InferStateInfo``: the per-step state and its ``init_some_extra_state``;
- ``copy_for_cuda_graph``: LightLLM's refresh of a captured decode graph's inputs;
- ``CompressorInfer``, ``DeepseekV4IndexInfer`` and ``Linear``: what the adapter's ``compressor_compress`` and
  ``write_indexer_k`` read, with a real bf16 GEMM to fp32 ``kv_score``.

``SlotAllocator`` does LightLLM's slot bookkeeping on host mirrors of the index tables and uploads them once
per step. Uploading avoids one device write per token. The bookkeeping covers ``_prepare_dsv4_slots``,
``copy_kv_index_to_req``, the free cascade of rejected MTP rows, SWA pages that leave the sliding window, and
radix prefix reuse.

``make_infer_state`` makes a forward's ``infer_state`` from its requests' rows and HOLD padding.

The sizes are parameters. At full size they use DeepSeek-V4's shapes: head 512, C128 ratio 128, SWA page 128. A
scaled-down run passes smaller values. The multi-GPU harness (``benchmarks/multi_gpu/``, run by
``scripts/multi_gpu_run.py``) runs on these stand-ins, and so does ``tests/test_integration_lightllm*.py``, through
a scaled-down subclass of the memory manager defined in ``tests/helpers/lightllm_engine.py``: the adapter reads
LightLLM's constants from the module that defines the memory manager's class, so that module's constants are the
scaled-down ones.

Kept from LightLLM at any size:

- the C4 ring ``8 + mtp_step`` rows per SWA page, read through ``req_to_token`` and ``full_to_swa``;
- the C128 ring ``ceil((r + mtp_step) / 4) * 4`` rows, addressed ``req * ring + pos % ring``, in a 2-D buffer
  with a sentinel row;
- pool pages of 64 / 2 / 64 slots;
- int32 index tables of ``size + 1`` entries, whose last entry maps the HOLD token to each pool's HOLD slot;
- compressed slots keyed by the full slot of the group-end token;
- HOLD = ``max_request_num`` for padding requests.

Pools are filled with the poison byte ``0xA5`` and state with a NaN poison. LightLLM zeroes both; the poison
shows any read of a row nothing saved, and any byte written where nothing should be.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

# LightLLM's constants (deepseek4_mem_manager.py). The adapter reads these names from the memory manager's module.
# A scaled-down run gives the SWA page and the C128 ratio to LightLLMLayout.from_mem_manager instead.
DSV4_SWA_PAGE_SIZE = 128
DSV4_C4_STATE_RING = 8
DSV4_C128_STATE_RING = 128
DSV4_C4_PAGE_SIZE = 64
DSV4_C128_PAGE_SIZE = 2
DSV4_INDEXER_PAGE_SIZE = 64

#: Poison of pool bytes and float32 state: a quiet NaN with a payload, which no check explains.
POISON_BYTE = 0xA5
POISON_F32 = 0x7FC0A5A5


def poison_f32(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.int32).fill_(POISON_F32)
    return t


class PackedPagePool:
    """LightLLM's ``PackedPagePool``: ``[layers, ceil((size + 1) / P), bytes_per_page]`` uint8.

    Slot ``size`` is the HOLD slot.
    """

    def __init__(self, size, page_size, layer_num, data_bytes, scale_bytes, align_bytes=1, device="cpu"):
        self.size, self.page_size = size, page_size
        self.data_bytes, self.scale_bytes = data_bytes, scale_bytes
        self.num_pages = -(-(size + 1) // page_size)
        self.bytes_per_page = -(-(page_size * (data_bytes + scale_bytes)) // align_bytes) * align_bytes
        shape = (layer_num, self.num_pages, self.bytes_per_page)
        self.buffer = torch.full(shape, POISON_BYTE, dtype=torch.uint8, device=device)
        self.HOLD_TOKEN_MEMINDEX = size

    def get_layer_buffer(self, layer_index: int) -> torch.Tensor:
        return self.buffer[layer_index]

    def _byte_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Byte offsets of each slot's record in a layer's flat buffer: the data bytes, then the scale bytes
        (LightLLM's ``PackedPagePool._loc_offsets``, mem manager L342-349)."""
        slots = slots.long().reshape(-1, 1)
        base = slots // self.page_size * self.bytes_per_page
        token = slots % self.page_size
        data = base + token * self.data_bytes + torch.arange(self.data_bytes, device=slots.device)
        scale = (base + self.page_size * self.data_bytes + token * self.scale_bytes
                 + torch.arange(self.scale_bytes, device=slots.device))  # fmt: skip
        return torch.cat([data, scale], dim=1)

    def read(self, layer_index: int, slots: torch.Tensor) -> torch.Tensor:
        """uint8 ``[n, data + scale]``: the records of ``slots`` (``PackedPagePool.read``, L364-374)."""
        return self.buffer[layer_index].reshape(-1)[self._byte_offsets(slots)]

    def write(self, layer_index: int, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Store uint8 records ``[n, data + scale]`` at ``slots`` (``PackedPagePool.write``, L351-362)."""
        self.buffer[layer_index].reshape(-1)[self._byte_offsets(slots)] = records


def prompt_page_size(mm) -> int:
    """LightLLM's radix / prompt-cache page, 256 tokens (``DSV4_PROMPT_CACHE_PAGE_SIZE``, mem manager L33: one C4
    pool page of entries, and two HCA groups), scaled as twice the memory manager's C128 ratio."""
    return 2 * mm.c128_ratio


class PDCacheLayout:
    """LightLLM's ``DeepseekV4PDCacheLayout`` (mem manager L94-169, L223-287): where a PD page of
    ``token_page_size`` tokens keeps each section, in bytes, for this memory manager's sizes. Sections in
    order: C4 entries, C4 indexer packs, C128 entries (``token_page_size // r`` records of 584 bytes per layer),
    the SWA tail (4 SWA pages per layer), C4 state (``ring_base - 1`` rows), C4 indexer state, and the C128
    state (``r - 1`` rows of ``2H`` float32 per HCA layer: the open group's ring rows)."""

    def __init__(self, mm: DeepseekV4MemoryManager, token_page_size: int):
        prompt_page = prompt_page_size(mm)
        if token_page_size <= 0 or token_page_size % prompt_page:
            raise ValueError(f"PD page size must be a positive multiple of {prompt_page}, got {token_page_size}")
        self.token_page_size = token_page_size
        lat, idx = mm.latent, mm.indexer
        record = lat.record_data_bytes + lat.record_scale_bytes
        c4_page = -(-(DSV4_C4_PAGE_SIZE * record) // lat.record_data_bytes) * lat.record_data_bytes
        c4_layer = token_page_size // prompt_page * c4_page
        idx_layer = token_page_size // prompt_page * DSV4_C4_PAGE_SIZE * (idx.head_dim + 4)
        self.c128_offset = mm.n_c4 * (c4_layer + idx_layer)
        self.c128_row_nbytes = record
        self.c128_layer_nbytes = token_page_size // mm.c128_ratio * record
        self.swa_offset = self.c128_offset + mm.n_c128 * self.c128_layer_nbytes
        swa_page = -(-(mm.swa_page_size * record) // lat.record_data_bytes) * lat.record_data_bytes
        c4_state_offset = self.swa_offset + len(mm.compress_rates) * 4 * swa_page
        c4_state_rows = DSV4_C4_STATE_RING - 1
        c4_state_nbytes = mm.n_c4 * c4_state_rows * 4 * mm.head_dim * 4
        c4_indexer_state_nbytes = mm.n_c4 * c4_state_rows * 4 * mm.indexer_head_dim * 4
        self.c128_state_offset = c4_state_offset + c4_state_nbytes + c4_indexer_state_nbytes
        self.c128_state_rows = mm.c128_ratio - 1
        self.c128_state_layer_nbytes = self.c128_state_rows * 2 * mm.head_dim * 4
        self.c128_state_nbytes = mm.n_c128 * self.c128_state_layer_nbytes
        self.page_nbytes = self.c128_state_offset + self.c128_state_nbytes


def copy_pd_cache_page(direction: str, mm, layout: PDCacheLayout, mem_indexes: torch.Tensor, staging: torch.Tensor,
                       start_kv_index: int, request_kv_len: int, req_idx: int) -> int:  # fmt: skip
    """LightLLM's ``pack_pd_cache_page`` / ``unpack_pd_cache_page`` (``pd_cache_io.py`` L300-409), for the
    sections of HCA layers: the page's compressed C128 entries (``copy_pool_pages`` over the group-end slots,
    L315-349) and, on pages that reach the request's tail, the ring rows of its open group (``_copy_pd_tail``,
    L214-227: rows ``req_idx * ring + p % ring`` for ``p`` in ``[L - L % r, L)``, skipped when the memory manager
    has no C128 state buffer). Returns the bytes the page sends (L351-367). The SWA and C4 sections are LightLLM's
    own and untouched by the adapter: not emulated (a memory manager with C4 layers is refused)."""
    if mm.n_c4:
        raise ValueError(
            "copy_pd_cache_page: the stand-in carries the C128 sections only; a memory manager with C4 layers is "
            "refused (LightLLM's own SWA and C4 sections are not emulated)"
        )
    full_slots = mem_indexes.reshape(-1).long()
    r, end = mm.c128_ratio, start_kv_index + full_slots.numel()
    flat = staging.reshape(-1)
    entries = end // r - start_kv_index // r
    if entries > 0:
        ends = full_slots[torch.arange(entries, device=full_slots.device) * r + r - 1]
        slots = mm.full_to_c128_indexs[ends]
        for layer in range(mm.n_c128):
            base = layout.c128_offset + layer * layout.c128_layer_nbytes
            window = flat[base : base + entries * layout.c128_row_nbytes].view(entries, layout.c128_row_nbytes)
            if direction == "pack":
                window.copy_(mm.c128_pool.read(layer, slots))
            else:
                mm.c128_pool.write(layer, slots, window)
    block = prompt_page_size(mm)  # pd_cache_io.py L13: _C4_TOKEN_BLOCK = 4 * 64
    swa_tail_start = max(0, request_kv_len // block * block - block)
    if end <= swa_tail_start:
        return layout.swa_offset
    partial = request_kv_len % r
    lo, hi = max(start_kv_index, request_kv_len - partial), min(end, request_kv_len)
    if partial and lo < hi and mm.c128_state_buffer is not None:
        ring, width = mm.c128_state_ring, 2 * mm.head_dim
        positions = torch.arange(lo, hi, device=full_slots.device)
        rows = req_idx * ring + positions % ring
        state = flat[layout.c128_state_offset : layout.page_nbytes].view(torch.float32)
        state = state.view(mm.n_c128, layout.c128_state_rows, width)[:, lo - (request_kv_len - partial) :][:, : hi - lo]
        if direction == "pack":
            state.copy_(mm.c128_state_buffer[:, rows])
        else:
            mm.c128_state_buffer[:, rows] = state
    return layout.page_nbytes


class DeepseekV4MemoryManager:
    """LightLLM's memory manager, as far as the compressors see it (docs/INTEGRATION.md, "LightLLM").

    ``latent`` and ``indexer`` are the ``CompressorConfig`` of the latent entries and of the indexer keys; they
    give the record sizes. ``compress_rates`` labels layers 4 (C4) or 128 (C128), as LightLLM does, whatever
    ``c128_ratio`` is.

    ``online_hca=True`` allots only the sentinel row of the C128 ring. This is what the adapter's
    ``install(online_hca=True)`` does: the caller then allots the online banks with
    ``adapter.allot_online_hca_banks``. ``c128_state_ring`` keeps LightLLM's value.
    """

    def __init__(self, size, compress_rates, max_request_num, mtp_step, *, swa_pages, latent, indexer,
                 swa_page_size=DSV4_SWA_PAGE_SIZE, c128_ratio=DSV4_C128_STATE_RING, online_hca=False,
                 device="cpu"):  # fmt: skip
        self.device = torch.device(device)
        self.compress_rates = list(compress_rates)
        self.n_c4 = self.compress_rates.count(4)
        self.n_c128 = self.compress_rates.count(128)
        self.layer_to_c4_idx = {i: k for k, i in enumerate(i for i, r in enumerate(compress_rates) if r == 4)}
        self.layer_to_c128_idx = {i: k for k, i in enumerate(i for i, r in enumerate(compress_rates) if r == 128)}
        self.max_request_num = max_request_num
        self.head_dim = latent.head_dim
        self.indexer_head_dim = indexer.head_dim
        self.latent, self.indexer = latent, indexer
        self.swa_page_size = swa_page_size
        self.c128_ratio = c128_ratio
        self.c4_state_ring = DSV4_C4_STATE_RING + mtp_step
        self.c128_state_ring = -(-(c128_ratio + mtp_step) // 4) * 4
        self.swa_num_pages = swa_pages
        self.online_hca = online_hca
        self.fixed_memory = self.get_fixed_memory_size()
        self._init_buffers(size, torch.bfloat16, 1, self.head_dim, len(compress_rates))

    def get_fixed_memory_size(self):
        if self.online_hca:  # the banks: (max_req + 1) slots x (mtp_step + 1) banks x 3 x H float32
            mtp = self.c4_state_ring - DSV4_C4_STATE_RING
            return self.n_c128 * (self.max_request_num + 1) * (mtp + 1) * 3 * self.head_dim * 4
        rows = (self.max_request_num + 1) * self.c128_state_ring + 1
        return self.n_c128 * rows * (2 * self.head_dim) * 4

    @staticmethod
    def _init_state(buffer: torch.Tensor) -> None:
        poison_f32(buffer)
        half = buffer.shape[-1] // 2
        buffer[:, -1, :half] = 0.0  # the sentinel row: kv 0, score -inf
        buffer[:, -1, half:] = float("-inf")

    def _init_buffers(self, size, dtype, head_num, head_dim, layer_num):
        self.size = self.HOLD_TOKEN_MEMINDEX = size
        swa_size = self.swa_num_pages * self.swa_page_size  # the HOLD slot swa_size has a page of its own
        self.swa_size = swa_size
        dev = self.device
        lat = self.latent
        latent = lat.record_data_bytes, lat.record_scale_bytes, lat.record_data_bytes
        c4_size, c128_size = -(-size // 4), -(-size // self.c128_ratio)
        self.c4_pool = PackedPagePool(c4_size, DSV4_C4_PAGE_SIZE, self.n_c4, *latent, device=dev)
        self.c4_indexer_pool = PackedPagePool(c4_size, DSV4_INDEXER_PAGE_SIZE, self.n_c4, self.indexer_head_dim, 4,
                                              device=dev)  # fmt: skip
        self.c128_pool = PackedPagePool(c128_size, DSV4_C128_PAGE_SIZE, self.n_c128, *latent, device=dev)
        # the last entry maps the HOLD token to each pool's HOLD slot
        self.full_to_swa_indexs = torch.full((size + 1,), -1, dtype=torch.int32, device=dev)
        self.full_to_swa_indexs[size] = swa_size
        self.full_to_c4_indexs = torch.full((size + 1,), -1, dtype=torch.int32, device=dev)
        self.full_to_c4_indexs[size] = self.c4_pool.HOLD_TOKEN_MEMINDEX
        self.full_to_c128_indexs = torch.full((size + 1,), -1, dtype=torch.int32, device=dev)
        self.full_to_c128_indexs[size] = self.c128_pool.HOLD_TOKEN_MEMINDEX
        rows4 = -(-(self.swa_num_pages * self.c4_state_ring + self.c4_state_ring + 1) // 4) * 4
        self.c4_state_buffer = torch.empty(self.n_c4, rows4, 4 * head_dim, device=dev)
        self.c4_indexer_state_buffer = torch.empty(self.n_c4, rows4, 4 * self.indexer_head_dim, device=dev)
        rows128 = (self.max_request_num + 1) * (0 if self.online_hca else self.c128_state_ring) + 1
        self.c128_state_buffer = torch.empty(self.n_c128, rows128, 2 * head_dim, device=dev)
        for buf in (self.c4_state_buffer, self.c4_indexer_state_buffer, self.c128_state_buffer):
            self._init_state(buf)

    def _pool_and_local_layer(self, layer_index):
        if self.compress_rates[layer_index] == 4:
            return self.c4_pool, self.layer_to_c4_idx[layer_index]
        return self.c128_pool, self.layer_to_c128_idx[layer_index]

    def get_compressed_kv_buffer(self, layer_index):
        pool, local = self._pool_and_local_layer(layer_index)
        return pool.get_layer_buffer(local)

    def get_c4_state_buffer(self, layer_index):
        return self.c4_state_buffer[self.layer_to_c4_idx[layer_index]]

    def get_c4_indexer_state_buffer(self, layer_index):
        return self.c4_indexer_state_buffer[self.layer_to_c4_idx[layer_index]]

    def get_c128_state_buffer(self, layer_index):
        return self.c128_state_buffer[self.layer_to_c128_idx[layer_index]]

    # -- PD disaggregation: LightLLM's page transfer (mem manager L1175-1247) ---------------------------------
    def alloc_paged_kv_move_buffer(self, page_num: int, page_size: int) -> torch.Tensor:
        self.pd_cache_layout = PDCacheLayout(self, page_size)
        self.kv_move_buffer = torch.full((page_num, 1, 1, 1, self.pd_cache_layout.page_nbytes), POISON_BYTE,
                                         dtype=torch.uint8, device=self.device)  # fmt: skip
        return self.kv_move_buffer

    def write_mem_to_page_kv_move_buffer(self, mem_indexes, page_index, dp_index, mem_managers, dp_world_size,
                                         start_kv_index, request_kv_len, page_kind="kv", req_idx=None):  # fmt: skip
        assert page_kind == "kv"
        slots = torch.tensor(list(mem_indexes), dtype=torch.int64, device=self.device)
        return copy_pd_cache_page("pack", mem_managers[dp_index], self.pd_cache_layout, slots,
                                  self.kv_move_buffer[page_index], start_kv_index, request_kv_len, req_idx)  # fmt: skip

    def read_page_kv_move_buffer_to_mem(self, mem_indexes, page_index, dp_index, mem_managers, dp_world_size,
                                        start_kv_index, request_kv_len, page_kind="kv", req_idx=None):  # fmt: skip
        assert page_kind == "kv"
        slots = torch.tensor(list(mem_indexes), dtype=torch.int64, device=self.device)
        copy_pd_cache_page("unpack", mem_managers[dp_index], self.pd_cache_layout, slots,
                           self.kv_move_buffer[page_index], start_kv_index, request_kv_len, req_idx)  # fmt: skip


class DeepseekV4ReqManager:
    """``req_to_token_indexs``: int32 ``[max_req + 1, max_seq]``, including the HOLD request's row."""

    def __init__(self, max_request_num, max_seq, hold_token, device="cpu"):
        self.HOLD_REQUEST_ID = max_request_num
        shape = (max_request_num + 1, max_seq)
        self.req_to_token_indexs = torch.full(shape, hold_token, dtype=torch.int32, device=device)


class DeepseekV4InferStateInfo:
    """LightLLM's per-step state. ``init_some_extra_state`` adds the per-row request index as LightLLM does
    (``infer_struct.py`` L45-98)."""

    def __init__(self, **fields):
        self.microbatch_index = 0
        self.__dict__.update(fields)

    def init_some_extra_state(self, model):
        if self.is_prefill:
            self.dsv4_sparse_req_idx = torch.repeat_interleave(self.b_req_idx, self.b_q_seq_len.long())
        else:
            self.dsv4_sparse_req_idx = self.b_req_idx


def copy_for_cuda_graph(captured, new) -> None:
    """LightLLM's ``InferStateInfo.copy_for_cuda_graph`` (``common/basemodel/infer_struct.py`` L143-153)."""
    for name, value in vars(new).items():
        if isinstance(value, torch.Tensor):
            old = getattr(captured, name, None)
            if old is not None and old.data_ptr() != value.data_ptr():
                old.copy_(value, non_blocking=True)


class CompressorInfer:
    """``transformer_layer_infer.py`` L615-666: what the adapter's ``compressor_compress`` reads.

    ``compress`` is LightLLM's method, which ``adapter.install`` replaces: here it fails if it ever runs."""

    def __init__(self, layer_idx, network_config, tp_world_size, is_in_indexer=False):
        self.layer_idx_ = layer_idx
        self.tp_world_size_ = tp_world_size
        self.is_in_indexer = is_in_indexer
        self.compress_ratio = network_config["compress_ratios"][layer_idx]
        self.eps = network_config["rms_norm_eps"]

    def compress(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
        raise AssertionError("LightLLM's own compressor ran: the adapter is not installed")


class DeepseekV4IndexInfer:
    """What the adapter's ``write_indexer_k`` reads. ``write_indexer_k`` fails if it ever runs, as ``compress``."""

    def __init__(self, layer_idx, network_config, tp_world_size):
        self.layer_idx_ = layer_idx
        self.tp_world_size_ = tp_world_size
        self.compress_ratio = network_config["compress_ratios"][layer_idx]
        self.indexer_compressor = None
        if self.compress_ratio == 4:
            self.indexer_compressor = CompressorInfer(layer_idx, network_config, tp_world_size, is_in_indexer=True)

    def write_indexer_k(self, x, infer_state, layer_weight, cos_table, sin_table, use_custom_tensor_manager=True):
        raise AssertionError("LightLLM's own indexer ran: the adapter is not installed")


def mm_fp32_supported(device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` runs here. On CUDA it does, since torch 2.8."""
    x = torch.zeros(2, 16, dtype=torch.bfloat16, device=device)
    try:
        return torch.mm(x, x.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class DeepseekV4TpPartModel:
    """``models/deepseek_v4/model.py``: what the adapter's patch of ``_init_mem_manager`` reads. LightLLM's
    ``basemodel.py`` ``__init__`` runs ``_init_weights`` (every layer's weight objects, allotted and empty:
    ``trans_layers_weight``), then ``_init_mem_manager`` (the KV cache sized from the memory left), then
    ``load_weights`` (the checkpoint copied into the weight packs in place): :meth:`start` plays that order,
    ``load`` being the loader's copy into ``mm_param_list`` (``quantize_method.load_weight``)."""

    def __init__(self, trans_layers_weight):
        self.trans_layers_weight = trans_layers_weight
        self.mem_manager_inits = 0

    def _init_mem_manager(self):
        self.mem_manager_inits += 1

    def start(self, checkpoint: dict) -> None:
        """``_init_mem_manager``, then ``load_weights``: ``checkpoint`` maps ``(layer, name)`` to the bf16
        ``[2W, D]`` the checkpoint holds for that weight object (its ``wkv`` rows, then its ``wgate`` rows)."""
        self._init_mem_manager()
        for (layer, name), weight in checkpoint.items():
            linear = getattr(self.trans_layers_weight[layer], name)
            parts = torch.split(weight, [p.weight.shape[0] for p in linear.mm_param_list])
            for pack, part in zip(linear.mm_param_list, parts):
                pack.weight[:].copy_(part)


@dataclass
class WeightPack:
    """LightLLM's ``quantize_method.WeightPack``: the weight (and, quantized, its scale and zero point)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None = None
    weight_zero_point: torch.Tensor | None = None


class NoQuantization:
    """LightLLM's ``no_quant.NoQuantization`` (what ``MMWeightTpl`` sets when ``quant_method=None``): ``apply``
    is ``torch.mm(x, weight_pack.weight.t(), out_dtype=...)``."""

    method_name = "none"


class Linear:
    """The replicated bf16 weight of a compressor: LightLLM's ``ROWMMWeight`` as ``_init_compressor`` /
    ``_init_indexer`` build it (``out_dims=[coff * H, coff * H]`` for ``wkv`` and ``wgate``, ``quant_method=None``,
    no bias): ``quant_method`` a :class:`NoQuantization`, ``mm_param.weight`` the row-major ``[2W, D]`` tensor
    (``NoQuantization._create_weight``), ``mm_param_list`` its two row halves (views, what the loader writes).
    LightLLM calls ``compressor_wkv_gate_.mm(x, out_dtype=torch.float32)``: ``torch.mm(x, weight.t(),
    out_dtype=float32)``. Where torch has no such GEMM (the CPU), the bf16 inputs are multiplied in float32. The
    last output is kept, so the harness can record the exact ``kv_score`` rows the compressor read.
    """

    def __init__(self, weight: torch.Tensor, fp32_out: bool):
        self.quant_method = NoQuantization()
        self.bias = None
        self.mm_param = WeightPack(weight)  # bf16 [2W, D], row-major
        half = weight.shape[0] // 2
        self.mm_param_list = [WeightPack(part) for part in torch.split(weight, [half, weight.shape[0] - half])]
        self.fp32_out = fp32_out
        self.last: torch.Tensor | None = None

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, fp32_out: bool) -> Linear:
        """LightLLM's weight object of a checkpoint's bf16 ``[2W, D]`` (``wkv`` and ``wgate`` stacked)."""
        return cls(weight.contiguous(), fp32_out)

    def mm(self, input_tensor, out=None, use_custom_tensor_mananger=True, out_dtype=None):
        assert out_dtype is torch.float32 and out is None
        weight = self.mm_param.weight.t()
        if self.fp32_out:
            result = torch.mm(input_tensor, weight, out_dtype=torch.float32)
        else:
            result = torch.mm(input_tensor.float(), weight.float())
        self.last = result
        return result


class SlotAllocator:
    """LightLLM's slot bookkeeping on host mirrors of its index tables, uploaded once per step.

    Each step:

    - a request's rows ``[start, start + n)`` first free the rows that MTP verification rejected (positions
      ``>= start``). This cascades to ``full_to_c4``, ``full_to_c128`` and ``full_to_swa``;
    - each position then gets a full slot (``req_to_token``) and an SWA slot;
    - SWA slots lie in position-aligned pages of ``swa_page`` slots, one page per request and page index;
    - each group-end position also gets a C4 and a C128 slot, keyed by its full slot.

    Every free list is in random order. SWA pages that left every holder's window (``swa_window`` tokens plus
    the MTP rewind reach) go back to the free list and are reused by other requests. ``written_c4`` and
    ``written_c128`` collect every compressed slot a step has written. Draft entries that were later rejected
    count too: the kernels wrote those bytes.
    """

    def __init__(self, mm: DeepseekV4MemoryManager, req: DeepseekV4ReqManager, *, rng: np.random.Generator,
                 swa_window: int, mtp_step: int):  # fmt: skip
        self.mm, self.req, self.rng = mm, req, rng
        self.page, self.window, self.mtp, self.c128_ratio = mm.swa_page_size, swa_window, mtp_step, mm.c128_ratio
        size = mm.size
        self.req_to_token = req.req_to_token_indexs.cpu().numpy().copy()
        self.full_to_swa = mm.full_to_swa_indexs.cpu().numpy().copy()
        self.full_to_c4 = mm.full_to_c4_indexs.cpu().numpy().copy()
        self.full_to_c128 = mm.full_to_c128_indexs.cpu().numpy().copy()
        self.free_full = deque(int(x) for x in rng.permutation(size))
        self.free_c4 = deque(int(x) for x in rng.permutation(mm.c4_pool.size))
        self.free_c128 = deque(int(x) for x in rng.permutation(mm.c128_pool.size))
        self.free_swa = [int(x) for x in rng.permutation(mm.swa_num_pages)]
        self.swa_refs = np.zeros(mm.swa_num_pages, dtype=np.int64)
        self.swa_tokens: dict[int, set[int]] = {}  # SWA page -> the full slots mapped onto it
        self.pages_of: dict[int, dict[int, int]] = {}  # request -> {page index p // page: SWA page}
        self.length: dict[int, int] = {}
        self.written_c4: set[int] = set()
        self.written_c128: set[int] = set()
        self.evictions = 0
        self.freed_rows = 0
        self.upload()

    # -- LightLLM's allocation --------------------------------------------------------------------------------
    def _free_token(self, slot: int) -> None:
        for table, free in ((self.full_to_c4, self.free_c4), (self.full_to_c128, self.free_c128)):
            if table[slot] >= 0:
                free.append(int(table[slot]))
                table[slot] = -1
        swa = int(self.full_to_swa[slot])
        if swa >= 0:
            self.swa_tokens[swa // self.page].discard(slot)
            self.full_to_swa[slot] = -1
        self.free_full.append(slot)
        self.freed_rows += 1

    def _swa_page(self, req: int, index: int) -> int:
        pages = self.pages_of.setdefault(req, {})
        if index not in pages:
            if not self.free_swa:
                raise RuntimeError("SlotAllocator: out of SWA pages (size the memory manager's swa_pages up)")
            page = self.free_swa.pop(0)
            pages[index] = page
            self.swa_refs[page] += 1
            self.swa_tokens[page] = set()
        return pages[index]

    def prepare(self, req: int, start: int, n: int) -> list[int]:
        """Allocate the full slots of rows ``[start, start + n)`` of ``req``, after freeing the rejected rows."""
        old = self.length.get(req, 0)
        assert start <= old, f"request {req}: a step at {start} beyond its length {old}"
        for p in range(start, old):
            self._free_token(int(self.req_to_token[req, p]))
        slots = []
        r128 = self.c128_ratio
        for p in range(start, start + n):
            if not self.free_full:
                raise RuntimeError("SlotAllocator: out of full token slots")
            slot = self.free_full.popleft()
            self.req_to_token[req, p] = slot
            page = self._swa_page(req, p // self.page)
            self.full_to_swa[slot] = page * self.page + p % self.page
            self.swa_tokens[page].add(slot)
            if p % 4 == 3:
                c4 = self.free_c4.popleft()
                self.full_to_c4[slot] = c4
                self.written_c4.add(c4)
            if p % r128 == r128 - 1:
                c128 = self.free_c128.popleft()
                self.full_to_c128[slot] = c128
                self.written_c128.add(c128)
            slots.append(slot)
        self.length[req] = start + n
        return slots

    def evict(self) -> None:
        """Return the SWA pages that left every holder's window, and the MTP rewind reach, to the free list."""
        for req, pages in self.pages_of.items():
            low = self.length[req] - self.window - self.mtp
            for index in [i for i in pages if (i + 1) * self.page <= low]:
                page = pages.pop(index)
                self.swa_refs[page] -= 1
                if self.swa_refs[page] == 0:
                    for slot in self.swa_tokens.pop(page):
                        self.full_to_swa[slot] = -1
                    self.free_swa.insert(int(self.rng.integers(0, len(self.free_swa) + 1)), page)
                    self.evictions += 1

    def reusable_prefix(self, src: int, align: int) -> int:
        """The longest radix hit on ``src`` that a new request can take: a multiple of ``align`` (whole SWA pages),
        ending at least ``mtp_step`` before ``src``'s length (rows that no rewind can change), and whose last
        SWA page ``src`` still holds (the C4 state of its tail rows is read by the new request's first window).
        Returns 0 when there is none."""
        length = self.length.get(src, 0)
        b = (length - self.mtp) // align * align
        if b <= 0 or (b // self.page - 1) not in self.pages_of.get(src, {}):
            return 0
        return b

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Radix prefix reuse: ``dst`` starts with ``src``'s first ``length`` tokens, on whole SWA pages."""
        assert length % self.page == 0 and length <= self.length[src] - self.mtp
        self.req_to_token[dst, :length] = self.req_to_token[src, :length]
        pages = self.pages_of.setdefault(dst, {})
        for index, page in self.pages_of[src].items():
            if index < length // self.page:
                pages[index] = page
                self.swa_refs[page] += 1
        self.length[dst] = length

    # -- the device tables -----------------------------------------------------------------------------------
    def upload(self) -> None:
        """Copy the host mirrors into LightLLM's device tables, in place: captured graphs keep their addresses."""
        mm = self.mm
        pairs = ((self.req.req_to_token_indexs, self.req_to_token), (mm.full_to_swa_indexs, self.full_to_swa),
                 (mm.full_to_c4_indexs, self.full_to_c4), (mm.full_to_c128_indexs, self.full_to_c128))  # fmt: skip
        for dst, src in pairs:
            dst.copy_(torch.from_numpy(src))


def make_infer_state(alloc: SlotAllocator, items, *, decode: bool, pad_requests: int = 0, pad_rows: int | None = None):
    """A forward's slots and ``infer_state``, as LightLLM makes them before ``init_some_extra_state``.

    ``items = [(req, start, n), ...]``: request ``req``'s rows ``[start, start + n)``, whose slots ``alloc``
    allocates (after freeing the rows MTP verification rejected). ``pad_requests`` HOLD requests of ``pad_rows``
    rows (default ``mtp_step + 1``) follow, as LightLLM pads a graph bucket or an idle DP rank: request
    ``HOLD_REQUEST_ID``, the HOLD token's slot, positions ``0 .. pad_rows - 1`` (they reach a group end and must
    write nothing). The index tables are uploaded before the state is made.

    Decode: one ``b_req_idx`` entry per row, ``b_mtp_index`` 0..mtp, ``b_seq_len`` = position + 1. Prefill: one
    entry per request, with ``b_ready_cache_len`` and ``b_q_seq_len``.

    Returns the state and the rows' full slots. The caller runs ``init_some_extra_state`` with its model (once
    ``adapter.install`` has patched it, that also runs the step builder).
    """
    mm, dev, s = alloc.mm, alloc.mm.device, alloc.mtp + 1
    pad_rows = s if pad_rows is None else pad_rows
    hold, hold_token = alloc.req.HOLD_REQUEST_ID, mm.HOLD_TOKEN_MEMINDEX
    mem, positions, row_req = [], [], []
    for req, start, n in items:
        mem += alloc.prepare(req, start, n)
        positions += range(start, start + n)
        row_req += [req] * n
    for _ in range(pad_requests):
        mem += [hold_token] * pad_rows
        positions += range(pad_rows)
        row_req += [hold] * pad_rows
    alloc.upload()
    t = len(positions)
    position_ids = torch.tensor(positions, dtype=torch.int64, device=dev)
    if decode:
        mtp_index = torch.tensor([i % s for i in range(t)], dtype=torch.int32, device=dev)
        fields = dict(b_req_idx=torch.tensor(row_req, dtype=torch.int32, device=dev),
                      b_seq_len=position_ids.int() + 1, b_mtp_index=mtp_index)  # fmt: skip
    else:
        reqs = [req for req, _, _ in items] + [hold] * pad_requests
        starts = [start for _, start, _ in items] + [0] * pad_requests
        ends = [start + n for _, start, n in items] + [pad_rows] * pad_requests
        b_seq_len = torch.tensor(ends, dtype=torch.int32, device=dev)
        ready = torch.tensor(starts, dtype=torch.int32, device=dev)
        fields = dict(b_req_idx=torch.tensor(reqs, dtype=torch.int32, device=dev), b_seq_len=b_seq_len,
                      b_ready_cache_len=ready, b_q_seq_len=b_seq_len - ready)  # fmt: skip
    state = DeepseekV4InferStateInfo(
        is_prefill=not decode, position_ids=position_ids, mem_index=torch.tensor(mem, dtype=torch.int32, device=dev),
        mem_manager=mm, req_manager=alloc.req, **fields,
    )  # fmt: skip
    return state, mem
