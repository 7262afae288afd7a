"""Shared helpers of the Triton ring-backend tests (CPU interpreter modules and the GPU module).

Nothing here imports Triton: a test module decides whether kernels run under the interpreter
(``TRITON_INTERPRET``) before the first kernel module is imported.

The pieces:

- small configurations, parameters and rows (``HCA_SMALL``, ``CSA_SMALL``, ``IDX``; :func:`make_rows`);
- :class:`Tracker`, a model of what a cache must hold after a sequence of steps (SPEC section 5): the current
  row of every position, the float64 values of every output slot ever written (also entries that discarded
  drafts emitted), and which ring rows are live;
- :func:`check_outputs`: every written slot is explained byte by byte by :mod:`dsv4_compressor.verify`, every
  other byte of the output areas still holds the poison it was filled with;
- :func:`check_ring`: live ring rows equal ``[kv | score + ape]`` of the current rows, bit for bit;
- :func:`guard_cache`: move the pool, the ring, the scratch workspace into larger poisoned buffers (guard
  bands) so that any out-of-bounds write is caught;
- step schedules that cover prefill chunks straddling cached and new rows, chunks longer than the ring,
  MTP rewinds that discard emitted entries, mixed steps, pure rewinds and request slot reuse.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# Configurations and inputs
# ----------------------------------------------------------------------------------------------
from _helpers import CSA_SMALL, HCA_SMALL  # noqa: E402  (the shared small configs)

import dsv4_compressor as dc
from dsv4_compressor import reference, verify
from dsv4_compressor.config import INDEXER, CompressorConfig, CompressorParams

IDX = CompressorConfig.indexer()  # r=4, H=128, FP8 pack on
SMALL_KINDS = {"hca_small": HCA_SMALL, "csa_small": CSA_SMALL, "indexer": IDX}

#: Byte the output areas (pool pages, indexer keys and FP8 pages) are filled with before a test.
POISON_BYTE = 0xA5
#: Byte of guard bands around output areas.
GUARD_BYTE = 0x5A
#: float32 poison of the ring and the scratch: a quiet NaN with a payload; a kernel that reads a row it should
#: not turns its result into NaN, which no check explains.
POISON_F32 = 0x7FC0A5A5
#: float32 guard bands and padding rows of ``kv_score``: finite values near 1 (~1.29, ~0.85), so that a stray
#: read-modify-write (e.g. adding the APE bias) changes their bits; NaN would carry its payload through it.
GUARD_F32 = 0x3FA5A5A5
PAD_F32 = 0x3F5A5A5A


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> torch.device:
    """Where Triton kernels can run in this process: CPU under the interpreter, else the GPU."""
    if interpreting() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def make_params(cfg: CompressorConfig, seed: int = 0, max_positions: int = 512, device="cpu") -> CompressorParams:
    return CompressorParams.random(cfg, max_positions=max_positions, seed=seed, device=device)


def make_rows(n: int, cfg: CompressorConfig, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Fresh float32 ``[n, 2W]`` rows: values ~ N(0, 1), gate logits ~ N(0, 1.5^2) (peaked softmaxes)."""
    kv = torch.randn(n, cfg.width, generator=gen)
    score = 1.5 * torch.randn(n, cfg.width, generator=gen)
    return torch.cat([kv, score], dim=1).contiguous().to(device)


def e4m3_probe_inputs() -> torch.Tensor:
    """float32 values in [-448, 448] that exercise every rounding case of float32 -> e4m3fn."""
    # every bfloat16 value in range (what the latent pack feeds the encoder)
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)
    bf = bits.view(torch.bfloat16).float()
    bf = bf[bf <= 448.0]
    # every e4m3fn value, the midpoints between neighbours (ties) and one float32 ulp either side
    q = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (q[1:] + q[:-1]) / 2
    up = torch.nextafter(mid, torch.full_like(mid, 1e9))
    down = torch.nextafter(mid, torch.zeros_like(mid))
    # just below and at powers of two (SPEC section 9: -31.46 came out as -16 in the interpreter)
    p2 = torch.tensor([2.0**k for k in range(-12, 9)])
    below = torch.nextafter(p2, torch.zeros_like(p2))
    special = torch.tensor([31.46, 31.999, 0.0, 1e-40, 2.0**-10, 3 * 2.0**-10, 448.0, 447.99, 464.0 - 1e-3])
    gen = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(40000, generator=gen) * 21 - 12).clamp(max=448.0)
    pos = torch.cat([bf, q, mid, up, down, p2, below, special, rand]).clamp(max=448.0)
    return torch.cat([pos, -pos]).float().contiguous()


def make_cache(cfg, params, backend="triton", *, max_requests=4, max_seq_len=256, mtp_step=2, device=None, **kw):
    device = kernel_device() if device is None else device
    return dc.CompressedKVCache(
        cfg,
        params,
        max_requests=max_requests,
        max_seq_len=max_seq_len,
        mtp_step=mtp_step,
        backend=backend,
        device=device,
        **kw,
    )


def build_desc(slots, starts, num_rows, *, pad_requests_to=None, **kw):
    """``dc.build_step_descriptor``, passing ``pad_requests_to`` (request capacity of a CUDA-graph descriptor)
    only to builders that take it."""
    if pad_requests_to is not None and "pad_requests_to" in inspect.signature(dc.build_step_descriptor).parameters:
        kw["pad_requests_to"] = pad_requests_to
    return dc.build_step_descriptor(slots, starts, num_rows, **kw)


# ----------------------------------------------------------------------------------------------
# Raw bytes, poison
# ----------------------------------------------------------------------------------------------
def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor (NaN-safe equality)."""
    return t.contiguous().view(-1).view(torch.uint8)


def fill_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """Fill a float32 tensor with a bit pattern (in place)."""
    assert t.dtype == torch.float32
    t.view(torch.int32).fill_(bits if bits < 2**31 else bits - 2**32)
    return t


def output_tensors(cache) -> dict[str, torch.Tensor]:
    """The pool's output areas by name (latent pages, or indexer keys and FP8 pages)."""
    pool = cache.pool
    out = {}
    for name in ("pages", "keys", "fp8_pages"):
        t = getattr(pool, name)
        if t is not None:
            out[name] = t
    return out


def poison_outputs(cache) -> None:
    """Fill the pool with ``POISON_BYTE`` and the ring with NaN poison (never test on zeros)."""
    for t in output_tensors(cache).values():
        t.view(torch.uint8).fill_(POISON_BYTE)
    fill_bits(cache.backend.ring, POISON_F32)


def snapshot(cache) -> dict:
    """Everything a refused step must leave unchanged."""
    snap = {name: raw(t).clone() for name, t in output_tensors(cache).items()}
    snap["ring"] = raw(cache.backend.ring).clone()
    snap["page_table"] = cache.pool.page_table.copy()
    snap["live"] = {rid: cache.length(rid) for rid in range(cache.max_requests) if cache.is_live(rid)}
    return snap


def assert_unchanged(cache, before: dict, what: str) -> None:
    after = snapshot(cache)
    assert after["live"] == before["live"], f"{what}: request lengths changed {before['live']} -> {after['live']}"
    changed = np.argwhere(after["page_table"] != before["page_table"])
    assert len(changed) == 0, (
        f"{what}: page table changed at (request, page) {changed.tolist()}: "
        f"{before['page_table'][tuple(changed.T)].tolist()} -> {after['page_table'][tuple(changed.T)].tolist()}"
    )
    for key in after:
        if isinstance(after[key], torch.Tensor):
            diff = (after[key] != before[key]).nonzero()
            assert len(diff) == 0, f"{what}: {len(diff)} bytes of {key} changed, first at byte {diff[0].item()}"


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
class Tracker:
    """What a cache must hold after a sequence of steps.

    ``rows[rid]``: float32 CPU rows of positions ``0..L-1`` (the most recently supplied row of each);
    ``written[slot]``: float64 values of the entry last written to global output slot ``slot`` (including
    entries emitted by drafts that a later step discarded: the kernels wrote those bytes too);
    ``retained[rid]``: the oldest position whose ring row is still valid (rows at or above it and within the
    last ``ring`` positions are live).
    """

    def __init__(self, cfg: CompressorConfig, params: CompressorParams, mtp_step: int):
        self.cfg = cfg
        self.params = params.to("cpu")
        self.ring = cfg.ring_rows(mtp_step)
        self.rows: dict[int, torch.Tensor] = {}
        self.retained: dict[int, int] = {}
        self.written: dict[int, torch.Tensor] = {}
        self.closed_log: list[tuple[int, int]] = []  # (rid, group) of every entry emitted, in order

    def length(self, rid: int) -> int:
        return self.rows[rid].shape[0] if rid in self.rows else 0

    def apply(self, rid: int, start: int, new_rows: torch.Tensor, page_table: np.ndarray, page_size: int) -> None:
        cfg, r = self.cfg, self.cfg.ratio
        new_rows = new_rows.detach().float().cpu()
        old = self.rows[rid][:start] if start > 0 else torch.zeros(0, cfg.row_width)
        assert old.shape[0] == start, f"model: request {rid} restarts at {start} but has {self.length(rid)} rows"
        rows = torch.cat([old, new_rows.clone()])
        self.rows[rid] = rows
        end = rows.shape[0]
        prev = 0 if start == 0 else self.retained[rid]
        self.retained[rid] = max(prev, end - self.ring)
        first = max(0, -(-(start - (r - 1)) // r))
        groups = list(range(first, end // r))
        if groups:
            values = reference.compress_sequence(rows[: end // r * r], self.params, cfg, dtype=torch.float64)
            for g in groups:
                page = int(page_table[rid, g // page_size])
                assert page >= 0, f"model: request {rid} group {g} has no page"
                self.written[page * page_size + g % page_size] = values[g].clone()
                self.closed_log.append((rid, g))

    def release(self, rid: int) -> None:
        del self.rows[rid]
        del self.retained[rid]

    def expected_entries(self, rid: int) -> torch.Tensor:
        """float64 ``[L // r, H]``: the one-shot entries over the current rows (the SPEC section 5 invariant)."""
        return reference.compress_sequence(self.rows[rid], self.params, self.cfg, dtype=torch.float64)

    def live_ring_positions(self, rid: int) -> list[int]:
        end = self.length(rid)
        return list(range(max(self.retained[rid], end - self.ring, 0), end))

    def gated(self, rid: int, positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long)
        return reference.gated_rows(self.rows[rid][pos], pos, self.params.ape, self.cfg.width)


def step_items(caches, tracker: Tracker | None, items, gen: torch.Generator, *, kv_transform=None):
    """Run one step ``items = [(rid, start, n), ...]`` with fresh rows on every cache (each gets its own copy of
    ``kv_score``: backends may write its gate-logit half) and on the model. Returns the CPU rows."""
    cfg = caches[0].config
    ids = [rid for rid, _, _ in items]
    starts = [s for _, s, _ in items]
    counts = [n for _, _, n in items]
    kv = make_rows(sum(counts), cfg, gen)
    for cache in caches:
        x = kv.to(cache.device).clone()
        if kv_transform is not None:
            x = kv_transform(x)
        cache.step(ids, starts, counts, x)
    if tracker is not None:
        row = 0
        for rid, start, n in items:
            tracker.apply(rid, start, kv[row : row + n], caches[0].pool.page_table, caches[0].page_size)
            row += n
    return kv


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------
def _record_byte_mask(layout, num_pages: int, slots: list[int]) -> torch.Tensor:
    """Bool mask over a flat page area: the bytes of the records of ``slots``."""
    mask = torch.zeros(num_pages * layout.bytes_per_page, dtype=torch.bool)
    p = layout.page_size
    for s in slots:
        base = (s // p) * layout.bytes_per_page
        d = base + layout.data_offset(s % p)
        c = base + layout.scale_offset(s % p)
        mask[d : d + layout.data_bytes] = True
        mask[c : c + layout.scale_bytes] = True
    return mask


def _poison_left(area: torch.Tensor, keep: torch.Tensor, name: str, what: str) -> None:
    bad = (area[~keep] != POISON_BYTE).nonzero()
    idx = (~keep).nonzero()[:, 0]
    assert len(bad) == 0, (
        f"{what}: {len(bad)} bytes of {name} outside every written record lost their poison "
        f"(first at byte {idx[bad[0, 0]].item()})"
    )


def check_outputs(cache, tracker: Tracker, what: str = "") -> verify.Report:
    """Every slot the model says was written is explained byte by byte; every other byte is still poison.

    Returns the merged report (``exact_fraction`` = bytes equal to the encoding of the float64 reference)."""
    cfg, pool = cache.config, cache.pool
    slots = sorted(tracker.written)
    values = torch.stack([tracker.written[s] for s in slots]) if slots else torch.zeros(0, cfg.head_dim)
    idx = torch.tensor(slots, dtype=torch.long)
    if cfg.output == INDEXER:
        keys = pool.keys.cpu()
        rep = verify.check_indexer_keys(keys[idx], values)
        assert rep.ok, f"{what}: {rep}"
        untouched = torch.ones(keys.shape[0], dtype=torch.bool)
        untouched[idx] = False
        bad = (raw(keys[untouched]) != POISON_BYTE).nonzero()
        assert len(bad) == 0, f"{what}: indexer key rows outside the written slots lost their poison"
        if pool.fp8_pages is not None:
            packs = pool.fp8_layout.read(pool.fp8_pages, idx.to(pool.device)).cpu()
            rep8 = verify.check_indexer_fp8(packs, keys[idx])
            assert rep8.ok, f"{what}: {rep8}"
            mask = _record_byte_mask(pool.fp8_layout, pool.num_pages, slots)
            _poison_left(raw(pool.fp8_pages.cpu()), mask, "fp8_pages", what)
            rep.merge(rep8)
        return rep
    records = pool.layout.read(pool.pages, idx.to(pool.device)).cpu()
    rep = verify.check_latent_records(records, values, cfg)
    assert rep.ok, f"{what}: {rep}"
    mask = _record_byte_mask(pool.layout, pool.num_pages, slots)
    _poison_left(raw(pool.pages.cpu()), mask, "pages", what)
    return rep


def check_invariant(cache, tracker: Tracker, what: str = "") -> verify.Report:
    """SPEC section 5: each live request's entries equal the one-shot entries of its current rows."""
    cfg = cache.config
    total = verify.Report(f"{cfg.name} invariant")
    for rid in sorted(tracker.rows):
        assert cache.length(rid) == tracker.length(rid), f"{what}: request {rid} length"
        want = tracker.expected_entries(rid)
        if cfg.output == INDEXER:
            rep = verify.check_indexer_keys(cache.entries(rid), want)
        else:
            rep = verify.check_latent_records(cache.packed_entries(rid), want, cfg)
        assert rep.ok, f"{what}: request {rid} (L={tracker.length(rid)}): {rep}"
        total.merge(rep)
    return total


def check_ring(cache, tracker: Tracker, what: str = "") -> None:
    """Live ring rows hold ``[kv | score + ape]`` of the current rows, bit for bit."""
    ring = cache.backend.ring
    for rid in sorted(tracker.rows):
        pos = tracker.live_ring_positions(rid)
        if not pos:
            continue
        got = ring[rid, torch.tensor(pos) % ring.shape[1]].cpu()
        want = tracker.gated(rid, pos)
        bad = (raw(got).view(len(pos), -1) != raw(want).view(len(pos), -1)).any(dim=1).nonzero()
        assert len(bad) == 0, (
            f"{what}: request {rid}: ring rows of positions {[pos[i] for i in bad[:, 0].tolist()]} differ "
            f"from [kv | score + ape] of the current rows"
        )


def compare_with_reference_backend(tri, ref, what: str = "") -> float:
    """Ring bytes identical; pool bytes: return the fraction equal (the rest must lie in written records,
    which :func:`check_outputs` explains)."""
    a, b = raw(tri.backend.ring).cpu(), raw(ref.backend.ring).cpu()
    diff = (a != b).nonzero()
    assert len(diff) == 0, f"{what}: ring differs from the reference backend's at {len(diff)} bytes"
    same = total = 0
    for name, t in output_tensors(tri).items():
        x, y = raw(t).cpu(), raw(getattr(ref.pool, name)).cpu()
        same += int((x == y).sum())
        total += x.numel()
    return same / max(total, 1)


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
        return torch.cat([raw(self.buffer[: self.lo]), raw(self.buffer[self.hi :])])

    def assert_intact(self, what: str = "") -> None:
        now = self._guard_bytes()
        bad = (now != self.guard).nonzero()
        assert len(bad) == 0, f"{what}: {len(bad)} guard-band bytes around {self.name} were overwritten"


def guarded_like(name: str, t: torch.Tensor, *, guard_elems: int, fill: int, guard: int) -> Guarded:
    """A poisoned copy-free replacement for ``t`` (same shape and dtype) inside guard bands.

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
    """Replace the cache's pool areas, ring and (tiled HCA) scratch workspace by poisoned views inside
    larger buffers whose surroundings are guard bands. The kernels read these attributes at launch time.

    Each band is one leading-dimension unit of its tensor (a page, a request's ring, a scratch region) plus
    ``guard_bytes``, so that an index of -1 (a padding row taken for a real one) lands in the band."""
    out = []
    pool, backend = cache.pool, cache.backend

    def elems(t):
        return t[0].numel() + guard_bytes // t.element_size()

    for name, t in output_tensors(cache).items():
        g = guarded_like(name, t, guard_elems=elems(t), fill=POISON_BYTE, guard=GUARD_BYTE)
        setattr(pool, name, g.view)
        out.append(g)
    g = guarded_like("ring", backend.ring, guard_elems=elems(backend.ring), fill=POISON_F32, guard=GUARD_F32)
    backend.ring = g.view
    out.append(g)
    ws = getattr(backend, "workspace", None)
    if ws is not None and getattr(backend, "tiled", False):
        g = guarded_like("scratch", ws.buffer, guard_elems=elems(ws.buffer), fill=POISON_F32, guard=GUARD_F32)
        ws.buffer = g.view
        out.append(g)
    return out


GUARD_UNUSED_SLOT = 4


class GuardedRun:
    """A triton cache whose pool, ring and scratch sit inside guard bands (:func:`guard_cache`), stepped with
    ``kv_score`` inside a guard band too, and checked after every step (see ``tests/test_guard_bands.py``).

    ``region``: run on that region of a two-region workspace (``None``: the backend's default)."""

    def __init__(self, cfg, opts, region, *, mtp=2, batch_max_tokens=64, max_positions=512, device=None):
        self.cfg, self.mtp, self.region = cfg, mtp, region
        self.device = dev = kernel_device() if device is None else torch.device(device)
        self.params = make_params(cfg, max_positions=max_positions)
        if region is not None:  # two micro-batch regions; this cache uses `region`
            plan = dc.plan_c128_scratch(
                batch_max_tokens=batch_max_tokens, max_req_num=GUARD_UNUSED_SLOT + 1, mtp_step=mtp,
                decode_overlap=True, dp=2, head_dim=cfg.head_dim,
            )  # fmt: skip
            assert plan.regions == 2
            opts = dict(opts, workspace=dc.Workspace(plan, device=dev), scratch_region=region)
        self.cache = make_cache(
            cfg, self.params, "triton", max_requests=GUARD_UNUSED_SLOT + 1, max_seq_len=max_positions, mtp_step=mtp,
            device=dev, **opts,
        )  # fmt: skip
        self.guards = guard_cache(self.cache)
        self.tracker = Tracker(cfg, self.params, mtp)
        self.saved = torch.zeros(self.cache.backend.ring.shape[:2], dtype=torch.bool)  # ring rows ever saved
        self.gen = torch.Generator().manual_seed(21)
        self.fuse_ape = self.cache.backend.fuse_ape

    @property
    def tiled(self) -> bool:
        return self.cache.backend.tiled

    def _scratch(self):
        return self.cache.backend.workspace.buffer

    def run(self, items, *, pad: int = 0, low_level: bool = False, what: str = ""):
        cfg, cache, dev = self.cfg, self.cache, self.device
        if self.tiled:
            fill_bits(self._scratch(), POISON_F32)
        total = sum(n for _, _, n in items)
        rows = make_rows(total, cfg, self.gen)
        kv = guarded_like("kv_score", torch.empty(total + pad, cfg.row_width, device=dev),
                          guard_elems=2 * cfg.row_width, fill=PAD_F32, guard=GUARD_F32)  # fmt: skip
        kv.view[:total] = rows.to(dev)
        if low_level:  # the CUDA-graph path: pages, a padded descriptor, backend.launch
            for rid, start, n in items:
                cache.pool.ensure(rid, (start + n) // cfg.ratio)
            desc = build_desc(
                [i[0] for i in items], [i[1] for i in items], [i[2] for i in items], ratio=cfg.ratio,
                page_table=cache.pool.page_table, page_size=cache.page_size, device=dev, pad_to=total + pad,
                pad_requests_to=len(items) + 1,
            )  # fmt: skip
            cache.backend.launch(desc, kv.view, decode=all(n <= self.mtp + 1 for _, _, n in items))
        else:
            assert pad == 0
            desc = cache.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], kv.view)
        row = 0
        for rid, start, n in items:
            self.tracker.apply(rid, start, rows[row : row + n], cache.pool.page_table, cache.page_size)
            ring = self.saved.shape[1]
            self.saved[rid, torch.arange(max(start, start + n - ring), start + n) % ring] = True
            row += n
        self.check(desc, kv, rows, what)

    def run_standard(self, decode_steps: int = 2, what: str = "") -> None:
        """The standard schedule step by step, then a padded decode launch through the CUDA-graph path
        (``backend.launch``) that closes a group in every live request."""
        r, mtp = self.cfg.ratio, self.mtp
        steps = standard_schedule(r, mtp, self.cfg.ring_rows(mtp), decode_steps=decode_steps)
        for i, step in enumerate(steps):
            if isinstance(step, tuple):
                self.cache.release(step[1])
                self.tracker.release(step[1])
                continue
            self.run(step, what=f"{what} step {i} {step}")
        lengths = {rid: self.tracker.length(rid) for rid in self.tracker.rows}
        items = [(rid, n, (n // r + 1) * r - n) for rid, n in sorted(lengths.items())]
        self.run(items, pad=3, low_level=True, what=f"{what} padded launch {items}")
        assert len(self.tracker.written) > 0

    def check(self, desc, kv, rows, what):
        cfg, cache = self.cfg, self.cache
        for g in self.guards + [kv]:
            g.assert_intact(what)
        # kv_score: untouched, or only the APE bias added to the gate logits of the valid rows
        got = kv.view.cpu()
        want = torch.empty_like(got)
        fill_bits(want, PAD_F32)
        want[: rows.shape[0]] = rows
        if not self.fuse_ape:
            pos = desc.positions[: rows.shape[0]].long().cpu()
            want[: rows.shape[0], cfg.width :] += self.params.ape[pos % cfg.ratio]
        assert torch.equal(raw(got), raw(want)), f"{what}: kv_score changed unexpectedly"
        check_outputs(cache, self.tracker, what)
        check_ring(cache, self.tracker, what)
        ring = cache.backend.ring.cpu()
        never = ring[~self.saved].view(torch.int32)
        assert bool((never == POISON_F32).all()), f"{what}: a ring row no step saved was written"
        assert bool((ring[GUARD_UNUSED_SLOT].view(torch.int32) == POISON_F32).all()), (
            f"{what}: unused slot's ring written"
        )
        if self.tiled:
            scratch = self._scratch().cpu()
            region = self.cache.backend.scratch_region
            for other in range(scratch.shape[0]):
                if other != region:
                    assert bool((scratch[other].view(torch.int32) == POISON_F32).all()), (
                        f"{what}: scratch region {other} (another micro-batch's) was written"
                    )
            mine = scratch[region].view(torch.int32)
            closing = torch.zeros(mine.shape[0], dtype=torch.bool)
            out_slot = desc.out_slot.cpu()
            closing[: out_slot.shape[0]] = out_slot >= 0
            poisoned = mine == POISON_F32
            partly = (closing & poisoned.any(dim=1)).nonzero()[:, 0]
            assert len(partly) == 0, f"{what}: scratch rows {partly.tolist()} (closing a group) only partly written"
            stray = (~closing & ~poisoned.all(dim=1)).nonzero()[:, 0]
            assert len(stray) == 0, f"{what}: scratch rows {stray.tolist()} (closing no group) were written"


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
        if step == "release":
            continue
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
    step([(1, 0, r + 1), (0, L[0], s)])  # slot 1 reused: its ring still holds the old request's rows
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


def run_schedule(caches, tracker: Tracker, steps, gen: torch.Generator, *, check_every_step=True, what=""):
    """Run a schedule on caches (all must end in the same state) and the model, checking as it goes."""
    for i, step in enumerate(steps):
        if isinstance(step, tuple):
            for cache in caches:
                cache.release(step[1])
            tracker.release(step[1])
            continue
        step_items(caches, tracker, step, gen)
        if check_every_step or i == len(steps) - 1:
            for cache in caches:
                label = f"{what} step {i} {step} [{cache.backend_name}]"
                check_outputs(cache, tracker, label)
                check_ring(cache, tracker, label)
    return tracker
