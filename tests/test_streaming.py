"""The streaming invariant (SPEC section 5) on every backend: after any sequence of steps, the entries of
groups ``g < L // r`` are the one-shot computation over the current rows of positions ``0..L-1``.

Random programs (hypothesis) mix first chunks, continuation chunks that straddle group boundaries, single
rows, empty chunks, MTP decode rows (``mtp_step + 1`` per request) with random acceptance (any start in
``[L - mtp_step, L]``, rewound positions get fresh rows), releases and id reuse, in shuffled request order.
Explicit cases pin down rejected drafts, rewinds across group boundaries, empty steps and refused rewinds.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.buffers import fill_bits, poison_cache
from helpers.checks import assert_unchanged, check_all, snapshot
from helpers.inputs import CSA_SMALL, HCA_SMALL, SMALL_KINDS, STREAMING_BACKENDS, make_cache, make_params, random_rows
from helpers.model import StreamModel, run_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_compressor.cache import StepError

MAX_SEQ = 64
MAX_REQUESTS = 4
KINDS = list(SMALL_KINDS)
#: Hypothesis programs per (backend, kind, mtp_step): the kernel backends run under the Triton interpreter, whose
#: launches cost ~10-50 ms each; these counts keep `make test` within its budget on two cores.
EXAMPLES = {"reference": 30, "triton": 8, "online": 8}
#: (backend, module, class of the HCA backend): every backend the cache offers exists and is what it says.
BACKEND_CLASSES = {
    "reference": ("dsv4_compressor.backends.reference", "ReferenceBackend"),
    "triton": ("dsv4_compressor.backends.triton", "TritonRingBackend"),
    "online": ("dsv4_compressor.backends.online", "OnlineBackend"),
}


# ----------------------------------------------------------------------------------------------
# The backends and the no-change snapshot themselves
# ----------------------------------------------------------------------------------------------
def test_every_streaming_backend_exists():
    """A missing or renamed backend must fail the suite, not skip it: every name the streaming tests run on
    imports and builds a cache whose backend is the expected class (the ``backend`` fixture skips nothing)."""
    assert sorted(STREAMING_BACKENDS) == sorted(BACKEND_CLASSES)
    for name in STREAMING_BACKENDS:
        module, cls = BACKEND_CLASSES[name]
        expected = getattr(importlib.import_module(module), cls)
        cache = make_cache(HCA_SMALL, make_params(HCA_SMALL), name)
        assert type(cache.backend) is expected and cache.backend_name == name


def test_backend_fixture_covers_every_backend(backend):
    assert backend in STREAMING_BACKENDS


@pytest.mark.parametrize(
    ("backend", "kind"), [("reference", "indexer"), ("triton", "csa_small"), ("online", "hca_small")]
)
def test_snapshot_sees_every_change(backend, kind):
    """``assert_unchanged`` must notice a change to any part of a cache: each tensor it owns (ring or online
    banks, pages, keys, FP8 pages: the three cases cover them all), the page table, the pages held, the free
    list and the request table."""
    cfg, cache, model = _setup(kind, backend, mtp=1, seed=9)
    poison_cache(cache)
    gen = torch.Generator().manual_seed(12)
    run_step(cache, model, [(0, 0, random_rows(2 * cfg.ratio + 1, cfg, gen)), (2, 0, random_rows(3, cfg, gen))])
    before = snapshot(cache)
    assert_unchanged(cache, before, "nothing happened")

    def breaks(change, what):
        saved = snapshot(cache)
        undo = change()
        with pytest.raises(AssertionError):
            assert_unchanged(cache, before, what)
        undo()
        assert_unchanged(cache, saved, f"undoing {what}")

    for name, t in cache.state_tensors().items():

        def corrupt(t=t):
            keep = t.clone()
            if t.dtype == torch.float32:  # e.g. the online banks overwritten with NaN after a refused step
                fill_bits(t, 0x7FC00000)
            else:
                t.view(torch.uint8).view(-1)[-1] ^= 1  # one bit of the last byte (a slot no step wrote)
            return lambda: t.copy_(keep)

        breaks(corrupt, f"tensor {name}")
    pool = cache.pool

    def table():
        pool.page_table[3, 0] = 7  # a slot that holds no page
        return lambda: pool.page_table.__setitem__((3, 0), -1)

    def held():
        pool.held[1] += 1
        return lambda: pool.held.__setitem__(1, pool.held[1] - 1)

    def free():
        pool._free[0], pool._free[-1] = pool._free[-1], pool._free[0]
        return lambda: free()

    def length():
        cache._length[0] -= 1
        return lambda: cache._length.__setitem__(0, cache._length[0] + 1)

    def retained():
        cache._retained[2] += 1
        return lambda: cache._retained.__setitem__(2, cache._retained[2] - 1)

    for change in (table, held, free, length, retained):
        breaks(change, change.__name__)


def _setup(kind, backend, mtp, seed=0, **kwargs):
    cfg = SMALL_KINDS[kind]
    params = make_params(cfg, seed=seed, max_positions=MAX_SEQ)
    cache = make_cache(cfg, params, backend, max_requests=MAX_REQUESTS, max_seq_len=MAX_SEQ, mtp_step=mtp, **kwargs)
    return cfg, cache, StreamModel(cfg, params)


# ----------------------------------------------------------------------------------------------
# Random programs
# ----------------------------------------------------------------------------------------------
def _draw_step(data, cfg, model: StreamModel, mtp: int, gen: torch.Generator):
    """Draw one step: releases first (applied by the caller), then per request an action."""
    chunk = st.one_of(st.integers(0, 3), st.integers(1, 3 * cfg.ratio + 3))
    releases, items = [], []
    for rid in range(MAX_REQUESTS):
        if rid in model.rows:
            length = model.length(rid)
            choices = ["skip", "chunk", "chunk", "release", "restart"]
            if length + 1 <= MAX_SEQ:
                choices += ["decode"] * 5
            action = data.draw(st.sampled_from(choices), label=f"action {rid}")
            if action == "chunk":
                n = min(data.draw(chunk, label=f"chunk {rid}"), MAX_SEQ - length)
                items.append((rid, length, random_rows(n, cfg, gen)))
            elif action == "decode":
                lo = max(0, length - mtp, length + mtp + 1 - MAX_SEQ)
                start = data.draw(st.integers(lo, length), label=f"accepted start {rid}")
                if start + mtp + 1 <= MAX_SEQ:
                    # rows of rewound positions are recomputed: fresh rows for all of [start, start + S)
                    items.append((rid, start, random_rows(mtp + 1, cfg, gen)))
            elif action in ("release", "restart"):
                releases.append(rid)
                if action == "restart":
                    n = data.draw(chunk, label=f"first chunk {rid}")
                    items.append((rid, 0, random_rows(n, cfg, gen)))
        elif data.draw(st.integers(0, 3), label=f"begin {rid}") > 0:
            n = data.draw(chunk, label=f"first chunk {rid}")
            items.append((rid, 0, random_rows(n, cfg, gen)))
    order = data.draw(st.permutations(range(len(items))), label="order")
    return releases, [items[i] for i in order]


@pytest.mark.parametrize("mtp", [0, 1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_streaming_invariant_random_programs(backend, kind, mtp):
    cfg = SMALL_KINDS[kind]
    params = make_params(cfg, seed=mtp + 10 * KINDS.index(kind), max_positions=MAX_SEQ)
    examples = EXAMPLES[backend]

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def program(data):
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="row seed"))
        cache = make_cache(cfg, params, backend, max_requests=MAX_REQUESTS, max_seq_len=MAX_SEQ, mtp_step=mtp)
        model = StreamModel(cfg, params)
        for _ in range(data.draw(st.integers(1, 8), label="steps")):
            releases, items = _draw_step(data, cfg, model, mtp, gen)
            for rid in releases:
                cache.release(rid)
                model.release(rid)
            run_step(cache, model, items)
            check_all(cache, model)

    program()


# ----------------------------------------------------------------------------------------------
# Explicit cases
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_chunks_and_decode(backend, kind):
    """One batch: a first chunk, a continuation chunk across a boundary, decode rows with a partial accept."""
    cfg, cache, model = _setup(kind, backend, mtp=3, seed=1)
    r = cfg.ratio
    gen = torch.Generator().manual_seed(5)
    run_step(cache, model, [(0, 0, random_rows(r + 1, cfg, gen)), (2, 0, random_rows(2 * r + 3, cfg, gen))])
    check_all(cache, model)
    run_step(
        cache,
        model,
        [
            (2, 2 * r + 1, random_rows(4, cfg, gen)),  # decode: 2 of 3 drafts accepted, 4 rows
            (1, 0, random_rows(3 * r - 1, cfg, gen)),  # first chunk
            (0, r + 1, random_rows(2 * r, cfg, gen)),  # continuation across two boundaries
        ],
    )
    check_all(cache, model)
    assert [cache.length(i) for i in range(3)] == [3 * r + 1, 3 * r - 1, 2 * r + 5]


@pytest.mark.parametrize("kind", KINDS)
def test_rewind_of_exactly_mtp_step(backend, kind):
    cfg, cache, model = _setup(kind, backend, mtp=3, seed=2)
    gen = torch.Generator().manual_seed(6)
    run_step(cache, model, [(1, 0, random_rows(2 * cfg.ratio + 3, cfg, gen))])
    for _ in range(2 * cfg.ratio):  # every draft rejected: start = L - mtp_step, L grows by one
        length = cache.length(1)
        run_step(cache, model, [(1, length - 3, random_rows(4, cfg, gen))])
        check_all(cache, model)
        assert cache.length(1) == length + 1


@pytest.mark.parametrize("refill", ["separately", "same_step"])
@pytest.mark.parametrize("kind", KINDS)
def test_rejected_draft_that_closed_a_group(backend, kind, refill):
    """A draft row closes group k and is rejected: entry k is not reported, and once the position is
    supplied again, entry k is the one-shot value of the new rows (not the draft's)."""
    cfg, cache, model = _setup(kind, backend, mtp=3, seed=3)
    r = cfg.ratio
    gen = torch.Generator().manual_seed(7)
    l0 = 2 * r - 2  # group 1 closes at position 2r - 1 = l0 + 1
    run_step(cache, model, [(0, 0, random_rows(l0, cfg, gen))])
    run_step(cache, model, [(0, l0, random_rows(4, cfg, gen))])  # drafts l0 .. l0+3; l0+1 closes group 1
    check_all(cache, model)
    draft_entry = cache.entries(0)[1].clone()
    assert cache.entries(0).shape[0] == (l0 + 4) // r
    if refill == "separately":
        run_step(cache, model, [(0, l0 + 1, random_rows(0, cfg, gen))])  # reject the closing draft and beyond
        check_all(cache, model)
        assert cache.length(0) == 2 * r - 1
        assert cache.entries(0).shape[0] == 1  # entry 1 ends at or beyond L: not reported
        if cfg.output == "latent" or cfg.indexer_fp8:
            assert cache.packed_entries(0).shape[0] == 1
        run_step(cache, model, [(0, l0 + 1, random_rows(1, cfg, gen))])
    else:
        run_step(cache, model, [(0, l0 + 1, random_rows(4, cfg, gen))])
    check_all(cache, model)
    assert cache.entries(0).shape[0] >= 2
    assert not torch.equal(cache.entries(0)[1], draft_entry)


@pytest.mark.parametrize("kind", KINDS)
def test_rewind_across_a_group_boundary(backend, kind):
    cfg, cache, model = _setup(kind, backend, mtp=3, seed=4)
    r = cfg.ratio
    gen = torch.Generator().manual_seed(8)
    run_step(cache, model, [(3, 0, random_rows(2 * r + 1, cfg, gen)), (0, 0, random_rows(r + 1, cfg, gen))])
    before = cache.entries(3).clone()
    # positions 2r-2 .. 2r: the last two rows of group 1 and the first of group 2 are replaced
    run_step(cache, model, [(0, r + 1, random_rows(1, cfg, gen)), (3, 2 * r - 2, random_rows(4, cfg, gen))])
    check_all(cache, model)
    after = cache.entries(3)
    assert torch.equal(after[0], before[0])
    assert not torch.equal(after[1], before[1])


@pytest.mark.parametrize("kind", KINDS)
def test_steps_with_zero_rows(backend, kind):
    cfg, cache, model = _setup(kind, backend, mtp=1, seed=5)
    r = cfg.ratio
    gen = torch.Generator().manual_seed(9)
    run_step(cache, model, [])  # an empty step
    run_step(cache, model, [(2, 0, random_rows(0, cfg, gen))])  # a request begins with no rows
    check_all(cache, model)
    assert cache.is_live(2) and cache.length(2) == 0 and cache.entries(2).shape == (0, cfg.head_dim)
    run_step(cache, model, [(2, 0, random_rows(r, cfg, gen)), (1, 0, random_rows(r + 2, cfg, gen))])
    check_all(cache, model)
    run_step(cache, model, [(1, r + 2, random_rows(0, cfg, gen)), (2, r, random_rows(r - 1, cfg, gen))])
    check_all(cache, model)
    run_step(cache, model, [(1, r + 1, random_rows(0, cfg, gen))])  # a rewind with no new rows: L shrinks
    check_all(cache, model)
    assert cache.length(1) == r + 1
    run_step(cache, model, [(1, r + 1, random_rows(2 * r, cfg, gen)), (2, 2 * r - 1, random_rows(0, cfg, gen))])
    check_all(cache, model)


@pytest.mark.parametrize("kind", KINDS)
def test_release_and_reuse_of_an_id(backend, kind):
    cfg, cache, model = _setup(kind, backend, mtp=1, seed=6)
    r = cfg.ratio
    gen = torch.Generator().manual_seed(10)
    run_step(cache, model, [(0, 0, random_rows(3 * r + 1, cfg, gen)), (1, 0, random_rows(2 * r, cfg, gen))])
    old = cache.entries(0).clone()
    cache.release(0)
    model.release(0)
    assert not cache.is_live(0)
    with pytest.raises(StepError, match=r"^entries: request 0 is not live \(begin it with a step at start 0\)$"):
        cache.entries(0)
    # the id begins again: a shorter request, then a longer one than before
    run_step(cache, model, [(0, 0, random_rows(r + 2, cfg, gen))])
    check_all(cache, model)
    assert not torch.equal(cache.entries(0)[0], old[0])
    run_step(cache, model, [(0, r + 2, random_rows(3 * r, cfg, gen)), (1, 2 * r, random_rows(2, cfg, gen))])
    check_all(cache, model)


def test_walk_down_too_deep_is_refused(backend):
    """Steps that each rewind mtp_step positions and add one row walk L down; the ring forgets rows as the
    walk goes, and the first step needing a forgotten row is refused, naming the request, with nothing
    changed. Every step before it is correct."""
    cfg, cache, model = _setup("csa_small", backend, mtp=3, seed=7)
    assert cfg is CSA_SMALL
    gen = torch.Generator().manual_seed(11)
    run_step(cache, model, [(2, 0, random_rows(30, cfg, gen)), (0, 0, random_rows(9, cfg, gen))])
    refused = None
    for _ in range(15):
        length = cache.length(2)
        items = [(2, length - 3, random_rows(1, cfg, gen))]
        before = snapshot(cache)
        try:
            run_step(cache, model, items)
        except StepError as err:
            refused = (str(err), length)
            assert_unchanged(cache, before)
            break
        check_all(cache, model)
    assert refused is not None, "a walk down of 15 x 2 positions below a 11-row ring was never refused"
    message, length = refused
    assert "request 2" in message and str(length - 3) in message, message
    assert length < 30
    # the cache still serves valid steps afterwards
    run_step(cache, model, [(2, length, random_rows(5, cfg, gen)), (0, 9, random_rows(4, cfg, gen))])
    check_all(cache, model)
