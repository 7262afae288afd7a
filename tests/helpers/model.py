"""The reference a cache is checked against: :class:`StreamModel`, a model of what a cache must hold after a
sequence of steps (SPEC section 5): the current row of every position, the float64 values of every output
slot ever written (also entries that discarded drafts emitted) and which ring rows are live.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_compressor import reference
from dsv4_compressor.config import CompressorConfig, CompressorParams
from helpers.inputs import random_rows


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
class StreamModel:
    """What a cache must hold after a sequence of steps (SPEC section 5).

    ``rows[rid]``: float32 CPU rows of positions ``0..L-1`` (the most recently supplied row of each);
    ``written``: global output slot -> the entry last written there (also entries emitted by drafts that a later
    step discarded: the kernels wrote those bytes too), recorded when :meth:`apply` is given the cache's pool and
    computed in float64 when asked (:meth:`written_values`); ``retained[rid]``: the oldest position whose ring
    row is still valid (``mtp_step`` sizes the ring).
    """

    def __init__(self, cfg: CompressorConfig, params: CompressorParams, mtp_step: int = 0):
        self.cfg = cfg
        self.params = params.to("cpu")
        self.ring = cfg.ring_rows(mtp_step)
        self.rows: dict[int, torch.Tensor] = {}
        self.retained: dict[int, int] = {}
        self.written: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (rows of that step, group)
        self.closed_log: list[tuple[int, int]] = []  # (rid, group) of every entry emitted, in order
        self._values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def live(self) -> list[int]:
        return sorted(self.rows)

    def length(self, rid: int) -> int:
        return self.rows[rid].shape[0] if rid in self.rows else 0

    def apply(self, rid: int, start: int, new_rows: torch.Tensor, pool=None) -> None:
        """Positions ``>= start`` are discarded, then ``new_rows`` supply ``[start, start + n)``; with ``pool``
        the output slots of the groups the rows close are recorded (its page table must hold their pages)."""
        cfg, r = self.cfg, self.cfg.ratio
        new_rows = new_rows.detach().float().cpu()
        old = self.rows[rid][:start] if start > 0 else torch.zeros(0, cfg.row_width)
        assert old.shape[0] == start, f"model: request {rid} restarts at {start} but has {self.length(rid)} rows"
        rows = torch.cat([old, new_rows.clone()])
        self.rows[rid] = rows
        end = rows.shape[0]
        prev = 0 if start == 0 else self.retained[rid]
        self.retained[rid] = max(prev, end - self.ring)
        first = max(0, -(-(start - (r - 1)) // r))  # first g with g*r + r - 1 >= start
        for g in range(first, end // r):
            self.closed_log.append((rid, g))
            if pool is not None:
                page = int(pool.page_table[rid, g // pool.page_size])
                assert page >= 0, f"model: request {rid} group {g} has no page"
                self.written[page * pool.page_size + g % pool.page_size] = (rows, g)

    def release(self, rid: int) -> None:
        del self.rows[rid]
        del self.retained[rid]

    def expected(self, rid: int) -> torch.Tensor:
        """float64 ``[L // r, H]``: the one-shot entries over the current rows."""
        return reference.compress_sequence(self.rows[rid], self.params, self.cfg, dtype=torch.float64)

    def _entries_of(self, rows: torch.Tensor) -> torch.Tensor:
        hit = self._values.get(id(rows))
        if hit is None or hit[0] is not rows:
            hit = (rows, reference.compress_sequence(rows, self.params, self.cfg, dtype=torch.float64))
            self._values[id(rows)] = hit
        return hit[1]

    def written_values(self) -> tuple[list[int], torch.Tensor]:
        """``(slots, float64 [N, H])``: every output slot written so far and the entry last written there."""
        slots = sorted(self.written)
        if not slots:
            return [], torch.zeros(0, self.cfg.head_dim, dtype=torch.float64)
        values = torch.stack([self._entries_of(self.written[s][0])[self.written[s][1]] for s in slots])
        live = {id(rows) for rows, _ in self.written.values()}
        self._values = {k: v for k, v in self._values.items() if k in live}
        return slots, values

    def live_ring_positions(self, rid: int) -> list[int]:
        end = self.length(rid)
        return list(range(max(self.retained[rid], end - self.ring, 0), end))

    def gated(self, rid: int, positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long)
        return reference.gated_rows(self.rows[rid][pos], pos, self.params.ape, self.cfg.width)


def split_rows(items, rows: torch.Tensor) -> list:
    """``[(rid, start, n)]`` and the step's concatenated rows -> ``[(rid, start, rows of that request)]``."""
    out, row = [], 0
    for rid, start, n in items:
        out.append((rid, start, rows[row : row + n]))
        row += n
    assert row == rows.shape[0], (row, rows.shape)
    return out


def run_step(caches, model: StreamModel | None, items, gen: torch.Generator | None = None) -> torch.Tensor:
    """One step ``items = [(rid, start, rows or n), ...]`` (in ``kv_score`` order) on one cache or a list of
    caches, then on the model; ``n`` draws fresh rows from ``gen``. Each cache gets its own copy of the rows on
    its device (``kv_score`` belongs to the cache for the step). Returns the step's CPU rows."""
    caches = caches if isinstance(caches, (list, tuple)) else [caches]
    cfg = caches[0].config
    items = [(rid, start, random_rows(x, cfg, gen) if isinstance(x, int) else x) for rid, start, x in items]
    ids = [rid for rid, _, _ in items]
    starts = [start for _, start, _ in items]
    counts = [rows.shape[0] for _, _, rows in items]
    kv = torch.cat([rows.cpu() for _, _, rows in items]) if items else torch.zeros(0, cfg.row_width)
    for cache in caches:
        cache.step(ids, starts, counts, kv.to(cache.device).clone().contiguous())
    for other in caches[1:]:
        assert np.array_equal(other.pool.page_table, caches[0].pool.page_table), "caches handed out other pages"
    if model is not None:
        for rid, start, rows in items:
            model.apply(rid, start, rows, caches[0].pool)
    return kv
