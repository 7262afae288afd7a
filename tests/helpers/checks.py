"""Assertions: :func:`check_all` (the invariant through the cache API), :func:`check_outputs` (every written
slot explained byte by byte by :mod:`dsv4_compressor.verify`, every other byte of the output areas still
holding its poison), :func:`check_ring` (live ring rows equal ``[kv | score + ape]`` bit for bit), and
:func:`snapshot` / :func:`assert_unchanged` (everything observable about a cache, for refused steps).
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_compressor import reference, verify
from dsv4_compressor.config import INDEXER
from dsv4_compressor.layout import decode_latent
from helpers.buffers import POISON_BYTE, output_tensors, raw
from helpers.model import StreamModel


def first_difference(a, b) -> str | None:
    """Where two caches' tensors (``state_tensors``) differ byte-wise (``None`` when identical)."""
    ta, tb = a.state_tensors(), b.state_tensors()
    assert ta.keys() == tb.keys(), (sorted(ta), sorted(tb))
    for name in ta:
        x, y = raw(ta[name]).cpu(), raw(tb[name]).cpu()
        diff = (x != y).nonzero()
        if len(diff):
            return f"{name}: {len(diff)} bytes differ, first at byte {diff[0, 0].item()}"
    return None


# ----------------------------------------------------------------------------------------------
# Snapshots: everything observable about a cache
# ----------------------------------------------------------------------------------------------
def snapshot(cache) -> dict:
    """Everything observable about a cache, for no-change checks: the raw bytes of every tensor it owns
    (``cache.state_tensors()``: ring or online banks, pages, keys, FP8 pages), the full page table, the pages
    each request slot holds, the free list (its order decides the next pages handed out), the request table
    (live requests, lengths, how far back their state reaches) and each live request's entries as read back."""
    pool = cache.pool
    snap = {("tensor", name): raw(t).cpu().clone() for name, t in cache.state_tensors().items()}
    snap["page_table"] = pool.page_table.copy()
    snap["held"] = pool.held.copy()
    snap["free"] = list(pool._free)
    snap["live"] = cache.live_requests()
    snap["length_table"] = cache._length.copy()
    snap["retained_table"] = cache._retained.copy()
    for rid in snap["live"]:
        snap[("len", rid)] = cache.length(rid)
        snap[("entries", rid)] = cache.entries(rid).cpu().clone()
        if cache.config.output != INDEXER or cache.config.indexer_fp8:
            snap[("packed", rid)] = cache.packed_entries(rid).cpu().clone()
        snap[("pages", rid)] = cache.page_table(rid).copy()
    return snap


def assert_unchanged(cache, before: dict, what: str = "") -> None:
    """Assert :func:`snapshot` of ``cache`` equals ``before`` in every part."""
    after = snapshot(cache)
    assert after.keys() == before.keys(), f"{what}: parts differ: {sorted(map(str, after.keys() ^ before.keys()))}"
    for key, value in before.items():
        got = after[key]
        if isinstance(value, torch.Tensor):
            assert got.shape == value.shape, f"{what}: {key} changed shape {list(value.shape)} -> {list(got.shape)}"
            diff = (raw(got) != raw(value)).nonzero()
            assert len(diff) == 0, f"{what}: {len(diff)} bytes of {key} changed, first at byte {diff[0, 0].item()}"
        elif isinstance(value, np.ndarray):
            changed = np.argwhere(got != value)
            assert got.shape == value.shape and len(changed) == 0, (
                f"{what}: {key} changed at {changed[:8].tolist()}: {value[tuple(changed.T)][:8].tolist()} -> "
                f"{got[tuple(changed.T)][:8].tolist()}"
            )
        else:
            assert got == value, f"{what}: {key} changed: {value} -> {got}"


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------
def check_cache_against_model(cache, model: StreamModel, rid: int) -> verify.Report:
    """Assert request ``rid``'s stored entries are the one-shot float64 entries of its current rows."""
    cfg = cache.config
    length = model.length(rid)
    assert cache.length(rid) == length, f"request {rid}: cache L={cache.length(rid)}, model L={length}"
    values64 = model.expected(rid)
    groups = length // cfg.ratio
    assert values64.shape == (groups, cfg.head_dim)
    entries = cache.entries(rid).cpu()
    assert entries.dtype == torch.float32
    assert entries.shape == (groups, cfg.head_dim), f"request {rid}: entries {list(entries.shape)}, L={length}"
    if cfg.output == INDEXER:
        rep = verify.check_indexer_keys(entries, values64)
        assert rep.ok, f"request {rid} (L={length}): {rep}"
        if cfg.indexer_fp8:
            packed = cache.packed_entries(rid).cpu()
            assert packed.dtype == torch.uint8 and packed.shape == (groups, cfg.indexer_fp8_bytes)
            rep8 = verify.check_indexer_fp8(packed, entries.to(torch.bfloat16))
            assert rep8.ok, f"request {rid} (L={length}): {rep8}"
            rep.merge(rep8)
        return rep
    packed = cache.packed_entries(rid).cpu()
    assert packed.dtype == torch.uint8 and packed.shape == (groups, cfg.entry_bytes)
    rep = verify.check_latent_records(packed, values64, cfg)
    assert rep.ok, f"request {rid} (L={length}): {rep}"
    assert torch.equal(entries, decode_latent(packed, cfg)), f"request {rid}: entries() != decode(packed)"
    return rep


def check_all(cache, model: StreamModel, what: str = "") -> verify.Report:
    """The SPEC section 5 invariant for every live request, and liveness as the model has it. Returns the merged
    report (``exact_fraction``: bytes equal to the encoding of the float64 reference)."""
    total = verify.Report(f"{what} {cache.config.name} invariant")
    for rid in model.live():
        total.merge(check_cache_against_model(cache, model, rid))
    for rid in range(cache.max_requests):
        assert cache.is_live(rid) == (rid in model.rows), f"{what}: request {rid}: liveness differs from the model"
    return total


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


def check_outputs(cache, model: StreamModel, what: str = "") -> verify.Report:
    """Every slot the model says was written is explained byte by byte; every other byte is still poison
    (the pool must have been poisoned first: :func:`poison_cache`). Returns the merged report."""
    cfg, pool = cache.config, cache.pool
    slots, values = model.written_values()
    idx = torch.tensor(slots, dtype=torch.long)
    if cfg.output == INDEXER:
        keys = pool.keys.cpu()
        rep = verify.check_indexer_keys(keys[idx].float(), values)
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


def check_ring(cache, model: StreamModel, what: str = "") -> None:
    """Live ring rows hold ``[kv | score + ape]`` of the current rows, bit for bit."""
    ring = cache.backend.ring
    for rid in model.live():
        pos = model.live_ring_positions(rid)
        if not pos:
            continue
        got = ring[rid, torch.tensor(pos) % ring.shape[1]].cpu()
        want = model.gated(rid, pos)
        bad = (raw(got).view(len(pos), -1) != raw(want).view(len(pos), -1)).any(dim=1).nonzero()
        assert len(bad) == 0, (
            f"{what}: request {rid}: ring rows of positions {[pos[i] for i in bad[:, 0].tolist()]} differ "
            f"from [kv | score + ape] of the current rows"
        )


def check_state(cache, model: StreamModel, what: str = "") -> None:
    """The backend state the next step may read: ring rows bit for bit (ring backends); for the online backend
    the bank of each live request's length, when mid-group: ``a / s`` is the pooled value of the partial group
    and ``m`` its exact per-channel maximum gate logit."""
    if hasattr(cache.backend, "ring"):
        check_ring(cache, model, what)
        return
    banks, cfg = cache.backend.state, cache.config
    for rid in model.live():
        ell = model.length(rid)
        g0 = ell // cfg.ratio * cfg.ratio
        if ell == g0:
            continue
        m, s, a = banks[rid, ell % banks.shape[1]].cpu().double()
        gated = model.gated(rid, list(range(g0, ell))).double()
        want = reference.pool_windows(gated[None, :, : cfg.width], gated[None, :, cfg.width :])[0]
        # float32 running sums over < r rows: within 1e-5 relative, 1e-6 absolute (pooled values are O(1))
        err = ((a / s - want).abs() - 1e-5 * want.abs()).max().item()
        assert err <= 1e-6, f"{what}: request {rid} (L={ell}): the bank's pooled value is off by {err:.3g}"
        assert torch.equal(m.float(), gated[:, cfg.width :].float().max(dim=0).values), (
            f"{what}: request {rid} (L={ell}): the bank's running max is not the largest gate logit"
        )


def compare_with_reference_backend(cache, ref, what: str = "") -> float:
    """Ring bytes identical (when both keep one); pool bytes: the fraction equal (the rest must lie in written
    records, which :func:`check_outputs` explains)."""
    if hasattr(cache.backend, "ring"):
        a, b = raw(cache.backend.ring).cpu(), raw(ref.backend.ring).cpu()
        diff = (a != b).nonzero()
        assert len(diff) == 0, f"{what}: ring differs from the reference backend's at {len(diff)} bytes"
    same = total = 0
    mine, theirs = output_tensors(cache), output_tensors(ref)
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        x, y = raw(t).cpu(), raw(theirs[name]).cpu()
        same += int((x == y).sum())
        total += x.numel()
    return same / max(total, 1)


def projected_rows(ws: torch.Tensor, rows: int, width: int, dim: int, *, online: bool, projection: str):
    """The ``[rows, 2W]`` float32 rows an op from hidden states projected into its workspace ``ws``, as its
    compression read them: ``kv_score`` where the op reduced, else its K split's partials added in split order
    (the online kernel's order). Which one the op did is ``ops.projection_choice``'s answer, the op's own."""
    from dsv4_compressor import ops

    choice = ops.projection_choice(rows, width, dim, projection=projection, online=online)
    if choice.reduce:
        return ws[: rows * width].view(rows, width)
    split = choice.cfg.split_k
    parts = ws[rows * width : rows * width * (1 + split)].view(split, rows, width)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total
