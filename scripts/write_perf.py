#!/usr/bin/env python3
"""Write docs/PERF.md from a benchmark results JSON (``dsv4-compressor bench --json ...``).

Usage::

    python scripts/write_perf.py out/bench.json                   # -> docs/PERF.md (+ docs/perf.png, docs/perf.json)
    python scripts/write_perf.py out/bench.json --plot out/bench.png --out docs/PERF.md

The plot and the JSON are copied next to PERF.md so the page links files that live with it; without a plot
file the plot is drawn from the JSON (needs matplotlib). Every number on the page comes from the JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from dsv4_compressor.bench.cli import write_perf_file
    from dsv4_compressor.bench.report import load_json
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from dsv4_compressor.bench.cli import write_perf_file
    from dsv4_compressor.bench.report import load_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results JSON written by the benchmark")
    parser.add_argument("--out", default="docs/PERF.md", help="where to write (default docs/PERF.md)")
    parser.add_argument("--plot", default=None, help="plot PNG of the same run (default: the one the JSON names)")
    parser.add_argument("--replot", action="store_true", help="draw the plot from the JSON instead of copying one")
    args = parser.parse_args(argv)
    try:
        results = load_json(args.results)
    except (OSError, ValueError) as exc:
        print(f"write_perf: {exc}", file=sys.stderr)
        return 2
    plot = args.plot or (results.get("outputs") or {}).get("plot")
    path = write_perf_file(results, args.out, plot_path=plot, json_path=args.results, replot=args.replot)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
