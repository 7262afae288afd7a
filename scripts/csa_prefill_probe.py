"""What CSA's 8K prefill chunk costs at least with its grid of one program per closing row (GPU only).

Issue 12 asks the CSA main compressor for an 8K prefill chunk in at most 24 us (25.6 when this probe was
written, 24.8 since the finish's inputs are requested with the window; SGLang's kernel 24.4). The shipped
kernel (:mod:`dsv4_compressor.kernels.fused_compress`) runs one 4-warp program per group-closing row: each
reads its 8-row window (the previous group's rows, the first half of each row, then its own, the second half;
values and gate logits, 32 KiB), pools it and writes one FP8 entry. This probe times the same grid and reads
in one launch with less to do, each program:

* ``read``: loads its window and stores the column sums of values plus logits (bf16, 1 KiB): the reads alone;
* ``pool``: ... and the per-channel softmax pooling instead (what the kernel computes before its finish);
* ``record``: ``pool``, with the window's row read first from a per-program table (int64, as the kernel reads
  its row from the plan's closing record before it can address its window): the cost of that round trip;

with nothing else the real kernel does (no APE bias, no RMSNorm, rope or FP8 pack). Timed like the benchmark's
prefill cases: one launch per CUDA graph, replay time, median of 200 replays, input copies rotated past twice
the L2 (cold). The figures bound from below what any kernel with this grid and these reads can take.

    python scripts/csa_prefill_probe.py OUT_DIR      (writes OUT_DIR/CSA_PREFILL.md and .json)
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

from dsv4_compressor.bench.results import table  # noqa: E402
from dsv4_compressor.bench.timing import CudaTimer, measure_copy_bandwidth, summarize  # noqa: E402

H, RATIO, L2_BYTES = 512, 4, 60 * 2**20
WIDTH = 2 * H  # a CSA row: values of both halves, then gate logits of both halves (float32)
CHUNKS = (8192, 65536)


@triton.jit
def _window_probe(kv_ptr, rows_ptr, out_ptr, T, H: tl.constexpr, RATIO: tl.constexpr, POOL: tl.constexpr,
                  RECORD: tl.constexpr):  # fmt: skip
    g = tl.program_id(0)  # the program of group g's closing row (the grid's last one is padding)
    row = g * RATIO + RATIO - 1
    if RECORD:  # the closing row from memory (-1: padding), as the plan's closing record gives it
        row = tl.load(rows_ptr + g)
    if (row >= 0) & (row < T):
        j = tl.arange(0, 2 * RATIO)
        q = row - (2 * RATIO - 1) + j  # the window: group g - 1's rows (first halves), then group g's (second)
        ok = q >= 0
        half = tl.where(j >= RATIO, 1, 0)
        ch = tl.arange(0, H)
        ptrs = kv_ptr + q.to(tl.int64)[:, None] * (2 * 2 * H) + (half * H)[:, None] + ch[None, :]
        kv = tl.load(ptrs, mask=ok[:, None], other=0.0)
        score = tl.load(ptrs + 2 * H, mask=ok[:, None], other=float("-inf"))
        if POOL:
            e = tl.exp(score - tl.max(score, axis=0)[None, :])
            c = tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)
        else:
            c = tl.sum(kv + tl.where(ok[:, None], score, 0.0), axis=0)
        tl.store(out_ptr + g.to(tl.int64) * H + ch, c.to(tl.bfloat16))


KERNELS = {"read": (0, 0), "pool": (1, 0), "record": (1, 1)}


def measure(timer, kernel: str, chunk: int) -> dict:
    row_bytes = 2 * WIDTH * 4
    copies = max(1, min(16, -(-2 * L2_BYTES // (chunk * row_bytes))))
    grid = (chunk // RATIO + 1,)
    dev = timer.device
    rows = torch.arange(grid[0], device=dev) * RATIO + RATIO - 1
    rows[-1] = -1
    sets = [
        (torch.randn(chunk, 2 * WIDTH, device=dev), torch.empty(grid[0] * H, dtype=torch.bfloat16, device=dev))
        for _ in range(copies)
    ]
    pool, record = KERNELS[kernel]

    def step(k):
        kv, out = sets[k]
        return lambda: _window_probe[grid](kv, rows, out, chunk, H=H, RATIO=RATIO, POOL=pool, RECORD=record,
                                           num_warps=4)  # fmt: skip

    calls = [step(k) for k in range(copies)]
    for call in calls:
        call()
    timer.sync()
    graphs = [timer.capture(call) for call in calls]
    us = summarize(timer.time(graphs, replays=200, warmup=20, queue_ahead=True))["median_us"]
    return {"us": us, "copies": copies, "bytes": chunk * row_bytes, "gbps": chunk * row_bytes / us / 1e3}


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    timer = CudaTimer("cuda")
    started = time.time()
    res = {"rows": {}, "copy_gbps": measure_copy_bandwidth(timer)["copy_bw_GBps"]}
    for kernel in KERNELS:
        for chunk in CHUNKS:
            res["rows"][f"{kernel} {chunk}"] = r = measure(timer, kernel, chunk)
            print(kernel, chunk, r, flush=True)
    save_results(out_dir, res, started, "csa_prefill", "CSA_PREFILL.md", render_markdown)


def render_markdown(res: dict) -> str:
    env = res["environment"]
    rows = [
        [k, f"{v['us']:.2f}", f"{v['bytes'] / 2**20:.0f}", f"{v['gbps']:,.0f}", f"{v['gbps'] / res['copy_gbps']:.0%}"]
        for k, v in res["rows"].items()
    ]
    lines = [
        *page_head(
            "CSA prefill: the floor of one program per closing row", "csa_prefill_probe.py", env, note=KERNELS_NOTE
        ),
        f"- H = {H}, ratio {RATIO} with overlap (8-row windows), float32 rows of {2 * WIDTH * 4} bytes; one "
        "4-warp program per closing row; cold (input copies rotated past twice the L2), one launch per graph",
        f"- device-to-device copy bandwidth: {res['copy_gbps']:,.0f} GB/s",
        "",
        table(["kernel, rows", "us", "MiB read", "GB/s", "of copy"], rows),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
