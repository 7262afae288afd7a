"""Online HCA banks on LightLLM's memory manager: allotment, per-layer views, the PD transfer, the saving."""

from __future__ import annotations

import torch

from ...config import CompressorConfig
from .layout import _BANKS, LightLLMLayout


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
    return hca_layers * (cfg.ring_bytes(mtp_step) - cfg.online_bank_bytes(mtp_step))


def online_hca_memory_report(mtp_step: int = 3) -> dict[str, int]:
    """Bytes per request freed by online HCA, for each model of docs/SPEC.md section 1 (V4-Flash, V4-Pro)."""
    from ...config import MODELS  # the layer counts of docs/SPEC.md section 1

    return {name: online_hca_savings(layers["hca"], mtp_step) for name, layers in MODELS.items()}
