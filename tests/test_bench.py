"""The benchmark on CPU: byte and memory counts, the case matrix, the layers driven through the ops, every phase's
runner under the Triton interpreter (host timer, small shapes) and the command line; the report is
``test_bench_report.py``'s."""

from __future__ import annotations

import os
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
from benchmarks.results import fmt_bytes, load_json
from benchmarks.runner import Runner
from benchmarks.timing import HostTimer, host_time
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
    assert len(ids) == len(cases) == 48 + 24 + 4 + 12 + 4 + 10  # joint: the CSA layers and the steps; beside
    beside = {c.id for c in cases if c.beside}
    assert beside == {f"layer/flash/{k}/{p}/B{b}/S4/beside-gemm" for k in ("csa", "hca") for b in (16, 64)
                      for p in ("torch", "auto", "joint") if p != "joint" or k == "csa"}  # fmt: skip
    assert all(c.id.replace("/beside-gemm", "") in ids for c in cases if c.beside)  # each beside its plain case
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
    beside = runner.run(Case("layer", "csa", "auto", 2, 4, "realistic", instances=2, model="flash", beside="gemm"))
    assert beside["status"] == "ok", beside.get("traceback")
    assert beside["beside"]["width"] == bench_cases.BESIDE_GEMM_WIDTH["flash"] and beside["beside"]["graph"]["per"] == 2
    assert beside["compressors"] == ["csa", "indexer"] and beside["traffic"] == runner.run(
        Case("layer", "csa", "auto", 2, 4, "realistic", instances=2, model="flash"))["traffic"]  # fmt: skip
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
