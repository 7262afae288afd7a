"""One rank's engine (:class:`Engine`): LightLLM's memory and request managers and slot allocator, the adapter's
step builder, the model, the eager prefill and graph-replayed decode forwards, and what the checks and the timing
read (the mutable buffers, the HOLD rows, the pool bytes outside every written slot)."""

from __future__ import annotations

import traceback

import numpy as np
import torch
import torch.distributed as dist
from helpers import lightllm_sim as sim

from dsv4_compressor.integrations import lightllm as adapter
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout

from .model import Model, layer_rates
from .options import Shapes
from .runtime import Dist, Replay


class Engine:
    def __init__(self, args, shapes: Shapes, ctx: Dist, *, max_len: int, seed: int):
        self.args, self.shapes, self.ctx = args, shapes, ctx
        dev = self.device = ctx.device
        self.mtp = args.mtp_step
        self.S = self.mtp + 1
        self.G = args.requests  # max_request_num = HOLD_REQUEST_ID = the decode graph's batch
        self.max_len = max_len
        rates = layer_rates(args.csa_layers, args.hca_layers)
        self.size = self.G * max_len + 64  # full token slots; HOLD_TOKEN_MEMINDEX = size
        swa_pages = self.G * (max_len // shapes.swa_page + 2) + 2
        self.mm = sim.DeepseekV4MemoryManager(
            self.size, rates, self.G, self.mtp, swa_pages=swa_pages, latent=shapes.csa, indexer=shapes.idx,
            swa_page_size=shapes.swa_page, c128_ratio=shapes.hca.ratio, online_hca=args.hca == "online", device=dev,
        )  # fmt: skip
        self.layout = adapter.LightLLMLayout.from_mem_manager(
            self.mm, swa_page_size=shapes.swa_page, c128_ratio=shapes.hca.ratio
        )
        if self.mm.n_c128 and args.hca == "online":
            sim.poison_f32(adapter.allot_online_hca_banks(self.mm, self.layout))
        self.reqm = sim.DeepseekV4ReqManager(self.G, max_len, self.size, device=dev)
        self.alloc = sim.SlotAllocator(self.mm, self.reqm, rng=np.random.default_rng(seed + 11),
                                       swa_window=shapes.swa_window, mtp_step=self.mtp)  # fmt: skip
        # LightLLM's tp_world_size_ is the DP group's size: 1 with DP attention, every rank for TP replicas
        tp_world_size = ctx.world if args.mode == "tp" else 1
        self.model = Model(args, shapes, self.mm, dev, max_len=max_len, max_req=self.G, tp_world_size=tp_world_size)
        self.gen = torch.Generator(device=dev).manual_seed(seed + 13)
        self.max_rows = -(-max(args.chunk, self.G * self.S, self.S) // 64) * 64
        opts = dict(max_rows=self.max_rows, device=dev, microbatches=1, online_hca=args.hca == "online",
                    projection=args.projection if args.kv_source == "gemm" else "engine",
                    hidden_size=args.hidden if args.kv_source == "gemm" else None)  # fmt: skip
        self.builder = adapter.StepBuilder(self.layout, check=not args.no_check_plan, **opts)
        self.timing_builder = adapter.StepBuilder(self.layout, check=False, **opts)  # production: no check_plan
        moe_dtype = torch.bfloat16 if ctx.cuda else torch.float32  # gloo: float32
        self.moe_prefill = torch.zeros(self.max_rows, args.hidden, dtype=moe_dtype, device=dev)
        self.moe_decode = torch.zeros(self.G * self.S, args.hidden, dtype=moe_dtype, device=dev)
        self.hold_before = self._hold_rows()
        self.plan_errors: list[str] = []
        self.stats = dict(prefill_forwards=0, decode_forwards=0, idle_prefill_forwards=0, idle_decode_forwards=0,
                          prefill_rows=0, decode_rows=0, hold_rows=0, graph_replays=0)  # fmt: skip
        self.static_state = self.static_inputs = self.decode_graph = None

    # -- a step's infer_state -----------------------------------------------------------------------------------
    def make_state(self, items, *, decode: bool, pad_requests: int):
        """Allocate the step's slots as LightLLM does, upload the tables and build its ``infer_state``. Rows:
        the items' rows first (``(req, start, n)``), then ``pad_requests`` HOLD requests of S rows. Returns the
        state, the number of the items' rows and their flat indices into each compressor's ``hist``."""
        state, mem = sim.make_infer_state(self.alloc, items, decode=decode, pad_requests=pad_requests)
        state.init_some_extra_state(None)  # not installed: the engine runs the builder itself
        flat = [req * self.max_len + p for req, start, n in items for p in range(start, start + n)]
        real = len(flat)
        self.stats["hold_rows"] += len(mem) - real
        return state, real, torch.tensor(flat, dtype=torch.int64, device=self.device)

    def _after_step(self, used: dict, real: int, flat: torch.Tensor, what: str) -> None:
        """Record the rows each compressor read (the reference's inputs), read ``check_plan``'s findings, let SWA
        pages leave the window."""
        for key, kv in used.items():
            c = self.model.comps[key]
            kv = kv() if callable(kv) else kv
            c.hist.view(-1, c.cfg.row_width).index_copy_(0, flat, kv[:real])
        if not self.args.no_check_plan:
            for msg in self.builder.plan_errors():
                self.plan_errors.append(f"{what}: {msg}")
        self.alloc.evict()

    def all_reduce_prefill(self, rows: int):
        return lambda: dist.all_reduce(self.moe_prefill[:rows])

    def all_reduce_decode(self):
        dist.all_reduce(self.moe_decode)

    # -- forwards ----------------------------------------------------------------------------------------------
    def forward_prefill(self, items, moe_rows: int) -> None:
        """A chunked-prefill forward, eager (LightLLM runs the compressors of prefill outside graphs); an idle
        rank runs one HOLD request."""
        state, real, flat = self.make_state(items, decode=False, pad_requests=0 if items else 1)
        self.builder.build(state)
        inputs = self.model.new_inputs(state.position_ids.shape[0], self.gen)
        used = self.model.run_layers(state, inputs, collective=self.all_reduce_prefill(moe_rows))
        self._after_step(used, real, flat, f"prefill {self.stats['prefill_forwards']}")
        self.stats["prefill_forwards"] += 1
        self.stats["idle_prefill_forwards"] += not items
        self.stats["prefill_rows"] += real

    def capture_decode(self) -> None:
        """The decode graph: the per-step build, every layer and (``--graph-collectives on``) a per-layer
        all_reduce, captured on a step of G HOLD requests (which writes nothing)."""
        self.static_state, _, _ = self.make_state([], decode=True, pad_requests=self.G)
        self.static_inputs = self.model.new_inputs(self.G * self.S, self.gen)
        collective = self.all_reduce_decode if self.args.graph_collectives == "on" else None

        def decode_step():
            self.builder.build(self.static_state)
            return self.model.run_layers(self.static_state, self.static_inputs, collective=collective)

        self.capture_error = None
        try:
            self.decode_graph = Replay(decode_step, self.device, self.args.capture_error_mode)
        except Exception as err:  # noqa: BLE001 - reported; the run goes on without collectives in the graph
            self.capture_error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        if self.ctx.all_max([int(self.capture_error is not None)])[0]:  # every rank drops them, or none does
            self.capture_error = self.capture_error or "the capture failed on another rank"
            self.args.graph_collectives = "off"
            collective = None
            self.decode_graph = Replay(decode_step, self.device, self.args.capture_error_mode)
        self.production_attrs = {k: v for k, v in vars(self.static_state).items() if k.startswith("dsv4c_")}

    def forward_decode(self, items) -> None:
        """An MTP decode forward: LightLLM's new ``infer_state`` is copied into the captured one, then the graph
        replays. An idle rank replays it with HOLD requests only."""
        state, real, flat = self.make_state(items, decode=True, pad_requests=self.G - len(items))
        sim.copy_for_cuda_graph(self.static_state, state)
        self.model.refill(self.static_inputs, self.gen)
        used = self.decode_graph.replay()
        if self.args.graph_collectives == "off":
            for _ in self.model.by_layer:
                self.all_reduce_decode()
        self._after_step(used, real, flat, f"decode {self.stats['decode_forwards']}")
        self.stats["decode_forwards"] += 1
        self.stats["graph_replays"] += self.decode_graph.graph is not None
        self.stats["idle_decode_forwards"] += not items
        self.stats["decode_rows"] += real

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.alloc.share_prefix(src, dst, length)
        for c in self.model.comps.values():
            c.hist[dst, :length] = c.hist[src, :length]

    # -- what the checks and the timing need -------------------------------------------------------------------
    def mutable_tensors(self) -> list[torch.Tensor]:
        mm = self.mm
        out = [mm.c4_state_buffer, mm.c4_indexer_state_buffer, mm.c128_state_buffer, mm.c4_pool.buffer,
               mm.c4_indexer_pool.buffer, mm.c128_pool.buffer]  # fmt: skip
        banks = getattr(mm, "dsv4c_c128_state_banks", None)
        return out + ([banks] if banks is not None else [])

    def _hold_rows(self) -> dict[str, torch.Tensor]:
        """State rows no step may write: the HOLD SWA page of the C4 state and its sentinel row, the HOLD
        request's C128 ring rows and the sentinel row (or the HOLD slot's online banks)."""
        mm, out = self.mm, {}
        first4 = mm.swa_num_pages * mm.c4_state_ring
        out["c4_state[HOLD page, sentinel]"] = mm.c4_state_buffer[:, first4:]
        out["c4_indexer_state[HOLD page, sentinel]"] = mm.c4_indexer_state_buffer[:, first4:]
        ring = 0 if mm.online_hca else mm.c128_state_ring
        out["c128_state[HOLD slot, sentinel]"] = mm.c128_state_buffer[:, self.G * ring :]
        banks = getattr(mm, "dsv4c_c128_state_banks", None)
        if banks is not None:
            out["c128_banks[HOLD slot]"] = banks[:, self.G]
        return {name: t.clone() for name, t in out.items()}

    def check_untouched(self) -> dict:
        """Pool bytes outside every slot the run wrote still hold their poison (that covers the HOLD slots); the
        HOLD state rows are as initialized."""
        mm, alloc = self.mm, self.alloc
        pools = {"c4": (mm.c4_pool, self.model.shapes.csa, alloc.written_c4, latent_page_layout, 64),
                 "indexer": (mm.c4_indexer_pool, self.model.shapes.idx, alloc.written_c4, indexer_fp8_page_layout, 64),
                 "c128": (mm.c128_pool, self.model.shapes.hca, alloc.written_c128, latent_page_layout, 2)}  # fmt: skip
        stray = {}
        for name, (pool, cfg, written, make_layout, page) in pools.items():
            if pool.buffer.shape[0] == 0:
                continue
            layout = make_layout(cfg, page)
            flat = pool.buffer.view(pool.buffer.shape[0], -1)
            keep = torch.zeros(flat.shape[1], dtype=torch.bool, device=flat.device)
            if written:
                slots = torch.tensor(sorted(written), dtype=torch.int64, device=flat.device)
                keep[layout._byte_index(slots).reshape(-1)] = True
            stray[name] = int(((flat != sim.POISON_BYTE) & ~keep).sum())
        changed = [name for name, t in self._hold_rows().items()
                   if not torch.equal(t.view(torch.int32), self.hold_before[name].view(torch.int32))]  # fmt: skip
        return {"stray_pool_bytes": stray, "hold_rows_changed": changed,
                "written_slots": {"c4": len(alloc.written_c4), "c128": len(alloc.written_c128)}}  # fmt: skip
