"""GPU tests of the online HCA backend at DeepSeek-V4 shapes (head 512, ratio 128, mtp_step 3).

Run on a CUDA machine: ``PYTHONPATH=src python -m pytest -q tests/test_online_gpu.py``.
Checks: the running state's pooled values against float64, every stored byte explained and >= 99.5% equal to
the reference pack, hardware and exact FP8 encoders byte-identical, and CUDA graphs of decode and prefill
steps (captured once, replayed with new positions and rows) equal to eager launches.
"""

from __future__ import annotations

import random

import pytest
import torch

import dsv4_compressor as dc
from dsv4_compressor import reference as ref
from dsv4_compressor import verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HCA = dc.CompressorConfig.hca()
MTP = 3


def _cache(seed=0, max_requests=4, max_seq_len=16384, **opts):
    params = dc.CompressorParams.random(HCA, max_positions=max_seq_len, seed=seed)
    return dc.CompressedKVCache(
        HCA, params, max_requests=max_requests, max_seq_len=max_seq_len, mtp_step=MTP, backend="online",
        device="cuda", **opts,
    )  # fmt: skip


def _serve(cache, seed, requests=3, prefill_steps=4, decode_steps=12):
    """Chunked prefill then MTP decode with random acceptance; returns the current rows per request."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = {rid: torch.zeros(0, HCA.row_width, device="cuda") for rid in range(requests)}
    length = dict.fromkeys(range(requests), 0)
    for it in range(prefill_steps + decode_steps):
        ids, starts, counts, chunks = [], [], [], []
        for rid in rng.sample(range(requests), requests):
            if it < prefill_steps:
                start, n = length[rid], rng.randint(60, 700)
            else:
                start, n = rng.randint(max(0, length[rid] - MTP), length[rid]), MTP + 1
            new = torch.randn(n, HCA.row_width, device="cuda", generator=gen)
            rows[rid] = torch.cat([rows[rid][:start], new])
            length[rid] = start + n
            ids.append(rid)
            starts.append(start)
            counts.append(n)
            chunks.append(new)
        cache.step(ids, starts, counts, torch.cat(chunks))
    torch.cuda.synchronize()
    return rows


def test_entries_explained_and_mostly_exact():
    cache = _cache(seed=1)
    rows = _serve(cache, seed=1)
    total = None
    for rid, r in rows.items():
        v64 = ref.compress_sequence(r.cpu(), cache.params.to("cpu"), HCA, dtype=torch.float64)
        rep = verify.check_latent_records(cache.packed_entries(rid), v64, HCA)
        total = rep if total is None else total.merge(rep)
    assert total.total_bytes > 0
    assert total.ok, str(total)
    assert total.exact_fraction >= 0.995, str(total)


def test_running_state_pooled_values_match_float64():
    """The bank of length L holds (max, sum, weighted sum) of the partial group: a / s is the pooled value."""
    cache = _cache(seed=2)
    rows = _serve(cache, seed=2, decode_steps=5)
    backend = cache.backend
    checked = 0
    for rid, r in rows.items():
        length = cache.length(rid)
        g0 = (length // HCA.ratio) * HCA.ratio
        if length == g0:
            continue
        bank = backend.state[rid, length % backend.banks].double().cpu()
        pooled = bank[2] / bank[1]
        part = r[g0:length].double().cpu()
        positions = torch.arange(g0, length)
        gated = ref.gated_rows(part, positions, cache.params.ape.double().cpu(), HCA.width)
        want = ref.pool_windows(gated[None, :, : HCA.width], gated[None, :, HCA.width :])[0]
        # relative error as ||out - ref|| / ||ref|| (per-element ratios blow up where a channel pools to ~0)
        rel = ((pooled - want).norm() / want.norm()).item()
        worst = ((pooled - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-5 and worst < 1e-5, f"request {rid}: pooled state off by {rel:.3g} (max {worst:.3g})"
        checked += 1
    assert checked > 0


def test_hardware_and_exact_fp8_identical():
    a = _cache(seed=3)
    b = _cache(seed=3, exact_fp8=True)
    _serve(a, seed=3)
    _serve(b, seed=3)
    assert torch.equal(a.pool.pages, b.pool.pages)
    assert torch.equal(a.backend.state, b.backend.state)


def test_channel_major_decode_layout_identical():
    a = _cache(seed=4)
    b = _cache(seed=4, channel_major=True)
    _serve(a, seed=4)
    _serve(b, seed=4)
    assert torch.equal(a.pool.pages, b.pool.pages)
    assert torch.equal(a.backend.state, b.backend.state)


def _decode_desc(cache, starts, rows_per_request, batch):
    for b, s in enumerate(starts):
        cache.pool.ensure(b, (s + rows_per_request) // HCA.ratio + 1)
    return dc.build_step_descriptor(
        list(range(batch)), starts, [rows_per_request] * batch, ratio=HCA.ratio, page_table=cache.pool.page_table,
        page_size=cache.page_size, device="cuda",
    )  # fmt: skip


def _prime(cache, batch, length, seed):
    """Bring every request to ``length`` positions with real rows (so banks hold real states)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(batch * length, HCA.row_width, device="cuda", generator=gen)
    cache.step(list(range(batch)), [0] * batch, [length] * batch, kv)


@pytest.mark.parametrize("batch", [16, 64])
def test_decode_graph_replay_equals_eager(batch):
    """Capture a decode step where no request closes a group; replay on steps where some and all do."""
    s = MTP + 1
    graph_cache, eager_cache = _cache(seed=5, max_requests=batch), _cache(seed=5, max_requests=batch)
    base = 3 * HCA.ratio + 10
    _prime(graph_cache, batch, base, seed=5)
    _prime(eager_cache, batch, base, seed=5)
    static_desc = _decode_desc(graph_cache, [base] * batch, s, batch)  # rows base..base+3: no boundary
    static_kv = torch.randn(batch * s, HCA.row_width, device="cuda")
    graph_cache.backend.launch(static_desc, static_kv, decode=True)  # warm-up (compile) on the same state
    eager_cache.backend.launch(static_desc, static_kv, decode=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cache.backend.launch(static_desc, static_kv, decode=True)
    gen = torch.Generator(device="cuda").manual_seed(6)
    ends = [base + s] * batch
    closed_all = False
    for step in range(60):
        # 30 lockstep steps (step 28 closes a group for every request at once), then MTP rewinds of 0..3
        rewinds = [0] * batch if step < 30 else [(b + step) % (MTP + 1) for b in range(batch)]
        starts = [e - k for e, k in zip(ends, rewinds)]
        closed_all |= all((st + s - 1) // HCA.ratio > (st - 1) // HCA.ratio for st in starts)
        kv = torch.randn(batch * s, HCA.row_width, device="cuda", generator=gen)
        desc = _decode_desc(eager_cache, starts, s, batch)
        _decode_desc(graph_cache, starts, s, batch)
        static_desc.copy_(desc)
        static_kv.copy_(kv)
        graph.replay()
        eager_cache.backend.launch(desc, kv, decode=True)
        ends = [st + s for st in starts]
    assert closed_all
    torch.cuda.synchronize()
    assert torch.equal(graph_cache.backend.state, eager_cache.backend.state)
    assert torch.equal(graph_cache.pool.pages, eager_cache.pool.pages)
    assert (graph_cache.pool.pages != 0).any()


def test_prefill_graph_replay_equals_eager():
    """A prefill chunk of fixed size captured once, replayed for chunks at other positions (carried groups)."""
    chunk = 1000
    graph_cache, eager_cache = _cache(seed=7, max_requests=2), _cache(seed=7, max_requests=2)
    _prime(graph_cache, 2, 37, seed=7)
    _prime(eager_cache, 2, 37, seed=7)

    def desc_for(cache, start):
        for b in range(2):
            cache.pool.ensure(b, (start + chunk) // HCA.ratio + 1)
        return dc.build_step_descriptor(
            [0, 1], [start, start], [chunk, chunk], ratio=HCA.ratio, page_table=cache.pool.page_table,
            page_size=cache.page_size, device="cuda",
        )  # fmt: skip

    static_desc = desc_for(graph_cache, 37)
    static_kv = torch.randn(2 * chunk, HCA.row_width, device="cuda")
    graph_cache.backend.launch(static_desc, static_kv, decode=False)
    eager_cache.backend.launch(static_desc, static_kv, decode=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cache.backend.launch(static_desc, static_kv, decode=False)
    gen = torch.Generator(device="cuda").manual_seed(8)
    start = 37 + chunk
    for _ in range(4):
        kv = torch.randn(2 * chunk, HCA.row_width, device="cuda", generator=gen)
        desc = desc_for(eager_cache, start)
        desc_for(graph_cache, start)
        static_desc.copy_(desc)
        static_kv.copy_(kv)
        graph.replay()
        eager_cache.backend.launch(desc, kv, decode=False)
        start += chunk
    torch.cuda.synchronize()
    assert torch.equal(graph_cache.backend.state, eager_cache.backend.state)
    assert torch.equal(graph_cache.pool.pages, eager_cache.pool.pages)


@pytest.mark.parametrize("shape", [None, (4, 16)], ids=["auto", "narrow"])
def test_prefill_graph_matches_reference_entries(shape):
    """Chunks through a captured graph give the same entries as the one-shot float64 computation, with the
    automatic tile shape (this chunk: 8 warps, 32 rows) and the one chunks of more groups than SMs get."""
    chunk, start0 = 640, 100
    opts = {} if shape is None else {"num_warps": shape[0], "block_t": shape[1]}
    cache = _cache(seed=9, max_requests=1, max_seq_len=8192, **opts)
    gen = torch.Generator(device="cuda").manual_seed(9)
    rows = torch.randn(start0 + 3 * chunk, HCA.row_width, device="cuda", generator=gen)
    cache.step([0], [0], [start0], rows[:start0].clone())

    def desc_for(start):
        cache.pool.ensure(0, (start + chunk) // HCA.ratio + 1)
        return dc.build_step_descriptor(
            [0], [start], [chunk], ratio=HCA.ratio, page_table=cache.pool.page_table, page_size=cache.page_size,
            device="cuda",
        )  # fmt: skip

    static_desc = desc_for(start0)
    static_kv = rows[start0 : start0 + chunk].clone()
    graph = torch.cuda.CUDAGraph()
    cache.backend.launch(desc_for(start0), static_kv.clone(), decode=False)  # compile; same input, same state
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        cache.backend.launch(static_desc, static_kv, decode=False)
    for k in range(1, 3):
        start = start0 + k * chunk
        static_desc.copy_(desc_for(start))
        static_kv.copy_(rows[start : start + chunk])
        graph.replay()
    torch.cuda.synchronize()
    length = start0 + 3 * chunk
    v64 = ref.compress_sequence(rows[:length].cpu(), cache.params.to("cpu"), HCA, dtype=torch.float64)
    g = length // HCA.ratio
    slots = cache.pool.slots_of(0, g)
    rep = verify.check_latent_records(cache.pool.records(slots), v64, HCA)
    assert rep.ok, str(rep)
