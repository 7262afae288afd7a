"""``dsv4-compressor bench`` / ``python -m dsv4_compressor bench``: the GPU benchmark's command line.

Examples::

    python -m dsv4_compressor bench --quick                       # < 3 minutes of GPU time
    python -m dsv4_compressor bench --preset c128                 # HCA decode: single-stage vs tiled (vs online)
    python -m dsv4_compressor bench --kinds hca --batch 16,64 --boundary none,every --no-prefill
    python -m dsv4_compressor bench --quick --perf docs/PERF.md   # also write docs/PERF.md from the results
    python -m dsv4_compressor.bench --quick --dry-run             # the case matrix and byte counts, no GPU

Without ``--quick``/``--preset`` the full matrix runs, trimmed by the axis flags; with a preset the flags
filter the preset's cases. Progress goes to stderr; the markdown table to stdout. Exit status: 0, 1 when a
case failed (its error is in the JSON and the table), 2 when the benchmark cannot run here (no CUDA GPU).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from .cases import (
    BACKENDS,
    BATCHES,
    BOUNDARIES,
    CHUNKS,
    KINDS,
    PRESETS,
    ROWS_PER_REQUEST,
    Case,
    case_traffic,
    choose_copies,
    filter_cases,
    full_cases,
    preset_cases,
)
from .floors import MEMORY_MTP_STEP, MEMORY_REQUESTS, kind_config, memory_table
from .report import fmt_bytes, markdown_table, new_results, render_perf, write_json

__all__ = ["main", "build_parser", "select_cases", "dry_run_text", "write_perf_file"]

NO_CUDA = "bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). Try --dry-run."
DEFAULT_L2 = 60 * 2**20  # H200


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------
# Arguments
# -------------------------------------------------------------------------------------------------
def _choices(allowed):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(items))

    return parse


def _size(text: str) -> int:
    t = text.strip().lower()
    scale = 1024 if t.endswith("k") else 1
    value = int(t[:-1] if t.endswith("k") else t)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value * scale


def _sizes(text: str) -> list[int]:
    try:
        out = [_size(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (8K = 8192), got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
    return list(dict.fromkeys(out))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-compressor bench",
        description="GPU benchmark of the compressor backends: CUDA-graph replay of whole per-layer steps, "
        "eager launches, floors (copy bandwidth, launch), memory. Writes a JSON file, a PNG plot and a "
        "markdown table.",
    )
    sel = p.add_argument_group("what to run")
    sel.add_argument("--quick", action="store_true", help="the quick preset (one device call, < 3 min)")
    sel.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="full (default), quick, c128 (HCA decode single vs tiled vs online), online (online HCA prefill "
        "and decode)",
    )
    sel.add_argument("--kinds", type=_choices(KINDS), default=None, help=f"subset of {','.join(KINDS)}")
    sel.add_argument("--backends", type=_choices(BACKENDS), default=None, help=f"subset of {','.join(BACKENDS)}")
    sel.add_argument("--batch", type=_sizes, default=None, help="decode requests per step (default 1,16,64,256)")
    sel.add_argument("--rows-per-request", type=_sizes, default=None, help="decode rows S per request (default 1,4)")
    sel.add_argument("--boundary", type=_choices(BOUNDARIES), default=None, help="none,every,realistic")
    sel.add_argument("--prefill", type=_sizes, default=None, help="prefill chunk sizes (default 512,8K,64K)")
    sel.add_argument("--carry", type=_choices(("no", "yes")), default=None, help="prefill carried partial group")
    sel.add_argument("--no-prefill", action="store_true", help="skip prefill cases")
    sel.add_argument("--no-decode", action="store_true", help="skip decode cases")
    how = p.add_argument_group("how")
    how.add_argument("--instances", type=_positive, default=20, help="layer instances per decode graph (20)")
    how.add_argument("--replays", type=_positive, default=200, help="timed replays per case (200)")
    how.add_argument("--warmup", type=_positive, default=20, help="untimed replays before timing (20)")
    how.add_argument("--max-copies", type=_positive, default=16, help="most rotated input copy sets (16)")
    how.add_argument("--max-copy-gib", type=float, default=2.0, help="most GiB of rotated input copies (2)")
    how.add_argument("--time-budget", type=float, default=None, help="skip remaining cases after this many s")
    how.add_argument("--seed", type=int, default=0)
    how.add_argument("--device", default="cuda")
    how.add_argument("--dry-run", action="store_true", help="print the cases and their byte counts; no GPU")
    out = p.add_argument_group("output")
    out.add_argument("--json", default="out/bench.json", help="results JSON (default out/bench.json)")
    out.add_argument("--plot", default="out/bench.png", help="PNG plot (default out/bench.png)")
    out.add_argument("--markdown", default=None, help="also write the markdown table here")
    out.add_argument("--perf", default=None, help="also write PERF.md here (e.g. docs/PERF.md)")
    return p


def select_cases(args: argparse.Namespace) -> tuple[str, list[Case]]:
    """The preset's name and its cases, trimmed by the axis flags."""
    preset = "quick" if args.quick else (args.preset or "full")
    carries = None if args.carry is None else [c == "yes" for c in args.carry]
    if preset == "full":
        cases = full_cases(
            kinds=args.kinds or KINDS,
            backends=args.backends or BACKENDS,
            batches=args.batch or BATCHES,
            rows=args.rows_per_request or ROWS_PER_REQUEST,
            boundaries=args.boundary or BOUNDARIES,
            chunks=args.prefill or CHUNKS,
            carries=carries if carries is not None else (False, True),
            instances=args.instances,
            decode=not args.no_decode,
            prefill=not args.no_prefill,
        )
        return preset, cases
    cases = filter_cases(
        preset_cases(preset, instances=args.instances),
        kinds=args.kinds,
        backends=args.backends,
        batches=args.batch,
        rows=args.rows_per_request,
        boundaries=args.boundary,
        chunks=args.prefill,
        carries=carries,
        decode=not args.no_decode,
        prefill=not args.no_prefill,
        instances=args.instances,
    )
    return preset, cases


def _command(argv: list[str]) -> str:
    prog = sys.argv[0] if sys.argv else ""
    if Path(prog).name == "dsv4-compressor":
        head = "dsv4-compressor bench"
    elif prog.endswith(("bench/__main__.py", "bench/cli.py")):
        head = "python -m dsv4_compressor.bench"
    else:
        head = "python -m dsv4_compressor bench"
    return " ".join([head, shlex.join(argv)]).strip()


# -------------------------------------------------------------------------------------------------
# Dry run
# -------------------------------------------------------------------------------------------------
def dry_run_text(cases: list[Case], args: argparse.Namespace, *, l2_bytes: int = DEFAULT_L2) -> str:
    """The case matrix with each case's bytes per layer and the input copies it would rotate (assuming an
    L2 of ``l2_bytes``), and the config-derived memory table."""
    lines = [
        f"{len(cases)} cases (rotated copies assume a {l2_bytes / 2**20:.0f} MiB L2; the online backend's cases run "
        "only if it is present at run time)",
        "",
        "| case | timing | instances | copies | entries/layer | rows read | state read | state written | "
        "entries written | bytes/layer |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in cases:
        traffic = case_traffic(case, 0, seed=args.seed)
        if traffic is None:
            lines.append(f"| {case.id} | n/a: {case.not_applicable()} | | | | | | | | |")
            continue
        cfg = kind_config(case.kind)
        inst = case.instances if case.timing == "graph" else 1
        if case.phase == "decode":
            per_copy = inst * case.batch * case.rows * cfg.row_width * 4
            replay = inst * traffic.total
        else:
            per_copy = case.chunk * cfg.row_width * 4
            replay = traffic.total
        copies = choose_copies(
            bytes_per_replay=replay,
            bytes_per_copy=per_copy,
            l2_bytes=l2_bytes,
            max_copies=args.max_copies,
            max_copy_bytes=int(args.max_copy_gib * 2**30),
        )
        timing = case.timing + (" + eager" if case.eager and case.timing == "graph" else "")
        lines.append(
            f"| {case.id} | {timing} | {inst} | {copies} | {traffic.closing_rows} | {fmt_bytes(traffic.rows_read)} | "
            f"{fmt_bytes(traffic.state_read)} | {fmt_bytes(traffic.state_written)} | "
            f"{fmt_bytes(traffic.entries_written)} | {fmt_bytes(traffic.total)} |"
        )
    lines += ["", _memory_text(memory_table(["reference", "triton-single", "triton-tiled"]))]
    return "\n".join(lines)


def _memory_text(rows: list[dict]) -> str:
    lines = [
        f"Memory at {MEMORY_REQUESTS} requests, mtp_step {MEMORY_MTP_STEP}: state per request per layer, all layers, "
        "and scratch (one region shared by all layers)",
        "",
        "| model | backend | HCA | CSA | indexer | per request | total | scratch | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for m in rows:
        s = m["state_per_request_per_layer"]
        lines.append(
            f"| {m['model']} | {m['backend']} | {fmt_bytes(s['hca'])} | {fmt_bytes(s['csa'])} | "
            f"{fmt_bytes(s['indexer'])} | {fmt_bytes(m['state_per_request_all_layers'])} | "
            f"{fmt_bytes(m['state_total'])} | {fmt_bytes(m['scratch'])} | {m['note'] or m['scratch_plan']} |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
# PERF.md
# -------------------------------------------------------------------------------------------------
def write_perf_file(
    results: dict,
    perf_path: str | Path,
    *,
    plot_path: str | Path | None = None,
    json_path: str | Path | None = None,
    replot: bool = False,
) -> Path:
    """Write ``perf_path`` from ``results``. The plot and the JSON are copied next to it (``<stem>.png``,
    ``<stem>.json``, lower-case) unless already there, so the page links files that live with it; with no
    plot file (or ``replot``) the plot is drawn from the results when matplotlib is available."""
    import shutil

    from .plot import plot_results

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

    plot_link = None if replot else beside(plot_path, ".png")
    if plot_link is None:
        drawn = plot_results(results, folder / f"{stem}.png")
        plot_link = Path(drawn).name if drawn else None
    json_link = beside(json_path, ".json")
    perf_path.write_text(render_perf(results, plot_link=plot_link, json_link=json_link))
    return perf_path


# -------------------------------------------------------------------------------------------------
# The run
# -------------------------------------------------------------------------------------------------
def _result_line(res: dict) -> str:
    if res["status"] != "ok":
        return f"    {res['status']}: {res.get('error') or res.get('note')}"
    g, e = res.get("graph"), res.get("eager")
    parts = []
    if g:
        parts.append(f"graph {g['median_us']:.2f} us/layer (p10 {g['p10_us']:.2f}, p90 {g['p90_us']:.2f})")
    if e:
        parts.append(f"eager {e['median_us']:.2f} us/layer")
    if res.get("x_floor"):
        parts.append(f"{res['gbps']:.0f} GB/s, {res['x_floor']:.1f}x floor")
    return "    " + "; ".join(parts) + (f" [{res['note']}]" if res.get("note") else "")


def _run(args: argparse.Namespace, argv: list[str], preset: str, cases: list[Case]) -> int:
    import torch

    from .env import environment
    from .runner import Runner, probe_online
    from .timing import CudaTimer, measure_copy_bandwidth, measure_launch_floor

    device = torch.device(args.device)
    if device.type != "cuda":
        _log(f"bench: --device must be a CUDA device, got {args.device!r}")
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    if args.replays < 200:
        _log(f"bench: warning: {args.replays} replays per case (the benchmark's figures use at least 200)")
    settings = {
        "replays": args.replays,
        "warmup": args.warmup,
        "instances": args.instances,
        "max_copies": args.max_copies,
        "max_copy_bytes": int(args.max_copy_gib * 2**30),
        "seed": args.seed,
        "time_budget_s": args.time_budget,
    }
    results = new_results(command=_command(argv), argv=argv, preset=preset, settings=settings)
    results["outputs"] = {"json": args.json, "plot": args.plot, "markdown": args.markdown, "perf": args.perf}
    t0 = time.perf_counter()
    results["env"] = environment(device)
    l2 = results["env"].get("l2_bytes") or DEFAULT_L2
    settings["l2_bytes"] = l2
    _log(f"bench: {results['env'].get('gpu')}, {len(cases)} cases ({preset}); results -> {args.json}")

    timer = CudaTimer(device)
    _log("floors: device-to-device copy bandwidth, empty-kernel launch floor")
    floors: dict = {}
    for name, measure in (("copy bandwidth", measure_copy_bandwidth), ("launch floor", measure_launch_floor)):
        try:
            floors.update(measure(timer))
        except Exception as exc:  # the cases still run; their floors are then reported as missing
            floors.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
            _log(f"    {name} failed: {type(exc).__name__}: {exc}")
    results["floors"] = floors
    _log(
        f"    copy {floors.get('copy_bw_GBps') or 0:.0f} GB/s; launch floor {floors.get('launch_floor_us') or 0:.2f} "
        f"us/kernel in a graph, eager empty launch {floors.get('eager_empty_launch_us') or 0:.2f} us"
    )

    problem, probe = probe_online(device, requests=MEMORY_REQUESTS, mtp_step=MEMORY_MTP_STEP)
    results["online"] = {"available": problem is None, "problem": problem, "probe": probe}
    _log(f"online backend: {'available' if problem is None else problem}")
    backends = ["reference", "triton-single", "triton-tiled", "online"]
    results["memory"] = memory_table(backends, {"online": probe} if probe else None)
    write_json(args.json, results)

    runner = Runner(
        timer,
        replays=args.replays,
        warmup=args.warmup,
        floors=floors,
        l2_bytes=l2,
        max_copies=args.max_copies,
        max_copy_bytes=int(args.max_copy_gib * 2**30),
        seed=args.seed,
        online_problem=problem,
        log=_log,
    )
    broken = None  # a failed case that left the CUDA context unusable (e.g. an illegal address)
    for i, case in enumerate(cases):
        elapsed = time.perf_counter() - t0
        skip = None
        if broken:
            skip = f"the CUDA context failed after {broken}"
        elif args.time_budget is not None and elapsed > args.time_budget:
            skip = f"time budget of {args.time_budget:.0f} s reached"
        if skip:
            res = {"id": case.id, "case": case.as_dict(), "status": "skipped", "note": skip, "error": None}
        else:
            _log(f"[{i + 1}/{len(cases)}] {case.id} ({elapsed:.0f} s)")
            c0 = time.perf_counter()
            res = runner.run(case)
            res["wall_s"] = time.perf_counter() - c0
            _log(_result_line(res))
            if res["status"] == "error":
                try:
                    torch.cuda.synchronize()
                except Exception as exc:  # sticky CUDA errors: every later case would fail the same way
                    broken = f"{case.id} ({type(exc).__name__}: {exc})"
        results["cases"].append(res)
        results["elapsed_s"] = time.perf_counter() - t0
        write_json(args.json, results)

    results["elapsed_s"] = time.perf_counter() - t0
    results["complete"] = True
    from .plot import plot_results

    results["outputs"]["plot"] = plot_results(results, args.plot) if args.plot else None
    write_json(args.json, results)
    table = markdown_table(results)
    print(table)
    print()
    print(_memory_text(results["memory"]))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table + "\n\n" + _memory_text(results["memory"]) + "\n")
    if args.perf:
        path = write_perf_file(results, args.perf, plot_path=results["outputs"]["plot"], json_path=args.json)
        _log(f"wrote {path}")
    errors = [r for r in results["cases"] if r["status"] == "error"]
    _log(f"bench: done in {results['elapsed_s']:.0f} s; {len(errors)} failed case(s); results in {args.json}")
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse printed it)
        return int(exc.code or 0)
    preset, cases = select_cases(args)
    if not cases:
        _log("bench: no case matches the given flags")
        return 2
    if args.dry_run:
        print(dry_run_text(cases, args))
        return 0
    import torch

    if not torch.cuda.is_available():
        _log(NO_CUDA)
        return 2
    return _run(args, argv, preset, cases)


if __name__ == "__main__":
    sys.exit(main())
