"""When each program of the one-launch tiled HCA decode kernel reaches each point of its work (GPU only).

The S = 1 x 4B workload at 4B = 64 (64 one-row requests, 16 of them closing a group) is the one tiled case of
issue 12 above SGLang's figure, and the latency probe (``scripts/tiled_latency_probe.py``) splits its time
by removing work. This probe instead stamps the shipped kernel's programs with the GPU's global timer
(``%globaltimer``, ns) at six points, each stamp taken once the value it names has arrived (its read waits on
that register):

* ``start``: the program's first instruction; ``waited``: after ``griddepcontrol.wait`` (the kernel before
  has completed), which it executes after requesting its plan record;
* ``record``: its plan record has arrived (tile programs: the closing record; row programs: the row's), read
  after ``waited``;
* ``pooled``: the pooled values of its window slice are in registers (tile programs of closing rows);
* ``counted``: its arrival count has come back from the atomic (they then know whether they finish the entry);
* ``end``: its last store was issued (the finishing program: after the entry's stores).

The kernel is ``_window_finish_kernel`` of ``kernels/c128_tiled.py`` with only the stamps added (they add a
few instructions and one reduction per stamp that needs a tensor's arrival). It runs as the benchmark runs
it: a CUDA graph of 20 layer instances replayed back to back (warm), programmatic dependent launch as
shipped; the stamps of one replay's middle instances are summarised relative to the moment the first
program of that instance passed its wait.

    python scripts/tiled_timeline_probe.py OUT_DIR [--start]   (writes OUT_DIR/TILED_TIMELINE.md and .json;
                                                               --start: TILED_TIMELINE_START.md, every program
                                                               releasing the next kernel at its start)
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tiled_latency_probe as latency  # noqa: E402
from probe_report import page_head, save_results  # noqa: E402

from dsv4_compressor.bench.timing import CudaTimer  # noqa: E402
from dsv4_compressor.kernels.c128_tiled import (  # noqa: E402
    PROGRAM_TILE,
    RELEASE_AT_START_MAX_REQUESTS,
    arrive,
    merged_row,
    pool_window_tile,
)
from dsv4_compressor.kernels.entry_pack import finish_entry  # noqa: E402
from dsv4_compressor.kernels.pdl import launch_options, pdl_enabled, wait_then_release  # noqa: E402
from dsv4_compressor.kernels.plan import closing_capacity, closing_record, row_record  # noqa: E402
from dsv4_compressor.kernels.ring import save_block, save_row, slot_in_state  # noqa: E402

REQUESTS, CLOSING, INSTANCES = 64, 16, 20
POINTS = ("start", "waited", "record", "pooled", "counted", "end")


@triton.jit
def _now(dep):
    """``%globaltimer`` read once the int32 ``dep`` has arrived: both reads are predicated on a comparison of
    ``dep``, so neither can be issued before it."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.u32 p, $1, 2147483647; @p mov.u64 $0, %globaltimer; @!p mov.u64 $0, %globaltimer; }",
        "=l,r",
        [dep],
        dtype=tl.int64,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _bits(x):
    """An int32 that depends on every value of the float tensor ``x``."""
    return tl.sum(x, axis=0).to(tl.int32, bitcast=True)


@triton.jit
def _stamped_kernel(
    kv, state, ape, plan, scratch_ptr, prm, out, tile_programs, stamps,
    E: tl.constexpr, SM: tl.constexpr, RATIO: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
    SAVE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    s0 = _now(pid)
    s3 = s0 * 0
    s4 = s0 * 0
    TILES: tl.constexpr = E.HEAD // TILE
    if pid < tile_programs:
        t, pos, slot, start, row0, end, out_slot, k = closing_record(plan, pid // TILES)
        wait_then_release(PDL)
        s1 = _now(pid)
        s2 = _now(t)
        if (t >= 0) & (out_slot >= 0) & slot_in_state(state, slot, SM):
            ch = (pid % TILES) * TILE + tl.arange(0, TILE)
            pooled = pool_window_tile(kv, state, ape, pos, slot, k, start, row0, ch, SM, RATIO, E.HEAD, TILE,
                                      BLOCK_T)  # fmt: skip
            s3 = _now(_bits(pooled))
            row = scratch_ptr + t.to(tl.int64) * E.HEAD
            arrived = arrive(row, ch, pooled, plan, t)
            s4 = _now(arrived)
            if arrived == TILES - 1:
                finish_entry(merged_row(row, plan, t, E.HEAD, E.BLOCK_HEAD), out_slot, pos - RATIO + 1, prm, out, E)
    else:
        t = pid - tile_programs
        pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
        wait_then_release(PDL)
        s1 = _now(pid)
        s2 = _now(pos)
        save_row(kv, state, ape, t, pos, slot, end, RATIO, E.HEAD, E.HEAD, SM, SAVE_BLOCK)
    s5 = _now(pid)
    base = stamps + pid.to(tl.int64) * 6
    tl.store(base, s0)
    tl.store(base + 1, s1)
    tl.store(base + 2, s2)
    tl.store(base + 3, s3)
    tl.store(base + 4, s4)
    tl.store(base + 5, s5)


def launch_stamped(b: dict, stamps: torch.Tensor, *, start: bool | None = None) -> None:
    """The shipped one-launch kernel's launch (``launch_c128_tiled`` with ``decode=True``), stamped; ``start``:
    its programs release the next kernel at their start (``None``: as shipped,
    ``c128_tiled.RELEASE_AT_START_MAX_REQUESTS``)."""
    kv, state, ape, plan, prm, out, meta, sm = b["args"]
    closing = closing_capacity(plan.T, plan.R, latency.RATIO)
    tile_programs = closing * (meta.HEAD // PROGRAM_TILE)
    programs = tile_programs + plan.T
    if start is None:
        start = plan.R <= RELEASE_AT_START_MAX_REQUESTS
    _stamped_kernel[(programs,)](
        kv, state, ape, plan, b["scratch"], prm, out, tile_programs, stamps, meta, SM=sm, RATIO=latency.RATIO,
        TILE=PROGRAM_TILE, BLOCK_T=128 if plan.R <= 64 else 64, SAVE_BLOCK=save_block(meta.HEAD), num_warps=4,
        **launch_options(pdl_enabled(b["kv"].device), programs, start=start),
    )  # fmt: skip


def _quantiles(x: torch.Tensor) -> list[float]:
    if x.numel() == 0:
        return []
    q = torch.quantile(x.double(), torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    return [round(float(v), 3) for v in q]


def summarise(stamps: torch.Tensor, tile_programs: int, closing: int, tiles: int) -> dict:
    """Per program group and point: ``[min, median, max]`` us after the instance's first ``waited``, over the
    middle instances; and the gap from an instance's last ``end`` to the next instance's first ``waited``."""
    groups = {
        "closing tile programs": torch.arange(closing * tiles),
        "padding tile programs": torch.arange(closing * tiles, tile_programs),
        "row programs": torch.arange(tile_programs, stamps.shape[1]),
    }
    middle = range(4, INSTANCES - 4)
    out: dict = {"groups": {}, "instances": []}
    for name, idx in groups.items():
        per_point = {}
        for j, point in enumerate(POINTS):
            vals = []
            for i in middle:
                zero = stamps[i, :, 1].min()
                v = stamps[i, idx, j]
                v = v[v > 0]
                vals.append((v - zero).double() / 1000.0)
            per_point[point] = _quantiles(torch.cat(vals)) if vals else []
        out["groups"][name] = per_point
    for i in range(INSTANCES):
        zero = stamps[i, :, 1].min()
        first_start = stamps[i, :, 0].min()
        last_end = stamps[i, :, 5].max()
        row = {
            "instance": i,
            "first start": round(float(first_start - zero) / 1000.0, 3),
            "last end": round(float(last_end - zero) / 1000.0, 3),
        }
        if i + 1 < INSTANCES:
            row["next waited - last end"] = round(float(stamps[i + 1, :, 1].min() - last_end) / 1000.0, 3)
        finishers = stamps[i, : closing * tiles, 5].view(closing, tiles).max(dim=1).values
        row["last entry finished"] = round(float(finishers.max() - zero) / 1000.0, 3)
        out["instances"].append(row)
    return out


def main(out_dir: str, *, start: bool = False) -> None:
    os.makedirs(out_dir, exist_ok=True)
    latency.B, latency.S = REQUESTS, 1
    latency.RING = latency.RATIO + 1
    timer = CudaTimer("cuda")
    started = time.time()
    dev = timer.device
    sets = [latency.real_step(CLOSING, dev) for _ in range(INSTANCES)]
    plan = sets[0]["args"][3]
    tile_programs = closing_capacity(plan.T, plan.R, latency.RATIO) * (latency.H // PROGRAM_TILE)
    programs = tile_programs + plan.T
    stamps = torch.zeros(INSTANCES, programs, 6, dtype=torch.int64, device=dev)

    def run():
        for i, b in enumerate(sets):
            launch_stamped(b, stamps[i], start=True if start else None)

    run()
    timer.sync()
    replay = timer.capture(run)
    replays = []
    for _ in range(5):
        replay()
        timer.sync()
        replays.append(summarise(stamps.cpu(), tile_programs, CLOSING, latency.H // PROGRAM_TILE))
    res = {
        "pdl": pdl_enabled(dev),
        "release": "start" if start else "as shipped",
        "requests": REQUESTS,
        "closing": CLOSING,
        "programs": programs,
        "tile_programs": tile_programs,
        "replays": replays,
    }
    stem = "tiled_timeline_start" if start else "tiled_timeline"
    save_results(out_dir, res, started, stem, f"{stem.upper()}.md", render_markdown)


def render_markdown(res: dict) -> str:
    env = res["environment"]
    last = res["replays"][-1]
    lines = page_head(
        "Tiled HCA decode, S = 1 x 4B at 4B = 64: when each program gets where",
        "tiled_timeline_probe.py",
        env,
        note=" What each stamp means: the script's docstring.",
        software=f"; programmatic dependent launch {'on' if res['pdl'] else 'off'}, release {res['release']}",
    )
    lines += [
        f"- {res['requests']} requests of one row, {res['closing']} closing; {res['programs']} programs "
        f"({res['tile_programs']} tile programs, 16 per closing-list record); a CUDA graph of {INSTANCES} "
        "instances, the last of 5 replays",
        "",
        "## us after the instance's first program passed its wait (min / median / max over instances 4-15)",
        "",
        "| programs | " + " | ".join(POINTS) + " |",
        "| --- | " + " | ".join("---:" for _ in POINTS) + " |",
    ]
    for name, per_point in last["groups"].items():
        cells = [" / ".join(f"{v:.2f}" for v in per_point[p]) if per_point[p] else "-" for p in POINTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Per instance (us, same zero)",
        "",
        "| instance | first start | last entry finished | last end | next waited - last end |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in last["instances"]:
        gap = row.get("next waited - last end")
        lines.append(
            f"| {row['instance']} | {row['first start']:.2f} | {row['last entry finished']:.2f} | "
            f"{row['last end']:.2f} | {'-' if gap is None else f'{gap:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out", start="--start" in sys.argv[2:])
