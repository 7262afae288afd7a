"""Host time of ``CompressedKVCache.step`` on a machine without a GPU, split by part.

The bench's ``cache-step`` case (B = 256 requests of 4 rows, mtp_step 3, every step rewinding over the rejected
drafts) measures the host wall time of one ``cache.step`` call on the GPU. This script reproduces that step with
CPU tensors and the stand-in driver of ``scripts/compile_check.py``: every Triton launch becomes a compile-only
``warmup`` (compiled for sm_90 on the first call, a cache hit after that), so a call pays everything a GPU call
pays on the host except the C launch itself (``kernel.launch_metadata`` and ``kernel.run``: packing the
arguments, ``cuLaunchKernel``). Two more differences from a CUDA device: the per-row metadata is not copied to a
device (on CPU the cache uses the numpy buffer as is; on CUDA it adds one host-to-device copy) and nothing is
pinned.

Parts (medians of per-call sums, in us):

* ``prepare``: ``cache._prepare`` (validation of the caller's input, the request table, pages, row metadata),
  with ``pool`` (``reserve`` and ``out_slots``) shown inside it;
* ``backend``: the kernel backend between the cache and the ops (``KernelBackend.run`` minus the ops);
* ``ops validation``: ``ops.build_plan`` / ``ops.compress`` / ``ops.compress_online_hca`` minus the launch
  functions they call (their checks and the launch arguments they build), with ``entry args``
  (``ops._entry``) shown inside it;
* ``launch fns``: the ``kernels/`` launch functions minus ``JITFunction.run``;
* ``triton run``: ``JITFunction.run`` (binder, specialisation, cache key, cache lookup; no C launch here);
* ``commit``: ``cache._commit``.

Run with ``TRITON_INTERPRET`` unset (the package's kernels are made when it is imported); compiling the kernels
takes a minute the first time::

    python -m benchmarks.probes.host_profile             # both bench cases, 200 plain and 200 split steps
    python -m benchmarks.probes.host_profile --cases hca-online --steps 500 --profile 25  # + cProfile top 25
    python -m benchmarks.probes.host_profile --rounds 3  # the fastest of 3 rounds (shared machines vary)

On a GPU machine, ``--device cuda`` runs the same steps with real launches and the metadata upload (the device
synchronised before each step, as the bench does): ``triton run`` then includes the C launch, ``prepare`` the
pinned buffer and the host-to-device copy.

To compare two versions of the package, point ``PYTHONPATH`` at each one's ``src`` in turn (and at a
``pip install --target`` directory of another triton to measure that one's host path).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict

os.environ.pop("TRITON_INTERPRET", None)
# the stand-in driver lives with the compile check in the checkout's scripts/ (this probe runs from a checkout)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 2, "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from compile_check import _install  # noqa: E402

CASES = {"hca-online": ("hca", "online"), "csa-triton": ("csa", "triton-single")}


class Split:
    """Per-call wall time of named parts, from wrappers around the functions that make them up."""

    def __init__(self):
        self.acc = defaultdict(float)
        self.samples = defaultdict(list)
        self.undo = []

    def wrap(self, owner, name: str, part: str):
        fn = getattr(owner, name)
        self.undo.append((owner, name, fn))
        acc = self.acc
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[part] += clock() - t0

        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)
        self.undo.clear()

    def close(self, total: float) -> None:
        self.samples["total"].append(total * 1e6)
        for part, value in self.acc.items():
            if not part.startswith("_"):
                self.samples[part].append(value * 1e6)
        self.acc.clear()


def _setup(device: str, pdl: bool = False):
    from dsv4_compressor import cache as cache_mod
    from dsv4_compressor import ops

    if device != "cpu":
        return ops  # real launches
    _install()
    # launch as on compute capability 9.0+ (programmatic dependent launch), which the CPU tensors' device turns off
    if pdl:
        ops.pdl_enabled = lambda device: True
    ops._runnable = lambda op, device: None  # CPU tensors stand in for device buffers; nothing runs
    cache_mod.interpreting = lambda: True  # lets a kernel backend live on a CPU device
    return ops


def _make(kind: str, backend: str, *, batch: int, rows: int, mtp: int, steps: int, device: str):
    from benchmarks.layers import make_cache
    from benchmarks.runner import kind_config
    from dsv4_compressor.config import CompressorParams

    cfg = kind_config(kind)
    max_seq_len = -(-rows * (steps + 2) // cfg.ratio) * cfg.ratio
    params = CompressorParams.random(cfg, max_positions=max_seq_len + 256, device=device)
    return make_cache(cfg, params, backend, max_requests=batch, mtp_step=mtp, max_seq_len=max_seq_len, device=device)


def _steps(cache, *, batch: int, rows: int, mtp: int, steps: int, seed: int = 0):
    """Like the bench's ``_run_cache_step``: every request begins, then ``steps`` decode steps, each restarting
    after 0..mtp accepted drafts. Yields before each timed call, with its arguments."""
    kv = torch.randn(batch * rows, cache.config.row_width, device=cache.device)
    ids = np.arange(batch)
    counts = np.full(batch, rows)
    rng = np.random.default_rng(seed)
    cache.step(ids, np.zeros(batch, dtype=np.int64), counts, kv)  # compiles every kernel
    lengths = counts.copy()
    for _ in range(steps):
        starts = lengths - mtp + rng.integers(0, mtp + 1, size=batch)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)  # as the bench: the device idle, its execution not timed
        yield ids, starts, counts, kv
        lengths = starts + rows


def measure(
    kind: str,
    backend: str,
    *,
    batch: int,
    rows: int,
    mtp: int,
    steps: int,
    warmup: int,
    profile: int,
    quiet: bool,
    device: str = "cpu",
):
    from triton.runtime import jit

    from dsv4_compressor import cache as cache_mod
    from dsv4_compressor import ops
    from dsv4_compressor.backends import base
    from dsv4_compressor.kernels import plan

    cache = _make(kind, backend, batch=batch, rows=rows, mtp=mtp, steps=2 * (steps + warmup) + 4, device=device)
    split = Split()
    launches = [
        (plan, "launch_build_plan"),
        (ops, "launch_compress_single"),
        (ops, "launch_ring_save"),
        (ops, "launch_c128_tiled"),
        (ops, "launch_online_hca"),
    ]
    runs = [0]

    def wrap_all():
        # innermost first, so that each wrapper's time includes the wrapped inner parts
        split.wrap(jit.JITFunction, "run", "triton run")
        for owner, name in launches:
            split.wrap(owner, name, "launch fns")
        split.wrap(ops, "_entry", "entry args")
        for name in ("build_plan", "compress", "compress_online_hca"):
            split.wrap(ops, name, "ops")
        split.wrap(base.KernelBackend, "run", "backend")
        split.wrap(cache.pool, "reserve", "pool")
        split.wrap(cache.pool, "out_slots", "pool")
        split.wrap(cache_mod.CompressedKVCache, "_prepare", "prepare")
        split.wrap(cache_mod.CompressedKVCache, "_commit", "commit")
        inner_run = jit.JITFunction.run

        def counting(self, *args, **kwargs):
            runs[0] += 1
            return inner_run(self, *args, **kwargs)

        split.wrap(jit.JITFunction, "run", "_counted")
        jit.JITFunction.run = counting

    # Even steps plain (nothing wrapped), odd steps with the wrappers: both see the same machine state.
    plain, launches_per_step = [], []
    prof = cProfile.Profile() if profile else None
    try:
        for i, (ids, starts, counts, kv) in enumerate(
            _steps(cache, batch=batch, rows=rows, mtp=mtp, steps=2 * (steps + warmup))
        ):
            timed = i >= 2 * warmup
            wrapped = i % 2 == 1
            if wrapped:
                wrap_all()
                split.acc.clear()
                runs[0] = 0
            elif prof is not None and timed:
                prof.enable()
            t0 = time.perf_counter()
            cache.step(ids, starts, counts, kv)
            total = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            if wrapped:
                split.restore()
                if timed:
                    split.close(total)
                    launches_per_step.append(runs[0])
                split.acc.clear()
            elif timed:
                plain.append(total * 1e6)
    finally:
        split.restore()
    med = {k: statistics.median(v) for k, v in split.samples.items()}
    parts = {
        "prepare (ours)": med.get("prepare", 0.0),
        "  of which pool": med.get("pool", 0.0),
        "backend (ours)": med.get("backend", 0.0) - med.get("ops", 0.0),
        "ops validation (ours)": med.get("ops", 0.0) - med.get("launch fns", 0.0),
        "  of which entry args": med.get("entry args", 0.0),
        "commit (ours)": med.get("commit", 0.0),
        "launch fns (kernels/)": med.get("launch fns", 0.0) - med.get("triton run", 0.0),
        "triton run (no C launch)": med.get("triton run", 0.0),
    }
    header = (
        f"== {kind} {backend}: B={batch} S={rows} mtp_step={mtp} on {device}, {steps} timed steps of each kind\n"
        f"   cache.step, nothing wrapped: median {statistics.median(plain):.1f} us, "
        f"p10 {np.percentile(plain, 10):.1f}, p90 {np.percentile(plain, 90):.1f}\n"
        f"   with the wrappers:           median {med['total']:.1f} us; {launches_per_step[0]} Triton launches/step"
    )
    if not quiet:
        print(header)
        for name, value in parts.items():
            print(f"   {name:28s} {value:8.1f} us")
    if prof is not None:
        stats = pstats.Stats(prof).sort_stats("tottime")
        print(f"   cProfile of the plain steps, top {profile} by own time (totals over {steps} steps):")
        stats.print_stats(profile)
    return statistics.median(plain), parts, header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--mtp-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="cpu (compile-only launches) or cuda (real launches)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the measurement; report the fastest round")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions by own time")
    ap.add_argument("--pdl", action="store_true", help="cpu: launch with PDL, as on a compute capability 9 GPU")
    args = ap.parse_args()
    _setup(args.device, args.pdl)
    torch.manual_seed(0)
    for name in args.cases:
        kind, backend = CASES[name]
        rounds = []
        for _ in range(args.rounds):
            rounds.append(
                measure(
                    kind,
                    backend,
                    batch=args.batch,
                    rows=args.rows,
                    mtp=args.mtp_step,
                    steps=args.steps,
                    warmup=args.warmup,
                    profile=args.profile,
                    quiet=args.rounds > 1,
                    device=args.device,
                )  # fmt: skip
            )
        if args.rounds > 1:  # shared machines change speed between rounds: the fastest round is the least disturbed
            plain, parts, header = min(rounds, key=lambda r: r[0])
            print(f"{header} (the fastest of {args.rounds} rounds; their medians: "
                  f"{', '.join(f'{r[0]:.0f}' for r in rounds)} us)")  # fmt: skip
            for name, value in parts.items():
                print(f"   {name:28s} {value:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
