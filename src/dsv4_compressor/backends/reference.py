"""``backend="reference"``: the ring-state streaming semantics in plain PyTorch, request by request.

Slow but obviously right: for each request it lays the rows it needs (old rows from the ring, new rows from
``kv_score``, both gated with the APE bias) side by side by position, cuts out the windows of the groups the
step closes, and runs them through :mod:`dsv4_compressor.reference`.
"""

from __future__ import annotations

import torch

from .. import reference as ref
from ..config import INDEXER
from ..layout import encode_indexer_fp8
from ..step import StepDescriptor
from .base import RingBackend

__all__ = ["ReferenceBackend"]


class ReferenceBackend(RingBackend):
    name = "reference"

    def __init__(self, *args, compute_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(*args, **kwargs)
        if compute_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
        self.compute_dtype = compute_dtype

    def step(self, desc: StepDescriptor, kv_score: torch.Tensor) -> None:
        cfg, r, ring = self.config, self.config.ratio, self.ring_rows
        out_slots = desc.out_slot
        gated_steps = []
        # Compress every request first: all windows read the ring before any new row is saved into it.
        for slot, start, n, row0 in desc.requests:
            end = start + n
            positions = torch.arange(start, end, device=self.device)
            new_rows = ref.gated_rows(kv_score[row0 : row0 + n], positions, self.params.ape, cfg.width)
            gated_steps.append((slot, start, end, new_rows))
            first_group = -(-(start - (r - 1)) // r)  # first g with g*r + r - 1 >= start
            groups = torch.arange(max(first_group, 0), end // r, device=self.device)
            if len(groups) == 0:
                continue
            lo = self.needs_from(start)
            old = self.ring[slot, torch.arange(lo, start, device=self.device) % ring]
            rows = torch.cat([old, new_rows]).to(self.compute_dtype)  # rows of positions lo .. end-1
            cur = torch.stack([rows[g * r - lo : g * r - lo + r] for g in groups.tolist()])
            prev = None
            if cfg.overlap:
                absent = torch.zeros_like(cur[0])
                absent[:, cfg.width :] = float("-inf")
                prev = torch.stack([rows[(g - 1) * r - lo : g * r - lo] if g > 0 else absent for g in groups.tolist()])
            kv, score = ref.window_halves(prev, cur, cfg)
            pooled = ref.pool_windows(kv, score)
            params = ref.params_as(self.params, self.compute_dtype)
            values = ref.finish_entries(pooled, groups * r, params, cfg)
            closing_rows = row0 + (groups * r + r - 1 - start)
            self._store(out_slots[closing_rows], values)
        # Then save each request's last min(n, ring) rows.
        for slot, start, end, new_rows in gated_steps:
            keep = max(start, end - ring)
            idx = torch.arange(keep, end, device=self.device)
            self.ring[slot, idx % ring] = new_rows[keep - start :]

    def _store(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        pool = self.pool
        if self.config.output == INDEXER:
            pool.keys[slots.long()] = values.float().to(torch.bfloat16)
            if pool.fp8_pages is not None:
                pool.fp8_layout.write(pool.fp8_pages, slots, encode_indexer_fp8(values.float()))
        else:
            pool.layout.write(pool.pages, slots, ref.encode_entries(values, self.config))
