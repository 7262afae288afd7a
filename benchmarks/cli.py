"""``dsv4-compressor bench`` / ``python -m dsv4_compressor bench`` / ``python -m benchmarks`` (from the repository
root): the GPU benchmark's command line.

Examples::

    python -m dsv4_compressor bench --quick                       # every measurement, a few minutes of GPU time
    python -m dsv4_compressor bench --preset c128                 # HCA decode: single-stage vs tiled (vs online)
    python -m dsv4_compressor bench --quick --phases model,plan   # only the whole-model steps and build_plan
    python -m dsv4_compressor bench --preset projection           # from hidden states: cuBLAS vs ours, layers, step
    python -m dsv4_compressor bench --kinds hca --batch 16,64 --boundary none,every --phases decode
    python -m benchmarks --quick --dry-run                        # the cases and their byte counts, no GPU
    python scripts/write_perf.py out/bench.json                   # docs/PERF.md (and its plot) from the results

Without ``--quick``/``--preset`` the full matrix runs, trimmed by the axis flags; with a preset the flags
filter the preset's cases. Progress goes to stderr; a summary table to stdout; the results to ``--json``.
Exit status: 0, 1 when a case failed (its error is in the JSON and the table), 2 when the benchmark cannot run
here (no CUDA GPU).
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
    HIDDEN,
    KINDS,
    MODEL_NAMES,
    PHASES,
    PLAN_ROWS,
    PRESETS,
    ROWS_PER_REQUEST,
    Case,
    case_traffic,
    choose_copies,
    extra_cases,
    filter_cases,
    full_cases,
    layer_kinds,
    model_footprint,
    model_launches,
    model_layers,
    online_splits,
    op_launches,
    plan_step,
    preset_cases,
    projection_bytes,
    projection_cases,
    projection_width,
)
from .floors import MEMORY_MTP_STEP, MEMORY_REQUESTS, kind_config, memory_table
from .results import fmt_bytes, new_results, summary_table, table, write_json

__all__ = ["main", "build_parser", "select_cases", "dry_run_text"]

NO_CUDA = "bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). Try --dry-run."
DEFAULT_L2 = 60 * 2**20  # an H200's L2


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
        description="GPU benchmark of the compressor ops: per-layer decode (cold and warm CUDA-graph replay, "
        "eager launches) and prefill, build_plan, the dispatcher's and cache.step's host time, whole-model decode "
        "steps, floors (copy bandwidth, launch), memory. Writes a results JSON (scripts/write_perf.py turns it "
        "into docs/PERF.md) and prints a summary table.",
    )
    sel = p.add_argument_group("what to run")
    sel.add_argument("--quick", action="store_true", help="the quick preset (one device call, a few minutes)")
    sel.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="full (default), quick, c128 (HCA decode single vs tiled vs online), online (online HCA prefill "
        "and decode), host (build_plan, dispatcher, cache.step), model (whole-model decode steps)",
    )
    sel.add_argument("--phases", type=_choices(PHASES), default=None, help=f"subset of {','.join(PHASES)}")
    sel.add_argument("--kinds", type=_choices(KINDS), default=None, help=f"subset of {','.join(KINDS)}")
    sel.add_argument("--backends", type=_choices(BACKENDS), default=None, help=f"subset of {','.join(BACKENDS)}")
    sel.add_argument("--batch", type=_sizes, default=None, help="requests per step (default 1,16,64,256)")
    sel.add_argument("--rows-per-request", type=_sizes, default=None, help="decode rows S per request (default 1,4)")
    sel.add_argument("--boundary", type=_choices(BOUNDARIES), default=None, help=",".join(BOUNDARIES))
    sel.add_argument("--prefill", type=_sizes, default=None, help="prefill chunk sizes (default 512,8K,64K)")
    sel.add_argument("--carry", type=_choices(("no", "yes")), default=None, help="prefill carried partial group")
    sel.add_argument(
        "--plan-rows", type=_sizes, default=None, help=f"build_plan step rows (default {','.join(map(str, PLAN_ROWS))})"
    )
    sel.add_argument("--models", type=_choices(tuple(MODEL_NAMES)), default=None, help="whole-model steps: flash,pro")
    sel.add_argument("--no-prefill", action="store_true", help="skip prefill cases")
    sel.add_argument("--no-decode", action="store_true", help="skip per-layer decode cases")
    how = p.add_argument_group("how")
    how.add_argument("--instances", type=_positive, default=20, help="layer instances per decode graph (20)")
    how.add_argument("--replays", type=_positive, default=200, help="timed replays per graph figure (200)")
    how.add_argument("--warmup", type=_positive, default=20, help="untimed replays before timing (20)")
    how.add_argument("--warm-replays", type=_positive, default=40, help="timed replays of a warm figure (40)")
    how.add_argument("--host-calls", type=_positive, default=200, help="eager calls per dispatch round (200)")
    how.add_argument("--host-rounds", type=_positive, default=5, help="dispatch rounds (5)")
    how.add_argument("--host-steps", type=_positive, default=50, help="timed cache.step calls (50)")
    how.add_argument("--max-copies", type=_positive, default=16, help="most rotated input copy sets (16)")
    how.add_argument("--max-copy-gib", type=float, default=2.0, help="most GiB of rotated input copies (2)")
    how.add_argument("--time-budget", type=float, default=None, help="skip remaining cases after this many s")
    how.add_argument("--seed", type=int, default=0)
    how.add_argument("--device", default="cuda")
    how.add_argument("--dry-run", action="store_true", help="print the cases and their byte counts; no GPU")
    out = p.add_argument_group("output")
    out.add_argument("--json", default="out/bench.json", help="results JSON (default out/bench.json)")
    return p


def _phases(args: argparse.Namespace) -> list[str]:
    phases = list(args.phases or PHASES)
    if args.no_decode:
        phases = [x for x in phases if x != "decode"]
    if args.no_prefill:
        phases = [x for x in phases if x != "prefill"]
    return phases


def select_cases(args: argparse.Namespace) -> tuple[str, list[Case]]:
    """The preset's name and its cases, trimmed by the axis flags."""
    preset = "quick" if args.quick else (args.preset or "full")
    carries = None if args.carry is None else [c == "yes" for c in args.carry]
    phases = _phases(args)
    axes = dict(
        kinds=args.kinds,
        backends=args.backends,
        batches=args.batch,
        rows=args.rows_per_request,
        boundaries=args.boundary,
        chunks=args.prefill,
        carries=carries,
        plan_rows=args.plan_rows,
        models=args.models,
        phases=phases,
        instances=args.instances,
    )
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
            decode="decode" in phases,
            prefill="prefill" in phases,
        )
        extra = extra_cases(args.instances) + projection_cases(args.instances)
        return preset, cases + filter_cases(extra, **axes)
    return preset, filter_cases(preset_cases(preset, instances=args.instances), **axes)


def _command(argv: list[str]) -> str:
    prog = sys.argv[0] if sys.argv else ""
    if Path(prog).name == "dsv4-compressor":
        head = "dsv4-compressor bench"
    elif prog.endswith(("bench/__main__.py", "bench/cli.py")):
        head = "python -m benchmarks"
    else:
        head = "python -m dsv4_compressor bench"
    return " ".join([head, shlex.join(argv)]).strip()


# -------------------------------------------------------------------------------------------------
# Dry run
# -------------------------------------------------------------------------------------------------
def dry_run_text(cases: list[Case], args: argparse.Namespace, *, l2_bytes: int = DEFAULT_L2) -> str:
    """The cases, phase by phase, with what each measures: bytes per layer and the input copies a cold figure
    would rotate (assuming an L2 of ``l2_bytes``), the plan's size, the host calls, the whole-model steps'
    bytes, launches and device memory; then the config-derived memory table."""
    lines = [
        f"{len(cases)} cases (rotated copies assume a {l2_bytes / 2**20:.0f} MiB L2; the online backend's cases run "
        "only if it is present at run time)",
        "",
    ]
    by_phase = {phase: [c for c in cases if c.phase == phase] for phase in ("decode", "prefill")}
    layer_cases = by_phase["decode"] + by_phase["prefill"]
    if layer_cases:
        lines += [_layer_table(layer_cases, args, l2_bytes), ""]
    plans = [c for c in cases if c.phase == "plan"]
    if plans:
        rows = []
        for c in plans:
            starts, counts = plan_step(c, seed=args.seed)
            r = kind_config(c.kind).ratio
            rows.append([c.id, c.chunk, len(counts), r, "decode" if max(counts) <= c.rows else "mixed", c.instances])
        lines += [
            "build_plan: a CUDA graph of N launches, us per launch",
            "",
            table(["case", "rows", "requests", "ratio", "step", "launches per graph"], rows, align="lrrrlr"),
            "",
        ]
    host = [c for c in cases if c.phase in ("dispatch", "cache-step")]
    if host:
        rows = []
        for c in host:
            if c.phase == "dispatch":
                op = "compress_online_hca" if c.backend == "online" else "compress"
                what = (
                    f"host us per eager call: ops.{op} vs torch.ops.dsv4c.{op}, ops.build_plan vs "
                    f"torch.ops.dsv4c.build_plan ({args.host_rounds} rounds of {args.host_calls} calls)"
                )
            else:
                what = (
                    f"host us per cache.step of {c.batch} requests x {c.rows} rows, mtp_step {c.mtp_step}, "
                    f"check_finite off (median of {args.host_steps} steps)"
                )
            rows.append([c.id, what])
        lines += ["Host time", "", table(["case", "what"], rows, align="ll"), ""]
    models = [c for c in cases if c.phase == "model"]
    if models:
        rows = []
        for c in models:
            layers = model_layers(c.model)
            mem = model_footprint(c, seed=args.seed)
            rows.append(
                [
                    c.id,
                    " + ".join(f"{n} {k}" for k, n in layers.items()),
                    model_launches(c),
                    fmt_bytes(case_traffic(c, seed=args.seed).total),
                    fmt_bytes(mem["state"]),
                    fmt_bytes(mem["pools"]),
                    fmt_bytes(mem["kv_score"]),
                    fmt_bytes(mem["scratch"]),
                    fmt_bytes(mem["total"]),
                ]
            )
        lines += [
            "Whole-model decode steps: both plans and every layer's op in one CUDA graph, warm and cold (L2 flushed)",
            "",
            table(
                ["case", "layers", "launches", "bytes/step", "state", "pools", "kv_score", "scratch", "device memory"],
                rows,
            ),
            "",
        ]
    hidden = [c for c in cases if c.phase in ("projection", "layer", "model-hidden")]
    if hidden:
        lines += [_hidden_table(hidden, args), ""]
    lines += [_memory_text(memory_table(["reference", "triton-single", "triton-tiled"]))]
    return "\n".join(lines)


def _hidden_table(cases: list[Case], args: argparse.Namespace) -> str:
    """The cases from hidden states: what each times and the bytes its floor counts (weights, ``x``, and the
    compression's own bytes; a projection alone also writes ``kv_score``)."""
    rows = []
    for c in cases:
        dim = HIDDEN[c.model]
        if c.phase == "projection":
            width = projection_width(c.kind)
            what = f"{c.instances} x [{c.chunk}, {dim}] @ [{width}, {dim}].T, distinct weights"
            if c.kind == "pair":
                what += " (CSA main + indexer: one GEMM of the concatenated weight / ours over both, one launch)"
            total = projection_bytes(width, dim, c.chunk)["total"]
        elif c.phase == "layer":
            kinds = layer_kinds(c.kind)
            what = f"{c.instances} layers ({' + '.join(kinds)}), B={c.batch} x S={c.rows}, D={dim}"
            total = case_traffic(c, seed=args.seed).total
            total += sum(projection_bytes(kind_config(k).row_width, dim, c.batch * c.rows)["read"] for k in kinds)
        else:
            what = f"plans + {sum(model_layers(c.model).values())} projections and compressions, B={c.batch}"
            total = case_traffic(c, seed=args.seed).total
            total += sum(
                n * projection_bytes(kind_config(k).row_width, dim, c.batch * c.rows)["read"]
                for k, n in model_layers(c.model).items()
            )
        rows.append([c.id, c.backend, what, fmt_bytes(total)])
    return (
        "From hidden states (projection path torch = cuBLAS via torch.mm, triton = ours, auto = the faster per shape): "
        "CUDA graphs, warm and cold "
        "(L2 flushed)\n\n" + table(["case", "projection", "what", "floor bytes"], rows, align="llll")
    )


def _layer_table(cases: list[Case], args: argparse.Namespace, l2_bytes: int) -> str:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the launches listed would run
    rows = []
    for case in cases:
        traffic = case_traffic(case, 0, seed=args.seed)
        if traffic is None:
            rows.append([case.id, f"n/a: {case.not_applicable()}"] + [""] * 9)
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
        timing = case.timing
        if case.timing == "graph":
            timing = "graph cold" + (" + warm" if case.phase == "decode" else "")
        timing += " + eager" if case.eager and case.timing == "graph" else ""
        split = online_splits(case, device)
        launches = op_launches(case.kind, case.backend, decode=case.phase == "decode", requests=case.batch,
                               split=split)  # fmt: skip
        rows.append(
            [
                case.id, timing, inst, copies, "-" if launches is None else launches, traffic.closing_rows,
                fmt_bytes(traffic.rows_read), fmt_bytes(traffic.state_read), fmt_bytes(traffic.state_written),
                fmt_bytes(traffic.entries_written), fmt_bytes(traffic.total),
            ]
        )  # fmt: skip
    header = ["case", "timing", "instances", "copies", "launches", "entries/layer", "rows read", "state read",
              "state written", "entries written", "bytes/layer"]  # fmt: skip
    return table(header, rows, align="llrrrrrrrrr")


def _memory_text(rows: list[dict]) -> str:
    body = []
    for m in rows:
        s = m["state_per_request_per_layer"]
        body.append(
            [
                m["model"], m["backend"], fmt_bytes(s["hca"]), fmt_bytes(s["csa"]), fmt_bytes(s["indexer"]),
                fmt_bytes(m["state_per_request_all_layers"]), fmt_bytes(m["state_total"]), fmt_bytes(m["scratch"]),
                m["note"] or m["scratch_plan"],
            ]
        )  # fmt: skip
    header = ["model", "backend", "HCA", "CSA", "indexer", "per request", "total", "scratch", "note"]
    return (
        f"Memory at {MEMORY_REQUESTS} requests, mtp_step {MEMORY_MTP_STEP}: state per request per layer, all layers, "
        "and scratch (one region shared by all layers)\n\n" + table(header, body, align="llrrrrrrl")
    )


# -------------------------------------------------------------------------------------------------
# The run
# -------------------------------------------------------------------------------------------------
def _result_line(res: dict) -> str:
    """One progress line: the case's figures as measured."""
    if res["status"] != "ok":
        return f"    {res['status']}: {res.get('error') or res.get('note')}"
    parts = []
    for key, label in (("graph", "cold graph"), ("warm", "warm graph"), ("eager", "eager")):
        stats = res.get(key)
        if stats:
            parts.append(f"{label} {stats['median_us']:.2f} (p10 {stats['p10_us']:.2f}, p90 {stats['p90_us']:.2f})")
    if res["case"]["phase"] == "dispatch":
        parts += [f"{label} {stats['median_us']:.2f}" for label, stats in res["host"].items()]
    elif res["case"]["phase"] == "cache-step":
        parts.append(f"cache.step {res['host']['median_us']:.2f}")
    text = "; ".join(parts) + f" {res.get('unit', '')}"
    if res.get("x_floor"):
        text += f"; {res['gbps']:.0f} GB/s, {res['x_floor']:.1f}x floor"
    if res.get("memory"):
        text += f"; device memory {fmt_bytes(res['memory']['total'])}"
    return "    " + text + (f" [{res['note']}]" if res.get("note") else "")


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
        "warm_replays": args.warm_replays,
        "instances": args.instances,
        "host_calls": args.host_calls,
        "host_rounds": args.host_rounds,
        "host_steps": args.host_steps,
        "max_copies": args.max_copies,
        "max_copy_bytes": int(args.max_copy_gib * 2**30),
        "seed": args.seed,
        "time_budget_s": args.time_budget,
    }
    results = new_results(command=_command(argv), argv=argv, preset=preset, settings=settings)
    results["outputs"] = {"json": args.json}
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
        warm_replays=args.warm_replays,
        host_calls=args.host_calls,
        host_rounds=args.host_rounds,
        host_steps=args.host_steps,
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
    write_json(args.json, results)
    print(summary_table(results))
    print()
    print(_memory_text(results["memory"]))
    errors = [r for r in results["cases"] if r["status"] == "error"]
    _log(f"bench: done in {results['elapsed_s']:.0f} s; {len(errors)} failed case(s); results in {args.json}")
    _log(f"bench: python scripts/write_perf.py {args.json} --out docs/PERF.md  (the page and its plot)")
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
