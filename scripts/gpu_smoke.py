"""Quick GPU smoke run: real-shape correctness of every backend, then a first look at HCA decode timings.

Usage (on a CUDA machine): PYTHONPATH=src python scripts/gpu_smoke.py [--no-perf]
This is a development aid; the benchmark of record is ``python -m dsv4_compressor bench``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import dsv4_compressor as dc
from dsv4_compressor import reference as ref
from dsv4_compressor import verify


def stream_check(cfg, backend, opts, seed=0, requests=3, mtp=3):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = dc.CompressorParams.random(cfg, max_positions=8192, seed=seed)
    cache = dc.CompressedKVCache(
        cfg, params, max_requests=requests, max_seq_len=8192, mtp_step=mtp, backend=backend, device="cuda", **opts
    )
    rows = {rid: torch.zeros(0, cfg.row_width, device="cuda") for rid in range(requests)}
    length = dict.fromkeys(range(requests), 0)
    for it in range(14):
        ids, starts, counts, chunks = [], [], [], []
        for rid in rng.sample(range(requests), requests):
            if it < 4:
                start, n = length[rid], rng.randint(50, 400)
            else:
                start, n = rng.randint(max(0, length[rid] - mtp), length[rid]), mtp + 1
            new = torch.randn(n, cfg.row_width, device="cuda")
            rows[rid] = torch.cat([rows[rid][:start], new])
            length[rid] = start + n
            ids.append(rid)
            starts.append(start)
            counts.append(n)
            chunks.append(new)
        cache.step(ids, starts, counts, torch.cat(chunks).clone())
    torch.cuda.synchronize()
    report = None
    for rid in range(requests):
        v64 = ref.compress_sequence(rows[rid].cpu(), params.to("cpu"), cfg, dtype=torch.float64)
        if cfg.output == "latent":
            rep = verify.check_latent_records(cache.packed_entries(rid), v64, cfg)
        else:
            rep = verify.check_indexer_keys(cache.entries(rid), v64)
            rep.merge(verify.check_indexer_fp8(cache.packed_entries(rid), cache.entries(rid).to(torch.bfloat16)))
        report = rep if report is None else report.merge(rep)
    return report, cache


def decode_instances(cfg, backend, opts, batch, rows_per_req, boundary, instances, mtp=3):
    """``instances`` caches with random state; one decode step descriptor + rows each."""
    r = cfg.ratio
    out = []
    ws = None
    if backend == "triton" and opts.get("c128_kernel", "tiled") == "tiled" and not cfg.overlap:
        ws = dc.Workspace(dc.plan_c128_scratch(batch_max_tokens=8192, max_req_num=batch, mtp_step=mtp), "cuda")
    for i in range(instances):
        params = dc.CompressorParams.random(cfg, max_positions=65536, seed=i)
        extra = dict(opts)
        if ws is not None:
            extra["workspace"] = ws
        cache = dc.CompressedKVCache(
            cfg, params, max_requests=batch, max_seq_len=65536, mtp_step=mtp, backend=backend, device="cuda",
            check_finite=False, **extra,
        )  # fmt: skip
        be = cache.backend
        if hasattr(be, "ring"):
            be.ring.normal_()
        if getattr(be, "state", None) is not None:
            be.state[:, :, 0].normal_()
            be.state[:, :, 1].uniform_(1.0, 4.0)
            be.state[:, :, 2].normal_()
        starts = []
        for b in range(batch):
            g = 10 + (b * 7 + i) % 100
            starts.append(g * r + 1 if boundary == "none" else g * r + r - rows_per_req)
        for b, s in enumerate(starts):
            cache.pool.ensure(b, (s + rows_per_req) // r + 1)
        desc = dc.build_step_descriptor(
            list(range(batch)), starts, [rows_per_req] * batch, ratio=r, page_table=cache.pool.page_table,
            page_size=cache.page_size, device="cuda",
        )  # fmt: skip
        kv = torch.randn(batch * rows_per_req, cfg.row_width, device="cuda")
        out.append((cache, desc, kv))
    return out


def time_graph(instances, replays=100):
    for cache, desc, kv in instances:  # warm-up / compile
        cache.backend.launch(desc, kv, decode=True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for cache, desc, kv in instances:
            cache.backend.launch(desc, kv, decode=True)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(instances))
    times.sort()
    return times[len(times) // 2]


def kernel_stats() -> None:
    """Registers and spills of every compiled kernel of the package (Triton's per-device caches)."""
    import dsv4_compressor.kernels as kpkg

    seen = set()
    for mod_name in ("c128_two_stage", "fused_compress", "online_hca", "ring_save", "ape"):
        mod = __import__(f"{kpkg.__name__}.{mod_name}", fromlist=["x"])
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)
            if not caches or name in seen:
                continue
            seen.add(name)
            for entry in caches.values():
                for kern in entry[0].values():
                    try:
                        kern._init_handles()
                        meta = kern.metadata
                        print(f"  {name:28s} warps={meta.num_warps} regs={kern.n_regs} spills={kern.n_spills}")
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {name}: {exc}")


def copy_bandwidth() -> float:
    src = torch.randn(256 * 1024 * 1024 // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * src.numel() * 4 * 10 / (a.elapsed_time(b) * 1e-3) / 1e12


def prefill_time(backend, opts, chunk, carry):
    cfg = dc.CompressorConfig.hca()
    params = dc.CompressorParams.random(cfg, max_positions=chunk + 256)
    extra = dict(opts)
    if backend == "triton" and opts.get("c128_kernel", "tiled") == "tiled":
        extra["workspace"] = dc.Workspace(dc.plan_c128_scratch(batch_max_tokens=chunk, max_req_num=1), "cuda")
    cache = dc.CompressedKVCache(
        cfg, params, max_requests=1, max_seq_len=chunk + 256, backend=backend, device="cuda", check_finite=False,
        **extra,
    )  # fmt: skip
    start = 64 if carry else 0
    if carry:
        cache.step([0], [0], [start], torch.randn(start, cfg.row_width, device="cuda"))
    cache.pool.ensure(0, (start + chunk) // cfg.ratio)
    desc = dc.build_step_descriptor(
        [0], [start], [chunk], ratio=cfg.ratio, page_table=cache.pool.page_table, page_size=cache.page_size,
        device="cuda",
    )  # fmt: skip
    copies = [torch.randn(chunk, cfg.row_width, device="cuda") for _ in range(2)]
    for kv in copies:
        cache.backend.launch(desc, kv, decode=False)
    torch.cuda.synchronize()
    times = []
    for i in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cache.backend.launch(desc, copies[i % 2], decode=False)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    times.sort()
    return times[len(times) // 2]


def tune() -> None:
    hca = dc.CompressorConfig.hca()
    print(f"copy bandwidth (read+write): {copy_bandwidth():.2f} TB/s", flush=True)
    print("\nvariants, HCA decode S=4, 20 instances, us/layer (median)")
    variants = [
        ("triton", {}),
        ("online", {}),
        ("online", {"channel_major": True}),
        ("online", {"channel_major": True, "decode_warps": 8}),
    ]
    for backend, opts in variants:
        for batch in (16, 64, 256):
            res = []
            for boundary in ("none", "every"):
                try:
                    res.append(f"{time_graph(decode_instances(hca, backend, opts, batch, 4, boundary, 20)):8.2f}")
                except Exception as exc:  # noqa: BLE001
                    res.append("   error")
                    print(f"  {backend} {opts} B={batch} {boundary}: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.empty_cache()
            print(f"{backend + ' ' + str(opts):48s} {batch:4d} {res[0]} {res[1]}", flush=True)
    print("\nHCA prefill (eager, median of 20), us and GB/s of rows read (chunk x 4 KiB)")
    for backend, opts in (("triton", {}), ("online", {}), ("online", {"block_t": 8})):
        for chunk in (8192, 65536):
            for carry in (False, True):
                try:
                    us = prefill_time(backend, opts, chunk, carry)
                    gbs = chunk * 4096 / (us * 1e-6) / 1e9
                    print(f"{backend + ' ' + str(opts):36s} chunk={chunk:6d} carry={carry!s:5s} {us:9.1f} us "
                          f"{gbs:7.0f} GB/s", flush=True)  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    print(f"  prefill {backend} {opts} {chunk} {carry}: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.empty_cache()
    print("\ncompiled kernels:")
    kernel_stats()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--tune", action="store_true", help="compare kernel variants instead of the default table")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__, flush=True)
    failures = 0
    combos = [
        (dc.CompressorConfig.hca(), "triton", {}),
        (dc.CompressorConfig.hca(), "triton", {"c128_kernel": "single"}),
        (dc.CompressorConfig.hca(), "triton", {"fuse_ape": False}),
        (dc.CompressorConfig.hca(), "online", {}),
        (dc.CompressorConfig.csa(), "triton", {}),
        (dc.CompressorConfig.indexer(), "triton", {}),
        (dc.CompressorConfig.csa(), "online", {}),
    ]
    for cfg, backend, opts in combos:
        t0 = time.time()
        try:
            rep, cache = stream_check(cfg, backend, opts)
            _, cache_exact = stream_check(cfg, backend, {**opts, "exact_fp8": True})
            same = all(
                torch.equal(getattr(cache.pool, a), getattr(cache_exact.pool, a))
                for a in ("pages", "keys", "fp8_pages")
                if getattr(cache.pool, a) is not None
            )
            ok = rep.ok and same
            failures += not ok
            print(f"[{'ok' if ok else 'FAIL'}] {cfg.name} {backend} {opts}: {rep}; hw==exact fp8: {same} "
                  f"({time.time() - t0:.1f}s)", flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - report and continue
            failures += 1
            print(f"[ERROR] {cfg.name} {backend} {opts}: {type(exc).__name__}: {exc}", flush=True)
    if args.tune:
        tune()
    elif not args.no_perf:
        hca = dc.CompressorConfig.hca()
        print("\nHCA decode, S=4, graph of 20 layer instances, us per layer (median of 100 replays)")
        print(f"{'variant':28s} {'B':>4s} {'none':>8s} {'every':>8s}")
        for backend, opts in (("triton", {"c128_kernel": "single"}), ("triton", {}), ("online", {})):
            for batch in (16, 64, 256):
                res = []
                for boundary in ("none", "every"):
                    try:
                        inst = decode_instances(hca, backend, opts, batch, 4, boundary, 20)
                        res.append(f"{time_graph(inst):8.2f}")
                    except Exception as exc:  # noqa: BLE001
                        res.append("   error")
                        print(f"  {backend} {opts} B={batch} {boundary}: {type(exc).__name__}: {exc}", flush=True)
                    torch.cuda.empty_cache()
                print(f"{backend + ' ' + str(opts):28s} {batch:4d} {res[0]} {res[1]}", flush=True)
    print(f"\n{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
