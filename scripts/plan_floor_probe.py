"""What a build_plan of a 1,024-row decode step costs at least with the blocks build's grid (GPU only).

Issue 12 asks ``build_plan`` for at most 3 us per step at T <= 1,024 rows (256 requests of 4 rows). The build
(:mod:`dsv4_compressor.kernels.plan`) runs one program per block of rows (``blocks_config``: at 1,024 rows 32
programs of 32 rows and 8 warps; 8 of 128 rows and 16 warps when docs/PLAN_FLOOR.md was made) and one more for
the header; each block's program reads its own rows' metadata and every row before its block (the prefix, one
1,024-row chunk), counts the runs and group-closing rows in the prefix, scans its own rows and writes their
records. This probe times the same grid of blocks with less to do, each program:

* ``empty``: nothing (the launch);
* ``own rows``: loads its block's ``positions``, ``row_req`` (and the row before each, for run starts) and
  ``out_slot``, and stores one 8-int record per row built from them: the memory round trip in, the stores out;
* ``own rows + prefix``: ... and loads the rows before its block as the build does, reduces them to one count
  (one multi-operand reduction, as the build's prefix count) that every record carries: the dependent chain of
  loads, one reduction and the stores, without the build's scans, run bookkeeping and list records.

Then the build itself in stages, each the previous plus one part, made of the build's own functions
(:mod:`dsv4_compressor.kernels.plan`) on the same grid and warps:

* ``build's reads``: the build's loads of its rows (each row's neighbours too) and its prefix count
  (``_prefix_runs``: run starts, closing rows and the last run start of every row before the block), one
  record per row written as the build writes records;
* ``+ scans``: ... and the build's two scans of its own rows (run and closing index and the run's first row;
  the run's last row), the records carrying what they give;
* ``+ list records``: ... the build's row, request and closing records (``_store_rows``) in place of those
  records: a block program of ``build_plan``, whose last program (the header and the list padding) runs
  beside the blocks.

And the build's last program alone (a grid of one), and the whole build without programmatic dependent launch
(as the stages above are launched), beside ``build_plan`` as the ops launch it.

Timed as the benchmark times ``build_plan``: a CUDA graph of 20 launches on one step's metadata, replay time /
20, median of 200 replays; the real ``build_plan`` is timed the same way in the same run.

    python scripts/plan_floor_probe.py OUT_DIR      (writes OUT_DIR/PLAN_FLOOR.md and .json)
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from probe_report import KERNELS_NOTE, page_head, save_results  # noqa: E402

from dsv4_compressor import ops  # noqa: E402
from dsv4_compressor.bench.results import table  # noqa: E402
from dsv4_compressor.bench.timing import CudaTimer, summarize  # noqa: E402
from dsv4_compressor.kernels import plan as _plan  # noqa: E402

ROWS, REQUESTS, RATIO, LAUNCHES = 1024, 256, 4, 20
BLOCK, WARPS, CHUNK = _plan.blocks_config(ROWS)


@triton.jit
def _sum2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _plan_probe(pos_ptr, req_ptr, out_ptr, rec_ptr, T, MODE: tl.constexpr, BLOCK: tl.constexpr,
                CHUNK: tl.constexpr):  # fmt: skip
    if MODE > 0:
        b0 = tl.program_id(0) * BLOCK
        t = b0 + tl.arange(0, BLOCK)
        inb = t < T
        pos = tl.load(pos_ptr + t, mask=inb, other=0)
        req = tl.load(req_ptr + t, mask=inb, other=-1)
        prev = tl.load(req_ptr + t - 1, mask=inb & (t > 0), other=-1)
        out = tl.load(out_ptr + t, mask=inb, other=-1)
        before = tl.zeros([], tl.int32)
        if MODE > 1:  # the prefix, one chunk: run starts and closing rows before the block
            c = tl.arange(0, CHUNK)
            pm = c < b0
            p_pos = tl.load(pos_ptr + c, mask=pm, other=0)
            p_req = tl.load(req_ptr + c, mask=pm, other=-1)
            p_prev = tl.load(req_ptr + c - 1, mask=pm & (c > 0), other=-1)
            starts, closes = tl.reduce(
                ((pm & (p_req != p_prev)).to(tl.int32), (pm & (p_pos % 4 == 3)).to(tl.int32)), 0, _sum2
            )
            before = starts + closes
        field = tl.arange(0, 8)[None, :]
        values = tl.where(
            field == 0,
            pos.to(tl.int32)[:, None],
            tl.where(field == 1, req.to(tl.int32)[:, None], (out.to(tl.int32) + (req != prev).to(tl.int32))[:, None]),
        )
        tl.store(rec_ptr + 8 * t[:, None] + field, values + before, mask=inb[:, None])


MODES = {"empty": 0, "own rows": 1, "own rows + prefix": 2}


@triton.jit
def _plan_stage_probe(plan, pos_ptr, req_ptr, out_ptr, num_slots, smap, STAGE: tl.constexpr, RATIO: tl.constexpr,
                      BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    T = plan.T
    R = plan.R
    b0 = tl.program_id(0) * BLOCK
    t = b0 + tl.arange(0, BLOCK)
    inb = t < T
    pos, slot, valid, is_start, is_last = _plan._runs(pos_ptr, req_ptr, t, T, num_slots, smap, True, False)
    out64 = tl.load(out_ptr + t, mask=inb, other=-1)
    runs0, closes0, start0 = _plan._prefix_runs(pos_ptr, req_ptr, T, num_slots, smap, b0, RATIO, CHUNK, False)
    rec = _plan._row_base(plan) + _plan.REC * t
    out = out64.to(tl.int32)
    if STAGE == 0:
        _plan._store_record(rec, pos, slot, runs0, closes0, start0, out, b0, T, inb, inb)
    else:
        closes_valid = valid & (pos % RATIO == RATIO - 1)
        n_run, n_close, row0 = tl.associative_scan(
            (is_start.to(tl.int32), closes_valid.to(tl.int32), tl.where(is_start, t, -1)), 0, _plan._scan3
        )
        last = tl.associative_scan(tl.where(is_last, t, 2147483647), 0, _plan._min, reverse=True)
        run = runs0 + n_run - 1
        fits = valid & (run < R)
        row0 = tl.maximum(row0, start0)
        closes_here = fits & (pos % RATIO == RATIO - 1)
        cid = closes0 + n_close - 1
        start = pos - (t - row0)
        end = pos + (last - t) + 1
        if STAGE == 1:
            _plan._store_record(rec, pos, slot, start, row0, end, out, run, cid, inb, inb)
        else:
            _plan._store_rows(plan, t, inb, pos, slot, start, row0, end, tl.where(closes_here, out, -1), run, cid,
                              fits, is_start, closes_here, RATIO)  # fmt: skip


STAGES = {"build's reads": 0, "+ scans": 1, "+ list records": 2}


def step_metadata(dev):
    """A decode step: 256 requests of 4 consecutive rows at random lengths, every request closing a group."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 1 << 16, (REQUESTS,), generator=gen) * RATIO
    positions = (starts[:, None] + torch.arange(RATIO)[None, :]).reshape(-1)
    row_req = torch.arange(REQUESTS).repeat_interleave(RATIO)
    out_slot = torch.where(positions % RATIO == RATIO - 1, torch.arange(ROWS), -1)
    return [x.to(dev) for x in (positions, row_req, out_slot)]


def measure(timer, launch) -> float:
    launch()
    timer.sync()
    graph = timer.capture(lambda: [launch() for _ in range(LAUNCHES)])
    return summarize(timer.time([graph], replays=200, warmup=20, queue_ahead=True))["median_us"] / LAUNCHES


def _launch_grid_of_one(plan, positions, row_req, out_slot, *, rows, requests, ratio, num_slots):
    """The blocks build's kernel on a grid of one program: its last program, which writes the header and pads
    the lists, alone (what ``launch_build_plan`` launches, less the block programs)."""
    block, warps, chunk = _plan.blocks_config(rows)
    _plan._build_plan_blocks_kernel[(1,)](
        _plan.PlanRef(plan, rows, requests), positions, row_req, out_slot, num_slots, _plan.SlotMap(row_req, 0, 0),
        RATIO=ratio, BLOCK=block, CHUNK=chunk, MAP=0, PDL=0, num_warps=warps,
    )  # fmt: skip


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    timer = CudaTimer("cuda")
    started = time.time()
    dev = timer.device
    positions, row_req, out_slot = step_metadata(dev)
    records = torch.empty(ROWS * 8, dtype=torch.int32, device=dev)
    grid = (ROWS // BLOCK,)
    res = {"rows": {}}
    for name, mode in MODES.items():
        res["rows"][name] = measure(
            timer,
            lambda mode=mode: _plan_probe[grid](
                positions, row_req, out_slot, records, ROWS, MODE=mode, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=WARPS
            ),
        )
        print(name, res["rows"][name], flush=True)
    plan = ops.empty_plan(ROWS, REQUESTS, RATIO, dev)
    ref = _plan.PlanRef(plan, ROWS, REQUESTS)
    for name, stage in STAGES.items():
        res["rows"][name] = measure(
            timer,
            lambda stage=stage: _plan_stage_probe[grid](
                ref,
                positions,
                row_req,
                out_slot,
                REQUESTS,
                _plan.SlotMap(row_req, 0, 0),
                STAGE=stage,
                RATIO=RATIO,
                BLOCK=BLOCK,
                CHUNK=CHUNK,
                num_warps=WARPS,
            ),
        )
        print(name, res["rows"][name], flush=True)
    # the last program of the build (the header and the list padding) alone: a grid of one is that program
    shape = dict(rows=ROWS, requests=REQUESTS, ratio=RATIO, num_slots=REQUESTS)
    res["rows"]["header's program alone"] = measure(
        timer, lambda: _launch_grid_of_one(plan, positions, row_req, out_slot, **shape)
    )
    print("header's program alone", res["rows"]["header's program alone"], flush=True)
    res["rows"]["build_plan, no PDL"] = measure(
        timer, lambda: _plan.launch_build_plan(plan, positions, row_req, out_slot, kernel="blocks", **shape)
    )
    print("build_plan, no PDL", res["rows"]["build_plan, no PDL"], flush=True)
    res["rows"]["build_plan"] = measure(
        timer, lambda: ops.build_plan(plan, positions, row_req, out_slot, ratio=RATIO, num_slots=REQUESTS)
    )
    print("build_plan", res["rows"]["build_plan"], flush=True)
    save_results(out_dir, res, started, "plan_floor", "PLAN_FLOOR.md", render_markdown)


def render_markdown(res: dict) -> str:
    env = res["environment"]
    lines = [
        *page_head(
            "build_plan at 1,024 rows: the floor of the blocks build's grid",
            "plan_floor_probe.py",
            env,
            note=KERNELS_NOTE,
        ),  # fmt: skip
        f"- {ROWS} rows, {REQUESTS} requests of {RATIO} rows, ratio {RATIO}; {ROWS // BLOCK} programs of {BLOCK} "
        f"rows and {WARPS} warps; a CUDA graph of {LAUNCHES} launches on one step's metadata (warm)",
        "",
        table(["kernel", "us per launch"], [[k, f"{v:.2f}"] for k, v in res["rows"].items()]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
