"""Running one case: build the layer instances, fill their state, warm up, capture, time, count bytes.

The step is driven below the cache's host-side validation, the way an engine drives it inside a CUDA graph:
``cache.backend.launch(desc, kv_score, decode=...)`` is everything the engine launches for one layer and
step (the reference backend, eager PyTorch, runs ``cache.backend.step``).

Decode: ``case.instances`` layer instances (own cache, ring / online state, pages, descriptor and
``kv_score`` copies); one CUDA graph per rotated input copy set holds all instances' launches in sequence;
the graphs replay round-robin. The tiled backend's instances share one scratch workspace, as sequential
layers of an engine do. Ring state is filled with random values (``normal_``) so windows read real values;
the online backend's banks get random but consistent running states (see :meth:`Runner._fill_state`).

Prefill: one instance, one request, ``chunk`` rows from position 0, or from ``r // 2`` after supplying the
carried partial group through ``cache.step``.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import traceback
from dataclasses import dataclass

import torch

from ..cache import CompressedKVCache
from ..config import CompressorParams
from ..step import StepDescriptor, build_step_descriptor
from ..workspace import Workspace, plan_c128_scratch
from .cases import (
    SPAN_GROUPS,
    Case,
    case_traffic,
    choose_copies,
    decode_starts,
    prefill_start,
)
from .floors import derive_metrics, kind_config, mean_traffic, state_model
from .timing import summarize

__all__ = ["Runner", "BACKEND_ARGS", "backend_scratch_bytes", "probe_online"]

#: Bench backend name -> (cache backend, backend options).
BACKEND_ARGS = {
    "reference": ("reference", {}),
    "triton-single": ("triton", {"c128_kernel": "single"}),
    "triton-tiled": ("triton", {"c128_kernel": "tiled"}),
    "online": ("online", {}),
}
#: Rope table length of the benchmark's parameters (covers a 64K chunk after a carried partial group).
PARAM_POSITIONS = 1 << 17
#: Requests per priming step of an online state of unknown layout.
PRIME_REQUESTS = 16


def backend_scratch_bytes(backend) -> int | None:
    """Scratch a backend instance holds: ``scratch_bytes()`` if it has one, else its workspace's bytes,
    else 0 (no workspace attribute)."""
    fn = getattr(backend, "scratch_bytes", None)
    if callable(fn):
        return int(fn())
    ws = getattr(backend, "workspace", None)
    if ws is not None:
        return int(ws.nbytes)
    return 0


@dataclass
class Layer:
    """One layer instance: its cache and, per rotated input copy, a descriptor and ``kv_score`` rows."""

    cache: CompressedKVCache
    descs: list[StepDescriptor]
    rows: list[torch.Tensor]
    decode: bool
    eager_reference: bool

    def call(self, copy: int) -> None:
        desc, kv = self.descs[copy], self.rows[copy]
        if self.eager_reference:
            self.cache.backend.step(desc, kv)
        else:
            self.cache.backend.launch(desc, kv, decode=self.decode)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Runner:
    """Runs cases on one device and returns one result dict per case (see :meth:`run`)."""

    def __init__(
        self,
        timer,
        *,
        replays: int = 200,
        warmup: int = 20,
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
        try:
            if case.phase == "decode":
                result.update(self._run_decode(case))
            else:
                result.update(self._run_prefill(case))
            result.update(self._metrics(result))
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

    def _metrics(self, result: dict) -> dict:
        timed = result.get("graph") or result.get("eager")
        us = timed["median_us"] if timed else None
        out = {"us_per_layer": us, "timing": "graph" if result.get("graph") else "eager"}
        out.update(derive_metrics(result["traffic"], us, self.floors))
        return out

    # -- building blocks -------------------------------------------------------------------------
    def params(self, kind: str) -> CompressorParams:
        if kind not in self._params:
            cfg = kind_config(kind)
            self._params[kind] = CompressorParams.random(
                cfg, max_positions=PARAM_POSITIONS, seed=self.seed, device=self.device
            )
        return self._params[kind]

    def _rows(self, n: int, width: int) -> torch.Tensor:
        return torch.randn(n, width, device=self.device, generator=self._gen)

    def _workspace(self, case: Case, *, rows: int, max_requests: int) -> Workspace | None:
        if case.backend != "triton-tiled":
            return None
        plan = plan_c128_scratch(
            batch_max_tokens=rows,
            max_req_num=max_requests,
            mtp_step=case.mtp_step,
            head_dim=kind_config(case.kind).head_dim,
        )
        return Workspace(plan, device=self.device)

    def _cache(self, case: Case, *, max_requests: int, max_seq_len: int, workspace: Workspace | None):
        name, opts = BACKEND_ARGS[case.backend]
        opts = dict(opts)
        if workspace is not None:
            opts["workspace"] = workspace
        return CompressedKVCache(
            kind_config(case.kind),
            self.params(case.kind),
            max_requests=max_requests,
            max_seq_len=max_seq_len,
            mtp_step=case.mtp_step,
            backend=name,
            device=self.device,
            check_finite=False,
            **opts,
        )

    def _fill_ring(self, cache: CompressedKVCache) -> None:
        """Random ring rows (also of a ring the backend delegates to, as the online one does for CSA)."""
        for owner in (cache.backend, getattr(cache.backend, "ring_backend", None)):
            ring = getattr(owner, "ring", None)
            if isinstance(ring, torch.Tensor) and ring.is_floating_point():
                ring.normal_(generator=self._gen)

    def _fill_state(self, cache: CompressedKVCache, case: Case, slots: list[int], phases: list[int]) -> str:
        """Random ring rows. Online state in the layout the online backend documents (float32
        ``state[slot, bank, (max, sum, weighted sum), H]``): random but consistent banks (max ~ N(0, 1), sum in
        [1, 4), weighted sum ~ N(0, 1)). A state of another layout is primed through the real path instead:
        ``cache.step`` of each request's partial group (``phases[i]`` rows), 16 requests a step. Returns a
        note (empty when nothing needs saying)."""
        self._fill_ring(cache)
        if state_model(case.backend, cache.config) != "online":
            return ""
        state = getattr(cache.backend, "state", None)
        if isinstance(state, torch.Tensor) and state.dim() == 4 and state.shape[2] == 3:
            state[:, :, 0].normal_(generator=self._gen)
            state[:, :, 1].uniform_(1.0, 4.0, generator=self._gen)
            state[:, :, 2].normal_(generator=self._gen)
            return ""
        try:
            for i in range(0, len(slots), PRIME_REQUESTS):
                part, counts = slots[i : i + PRIME_REQUESTS], phases[i : i + PRIME_REQUESTS]
                if any(counts):
                    rows = self._rows(sum(counts), cache.config.row_width)
                    cache.step(part, [0] * len(part), counts, rows)
        except Exception as exc:  # timing still means something without primed values
            return f"online state not primed ({type(exc).__name__}: {exc})"
        return "online state primed through cache.step"

    def _copies(self, *, bytes_per_replay: float, bytes_per_copy: float) -> int:
        return choose_copies(
            bytes_per_replay=bytes_per_replay,
            bytes_per_copy=bytes_per_copy,
            l2_bytes=self.l2_bytes,
            max_copies=self.max_copies,
            max_copy_bytes=self.max_copy_bytes,
        )

    def _time(self, case: Case, layers: list[Layer], copies: int) -> dict:
        """Warm up (compiles), then time graph replays and/or eager calls of all layers per copy set."""

        def step(copy: int):
            def run() -> None:
                for layer in layers:
                    layer.call(copy)

            return run

        calls = [step(k) for k in range(copies)]
        for call in calls:  # Triton compiles here; errors surface before any capture
            call()
        self.timer.sync()
        per = len(layers)
        out = {"graph": None, "eager": None}
        if case.timing == "graph":
            graphs = [self.timer.capture(call) for call in calls]
            samples = self.timer.time(graphs, replays=self.replays, warmup=max(self.warmup, copies), queue_ahead=True)
            out["graph"] = summarize(samples, per=per)
            del graphs
        if case.timing == "eager" or case.eager:
            samples = self.timer.time(calls, replays=self.replays, warmup=max(3, copies), queue_ahead=False)
            out["eager"] = summarize(samples, per=per)
        return out

    @staticmethod
    def _describe(cache: CompressedKVCache, workspace: Workspace | None, decode: bool) -> dict:
        backend = cache.backend
        launches = getattr(backend, "launches_per_step", None)
        return {
            "launches_per_step": launches(decode) if callable(launches) else None,
            "scratch_bytes": int(workspace.nbytes) if workspace is not None else backend_scratch_bytes(backend),
            "state_bytes_per_request": int(cache.state_bytes_per_request()),
        }

    # -- decode ----------------------------------------------------------------------------------
    def _run_decode(self, case: Case) -> dict:
        cfg = kind_config(case.kind)
        r, b, s = cfg.ratio, case.batch, case.rows
        instances = case.instances if case.timing == "graph" else 1
        first = case_traffic(case, 0, seed=self.seed)
        kv_bytes = b * s * cfg.row_width * 4
        copies = self._copies(bytes_per_replay=instances * first.total, bytes_per_copy=instances * kv_bytes)
        starts = [decode_starts(case, k, seed=self.seed) for k in range(copies)]
        traffic = mean_traffic([case_traffic(case, k, seed=self.seed) for k in range(copies)])
        max_seq_len = r * (max(SPAN_GROUPS, copies + 2) + 1)
        workspace = self._workspace(case, rows=b * s, max_requests=b)
        slots = list(range(b))
        self.log(f"    building {instances} instance(s) x {copies} input copy set(s)")
        layers, notes = [], set()
        for _ in range(instances):
            cache = self._cache(case, max_requests=b, max_seq_len=max_seq_len, workspace=workspace)
            note = self._fill_state(cache, case, slots, [st % r for st in starts[0]])
            if note:
                notes.add(note)
            for slot in slots:
                cache.pool.ensure(slot, max((st[slot] + s) // r for st in starts))
            descs = [
                build_step_descriptor(
                    slots,
                    st,
                    [s] * b,
                    ratio=r,
                    page_table=cache.pool.page_table,
                    page_size=cache.page_size,
                    device=self.device,
                )
                for st in starts
            ]
            rows = [self._rows(b * s, cfg.row_width) for _ in range(copies)]
            layers.append(Layer(cache, descs, rows, decode=True, eager_reference=case.backend == "reference"))
        timed = self._time(case, layers, copies)
        rotation = copies * instances * first.total
        out = {
            "instances": instances,
            "copies": copies,
            "rotation_bytes": rotation,
            "l2_rotation_ok": rotation >= 2 * self.l2_bytes,
            "traffic": traffic,
            "note": "; ".join(sorted(notes)),
            **self._describe(layers[0].cache, workspace, decode=True),
            **timed,
        }
        return out

    # -- prefill ---------------------------------------------------------------------------------
    def _run_prefill(self, case: Case) -> dict:
        cfg = kind_config(case.kind)
        r, n = cfg.ratio, case.chunk
        start = prefill_start(case)
        traffic = case_traffic(case, seed=self.seed)
        max_seq_len = -(-(start + n + 1) // r) * r
        workspace = self._workspace(case, rows=max(n, start), max_requests=1)
        cache = self._cache(case, max_requests=1, max_seq_len=max_seq_len, workspace=workspace)
        self._fill_ring(cache)
        if start:  # the carried partial group, through the real path
            cache.step([0], [0], [start], self._rows(start, cfg.row_width))
        else:
            cache.backend.begin(0)
        cache.pool.ensure(0, (start + n) // r)
        desc = build_step_descriptor(
            [0], [start], [n], ratio=r, page_table=cache.pool.page_table, page_size=cache.page_size, device=self.device
        )
        kv_bytes = n * cfg.row_width * 4
        copies = self._copies(bytes_per_replay=traffic.total, bytes_per_copy=kv_bytes)
        self.log(f"    1 instance x {copies} input cop{'y' if copies == 1 else 'ies'}")
        rows = [self._rows(n, cfg.row_width) for _ in range(copies)]
        layer = Layer(cache, [desc] * copies, rows, decode=False, eager_reference=case.backend == "reference")
        timed = self._time(case, [layer], copies)
        rotation = copies * traffic.total
        return {
            "instances": 1,
            "copies": copies,
            "rotation_bytes": rotation,
            "l2_rotation_ok": rotation >= 2 * self.l2_bytes,
            "traffic": traffic.as_dict(),
            **self._describe(cache, workspace, decode=False),
            **timed,
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
                cfg,
                params,
                max_requests=requests,
                max_seq_len=1024,
                mtp_step=mtp_step,
                backend="online",
                device=device,
                check_finite=False,
            )
            state[kind] = int(cache.state_bytes_per_request())
            if kind == "hca":
                scratch = backend_scratch_bytes(cache.backend)
            del cache
        except Exception as exc:  # a broken backend is reported, not fatal
            if kind == "hca":
                return f"online backend cannot be constructed ({type(exc).__name__}: {exc})", None
            state[kind] = None
            notes.append(f"{kind}: {type(exc).__name__}: {exc}")
    note = "; ".join(notes) if notes else "measured from constructed instances (CSA and indexer: ring fallback)"
    return None, {"state": state, "scratch": scratch, "note": note}
