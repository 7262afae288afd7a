"""The whole-step phases and those that start from hidden states: ``projection`` (one projection), ``layer`` (a
whole CSA or HCA layer: its projections and compressions), ``model`` (every compressor layer of a model and both
plans from given ``kv_score`` rows) and ``model-hidden`` (the same from hidden states), each captured in one CUDA
graph and timed warm and cold (the L2 flushed by a read of twice its size before each replay).

:class:`HiddenRuns` holds them as methods of :class:`~.runner.Runner`, which it is mixed into: they read the
runner's device, generator, timer and settings.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from dsv4_compressor import ops

from .cases import (
    BESIDE_GEMM_WIDTH,
    HIDDEN,
    Case,
    case_traffic,
    decode_starts,
    layer_kinds,
    model_footprint,
    model_launches,
    model_layers,
    pairs_projections,
    projection_bytes,
    projection_width,
)
from .floors import derive_metrics, kind_config
from .layers import HiddenLayerOp, PairedHiddenLayerOp, owned_bytes, reserve_pages, step_meta
from .timing import summarize

__all__ = ["HiddenRuns", "round_up"]


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return -(-x // m) * m


class HiddenRuns:
    """The hidden-state phases of :class:`~.runner.Runner` (a mixin: ``self`` is the runner)."""

    def _weight(self, width: int, dim: int) -> torch.Tensor:
        """A bf16 ``[2W, D]`` weight of unit-variance outputs for unit-variance inputs."""
        return (torch.randn(width, dim, device=self.device, generator=self._gen) / dim**0.5).to(torch.bfloat16)

    def _layer_weights(self, widths: list[int], dim: int, *, joint: bool) -> list[torch.Tensor]:
        """A layer's weights, one per compressor; ``joint``: the halves of one tensor (``ops.join_pair_weights``'
        layout), else each its own allocation."""
        if not joint:
            return [self._weight(w, dim) for w in widths]
        whole = self._weight(sum(widths), dim)
        offsets = np.cumsum([0, *widths])
        return [whole[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def _hidden_rows(self, rows: int, dim: int) -> torch.Tensor:
        return torch.randn(rows, dim, device=self.device, generator=self._gen).to(torch.bfloat16)

    def _flush(self):
        """A read of twice the L2 (the cold figures' ``before``), and the buffer it reads."""
        flush = torch.empty(max(1, 2 * self.l2_bytes // 4), dtype=torch.float32, device=self.device)
        return flush, flush.sum

    def _time_warm_cold(self, call, per: int) -> dict:
        """Compile, capture ``call`` in one graph, time it warm (back to back) and cold (L2 flushed before each
        replay, outside the timed events); per ``per`` instances."""
        call()
        self.timer.sync()
        graph = self.timer.capture(call)
        flush, before = self._flush()
        warm = self.timer.time([graph], replays=self.warm_replays, warmup=self.warmup, queue_ahead=True)
        cold = self.timer.time([graph], replays=self.replays, warmup=self.warmup, queue_ahead=True, before=before)
        out = {"warm": summarize(warm, per=per), "graph": summarize(cold, per=per), "eager": None}
        del graph, flush
        return out

    def _run_projection(self, case: Case) -> dict:
        from dsv4_compressor.kernels import projection as proj

        width, dim, rows = projection_width(case.kind), HIDDEN[case.model], case.chunk
        n = case.instances
        pair = case.kind == "pair"
        first = kind_config("csa").row_width if pair else width
        weights = [self._weight(width, dim) for _ in range(n)]
        xs = [self._hidden_rows(rows, dim) for _ in range(n)]
        launch_cfg = None
        if case.backend == "triton" and pair:
            launch_cfg = proj.pair_config(rows, first, width - first, dim)
        elif case.backend == "triton":
            launch_cfg = proj.projection_config(rows, width, dim)
        if case.backend == "torch":  # a pair: one GEMM of the concatenated weight
            outs = [torch.empty(rows, width, device=self.device) for _ in range(n)]

            def call() -> None:
                for x, w, out in zip(xs, weights, outs):
                    _mm_float32(x, w, out)
        else:
            workspace = ops.projection_workspace(rows, width, dim, self.device)
            pdl = ops.pdl_enabled(self.device)

            # a pair: the two weights as separate tensors (views of one allocation would let cuBLAS's path in)
            halves = [(w[:first].clone(), w[first:].clone()) if pair else (w, None) for w in weights]
            if pair:
                del weights

            def call() -> None:
                for x, (w, w2) in zip(xs, halves):
                    proj.launch_projection(x, w, workspace, rows=rows, cfg=launch_cfg, pdl=pdl, weight2=w2)

        timed = self._time_warm_cold(call, n)
        traffic = projection_bytes(width, dim, rows)
        figures = self._figures(timed, traffic)
        return {
            "instances": n,
            "width": width,
            "dim": dim,
            "config": list(launch_cfg) if launch_cfg else None,
            "traffic": traffic,
            **timed,
            **figures,
            "note": "warm: one graph of distinct weights replayed back to back; cold (the headline): the L2 "
            "flushed before each replay",
        }

    def _run_layer(self, case: Case) -> dict:
        b, s = case.batch, case.rows
        dim, rows, n = HIDDEN[case.model], case.batch * case.rows, case.instances
        starts = np.asarray(decode_starts(case, seed=self.seed))
        ends, slots = starts + s, np.arange(b)
        kinds = layer_kinds(case.kind)
        max_seq_len = round_up(int(ends.max()) + 1, kind_config("hca").ratio)
        paired = kinds == ("csa", "indexer") and pairs_projections(case.backend, rows, dim)
        widths = {kind: kind_config(kind).row_width for kind in kinds}
        if paired:
            workspaces = {"pair": ops.projection_workspace(rows, sum(widths.values()), dim, self.device)}
        else:
            workspaces = {kind: ops.projection_workspace(rows, widths[kind], dim, self.device) for kind in kinds}
        layers = {kind: [] for kind in kinds}
        calls, pools = [], []
        for _ in range(n):
            ops_ = []
            for kind in kinds:
                backend = "online" if kind == "hca" else "triton-single"
                op = self._layer(kind, backend, ends=ends, workspace=None, rows=rows, max_requests=b,
                                 max_seq_len=max_seq_len, mtp_step=case.mtp_step)  # fmt: skip
                ops_.append(op)
                pools.append(op.cache.pool)
                layers[kind].append(op)
            weights = self._layer_weights([widths[k] for k in kinds], dim, joint=case.backend == "joint")
            if paired:
                calls.append([PairedHiddenLayerOp(ops_[0], ops_[1], tuple(weights), workspaces["pair"])])
            else:
                calls.append(
                    [HiddenLayerOp(op, w, workspaces[k], case.backend) for op, w, k in zip(ops_, weights, kinds)]
                )
        reserve_pages(pools, slots, ends)
        cfg0 = kind_config(kinds[0])
        meta = step_meta(slots, starts, [s] * b, ratio=cfg0.ratio, num_slots=b, mtp_step=case.mtp_step,
                         device=self.device, pool=layers[kinds[0]][0].cache.pool)  # fmt: skip
        xs = [self._hidden_rows(rows, dim) for _ in range(n)]

        def call() -> None:
            for x, layer_calls in zip(xs, calls):
                for op in layer_calls:
                    op(x, meta)

        beside = None
        if case.beside == "gemm":
            call, beside = self._beside_gemm(xs, calls, meta, BESIDE_GEMM_WIDTH[case.model], dim)
        timed = self._time_warm_cold(call, n)
        compression = case_traffic(case, seed=self.seed)
        proj_bytes = [projection_bytes(kind_config(k).row_width, dim, rows) for k in kinds]
        # the layer's floor: the weights and x read once per projection, and the compression's own bytes (which
        # count reading kv_score once; a fused layer would not write it)
        read = compression.read + sum(p["read"] for p in proj_bytes)
        traffic = {"read": read, "written": compression.written, "total": read + compression.written}
        if paired:  # one projection, then ops.compress_pair
            launches = 1 + ops.launches("compress_pair", rows=rows, requests=b, decode=True)
        else:
            launches = sum(
                ops.launches(name, rows=rows, requests=b, ratio=kind_config(k).ratio, kind=kind_config(k).op_kind,
                             decode=True)
                for k in kinds
                for name in ("compress_online_hca_from_hidden" if k == "hca" else "compress_from_hidden",)
            )  # fmt: skip
        figures = self._figures(timed, traffic, launches=launches)
        return {
            "instances": n,
            "dim": dim,
            "compressors": list(kinds),
            "paired_projection": paired,
            "launches_per_layer": launches,
            "traffic": traffic,
            **timed,
            **figures,
            "us_per_layer": figures["us"],
            **({"beside": beside} if beside else {}),
            "note": "warm: one graph of distinct layers (weights, states, pages, hidden states) replayed back to "
            "back; cold (the headline): the L2 flushed before each replay",
        }

    def _beside_gemm(self, xs, calls, meta, width: int, dim: int):
        """A ``layer`` case's call with each instance beside the engine's attention GEMM (``x @ W.T``, bf16
        ``[width, D]``, bf16 out, a distinct weight per instance): per instance the side stream waits for the
        main one, runs the GEMM while the main stream runs the layer, and the main stream waits for it (what a
        graph of vLLM's or SGLang's multi-stream step records). Returns the call and the GEMMs' own figures
        (timed alone the same way); without CUDA the two run one after the other."""
        import contextlib

        weights = [self._weight(width, dim) for _ in xs]
        outs = [torch.empty(x.shape[0], width, dtype=torch.bfloat16, device=self.device) for x in xs]
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None

        def gemms_alone() -> None:
            for x, w, out in zip(xs, weights, outs):
                torch.mm(x, w.t(), out=out)

        def call() -> None:
            main = torch.cuda.current_stream(self.device) if cuda else None
            for x, w, out, layer_calls in zip(xs, weights, outs, calls):
                if cuda:
                    side.wait_stream(main)
                with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                    torch.mm(x, w.t(), out=out)
                for op in layer_calls:
                    op(x, meta)
                if cuda:
                    main.wait_stream(side)

        timed = self._time_warm_cold(gemms_alone, len(xs))
        return call, {"gemm": "x @ W.T, bf16", "width": width, "dim": dim, "warm": timed["warm"],
                      "graph": timed["graph"]}  # fmt: skip

    # -- the whole model -------------------------------------------------------------------------
    def _run_model(self, case: Case) -> dict:
        b, s, mtp = case.batch, case.rows, case.mtp_step
        rows = b * s
        counts = model_layers(case.model)
        starts = np.asarray(decode_starts(case, seed=self.seed))
        ends, slots = starts + s, np.arange(b)
        max_seq_len = round_up(int(ends.max()) + 1, kind_config("hca").ratio)
        for kind in counts:
            self.params(kind)
        flush = torch.empty(max(1, 2 * self.l2_bytes // 4), dtype=torch.float32, device=self.device)
        cuda = self.device.type == "cuda"
        if cuda:  # the peak below counts what the step's layers, inputs, plans and graph allocate
            self.timer.sync()
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        hidden = case.phase == "model-hidden"
        hca_backend = "online" if hidden else case.backend
        workspace = self._workspace("hca", hca_backend, rows=rows, max_requests=b, mtp_step=mtp)
        layers = {}
        for kind, count in counts.items():
            backend = hca_backend if kind == "hca" else "triton-single"
            layers[kind] = [
                self._layer(kind, backend, ends=ends, workspace=workspace, rows=rows, max_requests=b,
                            max_seq_len=max_seq_len, mtp_step=mtp)
                for _ in range(count)
            ]  # fmt: skip
        self.log(f"    {sum(counts.values())} layers ({', '.join(f'{n} {k}' for k, n in counts.items())}), B={b}")
        reserve_pages([layer.cache.pool for layer in layers["csa"] + layers["indexer"]], slots, ends)
        reserve_pages([layer.cache.pool for layer in layers["hca"]], slots, ends)
        # one step: positions and row_req shared, an out_slot per ratio; a plan per ratio
        meta = {
            kind: step_meta(slots, starts, [s] * b, ratio=kind_config(kind).ratio, num_slots=b, mtp_step=mtp,
                            device=self.device, pool=layers[kind][0].cache.pool)
            for kind in ("csa", "hca")
        }  # fmt: skip
        meta["csa"].positions, meta["csa"].row_req = meta["hca"].positions, meta["hca"].row_req
        order = _layer_order(counts["csa"], counts["hca"])
        calls = []
        dim = HIDDEN[case.model] if hidden else 0
        spaces = {}
        paired = hidden and pairs_projections(case.backend, rows, dim)
        if hidden:  # one projection workspace per width, shared by the layers (they run one after another)
            spaces = {k: ops.projection_workspace(rows, kind_config(k).row_width, dim, self.device) for k in counts}
            if paired:
                del spaces["csa"], spaces["indexer"]
                spaces["pair"] = ops.projection_workspace(rows, projection_width("pair"), dim, self.device)
        for kind, i in order:
            names = ("csa", "indexer") if kind == "csa" else ("hca",)
            x = self._hidden_rows(rows, dim) if hidden else None  # a layer's hidden states feed both compressors
            if paired and kind == "csa":
                widths = [layers[name][i].cache.config.row_width for name in names]
                weights = tuple(self._layer_weights(widths, dim, joint=case.backend == "joint"))
                pair = PairedHiddenLayerOp(layers["csa"][i], layers["indexer"][i], weights, spaces["pair"])
                calls.append((pair, x, meta["csa"]))
                continue
            for name in names:
                layer = layers[name][i]
                kv = self._rows(rows, layer.cache.config.row_width) if not hidden else x
                if hidden:
                    weight = self._weight(layer.cache.config.row_width, dim)
                    layer = HiddenLayerOp(layer, weight, spaces[name], case.backend)
                calls.append((layer, kv, meta["hca" if name == "hca" else "csa"]))

        def step() -> None:
            meta["csa"].build_plan()
            meta["hca"].build_plan()
            for layer, kv, m in calls:
                layer(kv, m)

        step()  # compiles
        self.timer.sync()
        for m in meta.values():
            m.check()
        graph = self.timer.capture(step)
        peak = torch.cuda.max_memory_allocated(self.device) - base if cuda else None
        warm = summarize(self.timer.time([graph], replays=self.replays, warmup=self.warmup, queue_ahead=True))
        cold = summarize(
            self.timer.time([graph], replays=self.replays, warmup=self.warmup, queue_ahead=True, before=flush.sum)
        )
        del flush
        traffic = case_traffic(case, seed=self.seed).as_dict()
        if hidden:  # every projection's weight and x read, its kv_score written
            for name, count in counts.items():
                p = projection_bytes(kind_config(name).row_width, dim, rows)
                traffic["read"] += count * p["read"]
                traffic["total"] += count * p["read"]
        launches = model_launches(case)
        owned = self._model_bytes(layers, workspace, meta, [kv for _, kv, _ in calls])
        if hidden:
            owned["weights"] = owned_bytes(
                w
                for layer, _, _ in calls
                for w in (layer.weights if isinstance(layer, PairedHiddenLayerOp) else [layer.weight])
            )
            owned["projection_workspaces"] = owned_bytes(spaces.values())
            owned["total"] += owned["weights"] + owned["projection_workspaces"]
        out = {
            "layers": counts,
            "launches_per_step": launches,
            "traffic": traffic,
            "warm": warm,
            "graph": cold,
            "memory": owned,
            "memory_estimate": model_footprint(replace(case, phase="model", backend=hca_backend), seed=self.seed),
            "timing": "graph",
            "note": "cold: the L2 flushed (a read of twice its size) before each replay; rotating copies of every "
            "layer's state instead would multiply the step's memory",
        }
        if peak is not None:
            out["cuda_peak_bytes"] = int(peak)
        out.update(derive_metrics(traffic, cold["median_us"], self.floors, launches=launches))
        out["us"] = cold["median_us"]
        return out

    @staticmethod
    def _model_bytes(layers: dict, workspace, meta: dict, kvs: list) -> dict:
        caches = [layer.cache for group in layers.values() for layer in group]
        parts = {
            "state": owned_bytes(t for c in caches for t in c.backend.state_tensors().values()),
            "pools": owned_bytes(t for c in caches for t in c.pool.tensors().values()),
            "kv_score": owned_bytes(kvs),
            "scratch": workspace.nbytes if workspace is not None else 0,
            "plans": owned_bytes(m.plan for m in meta.values()),
            "metadata": owned_bytes(
                [meta["hca"].positions, meta["hca"].row_req, meta["hca"].out_slot, meta["csa"].out_slot]
            ),
        }
        parts["total"] = sum(parts.values())
        return parts


def _mm_float32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ w.T`` in float32 from bf16: ``torch.mm(..., out_dtype=float32)`` (cuBLAS, the engines' GEMM),
    or on the CPU (no such kernel there; the bench's CPU tests) through float32 copies."""
    if x.device.type == "cpu":
        torch.mm(x.float(), w.float().t(), out=out)
    else:
        torch.mm(x, w.t(), out_dtype=torch.float32, out=out)


def _layer_order(csa: int, hca: int) -> list[tuple[str, int]]:
    """The model's compressor layers, CSA and HCA alternating while both last (what each op reads does not
    depend on the order; the checkpoint's exact order only moves which layer follows which)."""
    order = []
    for i in range(max(csa, hca)):
        if i < csa:
            order.append(("csa", i))
        if i < hca:
            order.append(("hca", i))
    return order
