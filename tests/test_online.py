"""The online HCA backend beyond the shared streaming suite (CPU, Triton interpreter, small shapes).

Covers what is specific to it: any head_dim that is a multiple of 64 and mtp_step up to 16, the decode-
specialised launch against the general one, long prefill chunks split between the request program and the
interior programs (with and without a carried partial group), the banked state itself, and state size.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.buffers import POISON_F32, fill_bits, launch_step, online_launcher, poison_cache
from helpers.checks import assert_unchanged, check_all, check_outputs, check_state, first_difference, snapshot
from helpers.inputs import make_cache, make_params, random_rows
from helpers.model import StreamModel, run_step, split_rows

import dsv4_compressor as dc
from dsv4_compressor import reference as ref

H192 = dc.CompressorConfig(ratio=4, head_dim=192, rope_dim=64, overlap=False, name="r4_h192")
R8 = dc.CompressorConfig(ratio=8, head_dim=128, rope_dim=64, overlap=False, name="r8_h128")
#: A ratio below mtp_step + 1: one decode step of a request closes two groups.
R2 = dc.CompressorConfig(ratio=2, head_dim=128, rope_dim=64, overlap=False, name="r2_h128")
#: With mtp_step 2, a ratio of 3 lets the decode program's 4 unrolled rows hold two closing positions, the
#: second past the step's end.
R3 = dc.CompressorConfig(ratio=3, head_dim=128, rope_dim=64, overlap=False, name="r3_h128")


def _cache(cfg, mtp, max_seq_len=160, seed=0, **opts):
    params = make_params(cfg, seed=seed, max_positions=max_seq_len)
    cache = make_cache(cfg, params, "online", max_requests=3, max_seq_len=max_seq_len, mtp_step=mtp, **opts)
    poison_cache(cache)
    return cache, StreamModel(cfg, params, mtp)


@pytest.mark.parametrize(("cfg", "mtp"), [(H192, 16), (H192, 5), (H192, 3), (R8, 16), (R8, 0), (R2, 3), (R3, 2)])
def test_head_dims_and_long_mtp(cfg, mtp):
    """Prefill chunks, then MTP verify steps (mtp_step + 1 rows, random acceptance) for two requests; with
    ``R2`` a step closes two groups of a request (and a chunk's banked rows close two groups)."""
    cache, model = _cache(cfg, mtp, seed=mtp)
    gen = torch.Generator().manual_seed(mtp)
    rng = random.Random(mtp)
    run_step(cache, model, [(0, 0, random_rows(13, cfg, gen)), (1, 0, random_rows(30, cfg, gen))])
    check_all(cache, model)  # the prefill's own entries and banks, before a rewind could rewrite them
    check_state(cache, model)
    for _ in range(4):
        items = []
        for rid in (1, 0):
            length = model.length(rid)
            start = rng.randint(max(0, length - mtp), length)
            items.append((rid, start, random_rows(mtp + 1, cfg, gen)))
        run_step(cache, model, items)
        check_all(cache, model)
        check_outputs(cache, model)  # also the entries of drafts a rewind discarded; the rest still poison
        check_state(cache, model)


ALIGNED_TAILS = {
    # (carry, mtp, chunk rows) with r = 8: where the chunk's banked tail (its last mtp + 1 rows) begins
    "tail_begins_a_group": (3, 2, 80),  # rows 80..82 after the carried group 0 closed at 7
    "tail_begins_with_a_closing": (3, 2, 79),  # row 79 closes interior group 9, rows 80..81 are banked
    "head_closes_before_tail": (3, 2, 8),  # the carried group closes at 7, rows 8..10 are banked
}


LONG_CHUNKS = [(c, m, 8 * 9 + 5, "split") for c in (0, 3) for m in (0, 2, 9)] + [
    (*tail, "split") for tail in ALIGNED_TAILS.values()
]
LONG_CHUNK_IDS = [f"carry{c}-mtp{m}" for c in (0, 3) for m in (0, 2, 9)] + list(ALIGNED_TAILS)
#: The same chunks in one launch (no scratch: whole-channel programs finish their own entries).
LONG_CHUNKS += [(0, 2, 8 * 9 + 5, "one_launch"), (3, 9, 8 * 9 + 5, "one_launch"), (3, 2, 79, "one_launch")]
LONG_CHUNK_IDS += ["carry0-mtp2-one_launch", "carry3-mtp9-one_launch", "tail_begins_with_a_closing-one_launch"]


@pytest.mark.parametrize(("carry", "mtp", "chunk", "launch"), LONG_CHUNKS, ids=LONG_CHUNK_IDS)
def test_long_chunk_interior_groups(carry, mtp, chunk, launch):
    """A chunk spanning many groups: fresh full groups go to interior programs, the partial ends and the banked
    tail to the request program (also where the tail begins a group, begins with the closing row of an interior
    group, or follows the carried group's closing row). Then rewinds into the banked tail must find the right
    states. ``split`` (the cache's default workspace): every program holds 32 of the 128 channels and a second
    launch finishes the entries; ``one_launch``: no workspace."""
    cfg = R8
    opts = {} if launch == "split" else {"workspace": False}
    cache, model = _cache(cfg, mtp, seed=10 + mtp, **opts)
    assert (cache.backend.workspace is not None) == (launch == "split")
    gen = torch.Generator().manual_seed(carry + 7 * mtp + chunk)
    if carry:
        run_step(cache, model, [(0, 0, random_rows(carry, cfg, gen))])
    run_step(cache, model, [(0, carry, random_rows(chunk, cfg, gen))])
    check_all(cache, model)
    length = model.length(0)
    for rewind in range(mtp + 1):
        start = length - rewind
        run_step(cache, model, [(0, start, random_rows(mtp + 1, cfg, gen))])
        check_all(cache, model)
        check_outputs(cache, model)
        check_state(cache, model)
        length = model.length(0)


def test_prefill_longer_than_the_scratch_runs_in_one_launch():
    """A prefill step with more rows than the cache's workspace region runs in one launch (no error, the
    scratch untouched); one that fits splits through it. Both are explained by the float64 model."""
    cfg, mtp = R8, 2
    plan = dc.plan_c128_scratch(batch_max_tokens=40, max_req_num=3, mtp_step=mtp, head_dim=cfg.head_dim)
    cache, model = _cache(cfg, mtp, seed=21, workspace=dc.Workspace(plan, device="cpu"))
    scratch = cache.backend.workspace.buffer.view(torch.int32)
    gen = torch.Generator().manual_seed(21)
    run_step(cache, model, [(0, 0, random_rows(77, cfg, gen))])  # 77 rows > 40: one launch
    assert (scratch == POISON_F32).all(), "a step longer than the region wrote the scratch"
    check_all(cache, model)
    run_step(cache, model, [(1, 0, random_rows(30, cfg, gen))])  # 30 rows: split through the region
    assert (scratch != POISON_F32).any(), "a step that fits the region did not split"
    check_all(cache, model)
    check_state(cache, model)


@pytest.mark.parametrize("channel_major", [False, True], ids=["row_major", "channel_major"])
def test_decode_launch_equals_general_launch(channel_major):
    """The decode-specialised launch (request programs only; also in its channel-major layout) computes what
    the general launch computes, and each of them what the float64 reference computes: every entry written
    (also the drafts a rewind discards) is explained byte by byte, every other pool byte is still poison, and
    the banks of both hold the same state, that of the reference's partial group."""
    cfg, mtp = R8, 3
    (dec, model), (gen_cache, _) = _cache(cfg, mtp, seed=3), _cache(cfg, mtp, seed=3)
    gen = torch.Generator().manual_seed(3)
    run_step([dec, gen_cache], model, [(0, 0, 21), (1, 0, 21)], gen)
    ends = [21, 21]
    for step in range(6):
        items = [(0, ends[0] - step % (mtp + 1), mtp + 1), (1, ends[1], mtp + 1)]
        rows = random_rows(2 * (mtp + 1), cfg, gen)
        launch_step(dec, items, rows, decode=True, pad_rows=2, launch=online_launcher(dec, channel_major=channel_major))
        launch_step(gen_cache, items, rows, decode=False, pad_rows=2)
        assert (dec.pool.page_table == gen_cache.pool.page_table).all()
        for rid, start, n in items:
            model.apply(rid, start, rows[rid * n : (rid + 1) * n], dec.pool)
        ends = [start + n for _, start, n in items]
        assert first_difference(dec, gen_cache) is None, f"step {step}: {first_difference(dec, gen_cache)}"
        for cache, what in ((dec, "decode launch"), (gen_cache, "general launch")):
            check_outputs(cache, model, f"{what} step {step} {items}")
            check_state(cache, model, f"{what} step {step} {items}")
    assert len(model.closed_log) > 4 and any(rid == 0 for rid, _ in model.closed_log[2:])


def test_banks_hold_the_partial_group_state():
    """After a step ending at L (not a group boundary), bank L % B is (max, sum, weighted sum) of the partial
    group: a / s is its pooled value and m its per-channel maximum gate logit; so are the banks of the other
    lengths of the last mtp_step + 1, which a rewind restarts from."""
    cfg, mtp = R8, 3
    cache, model = _cache(cfg, mtp, seed=5)
    gen = torch.Generator().manual_seed(5)
    run_step(cache, model, [(0, 0, random_rows(8 * 3 + 5, cfg, gen))])
    length = model.length(0)
    checked = 0
    for back in range(mtp + 1):  # every banked length of the last mtp_step + 1
        ell = length - back
        g0 = ell // cfg.ratio * cfg.ratio
        if ell == g0:
            continue
        m, s, a = cache.backend.state[0, ell % cache.backend.banks].double()
        rows = model.rows[0][g0:ell].double()
        gated = ref.gated_rows(rows, torch.arange(g0, ell), cache.params.ape.double(), cfg.width)
        want = ref.pool_windows(gated[None, :, : cfg.width], gated[None, :, cfg.width :])[0]
        assert torch.allclose(a / s, want, rtol=1e-5, atol=1e-6), (ell, (a / s - want).abs().max())
        # the running max is exact: the largest float32 gate logit score + ape of the partial group
        gated32 = ref.gated_rows(model.rows[0][g0:ell], torch.arange(g0, ell), cache.params.ape, cfg.width)
        assert torch.equal(m.float(), gated32[:, cfg.width :].max(dim=0).values)
        checked += 1
    assert checked == mtp + 1
    check_state(cache, model, "banks")
    # the banks of the two other request slots were never written: still poison
    assert bool((cache.backend.state[1:].view(torch.int32) == POISON_F32).all())


def test_state_bytes_per_request():
    """Online HCA state: mtp_step + 1 banks of 3 x H float32; at DeepSeek-V4 shapes (mtp 3) 24 KiB, 22x less
    than the 528 KiB ring. Overlapping kinds report their ring."""
    hca = dc.CompressorConfig.hca()
    params = dc.CompressorParams.random(hca, max_positions=1024)
    online = dc.CompressedKVCache(hca, params, max_requests=1, max_seq_len=1024, mtp_step=3, backend="online")
    ring = dc.CompressedKVCache(hca, params, max_requests=1, max_seq_len=1024, mtp_step=3, backend="reference")
    assert online.state_bytes_per_request() == 4 * 3 * 512 * 4 == 24576
    assert ring.state_bytes_per_request() == 132 * 1024 * 4 == 540672
    assert ring.state_bytes_per_request() >= 20 * online.state_bytes_per_request()
    csa = dc.CompressorConfig.csa()
    csa_params = dc.CompressorParams.random(csa, max_positions=64)
    csa_online = dc.CompressedKVCache(csa, csa_params, max_requests=1, max_seq_len=64, mtp_step=3, backend="online")
    assert csa_online.state_bytes_per_request() == csa.ring_bytes(3)


def test_rewind_below_the_banks_is_refused():
    """Banks cover the last mtp_step + 1 lengths; a chain of short rewinds that reaches below them is refused
    (StepError naming the request and the lost position), and the cache is unchanged."""
    cfg, mtp = R8, 2
    cache, model = _cache(cfg, mtp, seed=6)
    gen = torch.Generator().manual_seed(6)
    run_step(cache, model, [(0, 0, random_rows(21, cfg, gen))])  # L = 21
    run_step(cache, model, [(0, 19, random_rows(1, cfg, gen))])  # L = 20, banks hold lengths >= 19
    before = snapshot(cache)
    with pytest.raises(dc.StepError, match=r"request 0 cannot restart at 18: .*positions >= 19"):
        cache.step([0], [18], [1], random_rows(1, cfg, gen))  # 18 >= L - mtp, but the bank of 18 is gone
    assert_unchanged(cache, before, "refused rewind")
    run_step(cache, model, [(0, 19, random_rows(3, cfg, gen))])  # still usable
    check_all(cache, model)
    check_state(cache, model)


def test_prefill_launch_shape_depends_on_group_count_only(monkeypatch):
    """Non-decode steps pick (num_warps, block_t) from T // r against the SM count: a shape, never data."""
    from dsv4_compressor.kernels import online_hca

    monkeypatch.setattr(online_hca, "_sm_count", lambda device: 132)
    assert online_hca.prefill_launch_shape(8192, 128, "cuda") == (8, 32)  # 64 groups: one per SM
    assert online_hca.prefill_launch_shape(132 * 128, 128, "cuda") == (8, 32)
    assert online_hca.prefill_launch_shape(133 * 128, 128, "cuda") == (4, 16)
    assert online_hca.prefill_launch_shape(65536, 128, "cuda") == (4, 16)


def test_split_depends_on_group_count_only(monkeypatch):
    """A step given a scratch splits while it has at most 3 groups per SM (an 8K-32K chunk on the H200, not
    64K); the interpreter, with no SM count, always splits."""
    from dsv4_compressor.kernels import online_hca

    assert online_hca.splits(1 << 20, 128, "cpu")
    monkeypatch.setattr(online_hca, "_sm_count", lambda device: 132)
    assert online_hca.splits(8192, 128, "cuda") and online_hca.splits(32768, 128, "cuda")
    assert online_hca.splits(396 * 128 + 127, 128, "cuda")
    assert not online_hca.splits(397 * 128, 128, "cuda") and not online_hca.splits(65536, 128, "cuda")


@pytest.mark.parametrize(("warps", "block_t"), [(8, 32), (4, 2)])
def test_prefill_tile_shapes(warps, block_t):
    """Explicit tile shapes of the online kernel (the automatic choice's wide one, and tiles smaller than a
    group), launched through the engine path, write entries the float64 reference explains (every other pool
    byte still poison) and keep the same running state as the automatic shape up to summation order."""
    cfg = R8
    gen = torch.Generator().manual_seed(warps + block_t)
    steps = [[(0, 0, 37), (1, 0, 5)], [(0, 37, 28), (1, 5, 19)]]
    auto, model = _cache(cfg, 3)
    shaped, _ = _cache(cfg, 3)
    launch = online_launcher(shaped, num_warps=warps, block_t=block_t)
    for items in steps:
        rows = random_rows(sum(n for _, _, n in items), cfg, gen)
        run_step(auto, model, split_rows(items, rows))
        launch_step(shaped, items, rows, pad_rows=3, pad_requests=1, launch=launch)
        assert (shaped.pool.page_table == auto.pool.page_table).all()
    check_all(auto, model)
    for cache in (auto, shaped):
        check_outputs(cache, model, f"{warps} warps, {block_t}-row tiles")
        check_state(cache, model, f"{warps} warps, {block_t}-row tiles")
    torch.testing.assert_close(auto.backend.state[:2], shaped.backend.state[:2], rtol=1e-5, atol=1e-6)


def _strided_banks(cache, pad: int) -> torch.Tensor:
    """Give ``cache`` banks that are a view into padded slots (vLLM's request-scoped blocks: each slot's banks
    contiguous, slots ``banks * 3 * H + pad`` floats apart), every float poisoned; returns the whole buffer."""
    slots, banks, _, head = cache.backend.state.shape
    buffer = torch.empty(slots, banks * 3 * head + pad)
    fill_bits(buffer, POISON_F32)
    cache.backend.state = buffer[:, : banks * 3 * head].view(slots, banks, 3, head)
    assert cache.backend.state.stride(0) == banks * 3 * head + pad and not cache.backend.state.is_contiguous()
    return buffer


@pytest.mark.parametrize("pad", [1, 3 * 128 + 7])
def test_strided_banks_equal_contiguous_banks(pad):
    """Banks with a slot stride larger than ``banks * 3 * H`` (a view into padded blocks) get the bytes the
    contiguous banks get, in a program of prefill chunks (split through the scratch and not), decode and MTP
    verify with rewinds; every entry and bank is explained by the float64 model, and the padding between slots
    is never written."""
    cfg, mtp = R8, 3
    (strided, model), (dense, _) = _cache(cfg, mtp, seed=31), _cache(cfg, mtp, seed=31)
    buffer = _strided_banks(strided, pad)
    gen = torch.Generator().manual_seed(31)
    rng = random.Random(31)
    run_step([strided, dense], model, [(0, 0, 21), (2, 0, 13)], gen)
    for step in range(5):
        items = []
        for rid in (2, 0):
            length = model.length(rid)
            items.append((rid, rng.randint(max(0, length - mtp), length), mtp + 1 if step % 2 else 9))
        run_step([strided, dense], model, items, gen)
        assert first_difference(strided, dense) is None, f"step {step}: {first_difference(strided, dense)}"
        check_all(strided, model)
        check_state(strided, model, f"strided step {step}")
    assert bool((buffer[:, -pad:].view(torch.int32) == POISON_F32).all()), "the padding between slots was written"
    assert bool((buffer[1].view(torch.int32) == POISON_F32).all()), "an unused slot was written"


@pytest.mark.parametrize("bad", ["overlapping", "bank_stride", "channel_stride"])
def test_bank_strides_the_kernel_cannot_address_are_refused(bad):
    """Slots closer than ``banks * 3 * H`` (they overlap) or banks / channels not contiguous within a slot: an
    ``OpError`` naming the strides, before any launch, every buffer unchanged."""
    cfg, mtp = R8, 2
    cache, model = _cache(cfg, mtp, seed=32)
    slots, banks, _, head = cache.backend.state.shape
    flat = cache.backend.state.view(-1)
    if bad == "overlapping":
        view = flat.as_strided((slots, banks, 3, head), (banks * 3 * head - head, 3 * head, head, 1))
    elif bad == "bank_stride":
        view = flat.as_strided((slots, banks, 3, head), (banks * 3 * head, 3 * head - 1, head, 1))
    else:
        view = cache.backend.state.transpose(2, 3).contiguous().transpose(2, 3)
    cache.backend.state = view
    gen = torch.Generator().manual_seed(32)
    before = snapshot(cache)
    with pytest.raises(dc.OpError, match="state_banks .*strides"):
        cache.step([0], [0], [11], random_rows(11, cfg, gen))
    assert_unchanged(cache, before, f"refused banks ({bad})")
