"""The results file: its schema, writing and reading it, and the number formats and one-table summary the
command line prints. Pages made from a results file (``docs/PERF.md``, the plot) are the job of
``bench/report.py``; everything they show comes from this JSON.

A results dict (:func:`new_results`) holds the command, settings, the environment (date, GPU, versions, git
commit: :func:`.env.environment`), the floors, the memory table, and one entry per case: ``id``, ``case``
(the :class:`~.cases.Case` fields), ``status`` (``ok``, ``n/a``, ``skipped``, ``error``), ``note``,
``error``, the headline figure ``us`` with its ``unit``, and the phase's own figures (``graph`` = cold,
``warm``, ``eager``, ``host``; per-call samples and their spread, see :func:`.timing.summarize`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "SCHEMA",
    "READABLE_SCHEMAS",
    "new_results",
    "write_json",
    "load_json",
    "table",
    "status_text",
    "summary_table",
    "fmt_us",
    "fmt_num",
    "fmt_gbps",
    "fmt_bytes",
]

SCHEMA = "dsv4-compressor-bench/2"
#: Files of the first schema (decode and prefill only, no warm figures) still load; what they lack is missing.
READABLE_SCHEMAS = ("dsv4-compressor-bench/1", SCHEMA)


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
    if results.get("schema") not in READABLE_SCHEMAS:
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


def table(header: list[str], rows: Iterable[list], align: str | None = None) -> str:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _median(stats: dict | None) -> float | None:
    return stats["median_us"] if stats else None


def status_text(res: dict) -> str:
    if res.get("status") == "ok":
        return res.get("note") or ""
    text = res.get("error") or res.get("note") or ""
    return f"{res.get('status')}: {text}".strip()


def summary_table(results: dict) -> str:
    """Every case, one row: the headline figure and its unit, the cold (graph), warm and eager medians where
    the case has them, bandwidth and position against the floor."""
    rows = []
    for res in results.get("cases", []):
        us = res.get("us", res.get("us_per_layer"))
        rows.append(
            [
                res["id"],
                fmt_us(us),
                res.get("unit", "") if us is not None else "",
                fmt_us(_median(res.get("graph"))),
                fmt_us(_median(res.get("warm"))),
                fmt_us(_median(res.get("eager"))),
                fmt_gbps(res.get("gbps")),
                fmt_num(res.get("x_floor"), 1, "x"),
                status_text(res),
            ]
        )
    header = ["case", "us", "unit", "graph (cold)", "graph (warm)", "eager", "GB/s", "x floor", "note"]
    return table(header, rows, align="lrlrrrrrl")
