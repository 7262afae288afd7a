"""A long random fuzz of the streaming cache on a GPU, every step checked against the float64 reference.

For every kind (HCA, CSA, indexer) at DeepSeek-V4 shapes and every kernel backend (triton with the tiled and
the single-stage HCA kernel, online), a random program of steps: new requests (prefill chunks of 1..300
rows), continuation chunks, MTP verify steps (``mtp_step + 1`` rows from a random accepted length, so most
rewind), mixed batches, releases and re-begun ids. Decode-only steps alternate between ``cache.step`` and a
CUDA graph (``cache.graph``) captured once and replayed across group boundaries. After every step the entries of
every request the step touched are compared byte by byte with a one-shot float64 recomputation
(``demo.check_cache``), and at the end every live request.

    python scripts/gpu_fuzz.py [--steps 120] [--seed 0] [--json out/fuzz.json]

Exits non-zero on the first unexplained byte (printing which step, kind, backend and request).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

import dsv4_compressor as dc
from dsv4_compressor.demo import check_cache

MTP = 3
MAX_SEQ = 1024
MAX_REQUESTS = 8
RUNS = [
    ("hca", "triton", {"c128_kernel": "tiled"}),
    ("hca", "triton", {"c128_kernel": "single"}),
    ("hca", "online", {}),
    ("csa", "triton", {}),
    ("csa", "online", {}),
    ("indexer", "triton", {}),
]


def _config(kind: str) -> dc.CompressorConfig:
    return {
        "hca": dc.CompressorConfig.hca(),
        "csa": dc.CompressorConfig.csa(),
        "indexer": dc.CompressorConfig.indexer(),
    }[kind]


def fuzz(kind: str, backend: str, options: dict, *, steps: int, seed: int, device: torch.device) -> dict:
    cfg = _config(kind)
    params = dc.CompressorParams.random(cfg, max_positions=MAX_SEQ, seed=seed)
    cache = dc.CompressedKVCache(cfg, params, max_requests=MAX_REQUESTS, max_seq_len=MAX_SEQ, mtp_step=MTP,
                                 backend=backend, device=device, check_finite=False, **options)  # fmt: skip
    graph = cache.graph(max_requests=MAX_REQUESTS // 2, rows_per_request=MTP + 1)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    rows: dict[int, torch.Tensor] = {}
    counts = dict(steps=0, graph_steps=0, rewinds=0, releases=0, entries=0, groups_closed_in_graph=0)
    for k in range(steps):
        ids, starts, nums = [], [], []
        decode_only = rng.random() < 0.6
        for rid in rng.permutation(MAX_REQUESTS)[: int(rng.integers(1, MAX_REQUESTS // 2 + 1))].tolist():
            length = rows[rid].shape[0] if rid in rows else None
            if length is not None and rng.random() < 0.05:
                cache.release(rid)
                del rows[rid]
                counts["releases"] += 1
                continue
            if length is None:
                if decode_only:
                    continue
                start, n = 0, int(rng.integers(1, 301))
            elif decode_only or rng.random() < 0.5:
                start, n = max(0, length - int(rng.integers(0, MTP + 1))), MTP + 1
            else:
                start, n = length, int(rng.integers(1, 200))
            n = min(n, MAX_SEQ - start)
            if n <= 0:
                continue
            ids.append(rid)
            starts.append(start)
            nums.append(n)
            counts["rewinds"] += int(length is not None and start < length)
        if not ids:
            continue
        new = torch.randn(sum(nums), cfg.row_width, generator=gen)
        new[:, cfg.width :] *= 1.5
        use_graph = decode_only and k % 2 == 0 and max(nums) <= MTP + 1
        target = graph if use_graph else cache
        target.step(ids, starts, nums, new.to(device))
        counts["steps"] += 1
        counts["graph_steps"] += int(use_graph)
        t = 0
        for rid, start, n in zip(ids, starts, nums):
            old = rows[rid][:start] if start else torch.zeros(0, cfg.row_width)
            rows[rid] = torch.cat([old, new[t : t + n]])
            t += n
            if use_graph:
                counts["groups_closed_in_graph"] += (start + n) // cfg.ratio - start // cfg.ratio
        check = check_cache(cache, {rid: rows[rid].to(device) for rid in ids})
        if not check.ok:
            raise AssertionError(f"step {k} ({kind}/{backend} {options}, graph={use_graph}): {check.failures[:3]}")
    final = check_cache(cache, {rid: r.to(device) for rid, r in rows.items()})
    if not final.ok:
        raise AssertionError(f"final check ({kind}/{backend} {options}): {final.failures[:3]}")
    counts["entries"] = final.entries
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fuzz: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results, status = [], 0
    for kind, backend, options in RUNS:
        t0 = time.perf_counter()
        try:
            counts = fuzz(kind, backend, options, steps=args.steps, seed=args.seed, device=device)
            ok, error = True, None
        except AssertionError as exc:
            counts, ok, error, status = {}, False, str(exc), 1
        line = dict(kind=kind, backend=backend, options=options, ok=ok, error=error,
                    seconds=round(time.perf_counter() - t0, 1), **counts)  # fmt: skip
        results.append(line)
        print(json.dumps(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("gpu_fuzz:", "all runs verified" if status == 0 else "FAILED")
    return status


if __name__ == "__main__":
    sys.exit(main())
