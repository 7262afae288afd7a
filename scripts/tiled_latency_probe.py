"""What a decode step of the tiled HCA ring costs when a few requests close a group, at best (GPU only).

Issue 12 asks the two-stage tiled kernel for a step where a few requests close a group (the common case) to
take at most 1.5 us more than a step where none does. A ring design must read a closing request's whole
window (128 rows x 512 channels of values and gate logits, 512 KiB) when the group closes, split over
programs to read it fast, and then merge the programs' pooled channels before the RMSNorm. This probe times
the skeleton of such a step in one launch, the design issue 12 proposes and the shipped kernel runs for decode
steps of up to 256 requests (``kernels/c128_tiled.py``), with nothing the real kernel must also do (no plan, no
APE bias, no rope, no FP8 pack):

* ``save``: one program per row stores its row into the ring (what a step where no group closes does), plus
  16 programs per request slot of the closing list that find nothing to do (the grid depends on shapes only);
* ``window``: ... and the 16 programs of each closing request read their 128 x 32 slice of its window and
  store the pooled channels;
* ``merge``: ... and the last of a request's 16 programs to arrive (atomic counter) reads the 512 pooled
  channels back and stores them normalized.
* ``whole``: ... the other design, no merge: one program per closing request reads its whole window, 16
  rows at a time (online softmax over all 512 channels), and stores the pooled channels normalized.

Then the shipped design's real pieces (``kernels/c128_tiled.py``: a plan built by ``build_plan``, DeepSeek-V4's
132-row ring addressed as the kernels address it, the APE bias):

* ``real merge``: the shipped one-launch kernel up to its finish: each tile program reads its closing record
  from the plan and pools its window slice (``pool_window_tile``), the last to arrive stores the pooled row
  normalized (RMS only: no rope, no FP8 pack), and the row programs save the rows;
* ``shipped``: ``launch_c128_tiled`` as ``ops.compress`` launches it on a decode step (one launch).

Each is timed like the benchmark (a CUDA graph of 20 layer instances, replay time / 20, median of 200
replays; warm: one input set replayed back to back; cold: input copies rotated past twice the L2) for no,
a few (2) and every (64) request of 64 closing. ``merge(few) - save(none)`` is a floor under the issue's
1.5 us for any design that reads the window when its group closes.

    python scripts/tiled_latency_probe.py OUT_DIR      (writes OUT_DIR/TILED_LATENCY.md and .json)

Another workload: ``--requests N --rows S --closing K`` (requests, rows per request, and a column with K of
them closing besides none, few and every), written to ``TILED_LATENCY_<N>x<S>.md``; e.g. the S = 1 x 4B
workload at B = 16 (64 one-row requests, 16 of them closing) is ``--requests 64 --rows 1 --closing 16``.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from probe_report import KERNELS_NOTE, page_head, save_results  # noqa: E402

from dsv4_compressor import ops  # noqa: E402
from dsv4_compressor.bench.results import table  # noqa: E402
from dsv4_compressor.bench.timing import CudaTimer, summarize  # noqa: E402
from dsv4_compressor.config import CompressorConfig, CompressorParams  # noqa: E402
from dsv4_compressor.kernels import exact_fp8_default  # noqa: E402
from dsv4_compressor.kernels.c128_tiled import (  # noqa: E402
    PROGRAM_TILE,
    absorb_rows,
    launch_c128_tiled,
    pool_window_tile,
)
from dsv4_compressor.kernels.entry_pack import entry_args  # noqa: E402
from dsv4_compressor.kernels.pdl import launch_options, pdl_enabled, wait_then_release  # noqa: E402
from dsv4_compressor.kernels.plan import (  # noqa: E402
    PlanRef,
    closing_capacity,
    closing_record,
    row_arrivals_ptr,
    row_record,
)
from dsv4_compressor.kernels.ring import KvRef, StateMeta, save_block, save_row, slot_in_state  # noqa: E402

H, RATIO, S, B, TILES, INSTANCES, L2_BYTES = 512, 128, 4, 64, 16, 20, 60 * 2**20
RING = RATIO + S  # window rows, then the rows this step saves (kept apart: timing only)
CW = H // TILES


@triton.jit
def _softmax_pool(kv, score):
    """Each channel's values ``kv [rows, channels]`` pooled by the softmax of its gate logits over the rows."""
    e = tl.exp(score - tl.max(score, axis=0)[None, :])
    return tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)


@triton.jit
def _tiled_step(kv_ptr, ring_ptr, ring_desc, exch_ptr, cnt_ptr, out_ptr, closing,
                B: tl.constexpr, S: tl.constexpr, H: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr,
                TILES: tl.constexpr, WORK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_release(PDL)
    pid = tl.program_id(0)
    if pid < B * TILES:
        # a tile program of closing-list record k: requests k < closing close a group this step
        k = pid // TILES
        if (WORK == 3) & (k < closing) & (pid % TILES == 0):
            # one program per closing request: the whole window, 16 rows at a time, by online softmax
            full = tl.arange(0, H)
            m = tl.full([H], float("-inf"), tl.float32)
            s = tl.zeros([H], tl.float32)
            a = tl.zeros([H], tl.float32)
            for r0 in range(0, RATIO, 16):
                rows = r0 + tl.arange(0, 16)
                base = ring_ptr + (k.to(tl.int64) * RING + rows[:, None]) * (2 * H) + full[None, :]
                kv = tl.load(base)
                m, s, a = absorb_rows(m, s, a, kv, tl.load(base + H))
            c = a / s
            tl.store(out_ptr + k * H + full, c * tl.math.rsqrt(tl.sum(c * c, axis=0) / H + 1e-6))
        if (WORK == 1) | (WORK == 2):
            if k < closing:
                ch = (pid % TILES) * (H // TILES) + tl.arange(0, H // TILES)
                rows = tl.arange(0, RATIO)
                base = ring_ptr + (k.to(tl.int64) * RING + rows[:, None]) * (2 * H) + ch[None, :]
                kv = tl.load(base)
                score = tl.load(base + H)
                pooled = _softmax_pool(kv, score)
                tl.store(exch_ptr + k * H + ch, pooled)
                if WORK >= 2:
                    old = tl.atomic_add(cnt_ptr + k, 1, sem="acq_rel")
                    if old % TILES == TILES - 1:
                        full = tl.arange(0, H)
                        c = tl.load(exch_ptr + k * H + full, cache_modifier=".cg")
                        tl.store(out_ptr + k * H + full, c * tl.math.rsqrt(tl.sum(c * c, axis=0) / H + 1e-6))
        if (WORK == 4) | (WORK == 5):
            if k < closing:
                # the window split by rows as well as channels: RB row blocks of RATIO / RB rows, each over
                # CW = H * RB / TILES channels, so a program reads CW * 4 contiguous bytes of each of its rows
                RB: tl.constexpr = 16 if WORK == 4 else 4
                CW: tl.constexpr = H * RB // TILES
                j = pid % TILES
                ch = (j // RB) * CW + tl.arange(0, CW)
                rows = (j % RB) * (RATIO // RB) + tl.arange(0, RATIO // RB)
                base = ring_ptr + (k.to(tl.int64) * RING + rows[:, None]) * (2 * H) + ch[None, :]
                kv = tl.load(base)
                score = tl.load(base + H)
                # (a partial state per channel: its weighted sum over the block's rows, stored for timing only)
                tl.store(exch_ptr + k * H + ch, _softmax_pool(kv, score))
        if WORK == 6:
            if k < closing:
                # the shipped split (128 rows x 32 channels), each slice fetched by the tensor memory
                # accelerator (one bulk copy per operand) instead of by every thread's loads
                CW6: tl.constexpr = H // TILES
                c0 = (pid % TILES) * CW6
                kv = ring_desc.load([k * RING, c0])
                score = ring_desc.load([k * RING, H + c0])
                tl.store(exch_ptr + k * H + c0 + tl.arange(0, CW6), _softmax_pool(kv, score))
    else:
        # a row program: save the row into its request's ring
        t = pid - B * TILES
        col = tl.arange(0, 2 * H)
        row = tl.load(kv_ptr + t.to(tl.int64) * (2 * H) + col)
        tl.store(ring_ptr + ((t // S).to(tl.int64) * RING + RATIO + t % S) * (2 * H) + col, row)


WORK = {"save": 0, "window": 1, "merge": 2, "whole": 3}
#: Diagnostics, not in the page: other ways to read the same windows (``window rows16``: 16 blocks of 8 whole
#: rows; ``window rows4``: 4 blocks of 32 rows x 128 channels; ``window tma``: the shipped split, each slice
#: fetched by two TMA bulk copies), to time how fast each reads the same bytes.
READ_DIAGNOSTICS = {"window rows16": 4, "window rows4": 5, "window tma": 6}


@triton.jit
def _real_merge(kv, state, ape, plan, scratch_ptr, out_ptr, tile_programs, SM: tl.constexpr, RATIO: tl.constexpr,
                HEAD: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr, SAVE_BLOCK: tl.constexpr,
                PDL: tl.constexpr):  # fmt: skip
    """The shipped one-launch decode kernel with its finish cut to the RMS: ``out[row]`` gets the pooled row
    times ``rsqrt(mean(c^2) + 1e-6)``."""
    wait_then_release(PDL)
    pid = tl.program_id(0)
    TILES: tl.constexpr = HEAD // TILE
    if pid < tile_programs:
        t, pos, slot, start, row0, end, out_slot, k = closing_record(plan, pid // TILES)
        if (t >= 0) & (out_slot >= 0) & slot_in_state(state, slot, SM):
            ch = (pid % TILES) * TILE + tl.arange(0, TILE)
            pooled = pool_window_tile(kv, state, ape, pos, slot, k, start, row0, ch, SM, RATIO, HEAD, TILE, BLOCK_T)
            row = scratch_ptr + t.to(tl.int64) * HEAD
            tl.store(row + ch, pooled)
            tl.debug_barrier()
            arrivals = row_arrivals_ptr(plan, t)
            if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == TILES - 1:
                tl.store(arrivals, 0)
                full = tl.arange(0, HEAD)
                c = tl.load(row + full, cache_modifier=".cg")
                tl.store(out_ptr + t.to(tl.int64) * HEAD + full, c * tl.math.rsqrt(tl.sum(c * c, axis=0) / HEAD + 1e-6))
    else:
        t = pid - tile_programs
        pos, slot, start, row0, end, out_slot, k = row_record(plan, t)
        save_row(kv, state, ape, t, pos, slot, end, RATIO, HEAD, HEAD, SM, SAVE_BLOCK)


#: The kernels of the shipped design's real pieces (see the module docstring).
REAL = ("real merge", "shipped")


@functools.cache
def _hca(dev: torch.device):
    """DeepSeek-V4's HCA config and one random parameter set on ``dev`` (shared by every instance)."""
    cfg = CompressorConfig.hca()
    return cfg, CompressorParams.random(cfg, max_positions=4 * RATIO, device=dev)


def real_step(closing: int, dev) -> dict:
    """One layer instance of a decode step of ``B`` requests of ``S`` rows, the first ``closing`` of them
    closing a group at their last row (positions ``256 - S .. 255``; the others at ``200 ..``): its rows, ring,
    plan, scratch, output pages and the launchers' grouped arguments, built as ``ops.compress`` builds them."""
    cfg, p = _hca(dev)
    t = B * S
    first = torch.where(torch.arange(B) < closing, 2 * RATIO - S, 200)
    positions = (first[:, None] + torch.arange(S)).flatten().to(dev)
    row_req = torch.arange(B, device=dev).repeat_interleave(S)
    plan = ops.empty_plan(t, B, RATIO, dev)
    ops.build_plan(plan, positions, row_req, torch.arange(t, device=dev), ratio=RATIO, num_slots=B)
    kv = torch.randn(t, 2 * H, device=dev)
    ring = torch.randn(B, cfg.ring_rows(3), 2 * H, device=dev)
    pages = torch.empty(-(-t // 2), 2 * cfg.entry_bytes, dtype=torch.uint8, device=dev)
    state, ring_rows, per_block = ops._state("tiled_latency_probe", ring, None, None, None, ops.plan_info(plan),
                                             width=H, window=RATIO, decode=True, device=ring.device)  # fmt: skip
    prm, out, meta = entry_args(
        head=H, rope=cfg.rope_dim, latent=True, page_size=2, scale_bytes=cfg.record_scale_bytes,
        norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=p.eps, out_pages=pages, out_keys=None,
        exact_fp8=exact_fp8_default(dev),
    )  # fmt: skip
    return dict(
        kv=kv, ring=ring, plan=plan, scratch=torch.empty(t, H, device=dev), out=torch.empty(t * H, device=dev),
        pages=pages, args=(KvRef(kv, kv.stride(0)), state, ops._ape_ref(p.ape, H), PlanRef(plan, t, B), prm, out, meta,
                           StateMeta(RING=ring_rows, TABLE=False, HAS_APE=True, RPB=per_block)),
    )  # fmt: skip


def launch_real(kernel: str, b: dict) -> None:
    """One launch of a :data:`REAL` kernel on :func:`real_step`'s instance ``b``."""
    kv, state, ape, plan, prm, out, meta, sm = b["args"]
    closing = closing_capacity(plan.T, plan.R, RATIO)
    pdl = pdl_enabled(b["kv"].device)
    if kernel == "shipped":
        launch_c128_tiled(kv, state, ape, plan, prm, out, meta, sm, b["scratch"], ratio=RATIO, closing=closing,
                          decode=True, one_launch=True, pdl=pdl)  # fmt: skip
    elif kernel == "real merge":
        tile_programs = closing * (H // PROGRAM_TILE)
        programs = tile_programs + plan.T
        _real_merge[(programs,)](
            kv, state, ape, plan, b["scratch"], b["out"], tile_programs, SM=sm, RATIO=RATIO, HEAD=H,
            TILE=PROGRAM_TILE, BLOCK_T=128 if plan.R <= 64 else 64, SAVE_BLOCK=save_block(H), num_warps=4,
            **launch_options(pdl, programs),
        )  # fmt: skip
    else:
        raise ValueError(kernel)


def _instances(copies: int, dev):
    sets = []
    for _ in range(copies):
        instances = []
        for _ in range(INSTANCES):
            ring = torch.randn(B, RING, 2 * H, device=dev)
            instances.append(
                dict(
                    kv=torch.randn(B * S, 2 * H, device=dev), ring=ring, exch=torch.empty(B * H, device=dev),
                    cnt=torch.zeros(B, dtype=torch.int32, device=dev), out=torch.empty(B * H, device=dev),
                    # the ring as rows for `window tma` (a window slice: 128 rows x 32 channels)
                    desc=TensorDescriptor.from_tensor(ring.view(B * RING, 2 * H), [RATIO, H // TILES]),
                )
            )  # fmt: skip
        sets.append(instances)
    return sets


def measure(timer, kernel: str, closing: int, *, hot: bool) -> float:
    # bytes a replay touches: rows read and saved, and the closing requests' windows
    per_instance = (B * S * 2 * H * 2 + closing * RATIO * 2 * H) * 4
    copies = 1 if hot else max(1, min(16, -(-2 * L2_BYTES // (INSTANCES * per_instance))))
    if kernel in REAL:
        sets = [[real_step(closing, timer.device) for _ in range(INSTANCES)] for _ in range(copies)]
    else:
        sets = _instances(copies, timer.device)
    grid = (B * TILES + B * S,)
    # launched as the shipped kernels are (programmatic dependent launch where the device has it)
    opts = dict(num_warps=4, **launch_options(pdl_enabled(timer.device), grid[0]))

    def step(k):
        def run():
            for b in sets[k]:
                if kernel in REAL:
                    launch_real(kernel, b)
                    continue
                _tiled_step[grid](b["kv"], b["ring"], b["desc"], b["exch"], b["cnt"], b["out"], closing, B=B, S=S, H=H,
                                  RATIO=RATIO, RING=RING, TILES=TILES, WORK={**WORK, **READ_DIAGNOSTICS}[kernel],
                                  **opts)  # fmt: skip

        return run

    calls = [step(k) for k in range(copies)]
    for call in calls:
        call()
    timer.sync()
    graphs = [timer.capture(call) for call in calls]
    return summarize(timer.time(graphs, replays=200, warmup=20, queue_ahead=True), per=INSTANCES)["median_us"]


def main(out_dir: str, requests: int | None = None, rows: int | None = None, closing: int | None = None) -> None:
    global B, S, RING
    page = "TILED_LATENCY.md"
    if requests is not None:  # another workload: the module's shapes are what every function reads
        B, S = requests, rows or S
        RING = RATIO + S
        page = f"TILED_LATENCY_{B}x{S}.md"
    os.makedirs(out_dir, exist_ok=True)
    timer = CudaTimer("cuda")
    started = time.time()
    closings = {"none": 0, "few (2)": 2, **({f"{closing} of {B}": closing} if closing else {}), f"every ({B})": B}
    res = {"pdl": pdl_enabled(torch.device("cuda", torch.cuda.current_device())), "rows": {}}
    for kernel in (*WORK, *REAL):
        for hot in (True, False):
            label = f"{kernel}, {'warm' if hot else 'cold'}"
            res["rows"][label] = {name: measure(timer, kernel, c, hot=hot) for name, c in closings.items()}
            print(label, res["rows"][label], flush=True)
    name = page.removesuffix(".md").lower()
    save_results(out_dir, res, started, name, page, lambda res: render_markdown(res, list(closings)))


def render_markdown(res: dict, closings: list[str]) -> str:
    env = res["environment"]
    rows = res["rows"]
    lines = [
        *page_head(
            "Tiled HCA decode, a few requests closing: the floor of a one-launch ring step",
            "tiled_latency_probe.py",
            env,
            note=KERNELS_NOTE,
            software=f"; programmatic dependent launch {'on' if res.get('pdl') else 'off'}",
        ),  # fmt: skip
        f"- B = {B} requests of S = {S} rows, H = {H}, ratio {RATIO}; one launch of {B * TILES} tile programs "
        f"(16 per closing-list record) and {B * S} row programs, 4 warps each",
        "",
        "## us per layer",
        "",
        table(["kernel"] + closings, [[k] + [f"{v[c]:.2f}" for c in closings] for k, v in rows.items()]),
        "",
        "## Few closing minus none (us per layer)",
        "",
        "Against the same kernel's step where none closes (same code, so the same registers and occupancy), and "
        "against `save` where none closes (the step with only the save to do).",
        "",
        table(
            ["kernel", "warm, same kernel", "cold, same kernel", "warm, vs save", "cold, vs save"],
            [
                [k]
                + [f"{rows[f'{k}, {w}'][closings[1]] - rows[f'{k}, {w}'][closings[0]]:.2f}" for w in ("warm", "cold")]
                + [f"{rows[f'{k}, {w}'][closings[1]] - rows[f'save, {w}'][closings[0]]:.2f}" for w in ("warm", "cold")]
                for k in ("window", "merge", "whole", *REAL)
                if f"{k}, warm" in rows
            ],
        ),
        "",
        "`merge` is the skeleton of the whole one-launch design without its plan reads, APE bias, rope and FP8 "
        "pack: a real kernel of this design does all it does and more, so its few-minus-none gap cannot be "
        "smaller. `window` alone (no merge, so no entry could be finished) bounds any design that reads the "
        "window split over programs when the group closes. `whole` is the design without a merge: one program "
        "reads the window. `real merge` is the shipped kernel (`kernels/c128_tiled.py`: plan records, the real "
        "ring addressing, the APE bias) with its finish cut to the RMS; `shipped` is the shipped kernel, so "
        "`shipped` minus `real merge` is what rope and the FP8 pack add, and `real merge` minus `merge` what the "
        "plan and the real addressing add.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="out")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--closing", type=int, default=None)
    args = parser.parse_args()
    main(args.out, args.requests, args.rows, args.closing)
