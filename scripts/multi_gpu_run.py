"""An engine-shaped multi-GPU run of the LightLLM adapter: DeepSeek-V4 compressors on LightLLM's buffers, one
process per rank, between NCCL collectives and inside CUDA graphs (docs/INTEGRATION.md, "Distributed
engines")::

    torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode dp --hca ring      # or --hca online
    torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode tp --dispatch torch-ops
    # CPU smoke test (Triton interpreter, gloo, scaled-down shapes):
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 scripts/multi_gpu_run.py --mode dp --backend gloo --device cpu \\
        --small --requests 3 --max-prompt 48 --decode-steps 3 --chunk 48 --csa-layers 1 --hca-layers 1 --hidden 64

``scripts/multi_gpu_check.sh`` runs the GPU runs; ``tests/test_multi_gpu_cpu.py`` the CPU smoke test.

Each rank is a LightLLM instance of DeepSeek-V4-Flash's compressor layers. By default there are 21 CSA layers, each
with a C4 main compressor and an indexer compressor, and 20 HCA (C128) layers: 62 compressors at full size
(H = 512 / 128, ratio 4 / 128). The LightLLM stand-ins are in ``tests/helpers/lightllm_sim``. The LightLLM adapter
(``dsv4_compressor.integrations.lightllm``) runs on them: ``StepBuilder.build`` once per step, then one op per
compressor and layer (``compress_layer``, or ``compressor_compress`` / ``write_indexer_k`` after LightLLM's bf16
GEMM). The adapter calls the ops as Python functions, or with ``--dispatch torch-ops`` through
``torch.ops.dsv4c``.

``--mode dp`` is data-parallel attention, the production shape:

- every rank has its own requests and scheduler;
- chunked prefill runs eagerly, mixed with MTP decode. A decode step has S = mtp_step + 1 rows per request, and a
  random number of drafts is accepted, so most steps rewind;
- 256-aligned radix prefix reuse is taken where the source's SWA page is still held;
- the ranks stay in lockstep. Every iteration all-reduces the ranks' work; a rank with nothing to prefill or
  decode runs a HOLD dummy request;
- an NCCL all_reduce per layer stands in for the EP MoE;
- decode steps replay a CUDA graph. The graph holds the per-step build (plan and state rows), every compressor
  layer and the collectives; LightLLM's ``copy_for_cuda_graph`` refreshes its inputs.

``--mode tp`` runs tensor-parallel replicas:

- both ranks get the same requests and rows (same seeds). ``kv_score`` comes from a real bf16 GEMM of identical
  hidden states;
- at the end, per-layer checksums of every pool, state and input buffer are all-gathered and must be equal on
  every rank.

Checks, on every rank:

- every entry of every request is checked against the float64 reference (``reference.compress_sequence``):
  ``verify.check_latent_records``, and ``verify.check_indexer_pack(..., "hadamard_bf16")`` for the indexer;
- pool bytes outside the slots the run wrote must still hold their poison;
- the HOLD request's state rows, the HOLD SWA page's state rows and the sentinel rows must be untouched;
- ``check_plan`` must report nothing, step after step.

Any unexplained byte makes the exit status non-zero. The checks' results are written before the timing runs.

The report: rank 0 writes a JSON file (``--json``, default ``$OUT/multi_gpu_<mode>_<hca>.json``) and prints a
summary. It holds:

- the checks: entries verified and expected per rank and kind, unexplained and exact bytes, stray pool bytes,
  HOLD rows, ``check_plan`` findings, TP equality; and what ran: forwards, HOLD-only forwards, graph replays,
  rewinds, radix hits, SWA evictions, per request its prompt, decode steps and final length;
- microseconds per layer under graph replay, for the first decode step in which every rank decoded a full batch.
  That step is snapshot and replayed after the checks. The same graph of layers is timed alone, with a
  per-layer all_reduce after each layer (engine order), with the all_reduces running concurrently on a side
  stream, and with the all_reduces alone; HCA and CSA layers are also timed on their own. Timing uses CUDA
  events, median over replays, and the summary takes the slowest rank;
- HCA state bytes per request, ring against online banks, for DeepSeek-V4-Flash and -Pro, and the requests per
  rank that a memory budget admits (from ``CompressorConfig.hca()``);
- the environment.

On the CPU (gloo, Triton interpreter) the same code runs eagerly: no CUDA graphs, no NCCL, wall-clock timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
import types


def _interpret_on_cpu() -> None:
    """``--device cpu`` runs the kernels under the Triton interpreter, which must be on before triton is imported."""
    argv = sys.argv[1:]
    cpu = "--device=cpu" in argv or any(a == "--device" and argv[i + 1 : i + 2] == ["cpu"] for i, a in enumerate(argv))
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_on_cpu()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# the checkout's benchmarks/ (the run's environment record) and tests/helpers/ (LightLLM's stand-ins): neither is
# installed with the package
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:0] = [p for p in (_ROOT, os.path.join(_ROOT, "tests")) if p not in sys.path]

from helpers import lightllm_sim as sim  # noqa: E402

from benchmarks.env import environment  # noqa: E402
from dsv4_compressor import ops, reference, verify  # noqa: E402
from dsv4_compressor.config import MODELS, CompressorConfig, CompressorParams  # noqa: E402
from dsv4_compressor.integrations import lightllm as adapter  # noqa: E402
from dsv4_compressor.integrations.lightllm import layer as adapter_layer  # noqa: E402
from dsv4_compressor.integrations.lightllm import layout as adapter_layout  # noqa: E402
from dsv4_compressor.integrations.lightllm import step as adapter_step  # noqa: E402
from dsv4_compressor.layout import indexer_fp8_page_layout, latent_page_layout  # noqa: E402

KINDS_OF_RATE = {4: ("c4", "indexer"), 128: ("c128",)}
CSA_KINDS = frozenset({"c4", "indexer"})
HCA_KINDS = frozenset({"c128"})
#: The decode-step graphs the timing replays (``build`` is always one of them).
TIMING_VARIANTS = (
    "build", "layers", "layers_nccl_serial", "layers_nccl_concurrent", "nccl_only", "hca_layers", "csa_layers",
    "build_plans", "build_state_rows", "csa_ops_tables", "csa_ops_ring", "csa_ops_ring_tables", "layers_no_build",
    "one_kernel",
)  # fmt: skip
#: Probes of where the adapter's time goes (``--timing-variants`` names them; not timed by default): the build's
#: parts (``build_plans`` of both plans without the C4 tables, and the tables alone by ``build_state_rows``; the
#: whole build resolves them in the plans' own launch) and the CSA layers as bare ``ops.compress`` calls on the
#: adapter's state-row tables and on a request ring (no tables), same inputs/plan.
PROBE_VARIANTS = ("build_plans", "build_state_rows", "csa_ops_tables", "csa_ops_ring", "csa_ops_ring_tables",
                  "layers_no_build", "one_kernel")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Shapes and arguments
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shapes:
    """The three compressors' configs and LightLLM's SWA page / sliding window."""

    hca: CompressorConfig
    csa: CompressorConfig
    idx: CompressorConfig
    swa_page: int
    swa_window: int

    def cfg(self, kind: str) -> CompressorConfig:
        return {"c4": self.csa, "indexer": self.idx, "c128": self.hca}[kind]


FULL = Shapes(CompressorConfig.hca(), CompressorConfig.csa(), CompressorConfig.indexer(), 128, 128)
#: Scaled down for the CPU: H = 128, the HCA ratio 8, SWA pages of 16 (as tests/test_integration_lightllm.py).
SMALL = Shapes(
    CompressorConfig(ratio=8, head_dim=128, rope_dim=64, overlap=False, name="hca_small"),
    CompressorConfig(ratio=4, head_dim=128, rope_dim=64, overlap=True, name="csa_small"),
    CompressorConfig.indexer(),
    16,
    16,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("dp", "tp"), required=True, help="data-parallel attention or TP replicas")
    p.add_argument("--hca", choices=("ring", "online"), default="ring", help="LightLLM's C128 ring or online banks")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="scaled-down shapes (H=128, HCA r=8, SWA page 16)")
    p.add_argument("--csa-layers", type=int, default=21, help="C4 layers (main + indexer); Flash: 21")
    p.add_argument("--hca-layers", type=int, default=20, help="C128 layers; Flash: 20")
    p.add_argument("--requests", type=int, default=16, help="requests per rank = max_request_num = graph batch")
    p.add_argument("--max-prompt", type=int, default=600, help="prompt lengths are uniform in [1, max]")
    p.add_argument("--decode-steps", type=int, default=30, help="MTP decode steps per request (at most)")
    p.add_argument("--chunk", type=int, default=2048, help="rows per prefill forward (LightLLM batch_max_tokens)")
    p.add_argument("--mtp-step", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096, help="hidden size: MoE all_reduce width and GEMM input")
    p.add_argument(
        "--kv-source",
        choices=("auto", "random", "gemm"),
        default="auto",
        help="kv_score rows: random, or LightLLM's bf16 GEMM of hidden states (auto: dp random, tp gemm)",
    )
    p.add_argument("--prefix-reuse", type=float, default=0.5, help="chance an arriving request takes a radix hit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=0, help="also verify (and compare replicas) every N iterations")
    p.add_argument("--no-check-plan", action="store_true", help="skip ops.check_plan on every step's plans")
    p.add_argument(
        "--graph-collectives",
        choices=("on", "off"),
        default="on",
        help="off: the decode graph holds the layers only, the all_reduces run eagerly after it",
    )
    p.add_argument("--dispatch", choices=("python", "torch-ops"), default="python",
                   help="the adapter calls the ops as Python functions, or through torch.ops.dsv4c")  # fmt: skip
    p.add_argument("--capture-error-mode", choices=("global", "thread_local", "relaxed"), default="thread_local")
    p.add_argument("--timing-samples", type=int, default=30, help="timed samples per graph variant (0: no timing)")
    p.add_argument("--timing-inner", type=int, default=5, help="graph replays per timed sample")
    p.add_argument("--projection", choices=adapter.PROJECTIONS, default="auto",
                   help="kv gemm: ours where measured faster (auto) or LightLLM's GEMM (engine)")  # fmt: skip
    p.add_argument(
        "--no-join",
        action="store_true",
        help="keep each C4 layer's two weights apart (gemm, auto: the adapter joins them by default)",
    )
    p.add_argument("--timing-variants", default=",".join(v for v in TIMING_VARIANTS if v not in PROBE_VARIANTS),
                   help="comma-separated graph variants to time (the build is always timed)")  # fmt: skip
    p.add_argument("--memory-budget-gib", type=float, default=80.0, help="per-rank budget for the admission table")
    p.add_argument("--timeout-s", type=int, default=300, help="process group timeout")
    p.add_argument("--json", default=None, help="report path (default: $OUT or out, multi_gpu_<mode>_<hca>.json)")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.kv_source == "auto":
        args.kv_source = "random" if args.mode == "dp" else "gemm"
    if args.json is None:
        args.json = os.path.join(os.environ.get("OUT") or "out", f"multi_gpu_{args.mode}_{args.hca}.json")
    unknown = set(args.timing_variants.split(",")) - set(TIMING_VARIANTS)
    if unknown:
        p.error(f"--timing-variants: unknown {sorted(unknown)}; choose from {', '.join(TIMING_VARIANTS)}")
    if min(args.requests, args.max_prompt, args.decode_steps, args.chunk) < 1 or args.csa_layers + args.hca_layers < 1:
        p.error("requests, max-prompt, decode-steps, chunk and the layer count must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------------------------------------------
class Dist:
    """This rank, its device, and the few collectives the harness itself needs."""

    def __init__(self, args):
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        if args.device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("multi_gpu_run: --device cuda but no CUDA device (use --device cpu --backend gloo)")
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if args.backend == "nccl" and not self.cuda:
            raise SystemExit("multi_gpu_run: the nccl backend needs --device cuda")
        timeout = datetime.timedelta(seconds=args.timeout_s)
        kwargs = dict(device_id=self.device) if args.backend == "nccl" else {}
        dist.init_process_group(args.backend, timeout=timeout, **kwargs)
        self.backend = args.backend
        # where the harness's own collectives live (NCCL: the GPU)
        self.comm_device = self.device if args.backend == "nccl" else torch.device("cpu")

    def all_max(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        t = torch.zeros(1, device=self.comm_device)
        dist.all_reduce(t)
        if self.cuda:
            torch.cuda.synchronize()


class Replay:
    """``fn()`` captured in a CUDA graph, after a warm-up on a side stream that compiles every kernel at the graph's
    shapes and runs each collective once. Keeps ``fn``'s return value: the graph's output tensors. On the CPU,
    ``replay()`` runs ``fn()`` eagerly."""

    def __init__(self, fn, device: torch.device, capture_error_mode: str):
        self.fn, self.graph, self.out = fn, None, None
        if device.type != "cuda":
            return
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            fn()
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=capture_error_mode):
            self.out = fn()
        torch.cuda.synchronize()

    def replay(self):
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class TorchOps:
    """``dsv4_compressor.ops`` as the adapter sees it, with the launching ops routed through the dispatcher
    (``torch.ops.dsv4c.<name>``, docs/INTEGRATION.md, "torch.library registration"); everything else is the module's."""

    ROUTED = ("build_plan", "build_state_rows", "check_plan", "compress", "compress_online_hca")

    def __init__(self, module):
        self._module = module
        self.calls = 0

    def __getattr__(self, name):
        if name not in self.ROUTED:
            return getattr(self._module, name)
        op = getattr(torch.ops.dsv4c, name)

        def call(*args, **kwargs):
            self.calls += 1
            return op(*args, **kwargs)

        return call


# ---------------------------------------------------------------------------------------------------------------
# The model: every compressor of every layer, on LightLLM's buffers
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# One rank's engine: LightLLM's buffers, the step builder, the decode graph
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# The scheduler of one rank
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Request:
    rid: int
    arrive: int
    prompt: int
    decode_steps: int
    phase: str = "waiting"  # waiting -> prefill -> decode -> done (finished requests stay resident)
    filled: int = 0
    decoded: int = 0
    ready_at: int = 0
    prefix: int = 0


class Scheduler:
    """Requests arrive in two waves, at iterations 0 and 2 (the second wave may take radix hits on the first).
    Prefill is chunked FIFO within ``--chunk`` rows per forward. A request decodes from the iteration after its
    prefill: ``decode_steps`` MTP steps of S rows, each starting after a random number of accepted drafts (a
    rewind unless all were accepted). In DP mode rank ``k``'s requests arrive ``k`` iterations later and stop
    sooner, so ranks are idle at both ends and run HOLD forwards."""

    def __init__(self, args, engine: Engine, rank: int, rng: np.random.Generator):
        self.args, self.eng, self.rng = args, engine, rng
        self.S = args.mtp_step + 1
        self.align = 2 * engine.shapes.swa_page  # 256 at full size: whole SWA pages and whole HCA groups
        assert self.align % engine.shapes.hca.ratio == 0
        first_wave = max(1, -(-args.requests // 2))
        offset = rank if args.mode == "dp" else 0
        shorter = max(1, args.decode_steps // 6) * rank if args.mode == "dp" else 0
        self.requests = []
        for j in range(args.requests):
            prompt = int(rng.integers(1, args.max_prompt + 1))
            steps = int(rng.integers(max(1, args.decode_steps // 2), args.decode_steps + 1))
            arrive = (0 if j < first_wave else 2) + offset
            self.requests.append(Request(j, arrive, prompt, max(1, steps - shorter)))
        self.stats = dict(decode_request_steps=0, rewinds=0, rewound_rows=0, accepted_drafts=0, prefix_hits=0,
                          prefix_tokens=0)  # fmt: skip

    def admit(self, it: int) -> None:
        for r in self.requests:
            if r.phase != "waiting" or r.arrive > it:
                continue
            r.phase = "prefill"
            if self.rng.random() < self.args.prefix_reuse:
                best, src = 0, None
                for q in self.requests:
                    if q.phase in ("prefill", "decode", "done") and q is not r:
                        b = self.eng.alloc.reusable_prefix(q.rid, self.align)
                        if self.align <= b < self.args.max_prompt and b > best:
                            best, src = b, q
                if src is not None:
                    r.prompt = best + int(self.rng.integers(1, min(self.args.max_prompt - best, 64) + 1))
                    r.filled = r.prefix = best
                    self.eng.share_prefix(src.rid, r.rid, best)
                    self.stats["prefix_hits"] += 1
                    self.stats["prefix_tokens"] += best

    def plan(self, it: int):
        budget, prefill, decode = self.args.chunk, [], []
        for r in self.requests:
            if r.phase == "prefill" and budget > 0:
                n = min(r.prompt - r.filled, budget)
                prefill.append((r.rid, r.filled, n))
                budget -= n
        for r in self.requests:
            if r.phase != "decode" or r.ready_at > it:
                continue
            length = self.eng.alloc.length[r.rid]
            start = length
            if r.decoded:  # the previous step's 1 + accepted rows stay; the rejected drafts are rewritten
                accepted = int(self.rng.integers(0, self.S))
                start = length - (self.S - 1 - accepted)
                self.stats["accepted_drafts"] += accepted
                self.stats["rewinds"] += start < length
                self.stats["rewound_rows"] += length - start
            decode.append((r.rid, start, self.S))
        return prefill, decode

    def commit(self, it: int, prefill, decode) -> None:
        by_id = {r.rid: r for r in self.requests}
        for rid, _, n in prefill:
            r = by_id[rid]
            r.filled += n
            if r.filled == r.prompt:
                r.phase, r.ready_at = "decode", it + 1
        for rid, _, _ in decode:
            r = by_id[rid]
            r.decoded += 1
            self.stats["decode_request_steps"] += 1
            if r.decoded == r.decode_steps:
                r.phase = "done"

    def unfinished(self) -> bool:
        return any(r.phase != "done" for r in self.requests)


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------
def verify_entries(eng: Engine) -> dict:
    """Every entry of every request (every group within its current length) against the float64 reference of its
    current rows: the stored bytes, read through LightLLM's tables (``req_to_token``, ``full_to_c4`` /
    ``full_to_c128``) from the layer's pool."""
    alloc = eng.alloc
    kinds = KINDS_OF_RATE[4] + KINDS_OF_RATE[128]
    per_kind = {k: dict(entries_expected=0, entries_verified=0, missing_slots=0, report=None) for k in kinds}
    lengths = {rid: n for rid, n in alloc.length.items() if n > 0}
    for c in eng.model.comps.values():
        r = c.cfg.ratio
        table = alloc.full_to_c128 if c.kind == "c128" else alloc.full_to_c4
        slots, values, agg = [], [], per_kind[c.kind]
        for rid, length in sorted(lengths.items()):
            groups = length // r
            if groups == 0:
                continue
            agg["entries_expected"] += groups
            ends = np.arange(groups) * r + r - 1
            got = table[alloc.req_to_token[rid, ends]]
            ok = got >= 0
            agg["missing_slots"] += int((~ok).sum())
            want = reference.compress_sequence(c.hist[rid, :length], c.params, c.cfg, dtype=torch.float64)
            keep = torch.from_numpy(ok).to(want.device)
            slots.append(got[ok])
            values.append(want[keep])
        if not slots:
            continue
        slot_t = torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(c.pages.device)
        records = c.layout.read(c.pages, slot_t)
        want = torch.cat(values)
        if c.kind == "indexer":
            rep = verify.check_indexer_pack(records, want, adapter.INDEXER_PACK)
        else:
            rep = verify.check_latent_records(records, want, c.cfg)
        if not rep.ok:
            rep.failures = [f"layer {c.layer} {c.kind}: {f}" for f in rep.failures]
        agg["entries_verified"] += int(slot_t.numel()) if rep.ok else 0
        agg["report"] = rep if agg["report"] is None else agg["report"].merge(rep)
    out = {}
    for kind, agg in per_kind.items():
        rep = agg.pop("report") or verify.Report(kind)
        out[kind] = dict(agg, total_bytes=rep.total_bytes, exact_bytes=rep.exact_bytes,
                         unexplained_bytes=rep.unexplained, max_abs_err=rep.max_abs_err,
                         failures=rep.failures[:5])  # fmt: skip
    keys = ("entries_expected", "entries_verified", "missing_slots", "total_bytes", "exact_bytes", "unexplained_bytes")
    total = {k: sum(v[k] for v in out.values()) for k in keys}
    total["requests"] = len(lengths)
    total["all_verified"] = (
        total["unexplained_bytes"] == 0 and total["missing_slots"] == 0
        and total["entries_verified"] == total["entries_expected"]
    )  # fmt: skip
    return {"by_kind": out, "total": total}


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of a tensor's bytes (a word sum and a position-weighted word sum, both mod 2^64)."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    if b.numel() % 4 or b.storage_offset() % 4:
        b = torch.cat([b, b.new_zeros((-b.numel()) % 4)])
    w = b.view(torch.int32).to(torch.int64)
    weights = torch.arange(w.numel(), dtype=torch.int64, device=w.device) * 2654435761 + 1
    return torch.stack([w.sum(), (w * weights).sum()])


def tp_compare(eng: Engine, ctx: Dist) -> dict:
    """All-gather per-layer checksums of every pool, state and input buffer; every rank must hold the same bytes."""
    names, digests, nbytes = [], [], 0
    for c in eng.model.comps.values():
        for part, t in (("pool", c.pages), ("state", c.state), ("kv_score", c.hist)):
            names.append(f"layer {c.layer} {c.kind} {part}")
            digests.append(_digest(t))
            nbytes += t.numel() * t.element_size()
    mine = torch.stack(digests).to(ctx.comm_device)
    every = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(every, mine)
    differ = set()
    for other in every[1:]:
        bad = (other != every[0]).any(dim=1).cpu()
        differ.update(int(i) for i in bad.nonzero().flatten())
    return {"ranks": ctx.world, "buffers": len(names), "bytes_per_rank": nbytes, "equal": not differ,
            "differing": [names[i] for i in sorted(differ)][:20]}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------
def memory_report(eng: Engine, mtp: int, budget_gib: float) -> dict:
    """HCA state per request, LightLLM's C128 ring against the online banks, at DeepSeek-V4 shapes (from
    ``CompressorConfig.hca()`` and the layer counts of docs/SPEC.md section 1), and the requests per rank a budget
    holds."""
    hca = CompressorConfig.hca()
    ring_layer = hca.ring_bytes(mtp)  # ceil((128 + mtp) / 4) * 4 rows of [kv | score + ape], float32
    online_layer = (mtp + 1) * 3 * hca.head_dim * 4  # mtp + 1 banks of (max, sum, weighted sum) per channel
    budget = int(budget_gib * 2**30)
    models = {}
    for name, layers in MODELS.items():
        n = layers["hca"]
        ring, online = n * ring_layer, n * online_layer
        assert ring - online == adapter.online_hca_savings(n, mtp)
        models[name] = {
            "hca_layers": n,
            "ring_bytes_per_request": ring,
            "online_bytes_per_request": online,
            "freed_bytes_per_request": ring - online,
            "ring_over_online": ring / online,
            "admissible_requests_ring": budget // ring,
            "admissible_requests_online": budget // online,
        }
    csa, idx = CompressorConfig.csa(), CompressorConfig.indexer()
    c4_ring = sim.DSV4_C4_STATE_RING + mtp
    mm, lay = eng.mm, eng.layout
    run_layer = (mtp + 1) * 3 * lay.head_dim * 4 if mm.online_hca else lay.c128_state_ring * 2 * lay.head_dim * 4
    return {
        "mtp_step": mtp,
        "budget_bytes": budget,
        "budget_gib": budget_gib,
        "per_layer": {"ring_bytes": ring_layer, "online_bytes": online_layer},
        "models": models,
        "note": "HCA (C128) state only, per request, all HCA layers; admissible = budget // bytes per request. "
        "LightLLM's C4 state is per SWA page (shared through the radix cache) and the same either way: "
        f"{c4_ring * (csa.row_width + idx.row_width) * 4} bytes per SWA page and CSA layer (main + indexer).",
        "this_run": {
            "hca_state": "online banks" if mm.online_hca else "ring",
            "state_bytes_per_request_per_hca_layer": run_layer,
            "c128_state_allotted_bytes": mm.c128_state_buffer.numel() * 4
            + (mm.dsv4c_c128_state_banks.numel() * 4 if mm.online_hca and mm.n_c128 else 0),
            "fixed_memory_bytes (LightLLM get_fixed_memory_size)": mm.fixed_memory,
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------
def _env(eng: Engine, ctx: Dist, gpus: list) -> dict:
    env = environment(eng.device if ctx.cuda else None)
    nccl = None
    if ctx.cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - best effort
            nccl = "unknown"
    env.update(nccl=nccl, backend=ctx.backend, world_size=ctx.world, gpus=gpus, host=socket.gethostname(),
               triton_interpret=os.environ.get("TRITON_INTERPRET"))  # fmt: skip
    return env


def run(args) -> int:
    t0 = time.perf_counter()
    ctx = Dist(args)
    if args.dispatch == "torch-ops" and not isinstance(adapter.ops, TorchOps):
        routed = TorchOps(adapter.ops)
        for module in (adapter, adapter_layer, adapter_step):  # the adapter's modules that call ops, at every call
            module.ops = routed
    shapes = SMALL if args.small else FULL
    S = args.mtp_step + 1
    seed = args.seed + (1000 * ctx.rank if args.mode == "dp" else 0)  # TP replicas: the same everything
    max_len = -(-(args.max_prompt + S * args.decode_steps + S) // shapes.swa_page) * shapes.swa_page
    eng = Engine(args, shapes, ctx, max_len=max_len, seed=seed)
    sched = Scheduler(args, eng, ctx.rank, np.random.default_rng(seed + 17))
    ctx.sync()
    t_setup = time.perf_counter()
    eng.capture_decode()
    ctx.sync()
    t_capture = time.perf_counter()
    failures: list[str] = []
    snap, checks, it, last_decode = None, [], 0, []
    want_timing = args.timing_samples > 0
    while True:
        sched.admit(it)
        prefill, decode = sched.plan(it)
        prefill_rows = sum(n for _, _, n in prefill) if prefill else S
        local = [int(bool(prefill)), int(bool(decode)), prefill_rows, int(sched.unfinished()), -len(decode)]
        flags = ctx.all_max(local)  # LightLLM's DP backend: every rank runs the forwards any rank needs
        if flags[0]:
            eng.forward_prefill(prefill, moe_rows=flags[2])
        if flags[1]:
            eng.forward_decode(decode)
            last_decode = decode
            if want_timing and snap is None and -flags[4] == eng.G:  # every rank decoded a full batch: time it later
                snap = snapshot_step(eng, decode)
        sched.commit(it, prefill, decode)
        if args.check_every and it % args.check_every == 0 and it:
            checks.append({"iteration": it, **verify_entries(eng)["total"]})
            if args.mode == "tp":
                checks[-1]["tp_equal"] = tp_compare(eng, ctx)["equal"]
        if not flags[3]:
            break
        it += 1
        if it > 100_000:
            raise RuntimeError("the scheduler does not terminate")
    if ctx.cuda:
        torch.cuda.synchronize()
    t_run = time.perf_counter()
    result = verify_entries(eng)
    untouched = eng.check_untouched()
    tp = tp_compare(eng, ctx) if args.mode == "tp" else None
    t_verify = time.perf_counter()

    tot = result["total"]
    if not tot["all_verified"]:
        failures.append(f"verification: {tot['unexplained_bytes']} unexplained bytes, {tot['missing_slots']} missing "
                        f"slots, {tot['entries_verified']}/{tot['entries_expected']} entries verified")  # fmt: skip
        for kind, v in result["by_kind"].items():
            failures += [f"{kind}: {f}" for f in v["failures"]]
    if tot["entries_expected"] == 0:
        failures.append("verification: no entries at all")
    if any(untouched["stray_pool_bytes"].values()):
        failures.append(f"pool bytes written outside every written slot: {untouched['stray_pool_bytes']}")
    if untouched["hold_rows_changed"]:
        failures.append(f"state rows no step may write changed: {untouched['hold_rows_changed']}")
    failures += eng.plan_errors[:10]
    if eng.capture_error:
        failures.append(f"the decode graph with NCCL collectives did not capture ({eng.capture_error}); the run went "
                        "on with --graph-collectives off")  # fmt: skip
    bad_checks = [c for c in checks if not c["all_verified"] or c.get("tp_equal") is False]
    failures += [f"check at iteration {c['iteration']}: {c}" for c in bad_checks]
    if tp is not None and not tp["equal"]:
        failures.append(f"TP replicas differ: {tp['differing']}")
    mine = {
        "rank": ctx.rank,
        "device": torch.cuda.get_device_name(eng.device) if ctx.cuda else "cpu",
        "iterations": it + 1,
        "engine": eng.stats,
        "scheduler": sched.stats,
        "allocator": {"swa_page_evictions": eng.alloc.evictions, "rejected_rows_freed": eng.alloc.freed_rows},
        "requests": [dataclasses.asdict(r) | {"length": eng.alloc.length.get(r.rid, 0)} for r in sched.requests],
        "verification": result,
        "untouched": untouched,
        "plan_errors": eng.plan_errors[:10],
        "periodic_checks": checks,
        "tp": tp,
        "failures": failures,
        "dispatcher_calls": adapter.ops.calls if isinstance(adapter.ops, TorchOps) else 0,
        "cuda_max_memory_allocated": torch.cuda.max_memory_allocated(eng.device) if ctx.cuda else None,
        "seconds": {
            "setup": t_setup - t0,
            "capture": t_capture - t_setup,
            "run": t_run - t_capture,
            "verify": t_verify - t_run,
        },  # fmt: skip
    }
    ranks = ctx.gather(mine)
    report = None
    if ctx.rank == 0:  # the checks' results are on disk before the timing's graphs run
        report = _report(args, eng, ctx, ranks, max_len, t0)
        _write(report, args.json)
        print(f"multi_gpu_run: checks {'passed' if report['ok'] else 'FAILED'}; timing next ({args.json})", flush=True)

    timing, error, t_timing = None, None, time.perf_counter()
    if want_timing:
        note = None
        if snap is None:
            snap = snapshot_step(eng, last_decode)
            note = "no iteration decoded a full batch on every rank: timed the last decode step"
        try:
            timing = run_timing(eng, ctx, args, snap)
            timing["note"] = note
        except Exception as err:  # noqa: BLE001 - reported, and the run fails
            error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        timing = timing and dict(timing, seconds=time.perf_counter() - t_timing)
    timings = ctx.gather({"timing": timing, "error": error})
    errors = [f"rank {r}: timing: {t['error']}" for r, t in enumerate(timings) if t["error"]]
    errors += [f"rank {r}: timing {name}: {e}" for r, t in enumerate(timings) if t["timing"]
               for name, e in t["timing"]["errors"].items()]  # fmt: skip
    failures_all = [f"rank {r['rank']}: {f}" for r in ranks for f in r["failures"]] + errors
    ok = not failures_all and _lockstep(ranks)
    if report is not None:
        report["ok"] = ok
        report["failures"] = (report["failures"] + errors)[:50]
        report["timing"] = {f"rank{r}": t["timing"] for r, t in enumerate(timings)}
        report["timing_summary"] = _timing_summary([t["timing"] for t in timings])
        report["seconds_total"] = time.perf_counter() - t0
        _write(report, args.json)
        print(summary(report, args.json), flush=True)
    if not ok:
        for f in failures + ([error] if error else []):
            print(f"rank {ctx.rank}: FAILED: {f}", file=sys.stderr, flush=True)
    eng.decode_graph = None  # graphs holding NCCL work go before the communicator
    gc.collect()
    ctx.sync()
    dist.destroy_process_group()
    return 0 if ok else 1


def _lockstep(ranks: list[dict]) -> bool:
    return len({(r["engine"]["prefill_forwards"], r["engine"]["decode_forwards"]) for r in ranks}) == 1


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def _report(args, eng: Engine, ctx: Dist, ranks: list[dict], max_len: int, t0: float) -> dict:
    """Rank 0's report of the checks (the timing is added when it ran)."""
    failures = [f"rank {r['rank']}: {f}" for r in ranks for f in r["failures"]]
    lockstep = _lockstep(ranks)
    if not lockstep:
        failures.append("ranks ran different numbers of forwards")
    totals = [r["verification"]["total"] for r in ranks]
    return {
        "ok": not failures,
        "failures": failures[:50],
        "mode": args.mode,
        "hca": args.hca,
        "config": {
            **vars(args),
            "shapes": "small" if args.small else "DeepSeek-V4 (H=512/128, r=4/128)",
            "max_len": max_len,
            "layers": eng.mm.compress_rates,
            "compressors": len(eng.model.comps),
            "swa_page": eng.shapes.swa_page,
            "hca_ratio": eng.shapes.hca.ratio,
            "gemm_fp32_out": eng.model.fp32_out,
            "joined_c4_layers": eng.model.joined,
            "decode_graph_rows": eng.G * eng.S,
        },
        "verification": {
            "entries_expected": sum(t["entries_expected"] for t in totals),
            "entries_verified": sum(t["entries_verified"] for t in totals),
            "unexplained_bytes": sum(t["unexplained_bytes"] for t in totals),
            "all_verified": all(t["all_verified"] for t in totals),
            "stray_pool_bytes": sum(sum(r["untouched"]["stray_pool_bytes"].values()) for r in ranks),
            "hold_rows_untouched": not any(r["untouched"]["hold_rows_changed"] for r in ranks),
            "plan_errors": sum(len(r["plan_errors"]) for r in ranks),
        },
        "lockstep": lockstep,
        "tp": ranks[0]["tp"],
        "timing": "pending" if args.timing_samples > 0 else None,
        "timing_summary": None,
        "memory": memory_report(eng, args.mtp_step, args.memory_budget_gib),
        "environment": _env(eng, ctx, [r["device"] for r in ranks]),
        "ranks": ranks,
        "seconds_total": time.perf_counter() - t0,
    }


def _timing_summary(timings: list[dict | None]) -> dict | None:
    """Per-layer microseconds, the slowest rank's (the one the other waits for at the next collective)."""
    timings = [t for t in timings if t]
    if not timings:
        return None
    out = {}
    for key in timings[0]["per_layer_us"]:
        vals = [t["per_layer_us"][key] for t in timings if t["per_layer_us"][key] is not None]
        out[key] = max(vals) if vals else None
    out["build_us_per_step"] = max(t["build_us_per_step"] for t in timings)
    for part in timings[0].get("build_parts_us", {}):
        vals = [t["build_parts_us"][part] for t in timings if t["build_parts_us"].get(part) is not None]
        out[f"build_{part}_us"] = max(vals) if vals else None
    return out


def summary(report: dict, path: str) -> str:
    v, env, cfg = report["verification"], report["environment"] or {}, report["config"]
    ranks = report["ranks"]
    eng = [r["engine"] for r in ranks]
    sch = [r["scheduler"] for r in ranks]
    lines = [
        f"multi_gpu_run: mode={report['mode']} hca={report['hca']} kv={cfg['kv_source']} backend={env.get('backend')} "
        f"world={env.get('world_size')} on {', '.join(env.get('gpus') or [])} (torch {env.get('torch')}, triton "
        f"{env.get('triton')}, NCCL {env.get('nccl')})",
        f"  {cfg['compressors']} compressors in {len(cfg['layers'])} layers ({cfg['shapes']}), {cfg['requests']} "
        f"requests per rank, decode graph of {cfg['decode_graph_rows']} rows",
        "  forwards per rank: prefill {} (HOLD-only on a rank: {}), decode {} (HOLD-only: {}), graph replays {}".format(
            eng[0]["prefill_forwards"],
            [e["idle_prefill_forwards"] for e in eng],
            eng[0]["decode_forwards"],
            [e["idle_decode_forwards"] for e in eng],
            [e["graph_replays"] for e in eng],
        ),
        "  MTP: {} rewinds in {} request-steps; prefix hits {}".format(
            sum(s["rewinds"] for s in sch), sum(s["decode_request_steps"] for s in sch), [s["prefix_hits"] for s in sch]
        ),
        f"  verified {v['entries_verified']}/{v['entries_expected']} entries against float64, "
        f"{v['unexplained_bytes']} unexplained bytes; stray pool bytes {v['stray_pool_bytes']}; HOLD rows untouched "
        f"{v['hold_rows_untouched']}; plan errors {v['plan_errors']}",
    ]
    if report["tp"]:
        tp = report["tp"]
        lines.append(f"  TP replicas byte-equal: {tp['equal']} ({tp['buffers']} buffers, {tp['bytes_per_rank']} bytes)")
    ts = report["timing_summary"]
    if ts:
        f = lambda x: "-" if x is None else f"{x:.1f}"
        p = ts
        lines.append(
            f"  us per layer (slowest rank): alone {f(p['layers_alone'])} | + NCCL after each layer "
            f"{f(p['layers_with_nccl_serial'])} | + NCCL concurrent {f(p['layers_with_nccl_concurrent'])} | NCCL "
            f"alone {f(p['nccl_alone'])} | HCA {f(p['hca_layer_alone'])} | CSA+indexer "
            f"{f(p['csa_layer_alone (main + indexer)'])} | build {f(p['build_us_per_step'])} per step"
        )
        probes = ("csa_bare_ops_on_tables", "csa_bare_ops_on_ring", "csa_bare_ops_on_ring_tables", "build_plans_us",
                  "build_state_rows_us", "build_in_the_step_graph", "one_kernel_graph")  # fmt: skip
        if any(p.get(k) is not None for k in probes):
            lines.append(
                f"  probes: CSA+indexer as bare ops on LightLLM's tables {f(p.get('csa_bare_ops_on_tables'))} | on a "
                f"request ring {f(p.get('csa_bare_ops_on_ring'))} | on that ring through req_ring tables "
                f"{f(p.get('csa_bare_ops_on_ring_tables'))} us per layer; build parts: plans "
                f"{f(p.get('build_plans_us'))} | state rows "
                f"{f(p.get('build_state_rows_us'))} us; the build in the step graph (layers with it - without) "
                f"{f(p.get('build_in_the_step_graph'))} us, a one-kernel graph {f(p.get('one_kernel_graph'))} us"
            )
    mem = report["memory"]
    for name, m in mem["models"].items():
        lines.append(
            f"  {name}: HCA state {m['ring_bytes_per_request'] / 2**20:.2f} MiB (ring) vs "
            f"{m['online_bytes_per_request'] / 2**20:.3f} MiB (online) per request -> per {mem['budget_gib']:g} GiB: "
            f"{m['admissible_requests_ring']} vs {m['admissible_requests_online']} requests per rank"
        )
    lines.append(("  OK" if report["ok"] else "  FAILED: " + "; ".join(report["failures"][:5])) + f"  ({path})")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
