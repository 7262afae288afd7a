"""The model: every compressor of every layer, on LightLLM's buffers (:class:`Model`). Each compressor
(:class:`Comp`) has its params, pool, state and the history of the ``kv_score`` rows it read (the reference's
inputs); :meth:`Model.run_layers` runs a step's layers through the LightLLM adapter, with random ``kv_score`` rows
or LightLLM's bf16 GEMM of hidden states (``--kv-source``)."""

from __future__ import annotations

import dataclasses
import math
import types

import torch
from helpers import lightllm_sim as sim

from dsv4_compressor import ops
from dsv4_compressor.config import CompressorConfig, CompressorParams
from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout

from .options import KINDS_OF_RATE, Shapes


@dataclasses.dataclass
class Comp:
    """One compressor of one layer."""

    layer: int
    kind: str
    cfg: CompressorConfig
    params: CompressorParams  # ape [r, W] (checkpoint layout), bf16 norm weight, the shared strided rope tables
    layout: object  # the pool's PageLayout
    pages: torch.Tensor  # the layer's pool [pages, bytes]
    state: torch.Tensor  # the layer's state (C4 SWA-page ring, C128 ring or online banks)
    hist: torch.Tensor  # float32 [max_req, max_len, 2W]: the current kv_score row of every position

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.kind)


def layer_rates(csa: int, hca: int) -> list[int]:
    """LightLLM's ``compress_ratios`` labels: C4 and C128 layers alternating, C4 first (Flash: 21 + 20)."""
    rates = []
    while csa or hca:
        if csa and (not rates or rates[-1] == 128 or not hca):
            rates.append(4)
            csa -= 1
        else:
            rates.append(128)
            hca -= 1
    return rates


class Model:
    """The compressor layers. ``kv_source="random"``: each compressor's fp32 ``kv_score`` is given (as LightLLM's
    GEMM output would be); ``"gemm"``: a hidden state ``x`` goes through each layer's replicated bf16 GEMM
    (``sim.Linear``) and the adapter's LightLLM entry points (``compressor_compress``, ``write_indexer_k``)."""

    def __init__(self, args, shapes: Shapes, mm, device, *, max_len: int, max_req: int, tp_world_size: int):
        self.shapes, self.mm, self.device = shapes, mm, device
        self.rates = list(mm.compress_rates)
        self.gemm = args.kv_source == "gemm"
        self.hidden = args.hidden
        # LightLLM's compress rope table: fp32 strided .real / .imag views of one complex64 table, shared by layers
        base = CompressorParams.random(shapes.csa, max_positions=max_len, seed=args.seed, device=device)
        table = torch.complex(base.cos, base.sin)
        self.cos, self.sin = table.real, table.imag
        self.fp32_out = sim.mm_fp32_supported(device) if self.gemm else False
        wgen = torch.Generator(device=device).manual_seed(args.seed + 7)  # weights: the same on every rank
        network = {"compress_ratios": self.rates, "rms_norm_eps": 1e-6}
        self.comps: dict[tuple[int, str], Comp] = {}
        self.by_layer: list[list[Comp]] = []
        self.layer_objs, self.weights = [], []
        for layer, rate in enumerate(self.rates):
            comps, weight = [], types.SimpleNamespace()
            for k, kind in enumerate(KINDS_OF_RATE[rate]):
                cfg = shapes.cfg(kind)
                p = CompressorParams.random(cfg, max_positions=cfg.ratio, seed=args.seed + 1 + 10 * layer + k,
                                            norm_dtype=torch.bfloat16, device=device)  # fmt: skip
                params = CompressorParams(p.ape, p.norm_weight, self.cos, self.sin, p.eps)
                if kind == "indexer":
                    pages = mm.c4_indexer_pool.get_layer_buffer(mm.layer_to_c4_idx[layer])
                    layout = indexer_fp8_page_layout(cfg, sim.DSV4_INDEXER_PAGE_SIZE)
                    state = mm.get_c4_indexer_state_buffer(layer)
                    pool = mm.c4_indexer_pool
                elif kind == "c4":
                    pages, state, pool = mm.get_compressed_kv_buffer(layer), mm.get_c4_state_buffer(layer), mm.c4_pool
                    layout = latent_page_layout(cfg, sim.DSV4_C4_PAGE_SIZE)
                else:
                    pages, pool = mm.get_compressed_kv_buffer(layer), mm.c128_pool
                    layout = latent_page_layout(cfg, sim.DSV4_C128_PAGE_SIZE)
                    state = adapter.c128_state_banks(mm, layer) if mm.online_hca else mm.get_c128_state_buffer(layer)
                assert layout.bytes_per_page == pool.bytes_per_page, (kind, layout, pool.bytes_per_page)
                hist = torch.zeros(max_req, max_len, cfg.row_width, dtype=torch.float32, device=device)
                comp = Comp(layer, kind, cfg, params, layout, pages, state, hist)
                comps.append(comp)
                self.comps[comp.key] = comp
                prefix = "idx_cmp_" if kind == "indexer" else "compressor_"
                setattr(weight, prefix + "norm_", types.SimpleNamespace(weight=p.norm_weight))
                setattr(weight, prefix + "ape_", types.SimpleNamespace(weight=p.ape))
                if self.gemm:  # x ~ N(0, 1), W ~ N(0, 1.5^2 / D): kv_score ~ N(0, 1.5^2)
                    w = torch.empty(cfg.row_width, self.hidden, dtype=torch.bfloat16, device=device)
                    w.normal_(0.0, 1.5 / math.sqrt(self.hidden), generator=wgen)  # the checkpoint's [2W, D]
                    setattr(weight, prefix + "wkv_gate_", sim.Linear.from_checkpoint(w, self.fp32_out))
            self.by_layer.append(comps)
            self.weights.append(weight)
            self.layer_objs.append((sim.CompressorInfer(layer, network, tp_world_size),
                                    sim.DeepseekV4IndexInfer(layer, network, tp_world_size)))  # fmt: skip
        self.total_width = sum(c.cfg.row_width for c in self.comps.values())
        # as the installed adapter does before LightLLM loads its weights: one GEMM for a C4 layer's two
        self.joined = 0
        if self.gemm and args.projection == "auto" and not args.no_join:
            self.joined = adapter.join_c4_weights(self.weights)
        # the projections the adapter runs itself, recorded so the check recomputes their exact float32 rows
        self.recorded: list[tuple] = []
        if self.gemm:
            _record_projections(self.recorded)

    # -- inputs ------------------------------------------------------------------------------------------------
    def new_inputs(self, rows: int, gen: torch.Generator):
        """A step's inputs: every compressor's ``kv_score`` (random; padding rows are finite garbage too), or the
        hidden states of the step's rows (gemm)."""
        if self.gemm:
            return torch.empty(rows, self.hidden, dtype=torch.bfloat16, device=self.device).normal_(generator=gen)
        flat = torch.empty(rows * self.total_width, dtype=torch.float32, device=self.device)
        flat.normal_(0.0, 1.5, generator=gen)
        return self._views(flat, rows)

    def _views(self, flat: torch.Tensor, rows: int) -> dict:
        out, offset = {"flat": flat}, 0
        for key, c in self.comps.items():
            n = rows * c.cfg.row_width
            out[key] = flat[offset : offset + n].view(rows, c.cfg.row_width)  # contiguous [T, 2W], as LightLLM's GEMM
            offset += n
        return out

    def refill(self, inputs, gen: torch.Generator) -> None:
        """New values in a captured graph's static inputs (same addresses)."""
        if self.gemm:
            inputs.normal_(generator=gen)
        else:
            inputs["flat"].normal_(0.0, 1.5, generator=gen)

    # -- the layers --------------------------------------------------------------------------------------------
    def run_layers(self, state, inputs, *, kinds=None, collective=None) -> dict:
        """Every layer's compressors (``kinds``: a subset), each layer followed by ``collective()`` (the MoE
        stand-in). Returns the ``kv_score`` each compressor read, by ``(layer, kind)``: LightLLM's GEMM output, or,
        where the adapter projected ``x`` itself (``--projection auto``), a function computing ``x @ W.T`` in float32
        (called after the step). Launches only: no host synchronisation, so it can be captured in a CUDA graph."""
        used = {}
        for layer, comps in enumerate(self.by_layer):
            comps = [c for c in comps if kinds is None or c.kind in kinds]
            if comps and self.gemm:
                compressor, index_infer = self.layer_objs[layer]
                weight = self.weights[layer]
                pair = None  # a C4 layer's projection of both weights, from its first compressor's call
                for c in comps:
                    linear = weight.idx_cmp_wkv_gate_ if c.kind == "indexer" else weight.compressor_wkv_gate_
                    linear.last = None
                    self.recorded.clear()
                    if c.kind == "indexer":  # DeepseekV4IndexInfer.write_indexer_k, patched by install()
                        adapter.write_indexer_k(index_infer, inputs, state, weight, self.cos, self.sin)
                    else:  # CompressorInfer.compress, patched by install()
                        adapter.compressor_compress(compressor, inputs, state, weight, self.cos, self.sin)
                    if linear.last is not None:
                        used[c.key] = linear.last
                        continue
                    # our projection: its rows are recomputed after the step by the same op on the same path
                    # (deterministic: the same bits), since the workspace holding them is reused by the next layer
                    rec = self.recorded[0] if self.recorded else pair
                    if rec is None:
                        raise RuntimeError(f"layer {layer} {c.kind}: no projection recorded and no GEMM ran")
                    if rec[2] is not None:  # both weights: this compressor's columns
                        pair = rec
                        first = rec[1].shape[0]
                        cols = slice(0, first) if c.kind == "c4" else slice(first, first + rec[2].shape[0])
                    else:
                        cols = slice(None)
                    used[c.key] = lambda rec=rec, cols=cols: _projected(*rec)[:, cols]
            else:
                for c in comps:
                    kv = inputs[c.key]
                    adapter.compress_layer(c.kind, kv, state, c.layer, ape=c.params.ape,
                                           norm_weight=c.params.norm_weight, cos=self.cos, sin=self.sin,
                                           eps=c.params.eps)  # fmt: skip
                    used[c.key] = kv
            if collective is not None:
                collective()
        return used


def _record_projections(recorded: list) -> None:
    """Wrap the ops the adapter projects with (``ops.project``, ``ops.compress_from_hidden``,
    ``ops.compress_online_hca_from_hidden``) so each call appends ``(x, weight, weight2, rows, projection)`` to
    ``recorded`` (once per process: the wrappers append to the list given first)."""
    if getattr(ops, "_harness_recording", None) is not None:
        return
    ops._harness_recording = recorded
    for name in ("project", "compress_from_hidden", "compress_online_hca_from_hidden"):
        original = getattr(ops, name)

        def call(*args, _original=original, **kwargs):
            x, w = args[0], args[1]
            rows = kwargs.get("rows", x.shape[0])
            ops._harness_recording.append((x, w, kwargs.get("weight2"), rows, kwargs.get("projection", "auto")))
            return _original(*args, **kwargs)

        setattr(ops, name, call)


def _projected(x, weight, weight2, rows: int, projection: str) -> torch.Tensor:
    """``ops.project`` of a recorded call into a fresh workspace: the float32 ``[rows, N1 + N2]`` it wrote."""
    width = weight.shape[0] + (0 if weight2 is None else weight2.shape[0])
    ws = torch.zeros(ops.projection_workspace_numel(rows, width, x.shape[1]), device=x.device)
    ops.project(x, weight, ws, rows=rows, weight2=weight2, projection=projection)
    return ws[: rows * width].view(rows, width)
