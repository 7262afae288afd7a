"""Running one case: build the layers, fill their state, build the step's plans, warm up, capture, time.

Everything timed is what an engine launches (see :mod:`.layers`): the plans are built once per step before
the per-layer figures are taken (one plan per step per ratio, shared by every instance as an engine shares it
across layers; ``plan`` cases time ``build_plan`` itself, ``model`` cases include it), and each instance's op
runs on its own state, pages and input rows.

- decode: ``case.instances`` layer instances; one CUDA graph per rotated input copy set holds every
  instance's op in sequence. *Cold*: the graphs replay round-robin, copy sets rotating until they touch twice
  the L2. *Warm*: the first graph alone, replayed back to back. The tiled backend's instances share one
  scratch workspace, as sequential layers of an engine do.
- prefill: one instance, one request, ``chunk`` rows from position 0, or from ``r // 2`` after supplying the
  carried partial group through ``cache.step``.
- plan: a graph of ``case.instances`` ``build_plan`` launches.
- dispatch: host time per eager call, ``ops.<op>(...)`` against ``torch.ops.dsv4c.<op>(...)``.
- cache-step: host time of ``cache.step`` calls of a decode batch with MTP rewinds.
- model: every compressor layer of a model and both plans in one CUDA graph; warm, and cold (the L2 flushed
  by a read of twice its size before each replay, outside the timed events: rotated copies of every layer's
  state would multiply the memory the step needs).
- projection, layer, model-hidden: from hidden states (:mod:`.hidden_runs`, with ``model``).
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
import traceback

import numpy as np
import torch

from dsv4_compressor import ops
from dsv4_compressor.cache import CompressedKVCache
from dsv4_compressor.config import CompressorParams
from dsv4_compressor.workspace import Workspace, plan_c128_scratch

from .cases import (
    PREFILL_MTP_STEP,
    Case,
    case_traffic,
    choose_copies,
    decode_starts,
    online_splits,
    op_launches,
    pages_needed,
    plan_step,
    prefill_start,
)
from .floors import derive_metrics, kind_config, mean_traffic
from .hidden_runs import HiddenRuns, round_up
from .layers import (
    LayerOp,
    fill_state,
    make_cache,
    reserve_pages,
    step_meta,
)
from .timing import host_time, summarize

__all__ = ["Runner", "probe_online", "PARAM_POSITIONS"]

#: Rope table length of the benchmark's parameters (covers a 64K chunk after a carried partial group).
PARAM_POSITIONS = 1 << 17
#: Backends given an HCA scratch: the tiled kernel's, and the online kernel's for its prefill steps.
SCRATCH_BACKENDS = ("triton-tiled", "online")
#: What a result's headline figure ``us`` is, per phase.
UNITS = {
    "decode": "us per layer",
    "prefill": "us per layer",
    "plan": "us per launch",
    "dispatch": "host us per call",
    "cache-step": "host us per step",
    "model": "us per step",
    "projection": "us per projection",
    "layer": "us per layer",
    "model-hidden": "us per step",
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Runner(HiddenRuns):
    """Runs cases on one device and returns one result dict per case (see :meth:`run`).

    Args:
        timer: a :class:`~.timing.CudaTimer` (or :class:`~.timing.HostTimer` on CPU).
        replays, warmup: timed and untimed replays per graph figure (and eager figure).
        warm_replays: timed replays of a decode case's warm figure.
        host_calls, host_rounds: calls per round and rounds of a dispatch case.
        host_steps, host_warmup: timed and untimed ``cache.step`` calls of a cache-step case.
        floors: ``copy_bw_GBps`` and ``launch_floor_us`` of this run (for the derived metrics).
        l2_bytes, max_copies, max_copy_bytes: how far cold figures rotate input copies.
    """

    def __init__(
        self,
        timer,
        *,
        replays: int = 200,
        warmup: int = 20,
        warm_replays: int = 40,
        host_calls: int = 200,
        host_rounds: int = 5,
        host_steps: int = 50,
        host_warmup: int = 10,
        floors: dict | None = None,
        l2_bytes: int = 60 * 2**20,
        max_copies: int = 16,
        max_copy_bytes: int = 2 * 2**30,
        seed: int = 0,
        online_problem: str | None = None,
        log=_log,
    ):
        self.timer = timer
        self.device = torch.device(timer.device)
        self.replays = replays
        self.warmup = warmup
        self.warm_replays = warm_replays
        self.host_calls = host_calls
        self.host_rounds = host_rounds
        self.host_steps = host_steps
        self.host_warmup = host_warmup
        self.floors = floors or {}
        self.l2_bytes = l2_bytes
        self.max_copies = max_copies
        self.max_copy_bytes = max_copy_bytes
        self.seed = seed
        self.online_problem = online_problem
        self.log = log
        self._params: dict[str, CompressorParams] = {}
        self._gen = torch.Generator(device=self.device).manual_seed(seed)

    # -- the entry point -------------------------------------------------------------------------
    def run(self, case: Case) -> dict:
        """Measure ``case``; never raises: failures are recorded with ``status="error"`` and the text."""
        result = {"id": case.id, "case": case.as_dict(), "status": "ok", "note": "", "error": None}
        reason = case.not_applicable()
        if reason:
            result.update(status="n/a", note=reason)
            return result
        if case.backend == "online" and self.online_problem:
            result.update(status="skipped", note=self.online_problem)
            return result
        measure = {
            "decode": self._run_decode,
            "prefill": self._run_prefill,
            "plan": self._run_plan,
            "dispatch": self._run_dispatch,
            "cache-step": self._run_cache_step,
            "model": self._run_model,
            "projection": self._run_projection,
            "layer": self._run_layer,
            "model-hidden": self._run_model,
        }
        try:
            result.update(measure[case.phase](case))
            result["unit"] = UNITS[case.phase]
        except Exception as exc:  # one failure must not end the run
            result.update(
                status="error",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=8),
            )
        finally:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return result

    # -- building blocks -------------------------------------------------------------------------
    def params(self, kind: str) -> CompressorParams:
        """One parameter set per kind on the device, shared by every instance (rope tables are shared in the
        engines too; the APE and norm weight are a few KiB)."""
        if kind not in self._params:
            cfg = kind_config(kind)
            self._params[kind] = CompressorParams.random(
                cfg, max_positions=PARAM_POSITIONS, seed=self.seed, device=self.device
            )
        return self._params[kind]

    def _rows(self, n: int, width: int) -> torch.Tensor:
        return torch.randn(n, width, device=self.device, generator=self._gen)

    def _workspace(self, kind: str, backend: str, *, rows: int, max_requests: int, mtp_step: int):
        """The HCA scratch of the tiled kernel and of the online kernel's prefill steps (one region, shared by
        every instance), or ``None``."""
        cfg = kind_config(kind)
        if backend not in SCRATCH_BACKENDS or cfg.overlap:
            return None
        plan = plan_c128_scratch(
            batch_max_tokens=rows, max_req_num=max_requests, mtp_step=mtp_step, head_dim=cfg.head_dim
        )
        return Workspace(plan, device=self.device)

    def _layer(self, kind: str, backend: str, *, ends, workspace: Workspace | None, rows: int, **cache_args):
        """A cache owning one layer's buffers (pool sized to the pages ``ends`` need), its state filled, and
        the op bound to them (with a scratch region of ``workspace`` when it runs the tiled HCA kernel)."""
        cfg = kind_config(kind)
        if backend not in SCRATCH_BACKENDS or cfg.overlap:
            workspace = None
        pages = pages_needed(cfg, ends, cfg.default_page_size)
        cache = make_cache(
            cfg, self.params(kind), backend, device=self.device, workspace=workspace, max_pages=pages, **cache_args
        )
        fill_state(cache, self._gen)
        scratch = workspace.c128_scratch(0, rows) if workspace is not None else None
        return LayerOp(cache, scratch=scratch)

    def _copies(self, *, bytes_per_replay: float, bytes_per_copy: float) -> int:
        return choose_copies(
            bytes_per_replay=bytes_per_replay,
            bytes_per_copy=bytes_per_copy,
            l2_bytes=self.l2_bytes,
            max_copies=self.max_copies,
            max_copy_bytes=self.max_copy_bytes,
        )

    def _time_layers(self, case: Case, calls: list, per: int, *, warm: bool) -> dict:
        """Warm up (compiles), then time the calls (one per input copy set): cold graph replays round-robin,
        the first graph alone back to back (warm), eager calls."""
        for call in calls:  # Triton compiles here; errors surface before any capture
            call()
        self.timer.sync()
        copies = len(calls)
        out = {"graph": None, "warm": None, "eager": None}
        if case.timing == "graph":
            graphs = [self.timer.capture(call) for call in calls]
            samples = self.timer.time(graphs, replays=self.replays, warmup=max(self.warmup, copies), queue_ahead=True)
            out["graph"] = summarize(samples, per=per)
            if warm:
                samples = self.timer.time(graphs[:1], replays=self.warm_replays, warmup=self.warmup, queue_ahead=True)
                out["warm"] = summarize(samples, per=per)
            del graphs
        if case.timing == "eager" or case.eager:
            samples = self.timer.time(calls, replays=self.replays, warmup=max(3, copies), queue_ahead=False)
            out["eager"] = summarize(samples, per=per)
        return out

    def _figures(self, timed: dict, traffic: dict, *, launches: int = 1) -> dict:
        """The headline figure (cold graph, else eager) and the metrics derived from it."""
        stats = timed.get("graph") or timed.get("eager")
        us = stats["median_us"] if stats else None
        out = {"us": us, "timing": "graph" if timed.get("graph") else "eager"}
        out.update(derive_metrics(traffic, us, self.floors, launches=launches))
        return out

    # -- decode ----------------------------------------------------------------------------------
    def _run_decode(self, case: Case) -> dict:
        cfg = kind_config(case.kind)
        b, s = case.batch, case.rows
        instances = case.instances if case.timing == "graph" else 1
        first = case_traffic(case, 0, seed=self.seed)
        kv_bytes = b * s * cfg.row_width * 4
        copies = self._copies(bytes_per_replay=instances * first.total, bytes_per_copy=instances * kv_bytes)
        starts = [np.asarray(decode_starts(case, k, seed=self.seed)) for k in range(copies)]
        traffic = mean_traffic([case_traffic(case, k, seed=self.seed) for k in range(copies)])
        ends = np.max(starts, axis=0) + s
        slots = np.arange(b)
        rows = b * s
        workspace = self._workspace(case.kind, case.backend, rows=rows, max_requests=b, mtp_step=case.mtp_step)
        max_seq_len = round_up(int(ends.max()) + 1, cfg.ratio)
        self.log(f"    building {instances} instance(s) x {copies} input copy set(s)")
        layers = [
            self._layer(case.kind, case.backend, ends=ends, workspace=workspace, rows=rows, max_requests=b,
                        max_seq_len=max_seq_len, mtp_step=case.mtp_step)
            for _ in range(instances)
        ]  # fmt: skip
        reserve_pages([layer.cache.pool for layer in layers], slots, ends)
        metas = [
            step_meta(slots, st, [s] * b, ratio=cfg.ratio, num_slots=b, mtp_step=case.mtp_step, device=self.device,
                      pool=layers[0].cache.pool)
            for st in starts
        ]  # fmt: skip
        kv = [[self._rows(rows, cfg.row_width) for _ in range(copies)] for _ in layers]

        def step(copy: int):
            def run() -> None:
                for layer, rows_of in zip(layers, kv):
                    layer(rows_of[copy], metas[copy])

            return run

        timed = self._time_layers(case, [step(k) for k in range(copies)], instances, warm=True)
        rotation = copies * instances * first.total
        figures = self._figures(timed, traffic)
        return {
            "instances": instances,
            "copies": copies,
            "rotation_bytes": rotation,
            "l2_rotation_ok": rotation >= 2 * self.l2_bytes,
            "warm_bytes": instances * first.total,
            "traffic": traffic,
            **self._describe(case, layers[0].cache, workspace, decode=True),
            **timed,
            **figures,
            "us_per_layer": figures["us"],
        }

    def _describe(self, case: Case, cache: CompressedKVCache, workspace: Workspace | None, *, decode: bool) -> dict:
        split = workspace is not None and online_splits(case, self.device)
        return {
            "launches_per_layer": op_launches(case.kind, case.backend, decode=decode, requests=case.batch, split=split),
            "scratch_bytes": int(workspace.nbytes) if workspace is not None else 0,
            "state_bytes_per_request": int(cache.state_bytes_per_request()),
        }

    # -- prefill ---------------------------------------------------------------------------------
    def _run_prefill(self, case: Case) -> dict:
        cfg = kind_config(case.kind)
        r, n = cfg.ratio, case.chunk
        start = prefill_start(case)
        traffic = case_traffic(case, seed=self.seed).as_dict()
        ends = np.array([start + n])
        workspace = self._workspace(case.kind, case.backend, rows=max(n, start), max_requests=1,
                                    mtp_step=PREFILL_MTP_STEP)  # fmt: skip
        layer = self._layer(case.kind, case.backend, ends=ends, workspace=workspace, rows=n, max_requests=1,
                            max_seq_len=round_up(start + n + 1, r), mtp_step=case.mtp_step)  # fmt: skip
        cache = layer.cache
        if start:  # the carried partial group, through the real path
            cache.step([0], [0], [start], self._rows(start, cfg.row_width))
        reserve_pages([cache.pool], np.array([0]), ends)
        meta = step_meta([0], [start], [n], ratio=r, num_slots=1, mtp_step=case.mtp_step, device=self.device,
                         pool=cache.pool)  # fmt: skip
        kv_bytes = n * cfg.row_width * 4
        copies = self._copies(bytes_per_replay=traffic["total"], bytes_per_copy=kv_bytes)
        self.log(f"    1 instance x {copies} input cop{'y' if copies == 1 else 'ies'}")
        kv = [self._rows(n, cfg.row_width) for _ in range(copies)]

        def step(copy: int):
            return lambda: layer(kv[copy], meta)

        timed = self._time_layers(case, [step(k) for k in range(copies)], 1, warm=False)
        rotation = copies * traffic["total"]
        figures = self._figures(timed, traffic)
        return {
            "instances": 1,
            "copies": copies,
            "rotation_bytes": rotation,
            "l2_rotation_ok": rotation >= 2 * self.l2_bytes,
            "traffic": traffic,
            **self._describe(case, cache, workspace, decode=False),
            **timed,
            **figures,
            "us_per_layer": figures["us"],
        }

    # -- build_plan ------------------------------------------------------------------------------
    def _run_plan(self, case: Case) -> dict:
        r = kind_config(case.kind).ratio
        starts, counts = plan_step(case, seed=self.seed)
        b, rows = len(starts), int(sum(counts))
        # the step writes into no pool: every row gets its own output slot (build_plan only copies them)
        meta = step_meta(np.arange(b), starts, counts, ratio=r, num_slots=b, mtp_step=case.mtp_step,
                         device=self.device, out_slot=np.arange(rows, dtype=np.int64))  # fmt: skip

        def launches() -> None:
            for _ in range(case.instances):
                meta.build_plan()

        timed = self._time_layers(case, [launches], case.instances, warm=False)
        return {
            "instances": case.instances,
            "requests": b,
            "plan_rows": rows,
            "closing_rows": int((meta.host[0] % r == r - 1).sum()),
            "plan_bytes": int(meta.plan.numel() * 4),
            "decode": meta.decode,
            **timed,
            "us": timed["graph"]["median_us"] if timed["graph"] else None,
            "timing": "graph",
        }

    # -- host time: the dispatcher, cache.step ---------------------------------------------------
    def _run_dispatch(self, case: Case) -> dict:
        cfg = kind_config(case.kind)
        b, s = case.batch, case.rows
        starts = np.asarray(decode_starts(case, seed=self.seed))
        ends, slots, rows = starts + s, np.arange(b), b * s
        workspace = self._workspace(case.kind, case.backend, rows=rows, max_requests=b, mtp_step=case.mtp_step)
        layer = self._layer(case.kind, case.backend, ends=ends, workspace=workspace, rows=rows, max_requests=b,
                            max_seq_len=round_up(int(ends.max()) + 1, cfg.ratio), mtp_step=case.mtp_step)  # fmt: skip
        reserve_pages([layer.cache.pool], slots, ends)
        meta = step_meta(slots, starts, [s] * b, ratio=cfg.ratio, num_slots=b, mtp_step=case.mtp_step,
                         device=self.device, pool=layer.cache.pool)  # fmt: skip
        kv = self._rows(rows, cfg.row_width)
        name, args, kwargs = layer.call(kv, meta.plan, decode=True)
        plan_args = (meta.plan, meta.positions, meta.row_req, meta.out_slot)
        plan_kwargs = dict(ratio=meta.ratio, num_slots=meta.num_slots)
        lib = torch.ops.dsv4c
        fns = {
            f"ops.{name}": lambda: getattr(ops, name)(*args, **kwargs),
            f"torch.ops.dsv4c.{name}": lambda: getattr(lib, name)(*args, **kwargs),
            "ops.build_plan": lambda: ops.build_plan(*plan_args, **plan_kwargs),
            "torch.ops.dsv4c.build_plan": lambda: lib.build_plan(*plan_args, **plan_kwargs),
        }
        for fn in fns.values():  # compiles; the dispatcher path must run the same kernels
            fn()
        samples = host_time(fns, calls=self.host_calls, rounds=self.host_rounds, sync=self.timer.sync)
        host = {label: summarize(x) for label, x in samples.items()}
        overhead = {
            op: host[f"torch.ops.dsv4c.{op}"]["median_us"] - host[f"ops.{op}"]["median_us"]
            for op in (name, "build_plan")
        }
        return {
            "op": name,
            "calls": self.host_calls,
            "rounds": self.host_rounds,
            "host": host,
            "dispatcher_overhead_us": overhead,
            "us": host[f"ops.{name}"]["median_us"],
            "timing": "host",
            "note": "host wall time per call: rounds of back-to-back calls, the device synchronised only between "
            "rounds",
        }

    def _run_cache_step(self, case: Case) -> dict:
        cfg = kind_config(case.kind)
        b, s, mtp = case.batch, case.rows, case.mtp_step
        steps = self.host_warmup + self.host_steps
        cache = make_cache(cfg, self.params(case.kind), case.backend, max_requests=b, mtp_step=mtp,
                           max_seq_len=round_up(s * (steps + 2), cfg.ratio), device=self.device)  # fmt: skip
        kv = self._rows(b * s, cfg.row_width)
        ids = np.arange(b)
        counts = np.full(b, s)
        rng = np.random.default_rng(self.seed)
        cache.step(ids, np.zeros(b, dtype=np.int64), counts, kv)  # every request begins
        lengths = counts.copy()
        samples = []
        for _ in range(steps):
            # MTP verification accepted 0..mtp of each request's drafts: the next step restarts after them
            starts = lengths - mtp + rng.integers(0, mtp + 1, size=b)
            self.timer.sync()
            t0 = time.perf_counter()
            cache.step(ids, starts, counts, kv)
            samples.append((time.perf_counter() - t0) * 1e6)
            lengths = starts + s
        self.timer.sync()
        stats = summarize(samples[self.host_warmup :])
        return {
            "steps": self.host_steps,
            "warmup_steps": self.host_warmup,
            "host": stats,
            "us": stats["median_us"],
            "timing": "host",
            "check_finite": cache.check_finite,
            "note": "host wall time of the cache.step call (validation, pages, the metadata upload, the launches); "
            "the device is synchronised before each call and not within it, so its execution is not timed",
        }


def probe_online(device, *, requests: int, mtp_step: int) -> tuple[str | None, dict | None]:
    """``(problem, probe)``: why the online backend cannot run here (``None`` when it can), and its state
    bytes per request per kind and scratch bytes from instances built for ``requests`` requests."""
    module = "dsv4_compressor.backends.online"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"online backend not present ({module} does not exist in this build)", None
    state: dict[str, int | None] = {}
    notes: list[str] = []
    scratch = None
    for kind in ("hca", "csa", "indexer"):
        cfg = kind_config(kind)
        try:
            params = CompressorParams.random(cfg, max_positions=1024, device=device)
            cache = CompressedKVCache(
                cfg, params, max_requests=requests, max_seq_len=1024, mtp_step=mtp_step, backend="online",
                device=device, check_finite=False,
            )  # fmt: skip
            state[kind] = int(cache.state_bytes_per_request())
            if kind == "hca":
                workspace = getattr(cache.backend, "workspace", None)
                scratch = int(workspace.nbytes) if workspace is not None else 0
            del cache
        except Exception as exc:  # a broken backend is reported, not fatal
            if kind == "hca":
                return f"online backend cannot be constructed ({type(exc).__name__}: {exc})", None
            state[kind] = None
            notes.append(f"{kind}: {type(exc).__name__}: {exc}")
    note = "; ".join(notes) if notes else "measured from constructed instances (CSA and indexer: ring fallback)"
    return None, {"state": state, "scratch": scratch, "note": note}
