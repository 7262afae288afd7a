"""The plot of docs/PERF.md: decode latency per layer against batch size, per backend and boundary case."""

from __future__ import annotations

import sys
from pathlib import Path

from ..cases import BACKENDS
from .rows import _backend_order, _boundary_order, _kind_order, _median, _ok

__all__ = ["plot_results"]


# -------------------------------------------------------------------------------------------------
# The plot
# -------------------------------------------------------------------------------------------------
def _series(results: dict) -> dict:
    """``{(kind, S): {boundary: {backend: [(B, cold, p10, p90, warm)]}}}`` of decode cases timed in a graph."""
    out: dict = {}
    for res in _ok(results, "decode"):
        c, stats = res["case"], res.get("graph")
        if not stats:
            continue
        panel = out.setdefault((c["kind"], c["rows"]), {}).setdefault(c["boundary"], {})
        point = (c["batch"], stats["median_us"], stats["p10_us"], stats["p90_us"], _median(res.get("warm")))
        panel.setdefault(c["backend"], []).append(point)
    return out


def plot_results(results: dict, path: str | Path) -> str | None:
    """Decode latency per layer against batch size, one line per backend (cold, with its p10–p90; warm dotted),
    one panel per measured (kind, rows per request, boundary case). Returns the path, or ``None`` (with a warning
    on stderr) when matplotlib is missing or there is nothing to plot."""
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
    panels = sorted(
        ((kind, s, boundary) for (kind, s), by_boundary in series.items() for boundary in by_boundary),
        key=lambda k: (_kind_order(k[0]), k[1], _boundary_order(k[2])),
    )
    cols = min(3, len(panels))
    grid_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.4 * cols, 3.4 * grid_rows), squeeze=False)
    colors = {b: f"C{i}" for i, b in enumerate(BACKENDS)}
    instances = results.get("settings", {}).get("instances")
    for ax in axes.flat[len(panels) :]:
        ax.set_axis_off()
    for ax, (kind, s, boundary) in zip(axes.flat, panels):
        panel = series[(kind, s)][boundary]
        ax.set_title(f"{kind.upper()} decode, S={s}, boundary: {boundary}", fontsize=9)
        for backend in sorted(panel, key=_backend_order):
            pts = sorted(panel[backend])
            xs = [p[0] for p in pts]
            med = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            color = colors.get(backend)
            ax.errorbar(xs, med, yerr=err, marker="o", ms=3, capsize=2, label=f"{backend} (cold)", color=color)
            warm = [(p[0], p[4]) for p in pts if p[4] is not None]
            if warm:
                ax.plot(*zip(*warm), ls=":", marker=".", color=color, label=f"{backend} (warm)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        batches = sorted({p[0] for pts in panel.values() for p in pts})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        values = [v for pts in panel.values() for p in pts for v in (p[1], p[4]) if v]
        # minor ticks are labelled only within a decade, where no major tick may fall
        small_range = max(values) < 10 * min(values)
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g") if small_range else ticker.NullFormatter())
        ax.set_xlabel("requests (B)")
        ax.set_ylabel("us per layer")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    gpu = results.get("env", {}).get("gpu") or "GPU"
    fig.suptitle(
        f"dsv4-compressor decode step per layer on {gpu} (CUDA graph of {instances} layer instances, median, "
        "p10–p90; dotted: warm)",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
