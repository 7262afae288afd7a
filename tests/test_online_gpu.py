"""GPU tests of the online HCA backend at DeepSeek-V4 shapes (head 512, ratio 128, mtp_step 3).

Run on a CUDA machine: ``PYTHONPATH=src python -m pytest -q tests/test_online_gpu.py`` (``make test`` runs it in
its second pass, without the interpreter; with ``TRITON_INTERPRET`` set it skips).
Checks: the running state's pooled values against float64, every stored byte explained and >= 99.5% equal to
the reference pack, hardware and exact FP8 encoders byte-identical, the channel-major decode layout, and CUDA
graphs of decode steps (``backend.launch`` over static metadata and a plan) and of prefill chunks
(``cache.graph``), captured once and replayed with new positions and rows, equal to eager steps.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.buffers import launch_step, online_launcher, poison_cache, step_meta
from helpers.checks import assert_unchanged, check_all, check_outputs, first_difference, snapshot
from helpers.inputs import make_cache
from helpers.model import StreamModel, run_step, split_rows
from helpers.session import gpu_plan, interpreting

import dsv4_compressor as dc
from dsv4_compressor import reference as ref
from dsv4_compressor import verify

PLAN = gpu_plan(torch.cuda.is_available(), interpreting())
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        PLAN != "here",
        reason="needs a CUDA GPU"
        if PLAN == "none"
        else "this process runs Triton under the interpreter (TRITON_INTERPRET): run the GPU tests without it, as "
        "the second pass of make test does (python -m pytest -m gpu tests)",
    ),
]

HCA = dc.CompressorConfig.hca()
MTP = 3
DEV = torch.device("cuda", 0)


def _cache(seed=0, max_requests=4, max_seq_len=16384, **opts):
    params = dc.CompressorParams.random(HCA, max_positions=max_seq_len, seed=seed)
    cache = make_cache(HCA, params, "online", max_requests=max_requests, max_seq_len=max_seq_len, mtp_step=MTP,
                       device=DEV, **opts)  # fmt: skip
    poison_cache(cache)
    return cache


def _serve(cache, seed, requests=3, prefill_steps=4, decode_steps=12, launch=None):
    """Chunked prefill then MTP decode with random acceptance; returns the current rows per request. With
    ``launch`` the steps go through the engine path (:func:`launch_step`) with that launch instead of
    ``cache.step``."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = {rid: torch.zeros(0, HCA.row_width, device="cuda") for rid in range(requests)}
    length = dict.fromkeys(range(requests), 0)
    for it in range(prefill_steps + decode_steps):
        items, chunks = [], []
        for rid in rng.sample(range(requests), requests):
            if it < prefill_steps:
                start, n = length[rid], rng.randint(60, 700)
            else:
                start, n = rng.randint(max(0, length[rid] - MTP), length[rid]), MTP + 1
            new = torch.randn(n, HCA.row_width, device="cuda", generator=gen)
            rows[rid] = torch.cat([rows[rid][:start], new])
            length[rid] = start + n
            items.append((rid, start, n))
            chunks.append(new)
        kv = torch.cat(chunks)
        if launch is None:
            cache.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], kv)
        else:
            launch_step(cache, items, kv, launch=launch)
    torch.cuda.synchronize()
    return rows


def test_entries_explained_and_mostly_exact():
    cache = _cache(seed=1)
    rows = _serve(cache, seed=1)
    total = None
    for rid, r in rows.items():
        v64 = ref.compress_sequence(r.cpu(), cache.params.to("cpu"), HCA, dtype=torch.float64)
        assert v64.shape[0] == cache.length(rid) // HCA.ratio > 0
        rep = verify.check_latent_records(cache.packed_entries(rid).cpu(), v64, HCA)
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


def test_strided_banks_identical_to_contiguous_banks():
    """Banks that are a view into padded request blocks (vLLM's ``CircularBufferSpec`` block of the C128 state
    group: slots a whole page apart, here 32,832 floats against 6,144 of banks) get the bytes contiguous banks
    get, through prefill chunks (split through the scratch) and MTP verify steps; the padding stays poison."""
    a, b = _cache(seed=7), _cache(seed=7)
    slots, banks, _, head = b.backend.state.shape
    buffer = torch.empty(slots, 32832, device=DEV)
    buffer.view(torch.int32).fill_(0x7FC0A5A5)
    b.backend.state = buffer[:, : banks * 3 * head].view(slots, banks, 3, head)
    assert b.backend.state.stride(0) == 32832
    _serve(a, seed=7)
    _serve(b, seed=7)
    assert (a.pool.pages != 0xA5).any()
    assert first_difference(a, b) is None
    assert bool((buffer[:, banks * 3 * head :].view(torch.int32) == 0x7FC0A5A5).all())


def test_hardware_and_exact_fp8_identical():
    a = _cache(seed=3, exact_fp8=False)
    b = _cache(seed=3, exact_fp8=True)
    _serve(a, seed=3)
    _serve(b, seed=3)
    assert (a.pool.pages != 0xA5).any()
    assert first_difference(a, b) is None


def test_channel_major_decode_layout_identical():
    """The channel-major decode layout of the online kernel (``launch_online_hca(channel_major=True)``) stores
    the same bytes as the default launch."""
    a = _cache(seed=4)
    b = _cache(seed=4)
    rows = _serve(a, seed=4, launch=online_launcher(a))
    _serve(b, seed=4, launch=online_launcher(b, channel_major=True))
    assert first_difference(a, b) is None
    for rid, r in rows.items():  # and both are right: the engine path does not update the request table
        g = r.shape[0] // HCA.ratio
        v64 = ref.compress_sequence(r.cpu(), a.params.to("cpu"), HCA, dtype=torch.float64)
        rep = verify.check_latent_records(a.pool.records(a.pool.slots_of(rid, g)).cpu(), v64, HCA)
        assert rep.ok and rep.exact_fraction >= 0.995, str(rep)


def _prime(caches, model, batch, length, seed):
    """Bring every request to ``length`` positions with real rows (so banks hold real states)."""
    gen = torch.Generator().manual_seed(seed)
    run_step(caches, model, [(b, 0, length) for b in range(batch)], gen)


@pytest.mark.parametrize("batch", [16, 64])
def test_decode_graph_replay_equals_eager(batch):
    """Capture a decode step (``backend.launch`` over static metadata tensors and a plan) where no request
    closes a group; replay on steps where some and all do, with MTP rewinds; an eager cache runs ``cache.step``.
    Every entry written is checked against float64."""
    s = MTP + 1
    graph_cache, eager = _cache(seed=5, max_requests=batch), _cache(seed=5, max_requests=batch)
    model = StreamModel(HCA, graph_cache.params, MTP)
    base = 3 * HCA.ratio + 10
    _prime([graph_cache, eager], model, batch, base, seed=5)
    gen = torch.Generator().manual_seed(6)
    T = batch * s
    static_kv = torch.empty(T, HCA.row_width, device=DEV)
    static_meta = torch.empty(3, T, dtype=torch.int64, device=DEV)
    plan = graph_cache.backend.plan_buffer(T, batch)

    def fill(items):
        rows = torch.randn(T, HCA.row_width, generator=gen)
        static_meta.copy_(torch.from_numpy(step_meta(graph_cache, items)))
        static_kv.copy_(rows)
        eager.step([i[0] for i in items], [i[1] for i in items], [i[2] for i in items], rows.to(DEV))
        for rid, start, part in split_rows(items, rows):
            model.apply(rid, start, part, graph_cache.pool)

    first = [(b, base, s) for b in range(batch)]  # rows base..base+3: no boundary
    assert not any(p % HCA.ratio == HCA.ratio - 1 for p in range(base, base + s))
    fill(first)
    graph_cache.backend.launch(static_kv, *static_meta, plan, decode=True)  # the step itself, and the warm-up
    torch.cuda.synchronize()
    before = snapshot(graph_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cache.backend.launch(static_kv, *static_meta, plan, decode=True)
    torch.cuda.synchronize()
    assert_unchanged(graph_cache, before, "capturing")
    ends = [base + s] * batch
    closed_all = False
    for step in range(60):
        # 30 lockstep steps (step 28 closes a group for every request at once), then MTP rewinds of 0..3
        rewinds = [0] * batch if step < 30 else [(b + step) % (MTP + 1) for b in range(batch)]
        starts = [e - k for e, k in zip(ends, rewinds)]
        closed_all |= all((st + s - 1) // HCA.ratio > (st - 1) // HCA.ratio for st in starts)
        fill([(b, starts[b], s) for b in range(batch)])
        graph.replay()
        ends = [st + s for st in starts]
    assert closed_all
    torch.cuda.synchronize()
    assert first_difference(graph_cache, eager) is None
    check_all(eager, model, "eager")
    rep = check_outputs(graph_cache, model, "graph")
    assert rep.total_bytes > 0 and rep.exact_fraction >= 0.995, str(rep)


def test_prefill_graph_replay_equals_eager():
    """``cache.graph`` of prefill chunks (2 requests x 1000 rows) captured once, replayed for chunks at other
    positions (carried partial groups), equal to eager steps and explained against float64."""
    chunk = 1000
    graphed, eager = _cache(seed=7, max_requests=2), _cache(seed=7, max_requests=2)
    model = StreamModel(HCA, graphed.params, MTP)
    _prime([graphed, eager], model, 2, 37, seed=7)
    before = snapshot(graphed)
    graph = graphed.graph(max_requests=2, rows_per_request=chunk)
    assert not graph.decode
    torch.cuda.synchronize()
    assert_unchanged(graphed, before, "capturing")
    gen = torch.Generator().manual_seed(8)
    start = 37
    for _ in range(4):
        items = [(0, start, chunk), (1, start, chunk)]
        rows = torch.randn(2 * chunk, HCA.row_width, generator=gen)
        graph.step([0, 1], [start, start], [chunk, chunk], rows.to(DEV))
        run_step(eager, model, split_rows(items, rows))
        start += chunk
    torch.cuda.synchronize()
    assert first_difference(graphed, eager) is None
    rep = check_all(graphed, model, "prefill graph")
    assert rep.exact_fraction >= 0.995, str(rep)
    check_outputs(graphed, model, "prefill graph")


PREFILL_LAUNCHES = {
    "graph-auto": None,  # cache.graph: the cache's workspace, so split (32 channels, 128-row loads), 2 launches
    "eager-narrow": dict(num_warps=4, block_t=16),  # one launch, the shape of chunks with more groups than SMs
    "eager-wide": dict(num_warps=8, block_t=32),  # one launch, the shape of chunks of at most one group per SM
    "eager-split64": dict(split_tile=64, block_t=64),  # split, 64 channels and 64-row loads per program
}


@pytest.mark.parametrize("path", sorted(PREFILL_LAUNCHES))
def test_prefill_chunks_match_reference_entries(path):
    """Chunks give the same entries as the one-shot float64 computation: through a captured ``cache.graph``
    (split through the cache's scratch), and eagerly in one launch with either tile shape, or split with
    another channel tile."""
    chunk, start0 = 640, 100
    cache = _cache(seed=9, max_requests=1, max_seq_len=8192)
    model = StreamModel(HCA, cache.params, MTP)
    gen = torch.Generator().manual_seed(9)
    rows = torch.randn(start0 + 3 * chunk, HCA.row_width, generator=gen)
    run_step(cache, model, [(0, 0, rows[:start0])])
    graph = cache.graph(max_requests=1, rows_per_request=chunk) if path == "graph-auto" else None
    assert cache.backend.workspace is not None
    for k in range(3):
        start = start0 + k * chunk
        part = rows[start : start + chunk]
        if graph is not None:
            graph.step([0], [start], [chunk], part.to(DEV))
        else:
            launch_step(cache, [(0, start, chunk)], part, launch=online_launcher(cache, **PREFILL_LAUNCHES[path]))
        model.apply(0, start, part, cache.pool)
    torch.cuda.synchronize()
    length = start0 + 3 * chunk
    v64 = ref.compress_sequence(rows[:length], cache.params.to("cpu"), HCA, dtype=torch.float64)
    g = length // HCA.ratio
    rep = verify.check_latent_records(cache.pool.records(cache.pool.slots_of(0, g)).cpu(), v64, HCA)
    assert rep.ok, str(rep)
    rep = check_outputs(cache, model, path)
    assert rep.exact_fraction >= 0.995, str(rep)
