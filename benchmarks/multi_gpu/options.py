"""The compressors' kinds, the timing's graph variants, the shapes of a run (DeepSeek-V4's, or scaled down for the
CPU) and the command line of ``scripts/multi_gpu_run.py`` (:func:`parse_args`: its ``--help`` text is the first
paragraph of :mod:`benchmarks.multi_gpu`'s docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from benchmarks import multi_gpu as _package
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.integrations import lightllm as adapter

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
    p = argparse.ArgumentParser(
        description=_package.__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
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
