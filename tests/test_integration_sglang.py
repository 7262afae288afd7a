"""The SGLang adapter (``dsv4_compressor.integrations.sglang``) on SGLang-shaped buffers, against float64.

A :class:`World` holds what SGLang (0.5.23, docs/INTEGRATION.md, "SGLang 0.5.23") holds for a model of three
compressor layers, scaled down consistently (``HCA_SMALL`` r = 8 for C128 and a 32-token page for SGLang's
256-token full and SWA pages, so a compressed page still covers one full page: C4 8 slots, C128 4, indexer 8):

* ``ReqToTokenPool.req_to_token`` int32 with row 0 kept for CUDA-graph padding, position-aligned full pages
  handed out in random order (page 0 reserved), ``full_to_swa_index_mapping`` int64 onto random SWA pages;
* per layer SGLang's ``CompressStatePool.kv_score_buffer.kv_score``: flat float32 ``[size, 2 * coff * H]``
  rows of the RAW ``[kv | score]`` (C128 by request ring, 8 or 16 with MTP; C4 by SWA page with rings of 8 or
  16, or by request ring under unified KV), poisoned with a NaN;
* ``get_extra_key_buffer`` (FlashMLA pages padded past the layout) and ``get_index_k_with_scale_buffer``
  (``[P x 128 fp8][P x 4 B]``), poisoned; the C4 APE with the load-time hotfix's memory; ``freqs_cis`` complex64;
* per step, what SGLang's backend builds: ``positions`` int64, ``req_pool_indices`` repeated per token,
  ``raw_out_loc = req_to_token[req, pos]``, ``c{r}_out_loc = raw_out_loc // r`` on group ends and 0 elsewhere,
  graph batches padded with request 0 (decode / verify: ``seq_lens`` fill 1; prefill: rows past the last
  request), and for the installed path SGLang's per-request arguments of ``create_paged_compressor_data``.

Steps go through the adapter (``SGLangCompressor.metadata`` + ``forward_unified``, or ``install()`` on
stand-in SGLang classes); after every step every stored entry is checked against the one-shot float64
reference, every state row SGLang reads next (the next window, and the page tails a radix hit reads) must be
the raw row bit for bit, every state row no supplied position addresses and every page byte outside the
written records must still hold its poison, and ``kv_score`` must be unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows
from helpers.model import StreamModel
from helpers.session import interpreting

from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations import sglang as sg
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout
from dsv4_compressor.verify import ABS_TOL_RMS, check_indexer_pack, check_latent_records

POISON = 0xA5
POISON_F32 = 0x7FC0A5A5  # a NaN: a kernel reading a state row it should not turns its entry into NaN
PAGE = 32  # SGLang's full-token page and swa_page_size (256), scaled
PAGE_PAD = 64  # bytes SGLang's page buffers may have past the layout (bytes_per_page_padded); must stay poison
SLOTS = 6  # request slots, row 0 = CUDA-graph padding
MAX_CONTEXT = 96
FULL_PAGES = 12
SCRATCH_ROWS = 64  # the largest step's tokens (SGLang's limits, scaled): the scratch is sized once


def _poisoned_f32(*shape, device="cpu") -> torch.Tensor:
    return torch.full(shape, POISON_F32, dtype=torch.int32, device=device).view(torch.float32)


@contextlib.contextmanager
def _no_host_sync(device: torch.device):
    """On CUDA, any host synchronisation inside the block raises (what a captured graph would choke on)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class Mode:
    """``forward_batch.forward_mode``."""

    def __init__(self, name: str):
        self.name = name

    def is_idle(self) -> bool:
        return self.name == "idle"


class Layer:
    """One compressor as SGLang holds it: the ``Compressor`` module, its state pool, its output buffer."""

    def __init__(self, world: World, name: str, cfg, layer_id: int, *, hca: str = "ring"):
        self.world, self.name, self.cfg, self.layer_id, self.hca = world, name, cfg, layer_id, hca
        r, head, device = cfg.ratio, cfg.head_dim, world.device
        self.params = make_params(cfg, seed=layer_id + 11, max_positions=128, device=device)
        p = self.params
        overlap = cfg.overlap
        # the hotfix reorders the C4 APE's memory to [coff, r, H]; the parameter keeps its [r, coff * H] shape
        ape = p.ape.view(r, 2, head).permute(1, 0, 2).contiguous().view(r, 2 * head) if overlap else p.ape.clone()
        self.compressor = SimpleNamespace(
            ratio=r, head_dim=head, is_in_indexer=cfg.output == "indexer", rotate=cfg.output == "indexer", ape=ape,
            norm=SimpleNamespace(weight=p.norm_weight.float(), variance_epsilon=p.eps),
            freqs_cis=torch.complex(p.cos, p.sin), compute_kv_score=lambda x, fb: x,
            get_state_pool=lambda backend: SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=self.state)),
        )  # fmt: skip
        if overlap and not world.unified_kv:
            self.ring = world.ring4
            self.state = _poisoned_f32(world.swa_pages * self.ring, cfg.row_width, device=device)
        else:
            self.ring = world.ring4 if overlap else world.ring128
            self.state = _poisoned_f32(SLOTS * self.ring, cfg.row_width, device=device)
        self.page_size = PAGE // r
        if cfg.output == "indexer":
            self.layout = indexer_fp8_page_layout(cfg, self.page_size)
        else:
            self.layout = latent_page_layout(cfg, self.page_size)
        shape = (FULL_PAGES, self.layout.bytes_per_page + PAGE_PAD)
        self.memory = torch.full(shape, POISON, dtype=torch.uint8, device=device)
        self.model = StreamModel(cfg, p)
        self.written: set[int] = set()  # compressed slots some step wrote (drafts later rejected included)
        self.addressed: set[int] = set()  # state rows some supplied (request, position) maps to

    @property
    def kind(self) -> str:
        return "indexer" if self.cfg.output == "indexer" else ("csa" if self.cfg.overlap else "hca")

    def state_rows(self, slot: int, q) -> torch.Tensor:
        """SGLang's state row of positions ``q`` of request slot ``slot`` (compressor_v2 / c_plan.cuh)."""
        q = torch.as_tensor(q, dtype=torch.int64)
        w = self.world
        if self.cfg.overlap and not w.unified_kv:
            m = w.full_to_swa.cpu()[w.req_to_token.cpu()[slot, q].long()]
            return (m // PAGE) * self.ring + m % self.ring
        return slot * self.ring + q % self.ring

    # -- checks -------------------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        self.check_entries(what)
        for slot in self.model.live():
            if self.hca == "online" and self.kind == "hca":
                continue
            self._check_state(what, slot, self.model.length(slot))
        self._check_untouched(what)

    def check_entries(self, what: str, expected=None, abs_tol: float = ABS_TOL_RMS) -> None:
        """Every stored entry of every live request against ``expected(slot)`` (float64 ``[L // r, H]``; default
        the model's one-shot reference over its rows), with the checks' floor ``abs_tol`` (``verify``)."""
        cfg, r, w = self.cfg, self.cfg.ratio, self.world
        expected = self.model.expected if expected is None else expected
        pages = self.memory.cpu()[:, : self.layout.bytes_per_page]
        req_to_token = w.req_to_token.cpu()
        for slot in self.model.live():
            groups = self.model.length(slot) // r
            if not groups:
                continue
            ends = torch.arange(groups) * r + r - 1
            slots = req_to_token[slot, ends].long() // r  # where SGLang's c{r}_out_loc put them
            got = self.layout.read(pages, slots)
            want = expected(slot)
            if cfg.output == "indexer":
                rep = check_indexer_pack(got, want, "hadamard_f32", abs_tol=abs_tol)
            else:
                rep = check_latent_records(got, want, cfg, abs_tol=abs_tol)
            assert rep.ok, f"{what}: {self.name} slot {slot}: {rep}"

    def live_positions(self, length: int) -> list[int]:
        """The positions of a request of ``length`` committed rows whose raw state rows a later step may read:
        every position the next step's windows may read (it starts anywhere in ``[L - mtp, L]``), and for C4 by
        SWA page each complete page's last 4 positions (a radix hit there). SGLang's own path also leaves the
        rows of closed groups in the ring; no step reads them."""
        cfg, r, mtp = self.cfg, self.cfg.ratio, self.world.draft_tokens - 1
        low = max(0, length - mtp)
        lo = max(0, (low // r - (1 if cfg.overlap else 0)) * r)
        positions = list(range(lo, length))
        if cfg.overlap and not self.world.unified_kv:
            for end in range(PAGE, length + 1, PAGE):
                positions += [q for q in range(end - sg.C4_PAGE_TAIL, end) if q < lo]
        return positions

    def _check_state(self, what: str, slot: int, length: int) -> None:
        """Bit for bit the raw rows of :meth:`live_positions`."""
        positions = self.live_positions(length)
        if not positions:
            return
        q = torch.tensor(positions)
        got = self.state.cpu()[self.state_rows(slot, q)].view(torch.int32)
        want = self.model.rows[slot][q].view(torch.int32)
        bad = q[(got != want).any(dim=1)].tolist()
        assert not bad, f"{what}: {self.name} slot {slot}: state rows of positions {bad} are not the raw rows"

    def _check_untouched(self, what: str, used_slots=None) -> None:
        """No page byte outside the written records; no state row written that no supplied position addresses,
        or, with ``used_slots`` (the online HCA layer, whose state is its banks in the pool), no pool row of a
        request slot outside ``used_slots`` (``ring`` rows a slot)."""
        memory = self.memory.cpu()
        keep = torch.zeros_like(memory, dtype=torch.bool)
        if self.written:
            idx = self.layout._byte_index(torch.tensor(sorted(self.written)))
            page, off = idx // self.layout.bytes_per_page, idx % self.layout.bytes_per_page
            keep.view(-1)[(page * memory.shape[1] + off).reshape(-1)] = True
        stray = (memory != POISON) & ~keep
        assert not stray.any(), f"{what}: {self.name}: {int(stray.sum())} page bytes written outside the records"
        rows = torch.ones(self.state.shape[0], dtype=torch.bool)
        if used_slots is not None:
            for slot in used_slots:
                rows[slot * self.ring : (slot + 1) * self.ring] = False
        elif self.hca != "online" or self.kind != "hca":
            rows[sorted(self.addressed)] = False
        poisoned = (self.state.cpu()[rows].view(torch.int32) == POISON_F32).all()
        whose = "of request slots no step used" if used_slots is not None else "no supplied position addresses"
        assert poisoned, f"{what}: {self.name}: state rows {whose} were written"


class World:
    """SGLang's pools and per-step metadata for a model of an HCA, a CSA and its indexer compressor (plus an
    online HCA layer); see the module docstring."""

    def __init__(
        self, *, draft_tokens: int, seed: int, unified_kv: bool = False, hca_layers=("ring", "online"), device="cpu"
    ):
        self.draft_tokens, self.unified_kv, self.device = draft_tokens, unified_kv, torch.device(device)
        spec = draft_tokens > 1
        self.ring4 = 16 if spec else 8  # SGLang's C4 ring
        self.ring128 = 2 * HCA_SMALL.ratio if spec else HCA_SMALL.ratio  # get_ring_size(128): 128, 256 with MTP
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.req_to_token = torch.zeros(SLOTS, MAX_CONTEXT, dtype=torch.int32, device=device)  # row 0: padding
        self.free_pages = [int(p) for p in self.rng.permutation(np.arange(1, FULL_PAGES))]  # page 0: dummy token 0
        self.swa_pages = FULL_PAGES
        swa_of_page = np.concatenate([[0], 1 + self.rng.permutation(FULL_PAGES - 1)])
        full = np.arange(FULL_PAGES * PAGE)
        swa = swa_of_page[full // PAGE] * PAGE + full % PAGE
        self.full_to_swa = torch.tensor(swa, dtype=torch.int64, device=device)
        self.pages: dict[int, list[int]] = {}
        self.layers = [Layer(self, f"hca_{h}", HCA_SMALL, k, hca=h) for k, h in enumerate(hca_layers)]
        self.layers += [Layer(self, "csa", CSA_SMALL, 10), Layer(self, "indexer", INDEXER_CFG, 10)]
        self.pool = SimpleNamespace(
            swa_page_size=PAGE, _unified_kv=unified_kv, full_to_swa_index_mapping=self.full_to_swa,
            get_ring_size=lambda compress_ratio: self.ring4 if compress_ratio == 4 else self.ring128,
            get_extra_key_buffer=lambda layer_id: self._layer(layer_id, False).memory,
            get_extra_key_page_size=lambda layer_id: self._layer(layer_id, False).page_size,
            get_index_k_with_scale_buffer=lambda layer_id: self._layer(layer_id, True).memory,
            get_index_k_page_size=lambda compress_ratio: PAGE // compress_ratio,
        )  # fmt: skip
        self.adapters = {h: sg.SGLangCompressor(draft_tokens=draft_tokens, hca=h, unified_kv=unified_kv,
                                                scratch_rows=SCRATCH_ROWS) for h in ("ring", "online")}  # fmt: skip
        self.captured: dict[tuple, SimpleNamespace] = {}  # (mode, T, bs) -> the graph's static metadata
        self.lengths: dict[int, int] = {}

    def _layer(self, layer_id: int, indexer: bool) -> Layer:
        return next(x for x in self.layers if x.layer_id == layer_id and (x.kind == "indexer") == indexer)

    # -- scheduler side -----------------------------------------------------------------------------------------
    def reserve(self, slot: int, end: int) -> None:
        """Position-aligned full pages for positions ``< end`` of ``slot`` (SGLang's paged allocator)."""
        pages = self.pages.setdefault(slot, [])
        while len(pages) * PAGE < end:
            page = self.free_pages.pop()
            first = len(pages) * PAGE
            self.req_to_token[slot, first : first + PAGE] = torch.arange(PAGE, device=self.device) + page * PAGE
            pages.append(page)

    def share_prefix(self, src: int, dst: int, tokens: int) -> None:
        """A radix-cache hit: ``dst`` starts with ``src``'s first ``tokens`` (whole pages) token slots."""
        assert tokens % PAGE == 0
        self.pages[dst] = list(self.pages[src][: tokens // PAGE])
        self.req_to_token[dst, :tokens] = self.req_to_token[src, :tokens]
        for layer in self.layers:
            layer.model.apply(dst, 0, layer.model.rows[src][:tokens])
        self.lengths[dst] = tokens

    # -- one forward --------------------------------------------------------------------------------------------
    def step(self, items, mode: str, *, bs: int | None = None, tokens: int | None = None, path: str = "direct"):
        """``items = [(slot, start, n)]``; ``mode``: ``prefill``, ``verify`` (``n`` = E) or ``decode``; ``bs`` /
        ``tokens``: the graph's padded batch (verify / decode) or padded token count (prefill)."""
        bs = len(items) if bs is None else bs
        positions, req, raw_out_loc, rows = self.inputs(items, mode, bs, tokens)
        fb = SimpleNamespace(forward_mode=Mode(mode), positions=positions)
        if path == "direct":
            with _no_host_sync(self.device):
                metadata = self._direct_metadata(mode, positions, req, raw_out_loc, bs)
            self.run_layers(metadata, fb, rows)
        else:
            self._installed_step(items, mode, bs, positions, raw_out_loc, fb, rows)
        self._record(items, rows)

    def inputs(self, items, mode: str, bs: int, tokens: int | None = None):
        """The step's per-token tensors as SGLang's backend has them, and each layer's ``kv_score`` rows."""
        e = self.draft_tokens
        for slot, start, n in items:
            self.reserve(slot, start + n)
        positions, req = [], []
        for slot, start, n in items:
            positions += list(range(start, start + n))
            req += [slot] * n
        if mode == "prefill":
            pad = (tokens or len(positions)) - len(positions)
            positions += [0] * pad  # SGLang pads prefill graphs with rows of request 0 at position 0
            req += [0] * pad
        else:
            per = e if mode == "verify" else 1
            for _ in range(bs - len(items)):  # padded requests: seq_lens fill 1, request 0
                positions += list(range(1, 1 + per)) if mode == "verify" else [0]
                req += [0] * per
        positions = torch.tensor(positions, dtype=torch.int64, device=self.device)
        req = torch.tensor(req, dtype=torch.int64, device=self.device)
        raw_out_loc = self.req_to_token[req, positions].long()  # out_cache_loc (0 for padding: req_to_token[0])
        rows = {}
        for layer in self.layers:
            chunks = [random_rows(n, layer.cfg, self.gen) for _, _, n in items]
            chunks.append(random_rows(positions.shape[0] - sum(n for _, _, n in items), layer.cfg, self.gen))
            rows[layer.name] = torch.cat(chunks).to(self.device)
        return positions, req, raw_out_loc, rows

    def run_layers(self, metadata, fb, rows, *, check_inputs: bool = True) -> None:
        """Every layer's ``forward_unified`` (the C4 indexer after its main compressor, on the same metadata)."""
        backend = SimpleNamespace(token_to_kv_pool=self.pool, forward_metadata=metadata)
        inputs = {name: x.clone() for name, x in rows.items()} if check_inputs else rows
        with _no_host_sync(self.device):
            for layer in self.layers:
                adapter = self.adapters[layer.hca]
                adapter.forward_unified(backend, inputs[layer.name], fb, layer.layer_id, layer.compressor)
        if check_inputs:
            for name, x in rows.items():
                assert torch.equal(inputs[name].view(torch.int32), x.view(torch.int32)), f"{name}: kv_score written"

    def build_metadata(self, mode, positions, req, raw_out_loc, bs) -> SimpleNamespace:
        """What the backend builds once per step: c{r}_out_loc the SGLang way (``raw_out_loc // r`` on group
        ends, 0 elsewhere), then the adapter's metadata per ratio (shared by every layer of that ratio)."""
        seq_lens_casual = positions + 1
        built = {}
        for ratio, ring in ((4, self.ring4), (HCA_SMALL.ratio, self.ring128)):
            out_loc = torch.where(seq_lens_casual % ratio == 0, raw_out_loc // ratio, 0)
            built[ratio] = self.adapters["ring"].metadata(
                ratio, positions=positions, req_pool_indices=req, out_loc=out_loc, req_to_token=self.req_to_token,
                full_to_swa_index_mapping=self.full_to_swa, swa_page_size=PAGE, ring=ring, decode=mode != "prefill",
                num_requests=bs, unified_kv=self.unified_kv,
            )  # fmt: skip
        return SimpleNamespace(c4_compress_metadata=built[4], c8_compress_metadata=built[HCA_SMALL.ratio])

    def _direct_metadata(self, mode, positions, req, raw_out_loc, bs):
        """:meth:`build_metadata`; verify / decode steps replay a graph: the first step of a shape is its
        capture, later ones refresh it with ``copy_`` (DSV4Metadata.copy_ -> maybe_copy_inplace)."""
        fresh = self.build_metadata(mode, positions, req, raw_out_loc, bs)
        if mode == "prefill":
            return fresh
        key = (mode, positions.shape[0], bs)
        static = self.captured.setdefault(key, fresh)
        if static is not fresh:
            before = static.c4_compress_metadata.plan.data_ptr()
            static.c4_compress_metadata.copy_(fresh.c4_compress_metadata)
            static.c8_compress_metadata.copy_(fresh.c8_compress_metadata)
            assert static.c4_compress_metadata.plan.data_ptr() == before  # refreshed in place, as a graph needs
        return static

    def _installed_step(self, items, mode, bs, positions, raw_out_loc, fb, rows):
        """SGLang's own calls: the backend's metadata builder (calling ``create_paged_compressor_data`` with
        SGLang's per-request arguments), then ``forward_core_compressor`` / ``forward_indexer_compressor``."""
        backend = self.backend
        e = self.draft_tokens
        req_pool_indices = [s for s, _, _ in items] + [0] * (bs - len(items))
        req_pool_indices = torch.tensor(req_pool_indices, dtype=torch.int64, device=self.device)
        if mode == "prefill":
            seq_lens = torch.tensor([s + n for _, s, n in items], dtype=torch.int64, device=self.device)
            extend = [n for _, _, n in items]
            backend.init_forward_metadata_prefill(
                req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=[s + n for _, s, n in items],
                extend_seq_lens=torch.tensor(extend, dtype=torch.int32, device=self.device), extend_seq_lens_cpu=extend,
                out_cache_loc=raw_out_loc, num_tokens=positions.shape[0],
            )  # fmt: skip
        else:
            if mode == "verify":  # committed lengths; padding: SGLang's fill value 1
                seq = [s for _, s, _ in items] + [1] * (bs - len(items))
            else:  # decode seq_lens include the new token (padding: 1, position 0)
                seq = [s + 1 for _, s, _ in items] + [1] * (bs - len(items))
            seq_lens = torch.tensor(seq, dtype=torch.int64, device=self.device)
            raw = SimpleNamespace(req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=raw_out_loc)
            if mode == "verify":
                raw.extend_seq_lens = torch.full((bs,), e, dtype=torch.int32, device=self.device)
            backend.init_forward_metadata_in_graph(raw, verify=mode == "verify")
        for layer in self.layers:
            call = backend.forward_indexer_compressor if layer.kind == "indexer" else backend.forward_core_compressor
            call(rows[layer.name].clone(), fb, layer.layer_id, layer.compressor)

    def _record(self, items, rows) -> None:
        row = 0
        for slot, start, n in items:
            for layer in self.layers:
                r = layer.cfg.ratio
                mine = rows[layer.name][row : row + n]
                layer.model.apply(slot, start, mine)
                q = torch.arange(start, start + n)
                layer.addressed.update(layer.state_rows(slot, q).tolist())
                ends = q[q % r == r - 1]
                layer.written.update((self.req_to_token.cpu()[slot, ends].long() // r).tolist())
            row += n
            self.lengths[slot] = start + n

    def check(self, what: str) -> None:
        for layer in self.layers:
            layer.check(what)

    def verify_steps(self, slots, count: int, *, bs: int, path: str = "direct", accepted=None) -> None:
        """MTP target-verify: each request brings E rows at its committed length; a random number of them is
        accepted (1..E) and the next step starts there (SGLang advances seq_lens; nothing is rolled back)."""
        e = self.draft_tokens
        committed = {s: self.lengths[s] for s in slots}
        for k in range(count):
            items = [(s, committed[s], e) for s in slots]
            self.step(items, "verify", bs=bs, path=path)
            self.check(f"verify {k} {items}")
            for s in slots:
                committed[s] += int(self.rng.integers(1, e + 1)) if accepted is None else accepted
        for s in slots:
            self.lengths[s] = committed[s]

    def verify_in_graph(self, slots, count: int, *, bs: int) -> None:
        """As :meth:`verify_steps`, but every step replays one CUDA graph that holds the metadata build of both
        ratios and every layer's call (SGLang's in-graph metadata, ``init_forward_metadata_in_graph``): the step's
        inputs are copied into the graph's static buffers, nothing else changes between replays."""
        e = self.draft_tokens
        committed = {s: self.lengths[s] for s in slots}
        graph = static = None
        for k in range(count):
            items = [(s, committed[s], e) for s in slots]
            positions, req, raw_out_loc, rows = self.inputs(items, "verify", bs)
            if static is None:
                static = SimpleNamespace(positions=positions, req=req, raw=raw_out_loc, rows=rows)
                static.rows = {name: x.clone() for name, x in rows.items()}
                fb = SimpleNamespace(forward_mode=Mode("verify"), positions=static.positions)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # recorded, not run: the replay below runs step k
                    metadata = self.build_metadata("verify", static.positions, static.req, static.raw, bs)
                    self.run_layers(metadata, fb, static.rows, check_inputs=False)
            else:
                for dst, src in ((static.positions, positions), (static.req, req), (static.raw, raw_out_loc)):
                    dst.copy_(src)
                for name, x in rows.items():
                    static.rows[name].copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            for name, x in rows.items():
                assert torch.equal(static.rows[name].view(torch.int32), x.view(torch.int32)), f"{name} written"
            self._record(items, rows)
            self.check(f"graph verify {k} {items}")
            for s in slots:
                committed[s] += int(self.rng.integers(1, e + 1))
        for s in slots:
            self.lengths[s] = committed[s]


# ---------------------------------------------------------------------------------------------------------------
# Through the adapter's per-step metadata and forward_unified
# ---------------------------------------------------------------------------------------------------------------
def test_sglang_chunked_prefill_mtp_verify_prefix_reuse_padded_graphs():
    """E = 3 draft tokens (C4 ring 16, C128 ring 2r): chunked prefill (a padded prefill graph, a chunk across a
    page), MTP verify in a padded decode graph (replayed through ``copy_``) with random acceptance, a radix hit
    on a 32-token SWA page boundary (only the page's 4 tail rows were kept), then verify with the new request."""
    w = World(draft_tokens=3, seed=1, hca_layers=("ring",))
    w.step([(1, 0, 14), (2, 0, 7)], "prefill", tokens=24)
    w.check("prefill 1")
    w.step([(1, 14, 22), (3, 0, 5)], "prefill")
    w.check("prefill 2")
    w.verify_steps([1, 2, 3], 2, bs=4)
    w.share_prefix(1, 4, PAGE)
    w.step([(4, PAGE, 6)], "prefill")
    w.check("prefix reuse")
    w.verify_steps([1, 2, 3, 4], 1, bs=4)


def test_sglang_decode_without_speculation_and_prefix_reuse():
    """No MTP (C4 ring 8 per 32-position page, so rows alias; C128 ring r; online banks 1 deep): plain decode
    steps in a padded decode graph, and a radix hit that reads the 4 page-tail rows of a page its owner has long
    left (the online HCA layer starts it from NaN banks: a page boundary needs none)."""
    w = World(draft_tokens=1, seed=2)
    w.step([(1, 0, 37)], "prefill")
    w.check("prefill")
    w.share_prefix(1, 2, PAGE)
    w.step([(2, PAGE, 3)], "prefill")
    w.check("prefix reuse")
    for k in range(3):
        w.step([(1, w.lengths[1], 1), (2, w.lengths[2], 1)], "decode", bs=3)
        w.check(f"decode {k}")


# ---------------------------------------------------------------------------------------------------------------
# install() against stand-ins of SGLang's classes
# ---------------------------------------------------------------------------------------------------------------
def _stand_in_sglang():
    """``compressor_v2`` and ``deepseek_v4_backend`` as far as install() touches them: the mixin with its two
    aliases, the planner (the backend module imports it by name), ``DSV4Metadata.copy_`` through
    ``maybe_copy_inplace``, the backend's metadata builders calling the planner as SGLang's do."""
    cv2 = ModuleType("stand_in.compressor_v2")
    backend_mod = ModuleType("stand_in.deepseek_v4_backend")

    class CompressorBackendMixin:
        def forward_unified(self, x, forward_batch, layer_id, compressor):
            raise AssertionError("SGLang's own forward_unified ran")

        forward_indexer_compressor = forward_unified
        forward_core_compressor = forward_unified

    def create_paged_compressor_data(compress_ratio, *, is_prefill, token_to_kv_pool, req_to_token,
                                     req_pool_indices, seq_lens, **kwargs):  # fmt: skip
        raise AssertionError("SGLang's own planner ran")

    def maybe_copy_inplace(dst, *, src):
        assert type(src) is type(dst)
        if dst is not None:
            dst.copy_(src)

    class DSV4Metadata:
        def __init__(self, c4, c128):
            self.c4_compress_metadata, self.c8_compress_metadata = c4, c128

        def copy_(self, other):
            maybe_copy_inplace(self.c4_compress_metadata, src=other.c4_compress_metadata)
            maybe_copy_inplace(self.c8_compress_metadata, src=other.c8_compress_metadata)

    class DeepseekV4AttnBackend(CompressorBackendMixin):
        def __init__(self, world: World):
            self.token_to_kv_pool = world.pool
            self.req_to_token = world.req_to_token
            self.speculative_num_draft_tokens = world.draft_tokens if world.draft_tokens > 1 else None
            self.forward_metadata = None
            self.graphs: dict[tuple, DSV4Metadata] = {}

        def _create(self, **kwargs):
            create = backend_mod.create_paged_compressor_data  # a module global, as in SGLang
            common = dict(token_to_kv_pool=self.token_to_kv_pool, req_to_token=self.req_to_token, **kwargs)
            return DSV4Metadata(create(4, **common), create(HCA_SMALL.ratio, **common))

        def init_forward_metadata_prefill(self, *, req_pool_indices, seq_lens, seq_lens_cpu, extend_seq_lens,
                                          extend_seq_lens_cpu, out_cache_loc, num_tokens):  # fmt: skip
            graph = num_tokens != sum(extend_seq_lens_cpu)  # a padded prefill graph plans on the device
            self.forward_metadata = self._create(
                is_prefill=True, req_pool_indices=req_pool_indices, seq_lens=seq_lens, extend_lens=extend_seq_lens,
                seq_lens_cpu=None if graph else seq_lens_cpu, extend_lens_cpu=None if graph else extend_seq_lens_cpu,
                use_prefill_cuda_graph=graph, num_q_tokens=out_cache_loc.shape[0] if graph else None,
            )  # fmt: skip

        def make_forward_metadata_from_raw_verify(self, raw):
            e = self.speculative_num_draft_tokens
            return self._create(
                is_prefill=True, req_pool_indices=raw.req_pool_indices, seq_lens=raw.seq_lens + e,
                extend_lens=raw.extend_seq_lens, seq_lens_cpu=None, extend_lens_cpu=None, use_prefill_cuda_graph=True,
                num_q_tokens=e * raw.req_pool_indices.shape[0],
            )  # fmt: skip

        def make_forward_metadata_from_raw_decode(self, raw):
            return self._create(is_prefill=False, req_pool_indices=raw.req_pool_indices, seq_lens=raw.seq_lens)

        def init_forward_metadata_in_graph(self, raw, *, verify: bool):
            build = self.make_forward_metadata_from_raw_verify if verify else self.make_forward_metadata_from_raw_decode
            fresh = build(raw)
            key = (verify, raw.req_pool_indices.shape[0])
            static = self.graphs.setdefault(key, fresh)
            if static is not fresh:
                static.copy_(fresh)  # replay: the captured metadata refreshed in place
            self.forward_metadata = static

    cv2.CompressorBackendMixin = CompressorBackendMixin
    cv2.create_paged_compressor_data = create_paged_compressor_data
    cv2._use_online_compress = lambda ratio: False
    backend_mod.create_paged_compressor_data = create_paged_compressor_data
    backend_mod.DeepseekV4AttnBackend = DeepseekV4AttnBackend
    backend_mod.DSV4Metadata = DSV4Metadata
    return {"compressor_v2": cv2, "deepseek_v4_backend": backend_mod}


@contextlib.contextmanager
def _installed(mods, **options):
    sg.install(modules=mods, **options)
    try:
        yield
    finally:
        sg.uninstall()


def test_install_patches_stand_in_sglang_and_runs_its_calls():
    """install() on stand-ins: SGLang's builders and per-layer aliases reach the adapter (the planner imported
    by name in the backend module included), target-verify plans are decode plans, metadata replays through
    DSV4Metadata.copy_; C4 state by request ring (unified
    KV); uninstall() restores every original."""
    mods = _stand_in_sglang()
    cv2, backend_mod = mods["compressor_v2"], mods["deepseek_v4_backend"]
    mixin = cv2.CompressorBackendMixin
    originals = {name: mixin.__dict__[name] for name in ("forward_unified", "forward_core_compressor")}
    planner = cv2.create_paged_compressor_data
    verify_builder = backend_mod.DeepseekV4AttnBackend.__dict__["make_forward_metadata_from_raw_verify"]
    w = World(draft_tokens=3, seed=3, unified_kv=True, hca_layers=("ring",))
    with _installed(mods):
        assert sg.installed()
        assert backend_mod.create_paged_compressor_data is cv2.create_paged_compressor_data is not planner
        assert mixin.forward_core_compressor is mixin.forward_indexer_compressor is mixin.forward_unified
        with pytest.raises(RuntimeError, match="already installed"):
            sg.install(modules=mods, hca="ring")
        w.backend = backend_mod.DeepseekV4AttnBackend(w)
        w.step([(1, 0, 11), (2, 0, 5)], "prefill", path="installed", tokens=20)
        w.check("installed prefill (graph)")
        assert not w.backend.forward_metadata.c4_compress_metadata.decode
        w.step([(1, 11, 6), (3, 0, 3)], "prefill", path="installed")
        w.check("installed prefill (eager)")
        w.verify_steps([1, 2, 3], 2, bs=4, path="installed")
        meta = w.backend.forward_metadata
        assert meta.c4_compress_metadata.decode and meta.c4_compress_metadata.addressing == "req_ring"
        assert meta.c8_compress_metadata.decode
    assert not sg.installed()
    assert {n: mixin.__dict__[n] for n in originals} == originals
    assert backend_mod.create_paged_compressor_data is planner is cv2.create_paged_compressor_data
    assert backend_mod.DeepseekV4AttnBackend.__dict__["make_forward_metadata_from_raw_verify"] is verify_builder


def test_planner_derives_what_sglang_builds_per_token():
    """``create_paged_compressor_data`` (SGLang's per-request arguments) plans byte for byte what
    ``metadata`` plans from the per-token tensors SGLang's backend builds (positions, req_pool_indices repeated,
    c{r}_out_loc), for a padded prefill graph, an eager prefill, a padded verify graph and a decode graph."""
    w = World(draft_tokens=3, seed=4, hca_layers=("ring",))
    adapter = sg.SGLangCompressor(draft_tokens=3)
    w.reserve(1, 40)
    w.reserve(2, 20)
    w.reserve(3, 9)
    cases = [
        ("prefill", [(1, 0, 13), (2, 4, 9)], 26),  # a padded prefill graph: 4 rows past the last request
        ("prefill", [(1, 30, 7), (3, 0, 9)], None),
        ("verify", [(1, 21, 3), (2, 17, 3)], 4),
        ("decode", [(3, 8, 1), (1, 33, 1)], 3),
    ]
    for mode, items, pad in cases:
        positions, req = [], []
        for slot, start, n in items:
            positions += list(range(start, start + n))
            req += [slot] * n
        bs = len(items) if mode == "prefill" else pad
        requests = min(pad, SLOTS) if mode == "prefill" and pad else bs  # a prefill graph: plan shape by T only
        rid = torch.tensor([s for s, _, _ in items] + [0] * (bs - len(items)))
        if mode == "prefill":
            positions += [0] * ((pad or len(positions)) - len(positions))
            req += [0] * (len(positions) - len(req))
            starts, ext = torch.tensor([s for _, s, _ in items]), torch.tensor([n for _, _, n in items])
            kwargs = dict(is_prefill=True, seq_lens=starts + ext, extend_lens=ext.int())
            graph = dict(num_q_tokens=pad, use_prefill_cuda_graph=True)
            kwargs.update(graph if pad else dict(extend_lens_cpu=ext.tolist()))
        else:
            per = 3 if mode == "verify" else 1
            for _ in range(bs - len(items)):
                positions += list(range(1, 1 + per)) if per > 1 else [0]
                req += [0] * per
            fill = 1 if mode == "verify" else 0  # padded requests: seq_lens 1 (verify: committed; decode: with the row)
            starts = torch.tensor([s for _, s, _ in items] + [fill] * (bs - len(items)))
            if mode == "verify":
                kwargs = dict(is_prefill=True, seq_lens=starts + 3, extend_lens=torch.full((bs,), 3),
                              num_q_tokens=3 * bs)  # fmt: skip
            else:
                kwargs = dict(is_prefill=False, seq_lens=starts + 1)
        positions, req = torch.tensor(positions), torch.tensor(req)
        raw = w.req_to_token[req, positions].long()
        for ratio, ring in ((4, w.ring4), (HCA_SMALL.ratio, w.ring128)):
            out_loc = torch.where((positions + 1) % ratio == 0, raw // ratio, 0)
            want = adapter.metadata(
                ratio, positions=positions, req_pool_indices=req, out_loc=out_loc, req_to_token=w.req_to_token,
                full_to_swa_index_mapping=w.full_to_swa, swa_page_size=PAGE, ring=ring, decode=mode != "prefill",
                num_requests=requests,
            )  # fmt: skip
            with sg.verify_step() if mode == "verify" else contextlib.nullcontext():
                got = adapter.create_paged_compressor_data(
                    ratio, token_to_kv_pool=w.pool, req_to_token=w.req_to_token, req_pool_indices=rid, **kwargs
                )
            what = f"{mode} {items} ratio {ratio}"
            assert (got.decode, got.addressing, got.num_tokens) == (want.decode, want.addressing, want.num_tokens)
            assert torch.equal(got.plan, want.plan), what
            if want.read_rows is not None:
                assert torch.equal(got.read_rows, want.read_rows) and torch.equal(got.save_rows, want.save_rows), what


def test_install_without_sglang_says_so(monkeypatch):
    for name in ["sglang", *sg.MODULES.values()]:  # importing sglang now fails, whatever is installed or loaded
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(sg.SGLangNotInstalled, match="sglang.srt.layers.attention.dsv4.compressor_v2"):
        sg.install()
    assert not sg.installed()
    assert issubclass(sg.SGLangNotInstalled, ImportError)
    with pytest.raises(ValueError, match="hca"):
        sg.install(hca="tiled", modules=_stand_in_sglang())
    mods = _stand_in_sglang()
    mods["compressor_v2"]._use_online_compress = lambda ratio: ratio == 128
    with pytest.raises(sg.SGLangModeNotSupported, match="SGLANG_OPT_USE_ONLINE_COMPRESS"):
        sg.install(modules=mods)
    assert not sg.installed()
    importlib.import_module("dsv4_compressor.integrations.sglang")  # importing the adapter never needs SGLang


def test_refusals():
    """Rings too small for the draft depth, a ratio mismatch, a kv_score shorter than the plan, a replay refresh
    from a metadata of another shape, bad options."""
    w = World(draft_tokens=3, seed=5, hca_layers=("ring",))
    w.reserve(1, 8)
    adapter = sg.SGLangCompressor(draft_tokens=4)
    positions, req = torch.arange(8), torch.ones(8, dtype=torch.int64)
    args = dict(positions=positions, req_pool_indices=req, out_loc=positions, req_to_token=w.req_to_token,
                full_to_swa_index_mapping=w.full_to_swa, swa_page_size=PAGE, decode=False)  # fmt: skip
    with pytest.raises(OpError, match=r"ring 8 of ratio 4 .*needs >= 10"):
        adapter.metadata(4, ring=8, **args)
    meta = adapter.metadata(4, ring=16, **args)
    hca, csa = w.layers[0], w.layers[1]
    kw = dict(state=csa.state, out_pages=csa.memory, page_size=8)
    with pytest.raises(OpError, match="ratio 4 given to a ratio-8"):
        adapter.forward_compress(random_rows(8, hca.cfg, w.gen), meta, hca.compressor, **kw)
    with pytest.raises(OpError, match="kv_score has 5 rows"):
        adapter.forward_compress(random_rows(5, csa.cfg, w.gen), meta, csa.compressor, **kw)
    other = adapter.metadata(4, ring=16, num_requests=2, **args)
    with pytest.raises(ValueError, match="plan differs in shape"):
        meta.copy_(other)  # a graph replays one shape: a metadata of another capacity cannot refresh it
    with pytest.raises(ValueError, match="metadata differ"):
        meta.copy_(adapter.metadata(4, ring=16, **dict(args, decode=True)))
    for bad in (dict(hca="tiled"), dict(draft_tokens=0), dict(indexer_pack="fp4"), dict(c4_ape="x")):
        with pytest.raises(ValueError):
            sg.SGLangCompressor(**bad)


def test_wrong_ape_view_is_caught():
    """The checks see a mistake in how SGLang's hotfixed C4 APE is read (the checkpoint view instead)."""
    w = World(draft_tokens=1, seed=6, hca_layers=())
    w.adapters["ring"].c4_ape = "checkpoint"
    w.step([(1, 0, 9)], "prefill")
    with pytest.raises(AssertionError, match="csa slot 1"):
        w.check("wrong APE view")


def test_online_savings_from_config_numbers():
    flash = sg.hca_online_savings(hca_layers=20, draft_tokens=4, requests=256)
    assert flash["ring_bytes_per_request_layer"] == 1 << 20 and flash["online_bytes_per_request_layer"] == 24 << 10
    assert flash["ring_bytes"] == 5 << 30 and flash["online_bytes"] == 120 << 20
    assert (flash["launches_sglang"], flash["launches_sglang_online_mtp"], flash["launches_online"]) == (40, 60, 20)
    plain = sg.hca_online_savings(hca_layers=20)
    assert plain["ring_rows"] == 128 and plain["memory_ratio"] == pytest.approx(512 / 6)
    pro = sg.hca_online_savings(hca_layers=31, draft_tokens=4, requests=256)
    assert pro["ring_bytes"] == 31 * 256 << 20 and pro["launches_online"] == 31


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_gpu_metadata_and_layers_in_one_cuda_graph():
    """On a GPU with compiled kernels: eager steps never synchronise with the host (sync debug mode "error"
    around the metadata build and every layer call), and verify steps replayed from one CUDA graph (metadata
    build + all layers) store what the float64 reference says, before and after a radix hit."""
    if not torch.cuda.is_available() or interpreting():
        pytest.skip("needs CUDA and compiled Triton kernels (make test runs them in a pass without the interpreter)")
    w = World(draft_tokens=3, seed=7, device="cuda")
    w.step([(1, 0, 14), (2, 0, 7)], "prefill", tokens=24)
    w.check("prefill 1")
    w.step([(1, 14, 22), (3, 0, 5)], "prefill")
    w.check("prefill 2")
    w.verify_steps([1, 2, 3], 2, bs=4)  # eager (and the kernels' compilation for these shapes)
    w.verify_in_graph([1, 2, 3], 4, bs=4)
    w.share_prefix(1, 4, PAGE)
    w.step([(4, PAGE, 6)], "prefill")
    w.check("prefix reuse")
    w.verify_steps([1, 2, 3, 4], 1, bs=4)
    w.verify_in_graph([1, 2, 3, 4], 4, bs=4)
