"""Guard bands: output areas, ring, banks and the C128 scratch moved into larger buffers whose margins must
keep their fill (:func:`guard_cache`, :class:`GuardedRun`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from helpers.buffers import (
    GUARD_BYTE,
    GUARD_F32,
    PAD_F32,
    POISON_BYTE,
    POISON_F32,
    fill_bits,
    output_tensors,
    raw,
    step_meta,
)
from helpers.checks import check_outputs, check_state
from helpers.inputs import make_cache, make_params, random_rows
from helpers.model import StreamModel
from helpers.schedules import standard_schedule
from helpers.session import kernel_device


# ----------------------------------------------------------------------------------------------
# Guard bands
# ----------------------------------------------------------------------------------------------
@dataclass
class Guarded:
    """A tensor placed inside a larger buffer: ``view`` is the tensor, the rest of ``buffer`` is a guard band."""

    name: str
    buffer: torch.Tensor  # flat, the full allocation
    view: torch.Tensor
    lo: int  # element range of the view in buffer
    hi: int
    guard: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.guard = self._guard_bytes().clone()

    def _guard_bytes(self) -> torch.Tensor:
        return torch.cat([raw(self.buffer[: self.lo]), raw(self.buffer[self.hi :])]).cpu()

    def assert_intact(self, what: str = "") -> None:
        now = self._guard_bytes()
        bad = (now != self.guard).nonzero()
        assert len(bad) == 0, f"{what}: {len(bad)} guard-band bytes around {self.name} were overwritten"


def guarded_like(name: str, t: torch.Tensor, *, guard_elems: int, fill: int, guard: int) -> Guarded:
    """A poisoned replacement for ``t`` (same shape and dtype) inside guard bands.

    ``fill``/``guard``: a byte (uint8, bf16 areas) or a float32 bit pattern (float32 areas)."""
    n = t.numel()
    buf = torch.empty(guard_elems + n + guard_elems, dtype=t.dtype, device=t.device)
    if t.dtype == torch.float32:
        fill_bits(buf, guard)
        view = buf[guard_elems : guard_elems + n]
        fill_bits(view, fill)
    else:
        buf.view(torch.uint8).fill_(guard)
        view = buf[guard_elems : guard_elems + n]
        view.view(torch.uint8).fill_(fill)
    return Guarded(name, buf, view.view(t.shape), guard_elems, guard_elems + n)


def guard_cache(cache, guard_bytes: int = 4096) -> list[Guarded]:
    """Replace the cache's pool areas, its state (ring or online banks) and (tiled HCA) scratch workspace by
    poisoned views inside larger buffers whose surroundings are guard bands. The backends read these
    attributes at launch time.

    Each band is one leading-dimension unit of its tensor (a page, a request's ring or banks, a scratch region)
    plus ``guard_bytes``, so that an index of -1 (a padding row taken for a real one) lands in the band."""
    out = []
    pool, backend = cache.pool, cache.backend

    def elems(t):
        return t[0].numel() + guard_bytes // t.element_size()

    for name, t in output_tensors(cache).items():
        g = guarded_like(name, t, guard_elems=elems(t), fill=POISON_BYTE, guard=GUARD_BYTE)
        setattr(pool, name, g.view)
        out.append(g)
    attr, name = ("ring", "ring") if hasattr(backend, "ring") else ("state", "banks")
    state = getattr(backend, attr)
    g = guarded_like(name, state, guard_elems=elems(state), fill=POISON_F32, guard=GUARD_F32)
    setattr(backend, attr, g.view)
    out.append(g)
    ws = getattr(backend, "workspace", None)
    if ws is not None and getattr(backend, "tiled", False):
        g = guarded_like("scratch", ws.buffer, guard_elems=elems(ws.buffer), fill=POISON_F32, guard=GUARD_F32)
        ws.buffer = g.view
        out.append(g)
    names = {g.name for g in out}
    assert set(cache.state_tensors()) <= names, f"guard_cache missed {set(cache.state_tensors()) - names}"
    return out


GUARD_UNUSED_SLOT = 4


class GuardedRun:
    """A kernel-backend cache whose pool, state and scratch sit inside guard bands (:func:`guard_cache`),
    stepped with ``kv_score`` inside a guard band too, and checked after every step (``tests/test_guard_bands.py``
    and the GPU module). ``region``: run on that region of a two-region workspace (``None``: the default)."""

    def __init__(self, cfg, opts, region, *, backend="triton", mtp=2, batch_max_tokens=64, max_positions=512,
                 device=None, params_opts=None):  # fmt: skip
        self.cfg, self.mtp, self.region = cfg, mtp, region
        self.device = dev = kernel_device() if device is None else torch.device(device)
        self.params = make_params(cfg, max_positions=max_positions, **(params_opts or {}))
        if region is not None:  # two micro-batch regions; this cache uses `region`
            from dsv4_compressor import Workspace, plan_c128_scratch

            plan = plan_c128_scratch(
                batch_max_tokens=batch_max_tokens, max_req_num=GUARD_UNUSED_SLOT + 1, mtp_step=mtp,
                decode_overlap=True, dp=2, head_dim=cfg.head_dim,
            )  # fmt: skip
            assert plan.regions == 2
            opts = dict(opts, workspace=Workspace(plan, device=dev), scratch_region=region)
        elif backend == "triton":
            opts = dict(opts, batch_max_tokens=batch_max_tokens)
        self.cache = make_cache(
            cfg, self.params, backend, max_requests=GUARD_UNUSED_SLOT + 1, max_seq_len=max_positions, mtp_step=mtp,
            device=dev, **opts,
        )  # fmt: skip
        self.guards = guard_cache(self.cache)
        self.model = StreamModel(cfg, self.params, mtp)
        self.ring = hasattr(self.cache.backend, "ring")
        state = self.cache.backend.ring if self.ring else self.cache.backend.state
        self.saved = torch.zeros(state.shape[:2], dtype=torch.bool)  # ring rows / banks ever written
        self.gen = torch.Generator().manual_seed(21)

    @property
    def tiled(self) -> bool:
        return getattr(self.cache.backend, "tiled", False)

    def _scratch(self):
        return self.cache.backend.workspace.buffer

    def run(self, items, *, pad: int = 0, low_level: bool = False, what: str = ""):
        cfg, cache, dev = self.cfg, self.cache, self.device
        if self.tiled:
            fill_bits(self._scratch(), POISON_F32)
        total = sum(n for _, _, n in items)
        rows = random_rows(total, cfg, self.gen)
        kv = guarded_like("kv_score", torch.empty(total + pad, cfg.row_width, device=dev),
                          guard_elems=2 * cfg.row_width, fill=PAD_F32, guard=GUARD_F32)  # fmt: skip
        kv.view[:total] = rows.to(dev)
        if low_level:  # the CUDA-graph path: pages, padded metadata and plan, backend.launch
            host = step_meta(cache, items, pad_rows=pad, pad_slot=cache.max_requests)
            positions, row_req, out_slot = torch.from_numpy(host).to(dev)
            plan = cache.backend.plan_buffer(total + pad, len(items) + 1)
            decode = all(n <= self.mtp + 1 for _, _, n in items)
            cache.backend.launch(kv.view, positions, row_req, out_slot, plan, decode=decode)
            closing = host[2] >= 0
            closing[total:] = False
        else:
            assert pad == 0
            cache.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], kv.view)
            closing = None
        row = 0
        for rid, start, n in items:
            self.model.apply(rid, start, rows[row : row + n], cache.pool)
            width = self.saved.shape[1]
            if self.ring:
                self.saved[rid, torch.arange(max(start, start + n - width), start + n) % width] = True
            else:  # bank L % B holds the state after L positions; group boundaries bank nothing
                for ell in range(max(start + 1, start + n - width + 1), start + n + 1):
                    if ell % cfg.ratio:
                        self.saved[rid, ell % width] = True
            row += n
        if closing is None:
            pos = np.concatenate([np.arange(s, s + n) for _, s, n in items] + [np.zeros(0, np.int64)])
            closing = pos % cfg.ratio == cfg.ratio - 1
        self.check(torch.from_numpy(closing), kv, rows, what)

    def run_standard(self, decode_steps: int = 2, what: str = "") -> None:
        """The standard schedule step by step, then a padded decode launch through the CUDA-graph path
        (``backend.launch``) that closes a group in every live request."""
        r, mtp = self.cfg.ratio, self.mtp
        steps = standard_schedule(r, mtp, self.cfg.ring_rows(mtp), decode_steps=decode_steps)
        for i, step in enumerate(steps):
            if isinstance(step, tuple):
                self.cache.release(step[1])
                self.model.release(step[1])
                continue
            self.run(step, what=f"{what} step {i} {step}")
        lengths = {rid: self.model.length(rid) for rid in self.model.rows}
        items = [(rid, n, (n // r + 1) * r - n) for rid, n in sorted(lengths.items())]
        self.run(items, pad=3, low_level=True, what=f"{what} padded launch {items}")
        assert len(self.model.written) > 0

    def check(self, closing: torch.Tensor, kv: Guarded, rows: torch.Tensor, what: str) -> None:
        cache = self.cache
        for g in self.guards + [kv]:
            g.assert_intact(what)
        # kv_score is never written, padding rows included
        got = kv.view.cpu()
        want = torch.empty_like(got)
        fill_bits(want, PAD_F32)
        want[: rows.shape[0]] = rows
        assert torch.equal(raw(got), raw(want)), f"{what}: kv_score was written"
        check_outputs(cache, self.model, what)
        check_state(cache, self.model, what)
        state = (cache.backend.ring if self.ring else cache.backend.state).cpu()
        never = state[~self.saved].view(torch.int32)
        assert bool((never == POISON_F32).all()), f"{what}: a state row / bank no step saved was written"
        assert bool((state[GUARD_UNUSED_SLOT].view(torch.int32) == POISON_F32).all()), (
            f"{what}: the unused slot's state was written"
        )
        if self.tiled:
            scratch = self._scratch().cpu()
            region = cache.backend.scratch_region
            for other in range(scratch.shape[0]):
                if other != region:
                    assert bool((scratch[other].view(torch.int32) == POISON_F32).all()), (
                        f"{what}: scratch region {other} (another micro-batch's) was written"
                    )
            mine = scratch[region].view(torch.int32)
            closes = torch.zeros(mine.shape[0], dtype=torch.bool)
            closes[: closing.shape[0]] = closing
            poisoned = mine == POISON_F32
            partly = (closes & poisoned.any(dim=1)).nonzero()[:, 0]
            assert len(partly) == 0, f"{what}: scratch rows {partly.tolist()} (closing a group) only partly written"
            stray = (~closes & ~poisoned.all(dim=1)).nonzero()[:, 0]
            assert len(stray) == 0, f"{what}: scratch rows {stray.tolist()} (closing no group) were written"
