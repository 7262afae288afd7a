"""The benchmark's report on CPU: ``benchmarks/report`` (the PERF.md page, its rows, targets and plot) and
``scripts/write_perf.py`` rendering results JSON as the GPU machine writes it."""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_bench import FLOORS

from benchmarks import cli as bench_cli
from benchmarks import report as perf_report
from benchmarks.cases import (
    Case,
    case_traffic,
    model_footprint,
    model_launches,
    op_launches,
)
from benchmarks.floors import (
    derive_metrics,
    kind_config,
    memory_table,
)
from benchmarks.results import fmt_bytes, fmt_us, load_json, new_results, summary_table, write_json
from benchmarks.timing import summarize

REPO = Path(__file__).resolve().parents[1]
HCA, CSA, IDX = kind_config("hca"), kind_config("csa"), kind_config("indexer")
ROW_HCA = 2 * 512 * 4  # one HCA kv_score row: 4 KiB
BANK = 3 * 512 * 4  # one online state bank: 6 KiB


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


def test_beside_report_pairs_each_layer_with_its_plain_case():
    """A layer beside the engine's GEMM: its row holds the plain layer case's figure, the GEMMs alone and both
    together, and the overlap computed from them; the beside cases stay out of the projection tables."""
    results = _synthetic_results()
    plain = Case("layer", "csa", "auto", 16, 4, "realistic", model="flash")
    beside = replace(plain, beside="gemm")
    res = _hidden_result(beside, 20.0, 18.0)
    res["beside"] = {"width": 1536, "graph": _stats(8.0), "warm": _stats(7.0)}
    failed = replace(beside, kind="hca")
    results["cases"] += [
        _hidden_result(plain, 16.0, 15.0),
        res,
        {"id": failed.id, "case": failed.as_dict(), "status": "error", "note": "", "error": "x"},
    ]
    assert beside.id == "layer/flash/csa/auto/B16/S4/beside-gemm" and plain.id != beside.id
    rows = perf_report.beside_rows(results)
    assert [r["kind"] for r in rows] == ["csa", "hca"] and "failed" in rows[1]
    cold = rows[0]["cold"]
    assert (cold["layer"], cold["gemm"], cold["both"]) == pytest.approx((16.0, 8.0, 20.0))
    assert cold["overlap"] == pytest.approx((16 + 8 - 20) / 8)  # half of the GEMM hidden
    assert rows[0]["warm"]["overlap"] == pytest.approx((15 + 7 - 18) / 7)
    proj = perf_report.projection_rows(results)
    assert all(r["paths"]["auto"]["cold"] == pytest.approx(16.0) for r in proj if r["phase"] == "layer")
    text = perf_report.render_perf(results)
    assert "## The layer beside the engine's attention GEMM" in text
    assert "| flash | csa | 16 | auto | 16.0 | 8.00 | 20.0 | 0.50 |" in text
