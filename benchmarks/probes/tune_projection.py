"""Sweep the projection kernel's blocks on the GPU against cuBLAS, per DeepSeek-V4 shape and step size.

For each weight shape (V4-Flash D = 4096, V4-Pro 7168; CSA main 2W = 2048, the indexer 512, HCA 1024) and each
``T``, a CUDA graph of 20 launches on distinct weights, inputs and workspaces (the bench's projection case:
20 weights are far more than L2 holds) is timed for the heuristic's blocks, a sample of other blocks and
``torch.mm(x, w.T, out_dtype=float32)``; every candidate's output is checked against float64 first (the
float32 bound of ``tests/test_projection_gpu.py``) and a wrong one is reported, not timed::

    python -m benchmarks.probes.tune_projection OUT_DIR [--time-budget 240] [--rows 64,256] \
        [--block-k 64,128,256] [--stages 3,4,5] [--shapes 2048x4096,512x4096]

Beside them the probe times the **read floor**: :func:`_read_kernel`, no math, streams each of the 20 weights
once (flat, in chunks of ``BLOCK`` elements per program) and writes one float per program, at a few grid sizes;
the fastest is the least a kernel that reads the weight costs in this graph, cold from HBM. Writes
``OUT_DIR/tune_projection.md`` (best per shape against the heuristic, cuBLAS and the read floor) and
``OUT_DIR/tune_projection.json`` (every figure), and prints :data:`~dsv4_compressor.kernels.projection.OVERRIDES`
entries for the winners.

``--pairs 2048+512x4096,...`` measures a CSA layer's two projections (CSA main and the indexer, one ``x``)
instead: cuBLAS as two GEMMs and as one on the concatenated weight, ours as two launches (each at its
:func:`~dsv4_compressor.kernels.projection.projection_config`) and as one launch over both weights
(``launch_projection(..., weight2=)``) at the heuristic's and a sample of other blocks; writes
``OUT_DIR/tune_pairs.md`` / ``.json``.
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
import triton
import triton.language as tl

from dsv4_compressor import ops
from dsv4_compressor.kernels import projection as proj

SHAPES = [(width, dim) for dim in (4096, 7168) for width in (2048, 512, 1024)]
INSTANCES = 20
REPLAYS = 30
U32 = 2.0**-24


def candidates(rows: int, width: int, dim: int, *, sample: int, seed: int, block_ks=(64, 128),
               stages_list=(3, 4)) -> list[proj.ProjectionConfig]:  # fmt: skip
    """The heuristic's blocks first, then a seeded sample of the grid (row block the step's power of two up to
    64, or 128 at 8 warps for steps that have them; column blocks 32-128, K blocks ``block_ks``, K splits that
    keep two K steps per program, 4/8 warps, ``stages_list`` stages)."""
    base = proj.projection_config(rows, width, dim)
    pow2 = min(64, max(16, 1 << max(0, (rows - 1).bit_length())))
    grid = []
    for block_t, block_n, block_k, split, warps, stages in itertools.product(
        (pow2, 128), (32, 64, 128), block_ks, (1, 2, 4, 8, 16, 32), (4, 8), stages_list
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


@triton.jit
def _read_kernel(w_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``i`` reads elements ``[i * CHUNK, (i + 1) * CHUNK)`` of the flat weight, ``BLOCK`` per step,
    and stores their sum (so the loads are not dead code): the weight's bytes and nothing else."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK):
        acc += tl.load(w_ptr + base + k + offs).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


#: Read-floor grids: (programs, elements per load step, warps); programs that divide every V4 weight's numel.
READ_GRIDS = [(p, b, w) for p in (128, 256, 512, 1024, 2048) for b in (2048, 4096, 8192) for w in (4, 8)]


def read_floor(weights) -> list[dict]:
    """us per launch of :func:`_read_kernel` over ``weights`` (one graph launch per weight) at each grid."""
    numel = weights[0].numel()
    dev = weights[0].device
    out = [torch.empty(max(p for p, _, _ in READ_GRIDS), device=dev) for _ in weights]
    results = []
    for programs, block, warps in READ_GRIDS:
        chunk = numel // programs
        if numel % programs or chunk % block:
            continue

        def run(programs=programs, chunk=chunk, block=block, warps=warps):
            for w, o in zip(weights, out):
                _read_kernel[(programs,)](w, o, CHUNK=chunk, BLOCK=block, num_warps=warps, num_stages=4)

        entry = {"programs": programs, "block": block, "warps": warps}
        try:
            replay = _graph(run)
            got, want = out[0][:programs].sum().item(), weights[0].float().sum().item()
            if abs(got - want) > 1e-3 * (1 + weights[0].float().abs().sum().item()):
                entry["error"] = f"sum {got} != {want}"
            else:
                entry["us"] = _time(replay)
        except Exception as exc:  # noqa: BLE001 - reported, the probe goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(entry)
    return results


def _variants(cfgs, partials: bool):
    """``(cfg, reduce)`` to time: each config as the kernel sums it, and with ``partials`` a split one also as
    its unsummed partials (``launch_projection(reduce=False)``: what a consumer adding them itself would pay)."""
    for cfg in cfgs:
        yield cfg, True
        if partials and cfg.split_k > 1:
            yield cfg, False


def _result(space, rows: int, width: int, cfg, reduce: bool) -> torch.Tensor:
    """The float64 ``kv_score`` a launch left in ``space``: its sum, or its partials added in split order."""
    if reduce:
        return space[: rows * width].view(rows, width).double()
    parts = space[rows * width : rows * width * (1 + cfg.split_k)].view(cfg.split_k, rows, width)
    return parts.double().sum(0)


def _best_partials(res) -> dict | None:
    timed = [r for r in res if r.get("partials") and "us" in r]
    return min(timed, key=lambda r: r["us"]) if timed else None


def _partials_cell(best) -> str:
    return f"{best['us']:.2f} {tuple(best['config'])}" if best else "-"


def measure(
    rows: int, width: int, dim: int, cfgs, deadline: float, *, floor: bool = False, partials: bool = False
) -> list[dict]:
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
    if floor:
        reads = [r for r in read_floor(ws_) if "us" in r]
        if reads:
            best = min(reads, key=lambda r: r["us"])
            results.append({"config": "read floor", "us": best["us"], "grid": best, "grids": reads})
    for cfg, reduce in _variants(cfgs, partials):
        if time.monotonic() > deadline:
            break
        spaces = [torch.zeros(proj.workspace_numel(rows, width, cfg), device=dev) for _ in range(INSTANCES)]

        def ours(cfg=cfg, spaces=spaces, reduce=reduce):
            for x, w, s in zip(xs, ws_, spaces):
                proj.launch_projection(x, w, s, rows=rows, cfg=cfg, pdl=pdl, reduce=reduce)

        entry = {"config": list(cfg)} if reduce else {"config": list(cfg), "partials": True}
        try:
            replay = _graph(ours)
            kv = _result(spaces[0], rows, width, cfg, reduce)
            if not ((kv - ref).abs() <= bound).all():
                entry["error"] = "outside the float32 bound"
            else:
                entry["us"] = _time(replay)
        except Exception as exc:  # a config the compiler or the device refuses: reported, the sweep goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(entry)
        del spaces
    return results


def measure_pair(
    rows: int, first: int, second: int, dim: int, cfgs, deadline: float, *, partials: bool = False
) -> list[dict]:
    """us per instance of a CSA layer's two projections (``first`` and ``second`` outputs of one ``x``)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows * 7 + first + second + dim)
    w1 = [(torch.randn(first, dim, device=dev, generator=gen) / dim**0.5).to(torch.bfloat16) for _ in range(INSTANCES)]
    w2 = [(torch.randn(second, dim, device=dev, generator=gen) / dim**0.5).to(torch.bfloat16) for _ in range(INSTANCES)]
    cat = [torch.cat([a, b]) for a, b in zip(w1, w2)]
    xs = [torch.randn(rows, dim, device=dev, generator=gen).to(torch.bfloat16) for _ in range(INSTANCES)]
    width = first + second
    ref = xs[0].double() @ cat[0].double().t()
    bound = dim * U32 * (xs[0].double().abs() @ cat[0].double().abs().t())
    pdl = ops.pdl_enabled(dev)

    def cublas_two():
        for x, a, b in zip(xs, w1, w2):
            torch.mm(x, a.t(), out_dtype=torch.float32)
            torch.mm(x, b.t(), out_dtype=torch.float32)

    def cublas_cat():
        for x, w in zip(xs, cat):
            torch.mm(x, w.t(), out_dtype=torch.float32)

    results = [{"config": "cublas two", "us": _time(_graph(cublas_two))},
               {"config": "cublas concatenated", "us": _time(_graph(cublas_cat))}]  # fmt: skip
    c1, c2 = proj.projection_config(rows, first, dim), proj.projection_config(rows, second, dim)
    s1 = [torch.zeros(proj.workspace_numel(rows, first, c1), device=dev) for _ in range(INSTANCES)]
    s2 = [torch.zeros(proj.workspace_numel(rows, second, c2), device=dev) for _ in range(INSTANCES)]

    def ours_two():
        for x, a, b, u, v in zip(xs, w1, w2, s1, s2):
            proj.launch_projection(x, a, u, rows=rows, cfg=c1, pdl=pdl)
            proj.launch_projection(x, b, v, rows=rows, cfg=c2, pdl=pdl)

    results.append({"config": "ours two", "us": _time(_graph(ours_two)), "blocks": [list(c1), list(c2)]})
    for cfg, reduce in _variants(cfgs, partials):
        if time.monotonic() > deadline:
            break
        if first % cfg.block_n:
            continue
        spaces = [torch.zeros(proj.workspace_numel(rows, width, cfg), device=dev) for _ in range(INSTANCES)]

        def ours(cfg=cfg, spaces=spaces, reduce=reduce):
            for x, a, b, sp in zip(xs, w1, w2, spaces):
                proj.launch_projection(x, a, sp, rows=rows, cfg=cfg, pdl=pdl, weight2=b, reduce=reduce)

        entry = {"config": list(cfg)} if reduce else {"config": list(cfg), "partials": True}
        try:
            replay = _graph(ours)
            kv = _result(spaces[0], rows, width, cfg, reduce)
            if not ((kv - ref).abs() <= bound).all():
                entry["error"] = "outside the float32 bound"
            else:
                entry["us"] = _time(replay)
        except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(entry)
        del spaces
    return results


def pairs_main(args, rows_list, block_ks, stages_list) -> int:
    pairs = []
    for item in args.pairs.split(","):
        widths, dim = item.split("x")
        first, second = (int(v) for v in widths.split("+"))
        pairs.append((first, second, int(dim)))
    cases = [(rows, *p) for p in pairs for rows in rows_list]
    start = time.monotonic()
    report, lines = [], []
    for i, (rows, first, second, dim) in enumerate(cases):
        share = (args.time_budget - (time.monotonic() - start)) / (len(cases) - i)
        cfgs = candidates(rows, first + second, dim, sample=args.sample, seed=i, block_ks=block_ks,
                          stages_list=stages_list)  # fmt: skip
        res = measure_pair(rows, first, second, dim, cfgs, time.monotonic() + share, partials=args.partials)
        named = {r["config"]: r["us"] for r in res if isinstance(r["config"], str)}
        mine = [r for r in res if not isinstance(r["config"], str) and not r.get("partials")]
        timed = [r for r in mine if "us" in r]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        best_parts = _best_partials(res)
        report.append(
            {
                "T": rows,
                "first": first,
                "second": second,
                "dim": dim,
                "results": res,
                "best": best,
                "best_partials": best_parts,
            }
        )
        line = (f"| {dim} | {first} + {second} | {rows} | {named['cublas two']:.2f} | "
                f"{named['cublas concatenated']:.2f} | {named['ours two']:.2f} | "
                f"{mine[0].get('us', float('nan')) if mine else float('nan'):.2f} | "
                f"{best['us'] if best else float('nan'):.2f} | {tuple(best['config']) if best else '-'} | "
                f"{len(mine)} | {_partials_cell(best_parts)} |")  # fmt: skip
        lines.append(line)
        print(line, flush=True)
    md = ["# A CSA layer's two projections in one launch", "",
          f"Graph of {INSTANCES} layer instances on distinct weights, median of {REPLAYS} replays, us per "
          "instance (both projections).", "",
          "| D | 2W main + indexer | T | cuBLAS two | cuBLAS concatenated | ours two | ours one launch, "
          "heuristic | ours one launch, best | best blocks (T, N, K, split, warps, stages) | tried | partials "
          "left unsummed, best (blocks) |",
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |", *lines, ""]  # fmt: skip
    with open(os.path.join(args.out_dir, "tune_pairs.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.out_dir, "tune_pairs.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--rows", default="64,256", help="step sizes T")
    ap.add_argument("--sample", type=int, default=40, help="grid candidates per shape and T beside the heuristic")
    ap.add_argument("--block-k", default="64,128", help="K blocks the sample draws from")
    ap.add_argument("--stages", default="3,4", help="pipeline stages the sample draws from")
    ap.add_argument("--shapes", default=None, help="2WxD list (default: every V4 shape)")
    ap.add_argument("--no-floor", action="store_true", help="skip the read floor")
    ap.add_argument("--pairs", default=None, help="main+indexerxD list: time a CSA layer's two projections")
    ap.add_argument("--partials", action="store_true", help="also time each split config leaving its partials")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    block_ks = tuple(int(v) for v in args.block_k.split(","))
    stages_list = tuple(int(v) for v in args.stages.split(","))
    if args.pairs:
        return pairs_main(args, rows_list, block_ks, stages_list)
    cases = [(rows, width, dim) for width, dim in shapes for rows in rows_list]
    start = time.monotonic()
    report, lines = [], []
    for i, (rows, width, dim) in enumerate(cases):
        share = (args.time_budget - (time.monotonic() - start)) / (len(cases) - i)
        cfgs = candidates(rows, width, dim, sample=args.sample, seed=i, block_ks=block_ks, stages_list=stages_list)
        res = measure(rows, width, dim, cfgs, time.monotonic() + share, floor=not args.no_floor, partials=args.partials)
        named = {r["config"]: r for r in res if isinstance(r["config"], str)}
        mine = [r for r in res if not isinstance(r["config"], str) and not r.get("partials")]
        timed = [r for r in mine if "us" in r]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        best_parts = _best_partials(res)
        heur = mine[0] if mine else {}
        floor_us = named.get("read floor", {}).get("us", float("nan"))
        row = {"T": rows, "width": width, "dim": dim, "cublas_us": res[0]["us"], "read_floor_us": floor_us,
               "bytes_floor_us": (width * dim * 2 + rows * dim * 2 + rows * width * 4) / 4.2e6,
               "heuristic": heur, "best": best, "best_partials": best_parts, "tried": len(mine),
               "results": res}  # fmt: skip
        report.append(row)
        line = (f"| {dim} | {width} | {rows} | {res[0]['us']:.2f} | {floor_us:.2f} | {row['bytes_floor_us']:.2f} | "
                f"{heur.get('us', float('nan')):.2f} | {best['us'] if best else float('nan'):.2f} | "
                f"{tuple(best['config']) if best else '-'} | {len(mine)} | {_partials_cell(best_parts)} |")  # fmt: skip
        lines.append(line)
        print(line, flush=True)
    md = ["# Projection block sweep", "",
          f"Graph of {INSTANCES} launches on distinct weights, median of {REPLAYS} replays, us per launch. "
          "read floor: the fastest grid of a kernel that only reads the weight (no math); bytes floor: weight, "
          "x and kv_score bytes at 4.2 TB/s.", "",
          "| D | 2W | T | cuBLAS | read floor | bytes floor | heuristic | best | best blocks (T, N, K, split, "
          "warps, stages) | tried | partials left unsummed, best (blocks) |",
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |", *lines, ""]  # fmt: skip
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
