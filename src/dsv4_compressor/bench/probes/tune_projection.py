"""Sweep the projection kernel's blocks on the GPU against cuBLAS, per DeepSeek-V4 shape and step size.

For each weight shape (V4-Flash D = 4096, V4-Pro 7168; CSA main 2W = 2048, the indexer 512, HCA 1024) and each
``T``, a CUDA graph of 20 launches on distinct weights, inputs and workspaces (the bench's projection case:
20 weights are far more than L2 holds) is timed for the heuristic's blocks, a sample of other blocks and
``torch.mm(x, w.T, out_dtype=float32)``; every candidate's output is checked against float64 first (the
float32 bound of ``tests/test_projection_gpu.py``) and a wrong one is reported, not timed::

    python -m dsv4_compressor.bench.probes.tune_projection OUT_DIR [--time-budget 240] [--rows 64,256]

Writes ``OUT_DIR/tune_projection.md`` (best per shape against the heuristic and cuBLAS) and
``OUT_DIR/tune_projection.json`` (every figure), and prints :data:`~dsv4_compressor.kernels.projection.OVERRIDES`
entries for the winners.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time

import torch

from dsv4_compressor import ops
from dsv4_compressor.kernels import projection as proj

SHAPES = [(width, dim) for dim in (4096, 7168) for width in (2048, 512, 1024)]
INSTANCES = 20
REPLAYS = 30
U32 = 2.0**-24


def candidates(rows: int, width: int, dim: int, *, sample: int, seed: int) -> list[proj.ProjectionConfig]:
    """The heuristic's blocks first, then a seeded sample of the grid (row block the step's power of two up to
    64, or 128 at 8 warps for steps that have them; column blocks 32-128, K blocks 64/128, K splits that keep
    two K steps per program, 4/8 warps, 3/4 stages)."""
    base = proj.projection_config(rows, width, dim)
    pow2 = min(64, max(16, 1 << max(0, (rows - 1).bit_length())))
    grid = []
    for block_t, block_n, block_k, split, warps, stages in itertools.product(
        (pow2, 128), (32, 64, 128), (64, 128), (1, 2, 4, 8, 16, 32), (4, 8), (3, 4)
    ):
        if block_t > pow2 and (rows < 128 or block_n > 64 or warps < 8):  # a 128-row block only where T has them
            continue
        if block_n > width or dim % (block_k * split) or dim // (block_k * split) < 2:
            continue
        cfg = proj.ProjectionConfig(block_t, block_n, block_k, split, warps, stages)
        if cfg.tiles(rows, width) > proj.COUNTERS or cfg == base:
            continue
        grid.append(cfg)
    random.Random(seed).shuffle(grid)
    return [base] + grid[:sample]


def _time(replay) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS)]
    for _ in range(3):
        replay()
    for s, e in zip(start, end):
        s.record()
        replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(start, end)) / INSTANCES


def _graph(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def measure(rows: int, width: int, dim: int, cfgs, deadline: float) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows * 7 + width + dim)
    ws_ = [(torch.randn(width, dim, device=dev, generator=gen) / dim**0.5).to(torch.bfloat16) for _ in range(INSTANCES)]
    xs = [torch.randn(rows, dim, device=dev, generator=gen).to(torch.bfloat16) for _ in range(INSTANCES)]
    ref = xs[0].double() @ ws_[0].double().t()
    bound = dim * U32 * (xs[0].double().abs() @ ws_[0].double().abs().t())
    pdl = ops.pdl_enabled(dev)

    def cublas():  # the engines' GEMM (its outputs come from the graph's pool)
        for x, w in zip(xs, ws_):
            torch.mm(x, w.t(), out_dtype=torch.float32)

    results = [{"config": "cublas", "us": _time(_graph(cublas))}]
    for cfg in cfgs:
        if time.monotonic() > deadline:
            break
        spaces = [torch.zeros(proj.workspace_numel(rows, width, cfg), device=dev) for _ in range(INSTANCES)]

        def ours(cfg=cfg, spaces=spaces):
            for x, w, s in zip(xs, ws_, spaces):
                proj.launch_projection(x, w, s, rows=rows, cfg=cfg, pdl=pdl)

        entry = {"config": list(cfg)}
        try:
            replay = _graph(ours)
            kv = spaces[0][: rows * width].view(rows, width).double()
            if not ((kv - ref).abs() <= bound).all():
                entry["error"] = "outside the float32 bound"
            else:
                entry["us"] = _time(replay)
        except Exception as exc:  # a config the compiler or the device refuses: reported, the sweep goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(entry)
        del spaces
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--rows", default="64,256", help="step sizes T")
    ap.add_argument("--sample", type=int, default=40, help="grid candidates per shape and T beside the heuristic")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    cases = [(rows, width, dim) for width, dim in SHAPES for rows in rows_list]
    start = time.monotonic()
    report, lines = [], []
    for i, (rows, width, dim) in enumerate(cases):
        share = (args.time_budget - (time.monotonic() - start)) / (len(cases) - i)
        cfgs = candidates(rows, width, dim, sample=args.sample, seed=i)
        res = measure(rows, width, dim, cfgs, time.monotonic() + share)
        timed = [r for r in res if "us" in r and r["config"] != "cublas"]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        heur = res[1] if len(res) > 1 else {}
        row = {"T": rows, "width": width, "dim": dim, "cublas_us": res[0]["us"], "heuristic": heur,
               "best": best, "tried": len(res) - 1, "results": res}  # fmt: skip
        report.append(row)
        line = (f"| {dim} | {width} | {rows} | {res[0]['us']:.2f} | {heur.get('us', float('nan')):.2f} | "
                f"{best['us'] if best else float('nan'):.2f} | {tuple(best['config']) if best else '-'} | "
                f"{len(res) - 1} |")  # fmt: skip
        lines.append(line)
        print(line, flush=True)
    md = ["# Projection block sweep", "",
          f"Graph of {INSTANCES} launches on distinct weights, median of {REPLAYS} replays, us per launch.", "",
          "| D | 2W | T | cuBLAS | heuristic | best | best blocks (T, N, K, split, warps, stages) | tried |",
          "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |", *lines, ""]  # fmt: skip
    md.append("OVERRIDES entries (winners faster than the heuristic):")
    md.append("```")
    for r in report:
        if r["best"] and r["heuristic"].get("us") and r["best"]["us"] < r["heuristic"]["us"]:
            b, h, c = r["best"]["us"], r["heuristic"]["us"], r["cublas_us"]
            cfg = tuple(r["best"]["config"])
            key = f"({r['width']}, {r['dim']}): {{{r['T']}: ProjectionConfig{cfg}}},"
            md.append(f"{key}  # {b:.2f} us (heuristic {h:.2f}, cuBLAS {c:.2f})")
    md.append("```")
    with open(os.path.join(args.out_dir, "tune_projection.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.out_dir, "tune_projection.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(md[-len(report) - 3 :]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
