"""The Triton ring backend through the cache API (small shapes; the Triton interpreter on CPU).

Each schedule runs on a ``backend="triton"`` cache and a ``backend="reference"`` cache side by side, with the
pool poisoned (``0xA5``) and the ring poisoned (NaN) first. After every step:

- every output slot the step schedule wrote (also entries of drafts a later rewind discarded) is explained
  byte by byte against float64 values (:mod:`dsv4_compressor.verify`), every other pool byte is still poison;
- the live ring rows hold ``[kv | score + ape]`` of the current rows, bit for bit;

and at the end the two backends' rings are identical and each live request's entries satisfy the SPEC
section 5 invariant. Schedules cover prefill chunks that straddle cached and new rows, chunks longer than
the ring, MTP rewinds (also ones that discard an emitted entry), mixed steps, pure rewinds and slot reuse.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
from _kernel_helpers import (  # noqa: E402
    CSA_SMALL,
    HCA_SMALL,
    IDX,
    PAD_F32,
    POISON_F32,
    Tracker,
    assert_unchanged,
    build_desc,
    check_invariant,
    check_outputs,
    check_ring,
    compare_with_reference_backend,
    fill_bits,
    interpreting,
    kernel_device,
    make_cache,
    make_params,
    make_rows,
    max_positions_needed,
    poison_outputs,
    random_schedule,
    raw,
    run_schedule,
    schedule_coverage,
    snapshot,
    standard_schedule,
    step_items,
)

import dsv4_compressor as dc  # noqa: E402
from dsv4_compressor.config import CompressorConfig  # noqa: E402

DEV = kernel_device()

# (id, config, mtp_step, backend options)
VARIANTS = [
    ("hca_small-tiled", HCA_SMALL, 2, dict(c128_kernel="tiled")),
    ("hca_small-single-ape_add", HCA_SMALL, 2, dict(c128_kernel="single", fuse_ape=False)),
    ("hca_small-tiled-ape_add-mtp0", HCA_SMALL, 0, dict(c128_kernel="tiled", fuse_ape=False)),
    ("csa_small", CSA_SMALL, 2, {}),
    ("csa_small-ape_add-mtp3", CSA_SMALL, 3, dict(fuse_ape=False)),
    ("indexer", IDX, 2, {}),
]


def _pair(cfg, mtp, opts, *, max_requests=4, seq=None, seed=0):
    seq = seq or 256
    params = make_params(cfg, seed=seed, max_positions=max(seq, 64))
    tri = make_cache(cfg, params, "triton", max_requests=max_requests, max_seq_len=seq, mtp_step=mtp, **opts)
    ref = make_cache(cfg, params, "reference", max_requests=max_requests, max_seq_len=seq, mtp_step=mtp)
    poison_outputs(tri)
    poison_outputs(ref)
    return params, tri, ref


@pytest.mark.parametrize("vid,cfg,mtp,opts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_standard_schedule_matches_reference(vid, cfg, mtp, opts):
    r, ring = cfg.ratio, cfg.ring_rows(mtp)
    steps = standard_schedule(r, mtp, ring, decode_steps=3)
    cov = schedule_coverage(steps, r, mtp, ring)
    assert cov.straddle and cov.longer_than_ring and cov.mixed and cov.reuse and cov.all_close_decode, cov
    if mtp:
        assert cov.rewind_discards_entry and cov.pure_rewind, cov
    params, tri, ref = _pair(cfg, mtp, opts, seq=max_positions_needed(steps) + 1)
    tracker = Tracker(cfg, params, mtp)
    run_schedule([tri, ref], tracker, steps, torch.Generator().manual_seed(11), what=vid)
    inv = check_invariant(tri, tracker, vid)
    out = check_outputs(tri, tracker, vid)
    same = compare_with_reference_backend(tri, ref, vid)
    # both backends compute in float32 and encode exactly: only rounding-boundary bytes may differ
    assert same >= 0.999, f"{vid}: only {same:.4%} of pool bytes equal the reference backend's; {out}; {inv}"
    assert out.exact_fraction >= 0.995, str(out)


RANDOM = [
    ("hca_small-tiled", HCA_SMALL, dict(c128_kernel="tiled"), 1),
    ("csa_small-ape_add", CSA_SMALL, dict(fuse_ape=False), 2),
    ("indexer", IDX, {}, 3),
]


@pytest.mark.parametrize("vid,cfg,opts,seed", RANDOM, ids=[v[0] for v in RANDOM])
def test_random_schedule(vid, cfg, opts, seed):
    mtp = 2
    r, ring = cfg.ratio, cfg.ring_rows(mtp)
    steps = random_schedule(r, mtp, ring, seed=seed, num_steps=7, max_requests=3)
    params, tri, ref = _pair(cfg, mtp, opts, max_requests=3, seq=max_positions_needed(steps) + 1, seed=seed)
    tracker = Tracker(cfg, params, mtp)
    run_schedule([tri, ref], tracker, steps, torch.Generator().manual_seed(seed), check_every_step=False)
    check_invariant(tri, tracker, vid)
    compare_with_reference_backend(tri, ref, vid)


def test_real_hca_two_groups_with_rewind():
    """DeepSeek-V4's HCA (r=128, H=512, tiled kernel): a chunk straddling cached and new rows closes group 0,
    an MTP rewind discards it and closes it again with a new row."""
    cfg, mtp = CompressorConfig.hca(), 1
    steps = [[(0, 0, 120), (1, 0, 5)], [(0, 120, 8), (1, 5, 2)], [(0, 127, 2), (1, 6, 2)], [(0, 129, 2)]]
    params, tri, ref = _pair(cfg, mtp, dict(c128_kernel="tiled"), max_requests=2, seq=256)
    tracker = Tracker(cfg, params, mtp)
    run_schedule([tri, ref], tracker, steps, torch.Generator().manual_seed(5), what="hca")
    assert tracker.closed_log == [(0, 0), (0, 0)]
    check_invariant(tri, tracker, "hca")
    compare_with_reference_backend(tri, ref, "hca")


ODD_SHAPES = [
    (CompressorConfig(ratio=4, head_dim=128, rope_dim=0, overlap=True, name="no_rope"), {}),
    (CompressorConfig(ratio=8, head_dim=128, rope_dim=0, overlap=False, name="hca_no_rope"), {}),
    (CompressorConfig(ratio=8, head_dim=256, rope_dim=64, overlap=False, name="nope_3_blocks"), {}),
    (HCA_SMALL, dict(page_size=3)),  # a page size whose records do not fill the page (padding at its end)
    (CSA_SMALL, dict(page_size=5)),
    (
        CompressorConfig(
            ratio=4, head_dim=64, rope_dim=32, overlap=True, output="indexer", indexer_fp8=True, name="indexer_h64"
        ),
        {},
    ),  # fmt: skip
    (CompressorConfig.indexer(fp8=False), {}),
]


@pytest.mark.parametrize("cfg,opts", ODD_SHAPES, ids=[f"{c.name}-{o}" if o else c.name for c, o in ODD_SHAPES])
def test_other_shapes(cfg, opts):
    """Shapes the kernels are written for besides DeepSeek-V4's: no rope dims, a partly filled last FP8 block
    row, odd page sizes, a 64-dim indexer, an indexer without the FP8 pack."""
    mtp = 2
    params = make_params(cfg)
    cache = make_cache(cfg, params, "triton", max_requests=3, mtp_step=mtp, **opts)
    poison_outputs(cache)
    tracker = Tracker(cfg, params, mtp)
    gen = torch.Generator().manual_seed(12)
    r = cfg.ratio
    for items in ([(0, 0, 2 * r + 1), (1, 0, r + 2)], [(0, 2 * r + 1, 3), (1, r, 3)], [(0, 2 * r + 2, 3)]):
        step_items([cache], tracker, items, gen)
        check_outputs(cache, tracker, cfg.name)
        check_ring(cache, tracker, cfg.name)
    check_invariant(cache, tracker, cfg.name)


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL], ids=lambda c: c.name)
def test_steps_without_rows(cfg):
    """A step of zero rows (a pure MTP rewind of every request) launches nothing and changes no byte; the
    requests then continue from the rewound lengths."""
    mtp = 2
    params = make_params(cfg)
    cache = make_cache(cfg, params, "triton", max_requests=2, mtp_step=mtp)
    poison_outputs(cache)
    tracker = Tracker(cfg, params, mtp)
    gen = torch.Generator().manual_seed(14)
    r = cfg.ratio
    step_items([cache], tracker, [(0, 0, 2 * r), (1, 0, r + 1)], gen)  # request 0 just closed group 1
    before = snapshot(cache)
    step_items([cache], tracker, [(0, 2 * r - 2, 0), (1, r - 1, 0)], gen)  # discards both emitted entries
    assert cache.length(0) == 2 * r - 2 and cache.length(1) == r - 1
    for key in ("pages", "ring"):
        assert torch.equal(snapshot(cache)[key], before[key]), f"a zero-row step changed {key}"
    step_items([cache], tracker, [(0, 2 * r - 2, 3), (1, r - 1, 2)], gen)  # both groups closed again, new rows
    check_outputs(cache, tracker, cfg.name)
    check_invariant(cache, tracker, cfg.name)
    check_ring(cache, tracker, cfg.name)


def test_tiled_kernel_head_dim_not_multiple_of_64():
    """A non-overlapping config whose head_dim is not a multiple of 64 (valid: its nope dims are) gets the tiled
    C128 kernel by default, which cannot run it.

    The backend accepts it at construction, then every step raises ``ValueError`` from ``window_compress``
    in the middle of ``launch`` -- after ``ape_add`` (``fuse_ape=False``) has already modified ``kv_score``
    and after the cache allocated pages. Expected: refuse at construction, or run it (e.g. single-stage)."""
    cfg = CompressorConfig(ratio=8, head_dim=96, rope_dim=32, overlap=False, name="hca_h96")
    params = make_params(cfg)
    try:
        cache = make_cache(cfg, params, "triton", fuse_ape=False)
    except ValueError:
        return  # refused up front: fine
    poison_outputs(cache)
    tracker = Tracker(cfg, params, 2)
    step_items([cache], tracker, [(0, 0, 2 * cfg.ratio + 1)], torch.Generator().manual_seed(13))
    check_outputs(cache, tracker, cfg.name)


# ----------------------------------------------------------------------------------------------
# Padding rows, the decode flag, launch paths
# ----------------------------------------------------------------------------------------------
LOW_LEVEL = [
    ("hca_small-tiled", HCA_SMALL, dict(c128_kernel="tiled")),
    ("csa_small-ape_add", CSA_SMALL, dict(fuse_ape=False)),
    ("indexer", IDX, {}),
]


def _low_level_step(cache, items, rows, *, pad, decode, pad_requests=0):
    """Launch one step through ``backend.launch`` (the CUDA-graph path): pages first, a descriptor padded by
    ``pad`` rows (sentinel rows in ``kv_score``). Returns the padded ``kv_score`` after the launch."""
    cfg = cache.config
    for rid, start, n in items:
        cache.pool.ensure(rid, (start + n) // cfg.ratio)
    total = rows.shape[0]
    desc = build_desc(
        [i[0] for i in items],
        [i[1] for i in items],
        [i[2] for i in items],
        ratio=cfg.ratio,
        page_table=cache.pool.page_table,
        page_size=cache.page_size,
        device=cache.device,
        pad_to=total + pad,
        pad_requests_to=len(items) + pad_requests,
    )
    kv = fill_bits(torch.empty(total + pad, cfg.row_width, device=cache.device), PAD_F32)
    kv[:total] = rows.to(cache.device)
    cache.backend.launch(desc, kv, decode=decode)
    return kv


@pytest.mark.parametrize("vid,cfg,opts", LOW_LEVEL, ids=[v[0] for v in LOW_LEVEL])
def test_padding_rows_do_nothing(vid, cfg, opts):
    """A step padded with extra rows (``req_slot = out_slot = -1``, sentinel rows in ``kv_score``) gives the same
    pool and ring bytes as the unpadded step, in every kernel, and leaves the padding rows alone."""
    mtp = 2
    r = cfg.ratio
    params = make_params(cfg)
    a = make_cache(cfg, params, "triton", max_requests=3, mtp_step=mtp, **opts)
    b = make_cache(cfg, params, "triton", max_requests=3, mtp_step=mtp, **opts)
    for c in (a, b):
        poison_outputs(c)
    tracker = Tracker(cfg, params, mtp)
    gen = torch.Generator().manual_seed(3)
    step_items([a, b], tracker, [(0, 0, r + 3), (1, 0, 2 * r - 2)], gen)
    schedule = [
        ([(0, r + 3, r), (1, 2 * r - 2, 3), (2, 0, r + 1)], False),  # prefill / mixed: two launches
        ([(0, 2 * r + 3, 3), (1, 2 * r - 1, 3), (2, r + 1, 2)], True),  # decode with a rewind: in-kernel save
        ([(0, 2 * r + 4, 3), (2, r + 3, 3)], True),
    ]
    for items, decode in schedule:
        rows = make_rows(sum(n for _, _, n in items), cfg, gen)
        _low_level_step(a, items, rows, pad=0, decode=decode)
        kv = _low_level_step(b, items, rows, pad=5, decode=decode, pad_requests=2)
        pad_rows = kv[rows.shape[0] :].cpu()
        assert bool((pad_rows.view(torch.int32) == PAD_F32).all()), f"{vid}: a kernel wrote a padding row"
        row = 0
        for rid, start, n in items:
            tracker.apply(rid, start, rows[row : row + n], a.pool.page_table, a.page_size)
            row += n
        for name in ("ring",):
            assert torch.equal(raw(a.backend.ring.cpu()), raw(b.backend.ring.cpu())), f"{vid}: {name} differs"
        for name in ("pages", "keys", "fp8_pages"):
            x, y = getattr(a.pool, name), getattr(b.pool, name)
            if x is not None:
                assert torch.equal(raw(x.cpu()), raw(y.cpu())), f"{vid}: pool {name} differs with padding"
        check_outputs(a, tracker, vid)
        check_ring(a, tracker, vid)


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL, IDX], ids=lambda c: c.name)
def test_decode_flag_paths_agree(cfg):
    """On a decode step, the in-kernel ring save (``decode=True``) and the separate ``ring_save`` launch
    (``decode=False``) leave identical bytes."""
    mtp = 3
    r = cfg.ratio
    params = make_params(cfg)
    opts = dict(c128_kernel="single") if not cfg.overlap else {}
    caches = [make_cache(cfg, params, "triton", max_requests=3, mtp_step=mtp, **opts) for _ in range(2)]
    for c in caches:
        poison_outputs(c)
    gen = torch.Generator().manual_seed(4)
    tracker = Tracker(cfg, params, mtp)
    step_items(caches, tracker, [(0, 0, 2 * r - 2), (1, 0, r + 1), (2, 0, 1)], gen)
    for items in ([(0, 2 * r - 2, 4), (1, r + 1, 4), (2, 1, 2)], [(0, 2 * r - 1, 4), (1, r + 3, 4), (2, 3, 4)]):
        rows = make_rows(sum(n for _, _, n in items), cfg, gen)
        for cache, decode in zip(caches, (True, False)):
            _low_level_step(cache, items, rows, pad=1, decode=decode)
        row = 0
        for rid, start, n in items:
            tracker.apply(rid, start, rows[row : row + n], caches[0].pool.page_table, caches[0].page_size)
            row += n
        a, b = caches
        assert torch.equal(raw(a.backend.ring.cpu()), raw(b.backend.ring.cpu()))
        for name in ("pages", "keys", "fp8_pages"):
            if getattr(a.pool, name) is not None:
                assert torch.equal(raw(getattr(a.pool, name).cpu()), raw(getattr(b.pool, name).cpu())), name
        check_outputs(a, tracker)
        check_ring(a, tracker)


def test_backend_defaults_on_cpu():
    """Under the interpreter / on CPU the kernels encode FP8 exactly (the interpreter's cast mis-rounds)."""
    params = make_params(HCA_SMALL)
    cache = make_cache(HCA_SMALL, params, "triton")
    assert cache.backend.exact_fp8 is (interpreting() or DEV.type == "cpu")
    assert cache.backend.tiled and cache.backend.workspace is not None
    assert cache.backend.ring.shape == (4, HCA_SMALL.ring_rows(2), HCA_SMALL.row_width)
    csa = make_cache(CSA_SMALL, make_params(CSA_SMALL), "triton", c128_kernel="tiled")
    assert not csa.backend.tiled  # overlapping kinds always run single-stage
    with pytest.raises(ValueError, match="c128_kernel"):
        make_cache(HCA_SMALL, params, "triton", c128_kernel="fast")


def test_fuse_ape_false_adds_bias_in_place():
    """``fuse_ape=False`` adds the APE bias to the step's gate logits in place (documented); the default leaves
    ``kv_score`` untouched."""
    cfg = CSA_SMALL
    params = make_params(cfg)
    gen = torch.Generator().manual_seed(8)
    for fuse in (True, False):
        cache = make_cache(cfg, params, "triton", fuse_ape=fuse)
        rows = make_rows(7, cfg, gen).to(DEV)
        kv = rows.clone()
        cache.step([0], [0], [7], kv)
        want = rows.clone()
        if not fuse:
            want[:, cfg.width :] += params.ape.to(DEV)[torch.arange(7) % cfg.ratio]
        assert torch.equal(raw(kv.cpu()), raw(want.cpu())), f"fuse_ape={fuse}"


# ----------------------------------------------------------------------------------------------
# Capacity
# ----------------------------------------------------------------------------------------------
def _small_workspace(rows: int, head: int, regions: int = 1) -> dc.Workspace:
    plan = dc.C128ScratchPlan(regions=regions, rows_per_region=rows, head_dim=head)
    ws = dc.Workspace(plan, device=DEV)
    fill_bits(ws.buffer, POISON_F32)
    return ws


def _capacity_cache(rows=8):
    cfg, mtp = HCA_SMALL, 1
    params = make_params(cfg)
    ws = _small_workspace(rows, cfg.head_dim)
    cache = make_cache(cfg, params, "triton", max_requests=3, mtp_step=mtp, workspace=ws)
    poison_outputs(cache)
    tracker = Tracker(cfg, params, mtp)
    gen = torch.Generator().manual_seed(9)
    step_items([cache], tracker, [(0, 0, 5), (1, 0, 3)], gen)  # 8 rows: at capacity
    return cfg, cache, tracker, gen, ws


def test_capacity_refused_on_step_without_boundary():
    """SPEC section 7: the check runs from the step's row count before any launch, also when no row closes a
    group (a CUDA graph captured on such a step replays on steps where rows do)."""
    cfg, cache, tracker, gen, ws = _capacity_cache()
    before = snapshot(cache)
    scratch_before = raw(ws.buffer).clone()
    items = [(0, 5, 2), (1, 3, 4), (2, 0, 3)]  # 9 rows, positions 5-6, 3-6, 0-2: nothing closes (r = 8)
    assert not any(p % cfg.ratio == cfg.ratio - 1 for _, s, n in items for p in range(s, s + n))
    kv = make_rows(9, cfg, gen).to(DEV)
    with pytest.raises(dc.CapacityError) as err:
        cache.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], kv)
    msg = str(err.value)
    assert "region 0" in msg and "9 rows" in msg and "8" in msg, msg
    assert_unchanged(cache, before, "refused step")
    assert torch.equal(raw(ws.buffer), scratch_before), "the scratch was written by a refused step"
    assert not cache.is_live(2)
    # the cache still works: the same rows in two steps that fit
    step_items([cache], tracker, items[:2], gen)
    step_items([cache], tracker, items[2:], gen)
    check_outputs(cache, tracker, "after refusal")
    check_invariant(cache, tracker, "after refusal")


def test_capacity_refused_on_step_with_boundary():
    cfg, cache, tracker, gen, ws = _capacity_cache()
    before = snapshot(cache)
    items = [(0, 5, 6), (1, 3, 3)]  # 9 rows; position 7 of request 0 closes group 0
    kv = make_rows(9, cfg, gen).to(DEV)
    with pytest.raises(dc.CapacityError, match="region 0"):
        cache.step([0, 1], [5, 3], [6, 3], kv)
    before.pop("page_table")  # checked by the test below
    after = snapshot(cache)
    after.pop("page_table")
    assert after["live"] == before["live"]
    for key in ("pages", "ring"):
        assert torch.equal(after[key], before[key]), f"{key} changed by a refused step"
    step_items([cache], tracker, items[:1], gen)
    check_outputs(cache, tracker, "after refusal")


def test_capacity_refusal_leaves_page_table_unchanged():
    """A refused step must change nothing, page allocations included.

    ``CompressedKVCache.step`` allocates the pages of the entries a step will close (``pool.ensure``) before
    the backend's capacity check raises, so a refused step leaves pages allocated to its requests (here a
    page for request 0's group 0, which the step never wrote)."""
    cfg, cache, tracker, gen, ws = _capacity_cache()
    before = snapshot(cache)
    kv = make_rows(9, cfg, gen).to(DEV)
    with pytest.raises(dc.CapacityError):
        cache.step([0, 1], [5, 3], [6, 3], kv)
    assert_unchanged(cache, before, "refused step")


def test_capacity_refused_by_launch_and_region_checked():
    """``backend.launch`` (the CUDA-graph path) checks too, before launching; a region outside the plan is
    refused as well."""
    cfg, cache, tracker, gen, ws = _capacity_cache()
    before = snapshot(cache)
    desc = build_desc([0], [5], [9], ratio=cfg.ratio, page_table=None, page_size=cache.page_size, device=DEV)
    kv = make_rows(9, cfg, gen).to(DEV)
    kv_before = kv.clone()
    with pytest.raises(dc.CapacityError, match="9 rows"):
        cache.backend.launch(desc, kv, decode=True)
    desc8 = build_desc([0], [5], [8], ratio=cfg.ratio, page_table=None, page_size=cache.page_size, device=DEV)
    with pytest.raises(dc.CapacityError, match="region"):
        cache.backend.launch(desc8, kv[:8].contiguous(), decode=True, scratch_region=1)
    assert_unchanged(cache, before, "refused launch")
    assert torch.equal(raw(kv.cpu()), raw(kv_before.cpu()))


def test_default_workspace_plan_fits_batch_max_tokens():
    cfg = HCA_SMALL
    cache = make_cache(cfg, make_params(cfg), "triton", max_requests=4, mtp_step=3, batch_max_tokens=24)
    plan = cache.backend.workspace.plan
    assert plan.rows_per_region == 24 and plan.regions == 1 and plan.head_dim == cfg.head_dim
    gen = torch.Generator().manual_seed(10)
    step_items([cache], None, [(0, 0, 24)], gen)
    with pytest.raises(dc.CapacityError):
        step_items([cache], None, [(1, 0, 25)], gen)
