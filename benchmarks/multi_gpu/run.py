"""The run of one rank from start to end (:func:`run`; :func:`main` parses the command line): set up, capture the
decode graph, schedule and run the forwards in lockstep with the other ranks, check, write the checks' report,
time, and write the final report. Returns the exit status: 0 when every check on every rank passed."""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.integrations.lightllm import layer as adapter_layer
from dsv4_compressor.integrations.lightllm import step as adapter_step

from .checks import tp_compare, verify_entries
from .engine import Engine
from .options import FULL, SMALL, parse_args
from .report import _lockstep, _report, _timing_summary, _write, summary
from .runtime import Dist, TorchOps
from .scheduler import Scheduler
from .timing import run_timing, snapshot_step


def run(args) -> int:
    t0 = time.perf_counter()
    ctx = Dist(args)
    if args.dispatch == "torch-ops" and not isinstance(adapter.ops, TorchOps):
        routed = TorchOps(adapter.ops)
        for module in (adapter, adapter_layer, adapter_step):  # the adapter's modules that call ops, at every call
            module.ops = routed
    shapes = SMALL if args.small else FULL
    S = args.mtp_step + 1
    seed = args.seed + (1000 * ctx.rank if args.mode == "dp" else 0)  # TP replicas: the same everything
    max_len = -(-(args.max_prompt + S * args.decode_steps + S) // shapes.swa_page) * shapes.swa_page
    eng = Engine(args, shapes, ctx, max_len=max_len, seed=seed)
    sched = Scheduler(args, eng, ctx.rank, np.random.default_rng(seed + 17))
    ctx.sync()
    t_setup = time.perf_counter()
    eng.capture_decode()
    ctx.sync()
    t_capture = time.perf_counter()
    failures: list[str] = []
    snap, checks, it, last_decode = None, [], 0, []
    want_timing = args.timing_samples > 0
    while True:
        sched.admit(it)
        prefill, decode = sched.plan(it)
        prefill_rows = sum(n for _, _, n in prefill) if prefill else S
        local = [int(bool(prefill)), int(bool(decode)), prefill_rows, int(sched.unfinished()), -len(decode)]
        flags = ctx.all_max(local)  # LightLLM's DP backend: every rank runs the forwards any rank needs
        if flags[0]:
            eng.forward_prefill(prefill, moe_rows=flags[2])
        if flags[1]:
            eng.forward_decode(decode)
            last_decode = decode
            if want_timing and snap is None and -flags[4] == eng.G:  # every rank decoded a full batch: time it later
                snap = snapshot_step(eng, decode)
        sched.commit(it, prefill, decode)
        if args.check_every and it % args.check_every == 0 and it:
            checks.append({"iteration": it, **verify_entries(eng)["total"]})
            if args.mode == "tp":
                checks[-1]["tp_equal"] = tp_compare(eng, ctx)["equal"]
        if not flags[3]:
            break
        it += 1
        if it > 100_000:
            raise RuntimeError("the scheduler does not terminate")
    if ctx.cuda:
        torch.cuda.synchronize()
    t_run = time.perf_counter()
    result = verify_entries(eng)
    untouched = eng.check_untouched()
    tp = tp_compare(eng, ctx) if args.mode == "tp" else None
    t_verify = time.perf_counter()

    tot = result["total"]
    if not tot["all_verified"]:
        failures.append(f"verification: {tot['unexplained_bytes']} unexplained bytes, {tot['missing_slots']} missing "
                        f"slots, {tot['entries_verified']}/{tot['entries_expected']} entries verified")  # fmt: skip
        for kind, v in result["by_kind"].items():
            failures += [f"{kind}: {f}" for f in v["failures"]]
    if tot["entries_expected"] == 0:
        failures.append("verification: no entries at all")
    if any(untouched["stray_pool_bytes"].values()):
        failures.append(f"pool bytes written outside every written slot: {untouched['stray_pool_bytes']}")
    if untouched["hold_rows_changed"]:
        failures.append(f"state rows no step may write changed: {untouched['hold_rows_changed']}")
    failures += eng.plan_errors[:10]
    if eng.capture_error:
        failures.append(f"the decode graph with NCCL collectives did not capture ({eng.capture_error}); the run went "
                        "on with --graph-collectives off")  # fmt: skip
    bad_checks = [c for c in checks if not c["all_verified"] or c.get("tp_equal") is False]
    failures += [f"check at iteration {c['iteration']}: {c}" for c in bad_checks]
    if tp is not None and not tp["equal"]:
        failures.append(f"TP replicas differ: {tp['differing']}")
    mine = {
        "rank": ctx.rank,
        "device": torch.cuda.get_device_name(eng.device) if ctx.cuda else "cpu",
        "iterations": it + 1,
        "engine": eng.stats,
        "scheduler": sched.stats,
        "allocator": {"swa_page_evictions": eng.alloc.evictions, "rejected_rows_freed": eng.alloc.freed_rows},
        "requests": [dataclasses.asdict(r) | {"length": eng.alloc.length.get(r.rid, 0)} for r in sched.requests],
        "verification": result,
        "untouched": untouched,
        "plan_errors": eng.plan_errors[:10],
        "periodic_checks": checks,
        "tp": tp,
        "failures": failures,
        "dispatcher_calls": adapter.ops.calls if isinstance(adapter.ops, TorchOps) else 0,
        "cuda_max_memory_allocated": torch.cuda.max_memory_allocated(eng.device) if ctx.cuda else None,
        "seconds": {
            "setup": t_setup - t0,
            "capture": t_capture - t_setup,
            "run": t_run - t_capture,
            "verify": t_verify - t_run,
        },  # fmt: skip
    }
    ranks = ctx.gather(mine)
    report = None
    if ctx.rank == 0:  # the checks' results are on disk before the timing's graphs run
        report = _report(args, eng, ctx, ranks, max_len, t0)
        _write(report, args.json)
        print(f"multi_gpu_run: checks {'passed' if report['ok'] else 'FAILED'}; timing next ({args.json})", flush=True)

    timing, error, t_timing = None, None, time.perf_counter()
    if want_timing:
        note = None
        if snap is None:
            snap = snapshot_step(eng, last_decode)
            note = "no iteration decoded a full batch on every rank: timed the last decode step"
        try:
            timing = run_timing(eng, ctx, args, snap)
            timing["note"] = note
        except Exception as err:  # noqa: BLE001 - reported, and the run fails
            error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        timing = timing and dict(timing, seconds=time.perf_counter() - t_timing)
    timings = ctx.gather({"timing": timing, "error": error})
    errors = [f"rank {r}: timing: {t['error']}" for r, t in enumerate(timings) if t["error"]]
    errors += [f"rank {r}: timing {name}: {e}" for r, t in enumerate(timings) if t["timing"]
               for name, e in t["timing"]["errors"].items()]  # fmt: skip
    failures_all = [f"rank {r['rank']}: {f}" for r in ranks for f in r["failures"]] + errors
    ok = not failures_all and _lockstep(ranks)
    if report is not None:
        report["ok"] = ok
        report["failures"] = (report["failures"] + errors)[:50]
        report["timing"] = {f"rank{r}": t["timing"] for r, t in enumerate(timings)}
        report["timing_summary"] = _timing_summary([t["timing"] for t in timings])
        report["seconds_total"] = time.perf_counter() - t0
        _write(report, args.json)
        print(summary(report, args.json), flush=True)
    if not ok:
        for f in failures + ([error] if error else []):
            print(f"rank {ctx.rank}: FAILED: {f}", file=sys.stderr, flush=True)
    eng.decode_graph = None  # graphs holding NCCL work go before the communicator
    gc.collect()
    ctx.sync()
    dist.destroy_process_group()
    return 0 if ok else 1


def main(argv=None) -> int:
    return run(parse_args(argv))
