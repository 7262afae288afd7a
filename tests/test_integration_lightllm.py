"""The LightLLM adapter on LightLLM's own buffers and per-step metadata, scaled down (CPU, Triton interpreter).

LightLLM (``support_ds4``; docs/INTEGRATION.md, "What the engines call and hold") is played by the stand-ins of
``tests/helpers/lightllm_sim`` (``sim``), which ``scripts/multi_gpu_run.py`` runs on too: its memory manager, request
manager, ``infer_state``, compressor and indexer classes have LightLLM's names, attributes, dtypes and layouts, and
its ``SlotAllocator`` does LightLLM's slot bookkeeping. Scaled down: head 128 (``helpers.inputs`` configs), the HCA
ratio 8 (128), the SWA page 16 (128); the module constants below play ``deepseek4_mem_manager.py``'s, for this
module's subclass of the memory manager (the adapter reads them from the memory manager's module).
Kept as LightLLM has them: the C4 ring ``8 + mtp_step`` and page tail, the C128 ring ``ceil((r + mtp) / 4) * 4``
addressed ``req * ring + pos % ring`` in a 2-D ``[(max_req + 1) * ring + 1, 2W]`` buffer with a sentinel row,
the C4 state ``[n_c4, ceil((swa_pages * ring + ring + 1) / 4) * 4, 4H]`` addressed through ``req_to_token`` and
``full_to_swa``, pool pages of 64 / 2 / 64 slots, int32 index tables of ``size + 1`` entries whose last maps the
HOLD token to each pool's HOLD slot, compressed slots keyed by the group-end token's full slot, HOLD =
``max_request_num`` padding rows (prefill-graph tail requests, decode-graph padding, an idle DP rank), MTP
decode steps of ``mtp + 1`` rows whose rejected rows' full slots are freed (cascading to ``full_to_c*`` and
``full_to_swa``), position-aligned SWA pages that leave the sliding window and are reused by other requests,
and radix prefix reuse of a request's first SWA pages.

After every step every stored entry is checked against the float64 reference, every state row the next step
may read bit for bit, and every pool byte and state row nothing should have written against its poison.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import lightllm_sim as sim
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows
from helpers.model import StreamModel
from helpers.session import count_launches, interpreting

from dsv4_compressor import ops, reference
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.errors import CapacityError
from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.integrations.lightllm import patching as adapter_patching
from dsv4_compressor.kernels import projection as proj
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout
from dsv4_compressor.verify import check_indexer_pack, check_latent_records

# ---------------------------------------------------------------------------------------------------------------
# LightLLM's memory manager, scaled down
# ---------------------------------------------------------------------------------------------------------------
# LightLLM's constants (deepseek4_mem_manager.py), scaled down where marked. The adapter reads them from the module
# that defines the memory manager's class: this one, for the subclass below.
DSV4_SWA_PAGE_SIZE = 16  # 128
DSV4_C4_STATE_RING = sim.DSV4_C4_STATE_RING
DSV4_C128_STATE_RING = 8  # 128: the HCA ratio
MTP = 3  # LightLLM's production mtp_step: decode steps of S = 4 rows
S = MTP + 1
MAX_REQ = 4  # max_request_num = HOLD_REQUEST_ID
SWA_PAGES = 16
SIZE = 512  # full token slots (HOLD_TOKEN_MEMINDEX = SIZE)
MAX_SEQ = 96
SWA_WINDOW = 16  # LightLLM's sliding window (128) = one SWA page
assert HCA_SMALL.ratio == DSV4_C128_STATE_RING and CSA_SMALL.ratio == INDEXER_CFG.ratio == 4

#: The configs of LightLLM's three compressors at this scale: C4 main (CSA), its indexer, C128 (HCA).
KINDS = {"c4": CSA_SMALL, "indexer": INDEXER_CFG, "c128": HCA_SMALL}


class DeepseekV4MemoryManager(sim.DeepseekV4MemoryManager):
    """``tests/helpers/lightllm_sim``'s memory manager at this module's scale: head 128, the SWA page and the C128
    ratio of the constants above."""

    def __init__(self, size, compress_rates, max_request_num, mtp_step, swa_pages=SWA_PAGES, device="cpu"):
        super().__init__(size, compress_rates, max_request_num, mtp_step, swa_pages=swa_pages, latent=CSA_SMALL,
                         indexer=INDEXER_CFG, swa_page_size=DSV4_SWA_PAGE_SIZE, c128_ratio=DSV4_C128_STATE_RING,
                         device=device)  # fmt: skip


class _Linear:
    """A replicated GEMM stand-in: ``x`` carries every compressor's fp32 ``kv_score`` side by side; ``mm`` returns
    this weight's columns (LightLLM: ``compressor_wkv_gate_.mm(x, out_dtype=torch.float32)``)."""

    def __init__(self, cols: slice):
        self.cols = cols

    def mm(self, x, out_dtype=None, use_custom_tensor_mananger=True):
        assert out_dtype is torch.float32
        return x[:, self.cols].contiguous()


class OpSpy:
    """Records every op the adapter calls (name and keyword arguments), then runs it: what the Triton interpreter
    cannot show (e.g. a ``decode=True`` launch on a prefill step races only on a GPU) is checked on the call."""

    NAMES = ("build_plan", "build_plans", "build_state_rows", "check_plan", "compress", "compress_online_hca")

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, dict]] = []
        for name in self.NAMES:
            monkeypatch.setattr(ops, name, self._wrap(name, getattr(ops, name)))

    def _wrap(self, name, real):
        def spy(*args, **kwargs):
            self.calls.append((name, kwargs))
            return real(*args, **kwargs)

        return spy

    def take(self) -> list[tuple[str, dict]]:
        calls, self.calls = self.calls, []
        return calls


# ---------------------------------------------------------------------------------------------------------------
# The engine: allocation as LightLLM does it, steps, checks
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Compressor:
    """One compressor of one layer: its config, parameters (checkpoint layouts), pool, model of what it holds."""

    layer: int
    kind: str
    cfg: CompressorConfig
    params: object
    model: StreamModel
    pages: torch.Tensor
    layout: object
    written: set = dataclasses.field(default_factory=set)

    @property
    def ratio(self) -> int:
        return self.cfg.ratio


class Engine:
    """A scaled-down LightLLM serving ``compress_rates`` layers through the adapter, one step at a time.

    ``install=True`` drives the layers through LightLLM's (stand-in) classes as patched by ``adapter.install``;
    else the adapter's :class:`StepBuilder` and :func:`compress_layer` are called directly (``layout`` replaces
    the builder's, to break it on purpose)."""

    def __init__(
        self, rates=(4, 128), *, online=False, seed=0, install=False, layout=None, c128_kernel="tiled", spy=None,
        device="cpu", mtp=MTP, slot_seed=None,
    ):  # fmt: skip
        self.rates, self.online, self.install, self.spy = list(rates), online, install, spy
        self.c128_kernel, self.device, self.mtp = c128_kernel, torch.device(device), mtp
        self.rng = np.random.default_rng(seed if slot_seed is None else slot_seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.mm = DeepseekV4MemoryManager(SIZE, rates, MAX_REQ, mtp, device=device)
        if online and not install:
            adapter.allot_online_hca_banks(self.mm)
        if online:
            sim.poison_f32(self.mm.dsv4c_c128_state_banks)  # a bank read before it was written shows
        self.req = sim.DeepseekV4ReqManager(MAX_REQ, MAX_SEQ, SIZE, device=device)
        self.model = types.SimpleNamespace(
            mem_manager=self.mm,
            batch_max_tokens=40,
            max_req_num=MAX_REQ,
            graph_max_batch_size=MAX_REQ * S,
            layers_infer=[types.SimpleNamespace(compress_ratio=r) for r in rates],
        )  # LightLLM keeps graph_max_batch_size in rows (basemodel.py L83-87)
        params = make_params(CSA_SMALL, seed=seed, max_positions=256, device=device)
        table = torch.complex(params.cos, params.sin)  # model._freqs_cis_compress (complex64)
        self.cos, self.sin = table.real, table.imag  # layer.cos_compress_table / sin_compress_table: strided
        self.compressors: list[Compressor] = []
        for layer, rate in enumerate(rates):
            for kind in ("c4", "indexer") if rate == 4 else ("c128",):
                cfg = KINDS[kind]
                p = make_params(cfg, seed=seed + 10 * layer + len(kind), norm_dtype=torch.bfloat16, device=device)
                if kind == "indexer":
                    pool, lay = self.mm.c4_indexer_pool, indexer_fp8_page_layout(cfg, sim.DSV4_INDEXER_PAGE_SIZE)
                    pages = pool.get_layer_buffer(self.mm.layer_to_c4_idx[layer])
                else:
                    pages = self.mm.get_compressed_kv_buffer(layer)
                    lay = latent_page_layout(cfg, sim.DSV4_C4_PAGE_SIZE if kind == "c4" else sim.DSV4_C128_PAGE_SIZE)
                model = StreamModel(cfg, p, mtp_step=mtp)
                self.compressors.append(Compressor(layer, kind, cfg, p, model, pages, lay))
        self.builder = None
        if not install:
            self.builder = adapter.StepBuilder.for_model(self.model, online_hca=online, c128_kernel=c128_kernel)
            if layout is not None:
                self.builder = adapter.StepBuilder(layout, max_rows=self.builder.max_rows, device=device,
                                                   online_hca=online)  # fmt: skip
        self._init_layers(seed)
        # LightLLM's slot bookkeeping (random order: slots and pages land anywhere in the pools)
        self.alloc = sim.SlotAllocator(self.mm, self.req, rng=self.rng, swa_window=SWA_WINDOW, mtp_step=mtp)
        # state rows LightLLM's save rule allows to be written, and the state as initialized
        self.saved_c4: set[int] = set()
        self.saved_c128: set[int] = set()
        #: request -> the earliest position its next step may start at beyond ``L - mtp`` (a request a PD transfer
        #: brought starts at its length: its prompt is accepted)
        self.first_start: dict[int, int] = {}
        self.initial = {name: t.cpu().clone() for name, t in self._state_tensors().items()}

    def _init_layers(self, seed):
        """The stand-in layer objects and weights (LightLLM's names; checkpoint-layout APE ``[r, coff * H]``)."""
        config = {"compress_ratios": self.rates, "rms_norm_eps": 1e-6}
        self.layer_objs, self.weights = [], []
        for layer in range(len(self.rates)):
            comps = [c for c in self.compressors if c.layer == layer]
            widths = [c.cfg.row_width for c in comps]
            offsets = np.cumsum([0] + widths)
            cols = {c.kind: slice(int(offsets[i]), int(offsets[i + 1])) for i, c in enumerate(comps)}
            weight = types.SimpleNamespace()
            for c in comps:
                prefix = "idx_cmp_" if c.kind == "indexer" else "compressor_"
                setattr(weight, prefix + "wkv_gate_", _Linear(cols[c.kind]))
                setattr(weight, prefix + "norm_", types.SimpleNamespace(weight=c.params.norm_weight))
                setattr(weight, prefix + "ape_", types.SimpleNamespace(weight=c.params.ape))
            self.weights.append(weight)
            self.layer_objs.append((sim.CompressorInfer(layer, config, 1), sim.DeepseekV4IndexInfer(layer, config, 1)))

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"c4": self.mm.c4_state_buffer, "c4_idx": self.mm.c4_indexer_state_buffer}
        if self.online:
            out["banks"] = self.mm.dsv4c_c128_state_banks
        else:
            out["c128"] = self.mm.c128_state_buffer
        return out

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Radix prefix reuse: ``dst`` starts with ``src``'s first ``length`` tokens (whole SWA pages)."""
        self.alloc.share_prefix(src, dst, length)
        for c in self.compressors:
            c.model.apply(dst, 0, c.model.rows[src][:length])

    # -- a step ---------------------------------------------------------------------------------------------------
    def step(self, items, *, decode: bool, pad_requests: int = 0, pad_rows: int = S, chunks=None) -> dict:
        """``items = [(req, start, n), ...]``; ``pad_requests`` HOLD requests of ``pad_rows`` rows (decode: ``S``)
        pad the batch as LightLLM's graph buckets do. Runs the adapter, then updates the models. ``chunks``: the
        requests' rows per compressor (as :meth:`draw` returns them; default: fresh ones). Returns the chunks."""
        state, mem = self.begin(items, decode=decode, pad_requests=pad_requests, pad_rows=pad_rows)
        chunks, kv = self.draw(items, state.position_ids.shape[0], chunks)
        if self.spy is not None:
            self.spy.take()  # the step's metadata was checked in begin()
        self.run_layers(state, kv)
        if self.spy is not None:
            self._check_calls(self.spy.take(), decode)
        self.finish(items, mem, chunks)
        return chunks

    def begin(self, items, *, decode: bool, pad_requests: int = 0, pad_rows: int = S, build: bool = True):
        """Allocate the step's slots and build LightLLM's ``infer_state`` (then its ``init_some_extra_state``, and
        the builder unless ``build=False``). Returns the state and the rows' full slots."""
        state, mem = sim.make_infer_state(
            self.alloc, items, decode=decode, pad_requests=pad_requests, pad_rows=pad_rows
        )
        if self.spy is not None:
            self.spy.take()
        state.init_some_extra_state(self.model)  # patched by install(): LightLLM's, then the builder
        if self.builder is not None and build:
            self.builder.build(state)
        if self.spy is not None:  # once per step: every ratio's plan and the C4 state-row tables in one build_plans
            built = self.spy.calls
            assert [name for name, _ in built] == ["build_plans"], built
            assert (built[0][1].get("state_mode") == "token_map_ring") == (4 in self.rates), built
        return state, mem

    def draw(self, items, rows: int, chunks=None):
        """Every compressor's ``kv_score``: the requests' rows (``chunks``, else fresh ones), then the padding
        rows' finite garbage."""
        chunks, kv = ({} if chunks is None else chunks), {}
        for c in self.compressors:
            key = (c.layer, c.kind)
            if key not in chunks:
                chunks[key] = [random_rows(n, c.cfg, self.gen) for _, _, n in items]
            pad = 3.0 * torch.randn(rows - sum(n for _, _, n in items), c.cfg.row_width, generator=self.gen)
            kv[key] = torch.cat(chunks[key] + [pad]).to(self.device).contiguous()
        return chunks, kv

    def run_layers(self, state, kv) -> None:
        for layer, rate in enumerate(self.rates):
            self._run_layer(layer, rate, state, kv)

    def finish(self, items, mem, chunks) -> None:
        """After the step ran: account the slots and rows it wrote, update the models, evict SWA pages (LightLLM
        frees them in its tables at once: the checks read the tables)."""
        self._account(items, mem)
        for c in self.compressors:
            for (req, start, _), chunk in zip(items, chunks[(c.layer, c.kind)]):
                c.model.apply(req, start, chunk)
        self.alloc.evict()
        self.alloc.upload()

    def _run_layer(self, layer: int, rate: int, state, kv) -> None:
        kinds = ("c4", "indexer") if rate == 4 else ("c128",)
        # kv_score must come back unwritten (a comparison syncs: not while a CUDA graph is being captured)
        check = self.device.type == "cpu" or not torch.cuda.is_current_stream_capturing()
        if self.install:  # LightLLM's calls: compressor.compress, then the indexer's write_indexer_k
            x = torch.cat([kv[(layer, k)] for k in kinds], dim=1)
            before = x.clone() if check else None
            compressor, index_infer = self.layer_objs[layer]
            compressor.compress(x, state, self.weights[layer], self.cos, self.sin)
            index_infer.write_indexer_k(x, state, self.weights[layer], self.cos, self.sin)
            assert not check or torch.equal(x.view(torch.int32), before.view(torch.int32)), "kv_score was written"
            return
        for kind in kinds:
            c = next(c for c in self.compressors if c.layer == layer and c.kind == kind)
            x = kv[(layer, kind)]
            before = x.clone() if check else None
            adapter.compress_layer(
                kind, x, state, layer, ape=c.params.ape, norm_weight=c.params.norm_weight, cos=self.cos, sin=self.sin,
                eps=c.params.eps,
            )  # fmt: skip
            assert not check or torch.equal(x.view(torch.int32), before.view(torch.int32)), "kv_score was written"

    def _check_calls(self, calls, decode: bool) -> None:
        """One op per compressor and layer, nothing else (the plans were built once, before the layers), with
        LightLLM's page sizes, pack and ring, ``decode = not is_prefill``, and the tiled HCA kernel (scratch)."""
        kinds = [c.kind for c in self.compressors]
        assert [name for name, _ in calls] == [
            "compress_online_hca" if k == "c128" and self.online else "compress" for k in kinds
        ], calls
        for kind, (_, kw) in zip(kinds, calls):
            assert kw["decode"] is decode, f"{kind}: decode={kw['decode']} on a step with is_prefill={not decode}"
            want_page = sim.DSV4_C128_PAGE_SIZE if kind == "c128" else sim.DSV4_C4_PAGE_SIZE
            assert kw["page_size"] == want_page, (kind, kw["page_size"])
            if kind == "indexer":
                assert kw["indexer_pack"] == "hadamard_bf16" and "out_keys" not in kw, kw.keys()
            if kind == "c128" and not self.online:
                assert kw["ring"] == self.mm.c128_state_ring
                assert (kw["scratch"] is not None) == (self.c128_kernel == "tiled")

    def _account(self, items, mem) -> None:
        """Slots the step writes and state rows LightLLM's save rule lets it write (computed independently)."""
        i = 0
        ring4, ring128, page = self.mm.c4_state_ring, self.mm.c128_state_ring, DSV4_SWA_PAGE_SIZE
        for req, start, n in items:
            end = start + n
            for p in range(start, end):
                slot = mem[i]
                i += 1
                for c in self.compressors:
                    r = c.ratio
                    if p % r == r - 1:
                        table = self.mm.full_to_c128_indexs if c.kind == "c128" else self.mm.full_to_c4_indexs
                        c.written.add(int(table[slot]))
                m = int(self.mm.full_to_swa_indexs[slot])
                if p >= end - ring4 or m % page >= page - ring4:
                    self.saved_c4.add((m // page) * ring4 + m % ring4)
                if p >= end - ring128:
                    self.saved_c128.add(req * ring128 + p % ring128)

    # -- checks ---------------------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        for c in self.compressors:
            self._check_entries(c, what)
            self._check_untouched_pages(c, what)
            if c.kind != "c128" or not self.online:
                self._check_next_rows(c, what)
        self._check_untouched_state(what)

    def _check_entries(self, c: Compressor, what: str) -> None:
        table = (self.mm.full_to_c128_indexs if c.kind == "c128" else self.mm.full_to_c4_indexs).cpu()
        req_to_token, pages = self.req.req_to_token_indexs.cpu(), c.pages.cpu()
        for req in c.model.live():
            groups = c.model.length(req) // c.ratio
            if groups == 0:
                continue
            ends = req_to_token[req, torch.arange(groups) * c.ratio + c.ratio - 1].long()
            slots = table[ends].long()
            assert (slots >= 0).all(), f"{what}: request {req} has group ends without a compressed slot"
            records = c.layout.read(pages, slots)
            want = c.model.expected(req)
            if c.kind == "indexer":
                rep = check_indexer_pack(records, want, adapter.INDEXER_PACK)
            else:
                rep = check_latent_records(records, want, c.cfg)
            assert rep.ok, f"{what}: layer {c.layer} {c.kind} request {req}: {rep}"

    def _check_untouched_pages(self, c: Compressor, what: str) -> None:
        keep = torch.zeros(c.pages.numel(), dtype=torch.bool)
        if c.written:
            keep[c.layout._byte_index(torch.tensor(sorted(c.written))).reshape(-1)] = True
        stray = (c.pages.reshape(-1).cpu() != sim.POISON_BYTE) & ~keep
        assert not stray.any(), f"{what}: layer {c.layer} {c.kind}: {int(stray.sum())} pool bytes written elsewhere"

    def _state_rows(self, c: Compressor, req: int, q: torch.Tensor) -> torch.Tensor:
        """The state rows LightLLM addresses for positions ``q`` of ``req`` (its own formulas)."""
        mm = self.mm
        if c.kind == "c128":
            ring = mm.c128_state_ring
            return mm.get_c128_state_buffer(c.layer).cpu()[req * ring + q % ring]
        swa = mm.full_to_swa_indexs.cpu()[self.req.req_to_token_indexs.cpu()[req, q].long()].long()
        assert (swa >= 0).all(), f"request {req}: positions {q.tolist()} a next step may read left the SWA pool"
        ring, page = mm.c4_state_ring, DSV4_SWA_PAGE_SIZE
        state = mm.get_c4_state_buffer(c.layer) if c.kind == "c4" else mm.get_c4_indexer_state_buffer(c.layer)
        return state.cpu()[(swa // page) * ring + swa % ring]

    def _check_next_rows(self, c: Compressor, what: str) -> None:
        """The rows of every position a next step may read (continuing at L or rewinding by up to mtp_step) hold
        ``[kv | score + ape]`` bit for bit."""
        r = c.ratio
        for req in c.model.live():
            length = c.model.length(req)
            low = max(self.first_start.get(req, 0), length - self.mtp)
            lo = max(0, (low // r - (1 if c.cfg.overlap else 0)) * r)
            if lo >= length:
                continue
            q = torch.arange(lo, length)
            want = reference.gated_rows(c.model.rows[req][lo:length], q, c.params.ape.cpu(), c.cfg.width)
            got = self._state_rows(c, req, q)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{what}: {c.kind} {req} state rows"

    def _check_untouched_state(self, what: str) -> None:
        """State rows outside LightLLM's save rule (never-used rows, the HOLD page / slot, the sentinel row, the
        HOLD slot's banks) are as initialized."""
        for name, now in self._state_tensors().items():
            now, before = now.cpu(), self.initial[name]
            if name == "banks":  # [layers, max_req + 1, banks, 3, H]: slots of requests that ran may change
                used = sorted({req for c in self.compressors for req in c.model.live()})
                mask = torch.ones(now.shape[1], dtype=torch.bool)
                mask[used] = False
                now, before = now[:, mask], before[:, mask]
            else:
                allowed = self.saved_c4 if name.startswith("c4") else self.saved_c128
                mask = torch.ones(now.shape[1], dtype=torch.bool)
                mask[sorted(allowed)] = False
                now, before = now[:, mask], before[:, mask]
            assert torch.equal(now.view(torch.int32), before.view(torch.int32)), f"{what}: {name} written elsewhere"


def _decode_steps(engine: Engine, lengths: dict[int, int], steps: int, *, pad_requests: int = 1):
    """MTP verify steps: every request brings S rows; a random number of the previous step's drafts is
    accepted, so most steps rewind (start < L). Pads to the graph batch with HOLD requests of S rows."""
    for i in range(steps):
        items = []
        for req in sorted(lengths):
            accepted = int(engine.rng.integers(0, S))
            start = lengths[req] if i == 0 else lengths[req] - (S - 1 - accepted)
            items.append((req, start, S))
            lengths[req] = start + S
        engine.step(items, decode=True, pad_requests=pad_requests, pad_rows=S)
        yield i


@pytest.fixture
def restore_lightllm():
    yield
    adapter.uninstall()


# ---------------------------------------------------------------------------------------------------------------
# Serving through the adapter
# ---------------------------------------------------------------------------------------------------------------
def test_serving_ring_state_chunked_prefill_prefix_reuse_and_mtp_decode(monkeypatch):
    """One C4 layer (main + indexer) and one C128 layer on LightLLM's ring state: chunked prefill straddling
    groups and SWA pages with a HOLD tail request, radix prefix reuse at an SWA page boundary, MTP verify
    steps with random acceptance and HOLD padding, and an idle rank's HOLD-only step."""
    engine = Engine(rates=(4, 128), seed=1, spy=OpSpy(monkeypatch))
    engine.step([(0, 0, 21), (1, 0, 6)], decode=False, pad_requests=1)  # crosses SWA page 16, groups of 4 and 8
    engine.check("prefill 0")
    # request 0 crosses SWA page 32 and goes on past its last ring rows: only the page tail keeps positions 25-31;
    # page 0 leaves the window
    engine.step([(0, 21, 23), (1, 6, 7)], decode=False)
    engine.check("prefill 1")
    boundary = 2 * DSV4_SWA_PAGE_SIZE
    engine.share_prefix(0, 2, boundary)  # request 2's radix hit: request 0's first two SWA pages
    engine.step([(2, boundary, 6), (1, 13, 4)], decode=False, pad_requests=1)
    engine.check("prefix reuse")
    assert engine.mm.full_to_swa_indexs[engine.req.req_to_token_indexs[2, 0].long()] == -1, "page 0 not evicted"
    lengths = {0: 44, 1: 17, 2: boundary + 6}
    for i in _decode_steps(engine, lengths, 6):
        engine.check(f"decode {i}")
    engine.step([], decode=True, pad_requests=1, pad_rows=S)  # an idle DP rank: one HOLD request
    engine.check("idle rank")
    assert engine.builder.steps == 10


def test_builder_runs_once_per_step_for_every_layer_through_install_with_online_hca(monkeypatch, restore_lightllm):
    """``install(online_hca=True)`` on stand-in LightLLM modules: two C4 layers and one C128 layer (online banks,
    allotted by the patched memory manager) share one builder that runs once per step, in
    ``init_some_extra_state``; LightLLM's own compressor and indexer never run. The state-transfer paths that
    carry nothing: a radix hit (LightLLM matches at multiples of 256 tokens, ``infer_batch.py`` L740-760; here
    twice the HCA ratio) and a paused request recomputed from a matched prefix or from 0 (``free_a_req_mem``,
    L129-147; a CPU-cache restore and a DP-rank prefix fetch resume at such lengths too) start where no HCA group
    is open, into a bank slot holding poison or a stale state: neither may be read."""
    _stand_in_lightllm(monkeypatch)
    adapter.install(online_hca=True)
    engine = Engine(rates=(4, 128, 4), online=True, install=True, seed=2, spy=OpSpy(monkeypatch))
    assert engine.mm.c128_state_buffer is None, "the C128 ring was allotted"
    engine.step([(0, 0, 21), (1, 0, 9)], decode=False, pad_requests=1)
    engine.check("prefill")
    builder = engine.model._dsv4c_builder
    assert builder.online_hca and builder.steps == 1
    lengths = {0: 21, 1: 9}
    for i in _decode_steps(engine, lengths, 2):
        engine.check(f"decode {i}")
    boundary = 2 * DSV4_C128_STATE_RING  # LightLLM's radix page (256 = 2 x 128 tokens)
    engine.share_prefix(0, 2, boundary)  # request 2: a radix hit on request 0, in a never-used (poisoned) slot
    engine.step([(2, boundary, 7), (1, 0, 11)], decode=False)  # request 1: paused, recomputed from 0 (stale banks)
    engine.check("radix hit and resume")
    lengths.update({2: boundary + 7, 1: 11})
    for i in _decode_steps(engine, lengths, 2):
        engine.check(f"decode after resume {i}")
    assert builder.steps == 6, "the builder must run once per step, not once per layer"


def test_a_broken_adapter_is_caught():
    """The checks catch a wrong C4 page size (64 in LightLLM): entries land in the wrong slots."""
    good = adapter.LightLLMLayout.from_mem_manager(DeepseekV4MemoryManager(SIZE, (4,), MAX_REQ, MTP))
    engine = Engine(rates=(4,), seed=3, layout=dataclasses.replace(good, c4_page_size=32))
    engine.step([(0, 0, 9)], decode=False)
    with pytest.raises(AssertionError):
        engine.check("wrong page size")


# ---------------------------------------------------------------------------------------------------------------
# The builder and the layer call on their own
# ---------------------------------------------------------------------------------------------------------------
def test_layout_from_lightllm_memory_manager():
    mm = DeepseekV4MemoryManager(SIZE, (4, 128, 4), MAX_REQ, MTP)
    lay = adapter.LightLLMLayout.from_mem_manager(mm)
    assert (lay.max_request_num, lay.mtp_step, lay.c4_state_ring, lay.c128_state_ring) == (MAX_REQ, MTP, 11, 12)
    assert (lay.swa_page_size, lay.c128_ratio, lay.head_dim) == (DSV4_SWA_PAGE_SIZE, DSV4_C128_STATE_RING, 128)
    assert (lay.c4_page_size, lay.c128_page_size, lay.indexer_page_size) == (64, 2, 64)
    assert lay.index_dtype == torch.int32
    # LightLLM's real numbers: ring 8 + mtp for C4, ceil((128 + mtp) / 4) * 4 for C128
    real = adapter.LightLLMLayout(max_request_num=256, mtp_step=3, c4_state_ring=11, c128_state_ring=132)
    assert real.hca_config.ring_rows(3) == 132
    with pytest.raises(ValueError, match="c128_state_ring"):
        dataclasses.replace(real, c128_state_ring=128)
    with pytest.raises(ValueError, match="c4_state_ring"):
        dataclasses.replace(real, c4_state_ring=8)


def test_builder_refuses_a_step_beyond_its_rows_and_layers_without_a_builder():
    mm = DeepseekV4MemoryManager(SIZE, (4,), MAX_REQ, MTP)
    builder = adapter.StepBuilder(adapter.LightLLMLayout.from_mem_manager(mm), max_rows=8, device="cpu")
    state = sim.DeepseekV4InferStateInfo(
        is_prefill=True, position_ids=torch.arange(9), mem_index=torch.zeros(9, dtype=torch.int32),
        b_req_idx=torch.zeros(1, dtype=torch.int32), b_q_seq_len=torch.tensor([9], dtype=torch.int32), mem_manager=mm,
    )  # fmt: skip
    with pytest.raises(CapacityError, match="9 rows"):
        builder.build(state)
    p = make_params(CSA_SMALL)
    with pytest.raises(RuntimeError, match="builder did not run"):
        adapter.compress_layer("c4", random_rows(9, CSA_SMALL, torch.Generator()), state, 0, ape=p.ape,
                               norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=p.eps)  # fmt: skip


def test_check_plan_flags_a_decode_step_that_breaks_lightllm_s_promise():
    """``check=True`` validates every plan on the device; a "decode" step whose request brings more than
    ``mtp_step + 1`` rows is reported (read afterwards, with a sync)."""
    mm = DeepseekV4MemoryManager(SIZE, (4, 128), MAX_REQ, MTP)
    builder = adapter.StepBuilder(adapter.LightLLMLayout.from_mem_manager(mm), max_rows=16, device="cpu", check=True)
    n, req = S + 1, sim.DeepseekV4ReqManager(MAX_REQ, 64, SIZE)
    state = sim.DeepseekV4InferStateInfo(
        is_prefill=False, position_ids=torch.arange(n), mem_index=torch.full((n,), SIZE, dtype=torch.int32),
        b_req_idx=torch.zeros(n, dtype=torch.int32), mem_manager=mm, req_manager=req,
    )  # fmt: skip
    state.init_some_extra_state(None)
    builder.build(state)
    errors = builder.plan_errors()
    assert len(errors) == 2 and all(f"brings {n} rows" in e for e in errors), errors
    state.position_ids, state.b_req_idx = torch.arange(S), torch.zeros(S, dtype=torch.int32)
    state.mem_index = state.mem_index[:S]
    state.init_some_extra_state(None)
    builder.build(state)
    assert builder.plan_errors() == []


# ---------------------------------------------------------------------------------------------------------------
# install()
# ---------------------------------------------------------------------------------------------------------------
def _stand_in_lightllm(monkeypatch) -> None:
    """Register this module's stand-in classes under LightLLM's module paths (docs/INTEGRATION.md)."""
    modules = {
        "lightllm.models.deepseek_v4.layer_infer.transformer_layer_infer": dict(
            CompressorInfer=sim.CompressorInfer, DeepseekV4IndexInfer=sim.DeepseekV4IndexInfer
        ),
        "lightllm.models.deepseek_v4.infer_struct": dict(DeepseekV4InferStateInfo=sim.DeepseekV4InferStateInfo),
        "lightllm.common.kv_cache_mem_manager.deepseek4_mem_manager": dict(
            DeepseekV4MemoryManager=DeepseekV4MemoryManager, DSV4_SWA_PAGE_SIZE=DSV4_SWA_PAGE_SIZE
        ),
        "lightllm.models.deepseek_v4.model": dict(DeepseekV4TpPartModel=sim.DeepseekV4TpPartModel),
    }
    for path, attrs in modules.items():
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            if name not in sys.modules or k == len(parts):
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for attr, value in attrs.items():
            setattr(sys.modules[path], attr, value)


def test_install_without_lightllm_raises_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightllm", None)  # import lightllm -> ImportError
    with pytest.raises(adapter.LightLLMNotInstalled, match="support_ds4"):
        adapter.install()
    assert issubclass(adapter.LightLLMNotInstalled, ImportError)


def test_install_patches_the_documented_methods_once_and_uninstall_restores(monkeypatch, restore_lightllm):
    _stand_in_lightllm(monkeypatch)
    originals = (sim.CompressorInfer.compress, sim.DeepseekV4IndexInfer.write_indexer_k,
                 sim.DeepseekV4InferStateInfo.init_some_extra_state)  # fmt: skip
    mm_cls = DeepseekV4MemoryManager
    fixed, init, pd_write = mm_cls.get_fixed_memory_size, mm_cls._init_buffers, mm_cls.write_mem_to_page_kv_move_buffer
    adapter.install()
    assert sim.CompressorInfer.compress is adapter.compressor_compress
    assert sim.DeepseekV4IndexInfer.write_indexer_k is adapter.write_indexer_k
    patched_init = sim.DeepseekV4InferStateInfo.init_some_extra_state
    assert patched_init is not originals[2] and patched_init.__wrapped__ is originals[2]
    # both modes count and allot the step buffers with LightLLM's fixed buffers; the ring keeps LightLLM's PD path
    assert mm_cls.get_fixed_memory_size.__wrapped__ is fixed and mm_cls._init_buffers.__wrapped__ is init
    assert mm_cls.write_mem_to_page_kv_move_buffer is pd_write
    adapter.install(online_hca=True)  # again, with other options: wraps LightLLM's original, not the patch
    assert sim.DeepseekV4InferStateInfo.init_some_extra_state.__wrapped__ is originals[2]
    assert mm_cls._init_buffers.__wrapped__ is init
    assert mm_cls.write_mem_to_page_kv_move_buffer.__wrapped__ is pd_write, "online: the PD page carries the banks"
    adapter.install()  # back to the ring: LightLLM's PD transfer again
    assert mm_cls.write_mem_to_page_kv_move_buffer is pd_write
    adapter.install(online_hca=True)
    adapter.uninstall()
    assert (sim.CompressorInfer.compress, sim.DeepseekV4IndexInfer.write_indexer_k,
            sim.DeepseekV4InferStateInfo.init_some_extra_state) == originals  # fmt: skip
    assert (mm_cls.get_fixed_memory_size, mm_cls._init_buffers, mm_cls.write_mem_to_page_kv_move_buffer) == (
        fixed, init, pd_write)  # fmt: skip


def test_install_joins_the_c4_weights_before_lightllm_sizes_and_loads(monkeypatch, restore_lightllm):
    """Under ``install()`` (``projection="auto"``), ``DeepseekV4TpPartModel._init_mem_manager`` first joins each
    C4 layer's ``compressor_wkv_gate_`` and ``idx_cmp_wkv_gate_`` (allotted, not loaded yet, as LightLLM's
    ``__init__`` has them then) into one tensor: every weight pack (``mm_param`` and the ``mm_param_list`` views
    the loader writes) re-pointed at the same offsets, so the checkpoint loaded afterwards lands in the joint
    tensor. An HCA layer, a quantized weight, ``projection="engine"`` and LightLLM's torch memory saver (the
    weights belong to its weight region) are left as they are; uninstall restores LightLLM's method."""
    _stand_in_lightllm(monkeypatch)
    original = sim.DeepseekV4TpPartModel._init_mem_manager

    def layers():
        c4 = types.SimpleNamespace(
            compressor_wkv_gate_=sim.Linear(torch.full((64, HIDDEN), float("nan")).bfloat16(), fp32_out=False),
            idx_cmp_wkv_gate_=sim.Linear(torch.full((16, HIDDEN), float("nan")).bfloat16(), fp32_out=False),
        )
        hca = types.SimpleNamespace(
            compressor_wkv_gate_=sim.Linear(torch.full((32, HIDDEN), float("nan")).bfloat16(), fp32_out=False)
        )
        quantized = layers_c4()
        quantized.idx_cmp_wkv_gate_.quant_method = types.SimpleNamespace(method_name="fp8w8a8")
        return [c4, hca, quantized]

    def layers_c4():
        return types.SimpleNamespace(
            compressor_wkv_gate_=sim.Linear(torch.zeros(64, HIDDEN).bfloat16(), fp32_out=False),
            idx_cmp_wkv_gate_=sim.Linear(torch.zeros(16, HIDDEN).bfloat16(), fp32_out=False),
        )

    gen = torch.Generator().manual_seed(5)
    checkpoint = {(0, "compressor_wkv_gate_"): torch.randn(64, HIDDEN, generator=gen).bfloat16(),
                  (0, "idx_cmp_wkv_gate_"): torch.randn(16, HIDDEN, generator=gen).bfloat16(),
                  (1, "compressor_wkv_gate_"): torch.randn(32, HIDDEN, generator=gen).bfloat16()}  # fmt: skip
    for projection, joins in (("auto", 1), ("engine", 0)):
        adapter.install(projection=projection)
        model = sim.DeepseekV4TpPartModel(layers())
        model.start(checkpoint)
        assert model.mem_manager_inits == 1 and getattr(model, "_dsv4c_joined_layers", 0) == joins
        c4, hca, quantized = model.trans_layers_weight
        main, idx = c4.compressor_wkv_gate_, c4.idx_cmp_wkv_gate_
        joint = ops.joint_pair_weight(main.mm_param.weight, idx.mm_param.weight)
        assert (joint is not None) == bool(joins)
        for (layer, name), want in checkpoint.items():
            linear = getattr(model.trans_layers_weight[layer], name)
            assert torch.equal(linear.mm_param.weight, want), (projection, layer, name)  # the load reached it
            assert all(p.weight.data_ptr() >= linear.mm_param.weight.data_ptr() for p in linear.mm_param_list)
        if joins:
            assert joint.data_ptr() == main.mm_param_list[0].weight.data_ptr()
            assert idx.mm_param_list[1].weight.data_ptr() == joint[64 + 8 :].data_ptr()
        assert ops.joint_pair_weight(quantized.compressor_wkv_gate_.mm_param.weight,
                                     quantized.idx_cmp_wkv_gate_.mm_param.weight) is None  # fmt: skip
    adapter.install()
    model = sim.DeepseekV4TpPartModel(layers())
    model.args = types.SimpleNamespace(enable_torch_memory_saver=True)  # its weight region: left alone
    model.start(checkpoint)
    c4 = model.trans_layers_weight[0]
    assert ops.joint_pair_weight(c4.compressor_wkv_gate_.mm_param.weight, c4.idx_cmp_wkv_gate_.mm_param.weight) is None
    adapter.uninstall()
    assert sim.DeepseekV4TpPartModel._init_mem_manager is original


def test_online_install_allots_banks_in_place_of_the_c128_ring(monkeypatch, restore_lightllm):
    ring = DeepseekV4MemoryManager(SIZE, (4, 128, 128), MAX_REQ, MTP)
    _stand_in_lightllm(monkeypatch)
    adapter.install(online_hca=True)
    online = DeepseekV4MemoryManager(SIZE, (4, 128, 128), MAX_REQ, MTP)
    banks = adapter.c128_state_banks(online, 2)
    assert banks.shape == (MAX_REQ + 1, MTP + 1, 3, 128) and banks.is_contiguous()
    assert online.fixed_memory == 2 * (MAX_REQ + 1) * (MTP + 1) * 3 * 128 * 4 < ring.fixed_memory
    # no ring at all: a LightLLM path that would still read it fails at once (and the PD copy skips it)
    assert online.c128_state_buffer is None and online.c128_state_ring == ring.c128_state_ring


def test_online_hca_savings_for_v4_flash_and_pro():
    """Memory online HCA frees per request at mtp_step 3, from config numbers; the module docstring says the
    same."""
    hca = CompressorConfig.hca()
    ring, banks = hca.ring_bytes(3), 4 * 3 * hca.head_dim * 4
    assert (ring, banks) == (132 * 1024 * 4, 24 * 1024)
    report = adapter.online_hca_memory_report(3)
    assert report == {"DeepSeek-V4-Flash": 20 * (ring - banks), "DeepSeek-V4-Pro": 31 * (ring - banks)}
    assert adapter.online_hca_savings(20, 3) == report["DeepSeek-V4-Flash"]
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "INTEGRATION.md").read_text().split())
    for n in (ring, banks):
        assert f"{n:,} bytes" in doc
    for freed in report.values():
        assert f"{freed:,} bytes ({freed / 2**20:.2f} MiB) per request ({256 * freed / 2**30:.2f} GiB" in doc


def test_install_refuses_diverse_mode_before_patching_and_serves_pd_and_cpu_cache(monkeypatch, restore_lightllm):
    """With LightLLM's start arguments in the environment (every process it spawns has them), ``install``
    refuses ``--diverse_mode`` in both HCA modes and patches nothing; PD and the CPU cache are served."""
    _stand_in_lightllm(monkeypatch)
    compress = sim.CompressorInfer.compress
    monkeypatch.setenv(adapter.START_ARGS_ENV, json.dumps({"diverse_mode": True, "run_mode": "normal"}))
    for online in (False, True):
        with pytest.raises(adapter.LightLLMModeNotSupported, match="--diverse_mode is not supported"):
            adapter.install(online_hca=online)
        with pytest.raises(adapter.LightLLMModeNotSupported, match="--diverse_mode"):
            adapter.install_on_import(online_hca=online)
    assert sim.CompressorInfer.compress is compress and not any(
        isinstance(f, adapter_patching._PatchOnImport) for f in sys.meta_path
    ), "a refused install patched LightLLM"
    for run_mode in ("prefill", "decode"):
        monkeypatch.setenv(adapter.START_ARGS_ENV, json.dumps({"run_mode": run_mode, "enable_cpu_cache": True}))
        adapter.install(online_hca=True)
    assert sim.CompressorInfer.compress is adapter.compressor_compress


def test_memory_manager_allots_the_step_buffers_it_counts_and_the_mtp_draft_model_gets_none(
    monkeypatch, restore_lightllm
):
    """With LightLLM's start arguments set, ``get_fixed_memory_size`` (what LightLLM subtracts before it sizes the
    KV cache, ``profile_size``) counts the step builder, sized from LightLLM's limits (rows: the largest of
    ``batch_max_tokens``, ``max_req_num * (mtp + 1)`` and the decode graph's rows; one micro-batch without
    overlap), and ``_init_buffers`` allots exactly that builder, which the model's first step then uses. The MTP
    draft model shares the memory manager but has one SWA-only layer (``deepseek_v4_mtp/model.py`` L95): its
    forwards build no plan and get no builder (nor scratch)."""
    _stand_in_lightllm(monkeypatch)
    args = dict(batch_max_tokens=72, graph_max_batch_size=MAX_REQ, mtp_step=MTP, running_max_req_size=MAX_REQ,
                enable_decode_microbatch_overlap=False, enable_prefill_microbatch_overlap=False)  # fmt: skip
    monkeypatch.setenv(adapter.START_ARGS_ENV, json.dumps(args))
    lightllm_own = DeepseekV4MemoryManager(SIZE, (128,), MAX_REQ, MTP).fixed_memory
    adapter.install()
    spy = OpSpy(monkeypatch)
    engine = Engine(rates=(128,), install=True, seed=7, spy=spy)
    builder = adapter_patching._BUILDERS[engine.mm]
    assert (builder.max_rows, len(builder._sets), builder.workspace.buffer.shape) == (128, 1, (1, 128, 128))
    assert engine.mm.fixed_memory == lightllm_own + builder.nbytes > lightllm_own
    engine.step([(0, 0, 11)], decode=False)
    engine.check("prefill")
    assert engine.model._dsv4c_builder is builder, "the model must use the buffers its memory manager counted"
    draft = types.SimpleNamespace(
        mem_manager=engine.mm, layers_infer=[types.SimpleNamespace(compress_ratio=0)], batch_max_tokens=72,
        max_req_num=MAX_REQ, graph_max_batch_size=MAX_REQ * S, is_mtp_draft_model=True,
    )  # fmt: skip
    for decode in (False, True):  # the draft's forwards (its prefill runs on the main model's rows)
        state, _ = sim.make_infer_state(engine.alloc, [], decode=decode, pad_requests=1)
        spy.take()
        state.init_some_extra_state(draft)
        assert spy.take() == [] and draft._dsv4c_builder is None, "the MTP draft model built plans"
    engine.step([(0, 11, S)], decode=True)
    engine.check("decode")
    monkeypatch.setenv(adapter.START_ARGS_ENV, json.dumps(dict(args, enable_decode_microbatch_overlap=True)))
    two = DeepseekV4MemoryManager(SIZE, (128,), MAX_REQ, MTP)
    assert len(adapter_patching._BUILDERS[two]._sets) == 2, "decode overlap runs two micro-batches"


# ---------------------------------------------------------------------------------------------------------------
# From hidden states: our projection in place of LightLLM's GEMM
# ---------------------------------------------------------------------------------------------------------------
HIDDEN = 64  # D, scaled down (DeepSeek-V4-Flash: 4096)


class HiddenEngine(Engine):
    """:class:`Engine` fed hidden states: every compressor has a real bf16 ``wkv_gate`` weight in LightLLM's layout
    (``sim.Linear.from_checkpoint``: ``mm_param.weight``, the row-major ``[2W, D]``), and each step runs
    the adapter's ``compressor_compress`` / ``write_indexer_k`` on bf16 ``x`` ``[T, D]``. The models get the rows
    LightLLM's GEMM produced (``linear.last``), else ``x @ W.T`` in float32 (our projection's rows differ from it
    by float32 rounding only)."""

    def __init__(self, *, projection: str, projection_rows: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.builder = adapter.StepBuilder.for_model(self.model, online_hca=self.online, projection=projection,
                                                     hidden_size=HIDDEN)  # fmt: skip
        if projection_rows is not None:
            self.builder.projection_rows = projection_rows
        wgen = torch.Generator().manual_seed(99)  # the same weights in every engine
        for c in self.compressors:
            w = ((1.5 / HIDDEN**0.5) * torch.randn(c.cfg.row_width, HIDDEN, generator=wgen)).bfloat16()
            prefix = "idx_cmp_" if c.kind == "indexer" else "compressor_"
            linear = sim.Linear.from_checkpoint(w.to(self.device), sim.mm_fp32_supported(self.device))
            setattr(self.weights[c.layer], prefix + "wkv_gate_", linear)
        self.xgen = torch.Generator().manual_seed(7)

    def hidden_step(self, items, *, decode: bool, pad_requests: int = 0) -> torch.Tensor:
        state, mem = self.begin(items, decode=decode, pad_requests=pad_requests)
        self.last_rows, self.gemm_calls = state.position_ids.shape[0], 0
        x = torch.randn(self.last_rows, HIDDEN, generator=self.xgen).bfloat16().to(self.device)
        chunks = {}
        for layer, rate in enumerate(self.rates):
            compressor, index_infer = self.layer_objs[layer]
            weight = self.weights[layer]
            for kind in ("c4", "indexer") if rate == 4 else ("c128",):
                linear = weight.idx_cmp_wkv_gate_ if kind == "indexer" else weight.compressor_wkv_gate_
                linear.last = None
                if kind == "indexer":
                    adapter.write_indexer_k(index_infer, x, state, weight, self.cos, self.sin)
                else:
                    adapter.compressor_compress(compressor, x, state, weight, self.cos, self.sin)
                self.gemm_calls += linear.last is not None
                gemm = linear.last
                kv = gemm if gemm is not None else x.float() @ linear.mm_param.weight.float().t()
                offsets = np.cumsum([0] + [n for _, _, n in items])
                chunks[(layer, kind)] = [kv[offsets[i] : offsets[i + 1]] for i in range(len(items))]
        self.finish(items, mem, chunks)
        return x


def test_projection_weight_reads_lightllm_s_rowmmweight():
    """``projection_weight`` reads LightLLM's ``ROWMMWeight`` as ``support_ds4`` builds the compressors' (the
    ``[2W, D]`` ``mm_param.weight``, a ``NoQuantization`` ``quant_method``, no bias) and the older layout's
    ``weight`` (the ``[D, 2W]`` transposed view); every other weight gets a reason and LightLLM's GEMM."""
    w = (torch.randn(2 * 32, HIDDEN) / 8).bfloat16()
    linear = sim.Linear.from_checkpoint(w, fp32_out=False)
    got, why = adapter.projection_weight(linear, 64, HIDDEN)
    assert why is None and got is linear.mm_param.weight and torch.equal(got, w)
    legacy = types.SimpleNamespace(weight=w.t(), quant_method=None, bias=None)
    got, why = adapter.projection_weight(legacy, 64, HIDDEN)
    assert why is None and got.data_ptr() == w.data_ptr() and torch.equal(got, w)

    def refused(change: dict, match: str) -> None:
        other = sim.Linear.from_checkpoint(w, fp32_out=False)
        for name, value in change.items():
            if name == "weight":
                other.mm_param = sim.WeightPack(value)
            else:
                setattr(other, name, value)
        got, why = adapter.projection_weight(other, 64, HIDDEN)
        assert got is None and match in why, why

    refused({"quant_method": types.SimpleNamespace(method_name="fp8w8a8")}, "quantized (quant_method fp8w8a8)")
    refused({"bias": torch.zeros(64)}, "bias")
    refused({"weight": w.float()}, "float32")
    refused({"weight": w[:48]}, "not [2W, D]")
    refused({"weight": w.t().contiguous().t()}, "unit stride")
    refused({"mm_param": None}, "no weight tensor")
    assert adapter.projection_weight(legacy, 64, HIDDEN + 16)[1].startswith("the weight is")


def _hidden_program(engine: HiddenEngine):
    """Chunked prefill (31 rows with a HOLD request, then 18), then MTP decode steps with HOLD padding (16 rows)."""
    engine.hidden_step([(0, 0, 21), (1, 0, 6)], decode=False, pad_requests=1)
    yield "prefill"
    engine.hidden_step([(0, 21, 11), (1, 6, 7)], decode=False)
    yield "prefill 2"
    lengths = {0: 32, 1: 13}
    for i in range(3):
        items = []
        for req in sorted(lengths):
            start = lengths[req] - (0 if i == 0 else int(engine.rng.integers(0, S)))
            items.append((req, start, S))
            lengths[req] = start + S
        engine.hidden_step(items, decode=True, pad_requests=2)
        yield f"decode {i}"


@pytest.mark.parametrize("online", [False, True], ids=["ring", "online"])
def test_from_hidden_states_matches_lightllm_s_gemm_then_compress(monkeypatch, online):
    _from_hidden_against_gemm(monkeypatch, online, "cpu")


def test_online_c128_layers_project_on_the_partials_path(monkeypatch):
    """With online banks, the C128 layers' from-hidden gate follows the online op's ``auto``
    (``ops.projection_triton_rows(online=True)``: the rows ``kernels.projection.PARTIALS`` has blocks for, patched
    here for the test's shapes), and their decode steps run ``compress_online_hca_from_hidden`` on the projection's
    unsummed partials; the ring's gate and the C4 widths' do not move. The engine checks every step (entries
    against float64 of the rows the model was given, the banks)."""
    kwargs = dict(projection="auto", rates=(4, 128), seed=4, slot_seed=40)
    probe = HiddenEngine(online=True, **kwargs)
    c128, c4 = probe.builder.c128_width, probe.builder.c4_widths
    assert probe.builder.triton_rows(c128, HIDDEN) == 0  # the test's shapes are in no measured table
    monkeypatch.setitem(proj.PARTIALS, (c128, HIDDEN), {16: proj.ProjectionConfig(16, 32, 16, 2)})
    ring = HiddenEngine(online=False, **kwargs)
    assert ring.builder.triton_rows(ring.builder.c128_width, HIDDEN) == 0
    engine = HiddenEngine(online=True, **kwargs)
    assert engine.builder.triton_rows(c128, HIDDEN) == min(engine.builder.projection_rows, 16) > 0
    assert all(engine.builder.triton_rows(w, HIDDEN) == 0 for w in c4)
    assert engine.builder.nbytes > probe.builder.nbytes  # the C128 workspace, sized for the partials
    left = []
    real = proj.launch_projection
    monkeypatch.setattr(proj, "launch_projection", lambda *a, **k: left.append(not k["reduce"]) or real(*a, **k))
    steps = [what for what in _hidden_program(engine)]
    assert steps[-1] == "decode 2"
    decode_rows, c128_layers = 16, engine.rates.count(128)
    assert engine.last_rows == decode_rows and left == [True] * 3 * c128_layers  # three decode steps, none before


def test_decode_steps_project_a_c4_layer_s_two_weights_in_one_launch(monkeypatch):
    """With the pair measured faster (``ops.pair_projection_rows``, patched for the test's hidden size), each C4
    layer of a decode step runs one ``ops.project`` of its main and indexer weights, then one ``compress_pair``
    on its columns (from the main call; the indexer's call finds its work done); prefill steps do not pair. The same
    checks as unpaired: entries against float64, pools and state equal to LightLLM's GEMM run but at rounding
    boundaries, launches as ``ops.launches`` counts them."""
    _from_hidden_against_gemm(monkeypatch, False, "cpu", paired=True)


def test_joined_c4_weights_project_both_in_one_gemm_on_every_decode_step(monkeypatch):
    """With the C4 layer's two weights joined (``join_c4_weights``), every decode step the builder projects
    (here beyond ``pair_rows``, which the test's hidden size leaves at 0) runs one ``ops.project`` of both on
    ``projection="torch"`` (one GEMM of the joint weight, no Triton launch), then one ``compress_pair`` on its
    columns; the rest as unpaired, and the same checks."""
    _from_hidden_against_gemm(monkeypatch, False, "cpu", joined=True)


def test_an_indexer_call_with_other_arguments_compresses_its_held_columns(monkeypatch):
    """The C4 layer's first call compresses both compressors with its own rope tables; an indexer call that reads
    other ones (here equal copies) is not taken as done: it compresses the held columns with its own arguments,
    and every entry is right."""
    monkeypatch.setattr(adapter.ops, "projection_triton_rows", lambda width, dim, **_: 1 << 20)
    monkeypatch.setattr(adapter.ops, "pair_projection_rows", lambda first, second, dim: 1 << 20)
    engine = HiddenEngine(projection="auto", projection_rows=24, rates=(4, 128), online=False, seed=4, slot_seed=40)
    real = adapter.write_indexer_k

    def with_copied_tables(obj, x, state, weight, cos, sin):
        return real(obj, x, state, weight, cos.clone(), sin.clone())

    monkeypatch.setattr(adapter, "write_indexer_k", with_copied_tables)
    monkeypatch.setattr(OpSpy, "NAMES", OpSpy.NAMES + ("compress_pair",))
    spy = OpSpy(monkeypatch)
    decodes = 0
    for what in _hidden_program(engine):
        calls = [(name, kw.get("kind")) for name, kw in spy.take() if name in ("compress", "compress_pair")]
        for c in engine.compressors:
            engine._check_entries(c, what)
        if what.startswith("decode"):
            assert [c for c in calls if c[1] != "hca"] == [("compress_pair", None), ("compress", "indexer")], calls
            decodes += 1
    assert decodes == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs a CUDA device and compiled kernels")
@pytest.mark.parametrize("online", [False, True], ids=["ring", "online"])
def test_from_hidden_states_matches_lightllm_s_cublas_gemm_on_gpu(monkeypatch, online):
    """The same on the GPU: LightLLM's GEMM is cuBLAS (``torch.mm(x, W, out_dtype=torch.float32)``), ours the
    Triton split-K projection; the differing bytes are counted (printed) and must stay at rounding boundaries."""
    _from_hidden_against_gemm(monkeypatch, online, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs a CUDA device and compiled kernels")
@pytest.mark.parametrize("joined", [False, True], ids=["apart", "joined"])
def test_paired_projection_matches_lightllm_s_cublas_gemm_on_gpu(monkeypatch, joined):
    """The paired decode steps on the GPU: one ``ops.project`` per C4 layer (our one launch over both weights;
    joined: cuBLAS on the joint weight) against LightLLM's cuBLAS GEMMs."""
    _from_hidden_against_gemm(monkeypatch, False, "cuda", paired=not joined, joined=joined)


def _from_hidden_against_gemm(monkeypatch, online: bool, device: str, paired: bool = False,
                              joined: bool = False) -> None:  # fmt: skip
    """``projection="auto"``: steps of at most ``builder.triton_rows(2W, D)`` rows (here 24, so that the first
    prefill of 31 rows stays on LightLLM's GEMM) run ``ops.compress_from_hidden`` /
    ``compress_online_hca_from_hidden`` (our projection, then the compression: one op per compressor) in place
    of LightLLM's GEMM and ``ops.compress``; ``projection="engine"`` keeps LightLLM's GEMM. The two runs, on the
    same slots and hidden states, hold the same pool bytes and state but at float32 rounding boundaries of the
    projection (counted); the GEMM run is checked as everywhere (entries against float64, state rows bit for
    bit), ours' entries against the float64 reference of ``x @ W.T``. Our steps launch what ``ops.launches``
    says: the step's builds, then per compressor the projection and the compression."""
    kwargs = dict(rates=(4, 128), online=online, seed=4, slot_seed=40, device=device)
    gemm = HiddenEngine(projection="engine", **kwargs)
    plain = HiddenEngine(projection="auto", **kwargs)  # the test's shapes are not in the measured table: cuBLAS
    assert plain.builder.nbytes == gemm.builder.nbytes
    assert plain.builder.triton_rows(2048, 4096) == min(plain.builder.projection_rows, 64)  # V4-Flash CSA main
    assert plain.builder.triton_rows(512, 7168) == 0 and gemm.builder.triton_rows(2048, 4096) == 0
    # our projection for every width of the test's hidden size, as the measured table has it for the indexer
    monkeypatch.setattr(adapter.ops, "projection_triton_rows", lambda width, dim, **_: 1 << 20)
    assert plain.builder.pair_rows(HIDDEN) == 0 and "pair" not in plain.builder._projection_ws[0]
    if paired:
        monkeypatch.setattr(adapter.ops, "pair_projection_rows", lambda first, second, dim: 1 << 20)
    ours = HiddenEngine(projection="auto", projection_rows=24, **kwargs)
    assert gemm.builder.projection_rows == 0 and ours.builder.nbytes > gemm.builder.nbytes
    assert ("pair" in ours.builder._projection_ws[0]) == paired
    if joined:  # the C4 layer's two weights one tensor's halves (same values): one GEMM projects both
        c4 = ours.weights[ours.rates.index(4)]
        values = [w.clone() for w in (c4.compressor_wkv_gate_.mm_param.weight, c4.idx_cmp_wkv_gate_.mm_param.weight)]
        assert adapter.join_c4_weights(ours.weights) == 1
        weights = (c4.compressor_wkv_gate_.mm_param.weight, c4.idx_cmp_wkv_gate_.mm_param.weight)
        assert ops.joint_pair_weight(*weights) is not None and all(map(torch.equal, weights, values))
        assert adapter.join_c4_weights(ours.weights) == 1 and ops.joint_pair_weight(*weights) is not None
    monkeypatch.setattr(OpSpy, "NAMES", OpSpy.NAMES + ("compress_from_hidden", "compress_online_hca_from_hidden",
                                                       "project", "compress_pair"))  # fmt: skip
    spy = OpSpy(monkeypatch)
    names = count_launches(monkeypatch) if interpreting() else None
    hca = "compress_online_hca" if online else "compress"
    hca_ratio = DSV4_C128_STATE_RING
    diff_bytes = diff_words = total_bytes = 0
    steps_g, steps_o = _hidden_program(gemm), _hidden_program(ours)
    for what in steps_g:
        gemm.check(what)
        spy.take()
        if names is not None:
            names.clear()
        assert next(steps_o) == what
        calls, rows = spy.take(), ours.last_rows
        for c in ours.compressors:  # ours: the entries against the float64 reference of x @ W.T
            ours._check_entries(c, what)
        hidden = [(name, kw) for name, kw in calls if name.endswith("_from_hidden")]
        if rows > 24:  # LightLLM's GEMM in both runs
            assert hidden == [] and ours.gemm_calls == 3, [name for name, _ in calls]
            continue
        assert ours.gemm_calls == 0 and gemm.gemm_calls == 3, "LightLLM's GEMM ran on a step our op projects"
        decode = what.startswith("decode")
        projects = [kw for name, kw in calls if name == "project"]
        # build_plans with the C4 tables (one launch on steps that fit one program, else one per plan and one for
        # the tables); then each compressor's op
        want = ops.launches("build_plans", rows=rows, requests=MAX_REQ, plans=2, tables=True)
        if (paired or joined) and decode:  # the C4 layer: one projection of both weights, one compress_pair
            assert [name for name, _ in hidden] == [hca + "_from_hidden"], calls
            assert len(projects) == 1 and projects[0]["weight2"] is not None and projects[0]["rows"] == rows
            assert projects[0].get("projection", "auto") == ("torch" if joined else "auto")  # joined: one GEMM
            kinds = [kw["kind"] for name, kw in calls if name == "compress" and kw.get("kind") != "hca"]
            pairs = [kw for name, kw in calls if name == "compress_pair"]
            assert kinds == [] and len(pairs) == 1 and pairs[0]["decode"], calls
            assert pairs[0]["read_rows"] is pairs[0]["indexer_read_rows"] is not None  # LightLLM's C4 tables
            want += 0 if joined else 1  # the joint weight's GEMM is cuBLAS's, not a Triton launch
            want += ops.launches("compress_pair", rows=rows, requests=MAX_REQ, decode=True, tables=True)
        else:
            assert projects == [], calls
            assert [name for name, _ in hidden] == ["compress_from_hidden"] * 2 + [hca + "_from_hidden"], calls
        for name, kw in hidden:
            ratio = 4 if kw.get("kind") in ("csa", "indexer") else hca_ratio
            want += ops.launches(name, rows=rows, requests=MAX_REQ, ratio=ratio, kind=kw.get("kind", "hca"),
                                 decode=decode, scratch=kw.get("scratch") is not None,
                                 tables=kw.get("read_rows") is not None)  # fmt: skip
        assert names is None or len(names) == want, (what, want, names)
        # the two runs' pools and state: equal but at the projection's rounding boundaries
        for c_g, c_o in zip(gemm.compressors, ours.compressors):
            diff_bytes += int((c_g.pages != c_o.pages).sum().cpu())
            total_bytes += len(c_g.written) * c_g.layout.record_bytes
        for name, t in gemm._state_tensors().items():
            t, o = t.cpu(), ours._state_tensors()[name].cpu()
            finite = torch.isfinite(t)
            assert torch.equal(finite, torch.isfinite(o)), f"{what}: {name}: ours wrote other state rows"
            assert torch.allclose(t[finite], o[finite], rtol=1e-5, atol=1e-5), f"{what}: {name}: beyond rounding"
            diff_words += int((t[finite] != o[finite]).sum())
    print(f"from hidden ({'online' if online else 'ring'}, {device}): {diff_bytes} of {total_bytes} entry bytes and "
          f"{diff_words} state words differ from LightLLM's GEMM path")  # fmt: skip
    assert 0 < total_bytes and diff_bytes <= total_bytes // 50, "over 2% of entry bytes differ: not rounding"
    assert ours.builder.projection_fallbacks == {}


# ---------------------------------------------------------------------------------------------------------------
# PD disaggregation
# ---------------------------------------------------------------------------------------------------------------
def _entry_records(engine: Engine, c: Compressor, req: int) -> torch.Tensor:
    """The stored records of every group request ``req`` has closed, in group order."""
    r = c.ratio
    ends = engine.req.req_to_token_indexs.cpu()[req, torch.arange(c.model.length(req) // r) * r + r - 1].long()
    table = engine.mm.full_to_c128_indexs if c.kind == "c128" else engine.mm.full_to_c4_indexs
    return c.layout.read(c.pages.cpu(), table.cpu()[ends].long())


def _pd_transfer(prefill: Engine, decode: Engine, req_p: int, req_d: int) -> None:
    """LightLLM's PD transfer of one prefilled request: the decode node allocates its slots for ``[0, L)``
    (``prepare_pd_decode_cache``, req manager L531-573), the prefill node stages the request in pages of whole
    radix pages (``prefill_impl.py`` L60-73; the last page when prefill ends), each page is sent and unpacked
    (``prefill_trans_process.py`` L190-200, ``decode_trans_process.py`` L170-180); the transport (NIXL) is a copy
    of the bytes the page sends. Then the decode node's models hold the request's rows, and its accounting the
    entries and ring rows the transfer wrote."""
    length = prefill.alloc.length[req_p]
    page = 2 * DSV4_C128_STATE_RING  # scaled: LightLLM's 2048-token PD page is a multiple of its 256-token radix page
    decode.alloc.prepare(req_d, 0, length)
    decode.alloc.upload()
    for engine in (prefill, decode):
        engine.mm.alloc_paged_kv_move_buffer(page_num=2, page_size=page)
    for k, start in enumerate(range(0, length, page)):
        end = min(start + page, length)
        src = prefill.req.req_to_token_indexs[req_p, start:end].tolist()
        sent = prefill.mm.write_mem_to_page_kv_move_buffer(
            src, page_index=k, dp_index=0, mem_managers=[prefill.mm], dp_world_size=1, start_kv_index=start,
            request_kv_len=length, req_idx=req_p,
        )  # fmt: skip
        decode.mm.kv_move_buffer[k].view(-1)[:sent] = prefill.mm.kv_move_buffer[k].view(-1)[:sent]
        dst = decode.req.req_to_token_indexs[req_d, start:end].tolist()
        decode.mm.read_page_kv_move_buffer_to_mem(
            dst, page_index=k, dp_index=0, mem_managers=[decode.mm], dp_world_size=1, start_kv_index=start,
            request_kv_len=length, req_idx=req_d,
        )  # fmt: skip
    r, ring = DSV4_C128_STATE_RING, decode.mm.c128_state_ring
    for c_d, c_p in zip(decode.compressors, prefill.compressors):
        c_d.model.apply(req_d, 0, c_p.model.rows[req_p])
        ends = decode.req.req_to_token_indexs[req_d, torch.arange(length // r) * r + r - 1].long()
        c_d.written.update(int(x) for x in decode.mm.full_to_c128_indexs[ends])
    decode.saved_c128.update(req_d * ring + p % ring for p in range(length - length % r, length))
    decode.first_start[req_d] = length


@pytest.mark.parametrize("online", [False, True], ids=["ring", "online"])
def test_pd_transfer_carries_the_hca_state_to_the_decode_node(monkeypatch, restore_lightllm, online):
    """A prefill node (``mtp_step`` 0, ``model.py`` L96) prefills two requests, one ending inside an HCA group, one
    on a group end; LightLLM's PD page transfer (stand-in: ``sim.copy_pd_cache_page``) moves them to a decode node
    (``mtp_step`` 3), into other request slots, where MTP decode steps follow. The decode node's entries are
    checked against float64 and are byte for byte those of a node that ran the same rows without transfer. Ring:
    LightLLM's own transfer of the open group's ring rows; online: ``install(online_hca=True)`` carries the bank
    (:func:`adapter.move_pd_banks`) in the page's C128 state section. The decode node's banks start poisoned."""
    _stand_in_lightllm(monkeypatch)
    adapter.install(online_hca=online)
    prefill = Engine(rates=(128,), online=online, install=True, seed=5, mtp=0, slot_seed=50)
    decode = Engine(rates=(128,), online=online, install=True, seed=5, slot_seed=60)
    local = Engine(rates=(128,), online=online, install=True, seed=5, slot_seed=70)  # the run without transfer
    for items in ([(1, 0, 13), (0, 0, 16)], [(1, 13, 8)]):
        chunks = prefill.step(items, decode=False)
        local.step([(2 + req, start, n) for req, start, n in items], decode=False, chunks=chunks)
    prefill.check("prefill node")
    for req_p in (0, 1):  # lengths 16 (every group closed: nothing to carry) and 21 (a group open)
        _pd_transfer(prefill, decode, req_p, 2 + req_p)
    decode.check("transferred")
    lengths = {2: 16, 3: 21}
    for i in range(2):
        items = []
        for req in sorted(lengths):
            start = lengths[req] - (0 if i == 0 else int(decode.rng.integers(0, S)))
            items.append((req, start, S))
            lengths[req] = start + S
        chunks = decode.step(items, decode=True, pad_requests=1)
        local.step(items, decode=True, pad_requests=1, chunks=chunks)
        decode.check(f"decode node {i}")
        for c_d, c_l in zip(decode.compressors, local.compressors):
            for req in lengths:
                got, want = _entry_records(decode, c_d, req), _entry_records(local, c_l, req)
                assert torch.equal(got, want), f"decode step {i}: request {req}'s entries differ from a run without PD"


# ---------------------------------------------------------------------------------------------------------------
# Launching LightLLM with the adapter
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def spawn_stand_ins(tmp_path, monkeypatch):
    """``sim.write_spawn_stand_ins``'s LightLLM-shaped package on ``sys.path`` (a spawned process inherits it),
    with ``spawn`` as the start method as LightLLM sets it; LightLLM modules imported meanwhile are dropped."""
    sim.write_spawn_stand_ins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "lightllm" or n.startswith("lightllm.")]:
        monkeypatch.delitem(sys.modules, name)
    method = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    yield tmp_path
    multiprocessing.set_start_method(method, force=True)
    adapter.uninstall()
    for name in [n for n in sys.modules if n == "lightllm" or n.startswith("lightllm.")]:
        del sys.modules[name]


def _spawn_router(monkeypatch, root, main_module: str) -> list[dict]:
    """Start LightLLM's router stand-in in a spawned process, this process's ``__main__`` being
    ``main_module`` as ``python -m main_module`` makes it; the router spawns the model worker. Their reports."""
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec(main_module)
    monkeypatch.setitem(sys.modules, "__main__", main)
    from lightllm.server.router.manager import start_router_process

    report = root / f"{main_module}.jsonl"
    router = multiprocessing.Process(target=start_router_process, args=(str(report),))
    router.start()
    router.join(300)
    assert router.exitcode == 0, f"the router exited with {router.exitcode}"
    return [json.loads(line) for line in report.read_text().splitlines()]


def test_every_process_lightllm_spawns_from_the_launcher_has_the_adapter(spawn_stand_ins, monkeypatch):
    """LightLLM starts its router with ``spawn`` and the router its model workers (``api_server.py`` L14,
    ``model_rpc.py`` L217). A spawned process first re-imports the launch process's main module by name: with the
    launcher as main (``python -m dsv4_compressor.integrations.lightllm``) the router and the worker it spawns
    both run ``install_from_environment`` (``$DSV4C_LIGHTLLM=online``) and see every patch, without the hook
    having imported LightLLM's modules; with ``python -m lightllm.server.api_server`` as main they run
    LightLLM's own code."""
    monkeypatch.setenv(adapter.ENV_VAR, "online")
    patched = _spawn_router(monkeypatch, spawn_stand_ins, "dsv4_compressor.integrations.lightllm.launch")
    plain = _spawn_router(monkeypatch, spawn_stand_ins, "lightllm.server.api_server")
    flags = ("init_some_extra_state", "compress", "write_indexer_k", "get_fixed_memory_size", "pd_banks",
             "init_mem_manager")  # fmt: skip
    for lines, main, want in ((patched, "dsv4_compressor.integrations.lightllm.launch", True),
                              (plain, "lightllm.server.api_server", False)):  # fmt: skip
        assert [line["where"] for line in lines] == ["router", "model worker"], lines
        assert len({line["pid"] for line in lines} | {os.getpid()}) == 3, "router and worker are processes of their own"
        for line in lines:
            assert line["main"] == main and line["imported_before"] == [], line
            assert all(line[f] is want for f in flags), line


def test_the_launcher_command_patches_every_process_it_spawns(spawn_stand_ins):
    """``python -m dsv4_compressor.integrations.lightllm --dsv4c online <LightLLM's arguments>`` as a user types it
    (a child Python, LightLLM's launch stand-ins on its path): the package's ``__main__`` hands over to
    :mod:`.launch`, whose name the spawned router and model worker re-run, so both run patched. (Run as
    ``<package>.__main__`` itself, ``spawn`` would re-run nothing in them.)"""
    report = spawn_stand_ins / "launched.jsonl"
    src = Path(adapter.__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(spawn_stand_ins), str(src)]))
    env.pop(adapter.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-m", "dsv4_compressor.integrations.lightllm", "--dsv4c", "online",
                           "--report", str(report)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line["where"] for line in lines] == ["router", "model worker"], lines
    for line in lines:
        assert line["main"] == "dsv4_compressor.integrations.lightllm.launch", line
        assert line["compress"] is True and line["pd_banks"] is True and line["imported_before"] == [], line


def test_launcher_parses_lightllm_s_arguments_refuses_before_it_starts_and_hands_over(spawn_stand_ins, monkeypatch,
                                                                                        capsys):  # fmt: skip
    """``main`` parses LightLLM's arguments with LightLLM's parser, refuses a mode it cannot serve before
    anything starts, sets ``$DSV4C_LIGHTLLM`` for the processes to come, installs the import hook and calls
    ``launch_server`` with LightLLM's ``StartArgs``; ``--dsv4c off`` leaves LightLLM alone."""
    import lightllm.server.api_server as api_server
    from lightllm.server.core.objs.start_args_type import StartArgs

    started = []
    monkeypatch.setattr(api_server, "launch_server", started.append)
    monkeypatch.delenv(adapter.ENV_VAR, raising=False)
    with pytest.raises(SystemExit) as refused:
        adapter.main(["--report", "r", "--dsv4c", "online", "--diverse_mode"])
    assert refused.value.code == 2 and "--diverse_mode is not supported" in capsys.readouterr().err
    assert started == [] and not any(isinstance(f, adapter_patching._PatchOnImport) for f in sys.meta_path)
    adapter.main(["--report", "r", "--dsv4c", "online", "--mtp_step", "3"])
    (args,) = started
    assert isinstance(args, StartArgs) and (args.mtp_step, args.report, args.run_mode) == (3, "r", "normal")
    assert os.environ[adapter.ENV_VAR] == "online"
    from lightllm.common.kv_cache_mem_manager import deepseek4_mem_manager as mem  # imported after the hook

    assert hasattr(mem.DeepseekV4MemoryManager.write_mem_to_page_kv_move_buffer, "__wrapped__")
    adapter.uninstall()
    adapter.main(["--dsv4c", "off", "--report", "r"])
    assert len(started) == 2 and os.environ[adapter.ENV_VAR] == "off"
    assert not any(isinstance(f, adapter_patching._PatchOnImport) for f in sys.meta_path)


# ---------------------------------------------------------------------------------------------------------------
# What online HCA gives LightLLM back
# ---------------------------------------------------------------------------------------------------------------
def test_capacity_from_lightllm_s_own_sizing_for_v4_flash_and_pro():
    """LightLLM sizes its KV cache as ``(available - get_fixed_memory_size()) / get_cell_size()``: online HCA's
    extra tokens are the fixed bytes it saves over LightLLM's bytes per token, whatever the weights leave. At
    LightLLM's defaults (256 request slots, ``mtp_step`` 0): the adapter's ring install adds only its step
    buffers, online swaps the ring for the banks; docs/INTEGRATION.md holds the same table."""
    rows = sim.capacity_report(adapter)
    # LightLLM's bytes per token for V4-Flash at mtp_step 0, by hand from mem manager L478-487
    swa = 584 * 43 + 8 / 128 * (4 * 512 + 4 * 128) * 4 * 21
    assert rows[0]["cell_bytes"] == pytest.approx(0.1 * swa + (584 + 132) * 21 / 4 + 584 * 20 / 128)
    for row in rows:
        mtp, requests = row["mtp_step"], row["max_request_num"]
        ring = 4 * 2 * 512 * (-(-(128 + mtp) // 4) * 4 * (requests + 1) + 1)
        hca = {"DeepSeek-V4-Flash": 20, "DeepSeek-V4-Pro": 31}[row["model"]]
        assert row["lightllm_fixed"] == hca * ring
        steps = row["ring_fixed"] - row["lightllm_fixed"]  # the adapter's plans and scratch, in both modes
        assert 32 * 2**20 <= steps < 40 * 2**20
        assert row["online_fixed"] == hca * (requests + 1) * (mtp + 1) * 3 * 512 * 4 + steps
        assert row["extra_tokens"] == int((row["ring_fixed"] - row["online_fixed"]) // row["cell_bytes"]) > 300_000
    doc = (Path(__file__).parents[1] / "docs" / "INTEGRATION.md").read_text()
    assert sim.capacity_table(rows) in doc, (
        "docs/INTEGRATION.md: regenerate with cd tests && python -m helpers.lightllm_sim capacity"
    )


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs (GPU)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs a CUDA device and compiled kernels")
@pytest.mark.parametrize("online, builder_in_graph", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_graph_replays_lightllm_steps_on_gpu(online, builder_in_graph):
    """LightLLM's decode graph: a warm-up step, a captured step, then replays whose metadata arrives as a new
    ``infer_state`` copied into the captured one. ``builder_in_graph=False`` is LightLLM's flow (the builder
    runs eagerly in ``init_some_extra_state`` into the buffers the graph reads); ``True`` captures the builder
    too (its launches are graph-safe). Two C4 layers and one C128 layer, MTP rewinds, HOLD padding."""
    engine = Engine(rates=(4, 128, 4), online=online, seed=4, device="cuda")
    engine.step([(0, 0, 21), (1, 0, 13), (2, 0, 6)], decode=False, pad_requests=1)
    torch.cuda.synchronize()
    engine.check("prefill")
    lengths = {0: 21, 1: 13, 2: 6}

    def decode_items(first: bool):
        items = []
        for req in sorted(lengths):
            accepted = int(engine.rng.integers(0, S))
            start = lengths[req] if first else lengths[req] - (S - 1 - accepted)
            items.append((req, start, S))
            lengths[req] = start + S
        return items

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up compiles every kernel at the graph's row count
        engine.step(decode_items(True), decode=True, pad_requests=1, pad_rows=S)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    engine.check("warm-up")

    graph = torch.cuda.CUDAGraph()
    captured, static = None, None
    for k in range(12):
        items = decode_items(False)
        state, mem = engine.begin(items, decode=True, pad_requests=1, pad_rows=S, build=not builder_in_graph)
        chunks, kv = engine.draw(items, state.position_ids.shape[0])
        if captured is None:
            captured, static = state, kv
            with torch.cuda.graph(graph):
                if builder_in_graph:
                    engine.builder.build(captured)
                engine.run_layers(captured, static)
        else:
            sim.copy_for_cuda_graph(captured, state)
            for key, rows in kv.items():
                static[key].copy_(rows)
        graph.replay()
        engine.finish(items, mem, chunks)
        torch.cuda.synchronize()
        engine.check(f"replay {k}")
