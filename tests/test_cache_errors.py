"""Every invalid step, read or construction raises ``ValueError`` (``StepError`` for steps and reads) whose
message names the request and the numbers, and leaves the cache exactly as it was."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _helpers import (
    SMALL_KINDS,
    StreamModel,
    assert_unchanged,
    bad_params,
    check_all,
    make_cache,
    make_params,
    random_rows,
    run_step,
    snapshot,
)

from dsv4_compressor.cache import CompressedKVCache, StepError
from dsv4_compressor.config import CompressorConfig

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
        (dict(max_seq_len=41), ["max_seq_len=41", "40"]),
        (dict(max_seq_len=0), ["max_seq_len", "0"]),
        (dict(max_requests=0), ["max_requests", "0"]),
        (dict(max_requests=2.0), ["max_requests", "2.0"]),
        (dict(mtp_step=-1), ["mtp_step", "-1"]),
        (dict(mtp_step=17), ["mtp_step", "17"]),
    ]
    for kwargs, needles in cases:
        args = dict(max_requests=2, max_seq_len=32, mtp_step=1)
        args.update(kwargs)
        with pytest.raises(ValueError) as info:
            CompressedKVCache(cfg, params, backend=backend, device="cpu", **args)
        for needle in needles:
            assert needle in str(info.value), f"{kwargs}: {needle!r} not in {info.value}"
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
