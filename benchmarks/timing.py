"""One timing function, CUDA-graph capture, and the two floors (copy bandwidth, launch floor).

:meth:`CudaTimer.time` runs a list of callables round-robin (graph replays, or eager launches), each call
bracketed by its own pair of CUDA events, and returns one sample per call in microseconds:

- ``queue_ahead=True`` (graph replays, copies): before each chunk of calls a spin kernel
  (``torch.cuda._sleep``) holds the stream long enough for the host to enqueue the whole chunk, so a sample
  is the GPU time of one replay, not the host's time to submit it.
- ``queue_ahead=False`` (eager launches): nothing is queued ahead, so when the host is slower than the GPU
  the sample includes the gaps the host's launches leave: what an engine without graphs would see.
- ``before``: enqueued ahead of each call, outside its events (an L2 flush for cold whole-model steps).

:func:`host_time` measures the other side: the host's wall time per Python call, the device synchronised only
around each round of calls.

:class:`HostTimer` has the same interface without a GPU (no capture, ``perf_counter``); the CPU tests use it
to run the case plumbing under the Triton interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import triton

__all__ = ["CudaTimer", "HostTimer", "summarize", "host_time", "measure_copy_bandwidth", "measure_launch_floor"]

#: Calls enqueued behind one spin kernel.
CHUNK = 20
#: The host-side probe that sizes the spin kernel.
PROBE_CALLS = 10


def summarize(samples_us: Sequence[float], per: int = 1) -> dict:
    """Median and spread of per-call samples, divided by ``per`` (layer instances per call).

    ``samples_us`` are kept raw (per call) in the result; every other figure is per layer.
    """
    a = np.asarray(samples_us, dtype=np.float64)
    if a.size == 0:
        raise ValueError("summarize needs at least one sample")
    per_layer = a / per
    return {
        "n": int(a.size),
        "per": int(per),
        "median_us": float(np.median(per_layer)),
        "p10_us": float(np.percentile(per_layer, 10)),
        "p90_us": float(np.percentile(per_layer, 90)),
        "min_us": float(per_layer.min()),
        "max_us": float(per_layer.max()),
        "mean_us": float(per_layer.mean()),
        "call_median_us": float(np.median(a)),
        "samples_us": [round(float(x), 3) for x in a],
    }


class CudaTimer:
    """Times callables on one CUDA device with events; captures CUDA graphs."""

    def __init__(self, device="cuda"):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self._cycles_per_us: float | None = None

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Capture ``fn`` (already warmed up: Triton compiles on first call) into a CUDA graph; returns its
        replay."""
        graph = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(graph):
            fn()
        self.sync()
        return graph.replay

    def cycles_per_us(self) -> float:
        """GPU clock cycles per microsecond, calibrated once with the spin kernel."""
        if self._cycles_per_us is None:
            cuda = self.torch.cuda
            cuda._sleep(1000)
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            cycles = 5_000_000
            start.record()
            cuda._sleep(cycles)
            end.record()
            self.sync()
            us = start.elapsed_time(end) * 1e3
            self._cycles_per_us = cycles / us if us > 0 else 2000.0
        return self._cycles_per_us

    def _hold_stream(self, us: float) -> None:
        if hasattr(self.torch.cuda, "_sleep"):
            self.torch.cuda._sleep(int(min(us, 200_000.0) * self.cycles_per_us()))

    def time(
        self,
        calls: Sequence[Callable[[], None]],
        *,
        replays: int,
        warmup: int,
        queue_ahead: bool,
        before: Callable[[], None] | None = None,
    ) -> list[float]:
        """Call ``calls`` round-robin: ``warmup`` times, then ``replays`` timed times; one sample (us) per
        timed call. ``before`` runs ahead of every call, outside its events."""
        cuda = self.torch.cuda
        k = len(calls)
        i = 0

        def call(j: int) -> None:
            if before is not None:
                before()
            calls[j % k]()

        for _ in range(warmup):
            call(i)
            i += 1
        self.sync()
        t0 = time.perf_counter()
        for _ in range(PROBE_CALLS):
            call(i)
            i += 1
        host_us = (time.perf_counter() - t0) * 1e6 / PROBE_CALLS
        self.sync()
        starts = [cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [cuda.Event(enable_timing=True) for _ in range(replays)]
        for c0 in range(0, replays, CHUNK):
            m = min(CHUNK, replays - c0)
            if queue_ahead:
                self._hold_stream(3.0 * m * host_us + 100.0)
            for j in range(c0, c0 + m):
                if before is not None:
                    before()
                starts[j].record()
                calls[i % k]()
                ends[j].record()
                i += 1
        self.sync()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


class HostTimer:
    """:class:`CudaTimer`'s interface without a GPU: no capture, host clock (for CPU smoke tests)."""

    device = "cpu"

    def sync(self) -> None:
        pass

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn

    def time(
        self,
        calls: Sequence[Callable[[], None]],
        *,
        replays: int,
        warmup: int,
        queue_ahead: bool,
        before: Callable[[], None] | None = None,
    ) -> list[float]:
        k, out = len(calls), []
        for i in range(warmup):
            calls[i % k]()
        for i in range(replays):
            if before is not None:
                before()
            t0 = time.perf_counter()
            calls[i % k]()
            out.append((time.perf_counter() - t0) * 1e6)
        return out


def host_time(
    fns: dict[str, Callable[[], None]], *, calls: int, rounds: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Host wall time per call (us) of each function: ``rounds`` rounds, each ``calls`` back-to-back calls timed
    together after a ``sync()`` and synchronised only after the clock stops (so the device's work is not timed
    unless the launch queue fills). The functions take turns round by round, so drift hits them alike. One
    sample per round."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) * 1e6 / calls)
            sync()
    return out


# -------------------------------------------------------------------------------------------------
# Floors
# -------------------------------------------------------------------------------------------------
def measure_copy_bandwidth(timer: CudaTimer, *, nbytes: int = 1 << 30, replays: int = 30) -> dict:
    """Device-to-device copy bandwidth: ``dst.copy_(src)`` of ``nbytes``, counting read + write bytes."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=timer.device).normal_()
    dst = torch.empty_like(src)
    samples = timer.time([lambda: dst.copy_(src)], replays=replays, warmup=3, queue_ahead=True)
    stats = summarize(samples)
    return {
        "copy_bytes": int(nbytes),
        "copy_bw_GBps": 2 * nbytes / stats["median_us"] / 1e3,
        "copy_bw_GBps_best": 2 * nbytes / stats["min_us"] / 1e3,
        "copy": stats,
    }


@triton.jit
def _empty_kernel(x_ptr):
    pass


def measure_launch_floor(timer: CudaTimer, *, launches: int = 20, replays: int = 200) -> dict:
    """The launch floor: an empty kernel replayed in a CUDA graph of ``launches`` kernels, per kernel
    (the same way layer figures are replay / instances); plus a one-kernel graph and an eager launch."""
    import torch

    kernel = _empty_kernel
    x = torch.zeros(1, dtype=torch.float32, device=timer.device)

    def launch() -> None:
        kernel[(1,)](x)

    def launch_many() -> None:
        for _ in range(launches):
            launch()

    launch_many()
    timer.sync()
    many = timer.capture(launch_many)
    one = timer.capture(launch)
    s_many = summarize(timer.time([many], replays=replays, warmup=10, queue_ahead=True), per=launches)
    s_one = summarize(timer.time([one], replays=replays, warmup=10, queue_ahead=True))
    s_eager = summarize(timer.time([launch], replays=replays, warmup=10, queue_ahead=False))
    return {
        "launch_floor_us": s_many["median_us"],
        "launch_floor_kernels_per_graph": launches,
        "graph_one_kernel_us": s_one["median_us"],
        "eager_empty_launch_us": s_eager["median_us"],
        "launch_floor": s_many,
        "graph_one_kernel": s_one,
        "eager_empty_launch": s_eager,
    }
