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

import numpy as np
import pytest
import torch
from helpers.buffers import PAD_F32, POISON_F32, fill_bits, launch_step, poison_cache, raw
from helpers.checks import (
    assert_unchanged,
    check_all,
    check_outputs,
    check_ring,
    compare_with_reference_backend,
    first_difference,
    snapshot,
)
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_cache, make_params, random_rows
from helpers.model import StreamModel, run_step, split_rows
from helpers.schedules import max_positions_needed, random_schedule, run_schedule, schedule_coverage, standard_schedule
from helpers.session import kernel_device

import dsv4_compressor as dc
from dsv4_compressor.config import CompressorConfig

DEV = kernel_device()
BF16_NORM = dict(norm_dtype=torch.bfloat16)

# (id, config, mtp_step, backend options, parameter options)
VARIANTS = [
    ("hca_small-tiled", HCA_SMALL, 2, dict(c128_kernel="tiled"), {}),
    ("hca_small-single-bf16_norm", HCA_SMALL, 2, dict(c128_kernel="single"), BF16_NORM),
    ("hca_small-tiled-mtp0", HCA_SMALL, 0, dict(c128_kernel="tiled"), {}),
    ("csa_small", CSA_SMALL, 2, {}, {}),
    ("csa_small-bf16_norm-mtp3", CSA_SMALL, 3, {}, BF16_NORM),
    ("indexer", INDEXER_CFG, 2, {}, {}),
]


def _pair(cfg, mtp, opts, *, max_requests=4, seq=None, seed=0, params_opts=None):
    seq = seq or 256
    params = make_params(cfg, seed=seed, max_positions=max(seq, 64), **(params_opts or {}))
    tri = make_cache(cfg, params, "triton", max_requests=max_requests, max_seq_len=seq, mtp_step=mtp, **opts)
    ref = make_cache(cfg, params, "reference", max_requests=max_requests, max_seq_len=seq, mtp_step=mtp)
    poison_cache(tri)
    poison_cache(ref)
    return params, tri, ref


@pytest.mark.parametrize("vid,cfg,mtp,opts,popts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_standard_schedule_matches_reference(vid, cfg, mtp, opts, popts):
    r, ring = cfg.ratio, cfg.ring_rows(mtp)
    steps = standard_schedule(r, mtp, ring, decode_steps=3)
    cov = schedule_coverage(steps, r, mtp, ring)
    assert cov.straddle and cov.longer_than_ring and cov.mixed and cov.reuse and cov.all_close_decode, cov
    if mtp:
        assert cov.rewind_discards_entry and cov.pure_rewind, cov
    params, tri, ref = _pair(cfg, mtp, opts, seq=max_positions_needed(steps) + 1, params_opts=popts)
    assert params.norm_weight.dtype == popts.get("norm_dtype", torch.float32)
    model = StreamModel(cfg, params, mtp)
    run_schedule([tri, ref], model, steps, torch.Generator().manual_seed(11), what=vid)
    inv = check_all(tri, model, vid)
    out = check_outputs(tri, model, vid)
    same = compare_with_reference_backend(tri, ref, vid)
    # both backends compute in float32 and encode exactly: only rounding-boundary bytes may differ
    assert same >= 0.999, f"{vid}: only {same:.4%} of pool bytes equal the reference backend's; {out}; {inv}"
    assert out.exact_fraction >= 0.995, str(out)


RANDOM = [
    ("hca_small-tiled", HCA_SMALL, dict(c128_kernel="tiled"), 1, {}),
    ("csa_small-bf16_norm", CSA_SMALL, {}, 2, BF16_NORM),
    ("indexer", INDEXER_CFG, {}, 3, {}),
]


@pytest.mark.parametrize("vid,cfg,opts,seed,popts", RANDOM, ids=[v[0] for v in RANDOM])
def test_random_schedule(vid, cfg, opts, seed, popts):
    mtp = 2
    r, ring = cfg.ratio, cfg.ring_rows(mtp)
    steps = random_schedule(r, mtp, ring, seed=seed, num_steps=7, max_requests=3)
    seq = max_positions_needed(steps) + 1
    params, tri, ref = _pair(cfg, mtp, opts, max_requests=3, seq=seq, seed=seed, params_opts=popts)
    model = StreamModel(cfg, params, mtp)
    run_schedule([tri, ref], model, steps, torch.Generator().manual_seed(seed), check_every_step=False)
    inv = check_all(tri, model, vid)
    out = check_outputs(tri, model, vid)
    same = compare_with_reference_backend(tri, ref, vid)
    assert same >= 0.999, f"{vid}: only {same:.4%} of pool bytes equal the reference backend's; {out}; {inv}"
    assert out.total_bytes > 0 and out.exact_fraction >= 0.995, str(out)


def test_real_hca_two_groups_with_rewind():
    """DeepSeek-V4's HCA (r=128, H=512, tiled kernel): a chunk straddling cached and new rows closes group 0,
    an MTP rewind discards it and closes it again with a new row."""
    cfg, mtp = CompressorConfig.hca(), 1
    steps = [[(0, 0, 120), (1, 0, 5)], [(0, 120, 8), (1, 5, 2)], [(0, 127, 2), (1, 6, 2)], [(0, 129, 2)]]
    params, tri, ref = _pair(cfg, mtp, dict(c128_kernel="tiled"), max_requests=2, seq=256)
    model = StreamModel(cfg, params, mtp)
    run_schedule([tri, ref], model, steps, torch.Generator().manual_seed(5), what="hca")
    assert model.closed_log == [(0, 0), (0, 0)]
    check_all(tri, model, "hca")
    same = compare_with_reference_backend(tri, ref, "hca")
    assert same >= 0.999, f"only {same:.4%} of pool bytes equal the reference backend's"


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
    params = make_params(cfg, max_positions=256)
    cache = make_cache(cfg, params, "triton", max_requests=3, max_seq_len=256, mtp_step=mtp, **opts)
    poison_cache(cache)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(12)
    r = cfg.ratio
    for items in ([(0, 0, 2 * r + 1), (1, 0, r + 2)], [(0, 2 * r + 1, 3), (1, r, 3)], [(0, 2 * r + 2, 3)]):
        run_step(cache, model, items, gen)
        check_outputs(cache, model, cfg.name)
        check_ring(cache, model, cfg.name)
    check_all(cache, model, cfg.name)


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL], ids=lambda c: c.name)
def test_steps_without_rows(cfg):
    """A step of zero rows (a pure MTP rewind of every request) launches nothing and changes no byte; the
    requests then continue from the rewound lengths."""
    mtp = 2
    params = make_params(cfg)
    cache = make_cache(cfg, params, "triton", max_requests=2, mtp_step=mtp)
    poison_cache(cache)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(14)
    r = cfg.ratio
    run_step(cache, model, [(0, 0, 2 * r), (1, 0, r + 1)], gen)  # request 0 just closed group 1
    before = snapshot(cache)
    run_step(cache, model, [(0, 2 * r - 2, 0), (1, r - 1, 0)], gen)  # discards both emitted entries
    assert cache.length(0) == 2 * r - 2 and cache.length(1) == r - 1
    after = snapshot(cache)
    tensors = [key for key in before if key[0] == "tensor"]
    assert {name for _, name in tensors} == {"ring", *cache.pool.tensors()}
    for key in tensors:  # every byte as it was: no launch
        assert torch.equal(after[key], before[key]), f"a zero-row step changed {key}"
    for key in ("page_table", "held", "free"):  # the pages stay with their requests
        assert np.array_equal(after[key], before[key]), f"a zero-row step changed {key}"
    run_step(cache, model, [(0, 2 * r - 2, 3), (1, r - 1, 2)], gen)  # both groups closed again, new rows
    check_outputs(cache, model, cfg.name)
    check_all(cache, model, cfg.name)
    check_ring(cache, model, cfg.name)


def test_head_dim_not_multiple_of_64_runs_single_stage():
    """A non-overlapping config whose head_dim is not a multiple of 64 (valid: its nope dims are) cannot run the
    tiled C128 kernel (64-channel tiles); asked for it, the backend runs the single-stage kernel, and its entries
    are exact (formerly the step failed mid-launch, after pages were allocated)."""
    cfg = CompressorConfig(ratio=8, head_dim=96, rope_dim=32, overlap=False, name="hca_h96")
    params = make_params(cfg)
    cache = make_cache(cfg, params, "triton", mtp_step=2, c128_kernel="tiled")
    assert not cache.backend.tiled and cache.backend.c128_kernel == "single" and cache.backend.workspace is None
    poison_cache(cache)
    model = StreamModel(cfg, params, 2)
    gen = torch.Generator().manual_seed(13)
    run_step(cache, model, [(0, 0, 2 * cfg.ratio + 1), (1, 0, 5)], gen)
    run_step(cache, model, [(0, 2 * cfg.ratio - 1, 3), (1, 5, 3)], gen)
    out = check_outputs(cache, model, cfg.name)
    check_all(cache, model, cfg.name)
    check_ring(cache, model, cfg.name)
    assert out.total_bytes > 0 and out.exact_fraction >= 0.995, str(out)


# ----------------------------------------------------------------------------------------------
# Padding rows, the decode flag, launch paths
# ----------------------------------------------------------------------------------------------
LOW_LEVEL = [
    ("hca_small-tiled", HCA_SMALL, dict(c128_kernel="tiled"), {}),
    ("csa_small-bf16_norm", CSA_SMALL, {}, BF16_NORM),
    ("indexer", INDEXER_CFG, {}, {}),
]


@pytest.mark.parametrize("vid,cfg,opts,popts", LOW_LEVEL, ids=[v[0] for v in LOW_LEVEL])
def test_padding_rows_do_nothing(vid, cfg, opts, popts):
    """A step padded with extra rows (``row_req`` = -1 or the engines' ``num_slots``, each at a closing position
    with output slot 0, sentinel rows in ``kv_score``) and extra plan request records gives the same bytes as the
    unpadded step, in every kernel, and leaves the padding rows alone; so does ``cache.graph`` (on the CPU it
    runs its static, padded launch eagerly). Rows off a group boundary carry the engines' 0 or -1 out_slot."""
    mtp = 2
    r = cfg.ratio
    params = make_params(cfg, **popts)
    caches = [make_cache(cfg, params, "triton", max_requests=3, max_seq_len=128, mtp_step=mtp, **opts)
              for _ in range(4)]  # fmt: skip
    plain, padded, engine, graphed = caches
    for c in caches:
        poison_cache(c)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(3)
    run_step(caches, model, [(0, 0, r + 3), (1, 0, 2 * r - 2)], gen)
    graph = graphed.graph(max_requests=3, rows_per_request=r + 1)
    schedule = [
        [(0, r + 3, r), (1, 2 * r - 2, 3), (2, 0, r + 1)],  # prefill / mixed: a separate ring save
        [(0, 2 * r + 3, 3), (1, 2 * r - 1, 3), (2, r + 1, 2)],  # decode with a rewind: in-kernel save
        [(0, 2 * r + 4, 3), (2, r + 3, 3)],
    ]
    for items in schedule:
        rows = random_rows(sum(n for _, _, n in items), cfg, gen)
        launch_step(plain, items, rows)
        kv, _ = launch_step(padded, items, rows, pad_rows=5, pad_requests=2)
        kv_engine, _ = launch_step(engine, items, rows, pad_rows=4, pad_requests=1, off_slot=0, pad_slot=3)
        graph.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], rows.to(DEV))
        for pad in (kv[rows.shape[0] :], kv_engine[rows.shape[0] :]):
            assert bool((pad.cpu().view(torch.int32) == PAD_F32).all()), f"{vid}: a kernel wrote a padding row"
        for rid, start, part in split_rows(items, rows):
            model.apply(rid, start, part, plain.pool)
        for other, what in ((padded, "padding rows"), (engine, "engine padding"), (graphed, "cache.graph")):
            assert np.array_equal(other.pool.page_table, plain.pool.page_table), what
            diff = first_difference(plain, other)
            assert diff is None, f"{vid}: {what} changed the result: {diff}"
        check_outputs(plain, model, vid)
        check_ring(plain, model, vid)
    check_all(graphed, model, vid)


@pytest.mark.parametrize("cfg", [HCA_SMALL, CSA_SMALL, INDEXER_CFG], ids=lambda c: c.name)
def test_decode_flag_paths_agree(cfg):
    """On a decode step, the in-kernel ring save (``decode=True``) and the separate ring-save launch
    (``decode=False``) leave identical bytes, and both are right."""
    mtp = 3
    r = cfg.ratio
    params = make_params(cfg)
    opts = dict(c128_kernel="single") if not cfg.overlap else {}
    caches = [make_cache(cfg, params, "triton", max_requests=3, mtp_step=mtp, **opts) for _ in range(2)]
    for c in caches:
        poison_cache(c)
        assert c.backend.launches_per_step(True) == 2 and c.backend.launches_per_step(False) == 3
    gen = torch.Generator().manual_seed(4)
    model = StreamModel(cfg, params, mtp)
    run_step(caches, model, [(0, 0, 2 * r - 2), (1, 0, r + 1), (2, 0, 1)], gen)
    for items in ([(0, 2 * r - 2, 4), (1, r + 1, 4), (2, 1, 2)], [(0, 2 * r - 1, 4), (1, r + 3, 4), (2, 3, 4)]):
        rows = random_rows(sum(n for _, _, n in items), cfg, gen)
        for cache, decode in zip(caches, (True, False)):
            launch_step(cache, items, rows, pad_rows=1, decode=decode)
        for rid, start, part in split_rows(items, rows):
            model.apply(rid, start, part, caches[0].pool)
        assert first_difference(*caches) is None, first_difference(*caches)
        for cache in caches:
            check_outputs(cache, model)
            check_ring(cache, model)


def test_backend_defaults_on_cpu():
    """Under the interpreter / on CPU the kernels encode FP8 exactly (the interpreter's cast mis-rounds): the
    default (``exact_fp8=None``, resolved per launch) stores the bytes ``exact_fp8=True`` stores."""
    from dsv4_compressor.kernels import exact_fp8_default

    params = make_params(HCA_SMALL)
    cache = make_cache(HCA_SMALL, params, "triton", mtp_step=2)
    assert cache.backend.exact_fp8 is None and exact_fp8_default(DEV) is True
    assert cache.backend.tiled and cache.backend.c128_kernel == "tiled" and cache.backend.workspace is not None
    assert cache.backend.launches_per_step(False) == 3 and cache.backend.launches_per_step(False, requests=300) == 3
    assert cache.backend.launches_per_step(True) == 2 and cache.backend.launches_per_step(True, requests=300) == 3
    assert cache.backend.ring.shape == (4, HCA_SMALL.ring_rows(2), HCA_SMALL.row_width)
    assert set(cache.state_tensors()) == {"ring", "pages"}
    exact = make_cache(HCA_SMALL, params, "triton", mtp_step=2, exact_fp8=True)
    for c in (cache, exact):
        poison_cache(c)
    model = StreamModel(HCA_SMALL, params, 2)
    run_step([cache, exact], model, [(0, 0, 19), (1, 0, 9)], torch.Generator().manual_seed(1))
    assert first_difference(cache, exact) is None
    check_outputs(cache, model)
    csa = make_cache(CSA_SMALL, make_params(CSA_SMALL), "triton", c128_kernel="tiled")
    assert not csa.backend.tiled and csa.backend.c128_kernel == "single"  # overlapping kinds: single-stage
    with pytest.raises(ValueError, match=r"c128_kernel must be 'tiled' or 'single', got 'fast'"):
        make_cache(HCA_SMALL, params, "triton", c128_kernel="fast")
    with pytest.raises(ValueError, match=r"backend 'triton' takes no option\(s\) \['fuse_ape'\]"):
        make_cache(HCA_SMALL, params, "triton", fuse_ape=False)  # removed: APE is always fused on load


@pytest.mark.parametrize("backend", ["triton", "online", "reference"])
@pytest.mark.parametrize("kind", ["hca_small", "csa_small", "indexer"])
def test_kv_score_is_never_written(backend, kind):
    """``kv_score`` is read only: the APE bias is added on load, no backend uses the rows as scratch."""
    cfg = {"hca_small": HCA_SMALL, "csa_small": CSA_SMALL, "indexer": INDEXER_CFG}[kind]
    params = make_params(cfg)
    cache = make_cache(cfg, params, backend, mtp_step=1)
    gen = torch.Generator().manual_seed(8)
    r = cfg.ratio
    for ids, starts, counts in (([0, 1], [0, 0], [2 * r + 3, 5]), ([0, 1], [2 * r + 2, 5], [2, 2 * r])):
        kv = random_rows(sum(counts), cfg, gen, DEV)
        kept = kv.clone()
        cache.step(ids, starts, counts, kv)
        assert torch.equal(raw(kv), raw(kept)), f"{backend} wrote kv_score"


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
    poison_cache(cache)
    model = StreamModel(cfg, params, mtp)
    gen = torch.Generator().manual_seed(9)
    run_step(cache, model, [(0, 0, 5), (1, 0, 3)], gen)  # 8 rows: at capacity
    return cfg, cache, model, gen, ws


def test_capacity_refused_on_step_without_boundary():
    """SPEC section 7: the check runs from the step's row count before any launch, also when no row closes a
    group (a CUDA graph captured on such a step replays on steps where rows do)."""
    cfg, cache, model, gen, ws = _capacity_cache()
    before = snapshot(cache)
    scratch_before = raw(ws.buffer).clone()
    items = [(0, 5, 2), (1, 3, 4), (2, 0, 3)]  # 9 rows, positions 5-6, 3-6, 0-2: nothing closes (r = 8)
    assert not any(p % cfg.ratio == cfg.ratio - 1 for _, s, n in items for p in range(s, s + n))
    kv = random_rows(9, cfg, gen, DEV)
    with pytest.raises(dc.CapacityError, match=r"region 0 asked for 9 rows but holds 8"):
        cache.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], kv)
    assert_unchanged(cache, before, "refused step")
    assert torch.equal(raw(ws.buffer), scratch_before), "the scratch was written by a refused step"
    assert not cache.is_live(2)
    # the cache still works: the same rows in two steps that fit
    run_step(cache, model, items[:2], gen)
    run_step(cache, model, items[2:], gen)
    check_outputs(cache, model, "after refusal")
    check_all(cache, model, "after refusal")


def test_capacity_refused_on_step_with_boundary():
    """A refused step that would close a group changes nothing either: no byte, no page allocation (the step
    would have needed a page for request 0's group 0)."""
    cfg, cache, model, gen, ws = _capacity_cache()
    before = snapshot(cache)
    scratch_before = raw(ws.buffer).clone()
    items = [(0, 5, 6), (1, 3, 3)]  # 9 rows; position 7 of request 0 closes group 0
    kv = random_rows(9, cfg, gen, DEV)
    with pytest.raises(dc.CapacityError, match=r"region 0 asked for 9 rows but holds 8"):
        cache.step([0, 1], [5, 3], [6, 3], kv)
    assert_unchanged(cache, before, "refused step")
    assert torch.equal(raw(ws.buffer), scratch_before), "the scratch was written by a refused step"
    run_step(cache, model, items[:1], gen)
    check_outputs(cache, model, "after refusal")
    check_all(cache, model, "after refusal")


def test_capacity_refused_by_launch_and_region_checked():
    """``backend.launch`` (the CUDA-graph path) checks too, before the compress launch; a region outside the
    plan is refused as well, and so is ``cache.graph`` for more rows than the scratch holds."""
    cfg, cache, model, gen, ws = _capacity_cache()
    before = snapshot(cache)
    scratch_before = raw(ws.buffer).clone()
    kv = random_rows(9, cfg, gen, DEV)
    kv_before = kv.clone()
    meta = torch.tensor([list(range(5, 14)), [0] * 9, [-1] * 9], device=DEV)
    with pytest.raises(dc.CapacityError, match=r"region 0 asked for 9 rows but holds 8"):
        cache.backend.launch(kv, *meta, cache.backend.plan_buffer(9, 1), decode=True)
    with pytest.raises(dc.CapacityError, match=r"region 1 does not exist \(the plan has 1\)"):
        cache.backend.launch(kv[:8], *meta[:, :8], cache.backend.plan_buffer(8, 1), decode=True, scratch_region=1)
    with pytest.raises(dc.CapacityError, match=r"region 0 asked for 9 rows but holds 8"):
        cache.graph(max_requests=3, rows_per_request=3)
    assert_unchanged(cache, before, "refused launch")
    assert torch.equal(raw(ws.buffer), scratch_before), "the scratch was written by a refused launch"
    assert torch.equal(raw(kv.cpu()), raw(kv_before.cpu()))


def test_default_workspace_plan_fits_batch_max_tokens():
    cfg = HCA_SMALL
    cache = make_cache(cfg, make_params(cfg), "triton", max_requests=4, mtp_step=3, batch_max_tokens=24)
    plan = cache.backend.workspace.plan
    assert plan.rows_per_region == 24 and plan.regions == 1 and plan.head_dim == cfg.head_dim
    gen = torch.Generator().manual_seed(10)
    run_step(cache, None, [(0, 0, 24)], gen)
    before = snapshot(cache)
    with pytest.raises(dc.CapacityError, match=r"region 0 asked for 25 rows but holds 24"):
        run_step(cache, None, [(1, 0, 25)], gen)
    assert_unchanged(cache, before, "refused step")


def test_scratch_region_of_the_backend_is_used():
    """Two micro-batches share a two-region workspace, each cache on its own region: a step of the region-1
    cache must write region 1 only (region 0 belongs to the other micro-batch, possibly running concurrently)."""
    cfg = HCA_SMALL
    plan = dc.plan_c128_scratch(batch_max_tokens=16, max_req_num=2, mtp_step=1, decode_overlap=True, dp=2,
                                head_dim=cfg.head_dim)  # fmt: skip
    assert plan.regions == 2
    ws = dc.Workspace(plan, device=DEV)
    params = make_params(cfg)
    cache = make_cache(cfg, params, "triton", max_requests=2, mtp_step=1, workspace=ws, scratch_region=1)
    poison_cache(cache)
    assert cache.backend.scratch_region == 1
    model = StreamModel(cfg, params, 1)
    run_step(cache, model, [(0, 0, 2 * cfg.ratio)], torch.Generator().manual_seed(2))
    check_all(cache, model)
    scratch = ws.buffer.cpu().view(torch.int32)
    assert bool((scratch[1] != POISON_F32).any()), "region 1 was not used"
    assert bool((scratch[0] == POISON_F32).all()), "region 0 (another micro-batch's) was written"
