"""``backend="reference"``: the ring-state streaming semantics in plain PyTorch, request by request.

Slow but obviously right: for each request it lays the rows it needs (old rows from the ring, new rows from
``kv_score``, both gated with the APE bias) side by side by position, cuts out the windows of the groups the
step closes, and runs them through :mod:`dsv4_compressor.reference`. Everything is computed before anything is
written, so a failure leaves the state as it was.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import reference as ref
from ..config import INDEXER
from ..layout import encode_indexer_fp8
from .base import RingBackend, StepInput

__all__ = ["ReferenceBackend"]


class ReferenceBackend(RingBackend):
    name = "reference"

    def __init__(self, *args, compute_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(*args, **kwargs)
        if compute_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
        self.compute_dtype = compute_dtype

    def run(self, step: StepInput) -> None:
        cfg, r, ring = self.config, self.config.ratio, self.ring_rows
        out_slots = torch.from_numpy(step.out_slot_host)
        params = ref.params_as(self.params, self.compute_dtype)
        entries, saves = [], []
        # Compress every request first: all windows read the ring before any new row is saved into it.
        for slot, start, n, row0 in zip(*(a.tolist() for a in (step.slots, step.starts, step.counts, step.row0))):
            end = start + n
            positions = torch.arange(start, end, device=self.device)
            new_rows = ref.gated_rows(step.kv_score[row0 : row0 + n], positions, self.params.ape, cfg.width)
            keep = max(start, end - ring)
            saves.append((slot, torch.arange(keep, end, device=self.device) % ring, new_rows[keep - start :]))
            first_group = -(-(start - (r - 1)) // r)  # first g with g*r + r - 1 >= start
            groups = list(range(max(first_group, 0), end // r))
            if not groups:
                continue
            lo = int(self.needs_from(np.array([start]))[0])
            old = self.ring[slot, torch.arange(lo, start, device=self.device) % ring]
            rows = torch.cat([old, new_rows]).to(self.compute_dtype)  # rows of positions lo .. end-1
            cur = torch.stack([rows[g * r - lo : g * r - lo + r] for g in groups])
            prev = None
            if cfg.overlap:
                absent = torch.zeros_like(cur[0])
                absent[:, cfg.width :] = float("-inf")
                prev = torch.stack([rows[(g - 1) * r - lo : g * r - lo] if g > 0 else absent for g in groups])
            kv, score = ref.window_halves(prev, cur, cfg)
            values = ref.finish_entries(ref.pool_windows(kv, score), torch.tensor(groups) * r, params, cfg)
            closing_rows = torch.tensor([row0 + g * r + r - 1 - start for g in groups])
            entries.append((out_slots[closing_rows], values))
        for slots, values in entries:
            self._store(slots, values)
        for slot, idx, rows in saves:
            self.ring[slot, idx] = rows

    def _store(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        keep = slots >= 0
        slots, values = slots[keep], values[keep]
        pool = self.pool
        if self.config.output == INDEXER:
            pool.keys[slots.long()] = values.float().to(torch.bfloat16)
            if pool.fp8_pages is not None:
                pool.fp8_layout.write(pool.fp8_pages, slots, encode_indexer_fp8(values.float()))
        else:
            pool.layout.write(pool.pages, slots, ref.encode_entries(values, self.config))
