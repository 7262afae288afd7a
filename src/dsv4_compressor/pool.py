"""The paged output pool: where compressed entries land, and which pages each request owns.

Latent kinds (HCA, CSA) write 584-byte records into FlashMLA fp8-sparse pages (``layout.PageLayout``).
The indexer writes its bf16 keys into a slot-indexed ``[num_slots, H]`` tensor and, when enabled, its
132-byte FP8 packs into their own pages. Slot ``s`` is ``page * P + t`` in every area, so one page table
per request addresses all of them.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import INDEXER, LATENT, CompressorConfig
from .layout import decode_latent, indexer_fp8_page_layout, latent_page_layout

__all__ = ["EntryPool"]


class EntryPool:
    """Output pages for up to ``max_requests`` requests of ``max_entries`` entries each.

    Pages are handed out from a free list as requests grow (:meth:`ensure`) and come back on
    :meth:`free`. The pool is sized for the worst case, so an admitted request never runs out of pages.
    """

    def __init__(self, config: CompressorConfig, *, max_requests: int, max_entries: int, page_size: int, device):
        self.config = config
        self.page_size = page_size
        self.pages_per_request = max(1, -(-max_entries // page_size))
        self.num_pages = max_requests * self.pages_per_request
        self.device = torch.device(device)
        num_slots = self.num_pages * page_size
        if config.output == LATENT:
            self.layout = latent_page_layout(config, page_size)
            self.pages = torch.zeros(self.num_pages, self.layout.bytes_per_page, dtype=torch.uint8, device=device)
            self.keys = None
            self.fp8_layout = None
            self.fp8_pages = None
        else:
            self.layout = None
            self.pages = None
            self.keys = torch.zeros(num_slots, config.head_dim, dtype=torch.bfloat16, device=device)
            self.fp8_layout = indexer_fp8_page_layout(config, page_size) if config.indexer_fp8 else None
            self.fp8_pages = (
                torch.zeros(self.num_pages, self.fp8_layout.bytes_per_page, dtype=torch.uint8, device=device)
                if config.indexer_fp8
                else None
            )
        self.page_table = np.full((max_requests, self.pages_per_request), -1, dtype=np.int64)
        self._free = list(range(self.num_pages - 1, -1, -1))

    # -- allocation -------------------------------------------------------------------------------
    def pages_needed(self, slot: int, entries: int) -> int:
        """Pages ``slot`` lacks to hold ``entries`` entries."""
        want = -(-entries // self.page_size)
        return int((self.page_table[slot, :want] < 0).sum())

    def ensure(self, slot: int, entries: int) -> None:
        """Give ``slot`` pages for its first ``entries`` entries."""
        want = -(-entries // self.page_size)
        for i in range(want):
            if self.page_table[slot, i] < 0:
                self.page_table[slot, i] = self._free.pop()

    def free(self, slot: int) -> None:
        for page in self.page_table[slot]:
            if page >= 0:
                self._free.append(int(page))
        self.page_table[slot] = -1

    def slots_of(self, slot: int, entries: int) -> torch.Tensor:
        """Global slots of entries ``0..entries-1`` of request ``slot``."""
        g = np.arange(entries)
        return torch.from_numpy(self.page_table[slot, g // self.page_size] * self.page_size + g % self.page_size)

    # -- reading ----------------------------------------------------------------------------------
    def records(self, slots: torch.Tensor) -> torch.Tensor:
        """Stored bytes of ``slots``: 584-byte latent records, or ``[N, H + 4]`` indexer FP8 packs."""
        slots = slots.to(self.device)
        if self.config.output == LATENT:
            return self.layout.read(self.pages, slots)
        if self.fp8_pages is None:
            raise ValueError(f"{self.config.name}: this cache keeps no FP8 pack (indexer_fp8=False)")
        return self.fp8_layout.read(self.fp8_pages, slots)

    def values(self, slots: torch.Tensor) -> torch.Tensor:
        """What a reader sees, float32 ``[N, H]``: dequantized latents or the bf16 indexer keys."""
        slots = slots.to(self.device)
        if self.config.output == INDEXER:
            return self.keys[slots.long()].float()
        return decode_latent(self.layout.read(self.pages, slots), self.config)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pages, self.keys, self.fp8_pages) if t is not None)
