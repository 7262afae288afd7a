"""The one helper stack of the test suite (CPU modules under the Triton interpreter, and the GPU modules).

Nothing here imports Triton at module level: ``tests/conftest.py`` decides whether kernels run under the
interpreter (``TRITON_INTERPRET``) before the first kernel module is imported; helpers that launch kernels
import them when called.

- small configurations, parameters and rows (``HCA_SMALL``, ``CSA_SMALL``, ``INDEXER_CFG``; :func:`random_rows`),
  :func:`make_cache` (on the kernels' device: the CPU under the interpreter, else the GPU);
- :class:`StreamModel`, a model of what a cache must hold after a sequence of steps (SPEC section 5): the
  current row of every position, the float64 values of every output slot ever written (also entries that
  discarded drafts emitted) and which ring rows are live;
- checks: :func:`check_all` (the invariant through the cache API), :func:`check_outputs` (every written slot is
  explained byte by byte by :mod:`dsv4_compressor.verify`, every other byte of the output areas still holds
  its poison), :func:`check_ring` (live ring rows equal ``[kv | score + ape]`` bit for bit);
- :func:`snapshot` / :func:`assert_unchanged`: everything observable about a cache, for refused steps;
- :func:`launch_step`: a step through the engine path (``pool.reserve``, per-row metadata with padding rows,
  ``backend.launch``), what CUDA graphs capture;
- guard bands (:func:`guard_cache`, :class:`GuardedRun`) and step schedules that cover prefill chunks
  straddling cached and new rows, chunks longer than the ring, MTP rewinds that discard emitted entries,
  mixed steps, pure rewinds and request slot reuse.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4_compressor import reference, verify
from dsv4_compressor.cache import CompressedKVCache
from dsv4_compressor.config import INDEXER, LATENT, CompressorConfig, CompressorParams
from dsv4_compressor.layout import decode_latent

# ----------------------------------------------------------------------------------------------
# Configurations and inputs
# ----------------------------------------------------------------------------------------------
HCA_SMALL = CompressorConfig(ratio=8, head_dim=128, rope_dim=64, overlap=False, name="hca_small")
CSA_SMALL = CompressorConfig(ratio=4, head_dim=128, rope_dim=64, overlap=True, name="csa_small")
INDEXER_CFG = CompressorConfig.indexer()  # the real one: r=4, H=128, FP8 pack on

#: The three small kinds every streaming test runs on.
SMALL_KINDS = {"hca_small": HCA_SMALL, "csa_small": CSA_SMALL, "indexer": INDEXER_CFG}

#: Every backend of the cache. A name whose module is missing or renamed makes its tests FAIL (no skipping).
STREAMING_BACKENDS = ["reference", "triton", "online"]

#: Byte the output areas (pool pages, indexer keys and FP8 pages) are filled with before a test.
POISON_BYTE = 0xA5
#: Byte of guard bands around output areas.
GUARD_BYTE = 0x5A
#: float32 poison of the ring, the online banks and the scratch: a quiet NaN with a payload; a kernel that reads
#: a row it should not turns its result into NaN, which no check explains.
POISON_F32 = 0x7FC0A5A5
#: float32 guard bands and padding rows of ``kv_score``: finite values near 1 (~1.29, ~0.85), so that a stray
#: read-modify-write (e.g. adding the APE bias) changes their bits; NaN would carry its payload through it.
GUARD_F32 = 0x3FA5A5A5
PAD_F32 = 0x3F5A5A5A


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter in this process (read as ``@triton.jit`` reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gpu_plan(cuda: bool, interpret: bool) -> str:
    """Whether this process runs the GPU modules (``tests/test_gpu.py``, ``tests/test_online_gpu.py``):
    ``"here"`` (CUDA and compiled kernels), ``"interpreted"`` (CUDA, but Triton runs under the interpreter in
    this process, as in the first pass of ``make test``: they skip, the session summary says so loudly, and
    ``make test`` runs them in its next pass, without the interpreter) or ``"none"`` (no CUDA: they skip)."""
    if not cuda:
        return "none"
    return "interpreted" if interpret else "here"


def gpu_session_note(counts: dict, plan: str):
    """What the session summary says about the GPU tests, from their outcome counts (``passed``, ``failed``,
    ``skipped``, ``error``) and :func:`gpu_plan`: ``(level, title, line)`` with level ``"ok"``, ``"note"`` or
    ``"alarm"`` (a CUDA device is here and no GPU test ran), or ``None`` when no GPU test was collected."""
    if not any(counts.values()):
        return None
    if plan == "none":
        return (
            "note",
            "GPU tests NOT run: no CUDA device",
            (f"{counts['skipped']} GPU tests (marker 'gpu') were skipped; scripts/gpu_check.sh runs them on a GPU"),
        )
    ran = counts["passed"] + counts["failed"] + counts["error"]
    if plan == "interpreted" or ran == 0:
        why = "this process interprets Triton (TRITON_INTERPRET is set)" if plan == "interpreted" else "see -rs"
        return (
            "alarm",
            "CUDA IS AVAILABLE BUT THE GPU TESTS DID NOT RUN IN THIS SESSION",
            (
                f"{counts['skipped']} GPU tests were skipped: {why}; run them with compiled kernels: "
                f"python -m pytest -m gpu tests (make test does, in its second pass)"
            ),
        )
    failed = counts["failed"] + counts["error"]
    return (
        ("alarm" if failed else "ok"),
        f"GPU tests ran with compiled kernels: {counts}",
        (f"{counts['passed']} passed, {failed} failed, {counts['skipped']} skipped"),
    )


def kernel_device() -> torch.device:
    """Where Triton kernels can run in this process: the CPU under the interpreter, else the GPU."""
    if interpreting() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def make_params(cfg: CompressorConfig, seed: int = 0, max_positions: int = 256, **kwargs) -> CompressorParams:
    """Random realistic parameters (ape ~ N(0, 0.5), norm weight ~ 1 + N(0, 0.1), DeepSeek YaRN tables);
    ``norm_dtype=torch.bfloat16`` for a bf16 norm weight, ``device=`` as ``CompressorParams.random``."""
    return CompressorParams.random(cfg, max_positions=max_positions, seed=seed, **kwargs)


def random_rows(n: int, cfg: CompressorConfig, gen: torch.Generator, device=None) -> torch.Tensor:
    """Fresh float32 ``[n, 2W]`` rows: values ~ N(0, 1), gate logits ~ N(0, 1.5^2) (peaked softmaxes)."""
    kv = torch.randn(n, cfg.width, generator=gen)
    score = 1.5 * torch.randn(n, cfg.width, generator=gen)
    rows = torch.cat([kv, score], dim=1).contiguous()
    return rows if device is None else rows.to(device)


def params_with(params: CompressorParams, **changes) -> CompressorParams:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    fields.update(changes)
    return CompressorParams(**fields)


def make_cache(
    cfg: CompressorConfig,
    params: CompressorParams,
    backend: str,
    *,
    max_requests: int = 4,
    max_seq_len: int = 64,
    mtp_step: int = 0,
    device=None,
    **kwargs,
) -> CompressedKVCache:
    """A cache on :func:`kernel_device` (unless ``device`` is given); ``kwargs`` go to the cache (``page_size``,
    ``max_pages``, ``check_finite``) and its backend (``c128_kernel``, ``workspace``, ``exact_fp8``, ...)."""
    return CompressedKVCache(
        cfg,
        params,
        max_requests=max_requests,
        max_seq_len=max_seq_len,
        mtp_step=mtp_step,
        backend=backend,
        device=kernel_device() if device is None else device,
        **kwargs,
    )


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
    return cache.pool.tensors()


def backend_state(cache) -> dict[str, torch.Tensor]:
    """The backend's per-request state (ring or online banks), by name."""
    pool = set(cache.pool.tensors())
    return {k: v for k, v in cache.state_tensors().items() if k not in pool}


def poison_cache(cache) -> None:
    """Poison every tensor the cache owns (never test on zeros): pool bytes ``0xA5``; the float32 state (ring,
    online banks) and the C128 scratch with NaN, so that a row read by mistake shows up."""
    for t in cache.state_tensors().values():
        if t.dtype == torch.float32:
            fill_bits(t, POISON_F32)
        else:
            t.view(torch.uint8).fill_(POISON_BYTE)
    ws = getattr(cache.backend, "workspace", None)
    if ws is not None:
        fill_bits(ws.buffer, POISON_F32)


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


# ----------------------------------------------------------------------------------------------
# The engine path: pages, per-row metadata with padding, backend.launch
# ----------------------------------------------------------------------------------------------
def step_meta(cache, items, *, pad_rows: int = 0, off_slot: int = -1, pad_slot: int = -1) -> np.ndarray:
    """Reserve the pages of ``items = [(rid, start, n)]`` and return int64 ``[3, T + pad_rows]``:
    ``positions, row_req, out_slot`` as an engine passes them to ``build_plan``. ``off_slot`` is written on rows
    that close no group (engines use 0 or -1); padding rows get ``row_req = pad_slot`` (-1, or the engines'
    ``num_slots``) and, adversarially, a closing position and output slot 0: they must still do nothing."""
    cfg, pool = cache.config, cache.pool
    r = cfg.ratio
    ids = np.array([i[0] for i in items], dtype=np.int64)
    starts = np.array([i[1] for i in items], dtype=np.int64)
    counts = np.array([i[2] for i in items], dtype=np.int64)
    pool.reserve(ids, (starts + counts) // r)
    total = int(counts.sum())
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)] + [np.zeros(0, np.int64)])
    row_req = np.repeat(ids, counts)
    closes = positions % r == r - 1
    out_slot = np.full(total, off_slot, dtype=np.int64)
    out_slot[closes] = pool.out_slots(row_req[closes], positions[closes] // r)
    pad = np.stack([np.full(pad_rows, r - 1), np.full(pad_rows, pad_slot), np.zeros(pad_rows)]).astype(np.int64)
    return np.concatenate([np.stack([positions, row_req, out_slot]), pad], axis=1)


def launch_step(cache, items, rows: torch.Tensor, *, pad_rows=0, pad_requests=0, decode=None, launch=None, **meta):
    """One step through the engine path: :func:`step_meta`, ``kv_score`` with ``pad_rows`` sentinel rows
    (``PAD_F32``), a plan for ``len(items) + pad_requests`` requests, then ``launch(kv, positions, row_req,
    out_slot, plan, decode=...)`` (default ``cache.backend.launch``). The cache's request table is not updated
    (as in an engine, which keeps its own). Returns ``(kv_score, host metadata)``."""
    cfg, dev = cache.config, cache.device
    host = step_meta(cache, items, pad_rows=pad_rows, **meta)
    total = rows.shape[0]
    assert total == sum(n for _, _, n in items)
    kv = fill_bits(torch.empty(total + pad_rows, cfg.row_width, device=dev), PAD_F32)
    kv[:total] = rows.to(dev)
    if decode is None:
        decode = all(n <= cache.mtp_step + 1 for _, _, n in items)
    positions, row_req, out_slot = torch.from_numpy(host).to(dev)
    plan = cache.backend.plan_buffer(total + pad_rows, len(items) + pad_requests)
    (launch or cache.backend.launch)(kv, positions, row_req, out_slot, plan, decode=decode)
    return kv, host


def online_launcher(cache, *, block_t=None, num_warps=None, channel_major=False, exact_fp8=None, split_tile=None):
    """A ``launch`` for :func:`launch_step` that runs the online HCA kernel with an explicit launch shape
    (``ops.compress_online_hca`` picks one itself): ``build_plan``, then ``launch_online_hca`` on the cache's
    banks and pages; in one launch, or with ``split_tile`` channels per program through the cache's scratch."""
    from dsv4_compressor import ops
    from dsv4_compressor.kernels import exact_fp8_default
    from dsv4_compressor.kernels.entry_pack import entry_args
    from dsv4_compressor.kernels.online_hca import launch_online_hca
    from dsv4_compressor.kernels.plan import PlanRef, closing_capacity
    from dsv4_compressor.kernels.ring import ApeRef, KvRef

    cfg, params, pool, banks = cache.config, cache.params, cache.pool, cache.backend.state
    assert not cfg.overlap

    def launch(kv, positions, row_req, out_slot, plan, *, decode):
        ops.build_plan(plan, positions, row_req, out_slot, ratio=cfg.ratio, num_slots=cache.max_requests)
        exact = exact_fp8_default(kv.device) if exact_fp8 is None else exact_fp8
        prm, out, meta = entry_args(
            head=cfg.head_dim, rope=cfg.rope_dim, latent=True, page_size=pool.page_size,
            scale_bytes=cfg.record_scale_bytes, norm_weight=params.norm_weight, cos=params.cos, sin=params.sin,
            eps=params.eps, out_pages=pool.pages, out_keys=None, exact_fp8=exact,
        )  # fmt: skip
        ape = ApeRef(params.ape, params.ape.stride(0), cfg.head_dim * params.ape.stride(1), params.ape.stride(1))
        rows, requests = kv.shape[0], plan.shape[0]
        split = {}
        if split_tile is not None:
            split = dict(scratch=cache.backend.workspace.c128_scratch(0, rows), split_tile=split_tile)
        launch_online_hca(
            KvRef(kv, kv.stride(0)), ape, PlanRef(plan, rows, requests), banks, prm, out, meta, ratio=cfg.ratio,
            closing=closing_capacity(rows, requests, cfg.ratio), decode=decode, block_t=block_t,
            num_warps=num_warps, channel_major=channel_major, **split,
        )  # fmt: skip

    return launch


def pack_args(pool, *, exact_fp8: bool = True):
    """``(EntryOut, EntryMeta)`` of a pool for ``kernels.entry_pack.pack_values`` (which reads no parameters)."""
    from dsv4_compressor.kernels.entry_pack import entry_args

    cfg = pool.config
    one = torch.ones(cfg.head_dim, dtype=torch.float32, device=pool.device)
    table = torch.ones(1, max(1, cfg.rope_dim // 2), dtype=torch.float32, device=pool.device)
    _, out, meta = entry_args(
        head=cfg.head_dim, rope=cfg.rope_dim, latent=cfg.output == LATENT, page_size=pool.page_size,
        scale_bytes=cfg.record_scale_bytes, norm_weight=one, cos=table, sin=table, eps=1e-6,
        out_pages=pool.out_pages, out_keys=pool.out_keys, exact_fp8=exact_fp8,
    )  # fmt: skip
    return out, meta


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


# ----------------------------------------------------------------------------------------------
# CompressorParams.validate
# ----------------------------------------------------------------------------------------------
def bad_params(cfg: CompressorConfig, p: CompressorParams):
    """``(name, invalid params, substrings the error must hold)`` for ``CompressorParams.validate``."""
    r, w, h = cfg.ratio, cfg.width, cfg.head_dim
    half = cfg.rope_dim // 2
    nan_ape = p.ape.clone()
    nan_ape[1, 5] = float("nan")
    inf_w = p.norm_weight.clone()
    inf_w[3] = float("inf")
    nan_cos = p.cos.clone()
    nan_cos[7, 1] = float("nan")
    yield "ape shape", params_with(p, ape=torch.randn(r, w + 1)), ["ape", f"[{r}, {w}]", f"[{r}, {w + 1}]"]
    yield "ape rows", params_with(p, ape=torch.randn(r + 1, w)), ["ape", f"[{r}, {w}]", f"[{r + 1}, {w}]"]
    yield "ape dtype", params_with(p, ape=p.ape.double()), ["ape", "float64"]
    yield "ape nan", params_with(p, ape=nan_ape), ["ape", "non-finite"]
    yield "norm shape", params_with(p, norm_weight=torch.ones(h - 2)), ["norm_weight", f"[{h}]", f"[{h - 2}]"]
    yield "norm dtype", params_with(p, norm_weight=p.norm_weight.half()), ["norm_weight", "float16"]
    yield "norm inf", params_with(p, norm_weight=inf_w), ["norm_weight", "non-finite"]
    yield "cos width", params_with(p, cos=p.cos[:, :-1].contiguous()), ["cos", str(half), str(half - 1)]
    yield "sin rows", params_with(p, sin=p.sin[:-3].contiguous()), ["sin", str(p.cos.shape[0] - 3)]
    yield "cos dtype", params_with(p, cos=p.cos.double()), ["cos", "float64"]
    yield "cos nan", params_with(p, cos=nan_cos), ["cos", "non-finite"]
    yield "ape not a tensor", params_with(p, ape=p.ape.numpy()), ["ape", "ndarray"]
    yield "norm on meta", params_with(p, norm_weight=torch.empty(h, device="meta")), ["norm_weight", "meta"]
    yield "eps zero", params_with(p, eps=0.0), ["eps", "0.0"]
    yield "eps too big", params_with(p, eps=1.5), ["eps", "1.5"]
    yield "tables shorter than a group", params_with(p, cos=p.cos[: r - 1], sin=p.sin[: r - 1]), [str(r - 1)]
