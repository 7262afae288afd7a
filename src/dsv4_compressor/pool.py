"""The paged output pool: where compressed entries land, and which pages each request owns.

Latent kinds (HCA, CSA) write 584-byte records into FlashMLA fp8-sparse pages (``layout.PageLayout``).
The indexer writes its bf16 keys into a slot-indexed ``[num_slots, H]`` tensor and, when enabled, its
132-byte FP8 packs into their own pages. Slot ``s`` is ``page * P + t`` in every area, so one page table
per request addresses all of them.

The pool holds ``max_pages`` pages (a budget; by default enough for every request at ``max_seq_len``), allocated
once, so buffers never move (CUDA graphs keep their pointers). Pages are handed out as requests grow, in
O(new pages) host work per step, and come back when a request ends.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .config import INDEXER, LATENT, CompressorConfig
from .errors import CapacityError
from .layout import decode_latent, indexer_fp8_page_layout, latent_page_layout

__all__ = ["EntryPool", "pool_bytes"]


def _page_bytes(config: CompressorConfig, page_size: int) -> int:
    """Bytes one page costs across the pool's areas."""
    if config.output == LATENT:
        return latent_page_layout(config, page_size).bytes_per_page
    fp8 = indexer_fp8_page_layout(config, page_size).bytes_per_page if config.indexer_fp8 else 0
    return page_size * config.head_dim * 2 + fp8


def pool_bytes(config: CompressorConfig, page_size: int, pages: int) -> int:
    """Bytes of a pool of ``pages`` pages."""
    return pages * _page_bytes(config, page_size)


def _memory_limit(device: torch.device) -> int | None:
    """Bytes a new allocation may take on ``device`` (free GPU memory; the host's physical memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not a POSIX host
        return None


class EntryPool:
    """Output pages for up to ``max_requests`` requests of up to ``max_entries`` entries each.

    Args:
        max_pages: the page budget (default ``max_requests * ceil(max_entries / page_size)``: an admitted
            request never runs out). With a smaller budget a step that needs more pages than are free is refused
            with a :class:`~dsv4_compressor.errors.CapacityError`.

    Raises:
        ValueError: the pool does not fit the device's memory (say how many bytes it needs).
    """

    def __init__(
        self,
        config: CompressorConfig,
        *,
        max_requests: int,
        max_entries: int,
        page_size: int,
        device,
        max_pages: int | None = None,
    ):
        self.config = config
        self.page_size = page_size
        self.pages_per_request = max(1, -(-max_entries // page_size))
        self.num_pages = max_requests * self.pages_per_request if max_pages is None else max_pages
        self.device = torch.device(device)
        need = pool_bytes(config, page_size, self.num_pages)
        limit = _memory_limit(self.device)
        if limit is not None and need > limit:
            raise ValueError(
                f"{config.name}: the output pool needs {need:,} bytes ({self.num_pages:,} pages of "
                f"{_page_bytes(config, page_size):,} B) but {self.device} has {limit:,}; pass max_pages= (a page "
                f"budget) or lower max_requests / max_seq_len"
            )
        try:
            self._allocate(config, page_size)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ValueError(f"{config.name}: could not allocate the output pool ({need:,} bytes): {exc}") from None
        self.page_table = np.full((max_requests, self.pages_per_request), -1, dtype=np.int64)
        self.held = np.zeros(max_requests, dtype=np.int64)  # pages held by each request slot
        self._free = list(range(self.num_pages - 1, -1, -1))

    def _allocate(self, config: CompressorConfig, page_size: int) -> None:
        n, dev = self.num_pages, self.device
        self.layout = self.fp8_layout = None
        self.pages = self.keys = self.fp8_pages = None
        if config.output == LATENT:
            self.layout = latent_page_layout(config, page_size)
            self.pages = torch.zeros(n, self.layout.bytes_per_page, dtype=torch.uint8, device=dev)
        else:
            self.keys = torch.zeros(n * page_size, config.head_dim, dtype=torch.bfloat16, device=dev)
            if config.indexer_fp8:
                self.fp8_layout = indexer_fp8_page_layout(config, page_size)
                self.fp8_pages = torch.zeros(n, self.fp8_layout.bytes_per_page, dtype=torch.uint8, device=dev)

    # -- what the ops write ------------------------------------------------------------------------
    @property
    def out_pages(self) -> torch.Tensor | None:
        """The pages compress writes records into: latent pages, or the indexer's FP8 pages (if any)."""
        return self.pages if self.config.output == LATENT else self.fp8_pages

    @property
    def out_keys(self) -> torch.Tensor | None:
        return self.keys

    # -- allocation ---------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    def reserve(self, slots: np.ndarray, entries: np.ndarray, what: str = "step") -> list[tuple[int, int]]:
        """Give each request slot pages for its first ``entries`` entries; O(new pages). Returns what was
        handed out, for :meth:`undo`. Nothing changes when there are too few free pages."""
        held = self.held[slots]
        if not (entries > held * self.page_size).any():  # the usual step: every request's pages suffice
            return []
        want = -(-entries // self.page_size)
        new = np.maximum(want - held, 0)
        total = int(new.sum())
        if total > len(self._free):
            k = int(np.argmax(np.cumsum(new) > len(self._free)))
            raise CapacityError(
                f"{what}: request {int(slots[k])} needs {int(new[k])} more output page(s) (the step needs {total}) but "
                f"only {len(self._free)} of the pool's {self.num_pages} are free (max_pages)"
            )
        given = []
        for k in np.nonzero(new)[0]:
            slot, held, count = int(slots[k]), int(self.held[slots[k]]), int(new[k])
            for i in range(held, held + count):
                self.page_table[slot, i] = self._free.pop()
            self.held[slot] = held + count
            given.append((slot, held))
        return given

    def undo(self, given: list[tuple[int, int]]) -> None:
        """Return the pages :meth:`reserve` handed out (a failed step)."""
        for slot, held in reversed(given):
            for i in range(int(self.held[slot]) - 1, held - 1, -1):
                self._free.append(int(self.page_table[slot, i]))
                self.page_table[slot, i] = -1
            self.held[slot] = held

    def free(self, slot: int) -> None:
        for i in range(int(self.held[slot]) - 1, -1, -1):
            self._free.append(int(self.page_table[slot, i]))
        self.page_table[slot, : self.held[slot]] = -1
        self.held[slot] = 0

    def slots_of(self, slot: int, entries: int) -> torch.Tensor:
        """Global slots of entries ``0..entries-1`` of request ``slot``."""
        g = np.arange(entries)
        return torch.from_numpy(self.page_table[slot, g // self.page_size] * self.page_size + g % self.page_size)

    def out_slots(self, slots: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """Global slots of entry ``groups[i]`` of request ``slots[i]`` (vectorised)."""
        p = self.page_size
        if p & (p - 1) == 0:  # a power of two (every default): shifts and masks instead of divisions
            shift = int(p).bit_length() - 1
            return (self.page_table[slots, groups >> shift] << shift) | (groups & (p - 1))
        return self.page_table[slots, groups // p] * p + groups % p

    # -- reading ------------------------------------------------------------------------------------
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

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor of the pool, by name."""
        named = {"pages": self.pages, "keys": self.keys, "fp8_pages": self.fp8_pages}
        return {k: v for k, v in named.items() if v is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
