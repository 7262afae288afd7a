"""Rendering a results dict: the stdout table, the JSON file, and ``docs/PERF.md``.

Everything here reads the results dict the CLI writes (see :func:`new_results`) and nothing else, so
``docs/PERF.md`` is regenerated from a JSON file (``scripts/write_perf.py``) and every number in it comes
from a measurement or a byte count of that run. Missing measurements print as ``-`` or "not measured".
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable
from pathlib import Path

from .cases import BACKENDS, BOUNDARIES

__all__ = [
    "SCHEMA",
    "new_results",
    "write_json",
    "load_json",
    "markdown_table",
    "render_perf",
    "pick_table",
    "c128_rows",
    "online_target_rows",
    "fmt_bytes",
    "fmt_us",
]

SCHEMA = "dsv4-compressor-bench/1"
#: The online target for a 64K prefill chunk: read bandwidth over the measured copy bandwidth.
ONLINE_READ_TARGET_PCT = 60.0
#: The online backend's HCA decode targets (S = 4 rows per request, CUDA graph figures): every-closes time over
#: none-closes time, online over tiled on each, and the slowest boundary case per batch size (us per layer).
ONLINE_DECODE_TARGETS = {
    "every_over_none": 1.1,
    "vs_tiled_every": 0.5,
    "vs_tiled_none": 1.0,
    "us_per_layer": {16: 2.0, 64: 3.5, 256: 7.0},
}
#: HCA state per request and layer: the ring backends' over the online backend's.
ONLINE_STATE_FACTOR_TARGET = 20.0


def new_results(*, command: str, argv: list[str], preset: str, settings: dict) -> dict:
    return {
        "schema": SCHEMA,
        "command": command,
        "argv": list(argv),
        "preset": preset,
        "settings": dict(settings),
        "env": {},
        "floors": {},
        "online": {},
        "memory": [],
        "cases": [],
        "elapsed_s": None,
        "complete": False,
        "outputs": {},
    }


def write_json(path: str | os.PathLike, results: dict) -> None:
    """Write atomically (the run rewrites it after every case, so a killed run leaves valid JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def load_json(path: str | os.PathLike) -> dict:
    results = json.loads(Path(path).read_text())
    if results.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} results file (schema={results.get('schema')!r})")
    return results


# -------------------------------------------------------------------------------------------------
# Number formatting
# -------------------------------------------------------------------------------------------------
def fmt_us(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 10:
        return f"{x:.2f}"
    if x < 1000:
        return f"{x:.1f}"
    return f"{x:,.0f}"


def fmt_num(x: float | None, digits: int = 0, suffix: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}{suffix}"


def fmt_gbps(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _spread(stats: dict | None) -> str:
    if not stats:
        return "-"
    return f"{fmt_us(stats['p10_us'])}–{fmt_us(stats['p90_us'])}"


def _timing_label(res: dict) -> str:
    if res.get("status") != "ok":
        return "-"
    n = res.get("instances", 1)
    inst = f"{n} instance{'s' if n != 1 else ''}"
    copies = res.get("copies", 1)
    rot = f", {copies} input copies" if copies > 1 else ""
    warm = "" if res.get("l2_rotation_ok", True) else " (rotation < 2x L2)"
    return f"{res.get('timing', '?')}, {inst}{rot}{warm}"


def _table(header: list[str], rows: Iterable[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _status_text(res: dict) -> str:
    if res.get("status") == "ok":
        return res.get("note") or ""
    text = res.get("error") or res.get("note") or ""
    return f"{res.get('status')}: {text}".strip()


# -------------------------------------------------------------------------------------------------
# The stdout table
# -------------------------------------------------------------------------------------------------
def markdown_table(results: dict) -> str:
    """Every case, one row: latency per layer, spread, bandwidth, floor, and eager next to graph."""
    rows = []
    for res in results.get("cases", []):
        g = res.get("graph") or res.get("eager")
        e = res.get("eager") if res.get("graph") else None
        rows.append(
            [
                res["id"],
                _timing_label(res),
                fmt_us(res.get("us_per_layer")),
                _spread(g),
                fmt_gbps(res.get("gbps")),
                fmt_us(res.get("floor_us")),
                fmt_num(res.get("x_floor"), 1, "x"),
                fmt_us(e["median_us"]) if e else "-",
                _status_text(res),
            ]
        )
    header = ["case", "timing", "us/layer", "p10–p90", "GB/s", "floor us", "x floor", "eager us/layer", "note"]
    return _table(header, rows, align="llrrrrrrl")


# -------------------------------------------------------------------------------------------------
# Lookups
# -------------------------------------------------------------------------------------------------
def _ok(results: dict) -> list[dict]:
    return [r for r in results.get("cases", []) if r.get("status") == "ok" and r.get("us_per_layer")]


def _find(results: dict, **want) -> dict | None:
    for res in _ok(results):
        c = res["case"]
        if all(c.get(k) == v for k, v in want.items()):
            return res
    return None


def _backend_order(name: str) -> int:
    return BACKENDS.index(name) if name in BACKENDS else len(BACKENDS)


def _boundary_order(name: str) -> int:
    return BOUNDARIES.index(name) if name in BOUNDARIES else len(BOUNDARIES)


def _graph_us(res: dict | None) -> float | None:
    if res and res.get("graph"):
        return res["graph"]["median_us"]
    return None


# -------------------------------------------------------------------------------------------------
# The answers: tiled vs single, the extra launch, the pick per case
# -------------------------------------------------------------------------------------------------
def c128_rows(results: dict) -> list[dict]:
    """HCA decode rows per (S, boundary, B): graph medians of single, tiled, online and their ratios."""
    keys = sorted(
        {
            (r["case"]["rows"], r["case"]["boundary"], r["case"]["batch"])
            for r in _ok(results)
            if r["case"]["phase"] == "decode" and r["case"]["kind"] == "hca" and r.get("graph")
        },
        key=lambda k: (k[0], _boundary_order(k[1]), k[2]),
    )
    out = []
    for s, boundary, b in keys:

        def us(backend, s=s, boundary=boundary, b=b):
            return _graph_us(
                _find(results, phase="decode", kind="hca", backend=backend, rows=s, boundary=boundary, batch=b)
            )

        single, tiled, online = us("triton-single"), us("triton-tiled"), us("online")
        out.append(
            {
                "rows": s,
                "boundary": boundary,
                "batch": b,
                "single": single,
                "tiled": tiled,
                "online": online,
                "single_over_tiled": single / tiled if single and tiled else None,
                "tiled_minus_single": tiled - single if single is not None and tiled is not None else None,
                "online_over_tiled": online / tiled if online and tiled else None,
            }
        )
    return out


def online_target_rows(results: dict, rows_per_request: int = 4) -> list[dict]:
    """The online backend's HCA decode figures against :data:`ONLINE_DECODE_TARGETS`, one row per check:
    ``{"check", "target", "values": {B: value or None}, "limits": {B: limit}}``; a value meets its check when it is
    at most its limit."""
    t = ONLINE_DECODE_TARGETS

    def us(backend, boundary, b):
        want = dict(phase="decode", kind="hca", rows=rows_per_request, boundary=boundary, batch=b)
        return _graph_us(_find(results, backend=backend, **want))

    def ratio(x, y):
        return x / y if x is not None and y else None

    batches = sorted(
        {
            r["case"]["batch"]
            for r in _ok(results)
            if r["case"]["phase"] == "decode" and r["case"]["kind"] == "hca" and r["case"]["backend"] == "online"
            and r["case"]["rows"] == rows_per_request and r.get("graph")
        }
    )  # fmt: skip
    if not batches:
        return []
    online = {b: {k: us("online", k, b) for k in BOUNDARIES} for b in batches}
    tiled = {b: {k: us("triton-tiled", k, b) for k in ("none", "every")} for b in batches}
    worst = {b: max((v for v in online[b].values() if v is not None), default=None) for b in batches}
    return [
        {
            "check": "every request closes a group ÷ none does",
            "target": f"≤ {t['every_over_none']}",
            "values": {b: ratio(online[b]["every"], online[b]["none"]) for b in batches},
            "limits": {b: t["every_over_none"] for b in batches},
        },
        {
            "check": "online ÷ tiled, every request closes a group",
            "target": f"≤ {t['vs_tiled_every']}",
            "values": {b: ratio(online[b]["every"], tiled[b]["every"]) for b in batches},
            "limits": {b: t["vs_tiled_every"] for b in batches},
        },
        {
            "check": "online ÷ tiled, no request closes a group",
            "target": f"≤ {t['vs_tiled_none']}",
            "values": {b: ratio(online[b]["none"], tiled[b]["none"]) for b in batches},
            "limits": {b: t["vs_tiled_none"] for b in batches},
        },
        {
            "check": "slowest boundary case, us per layer",
            "target": " / ".join(f"≤ {v} (B={b})" for b, v in t["us_per_layer"].items()),
            "values": worst,
            "limits": {b: t["us_per_layer"].get(b) for b in batches},
        },
    ]


def pick_table(results: dict) -> list[dict]:
    """Per decode (kind, S, boundary, B) and prefill (kind, chunk, carry): the fastest backend measured in
    a CUDA graph (eager-only figures are not comparable), and how much slower the next one is."""
    groups: dict[tuple, list[dict]] = {}
    for res in _ok(results):
        if not res.get("graph"):
            continue
        c = res["case"]
        if c["phase"] == "decode":
            key = ("decode", c["kind"], c["rows"], c["boundary"], c["batch"])
        else:
            key = ("prefill", c["kind"], c["chunk"], c["carry"], 1)
        groups.setdefault(key, []).append(res)
    out = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], str(k[2]), _boundary_order(str(k[3])), k[4])):
        ranked = sorted(groups[key], key=lambda r: r["graph"]["median_us"])
        best = ranked[0]
        nxt = ranked[1] if len(ranked) > 1 else None
        out.append(
            {
                "key": key,
                "pick": best["case"]["backend"],
                "us": best["graph"]["median_us"],
                "x_floor": best.get("x_floor"),
                "next": nxt["case"]["backend"] if nxt else None,
                "next_slower": nxt["graph"]["median_us"] / best["graph"]["median_us"] if nxt else None,
                "compared": [r["case"]["backend"] for r in ranked],
            }
        )
    return out


def _answers(results: dict) -> list[str]:
    """Short generated statements; each cites the numbers it is made of."""
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
            "- **Tiled vs single-stage (HCA decode, CUDA graph; single-stage time / tiled time, above 1 means the "
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
    for res in _ok(results):
        c = res["case"]
        if c["phase"] == "prefill" and c["backend"] == "online" and c["kind"] == "hca" and c["chunk"] == 65536:
            pct = res.get("read_pct_of_copy")
            if pct is None:
                continue
            verdict = "meets" if pct >= ONLINE_READ_TARGET_PCT else "misses"
            lines.append(
                f"- **Online HCA prefill, 64K chunk, {'with' if c['carry'] else 'without'} a carried partial group:** "
                f"reads at {fmt_gbps(res.get('read_gbps'))} GB/s = {pct:.0f}% of the measured copy bandwidth; "
                f"{verdict} the {ONLINE_READ_TARGET_PCT:.0f}% target."
            )
    floors = [(r["case"]["backend"], r["x_floor"]) for r in _ok(results) if r.get("x_floor") and r.get("graph")]
    if floors:
        by_backend: dict[str, list[float]] = {}
        for b, x in floors:
            by_backend.setdefault(b, []).append(x)
        parts = "; ".join(
            f"{b}: {min(xs):.1f}x–{max(xs):.1f}x (median {statistics.median(xs):.1f}x)"
            for b, xs in sorted(by_backend.items(), key=lambda kv: _backend_order(kv[0]))
        )
        lines.append(
            f"- **Against the floor** (time / max(bytes floor, launch floor), graph figures; each backend against "
            f"the bytes its own state design must move): {parts}."
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
# PERF.md
# -------------------------------------------------------------------------------------------------
def _case_row_decode(res: dict) -> list[str]:
    c, t = res["case"], res["traffic"]
    return [
        str(c["batch"]),
        c["backend"],
        fmt_us(res["us_per_layer"]),
        _spread(res.get("graph") or res.get("eager")),
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
        key=lambda k: (
            ("hca", "csa", "indexer").index(k[0]) if k[0] in ("hca", "csa", "indexer") else 9,
            k[1],
            _boundary_order(k[2]),
        ),
    )
    header = [
        "B",
        "backend",
        "us/layer",
        "p10–p90",
        "GB/s",
        "floor us",
        "x floor",
        "bytes/layer",
        "entries",
        "timing",
    ]
    for kind, s, boundary in keys:
        group = [
            r for r in decode if (r["case"]["kind"], r["case"]["rows"], r["case"]["boundary"]) == (kind, s, boundary)
        ]
        ok = sorted(
            (r for r in group if r["status"] == "ok" and r.get("us_per_layer")),
            key=lambda r: (r["case"]["batch"], _backend_order(r["case"]["backend"])),
        )
        out.append(f"### {kind.upper()} decode, S = {s} rows per request, boundary: {boundary}\n")
        if ok:
            out += [_table(header, [_case_row_decode(r) for r in ok], align="rlrrrrrrrl"), ""]
        out += [f"- `{r['id']}`: {_status_text(r)}" for r in group if r not in ok]
        if out[-1]:
            out.append("")
    return out


def _c128_table(results: dict) -> list[str]:
    rows = c128_rows(results)
    if not rows:
        return []
    header = [
        "S",
        "boundary",
        "B",
        "triton-single",
        "triton-tiled",
        "online",
        "single ÷ tiled",
        "tiled − single",
        "online ÷ tiled",
    ]
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
        "Graph medians, microseconds per layer (replay time / layer instances).\n",
        _table(header, body, align="rlrrrrrrr"),
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
        "S = 4 rows per request, CUDA-graph medians of the cases above; the slowest boundary case is the largest of "
        "the measured none / every / realistic figures. Why small batches sit where they do: "
        "[ONLINE_LATENCY.md](ONLINE_LATENCY.md).\n",
        _table(["check", "target"] + [f"B={b}" for b in batches], body, align="ll" + "r" * len(batches)),
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


def _prefill_table(results: dict) -> list[str]:
    pre = [r for r in results.get("cases", []) if r["case"]["phase"] == "prefill"]
    if not pre:
        return []
    ok = sorted(
        (r for r in pre if r["status"] == "ok" and r.get("us_per_layer")),
        key=lambda r: (r["case"]["kind"], r["case"]["chunk"], r["case"]["carry"], _backend_order(r["case"]["backend"])),
    )
    header = [
        "kind",
        "chunk",
        "carry",
        "backend",
        "us",
        "p10–p90",
        "GB/s",
        "read GB/s",
        "read % of copy",
        "floor us",
        "x floor",
        "bytes",
        "timing",
    ]
    body = [
        [
            r["case"]["kind"],
            f"{r['case']['chunk']:,}",
            "yes" if r["case"]["carry"] else "no",
            r["case"]["backend"],
            fmt_us(r["us_per_layer"]),
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
        f"Carry: the chunk starts after a partial group of r/2 rows supplied by an earlier step. "
        f"The online backend's target is a read bandwidth of at least {ONLINE_READ_TARGET_PCT:.0f}% of the copy "
        "bandwidth on the bytes it must read (a 64K chunk).\n",
        _table(header, body, align="lrllrrrrrrrrl"),
    ]
    not_ok = [r for r in pre if r not in ok]
    if not_ok:
        out.append("")
        out += [f"- `{r['id']}`: {_status_text(r)}" for r in not_ok]
    out.append("")
    return out


def _eager_table(results: dict) -> list[str]:
    both = [r for r in _ok(results) if r.get("graph") and r.get("eager")]
    if not both:
        return []
    body = [
        [
            r["id"],
            fmt_us(r["graph"]["median_us"]),
            fmt_us(r["eager"]["median_us"]),
            fmt_num(r["eager"]["median_us"] - r["graph"]["median_us"], 2),
            str(r.get("launches_per_step") if r.get("launches_per_step") is not None else "-"),
            str(r.get("instances")),
        ]
        for r in both
    ]
    eager_empty = results.get("floors", {}).get("eager_empty_launch_us")
    extra = f" An empty Triton kernel launched eagerly measured {eager_empty:.2f} us." if eager_empty else ""
    return [
        "## Eager launches vs CUDA graph replay\n",
        "Same instances and inputs; eager figures include the gaps the host's launches leave on the stream."
        + extra
        + "\n",
        _table(["case", "graph us/layer", "eager us/layer", "eager − graph", "launches/step", "instances"], body),
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
    return [
        "## Memory\n",
        f"Per-request state of one layer, and totals for {first['requests']} requests at mtp_step "
        f"{first['mtp_step']} over the model's layers (Flash: 20 HCA + 21 CSA layers, Pro: 31 HCA + 30 CSA; the "
        "indexer runs on every CSA layer). Scratch is one region shared by all layers.\n",
        _table(
            [
                "model",
                "backend",
                "HCA state/req/layer",
                "CSA",
                "indexer",
                "per request, all layers",
                "total",
                "scratch",
                "note",
            ],
            body,
            align="llrrrrrrl",
        ),
        "",
    ]


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
            "Fastest backend per case (CUDA-graph median per layer; the reference backend is eager-only and "
            "not ranked):\n",
            _table(["kind", "case", "pick", "us/layer", "x floor", "runner-up (x slower)"], body, align="lllrrl"),
            "",
        ]
    return out


def _failures(results: dict) -> list[str]:
    bad = [r for r in results.get("cases", []) if r.get("status") != "ok"]
    if not bad:
        return []
    return ["## Cases without a figure\n"] + [f"- `{r['id']}`: {_status_text(r)}" for r in bad] + [""]


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
        + " by `dsv4-compressor bench --perf` or `scripts/write_perf.py`; do not edit by hand. Rerun the command "
        "below to refresh it.",
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
    lines += ["## Decode\n"]
    lines += _decode_tables(results)
    lines += _prefill_table(results)
    lines += _eager_table(results)
    lines += _memory_table(results)
    lines += _failures(results)
    online = results.get("online", {})
    online_text = "available" if online.get("available") else online.get("problem") or "not probed"
    lines += [
        "## Method",
        "",
        "- Decode: a CUDA graph holds the whole per-layer step (every launch the engine makes for the layer) of "
        "each layer instance in sequence; each instance has its own cache, state, pages, descriptor and input "
        "rows. Figures are replay time / instances (median, 10th–90th percentile over the timed replays, each "
        "bracketed by CUDA events). Input copy sets rotate (one graph per set, replayed round-robin) until the "
        "bytes touched per rotation exceed twice the L2 cache (at most --max-copies sets; a timing label says "
        '"rotation < 2x L2" where the cap was reached first).',
        "- Boundary cases: `none` (no request closes a group), `every` (every request's last row closes one), "
        "`realistic` (requests at random lengths: about S/r of them close a group per step).",
        "- Prefill: one instance, one request; the reference backend is eager PyTorch, timed eagerly on one instance.",
        "- Bytes per layer: new rows read whole; ring rows of the closed windows that precede the step (the half "
        "each window uses); saved ring rows; online state banks (3 x head_dim float32) read and written; entries "
        "written (584 B latent; 256 B key + 132 B FP8 pack for the indexer). Scratch traffic is not counted. "
        "Each backend's floor counts the bytes its own state design must move, so the online backend (a few "
        "KiB of banks instead of 124 ring rows per closing row) has a much lower floor than the ring backends.",
        f"- Online backend in this run: {online_text}.",
        "",
    ]
    return "\n".join(lines)
