"""Probe: when a kernel's first weight byte lands after the kernel before it, with and without PDL.

The question behind it (performance round 4): about half of the decode step's weight-read "floor" looked like a
fixed cost per launch; how much of it is the launch gap after the predecessor, and how much the first load's
latency, and how much of both does programmatic dependent launch (PDL) hide when the weight load is issued
before ``griddepcontrol.wait``?

A predecessor kernel copies a buffer (``--pred-mib``, every program stamping ``%globaltimer`` when its last
store is issued); then the probe kernel, one program per multiprocessor, stamps its start, loads a tile of a
cold weight (``--tile-kib`` per program, a region no earlier repeat read), stamps the load's arrival (a timer
read that takes the loaded values as its input, so it cannot issue before they arrived) and the end of its
``griddepcontrol.wait``. Launch modes:

``plain``            the probe launched in stream order (no PDL)
``pdl_wait_load``    PDL, the predecessor releases at its programs' exit, the probe waits, then loads
``pdl_load_wait``    PDL, release at exit, the probe loads, then waits (the weight does not depend on it)
``pdl_start_load``   PDL, the predecessor releases at its programs' start, the probe loads, then waits

Reported per mode, medians over ``--repeats`` in microseconds relative to the predecessor's last program's
end: the first and the last probe program's start, the first byte's arrival (first program, median program),
the wait's end (median program), and the load's own latency (arrival minus start, median program).

    python -m benchmarks.probes.first_byte [--repeats 50] [--json out/first_byte.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer

MODES = ("plain", "pdl_wait_load", "pdl_load_wait", "pdl_start_load")


@triton.jit
def _timer_after(x):
    """``%globaltimer`` read with ``x`` (float32) as an input operand: it issues once ``x`` is available."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _copy_then_stamp(src, dst, stamps, ITERS: tl.constexpr, BLOCK: tl.constexpr, RELEASE_START: tl.constexpr):
    """The predecessor: program ``p`` copies ``ITERS`` blocks of ``BLOCK`` elements, then stamps its end."""
    pid = tl.program_id(0)
    if RELEASE_START:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * ITERS * BLOCK
    for i in range(ITERS):
        at = base + i * BLOCK + offs
        tl.store(dst + at, tl.load(src + at))
    tl.store(stamps + pid, globaltimer())


@triton.jit
def _first_byte(weight, stamps, row0, PDL: tl.constexpr, LOAD_FIRST: tl.constexpr, TILE: tl.constexpr):
    """The probe: program ``p`` stamps ``[start, first byte, wait end]`` into ``stamps[p]``; it loads
    ``TILE`` elements of ``weight`` at row ``row0 + p``."""
    pid = tl.program_id(0)
    start = globaltimer()
    ptrs = weight + (row0 + pid).to(tl.int64) * TILE + tl.arange(0, TILE)
    if LOAD_FIRST:
        arrived = _timer_after(tl.sum(tl.load(ptrs).to(tl.float32), axis=0))
        if PDL:
            gdc_wait()
        waited = globaltimer()
    else:
        if PDL:
            gdc_wait()
        waited = globaltimer()
        arrived = _timer_after(tl.sum(tl.load(ptrs).to(tl.float32), axis=0))
    tl.store(stamps + pid * 3 + 0, start)
    tl.store(stamps + pid * 3 + 1, arrived)
    tl.store(stamps + pid * 3 + 2, waited)


def run(repeats: int = 50, pred_mib: int = 64, tile_kib: int = 16) -> dict:
    """Every mode ``repeats`` times on the current CUDA device; returns the medians (see the module docstring)."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    block, iters = 4096, 8
    pred_programs = max(1, pred_mib * 2**20 // 2 // (block * iters))
    src = torch.randn(pred_programs * iters * block, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(src)
    tile = tile_kib * 1024 // 2
    rounds = len(MODES) * (repeats + 2)
    weight = torch.randn(rounds * sms * tile, device=dev).to(torch.bfloat16)  # each launch reads its own rows
    pred_stamps = torch.zeros(pred_programs, dtype=torch.int64, device=dev)
    stamps = torch.zeros(sms, 3, dtype=torch.int64, device=dev)
    rows = 0
    out = {"device": torch.cuda.get_device_name(dev), "sms": sms, "pred_mib": pred_mib, "tile_kib": tile_kib,
           "repeats": repeats, "modes": {}}  # fmt: skip
    for mode in MODES:
        pdl = mode != "plain"
        samples: dict[str, list[float]] = {k: [] for k in ("start_first", "start_last", "byte_first", "byte_median",
                                                           "wait_median", "load_latency", "pred_us")}  # fmt: skip
        for r in range(repeats + 2):  # the first two compile and warm up
            torch.cuda.synchronize()
            _copy_then_stamp[(pred_programs,)](src, dst, pred_stamps, ITERS=iters, BLOCK=block,
                                               RELEASE_START=mode == "pdl_start_load")  # fmt: skip
            kw = {"launch_pdl": True} if pdl else {}
            _first_byte[(sms,)](weight, stamps, rows, PDL=pdl, LOAD_FIRST=mode in ("pdl_load_wait", "pdl_start_load"),
                                TILE=tile, **kw)  # fmt: skip
            rows += sms
            torch.cuda.synchronize()
            if r < 2:
                continue
            p = pred_stamps.cpu().double()
            s = stamps.cpu().double()
            end = float(p.max())
            rel = (s - end) / 1e3
            samples["start_first"].append(float(rel[:, 0].min()))
            samples["start_last"].append(float(rel[:, 0].max()))
            samples["byte_first"].append(float(rel[:, 1].min()))
            samples["byte_median"].append(float(rel[:, 1].median()))
            samples["wait_median"].append(float(rel[:, 2].median()))
            samples["load_latency"].append(float(((s[:, 1] - s[:, 0]) / 1e3).median()))
            samples["pred_us"].append((end - float(p.min())) / 1e3)
        out["modes"][mode] = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    return out


def table(result: dict) -> str:
    """A Markdown table of :func:`run`'s result."""
    cols = ("start_first", "start_last", "byte_first", "byte_median", "wait_median", "load_latency")
    lines = [
        f"first weight byte after the predecessor ({result['device']}, {result['sms']} programs, "
        f"{result['tile_kib']} KiB each; predecessor copies {result['pred_mib']} MiB; us, median of "
        f"{result['repeats']})",
        "",
        "| mode | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for mode, m in result["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{m[c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--pred-mib", type=int, default=64)
    ap.add_argument("--tile-kib", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("first_byte: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args.repeats, args.pred_mib, args.tile_kib)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
