#!/usr/bin/env python3
"""Write docs/PERF.md (and its plot) from a benchmark results JSON (``dsv4-compressor bench --json ...``).

Usage::

    python scripts/write_perf.py out/bench.json                   # -> docs/PERF.md (+ docs/perf.png, docs/perf.json)
    python scripts/write_perf.py out/bench.json --out out/PERF.md --plot out/bench.png
    python scripts/write_perf.py out/base.json --compare out/other.json --out out/ab.md   # an A/B page

The plot and the JSON are placed next to PERF.md so the page links files that live with it: ``--plot`` names an
existing plot of the same run to copy; without one the plot is drawn from the JSON (needs matplotlib). Every
number on the page comes from the JSON (the page is made by ``benchmarks/report``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import dsv4_compressor  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the checkout's benchmarks/ (not installed with the package)
from benchmarks.report import compare_markdown, write_perf_file  # noqa: E402
from benchmarks.results import load_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results JSON written by the benchmark")
    parser.add_argument("--out", default="docs/PERF.md", help="where to write (default docs/PERF.md)")
    parser.add_argument("--plot", default=None, help="an existing plot PNG of the same run (default: draw one)")
    parser.add_argument("--compare", default=None, help="a second run's JSON: write the A/B page of the two")
    args = parser.parse_args(argv)
    try:
        results = load_json(args.results)
        other = load_json(args.compare) if args.compare else None
    except (OSError, ValueError) as exc:
        print(f"write_perf: {exc}", file=sys.stderr)
        return 2
    if other is not None:
        Path(args.out).write_text(compare_markdown(results, other))
        print(f"wrote {args.out}")
        return 0
    path = write_perf_file(results, args.out, plot_path=args.plot, json_path=args.results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
