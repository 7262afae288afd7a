"""The benchmark's pure-Python parts on CPU: byte counting, the case matrix, rendering, the CLI's refusal
without CUDA, and the case plumbing under the Triton interpreter (host timer, tiny shapes)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from _helpers import backend_missing

from dsv4_compressor.bench import cli as bench_cli
from dsv4_compressor.bench.cases import (
    Case,
    case_traffic,
    choose_copies,
    decode_starts,
    filter_cases,
    full_cases,
    preset_cases,
)
from dsv4_compressor.bench.floors import (
    MEMORY_REQUESTS,
    derive_metrics,
    kind_config,
    memory_table,
    request_traffic,
    step_traffic,
)
from dsv4_compressor.bench.report import (
    c128_rows,
    load_json,
    markdown_table,
    new_results,
    online_target_rows,
    pick_table,
    render_perf,
    write_json,
)
from dsv4_compressor.bench.runner import Runner
from dsv4_compressor.bench.timing import HostTimer, summarize

REPO = Path(__file__).resolve().parents[1]
HCA, CSA, IDX = kind_config("hca"), kind_config("csa"), kind_config("indexer")
ROW_HCA = 2 * 512 * 4  # one HCA kv_score row: 4 KiB


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
    bank = 3 * 512 * 4
    assert every.state_read == bank
    assert every.state_written == 4 * bank
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
    assert online.state_read == 3 * 512 * 4 and online.state_written == 4 * 3 * 512 * 4


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
# Cases
# -------------------------------------------------------------------------------------------------
def test_decode_starts():
    r = 128
    every = Case("decode", "hca", "triton-tiled", batch=8, rows=4, boundary="every")
    none = Case("decode", "hca", "triton-tiled", batch=8, rows=4, boundary="none")
    real = Case("decode", "hca", "triton-tiled", batch=256, rows=4, boundary="realistic")
    for copy in range(4):
        assert all((s + 3) % r == r - 1 for s in decode_starts(every, copy))
        assert all(not any((p % r) == r - 1 for p in range(s, s + 4)) for s in decode_starts(none, copy))
    starts = decode_starts(real, 0)
    assert starts == decode_starts(Case("decode", "hca", "online", batch=256, rows=4, boundary="realistic"), 0)
    assert starts != decode_starts(real, 1)
    closing = sum(any(p % r == r - 1 for p in range(s, s + 4)) for s in starts)
    assert 0 < closing < 40  # about S/r = 3% of 256
    assert decode_starts(Case("decode", "csa", "triton-single", batch=2, rows=4, boundary="none")) is None
    assert decode_starts(Case("decode", "csa", "triton-single", batch=2, rows=1, boundary="none")) == [5, 5]


def test_quick_preset_holds_the_required_measurements():
    quick = preset_cases("quick")
    ids = {c.id for c in quick}
    assert len(ids) == len(quick)
    for boundary in ("none", "every"):
        for b in (16, 64, 256):
            for backend in ("triton-single", "triton-tiled", "online"):
                case = next(c for c in quick if c.id == f"decode/hca/{backend}/B{b}/S4/{boundary}")
                assert case.instances == 20 and case.timing == "graph" and case.mtp_step == 3
    for carry in ("no-carry", "carry"):
        assert f"prefill/hca/online/65536/{carry}" in ids
        assert f"prefill/hca/triton-tiled/8192/{carry}" in ids
    assert {"decode/hca/triton-tiled/B64/S4/realistic", "decode/hca/online/B64/S4/realistic"} <= ids
    for kind in ("csa", "indexer"):
        assert {f"decode/{kind}/triton-single/B16/S4/every", f"decode/{kind}/triton-single/B256/S4/every"} <= ids
    refs = [c for c in quick if c.backend == "reference"]
    assert refs and all(c.batch == 16 and c.timing == "eager" and c.instances == 1 for c in refs)
    assert any(c.eager and c.timing == "graph" for c in quick)  # eager launches timed next to graphs
    assert not any(c.not_applicable() for c in quick)
    # the named presets are parts of quick
    assert {c.id for c in preset_cases("c128")} <= ids
    assert {c.id for c in preset_cases("online")} <= ids
    assert quick[0].group == "c128"  # the measurements other issues need run first


def test_full_matrix_rules():
    full = full_cases()
    assert not [c for c in full if c.kind != "hca" and c.backend in ("triton-tiled", "online")]
    assert all(c.batch <= 16 for c in full if c.backend == "reference" and c.phase == "decode")
    assert all(c.chunk <= 8192 for c in full if c.backend == "reference" and c.phase == "prefill")
    na = [c for c in full if c.not_applicable()]
    assert na and all(c.kind in ("csa", "indexer") and c.rows == 4 and c.boundary == "none" for c in na)
    assert len({c.id for c in full}) == len(full)


def test_filter_cases():
    quick = preset_cases("quick")
    tiled = filter_cases(quick, backends=["triton-tiled"], decode=True, prefill=False)
    assert tiled and all(c.backend == "triton-tiled" and c.phase == "decode" for c in tiled)
    few = filter_cases(quick, kinds=["hca"], batches=[16], boundaries=["none"], prefill=False, instances=5)
    assert {c.backend for c in few} == {"triton-single", "triton-tiled", "online", "reference"}
    assert all(c.instances == (1 if c.backend == "reference" else 5) for c in few)
    assert all(c.phase == "prefill" for c in filter_cases(quick, decode=False))


# -------------------------------------------------------------------------------------------------
# Rendering
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


def _result(case: Case, us: float | None, *, eager_us: float | None = None, status="ok", error=None) -> dict:
    res = {"id": case.id, "case": case.as_dict(), "status": status, "note": "", "error": error}
    if status != "ok":
        return res
    traffic = case_traffic(case).as_dict()
    graph = summarize([us * case.instances * f for f in (0.98, 1.0, 1.03)], per=case.instances) if us else None
    eager = summarize([eager_us * case.instances] * 3, per=case.instances) if eager_us else None
    res.update(
        instances=case.instances,
        copies=2,
        traffic=traffic,
        graph=graph if case.timing == "graph" else None,
        eager=eager if case.timing == "eager" or eager_us else None,
        launches_per_step=2 if case.backend == "triton-tiled" else 1,
        us_per_layer=graph["median_us"] if case.timing == "graph" else eager["median_us"],
        timing=case.timing,
    )
    res.update(derive_metrics(traffic, res["us_per_layer"], FLOORS))
    return res


def _synthetic_results() -> dict:
    results = new_results(
        command="python -m dsv4_compressor bench --quick", argv=["--quick"], preset="quick",
        settings={"replays": 200, "warmup": 20, "instances": 20},
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
                base + 3 * extra,
                eager_us=base + 20,
            )
            tiled = _result(Case("decode", "hca", "triton-tiled", b, 4, boundary, instances=20), base + 1.5 + extra)
            online = _result(Case("decode", "hca", "online", b, 4, boundary, instances=20), base + 0.2 + 0.5 * extra)
            cases += [single, tiled, online]
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
    results["cases"] = cases
    results["elapsed_s"] = 123.0
    results["complete"] = True
    return results


def test_markdown_table_lists_every_case():
    results = _synthetic_results()
    table = markdown_table(results)
    for res in results["cases"]:
        assert res["id"] in table
    assert "error: RuntimeError: boom" in table
    assert "n/a" in table


def test_answers_come_from_the_numbers():
    results = _synthetic_results()
    rows = {(r["boundary"], r["batch"]): r for r in c128_rows(results)}
    none16 = rows[("none", 16)]
    assert none16["tiled_minus_single"] == pytest.approx(1.5)
    assert none16["single_over_tiled"] == pytest.approx(10.0 / 11.5)
    every64 = rows[("every", 64)]
    assert every64["single_over_tiled"] == pytest.approx((14 + 3 * 64) / (14 + 1.5 + 64))
    picks = {p["key"]: p for p in pick_table(results)}
    assert picks[("decode", "hca", 4, "every", 64)]["pick"] == "online"
    assert picks[("decode", "hca", 4, "none", 16)]["pick"] == "triton-single"
    assert picks[("decode", "hca", 4, "none", 16)]["next"] == "online"
    assert all(p["pick"] != "reference" for p in picks.values())


def test_online_targets_come_from_the_numbers():
    rows = {r["check"]: r for r in online_target_rows(_synthetic_results())}
    # synthetic online: base + 0.2 (+ 0.5 B when every request closes); tiled: base + 1.5 (+ B)
    ratio = rows["every request closes a group ÷ none does"]
    assert ratio["values"][16] == pytest.approx((10.2 + 8) / 10.2) and ratio["limits"][16] == 1.1
    assert rows["online ÷ tiled, no request closes a group"]["values"][64] == pytest.approx(14.2 / 15.5)
    assert rows["online ÷ tiled, every request closes a group"]["values"][64] == pytest.approx(46.2 / 79.5)
    worst = rows["slowest boundary case, us per layer"]
    assert worst["values"] == {16: pytest.approx(18.2), 64: pytest.approx(46.2)}
    assert worst["limits"] == {16: 2.0, 64: 3.5}
    assert online_target_rows({"cases": []}) == []


def test_render_perf():
    results = _synthetic_results()
    text = render_perf(results, plot_link="perf.png", json_link="perf.json")
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
        "### HCA decode, S = 4 rows per request, boundary: every",
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


def test_render_perf_with_nothing_measured():
    results = new_results(command="x", argv=[], preset="quick", settings={})
    text = render_perf(results)
    assert "No comparable CUDA-graph measurements" in text and "None" not in text


def test_json_roundtrip_and_write_perf_script(tmp_path, monkeypatch):
    results = _synthetic_results()
    path = tmp_path / "out" / "bench.json"
    plot = tmp_path / "out" / "bench.png"
    plot.parent.mkdir(parents=True)
    plot.write_bytes(b"\x89PNG fake")
    results["outputs"] = {"plot": str(plot)}
    write_json(path, results)
    assert load_json(path) == json.loads(json.dumps(results))
    out = tmp_path / "docs" / "PERF.md"
    monkeypatch.setattr(sys, "argv", ["write_perf.py", str(path), "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / "write_perf.py"), run_name="__main__")
    assert exit_info.value.code == 0
    text = out.read_text()
    assert "NVIDIA H200" in text and "(`perf.json`)" in text and "](perf.png)" in text
    assert (out.parent / "perf.json").is_file()
    assert (out.parent / "perf.png").read_bytes() == plot.read_bytes()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError):
        load_json(bad)


def test_plot_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    from dsv4_compressor.bench.plot import plot_results

    path = plot_results(_synthetic_results(), tmp_path / "p.png")
    assert path and Path(path).stat().st_size > 1000


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
    assert bench_cli.main(["--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "decode/hca/triton-tiled/B256/S4/every" in out and "132.14 MiB" in out
    assert "DeepSeek-V4-Pro" in out
    assert bench_cli.main(["--quick", "--dry-run", "--kinds", "csa", "--no-decode"]) == 2  # nothing left
    assert bench_cli.main(["--kinds", "mla"]) == 2
    capsys.readouterr()
    assert bench_cli.main(["--dry-run", "--kinds", "csa", "--batch", "16", "--rows-per-request", "4",
                           "--boundary", "none", "--no-prefill", "--backends", "triton-single"]) == 0  # fmt: skip
    assert "n/a" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------
# Plumbing on CPU (Triton interpreter, host timer): the runner builds, fills and times real caches
# -------------------------------------------------------------------------------------------------
def _runner(**kwargs) -> Runner:
    return Runner(HostTimer(), replays=2, warmup=1, floors=FLOORS, max_copies=2, log=lambda _: None, **kwargs)


def test_runner_decode_and_prefill_on_cpu():
    runner = _runner()
    res = runner.run(Case("decode", "indexer", "reference", batch=2, rows=4, boundary="every", timing="eager"))
    assert res["status"] == "ok", res.get("traceback")
    assert res["eager"]["n"] == 2 and res["graph"] is None and res["x_floor"] is not None
    res = runner.run(Case("decode", "hca", "triton-single", batch=1, rows=4, boundary="none", instances=2))
    assert res["status"] == "ok", res.get("traceback")
    assert res["instances"] == 2 and res["copies"] == 2 and res["launches_per_step"] == 1
    assert res["graph"]["per"] == 2
    res = runner.run(Case("prefill", "hca", "reference", chunk=128, carry=True, timing="eager"))
    assert res["status"] == "ok", res.get("traceback")
    assert res["traffic"]["state_read"] == 64 * ROW_HCA


@pytest.mark.skipif(backend_missing("online") is not None, reason="no online backend in this build")
def test_runner_online_on_cpu():
    res = _runner().run(Case("decode", "hca", "online", batch=1, rows=4, boundary="every", instances=1))
    assert res["status"] == "ok", res.get("traceback")
    assert res["note"] == ""  # the banks were filled in the documented layout
    assert res["state_bytes_per_request"] == 4 * 3 * 512 * 4
    assert res["traffic"]["state_read"] == 3 * 512 * 4


def test_runner_records_failures_and_skips():
    runner = _runner(online_problem="online backend not present")
    res = runner.run(Case("decode", "hca", "online", batch=1, rows=4, boundary="none"))
    assert res["status"] == "skipped" and "not present" in res["note"]
    res = runner.run(Case("decode", "csa", "triton-single", batch=1, rows=4, boundary="none"))
    assert res["status"] == "n/a"
    res = runner.run(Case("decode", "hca", "no-such-backend", batch=1, rows=4, boundary="none"))
    assert res["status"] == "error" and "KeyError" in res["error"]


def test_cli_run_end_to_end_with_a_host_timer(tmp_path, monkeypatch, capsys):
    """The orchestration (floors, probe, cases, JSON after each case, tables, PERF.md) with the GPU parts
    replaced by host stand-ins: the real run differs only in the timer, the floors and the device."""
    from dsv4_compressor.bench import env, runner, timing

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
    argv = ["--quick", "--kinds", "indexer", "--backends", "reference", "--replays", "2", "--warmup", "1",
            "--max-copies", "1", "--json", str(out / "b.json"), "--plot", str(out / "b.png"),
            "--markdown", str(out / "b.md"), "--perf", str(tmp_path / "docs" / "PERF.md")]  # fmt: skip
    assert bench_cli.main(["--device", "cuda:0", *argv]) == 0
    captured = capsys.readouterr()
    assert "decode/indexer/reference/B16/S4/every" in captured.out and "DeepSeek-V4-Flash" in captured.out
    assert "2 replays per case" in captured.err
    results = load_json(out / "b.json")
    assert results["complete"] and results["env"]["gpu"] == "fake GPU"
    assert [c["status"] for c in results["cases"]] == ["ok"]
    case = results["cases"][0]
    assert case["eager"]["n"] == 2 and case["copies"] == 1 and case["x_floor"] is not None
    assert "bench --device cuda:0 --quick" in results["command"]
    online_rows = [m for m in results["memory"] if m["backend"] == "online"]
    if results["online"]["available"]:
        assert online_rows[0]["state_per_request_per_layer"]["hca"] == 4 * 3 * 512 * 4
    perf = (tmp_path / "docs" / "PERF.md").read_text()
    assert "fake GPU" in perf and "decode/indexer/reference" not in perf.split("## Decode")[0]
    assert (out / "b.md").read_text().startswith("| case |")
