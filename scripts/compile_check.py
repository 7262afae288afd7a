"""Compile every kernel variant the ops launch for Hopper (sm_90a) and Blackwell (sm_100a, sm_103a) GPUs, on a
machine without one.

Triton compiles ahead of a launch; this script puts a stand-in driver in place that reports the target and
turns every launch into a compile-only ``warmup``, then drives the ops with CPU tensors of DeepSeek-V4's shapes.
It catches what the interpreter does not (non-constexpr globals, unsupported constructs, type errors in code
paths the interpreter never specialises) before any GPU time is spent, and checks instructions the interpreter
cannot show: a kernel writing uniform FP8 records must normalize with ``rsqrt.approx`` (SGLang's ``tl.rsqrt``).
Run with the triton the GPU image pins::

    python scripts/compile_check.py            # prints one line per compiled kernel, exits non-zero on failure
    python scripts/compile_check.py --pdl      # the same with programmatic dependent launch on (the H200's
                                               # default): every kernel must wait on its predecessor
    python scripts/compile_check.py --quiet    # failures and the summary only (make test runs this on triton 3.6)
    python scripts/compile_check.py --pdl-release-start   # ... and release its successor at its start
    python scripts/compile_check.py --arch 90,100,103     # each target in turn (default 90); an arch the installed
                                               # triton cannot compile for (sm_103a before its LLVM and ptxas
                                               # know it) is reported and skipped, the others still fail hard
    python scripts/compile_check.py --only online         # the variants whose label contains the text
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import jit  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402


class _CompileOnlyDriver:
    """Just enough of a driver for ``JITFunction.run(..., warmup=True)``; ``arch``: the compute capability
    compiled for (90: sm_90a, 100: sm_100a, 103: sm_103a)."""

    arch = 90

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return self.arch  # triton keeps one kernel cache (and target) per device: one per arch here

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


COMPILED: list[str] = []


DRIVER = _CompileOnlyDriver()


def _install() -> None:
    driver.set_active(DRIVER)
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm["ptx"]
        mode = kwargs.get("PDL", 0)
        if mode and "griddepcontrol.wait" not in ptx:
            raise RuntimeError(f"{self.fn.__name__}: launched with PDL, but its PTX does not wait")
        if kwargs.get("PREFETCH_CHUNKS", 0):  # the projection's L2 prefetch of its weight comes before its wait
            first = ptx.find("cp.async.bulk.prefetch.L2.global")
            wait = ptx.find("griddepcontrol.wait")
            if first < 0 or (wait >= 0 and wait < first):
                raise RuntimeError(f"{self.fn.__name__}: PREFETCH_CHUNKS set, but no L2 prefetch before the wait")
        if ("griddepcontrol.launch_dependents" in ptx) != (mode == 2):
            raise RuntimeError(f"{self.fn.__name__}: PDL mode {mode}, launch_dependents in its PTX does not match")
        from dsv4_compressor.kernels.entry_pack import EntryMeta

        metas = [v for v in (*args, *kwargs.values()) if isinstance(v, EntryMeta)]
        if any(m.LATENT and m.LAYOUT == 3 for m in metas) and "rsqrt.approx" not in ptx:
            raise RuntimeError(f"{self.fn.__name__}: uniform FP8 records, but its PTX has no rsqrt.approx: SGLang's "
                               "trtllm store normalizes with tl.rsqrt")  # fmt: skip
        pdl = " (PDL)" if kwargs.get("launch_pdl") else ""
        target = f"sm_{DRIVER.arch}a"
        if f".target {target}" not in ptx:
            raise RuntimeError(f"{self.fn.__name__}: asked for {target}, its PTX targets something else")
        COMPILED.append(f"{target} {self.fn.__name__}{pdl}: {len(ptx)} chars of PTX")
        return kernel

    jit.JITFunction.run = compile_only


def _variants():
    """``(label, op, args, kwargs)`` for every launch configuration the ops use at DeepSeek-V4 shapes."""
    from dsv4_compressor import ops
    from dsv4_compressor.config import CompressorConfig, CompressorParams

    for dtype in (torch.int32, torch.int64):  # a step's per-row tensors from SGLang's per-request ones
        for batch, rows, packed in ((4, 16, True), (256, 2048, True), (64, 64, False)):
            per = torch.zeros(batch, dtype=dtype)
            yield (f"rows_from_requests {dtype} B={batch}{'' if packed else ' decode'}", ops.rows_from_requests,
                   (per, per, per if packed else None, rows), dict(pad_request=0))  # fmt: skip
    kinds = {"hca": CompressorConfig.hca(), "csa": CompressorConfig.csa(), "indexer": CompressorConfig.indexer()}
    for kind, cfg in kinds.items():
        p = CompressorParams.random(cfg, max_positions=1024)
        page = cfg.default_page_size
        for rows, decode in ((64, True), (300, False)):
            plan = ops.empty_plan(rows, 16, cfg.ratio, "cpu")
            for dtype in (torch.int32, torch.int64):
                idx = torch.zeros(rows, dtype=dtype)
                yield f"build_plan {dtype}", ops.build_plan, (plan, idx, idx, idx), dict(ratio=cfg.ratio, num_slots=16)
                long = torch.zeros(4096, dtype=dtype)  # a step of several blocks
                long_plan = ops.empty_plan(4096, 16, cfg.ratio, "cpu")
                yield (
                    "build_plan (long)",
                    ops.build_plan,
                    (long_plan, long, long, long),
                    dict(ratio=cfg.ratio, num_slots=16),
                )
                table = dict(ratio=cfg.ratio, num_slots=16, req_state_slot=torch.zeros(16, dtype=dtype))
                yield "build_plan req_state_slot", ops.build_plan, (plan, idx, idx, idx), table
                long_table = dict(ratio=cfg.ratio, num_slots=16, req_state_slot=torch.zeros(5000, dtype=dtype))
                yield "build_plan req_state_slot, looked up", ops.build_plan, (plan, idx, idx, idx), long_table
                # out slots through an engine's table (LightLLM's full_to_c4_indexs[mem_index]), contiguous or a column
                for label, omap in (
                    ("", torch.zeros(5000, dtype=dtype)),
                    (", strided", torch.zeros(5000, 2, dtype=dtype)[:, 1]),
                ):
                    mapped = dict(ratio=cfg.ratio, num_slots=16, out_slot_map=omap)
                    yield f"build_plan out_slot_map{label}", ops.build_plan, (plan, idx, idx, idx), mapped
                    yield (
                        f"build_plan out_slot_map{label} (long)",
                        ops.build_plan,
                        (long_plan, long, long, long),
                        mapped,
                    )
                both = dict(long_table, out_slot_map=torch.zeros(5000, dtype=dtype))
                yield "build_plan req_state_slot + out_slot_map", ops.build_plan, (plan, idx, idx, idx), both
            if kind == "hca" and rows == 64:  # build_plans: LightLLM's C4 and C128 plans in one launch
                c4_plan = ops.empty_plan(rows, 16, 4, "cpu")
                for dtype in (torch.int32, torch.int64):
                    idx = torch.zeros(rows, dtype=dtype)
                    omap = torch.zeros(5000, dtype=dtype)
                    two = dict(ratios=[4, cfg.ratio], num_slots=16)
                    for label, extra in (
                        ("", {}),
                        (", out_slot_maps", dict(out_slot_maps=[omap, torch.zeros(5000, 2, dtype=dtype)[:, 1]])),
                        (", one out_slot_map", dict(out_slot_maps=[None, omap])),
                        (", req_state_slot", dict(req_state_slot=torch.zeros(16, dtype=dtype))),
                        (", req_state_slot + out_slot_maps",
                         dict(req_state_slot=torch.zeros(16, dtype=dtype), out_slot_maps=[omap, omap])),
                    ):  # fmt: skip
                        args = ([c4_plan, plan], idx, idx, [idx, idx])
                        yield f"build_plans {dtype}{label}", ops.build_plans, args, dict(two, **extra)
                    # with the C4 plan's state-row tables in the same launch, in each addressing mode
                    tables = dict(read_rows=torch.zeros(16, 7, dtype=dtype), save_rows=torch.zeros(rows, dtype=dtype))
                    for mode, addressing in (
                        ("req_ring", dict(ring=11)),
                        ("token_map_ring", dict(ring=11, req_to_token=torch.zeros(16, 4096, dtype=torch.int32),
                                                token_to_state=torch.zeros(5000, dtype=dtype), state_page=128,
                                                page_tail=11)),
                        ("block_table", dict(block_table=torch.zeros(16, 64, dtype=dtype), block_size=4)),
                    ):  # fmt: skip
                        args = ([c4_plan, plan], idx, idx, [idx, idx])
                        step = dict(two, out_slot_maps=[omap, omap], state_mode=mode, **tables, **addressing)
                        yield f"build_plans {dtype} + state rows {mode}", ops.build_plans, args, step
                    yield (
                        "build_plans (one plan)",
                        ops.build_plans,
                        ([plan], idx, idx, [idx]),
                        dict(ratios=[cfg.ratio], num_slots=16),
                    )
            lengths, err = torch.zeros(16, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
            yield "check_plan", ops.check_plan, (plan, lengths, err), dict(decode=True)
            kv = torch.zeros(rows, cfg.row_width)
            state = torch.zeros(16, cfg.ring_rows(3), cfg.row_width)
            pages = torch.zeros(8, 64 * 600, dtype=torch.uint8)
            keys = torch.zeros(512, cfg.head_dim, dtype=torch.bfloat16) if kind == "indexer" else None
            scratches = [None, torch.zeros(rows, cfg.head_dim)] if kind == "hca" else [None]
            rebuild = dict(ratio=cfg.ratio, num_slots=16)
            for scratch in scratches:
                # the first compress right after its plan's build waits before reading its plan record, later
                # ones read it first (ops.records_first): both variants of each kernel compile
                yield "build_plan (again)", ops.build_plan, (plan, idx, idx, idx), rebuild
                for exact in (False, True):
                    label = f"{kind} rows={rows} decode={decode} tiled={scratch is not None} exact_fp8={exact}"
                    args = (kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages)
                    kwargs = dict(kind=kind, page_size=page, decode=decode, out_keys=keys, exact_fp8=exact)
                    yield label, ops.compress, args, dict(kwargs, scratch=scratch)
            if kind != "indexer":  # the other latent record layouts (SGLang's V4.1 records, uniform FP8)
                for layout in ("v41", "v41_new", "uniform_fp8"):
                    for scratch in scratches:
                        yield "build_plan (again)", ops.build_plan, (plan, idx, idx, idx), rebuild
                        label = f"{kind} rows={rows} decode={decode} tiled={scratch is not None} layout={layout}"
                        args = (kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages)
                        kwargs = dict(kind=kind, page_size=page, decode=decode, scratch=scratch, layout=layout)
                        yield label, ops.compress, args, kwargs
            # engine variants: state-row tables, APE-less rows, every indexer pack
            read_rows = torch.zeros(16, cfg.window - 1, dtype=torch.int64)
            save_rows = torch.zeros(rows, dtype=torch.int64)
            tables = dict(
                req_ring=dict(ring=cfg.ring_rows(3)),
                token_map_ring=dict(ring=cfg.ring_rows(3), req_to_token=torch.zeros(16, 64, dtype=torch.int32),
                                    token_to_state=torch.zeros(1024, dtype=torch.int64), state_page=128, page_tail=11),
                block_table=dict(block_table=torch.zeros(16, 8, dtype=torch.int32), block_size=4),
            )  # fmt: skip
            for mode, extra in tables.items():
                yield (
                    f"build_state_rows {mode}",
                    ops.build_state_rows,
                    (plan, read_rows, save_rows),
                    dict(mode=mode, **extra),
                )
            args = (kv, plan, p.ape, p.norm_weight, p.cos, p.sin, state, pages)
            kwargs = dict(kind=kind, page_size=page, decode=decode, out_keys=keys, read_rows=read_rows,
                          save_rows=save_rows, state_has_ape=False)  # fmt: skip
            yield f"{kind} tables, no ape, decode={decode}", ops.compress, args, kwargs
            if kind == "indexer":
                for pack in ops.INDEXER_PACKS:
                    kwargs = dict(kind=kind, page_size=page, decode=decode, indexer_pack=pack)
                    yield f"indexer pack {pack}", ops.compress, args, kwargs
                # the launchers the engine pack check runs on the GPU (benchmarks/engine_checks/indexer_packs.py,
                # scripts/engine_pack_check.py; hardware FP8 casts)
                from dsv4_compressor.kernels.entry_pack import entry_args, finish_values, pack_values

                vals, rows_i = torch.zeros(rows, cfg.head_dim), torch.zeros(rows, dtype=torch.int32)
                for pack in ("hadamard_f32", "hadamard_bf16"):
                    prm, out, meta = entry_args(
                        head=cfg.head_dim, rope=cfg.rope_dim, latent=False, page_size=page, scale_bytes=8,
                        norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=1e-6, out_pages=pages, out_keys=None,
                        exact_fp8=False, indexer_pack=pack,
                    )  # fmt: skip
                    yield f"finish_values {pack}", finish_values, (vals, rows_i, rows_i, prm, out, meta), {}
                    yield f"pack_values {pack}", pack_values, (vals, rows_i, out, meta), {}
            if kind == "hca":
                banks = torch.zeros(16, 4, 3, cfg.head_dim)
                yield "build_plan (again)", ops.build_plan, (plan, idx, idx, idx), rebuild
                for exact in (False, True):
                    label = f"online rows={rows} decode={decode} exact_fp8={exact}"
                    args = (kv, plan, p.ape, p.norm_weight, p.cos, p.sin, banks, pages)
                    yield label, ops.compress_online_hca, args, dict(page_size=page, decode=decode, exact_fp8=exact)
                for layout in ("v41", "v41_new", "uniform_fp8"):
                    yield "build_plan (again)", ops.build_plan, (plan, idx, idx, idx), rebuild
                    label = f"online rows={rows} decode={decode} layout={layout}"
                    yield label, ops.compress_online_hca, args, dict(page_size=page, decode=decode, layout=layout)
                if not decode:  # the split prefill: channel tiles into the scratch, then the finish launch
                    scratch = torch.zeros(rows, cfg.head_dim)
                    kwargs = dict(page_size=page, decode=False, scratch=scratch)
                    yield f"online split rows={rows}", ops.compress_online_hca, args, kwargs


def _pair_variants():
    """``(label, op, args, kwargs)`` of ``ops.compress_pair`` (a CSA layer's main compressor and indexer in one
    decode launch) at DeepSeek-V4's shapes: ring and table states, with and without APE in the rows, every
    indexer pack, both FP8 roundings."""
    from dsv4_compressor import ops
    from dsv4_compressor.config import CompressorConfig, CompressorParams

    rows = 64
    plan = ops.empty_plan(rows, 16, 4, "cpu")
    idx = torch.zeros(rows, dtype=torch.int64)
    halves = []
    for cfg in (CompressorConfig.csa(), CompressorConfig.indexer()):
        p = CompressorParams.random(cfg, max_positions=1024)
        state = torch.zeros(16, cfg.ring_rows(3), cfg.row_width)
        pages = torch.zeros(8, 64 * 600, dtype=torch.uint8)
        halves.append((torch.zeros(rows, cfg.row_width), p.ape, p.norm_weight, p.cos, p.sin, state, pages))
    args = (halves[0][0], plan, *halves[0][1:], *halves[1])
    tables = dict(read_rows=torch.zeros(16, 7, dtype=torch.int64), save_rows=torch.zeros(rows, dtype=torch.int64))
    tables.update({f"indexer_{k}": v for k, v in tables.items()}, state_has_ape=False)
    for layout in ("v41", "v41_new", "uniform_fp8"):
        kwargs = dict(page_size=64, indexer_page_size=64, decode=True, indexer_pack="hadamard_f32", layout=layout)
        yield "build_plan (again)", ops.build_plan, (plan, idx, idx, idx), dict(ratio=4, num_slots=16)
        yield f"compress_pair ring layout={layout}", ops.compress_pair, args, kwargs
    for pack in ops.INDEXER_PACKS:
        for exact in (False, True):
            for label, extra in (("ring", {}), ("tables, no ape", tables)):
                kwargs = dict(page_size=64, indexer_page_size=64, decode=True, indexer_pack=pack, exact_fp8=exact,
                              **extra)  # fmt: skip
                yield "build_plan (again)", ops.build_plan, (plan, idx, idx, idx), dict(ratio=4, num_slots=16)
                if extra:
                    rows_args = (plan, tables["read_rows"], tables["save_rows"])
                    yield "build_state_rows", ops.build_state_rows, rows_args, dict(mode="req_ring", ring=11)
                yield f"compress_pair {label} pack={pack} exact_fp8={exact}", ops.compress_pair, args, kwargs


def _projection_variants():
    """``(label, launch, args, kwargs)`` of the projection kernel at DeepSeek-V4's shapes (V4-Flash D = 4096,
    V4-Pro 7168; CSA main 2W = 2048, the indexer 512, HCA 1024) for decode-sized steps, each with the blocks
    :func:`~dsv4_compressor.kernels.projection.projection_config` picks, and one call of each op."""
    from dsv4_compressor import ops
    from dsv4_compressor.config import CompressorConfig, CompressorParams
    from dsv4_compressor.kernels import projection

    pdl = ops.pdl_enabled(torch.device("cpu"))
    for dim in (4096, 7168):
        for width in (2048, 512, 1024):
            for rows in (1, 16, 64, 256):
                cfg = projection.projection_config(rows, width, dim)
                x = torch.zeros(rows, dim, dtype=torch.bfloat16)
                w = torch.zeros(width, dim, dtype=torch.bfloat16)
                ws = torch.zeros(projection.workspace_numel(rows, width, cfg))
                label = f"projection D={dim} 2W={width} T={rows} {tuple(cfg)}"
                yield label, projection.launch_projection, (x, w, ws), dict(rows=rows, cfg=cfg, pdl=pdl)
                if rows in (64, 256):  # the weight's L2 prefetch before the wait (projection.PREFETCH)
                    kwargs = dict(rows=rows, cfg=cfg, pdl=pdl, prefetch=True)
                    yield f"{label} prefetch", projection.launch_projection, (x, w, ws), kwargs
    for kind, cfg in (("csa", CompressorConfig.csa()), ("hca", CompressorConfig.hca())):
        p = CompressorParams.random(cfg, max_positions=1024)
        rows = 64
        plan = ops.empty_plan(rows, 16, cfg.ratio, "cpu")
        idx = torch.zeros(rows, dtype=torch.int64)
        ops.build_plan(plan, idx, idx, idx, ratio=cfg.ratio, num_slots=16, mtp_step=3)
        x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
        w = torch.zeros(cfg.row_width, 4096, dtype=torch.bfloat16)
        ws = ops.projection_workspace(rows, cfg.row_width, 4096, "cpu")
        pages = torch.zeros(8, 64 * 600, dtype=torch.uint8)
        common = (x, w, ws, plan, p.ape, p.norm_weight, p.cos, p.sin)
        if kind == "csa":
            state = torch.zeros(16, cfg.ring_rows(3), cfg.row_width)
            kwargs = dict(kind=kind, page_size=64, decode=True)
            yield "compress_from_hidden csa", ops.compress_from_hidden, (*common, state, pages), kwargs
        else:
            banks = torch.zeros(16, 4, 3, cfg.head_dim)
            kwargs = dict(page_size=2, decode=True)
            op = ops.compress_online_hca_from_hidden
            yield "compress_online_hca_from_hidden", op, (*common, banks, pages), kwargs


def _probe(arch: int) -> str | None:
    """``None`` where the installed triton compiles a trivial kernel for ``arch``, else why not."""
    import triton.language as tl

    @triton.jit
    def _probe_kernel(x_ptr):
        tl.store(x_ptr + tl.arange(0, 16), tl.full([16], 1.0, tl.float32))

    DRIVER.arch = arch
    try:
        _probe_kernel.warmup(torch.zeros(16), grid=(1,))
    except Exception as exc:  # noqa: BLE001 - the reason is reported
        return str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
    finally:
        COMPILED.clear()
    return None


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quiet", action="store_true", help="failures and the summary only")
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch on")
    parser.add_argument("--pdl-release-start", action="store_true", help="PDL on, every program releasing at start")
    parser.add_argument("--arch", default="90", help="compute capabilities, comma-separated (90, 100, 103)")
    parser.add_argument(
        "--only", default=None, help="only the variants whose label contains this text (and the plan builds they need)"
    )
    args = parser.parse_args(argv)
    args.arch = [int(a) for a in args.arch.split(",") if a.strip()]
    if not args.arch or any(a < 90 for a in args.arch):
        parser.error(f"--arch takes compute capabilities of 90 and up, got {args.arch}")
    return args


def main(argv=None) -> int:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    _install()
    from dsv4_compressor import ops

    ops._runnable = lambda op, device: None  # CPU tensors stand in for device buffers; nothing runs
    if args.pdl:
        ops.pdl_enabled = lambda device: True  # the CPU tensors' device would turn it off
    if args.pdl_release_start:
        ops.pdl_enabled = lambda device: True
        from dsv4_compressor.kernels import pdl

        pdl.RELEASE = "start"
    builders = (ops.build_plan, ops.build_plans, ops.build_state_rows)
    failures = 0
    for arch in args.arch:
        started = time.perf_counter()
        reason = _probe(arch)
        if reason is not None:
            if arch == 90:  # the GPU image's target: never skipped
                print(f"FAILED sm_90a: triton {triton.__version__} cannot compile for it: {reason}")
                failures += 1
            else:
                print(f"sm_{arch}a: skipped, triton {triton.__version__} cannot compile for it: {reason}")
            continue
        DRIVER.arch = arch
        COMPILED.clear()
        arch_failures = 0
        for label, op, op_args, kwargs in (*_variants(), *_pair_variants(), *_projection_variants()):
            if args.only and args.only not in label and op not in builders:
                continue  # plan and state-row builds run whatever the filter: the compresses check their records
            try:
                op(*op_args, **kwargs)
            except Exception as exc:  # report every failing variant, not just the first
                arch_failures += 1
                print(f"FAILED sm_{arch}a {label}: {str(exc)[-1500:]}")
        if not args.quiet:
            for line in COMPILED:
                print(line)
        seconds = time.perf_counter() - started
        print(f"triton {triton.__version__} sm_{arch}a: {len(COMPILED)} compiles, {arch_failures} failures, "
              f"{seconds:.0f} s")  # fmt: skip
        failures += arch_failures
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
