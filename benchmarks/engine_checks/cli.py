"""The command line of ``scripts/engine_pack_check.py`` (:func:`main`: its ``--help`` text is the first line of
:mod:`benchmarks.engine_checks`'s docstring) and the default check's run: each engine's kernel against our pack at
each ``--sizes`` batch, written to ``engine_pack_check.json`` and ``.log``. Returns the exit status: 0 when every
engine that ran wrote identical records."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

import torch
import triton

from benchmarks import engine_checks as _package

from .common import LOG, log
from .indexer_packs import (
    build_sglang,
    compare,
    load_lightllm,
    make_inputs,
    ours_finish,
    ours_pack,
    probes,
    run_lightllm,
    run_sglang,
)
from .ring_decode import ring_compile_check, ring_main


def main() -> int:
    ap = argparse.ArgumentParser(description=_package.__doc__.split("\n")[0])
    ap.add_argument("--src", default="engine_src", help="folder made by scripts/engine_pack_sources.sh")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--sizes", default="16,256")
    ap.add_argument("--seed", type=int, default=0)
    ring = ap.add_argument_group("--ring-decode: SGLang's C128 ring decode against our tiled kernel")
    ring.add_argument("--ring-decode", action="store_true", help="run the ring decode harness instead")
    ring.add_argument("--ring-compile-only", action="store_true", help="only build its CUDA wrappers (--arch)")
    ring.add_argument("--arch", default="9.0", help="compute capability for --ring-compile-only")
    ring.add_argument("--device", default="cuda", help="cpu: our side under TRITON_INTERPRET=1, SGLang emulated")
    ring.add_argument("--sglang", choices=("kernels", "emulated"), default="kernels")
    ring.add_argument("--sglang-pdl", type=int, default=1, help="launch SGLang's kernels with PDL (as on sm90)")
    ring.add_argument("--ring-sizes", default="64,256,1024", help="requests 4B of S = 1 row each")
    ring.add_argument("--ring-cases", default="every,quarter", help="every: all close a group; quarter: every 4th")
    ring.add_argument("--instances", type=int, default=20, help="layer instances per CUDA graph")
    ring.add_argument("--replays", type=int, default=200, help="timed cold replays")
    ring.add_argument("--warm-replays", type=int, default=100, help="timed warm replays")
    ring.add_argument("--warmup", type=int, default=20)
    ring.add_argument("--l2-mib", type=int, default=60, help="cold replays read 2x this many MiB first")
    ring.add_argument("--no-timing", action="store_true", help="only the byte comparisons")
    ring.add_argument(
        "--bench-cross-check",
        action="store_true",
        help="also run the bench's own decode case for ours (cold there: rotated input copies)",
    )
    ring.add_argument(
        "--max-rel-diff",
        type=float,
        default=0.15,
        help="largest decoded difference, relative to a record's largest value, that passes",
    )
    ring.add_argument(
        "--variants",
        default="default",
        help="our launch variants, ';'-separated, each 'default' or k=v,... over tile, block_t, "
        "num_warps, one_launch, tile_major (launch_c128_tiled) and pdl, e.g. "
        "'default;tile=32;block_t=16,num_warps=8'",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.ring_compile_only:
        return ring_compile_check(args)
    if args.ring_decode:
        return ring_main(args)
    work = os.path.join(args.out, "build")
    os.makedirs(work, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    report: dict = dict(sizes=sizes, engines={})
    if not torch.cuda.is_available():
        log("not run: no CUDA device")
        report["error"] = "no CUDA device"
    else:
        report["environment"] = dict(
            gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
            torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
        )  # fmt: skip
        try:
            report["environment"]["nvcc"] = subprocess.run(
                ["nvcc", "--version"], capture_output=True, text=True
            ).stdout.strip().splitlines()[-1]  # fmt: skip
        except Exception as e:  # noqa: BLE001
            report["environment"]["nvcc"] = f"none: {e}"
        log(f"environment: {report['environment']}")
        try:
            report["probes"] = probes()
        except Exception as e:  # noqa: BLE001
            report["probes"] = f"failed: {e!r}"
        log(f"probes: {report['probes']}")
        engines = {
            "sglang": ("hadamard_f32", lambda: build_sglang(args.src, work), run_sglang, ours_finish),
            "lightllm": ("hadamard_bf16", lambda: load_lightllm(args.src), run_lightllm, ours_pack),
        }
        for name, (pack, setup, theirs, ours) in engines.items():
            log(f"== {name}: our {pack!r} pack against the engine's kernel")
            entry: dict = dict(pack=pack)
            report["engines"][name] = entry
            try:
                handle = setup()
            except Exception as e:  # noqa: BLE001
                entry["status"] = f"not run: {type(e).__name__}: {e}"
                log(f"  {entry['status']}")
                continue
            entry["status"] = "run"
            for batch in sizes:
                try:
                    inp = make_inputs(batch, args.seed, "cuda")
                    result = compare(ours(inp, pack), theirs(handle, inp), inp["slots"])
                    result["verdict"] = "identical" if result["differing_records"] == 0 and not result[
                        "other_bytes_differ"] else "DIFFERENT"  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    result = dict(verdict=f"failed: {type(e).__name__}: {e}", traceback=traceback.format_exc())
                entry[f"B={batch}"] = result
                log(f"  B={batch}: {result.get('verdict')}: " + json.dumps(
                    {k: v for k, v in result.items() if k not in ("examples", "traceback", "verdict")}))  # fmt: skip
                for ex in result.get("examples", []):
                    log(f"    {ex}")
                if "traceback" in result:
                    log(result["traceback"])
    with open(os.path.join(args.out, "engine_pack_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "engine_pack_check.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    ok = all(
        isinstance(v, dict) and v.get("verdict") == "identical"
        for e in report["engines"].values() if e.get("status") == "run"
        for k, v in e.items() if k.startswith("B=")
    )  # fmt: skip
    parts = []
    for name, e in report["engines"].items():
        runs = " ".join(f"{k} {v['verdict']}" for k, v in e.items() if k.startswith("B="))
        parts.append(f"{name}: {runs if e['status'] == 'run' else e['status']}")
    log("summary: " + ", ".join(parts))
    return 0 if ok and report["engines"] else 1
