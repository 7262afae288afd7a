"""The op layer on a CUDA GPU at DeepSeek-V4 shapes: a whole step (plan + 20 layers) in one CUDA graph, the
cache's graph API, torch.compile with inductor, determinism, and build_plan at large T.

Every stored entry is checked against the one-shot float64 reference (``verify``), on fresh random data, with
the pages poisoned beforehand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.inputs import random_rows
from helpers.model import StreamModel

import dsv4_compressor as dc
from dsv4_compressor.config import CompressorConfig, CompressorParams
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout
from dsv4_compressor.verify import check_indexer_fp8, check_indexer_keys, check_latent_records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEV = torch.device("cuda")
MTP = 3
S = MTP + 1
POISON = 0xA5


class Layer:
    """One layer's engine-owned buffers at real shapes (state, pages, keys, scratch) and its model."""

    def __init__(self, kind: str, seed: int, *, slots: int, online: bool = False):
        self.kind, self.online = kind, online
        self.cfg = {
            "hca": CompressorConfig.hca(),
            "csa": CompressorConfig.csa(),
            "indexer": CompressorConfig.indexer(),
        }[kind]
        cfg = self.cfg
        self.params = CompressorParams.random(cfg, max_positions=4096, seed=seed, device=DEV, norm_dtype=torch.bfloat16)
        self.page = cfg.default_page_size
        pages_per_slot = -(-(1024 // cfg.ratio) // self.page)
        self.num_pages = slots * pages_per_slot
        rng = np.random.default_rng(seed)
        self.page_of = rng.permutation(self.num_pages).reshape(slots, pages_per_slot)
        self.layout = (latent_page_layout if cfg.output == "latent" else indexer_fp8_page_layout)(cfg, self.page)
        self.pages = torch.full((self.num_pages, self.layout.bytes_per_page), POISON, dtype=torch.uint8, device=DEV)
        self.keys = None
        if kind == "indexer":
            self.keys = torch.zeros(self.num_pages * self.page, cfg.head_dim, dtype=torch.bfloat16, device=DEV)
        if online:
            self.state = torch.zeros(slots, MTP + 1, 3, cfg.head_dim, device=DEV)
        else:
            self.state = torch.zeros(slots, cfg.ring_rows(MTP), cfg.row_width, device=DEV)
        self.scratch = torch.zeros(2048, cfg.head_dim, device=DEV) if kind == "hca" and not online else None
        self.model = StreamModel(cfg, self.params.to("cpu"))
        self.gen = torch.Generator().manual_seed(seed + 1)

    def out_slot(self, slot: int, position: int) -> int:
        g = position // self.cfg.ratio
        return int(self.page_of[slot, g // self.page]) * self.page + g % self.page

    def compress(self, kv, plan, *, decode: bool) -> None:
        p = self.params
        if self.online:
            dc.ops.compress_online_hca(
                kv, plan, p.ape, p.norm_weight, p.cos, p.sin, self.state, self.pages, page_size=self.page,
                decode=decode,
            )  # fmt: skip
        else:
            dc.ops.compress(
                kv, plan, p.ape, p.norm_weight, p.cos, p.sin, self.state, self.pages, kind=self.kind,
                page_size=self.page, decode=decode, scratch=self.scratch, out_keys=self.keys,
            )  # fmt: skip

    def check(self, what: str) -> int:
        cfg, checked = self.cfg, 0
        for slot in self.model.live():
            groups = self.model.length(slot) // cfg.ratio
            if not groups:
                continue
            want = self.model.expected(slot)
            slots = torch.tensor([self.out_slot(slot, g * cfg.ratio) for g in range(groups)])
            if cfg.output == "latent":
                rep = check_latent_records(self.layout.read(self.pages, slots.to(DEV)).cpu(), want, cfg)
            else:
                keys = self.keys[slots.to(DEV)].cpu()
                rep = check_indexer_keys(keys.float(), want)
                assert rep.ok, f"{what}: {self.kind} slot {slot}: {rep}"
                rep = check_indexer_fp8(self.layout.read(self.pages, slots.to(DEV)).cpu(), keys)
            assert rep.ok, f"{what}: {self.kind} slot {slot}: {rep}"
            checked += groups
        return checked


class Step:
    """Static per-step metadata of ``B`` requests x ``S`` rows (an engine's persistent buffers)."""

    def __init__(self, requests: int, rows_per_request: int):
        self.rows = requests * rows_per_request
        self.meta = torch.zeros(3, self.rows, dtype=torch.int64, device=DEV)
        self.meta[1] = -1
        self.host = torch.zeros(3, self.rows, dtype=torch.int64).pin_memory()

    def fill(self, items, layer_for_slots: Layer) -> None:
        """``items = [(slot, start, n)]``; out slots from the layer's page map (the same for every layer of a
        ratio here: the layers share the page map's seed-independent shape, see :func:`_make_layers`)."""
        host = np.zeros((3, self.rows), dtype=np.int64)
        host[1] = -1
        t = 0
        for slot, start, n in items:
            for p in range(start, start + n):
                host[:, t] = (p, slot, layer_for_slots.out_slot(slot, p) if p % layer_for_slots.cfg.ratio ==
                              layer_for_slots.cfg.ratio - 1 else -1)  # fmt: skip
                t += 1
        self.host.copy_(torch.from_numpy(host))
        self.meta.copy_(self.host, non_blocking=True)


def _make_layers(slots: int):
    """20 layers: 7 HCA (4 online, 3 tiled ring), 7 CSA main and 6 indexer compressors. Layers of one ratio
    share their page map (one out_slot per row per ratio, as engines build it once per step)."""
    layers = []
    for i in range(7):
        layers.append(Layer("hca", 100 + i, slots=slots, online=i < 4))
    for i in range(7):
        layers.append(Layer("csa", 200 + i, slots=slots))
    for i in range(6):
        layers.append(Layer("indexer", 300 + i, slots=slots))
    maps = {128: layers[0].page_of, 4: layers[7].page_of}  # CSA and indexer pages have the same shape
    for layer in layers:
        layer.page_of = maps[layer.cfg.ratio]
    return layers


def test_whole_step_plan_and_20_layers_in_one_graph():
    slots, batch = 6, 4
    layers = _make_layers(slots)
    hca_ref, c4_ref = layers[0], layers[7]
    prompts = {0: 253, 1: 126, 2: 381, 3: 60}  # HCA groups close a few decode steps in

    # prefill, eager, one chunk per request (not a graph: an engine runs prefill eagerly too)
    items = [(slot, 0, n) for slot, n in prompts.items()]
    rows_total = sum(n for _, _, n in items)
    pre = {r: Step(len(items), max(prompts.values())) for r in (4, 128)}
    for step, ref_layer in ((pre[4], c4_ref), (pre[128], hca_ref)):
        step.fill(items, ref_layer)
    plans = {r: dc.ops.empty_plan(pre[r].rows, len(items), r, DEV) for r in (4, 128)}
    for r in (4, 128):
        meta = pre[r].meta
        dc.ops.build_plan(plans[r], meta[0], meta[1], meta[2], ratio=r, num_slots=slots)
    for layer in layers:
        rows = random_rows(rows_total, layer.cfg, layer.gen)
        padded = torch.zeros(pre[4].rows, layer.cfg.row_width)
        padded[:rows_total] = rows
        layer.compress(padded.to(DEV), plans[layer.cfg.ratio], decode=False)
        t = 0
        for slot, start, n in items:
            layer.model.apply(slot, start, rows[t : t + n])
            t += n
    torch.cuda.synchronize()
    for layer in layers:
        layer.check("prefill")

    # decode: one graph holds both plans and all 20 layers' ops
    step = {r: Step(batch, S) for r in (4, 128)}
    plans = {r: dc.ops.empty_plan(step[r].rows, batch, r, DEV) for r in (4, 128)}
    kv = [torch.zeros(step[4].rows, layer.cfg.row_width, device=DEV) for layer in layers]

    def forward():
        for r in (4, 128):
            meta = step[r].meta
            dc.ops.build_plan(plans[r], meta[0], meta[1], meta[2], ratio=r, num_slots=slots)
        for layer, rows in zip(layers, kv):
            layer.compress(rows, plans[layer.cfg.ratio], decode=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # all rows are padding: compiles, writes nothing
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    rng = np.random.default_rng(0)
    lengths = dict(prompts)
    checked = 0
    for k in range(40):
        live = sorted(rng.permutation(sorted(lengths))[: int(rng.integers(1, batch + 1))].tolist())
        items = []
        for slot in live:
            accepted = int(rng.integers(0, S))
            start = max(0, lengths[slot] - (S - 1 - accepted)) if k else lengths[slot]
            n = int(rng.integers(1, S + 1))
            items.append((slot, start, n))
            lengths[slot] = start + n
        for r, ref_layer in ((4, c4_ref), (128, hca_ref)):
            step[r].fill(items, ref_layer)
        total = sum(n for _, _, n in items)
        for layer, buf in zip(layers, kv):
            rows = random_rows(total, layer.cfg, layer.gen)
            buf[:total].copy_(rows)
            t = 0
            for slot, start, n in items:
                layer.model.apply(slot, start, rows[t : t + n])
                t += n
        graph.replay()
        if k % 8 == 7 or k == 39:
            torch.cuda.synchronize()
            checked = sum(layer.check(f"decode step {k}") for layer in layers)
    assert checked > 0
    hca_groups = sum(layer.model.length(s) // 128 for layer in layers[:7] for s in layer.model.live())
    assert hca_groups >= 7 * 6, "the schedule closed too few HCA groups to test them"


@pytest.mark.parametrize("backend", ["triton", "online"])
def test_cache_graph_api_on_gpu(backend):
    cfg = CompressorConfig.hca()
    params = CompressorParams.random(cfg, max_positions=4096, seed=5)
    cache = dc.CompressedKVCache(cfg, params, max_requests=8, max_seq_len=2048, mtp_step=MTP, backend=backend,
                                 device=DEV)  # fmt: skip
    model = StreamModel(cfg, params)
    gen = torch.Generator().manual_seed(2)
    prompts = [125, 250, 7]
    rows = random_rows(sum(prompts), cfg, gen)
    cache.step([0, 1, 2], [0, 0, 0], prompts, rows.to(DEV))
    t = 0
    for rid, n in enumerate(prompts):
        model.apply(rid, 0, rows[t : t + n])
        t += n
    graph = cache.graph(max_requests=4, rows_per_request=S)
    rng = np.random.default_rng(3)
    lengths = dict(enumerate(prompts))
    for _ in range(24):
        items = []
        for rid in sorted(lengths):
            start = max(0, lengths[rid] - int(rng.integers(0, S)))
            items.append((rid, start, S))
            lengths[rid] = start + S
        step_rows = random_rows(S * len(items), cfg, gen)
        graph.step([i for i, _, _ in items], [s for _, s, _ in items], [n for *_, n in items], step_rows.to(DEV))
        for k, (rid, start, _) in enumerate(items):
            model.apply(rid, start, step_rows[k * S : (k + 1) * S])
    checked = 0
    for rid in lengths:
        want = model.expected(rid)
        rep = check_latent_records(cache.packed_entries(rid).cpu(), want, cfg)
        assert rep.ok, f"request {rid}: {rep}"
        checked += len(want)
    assert checked >= 3, "the schedule closed too few HCA groups to test anything"
    with pytest.raises(dc.StepError, match="captured for 4 per request"):
        graph.step([0], [lengths[0]], [S + 1], random_rows(S + 1, cfg, gen).to(DEV))


def test_compile_inductor_reinplaces_the_ops_on_gpu():
    from torch._inductor.utils import run_and_get_code

    layer = Layer("csa", 7, slots=4)
    rows = random_rows(4 * S, layer.cfg, layer.gen).to(DEV)
    row_req = torch.repeat_interleave(torch.arange(4, device=DEV), S)
    positions = torch.cat([torch.arange(10 * k, 10 * k + S, device=DEV) for k in range(4)])
    out_slot = torch.where(positions % 4 == 3, positions // 4, -1)
    plan = dc.ops.empty_plan(4 * S, 4, 4, DEV)
    p = layer.params

    def layer_step(plan, positions, row_req, out_slot, rows, state, pages):
        torch.ops.dsv4c.build_plan(plan, positions, row_req, out_slot, ratio=4, num_slots=4)
        torch.ops.dsv4c.compress(rows, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages, kind="csa",
                                 page_size=64, decode=True)  # fmt: skip

    state0 = torch.randn_like(layer.state)
    eager_state, eager_pages = state0.clone(), layer.pages.clone()
    layer_step(plan.clone(), positions, row_req, out_slot, rows, eager_state, eager_pages)
    state, pages = state0.clone(), layer.pages.clone()
    compiled = torch.compile(layer_step, fullgraph=True)
    _, code = run_and_get_code(compiled, plan, positions, row_req, out_slot, rows, state, pages)
    code = "\n".join(code)
    assert "clone" not in code and "copy_" not in code, code
    assert torch.equal(state, eager_state) and torch.equal(pages, eager_pages)
    assert not torch.equal(pages, layer.pages)


def test_build_plan_large_steps_match_the_cpu_build():
    """The blocks build at T = 8192 and 65536, and at a step of each of its block shapes up to 4,096 rows
    (``blocks_config``); the GPU plan equals the numpy model of test_plan.py, with slots in ``row_req`` and with
    request indices and a ``req_state_slot`` table."""
    from test_plan import model_plan, read_plan

    rng = np.random.default_rng(11)
    steps = [(8192, 128, 3), (65536, 4, 40), (1024, 4, 256), (100, 4, 25), (256, 128, 64), (700, 4, 9)]
    steps += [(2000, 4, 256), (4096, 128, 30)]
    for rows, ratio, requests in steps:
        counts = rng.multinomial(rows - 8, np.ones(requests) / requests)
        positions, row_req = [], []
        for slot, n in enumerate(counts):
            start = int(rng.integers(0, 1000))
            positions += range(start, start + n)
            row_req += [slot] * n
        positions += [0] * 8
        row_req += [-1] * 8
        out = rng.integers(0, 1 << 30, size=rows)
        plan = dc.ops.empty_plan(rows, requests, ratio, DEV)
        t = [torch.tensor(np.asarray(a), dtype=torch.int64, device=DEV) for a in (positions, row_req, out)]
        dc.ops.build_plan(plan, *t, ratio=ratio, num_slots=requests)
        want = model_plan(np.asarray(positions), np.asarray(row_req), out, requests=requests, ratio=ratio,
                          num_slots=requests)  # fmt: skip
        got = read_plan(plan, rows, requests, ratio)
        for name, w, g in zip(("header", "requests", "rows", "closing"), want, got):
            assert np.array_equal(w, g), f"T={rows}: {name}"
        # the same step with request indices and a strided request-to-slot table (vLLM's block_table[:, 0])
        order = rng.permutation(requests)
        index_of = np.argsort(order)
        table = torch.zeros((requests, 3), dtype=torch.int32, device=DEV)
        table[:, 0] = torch.tensor(order, dtype=torch.int32)
        indices = torch.tensor([int(index_of[s]) if s >= 0 else -1 for s in row_req], dtype=torch.int64, device=DEV)
        plan.fill_(0x5A5A5A5A)
        dc.ops.build_plan(plan, t[0], indices, t[2], ratio=ratio, num_slots=requests, req_state_slot=table[:, 0])
        got = read_plan(plan, rows, requests, ratio)
        for name, w, g in zip(("header", "requests", "rows", "closing"), want, got):
            assert np.array_equal(w, g), f"T={rows}, req_state_slot: {name}"


def test_replicas_are_byte_identical():
    """Two sets of buffers fed the same rows through the same ops hold the same bytes (no atomics)."""
    layers = [[Layer(kind, 40, slots=4, online=online) for kind, online in (("hca", True), ("hca", False),
                                                                             ("csa", False), ("indexer", False))]
              for _ in range(2)]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for start, n in ((0, 300), (300, 4), (302, 4), (306, 3)):
        for r in (4, 128):
            positions = torch.cat([torch.arange(start, start + n)] * 2).to(DEV)
            row_req = torch.repeat_interleave(torch.tensor([0, 3]), n).to(DEV)
            rows = {k: random_rows(2 * n, layers[0][k].cfg, gen).to(DEV) for k in range(4)}
            for replica in layers:
                for k, layer in enumerate(replica):
                    if layer.cfg.ratio != r:
                        continue
                    out = torch.tensor([layer.out_slot(int(s), int(p)) if p % r == r - 1 else -1
                                        for s, p in zip(row_req.tolist(), positions.tolist())], device=DEV)  # fmt: skip
                    plan = dc.ops.empty_plan(2 * n, 2, r, DEV)
                    dc.ops.build_plan(plan, positions, row_req, out, ratio=r, num_slots=4)
                    layer.compress(rows[k], plan, decode=n <= S)
    torch.cuda.synchronize()
    for a, b in zip(*layers):
        assert torch.equal(a.state.view(torch.uint8), b.state.view(torch.uint8)), a.kind
        assert torch.equal(a.pages, b.pages), a.kind


def _run_pdl_schedule(pdl: bool, monkeypatch) -> list[Layer]:
    """A prefill and 12 decode steps (plans + four layers in one CUDA graph) with every kernel launched with
    or without programmatic dependent launch; returns the layers, entries checked."""
    plain = dc.ops.pdl_enabled
    monkeypatch.setattr(dc.ops, "pdl_enabled", lambda device: pdl and plain(device))
    slots = 4
    kinds = (("hca", True), ("hca", False), ("csa", False), ("indexer", False))
    layers = [Layer(kind, 60 + i, slots=slots, online=online) for i, (kind, online) in enumerate(kinds)]
    refs = {128: layers[0], 4: layers[2]}
    layers[3].page_of = layers[2].page_of
    layers[1].page_of = layers[0].page_of
    prompts = {0: 250, 1: 127, 2: 61}
    items = [(slot, 0, n) for slot, n in prompts.items()]
    pre = {r: Step(len(items), max(prompts.values())) for r in (4, 128)}
    plans = {r: dc.ops.empty_plan(pre[r].rows, len(items), r, DEV) for r in (4, 128)}
    for r in (4, 128):
        pre[r].fill(items, refs[r])
        dc.ops.build_plan(plans[r], *pre[r].meta, ratio=r, num_slots=slots)
    for layer in layers:
        rows = random_rows(pre[4].rows, layer.cfg, layer.gen)
        layer.compress(rows.to(DEV), plans[layer.cfg.ratio], decode=False)
        t = 0
        for slot, start, n in items:
            layer.model.apply(slot, start, rows[t : t + n])
            t += n
    step = {r: Step(len(prompts), S) for r in (4, 128)}
    plans = {r: dc.ops.empty_plan(step[r].rows, len(prompts), r, DEV) for r in (4, 128)}
    kv = [torch.zeros(step[4].rows, layer.cfg.row_width, device=DEV) for layer in layers]

    def forward():
        for r in (4, 128):
            dc.ops.build_plan(plans[r], *step[r].meta, ratio=r, num_slots=slots)
        for layer, rows in zip(layers, kv):
            layer.compress(rows, plans[layer.cfg.ratio], decode=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    lengths = dict(prompts)
    for k in range(12):
        items = []
        for slot in sorted(lengths):
            start = max(0, lengths[slot] - (k % S)) if k else lengths[slot]  # rewinds of 0..3 rows
            items.append((slot, start, S))
            lengths[slot] = start + S
        for r in (4, 128):
            step[r].fill(items, refs[r])
        for layer, buf in zip(layers, kv):
            rows = random_rows(step[4].rows, layer.cfg, layer.gen)
            buf.copy_(rows)
            for i, (slot, start, n) in enumerate(items):
                layer.model.apply(slot, start, rows[i * S : i * S + n])
        graph.replay()
    torch.cuda.synchronize()
    assert sum(layer.check(f"pdl={pdl}") for layer in layers) > 0
    return layers


def test_pdl_launches_write_what_plain_launches_write(monkeypatch):
    """Programmatic dependent launch (on by default on compute capability 9+) changes when a kernel starts, not
    what it writes: the same schedule, launched with and without it, verified and byte-equal in every state
    and page. The schedule closes HCA groups inside graph replays and rewinds MTP rows."""
    assert dc.ops.pdl_enabled(DEV) == (torch.cuda.get_device_capability(DEV)[0] >= 9)
    with_pdl = _run_pdl_schedule(True, monkeypatch)
    without = _run_pdl_schedule(False, monkeypatch)
    for a, b in zip(with_pdl, without):
        assert torch.equal(a.state.view(torch.uint8), b.state.view(torch.uint8)), a.kind
        assert torch.equal(a.pages, b.pages), a.kind


def _pair_call(main: Layer, indexer: Layer, kv, kv2, plan, *, decode: bool) -> None:
    p, q = main.params, indexer.params
    dc.ops.compress_pair(
        kv, plan, p.ape, p.norm_weight, p.cos, p.sin, main.state, main.pages, kv2, q.ape, q.norm_weight, q.cos,
        q.sin, indexer.state, indexer.pages, page_size=main.page, indexer_page_size=indexer.page, decode=decode,
        indexer_out_keys=indexer.keys,
    )  # fmt: skip


def test_compress_pair_in_a_graph_against_two_compresses():
    """A CSA layer's main compressor and indexer at V4 shapes: a prefill chunk, then 24 MTP decode steps (B = 16,
    S = 4, random acceptance) replayed from a CUDA graph, once through ``compress_pair`` (one launch a step) and
    once through two ``compress`` calls. Every entry checked against the float64 reference after every step;
    the main compressor's pages and state and the indexer's state byte-identical to the two calls'. The
    indexer's entries may differ at rounding boundaries: its window and norm sums run on 4 warps in the pair
    (the main's count), on 1 alone, so they add in another order; the bytes that differ are counted."""
    slots, batch = 16, 16
    pair = [Layer("csa", 500, slots=slots), Layer("indexer", 600, slots=slots)]
    apart = [Layer("csa", 500, slots=slots), Layer("indexer", 600, slots=slots)]
    for layer in (pair[1], apart[0], apart[1]):
        layer.page_of = pair[0].page_of
    prompts = {s: int(n) for s, n in enumerate(np.random.default_rng(1).integers(1, 300, size=batch))}
    items = [(slot, 0, n) for slot, n in prompts.items()]
    pre = Step(len(items), max(prompts.values()))
    pre.fill(items, pair[0])
    plan = dc.ops.empty_plan(pre.rows, len(items), 4, DEV)
    dc.ops.build_plan(plan, pre.meta[0], pre.meta[1], pre.meta[2], ratio=4, num_slots=slots)
    total = sum(prompts.values())
    rows = [random_rows(total, layer.cfg, layer.gen) for layer in pair]
    pads = [torch.zeros(pre.rows, layer.cfg.row_width, device=DEV) for layer in pair]
    for pad, r in zip(pads, rows):
        pad[:total] = r.to(DEV)
    _pair_call(*pair, *pads, plan, decode=False)
    for layer, pad in zip(apart, pads):
        layer.compress(pad, plan, decode=False)
    for layer, r in zip(pair, rows):
        t = 0
        for slot, start, n in items:
            layer.model.apply(slot, start, r[t : t + n])
            t += n

    step = Step(batch, S)
    plan = dc.ops.empty_plan(step.rows, batch, 4, DEV)
    kv = [torch.zeros(step.rows, layer.cfg.row_width, device=DEV) for layer in pair]

    def forward(two: bool):
        dc.ops.build_plan(plan, step.meta[0], step.meta[1], step.meta[2], ratio=4, num_slots=slots)
        if two:
            for layer, rows in zip(apart, kv):
                layer.compress(rows, plan, decode=True)
        else:
            _pair_call(*pair, *kv, plan, decode=True)

    graphs = []
    for two in (False, True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(two)  # all rows are padding: compiles, writes nothing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(two)
        graphs.append(graph)

    rng = np.random.default_rng(2)
    lengths, checked = dict(prompts), 0
    for k in range(24):
        items = []
        for slot in range(batch):
            accepted = int(rng.integers(0, S))
            start = max(0, lengths[slot] - (S - 1 - accepted)) if k else lengths[slot]
            items.append((slot, start, S))
            lengths[slot] = start + S
        step.fill(items, pair[0])
        for layer, buf in zip(pair, kv):
            r = random_rows(batch * S, layer.cfg, layer.gen)
            buf.copy_(r)
            t = 0
            for slot, start, n in items:
                layer.model.apply(slot, start, r[t : t + n])
                t += n
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(pair, apart):
            for name in ("pages", "state", "keys"):
                x, y = getattr(a, name), getattr(b, name)
                if x is None:
                    continue
                if a.kind == "csa" or name == "state":
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"step {k}: {a.kind} {name}"
        checked = sum(layer.check(f"decode step {k}") for layer in pair)
    assert checked >= 2 * batch * 20
    # the indexer's sums run in another order (4 warps, not 1): its bytes that differ, over the 24 steps' entries
    # (each request closes one group a step, S = r = 4: B entries of 132 record and 256 key bytes)
    idx, ref = pair[1], apart[1]
    differ = {
        n: int((getattr(idx, n).view(torch.uint8) != getattr(ref, n).view(torch.uint8)).sum())
        for n in ("pages", "keys")
    }
    written = {"pages": 24 * batch * (idx.cfg.head_dim + 4), "keys": 24 * batch * 2 * idx.cfg.head_dim}
    print(f"indexer bytes that differ from two compresses' (24 decode steps): {differ} of {written}")
    assert all(differ[n] <= 0.02 * written[n] for n in differ), (differ, written)
