"""The C128 scratch capacity rule (SPEC section 7) and the workspace that applies it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dsv4_compressor.workspace import C128ScratchPlan, CapacityError, Workspace, plan_c128_scratch


def test_spec_worked_cases():
    p = plan_c128_scratch(batch_max_tokens=256, max_req_num=256, mtp_step=3, dp=1)
    assert (p.regions, p.rows_per_region) == (1, 1024)
    p = plan_c128_scratch(batch_max_tokens=256, max_req_num=256, mtp_step=3, dp=2, decode_overlap=True)
    assert (p.regions, p.rows_per_region) == (2, 512)
    p = plan_c128_scratch(batch_max_tokens=128, max_req_num=256, tp=1, dp=1, decode_overlap=True)
    assert p.rows_per_region == 256  # not 128: with dp == 1 the decode batch is not split
    assert p.regions == 2


def test_bytes():
    p = plan_c128_scratch(batch_max_tokens=8192, max_req_num=64)
    assert p.rows_per_region == 8192 and p.head_dim == 512
    assert p.bytes == 8192 * 512 * 4 == 16 * 2**20
    p2 = plan_c128_scratch(batch_max_tokens=8192, max_req_num=64, prefill_overlap=True, tp=8)
    assert p2.regions == 2 and p2.bytes == 2 * 16 * 2**20
    p3 = plan_c128_scratch(batch_max_tokens=100, max_req_num=3, head_dim=128)
    assert p3.bytes == 100 * 128 * 4
    assert C128ScratchPlan(regions=3, rows_per_region=7, head_dim=5).bytes == 3 * 7 * 5 * 4


def test_tp_padding_only_with_overlap():
    # B = 250 tokens, tp = 8: padded to 256 when overlap mixes TP/SP, untouched otherwise
    assert plan_c128_scratch(batch_max_tokens=250, max_req_num=4, tp=8).rows_per_region == 250
    assert plan_c128_scratch(batch_max_tokens=250, max_req_num=4, tp=8, prefill_overlap=True).rows_per_region == 256
    assert plan_c128_scratch(batch_max_tokens=250, max_req_num=4, tp=8, decode_overlap=True).rows_per_region == 256
    # decode side: R = 61 requests x S = 2 rows = 122 -> 128 (tp 8); split in two (dp 2): 31 x 2 = 62 -> 64
    kw = dict(batch_max_tokens=16, max_req_num=61, mtp_step=1, tp=8)
    assert plan_c128_scratch(**kw).rows_per_region == 122
    assert plan_c128_scratch(**kw, prefill_overlap=True).rows_per_region == 128
    assert plan_c128_scratch(**kw, decode_overlap=True, dp=2).rows_per_region == 64


def test_graph_batch_larger_than_admitted_requests():
    # graphs captured for 512 requests while only 100 are admitted: a replay can hand over 512 * S rows
    p = plan_c128_scratch(batch_max_tokens=256, max_req_num=100, mtp_step=1, graph_max_batch_size=512)
    assert p.rows_per_region == 1024
    p = plan_c128_scratch(
        batch_max_tokens=256, max_req_num=100, mtp_step=1, graph_max_batch_size=512, decode_overlap=True, dp=4, tp=3
    )
    assert p.rows_per_region == 3 * math.ceil(256 * 2 / 3)  # ceil(512 / 2) * 2 = 512 rows, padded to tp = 3
    # a smaller graph batch than R changes nothing
    assert plan_c128_scratch(batch_max_tokens=8, max_req_num=100, graph_max_batch_size=16).rows_per_region == 100


# ----------------------------------------------------------------------------------------------
# Brute force: simulate every step each serving mode can hand the compressor
# ----------------------------------------------------------------------------------------------
def _largest_step(b, r, mtp, tp, dp, decode_overlap, prefill_overlap, gq) -> tuple[int, int]:
    """``(regions, rows)`` by enumeration: every prefill forward, every decode batch and every graph replay."""
    overlap = decode_overlap or prefill_overlap
    s = mtp + 1

    def padded(tokens):
        if not overlap:
            return tokens
        while tokens % tp:
            tokens += 1
        return tokens

    def micro_batches(requests):
        if decode_overlap and dp > 1:  # split in two halves, the first one takes the odd request
            return [requests - requests // 2, requests // 2]
        return [requests]

    sizes = []
    sizes += [padded(t) for t in range(1, b + 1)]  # prefill forwards of 1..B tokens
    for n in range(1, r + 1):  # eager decode batches of 1..R requests
        sizes += [padded(m * s) for m in micro_batches(n)]
    for n in range(1, gq + 1):  # graph replays are padded to a captured batch of up to Gq requests
        sizes += [padded(m * s) for m in micro_batches(n)]
    return (2 if overlap else 1), max(sizes)


CONFIGS = list(
    itertools.product(
        [1, 5, 16],  # B
        [1, 3, 8],  # R
        [0, 1, 3],  # mtp
        [1, 3, 4],  # tp
        [1, 2],  # dp
        [False, True],  # decode_overlap
        [False, True],  # prefill_overlap
        [0, 2, 11],  # Gq
    )
)


def test_plan_covers_every_step_and_no_more():
    for b, r, mtp, tp, dp, dov, pov, gq in CONFIGS:
        plan = plan_c128_scratch(
            batch_max_tokens=b,
            max_req_num=r,
            mtp_step=mtp,
            tp=tp,
            dp=dp,
            decode_overlap=dov,
            prefill_overlap=pov,
            graph_max_batch_size=gq,
            head_dim=64,
        )
        want = _largest_step(b, r, mtp, tp, dp, dov, pov, gq)
        assert (plan.regions, plan.rows_per_region) == want, (b, r, mtp, tp, dp, dov, pov, gq)
        assert plan.bytes == want[0] * want[1] * 64 * 4


@pytest.mark.parametrize(
    "name,value",
    [
        ("batch_max_tokens", 0),
        ("batch_max_tokens", 1.0),
        ("batch_max_tokens", True),
        ("max_req_num", 0),
        ("mtp_step", -1),
        ("tp", 0),
        ("dp", 0),
        ("graph_max_batch_size", -1),
        ("head_dim", 0),
    ],
)
def test_plan_rejects_bad_arguments(name, value):
    kwargs = dict(batch_max_tokens=4, max_req_num=2)
    kwargs[name] = value
    with pytest.raises(ValueError) as info:
        plan_c128_scratch(**kwargs)
    assert name in str(info.value) and repr(value) in str(info.value)


# ----------------------------------------------------------------------------------------------
# Workspace
# ----------------------------------------------------------------------------------------------
def test_workspace_views_and_capacity():
    plan = plan_c128_scratch(batch_max_tokens=24, max_req_num=4, mtp_step=1, decode_overlap=True, dp=2, head_dim=32)
    assert (plan.regions, plan.rows_per_region) == (2, 24)
    ws = Workspace(plan, device="cpu")
    assert ws.nbytes == plan.bytes
    gen = torch.Generator().manual_seed(0)
    a = ws.c128_scratch(0, 24)
    b = ws.c128_scratch(1, 10)
    assert a.dtype == b.dtype == torch.float32
    assert a.shape == (24, 32) and b.shape == (10, 32)
    assert a.is_contiguous() and b.is_contiguous()
    # regions do not overlap in memory
    a_lo, a_hi = a.data_ptr(), a.data_ptr() + 24 * 32 * 4
    b_full = ws.c128_scratch(1, 24)
    b_lo, b_hi = b_full.data_ptr(), b_full.data_ptr() + 24 * 32 * 4
    assert a_hi <= b_lo or b_hi <= a_lo
    fill_a = torch.randn(24, 32, generator=gen)
    fill_b = torch.randn(24, 32, generator=gen)
    a.copy_(fill_a)
    b_full.copy_(fill_b)
    assert torch.equal(ws.c128_scratch(0, 24), fill_a)
    assert torch.equal(ws.c128_scratch(1, 24), fill_b)
    # views of one region alias each other
    small = ws.c128_scratch(0, 5)
    assert small.data_ptr() == a.data_ptr() and torch.equal(small, fill_a[:5])
    assert ws.c128_scratch(0, 0).shape == (0, 32)


def test_workspace_capacity_errors():
    plan = plan_c128_scratch(batch_max_tokens=20, max_req_num=4, prefill_overlap=True, tp=3, head_dim=16)
    assert (plan.regions, plan.rows_per_region) == (2, 21)
    ws = Workspace(plan, device="cpu")
    with pytest.raises(CapacityError) as info:
        ws.c128_scratch(1, 22)
    msg = str(info.value)
    assert "region 1" in msg and "22" in msg and "21" in msg
    assert isinstance(info.value, ValueError)
    for region in (2, -1, True, 0.0):
        with pytest.raises(CapacityError, match="region"):
            ws.c128_scratch(region, 1)
    for rows in (-1, 2.0, False):
        with pytest.raises(CapacityError, match="rows"):
            ws.c128_scratch(0, rows)
    assert ws.c128_scratch(1, 21).shape == (21, 16)
