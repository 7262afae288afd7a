"""docs/PERF.md and its plot, made from a benchmark results JSON (``dsv4-compressor bench --json ...``).

Used by ``scripts/write_perf.py``. Everything here reads the results dict (:mod:`benchmarks.results`) and nothing
else, so every number on the page comes from a measurement or a byte count of that run; missing measurements
print as ``-`` or "not measured". The targets (:mod:`.targets`) are compared with the run's figures, never used
as figures.

- :mod:`.rows`: the comparisons as rows of numbers;
- :mod:`.page`: the page's text (:func:`render_perf`);
- :mod:`.plot`: the plot (:func:`plot_results`, needs matplotlib);
- here: :func:`write_perf_file` (the page with its plot and JSON beside it) and :func:`compare_markdown` (an A/B
  page of two runs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..results import fmt_us
from .page import render_perf
from .plot import plot_results
from .rows import (
    _median,
    _ok,
    _ratio,
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
from .targets import FROM_HIDDEN_TARGETS_US

__all__ = [
    "render_perf",
    "plot_results",
    "write_perf_file",
    "c128_rows",
    "online_target_rows",
    "pick_table",
    "warm_rows",
    "s1_rows",
    "model_rows",
    "plan_rows",
    "dispatch_rows",
    "cache_step_rows",
    "projection_rows",
    "beside_rows",
    "compare_markdown",
    "FROM_HIDDEN_TARGETS_US",
]


def compare_markdown(base: dict, other: dict) -> str:
    """A page comparing two runs case by case (an A/B of one setting, e.g. ``DSV4_STEP_TABLES_IN_PLAN_LAUNCH=1``
    against the default, on one GPU): the cold (``graph``) and warm medians of every case both measured, and
    other over base. Cases only one run measured are listed by id."""
    mine = {r["id"]: r for r in _ok(other)}
    rows, only = [], []
    for res in _ok(base):
        theirs = mine.pop(res["id"], None)
        if theirs is None:
            only.append(f"`{res['id']}` (base only)")
            continue
        cells = [f"`{res['id']}`"]
        for key in ("graph", "warm"):
            a, b = _median(res.get(key)), _median(theirs.get(key))
            ratio = _ratio(b, a)
            cells += [fmt_us(a), fmt_us(b), "-" if ratio is None else f"{ratio:.3f}"]
        rows.append(cells)
    only += [f"`{case}` (other only)" for case in mine]

    def run(results: dict) -> str:
        env = results.get("env", {})
        switches = ", ".join(f"{k}={v}" for k, v in env.get("settings", {}).items()) or "defaults"
        return f"commit {env.get('commit', '?')}, {env.get('gpu') or '?'}, {env.get('date', '?')}, {switches}"

    lines = [
        "# A/B of two benchmark runs",
        "",
        f"- base: {run(base)}",
        f"- other: {run(other)}",
        "",
        "us per layer instance (per step for whole-model cases); cold = the graph with inputs and weights "
        "rotated past L2, warm = back-to-back replays.",
        "",
        "| case | cold base | cold other | other / base | warm base | warm other | other / base |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]
    if only:
        lines += ["", "Measured in one run only: " + ", ".join(only) + "."]
    return "\n".join(lines) + "\n"


def write_perf_file(
    results: dict,
    perf_path: str | Path,
    *,
    plot_path: str | Path | None = None,
    json_path: str | Path | None = None,
) -> Path:
    """Write ``perf_path`` from ``results``, with the plot and the JSON next to it (``<stem>.png``, ``<stem>.json``,
    lower-case) so the page links files that live with it. ``plot_path``: an existing plot of the same run to copy;
    without one the plot is drawn from the results (when matplotlib is available)."""
    perf_path = Path(perf_path)
    folder = perf_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    stem = perf_path.stem.lower()

    def beside(src: str | Path | None, suffix: str) -> str | None:
        if src is None or not Path(src).is_file():
            return None
        dst = folder / f"{stem}{suffix}"
        if Path(src).resolve() != dst.resolve():
            shutil.copyfile(src, dst)
        return dst.name

    plot_link = beside(plot_path, ".png")
    if plot_link is None:
        drawn = plot_results(results, folder / f"{stem}.png")
        plot_link = Path(drawn).name if drawn else None
    json_link = beside(json_path, ".json")
    perf_path.write_text(render_perf(results, plot_link=plot_link, json_link=json_link))
    return perf_path
