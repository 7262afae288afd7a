"""The ``--ring-decode`` run: our launch variants (:func:`parse_variants`, :func:`install_variant`), the timing of a
CUDA graph of layer instances (:func:`time_graph`), each case's checks and timing (:func:`run_variant`,
:func:`run_ring_case`), the markdown table and the JSON report (:func:`ring_main`: ``ring_decode.json``,
``ring_decode.md``, ``ring_decode.log``), and ``--ring-compile-only`` (:func:`ring_compile_check`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import torch
import triton

from .common import LOG, POISON, log
from .ring_case import RingCase, compare_latent
from .sglang_ring import (
    RING_HEAD,
    RING_POSITIONS,
    RING_UNITS,
    SglangRing,
    SglangRingEmulated,
    build_sglang_ring,
    ring_nvcc_command,
)


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``"default;tile=32;block_t=16,num_warps=8"`` -> ``[(name, launch_c128_tiled overrides), ...]``; ``pdl=0``
    turns programmatic dependent launch off for our launches."""
    out = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        if part == "default":
            out.append(("default", {}))
            continue
        kw = {}
        for item in part.split(","):
            key, _, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if key not in ("tile", "block_t", "num_warps", "one_launch", "tile_major", "pdl", "fused_sums"):
                raise ValueError(f"unknown variant key {key!r} in {part!r}")
            if key in ("one_launch", "tile_major", "pdl", "fused_sums"):
                kw[key] = value.lower() in ("1", "true", "yes")
            else:
                kw[key] = int(value)
        out.append((" ".join(f"{k}={v}" for k, v in kw.items()), kw))
    return out


_ORIGINAL_TILED = None
_ORIGINAL_PDL = None


def install_variant(kw: dict) -> None:
    """Override ``launch_c128_tiled``'s settings as ``ops`` calls it (the bench's tune probe does the same)."""
    global _ORIGINAL_TILED, _ORIGINAL_PDL
    from dsv4_compressor import ops

    if _ORIGINAL_TILED is None:
        _ORIGINAL_TILED, _ORIGINAL_PDL = ops.launch_c128_tiled, ops.pdl_enabled
    kw = dict(kw)
    pdl_on = kw.pop("pdl", None)
    ops.pdl_enabled = _ORIGINAL_PDL if pdl_on is None else (lambda device, on=pdl_on: on and _ORIGINAL_PDL(device))
    if not kw:
        ops.launch_c128_tiled = _ORIGINAL_TILED
        return

    def launch(*args, **kwargs):
        return _ORIGINAL_TILED(*args, **{**kwargs, **kw})

    ops.launch_c128_tiled = launch


def time_graph(timer, fn, *, per: int, replays: int, warm_replays: int, warmup: int, flush) -> dict:
    """Capture ``fn`` (already run once) in one CUDA graph; warm (replayed back to back) and cold (``flush``, a
    read of twice the L2, before each replay, outside the timed events), per ``per`` instances (us)."""
    from benchmarks.timing import summarize

    fn()
    timer.sync()
    graph = timer.capture(fn)
    warm = timer.time([graph], replays=warm_replays, warmup=warmup, queue_ahead=True)
    cold = timer.time([graph], replays=replays, warmup=warmup, queue_ahead=True, before=flush)
    keep = ("median_us", "p10_us", "p90_us", "min_us", "n")
    return dict(
        warm={k: v for k, v in summarize(warm, per=per).items() if k in keep},
        cold={k: v for k, v in summarize(cold, per=per).items() if k in keep},
    )


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _reset_ours(case: RingCase) -> None:
    """Our rings back to the history before the step, our pages poisoned (before another variant runs)."""
    for inst in case.instances:
        ring = inst.layer.cache.backend.ring
        ring.copy_(inst.history if inst.history is not None else inst.sg_ring)
        ring[..., RING_HEAD:] += case.ape[None]
        inst.layer.cache.pool.out_pages.fill_(POISON)


def run_variant(args, case: RingCase, ref, timing: dict | None) -> dict:
    """Our layers once on the case (its state fresh), compared with SGLang's pages; then timed (``timing``: the
    timer and flush, or ``None``)."""
    v: dict = {}
    case.our_layers()
    if case.device.type == "cuda":
        torch.cuda.synchronize()
    cmp = [
        compare_latent(inst.layer.cache.pool.out_pages, inst.sg_pages, case.slots, case.page_layout,
                       ref if i == 0 else None)
        for i, inst in enumerate(case.instances)
    ]  # fmt: skip
    v["compare_instance0"] = cmp[0]
    v["records"] = sum(c["records"] for c in cmp)
    v["differing_records"] = sum(c["differing_records"] for c in cmp)
    v["differing_data_bytes"] = sum(c["differing_data_bytes"] for c in cmp)
    v["differing_scale_bytes"] = sum(c["differing_scale_bytes"] for c in cmp)
    v["max_abs_diff"] = max(c["max_abs_diff"] for c in cmp)
    v["max_rel_diff"] = max(c["max_rel_diff"] for c in cmp)
    v["other_bytes_differ"] = sum(c["other_bytes_differ"] for c in cmp)
    v["untouched_poisoned"] = all(c["untouched_poisoned"] for c in cmp)
    v["ok"] = (not v["other_bytes_differ"] and v["untouched_poisoned"] and v["max_rel_diff"] <= args.max_rel_diff
               and not any(c["records_poisoned_ours"] or c["records_poisoned_sglang"] for c in cmp))  # fmt: skip
    if timing is not None:
        v["ours"] = time_graph(timing["timer"], case.our_layers, per=args.instances, replays=args.replays,
                               warm_replays=args.warm_replays, warmup=args.warmup, flush=timing["flush"])  # fmt: skip
    return v


def run_ring_case(args, sg, params, n: int, boundary: str, variants, timing: dict | None) -> dict:
    """One case: SGLang's plan and layers once on fresh poisoned pages, ours per variant, compared; then timed."""
    case = RingCase(n, boundary, instances=args.instances, params=params, seed=args.seed, device=args.device)
    entry: dict = dict(id=case.id, closing=int(case.closing.numel()), instances=args.instances, variants={})
    case.poison()
    case.sglang_plan(sg)
    want = torch.zeros_like(case.plan_d)
    SglangRingEmulated().plan(want, case.req_pool_indices, case.seq_lens, case.req_to_token, case.full_to_state)
    entry["plan_matches_emulation"] = bool(torch.equal(want, case.plan_d))
    case.sglang_layers(sg)
    ref = case.reference_values()
    for i, (name, kw) in enumerate(variants):
        install_variant(kw)
        try:
            if i:
                _reset_ours(case)
            entry["variants"][name] = v = run_variant(args, case, ref, timing)
            if i == 0:
                entry["ring"] = case.ring_mismatch()
            log(f"  [{name}] records {v['records']}, differing {v['differing_records']} ({v['differing_data_bytes']} "
                f"data / {v['differing_scale_bytes']} scale bytes), max abs diff {v['max_abs_diff']:.3g} (rel "
                f"{v['max_rel_diff']:.3g}), other bytes differ {v['other_bytes_differ']}, untouched poisoned "
                f"{v['untouched_poisoned']}" + (f"; ours warm {v['ours']['warm']['median_us']:.2f} cold "
                f"{v['ours']['cold']['median_us']:.2f} us/layer" if "ours" in v else ""))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            entry["variants"][name] = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            log(f"  [{name}] failed: {entry['variants'][name]['error']}\n{entry['variants'][name]['traceback']}")
        finally:
            install_variant({})
    first = entry["variants"][variants[0][0]].get("compare_instance0", {})
    log("  instance 0: " + json.dumps({k: x for k, x in first.items() if k != "examples"}))
    for ex in first.get("examples", []):
        log(f"    {ex}")
    log(f"  rings after the step: {entry.get('ring')}; SGLang plan = emulation: {entry['plan_matches_emulation']}")
    ring = entry.get("ring") or {}
    entry["ok"] = (entry["plan_matches_emulation"] and ring.get("rows", 0) > 0 and not ring.get("kv_rows_differ")
                   and not ring.get("score_rows_differ")
                   and all(v.get("ok") for v in entry["variants"].values()))  # fmt: skip
    # SGLang's emulation is timed only on the CPU (to run the code path; its nonzero() cannot be captured)
    if timing is not None and (isinstance(sg, SglangRing) or case.device.type == "cpu"):
        t = dict(per=args.instances, replays=args.replays, warm_replays=args.warm_replays, warmup=args.warmup,
                 flush=timing["flush"])  # fmt: skip
        entry["sglang_timing"] = time_graph(timing["timer"], lambda: case.sglang_layers(sg), **t)
        # the plans: one per step, shared by the layers; a graph of `instances` launches, per launch
        entry["sglang_plan_timing"] = time_graph(
            timing["timer"], lambda: [case.sglang_plan(sg) for _ in range(args.instances)], **t
        )
        entry["our_plan_timing"] = time_graph(
            timing["timer"], lambda: [case.our_plan() for _ in range(args.instances)], **t
        )
        s, sp, op = entry["sglang_timing"], entry["sglang_plan_timing"], entry["our_plan_timing"]
        log(f"  SGLang warm {s['warm']['median_us']:.2f} cold {s['cold']['median_us']:.2f} us/layer; plan per step "
            f"(warm / cold): SGLang {sp['warm']['median_us']:.2f} / {sp['cold']['median_us']:.2f} us, ours "
            f"{op['warm']['median_us']:.2f} / {op['cold']['median_us']:.2f} us")  # fmt: skip
    if args.bench_cross_check and timing is not None and case.device.type == "cuda":
        try:  # our default as the project's bench measures it (cold: rotated input copies, not a flush)
            from benchmarks.cases import Case
            from benchmarks.runner import Runner

            res = Runner(timing["timer"], replays=args.replays, warmup=args.warmup, warm_replays=args.warm_replays,
                         l2_bytes=args.l2_mib * 2**20, seed=args.seed).run(
                Case("decode", "hca", "triton-tiled", n, 1, boundary, instances=args.instances))  # fmt: skip
            warm = (res.get("warm") or {}).get("median_us")
            entry["bench"] = dict(status=res["status"], error=res.get("error"), cold_us=res.get("us_per_layer"),
                                  warm_us=warm, copies=res.get("copies"))  # fmt: skip
            log(f"  bench {res['id']}: {entry['bench']}")
        except Exception as e:  # noqa: BLE001
            entry["bench"] = dict(status="error", error=f"{type(e).__name__}: {e}")
            log(f"  bench cross-check failed: {entry['bench']['error']}")
    return entry


def table_rows(key: str, entry: dict) -> list[str]:
    """The markdown rows of one case: one per variant of ours against SGLang's figure."""

    def med(t, which):
        return t[which]["median_us"] if t else None

    sgt = entry.get("sglang_timing")
    rows = []
    for name, v in entry.get("variants", {}).items():
        ours = v.get("ours")
        ow, oc, sw, sc = med(ours, "warm"), med(ours, "cold"), med(sgt, "warm"), med(sgt, "cold")
        rw = ow / sw if ow and sw else None
        rcold = oc / sc if oc and sc else None
        diff = f"{v['differing_records']} / {v['records']}" if "records" in v else "error"
        mad = f"{v['max_abs_diff']:.3g}" if "max_abs_diff" in v else "-"
        rows.append(f"| {key} | {name} | {_fmt(ow)} | {_fmt(oc)} | {_fmt(sw)} | {_fmt(sc)} | {_fmt(rw)} | "
                    f"{_fmt(rcold)} | {diff} | {mad} |")  # fmt: skip
    return rows


def ring_main(args) -> int:
    from benchmarks.floors import kind_config
    from benchmarks.timing import CudaTimer, HostTimer
    from dsv4_compressor.config import CompressorParams

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    work = os.path.join(args.out, "build")
    os.makedirs(work, exist_ok=True)
    report: dict = dict(mode="ring-decode", args=vars(args), cases={})
    if gpu and not torch.cuda.is_available():
        log("not run: no CUDA device")
        report["error"] = "no CUDA device"
        return _ring_write(args, report, 1)
    report["environment"] = dict(
        device=torch.cuda.get_device_name() if gpu else "cpu", torch=torch.__version__, triton=triton.__version__,
        python=sys.version.split()[0], interpret=os.environ.get("TRITON_INTERPRET"),
    )  # fmt: skip
    log(f"environment: {report['environment']}")
    if args.sglang == "emulated" or not gpu:
        sg, report["sglang"] = SglangRingEmulated(), "emulated in PyTorch (not SGLang's kernels; timed only on the CPU)"
    else:
        try:
            sg, report["sglang"] = SglangRing(build_sglang_ring(args.src, work), pdl=args.sglang_pdl), "kernels"
        except Exception as e:  # noqa: BLE001
            report["sglang"] = f"not built: {type(e).__name__}: {e}"
            log(report["sglang"])
            return _ring_write(args, report, 1)
    timing = None
    if gpu and not args.no_timing:
        flush_buf = torch.empty(max(1, 2 * args.l2_mib * 2**20 // 4), device=device)
        timing = dict(timer=CudaTimer(device), flush=flush_buf.sum)
    elif not args.no_timing:  # the CPU check of the timing path: host clock, no capture, no flush
        timing = dict(timer=HostTimer(), flush=None)
    params = CompressorParams.random(kind_config("hca"), max_positions=RING_POSITIONS, seed=args.seed, device=device)
    variants = parse_variants(args.variants)
    ok, rows_md = True, []
    for n in [int(s) for s in args.ring_sizes.split(",")]:
        for boundary in args.ring_cases.split(","):
            key = f"4B={n} {boundary}"
            closes = "every request closes a group" if boundary == "every" else "every 4th request closes a group"
            log(f"== {key}: {n} requests x S = 1, {closes}")
            try:
                entry = run_ring_case(args, sg, params, n, boundary, variants, timing)
            except Exception as e:  # noqa: BLE001
                entry = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                log(f"  failed: {entry['error']}\n{entry['traceback']}")
            report["cases"][key] = entry
            ok = ok and entry["ok"]
            rows_md += table_rows(key, entry)
            if gpu:
                torch.cuda.empty_cache()
    table = [
        f"us per layer: median over replays of a CUDA graph of {args.instances} layer instances; warm: replayed back "
        f"to back; cold: {2 * args.l2_mib} MiB read before each replay; ratio = ours / SGLang; SGLang: "
        f"{report['sglang']} (its c128 decode + its norm-rope-store per layer; plans not included)",
        "",
        "| case | our variant | ours warm | ours cold | SGLang warm | SGLang cold | ratio warm | ratio cold | "
        "differing records | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows_md,
    ]
    log("")
    for line in table:
        log(line)
    with open(os.path.join(args.out, "ring_decode.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    report["table"] = table
    return _ring_write(args, report, 0 if ok else 1)


def _ring_write(args, report: dict, rc: int) -> int:
    report["ok"] = rc == 0
    with open(os.path.join(args.out, "ring_decode.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "ring_decode.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    log(f"ring decode: {'ok' if rc == 0 else 'FAILED'} ({os.path.join(args.out, 'ring_decode.json')})")
    return rc


def ring_compile_check(args) -> int:
    """Build the three ring wrappers for the given arch without a device (``--ring-compile-only``)."""
    work = os.path.join(args.out, "build")
    os.makedirs(work, exist_ok=True)
    major, minor = (int(x) for x in args.arch.split("."))
    rc = 0
    for name in RING_UNITS:
        cmd, _, lib = ring_nvcc_command(args.src, work, name, (major, minor))
        log(f"  nvcc: {' '.join(cmd)}")
        r = subprocess.run(cmd, capture_output=True, text=True)
        log(f"  {name}: {'built ' + lib if r.returncode == 0 else 'FAILED'}")
        if r.returncode != 0:
            log((r.stdout + r.stderr)[-4000:])
            rc = 1
    return rc
