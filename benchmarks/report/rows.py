"""The comparisons of docs/PERF.md as rows of numbers, read from a results dict and nothing else, and the
lookups the page's sections share (a case's figures, sort orders, ratios)."""

from __future__ import annotations

from ..cases import BACKENDS, BOUNDARIES
from ..results import fmt_us, status_text
from .targets import CACHE_STEP_TARGET_US, FROM_HIDDEN_TARGETS_US, ONLINE_DECODE_TARGETS

#: Decode cases and their plot panels run in this kind order.
KIND_ORDER = ("hca", "csa", "indexer")


# -------------------------------------------------------------------------------------------------
# Lookups
# -------------------------------------------------------------------------------------------------
def _us(res: dict) -> float | None:
    """The headline figure (files of the first schema call it ``us_per_layer``)."""
    return res.get("us", res.get("us_per_layer"))


def _ok(results: dict, phase: str | None = None) -> list[dict]:
    return [
        r
        for r in results.get("cases", [])
        if r.get("status") == "ok" and _us(r) is not None and (phase is None or r["case"]["phase"] == phase)
    ]


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


def _kind_order(name: str) -> int:
    return KIND_ORDER.index(name) if name in KIND_ORDER else len(KIND_ORDER)


def _median(stats: dict | None) -> float | None:
    return stats["median_us"] if stats else None


def _graph_us(res: dict | None) -> float | None:
    return _median(res.get("graph")) if res else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


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


# -------------------------------------------------------------------------------------------------
# The comparisons, as rows of numbers
# -------------------------------------------------------------------------------------------------
def c128_rows(results: dict) -> list[dict]:
    """HCA decode rows per (S, boundary, B): cold graph medians of single, tiled, online and their ratios."""
    keys = sorted(
        {
            (r["case"]["rows"], r["case"]["boundary"], r["case"]["batch"])
            for r in _ok(results, "decode")
            if r["case"]["kind"] == "hca" and r.get("graph")
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
                "single_over_tiled": _ratio(single, tiled),
                "tiled_minus_single": tiled - single if single is not None and tiled is not None else None,
                "online_over_tiled": _ratio(online, tiled),
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

    batches = sorted(
        {
            r["case"]["batch"]
            for r in _ok(results, "decode")
            if r["case"]["kind"] == "hca" and r["case"]["backend"] == "online" and r["case"]["rows"] == rows_per_request
            and r.get("graph")
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
            "values": {b: _ratio(online[b]["every"], online[b]["none"]) for b in batches},
            "limits": {b: t["every_over_none"] for b in batches},
        },
        {
            "check": "online ÷ tiled, every request closes a group",
            "target": f"≤ {t['vs_tiled_every']}",
            "values": {b: _ratio(online[b]["every"], tiled[b]["every"]) for b in batches},
            "limits": {b: t["vs_tiled_every"] for b in batches},
        },
        {
            "check": "online ÷ tiled, no request closes a group",
            "target": f"≤ {t['vs_tiled_none']}",
            "values": {b: _ratio(online[b]["none"], tiled[b]["none"]) for b in batches},
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
        c = res["case"]
        if not res.get("graph") or c["phase"] not in ("decode", "prefill"):
            continue
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


def warm_rows(results: dict) -> list[dict]:
    """Decode cases with both figures: cold (rotated past the L2) and warm (one input set, back to back)."""
    l2 = results.get("env", {}).get("l2_bytes")
    out = []
    for res in _ok(results, "decode"):
        if not (res.get("graph") and res.get("warm")):
            continue
        warm_bytes = res.get("warm_bytes")
        out.append(
            {
                "id": res["id"],
                "cold": res["graph"]["median_us"],
                "warm": res["warm"]["median_us"],
                "warm_over_cold": _ratio(res["warm"]["median_us"], res["graph"]["median_us"]),
                "warm_bytes": warm_bytes,
                "fits_l2": None if warm_bytes is None or not l2 else warm_bytes <= l2,
            }
        )
    return out


def s1_rows(results: dict) -> list[dict]:
    """The S = 1 workload beside S = 4: per B and HCA backend, ``4B`` requests of one row with every 4th closing a
    group, against ``B`` requests of 4 rows that all close one (the same rows and closing rows)."""
    out = []
    for res in _ok(results, "decode"):
        c = res["case"]
        if c["kind"] != "hca" or c["rows"] != 1 or c["boundary"] != "quarter" or c["batch"] % 4:
            continue
        b = c["batch"] // 4
        s4 = _find(results, phase="decode", kind="hca", backend=c["backend"], rows=4, boundary="every", batch=b)
        out.append(
            {
                "batch": b,
                "backend": c["backend"],
                "s4_cold": _graph_us(s4),
                "s1_cold": _graph_us(res),
                "s4_warm": _median(s4.get("warm")) if s4 else None,
                "s1_warm": _median(res.get("warm")),
                "s1_over_s4": _ratio(_graph_us(res), _graph_us(s4)),
            }
        )
    return sorted(out, key=lambda r: (r["batch"], _backend_order(r["backend"])))


def model_rows(results: dict) -> list[dict]:
    """Whole-model decode steps: per model, HCA backend and B, the warm and cold step and what it used."""
    out = []
    for res in _ok(results, "model"):
        c = res["case"]
        out.append(
            {
                "model": c["model"],
                "backend": c["backend"],
                "batch": c["batch"],
                "rows": c["rows"],
                "layers": res.get("layers", {}),
                "launches": res.get("launches_per_step"),
                "warm": _median(res.get("warm")),
                "cold": _median(res.get("graph")),
                "bytes": res.get("traffic", {}).get("total"),
                "gbps": res.get("gbps"),
                "x_floor": res.get("x_floor"),
                "memory": (res.get("memory") or {}).get("total"),
                "cuda_peak": res.get("cuda_peak_bytes"),
            }
        )
    return sorted(out, key=lambda r: (r["model"], r["batch"], _backend_order(r["backend"])))


def plan_rows(results: dict) -> list[dict]:
    out = []
    for res in _ok(results, "plan"):
        c = res["case"]
        out.append(
            {
                "id": res["id"],
                "rows": res.get("plan_rows", c["chunk"]),
                "requests": res.get("requests"),
                "closing": res.get("closing_rows"),
                "decode": res.get("decode"),
                "us": _us(res),
                "graph": res.get("graph"),
                "launches": res.get("instances"),
            }
        )
    return sorted(out, key=lambda r: (int(r["id"].split("/")[1][1:]), r["rows"]))  # ids: plan/r<ratio>/T<rows>


def dispatch_rows(results: dict) -> list[dict]:
    """Per dispatch case and op: host us per call of the Python launcher and of ``torch.ops.dsv4c``."""
    out = []
    for res in _ok(results, "dispatch"):
        host = res.get("host") or {}
        for op in (res.get("op"), "build_plan"):
            py, lib = host.get(f"ops.{op}"), host.get(f"torch.ops.dsv4c.{op}")
            out.append(
                {
                    "id": res["id"],
                    "op": op,
                    "python": _median(py),
                    "dispatcher": _median(lib),
                    "overhead": (res.get("dispatcher_overhead_us") or {}).get(op),
                    "calls": res.get("calls"),
                    "rounds": res.get("rounds"),
                }
            )
    return out


def cache_step_rows(results: dict) -> list[dict]:
    out = []
    for res in _ok(results, "cache-step"):
        c, host = res["case"], res.get("host")
        us = _us(res)
        out.append(
            {
                "id": res["id"],
                "kind": c["kind"],
                "backend": c["backend"],
                "batch": c["batch"],
                "rows": c["rows"],
                "us": us,
                "spread": _spread(host),
                "steps": res.get("steps"),
                "met": us < CACHE_STEP_TARGET_US,
            }
        )
    return out


def projection_rows(results: dict) -> list[dict]:
    """The cases from hidden states, paired: per (phase, model, kind, T or B) the cuBLAS (``torch``) and our
    (``triton``) figures, warm and cold, which path is faster on each, and the target where it has one
    (:data:`.targets.FROM_HIDDEN_TARGETS_US`)."""
    pairs: dict[tuple, dict] = {}
    for res in results.get("cases", []):
        c = res["case"]
        if c["phase"] not in ("projection", "layer", "model-hidden") or c.get("beside"):
            continue
        size = c["chunk"] if c["phase"] == "projection" else c["batch"]
        key = (c["phase"], c["model"], c["kind"], size)
        row = pairs.setdefault(key, {"phase": key[0], "model": key[1], "kind": key[2], "size": size, "paths": {}})
        if res.get("status") == "ok":
            row["paths"][c["backend"]] = {
                "cold": _median(res.get("graph")), "warm": _median(res.get("warm")), "x_floor": res.get("x_floor"),
                "floor": res.get("floor_us"), "config": res.get("config"),
            }  # fmt: skip
        else:
            row.setdefault("failed", []).append(f"{res['id']}: {status_text(res)}")
    out = []
    for key, row in pairs.items():
        for figure in ("cold", "warm"):
            times = {p: v[figure] for p, v in row["paths"].items() if v[figure] is not None}
            row[f"fastest_{figure}"] = min(times, key=times.get) if times else None
        t, o = (row["paths"].get(p, {}).get("cold") for p in ("torch", "triton"))
        row["speedup_cold"] = _ratio(t, o)
        row["target_us"] = FROM_HIDDEN_TARGETS_US.get(key)
        # the target is the adapters' default path's: joint (they join a CSA layer's weights) where the case ran
        # it, else auto, else ours
        row["target_path"] = next((p for p in ("joint", "auto") if p in row["paths"]), "triton")
        out.append(row)
    order = {"projection": 0, "layer": 1, "model-hidden": 2}
    return sorted(out, key=lambda r: (order[r["phase"]], r["model"], _kind_order(r["kind"] or "csa"), r["size"]))


def beside_rows(results: dict) -> list[dict]:
    """The ``layer`` cases run beside the engine's attention GEMM: per (model, kind, B, path) the layer alone
    (its plain case), the GEMMs alone and both on two streams, cold and warm, and ``overlap`` (cold): the share
    of the shorter of the two that running them together hid, ``(layer + gemm - both) / min(layer, gemm)``
    (1: fully hidden, 0: serialized)."""
    plain = {}
    for res in results.get("cases", []):
        c = res["case"]
        if c["phase"] == "layer" and not c.get("beside") and res.get("status") == "ok":
            plain[(c["model"], c["kind"], c["batch"], c["backend"])] = res
    out = []
    for res in results.get("cases", []):
        c = res["case"]
        if c["phase"] != "layer" or not c.get("beside"):
            continue
        key = (c["model"], c["kind"], c["batch"], c["backend"])
        row = {"model": key[0], "kind": key[1], "batch": key[2], "path": key[3], "id": res["id"]}
        if res.get("status") != "ok":
            row["failed"] = status_text(res)
            out.append(row)
            continue
        alone = plain.get(key)
        for figure, stat in (("cold", "graph"), ("warm", "warm")):
            layer = _median(alone.get(stat)) if alone else None
            gemm, both = _median(res["beside"].get(stat)), _median(res.get(stat))
            row[figure] = {"layer": layer, "gemm": gemm, "both": both}
            hidden = None
            if None not in (layer, gemm, both) and min(layer, gemm) > 0:
                hidden = (layer + gemm - both) / min(layer, gemm)
            row[figure]["overlap"] = hidden
        row["gemm_width"] = res["beside"].get("width")
        out.append(row)
    return out
