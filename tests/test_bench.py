"""The benchmark on CPU: byte and memory counts, the case matrix, the layers driven through the ops, every phase's
runner under the Triton interpreter (host timer, small shapes), the command line, and the report scripts
(``benchmarks/report``, ``scripts/write_perf.py``)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import cases as bench_cases
from benchmarks import cli as bench_cli
from benchmarks import floors as bench_floors
from benchmarks import report as perf_report
from benchmarks.cases import (
    Case,
    case_traffic,
    choose_copies,
    decode_starts,
    filter_cases,
    full_cases,
    model_footprint,
    model_launches,
    op_launches,
    plan_step,
    preset_cases,
)
from benchmarks.floors import (
    MEMORY_REQUESTS,
    derive_metrics,
    kind_config,
    memory_table,
    request_traffic,
    step_traffic,
)
from benchmarks.layers import LayerOp, fill_state, make_cache, reserve_pages, step_meta
from benchmarks.results import fmt_bytes, fmt_us, load_json, new_results, summary_table, write_json
from benchmarks.runner import Runner
from benchmarks.timing import HostTimer, host_time, summarize
from dsv4_compressor.config import CompressorParams

REPO = Path(__file__).resolve().parents[1]
HCA, CSA, IDX = kind_config("hca"), kind_config("csa"), kind_config("indexer")
ROW_HCA = 2 * 512 * 4  # one HCA kv_score row: 4 KiB
BANK = 3 * 512 * 4  # one online state bank: 6 KiB


# -------------------------------------------------------------------------------------------------
# Bytes
# -------------------------------------------------------------------------------------------------
def test_hca_decode_every_reads_the_whole_window():
    case = Case("decode", "hca", "triton-tiled", batch=1, rows=4, boundary="every", instances=20)
    t = case_traffic(case)
    assert t.closing_rows == 1
    assert t.rows_read == 4 * ROW_HCA
    assert t.state_read == 124 * ROW_HCA  # the window's rows before the step come from the ring
    assert t.rows_read + t.state_read == 128 * 1024 * 4
    assert t.state_written == 4 * ROW_HCA
    assert t.entries_written == 584
    assert t.total == 128 * 1024 * 4 + 4 * ROW_HCA + 584


def test_hca_decode_none_and_batch_scaling():
    one = case_traffic(Case("decode", "hca", "triton-single", batch=1, rows=4, boundary="none"))
    assert (one.closing_rows, one.state_read, one.entries_written) == (0, 0, 0)
    assert one.total == 2 * 4 * ROW_HCA
    many = case_traffic(Case("decode", "hca", "triton-single", batch=64, rows=4, boundary="none"))
    assert many.total == 64 * one.total
    assert one.scaled(64) == many


def test_s1_quarter_has_the_rows_and_closing_rows_of_s4_every():
    for b in (16, 64):
        s4 = case_traffic(Case("decode", "hca", "triton-tiled", batch=b, rows=4, boundary="every"))
        s1 = case_traffic(Case("decode", "hca", "triton-tiled", batch=4 * b, rows=1, boundary="quarter"))
        assert (s1.rows_read, s1.closing_rows, s1.entries_written) == (
            s4.rows_read,
            s4.closing_rows,
            s4.entries_written,
        )
        assert s4.state_read == b * 124 * ROW_HCA
        assert s1.state_read == b * 127 * ROW_HCA  # one new row per closing request: 127 come from the ring
        online = case_traffic(Case("decode", "hca", "online", batch=4 * b, rows=1, boundary="quarter"))
        # mtp_step 0: one bank per request; the non-closing requests start inside a group and read theirs
        assert online.state_read == 4 * b * BANK and online.state_written == 4 * b * BANK


def test_csa_and_indexer_use_the_halves_they_need():
    # S = 4 from a group start: the previous group's 4 ring rows give their [0, H) halves (kv and score).
    t = case_traffic(Case("decode", "csa", "triton-single", batch=1, rows=4, boundary="every"))
    assert t.rows_read == 4 * 2 * 1024 * 4
    assert t.state_read == 4 * (512 + 512) * 4
    assert t.state_written == 4 * 2 * 1024 * 4
    assert t.entries_written == 584
    # S = 1, closing row: 4 previous-group halves + 3 current-group halves come from the ring.
    t1 = case_traffic(Case("decode", "csa", "triton-single", batch=1, rows=1, boundary="every"))
    assert t1.state_read == 7 * 4096
    ti = case_traffic(Case("decode", "indexer", "triton-single", batch=2, rows=4, boundary="every"))
    assert ti.entries_written == 2 * (256 + 132)
    assert ti.state_read == 2 * 4 * (128 + 128) * 4


def test_a_position_needed_by_two_windows_counts_each_half_once():
    # positions 2..9 close groups 0 and 1; ring positions 0, 1 serve group 0 (current half) and group 1
    # (previous half): 4 half pairs.
    t = request_traffic(CSA, 2, 8, state="ring", mtp_step=3)
    assert t.closing_rows == 2
    assert t.state_read == 4 * 2 * 512 * 4


def test_online_state_bytes():
    every = case_traffic(Case("decode", "hca", "online", batch=1, rows=4, boundary="every"))
    assert every.state_read == BANK
    assert every.state_written == 4 * BANK
    assert every.rows_read == 4 * ROW_HCA and every.entries_written == 584
    aligned = request_traffic(HCA, 256, 4, state="online", mtp_step=3)  # a group start: no state to read
    assert aligned.state_read == 0
    with pytest.raises(ValueError):
        request_traffic(CSA, 4, 4, state="online", mtp_step=3)
    # online on CSA falls back to the ring: counted as ring
    csa_online = case_traffic(Case("decode", "csa", "online", batch=1, rows=4, boundary="every"))
    assert csa_online == case_traffic(Case("decode", "csa", "triton-single", batch=1, rows=4, boundary="every"))


def test_prefill_bytes():
    plain = case_traffic(Case("prefill", "hca", "triton-tiled", chunk=65536))
    assert plain.rows_read == 65536 * ROW_HCA
    assert plain.closing_rows == 512 and plain.entries_written == 512 * 584
    assert plain.state_read == 0 and plain.state_written == 132 * ROW_HCA
    carry = case_traffic(Case("prefill", "hca", "triton-tiled", chunk=65536, carry=True))
    assert carry.state_read == 64 * ROW_HCA and carry.closing_rows == 512
    online = case_traffic(Case("prefill", "hca", "online", chunk=65536, carry=True))
    assert online.state_read == BANK and online.state_written == 4 * BANK


def test_step_traffic_sums_requests():
    t = step_traffic(HCA, [124, 300], [4, 4], state="ring", mtp_step=3)
    assert t == request_traffic(HCA, 124, 4, state="ring", mtp_step=3) + request_traffic(
        HCA, 300, 4, state="ring", mtp_step=3
    )


def test_derive_metrics():
    traffic = {"total": 1_000_000, "read": 600_000}
    m = derive_metrics(traffic, 10.0, {"copy_bw_GBps": 4000.0, "launch_floor_us": 2.0})
    assert m["gbps"] == pytest.approx(100.0)
    assert m["read_gbps"] == pytest.approx(60.0)
    assert m["bytes_floor_us"] == pytest.approx(0.25)
    assert m["floor_us"] == 2.0 and m["floor_bound"] == "launch"
    assert m["x_floor"] == pytest.approx(5.0)
    assert m["read_pct_of_copy"] == pytest.approx(1.5)
    assert derive_metrics(traffic, None, {})["gbps"] is None
    assert derive_metrics(traffic, 1.0, {})["x_floor"] is None  # no floors measured: nothing invented
    step = derive_metrics(traffic, 300.0, {"copy_bw_GBps": 4000.0, "launch_floor_us": 2.0}, launches=64)
    assert step["launch_floor_us"] == 128.0 and step["x_floor"] == pytest.approx(300.0 / 128.0)


def test_choose_copies():
    mib = 2**20
    assert choose_copies(bytes_per_replay=10 * mib, bytes_per_copy=mib, l2_bytes=60 * mib, max_copies=16,
                         max_copy_bytes=2**30) == 12  # fmt: skip
    assert choose_copies(bytes_per_replay=500 * mib, bytes_per_copy=mib, l2_bytes=60 * mib, max_copies=16,
                         max_copy_bytes=2**30) == 1  # fmt: skip
    assert choose_copies(bytes_per_replay=mib, bytes_per_copy=mib, l2_bytes=60 * mib, max_copies=16,
                         max_copy_bytes=2**30) == 16  # fmt: skip
    assert choose_copies(bytes_per_replay=mib, bytes_per_copy=300 * mib, l2_bytes=60 * mib, max_copies=16,
                         max_copy_bytes=2**30) == 3  # fmt: skip


def test_memory_table():
    rows = {(m["model"], m["backend"]): m for m in memory_table(["triton-tiled", "triton-single", "online"])}
    flash = rows[("DeepSeek-V4-Flash", "triton-tiled")]
    per_layer = flash["state_per_request_per_layer"]
    assert per_layer == {"hca": 132 * 4096, "csa": 11 * 8192, "indexer": 11 * 2048}
    assert flash["state_total"] == MEMORY_REQUESTS * (20 * 132 * 4096 + 21 * (11 * 8192 + 11 * 2048))
    assert flash["scratch"] == 8192 * 512 * 4
    assert rows[("DeepSeek-V4-Pro", "triton-single")]["scratch"] == 0
    assert rows[("DeepSeek-V4-Flash", "online")]["state_total"] is None  # not probed: no number
    probed = memory_table(
        ["online"], {"online": {"state": {"hca": 24576, "csa": 90112, "indexer": 22528}, "scratch": 0}}
    )
    pro = next(m for m in probed if m["model"] == "DeepSeek-V4-Pro")
    assert pro["state_total"] == MEMORY_REQUESTS * (31 * 24576 + 30 * (90112 + 22528))


# -------------------------------------------------------------------------------------------------
# The whole model: layers, launches, bytes, memory
# -------------------------------------------------------------------------------------------------
def test_model_launches_and_traffic():
    flash_online = Case("model", "", "online", 16, 4, "realistic", model="flash")
    assert model_launches(flash_online) == 2 + 20 * 1 + 21 * 2  # two plans, then one launch per op
    # the tiled HCA kernel: one launch on decode steps of up to 256 requests, two beyond
    assert model_launches(Case("model", "", "triton-tiled", 16, 4, "realistic", model="flash")) == 2 + 20 + 21 * 2
    assert model_launches(Case("model", "", "triton-tiled", 512, 4, "realistic", model="flash")) == 2 + 40 + 21 * 2
    assert model_launches(Case("model", "", "online", 16, 4, "realistic", model="pro")) == 2 + 31 + 30 * 2
    starts = decode_starts(flash_online)
    assert len(starts) == 16 and all(128 <= s < 256 for s in starts)
    each = {
        kind: step_traffic(kind_config(kind), starts, [4] * 16, state=state, mtp_step=3)
        for kind, state in (("hca", "online"), ("csa", "ring"), ("indexer", "ring"))
    }
    want = each["hca"].scaled(20) + each["csa"].scaled(21) + each["indexer"].scaled(21)
    assert case_traffic(flash_online) == want
    with pytest.raises(ValueError, match="unknown model"):
        model_launches(Case("model", "", "online", 16, 4, "realistic", model="v3"))


def test_model_footprint_from_the_spec_sizes():
    mem = model_footprint(Case("model", "", "online", 16, 4, "realistic", model="flash"))
    # state per request: 4 online banks of 6 KiB (HCA); rings of 11 rows of 8 KiB (CSA) and 2 KiB (indexer)
    assert mem["state"] == 16 * (20 * 4 * BANK + 21 * (11 * 8192 + 11 * 2048))
    # lengths below 260: one output page per request and layer (SPEC pages: 1,728 B HCA, 37,440 B CSA;
    # the indexer's 64 bf16 keys plus its 8,448-byte FP8 page)
    assert mem["pools"] == 16 * (20 * 1728 + 21 * 37440 + 21 * (64 * 256 + 8448))
    assert mem["kv_score"] == 64 * (20 * 4096 + 21 * (8192 + 2048))
    assert mem["scratch"] == 0 and mem["metadata"] == 4 * 64 * 8
    assert mem["plans"] == 4 * 16 * (-(-8 * (1 + 16 + 64 + 16 + 16) // 16) + -(-8 * (1 + 16 + 64 + 0 + 16) // 16))
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    tiled = model_footprint(Case("model", "", "triton-tiled", 256, 4, "realistic", model="pro"))
    assert tiled["scratch"] == 1024 * 512 * 4  # one region for the step's 1,024 rows, shared by the HCA layers
    assert tiled["state"] == 256 * (31 * 132 * 4096 + 30 * (11 * 8192 + 11 * 2048))


# -------------------------------------------------------------------------------------------------
# Cases
# -------------------------------------------------------------------------------------------------
def test_decode_starts():
    r = 128
    every = Case("decode", "hca", "triton-tiled", batch=8, rows=4, boundary="every")
    none = Case("decode", "hca", "triton-tiled", batch=8, rows=4, boundary="none")
    quarter = Case("decode", "hca", "online", batch=8, rows=1, boundary="quarter")
    real = Case("decode", "hca", "triton-tiled", batch=256, rows=4, boundary="realistic")
    for copy in range(4):
        assert all((s + 3) % r == r - 1 for s in decode_starts(every, copy))
        assert all(not any((p % r) == r - 1 for p in range(s, s + 4)) for s in decode_starts(none, copy))
        closes = [s % r == r - 1 for s in decode_starts(quarter, copy)]
        assert closes == [True, False, False, False] * 2
    starts = decode_starts(real, 0)
    assert starts == decode_starts(Case("decode", "hca", "online", batch=256, rows=4, boundary="realistic"), 0)
    assert starts != decode_starts(real, 1)
    closing = sum(any(p % r == r - 1 for p in range(s, s + 4)) for s in starts)
    assert 0 < closing < 40  # about S/r = 3% of 256
    assert decode_starts(Case("decode", "csa", "triton-single", batch=2, rows=4, boundary="none")) is None
    assert decode_starts(Case("decode", "csa", "triton-single", batch=2, rows=4, boundary="quarter")) is None
    assert decode_starts(Case("decode", "csa", "triton-single", batch=2, rows=1, boundary="none")) == [5, 5]


def test_plan_step():
    for t, requests in ((64, 16), (1024, 256)):
        starts, counts = plan_step(Case("plan", "csa", "", batch=requests, rows=4, chunk=t))
        assert counts == [4] * requests and all(4 <= s for s in starts)
    starts, counts = plan_step(Case("plan", "hca", "", batch=256, rows=4, chunk=8192))
    assert sum(counts) == 8192 and counts[:255] == [4] * 255 and counts[-1] == 8192 - 1020 and starts[-1] == 0


def test_op_launches():
    """The bench's launch counts are ``ops.launches``' for the calls it makes (ring states, no tables)."""
    n = dict(requests=16)
    assert op_launches("hca", "triton-tiled", decode=True, **n) == 1  # tile programs finish their entries
    assert op_launches("hca", "triton-tiled", decode=True, requests=256) == 1
    assert op_launches("hca", "triton-tiled", decode=True, requests=257) == 2  # two stages above 256 requests
    assert op_launches("hca", "triton-tiled", decode=False, **n) == 2
    assert op_launches("hca", "triton-single", decode=True, **n) == 1
    # a prefill step on a ring saves each request's rows from its own program, after its windows: one launch
    assert op_launches("hca", "triton-single", decode=False, **n) == 1
    assert op_launches("hca", "online", decode=False, **n) == 1
    assert op_launches("hca", "online", decode=False, split=True, **n) == 2  # the finish launch of a split step
    assert op_launches("hca", "online", decode=True, split=True, **n) == 1  # decode steps never split
    assert op_launches("csa", "online", decode=True, **n) == 1  # the ring kernel
    assert op_launches("csa", "triton-tiled", decode=False, **n) == 1
    assert op_launches("hca", "reference", decode=True, **n) is None


def test_quick_preset_holds_the_required_measurements():
    quick = preset_cases("quick")
    ids = {c.id for c in quick}
    assert len(ids) == len(quick)
    for boundary in ("none", "every"):
        for b in (16, 64, 256):
            for backend in ("triton-single", "triton-tiled", "online"):
                case = next(c for c in quick if c.id == f"decode/hca/{backend}/B{b}/S4/{boundary}")
                assert case.instances == 20 and case.timing == "graph" and case.mtp_step == 3
            for backend in ("triton-tiled", "online"):
                s1 = next(c for c in quick if c.id == f"decode/hca/{backend}/B{4 * b}/S1/quarter")
                assert s1.timing == "graph" and s1.instances == 20 and s1.mtp_step == 0
    for carry in ("no-carry", "carry"):
        assert f"prefill/hca/online/65536/{carry}" in ids
        assert f"prefill/hca/triton-tiled/8192/{carry}" in ids
    assert {"decode/hca/triton-tiled/B64/S4/realistic", "decode/hca/online/B64/S4/realistic"} <= ids
    for kind in ("csa", "indexer"):
        assert {f"decode/{kind}/triton-single/B{b}/S4/every" for b in (16, 64, 256)} <= ids
        assert {f"prefill/{kind}/triton-single/{chunk}/no-carry" for chunk in (8192, 65536)} <= ids
    refs = [c for c in quick if c.backend == "reference"]
    assert refs and all(c.batch == 16 and c.timing == "eager" and c.instances == 1 for c in refs)
    assert any(c.eager and c.timing == "graph" for c in quick)  # eager launches timed next to graphs
    assert {f"plan/r{r}/T{t}" for r in (4, 128) for t in (64, 1024, 8192)} <= ids
    assert {"dispatch/hca/triton-tiled/B64/S4/every", "dispatch/hca/online/B64/S4/every"} <= ids
    assert {"cache-step/hca/online/B256/S4", "cache-step/csa/triton-single/B256/S4"} <= ids
    models = {
        f"model/{m}/{b}/B{n}/S4" for m in ("flash", "pro") for b in ("online", "triton-tiled") for n in (16, 64, 256)
    }
    assert models <= ids
    assert not any(c.not_applicable() for c in quick)
    # the named presets are parts of quick
    for preset in ("c128", "online", "host", "model", "projection"):
        assert {c.id for c in preset_cases(preset)} <= ids, preset
    assert quick[0].group == "c128"  # the measurements other issues need run first


def test_full_matrix_rules():
    full = full_cases()
    assert not [c for c in full if c.kind != "hca" and c.backend in ("triton-tiled", "online")]
    assert all(c.batch <= 16 for c in full if c.backend == "reference" and c.phase == "decode")
    assert all(c.chunk <= 8192 for c in full if c.backend == "reference" and c.phase == "prefill")
    na = [c for c in full if c.not_applicable()]
    assert na and all(c.kind in ("csa", "indexer") and c.rows == 4 and c.boundary in ("none", "quarter") for c in na)
    assert len({c.id for c in full}) == len(full)
    every_phase = {c.phase for c in preset_cases("full")}
    assert every_phase == set(bench_cases.PHASES)


def test_filter_cases():
    quick = preset_cases("quick")
    tiled = filter_cases(quick, backends=["triton-tiled"], phases=["decode"])
    assert tiled and all(c.backend == "triton-tiled" and c.phase == "decode" for c in tiled)
    few = filter_cases(quick, kinds=["hca"], batches=[16], boundaries=["none"], phases=["decode"], instances=5)
    assert {c.backend for c in few} == {"triton-single", "triton-tiled", "online", "reference"}
    assert all(c.instances == (1 if c.backend == "reference" else 5) for c in few)
    assert all(c.phase == "prefill" for c in filter_cases(quick, phases=["prefill"]))
    # kinds do not filter whole-model steps (every kind runs in them); models and batches do
    models = filter_cases(quick, kinds=["csa"], phases=["model"], models=["pro"], batches=[64])
    assert [c.id for c in models] == ["model/pro/online/B64/S4", "model/pro/triton-tiled/B64/S4"]
    plans = filter_cases(quick, phases=["plan"], plan_rows=[8192], instances=7)
    assert [c.id for c in plans] == ["plan/r4/T8192", "plan/r128/T8192"] and all(c.instances == 7 for c in plans)


# -------------------------------------------------------------------------------------------------
# The layers: an engine's step through the ops
# -------------------------------------------------------------------------------------------------
def test_step_meta_rows_and_plan():
    cfg = CSA
    cache = make_cache(cfg, CompressorParams.random(cfg, max_positions=64), "triton-single", max_requests=6,
                       max_seq_len=64, mtp_step=3, device="cpu")  # fmt: skip
    slots, starts, counts = np.array([3, 5]), np.array([6, 0]), np.array([2, 4])
    reserve_pages([cache.pool], slots, starts + counts)
    meta = step_meta(slots, starts, counts, ratio=4, num_slots=6, mtp_step=3, device="cpu", pool=cache.pool)
    assert meta.positions.tolist() == [6, 7, 0, 1, 2, 3] and meta.row_req.tolist() == [3, 3, 5, 5, 5, 5]
    table = cache.pool.page_table
    # position 7 closes request 3's group 1, position 3 request 5's group 0 (slot = page * 64 + group)
    assert meta.out_slot.tolist() == [-1, table[3, 0] * 64 + 1, -1, -1, -1, table[5, 0] * 64]
    assert meta.positions.dtype == torch.int64 and meta.decode and meta.rows == 6
    header = meta.plan.reshape(-1)[:8].tolist()
    assert header[:6] == [6, 2, 4, 6, 2, 2]  # rows, request capacity, ratio, slots, requests, closing rows
    with pytest.raises(RuntimeError, match="invalid step.*negative position"):  # the plan is checked on the device
        step_meta([0], [-2], [4], ratio=4, num_slots=6, mtp_step=3, device="cpu")
    pools = [cache.pool, make_cache(cfg, CompressorParams.random(cfg, max_positions=64), "triton-single",
                                    max_requests=6, max_seq_len=64, mtp_step=3, device="cpu").pool]  # fmt: skip
    with pytest.raises(RuntimeError, match="page tables differ"):
        reserve_pages(pools, np.array([0]), np.array([8]))


@pytest.mark.parametrize("kind, backend", [("hca", "online"), ("hca", "triton-tiled"), ("indexer", "triton-single")])
def test_layer_op_runs_what_the_backend_runs(kind, backend):
    """The bench's op call on the cache's buffers writes the bytes the cache's own backend writes for the same
    step from the same state; so does the same call through ``torch.ops.dsv4c``."""
    from dsv4_compressor.workspace import Workspace, plan_c128_scratch

    cfg = kind_config(kind)
    params = CompressorParams.random(cfg, max_positions=512)
    slots, starts, counts = np.array([0, 1]), np.array([2 * cfg.ratio - 3, cfg.ratio + 1]), np.array([4, 4])
    workspace = None
    if backend == "triton-tiled":
        workspace = Workspace(plan_c128_scratch(batch_max_tokens=8, max_req_num=2, mtp_step=3), device="cpu")
    caches = [
        make_cache(cfg, params, backend, max_requests=2, max_seq_len=512, mtp_step=3, device="cpu",
                   workspace=workspace)
        for _ in range(3)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    fill_state(caches[0], gen)
    for cache in caches[1:]:
        for name, t in cache.backend.state_tensors().items():
            t.copy_(caches[0].backend.state_tensors()[name])
    reserve_pages([c.pool for c in caches], slots, starts + counts)
    meta = step_meta(slots, starts, counts, ratio=cfg.ratio, num_slots=2, mtp_step=3, device="cpu",
                     pool=caches[0].pool)  # fmt: skip
    kv = torch.randn(8, cfg.row_width, generator=gen)
    scratch = workspace.c128_scratch(0, 8) if workspace is not None else None
    LayerOp(caches[0], scratch=scratch)(kv, meta)
    caches[1].backend.launch(kv, meta.positions, meta.row_req, meta.out_slot, meta.plan, decode=True)
    name, args, kwargs = LayerOp(caches[2], scratch=scratch).call(kv, meta.plan, decode=True)
    getattr(torch.ops.dsv4c, name)(*args, **kwargs)
    assert (meta.host[2] >= 0).any()  # the step closes a group: an entry is written
    for other in caches[1:]:
        for name, t in caches[0].state_tensors().items():
            assert torch.equal(t, other.state_tensors()[name]), name
    written = caches[0].pool.out_pages if caches[0].pool.out_pages is not None else caches[0].pool.out_keys
    assert written.abs().sum() > 0  # the closing row's entry was written


# -------------------------------------------------------------------------------------------------
# Timing helpers
# -------------------------------------------------------------------------------------------------
def test_host_time_takes_turns_and_times_each_call():
    order = []
    samples = host_time(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, calls=3, rounds=2, sync=lambda: None
    )
    assert order == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert set(samples) == {"a", "b"} and all(len(v) == 2 and min(v) > 0 for v in samples.values())


def test_host_timer_runs_before_outside_the_sample():
    seen = []
    timer = HostTimer()
    samples = timer.time([lambda: seen.append("call")], replays=3, warmup=1, queue_ahead=True,
                         before=lambda: seen.append("before"))  # fmt: skip
    assert seen == ["call"] + ["before", "call"] * 3 and len(samples) == 3


# -------------------------------------------------------------------------------------------------
# Every phase's runner on CPU (Triton interpreter, host timer)
# -------------------------------------------------------------------------------------------------
FLOORS = {
    "copy_bw_GBps": 4000.0,
    "copy_bw_GBps_best": 4100.0,
    "copy_bytes": 2**30,
    "launch_floor_us": 1.5,
    "launch_floor_kernels_per_graph": 20,
    "graph_one_kernel_us": 2.5,
    "eager_empty_launch_us": 6.0,
}


def _runner(**kwargs) -> Runner:
    settings = dict(replays=2, warmup=1, warm_replays=2, host_calls=2, host_rounds=2, host_steps=3, host_warmup=1,
                    floors=FLOORS, max_copies=2, log=lambda _: None)  # fmt: skip
    settings.update(kwargs)
    return Runner(HostTimer(), **settings)


def test_runner_decode_and_prefill_on_cpu():
    runner = _runner()
    res = runner.run(Case("decode", "indexer", "reference", batch=2, rows=4, boundary="every", timing="eager"))
    assert res["status"] == "ok", res.get("traceback")
    assert res["eager"]["n"] == 2 and res["graph"] is None and res["warm"] is None and res["x_floor"] is not None
    res = runner.run(Case("decode", "hca", "triton-single", batch=1, rows=4, boundary="none", instances=2))
    assert res["status"] == "ok", res.get("traceback")
    assert res["instances"] == 2 and res["copies"] == 2 and res["launches_per_layer"] == 1
    assert res["graph"]["per"] == 2 and res["warm"]["per"] == 2 and res["warm"]["n"] == 2
    assert res["us"] == res["us_per_layer"] == res["graph"]["median_us"] and res["unit"] == "us per layer"
    assert res["warm_bytes"] == 2 * case_traffic(Case("decode", "hca", "triton-single", 1, 4, "none")).total
    res = runner.run(Case("prefill", "hca", "reference", chunk=128, carry=True, timing="eager"))
    assert res["status"] == "ok", res.get("traceback")
    assert res["traffic"]["state_read"] == 64 * ROW_HCA and res.get("warm") is None


def test_runner_online_s1_on_cpu():
    case = Case("decode", "hca", "online", batch=4, rows=1, boundary="quarter", instances=1)
    res = _runner(max_copies=1).run(case)
    assert res["status"] == "ok", res.get("traceback")
    assert res["state_bytes_per_request"] == 1 * BANK  # mtp_step 0: one bank
    assert res["traffic"]["closing_rows"] == 1 and res["launches_per_layer"] == 1


def test_runner_plan_dispatch_and_cache_step_on_cpu():
    runner = _runner()
    res = runner.run(Case("plan", "hca", "", batch=4, rows=4, chunk=64, instances=3))
    assert res["status"] == "ok", res.get("traceback")
    assert res["graph"]["per"] == 3 and res["unit"] == "us per launch" and res["requests"] == 4
    assert res["plan_rows"] == 64 and not res["decode"]  # 3 decode requests and a 52-row prompt chunk
    res = runner.run(Case("dispatch", "hca", "online", 1, 4, "every", timing="host"))
    assert res["status"] == "ok", res.get("traceback")
    assert set(res["host"]) == {
        "ops.compress_online_hca", "torch.ops.dsv4c.compress_online_hca", "ops.build_plan",
        "torch.ops.dsv4c.build_plan",
    }  # fmt: skip
    assert all(s["n"] == 2 for s in res["host"].values())
    overhead = res["dispatcher_overhead_us"]["build_plan"]
    assert (
        overhead == res["host"]["torch.ops.dsv4c.build_plan"]["median_us"] - res["host"]["ops.build_plan"]["median_us"]
    )
    res = runner.run(Case("cache-step", "csa", "triton-single", 2, 4, timing="host"))
    assert res["status"] == "ok", res.get("traceback")
    assert res["host"]["n"] == 3 and res["steps"] == 3 and res["check_finite"] is False
    assert res["unit"] == "host us per step" and "synchronised before each call" in res["note"]


def test_runner_whole_model_on_cpu(monkeypatch):
    """A two-layer model (one CSA layer with its indexer, one HCA layer) through the whole-model runner: the
    buffers it allocates are exactly the footprint the dry run prints."""
    monkeypatch.setitem(bench_floors.MODELS, "tiny", {"csa": 1, "hca": 1})
    monkeypatch.setitem(bench_cases.MODEL_NAMES, "tiny", "tiny")
    case = Case("model", "", "triton-tiled", 1, 4, "realistic", model="tiny")
    res = _runner().run(case)
    assert res["status"] == "ok", res.get("traceback")
    assert res["memory"] == res["memory_estimate"] == model_footprint(case)
    assert res["launches_per_step"] == model_launches(case) == 2 + 2 + 1  # plans, CSA and indexer, HCA
    assert res["layers"] == {"hca": 1, "csa": 1, "indexer": 1}
    assert res["warm"]["n"] == 2 and res["graph"]["n"] == 2 and res["us"] == res["graph"]["median_us"]
    assert res["traffic"] == case_traffic(case).as_dict() and res["launch_floor_us"] == 5 * 1.5


def test_runner_records_failures_and_skips():
    runner = _runner(online_problem="online backend not present")
    res = runner.run(Case("decode", "hca", "online", batch=1, rows=4, boundary="none"))
    assert res["status"] == "skipped" and "not present" in res["note"]
    res = runner.run(Case("decode", "csa", "triton-single", batch=1, rows=4, boundary="none"))
    assert res["status"] == "n/a"
    res = runner.run(Case("decode", "hca", "no-such-backend", batch=1, rows=4, boundary="none"))
    assert res["status"] == "error" and "KeyError" in res["error"]


# -------------------------------------------------------------------------------------------------
# Rendering
# -------------------------------------------------------------------------------------------------
def _stats(us: float, per: int = 1, spread: float = 0.03) -> dict:
    return summarize([us * per * f for f in (1 - spread, 1.0, 1 + spread)], per=per)


def _result(case: Case, us: float | None, *, eager_us=None, warm_us=None, status="ok", error=None) -> dict:
    res = {"id": case.id, "case": case.as_dict(), "status": status, "note": "", "error": error}
    if status != "ok":
        return res
    traffic = case_traffic(case).as_dict()
    per = case.instances
    graph = _stats(us, per) if us and case.timing == "graph" else None
    eager = _stats(eager_us, per, 0) if eager_us else None
    headline = graph["median_us"] if graph else eager["median_us"]
    res.update(
        instances=per, copies=2, traffic=traffic, graph=graph, eager=eager,
        warm=_stats(warm_us, per) if warm_us else None, warm_bytes=per * traffic["total"],
        launches_per_layer=op_launches(case.kind, case.backend, decode=case.phase == "decode", requests=case.batch),
        us=headline, us_per_layer=headline, unit="us per layer", timing=case.timing,
    )  # fmt: skip
    res.update(derive_metrics(traffic, headline, FLOORS))
    return res


def _extra_results() -> list[dict]:
    out = []
    for kind, t, us in (("csa", 64, 3.0), ("csa", 8192, 41.0), ("hca", 1024, 7.5)):
        case = Case("plan", kind, "", batch=min(t // 4, 256), rows=4, chunk=t, instances=20)
        out.append({"id": case.id, "case": case.as_dict(), "status": "ok", "note": "", "error": None,
                    "graph": _stats(us, 20), "us": us, "unit": "us per launch", "requests": case.batch,
                    "plan_rows": t, "closing_rows": t // kind_config(kind).ratio, "decode": t < 8192,
                    "instances": 20})  # fmt: skip
    case = Case("dispatch", "hca", "online", 64, 4, "every", timing="host")
    host = {"ops.compress_online_hca": _stats(21.0), "torch.ops.dsv4c.compress_online_hca": _stats(24.5),
            "ops.build_plan": _stats(12.0), "torch.ops.dsv4c.build_plan": _stats(13.25)}  # fmt: skip
    out.append({"id": case.id, "case": case.as_dict(), "status": "ok", "note": "", "error": None, "op":
                "compress_online_hca", "host": host, "calls": 200, "rounds": 5, "us": 21.0, "unit": "host us per call",
                "dispatcher_overhead_us": {"compress_online_hca": 3.5, "build_plan": 1.25}})  # fmt: skip
    for kind, backend, us in (("hca", "online", 41.0), ("csa", "triton-single", 62.0)):
        case = Case("cache-step", kind, backend, 256, 4, timing="host")
        out.append({"id": case.id, "case": case.as_dict(), "status": "ok", "note": "", "error": None,
                    "host": _stats(us), "us": us, "unit": "host us per step", "steps": 50})  # fmt: skip
    for backend, cold, warm in (("online", 300.0, 250.0), ("triton-tiled", 420.0, 380.0)):
        case = Case("model", "", backend, 64, 4, "realistic", model="flash")
        mem = model_footprint(case)
        traffic = case_traffic(case).as_dict()
        res = {"id": case.id, "case": case.as_dict(), "status": "ok", "note": "", "error": None,
               "layers": {"hca": 20, "csa": 21, "indexer": 21}, "launches_per_step": model_launches(case),
               "traffic": traffic, "warm": _stats(warm), "graph": _stats(cold), "memory": mem,
               "memory_estimate": mem, "cuda_peak_bytes": mem["total"] + 2**20, "us": cold,
               "unit": "us per step"}  # fmt: skip
        res.update(derive_metrics(traffic, cold, FLOORS, launches=res["launches_per_step"]))
        out.append(res)
    failed = Case("model", "", "online", 256, 4, "realistic", model="pro")
    out.append({"id": failed.id, "case": failed.as_dict(), "status": "error", "note": "",
                "error": "OutOfMemoryError: CUDA out of memory"})  # fmt: skip
    return out


def _synthetic_results() -> dict:
    results = new_results(
        command="python -m dsv4_compressor bench --quick", argv=["--quick"], preset="quick",
        settings={"replays": 200, "warmup": 20, "instances": 20, "warm_replays": 40},
    )  # fmt: skip
    results["env"] = {"gpu": "NVIDIA H200", "driver": "570.1", "torch": "2.11", "triton": "3.6", "commit": "abc123",
                      "date": "2025-01-01 00:00:00 UTC", "l2_bytes": 60 * 2**20}  # fmt: skip
    results["floors"] = dict(FLOORS)
    results["online"] = {"available": True, "problem": None}
    results["memory"] = memory_table(["triton-single", "triton-tiled"])
    cases = []
    for boundary in ("none", "every"):
        for b, base in ((16, 10.0), (64, 14.0)):
            extra = 0 if boundary == "none" else b
            single = _result(
                Case("decode", "hca", "triton-single", b, 4, boundary, instances=20, eager=True),
                base + 3 * extra, eager_us=base + 20, warm_us=base,
            )  # fmt: skip
            tiled = _result(Case("decode", "hca", "triton-tiled", b, 4, boundary, instances=20), base + 1.5 + extra)
            online = _result(
                Case("decode", "hca", "online", b, 4, boundary, instances=20), base + 0.2 + 0.5 * extra,
                warm_us=(base + 0.2 + 0.5 * extra) / 2,
            )  # fmt: skip
            cases += [single, tiled, online]
    for b, tiled_us, online_us in ((16, 30.0, 7.0), (64, 90.0, 9.0)):
        cases.append(_result(Case("decode", "hca", "triton-tiled", 4 * b, 1, "quarter", instances=20), tiled_us))
        cases.append(
            _result(
                Case("decode", "hca", "online", 4 * b, 1, "quarter", instances=20), online_us, warm_us=online_us - 1
            )
        )
    cases.append(_result(Case("prefill", "hca", "online", chunk=65536, timing="graph"), 100.0))
    cases.append(_result(Case("prefill", "hca", "triton-tiled", chunk=65536, carry=True), 150.0))
    cases.append(_result(Case("decode", "hca", "reference", 16, 4, "every", timing="eager"), None, eager_us=5000.0))
    cases.append(
        _result(
            Case("decode", "csa", "triton-single", 16, 4, "every", instances=20), None, status="error",
            error="RuntimeError: boom",
        )
    )  # fmt: skip
    cases.append(
        {"id": "decode/csa/triton-single/B16/S4/none", "case": Case("decode", "csa", "triton-single", 16, 4,
         "none").as_dict(), "status": "n/a", "note": "no step of 4 rows avoids a boundary at r=4", "error": None}
    )  # fmt: skip
    results["cases"] = cases + _extra_results()
    results["elapsed_s"] = 123.0
    results["complete"] = True
    return results


def test_summary_table_lists_every_case():
    results = _synthetic_results()
    table = summary_table(results)
    for res in results["cases"]:
        assert res["id"] in table
    assert "error: RuntimeError: boom" in table and "n/a" in table
    assert "| model/flash/online/B64/S4 | 300.0 | us per step | 300.0 | 250.0 |" in table
    assert "| plan/r4/T8192 | 41.0 | us per launch | 41.0 |" in table


def test_progress_lines_for_every_phase():
    lines = {res["id"]: bench_cli._result_line(res) for res in _synthetic_results()["cases"]}
    model = lines["model/flash/online/B64/S4"]
    assert "cold graph 300.00" in model and "warm graph 250.00" in model and "us per step" in model
    memory = model_footprint(Case("model", "", "online", 64, 4, "realistic", model="flash"))["total"]
    assert f"device memory {fmt_bytes(memory)}" in model
    dispatch = lines["dispatch/hca/online/B64/S4/every"]
    assert "ops.compress_online_hca 21.00" in dispatch and "torch.ops.dsv4c.build_plan 13.25" in dispatch
    assert "cache.step 62.00 host us per step" in lines["cache-step/csa/triton-single/B256/S4"]
    assert "warm graph 9.10" in lines["decode/hca/online/B16/S4/every"]
    assert lines["decode/csa/triton-single/B16/S4/every"].strip() == "error: RuntimeError: boom"


def test_answers_come_from_the_numbers():
    results = _synthetic_results()
    rows = {(r["rows"], r["boundary"], r["batch"]): r for r in perf_report.c128_rows(results)}
    none16 = rows[(4, "none", 16)]
    assert none16["tiled_minus_single"] == pytest.approx(1.5)
    assert none16["single_over_tiled"] == pytest.approx(10.0 / 11.5)
    every64 = rows[(4, "every", 64)]
    assert every64["single_over_tiled"] == pytest.approx((14 + 3 * 64) / (14 + 1.5 + 64))
    picks = {p["key"]: p for p in perf_report.pick_table(results)}
    assert picks[("decode", "hca", 4, "every", 64)]["pick"] == "online"
    assert picks[("decode", "hca", 4, "none", 16)]["pick"] == "triton-single"
    assert picks[("decode", "hca", 4, "none", 16)]["next"] == "online"
    assert all(p["pick"] != "reference" for p in picks.values())
    assert all(p["key"][0] in ("decode", "prefill") for p in picks.values())  # plans and models are not ranked


def test_new_comparisons_come_from_the_numbers():
    results = _synthetic_results()
    warm = {r["id"]: r for r in perf_report.warm_rows(results)}
    online16 = warm["decode/hca/online/B16/S4/every"]
    assert online16["warm_over_cold"] == pytest.approx(0.5) and online16["fits_l2"] is True
    assert warm["decode/hca/triton-single/B64/S4/every"]["fits_l2"] is False  # 20 x 33 MiB
    s1 = {(r["batch"], r["backend"]): r for r in perf_report.s1_rows(results)}
    assert s1[(64, "online")]["s1_over_s4"] == pytest.approx(9.0 / (14.2 + 32))
    assert (
        s1[(16, "triton-tiled")]["s4_cold"] == pytest.approx(11.5 + 16) and s1[(16, "triton-tiled")]["s1_warm"] is None
    )
    models = {r["backend"]: r for r in perf_report.model_rows(results)}
    assert models["online"]["warm"] == pytest.approx(250.0) and models["online"]["launches"] == 64
    assert models["triton-tiled"]["memory"] == model_footprint(Case("model", "", "triton-tiled", 64, 4, "realistic",
                                                                    model="flash"))["total"]  # fmt: skip
    steps = {r["kind"]: r for r in perf_report.cache_step_rows(results)}
    assert steps["hca"]["met"] and not steps["csa"]["met"]
    dispatch = {r["op"]: r for r in perf_report.dispatch_rows(results)}
    assert dispatch["compress_online_hca"]["overhead"] == 3.5 and dispatch["build_plan"]["dispatcher"] == 13.25


def test_online_targets_come_from_the_numbers():
    rows = {r["check"]: r for r in perf_report.online_target_rows(_synthetic_results())}
    # synthetic online: base + 0.2 (+ 0.5 B when every request closes); tiled: base + 1.5 (+ B)
    ratio = rows["every request closes a group ÷ none does"]
    assert ratio["values"][16] == pytest.approx((10.2 + 8) / 10.2) and ratio["limits"][16] == 1.1
    assert rows["online ÷ tiled, no request closes a group"]["values"][64] == pytest.approx(14.2 / 15.5)
    assert rows["online ÷ tiled, every request closes a group"]["values"][64] == pytest.approx(46.2 / 79.5)
    worst = rows["slowest boundary case, us per layer"]
    assert worst["values"] == {16: pytest.approx(18.2), 64: pytest.approx(46.2)}
    assert worst["limits"] == {16: 2.0, 64: 3.5}
    assert perf_report.online_target_rows({"cases": []}) == []


def test_render_perf():
    results = _synthetic_results()
    text = perf_report.render_perf(results, plot_link="perf.png", json_link="perf.json")
    flash_online = fmt_bytes(model_footprint(Case("model", "", "online", 64, 4, "realistic", model="flash"))["total"])
    for needle in (
        "NVIDIA H200",
        "570.1",
        "abc123",
        "2025-01-01",
        "`python -m dsv4_compressor bench --quick`",
        "4,000 GB/s",
        "1.50 us per empty kernel",
        "![latency per layer against batch size](perf.png)",
        "## What to pick",
        "## HCA decode summary",
        "## Online HCA decode against its targets",
        "| every request closes a group ÷ none does | ≤ 1.1 | 1.78 (missed) |",
        "0.92 (met)",
        "## Decode: cold and warm figures",
        "| decode/hca/online/B16/S4/every | 18.2 | 9.10 | 0.50x |",
        "## HCA decode: S = 1 row for 4B requests against S = 4 rows for B requests",
        "| 64 | online | 46.2 | 9.00 | 0.19x | 23.1 | 8.00 |",
        "## Whole-model decode step",
        "| flash | online | 64 | 250.0 | 300.0 | 64 |",
        flash_online,
        "`model/pro/online/B256/S4`: error: OutOfMemoryError",
        "HCA backend for a whole model's decode step** (tiled minus online, us per step, cold; above 0 means the "
        "online backend is faster): flash B=64: +120.0 us",
        "## build_plan",
        "| plan/r4/T8192 | 8,192 | 256 | 2048 | mixed (one prompt chunk) | 41.0 |",
        "## Dispatcher overhead",
        "| dispatch/hca/online/B64/S4/every | compress_online_hca | 21.0 | 24.5 | 3.50 us |",
        "## cache.step host time",
        "| cache-step/hca/online/B256/S4 | 41.0 |",
        "< 50 us: met",
        "< 50 us: missed",
        "### HCA decode, S = 4 rows per request, boundary: every",
        "### HCA decode, S = 1 row per request, boundary: quarter",
        "## Prefill",
        "## Eager launches vs CUDA graph replay",
        "## Memory",
        "DeepSeek-V4-Flash",
        "## Cases without a figure",
        "RuntimeError: boom",
        "The tiled kernel's extra launch",
        "B=16: +1.50 us",
    ):
        assert needle in text, needle
    assert "None" not in text
    # the online 64K prefill verdict: read 256 MiB in 100 us -> 2684 GB/s = 67% of 4000 GB/s
    assert "meets the 60% target" in text


def test_render_perf_with_nothing_measured_and_a_first_schema_file():
    results = new_results(command="x", argv=[], preset="quick", settings={})
    text = perf_report.render_perf(results)
    assert "No comparable CUDA-graph measurements" in text and "None" not in text
    assert "## Whole-model decode step" not in text and "## build_plan" not in text
    # a file of the first schema: decode figures under us_per_layer, launches_per_step, no warm figures
    old = _result(Case("decode", "hca", "online", 16, 4, "every", instances=20, eager=True), 3.75, eager_us=20.0)
    for key in ("us", "unit", "warm", "warm_bytes", "launches_per_layer"):
        old.pop(key)
    old["launches_per_step"] = 2
    results = {**new_results(command="x", argv=[], preset="quick", settings={}), "cases": [old]}
    results["schema"] = "dsv4-compressor-bench/1"
    text = perf_report.render_perf(results)
    assert (
        "| 16 | online | 3.75 |" in text and "| decode/hca/online/B16/S4/every | 3.75 | 20.0 | 16.25 | 2 | 20 |" in text
    )


def test_json_roundtrip_and_write_perf_script(tmp_path, monkeypatch):
    results = _synthetic_results()
    path = tmp_path / "out" / "bench.json"
    write_json(path, results)
    assert load_json(path) == json.loads(json.dumps(results))
    plot = tmp_path / "out" / "bench.png"
    plot.write_bytes(b"\x89PNG fake")
    out = tmp_path / "docs" / "PERF.md"
    for argv, drawn in (
        ([str(path), "--out", str(out), "--plot", str(plot)], False),
        ([str(path), "--out", str(out)], True),
    ):
        monkeypatch.setattr(sys, "argv", ["write_perf.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(REPO / "scripts" / "write_perf.py"), run_name="__main__")
        assert exit_info.value.code == 0
        text = out.read_text()
        assert "NVIDIA H200" in text and "(`perf.json`)" in text and "](perf.png)" in text
        assert (out.parent / "perf.json").is_file()
        png = (out.parent / "perf.png").read_bytes()
        assert (
            (png != plot.read_bytes() and png.startswith(b"\x89PNG") and len(png) > 1000)
            if drawn
            else png == plot.read_bytes()
        )
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError):
        load_json(bad)


def test_compare_page_of_two_runs(tmp_path, monkeypatch):
    """write_perf.py --compare: every case both runs measured, cold and warm, other over base; a case only one
    run has is named; each run's switches are listed (and PERF.md lists them too)."""
    base = _synthetic_results()
    other = json.loads(json.dumps(base))
    other["env"]["settings"] = {"DSV4_PDL": "1"}
    target = next(r for r in other["cases"] if r.get("warm") and r["status"] == "ok")
    for key in ("graph", "warm"):
        target[key]["median_us"] *= 0.5 if key == "graph" else 2.0
    dropped = [r for r in other["cases"] if r["status"] == "ok" and r is not target][-1]
    other["cases"].remove(dropped)
    base_path, other_path, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ab.md"
    write_json(base_path, base)
    write_json(other_path, other)
    monkeypatch.setattr(sys, "argv", ["write_perf.py", str(base_path), "--compare", str(other_path), "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / "write_perf.py"), run_name="__main__")
    assert exit_info.value.code == 0
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith(f"| `{target['id']}` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "0.500" and cells[6] == "2.000"
    assert f"`{dropped['id']}` (base only)" in text
    assert "other: commit abc123" in text and "DSV4_PDL=1" in text and "base: commit abc123" in text
    assert "| 1.000 |" in text  # the cases left alone
    assert "Library switches: `DSV4_PDL=1`" in perf_report.render_perf(other)
    assert "Library switches: none set" in perf_report.render_perf(base)


def test_plot(tmp_path):
    import matplotlib  # noqa: F401  (the plot needs it; the test extra installs it)

    results = _synthetic_results()
    path = perf_report.plot_results(results, tmp_path / "p.png")
    assert path and Path(path).read_bytes().startswith(b"\x89PNG") and Path(path).stat().st_size > 1000
    series = perf_report.plot._series(results)
    assert set(series) == {("hca", 4), ("hca", 1)}
    online_every = sorted(series[("hca", 4)]["every"]["online"])
    assert [p[0] for p in online_every] == [16, 64] and online_every[0][4] == pytest.approx(9.1)  # warm
    assert perf_report.plot_results({"cases": []}, tmp_path / "none.png") is None


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------
def test_cli_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli.main(["--quick"]) == 2
    assert "CUDA" in capsys.readouterr().err
    from dsv4_compressor import cli as top_cli

    assert top_cli.main(["bench", "--quick"]) == 2


def test_cli_dry_run_and_usage_errors(capsys):
    from dsv4_compressor import cli as top_cli

    assert top_cli.main(["bench", "--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(preset_cases('quick'))} cases")
    assert "decode/hca/triton-tiled/B256/S4/every | graph cold + warm | 20 | 1 | 1 | 256 |" in out
    assert "decode/hca/triton-tiled/B1024/S1/quarter | graph cold + warm | 20 | 1 | 2 | 256 |" in out
    assert "132.14 MiB" in out and "DeepSeek-V4-Pro" in out
    assert "| decode/hca/online/B1024/S1/quarter | graph cold + warm | 20 |" in out
    assert "| plan/r128/T8192 | 8192 | 256 | 128 | mixed | 20 |" in out
    assert "dispatch/hca/online/B64/S4/every | host us per eager call: ops.compress_online_hca vs torch.ops" in out
    assert "cache-step/csa/triton-single/B256/S4 | host us per cache.step of 256 requests x 4 rows" in out
    pro = Case("model", "", "triton-tiled", 256, 4, "realistic", model="pro")
    assert "| model/pro/triton-tiled/B256/S4 | 31 hca + 30 csa + 30 indexer | 93 | " in out
    assert fmt_bytes(model_footprint(pro)["total"]) + " |" in out
    nothing_left = ["--quick", "--dry-run", "--kinds", "indexer", "--phases", "prefill", "--carry", "yes"]
    assert bench_cli.main(nothing_left) == 2
    assert bench_cli.main(["--kinds", "mla"]) == 2
    assert bench_cli.main(["--phases", "training"]) == 2
    capsys.readouterr()
    assert bench_cli.main(["--dry-run", "--kinds", "csa", "--batch", "16", "--rows-per-request", "4",
                           "--boundary", "none", "--phases", "decode", "--backends", "triton-single"]) == 0  # fmt: skip
    assert "n/a" in capsys.readouterr().out
    assert bench_cli.main(["--quick", "--dry-run", "--phases", "model,plan", "--models", "flash", "--batch", "16",
                           "--plan-rows", "64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("4 cases") and "model/flash/online/B16/S4" in out and "plan/r4/T64" in out
    assert bench_cli.main(["--dry-run", "--phases", "cache-step"]) == 0  # the full preset has the extras too
    assert capsys.readouterr().out.startswith("2 cases")


def test_cli_finds_the_checkout_s_benchmarks_from_anywhere(tmp_path):
    """``dsv4-compressor bench`` imports ``benchmarks/`` next to ``src/`` (not installed), whatever the working
    directory and ``sys.path``: a process started outside the checkout, with only ``src`` on its path, lists the
    same cases as the benchmark's own command line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO / "src")
    code = "import sys; from dsv4_compressor.cli import main; sys.exit(main(['bench', '--quick', '--dry-run']))"
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"{len(preset_cases('quick'))} cases")
    assert "decode/hca/triton-tiled/B256/S4/every | graph cold + warm | 20 | 1 | 1 | 256 |" in got.stdout


def test_cli_without_the_benchmarks_folder_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    """An installed package has no ``benchmarks/`` beside it: ``bench`` says where they ship and exits 2; another
    ``benchmarks`` package that shadows the checkout's is refused by name."""
    from dsv4_compressor import cli as top_cli

    monkeypatch.setattr(top_cli, "BENCHMARKS_DIR", str(tmp_path / "benchmarks"))
    assert top_cli.main(["bench", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "ship with a checkout of the repository" in err and "git clone" in err and str(tmp_path) in err
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "cli.py").write_text("def main(argv):\n    return 0\n")
    assert top_cli.main(["bench", "--dry-run"]) == 2  # the checkout's benchmarks is the one imported, not this
    assert "shadows" in capsys.readouterr().err


def test_cli_run_end_to_end_with_a_host_timer(tmp_path, monkeypatch, capsys):
    """The orchestration (floors, probe, cases, JSON after each case, the summary, then PERF.md from the JSON)
    with the GPU parts replaced by host stand-ins: the real run differs only in the timer, floors and device."""
    from benchmarks import env, runner, timing

    class FakeCudaTimer(HostTimer):
        def __init__(self, device):
            pass

    real_probe = runner.probe_online
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "CudaTimer", FakeCudaTimer)
    monkeypatch.setattr(timing, "measure_copy_bandwidth", lambda timer: {"copy_bw_GBps": 4000.0})
    monkeypatch.setattr(
        timing, "measure_launch_floor", lambda timer: {"launch_floor_us": 1.5, "eager_empty_launch_us": 5.0}
    )
    monkeypatch.setattr(env, "environment", lambda device: {"gpu": "fake GPU", "date": "today", "l2_bytes": 2**20})
    monkeypatch.setattr(runner, "probe_online", lambda device, **kw: real_probe("cpu", **kw))
    out = tmp_path / "out"
    argv = ["--quick", "--kinds", "indexer", "--backends", "reference", "--phases", "decode", "--replays", "2",
            "--warmup", "1", "--max-copies", "1", "--json", str(out / "b.json")]  # fmt: skip
    assert bench_cli.main(["--device", "cuda:0", *argv]) == 0
    captured = capsys.readouterr()
    assert "decode/indexer/reference/B16/S4/every" in captured.out and "DeepSeek-V4-Flash" in captured.out
    assert "2 replays per case" in captured.err and "scripts/write_perf.py" in captured.err
    results = load_json(out / "b.json")
    assert results["complete"] and results["env"]["gpu"] == "fake GPU"
    assert results["schema"] == "dsv4-compressor-bench/2" and results["settings"]["warm_replays"] == 40
    assert [c["status"] for c in results["cases"]] == ["ok"]
    case = results["cases"][0]
    assert case["eager"]["n"] == 2 and case["copies"] == 1 and case["x_floor"] is not None
    assert "bench --device cuda:0 --quick" in results["command"]
    online_rows = [m for m in results["memory"] if m["backend"] == "online"]
    assert results["online"]["available"] and online_rows[0]["state_per_request_per_layer"]["hca"] == 4 * BANK
    perf = perf_report.write_perf_file(results, tmp_path / "docs" / "PERF.md", json_path=out / "b.json")
    text = perf.read_text()
    assert "fake GPU" in text and "decode/indexer/reference" not in text.split("## Decode\n")[0]


# -------------------------------------------------------------------------------------------------
# From hidden states: the projection preset, its runners, its report
# -------------------------------------------------------------------------------------------------
def test_projection_preset_pairs_both_paths():
    cases = preset_cases("projection")
    ids = {c.id for c in cases}
    assert len(ids) == len(cases) == 48 + 24 + 4 + 12 + 4  # joint: the CSA layers and the steps
    for model in ("flash", "pro"):
        for kind in ("csa", "indexer", "hca", "pair"):
            for t in (64, 256, 1024):
                assert {f"projection/{model}/{kind}/{p}/T{t}" for p in ("torch", "triton")} <= ids
                assert f"projection/{model}/{kind}/auto/T{t}" not in ids
        for b in (16, 64):
            paths = ("torch", "triton", "auto")
            assert {f"layer/{model}/{k}/{p}/B{b}/S4" for k in ("csa", "hca") for p in paths} <= ids
            assert {f"model-hidden/{model}/{p}/B{b}/S4" for p in (*paths, "joint")} <= ids
            assert f"layer/{model}/csa/joint/B{b}/S4" in ids and f"layer/{model}/hca/joint/B{b}/S4" not in ids
    assert all(c.instances == 20 for c in cases if c.phase in ("projection", "layer"))
    assert ids <= {c.id for c in preset_cases("full")}
    assert ids <= {c.id for c in preset_cases("quick")}
    flash = filter_cases(cases, models=["flash"], chunks=[64])
    assert flash and all(c.model == "flash" for c in flash)
    assert all(c.chunk == 64 for c in flash if c.phase == "projection")
    assert bench_cases.projection_bytes(2048, 4096, 64) == {
        "read": 2048 * 4096 * 2 + 64 * 4096 * 2, "written": 64 * 2048 * 4,
        "total": 2048 * 4096 * 2 + 64 * 4096 * 2 + 64 * 2048 * 4,
    }  # fmt: skip
    hidden = Case("model-hidden", "", "triton", 16, 4, "realistic", model="flash")
    plain = Case("model", "", "online", 16, 4, "realistic", model="flash")
    # a CSA layer's two projections: one launch, and its two compressions: one (ops.compress_pair)
    assert model_launches(hidden) == model_launches(plain) + 62 - 21 - 21
    assert model_launches(replace(hidden, backend="torch")) == model_launches(plain) + 62
    assert model_launches(replace(hidden, backend="auto")) == model_launches(hidden)  # T = 64: paired
    assert model_launches(replace(hidden, backend="auto", batch=64)) == model_launches(plain) + 62  # T = 256: apart
    assert model_launches(replace(hidden, backend="joint", batch=64)) == model_launches(hidden)  # one GEMM a pair
    assert case_traffic(hidden) == case_traffic(plain)  # the compression's bytes; the runner adds the projections'


def test_runner_projection_layer_and_step_from_hidden_on_cpu(monkeypatch):
    """Every new phase through the runner at a small hidden size (the real widths): the figures, the bytes the
    floor counts, the launches; the whole step of a two-layer model owns one weight per compressor."""
    monkeypatch.setitem(bench_cases.HIDDEN, "flash", 256)
    monkeypatch.setitem(bench_floors.MODELS, "tiny", {"csa": 1, "hca": 1})
    monkeypatch.setitem(bench_cases.MODEL_NAMES, "tiny", "tiny")
    monkeypatch.setitem(bench_cases.HIDDEN, "tiny", 256)
    runner = _runner()
    for backend in ("triton", "torch"):
        res = runner.run(Case("projection", "indexer", backend, chunk=16, instances=2, model="flash"))
        assert res["status"] == "ok", res.get("traceback")
        assert res["traffic"] == bench_cases.projection_bytes(512, 256, 16) and res["unit"] == "us per projection"
        assert res["graph"]["per"] == 2 and res["warm"]["n"] == 2 and res["us"] == res["graph"]["median_us"]
        assert (res["config"] is None) == (backend == "torch")
    for backend in ("triton", "torch"):  # the pair: one launch over both weights / cuBLAS on their concatenation
        res = runner.run(Case("projection", "pair", backend, chunk=16, instances=2, model="flash"))
        assert res["status"] == "ok", res.get("traceback")
        assert res["traffic"] == bench_cases.projection_bytes(2048 + 512, 256, 16) and res["width"] == 2560
        assert (res["config"] is None) == (backend == "torch")
    # D = 256: no measured pair on auto; joint: one GEMM of the joint weight
    for backend, paired in (("triton", True), ("torch", False), ("auto", False), ("joint", True)):
        case = Case("layer", "csa", backend, 2, 4, "realistic", instances=1, model="flash")
        res = runner.run(case)
        assert res["status"] == "ok", res.get("traceback")
        assert res["compressors"] == ["csa", "indexer"] and res["paired_projection"] == paired
        assert res["launches_per_layer"] == (2 if paired else 4)  # one projection + compress_pair, or two of each
        proj_read = sum(bench_cases.projection_bytes(w, 256, 8)["read"] for w in (2048, 512))
        assert res["traffic"]["read"] == case_traffic(case).read + proj_read
    res = runner.run(Case("layer", "hca", "torch", 2, 4, "realistic", instances=1, model="flash"))
    assert res["status"] == "ok", res.get("traceback")
    assert res["launches_per_layer"] == 2
    res = runner.run(Case("layer", "hca", "auto", 2, 4, "realistic", instances=1, model="flash"))
    assert res["status"] == "ok", res.get("traceback")
    case = Case("model-hidden", "", "triton", 1, 4, "realistic", model="tiny")
    res = runner.run(case)
    assert res["status"] == "ok", res.get("traceback")
    # CSA's two projections: one launch; its two compressions: one
    assert res["launches_per_step"] == model_launches(case) == 2 + 2 + 2
    assert res["memory"]["weights"] == 256 * 2 * (2048 + 512 + 1024)
    joint = runner.run(replace(case, backend="joint"))
    assert joint["status"] == "ok", joint.get("traceback")
    assert joint["launches_per_step"] == res["launches_per_step"]  # the cuBLAS GEMM counts as the pair's launch
    assert joint["memory"]["weights"] == res["memory"]["weights"]  # one storage of both halves


def _hidden_result(case: Case, cold: float, warm: float) -> dict:
    return {"id": case.id, "case": case.as_dict(), "status": "ok", "note": "", "error": None, "graph": _stats(cold),
            "warm": _stats(warm), "us": cold, "x_floor": cold / 2}  # fmt: skip


def test_projection_report_says_which_path_is_fastest():
    results = _synthetic_results()
    cases = [
        _hidden_result(Case("projection", "csa", "torch", chunk=64, model="flash"), 9.8, 9.0),
        _hidden_result(Case("projection", "csa", "triton", chunk=64, model="flash"), 6.0, 9.5),
        _hidden_result(Case("layer", "csa", "torch", 16, 4, "realistic", model="flash"), 23.4, 20.0),
        _hidden_result(Case("layer", "csa", "triton", 16, 4, "realistic", model="flash"), 7.5, 7.0),
        _hidden_result(Case("layer", "csa", "auto", 16, 4, "realistic", model="flash"), 9.0, 8.5),
        _hidden_result(Case("layer", "csa", "joint", 16, 4, "realistic", model="flash"), 6.9, 6.5),
        _hidden_result(Case("layer", "hca", "triton", 64, 4, "realistic", model="flash"), 6.0, 5.0),
        _hidden_result(Case("model-hidden", "", "triton", 16, 4, "realistic", model="flash"), 310.0, 280.0),
    ]
    failed = Case("layer", "hca", "torch", 64, 4, "realistic", model="flash")
    cases.append({"id": failed.id, "case": failed.as_dict(), "status": "error", "note": "", "error": "boom"})
    results["cases"] += cases
    rows = {(r["phase"], r["kind"], r["size"]): r for r in perf_report.projection_rows(results)}
    proj = rows[("projection", "csa", 64)]
    assert proj["fastest_cold"] == "triton" and proj["fastest_warm"] == "torch"
    assert proj["speedup_cold"] == pytest.approx(9.8 / 6.0) and proj["target_us"] is None
    assert rows[("layer", "csa", 16)]["target_us"] == 8.0 and rows[("layer", "csa", 16)]["target_path"] == "joint"
    assert rows[("layer", "hca", 64)]["target_path"] == "triton"  # no auto figure: ours
    assert rows[("layer", "hca", 64)]["fastest_cold"] == "triton" and rows[("layer", "hca", 64)]["failed"]
    text = perf_report.render_perf(results)
    assert "## From hidden states" in text
    row = "| flash | csa | 16 | 20.0 | 23.4 | 7.00 | 7.50 | 8.50 | 9.00 | 6.50 | 6.90 | joint | joint | 3.12x |"
    assert row in text
    assert "8.00 (met, joint)" in text  # the adapters' default: joint's 6.90 cold (auto's 9.00 would miss it)
    assert "5.00 (missed, triton)" in text and f"{fmt_us(300.0)} (missed, triton)" in text
    assert f"`{failed.id}" in text
