"""The ``dsv4-compressor`` command line (also ``python -m dsv4_compressor``).

Subcommands:

- ``demo``: simulated serving of one HCA, one CSA and one indexer layer, every entry checked against a
  float64 one-shot recomputation (:mod:`dsv4_compressor.demo`); exits 1 if any byte is unexplained. A Triton
  backend on CPU tensors needs the interpreter on before triton is imported, which ``import dsv4_compressor``
  already did: the demo then reruns its command line in a child Python with ``TRITON_INTERPRET=1``.
- ``bench``: GPU benchmarks (``benchmarks/cli.py`` of a checkout of the repository, next to ``src/``: they are
  not installed; needs a CUDA GPU); arguments after ``bench`` are passed through.
- ``info``: versions, the device, where each backend can run here, and the sizes of each layer kind (entries,
  pages, ring state).

Exit status 2 means the command cannot run here (a missing backend or module, no GPU for ``bench``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["main", "backend_status", "backend_summary"]

BACKEND_MODULES = {
    "reference": "dsv4_compressor.backends.reference",
    "triton": "dsv4_compressor.backends.triton",
    "online": "dsv4_compressor.backends.online",
}
NO_CUDA = "bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def backend_status(name: str) -> str | None:
    """``None`` when backend ``name`` can be imported, else why not (one line)."""
    module = BACKEND_MODULES[name]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return f"backend {name!r} is not available in this build ({module} does not exist yet)"
        return f"backend {name!r} cannot be imported: {exc}"
    except ImportError as exc:
        return f"backend {name!r} cannot be imported: {exc}"
    return None


def backend_summary(name: str, cuda: bool, interpreting: bool) -> str:
    """What ``info`` says of backend ``name`` here: whether it imports and where its kernels can run.

    The Triton backends import wherever triton does, but their kernels run only on a CUDA GPU or, on CPU
    tensors, under the Triton interpreter (``TRITON_INTERPRET=1`` before triton is imported)."""
    problem = backend_status(name)
    if problem:
        return problem
    if name == "reference" or cuda:
        return "ok"
    if interpreting:
        return "ok on the CPU under the Triton interpreter (TRITON_INTERPRET=1), slow"
    return "importable, but no GPU: its kernels run only under TRITON_INTERPRET=1 (unset here)"


# ----------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------
def _kinds(text: str) -> list[str]:
    from .demo import KINDS

    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"choose a comma-separated subset of {','.join(KINDS)}, got {text!r}")
    return list(dict.fromkeys(kinds))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _rerun_under_interpreter(argv: list[str]) -> int:
    """Run this command line again in a child Python with ``TRITON_INTERPRET=1``; its exit status.

    The interpreter must be on before ``triton`` itself is imported (``triton.language``'s own ``@jit`` helpers
    are decorated then, and a kernel calling one of them fails with "Cannot call @triton.jit'd outside of the
    scope of a kernel"); ``import dsv4_compressor`` has already imported it by the time this module runs."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        return subprocess.call([sys.executable, "-m", "dsv4_compressor", *argv], env=env)
    except KeyboardInterrupt:
        return 130


def _cmd_demo(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    cuda = torch.cuda.is_available()
    backend = args.backend or ("triton" if cuda else "reference")
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if device.type == "cuda" and not cuda:
        print(f"demo: --device {device} asked for, but no CUDA GPU is visible", file=sys.stderr)
        return 2
    if backend != "reference" and device.type == "cpu" and not _interpreter_on():
        # Triton kernels run on CPU tensors only under the interpreter.
        print(
            "demo: running Triton kernels on the CPU under the interpreter (TRITON_INTERPRET=1); this is slow, "
            "try small sizes (e.g. --max-prompt 256 --decode-steps 8)",
            flush=True,
        )
        if "triton" in sys.modules:
            return _rerun_under_interpreter(argv)
        os.environ["TRITON_INTERPRET"] = "1"
    problem = backend_status(backend)
    if problem:
        print(f"demo: {problem}; try --backend reference", file=sys.stderr)
        return 2

    from .demo import format_result, run_demo

    result = run_demo(
        requests=args.requests,
        max_prompt=args.max_prompt,
        decode_steps=args.decode_steps,
        seed=args.seed,
        kinds=args.kinds,
        backend=backend,
        device=device,
        progress=not args.no_progress,
    )
    print(format_result(result))
    return 0 if result.ok else 1


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------
#: bench flags that need no GPU (they print and exit).
BENCH_NO_GPU_FLAGS = ("-h", "--help", "--dry-run")
#: The checkout's ``benchmarks/`` folder: ``src/dsv4_compressor/cli.py`` -> the repository root. An installed
#: (non-editable) package has none there.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
BENCHMARKS_DIR = os.path.join(_REPO_ROOT, "benchmarks")
NO_BENCHMARKS = (
    "bench: not available in this build: the benchmarks ship with a checkout of the repository, not with the "
    "installed package (no {path}). git clone the dsv4-compressor repository, pip install -e . in it, then run "
    "dsv4-compressor bench (or python -m benchmarks from the checkout's root)"
)


def _cmd_bench(rest: list[str]) -> int:
    """Run the benchmark's command line (``benchmarks.cli.main(rest)``) from the checkout this package runs from.

    The benchmarks are not part of the installed package: they live in ``benchmarks/`` at the repository root,
    next to ``src/``. This finds that folder from this file's path (:data:`BENCHMARKS_DIR`, so an editable install
    or ``PYTHONPATH=src`` works from anywhere), puts the repository root on ``sys.path`` and imports
    ``benchmarks.cli``. Without the folder (an installed wheel), or when another ``benchmarks`` package shadows
    it, it prints how to get a checkout and returns 2; likewise 2 without a CUDA GPU unless ``--help`` or
    ``--dry-run`` is asked for.
    """
    if not any(flag in rest for flag in BENCH_NO_GPU_FLAGS) and not _cuda_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(BENCHMARKS_DIR, "cli.py")):
        print(NO_BENCHMARKS.format(path=BENCHMARKS_DIR), file=sys.stderr)
        return 2
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    try:
        bench_cli = importlib.import_module("benchmarks.cli")
    except ModuleNotFoundError as exc:
        if exc.name in ("benchmarks", "benchmarks.cli"):
            print(NO_BENCHMARKS.format(path=BENCHMARKS_DIR), file=sys.stderr)
            return 2
        raise
    found = os.path.dirname(os.path.realpath(bench_cli.__file__))
    if os.path.normcase(found) != os.path.normcase(BENCHMARKS_DIR):
        print(f"bench: a 'benchmarks' package at {found} shadows this checkout's {BENCHMARKS_DIR}", file=sys.stderr)
        return 2
    return int(bench_cli.main(rest) or 0)


# ----------------------------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------------------------
def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from . import __version__
    from .config import INDEXER, CompressorConfig
    from .layout import indexer_fp8_page_layout, latent_page_layout

    try:
        import triton

        triton_version = triton.__version__
    except ImportError as exc:  # pragma: no cover - triton is a dependency
        triton_version = f"not importable ({exc})"
    print(f"dsv4-compressor {__version__}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton_version}")
    cuda = torch.cuda.is_available()
    if cuda:
        idx = torch.cuda.current_device()
        print(f"device: cuda:{idx} ({torch.cuda.get_device_name(idx)}), {torch.cuda.device_count()} visible")
    else:
        state = "on" if _interpreter_on() else "off"
        print(f"device: cpu (no CUDA GPU visible; Triton kernels need TRITON_INTERPRET=1, now {state})")
    print("backends:")
    for name in BACKEND_MODULES:
        print(f"  {name}: {backend_summary(name, cuda, _interpreter_on())}")
    print()

    header = (
        "kind",
        "r",
        "H",
        "W",
        "window",
        "entry B",
        "page P",
        "bytes/page",
        "ring rows m0/m3",
        "ring B/req m0",
        "ring B/req m3",
    )
    table = [header]
    for cfg in (CompressorConfig.hca(), CompressorConfig.csa(), CompressorConfig.indexer()):
        page = cfg.default_page_size
        if cfg.output == INDEXER:
            bpp = f"{page * cfg.entry_bytes:,} bf16"
            if cfg.indexer_fp8:
                bpp += f" + {indexer_fp8_page_layout(cfg, page).bytes_per_page:,} fp8"
            entry = f"{cfg.entry_bytes}" + (f" + {cfg.indexer_fp8_bytes}" if cfg.indexer_fp8 else "")
        else:
            bpp = f"{latent_page_layout(cfg, page).bytes_per_page:,}"
            entry = str(cfg.entry_bytes)
        table.append(
            (
                cfg.name,
                str(cfg.ratio),
                str(cfg.head_dim),
                str(cfg.width),
                str(cfg.window),
                entry,
                str(page),
                bpp,
                f"{cfg.ring_rows(0)}/{cfg.ring_rows(3)}",
                f"{cfg.ring_bytes(0):,}",
                f"{cfg.ring_bytes(3):,}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for j, row in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print(
        "W: values per kv_score row half (rows are 2W float32); window: positions pooled per entry; "
        "entry B: bytes per stored entry (indexer: bf16 key + FP8 pack); ring: raw float32 state per request "
        "at mtp_step 0 / 3"
    )
    print()
    _memory_table(args.max_requests, args.max_seq_len, args.mtp_step)
    return 0


def _memory_table(requests: int, seq_len: int, mtp_step: int) -> None:
    """What one layer of each kind holds for a serving configuration: the output pool sized for every request at
    ``seq_len`` (what ``CompressedKVCache`` allocates by default; ``max_pages`` lowers it) and the state, ring or
    online. These are ``cache.memory_bytes()``'s parts, from the same size functions."""
    from .config import CompressorConfig
    from .pool import pool_bytes

    print(f"one layer, {requests:,} requests x {seq_len:,} positions, mtp_step {mtp_step}:")
    rows = [("kind", "pool pages", "pool bytes", "ring state bytes", "online state bytes")]
    for cfg in (CompressorConfig.hca(), CompressorConfig.csa(), CompressorConfig.indexer()):
        page = cfg.default_page_size
        pages = requests * max(1, -(-(seq_len // cfg.ratio) // page))
        online = f"{requests * (mtp_step + 1) * 3 * cfg.head_dim * 4:,}" if not cfg.overlap else "(ring)"
        rows.append(
            (cfg.name, f"{pages:,}", f"{pool_bytes(cfg, page, pages):,}", f"{requests * cfg.ring_bytes(mtp_step):,}",
             online)
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dsv4-compressor",
        description="DeepSeek-V4 compressed KV cache (HCA / CSA / Lightning-Indexer compressors).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,info}")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="simulated serving (chunked prefill, MTP decode), every entry verified",
        description="Simulated serving of DeepSeek-V4-Flash compressor layers: chunked prefill mixed with MTP "
        "decode (mtp_step 3, random draft acceptance and rewinds); every entry of every request is checked "
        "against a float64 one-shot recomputation. Exits 1 on any failure.",
    )
    demo.add_argument(
        "--backend",
        choices=sorted(BACKEND_MODULES),
        default=None,
        help="compute backend (default: triton when CUDA is available, else reference)",
    )
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    demo.add_argument("--requests", type=_positive, default=4, help="number of requests (default 4)")
    demo.add_argument("--max-prompt", type=_positive, default=2048, help="longest prompt in tokens (default 2048)")
    demo.add_argument(
        "--decode-steps", type=_non_negative, default=128, help="MTP decode steps per request (default 128)"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument(
        "--kinds",
        type=_kinds,
        default=["hca", "csa", "indexer"],
        help="comma-separated subset of hca,csa,indexer (default: all three)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    sub.add_parser(
        "bench",
        add_help=False,
        help="GPU benchmarks (needs CUDA; 'bench --help' and 'bench --dry-run' work without); arguments after "
        "'bench' are passed to the benchmark",
    )
    info = sub.add_parser(
        "info", help="versions, device, sizes of each layer kind, and a serving configuration's memory"
    )
    info.add_argument("--max-requests", type=int, default=256, help="requests of the memory table (default 256)")
    info.add_argument("--max-seq-len", type=int, default=65536, help="positions per request (default 65536)")
    info.add_argument("--mtp-step", type=int, default=3, help="drafts per decode step (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])  # everything after 'bench' belongs to the benchmark's own parser
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _cmd_demo(args, argv)
    if args.command == "info":
        return _cmd_info(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects it first
    return 2
