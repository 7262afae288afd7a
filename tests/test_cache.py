"""The cache's guarantees: every invalid step, read or construction is refused with a clear error
(``StepError`` for steps and reads, ``TypeError`` / ``ValueError`` naming the argument at construction) and
leaves the cache exactly as it was; a step that fails inside the backend is rolled back; pages come from a
budget in O(new pages) host work; the CUDA-graph API (``cache.graph``) validates and replays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.checks import assert_unchanged, check_all, snapshot
from helpers.inputs import SMALL_KINDS, bad_params, make_cache, make_params, random_rows
from helpers.model import StreamModel, run_step

from dsv4_compressor.cache import CompressedKVCache
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.errors import CapacityError, StepError

MAX_SEQ = 48
MTP = 2


def _live_cache(backend: str, kind: str):
    """A cache with request 0 at L0 = 2r + 3 and request 1 at L1 = r + 1; ids 2 and 3 are free."""
    cfg = SMALL_KINDS[kind]
    params = make_params(cfg, seed=21, max_positions=MAX_SEQ)
    cache = make_cache(cfg, params, backend, max_requests=4, max_seq_len=MAX_SEQ, mtp_step=MTP)
    model = StreamModel(cfg, params)
    gen = torch.Generator().manual_seed(33)
    r = cfg.ratio
    run_step(cache, model, [(0, 0, random_rows(2 * r + 3, cfg, gen)), (1, 0, random_rows(r + 1, cfg, gen))])
    check_all(cache, model)
    return cfg, cache, model, gen


def _bad_steps(cfg: CompressorConfig, l0: int, l1: int, gen: torch.Generator):
    """``(name, (ids, starts, counts, kv_score), substrings the message must hold)``."""
    w2 = cfg.row_width

    def rows(n):
        return random_rows(n, cfg, gen)

    def poisoned(n, row, value):
        x = rows(n)
        x[row, (7 * row) % w2] = value
        return x

    noncontig = torch.randn(w2, 3, generator=gen).t()
    assert noncontig.shape == (3, w2) and not noncontig.is_contiguous()
    yield "id too large", ([4], [0], [2], rows(2)), ["4", "[0, 4)"]
    yield "id far too large", ([0, 1000], [l0, 0], [1, 1], rows(2)), ["1000", "[0, 4)"]
    yield "id negative", ([-1], [0], [1], rows(1)), ["-1", "[0, 4)"]
    yield "id bool", ([True], [0], [1], rows(1)), ["True"]
    yield "id float", ([1.0], [l1], [1], rows(1)), ["1.0"]
    yield "id float tensor", (torch.tensor([1.0]), [l1], [1], rows(1)), ["request_ids"]
    yield "ids 2-D tensor", (torch.tensor([[1]]), [l1], [1], rows(1)), ["request_ids"]
    yield "start float", ([1], [float(l1)], [1], rows(1)), ["starts", str(float(l1))]
    yield "num_rows bool", ([1], [l1], [True], rows(1)), ["num_rows", "True"]
    yield "not live, start > 0", ([2], [3], [1], rows(1)), ["request 2", "start=3"]
    yield "not live among live", ([0, 3], [l0, 1], [1, 1], rows(2)), ["request 3", "start=1"]
    yield "id twice", ([0, 1, 0], [l0, l1, l0], [1, 1, 1], rows(3)), ["request 0", "twice"]
    low0 = l0 - MTP
    yield (
        "start below L - mtp",
        ([0], [low0 - 1], [4], rows(4)),
        [
            "request 0",
            f"L={l0}",
            f"start={low0 - 1}",
            f"[{low0}, {l0}]",
        ],
    )
    yield "start beyond L", ([1, 0], [l1, l0 + 1], [1, 1], rows(2)), ["request 0", f"start={l0 + 1}", f"[{low0}, {l0}]"]
    yield "rows mismatch (fewer)", ([0, 1], [l0, l1], [2, 3], rows(4)), ["5", "4"]
    yield "rows mismatch (more)", ([0], [l0], [2], rows(3)), ["2", "3"]
    yield "rows for an empty step", ([], [], [], rows(1)), ["0", "1"]
    yield "wrong width", ([0], [l0], [2], torch.randn(2, w2 - 1, generator=gen)), [str(w2), str(w2 - 1)]
    yield "wrong width (W)", ([0], [l0], [2], torch.randn(2, w2 // 2, generator=gen)), [str(w2), str(w2 // 2)]
    yield "1-D rows", ([0], [l0], [1], torch.randn(w2, generator=gen)), [str(w2)]
    for dtype in (torch.float16, torch.float64, torch.bfloat16):
        yield f"dtype {dtype}", ([0], [l0], [2], rows(2).to(dtype)), ["float32", str(dtype)]
    yield "not a tensor", ([0], [l0], [2], rows(2).numpy()), ["Tensor", "ndarray"]
    yield "meta device", ([0], [l0], [2], torch.empty(2, w2, device="meta")), ["meta", "cpu"]
    yield "non-contiguous", ([1], [l1], [3], noncontig), ["contiguous"]
    yield "nan in request 1", ([0, 1], [l0, l1], [2, 3], poisoned(5, 3, float("nan"))), ["request 1", "row 3"]
    yield "inf in request 0", ([1, 0], [l1, l0], [2, 3], poisoned(5, 4, float("inf"))), ["request 0", "row 4"]
    yield "-inf in a new request", ([2, 1], [0, l1], [2, 1], poisoned(3, 0, float("-inf"))), ["request 2", "row 0"]
    over = MAX_SEQ - l0 + 1
    yield (
        "beyond max_seq_len",
        ([1, 0], [l1, l0], [1, over], rows(over + 1)),
        [
            "request 0",
            str(MAX_SEQ),
            f"up to {MAX_SEQ}",
        ],
    )
    yield (
        "new request beyond max_seq_len",
        ([3], [0], [MAX_SEQ + 2], rows(MAX_SEQ + 2)),
        [
            "request 3",
            f"up to {MAX_SEQ + 1}",
        ],
    )
    yield "lengths differ (starts)", ([0, 1], [l0], [1, 1], rows(2)), ["(2, 1, 2)"]
    yield "lengths differ (num_rows)", ([0, 1], [l0, l1], [1], rows(1)), ["(2, 2, 1)"]
    yield "negative num_rows", ([1, 0], [l1, l0], [2, -1], rows(1)), ["request 0", "num_rows=-1"]


@pytest.mark.parametrize("kind", ["hca_small", "csa_small"])
def test_bad_steps_raise_and_change_nothing(backend, kind):
    cfg, cache, model, gen = _live_cache(backend, kind)
    l0, l1 = cache.length(0), cache.length(1)
    for name, (ids, starts, counts, kv_score), needles in _bad_steps(cfg, l0, l1, gen):
        before = snapshot(cache)
        with pytest.raises(ValueError) as info:
            cache.step(ids, starts, counts, kv_score)
        assert isinstance(info.value, StepError), name
        message = str(info.value)
        for needle in needles:
            assert needle in message, f"{name}: {needle!r} not in {message!r}"
        assert_unchanged(cache, before)
    # the cache still works and is still right: continue both requests and begin a third
    r = cfg.ratio
    run_step(
        cache,
        model,
        [
            (1, l1, random_rows(r + 2, cfg, gen)),
            (2, 0, random_rows(r, cfg, gen)),
            (0, l0 - MTP, random_rows(3, cfg, gen)),
        ],
    )
    check_all(cache, model)


@pytest.mark.parametrize("kind", ["hca_small", "csa_small"])
def test_bad_reads_raise_and_change_nothing(backend, kind):
    cfg, cache, model, gen = _live_cache(backend, kind)
    reads = {
        "entries": cache.entries,
        "packed_entries": cache.packed_entries,
        "length": cache.length,
        "release": cache.release,
        "page_table": cache.page_table,
    }
    for what, read in reads.items():
        for rid, needles in (
            (2, ["request 2", "not live"]),
            (3, ["request 3", "not live"]),
            (4, ["4", "[0, 4)"]),
            (-2, ["-2", "[0, 4)"]),
            (True, ["True"]),
            (0.0, ["0.0"]),
            (np.float32(1.0), ["1.0"]),
        ):
            before = snapshot(cache)
            with pytest.raises(StepError) as info:
                read(rid)
            message = str(info.value)
            assert what in message, message
            for needle in needles:
                assert needle in message, f"{what}({rid!r}): {needle!r} not in {message!r}"
            assert_unchanged(cache, before)
    # reads accept numpy and 0-d tensor ids of live requests
    assert cache.length(np.int64(0)) == cache.length(torch.tensor(0)) == model.length(0)
    # a released request is no longer readable, the other one is untouched
    cache.release(1)
    model.release(1)
    with pytest.raises(StepError, match="request 1 is not live"):
        cache.entries(1)
    with pytest.raises(StepError, match="request 1 is not live"):
        cache.release(1)
    check_all(cache, model)


def test_packed_entries_without_indexer_fp8(backend):
    cfg = dataclasses.replace(SMALL_KINDS["indexer"], indexer_fp8=False, name="indexer_bf16")
    params = make_params(cfg, seed=3, max_positions=MAX_SEQ)
    cache = make_cache(cfg, params, backend, max_seq_len=MAX_SEQ)
    model = StreamModel(cfg, params)
    gen = torch.Generator().manual_seed(1)
    run_step(cache, model, [(0, 0, random_rows(9, cfg, gen))])
    check_all(cache, model)
    with pytest.raises(StepError, match="indexer_fp8"):
        cache.packed_entries(0)


def test_check_finite_off_skips_the_scan():
    """``check_finite=False`` trusts the rows (no host sync): a NaN row is accepted, and lands only in the
    entries whose windows hold it."""
    cfg = SMALL_KINDS["csa_small"]
    params = make_params(cfg, seed=4, max_positions=MAX_SEQ)
    cache = make_cache(cfg, params, "reference", max_seq_len=MAX_SEQ, check_finite=False)
    gen = torch.Generator().manual_seed(2)
    rows = random_rows(16, cfg, gen)
    rows[13, cfg.head_dim] = float("nan")  # position 13's current-group half: only group 3 reads it
    cache.step([0], [0], [16], rows)
    entries = cache.entries(0)
    assert bool(torch.isfinite(entries[:3]).all())
    assert not bool(torch.isfinite(entries[3]).all())


# ----------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------
def test_constructor_validation(backend):
    cfg = SMALL_KINDS["csa_small"]
    params = make_params(cfg, seed=9, max_positions=40)
    for name, bad, needles in bad_params(cfg, params):
        if name in ("norm on meta", "ape not a tensor"):
            continue  # the cache moves params to its device before validating them
        with pytest.raises(ValueError) as info:
            make_cache(cfg, bad, backend, max_seq_len=32)
        for needle in needles:
            assert needle in str(info.value), f"{name}: {needle!r} not in {info.value}"
    cases = [
        (dict(max_seq_len=41), ValueError, ["max_seq_len=41", "40"]),
        (dict(max_seq_len=0), ValueError, ["max_seq_len", "0"]),
        (dict(max_requests=0), ValueError, ["max_requests", "0"]),
        (dict(max_requests=2.0), TypeError, ["max_requests", "2.0"]),
        (dict(max_requests=True), TypeError, ["max_requests", "True"]),
        (dict(mtp_step=-1), ValueError, ["mtp_step", "-1"]),
        (dict(mtp_step=17), ValueError, ["mtp_step", "17"]),
        (dict(mtp_step=False), TypeError, ["mtp_step", "False"]),
        (dict(page_size=0), ValueError, ["page_size", "0"]),
        (dict(page_size=2.7), TypeError, ["page_size", "2.7"]),
        (dict(page_size="4"), TypeError, ["page_size", "'4'"]),
        (dict(page_size=True), TypeError, ["page_size", "True"]),
        (dict(max_pages=0), ValueError, ["max_pages", "0"]),
        (dict(check_finite="yes"), TypeError, ["check_finite", "'yes'"]),
        (dict(device="cuda:0") if not torch.cuda.is_available() else dict(device="cuda:99"), ValueError, ["cuda"]),
        (dict(device="tpu"), ValueError, ["tpu"]),
        (dict(bogus_option=1), ValueError, ["bogus_option", repr(backend)]),
    ]
    for kwargs, error, needles in cases:
        args = dict(max_requests=2, max_seq_len=32, mtp_step=1, backend=backend, device="cpu")
        args.update(kwargs)
        with pytest.raises(error) as info:
            CompressedKVCache(cfg, params, **args)
        assert type(info.value) is error, f"{kwargs}: {type(info.value).__name__}: {info.value}"
        for needle in needles:
            assert needle in str(info.value), f"{kwargs}: {needle!r} not in {info.value}"
    # numpy integers are integers
    cache = CompressedKVCache(cfg, params, max_requests=np.int64(2), max_seq_len=np.int32(32), backend=backend,
                              page_size=np.int64(4))  # fmt: skip
    assert cache.max_requests == 2 and cache.page_size == 4
    # the limits themselves are fine
    cache = CompressedKVCache(cfg, params, max_requests=1, max_seq_len=40, mtp_step=3, backend=backend)
    assert cache.max_seq_len == 40


def test_constructor_rejects_unknown_backend_and_config():
    cfg = SMALL_KINDS["csa_small"]
    params = make_params(cfg, seed=9, max_positions=40)
    with pytest.raises(ValueError, match="'cuda_magic'"):
        CompressedKVCache(cfg, params, max_requests=1, max_seq_len=8, backend="cuda_magic")
    with pytest.raises(TypeError):
        CompressedKVCache("csa", params, max_requests=1, max_seq_len=8)
    # params for another kind do not fit
    with pytest.raises(ValueError, match="ape"):
        CompressedKVCache(SMALL_KINDS["hca_small"], params, max_requests=1, max_seq_len=8)


def test_kernel_backend_on_cpu_needs_the_interpreter(monkeypatch):
    cfg = SMALL_KINDS["csa_small"]
    params = make_params(cfg, seed=9, max_positions=40)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for backend in ("triton", "online"):
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            CompressedKVCache(cfg, params, max_requests=1, max_seq_len=8, backend=backend)
    CompressedKVCache(cfg, params, max_requests=1, max_seq_len=8, backend="reference")  # needs no kernels


def test_backend_options_checked_at_construction():
    cfg = SMALL_KINDS["hca_small"]
    params = make_params(cfg, seed=9, max_positions=64)
    with pytest.raises(CapacityError, match="region 3"):
        CompressedKVCache(cfg, params, max_requests=1, max_seq_len=64, backend="triton", scratch_region=3)
    with pytest.raises(ValueError, match="c128_kernel"):
        CompressedKVCache(cfg, params, max_requests=1, max_seq_len=64, backend="triton", c128_kernel="fast")
    for backend in ("reference", "triton", "online"):
        with pytest.raises(ValueError, match="no option"):
            CompressedKVCache(cfg, params, max_requests=1, max_seq_len=64, backend=backend, fuse_ape=False)


def test_capacity_error_is_a_step_error():
    assert issubclass(CapacityError, StepError) and issubclass(CapacityError, ValueError)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_page_budget_refuses_and_recovers(backend_name):
    """``max_pages`` bounds the pool: a step needing more pages than are free is refused (naming the request
    and the pages), nothing changes, and released pages serve the next step."""
    cfg = SMALL_KINDS["csa_small"]  # r = 4, P = 64 by default: use P = 2 so pages run out quickly
    params = make_params(cfg, seed=2, max_positions=64)
    cache = make_cache(cfg, params, backend_name, max_requests=3, max_seq_len=64, page_size=2, max_pages=4)
    model = StreamModel(cfg, params)
    gen = torch.Generator().manual_seed(5)
    run_step(cache, model, [(0, 0, random_rows(12, cfg, gen))])  # 3 entries: 2 pages
    before = snapshot(cache)
    with pytest.raises(CapacityError) as info:
        cache.step([1, 2], [0, 0], [12, 9], random_rows(21, cfg, gen))  # 2 + 1 pages, 2 free
    assert "request 2 needs 1 more output page(s)" in str(info.value) and "needs 3" in str(info.value), info.value
    assert_unchanged(cache, before)
    run_step(cache, model, [(1, 0, random_rows(8, cfg, gen))])
    check_all(cache, model)
    cache.release(0)
    model.release(0)
    run_step(cache, model, [(2, 0, random_rows(9, cfg, gen)), (1, 8, random_rows(1, cfg, gen))])
    check_all(cache, model)
    assert cache.pool.free_pages == 2 and int(cache.pool.held.sum()) == 2  # requests 1 and 2: a page each


def test_pool_that_cannot_be_allocated_is_a_value_error():
    cfg = SMALL_KINDS["hca_small"]
    params = make_params(cfg, seed=2, max_positions=256)
    with pytest.raises(ValueError, match="max_pages") as info:
        CompressedKVCache(cfg, params, max_requests=10**7, max_seq_len=256, page_size=1)
    assert "bytes" in str(info.value)


@pytest.mark.parametrize("backend_name", ["reference", "triton", "online"])
def test_memory_bytes(backend_name):
    cfg = SMALL_KINDS["hca_small"]
    params = make_params(cfg, seed=2, max_positions=64)
    cache = make_cache(cfg, params, backend_name, max_requests=3, max_seq_len=64, mtp_step=1, max_pages=5)
    mem = cache.memory_bytes()
    assert mem["pool"] == 5 * cache.pool.layout.bytes_per_page
    state = sum(t.numel() * t.element_size() for t in cache.backend.state_tensors().values())
    scratch = cache.backend.workspace.nbytes if getattr(cache.backend, "workspace", None) is not None else 0
    assert mem["state"] == state + scratch
    assert cache.state_bytes_per_request() * 3 == state


def test_is_live_normalises_ids(backend):
    cfg = SMALL_KINDS["csa_small"]
    params = make_params(cfg, seed=2, max_positions=32)
    cache = make_cache(cfg, params, backend, max_requests=3, max_seq_len=32)
    cache.step([1], [0], [2], random_rows(2, cfg, torch.Generator().manual_seed(0)))
    assert cache.is_live(1) and cache.is_live(np.int64(1)) and cache.is_live(torch.tensor(1))
    assert not cache.is_live(0) and not cache.is_live(7) and not cache.is_live(-1)
    for bad in (1.0, True, "1", torch.tensor([1, 2])):
        with pytest.raises(StepError, match="is_live"):
            cache.is_live(bad)


def test_unordered_ids_and_grad_rows_are_refused(backend):
    cfg, cache, model, gen = _live_cache(backend, "csa_small")
    l0 = cache.length(0)
    before = snapshot(cache)
    with pytest.raises(StepError, match="ordered sequence"):
        cache.step({0}, [l0], [1], random_rows(1, cfg, gen))
    rows = random_rows(1, cfg, gen).requires_grad_(True)
    with pytest.raises(StepError, match="requires grad"):
        cache.step([0], [l0], [1], rows)
    assert_unchanged(cache, before)
    run_step(cache, model, [(0, l0, random_rows(1, cfg, gen))])
    check_all(cache, model)


def test_a_failing_backend_leaves_the_cache_as_it_was(backend, monkeypatch):
    """An exception inside the backend (here: the kernel launch failing the way "0 active drivers" does) rolls
    back the pages and the request table."""
    cfg, cache, model, gen = _live_cache(backend, "hca_small")
    before = snapshot(cache)
    free_before = cache.pool.free_pages

    def fail(*args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    target = "run" if backend == "reference" else "compress"
    monkeypatch.setattr(cache.backend, target, fail)
    r = cfg.ratio
    with pytest.raises(RuntimeError, match="active drivers"):
        cache.step([2, 0], [0, cache.length(0)], [3 * r, r], random_rows(4 * r, cfg, gen))
    assert_unchanged(cache, before)
    assert cache.pool.free_pages == free_before and not cache.is_live(2)
    monkeypatch.undo()
    run_step(cache, model, [(2, 0, random_rows(3 * r, cfg, gen))])
    check_all(cache, model)


class _CountingTable:
    """A page table that counts the elements every read and write touches."""

    def __init__(self, table: np.ndarray):
        self.table, self.touched = table, 0

    def __getitem__(self, idx):
        out = self.table[idx]
        self.touched += np.size(out)
        return out

    def __setitem__(self, idx, value):
        self.table[idx] = value
        self.touched += np.size(self.table[idx])


def test_host_work_per_step_is_o_new_pages():
    """A long request (2,000 pages) costs a decode step a handful of page-table elements, not a walk over the
    pages it holds."""
    cfg = SMALL_KINDS["hca_small"]  # r = 8
    params = make_params(cfg, seed=1, max_positions=16384)
    cache = make_cache(cfg, params, "reference", max_requests=2, max_seq_len=16384, page_size=1, mtp_step=3)
    gen = torch.Generator().manual_seed(0)
    length = 16000 - 3
    cache.step([0], [0], [length], random_rows(length, cfg, gen))
    assert cache.pool.held[0] == length // 8
    counter = _CountingTable(cache.pool.page_table)
    cache.pool.page_table = counter
    for start, n in ((length, 1), (length + 1, 4), (length + 3, 4)):  # no group closes; one closes; a rewind
        counter.touched = 0
        cache.step([0], [start], [n], random_rows(n, cfg, gen))
        assert counter.touched <= 2, f"step at {start}: {counter.touched} page-table elements touched"
    assert cache.length(0) == length + 7


@pytest.mark.parametrize("backend_name", ["triton", "online"])
def test_graph_api_validates_fills_and_keeps_lengths(backend_name):
    """``cache.graph`` (eager on CPU, a CUDA graph on a GPU): decode steps with rewinds through the graph match
    the model; a step the graph cannot replay is refused and changes nothing."""
    cfg = SMALL_KINDS["hca_small"]
    params = make_params(cfg, seed=4, max_positions=128)
    mtp = 2
    cache = make_cache(cfg, params, backend_name, max_requests=4, max_seq_len=128, mtp_step=mtp)
    model = StreamModel(cfg, params)
    gen = torch.Generator().manual_seed(6)
    run_step(cache, model, [(0, 0, random_rows(13, cfg, gen)), (1, 0, random_rows(6, cfg, gen))])
    graph = cache.graph(max_requests=2, rows_per_request=mtp + 1)
    lengths = {0: 13, 1: 6}
    rng = np.random.default_rng(1)
    for _ in range(5):
        items = []
        for rid in rng.permutation(2)[: int(rng.integers(1, 3))]:
            start = max(0, lengths[rid] - int(rng.integers(0, mtp + 1)))
            n = int(rng.integers(1, mtp + 2))
            items.append((int(rid), start, random_rows(n, cfg, gen)))
            lengths[rid] = start + n
        graph.step([i for i, _, _ in items], [s for _, s, _ in items], [r.shape[0] for *_, r in items],
                   torch.cat([r for *_, r in items]))  # fmt: skip
        for rid, start, rows in items:
            model.apply(rid, start, rows)
        check_all(cache, model)
    before = snapshot(cache)
    with pytest.raises(StepError, match="captured for 3 per request"):
        graph.step([0], [lengths[0]], [mtp + 2], random_rows(mtp + 2, cfg, gen))
    with pytest.raises(StepError, match="captured for 2"):
        graph.step([0, 1, 2], [lengths[0], lengths[1], 0], [1, 1, 1], random_rows(3, cfg, gen))
    with pytest.raises(StepError, match="start=0"):  # the cache's own validation applies too
        graph.step([0], [0], [1], random_rows(1, cfg, gen))
    assert_unchanged(cache, before)


def test_graph_api_needs_a_kernel_backend():
    cfg = SMALL_KINDS["csa_small"]
    cache = make_cache(cfg, make_params(cfg, seed=1, max_positions=32), "reference", max_seq_len=32)
    with pytest.raises(ValueError, match="kernel backend"):
        cache.graph(max_requests=1, rows_per_request=1)


@pytest.mark.parametrize("backend_name", ["triton", "online"])
def test_same_steps_give_byte_identical_state_and_pools(backend_name):
    """Determinism: tensor-parallel replicas fed the same rows must hold the same bytes."""
    cfg = SMALL_KINDS["hca_small"]
    params = make_params(cfg, seed=4, max_positions=64)
    caches = [make_cache(cfg, params, backend_name, max_requests=3, max_seq_len=64, mtp_step=1) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    steps = [([0, 1], [0, 0], [11, 17]), ([1, 0, 2], [16, 11, 0], [2, 2, 5]), ([0], [12], [2])]
    for ids, starts, counts in steps:
        rows = random_rows(sum(counts), cfg, gen)
        for cache in caches:
            cache.step(ids, starts, counts, rows.clone())
    a, b = (c.state_tensors() for c in caches)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


# ----------------------------------------------------------------------------------------------
# The host fast paths of a step (bench/probes/host_profile.py measures them)
# ----------------------------------------------------------------------------------------------
def test_repeated_layouts_still_refuse_bad_starts(backend):
    """Decode steps repeat their request ids and row counts, and the cache reuses their validated layout; the
    starts are still checked every step, each refusal names the first bad request and changes nothing, and a
    kernel backend reuses its plan buffer while the steps keep their shape."""
    cfg, cache, model, gen = _live_cache(backend, "csa_small")
    l0, l1 = cache.length(0), cache.length(1)
    run_step(cache, model, [(0, l0 - MTP, 2), (1, l1, 2)], gen)  # a rewind and a continuation
    l0, l1 = l0 - MTP + 2, l1 + 2
    layout = cache._last_layout
    plan = getattr(cache.backend, "_plan", None)
    bad = [
        ([l0 - MTP - 1, l1], ["request 0", f"start={l0 - MTP - 1}", f"[{l0 - MTP}, {l0}]"]),  # below the window
        ([l0, l1 + 1], ["request 1", f"start={l1 + 1}", f"[{l1 - MTP}, {l1}]"]),  # beyond L
        ([l0 + 1, l1 + 1], ["request 0", f"start={l0 + 1}"]),  # the first bad request is named
        ([-1, l1], ["request 0", "start=-1"]),
    ]
    for starts, needles in bad:
        before = snapshot(cache)
        with pytest.raises(StepError) as info:
            cache.step([0, 1], starts, [2, 2], random_rows(4, cfg, gen))
        for needle in needles:
            assert needle in str(info.value), f"{starts}: {needle!r} not in {info.value}"
        assert_unchanged(cache, before, f"starts {starts}")
        assert cache._last_layout is layout  # the refusals came from the per-step checks
    # a request that is no longer live must begin again at 0, also within a repeated layout
    cache.release(1)
    model.release(1)
    before = snapshot(cache)
    with pytest.raises(StepError, match=f"request 1 is not live; it must begin with start 0, got start={l1}"):
        cache.step([0, 1], [l0, l1], [2, 2], random_rows(4, cfg, gen))
    assert_unchanged(cache, before)
    run_step(cache, model, [(0, l0 - 1, 2), (1, 0, 2)], gen)
    run_step(cache, model, [(0, l0 + 1, 2), (1, 2, 2)], gen)
    assert cache._last_layout is layout
    if plan is not None:
        assert cache.backend._plan is plan, "a step of the same shape should reuse the plan buffer"
    check_all(cache, model)
    # a new layout is validated in full: a request twice is refused, then a smaller and a longer step run
    before = snapshot(cache)
    with pytest.raises(StepError, match="request 0 appears twice"):
        cache.step([0, 0], [l0 + 3, l0 + 3], [2, 2], random_rows(4, cfg, gen))
    assert_unchanged(cache, before)
    run_step(cache, model, [(1, 4, 1)], gen)
    run_step(cache, model, [(0, l0 + 3, 5), (1, 5, 3), (2, 0, 6)], gen)
    check_all(cache, model)


def test_entry_args_fast_path_matches_entry_args(monkeypatch):
    """``ops._entry`` keeps each launch's ``EntryMeta`` and afterwards builds only the tensor arguments; both of
    its paths must give exactly what ``entry_args`` gives, for every kind of output."""
    from dsv4_compressor import ops
    from dsv4_compressor.kernels.entry_pack import entry_args

    monkeypatch.setattr(ops, "_ENTRY_META", {})
    head, rope, page = 128, 64, 4
    norm = torch.randn(head)
    table = torch.randn(32, rope // 2, 2)
    cos, sin = table[..., 0], table[..., 1]  # strided views, as the engines pass them
    pages = torch.zeros(6, page * (head + rope + 8) + 32, dtype=torch.uint8)
    packs = torch.zeros(5, page * (head + 4), dtype=torch.uint8)
    outputs = []
    for latent in (True, False):
        for out_pages in (pages if latent else packs, None):
            for out_keys in (None, torch.zeros(19, head, dtype=torch.bfloat16), torch.zeros(30, head)):
                if out_pages is not None or out_keys is not None:
                    outputs.append((latent, out_pages, out_keys))
    for latent, out_pages, out_keys in outputs:
        for exact in (None, True, False):
            for pack in ("hadamard", "pow2") if not latent else ("hadamard",):
                args = (head, rope, latent, page, norm, cos, sin, 1e-6, out_pages, out_keys, exact, norm.device, pack)
                want = entry_args(
                    head=head, rope=rope, latent=latent, page_size=page, scale_bytes=8, norm_weight=norm, cos=cos,
                    sin=sin, eps=1e-6, out_pages=out_pages, out_keys=out_keys, exact_fp8=exact is not False,
                    indexer_pack=pack,
                )  # fmt: skip
                for attempt in ("first", "again"):
                    got = ops._entry(*args)
                    label = f"latent={latent} pages={out_pages is not None} keys={out_keys} exact={exact} {attempt}"
                    for have, expect in zip(got, want):
                        assert type(have) is type(expect), label
                        for name, a, b in zip(expect._fields, have, expect):
                            same = a is b if isinstance(b, torch.Tensor) else (type(a) is type(b) and a == b)
                            assert same, f"{label}: {type(expect).__name__}.{name}: {a!r} != {b!r}"
    assert len(ops._ENTRY_META) > 1
