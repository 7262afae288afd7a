"""The timing: the decode step snapshot after it ran (:func:`snapshot_step`), restored after the checks and
replayed as graph variants (:func:`run_timing`), each timed with CUDA events (wall clock on the CPU)."""

from __future__ import annotations

import statistics
import time
import traceback

import torch

from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.integrations.lightllm import layer as adapter_layer
from dsv4_compressor.integrations.lightllm import layout as adapter_layout

from .engine import Engine
from .options import CSA_KINDS, HCA_KINDS
from .runtime import Dist, Replay


def _measure(replay, ctx: Dist, samples: int, inner: int) -> dict:
    times = []
    for _ in range(samples):
        ctx.sync()  # every rank starts together: the collectives inside do not time the other rank's lateness
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                replay()
            times.append((time.perf_counter() - t0) * 1e6 / inner)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    return {"median_us": statistics.median(times), "p10_us": q(0.1), "p90_us": q(0.9), "samples": samples,
            "replays_per_sample": inner}  # fmt: skip


def snapshot_step(eng: Engine, items) -> dict:
    """Everything the decode step just replayed reads and writes: the captured ``infer_state`` and inputs,
    LightLLM's tables, the state and the pools. The timing restores it later and replays that step."""
    static_tensors = {k: v.clone() for k, v in vars(eng.static_state).items()
                      if isinstance(v, torch.Tensor) and not k.startswith("dsv4c_")}  # fmt: skip
    inputs = eng.static_inputs if eng.model.gemm else eng.static_inputs["flat"]
    tables = [eng.reqm.req_to_token_indexs, eng.mm.full_to_swa_indexs, eng.mm.full_to_c4_indexs,
              eng.mm.full_to_c128_indexs]  # fmt: skip
    return {"items": list(items), "static": static_tensors, "inputs": (inputs, inputs.clone()),
            "tensors": [(t, t.clone()) for t in tables + eng.mutable_tensors()]}  # fmt: skip


def run_timing(eng: Engine, ctx: Dist, args, snap: dict) -> dict:
    """Graph variants of a decode step, each captured, replayed and timed with CUDA events:

    - the build alone;
    - the build and every layer;
    - the same with a per-layer all_reduce after each layer (engine order);
    - the same with the all_reduces running concurrently on a side stream;
    - the all_reduces alone;
    - the HCA layers only, and the CSA layers only.

    The step is the first one in which every rank decoded a full batch, restored from ``snap``. Replays rewrite
    state and pools, so this runs after the checks."""
    for name, saved in snap["static"].items():
        getattr(eng.static_state, name).copy_(saved)
    snap["inputs"][0].copy_(snap["inputs"][1])
    for t, saved in snap["tensors"]:
        t.copy_(saved)
    items = snap["items"]
    model, static, inputs, tb = eng.model, eng.static_state, eng.static_inputs, eng.timing_builder
    n_layers = len(model.by_layer)
    side = torch.cuda.Stream() if ctx.cuda else None

    def body(kinds=None, collective=None, build=True):
        def fn():
            if build:  # (without: the layers on the snapshot step's plans, built before the capture)
                tb.build(static)
            return model.run_layers(static, inputs, kinds=kinds, collective=collective)

        return fn

    def nccl_only():
        for _ in range(n_layers):
            eng.all_reduce_decode()

    def concurrent():
        if side is None:  # the CPU: no streams, the same work one after the other
            out = body()()
            nccl_only()
            return out
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            nccl_only()
        out = body()()
        main.wait_stream(side)
        return out

    def bare_csa(ring_states, ring_tables=None):  # the CSA layers as bare ops.compress calls (probes; kv_score only)
        def fn():
            tb.build(static)
            if ring_tables is not None:  # the rings addressed through req_ring tables: table mode on compact state
                plan = getattr(static, adapter_layout._C4_PLAN)
                adapter.ops.build_state_rows(plan, *ring_tables, mode="req_ring", ring=eng.layout.c4_state_ring)
            for c in (c for comps in model.by_layer for c in comps if c.kind in CSA_KINDS):
                _, name, args_, kw = adapter_layer._layer_op(c.kind, static, c.layer, ape=c.params.ape,
                                                       norm_weight=c.params.norm_weight, cos=model.cos, sin=model.sin,
                                                       eps=c.params.eps)  # fmt: skip
                if ring_states is not None:  # a request ring [slots, 8 + mtp, 2W] in place of LightLLM's tables
                    for k in ("read_rows", "save_rows"):
                        kw.pop(k)
                    kw["state"] = ring_states[c.key]
                    if ring_tables is not None:
                        kw.update(read_rows=ring_tables[0], save_rows=ring_tables[1])
                getattr(adapter.ops, name)(inputs[c.key], *args_, **kw)

        return fn

    probes = []
    if not model.gemm and eng.mm.n_c4:
        ring = eng.layout.c4_state_ring
        rings = {c.key: torch.zeros(eng.G, ring, c.cfg.row_width, dtype=torch.float32, device=eng.device)
                 for comps in model.by_layer for c in comps if c.kind in CSA_KINDS}  # fmt: skip
        read0 = getattr(static, adapter_layout._C4_READ)
        save0 = getattr(static, adapter_layout._C4_SAVE)
        ring_tables = (torch.full_like(read0, -1), torch.full_like(save0, -1))
        probes = [("csa_ops_tables", bare_csa(None)), ("csa_ops_ring", bare_csa(rings)),
                  ("csa_ops_ring_tables", bare_csa(rings, ring_tables))]  # fmt: skip
    variants = [
        ("build", lambda: tb.build(static)),
        ("layers", body()),
        ("layers_nccl_serial", body(collective=eng.all_reduce_decode)),
        ("layers_nccl_concurrent", concurrent),
        ("nccl_only", nccl_only),
        ("hca_layers", body(kinds=HCA_KINDS)),
        ("csa_layers", body(kinds=CSA_KINDS)),
        ("layers_no_build", body(build=False)),
        ("one_kernel", lambda: eng.moe_decode.add_(0)),  # a graph's own cost: one tiny kernel
        *probes,  # after the full builds: the parts below leave a plan without its tables
        ("build_plans", lambda: tb.build(static, parts=("plans",))),
        ("build_state_rows", lambda: tb.build(static, parts=("state_rows",))),
    ]
    wanted = {"build", *args.timing_variants.split(",")}
    variants = [(name, fn) for name, fn in variants if name in wanted]
    if args.graph_collectives == "off":  # collectives are not captured in this run: time the layers only
        variants = [(name, fn) for name, fn in variants if "nccl" not in name]
    raw, errors = {}, {}
    for name, fn in variants:
        rep, error = None, None
        try:
            rep = Replay(fn, eng.device, args.capture_error_mode)
        except Exception as err:  # noqa: BLE001 - reported; every rank skips the variant
            error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        if ctx.all_max([int(error is not None)])[0]:
            errors[name] = error or "the capture failed on another rank"
            continue
        raw[name] = _measure(rep.replay, ctx, args.timing_samples, args.timing_inner)
        del rep
    for k, v in eng.production_attrs.items():  # the captured state points at the production builder again
        setattr(static, k, v)
    if ctx.cuda:
        torch.cuda.synchronize()
    med = {k: v["median_us"] for k, v in raw.items()}
    med.setdefault("build", float("nan"))
    n_hca, n_csa = eng.mm.n_c128, eng.mm.n_c4
    hca_closing = sum(1 for _, start, n in items if (start + n) // eng.shapes.hca.ratio > start // eng.shapes.hca.ratio)
    less_build = lambda name, n: (med[name] - med["build"]) / n if name in med and n else None
    per_layer = {
        "layers_alone": less_build("layers", n_layers),
        "layers_with_nccl_serial": less_build("layers_nccl_serial", n_layers),
        "layers_with_nccl_concurrent": less_build("layers_nccl_concurrent", n_layers),
        "nccl_alone": med["nccl_only"] / n_layers if "nccl_only" in med else None,
        "hca_layer_alone": less_build("hca_layers", n_hca),
        "csa_layer_alone (main + indexer)": less_build("csa_layers", n_csa),
        "csa_bare_ops_on_tables": less_build("csa_ops_tables", n_csa),
        "csa_bare_ops_on_ring": less_build("csa_ops_ring", n_csa),
        "csa_bare_ops_on_ring_tables": less_build("csa_ops_ring_tables", n_csa),
        "one_kernel_graph": med.get("one_kernel"),
        "build_in_the_step_graph": med["layers"] - med["layers_no_build"]
        if "layers_no_build" in med and "layers" in med
        else None,
    }
    return {
        "clock": "CUDA events around graph replays" if ctx.cuda else "wall clock around eager calls (CPU)",
        "graphs": ctx.cuda,
        "step": {
            "requests": len(items),
            "hold_requests": eng.G - len(items),
            "rows": eng.G * eng.S,
            "requests_closing_an_hca_group": hca_closing,
            "c4_groups_closed": len(items),
        },
        "layers": n_layers,
        "layers_include_gemm": model.gemm,
        "graph_collectives": args.graph_collectives,
        "moe_all_reduce_bytes": eng.moe_decode.numel() * eng.moe_decode.element_size(),
        "build_us_per_step": med["build"],
        "build_parts_us": {part: med.get(f"build_{part}") for part in ("plans", "state_rows")},
        "per_layer_us": per_layer,
        "raw": raw,
        "errors": errors,
    }
