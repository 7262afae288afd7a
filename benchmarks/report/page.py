"""The text of docs/PERF.md (:func:`render_perf`): the method, what to pick, and one section per comparison, each
made from the rows of :mod:`.rows`."""

from __future__ import annotations

import statistics

from ..results import fmt_bytes, fmt_gbps, fmt_num, fmt_us, status_text, table
from .rows import (
    _backend_order,
    _boundary_order,
    _find,
    _kind_order,
    _median,
    _ok,
    _spread,
    _timing_label,
    _us,
    beside_rows,
    c128_rows,
    cache_step_rows,
    dispatch_rows,
    model_rows,
    online_target_rows,
    pick_table,
    plan_rows,
    projection_rows,
    s1_rows,
    warm_rows,
)
from .targets import CACHE_STEP_TARGET_US, ONLINE_READ_TARGET_PCT, ONLINE_STATE_FACTOR_TARGET

__all__ = ["render_perf"]


# -------------------------------------------------------------------------------------------------
# What to pick: short statements, each citing the numbers it is made of
# -------------------------------------------------------------------------------------------------
def _answers(results: dict) -> list[str]:
    lines = []
    rows = [r for r in c128_rows(results) if r["single_over_tiled"]]
    if rows:
        parts = []
        for s, boundary in sorted(
            {(r["rows"], r["boundary"]) for r in rows}, key=lambda k: (k[0], _boundary_order(k[1]))
        ):
            pts = [r for r in rows if (r["rows"], r["boundary"]) == (s, boundary)]
            each = ", ".join(f"B={r['batch']}: {r['single_over_tiled']:.2f}x" for r in pts)
            parts.append(f"S={s}, {boundary}: {each}")
        lines.append(
            "- **Tiled vs single-stage (HCA decode, cold CUDA graph; single-stage time / tiled time, above 1 means the "
            f"tiled kernel is faster):** {'; '.join(parts)}."
        )
        none = [r for r in rows if r["boundary"] == "none" and r["tiled_minus_single"] is not None]
        if none:
            parts = ", ".join(f"S={r['rows']} B={r['batch']}: {r['tiled_minus_single']:+.2f} us" for r in none)
            floor = results.get("floors", {}).get("launch_floor_us")
            floor_txt = f"; an empty kernel in a graph costs {floor:.2f} us" if floor else ""
            eager = []
            for r in none:
                want = {"phase": "decode", "kind": "hca", "rows": r["rows"], "boundary": "none", "batch": r["batch"]}
                single = _find(results, backend="triton-single", **want)
                tiled = _find(results, backend="triton-tiled", **want)
                if single and tiled and single.get("eager") and tiled.get("eager"):
                    diff = tiled["eager"]["median_us"] - single["eager"]["median_us"]
                    eager.append(f"S={r['rows']} B={r['batch']}: {diff:+.2f} us")
            eager_txt = f"; launched eagerly: {', '.join(eager)}" if eager else ""
            lines.append(
                "- **The tiled kernel's extra launch** (steps where no request closes a group, so both variants only "
                f"save rows; tiled minus single-stage per layer, CUDA graph): {parts}{floor_txt}{eager_txt}."
            )
    for res in _ok(results, "prefill"):
        c = res["case"]
        if c["backend"] == "online" and c["kind"] == "hca" and c["chunk"] == 65536:
            pct = res.get("read_pct_of_copy")
            if pct is None:
                continue
            verdict = "meets" if pct >= ONLINE_READ_TARGET_PCT else "misses"
            lines.append(
                f"- **Online HCA prefill, 64K chunk, {'with' if c['carry'] else 'without'} a carried partial group:** "
                f"reads at {fmt_gbps(res.get('read_gbps'))} GB/s = {pct:.0f}% of the measured copy bandwidth; "
                f"{verdict} the {ONLINE_READ_TARGET_PCT:.0f}% target."
            )
    models = model_rows(results)
    pairs = []
    for m in models:
        if m["backend"] != "online":
            continue
        tiled = next(
            (x for x in models if (x["model"], x["batch"], x["backend"]) == (m["model"], m["batch"], "triton-tiled")),
            None,
        )
        if tiled and tiled["cold"] is not None and m["cold"] is not None:
            pairs.append(f"{m['model']} B={m['batch']}: {tiled['cold'] - m['cold']:+,.1f} us")
    if pairs:
        lines.append(
            "- **HCA backend for a whole model's decode step** (tiled minus online, us per step, cold; above 0 means "
            f"the online backend is faster): {', '.join(pairs)}."
        )
    layer_figures = _ok(results, "decode") + _ok(results, "prefill")
    floors = [(r["case"]["backend"], r["x_floor"]) for r in layer_figures if r.get("x_floor") and r.get("graph")]
    if floors:
        by_backend: dict[str, list[float]] = {}
        for b, x in floors:
            by_backend.setdefault(b, []).append(x)
        parts = "; ".join(
            f"{b}: {min(xs):.1f}x–{max(xs):.1f}x (median {statistics.median(xs):.1f}x)"
            for b, xs in sorted(by_backend.items(), key=lambda kv: _backend_order(kv[0]))
        )
        lines.append(
            "- **Against the floor** (time / max(bytes floor, launch floor), cold graph figures per layer; each "
            f"backend against the bytes its own state design must move): {parts}."
        )
    picks = pick_table(results)
    if picks:
        wins: dict[str, int] = {}
        for p in picks:
            wins[p["pick"]] = wins.get(p["pick"], 0) + 1
        parts = ", ".join(f"{b} {n}" for b, n in sorted(wins.items(), key=lambda kv: -kv[1]))
        lines.append(f"- **Fastest per case** (of {len(picks)} cases with a CUDA-graph figure): {parts}; see below.")
    return lines


# -------------------------------------------------------------------------------------------------
# PERF.md sections
# -------------------------------------------------------------------------------------------------
def _pick_section(results: dict) -> list[str]:
    picks = pick_table(results)
    out = ["## What to pick\n"]
    answers = _answers(results)
    out += answers if answers else ["- No comparable CUDA-graph measurements in this run."]
    out.append("")
    if picks:
        body = []
        for p in picks:
            phase, kind, a, b, batch = p["key"]
            what = (
                f"decode S={a}, {b}, B={batch}"
                if phase == "decode"
                else f"prefill {a:,} tokens, {'carry' if b else 'no carry'}"
            )
            body.append(
                [
                    kind,
                    what,
                    f"**{p['pick']}**",
                    fmt_us(p["us"]),
                    fmt_num(p.get("x_floor"), 1, "x"),
                    f"{p['next']} ({p['next_slower']:.2f}x)" if p["next"] else "only one measured",
                ]
            )
        out += [
            "Fastest backend per case (cold CUDA-graph median per layer; the reference backend is eager-only and "
            "not ranked):\n",
            table(["kind", "case", "pick", "us/layer", "x floor", "runner-up (x slower)"], body, align="lllrrl"),
            "",
        ]
    return out


def _c128_table(results: dict) -> list[str]:
    rows = c128_rows(results)
    if not rows:
        return []
    header = ["S", "boundary", "B", "triton-single", "triton-tiled", "online", "single ÷ tiled", "tiled − single",
              "online ÷ tiled"]  # fmt: skip
    body = [
        [
            str(r["rows"]),
            r["boundary"],
            str(r["batch"]),
            fmt_us(r["single"]),
            fmt_us(r["tiled"]),
            fmt_us(r["online"]),
            fmt_num(r["single_over_tiled"], 2, "x"),
            fmt_num(r["tiled_minus_single"], 2, " us") if r["tiled_minus_single"] is not None else "-",
            fmt_num(r["online_over_tiled"], 2, "x"),
        ]
        for r in rows
    ]
    return [
        "## HCA decode summary: single-stage vs tiled vs online\n",
        "Cold graph medians, microseconds per layer (replay time / layer instances).\n",
        table(header, body, align="rlrrrrrrr"),
        "",
    ]


def _online_targets_table(results: dict) -> list[str]:
    rows = online_target_rows(results)
    if not rows:
        return []
    batches = sorted(rows[0]["values"])

    def cell(value, limit):
        if value is None:
            return "-"
        text = f"{value:.2f}"
        return text if limit is None else f"{text} ({'met' if value <= limit else 'missed'})"

    body = [[r["check"], r["target"]] + [cell(r["values"][b], r["limits"][b]) for b in batches] for r in rows]
    out = [
        "## Online HCA decode against its targets\n",
        "S = 4 rows per request, cold CUDA-graph medians of the cases above; the slowest boundary case is the largest "
        "of the measured none / every / quarter / realistic figures. Why small batches sit where they do: "
        "[DESIGN.md](DESIGN.md#measured-floors).\n",
        table(["check", "target"] + [f"B={b}" for b in batches], body, align="ll" + "r" * len(batches)),
        "",
    ]
    mem = [m for m in results.get("memory") or [] if m.get("state_per_request_per_layer", {}).get("hca")]
    online = next((m for m in mem if m["backend"] == "online"), None)
    ring = next((m for m in mem if m["backend"] in ("triton-tiled", "triton-single")), None)
    if online and ring:
        factor = ring["state_per_request_per_layer"]["hca"] / online["state_per_request_per_layer"]["hca"]
        verdict = "met" if factor >= ONLINE_STATE_FACTOR_TARGET else "missed"
        out += [
            f"HCA state per request and layer: {fmt_bytes(online['state_per_request_per_layer']['hca'])} online "
            f"against {fmt_bytes(ring['state_per_request_per_layer']['hca'])} ring = {factor:.1f}x less (target "
            f"≥ {ONLINE_STATE_FACTOR_TARGET:.0f}x: {verdict}).",
            "",
        ]
    return out


def _warm_table(results: dict) -> list[str]:
    rows = warm_rows(results)
    if not rows:
        return []
    l2 = results.get("env", {}).get("l2_bytes")
    body = [
        [
            r["id"],
            fmt_us(r["cold"]),
            fmt_us(r["warm"]),
            fmt_num(r["warm_over_cold"], 2, "x"),
            fmt_bytes(r["warm_bytes"]),
            "-" if r["fits_l2"] is None else ("yes" if r["fits_l2"] else "no"),
        ]
        for r in rows
    ]
    warm_replays = results.get("settings", {}).get("warm_replays", "?")
    return [
        "## Decode: cold and warm figures\n",
        "Two timings of the same CUDA graphs, us per layer. **Cold**: input copy sets (rows, and the state rows each "
        "copy's positions touch) rotate until they exceed twice the L2, so every layer reads from memory, as an "
        "engine's layers do when the rest of the model runs in between. **Warm**: the first copy set's graph "
        f"replayed back to back (median of {warm_replays} replays / layer instances), so whatever of the instances' "
        f"bytes fits the L2 ({fmt_bytes(l2)}) stays there, as in a loop that times one layer repeatedly.\n",
        table(["case", "cold us/layer", "warm us/layer", "warm ÷ cold", "bytes per replay", "fits the L2"], body),
        "",
    ]


def _s1_table(results: dict) -> list[str]:
    rows = s1_rows(results)
    if not rows:
        return []
    body = [
        [
            str(r["batch"]),
            r["backend"],
            fmt_us(r["s4_cold"]),
            fmt_us(r["s1_cold"]),
            fmt_num(r["s1_over_s4"], 2, "x"),
            fmt_us(r["s4_warm"]),
            fmt_us(r["s1_warm"]),
        ]
        for r in rows
    ]
    return [
        "## HCA decode: S = 1 row for 4B requests against S = 4 rows for B requests\n",
        "Both steps have 4B rows and B group-closing rows: B requests of 4 rows that all close a group, or 4B "
        "requests of one row of which every 4th closes one. Us per layer, CUDA graph of layer instances.\n",
        table(
            ["B", "backend", "S=4 x B, cold", "S=1 x 4B, cold", "S=1 ÷ S=4", "S=4 x B, warm", "S=1 x 4B, warm"],
            body,
            align="rlrrrrr",
        ),
        "",
    ]


def _model_table(results: dict) -> list[str]:
    rows = model_rows(results)
    failed = [r for r in results.get("cases", []) if r["case"]["phase"] == "model" and r.get("status") != "ok"]
    if not rows and not failed:
        return []
    body = [
        [
            r["model"],
            r["backend"],
            str(r["batch"]),
            fmt_us(r["warm"]),
            fmt_us(r["cold"]),
            str(r["launches"] if r["launches"] is not None else "-"),
            fmt_bytes(r["bytes"]),
            fmt_gbps(r["gbps"]),
            fmt_num(r["x_floor"], 1, "x"),
            fmt_bytes(r["memory"]),
            fmt_bytes(r["cuda_peak"]),
        ]
        for r in rows
    ]
    layers = "; ".join(
        sorted({f"{r['model']}: " + ", ".join(f"{n} {k}" for k, n in r["layers"].items()) for r in rows})
    )
    out = [
        "## Whole-model decode step\n",
        f"Every compressor layer of the model ({layers}; the indexer compressor runs on every CSA layer) and the "
        "step's two plans (ratio 4 and 128) in one CUDA graph; S = 4 rows per request (mtp_step 3), requests at "
        "random lengths. The HCA layers run the named backend, CSA and indexer layers the single-stage ring kernels. "
        "**Warm**: the graph replayed back to back. **Cold**: the L2 flushed (a read of twice its size) before each "
        "replay, outside the timed events; rotating input copies as the per-layer figures do would multiply every "
        "layer's state. Device memory: the step's own buffers (state, output pages, input rows, scratch, plans); "
        "CUDA peak: what the allocator handed out while they were built and the graph captured.\n",
    ]
    if rows:
        header = ["model", "HCA backend", "B", "warm us/step", "cold us/step", "launches", "bytes/step",
                  "GB/s (cold)", "x floor", "device memory", "CUDA peak"]  # fmt: skip
        out += [table(header, body, align="llrrrrrrrrr"), ""]
    out += [f"- `{r['id']}`: {status_text(r)}" for r in failed]
    if failed:
        out.append("")
    return out


def _projection_tables(results: dict) -> list[str]:
    rows = projection_rows(results)
    if not rows:
        return []
    out = [
        "## From hidden states: the projection, the layer, the step\n",
        "Each compressor first projects the layer's hidden states, `kv_score = x @ wkv_gate.T` (bf16 in, "
        "float32 out). **torch**: `torch.mm(x, w.T, out_dtype=float32)` (cuBLAS, what the engines run), "
        "followed in the layer and step cases by our compress; **triton**: `ops.compress_from_hidden` with "
        "our projection kernel (`kernels/projection.py`: one program per row block, column block and K split; "
        "the split's partials added in a fixed order). **pair**: a CSA layer's main and indexer projections "
        "of one `x` (torch: one GEMM of the two weights concatenated, as an engine holding them as one tensor "
        "would run it; triton: `ops.project` of both weights in one launch); the CSA layers and steps on "
        "triton, and on auto up to `ops.pair_projection_rows`, project that way. Graphs of 20 instances with "
        "distinct weights (layers: distinct weights, states, pages and hidden states), us per instance. "
        "**Warm**: replayed back to back. **Cold**: the L2 flushed before each replay. *Fastest* is per "
        "figure. **auto** (layers and steps): the ops' default, per weight shape and step the path measured "
        "faster (`kernels/projection.py` `FASTER_THAN_CUBLAS`, from this page's projection cases: ours on "
        "decode steps of 64 rows, cuBLAS on larger ones). **joint** (layers and steps with CSA layers): auto "
        "with each CSA layer's two weights held as one tensor's halves (`ops.join_pair_weights`, as the LightLLM "
        "and SGLang adapters join them before the first step), so the pair is one cuBLAS GEMM of the joint "
        "weight, or on steps of up to `ops.joint_pair_triton_rows` rows our one launch on its halves (measured "
        "faster beside the engine's attention GEMM). The targets are checked on the adapters' default: joint "
        "where the case has it, else auto.\n",
    ]
    headings = {
        "projection": ("Projection alone", "T"),
        "layer": ("Whole layer (CSA: main + indexer; HCA: online), S = 4", "B"),
        "model-hidden": ("Whole decode step from hidden states (plans, every projection and compression), S = 4", "B"),
    }
    for phase, (title, size) in headings.items():
        body = []
        for r in (r for r in rows if r["phase"] == phase):
            t, o, a, j = (r["paths"].get(p, {}) for p in ("torch", "triton", "auto", "joint"))
            target, judged = r["target_us"], r["paths"].get(r["target_path"], {}).get("cold")
            met = "-" if target is None or judged is None else ("met" if judged <= target else "missed")
            body.append(
                [
                    r["model"], r["kind"] or "-", str(r["size"]), fmt_us(t.get("warm")), fmt_us(t.get("cold")),
                    fmt_us(o.get("warm")), fmt_us(o.get("cold")), fmt_us(a.get("warm")), fmt_us(a.get("cold")),
                    fmt_us(j.get("warm")), fmt_us(j.get("cold")), r["fastest_warm"] or "-", r["fastest_cold"] or "-",
                    fmt_num(r["speedup_cold"], 2, "x"),
                    fmt_num(o.get("x_floor"), 1, "x"),
                    "-" if target is None else f"{fmt_us(target)} ({met}, {r['target_path']})",
                ]
            )  # fmt: skip
        if not body:
            continue
        header = ["model", "kind", size, "torch warm", "torch cold", "triton warm", "triton cold", "auto warm",
                  "auto cold", "joint warm", "joint cold", "fastest warm", "fastest cold", "torch / triton (cold)",
                  "triton x floor", "target (cold)"]  # fmt: skip
        out += [f"### {title}\n", table(header, body, align="llrrrrrrrrrllrrl"), ""]
    failed = [f for r in rows for f in r.get("failed", [])]
    out += [f"- `{f}`" for f in failed]
    return out + ([""] if failed else [])


def _beside_table(results: dict) -> list[str]:
    rows = beside_rows(results)
    if not rows:
        return []
    body = []
    for r in rows:
        if "failed" in r:
            body.append([r["model"], r["kind"], str(r["batch"]), r["path"], r["failed"], "", "", "", "", ""])
            continue
        c, w = r["cold"], r["warm"]
        body.append(
            [
                r["model"], r["kind"], str(r["batch"]), r["path"], fmt_us(c["layer"]), fmt_us(c["gemm"]),
                fmt_us(c["both"]), fmt_num(c["overlap"], 2), fmt_us(w["both"]), fmt_num(w["overlap"], 2),
            ]
        )  # fmt: skip
    width = next((r["gemm_width"] for r in rows if r.get("gemm_width")), None)
    return [
        "## The layer beside the engine's attention GEMM\n",
        "The engines run a layer's compressor on another stream while the default one runs the attention's own "
        f"input GEMM (`x @ fused_wqa_wkv.T`, bf16, {width or '?'} outputs for V4-Flash): vLLM's "
        "`_run_parallel_input_projections`, SGLang's multi-stream prepare. Each of the 20 instances forks the "
        "GEMM onto a side stream and joins it after its layer; us per instance. **overlap**: the share of the "
        "shorter of layer and GEMM that running them together hid, `(layer + gemm - both) / min(layer, gemm)` "
        "(1: hidden, 0: one after the other; the layer alone is the plain layer case above).\n",
        table(
            [
                "model",
                "kind",
                "B",
                "path",
                "layer cold",
                "GEMM cold",
                "both cold",
                "overlap cold",
                "both warm",
                "overlap warm",
            ],
            body,
            align="llrlrrrrrr",
        ),  # fmt: skip
        "",
    ]


def _plan_table(results: dict) -> list[str]:
    rows = plan_rows(results)
    if not rows:
        return []
    body = [
        [
            r["id"],
            f"{r['rows']:,}",
            str(r["requests"]),
            str(r["closing"]),
            "decode" if r["decode"] else "mixed (one prompt chunk)",
            fmt_us(r["us"]),
            _spread(r["graph"]),
        ]
        for r in rows
    ]
    n = rows[0]["launches"]
    return [
        "## build_plan\n",
        f"One plan per step per ratio, shared by every layer of that ratio. A CUDA graph of {n} `build_plan` launches "
        "on one step's metadata, replay time / launches.\n",
        table(["case", "rows", "requests", "closing rows", "step", "us per launch", "p10–p90"], body, align="lrrrlrr"),
        "",
    ]


def _dispatch_table(results: dict) -> list[str]:
    rows = dispatch_rows(results)
    if not rows:
        return []
    body = [
        [r["id"], r["op"], fmt_us(r["python"]), fmt_us(r["dispatcher"]), fmt_num(r["overhead"], 2, " us")] for r in rows
    ]
    calls, rounds = rows[0]["calls"], rows[0]["rounds"]
    return [
        "## Dispatcher overhead\n",
        "Host time per eager call of the same op with the same tensors: the Python launcher (`ops.<op>`, what an "
        f"eager engine calls) against `torch.ops.dsv4c.<op>` (the registered op, for compiled graphs). Median of "
        f"{rounds} rounds of {calls} back-to-back calls, the device synchronised only between rounds.\n",
        table(["case", "op", "ops.<op> us", "torch.ops.dsv4c.<op> us", "dispatcher overhead"], body, align="llrrr"),
        "",
    ]


def _cache_step_table(results: dict) -> list[str]:
    rows = cache_step_rows(results)
    if not rows:
        return []
    body = [
        [
            r["id"],
            fmt_us(r["us"]),
            r["spread"],
            f"< {CACHE_STEP_TARGET_US:.0f} us: {'met' if r['met'] else 'missed'}",
        ]
        for r in rows
    ]
    steps = rows[0]["steps"]
    return [
        "## cache.step host time\n",
        "Host wall time of one `CompressedKVCache.step` per layer (validation, page reservation, the metadata "
        f"upload, the launches), a decode batch with MTP rewinds, `check_finite=False`; median of {steps} steps. "
        "The device is synchronised before each call and not within it, so its execution is not in the figure.\n",
        table(["case", "host us per step", "p10–p90", "target"], body, align="lrrl"),
        "",
    ]


def _case_row_decode(res: dict) -> list[str]:
    c, t = res["case"], res["traffic"]
    return [
        str(c["batch"]),
        c["backend"],
        fmt_us(_us(res)),
        _spread(res.get("graph") or res.get("eager")),
        fmt_us(_median(res.get("warm"))),
        fmt_gbps(res.get("gbps")),
        fmt_us(res.get("floor_us")),
        fmt_num(res.get("x_floor"), 1, "x"),
        fmt_bytes(t["total"]),
        f"{t['closing_rows']:.1f}".rstrip("0").rstrip("."),
        _timing_label(res),
    ]


def _decode_tables(results: dict) -> list[str]:
    out = []
    decode = [r for r in results.get("cases", []) if r["case"]["phase"] == "decode"]
    keys = sorted(
        {(r["case"]["kind"], r["case"]["rows"], r["case"]["boundary"]) for r in decode},
        key=lambda k: (_kind_order(k[0]), k[1], _boundary_order(k[2])),
    )
    header = ["B", "backend", "us/layer", "p10–p90", "warm", "GB/s", "floor us", "x floor", "bytes/layer", "entries",
              "timing"]  # fmt: skip
    for kind, s, boundary in keys:
        group = [
            r for r in decode if (r["case"]["kind"], r["case"]["rows"], r["case"]["boundary"]) == (kind, s, boundary)
        ]
        ok = sorted(
            (r for r in group if r["status"] == "ok" and _us(r) is not None),
            key=lambda r: (r["case"]["batch"], _backend_order(r["case"]["backend"])),
        )
        out.append(f"### {kind.upper()} decode, S = {s} row{'s' if s != 1 else ''} per request, boundary: {boundary}\n")
        if ok:
            out += [table(header, [_case_row_decode(r) for r in ok], align="rlrrrrrrrrl"), ""]
        out += [f"- `{r['id']}`: {status_text(r)}" for r in group if r not in ok]
        if out[-1]:
            out.append("")
    return out


def _prefill_table(results: dict) -> list[str]:
    pre = [r for r in results.get("cases", []) if r["case"]["phase"] == "prefill"]
    if not pre:
        return []
    ok = sorted(
        (r for r in pre if r["status"] == "ok" and _us(r) is not None),
        key=lambda r: (r["case"]["kind"], r["case"]["chunk"], r["case"]["carry"], _backend_order(r["case"]["backend"])),
    )
    header = ["kind", "chunk", "carry", "backend", "us", "p10–p90", "GB/s", "read GB/s", "read % of copy",
              "floor us", "x floor", "bytes", "timing"]  # fmt: skip
    body = [
        [
            r["case"]["kind"],
            f"{r['case']['chunk']:,}",
            "yes" if r["case"]["carry"] else "no",
            r["case"]["backend"],
            fmt_us(_us(r)),
            _spread(r.get("graph") or r.get("eager")),
            fmt_gbps(r.get("gbps")),
            fmt_gbps(r.get("read_gbps")),
            fmt_num(r.get("read_pct_of_copy"), 0, "%"),
            fmt_us(r.get("floor_us")),
            fmt_num(r.get("x_floor"), 1, "x"),
            fmt_bytes(r["traffic"]["total"]),
            _timing_label(r),
        ]
        for r in ok
    ]
    out = [
        "## Prefill (one request, one chunk)\n",
        "Carry: the chunk starts after a partial group of r/2 rows supplied by an earlier step. "
        f"The online backend's target is a read bandwidth of at least {ONLINE_READ_TARGET_PCT:.0f}% of the copy "
        "bandwidth on the bytes it must read (a 64K chunk).\n",
        table(header, body, align="lrllrrrrrrrrl"),
    ]
    not_ok = [r for r in pre if r not in ok]
    if not_ok:
        out.append("")
        out += [f"- `{r['id']}`: {status_text(r)}" for r in not_ok]
    out.append("")
    return out


def _eager_table(results: dict) -> list[str]:
    both = [r for r in _ok(results) if r.get("graph") and r.get("eager")]
    if not both:
        return []
    body = []
    for r in both:
        launches = r.get("launches_per_layer", r.get("launches_per_step"))
        body.append(
            [
                r["id"],
                fmt_us(r["graph"]["median_us"]),
                fmt_us(r["eager"]["median_us"]),
                fmt_num(r["eager"]["median_us"] - r["graph"]["median_us"], 2),
                "-" if launches is None else str(launches),
                str(r.get("instances")),
            ]
        )
    eager_empty = results.get("floors", {}).get("eager_empty_launch_us")
    extra = f" An empty Triton kernel launched eagerly measured {eager_empty:.2f} us." if eager_empty else ""
    return [
        "## Eager launches vs CUDA graph replay\n",
        "Same instances and inputs; eager figures include the gaps the host's launches leave on the stream."
        + extra
        + "\n",
        table(["case", "graph us/layer", "eager us/layer", "eager − graph", "launches/layer", "instances"], body),
        "",
    ]


def _memory_table(results: dict) -> list[str]:
    mem = results.get("memory") or []
    if not mem:
        return []
    body = []
    for m in mem:
        s = m["state_per_request_per_layer"]
        body.append(
            [
                m["model"],
                m["backend"],
                fmt_bytes(s.get("hca")),
                fmt_bytes(s.get("csa")),
                fmt_bytes(s.get("indexer")),
                fmt_bytes(m.get("state_per_request_all_layers")),
                fmt_bytes(m.get("state_total")),
                fmt_bytes(m.get("scratch")),
                m.get("note") or m.get("scratch_plan") or "",
            ]
        )
    first = mem[0]
    header = ["model", "backend", "HCA state/req/layer", "CSA", "indexer", "per request, all layers", "total",
              "scratch", "note"]  # fmt: skip
    return [
        "## Memory\n",
        f"Per-request state of one layer, and totals for {first['requests']} requests at mtp_step "
        f"{first['mtp_step']} over the model's layers (Flash: 20 HCA + 21 CSA layers, Pro: 31 HCA + 30 CSA; the "
        "indexer runs on every CSA layer). Scratch is one region shared by all layers.\n",
        table(header, body, align="llrrrrrrl"),
        "",
    ]


def _failures(results: dict) -> list[str]:
    bad = [r for r in results.get("cases", []) if r.get("status") != "ok"]
    if not bad:
        return []
    return ["## Cases without a figure\n"] + [f"- `{r['id']}`: {status_text(r)}" for r in bad] + [""]


def _method(results: dict) -> list[str]:
    online = results.get("online", {})
    online_text = "available" if online.get("available") else online.get("problem") or "not probed"
    return [
        "## Method",
        "",
        "- What is timed is what an engine launches: per step, the per-row metadata (positions, request slots, "
        "output slots; int64 device tensors) and one `ops.build_plan` per ratio, shared by every layer of that "
        "ratio; per layer, `ops.compress` (ring state; HCA tiled with a scratch region, or single-stage) or "
        "`ops.compress_online_hca` on that layer's own state and output pages. A cache object only allocates the "
        "buffers. Per-layer figures exclude the plan (built once before timing, as it is once per step for all "
        "layers); `build_plan` is timed on its own and inside the whole-model step.",
        "- Decode: a CUDA graph holds each layer instance's op in sequence; each instance has its own state, pages "
        "and input rows. Figures are replay time / instances (median, 10th–90th percentile over the timed replays, "
        "each bracketed by CUDA events). Cold: input copy sets rotate (one graph per set, replayed round-robin) "
        "until the bytes touched per rotation exceed twice the L2 cache (at most --max-copies sets; a timing label "
        'says "rotation < 2x L2" where the cap was reached first). Warm: the first set\'s graph alone.',
        "- Boundary cases: `none` (no request closes a group), `every` (every request's last row closes one), "
        "`quarter` (every 4th request closes one), `realistic` (requests at random lengths: about S/r of them close "
        "a group per step).",
        "- Prefill: one instance, one request; the reference backend is eager PyTorch, timed eagerly on one instance.",
        "- Bytes per layer: new rows read whole; ring rows of the closed windows that precede the step (the half "
        "each window uses); saved ring rows; online state banks (3 x head_dim float32) read and written; entries "
        "written (584 B latent; 256 B key + 132 B FP8 pack for the indexer). Scratch traffic is not counted. "
        "Each backend's floor counts the bytes its own state design must move, so the online backend (a few "
        "KiB of banks instead of 124 ring rows per closing row) has a much lower floor than the ring backends. "
        "A whole-model step's launch floor is its number of launches times the empty-kernel floor.",
        f"- Online backend in this run: {online_text}.",
        "",
    ]


def render_perf(results: dict, *, plot_link: str | None = None, json_link: str | None = None) -> str:
    """The text of ``docs/PERF.md`` for ``results``."""
    env, floors, st = results.get("env", {}), results.get("floors", {}), results.get("settings", {})
    commit = env.get("commit", "unknown")
    if env.get("dirty"):
        commit += " (with uncommitted changes)"
    lines = [
        "# Performance",
        "",
        "Generated from the benchmark's results JSON"
        + (f" (`{json_link}`)" if json_link else "")
        + " by `scripts/write_perf.py`; do not edit by hand. Rerun the command below, then the script, to refresh "
        "it.",
        "",
        "## Run",
        "",
        f"- Date: {env.get('date', 'unknown')}",
        f"- GPU: {env.get('gpu') or 'unknown'} (driver {env.get('driver') or 'unknown'}, CUDA runtime "
        f"{env.get('cuda_runtime') or 'unknown'}, L2 {fmt_bytes(env.get('l2_bytes'))})",
        f"- Software: torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, python {env.get('python', '?')}, "
        f"dsv4-compressor {env.get('dsv4_compressor', '?')}",
        f"- Commit: `{commit}`",
        f"- Command: `{results.get('command', '?')}`",
        "- Library switches: "
        + (", ".join(f"`{k}={v}`" for k, v in env.get("settings", {}).items()) or "none set (the defaults)"),
        f"- Preset: {results.get('preset', '?')}; {st.get('replays', '?')} timed replays per case after "
        f"{st.get('warmup', '?')} warm-up; decode graphs hold {st.get('instances', '?')} layer instances",
        f"- Wall time of the run: {fmt_num(results.get('elapsed_s'), 0, ' s')}"
        + ("" if results.get("complete") else " (the run did not finish: figures are partial)"),
        "",
        "## Floors measured in this run",
        "",
        f"- Device-to-device copy bandwidth: {fmt_num(floors.get('copy_bw_GBps'))} GB/s (median; read + write "
        f"bytes of a {fmt_bytes(floors.get('copy_bytes'))} `torch` copy; "
        f"best {fmt_num(floors.get('copy_bw_GBps_best'))} GB/s)",
        f"- Launch floor: {fmt_us(floors.get('launch_floor_us'))} us per empty kernel in a CUDA graph of "
        f"{floors.get('launch_floor_kernels_per_graph', '?')}; a one-kernel graph replay "
        f"{fmt_us(floors.get('graph_one_kernel_us'))} us; "
        f"one eager empty launch {fmt_us(floors.get('eager_empty_launch_us'))} us",
        "- A case's floor is max(bytes it must move / copy bandwidth, launch floor); `x floor` = time / floor.",
    ]
    lines += [f"- Floor measurement failed: {e}" for e in floors.get("errors", [])]
    lines.append("")
    if plot_link:
        lines += [f"![latency per layer against batch size]({plot_link})", ""]
    lines += _pick_section(results)
    lines += _c128_table(results)
    lines += _online_targets_table(results)
    lines += _warm_table(results)
    lines += _s1_table(results)
    lines += _model_table(results)
    lines += _projection_tables(results)
    lines += _beside_table(results)
    lines += _plan_table(results)
    lines += _dispatch_table(results)
    lines += _cache_step_table(results)
    lines += ["## Decode\n"]
    lines += _decode_tables(results)
    lines += _prefill_table(results)
    lines += _eager_table(results)
    lines += _memory_table(results)
    lines += _failures(results)
    lines += _method(results)
    return "\n".join(lines)
