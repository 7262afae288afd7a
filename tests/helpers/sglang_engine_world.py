"""SGLang's real pools, backend, builders and ``Compressor``s on one device, for a step program run twice: once
through SGLang's own compressor path (its JIT CUDA kernels; no ``install()``) and once through the adapter
(``install(projection=..., hca=...)``: with ``hca="online"`` the C128 layer's state is our banks in SGLang's C128
pool, sized for them), on identical inputs, so the two runs' pages and state rows can be compared byte for
byte (``tests/test_engine_sglang_gpu.py``).

The world is ``tests/test_engine_sglang.py``'s ``RealPoolWorld`` (its pool shapes: layer 0 C128, layer 1 C4 with
its indexer, 256-token pages; ``tests/test_integration_sglang.py``'s bookkeeping and checks) made device-generic,
driven from bf16 hidden states, with decode and verify steps captured as CUDA graphs the way SGLang's graph
runners do it (a raw metadata of static buffers, ``init_forward_metadata_in_graph`` and every layer recorded,
then each step copies its inputs into the buffers and replays) and the C4 layer's two compressors held by a model
the backend's constructor sees (so ``projection="auto"`` joins their weights: the paired launch).

Stand-ins (as in the CPU test): the ``ModelRunner`` (a namespace of what the constructor reads), the SWA
allocator's mapping (a page permutation registered through the pool's own ``register_mapping``), the scheduler,
``dsa_utils.get_parallel`` (no process group) and the attention indexer's top-k metadata
(``init_forward_metadata_indexer``: deep_gemm; no compressor reads it). On CPU (``device="cpu"``) FlashMLA's
schedule is None as in the CPU test and no graph is captured.
"""

from __future__ import annotations

import types

import numpy as np
import test_engine_sglang as tes
import test_integration_sglang as tis
import torch

from dsv4_compressor import reference
from dsv4_compressor.integrations import sglang as sg
from dsv4_compressor.verify import ABS_TOL_RMS
from helpers.inputs import INDEXER_CFG, projection_weight

backend_mod, pool_mod, compressor_mod = tes.backend_mod, tes.pool_mod, tes.compressor_mod
CSA, HCA = tes.CSA, tes.HCA
PAGE, PAGES, SLOTS = tes.REAL_PAGE, tes.REAL_PAGES, tes.REAL_SLOTS
HIDDEN_GPU = 4096  # DeepSeek-V4-Flash's hidden size: our projection's measured gate (64 / 256 rows) applies as is
PADDING_ROWS = "rows < ring"  # request 0 (SGLang's CUDA-graph padding) owns state rows [0, ring) and slot 0


def compressor_on(layer, hidden: int, device: torch.device):
    """SGLang's own ``Compressor`` of a world layer, built on ``device`` (its APE through SGLang's loader, the
    layer's norm weight and bf16 ``layer.weight`` as ``wkv_gate``)."""
    p, cfg = layer.params, layer.cfg
    indexer = cfg.output == "indexer"
    with torch.device(device):
        c = compressor_mod.Compressor(
            types.SimpleNamespace(hidden_size=hidden, rms_norm_eps=p.eps), layer_id=layer.layer_id,
            is_in_indexer=indexer, freqs_cis=torch.complex(p.cos, p.sin).to(device), compress_ratio=cfg.ratio,
            head_dim=cfg.head_dim, rotate=indexer,
        )  # fmt: skip
    with torch.no_grad():
        c.load_ape_weight(c.ape, p.ape.to(device))
        c.norm.weight.copy_(p.norm_weight.float())
        c.wkv_gate.weight.copy_(layer.weight)
    return c


class EngineWorld(tis.World):
    """One run of the program on SGLang's real objects (see the module docstring). ``ours`` says whether the
    adapter is installed (the caller installs it before constructing). After each step :attr:`log` holds the
    step's mode, rows and a snapshot (pages, state) of every layer; :meth:`check` runs the float64 checks."""

    def __init__(self, server_args, *, device: str, hidden: int, ours: bool, seed: int = 31):
        ns = types.SimpleNamespace
        draft = tes.runtime_mod.get_spec().speculative_num_draft_tokens
        self.draft_tokens, self.unified_kv, self.device = draft or 1, False, torch.device(device)
        self.ours, self.hidden = ours, hidden
        #: SGLang's own run: ``(layer, step, first line)`` of each float64 check its records fail (counted, not
        #: asserted: SGLang's kernels are the engine's reference, not held to our tolerance)
        self.engine_deviations: list[tuple[str, str, str]] = []
        self.rng = np.random.default_rng(seed)
        self.gen, self.xgen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
        self.lengths, self.pages, self.captured = {}, {}, {}
        self.free_pages = [int(p) for p in self.rng.permutation(np.arange(1, PAGES))]
        ratios = [HCA.ratio, CSA.ratio]
        size = PAGES * PAGE
        self.pool = pool_mod.DeepSeekV4TokenToKVPool(
            max_num_reqs=SLOTS, swa_size=size, c4_size=size // 4, c128_size=size // 128,
            c4_state_pool_size=PAGES * 16, c128_state_pool_size=0, page_size=PAGE, swa_page_size=PAGE,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
            qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=INDEXER_CFG.head_dim, layer_num=2,
            device=device, enable_memory_saver=False, compression_ratios=ratios,
        )  # fmt: skip
        self.ring4, self.ring128 = self.pool.get_ring_size(4), self.pool.get_ring_size(128)
        swa_of_page = np.concatenate([[0], 1 + self.rng.permutation(PAGES - 1)])
        full = np.arange(size)
        swa = swa_of_page[full // PAGE] * PAGE + full % PAGE
        self.full_to_swa = torch.tensor(swa, dtype=torch.int64, device=device)
        self.pool.register_mapping(self.full_to_swa)
        self.req_pool = tes.memory_pool_mod.ReqToTokenPool(size=SLOTS, max_context_len=512, device=device,
                                                           enable_memory_saver=False)  # fmt: skip
        self.req_to_token = self.req_pool.req_to_token
        self.layers = []
        for name, cfg, layer_id in (("hca", HCA, 0), ("csa", CSA, 1), ("indexer", INDEXER_CFG, 1)):
            if cfg.output == "indexer":
                state = self.pool.get_indexer_compress_states(layer_id)
                memory, page = self.pool.get_index_k_with_scale_buffer(layer_id), self.pool.get_index_k_page_size()
            else:
                state = self.pool.get_attention_compress_states(layer_id)
                memory, page = self.pool.get_extra_key_buffer(layer_id), self.pool.get_extra_key_page_size(layer_id)
            layer = tes._PoolLayer(self, name, cfg, layer_id, None, state.kv_score_buffer.kv_score, memory, page)
            layer.weight = projection_weight(cfg.row_width, hidden, seed=40 + len(self.layers)).to(device)
            layer.compressor = compressor_on(layer, hidden, self.device)
            self.layers.append(layer)
        # the model the backend's constructor sees: the C4 layer's attention holds both compressors
        csa, idx = self.layers[1], self.layers[2]
        model, attn = torch.nn.Module(), torch.nn.Module()
        attn.compressor, attn.indexer = csa.compressor, torch.nn.Module()
        attn.indexer.compressor = idx.compressor
        model.attn = attn
        hf = ns(hidden_size=hidden, head_dim=512, index_head_dim=INDEXER_CFG.head_dim, compress_ratios=ratios)
        model_config = ns(head_dim=512, v_head_dim=512, context_len=512, hf_text_config=hf, hf_config=hf)
        runner = ns(device=device, model_config=model_config, page_size=PAGE, req_to_token_pool=self.req_pool,
                    token_to_kv_pool=self.pool, hisparse_coordinator=None, is_draft_worker=False, model=model,
                    spec_algorithm=tes.spec_mod.SpeculativeAlgorithm.NONE, server_args=server_args,
                    memory_saver_adapter=ns(enabled=False))  # fmt: skip
        self.backend = backend_mod.DeepseekV4AttnBackend(runner)
        self.adapter = self.backend.__dict__.get(sg._ADAPTER_ATTR)
        assert (self.adapter is not None) == ours, "the adapter is installed exactly in our run"
        if ours and self.adapter.hca == "online":  # the C128 pool holds the banks: ring128 rows per request slot
            assert self.layers[0].kind == "hca" and self.ring128 == sg.bank_rows(self.draft_tokens)
            self.layers[0].hca = "online"
        self.used_slots: set[int] = set()  # request slots some step ran (their pool rows hold banks)
        self.x: dict[int, torch.Tensor] = {}  # slot -> bf16 hidden states of its current rows (CPU)
        self.log: list[dict] = []
        self.graphs: dict[tuple, types.SimpleNamespace] = {}
        self.replays = 0

    # -- one step ---------------------------------------------------------------------------------------------
    def inputs(self, items, mode, bs, tokens=None):
        self.used_slots.update(s for s, _, _ in items)
        return super().inputs(items, mode, bs, tokens)

    def _hidden(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.hidden, generator=self.xgen).to(torch.bfloat16)

    def _gemm_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each layer's ``kv_score`` as SGLang's own GEMM computes it (``linear_bf16_fp32``, eager, same shapes):
        the rows the state must hold bit for bit where SGLang's GEMM ran."""
        bf16_fp32 = compressor_mod.linear_bf16_fp32
        return {layer.name: bf16_fp32(x, layer.weight).float().cpu() for layer in self.layers}

    def _layers(self, x, fb) -> None:
        b = self.backend
        for layer in self.layers:
            call = b.forward_indexer_compressor if layer.kind == "indexer" else b.forward_core_compressor
            call(x, fb, layer.layer_id, layer.compressor)

    def step(self, items, mode: str, *, bs: int | None = None, tokens: int | None = None, path: str = "real"):
        """One forward: a prefill eagerly through ``init_forward_metadata_prefill``; a decode / verify batch of
        ``bs`` requests (padded with request 0) as a CUDA graph on CUDA (captured at its first step, replayed
        after), eagerly through ``make_forward_metadata_from_raw_*`` on CPU."""
        bs = len(items) if bs is None else bs
        positions, req, raw_out_loc, _ = self.inputs(items, mode, bs, tokens)
        x_cpu = self._hidden(positions.shape[0])
        x = x_cpu.to(self.device)
        backend = self.backend
        req_pool_indices = torch.tensor([s for s, _, _ in items] + [0] * (bs - len(items)), dtype=torch.int64,
                                        device=self.device)  # fmt: skip
        fb = types.SimpleNamespace(forward_mode=tes.MODES[mode], positions=positions, attn_cp_metadata=None,
                                   out_cache_loc=raw_out_loc, batch_size=bs,
                                   req_pool_indices=req_pool_indices)  # fmt: skip
        if mode == "prefill":
            seq = [s + n for _, s, n in items]
            extend = [n for _, _, n in items]
            ext = torch.tensor(extend, dtype=torch.int32, device=self.device)
            backend.forward_metadata = backend.init_forward_metadata_prefill(
                max_seq_len=max(seq), req_pool_indices=req_pool_indices,
                seq_lens=torch.tensor(seq, device=self.device), seq_lens_cpu=seq, out_cache_loc=raw_out_loc,
                num_tokens=sum(extend), extend_seq_lens=ext, extend_seq_lens_cpu=extend,
                extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            )  # fmt: skip
            self._layers(x, fb)
        else:
            if mode == "verify":  # committed lengths; padded requests: request 0, seq_lens 1
                seq = [s for _, s, _ in items] + [1] * (bs - len(items))
            else:  # decode seq_lens include the new token
                seq = [s + 1 for _, s, _ in items] + [1] * (bs - len(items))
            seq_lens = torch.tensor(seq, dtype=torch.int64, device=self.device)
            if self.device.type == "cuda":
                self._graph_step(mode, bs, req_pool_indices, seq_lens, raw_out_loc, positions, x)
            else:
                backend.forward_metadata = self._raw(mode, bs, req_pool_indices, seq_lens, raw_out_loc)
                backend.init_forward_metadata_in_graph(fb)
                self._layers(x, fb)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._record(items, self._gemm_rows(x))
        offset = 0
        for slot, start, n in items:
            old = self.x.get(slot, torch.empty(0, self.hidden, dtype=torch.bfloat16))[:start]
            self.x[slot] = torch.cat([old, x_cpu[offset : offset + n]])
            offset += n
        snap = {layer.name: (layer.memory.clone(), layer.state.clone()) for layer in self.layers}
        live = {layer.name: sorted({int(r) for slot in layer.model.live()
                                    for r in layer.state_rows(slot, layer.live_positions(layer.model.length(slot)))})
                for layer in self.layers}  # fmt: skip
        self.log.append(dict(mode=mode, rows=positions.shape[0], bs=bs, snapshot=snap, live_rows=live))

    def _raw(self, mode, bs, req_pool_indices, seq_lens, out_loc):
        if mode == "verify":
            e = torch.full((bs,), self.draft_tokens, dtype=torch.int32, device=self.device)
            return backend_mod.DSV4RawVerifyMetadata(req_pool_indices, seq_lens, out_loc, extend_seq_lens=e)
        return backend_mod.DSV4RawDecodeMetadata(req_pool_indices, seq_lens, out_loc)

    def _graph_step(self, mode, bs, req_pool_indices, seq_lens, out_loc, positions, x) -> None:
        """SGLang's decode / target-verify graph: static input buffers, the raw metadata over them, and
        ``init_forward_metadata_in_graph`` (the full metadata build, the planner included) plus every layer's
        compressor recorded in one graph; a padded all-request-0 warm-up runs first, eagerly (SGLang's runner
        warms up before it captures; it compiles the JIT and Triton kernels)."""
        key = (mode, bs)
        g = self.graphs.get(key)
        backend = self.backend
        if g is None:
            g = types.SimpleNamespace(req=req_pool_indices.clone(), seq=seq_lens.clone(), loc=out_loc.clone(),
                                      pos=positions.clone(), x=x.clone())  # fmt: skip
            g.fb = types.SimpleNamespace(forward_mode=tes.MODES[mode], positions=g.pos, attn_cp_metadata=None,
                                         out_cache_loc=g.loc, batch_size=bs, req_pool_indices=g.req,
                                         seq_lens=g.seq)  # fmt: skip
            # warm-up: every request the padding request (0), positions as SGLang pads them
            per = self.draft_tokens if mode == "verify" else 1
            saved = [t.clone() for t in (g.req, g.seq, g.loc, g.pos)]
            g.req.zero_(), g.seq.fill_(1), g.loc.zero_()
            if mode == "verify":
                g.pos.copy_(torch.arange(1, 1 + per, device=self.device).repeat(bs))
            else:
                g.pos.zero_()
            for _ in range(2):
                backend.forward_metadata = self._raw(mode, bs, g.req, g.seq, g.loc)
                backend.init_forward_metadata_in_graph(g.fb)
                self._layers(g.x, g.fb)
            torch.cuda.synchronize()
            for dst, src in zip((g.req, g.seq, g.loc, g.pos), saved):
                dst.copy_(src)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph):
                backend.forward_metadata = self._raw(mode, bs, g.req, g.seq, g.loc)
                backend.init_forward_metadata_in_graph(g.fb)
                self._layers(g.x, g.fb)
            self.graphs[key] = g
        for dst, src in ((g.req, req_pool_indices), (g.seq, seq_lens), (g.loc, out_loc), (g.pos, positions),
                         (g.x, x)):  # fmt: skip
            dst.copy_(src)
        g.graph.replay()
        self.replays += 1

    # -- checks -----------------------------------------------------------------------------------------------
    def expected_from_hidden(self, layer):
        """The float64 reference of ``x @ W.T`` then the compression, over each request's current rows."""
        weight = layer.weight.double().cpu()

        def expected(slot: int) -> torch.Tensor:
            kv64 = self.x[slot].double() @ weight.t()
            return reference.compress_sequence(kv64, layer.params, layer.cfg, dtype=torch.float64)

        return expected

    def projection_floor(self, layer) -> float:
        """The checks' floor (``verify``'s ``abs_tol``, in units of an entry's RMS) for entries whose ``kv_score``
        came from a float32 projection other than the one the model's rows record: two float32 dot products of
        the same ``D`` bf16 products differ by about ``sqrt(D) * 2^-24`` of a ``kv_score`` value's RMS (a random
        walk of ``D`` roundings); the window's pooling and the RMS normalisation scale that by at most the ratio of
        the rows' RMS to the pooled RMS, about ``sqrt(window)`` for random gates. Four times that product: a byte
        whose float64 value lies farther from a rounding boundary still has one right encoding."""
        window = layer.cfg.ratio * (2 if layer.cfg.overlap else 1)
        return 4 * self.hidden**0.5 * 2.0**-24 * window**0.5

    def check(self, what: str) -> None:
        """Every written entry against float64: asserted for our run, recorded in :attr:`engine_deviations` for
        SGLang's own; for our run also the state rows bit for bit where SGLang's GEMM made the rows
        (``projection="engine"``) and no byte or row outside what the steps address (SGLang's own path writes
        the padding request's rows and slot 0: see :func:`compare`).

        The reference: where SGLang's GEMM made every ``kv_score`` row (its own run, ours under ``"engine"``),
        the float64 compression of those float32 rows (the model's rows, :meth:`step` records them), so the
        compression is checked at the module's tolerance on exactly its inputs; under ``"auto"`` our projection
        made some of them, so the float64 compression of ``x @ W.T`` with :meth:`projection_floor`."""
        engine_rows = not self.ours or self.adapter.projection == "engine"
        for layer in self.layers:
            if engine_rows:
                expected, floor = None, ABS_TOL_RMS
            else:
                expected, floor = self.expected_from_hidden(layer), self.projection_floor(layer)
            if not self.ours:
                try:
                    layer.check_entries(what, expected, floor)
                except AssertionError as e:
                    self.engine_deviations.append((layer.name, what, str(e).splitlines()[0]))
                continue
            layer.check_entries(what, expected, floor)
            banks = layer.hca == "online" and layer.kind == "hca"
            if self.adapter.projection == "engine" and not banks:
                for slot in layer.model.live():
                    layer._check_state(what, slot, layer.model.length(slot))
            if banks:
                self._check_untouched_banks(what, layer)
            else:
                layer._check_untouched(what)

    def _check_untouched_banks(self, what: str, layer) -> None:
        """The online HCA layer: no page byte outside its records, no pool row of a slot no step ran (the padding
        request's included) written; each live request's bank of its length, when mid-group, finite."""
        layer._check_untouched(what, self.used_slots)
        b = sg.bank_count(self.draft_tokens)
        banks = sg.banks_view(layer.state.cpu(), b, layer.cfg.head_dim)
        for slot in layer.model.live():
            length = layer.model.length(slot)
            if length % layer.cfg.ratio:
                assert torch.isfinite(banks[slot, length % b]).all(), f"{what}: slot {slot}'s bank of {length}"


def _dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 dot-product error bound ``D * 2^-24 * |x| @ |w|.T`` (per row and output), float64."""
    return x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())


def compare(theirs: EngineWorld, ours: EngineWorld) -> dict:
    """The two runs' snapshots after every step: every written record of every layer byte for byte (slot 0,
    the padding request's, apart), every state row a later step of a real request may read (``live_positions``;
    rows of request 0 apart), and what SGLang's own path wrote for its padding request. Ours passed the float64
    checks after every step; a record that differs is counted with its bytes, and the steps where SGLang's own
    records failed those checks are counted apart (``engine_deviations``: there the records differ by SGLang's
    arithmetic, not ours). A state row must be equal bit for bit where both projections were SGLang's GEMM
    (``projection="engine"``), else within twice the float32 dot-product bound of the exact product; under online
    HCA the C128 layer's state is our banks, not SGLang's ring rows: not compared (:meth:`EngineWorld.check`
    checks them). Returns the counts per layer (records and state rows as of the last step; differences the most
    at any step)."""
    assert len(theirs.log) == len(ours.log)
    engine_rows = ours.adapter.projection == "engine"
    x_all = torch.cat(list(ours.x.values())) if ours.x else torch.zeros(1, ours.hidden)
    limits = {layer.name: 2 * float(_dot_bound(x_all, layer.weight.cpu()).max()) for layer in ours.layers}
    counts = {layer.name: dict(records=0, record_bytes=0, differing_records=0, differing_bytes=0, state_rows=0,
                               differing_state_rows=0, padding_rows_theirs=0, padding_slot_theirs=0,
                               engine_deviations=sum(d[0] == layer.name for d in theirs.engine_deviations))
              for layer in ours.layers}  # fmt: skip
    for k, (t, o) in enumerate(zip(theirs.log, ours.log, strict=True)):
        what = f"step {k} ({o['mode']}, {o['rows']} rows, bs {o['bs']})"
        assert (t["mode"], t["rows"]) == (o["mode"], o["rows"]), what
        for layer in ours.layers:
            c = counts[layer.name]
            (tp, ts), (op, os_) = t["snapshot"][layer.name], o["snapshot"][layer.name]
            tp, ts, op, os_ = tp.cpu(), ts.cpu(), op.cpu(), os_.cpu()
            written = sorted(s for s in layer.written if s != 0)
            slots = torch.tensor(written, dtype=torch.int64)
            got_o = layer.layout.read(op[:, : layer.layout.bytes_per_page], slots).reshape(len(written), -1)
            got_t = layer.layout.read(tp[:, : layer.layout.bytes_per_page], slots).reshape(len(written), -1)
            diff = got_o != got_t
            c["records"], c["record_bytes"] = len(written), diff.numel()
            c["differing_records"] = max(c["differing_records"], int(diff.any(1).sum()))
            c["differing_bytes"] = max(c["differing_bytes"], int(diff.sum()))
            # every byte outside the written records: ours poison (our world's check), theirs too but slot 0
            # (its padding request's group ends may store a record there)
            keep = torch.zeros_like(tp, dtype=torch.bool)
            for mark, which in ((keep, sorted(layer.written)), (None, [0])):
                idx = layer.layout._byte_index(torch.tensor(which))
                page, off = idx // layer.layout.bytes_per_page, idx % layer.layout.bytes_per_page
                flat = (page * tp.shape[1] + off).reshape(-1)
                if mark is None:
                    slot0 = torch.zeros_like(keep)
                    slot0.view(-1)[flat] = True
                else:
                    keep.view(-1)[flat] = True
            stray = (tp != tis.POISON) & ~keep & ~slot0
            assert not stray.any(), f"{what}: {layer.name}: SGLang wrote {int(stray.sum())} bytes off its records"
            c["padding_slot_theirs"] = max(c["padding_slot_theirs"], int(((tp != tis.POISON) & slot0).any()))
            # state rows: those a later step of a real request may read (the padding request's are rows
            # [0, ring)); SGLang's path also keeps closed groups' rows, ours does not write them
            ring = layer.ring
            rows = torch.tensor([r for r in o["live_rows"][layer.name] if r >= ring], dtype=torch.int64)
            if layer.hca == "online" and layer.kind == "hca":
                rows = rows[:0]  # banks against SGLang's ring rows: nothing to compare
            a, b = os_[rows], ts[rows]
            bad = (a.view(torch.int32) != b.view(torch.int32)).any(1)
            c["state_rows"] = rows.numel()
            c["differing_state_rows"] = max(c["differing_state_rows"], int(bad.sum()))
            if engine_rows:
                assert not bad.any(), f"{what}: {layer.name}: state rows {rows[bad].tolist()} differ (same GEMM)"
            elif bad.any():
                gap = (a[bad].double() - b[bad].double()).abs().max()
                finite = torch.isfinite(a[bad]).all() and torch.isfinite(b[bad]).all()
                assert finite and gap <= limits[layer.name], (
                    f"{what}: {layer.name}: state rows differ by {float(gap)} > {limits[layer.name]} (float32)"
                )
            theirs_pad = (ts[:ring].view(torch.int32) != tis.POISON_F32).any(1)
            c["padding_rows_theirs"] = max(c["padding_rows_theirs"], int(theirs_pad.sum()))
            assert (os_[:ring].view(torch.int32) == tis.POISON_F32).all(), f"{what}: ours wrote padding rows"
    return counts
