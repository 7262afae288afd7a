"""The LightLLM adapter on LightLLM's own buffers and per-step metadata, scaled down (CPU, Triton interpreter).

LightLLM (``support_ds4``; docs/INTEGRATION.md, "What the engines call and hold") is played by the stand-ins of
``tests/helpers/lightllm_sim`` (``sim``), which the multi-GPU harness (``benchmarks/multi_gpu/``) runs on too: its
memory manager, request manager, ``infer_state``, compressor and indexer classes have LightLLM's names, attributes,
dtypes and layouts, and its ``SlotAllocator`` does LightLLM's slot bookkeeping. Scaled down: head 128
(``helpers.inputs`` configs), the HCA ratio 8 (128), the SWA page 16 (128); the module constants below play
``deepseek4_mem_manager.py``'s, for this module's subclass of the memory manager (the adapter reads them from the
memory manager's module).
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
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import lightllm_sim as sim
from helpers.inputs import CSA_SMALL, make_params, random_rows
from helpers.lightllm_engine import (
    DSV4_C128_STATE_RING,
    DSV4_SWA_PAGE_SIZE,
    HIDDEN,
    MAX_REQ,
    MTP,
    SIZE,
    Compressor,
    DeepseekV4MemoryManager,
    Engine,
    OpSpy,
    S,
    _decode_steps,
    _stand_in_lightllm,
)
from helpers.session import interpreting

from dsv4_compressor import ops
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.errors import CapacityError
from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.integrations.lightllm import patching as adapter_patching


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
