"""What the run reports: the HCA state per request and the requests a memory budget admits
(:func:`memory_report`), the environment, rank 0's JSON report of the checks (:func:`_report`, written by
:func:`_write`), the slowest rank's timing (:func:`_timing_summary`) and the printed summary (:func:`summary`)."""

from __future__ import annotations

import json
import os
import socket
import time

import torch
from helpers import lightllm_sim as sim

from benchmarks.env import environment
from dsv4_compressor.config import MODELS, CompressorConfig
from dsv4_compressor.integrations import lightllm as adapter

from .engine import Engine
from .runtime import Dist


def memory_report(eng: Engine, mtp: int, budget_gib: float) -> dict:
    """HCA state per request, LightLLM's C128 ring against the online banks, at DeepSeek-V4 shapes (from
    ``CompressorConfig.hca()`` and the layer counts of docs/SPEC.md section 1), and the requests per rank a budget
    holds."""
    hca = CompressorConfig.hca()
    ring_layer = hca.ring_bytes(mtp)  # ceil((128 + mtp) / 4) * 4 rows of [kv | score + ape], float32
    online_layer = (mtp + 1) * 3 * hca.head_dim * 4  # mtp + 1 banks of (max, sum, weighted sum) per channel
    budget = int(budget_gib * 2**30)
    models = {}
    for name, layers in MODELS.items():
        n = layers["hca"]
        ring, online = n * ring_layer, n * online_layer
        assert ring - online == adapter.online_hca_savings(n, mtp)
        models[name] = {
            "hca_layers": n,
            "ring_bytes_per_request": ring,
            "online_bytes_per_request": online,
            "freed_bytes_per_request": ring - online,
            "ring_over_online": ring / online,
            "admissible_requests_ring": budget // ring,
            "admissible_requests_online": budget // online,
        }
    csa, idx = CompressorConfig.csa(), CompressorConfig.indexer()
    c4_ring = sim.DSV4_C4_STATE_RING + mtp
    mm, lay = eng.mm, eng.layout
    run_layer = (mtp + 1) * 3 * lay.head_dim * 4 if mm.online_hca else lay.c128_state_ring * 2 * lay.head_dim * 4
    return {
        "mtp_step": mtp,
        "budget_bytes": budget,
        "budget_gib": budget_gib,
        "per_layer": {"ring_bytes": ring_layer, "online_bytes": online_layer},
        "models": models,
        "note": "HCA (C128) state only, per request, all HCA layers; admissible = budget // bytes per request. "
        "LightLLM's C4 state is per SWA page (shared through the radix cache) and the same either way: "
        f"{c4_ring * (csa.row_width + idx.row_width) * 4} bytes per SWA page and CSA layer (main + indexer).",
        "this_run": {
            "hca_state": "online banks" if mm.online_hca else "ring",
            "state_bytes_per_request_per_hca_layer": run_layer,
            "c128_state_allotted_bytes": mm.c128_state_buffer.numel() * 4
            + (mm.dsv4c_c128_state_banks.numel() * 4 if mm.online_hca and mm.n_c128 else 0),
            "fixed_memory_bytes (LightLLM get_fixed_memory_size)": mm.fixed_memory,
        },
    }


def _env(eng: Engine, ctx: Dist, gpus: list) -> dict:
    env = environment(eng.device if ctx.cuda else None)
    nccl = None
    if ctx.cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - best effort
            nccl = "unknown"
    env.update(nccl=nccl, backend=ctx.backend, world_size=ctx.world, gpus=gpus, host=socket.gethostname(),
               triton_interpret=os.environ.get("TRITON_INTERPRET"))  # fmt: skip
    return env


def _lockstep(ranks: list[dict]) -> bool:
    return len({(r["engine"]["prefill_forwards"], r["engine"]["decode_forwards"]) for r in ranks}) == 1


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def _report(args, eng: Engine, ctx: Dist, ranks: list[dict], max_len: int, t0: float) -> dict:
    """Rank 0's report of the checks (the timing is added when it ran)."""
    failures = [f"rank {r['rank']}: {f}" for r in ranks for f in r["failures"]]
    lockstep = _lockstep(ranks)
    if not lockstep:
        failures.append("ranks ran different numbers of forwards")
    totals = [r["verification"]["total"] for r in ranks]
    return {
        "ok": not failures,
        "failures": failures[:50],
        "mode": args.mode,
        "hca": args.hca,
        "config": {
            **vars(args),
            "shapes": "small" if args.small else "DeepSeek-V4 (H=512/128, r=4/128)",
            "max_len": max_len,
            "layers": eng.mm.compress_rates,
            "compressors": len(eng.model.comps),
            "swa_page": eng.shapes.swa_page,
            "hca_ratio": eng.shapes.hca.ratio,
            "gemm_fp32_out": eng.model.fp32_out,
            "joined_c4_layers": eng.model.joined,
            "decode_graph_rows": eng.G * eng.S,
        },
        "verification": {
            "entries_expected": sum(t["entries_expected"] for t in totals),
            "entries_verified": sum(t["entries_verified"] for t in totals),
            "unexplained_bytes": sum(t["unexplained_bytes"] for t in totals),
            "all_verified": all(t["all_verified"] for t in totals),
            "stray_pool_bytes": sum(sum(r["untouched"]["stray_pool_bytes"].values()) for r in ranks),
            "hold_rows_untouched": not any(r["untouched"]["hold_rows_changed"] for r in ranks),
            "plan_errors": sum(len(r["plan_errors"]) for r in ranks),
        },
        "lockstep": lockstep,
        "tp": ranks[0]["tp"],
        "timing": "pending" if args.timing_samples > 0 else None,
        "timing_summary": None,
        "memory": memory_report(eng, args.mtp_step, args.memory_budget_gib),
        "environment": _env(eng, ctx, [r["device"] for r in ranks]),
        "ranks": ranks,
        "seconds_total": time.perf_counter() - t0,
    }


def _timing_summary(timings: list[dict | None]) -> dict | None:
    """Per-layer microseconds, the slowest rank's (the one the other waits for at the next collective)."""
    timings = [t for t in timings if t]
    if not timings:
        return None
    out = {}
    for key in timings[0]["per_layer_us"]:
        vals = [t["per_layer_us"][key] for t in timings if t["per_layer_us"][key] is not None]
        out[key] = max(vals) if vals else None
    out["build_us_per_step"] = max(t["build_us_per_step"] for t in timings)
    for part in timings[0].get("build_parts_us", {}):
        vals = [t["build_parts_us"][part] for t in timings if t["build_parts_us"].get(part) is not None]
        out[f"build_{part}_us"] = max(vals) if vals else None
    return out


def summary(report: dict, path: str) -> str:
    v, env, cfg = report["verification"], report["environment"] or {}, report["config"]
    ranks = report["ranks"]
    eng = [r["engine"] for r in ranks]
    sch = [r["scheduler"] for r in ranks]
    lines = [
        f"multi_gpu_run: mode={report['mode']} hca={report['hca']} kv={cfg['kv_source']} backend={env.get('backend')} "
        f"world={env.get('world_size')} on {', '.join(env.get('gpus') or [])} (torch {env.get('torch')}, triton "
        f"{env.get('triton')}, NCCL {env.get('nccl')})",
        f"  {cfg['compressors']} compressors in {len(cfg['layers'])} layers ({cfg['shapes']}), {cfg['requests']} "
        f"requests per rank, decode graph of {cfg['decode_graph_rows']} rows",
        "  forwards per rank: prefill {} (HOLD-only on a rank: {}), decode {} (HOLD-only: {}), graph replays {}".format(
            eng[0]["prefill_forwards"],
            [e["idle_prefill_forwards"] for e in eng],
            eng[0]["decode_forwards"],
            [e["idle_decode_forwards"] for e in eng],
            [e["graph_replays"] for e in eng],
        ),
        "  MTP: {} rewinds in {} request-steps; prefix hits {}".format(
            sum(s["rewinds"] for s in sch), sum(s["decode_request_steps"] for s in sch), [s["prefix_hits"] for s in sch]
        ),
        f"  verified {v['entries_verified']}/{v['entries_expected']} entries against float64, "
        f"{v['unexplained_bytes']} unexplained bytes; stray pool bytes {v['stray_pool_bytes']}; HOLD rows untouched "
        f"{v['hold_rows_untouched']}; plan errors {v['plan_errors']}",
    ]
    if report["tp"]:
        tp = report["tp"]
        lines.append(f"  TP replicas byte-equal: {tp['equal']} ({tp['buffers']} buffers, {tp['bytes_per_rank']} bytes)")
    ts = report["timing_summary"]
    if ts:
        f = lambda x: "-" if x is None else f"{x:.1f}"
        p = ts
        lines.append(
            f"  us per layer (slowest rank): alone {f(p['layers_alone'])} | + NCCL after each layer "
            f"{f(p['layers_with_nccl_serial'])} | + NCCL concurrent {f(p['layers_with_nccl_concurrent'])} | NCCL "
            f"alone {f(p['nccl_alone'])} | HCA {f(p['hca_layer_alone'])} | CSA+indexer "
            f"{f(p['csa_layer_alone (main + indexer)'])} | build {f(p['build_us_per_step'])} per step"
        )
        probes = ("csa_bare_ops_on_tables", "csa_bare_ops_on_ring", "csa_bare_ops_on_ring_tables", "build_plans_us",
                  "build_state_rows_us", "build_in_the_step_graph", "one_kernel_graph")  # fmt: skip
        if any(p.get(k) is not None for k in probes):
            lines.append(
                f"  probes: CSA+indexer as bare ops on LightLLM's tables {f(p.get('csa_bare_ops_on_tables'))} | on a "
                f"request ring {f(p.get('csa_bare_ops_on_ring'))} | on that ring through req_ring tables "
                f"{f(p.get('csa_bare_ops_on_ring_tables'))} us per layer; build parts: plans "
                f"{f(p.get('build_plans_us'))} | state rows "
                f"{f(p.get('build_state_rows_us'))} us; the build in the step graph (layers with it - without) "
                f"{f(p.get('build_in_the_step_graph'))} us, a one-kernel graph {f(p.get('one_kernel_graph'))} us"
            )
    mem = report["memory"]
    for name, m in mem["models"].items():
        lines.append(
            f"  {name}: HCA state {m['ring_bytes_per_request'] / 2**20:.2f} MiB (ring) vs "
            f"{m['online_bytes_per_request'] / 2**20:.3f} MiB (online) per request -> per {mem['budget_gib']:g} GiB: "
            f"{m['admissible_requests_ring']} vs {m['admissible_requests_online']} requests per rank"
        )
    lines.append(("  OK" if report["ok"] else "  FAILED: " + "; ".join(report["failures"][:5])) + f"  ({path})")
    return "\n".join(lines)
