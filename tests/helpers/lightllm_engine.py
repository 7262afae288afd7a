"""The scaled-down LightLLM engine the LightLLM adapter's tests serve through: its memory manager subclass
(LightLLM's ``deepseek4_mem_manager.py`` constants, scaled down), the :class:`Engine` that allocates, steps and checks
as LightLLM does, and the stand-in modules registered under LightLLM's import paths.

The adapter reads the memory manager's constants from the module that defines its class: this one.
Used by ``tests/test_integration_lightllm*.py``."""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import torch

from dsv4_compressor import ops, reference
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout
from dsv4_compressor.verify import check_indexer_pack, check_latent_records
from helpers import lightllm_sim as sim
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, make_params, random_rows
from helpers.model import StreamModel

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

HIDDEN = 64  # D of the from-hidden tests, scaled down (DeepSeek-V4-Flash: 4096)


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
