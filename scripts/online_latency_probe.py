"""Latency floors of an online HCA decode step, measured with stripped-down kernels (GPU only).

Why the online backend's small-batch decode step costs what it does: each probe kernel does a prefix of what
the real request program does (no launch work at all; read the request's record of the step's plan; then read
the state bank and the request's 4 rows and absorb them; then finish an entry: the RMS alone, or RMSNorm, rope
and the FP8 record as the shipped program does; then add the APE bias to the rows' gate logits, as the shipped
program does too), timed like the benchmark (CUDA
graph of 20 layer instances with distinct inputs, input copies rotated past twice the L2 unless ``hot``), so the
difference between two rows is the cost of one stage. A second table compares ways to finish an entry when a request's
channels are split over several programs (the RMS needs all channels): one program per request, the last of a
request's programs to arrive finishes (atomic counter), or all programs wait for each other (spin; such a
kernel relies on its programs being co-resident, so it is measured here only, never shipped).

    python scripts/online_latency_probe.py OUT_DIR      (writes OUT_DIR/ONLINE_LATENCY.md and .json)
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from probe_report import page_head, save_results  # noqa: E402

from dsv4_compressor import ops  # noqa: E402
from dsv4_compressor.bench.results import table  # noqa: E402
from dsv4_compressor.bench.timing import CudaTimer, summarize  # noqa: E402
from dsv4_compressor.config import CompressorConfig, CompressorParams  # noqa: E402
from dsv4_compressor.kernels import exact_fp8_default  # noqa: E402
from dsv4_compressor.kernels.entry_pack import entry_args, finish_entry_with, finish_inputs  # noqa: E402
from dsv4_compressor.kernels.online_hca import _absorb_row  # noqa: E402
from dsv4_compressor.kernels.pdl import launch_options, pdl_enabled, wait_then_release  # noqa: E402
from dsv4_compressor.kernels.plan import PlanRef, request_record  # noqa: E402

H, BANKS, S, RATIO, INSTANCES, L2_BYTES = 512, 4, 4, 128, 20, 60 * 2**20


@triton.jit
def _empty(x_ptr, PDL: tl.constexpr):
    wait_then_release(PDL)


@triton.jit
def _record_only(plan, out_ptr, PDL: tl.constexpr):
    wait_then_release(PDL)
    k = tl.program_id(0)
    first, slot, start, row0, end, first_out = request_record(plan, k)
    tl.store(out_ptr + k, first + slot + start + row0 + end + first_out)


@triton.jit
def _store_bank(state_ptr, slot, length, idx, m, s, a, H: tl.constexpr, BANKS: tl.constexpr):
    b = state_ptr + (slot.to(tl.int64) * BANKS + length % BANKS) * (3 * H)
    tl.store(b + idx, m)
    tl.store(b + H + idx, s)
    tl.store(b + 2 * H + idx, a)


@triton.jit
def _chain(plan, kv_ptr, state_ptr, k, tile, CW: tl.constexpr, H: tl.constexpr, BANKS: tl.constexpr, ape_ptr=None,
           APE: tl.constexpr = False, RATIO: tl.constexpr = 128):  # fmt: skip
    """Request record -> state bank + 4 rows (channels ``tile * CW ..``) -> absorb, banking after rows 1-3;
    with ``APE`` each row's gate logits get ``ape[position % RATIO]`` (``[RATIO, H]``, requested with the rows).
    Returns the pooled values after row 4 and their channel indices."""
    first, slot, start, row0, end, first_out = request_record(plan, k)
    idx = tile * CW + tl.arange(0, CW)
    bank = state_ptr + (slot.to(tl.int64) * BANKS + start % BANKS) * (3 * H)
    m = tl.load(bank + idx)
    s = tl.load(bank + H + idx)
    a = tl.load(bank + 2 * H + idx)
    r0 = kv_ptr + row0.to(tl.int64) * (2 * H)
    kv0, x0 = tl.load(r0 + idx), tl.load(r0 + H + idx)
    kv1, x1 = tl.load(r0 + 2 * H + idx), tl.load(r0 + 3 * H + idx)
    kv2, x2 = tl.load(r0 + 4 * H + idx), tl.load(r0 + 5 * H + idx)
    kv3, x3 = tl.load(r0 + 6 * H + idx), tl.load(r0 + 7 * H + idx)
    if APE:
        x0 += tl.load(ape_ptr + (start % RATIO) * H + idx)
        x1 += tl.load(ape_ptr + ((start + 1) % RATIO) * H + idx)
        x2 += tl.load(ape_ptr + ((start + 2) % RATIO) * H + idx)
        x3 += tl.load(ape_ptr + ((start + 3) % RATIO) * H + idx)
    m, s, a = _absorb_row(m, s, a, kv0, x0)
    _store_bank(state_ptr, slot, start + 1, idx, m, s, a, H, BANKS)
    m, s, a = _absorb_row(m, s, a, kv1, x1)
    _store_bank(state_ptr, slot, start + 2, idx, m, s, a, H, BANKS)
    m, s, a = _absorb_row(m, s, a, kv2, x2)
    _store_bank(state_ptr, slot, start + 3, idx, m, s, a, H, BANKS)
    m, s, a = _absorb_row(m, s, a, kv3, x3)
    return m, s, a, idx, slot, start


@triton.jit
def _chain_bank(plan, kv_ptr, state_ptr, out_ptr, NT: tl.constexpr, H: tl.constexpr, BANKS: tl.constexpr,
                PDL: tl.constexpr):  # fmt: skip
    """The no-boundary step: all four states banked (``NT`` programs per request)."""
    wait_then_release(PDL)
    k = tl.program_id(0) // NT
    m, s, a, idx, slot, start = _chain(plan, kv_ptr, state_ptr, k, tl.program_id(0) % NT, H // NT, H, BANKS)
    _store_bank(state_ptr, slot, start + 4, idx, m, s, a, H, BANKS)


@triton.jit
def _finish_single(plan, kv_ptr, state_ptr, out_ptr, H: tl.constexpr, BANKS: tl.constexpr, PDL: tl.constexpr):
    """Row 4 closes the group: one program holds every channel, RMS in-program."""
    wait_then_release(PDL)
    k = tl.program_id(0)
    m, s, a, idx, slot, start = _chain(plan, kv_ptr, state_ptr, k, 0, H, H, BANKS)
    c = a / s
    tl.store(out_ptr + k * H + idx, c * tl.math.rsqrt(tl.sum(c * c, axis=0) / H + 1e-6))


@triton.jit
def _finish_entry(plan, kv_ptr, state_ptr, ape_ptr, prm, out, E: tl.constexpr, BANKS: tl.constexpr,
                  APE: tl.constexpr, RATIO: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Row 4 closes the group and the entry is finished as the shipped decode program finishes it: RMSNorm,
    rope, the FP8 record and its page write (:func:`finish_entry_with`), its inputs requested up front; with
    ``APE`` the rows' gate logits also get the APE bias, as the shipped program adds it."""
    wait_then_release(PDL)
    k = tl.program_id(0)
    w, cos, sin = finish_inputs(prm, k * 0, E)  # rope row 0: any row costs the same
    m, s, a, idx, slot, start = _chain(plan, kv_ptr, state_ptr, k, 0, E.HEAD, E.HEAD, BANKS, ape_ptr, APE, RATIO)
    finish_entry_with(a / s, k, w, cos, sin, prm, out, E)


@triton.jit
def _finish_last(plan, kv_ptr, state_ptr, out_ptr, exch_ptr, cnt_ptr, NT: tl.constexpr, H: tl.constexpr,
                 BANKS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Channels split over ``NT`` programs; each posts its pooled values, the last to arrive finishes."""
    wait_then_release(PDL)
    k = tl.program_id(0) // NT
    m, s, a, idx, slot, start = _chain(plan, kv_ptr, state_ptr, k, tl.program_id(0) % NT, H // NT, H, BANKS)
    tl.store(exch_ptr + k * H + idx, a / s)
    old = tl.atomic_add(cnt_ptr + k, 1, sem="acq_rel")
    if old % NT == NT - 1:
        full = tl.arange(0, H)
        c = tl.load(exch_ptr + k * H + full, cache_modifier=".cg")
        tl.store(out_ptr + k * H + full, c * tl.math.rsqrt(tl.sum(c * c, axis=0) / H + 1e-6))


@triton.jit
def _finish_spin(plan, kv_ptr, state_ptr, out_ptr, exch_ptr, cnt_ptr, NT: tl.constexpr, H: tl.constexpr,
                 BANKS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Channels split over ``NT`` programs; each posts its sum of squares and waits for the others."""
    wait_then_release(PDL)
    k = tl.program_id(0) // NT
    tile = tl.program_id(0) % NT
    m, s, a, idx, slot, start = _chain(plan, kv_ptr, state_ptr, k, tile, H // NT, H, BANKS)
    c = a / s
    tl.store(exch_ptr + k * NT + tile, tl.sum(c * c, axis=0))
    cur = tl.atomic_add(cnt_ptr + k, 1, sem="acq_rel") + 1
    target = (cur - 1) // NT * NT + NT
    while cur < target:
        cur = tl.atomic_add(cnt_ptr + k, 0, sem="acquire")
    parts = tl.load(exch_ptr + k * NT + tl.arange(0, NT), cache_modifier=".cg")
    tl.store(out_ptr + k * H + idx, c * tl.math.rsqrt(tl.sum(parts, axis=0) / H + 1e-6))


def _plan(batch: int, start: int, dev) -> PlanRef:
    """The step's plan (``ops.build_plan``): ``batch`` requests of ``S`` rows from ``start``, writing nowhere."""
    positions = (start + torch.arange(S, device=dev)).repeat(batch)
    row_req = torch.arange(batch, device=dev).repeat_interleave(S)
    out_slot = torch.full_like(positions, -1)
    plan = ops.empty_plan(batch * S, batch, RATIO, dev)
    ops.build_plan(plan, positions, row_req, out_slot, ratio=RATIO, num_slots=batch)
    return PlanRef(plan, batch * S, batch)


def _instances(batch: int, copies: int, dev, instances: int = INSTANCES):
    """Per rotated copy, ``instances`` sets of (plan, rows, state, out, exchange, counters)."""
    t = batch * S
    sets = []
    for _ in range(copies):
        per = []
        for _ in range(instances):
            state = torch.randn(batch, BANKS, 3, H, device=dev)
            state[:, :, 1].uniform_(1.0, 4.0)
            per.append(
                dict(
                    plan=_plan(batch, RATIO + 1, dev), kv=torch.randn(t, 2 * H, device=dev), state=state,
                    out=torch.empty(batch * H, device=dev), exch=torch.empty(batch * H, device=dev),
                    cnt=torch.zeros(batch, dtype=torch.int32, device=dev),
                    pages=torch.empty(-(-batch // 2), 2 * _hca(dev)[0].entry_bytes, dtype=torch.uint8, device=dev),
                )
            )  # fmt: skip
        sets.append(per)
    return sets


@functools.cache
def _hca(dev: torch.device):
    """DeepSeek-V4's HCA config and one random parameter set on ``dev`` (shared by every instance)."""
    cfg = CompressorConfig.hca()
    return cfg, CompressorParams.random(cfg, max_positions=RATIO * 4, device=dev)


def _entry(pages: torch.Tensor):
    """``entry_args`` of HCA entries written to ``pages`` with a page size of 2, as the shipped kernel launches
    them (the hardware FP8 cast on a GPU, the exact rounding under the interpreter)."""
    cfg, p = _hca(pages.device)
    return entry_args(
        head=cfg.head_dim, rope=cfg.rope_dim, latent=True, page_size=2, scale_bytes=cfg.record_scale_bytes,
        norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=p.eps, out_pages=pages, out_keys=None,
        exact_fp8=exact_fp8_default(pages.device),
    )  # fmt: skip


def _launch(probe: str, b: dict, batch: int, nt: int, warps: int) -> None:
    # launched as the shipped kernels are (programmatic dependent launch where the device has it)
    programs = batch * (nt if probe in ("bank", "finish-last", "finish-spin") else 1)
    opts = dict(num_warps=warps, **launch_options(pdl_enabled(b["out"].device), programs))
    if probe == "empty":
        _empty[(batch,)](b["out"], **opts)
    elif probe == "record":
        _record_only[(batch,)](b["plan"], b["out"], **opts)
    elif probe == "bank":
        _chain_bank[(batch * nt,)](b["plan"], b["kv"], b["state"], b["out"], NT=nt, H=H, BANKS=BANKS, **opts)
    elif probe == "finish-single":
        _finish_single[(batch,)](b["plan"], b["kv"], b["state"], b["out"], H=H, BANKS=BANKS, **opts)
    elif probe in ("finish-entry", "finish-entry-ape"):
        prm, out, meta = _entry(b["pages"])
        ape = _hca(b["pages"].device)[1].ape
        _finish_entry[(batch,)](b["plan"], b["kv"], b["state"], ape, prm, out, meta, BANKS=BANKS,
                                APE=probe == "finish-entry-ape", RATIO=RATIO, **opts)  # fmt: skip
    elif probe == "finish-last":
        _finish_last[(batch * nt,)](b["plan"], b["kv"], b["state"], b["out"], b["exch"], b["cnt"], NT=nt, H=H,
                                    BANKS=BANKS, **opts)  # fmt: skip
    elif probe == "finish-spin":
        _finish_spin[(batch * nt,)](b["plan"], b["kv"], b["state"], b["out"], b["exch"], b["cnt"], NT=nt, H=H,
                                    BANKS=BANKS, **opts)  # fmt: skip
    else:
        raise ValueError(probe)


def measure(timer, probe: str, batch: int, *, nt: int = 1, warps: int = 4, hot: bool = False) -> float:
    per_instance = batch * (S * 2 * H + 2 * BANKS * 3 * H) * 4  # rows + banks read and written
    copies = 1 if hot else max(1, min(16, -(-2 * L2_BYTES // (INSTANCES * per_instance))))
    sets = _instances(batch, copies, timer.device)

    def step(k):
        def run():
            for b in sets[k]:
                _launch(probe, b, batch, nt, warps)

        return run

    calls = [step(k) for k in range(copies)]
    for call in calls:
        call()
    timer.sync()
    graphs = [timer.capture(call) for call in calls]
    return summarize(timer.time(graphs, replays=200, warmup=20, queue_ahead=True), per=INSTANCES)["median_us"]


STAGES = [
    ("empty kernel, one program per request", "empty", 1, 4, False),
    ("+ read the request record", "record", 1, 4, False),
    ("+ read bank and 4 rows, absorb, bank 4 states (one 4-warp program per request)", "bank", 1, 4, False),
    ("  the same, one input copy set (no rotation)", "bank", 1, 4, True),
    ("  the same, channels over 8 one-warp programs per request", "bank", 8, 1, False),
    ("  the same, 8 programs, one input copy set (no rotation)", "bank", 8, 1, True),
    ("+ the 4th row closes the group: RMS only (one 4-warp program per request)", "finish-single", 1, 4, False),
    ("  RMS only, one input copy set (no rotation)", "finish-single", 1, 4, True),
    ("+ the entry finished as shipped: RMSNorm, rope, FP8 record, page write", "finish-entry", 1, 4, False),
    ("  finished as shipped, one input copy set (no rotation)", "finish-entry", 1, 4, True),
    ("+ the APE bias on the 4 rows' gate logits", "finish-entry-ape", 1, 4, False),
    ("  with the APE bias, one input copy set (no rotation)", "finish-entry-ape", 1, 4, True),
]
assert len({label for label, *_ in STAGES}) == len(STAGES), "stage labels key the results: keep them distinct"
FINISHES = [
    ("one 4-warp program per request, RMS in-program", "finish-single", 1, 4),
    ("8 one-warp programs per request, the last to arrive finishes", "finish-last", 8, 1),
    ("8 one-warp programs per request, all wait for all (spin)", "finish-spin", 8, 1),
]


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    timer = CudaTimer("cuda")
    batches = (16, 64, 256)
    started = time.time()
    res = {"stages": {}, "finishes": {}, "pdl": pdl_enabled(torch.device("cuda", torch.cuda.current_device()))}
    for label, probe, nt, warps, hot in STAGES:
        res["stages"][label] = {b: measure(timer, probe, b, nt=nt, warps=warps, hot=hot) for b in batches}
        print(label, res["stages"][label], flush=True)
    for label, probe, nt, warps in FINISHES:
        # the spin variant needs every program resident at once: small grids only
        row = {
            b: measure(timer, probe, b, nt=nt, warps=warps) if probe != "finish-spin" or b * nt <= 1024 else None
            for b in batches
        }
        res["finishes"][label] = row
        print(label, row, flush=True)
    save_results(
        out_dir, res, started, "online_latency", "ONLINE_LATENCY.md", lambda res: render_markdown(res, batches)
    )


def render_markdown(res: dict, batches) -> str:
    """The ONLINE_LATENCY.md page of a probe's results."""
    env = res["environment"]

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    lines = [
        *page_head(
            "Online HCA decode: latency floors",
            "online_latency_probe.py",
            env,
            run_by=" (run by `scripts/gpu_check.sh`)",
        ),  # fmt: skip
        "- Method: stripped-down kernels, each a prefix of the online request program (H = 512, 4 rows per "
        "request, mtp_step 3), timed as the benchmark times a decode step: a CUDA graph of 20 layer instances "
        "with distinct inputs, replay time / 20, median of 200 replays; input copies rotate past twice the L2 "
        "unless marked otherwise (without rotation the 20 instances' inputs, 64 KiB per request, fit in the "
        "60 MiB L2 at B=16 only). Launched as the shipped kernels are: with programmatic dependent launch "
        f"where the device has it (here: {'on' if res.get('pdl') else 'off'}).",
        "",
    ]

    def stage_table(first: str, rows: dict) -> str:
        return table(
            [first] + [f"B={b}" for b in batches], [[k] + [fmt(v[b]) for b in batches] for k, v in rows.items()]
        )

    lines += ["## Stages (us per layer)", "", stage_table("stage", res["stages"])]
    lines += [
        "",
        "## Finishing an entry when a request's channels are split (us per layer; every request closes a group)",
        "",
        stage_table("design", res["finishes"]),
    ]
    lines += [
        "",
        "`-`: not run (the spin variant deadlocks unless all programs are resident at once, so it is probed on "
        "small grids only and never shipped).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
