"""Step schedules that cover prefill chunks straddling cached and new rows, chunks longer than the ring, MTP
rewinds that discard emitted entries, mixed steps, pure rewinds and request slot reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from helpers.checks import check_outputs, check_state
from helpers.model import StreamModel, run_step


# ----------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------
@dataclass
class Coverage:
    straddle: int = 0  # a chunk of > 1 rows starting mid-group that closes that group (cached + new rows)
    longer_than_ring: int = 0
    rewind: int = 0
    rewind_discards_entry: int = 0  # a rewind below a position that had closed a group
    mixed: int = 0  # a step with both decode-sized and longer requests
    pure_rewind: int = 0  # n == 0 with start < L
    reuse: int = 0  # a released slot begun again
    boundary_decode: int = 0  # decode steps where some row closes a group
    all_close_decode: int = 0  # decode steps where every request closes a group


def schedule_coverage(steps, r: int, mtp: int, ring: int) -> Coverage:
    cov = Coverage()
    length: dict[int, int] = {}
    released: set[int] = set()
    for step in steps:
        if isinstance(step, tuple) and step[0] == "release":
            released.add(step[1])
            length.pop(step[1], None)
            continue
        sizes = [n for _, _, n in step]
        decode = all(n <= mtp + 1 for n in sizes)
        if not decode and any(0 < n <= mtp + 1 for n in sizes):
            cov.mixed += 1
        closes = []
        for rid, start, n in step:
            L = length.get(rid, 0)
            if start == 0 and rid in released:
                cov.reuse += 1
                released.discard(rid)
            closes.append(any(p % r == r - 1 for p in range(start, start + n)))
            if start < L:
                cov.rewind += 1
                if any(p % r == r - 1 for p in range(start, L)):
                    cov.rewind_discards_entry += 1
                if n == 0:
                    cov.pure_rewind += 1
            if n > 1 and start % r and closes[-1]:
                cov.straddle += 1
            if n > ring:
                cov.longer_than_ring += 1
            length[rid] = start + n
        if decode and any(closes):
            cov.boundary_decode += 1
        if decode and closes and all(c for c, (_, _, n) in zip(closes, step) if n):
            cov.all_close_decode += 1
    return cov


def standard_schedule(r: int, mtp: int, ring: int, decode_steps: int | None = None) -> list:
    """A fixed schedule for up to 4 requests that covers every case of :class:`Coverage`.

    Items are lists ``[(rid, start, n), ...]`` (one step) or ``("release", rid)``."""
    s = mtp + 1
    steps: list = []
    L = {}

    def step(items):
        steps.append(items)
        for rid, start, n in items:
            L[rid] = start + n

    step([(0, 0, r + r // 2 + 1), (1, 0, 3)])
    step([(0, L[0], 2 * r + 1), (1, L[1], ring + r + 1), (2, 0, 2)])  # straddles; longer than the ring
    step([(rid, L[rid], s) for rid in (0, 1, 2)])  # decode
    step([(0, L[0] - min(2, mtp), s), (1, L[1] - min(1, mtp), s), (2, L[2], s)])  # rewinds
    step([(0, L[0] - min(1, mtp), s), (1, L[1], 2 * r), (2, L[2] - min(1, mtp), 0), (3, 0, 2 * r + 3)])  # mixed
    steps.append(("release", 1))
    L.pop(1)
    step([(1, 0, r + 1), (0, L[0], s)])  # slot 1 reused: its state still holds the old request's
    # Move every request to just before a group boundary (a prefill chunk), then decode with MTP across it,
    # rewinding onto a closing position when one was just supplied (discarding the entry it emitted).
    approach = []
    for rid in sorted(L):
        target = max(L[rid], (L[rid] // r + 1) * r - 1 - mtp - (rid % 2))
        approach.append((rid, L[rid], target - L[rid]))
    step(approach)
    n_dec = 4 if decode_steps is None else decode_steps
    for _ in range(n_dec):
        items = []
        for rid in sorted(L):
            start = L[rid]
            closers = [p for p in range(max(0, start - mtp), start) if p % r == r - 1]
            if closers:
                start = closers[0]
            items.append((rid, start, s))
        step(items)
    # Line every request up so that one decode step closes a group in all of them.
    items = []
    for rid in sorted(L):
        target = (L[rid] // r + 1) * r - 1  # the next closing position
        items.append((rid, L[rid], max(0, target - L[rid])))
    step(items)
    step([(rid, L[rid], s) for rid in sorted(L)])
    return steps


def random_schedule(r: int, mtp: int, ring: int, *, seed: int, num_steps: int, max_requests: int = 4) -> list:
    """A random valid schedule: begins, prefill chunks, decode with MTP rewinds, releases."""
    rng = np.random.default_rng(seed)
    s = mtp + 1
    L: dict[int, int] = {}
    steps: list = []
    for _ in range(num_steps):
        if L and rng.random() < 0.08:
            rid = int(rng.choice(sorted(L)))
            steps.append(("release", rid))
            L.pop(rid)
            continue
        items = []
        for rid in range(max_requests):
            if rid not in L:
                if rng.random() < 0.5:
                    items.append((rid, 0, int(rng.integers(0, 3 * r + 2))))
                continue
            if rng.random() < 0.2:
                continue
            start = L[rid] - int(rng.integers(0, min(mtp, L[rid]) + 1))
            n = s if rng.random() < 0.6 else int(rng.integers(0, ring + 2 * r))
            items.append((rid, start, n))
        rng.shuffle(items)
        if not items:
            continue
        steps.append(items)
        for rid, start, n in items:
            L[rid] = start + n
    return steps


def max_positions_needed(steps) -> int:
    L: dict[int, int] = {}
    top = 0
    for step in steps:
        if isinstance(step, tuple):
            L.pop(step[1], None)
            continue
        for rid, start, n in step:
            L[rid] = start + n
            top = max(top, L[rid])
    return top


def run_schedule(caches, model: StreamModel, steps, gen: torch.Generator, *, check_every_step=True, what=""):
    """Run a schedule on caches (all must end in the same state) and the model, checking as it goes."""
    for i, step in enumerate(steps):
        if isinstance(step, tuple):
            for cache in caches:
                cache.release(step[1])
            model.release(step[1])
            continue
        run_step(caches, model, step, gen)
        if check_every_step or i == len(steps) - 1:
            for cache in caches:
                label = f"{what} step {i} {step} [{cache.backend_name}]"
                check_outputs(cache, model, label)
                check_state(cache, model, label)
    return model
