"""The PNG plot: decode latency per layer against batch size, one line per backend, one panel per boundary
case (a row of panels per kind and rows-per-request), from a results dict. matplotlib (Agg) is optional."""

from __future__ import annotations

import sys
from pathlib import Path

from .cases import BACKENDS, BOUNDARIES

__all__ = ["plot_results"]

_KIND_ORDER = ("hca", "csa", "indexer")


def _series(results: dict) -> dict:
    """``{(kind, S): {boundary: {backend: [(B, median, p10, p90)]}}}`` of decode cases timed in a graph."""
    out: dict = {}
    for res in results.get("cases", []):
        c = res["case"]
        stats = res.get("graph")
        if c["phase"] != "decode" or res.get("status") != "ok" or not stats:
            continue
        panel = out.setdefault((c["kind"], c["rows"]), {}).setdefault(c["boundary"], {})
        panel.setdefault(c["backend"], []).append((c["batch"], stats["median_us"], stats["p10_us"], stats["p90_us"]))
    return out


def plot_results(results: dict, path: str | Path) -> str | None:
    """Write the plot to ``path``; returns the path, or ``None`` (with a warning on stderr) when matplotlib is
    missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        print("warning: matplotlib is not installed; no plot written", file=sys.stderr)
        return None
    series = _series(results)
    if not series:
        print("warning: no decode figures measured in a CUDA graph; no plot written", file=sys.stderr)
        return None
    rows = sorted(series, key=lambda k: (_KIND_ORDER.index(k[0]) if k[0] in _KIND_ORDER else 9, k[1]))
    boundaries = [b for b in BOUNDARIES if any(b in series[r] for r in rows)]
    fig, axes = plt.subplots(
        len(rows), len(boundaries), figsize=(4.2 * len(boundaries), 3.4 * len(rows)), squeeze=False
    )
    colors = {b: f"C{i}" for i, b in enumerate(BACKENDS)}
    instances = results.get("settings", {}).get("instances")
    for i, (kind, s) in enumerate(rows):
        for j, boundary in enumerate(boundaries):
            ax = axes[i][j]
            panel = series[(kind, s)].get(boundary)
            ax.set_title(f"{kind.upper()} decode, S={s}, boundary: {boundary}", fontsize=9)
            if not panel:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            for backend in sorted(panel, key=lambda b: BACKENDS.index(b) if b in BACKENDS else 9):
                pts = sorted(panel[backend])
                xs = [p[0] for p in pts]
                med = [p[1] for p in pts]
                lo = [p[1] - p[2] for p in pts]
                hi = [p[3] - p[1] for p in pts]
                ax.errorbar(
                    xs, med, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=backend, color=colors.get(backend)
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            batches = sorted({p[0] for pts in panel.values() for p in pts})
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
            ax.set_xlabel("requests (B)")
            ax.set_ylabel("us per layer")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    gpu = results.get("env", {}).get("gpu") or "GPU"
    fig.suptitle(
        f"dsv4-compressor decode step per layer on {gpu} (CUDA graph of {instances} layer instances, median, p10–p90)",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
