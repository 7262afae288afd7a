"""The SGLang adapter's projection from hidden states (``install(projection=...)``) against the REAL
``sglang==0.5.23`` package (``make test-sglang``; skipped without it), CPU, Triton interpreted.

What runs here: a step program from bf16 hidden states through SGLang's own ``Compressor`` modules
(``compute_kv_score`` -> ``linear_bf16_fp32``, the APE loader's hotfix) and the real ``DeepseekV4AttnBackend``
class's patched ``forward_core_compressor`` / ``forward_indexer_compressor``, on the SGLang-shaped pools and
metadata of ``tests/test_integration_sglang.py`` (``World``), against float64 (``projection="auto"`` against
``"engine"``); the C4 layer's two projections as one GEMM of joined weights (``join_c4_weights``, the names
SGLang's attention modules give them, ``compress_pair`` on decode and verify steps); where SGLang's GEMM is kept
(``projection_for``'s fallbacks); the workspaces allocated once and counted in the KV sizing. The backend's
constructor is stubbed inside the adapter's wrapper (:func:`_stub_init`).

SGLang's modules, the small shapes and ``_real_compressor`` are ``tests/test_engine_sglang.py``'s (imported
first: its torchvision stand-in, its skip without SGLang).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types

import pytest
import test_engine_sglang as tes  # the torchvision stand-in and SGLang's modules, imported once
import torch
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, projection_weight
from test_integration_sglang import World

from dsv4_compressor import reference
from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations import sglang as sg
from dsv4_compressor.kernels import projection as kernel_projection

backend_mod, compressor_mod, dsa_utils = tes.backend_mod, tes.compressor_mod, tes.dsa_utils
ForwardMode, MODES, HIDDEN, SMALL = tes.ForwardMode, tes.MODES, tes.HIDDEN, tes.SMALL
_record, _profiling_stand_ins, _real_compressor = tes._record, tes._profiling_stand_ins, tes._real_compressor
clean = tes.clean  # the fixture: uninstall before and after
FROM_HIDDEN = ("compress_from_hidden", "compress_online_hca_from_hidden")


class _Spy:
    """The top-level op calls of the adapter (an op calling another, as ``compress_from_hidden`` calls
    ``compress``, is one call) and SGLang's ``Compressor.compute_kv_score`` calls with their output."""

    OPS = ("compress", "compress_online_hca", "project", "compress_pair") + FROM_HIDDEN

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, dict]] = []
        self.depth = 0
        for name in self.OPS:
            monkeypatch.setattr(sg.ops, name, self._wrap(name, getattr(sg.ops, name)))
        real = compressor_mod.Compressor.compute_kv_score

        @functools.wraps(real)
        def compute_kv_score(compressor, x, forward_batch):
            out = real(compressor, x, forward_batch)
            self.calls.append(("compute_kv_score", dict(compressor=compressor, out=out)))
            return out

        monkeypatch.setattr(compressor_mod.Compressor, "compute_kv_score", compute_kv_score)

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            if self.depth == 0:
                self.calls.append((name, kwargs))
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return call

    def take(self) -> list[tuple[str, dict]]:
        calls, self.calls = self.calls, []
        return calls


def _stub_init(self, model_runner, *args, **kwargs):
    """SGLang's ``DeepseekV4AttnBackend.__init__`` needs a ``ModelRunner`` with CUDA pools: the attributes the
    compressor path reads, from the test's world (the adapter's wrapper around it runs as under SGLang)."""
    world = model_runner.world
    self.device = torch.device("cpu")
    self.token_to_kv_pool = world.pool
    self.req_to_token = world.req_to_token
    self.speculative_num_draft_tokens = world.draft_tokens if world.draft_tokens > 1 else None
    self.forward_metadata = None


def _server_args(**kwargs):
    return _record(chunked_prefill_size=64, max_prefill_tokens=64, **kwargs)


class HiddenWorld(World):
    """:class:`test_integration_sglang.World` (SGLang-shaped pools, metadata and checks) driven from hidden
    states through SGLang's own classes under ``install()``: per layer a real ``Compressor`` (its bf16
    ``wkv_gate``, its loader's C4 APE hotfix, ``RMSNorm``, ``compute_kv_score`` -> ``linear_bf16_fp32``; only
    ``get_state_pool`` reads the world's stand-in pool), one real ``DeepseekV4AttnBackend`` (its constructor
    stubbed, :func:`_stub_init`, inside the adapter's wrapper, which allocates the scratch and the projection
    workspaces from the server arguments and model config), and each step's bf16 ``x`` ``[T, D]`` handed to
    ``forward_core_compressor`` / ``forward_indexer_compressor``. A second HCA layer keeps online banks
    (``hca="online"`` in direct use, banks held by the adapter): the world's direct adapter runs its
    ``forward_unified`` on the same backend, with the installed run's projection switch and its own workspace.
    The model's rows are what SGLang's GEMM returned (the spy's), or its CPU arithmetic
    ``float32(x) @ float32(W).T`` on steps our projection served."""

    def __init__(self, *, spy: _Spy, draft_tokens: int, seed: int = 21, model: bool = False,
                 memory_saver: bool = False):  # fmt: skip
        super().__init__(draft_tokens=draft_tokens, seed=seed, hca_layers=("ring", "online"))
        self.spy = spy
        self.xgen = torch.Generator().manual_seed(seed + 1)
        self.x: dict[int, torch.Tensor] = {}  # slot -> bf16 hidden states of its current rows
        self.log: list[dict] = []  # per step: rows, calls
        for k, layer in enumerate(self.layers):
            layer.weight = projection_weight(layer.cfg.row_width, HIDDEN, seed=30 + k)
            layer.compressor = self._sglang_compressor(layer)
        hf = types.SimpleNamespace(hidden_size=HIDDEN, head_dim=CSA_SMALL.head_dim, index_head_dim=INDEXER_CFG.head_dim,
                                   compress_ratios=[HCA_SMALL.ratio, 4])  # fmt: skip
        runner = types.SimpleNamespace(server_args=_server_args(), model_config=types.SimpleNamespace(hf_config=hf),
                                       device="cpu", world=self,
                                       memory_saver_adapter=types.SimpleNamespace(enabled=memory_saver))  # fmt: skip
        if model:  # the model the backend's constructor sees: the C4 layer's attention holds both compressors
            csa, idx = (next(x for x in self.layers if x.name == n) for n in ("csa", "indexer"))
            attn, runner.model = torch.nn.Module(), torch.nn.Module()
            attn.compressor, attn.indexer = csa.compressor, torch.nn.Module()
            attn.indexer.compressor = idx.compressor
            runner.model.attn = attn
        self.runner = runner
        self.backend = backend_mod.DeepseekV4AttnBackend(runner)
        self.adapter = self.backend.__dict__[sg._ADAPTER_ATTR]
        self.online = self.adapters["online"]  # direct use, as install() allocated for its own adapter
        self.online.projection = self.adapter.projection
        dims = sg.model_dims(runner.model_config)
        self.online.allocate_projection("cpu", max_rows=sg.scratch_rows_for(runner.server_args, draft_tokens), **dims)

    def _sglang_compressor(self, layer):
        c = _real_compressor(layer)
        pool = types.SimpleNamespace(kv_score_buffer=types.SimpleNamespace(kv_score=layer.state))
        c.get_state_pool = lambda backend: pool  # the real one asserts SGLang's pool class
        return c

    def step(self, items, mode: str, *, bs: int | None = None, tokens: int | None = None, path: str = "direct"):
        bs = len(items) if bs is None else bs
        positions, req, raw_out_loc, _ = self.inputs(items, mode, bs, tokens)
        x = torch.randn(positions.shape[0], HIDDEN, generator=self.xgen).to(torch.bfloat16)
        given = x.clone()
        self.backend.forward_metadata = self._direct_metadata(mode, positions, req, raw_out_loc, bs)
        fb = types.SimpleNamespace(forward_mode=MODES[mode], positions=positions, attn_cp_metadata=None)
        self.spy.take()
        rows, calls = {}, []
        for layer in self.layers:
            indexer = layer.kind == "indexer"
            if layer.hca == "online":
                self.online.forward_unified(self.backend, x, fb, layer.layer_id, layer.compressor)
            elif indexer:
                self.backend.forward_indexer_compressor(x, fb, layer.layer_id, layer.compressor)
            else:
                self.backend.forward_core_compressor(x, fb, layer.layer_id, layer.compressor)
            mine = self.spy.take()
            gemm = [kw["out"] for name, kw in mine if name == "compute_kv_score"]
            rows[layer.name] = gemm[0] if gemm else x.float() @ layer.weight.float().t()
            calls.append([(name, kw) for name, kw in mine])
        assert torch.equal(x.view(torch.int16), given.view(torch.int16)), "x was written"
        self._record(items, rows)
        offset = 0
        for slot, start, n in items:
            old = self.x.get(slot, torch.empty(0, HIDDEN, dtype=torch.bfloat16))[:start]
            self.x[slot] = torch.cat([old, x[offset : offset + n]])
            offset += n
        self.log.append(dict(mode=mode, rows=positions.shape[0], calls=calls, snapshot=self._snapshot()))

    def _snapshot(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's pages and state (the online layer's: its banks)."""
        out = {}
        for layer in self.layers:
            state = self.online._banks[layer.layer_id] if layer.hca == "online" else layer.state
            out[layer.name] = (layer.memory.clone(), state.clone())
        return out

    def expected_from_hidden(self, layer):
        """The float64 reference of ``x @ W.T`` then the compression, over each request's current rows."""

        def expected(slot: int) -> torch.Tensor:
            kv64 = self.x[slot].double() @ layer.weight.double().t()
            return reference.compress_sequence(kv64, layer.params, layer.cfg, dtype=torch.float64)

        return expected

    def check(self, what: str) -> None:
        if self.adapter.projection == "engine":
            super().check(what)  # entries against float64 of SGLang's rows, state rows bit for bit, no stray byte
            return
        for layer in self.layers:  # ours: the entries against float64 of x @ W.T, no stray byte
            assert all(self.x[slot].shape[0] == layer.model.length(slot) for slot in layer.model.live())
            layer.check_entries(what, self.expected_from_hidden(layer))
            layer._check_untouched(what)


def _hidden_world_setup(monkeypatch) -> _Spy:
    """What a :class:`HiddenWorld` test patches: SGLang's runtime context (no context parallelism), the backend's
    constructor (:func:`_stub_init`), our projection admitted up to ``SMALL`` rows; returns the op spy."""
    monkeypatch.setattr(dsa_utils, "get_parallel", lambda: types.SimpleNamespace(attn_cp_size=1))
    monkeypatch.setattr(backend_mod.DeepseekV4AttnBackend, "__init__", _stub_init)
    monkeypatch.setattr(sg.ops, "projection_triton_rows", lambda width, dim, **_: SMALL)
    return _Spy(monkeypatch)


def _hidden_program(w: HiddenWorld) -> None:
    """Chunked prefill (a padded 24-row prefill graph: SGLang's GEMM; a 15-row chunk: ours), then decode steps
    (E = 1) or MTP verify with random acceptance (E = 3) in padded graphs of 4 requests (ours) and one of more
    rows than ours serves (SGLang's GEMM), then ours again."""
    w.step([(1, 0, 14), (2, 0, 7)], "prefill", tokens=24)
    w.check("prefill")
    w.step([(1, 14, 10), (3, 0, 5)], "prefill")
    w.check("prefill 2")
    slots = [1, 2, 3]
    if w.draft_tokens > 1:
        w.verify_steps(slots, 2, bs=4)
        w.verify_steps(slots, 1, bs=8)  # 24 rows
        w.verify_steps(slots, 1, bs=4)
        return
    for k, bs in enumerate((4, 4, 20, 4)):  # 20 rows: a large padded decode graph
        w.step([(s, w.lengths[s], 1) for s in slots], "decode", bs=bs)
        w.check(f"decode {k} (bs {bs})")


@pytest.mark.parametrize("draft_tokens", [1, 3], ids=["decode", "mtp"])
def test_projection_auto_from_hidden_on_small_steps_sglang_gemm_on_big(clean, monkeypatch, draft_tokens):
    """``install(projection="engine")`` and ``install(projection="auto")`` run one program on identical inputs
    and slots, with ``ops.projection_triton_rows`` admitting steps of up to 16 rows at the test's shapes. Engine:
    SGLang's ``compute_kv_score`` for every layer of every step, never a ``*_from_hidden`` op, no workspace.
    Auto: the workspaces exist from the backend's constructor on and are never replaced; steps of <= 16 rows
    run ``ops.compress_from_hidden`` (our Triton projection, then the compression) for the HCA, CSA and indexer
    compressors (``compress_online_hca_from_hidden`` for the online HCA layer, direct use) and never SGLang's
    GEMM, larger steps SGLang's ``compute_kv_score`` then ``ops.compress``; no fallback. After every step: the
    engine run's entries against float64 of its rows and its state rows bit for bit; ours' entries against the
    float64 reference of ``x @ W.T`` then the compression, no stray byte; the two runs' pages equal but at the
    projection's float32 rounding boundaries (<= 2% of entry bytes), their state rows (and banks) written alike
    (the same rows still poisoned) and allclose."""
    spy = _hidden_world_setup(monkeypatch)
    runs = {}
    for projection in ("engine", "auto"):
        sg.install(projection=projection, check_environment=False)
        try:
            w = HiddenWorld(spy=spy, draft_tokens=draft_tokens)
            adapters = (w.adapter, w.online)
            workspaces = [dict(a._projection) for a in adapters]  # allocated by the constructor, before any step
            _hidden_program(w)
            for a, ws in zip(adapters, workspaces):
                assert a._projection.keys() == ws.keys() and all(a._projection[g] is t for g, t in ws.items())
        finally:
            sg.uninstall()
        runs[projection] = w
    engine, auto = runs["engine"], runs["auto"]
    assert engine.adapter.projection == engine.online.projection == "engine"
    assert engine.adapter._projection == engine.online._projection == {}
    assert set(auto.adapter._projection) == {"main", "indexer"}
    for w in (engine, auto):
        assert w.adapter.projection_fallbacks == w.online.projection_fallbacks == {}
    ours = big = 0
    diff_bytes = total_bytes = 0
    for k, (g, o) in enumerate(zip(engine.log, auto.log, strict=True)):
        what = f"step {k} ({g['mode']}, {g['rows']} rows)"
        assert g["rows"] == o["rows"]
        small = o["rows"] <= SMALL
        ours, big = ours + small, big + (not small)
        for layer, g_calls, o_calls in zip(engine.layers, g["calls"], o["calls"], strict=True):
            op = "compress_online_hca" if layer.hca == "online" else "compress"
            gemm = ["compute_kv_score", op]  # SGLang's GEMM, then our compression
            assert [name for name, _ in g_calls] == gemm, (what, layer.name)
            assert [name for name, _ in o_calls] == ([op + "_from_hidden"] if small else gemm), (what, layer.name)
            assert not small or o_calls[0][1]["projection"] == "triton"
        for layer in engine.layers:
            (g_pages, g_state), (o_pages, o_state) = g["snapshot"][layer.name], o["snapshot"][layer.name]
            diff_bytes += int((g_pages != o_pages).sum())
            finite = torch.isfinite(g_state)
            assert torch.equal(finite, torch.isfinite(o_state)), f"{what}: {layer.name}: other state rows written"
            assert torch.allclose(g_state[finite], o_state[finite], rtol=1e-5, atol=1e-5), f"{what}: {layer.name}"
            total_bytes += len(layer.written) * layer.layout.record_bytes
    assert ours >= 3 and big >= 2, (ours, big)
    print(f"from hidden (E = {draft_tokens}): {diff_bytes} of {total_bytes} entry bytes differ from SGLang's GEMM")
    assert 0 < total_bytes and diff_bytes <= total_bytes // 50, "over 2% of entry bytes differ: not rounding"


def test_join_walks_the_attributes_sglang_s_attention_has():
    """``join_c4_weights`` pairs a module's ``compressor`` (``ratio`` 4) with its ``indexer.compressor`` and
    joins their ``wkv_gate.weight``: the names SGLang 0.5.23's own ``MQALayer``, ``C4Indexer`` and
    ``Compressor`` constructors give them (their source), and a module without them is left alone."""
    model_mod = importlib.import_module("sglang.srt.models.deepseek_v4")
    indexer_mod = importlib.import_module("sglang.srt.layers.attention.dsv4.indexer")
    layer = inspect.getsource(model_mod.MQALayer.__init__)
    assert "self.compressor = Compressor(" in layer and "self.indexer = C4Indexer(" in layer
    assert "self.compressor = Compressor(" in inspect.getsource(indexer_mod.C4Indexer.__init__)
    init = inspect.getsource(compressor_mod.Compressor.__init__)
    assert "self.ratio = compress_ratio" in init and "self.wkv_gate = ReplicatedLinear(" in init
    hca = torch.nn.Module()
    hca.compressor = _small_compressor(ratio=128)
    hca.indexer = None
    assert sg.join_c4_weights(hca) == 0
    c4, float32 = torch.nn.Module(), torch.nn.Module()
    for m in (c4, float32):
        m.compressor, m.indexer = _small_compressor(4), torch.nn.Module()
        m.indexer.compressor = _small_compressor(4, indexer=True)
    w = float32.indexer.compressor.wkv_gate.weight
    w.data = w.data.float()  # a weight the op does not read: left as it is
    assert sg.join_c4_weights(float32) == 0 and w.dtype == torch.float32
    weights = (c4.compressor.wkv_gate.weight, c4.indexer.compressor.wkv_gate.weight)
    values = [t.detach().clone() for t in weights]
    assert sg.join_c4_weights(c4) == 1
    joint = sg.ops.joint_pair_weight(*weights)
    assert joint is not None and all(torch.equal(t, v) for t, v in zip(weights, values))
    assert sg.join_c4_weights(c4) == 1 and sg.ops.joint_pair_weight(*weights).data_ptr() == joint.data_ptr()


def _on_two_streams(monkeypatch, adapter) -> None:
    """From now on the indexer's and the main compressor's calls see different streams in their ``x`` keys (as
    under SGLang's multi-stream prepare)."""
    stream = [0]
    key, pair = sg._x_key, adapter.paired_kv_score

    def on_streams(x, forward_batch, compressor, rows, compress_both=None):
        stream[0] = 1 + bool(compressor.is_in_indexer)
        return pair(x, forward_batch, compressor, rows, compress_both)

    monkeypatch.setattr(sg.adapter, "_x_key", lambda x, fb, layer: (*key(x, fb, layer), stream[0]))
    monkeypatch.setattr(adapter, "paired_kv_score", on_streams)


@pytest.mark.parametrize("joint_ours", [False, True], ids=["cublas", "ours-up-to-small"])
@pytest.mark.parametrize("draft_tokens", [1, 3], ids=["decode", "mtp"])
def test_c4_layer_s_two_projections_as_one_gemm_of_joined_weights(clean, monkeypatch, draft_tokens, joint_ours):
    """Under ``install()``, the backend's constructor joins the C4 layer's two ``wkv_gate`` weights (SGLang's
    real ``Compressor`` parameters: the same objects and values, now one tensor's halves). The indexer's
    compressor runs first, as in SGLang. At a step size first seen, each compressor projects on its own (the
    layer learns whether both see one ``x`` on one stream); from then on the indexer's call is one
    ``ops.project`` of both weights on the joint weight (``projection="torch"``: one GEMM; ``joint_ours``: on
    steps of up to ``SMALL`` rows, as ``ops.joint_pair_triton_rows`` has V4-Flash's at 64, ``"auto"``: our one
    launch on the halves, into the adapter's ``"pair"`` workspace), then on decode and
    verify steps one ``compress_pair`` of both compressors (the main compressor's call then runs nothing), on
    prefill steps ``compress`` (the main's call ``compress`` on the held columns), never SGLang's GEMM. Every step is
    checked as the from-hidden run is (entries against float64 of ``x @ W.T``, no stray byte); pages are
    compared with ``projection="engine"`` on identical inputs. Then the two compressors are made to run on
    different streams: a step size that paired pays once (the main compressor projects and compresses afresh)
    and pairs no more, a new size never pairs, and entries stay exact."""
    spy = _hidden_world_setup(monkeypatch)
    if joint_ours:
        shape = (4 * CSA_SMALL.head_dim, 4 * INDEXER_CFG.head_dim, HIDDEN)
        monkeypatch.setitem(kernel_projection.PAIR_FASTER, shape, SMALL)
        monkeypatch.setitem(kernel_projection.JOINT_PAIR_TRITON, shape, SMALL)
    runs = {}
    for projection in ("engine", "auto"):
        sg.install(projection=projection, check_environment=False)
        try:
            w = HiddenWorld(spy=spy, draft_tokens=draft_tokens, model=True)
            csa, idx = (next(x for x in w.layers if x.name == n) for n in ("csa", "indexer"))
            w.layers = [x for x in w.layers if x.kind != "indexer"]
            w.layers.insert(w.layers.index(csa), idx)  # SGLang calls the indexer's compressor first
            weights = (csa.compressor.wkv_gate.weight, idx.compressor.wkv_gate.weight)
            joint = sg.ops.joint_pair_weight(*weights)
            assert (joint is not None) == (projection == "auto") and w.adapter.joined_layers == (projection == "auto")
            assert all(isinstance(p, torch.nn.Parameter) for p in weights)
            assert torch.equal(weights[0], csa.weight) and torch.equal(weights[1], idx.weight)
            _hidden_program(w)
            if projection == "auto":
                _on_two_streams(monkeypatch, w.adapter)
                split_from = len(w.log)
                _hidden_program(w)
        finally:
            sg.uninstall()
        runs[projection] = w
    engine, auto = runs["engine"], runs["auto"]
    assert auto.adapter.projection_fallbacks == {}
    seen, pairs, learned_no, pair_launches = set(), 0, set(), 0
    for k, step in enumerate(auto.log):
        rows, what = step["rows"], f"step {k} ({step['mode']}, {step['rows']} rows)"
        names = {layer.name: [n for n, _ in calls] for layer, calls in zip(auto.layers, step["calls"])}
        alone = ["compress_from_hidden"] if rows <= SMALL else ["compute_kv_score", "compress"]
        split = k >= split_from
        paired = rows in seen and not (split and rows in learned_no)
        if paired:
            decode = step["mode"] != "prefill"
            assert names["indexer"] == ["project", "compress_pair" if decode else "compress"], what
            project = step["calls"][[x.name for x in auto.layers].index("indexer")][0][1]
            assert project.get("projection", "auto") == ("auto" if joint_ours and rows <= SMALL else "torch"), what
            if project.get("projection", "auto") == "auto":
                assert project["workspace"] is auto.adapter._projection["pair"], what
            assert names["csa"] == (alone if split else [] if decode else ["compress"]), what
            pairs += 1
            pair_launches += decode
        else:
            assert names["indexer"] == names["csa"] == alone, what
        if split:
            learned_no.add(rows)
        seen.add(rows)
    assert pairs >= 3 and pair_launches >= 2 and any(k >= split_from for k in range(len(auto.log)))
    if draft_tokens == 1:  # SGLang's memory saver on: the weights stay in its weight region, apart
        sg.install(check_environment=False)
        try:
            w = HiddenWorld(spy=spy, draft_tokens=draft_tokens, model=True, memory_saver=True)
        finally:
            sg.uninstall()
        csa, idx = (next(x for x in w.layers if x.name == n) for n in ("csa", "indexer"))
        assert w.adapter.joined_layers == 0 and "memory saver" in w.adapter.join_refused
        assert sg.ops.joint_pair_weight(csa.compressor.wkv_gate.weight, idx.compressor.wkv_gate.weight) is None
    diff = total = 0
    for g, o in zip(engine.log, auto.log[:split_from], strict=True):
        for layer in engine.layers:
            diff += int((g["snapshot"][layer.name][0] != o["snapshot"][layer.name][0]).sum())
            total += len(layer.written) * layer.layout.record_bytes
    print(f"joined C4 weights (E = {draft_tokens}): {diff} of {total} entry bytes differ from SGLang's GEMM")
    assert 0 < total and diff <= total // 50


def _small_compressor(ratio: int = 4, *, indexer: bool = False, cls=None):
    """A real SGLang ``Compressor`` of the test's small shapes (head 128, D = HIDDEN) with a bf16 weight."""
    cfg = INDEXER_CFG if indexer else (CSA_SMALL if ratio == 4 else HCA_SMALL)
    gen = torch.Generator().manual_seed(ratio)
    freqs = torch.polar(torch.ones(64, cfg.rope_dim // 2), torch.rand(64, cfg.rope_dim // 2, generator=gen))
    c = (cls or compressor_mod.Compressor)(
        types.SimpleNamespace(hidden_size=HIDDEN, rms_norm_eps=1e-6), layer_id=0, is_in_indexer=indexer,
        freqs_cis=freqs, compress_ratio=ratio, head_dim=cfg.head_dim, rotate=indexer,
    )  # fmt: skip
    with torch.no_grad():
        c.wkv_gate.weight.copy_(projection_weight(cfg.row_width, HIDDEN))
    return c


def test_sglang_s_gemm_is_kept_where_it_computes_something_else(monkeypatch):
    """``projection_for`` (the per-layer choice, from host values) takes ours only where SGLang 0.5.23's
    ``compute_kv_score`` is the plain bf16 GEMM: not under prefill context parallelism (SGLang's own
    ``dsa_use_prefill_cp``, here a stand-in: it gathers kv_score across ranks), not with aiter (tgemm rounds to
    bf16), not for a GGUF / float32 / column-major weight, a float32 ``x``, a subclass or stand-in computing
    kv_score its own way, or a step larger than the workspace; each counted in ``projection_fallbacks``. Above
    ``ops.projection_triton_rows`` SGLang's GEMM runs by choice (not counted); nothing is allocated there."""
    monkeypatch.setattr(dsa_utils, "get_parallel", lambda: types.SimpleNamespace(attn_cp_size=1))
    monkeypatch.setattr(sg.ops, "projection_triton_rows", lambda width, dim, **_: SMALL)
    adapter = sg.SGLangCompressor()
    sized = adapter.allocate_projection("cpu", hidden_size=HIDDEN, max_rows=8, head_dim=128, ratios=(4, 8))
    assert set(sized) == {"main", "indexer"}
    c = _small_compressor(4)
    x = torch.randn(8, HIDDEN).to(torch.bfloat16)
    fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, attn_cp_metadata=None)
    weight, ws = adapter.projection_for(x, fb, c, 8)
    assert weight is c.wkv_gate.weight and ws is sized["main"]
    assert adapter.projection_for(x, fb, _small_compressor(indexer=True), 8)[1] is sized["indexer"]
    assert adapter.projection_for(x, fb, _small_compressor(8), 8)[1] is sized["main"]  # HCA: the main group
    assert adapter.projection_for(x, fb, c, SMALL + 1) is None and adapter.projection_fallbacks == {}
    assert sg.SGLangCompressor(projection="engine").projection_for(x, fb, c, 8) is None

    class Sub(compressor_mod.Compressor):
        def compute_kv_score(self, x, forward_batch):
            return super().compute_kv_score(x, forward_batch) * 2

    gguf, fp32, column = _small_compressor(4), _small_compressor(4), _small_compressor(4)
    gguf.wkv_gate.weight = None
    fp32.wkv_gate.weight = torch.nn.Parameter(c.wkv_gate.weight.float(), requires_grad=False)
    column.wkv_gate.weight = torch.nn.Parameter(c.wkv_gate.weight.t().contiguous().t(), requires_grad=False)
    stand_in = types.SimpleNamespace(ratio=4, head_dim=128, is_in_indexer=False, wkv_gate=c.wkv_gate,
                                     compute_kv_score=lambda x, fb: x)  # fmt: skip
    cp = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, attn_cp_metadata=object())
    cases = [
        ("no projection workspace", c, x, fb, 12),
        ("not SGLang's Compressor", _small_compressor(4, cls=Sub), x, fb, 8),
        ("not SGLang's Compressor", stand_in, x, fb, 8),
        ("GGUF", gguf, x, fb, 8),
        ("torch.float32, not bf16", fp32, x, fb, 8),
        ("not row-major", column, x, fb, 8),
        ("x is torch.float32", c, x.float(), fb, 8),
        ("prefill context parallel", c, x, cp, 8),
        ("aiter", c, x, fb, 8),
    ]
    # SGLang's own check reads its runtime context (CP size, model config); the stand-in answers from the batch
    monkeypatch.setattr(compressor_mod, "dsa_use_prefill_cp", lambda forward_batch: forward_batch is cp)
    for why, comp, xs, batch, rows in cases:
        if why == "aiter":
            monkeypatch.setattr(compressor_mod, "_use_aiter", True)
        before = sum(adapter.projection_fallbacks.values())
        assert adapter.projection_for(xs, batch, comp, rows) is None, why
        assert sum(adapter.projection_fallbacks.values()) == before + 1, why
        assert any(why in reason for reason in adapter.projection_fallbacks), (why, adapter.projection_fallbacks)
    assert sized == adapter._projection  # nothing allocated on a fallback


def test_projection_workspaces_allocated_once_and_counted_where_sglang_sizes_the_kv_cache(clean, monkeypatch):
    """``install()`` (projection "auto") allocates, in each backend's constructor, one workspace per stream group
    (main, indexer) for steps of ``min(ops.projection_triton_rows, SGLang's largest step)`` rows, and one for
    the C4 layer's pair on its joined weights (``ops.joint_pair_triton_rows``): at DeepSeek-V4-Flash's shapes
    2.27 + 2.52 + 1.89 MiB, the bytes ``projection_bytes_for`` counts per backend and
    ``_profile_available_bytes`` subtracts (with the HCA scratch) from the KV budget, once per backend SGLang
    builds (3 with two-batch overlap). A later request returns the same buffers, a larger one is refused (never
    replaced), none is allocated under capture. ``projection="engine"`` allocates and counts nothing; an
    invalid value is refused at install()."""
    with pytest.raises(ValueError, match="projection must be one of"):
        sg.install(projection="cublas", check_environment=False)
    assert not sg.installed()
    kvc_mod = importlib.import_module("sglang.srt.mem_cache.kv_cache_configurator")
    cls = kvc_mod.KVCacheConfigurator
    _profiling_stand_ins(monkeypatch, kvc_mod, free_gb=60.0)
    monkeypatch.setattr(backend_mod.DeepseekV4AttnBackend, "__init__", lambda self, runner: None)
    ns = types.SimpleNamespace
    flash = ns(architectures=["DeepseekV4ForCausalLM"], hidden_size=4096, head_dim=512, index_head_dim=128,
               compress_ratios=[0, 0] + [4, 128] * 20 + [0])  # fmt: skip
    model_config = ns(is_multimodal=False, hf_config=flash)
    server = _record(chunked_prefill_size=8192, max_prefill_tokens=16384,
                                        enable_two_batch_overlap=True)  # fmt: skip
    kvc = ns(device="cuda", gpu_id=0, mambaish_config=None, post_capture_kv_active=False, is_draft_worker=False,
             model_config=model_config, server_args=server)  # fmt: skip
    main = max(sg.ops.projection_workspace_numel(64, 2048, 4096), sg.ops.projection_workspace_numel(64, 1024, 4096))
    indexer = sg.ops.projection_workspace_numel(256, 512, 4096)
    pair = sg.ops.projection_workspace_numel(64, 2560, 4096)
    sizes = sg.projection_workspaces(4096, 16384, head_dim=512, index_head_dim=128, ratios=flash.compress_ratios)
    assert sizes == {"main": (main, {2048: 64, 1024: 64}), "indexer": (indexer, {512: 256}),
                     "pair": (pair, {2560: 64})}  # fmt: skip
    per_backend = (main + indexer + pair) * 4
    assert per_backend == 6_995_968  # 2.27 + 2.52 + 1.89 MiB
    assert set(sg.projection_workspaces(4096, 16384, ratios=(128,))) == {"main"}  # no C4 layer: no pair
    assert set(sg.projection_workspaces(7168, 16384)) == {"main"}  # V4-Pro's indexer and pair: cuBLAS
    assert sg.projection_bytes_for(server, model_config) == 3 * per_backend
    assert sg.projection_bytes_for(server, model_config, projection="engine") == 0
    assert sg.projection_bytes_for(server, ns(hf_config=ns(architectures=flash.architectures))) == 0  # no D
    before, scratch = cls._profile_available_bytes(kvc, 80.0), sg.scratch_bytes_for(server)
    runner = ns(server_args=server, model_config=model_config, device="cpu")
    for projection, counted in (("auto", 3 * per_backend), ("engine", 0)):
        sg.install(projection=projection, check_environment=False)
        assert cls._profile_available_bytes(kvc, 80.0) == before - scratch - counted
        adapter = backend_mod.DeepseekV4AttnBackend(runner).__dict__[sg._ADAPTER_ATTR]
        assert adapter.projection_bytes == counted // 3  # what one backend's constructor allocated
        sg.uninstall()
    adapter = sg.SGLangCompressor()
    ws = adapter.allocate_projection("cpu", hidden_size=4096, max_rows=16384)
    assert adapter.allocate_projection("cpu", hidden_size=4096, max_rows=64) == ws
    assert all(adapter.allocate_projection("cpu", hidden_size=4096, max_rows=16384)[g] is t for g, t in ws.items())
    with pytest.raises(OpError, match="never replaced"):
        adapter.allocate_projection("cpu", hidden_size=7168, max_rows=16384)  # V4-Pro's main needs more
    assert all(adapter._projection[g] is t for g, t in ws.items())
    monkeypatch.setattr(sg.adapter, "_capturing", lambda device: True)
    with pytest.raises(OpError, match="before CUDA-graph capture"):
        sg.SGLangCompressor().allocate_projection("cpu", hidden_size=4096, max_rows=64)
