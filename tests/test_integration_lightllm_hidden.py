"""The LightLLM adapter from hidden states: our projection in place of LightLLM's GEMM, on the scaled-down
engine of ``helpers.lightllm_engine`` (CPU, Triton interpreter; the cuBLAS comparisons on a GPU)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from helpers import lightllm_sim as sim
from helpers.lightllm_engine import DSV4_C128_STATE_RING, HIDDEN, MAX_REQ, Engine, OpSpy, S
from helpers.session import count_launches, interpreting

from dsv4_compressor import ops
from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.kernels import projection as proj

# ---------------------------------------------------------------------------------------------------------------
# From hidden states: our projection in place of LightLLM's GEMM
# ---------------------------------------------------------------------------------------------------------------


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


def test_joined_c4_weights_project_both_in_our_one_launch_up_to_the_joint_pair_rows(monkeypatch):
    """Where ``kernels.projection.JOINT_PAIR_TRITON`` admits the step (patched for the test's shapes, as it has
    V4-Flash's at 64 rows: faster beside the attention's own GEMM), the joined C4 weights' decode steps run one
    ``ops.project`` of both on ``"auto"``: our one launch on the halves into the builder's ``"pair"`` workspace,
    not cuBLAS; then one ``compress_pair``, and the same checks."""
    _from_hidden_against_gemm(monkeypatch, False, "cpu", joined=True, joint_ours=True)


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
                              joined: bool = False, joint_ours: bool = False) -> None:  # fmt: skip
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
    if joint_ours:  # the tables themselves: ops.project reads them too
        monkeypatch.setitem(proj.PAIR_FASTER, (*plain.builder.c4_widths, HIDDEN), 1 << 20)
        monkeypatch.setitem(proj.JOINT_PAIR_TRITON, (*plain.builder.c4_widths, HIDDEN), 1 << 20)
    ours = HiddenEngine(projection="auto", projection_rows=24, **kwargs)
    assert gemm.builder.projection_rows == 0 and ours.builder.nbytes > gemm.builder.nbytes
    assert ("pair" in ours.builder._projection_ws[0]) == (paired or joint_ours)
    assert ops.joint_pair_triton_rows(*ours.builder.c4_widths, HIDDEN) == (1 << 20 if joint_ours else 0)
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
            cublas = joined and not joint_ours
            assert projects[0].get("projection", "auto") == ("torch" if cublas else "auto")  # cuBLAS: one GEMM
            kinds = [kw["kind"] for name, kw in calls if name == "compress" and kw.get("kind") != "hca"]
            pairs = [kw for name, kw in calls if name == "compress_pair"]
            assert kinds == [] and len(pairs) == 1 and pairs[0]["decode"], calls
            assert pairs[0]["read_rows"] is pairs[0]["indexer_read_rows"] is not None  # LightLLM's C4 tables
            want += 0 if cublas else 1  # the joint weight's GEMM is cuBLAS's, not a Triton launch
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
